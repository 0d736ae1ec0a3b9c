"""Hostile inputs to the core's pure faces (layouts and their constructors, local shapes, the abstract mesh, quantized
layouts, trees of paths, reshard plans, params): each refused in one line naming the value and the fix, at
construction rather than at first use."""

import re

import pytest
import torch

from functional_npu import (
    Layout,
    Mesh,
    Params,
    Quant,
    cyclic,
    fused,
    local_shape,
    plan_reshard,
    quant_layouts,
    replicated,
    sharded,
    tree_from_paths,
)
from functional_npu.core.layout import Block, LayoutError

MESH = Mesh.abstract({"tp": 1}, 0)
REP = {"w": replicated()}

REFUSED = [
    # quant_layouts: a dim past ndim, ndim 0 or negative
    (
        lambda: quant_layouts(sharded(3, "tp"), Quant(), ndim=2),
        LayoutError,
        "quant_layouts: Layout(dim3=shard(tp)) places dim 3, past a weight of ndim 2 (dims 0..1); give the weight's "
        "ndim, or a layout of its dims",
    ),
    (
        lambda: quant_layouts(replicated(), Quant(), ndim=0),
        ValueError,
        "quant_layouts: ndim must be an int >= 2 (a quantized linear's weight is [..., out, in]), got 0",
    ),
    (
        lambda: quant_layouts(replicated(), Quant(), ndim=-1),
        ValueError,
        "quant_layouts: ndim must be an int >= 2 (a quantized linear's weight is [..., out, in]), got -1",
    ),
    (
        lambda: quant_layouts(replicated(), "int8"),
        TypeError,
        "quant_layouts: quant must be a Quant such as Quant(8), got 'int8'",
    ),
    # local_shape: negative, str, past int64
    (
        lambda: local_shape((-4, 8), replicated(), MESH),
        ValueError,
        "local_shape: <leaf>'s shape (-4, 8) has size -4; sizes are ints in [0, 2**63) (a tensor's shape)",
    ),
    (
        lambda: local_shape("ab", sharded(0, "tp"), MESH),
        TypeError,
        "local_shape: <leaf>'s shape must be a sequence of ints such as (8, 4), got 'ab'",
    ),
    (
        lambda: local_shape((2**70, 8), replicated(), MESH, path="w"),
        ValueError,
        f"local_shape: w's shape ({2**70}, 8) has size {2**70}; sizes are ints in [0, 2**63) (a tensor's shape)",
    ),
    (
        lambda: local_shape((4.0, 8), replicated(), MESH),
        ValueError,
        "local_shape: <leaf>'s shape (4.0, 8) has size 4.0; sizes are ints in [0, 2**63)",
    ),
    # Mesh.abstract given a list
    (
        lambda: Mesh.abstract([("tp", 2)], 0),
        TypeError,
        "Mesh.abstract: axes must be a mapping of axis name to size such as {'dp': 2, 'tp': 4}, got [('tp', 2)]; "
        "pass dict(...) of it",
    ),
    # layout constructors refuse junk when built, not at first use
    (lambda: sharded(0, "tp", pack=0), ValueError, "Shard: pack must be a positive int, got 0"),
    (
        lambda: sharded(0, 3),
        ValueError,
        "a layout's mesh axes are axis names such as 'tp' or ('dp', 'tp'), got 3",
    ),
    (
        lambda: sharded(0, ""),
        ValueError,
        "a layout's mesh axes are axis names such as 'tp' or ('dp', 'tp'), got ''",
    ),
    (
        lambda: sharded(2**70, "tp"),
        LayoutError,
        f"layout dims are non-negative ints below 64, got {2**70}",
    ),
    (lambda: cyclic(0, "tp", 0), ValueError, "Cyclic: size (the stacked layers) must be a positive int, got 0"),
    (
        lambda: Block("q", -1),
        ValueError,
        "Block 'q': size must be an int >= 0 and unit an int >= 1 (a head's width), got size -1, unit 1",
    ),
    (
        lambda: fused(0, [("q", -4)], "tp"),
        ValueError,
        "Block 'q': size must be an int >= 0 and unit an int >= 1 (a head's width), got size -4, unit 1",
    ),
    (
        lambda: fused(0, [("q", 8)], "tp", groups=0),
        ValueError,
        "Shard: groups must be a positive int, got 0",
    ),
    (
        lambda: Layout("abc"),
        TypeError,
        "Layout: dims must be a sequence of Shard, Cyclic or None, got 'abc'",
    ),
    (
        lambda: Layout((None, "tp")),
        TypeError,
        "Layout: each dim is a Shard, a Cyclic or None, got 'tp'; build one with sharded(0, 'tp'), fused(...), "
        "cyclic(...) or replicated()",
    ),
    # tree_from_paths
    (
        lambda: tree_from_paths([("a", 1), ("a", 2)]),
        ValueError,
        "path 'a' is given twice or is also a prefix of another path",
    ),
    (
        lambda: tree_from_paths({"a..b": 1}),
        ValueError,
        "path 'a..b' has an empty key; a path is dotted keys such as 'layers.0.qkv'",
    ),
    (
        lambda: tree_from_paths({3: 1}),
        TypeError,
        "path 3: a path is a str of dotted keys such as 'layers.0.qkv', got int",
    ),
    # plan_reshard
    (
        lambda: plan_reshard({"w": ((-4,), torch.float32)}, REP, REP, MESH),
        ValueError,
        "plan_reshard: shapes['w']'s shape (-4,) has size -4; sizes are ints in [0, 2**63) (a tensor's shape)",
    ),
    (
        lambda: plan_reshard({"w": ((4,), torch.float32)}, {"v": replicated()}, REP, MESH),
        ValueError,
        "plan_reshard: src_specs has no layout for 1 path(s) of shapes, e.g. 'w'; give one per leaf "
        "(leaf_specs(specs, tree))",
    ),
    (
        lambda: plan_reshard({"w": torch.ones(4)}, REP, REP, MESH),
        TypeError,
        "plan_reshard: shapes['w'] must be (full shape, dtype), e.g. (tuple(x.shape), x.dtype), got Tensor",
    ),
    # Params' config
    (
        lambda: Params({}, "llama"),
        TypeError,
        "Params: config must be a model config object (functional_npu.read_config(path)), got str 'llama'",
    ),
    (
        lambda: Params({}, {"vocab_size": 64}),
        TypeError,
        "Params: config must be a model config object (functional_npu.read_config(path)), got dict {'vocab_size': 64}",
    ),
]


@pytest.mark.parametrize("call, error, message", REFUSED, ids=[m[:60] for _, _, m in REFUSED])
def test_refused_in_one_line(call, error, message):
    with pytest.raises(error, match=re.escape(message)) as e:
        call()
    assert "\n" not in str(e.value)


def test_valid_inputs_still_answer():
    assert local_shape((8, 4), sharded(0, "tp"), Mesh.abstract({"tp": 4}), coordinate=1) == (2, 4)
    assert local_shape(torch.Size([0, 4]), replicated(), MESH) == (0, 4)
    assert tree_from_paths([("a.b", 1), ("a.c", 2)]) == {"a": {"b": 1, "c": 2}}
    assert Block("q", 0).size == 0  # an empty block is refused where it is placed, with its dim and axis
    assert quant_layouts(sharded(0, "tp"), Quant(), ndim=2)["weight"] == sharded(0, "tp")
