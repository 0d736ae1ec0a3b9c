"""npugraph_ex's options this library refuses (functional_npu/runtime/serving/backends.py): each at its refused value is
one line naming it, why and the value to leave it at; its defaults and clone_input are accepted. (The refusal of
npugraph_ex's own CompilerConfig, and what each refused option would do, run in tests/npu/test_acl_replay.py.) The
capture mode is held at "global", the one under which an allocation inside capture fails loudly."""

import types

import pytest

from functional_npu.runtime.serving.backends import (
    REFUSED_NPUGRAPH_EX_OPTIONS,
    REQUIRED_NPUGRAPH_EX_OPTIONS,
    check_npugraph_ex_config,
)


class _Option:
    def __init__(self, value):
        self.value = value


def _config(**values):
    defaults = {name: _Option(not refused) for name, (refused, _) in REFUSED_NPUGRAPH_EX_OPTIONS.items()}
    defaults |= {name: _Option(required) for name, (required, _) in REQUIRED_NPUGRAPH_EX_OPTIONS.items()}
    return types.SimpleNamespace(**defaults | {k: _Option(v) for k, v in values.items()})


def test_the_default_config_and_clone_input_are_accepted():
    config = _config(clone_input=False)
    assert check_npugraph_ex_config(config) is config


@pytest.mark.parametrize("name", sorted(REFUSED_NPUGRAPH_EX_OPTIONS))
def test_each_refused_option_is_one_line_naming_it(name):
    refused, why = REFUSED_NPUGRAPH_EX_OPTIONS[name]
    with pytest.raises(ValueError) as e:
        check_npugraph_ex_config(_config(**{name: refused}))
    assert str(e.value) == f"npugraph_ex option {name}={refused!r} is refused: {why}; leave {name} at {not refused!r}"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["relaxed", "thread_local", None])
def test_a_capture_mode_that_lets_an_allocation_through_is_refused(mode):
    """npugraph_ex's ``capture_error_mode`` other than ``"global"`` (or left unset on a config that lacks it): an
    allocation or synchronous copy inside the captured region would not fail at capture."""
    required, why = REQUIRED_NPUGRAPH_EX_OPTIONS["capture_error_mode"]
    assert required == "global"
    with pytest.raises(ValueError) as e:
        check_npugraph_ex_config(_config(capture_error_mode=mode))
    assert str(e.value) == (
        f"npugraph_ex option capture_error_mode={mode!r} is refused: {why}; leave capture_error_mode at 'global'"
    )
