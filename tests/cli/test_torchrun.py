"""Across machines: ``generate --tp 2`` as two ``torchrun --nnodes 2`` node groups of one rank each, meeting at a
rendezvous on 127.0.0.1 (gloo over loopback), gives transformers' tokens, as the one-node run does
(tests/cli/test_cli.py)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from functional_npu.runtime.launch import free_port

from ..support.cli import PROMPTS
from ..support.hf_models import hf_greedy, save_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    hf = save_tiny("qwen3", path, 9)
    return path, [hf_greedy(hf, p, 6) for p in PROMPTS]


def _node(rank: int, port: int, args: list[str], tmp: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    cmd += ["--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    # TMPDIR: torchrun makes its log directory (torchelastic_*) there and never removes it
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    return subprocess.Popen(
        [*cmd, "-m", "functional_npu", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, start_new_session=True,
    )  # fmt: skip


def test_generate_tp2_across_two_torchrun_nodes_on_loopback(model, tmp_path):
    path, want = model
    args = ["generate", "--model", str(path), "--tp", "2", "--max-new-tokens", "6", "--backend", "none", "--json"]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    port = free_port()
    nodes = [_node(r, port, args, tmp_path) for r in range(2)]
    try:
        outs = [n.communicate(timeout=300) for n in nodes]
    finally:
        for n in nodes:  # nothing outlives the test
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait()
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    tokens = json.loads(outs[0][0].strip().splitlines()[-1])["token_ids"]
    assert tokens == want
    assert outs[1][0].strip() == ""  # only node 0's rank speaks
