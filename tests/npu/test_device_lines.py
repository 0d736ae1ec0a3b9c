"""The lines only an NPU runs, run here (tests/npu/device_driver.py): torchair's and npugraph_ex's own Python with a
stand-in for the device alone. The backend the library builds for each converts a graph of its Ascend ops, its ring's
in-place broadcast and its stream hints, and every function that only a device runs is executed to at least
:data:`TARGET` of its lines (``python -m tests.npu.test_device_lines`` prints the table)."""

from __future__ import annotations

import ast
import sys

import pytest

from functional_npu.runtime.serving.backends import REFUSED_NPUGRAPH_EX_OPTIONS
from tests.npu.device_driver import WHICH
from tools.conversion import run_conversion

from ..support import ROOT, run_driver

TARGET = 0.9
# the functions only an NPU runs: file -> names (a class: its methods)
DEVICE_ONLY = {
    "functional_npu/runtime/serving/backends.py": (
        "npu_status",
        "torchair_streams",
        "_SideStream",
        "_event_record",
        "_event_wait",
        "npugraph_ex_streams",
        "_create_events",
        "npugraph_ex_config",
        "check_npugraph_ex_config",
        "_npugraph_ex",
        "_torchair",
        "resolve_backend",
    ),
    "functional_npu/runtime/serving/ge_converters.py": (
        "reinplace_ring",
        "configure",
        "_quant_matmul",
        "_weight_quant_matmul",
        "_ring_write",
    ),
}


def _ranges(file: str, names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """name -> (first line, last line) of each top-level function or class ``names`` in ``file``."""
    tree = ast.parse((ROOT / file).read_text())
    found = {
        n.name: (n.lineno, n.end_lineno)
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names
    }
    missing = set(names) - set(found)
    assert not missing, f"{file} no longer defines {sorted(missing)}: update DEVICE_ONLY"
    return found


def line_coverage(runs: dict[str, dict]) -> dict[str, tuple[int, int, list[int]]]:
    """``"file:name" -> (statements run, statements, lines not run)`` over every driver run together (a line counts
    as run when any run ran it)."""
    out = {}
    for file, names in DEVICE_ONLY.items():
        key = file.removeprefix("functional_npu/")
        name = f"functional_npu/{key}"
        seen = [r["coverage"][name] for r in runs.values() if name in r["coverage"]]
        statements = set(seen[0]["statements"]) if seen else set()
        missing = set.intersection(*(set(s["missing"]) for s in seen)) if seen else statements
        for name, (first, last) in _ranges(file, names).items():
            body = {line for line in statements if first < line <= last}  # the def line runs at import
            left = sorted(body & missing)
            out[f"{file}:{name}"] = (len(body) - len(left), len(body), left)
    return out


@pytest.fixture(scope="module")
def runs():
    return {which: run_driver("tests.npu.device_driver", [which], f"{which} device lines") for which in WHICH}


def test_torchair_backend_as_on_a_device_converts_the_librarys_ops(runs):
    """``resolve_backend`` on a device: "auto" is torchair's GE graph with its stream scopes; its compiler registers
    the library's GE converters (the import that once pointed at a folder it had left) and converts the Ascend
    matmuls, the ring's in-place broadcast (a ``ViewCopy`` into a ``RefData`` slot, then ``HcomBroadcast``) and the
    prefetch stream's label."""
    got = runs["torchair"]
    assert got["auto"] == {"name": "torchair", "mode": "max-autotune", "streams": "torchair", "kernels": "npu"}
    assert got["reduce_overhead"] == {"name": "torchair", "mode": "reduce-overhead", "streams": "inline"}
    ops = set(got["ge_ops"])
    assert {"QuantBatchMatmulV3", "WeightQuantBatchMatmulV2", "HcomBroadcast", "ViewCopy", "RefData"} <= ops
    assert "TensorMove" not in ops  # the slot is written in place, not a copy of it
    assert got["ge_stream_labels"] == ["prefetch"]


def test_npugraph_ex_backend_as_on_a_device_hands_its_streams_to_capture(runs):
    """``resolve_backend("npugraph_ex")`` on a device: its config (with the event pre-pass) and hints compile through
    npugraph_ex's passes to capture, with the side stream's label and the library's tagged events created; the real
    NPU probe sees the stand-in torch_npu and no device; each refused option is refused on npugraph_ex's own
    config."""
    got = runs["npugraph_ex"]
    assert got["backend"] == {"name": "npugraph_ex", "streams": "npugraph_ex", "kernels": "npu"}
    assert got["stream_labels"] == ["prefetch"]
    assert got["tagged_events"] == ["functional_npu.done", "functional_npu.made", "functional_npu.prefetch.issue"]
    assert {"npugraph_ex.tagged_event_record.default", "npugraph_ex.scope_enter.default"} <= set(got["graph_ops"])
    assert got["status"] == [False, "torch_npu imported but torch.npu.is_available() is False"]
    refused = got["refused"]
    pre_pass = refused.pop("post_grad_custom_pre_pass")
    assert pre_pass.startswith("npugraph_ex option post_grad_custom_pre_pass is this library's")
    assert sorted(refused) == sorted(REFUSED_NPUGRAPH_EX_OPTIONS)
    assert all(why.startswith(f"npugraph_ex option {name}=") for name, why in refused.items())


def test_every_device_only_function_runs_here(runs):
    """At least :data:`TARGET` of their lines together, and some of each one. What is not run: the branch of
    ``npu_status`` where the device answers yes (the stand-in ``torch.npu`` has no device), two refusals of a graph
    the ring never makes, and a one-rank ring write."""
    table = line_coverage(runs)
    run, total = sum(r for r, _, _ in table.values()), sum(t for _, t, _ in table.values())
    unrun = [k for k, (r, t, _) in table.items() if t and not r]
    missed = {k: left for k, (_, _, left) in table.items() if left}
    assert run / total >= TARGET and not unrun, f"{run}/{total} device-only lines run; not run: {missed}"


def test_the_coverage_counts_a_line_not_run():
    """The count itself: a statement of a listed function missing from every run is counted as not run."""
    file = "functional_npu/runtime/serving/backends.py"
    first, last = _ranges(file, ("_torchair",))["_torchair"]
    statements = list(range(first, last + 1))
    run = {"coverage": {file: {"statements": statements, "missing": [last]}}}
    done, total, left = line_coverage({"a": run, "b": run})["functional_npu/runtime/serving/backends.py:_torchair"]
    assert left == [last] and done == total - 1


def main() -> int:
    from functional_npu.npu import torchair_sources

    sources = torchair_sources()
    got = {w: run_conversion("tests.npu.device_driver", sources, [w], w, 600)[0] for w in WHICH}
    table = line_coverage(got)
    for name, (run, total, left) in table.items():
        print(f"{run:4d}/{total:<4d} {run / max(total, 1):6.1%}  {name}" + (f"  not run: {left}" if left else ""))
    run, total = sum(r for r, _, _ in table.values()), sum(t for _, t, _ in table.values())
    print(f"{run:4d}/{total:<4d} {run / total:6.1%}  every device-only function")
    return 0


if __name__ == "__main__":
    sys.exit(main())
