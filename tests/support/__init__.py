"""What the tests share: repository paths (here), tiny transformers reference models (``hf_models``), CLI
helpers (``cli``), hypothesis strategies (``strategies``) and the functions the gloo ranks run (``workers``,
``prefetch_workers``, ``reshard_workers``, ``eplb_workers``). Rank functions pickle by module path, so they
live in modules a spawned process imports as ``tests.support.<module>`` from the repository root."""

import functools
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "graphs"


@functools.cache
def torchair_ops() -> dict:
    """torchair's working GE converters, stubs and decompositions (from tools/extract_torchair_ops.py)."""
    return json.loads((ROOT / "functional_npu" / "data" / "torchair_ops.json").read_text())


def run_driver(module: str, args: list[str], what: str, timeout: float = 600) -> dict:
    """Run the test driver ``python -m module SOURCES OUT *args`` in a process of its own over torchair's sources
    (:func:`tools.conversion.run_conversion`) and return what it wrote; skips when the sources cannot be had."""
    import pytest

    from functional_npu.npu import TorchairUnavailable, torchair_sources
    from tools.conversion import run_conversion

    try:
        sources = torchair_sources()
    except TorchairUnavailable as e:
        pytest.skip(str(e))
    got, problems = run_conversion(module, sources, args, what, timeout)
    assert got is not None, problems
    return got
