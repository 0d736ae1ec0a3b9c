"""A conversion process that fails, and case names that are no case: one line each, naming what and the fix."""

import pytest

from tools import graphs
from tools.acl_graphs import acl_artifacts
from tools.conversion import run_conversion
from tools.ge_graphs import ge_artifacts


def test_a_broken_torchair_is_one_line_naming_its_sources_and_the_fix(tmp_path):
    """torchair's sources that do not import (a half-deleted or foreign unpack): one line with the exception, the
    sources and what to remove, not the child's traceback (before: its last 15 lines)."""
    sources = tmp_path / "torchair-2.13.0" / "torch_npu" / "dynamo"
    (sources / "torchair").mkdir(parents=True)
    (sources / "torchair" / "__init__.py").write_text("import a_module_no_one_has\n")
    results, (problem,) = run_conversion("tools.ge_graphs", sources, [], "GE conversion", 300)
    assert results is None and "\n" not in problem and "Traceback" not in problem
    assert problem.startswith("the GE conversion process failed (exit 1): ModuleNotFoundError: No module named ")
    assert f"(torchair's sources at {sources}); those sources do not import: remove {tmp_path / 'torchair-2.13.0'}" in (
        problem
    )


def test_an_unknown_golden_case_is_refused_naming_the_cases(tmp_path, capsys):
    """Before: converted nothing and said nothing."""
    with pytest.raises(ValueError, match=r"unknown golden case 'no-such-case'; the cases are: \w"):
        ge_artifacts({}, ["no-such-case"])
    with pytest.raises(ValueError, match=r"unknown golden case 'no-such-case'"):
        acl_artifacts(["no-such-case"])
    with pytest.raises(ValueError, match=r"unknown golden case 'no-such-case'"):
        graphs.regenerate(tmp_path, names=["no-such-case"], check=True)
    with pytest.raises(SystemExit) as stop:
        graphs.main(["no-such-case", "--check"])
    assert stop.value.code == 2
    assert "unknown golden case 'no-such-case'; the cases are: " in capsys.readouterr().err
