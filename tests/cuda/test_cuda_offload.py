"""Weights kept in host memory on a GPU (``Plan.offload``): the series stay in pinned host memory, the ring's slots on
the device are filled from them by asynchronous copies on a side stream (:mod:`functional_npu.core.side_copy`), and
greedy tokens equal the resident model's at prefetch steps 0, 1 and 2 (3 layers: vLLM 54975's 3 modules), eager and
compiled with inductor; the copies, counted on the device, run on another stream than the kernels and carry whole
layers; in a capturing mode (inductor's CUDA graphs skip a graph with host inputs) the library's own graph around each
step gives the same tokens.

Run by ``python -m benchmarks gpu``; skipped where CUDA is absent, as on CI.
"""

from __future__ import annotations

import json

import pytest
import torch

from functional_npu import Mesh, Plan, compile_model, load_checkpoint

from ..support.hf_models import save_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (python -m benchmarks gpu)")

ONE = Mesh.abstract({"tp": 1}, 0)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-offload-cuda")
    save_tiny("qwen3", path, 31, num_hidden_layers=3)
    return str(path)


@pytest.fixture(scope="module")
def resident(qwen3):
    params = load_checkpoint(qwen3, ONE, device="cuda")
    model = compile_model(params, ONE, backend="inductor", mode="default", batch_sizes=[4], max_seq_len=24)
    return model.generate(PROMPTS, 8)


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("backend", ["none", "inductor"])
def test_offloaded_series_on_the_gpu_give_the_resident_tokens(qwen3, resident, k, backend):
    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj,down", prefetch_step=k), device="cuda")
    host = params["host"]["o_proj"]
    assert host.device.type == "cpu" and host.is_pinned() and params["embed"].device.type == "cuda"
    mode = "default" if backend == "inductor" else None
    model = compile_model(params, ONE, backend=backend, mode=mode, batch_sizes=[4], max_seq_len=24)
    state = model.new_state(4)
    assert len(state.prefetched) == k + 1 and all(t.device.type == "cuda" for t in state.prefetched)
    assert model.generate(PROMPTS, 8) == resident


def test_the_host_copies_run_beside_the_kernels_and_carry_whole_layers(qwen3, resident, tmp_path):
    """Counted on the device (the profiler's memcpy records): every copy of at least a part's bytes is host to device
    on a stream no kernel of the step's main stream runs on, and they carry whole layers: the first ``k`` from
    ``new_state``, then ``L`` per forward (layer ``i + k`` at layer ``i``), 8 forwards (a prefill, 7 decode steps)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.ring_gpu import host_copies, host_part_bytes

    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj,down", prefetch_step=1), device="cuda")
    model = compile_model(params, ONE, backend="inductor", mode="default", batch_sizes=[4], max_seq_len=24)
    assert model.generate(PROMPTS, 8) == resident  # compiled and warm
    parts = host_part_bytes(model)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        assert model.generate(PROMPTS, 8) == resident
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    got = host_copies(json.loads((tmp_path / "trace.json").read_text()), min(parts))
    assert got["copies"] > 0 and got["compute_stream"] not in got["copy_streams"], got
    assert got["bytes"] == sum(parts) * (1 + 8 * 3), (got, parts)


@pytest.mark.parametrize("k", [1, 2])
def test_host_series_in_a_capturing_mode_run_in_the_librarys_graphs(qwen3, resident, k):
    """Inductor's CUDA graphs would skip every step (host inputs): compile_model compiles without them and captures
    each step itself; the tokens are the resident model's, and the second generate replays only (k = 1 over 3 layers:
    two ring phases)."""
    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj,down", prefetch_step=k), device="cuda")
    model = compile_model(params, ONE, batch_sizes=[4], max_seq_len=24)
    assert model.captured == "library" and model.backend.mode == "default"
    assert model.generate(PROMPTS, 8) == resident
    graphs = dict(model._graphs.graphs)
    assert len(graphs) == 1 + model.ring.phases
    assert model.generate(PROMPTS, 8) == resident and model._graphs.graphs == graphs
