"""Hostile inputs to the prefetch ring's hazard check: a bad prefetch step, ops that are not distinct names, an access
by an op not in the program, code that is not inductor's: each refused in one line naming the value."""

import re

import pytest

from functional_npu.checks import Program, check, expected_slot, from_inductor_code

OK = Program(ops=["w0", "r0"], after={"r0": ["w0"]}, writes={"w0": ("s0", 0)}, reads={"r0": ("s0", 0)})
STEP = "k (the prefetch step: a ring of k + 1 slots) must be an int >= 0, got"
CODE = "from_inductor_code: code must be inductor's generated module with its 'def call(self, args):' (e.g. from "
CODE += "torch._inductor.utils.run_and_get_code), got"

REFUSED = [
    (lambda: check(OK, -1), ValueError, f"check: {STEP} -1"),
    (lambda: check(OK, 1.5), ValueError, f"check: {STEP} 1.5"),
    (lambda: expected_slot(3, -1), ValueError, f"expected_slot: {STEP} -1"),
    (
        lambda: check(OK, 0, -1),
        ValueError,
        "check: slots (the ring's slots) must be an int >= 0 or None, got -1",
    ),
    (
        lambda: check({"ops": []}, 0),
        TypeError,
        "check: program must be a Program (from_fx, from_inductor_code, ...), got {'ops': []}",
    ),
    (
        lambda: Program(ops=["a"], after={}, writes={"zz": ("s", 0)}),
        ValueError,
        "Program: writes names op 'zz', which is not in ops; add it to ops in order",
    ),
    (
        lambda: Program(ops=["a"], after={}, reads={"zz": ("s", 0)}),
        ValueError,
        "Program: reads names op 'zz', which is not in ops; add it to ops in order",
    ),
    (
        lambda: Program(ops=["a"], after={}, waits={"zz": "s"}),
        ValueError,
        "Program: waits names op 'zz', which is not in ops; add it to ops in order",
    ),
    (
        lambda: Program(ops=["a", "a"], after={}),
        ValueError,
        "Program: op 'a' appears twice in ops; name each op once",
    ),
    (
        lambda: Program(ops="ab", after={}),
        TypeError,
        "Program: ops must be a sequence of op names such as ['w0', 'r0'], got 'ab'",
    ),
    (lambda: from_inductor_code("", 1), ValueError, f"{CODE} ''"),
    (lambda: from_inductor_code(None, 1), ValueError, f"{CODE} None"),
]


@pytest.mark.parametrize("call, error, message", REFUSED, ids=[m[:60] for _, _, m in REFUSED])
def test_refused_in_one_line(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as e:
        call()
    assert "\n" not in str(e.value)


def test_a_safe_program_still_checks():
    safe = Program(["w0", "q0", "r0"], {"q0": ["w0"], "r0": ["q0"]}, {"w0": ("s0", 0)}, {"q0": "s0"}, {"r0": ("s0", 0)})
    assert check(safe, 0) == []
    assert expected_slot(3, 1) == 1
