"""The request engine: continuous batching over a paged KV cache.

Each request's greedy tokens are those of running it alone with ``generate`` (the lockstep path over the contiguous
cache, a reference the engine does not share: no block table, no chunking, no other requests), whatever arrives
beside it, in whatever order, with aborts and a pool small enough to preempt; after every step the pool's blocks add
up and have one owner each (checked inside ``step``), and at the end every block is free again. Bad requests are
refused in one line naming them while the others go on.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_npu import Mesh, Plan, compile_model, load_checkpoint
from functional_npu.runtime.serving import Engine, Event, Request, stop_ids

from ..support.hf_models import save_tiny

ONE = Mesh.abstract({"tp": 1}, 0)
MAX_SEQ = 48
BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-qwen3")
    save_tiny("qwen3", path, 7, num_hidden_layers=2)
    return str(path)


@pytest.fixture(scope="module")
def model(model_dir):
    """The batch-invariant plan: a sequence's logits do not depend on the batch, the chunk or the cache's length, so
    the engine's tokens can be held to generate()'s exactly."""
    params = load_checkpoint(model_dir, ONE, Plan(invariant="batch"))
    return compile_model(
        params, ONE, backend="none", batch_sizes=[1, 2, 4], max_seq_len=MAX_SEQ, prefill_lengths=[8, 16, 48]
    )


@pytest.fixture(scope="module")
def alone(model):
    """generate() of one prompt alone, cached by prompt (greedy tokens are prefix-stable)."""
    done: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt: tuple[int, ...], n: int) -> list[int]:
        if len(done.get(prompt, ())) < n:
            done[prompt] = model.generate([list(prompt)], max(n, 8 if len(prompt) + 8 <= MAX_SEQ else n))[0]
        return done[prompt][:n]

    return tokens


def _expected(alone, request: Request) -> list[int]:
    out = alone(request.prompt, request.max_new_tokens)
    stops = [i for i, t in enumerate(out) if t in (request.stop or ())]
    return out[: stops[0] + 1] if stops else out


def _serve(engine: Engine, arrivals: list[tuple[int, Request]], aborts: dict[int, int]) -> dict[int, list[Event]]:
    """Add each request at its step, abort at its step; every event by request id."""
    events: dict[int, list[Event]] = {}
    step, added = 0, set()
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])  # request i: the i-th arrival, whenever it comes
    while pending or engine.has_work():
        while pending and pending[0][1][0] <= step:
            i, (_, request) = pending.pop(0)
            added.add(engine.add(request, i))
        for i, at in aborts.items():
            if at == step and i in added:
                if (e := engine.abort(i)) is not None:
                    events.setdefault(e.id, []).append(e)
        for e in engine.step():
            events.setdefault(e.id, []).append(e)
        step += 1
        assert step < 2000, "the engine made no progress"
    return events


requests = st.builds(
    Request,
    prompt=st.lists(st.integers(0, 127), min_size=1, max_size=30).map(tuple),
    max_new_tokens=st.integers(1, 12),
    stop=st.one_of(st.just(()), st.lists(st.integers(0, 127), max_size=3).map(tuple)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(st.tuples(st.integers(0, 6), requests), min_size=1, max_size=7),
    blocks=st.integers(MAX_SEQ // BLOCK + 1, 40),
    data=st.data(),
)
def test_each_request_gets_its_alone_tokens_whatever_shares_its_steps(model, alone, arrivals, blocks, data):
    arrivals = [(t, r) for t, r in arrivals if len(r.prompt) + r.max_new_tokens <= MAX_SEQ]
    aborts = data.draw(st.dictionaries(st.integers(0, len(arrivals) - 1), st.integers(0, 8), max_size=2))
    engine = Engine(model, blocks=blocks, block_size=BLOCK, chunk=8)
    events = _serve(engine, arrivals, aborts)
    for i, (_, request) in enumerate(arrivals):
        got = [t for e in events.get(i, []) for t in e.tokens]
        finished = [e.finished for e in events.get(i, []) if e.finished]
        assert len(finished) == 1, (i, events.get(i))
        want = _expected(alone, request)
        if finished[0] == "abort":
            assert got == want[: len(got)]
        else:
            assert got == want, (i, request)
            assert finished[0] == ("stop" if request.stop and want[-1] in request.stop else "length")
    assert engine.pool.used == 0 and len(engine.pool.free) == blocks - 1  # every block back


def test_a_pool_that_forces_preemption_gives_the_same_tokens(model, alone):
    """Four requests growing to 40 positions each in a pool of 13 blocks (one sequence's 12 and the null block):
    requests are preempted and recomputed, and each still gets its alone tokens."""
    reqs = [Request(tuple(range(3 + i, 3 + i + 10 + 5 * i)), max_new_tokens=20, stop=()) for i in range(4)]
    engine = Engine(model, blocks=MAX_SEQ // BLOCK + 1, block_size=BLOCK, chunk=8)
    events = _serve(engine, [(0, r) for r in reqs], {})
    for i, r in enumerate(reqs):
        assert [t for e in events[i] for t in e.tokens] == _expected(alone, r)


def test_bad_requests_are_refused_in_one_line_and_the_others_go_on(model, alone):
    good = Request((1, 2, 3), max_new_tokens=4, stop=())
    bad = [
        Request(tuple(range(40)), max_new_tokens=20),  # past the context
        Request((1, 2), max_new_tokens=3, temperature=-1.0),
        Request((1, 2), max_new_tokens=3, stop=(999,)),
        Request((1, 500), max_new_tokens=3),
        Request((1, 2), max_new_tokens=0),
    ]
    engine = Engine(model, blocks=40, block_size=BLOCK)
    events = list(engine.run([bad[0], good, *bad[1:]]))
    errors = [e.error for e in events if e.error]
    assert len(errors) == len(bad) and all("\n" not in e for e in errors)
    assert errors[0].startswith("request 0: 40 prompt tokens + 20 new exceed the engine's context of 48 positions")
    assert "request 2: temperature must be 0 (greedy)" in errors[1]
    assert errors[2] == "request 3: stop ids [999] are not in the vocabulary [0, 128)"
    assert "request 4: prompt 0 has token ids [500] outside the vocabulary" in errors[3]
    assert errors[4] == "request 5: max_new_tokens must be an int >= 1, got 0"
    assert [t for e in events if e.id == 1 for t in e.tokens] == _expected(alone, good)


def test_a_budget_that_cannot_hold_one_sequence_names_the_smallest_that_can(model):
    want = r"cannot hold one sequence of max_seq_len 48 \(12 blocks, and the null block\): give at least blocks=13 "
    with pytest.raises(ValueError, match=want + r"\(kv_bytes=\d+ on each rank\)"):
        Engine(model, blocks=12, block_size=BLOCK)
    Engine(model, blocks=13, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"chunk 12 is not a compiled prompt-length bucket \[8, 16, 48\]"):
        Engine(model, blocks=13, block_size=BLOCK, chunk=12)


def test_stop_ids_come_from_the_checkpoint(model_dir, tmp_path):
    assert isinstance(stop_ids(model_dir), tuple)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [5, 7]}')
    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    assert stop_ids(tmp_path) == (5, 7)
    (tmp_path / "generation_config.json").unlink()
    assert stop_ids(tmp_path) == (2,)


def test_logprobs_under_shifting_batches_are_the_training_forwards_bit_for_bit(model, alone):
    """Invariant mode: the engine's log-probabilities of sampled tokens, with requests joining and leaving around
    them, equal token_logprobs (the training forward over the whole sequence, no cache) of the same tokens."""
    from functional_npu.runtime.training import token_logprobs

    reqs = [
        Request(tuple(range(5, 5 + n)), max_new_tokens=6 + i, stop=(), temperature=0.8, seed=i, logprobs=True)
        for i, n in enumerate([3, 17, 9, 1])
    ]
    engine = Engine(model, blocks=30, block_size=BLOCK, chunk=8)
    events = _serve(engine, [(i, r) for i, r in enumerate(reqs)], {})
    for i, r in enumerate(reqs):
        tokens = [t for e in events[i] for t in e.tokens]
        got = torch.tensor([p for e in events[i] for p in e.logprobs])
        full = torch.tensor([list(r.prompt) + tokens])
        want = token_logprobs(model.params, full, ONE, temperature=r.temperature)[0, len(r.prompt) - 1 :]
        assert torch.equal(got, want), (i, got, want)


@pytest.mark.parametrize(
    "family, plan",
    [
        ("deepseek_v3", {}),  # blocks of the latent and the rope keys (the absorbed decode)
        ("deepseek_v3", {"mla_cache": "heads"}),  # blocks of every head's keys and values
        ("qwen3_moe", {}),
    ],
    ids=["deepseek-latent", "deepseek-heads", "qwen3-moe"],
)
def test_every_attention_kind_is_served_as_generate_alone(tmp_path, family, plan):
    from functional_npu import Plan

    from ..support.hf_models import save_tiny_deepseek, save_tiny_moe

    (save_tiny_deepseek if family.startswith("deepseek") else save_tiny_moe)(family, tmp_path, 3)
    params = load_checkpoint(str(tmp_path), ONE, Plan(**plan))
    shapes = dict(batch_sizes=[1, 2, 4], max_seq_len=40, prefill_lengths=[8, 32])
    model = compile_model(params, ONE, backend="none", **shapes)
    reqs = [Request(tuple(range(3, 3 + n)), max_new_tokens=m, stop=()) for n, m in ((4, 6), (13, 9), (1, 5))]
    engine = Engine(model, blocks=30, block_size=4, chunk=8)
    events = _serve(engine, [(i, r) for i, r in enumerate(reqs)], {})
    for i, r in enumerate(reqs):
        assert [t for e in events[i] for t in e.tokens] == model.generate([list(r.prompt)], r.max_new_tokens)[0]
    assert engine.pool.used == 0


def test_sliding_layers_keep_blocks_for_their_window_alone_and_serve_as_generate_alone(tmp_path):
    """Gemma 3: a sliding layer (window 4) keeps a ring of 3 blocks per row (the window and a chunk of 8, in blocks of
    4), reused as the sequence moves past it, while a full layer keeps the context's blocks; prompts and outputs run
    well past the ring (40 positions), and each request's tokens are generate()'s alone over the contiguous ring."""
    from functional_npu.models.paged import pool_bytes

    from ..support.hf_models import save_tiny_gemma3

    save_tiny_gemma3("gemma3", tmp_path, 3)
    model = compile_model(
        load_checkpoint(str(tmp_path), ONE), ONE, backend="none", batch_sizes=[1, 2, 4], max_seq_len=40,
        prefill_lengths=[8, 32],
    )  # fmt: skip
    engine = Engine(model, blocks=30, block_size=4, chunk=8)
    assert engine.layout.windows == (4, 4, None, 4) and engine.ring_width == 3
    assert [k.shape[0] for k, _ in engine._pools] == [4 * 3 + 1, 4 * 3 + 1, 30, 4 * 3 + 1]
    assert (
        engine.kv_bytes_used
        == pool_bytes(engine.layout, 30, 4, torch.float32, 13)
        < pool_bytes(engine.layout, 30, 4, torch.float32, 30)
    )
    reqs = [Request(tuple(range(3, 3 + n)), max_new_tokens=m, stop=()) for n, m in ((4, 20), (21, 9), (1, 14), (30, 6))]
    events = _serve(engine, [(i // 2, r) for i, r in enumerate(reqs)], {})
    for i, r in enumerate(reqs):
        assert [t for e in events[i] for t in e.tokens] == model.generate([list(r.prompt)], r.max_new_tokens)[0], i
    assert engine.pool.used == 0 and engine._ring.used == 0


def test_a_ring_without_room_for_a_chunk_loses_the_window(tmp_path):
    """The counterexample to the ring's width: a chunk's writes reach back ``R - window`` slots, so a ring of the
    window alone (R = 4) overwrites keys the chunk's first queries still see, and the logits change."""
    from functional_npu.models import ring
    from functional_npu.models.gemma3 import LayerAttention
    from functional_npu.models.paged import PagedKV, paged

    cfg = LayerAttention(8, 10_000.0, "default", 1.0, 4)
    keys, queries = torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8)
    steps = [(p, p + 1) for p in range(8)] + [(8, 12)]  # eight decode steps, then a chunk of positions 8..11

    def attend(nb: int) -> torch.Tensor:
        pool, table = torch.zeros(nb + 1, 4, 1, 8), torch.arange(1, nb + 1)[None]
        for lo, hi in steps:
            step = ring.prepare(cfg, torch.arange(lo, hi)[None], PagedKV(pool, pool, table), torch.float32)
            k = paged(pool, keys[:, :, lo:hi], step.write, step.read)
            scores = (queries[:, :, lo:hi] @ k.transpose(-1, -2)).masked_fill(~step.mask, float("-inf"))
        return torch.softmax(scores, -1) @ k

    q, kp = torch.arange(8, 12)[:, None], torch.arange(12)[None, :]
    scores = (queries[:, :, 8:] @ keys.transpose(-1, -2)).masked_fill(~((kp <= q) & (kp > q - 4)), float("-inf"))
    full = torch.softmax(scores, -1) @ keys
    assert torch.allclose(attend(2), full)  # R = 8 = window + chunk: every query finds its window
    assert not torch.allclose(attend(1), full)  # R = 4 = window: the chunk's later keys overwrote its first's


def test_series_kept_in_host_memory_are_served_through_the_ring(model_dir):
    """Plan.offload: o_proj and down come from host memory through the prefetch ring (k = 1, L = 2: one ring and
    phase carried through every bucket's states), each request's tokens those of generate alone."""
    from functional_npu import Plan

    params = load_checkpoint(model_dir, ONE, Plan(offload="o_proj,down_proj", prefetch_step=1))
    model = compile_model(params, ONE, backend="none", batch_sizes=[1, 2, 4], max_seq_len=40, prefill_lengths=[8, 32])
    assert model.ring is not None and model.ring.k == 1
    reqs = [Request(tuple(range(3, 3 + n)), max_new_tokens=m, stop=()) for n, m in ((4, 6), (13, 9), (1, 5))]
    engine = Engine(model, blocks=30, block_size=4, chunk=8)
    events = _serve(engine, [(i, r) for i, r in enumerate(reqs)], {})
    for i, r in enumerate(reqs):
        assert [t for e in events[i] for t in e.tokens] == model.generate([list(r.prompt)], r.max_new_tokens)[0]


def test_extend_takes_the_logits_at_each_rows_last_token_alone(model):
    """The head on one row per sequence gives what the head on every position gives there, bit for bit (the
    batch-invariant plan); another position's logits differ, so the index is read."""
    tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    every = model.extend(tokens, positions, model.new_state(2))
    last = torch.tensor([7, 3])
    got = model.extend(tokens, positions, model.new_state(2), last=last)
    assert got.shape == (2, model.config.vocab_size) and torch.equal(got, every[torch.arange(2), last])
    assert not torch.equal(got[1], every[1, 7])


@pytest.mark.parametrize(
    ("last", "got"),
    [
        (torch.tensor([7]), r"\(1,\) torch.int64 \[7\]"),
        (torch.tensor([8, 0]), r"\(2,\) torch.int64 \[8, 0\]"),
        (torch.tensor([-1, 0]), r"\(2,\) torch.int64 \[-1, 0\]"),
        (torch.tensor([1.0, 0.0]), r"\(2,\) torch.float32 \[1.0, 0.0\]"),
        ([7, 7], r"\[7, 7\]"),
    ],
)
def test_extend_refuses_a_last_that_is_not_one_index_per_row(model, last, got):
    tokens, positions = torch.ones(2, 8, dtype=torch.long), torch.arange(8).expand(2, 8)
    with pytest.raises(ValueError, match=r"extend: last must be \[batch 2\] integer indices in \[0, 8\), got " + got):
        model.extend(tokens, positions, model.new_state(2), last=last)
