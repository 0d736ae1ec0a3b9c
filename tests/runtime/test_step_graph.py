"""The library's own graph around each step (:mod:`functional_npu.runtime.serving.step_graph`), for series kept in host
memory where inductor's CUDA graphs would skip the step: run on the CPU with the device's graph module stood in by
one that records a capture and replays its ops on the captured tensors, running no Python (tests/support/
graph_standin.py). Greedy tokens equal the uncaptured model's through prefill, decode, a ring of two phases, the
engine's paged states and new weights; each part of the replay that a device graph needs is shown necessary by a
planted variant without it whose tokens differ (or whose replay reads poisoned outputs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from functional_npu import Mesh, Plan, compile_model, load_checkpoint
from functional_npu.runtime.serving import Engine, Request
from functional_npu.runtime.serving.backends import Backend
from functional_npu.runtime.serving.compile import library_graphs
from functional_npu.runtime.serving.step_graph import StepGraphs, join_ring

from ..support.graph_standin import StandInGraphs
from ..support.hf_models import save_tiny

ONE = Mesh.abstract({"tp": 1}, 0)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7]]
NEW = 7


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-step-graph")
    save_tiny("qwen3", path, 31, num_hidden_layers=3)
    return str(path)


def _model(qwen3: str, k: int = 1, **options):
    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj,down_proj", prefetch_step=k))
    return compile_model(params, ONE, **({"backend": "none", "batch_sizes": [4], "max_seq_len": 24} | options))


def _captured(model, graphs: StepGraphs | None = None):
    """``model`` with its steps in graphs of the stand-in (the device's graph module on the CPU)."""
    return dataclasses.replace(model, _graphs=graphs or StepGraphs(StandInGraphs()))


@pytest.fixture(scope="module")
def reference(qwen3):
    """The tokens of the model uncaptured, at k = 1 (3 layers over 2 slots: 2 phases) and k = 2 (one phase)."""
    return {k: _model(qwen3, k).generate(PROMPTS, NEW) for k in (1, 2)}


@pytest.mark.parametrize(("k", "backend"), [(1, "none"), (2, "none"), (1, "eager")])
def test_captured_steps_give_the_uncaptured_tokens(qwen3, reference, k, backend):
    """Prefill and every decode step of both phases warm, capture, then replay (the plain forward, and dynamo's
    graph, whose ring phase moves as a side effect it replays after each call): the second generate replays alone."""
    model = _captured(_model(qwen3, k, backend=backend))
    assert model.captured == "library"
    api = model._graphs.api
    first = model.generate(PROMPTS, NEW)  # warm-ups and captures
    replayed = api.replays
    again = model.generate(PROMPTS, NEW)  # replays alone: the prefill and NEW - 1 decode steps
    assert first == again == reference[k]
    assert len(api.captured) == len(model._graphs.graphs) == 1 + model.ring.phases  # the prefill, a step per phase
    assert api.replays - replayed == NEW


def test_the_engines_paged_states_replay_as_generate_alone(qwen3):
    """The engine's chunks and steps over paged states of two buckets, one ring carried through them, captured: each
    request's tokens are generate's alone."""
    model = _captured(_model(qwen3, 1, batch_sizes=[1, 2], max_seq_len=40, prefill_lengths=[8]))
    alone = _model(qwen3, 1, batch_sizes=[1], max_seq_len=40, prefill_lengths=[16])
    reqs = [Request(tuple(range(3, 3 + n)), max_new_tokens=m, stop=()) for n, m in ((4, 9), (11, 12), (2, 6))]
    want = [alone.generate([list(r.prompt)], r.max_new_tokens)[0] for r in reqs]
    for _ in range(2):  # the second pass replays graphs captured in the first
        engine = Engine(model, blocks=30, block_size=4, chunk=8)
        got: dict[int, list[int]] = {engine.add(r, i): [] for i, r in enumerate(reqs)}
        for _ in range(500):
            if not engine.has_work():
                break
            for e in engine.step():
                got[e.id] += e.tokens
        assert [got[i] for i in range(len(reqs))] == want
    assert model._graphs.api.replays > 0


def test_new_weights_start_new_graphs(qwen3, reference):
    """with_params: the graphs captured on the old weights would replay reading them; the new model captures its own.
    Kept (the planted variant), the old weights' tokens come back."""
    model = _captured(_model(qwen3, 2))
    model.generate(PROMPTS, NEW)
    model.generate(PROMPTS, NEW)
    scaled = _model(qwen3, 2).params
    scaled["embed"].mul_(1.5)
    fresh = _model(qwen3, 2).with_params(scaled).generate(PROMPTS, NEW)
    assert fresh != reference[2]
    assert model.with_params(scaled).generate(PROMPTS, NEW) == fresh
    kept = dataclasses.replace(model.with_params(scaled), _graphs=model._graphs)
    assert kept.generate(PROMPTS, NEW) != fresh


class _NoInputCopy(StepGraphs):
    def _replay(self, captured, inputs, state):
        return super()._replay(captured, (), state)


class _NoPhase(StepGraphs):
    def _replay(self, captured, inputs, state):
        at = state.phase.at
        out = super()._replay(captured, inputs, state)
        state.phase.at = at
        return out


class _NoReplay(StepGraphs):
    def _replay(self, captured, inputs, state):
        if captured.phase is not None:
            state.phase.at = captured.phase
        return captured.out.clone()


@pytest.mark.parametrize("variant", [_NoInputCopy, _NoPhase, _NoReplay], ids=["no-input-copy", "no-phase", "no-replay"])
def test_each_part_of_a_replay_is_needed(qwen3, reference, variant):
    """Without the copy of the step's inputs into the graph's buffers, the replay runs the captured step's tokens;
    without the phase set, the next step picks the other phase's graph; returning the output without a replay reads
    what the capture left (nothing: poisoned). Each gives other tokens, or fails."""
    model = _captured(_model(qwen3, 1), variant(StandInGraphs()))
    try:
        model.generate(PROMPTS, NEW)
        got = model.generate(PROMPTS, NEW)
    except FloatingPointError as e:  # poisoned logits
        got = str(e)
    assert got != reference[1]


def test_the_stand_in_refuses_a_host_wait_inside_a_capture():
    """What makes the stand-in a device graph: a sync inside the capture raises, and what the capture made is empty
    until a replay."""
    api = StandInGraphs()
    g = api.CUDAGraph()
    x = torch.arange(4.0)
    with pytest.raises(RuntimeError, match=r"stand-in capture: aten._local_scalar_dense.default waits for the device"):
        with api.graph(g):
            (x * 2).sum().item()
    with api.graph(g):
        y = x * 2
    assert y.isnan().all()
    x.add_(1)
    g.replay()
    assert y.tolist() == [2.0, 4.0, 6.0, 8.0]


def test_a_pending_ring_copy_is_joined_before_the_capture_ends():
    """join_ring waits on each slot's pending work: the works registered for the slots are gone after it."""
    from functional_npu.core.side_copy import side_copy

    from ..support.standin_streams import Device

    api = Device()
    slots = [torch.zeros(4), torch.zeros(4)]
    for s in slots:
        side_copy(s, [torch.ones(4)], api)
    join_ring(slots)
    # each copy: the side stream waits for the fork, the current stream for the join
    assert [e[0] for e in api.log].count("wait") == 4
    join_ring(slots)  # nothing pending: nothing waited
    assert [e[0] for e in api.log].count("wait") == 4


def test_inductors_capturing_modes_with_host_series_compile_uncaptured_under_the_librarys_graphs(qwen3):
    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj", prefetch_step=1))
    for mode, uncaptured in (("reduce-overhead", "default"), ("max-autotune", "max-autotune-no-cudagraphs")):
        chosen, graphs = library_graphs(params, Backend("inductor", "cuda", mode))
        assert chosen == Backend("inductor", "cuda", uncaptured) and not chosen.captures
        assert graphs.api is torch.cuda and not graphs.graphs
    for backend in (Backend("inductor", "cuda", "default"), Backend("inductor", "cpu", "reduce-overhead")):
        assert library_graphs(params, backend) == (backend, None)
    resident = load_checkpoint(qwen3, ONE)
    assert library_graphs(resident, Backend("inductor", "cuda", "reduce-overhead"))[1] is None  # inductor's own
