"""``demo --post-train``: one round of the post-training loop on 2 local ranks, in a fresh process (compiled
rollouts and a compiled train step: about a minute on 2 cores). It must finish OK: the reshard to the inference
plan received exactly each rank's lower bound, the rollout's log-probabilities equal the training forward's under
both plans (the invariant mode: a mismatch of exactly 0.0, beside the same round's nonzero figure without it), the
GRPO loss fell over the steps, and the swapped-in weights sampled again."""

import re

from ..support.cli import cli


def test_demo_post_train_runs_one_round():
    out = cli("demo", "--post-train")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo --post-train: OK" in out.stdout
    moved = re.findall(r"rank (\d): (\d+) of (\d+)", out.stdout)
    assert len(moved) == 2 and all(int(a) == int(b) > 0 for _, a, b in moved)
    before, after = map(float, re.search(r"same seed\) \| ([\d.]+) -> ([\d.]+) \|", out.stdout).groups())
    assert 0 <= before <= 1 and 0 <= after <= 1
    first, last = map(float, re.search(r"step 1 -> step \d \| (-?[\d.]+) -> (-?[\d.]+) \|", out.stdout).groups())
    assert last < first
    assert re.search(r"train step \(compiled, warm\) \| [\d.]+ ms", out.stdout)
    same, trained = re.search(r"log-prob mismatch, .* \| ([\d.e+-]+) / ([\d.e+-]+) \|", out.stdout).groups()
    assert (same, trained) == ("0.0", "0.0")
    off = re.search(r"without the invariant mode .* \| ([\d.e+-]+) / ([\d.e+-]+) \|", out.stdout).groups()
    assert all(0 < float(g) < 1e-4 for g in off)
