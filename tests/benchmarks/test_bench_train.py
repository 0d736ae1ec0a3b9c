"""The train-step benchmark's pieces in ``--quick`` form on 2 gloo ranks; its figures come from ``python -m benchmarks
train`` and are never asserted here.

Only the eager systems run: this library's step with ``backend="none"``, FSDP2 and transformers' tp plan, each
eager. Compiling the three compiled systems on two ranks takes minutes on this 2-core host. Checked:

- every system ran or carries its error;
- the first-step losses agree within 1e-4 (the same computation on the same global batch), and so do the
  gradient norms;
- the summary's structure and the printed table;
- a system that fails on one rank only is recorded with that rank's error, and the other systems still run.

The file takes about 12 s here (2 cores).
"""

import pytest

from benchmarks import bench_train
from benchmarks.train_systems import System

EAGER = ["fnpu_tp2_eager", "fsdp2_eager", "hf_tp_eager"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-train")
    bench_train.save_model(str(path), "quick")
    return str(path)


def test_the_eager_systems_take_the_same_step(world2, model):
    tokens = bench_train.batch("quick")
    ranks = world2.run(bench_train.train_rank, model, tokens, EAGER, 2)
    alone = {"fnpu_tp2_eager": world2.run(bench_train.train_rank, model, tokens, ["fnpu_tp2_eager"], 0)}
    run = bench_train.summarize(ranks, alone, size="quick", repeat=2)
    assert list(run["systems"]) == EAGER and run["global_batch"] == [4, 32]
    for name, s in run["systems"].items():
        assert s["how"] == bench_train.HOW[name]
        assert s["ran"] or s["error"], name
    ran = {n: s for n, s in run["systems"].items() if s["ran"]}
    assert "fnpu_tp2_eager" in ran and len(ran) >= 2
    assert run["same_loss"] and run["loss_spread"] <= bench_train.LOSS_TOL
    assert run["grad_norm_spread"] <= 1e-4 * ran["fnpu_tp2_eager"]["first_grad_norm"]
    for name, s in ran.items():
        assert len(s["step_s"]["runs"]) == 2 and s["state_bytes"] > 0 and not s["recompiled_in_rounds"]
        assert set(s["vs"]) == ({"fnpu_tp2_eager"} - {name})
    assert abs(ran["fnpu_tp2_eager"]["last_loss"] - ran["fsdp2_eager"]["last_loss"]) < 1e-3  # 5 steps each
    memory = ran["fnpu_tp2_eager"]["memory"]  # its structure only: world2's processes are not fresh (the bench's are)
    assert all(peak >= added >= 0 for peak, added in zip(memory["peak_rss_bytes"], memory["added_rss_bytes"]))
    if "hf_tp_eager" in ran:  # transformers' tp plan leaves the norm weights plain beside the DTensors
        assert "mixed torch.Tensor and DTensor" in ran["hf_tp_eager"]["notes"]["clip"]
    printed = bench_train.report({"runs": [run, run]})
    assert "| fsdp2_eager | " in printed and " / " in printed.splitlines()[2] and "losses equal" in printed


def _fails_on_rank_1(ctx, path, tokens):
    if ctx.rank == 1:
        raise RuntimeError("rank 1 cannot build this")
    return System(lambda: (0.0, 0.0), lambda: 0, {})


def _with_a_broken_system(ctx, path, tokens):
    bench_train.BUILDERS["broken"] = _fails_on_rank_1
    bench_train.HOW["broken"] = "fails on rank 1"
    return bench_train.train_rank(ctx, path, tokens, ["broken", "fnpu_tp2_eager"], 1)


def test_a_system_failing_on_one_rank_is_recorded_and_the_others_run(world2, model, monkeypatch):
    monkeypatch.setitem(bench_train.HOW, "broken", "fails on rank 1")
    ranks = world2.run(_with_a_broken_system, model, bench_train.batch("quick"))
    assert ranks[0]["broken"]["error"] == "another rank failed to build or step it"
    run = bench_train.summarize(ranks, None, size="quick", repeat=1)
    assert run["systems"]["broken"] == {
        "how": "fails on rank 1",
        "ran": False,
        "error": "RuntimeError: rank 1 cannot build this",
    }
    assert run["systems"]["fnpu_tp2_eager"]["ran"] and not run["same_loss"]  # one system is no comparison
    assert "| broken | did not run: RuntimeError: rank 1 cannot build this |" in bench_train.table([run])
