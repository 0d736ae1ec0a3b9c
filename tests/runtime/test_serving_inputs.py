"""Hostile inputs at the serving faces: each is refused in one line naming the parameter, its value and a fix, before
anything is built (the engine's pool, a compile, a decode step); the correct calls beside them answer as before."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from functional_npu import Mesh
from functional_npu.models.llama import init_params
from functional_npu.runtime.serving import (
    CompileOptions,
    Engine,
    Lockstep,
    Request,
    batch_coverage,
    cache_length,
    compile_model,
    generate,
    modes,
    resolve_backend,
    stop_ids,
)
from functional_npu.runtime.serving.engine import free_bytes

from ..support.configs import TINY as CFG

ONE = Mesh.abstract({"tp": 1}, 0)
FREE = r"more than the \d+ bytes free on cpu; "  # the host's memory available now


@pytest.fixture(scope="module")
def m():
    params = init_params(CFG, seed=0)
    model = compile_model(params, ONE, backend="none", batch_sizes=[1, 2], max_seq_len=32, prefill_lengths=[8, 16])
    return SimpleNamespace(params=params, model=model)


def _prefilled(model):
    state = model.new_state(1)
    model.prefill([[1, 2]], state)
    return state


def _compile(m, **options):
    fields = {"backend": "none", "batch_sizes": [1], "max_seq_len": 16, "prefill_lengths": [8]} | options
    return compile_model(m.params, ONE, **fields)


def _twice(m):
    engine = Engine(m.model, blocks=10)
    engine.add(Request((1, 2), 3), id="a")
    engine.add(Request((3, 4), 3), id="a")


def _after_a_step(m):
    engine = Engine(m.model, blocks=10)
    engine.add(Request((1, 2), 3), id="a")
    engine.step()
    engine.add(Request((3, 4), 3), id="a")


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


CASES = [
    # 1: a duplicate request id, waiting or running
    ("duplicate-id", _twice, ValueError, _exact(
        "Engine.add: request id 'a' is already in the engine; give each request its own id (or none: the engine "
        "numbers them), or abort the first")),
    ("duplicate-id-running", _after_a_step, ValueError, "^" + re.escape("Engine.add: request id 'a' is already in")),
    # 3: a pool that cannot be allocated, refused before anything is built
    ("blocks-2**40", lambda m: Engine(m.model, blocks=2**40), ValueError,
     "^" + re.escape("Engine: blocks=1099511627776 asks for a KV pool of 4.5e+15 bytes (1099511627776 blocks of "
                     "block_size=16 positions), ") + FREE + r"give at most blocks=\d+ \(or kv_bytes=\d+\)$"),
    ("kv_bytes-10**300", lambda m: Engine(m.model, kv_bytes=10**300), ValueError,
     "^" + re.escape("Engine: kv_bytes=1e+300 asks for a KV pool of 1e+300 bytes (2.44e+296 blocks of block_size=16 "
                     "positions), ") + FREE + r"give at most kv_bytes=\d+ \(or blocks=\d+\)$"),
    # 5: token ids outside the vocabulary
    ("prefill-ids", lambda m: m.model.prefill([[1, 999, -7]], m.model.new_state(1)), ValueError, _exact(
        "prefill: prompt 0 has token ids [999, -7] outside the vocabulary [0, 64); tokenize with this model's "
        "tokenizer")),
    ("decode-id", lambda m: m.model.decode(torch.tensor([999]), torch.tensor([2]), _prefilled(m.model)), ValueError,
     _exact("decode: tokens[0] is 999, outside the vocabulary [0, 64); tokenize with this model's tokenizer")),
    ("decode-negative-id", lambda m: m.model.decode(torch.tensor([-1]), torch.tensor([2]), _prefilled(m.model)),
     ValueError, _exact("decode: tokens[0] is -1, outside the vocabulary [0, 64); tokenize with this model's "
                        "tokenizer")),
    # 20: a batch below 1
    ("new_state-0", lambda m: m.model.new_state(0), ValueError, _exact(
        "new_state: batch must be an int >= 1 (it is rounded up to a bucket of [1, 2]), got 0")),
    ("new_state--1", lambda m: m.model.new_state(-1), ValueError, _exact(
        "new_state: batch must be an int >= 1 (it is rounded up to a bucket of [1, 2]), got -1")),
    # 21: compile options checked at construction
    ("greedy_head-str", lambda m: _compile(m, greedy_head="no"), TypeError, _exact(
        "compile_model: greedy_head must be a bool, got str 'no'")),
    ("batch_sizes-bool", lambda m: _compile(m, batch_sizes=[True]), TypeError, _exact(
        "compile_model: batch_sizes must be positive ints, got [True] (True is a bool)")),
    ("batch_sizes-empty", lambda m: _compile(m, batch_sizes=[]), ValueError, _exact(
        "compile_model: batch_sizes must be positive ints, got []; give at least one (None: the default)")),
    ("max_seq_len-bool", lambda m: _compile(m, max_seq_len=True), TypeError, _exact(
        "compile_model: max_seq_len must be a positive int (None: the default), got bool True")),
    ("options-backend", lambda m: CompileOptions(backend="bogus", mode="bogus", max_seq_len=-5), ValueError, _exact(
        "compile_model: backend='bogus' is not one of ('auto', 'inductor', 'torchair', 'eager', 'aot_eager', 'none', "
        "'npugraph_ex')")),
    ("options-mode", lambda m: CompileOptions(mode="bogus"), ValueError, _exact(
        "compile_model: mode='bogus' is no backend's mode; give one of ('max-autotune', 'reduce-overhead', 'default', "
        "'max-autotune-no-cudagraphs') (or None: the one measured fastest there)")),
    ("options-max_seq_len", lambda m: CompileOptions(max_seq_len=-5), ValueError, _exact(
        "compile_model: max_seq_len must be a positive int (None: the default), got -5")),
    # 22: stop_ids of a missing directory
    ("stop_ids-missing", lambda m: stop_ids("/definitely/not/here"), ValueError, _exact(
        "stop_ids: '/definitely/not/here' is not a directory; give the checkpoint's directory")),
    # 24: the engine's stop ids checked as a request's
    ("engine-stop-vocab", lambda m: Engine(m.model, blocks=10, stop=(999,)), ValueError, _exact(
        "Engine: stop ids [999] are not in the vocabulary [0, 64)")),
    ("engine-stop-str", lambda m: Engine(m.model, blocks=10, stop="ab"), TypeError, _exact(
        "Engine: stop must be a tuple of int token ids (() for none), got str 'ab'")),
    ("engine-stop-int", lambda m: Engine(m.model, blocks=10, stop=5), TypeError, _exact(
        "Engine: stop must be a tuple of int token ids (() for none), got int 5")),
    # 28: block sizes
    ("block_size-0", lambda m: Engine(m.model, blocks=10, block_size=0), ValueError, _exact(
        "Engine: block_size=0 must be an int >= 1 (positions per block), e.g. 16")),
    ("block_size-2**40", lambda m: Engine(m.model, blocks=10, block_size=2**40), ValueError,
     "^" + re.escape("Engine: blocks=10 asks for a KV pool of 2.81e+15 bytes (10 blocks of block_size=1099511627776 "
                     "positions), ") + FREE + re.escape("use a smaller block_size, or a smaller max_seq_len") + "$"),
    # 33: lockstep counts
    ("lockstep-ranks-0", lambda m: Lockstep.over(4, 0, 8, [1, 2]), ValueError, _exact(
        "Lockstep.over: ranks must be an int >= 1 (the ranks that share the steps), got 0")),
    ("lockstep-prompts-negative", lambda m: Lockstep.over(-4, 2, 8, [1, 2]), ValueError, _exact(
        "Lockstep.over: prompts must be an int >= 0 (the number of prompts over all ranks), got -4")),
    ("lockstep-no-buckets", lambda m: Lockstep.over(4, 2, 8, []), ValueError, _exact(
        "Lockstep.over: batch_sizes must be a non-empty list of positive ints (the model's batch_sizes), got []")),
    ("lockstep-0-0-0", lambda m: generate(m.model, [[1, 2]], 2, lockstep=Lockstep(0, 0, 0)), ValueError, _exact(
        "Lockstep: chunks must be an int >= 1 (as Lockstep.over gives them), got 0")),
    # 34: decode's tokens and positions
    ("decode-position-negative", lambda m: m.model.decode(torch.tensor([3]), torch.tensor([-5]), _prefilled(m.model)),
     ValueError, _exact("decode: positions must be in [0, max_seq_len 32), got -5")),
    ("decode-position-past", lambda m: m.model.decode(torch.tensor([3]), torch.tensor([32]), _prefilled(m.model)),
     ValueError, _exact("decode: positions must be in [0, max_seq_len 32), got 32")),
    ("decode-lengths", lambda m: m.model.decode(torch.tensor([3, 4]), torch.tensor([2]), _prefilled(m.model)),
     ValueError, _exact("decode: tokens [2] and positions [1] must both be [n] with 1 <= n <= the state's batch 1")),
    ("decode-past-batch", lambda m: m.model.decode(torch.tensor([3, 4]), torch.tensor([2, 2]), _prefilled(m.model)),
     ValueError, _exact("decode: tokens [2] and positions [2] must both be [n] with 1 <= n <= the state's batch 1")),
    ("decode-float", lambda m: m.model.decode(torch.tensor([3.0]), torch.tensor([2]), _prefilled(m.model)),
     TypeError, _exact("decode: tokens are torch.float32; give an integer tensor (torch.long)")),
    ("decode-list", lambda m: m.model.decode([3], torch.tensor([2]), _prefilled(m.model)), TypeError, _exact(
        "decode: tokens must be a 1-d integer tensor [n], got list")),
    # 41: kv_bytes that is no number of bytes
    ("kv_bytes-inf", lambda m: Engine(m.model, kv_bytes=float("inf")), ValueError, _exact(
        "Engine: kv_bytes=inf must be a finite number of bytes >= 0 (the KV budget on each rank), "
        "e.g. kv_bytes=2**30")),
    ("kv_bytes-nan", lambda m: Engine(m.model, kv_bytes=float("nan")), ValueError, _exact(
        "Engine: kv_bytes=nan must be a finite number of bytes >= 0 (the KV budget on each rank), "
        "e.g. kv_bytes=2**30")),
    ("kv_bytes-str", lambda m: Engine(m.model, kv_bytes="1e6"), TypeError, _exact(
        "Engine: kv_bytes must be a number of bytes (the KV budget on each rank), got str '1e6'")),
    # also seen: the shape helpers and the backend names
    ("cache_length-negative", lambda m: cache_length(-100), ValueError, _exact(
        "cache_length: tokens must be an int >= 1, got -100")),
    ("cache_length-limit", lambda m: cache_length(100, limit=-5), ValueError, _exact(
        "cache_length: limit must be an int >= 1, got -5")),
    ("batch_coverage-empty", lambda m: batch_coverage([], [1]), ValueError, _exact(
        "batch_coverage: buckets must be the compiled batch_sizes, positive ints (at least one), got []")),
    ("batch_coverage-nan", lambda m: batch_coverage([1, float("nan")], [1]), ValueError, _exact(
        "batch_coverage: buckets must be the compiled batch_sizes, positive ints (at least one), got [1, nan]")),
    ("batch_coverage-float", lambda m: batch_coverage([1, 2.0], [1]), ValueError, _exact(
        "batch_coverage: buckets must be the compiled batch_sizes, positive ints (at least one), got [1, 2.0]")),
    ("modes-bogus", lambda m: modes("bogus", "cpu"), ValueError, _exact(
        "unknown backend 'bogus'; choose one of auto, inductor, torchair, eager, aot_eager, none, npugraph_ex")),
    ("resolve_backend-banana", lambda m: resolve_backend("none", device_type="banana"), ValueError, _exact(
        "device_type 'banana' is not a device type ('cpu', 'cuda', 'npu', ...); give the params' device type "
        "(params['embed'].device.type), or None: the detected accelerator")),
]  # fmt: skip


@pytest.mark.parametrize("call, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_input_is_refused_in_one_line(m, call, error, message):
    if FREE in message and free_bytes(torch.device("cpu")) is None:
        pytest.skip("the host's free memory cannot be known here: the pool would be built")  # never: Linux knows it
    with pytest.raises(error, match=message):
        call(m)


def test_a_request_with_a_stop_that_is_no_tuple_is_an_event_naming_the_request_and_stop(m):
    events = list(Engine(m.model, blocks=10).run([Request((1, 2), 2, stop=5)]))
    assert [(e.id, e.finished, e.error) for e in events] == [
        (0, "error", "request 0: stop must be a tuple of int token ids (() for none), got int 5")
    ]


@pytest.mark.parametrize(
    "eos, message",
    [
        (2.7, "must be an int >= 0 or a list of them, got 2.7"),
        (["a", "b"], "must be an int >= 0 or a list of them, got ['a', 'b']"),
        (-1, "must be an int >= 0 or a list of them, got -1"),
    ],
)
def test_stop_ids_refuse_eos_ids_that_are_no_token_ids(tmp_path, eos, message):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": eos}))
    want = f"stop_ids: eos_token_id of {tmp_path / 'config.json'} {message}"
    with pytest.raises(ValueError, match=_exact(want)):
        stop_ids(tmp_path)


def test_distinct_ids_still_give_each_request_its_own_tokens(m):
    """The duplicate check refuses nothing else: two requests under their own ids get generate()'s tokens."""
    engine = Engine(m.model, blocks=10)
    engine.add(Request((1, 2), 3), id="a")
    engine.add(Request((3, 4), 3), id="b")
    got: dict = {"a": [], "b": []}
    while engine.has_work():
        for event in engine.step():
            got[event.id] += event.tokens
    assert got == {"a": m.model.generate([[1, 2]], 3)[0], "b": m.model.generate([[3, 4]], 3)[0]}


def test_a_decode_of_ids_in_the_vocabulary_gives_the_prefills_logits(m):
    """The checks refuse nothing in range: a decode step's logits are those of the prompt prefilled whole."""
    for token in (0, 3, CFG.vocab_size - 1):
        step = m.model.decode(torch.tensor([token]), torch.tensor([2]), _prefilled(m.model))
        whole = m.model.prefill([[1, 2, token]], m.model.new_state(1))
        torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)
