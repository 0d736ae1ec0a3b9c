"""The prefetch pass reads inductor's scheduler IR, which torch's own config calls a prototype: if a torch
upgrade moves what the pass reads, this fails first, naming the torch version and what moved."""

import importlib
import inspect

import torch

from functional_npu.parallel.schedule import BUILT_FOR, IR_NEEDS


def _owner(path):
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def test_the_scheduler_ir_the_pass_reads_is_there():
    missing = []
    for path, names in IR_NEEDS.items():
        owner = _owner(path)
        # instance attributes are set in __init__: look for them in the class source too
        source = inspect.getsource(owner) if inspect.isclass(owner) else ""
        missing += [f"{path}.{n}" for n in names if not hasattr(owner, n) and f"self.{n}" not in source]
    assert not missing, (
        f"the prefetch pass was written against torch {BUILT_FOR}'s inductor scheduler IR; torch "
        f"{torch.__version__} no longer has {missing}: update functional_npu.parallel.schedule"
    )


def test_the_torch_line_is_the_one_the_pass_was_built_for():
    assert torch.__version__.startswith(BUILT_FOR + "."), (
        f"torch {torch.__version__} is not the {BUILT_FOR} line the prefetch pass was built and tested "
        f"against; run tests/parallel/test_layer_shard.py and update BUILT_FOR"
    )
