"""The GPU ring cell's pieces that need no GPU (:mod:`benchmarks.ring_gpu`): the hidden shares, the count of host
copies in a profiler trace, and the whole cell on the CPU with a small stand-in model (backend ``none``)."""

import dataclasses
import math

import pytest

from benchmarks.ring_gpu import hidden, host_copies, ring_cell


def test_the_time_hidden_is_the_exposed_copy_less_what_is_left():
    got = hidden(resident=1.0, exposed=3.0, ring=2.2)  # a 2 s copy beside 1 s of compute: at most 1 s hides
    assert got["copy_s"] == 2.0 and got["hidden_s"] == pytest.approx(0.8)
    assert got["hidden_of_copy"] == pytest.approx(0.4) and got["hidden_of_hideable"] == pytest.approx(0.8)
    assert hidden(1.0, 3.0, 3.0)["hidden_of_hideable"] == 0.0  # nothing overlapped
    assert math.isnan(hidden(1.0, 1.0, 1.0)["hidden_of_copy"])  # no copy time to hide: no share, not 0 or 1


def _event(cat, name, stream, nbytes=0):
    return {"cat": cat, "name": name, "args": {"stream": stream, "bytes": nbytes}}


def test_host_copies_are_counted_with_their_streams():
    trace = {"traceEvents": [
        _event("kernel", "gemm", 7), _event("kernel", "rms", 7), _event("kernel", "x", 20),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 4096),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 21, 4096),
        _event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 7, 8),  # the tokens: below the least part
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 7, 8192),
    ]}  # fmt: skip
    assert host_copies(trace, 1024) == {"copies": 2, "bytes": 8192, "copy_streams": [20, 21], "compute_stream": 7}
    # the counterexample: copies on the compute stream name it among their streams
    trace["traceEvents"][3]["args"]["stream"] = 7
    assert 7 in host_copies(trace, 1024)["copy_streams"]


def test_the_ring_cell_runs_through_on_the_cpu_with_a_small_stand_in():
    """Everything the GPU run does but the device: the three systems built from one config, their tokens compared,
    timed in rounds and set against each other per phase; no delivered count off CUDA."""
    from benchmarks.configs import QWEN3_8B

    small = dataclasses.replace(
        QWEN3_8B, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512
    )
    got = ring_cell(small, layers=3, prompt=16, new=3, repeat=2, device="cpu", backend="none", log=lambda m: None)
    assert "skipped" not in got, got
    assert set(got["seconds"]) == {"resident", "k0", "k1"} and got["delivered"] is None
    assert got["layer_bytes"] == 64 * 64 * 2  # o_proj, bf16
    for phase in ("prefill", "decode"):
        cell = got["phases"][phase]["k1"]
        assert len(cell["copy_s"]["runs"]) == 2 and cell["compute_s"]["median"] > 0
