"""The expert transforms on real gloo ranks: eplb.rebalance and ep_tp, eager and compiled, on one 4-rank world.

The expert axis ("dp", "tp") has 4 ranks; "tp" alone is two groups of 2 ranks. Each case checks
every rank's result bit for bit against ``shard`` of the full tensors (EP<->TP) or against the
new placement's rows (rebalance), and that the inputs were not modified. The aten graphs are
checked against torchair's working converters (NPU convertibility without an NPU).
"""

import pytest
import torch

from ..support import torchair_ops
from ..support.eplb_workers import ep_tp_program, rebalance_program

AXES = {"dp": 2, "tp": 2}
OLD2, NEW2 = (
    [[[0, 1, 2], [3, 4, 0]]] * 2,
    [[[0, 1, 3], [3, 4, 2]], [[4, 1, 2], [0, 4, 3]]],
)  # 0 hot; 2, 3, 4 doubled; local permutes
OLD4 = [[[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2, 3]]] * 2
NEW4 = [[[0, 1, 7], [3, 4, 5], [6, 7, 0], [0, 2, 3]], [[5, 1, 2], [3, 4, 0], [6, 7, 0], [1, 2, 0]]]
REBALANCE = {
    "2-rank-groups": ("tp", OLD2, NEW2, 5, torch.bfloat16),
    "4-ranks": (("dp", "tp"), OLD4, NEW4, 8, torch.float32),
}
EP_TP = {"2-rank-groups": ("tp", torch.bfloat16), "4-ranks": (("dp", "tp"), torch.float32)}


def _collectives(ops: list[str]) -> int:
    return sum("all_to_all_single" in op for op in ops)


@pytest.mark.parametrize("mode,case", [("eager", "2-rank-groups"), ("eager", "4-ranks"), ("inductor", "4-ranks")])
def test_rebalance(world4, mode, case):
    axis, old, new, experts, dtype = REBALANCE[case]
    results = world4.run(rebalance_program, AXES, axis, old, new, experts, dtype, 3, mode)
    for r in results:
        assert r["experts"] and r["maps"] and r["layers"] and r["inputs_untouched"], r
        if mode == "inductor":
            assert _collectives(r["ops"]) == 2, r["ops"]  # one uneven all_to_all per expert leaf
        else:  # counted at the collectives: each expert a rank gains, once, and nothing else
            assert r["received"] == r["need"], (r["received"], r["need"])
    assert sum(r["need"] for r in results) > 0


@pytest.mark.parametrize("mode,case", [("eager", "2-rank-groups"), ("eager", "4-ranks"), ("inductor", "2-rank-groups")])
def test_ep_tp(world4, mode, case):
    axis, dtype = EP_TP[case]
    for r in world4.run(ep_tp_program, AXES, axis, 8, 4, 5, dtype, 11, mode):
        assert r["tp"] and r["roundtrip"] and r["inputs_untouched"], r
        if mode == "inductor":
            assert _collectives(r["ops"]) == 4, r["ops"]  # one per leaf and direction, nothing else moved


def _convertible(ops: list[str]) -> None:
    ops = {op for op in ops if not op.startswith("<")}  # '<built-in function getitem>' is plumbing
    assert "_c10d_functional.all_to_all_single.default" in ops
    table = torchair_ops()
    supported = set(table["converters"]) | set(table["decompositions"])
    assert ops <= supported, f"ops without a working torchair converter: {ops - supported}"


def test_aten_graphs_are_npu_convertible(world4):
    axis, old, new, experts, dtype = REBALANCE["4-ranks"]
    r = world4.run(rebalance_program, AXES, axis, old, new, experts, dtype, 3, "aten")[0]
    assert r["experts"] and r["maps"]
    _convertible(r["ops"])
    r = world4.run(ep_tp_program, AXES, "tp", 8, 4, 5, torch.float32, 11, "aten")[0]
    assert r["tp"] and r["roundtrip"]
    _convertible(r["ops"])
