"""Reading GE graphs: the partial-order checks against brute force over every order, and the prefetch
check on graphs built the way torchair converts the layer-sharded decoder (with and without hints)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu.npu.ge_graph import ancestors, census, group_ranks, hcom_schedule, max_live, prefetch_order

WAIT = "wait_tensor_0-_c10d_functional.wait_tensor.default.OUTPUT.0"


def op(name, type_, inputs=(), controls=(), stream=None, attrs=None, out_fx="", shape=(4, 4)):
    desc = {"dtype": "DT_FLOAT", "shape": list(shape), "fx": out_fx}
    return {
        "name": name,
        "type": type_,
        "inputs": list(inputs),
        "controls": list(controls),
        "stream": stream,
        "attrs": attrs or {},
        "in": [desc] if inputs else [],
        "out": [desc],
    }


# ---- max_live against every linearization ------------------------------------------------------
@st.composite
def dags_with_buffers(draw):
    n = draw(st.integers(2, 7))
    edges = {(i, j) for i in range(n) for j in range(i + 1, n) if draw(st.booleans())}
    ops = [op(f"n{j}", "Op", [f"n{i}" for i in range(j) if (i, j) in edges]) for j in range(n)]
    below = {i: a for i, a in enumerate(ancestors(ops).values())}
    buffers = []
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.integers(0, n - 1))
        later = [j for j in range(n) if below[j] >> start & 1]
        if later:
            uses = draw(st.lists(st.sampled_from(later), min_size=1, max_size=3, unique=True))
            buffers.append((start, sum(1 << u for u in uses)))
    return ops, below, buffers


def _orders(ops, below):
    n = len(ops)

    def extend(done, order):
        if len(order) == n:
            yield order
            return
        for j in range(n):
            if not done >> j & 1 and below[j] & ~done == 0:
                yield from extend(done | 1 << j, order + [j])

    yield from extend(0, [])


@settings(max_examples=150, deadline=None)
@given(dags_with_buffers())
def test_max_live_is_the_most_live_in_any_order(case):
    ops, below, buffers = case
    starts, uses = [b[0] for b in buffers], [b[1] for b in buffers]
    brute = 0
    for order in _orders(ops, below):
        done = 0
        for j in order:
            done |= 1 << j
            live = sum(1 for s, u in zip(starts, uses) if done >> s & 1 and u & ~done)
            brute = max(brute, live)
    got, witness = max_live(starts, uses, below)
    assert got == brute
    assert len(witness) == got


def test_ancestors_reject_cycles_and_unknown_inputs():
    with pytest.raises(ValueError, match="cycle"):
        ancestors([op("a", "Op", ["b"]), op("b", "Op", ["a"])])
    with pytest.raises(ValueError, match="ghost"):
        ancestors([op("a", "Op", ["ghost"])])
    assert ancestors([op("a", "Op"), op("b", "Op", [], ["a"]), op("c", "Op", ["b"])]) == {"a": 0, "b": 1, "c": 3}


# ---- the prefetch check on torchair-shaped graphs ----------------------------------------------------
def layer_sharded(layers, k, *, hints=True, late=0, stream="prefetch", n=2, dp=2):
    """One decode step as torchair converts it: carried buffers for layers 0..k-1, then per layer i the
    broadcasts of layer i + k (Fill -> Identity(^x_i) -> HcomBroadcast -> wait Identity) and the layer's
    matmuls on its n series weights; the last k layers' buffers go to the output. ``late`` makes each
    broadcast wait ``late`` layers more (fewer, if negative) than it should; ``hints=False`` drops the
    stream and the edges."""
    ops = [op("tokens", "Data"), op("x0", "Add", ["tokens"])]
    weight = {}
    for j in range(k):
        for s in range(n):
            ops += [op(f"carry{j}_{s}", "Data"), op(f"cw{j}_{s}", "Identity", [f"carry{j}_{s}"], out_fx=WAIT)]
            weight[j, s] = f"cw{j}_{s}"
    xs = ["x0"]
    for i in range(layers):
        j = i + k
        for s in range(n):
            after = f"x{min(layers, max(0, i + late))}"
            ops += [
                op(f"empty{j}_{s}", "Fill", stream=stream if hints else None),
                op(f"edge{j}_{s}", "Identity", [f"empty{j}_{s}"], [after] if hints else [], stream if hints else None),
                op(
                    f"bcast{j}_{s}",
                    "HcomBroadcast",
                    [f"edge{j}_{s}"],
                    stream=stream if hints else None,
                    attrs={"group": "tag=ptd:0;rank_list=0,1", "root_rank": j % layers % dp},
                ),
                op(f"w{j}_{s}", "Identity", [f"bcast{j}_{s}"], out_fx=WAIT),
            ]
            weight[j, s] = f"w{j}_{s}"
        mms = [f"mm{i}_{s}" for s in range(n)]
        ops += [op(mms[s], "MatMul", [xs[-1], weight[i, s]]) for s in range(n)]
        ops.append(op(f"x{i + 1}", "Add", [xs[-1], *mms]))
        xs.append(f"x{i + 1}")
    ops.append(op("out", "NetOutput", [xs[-1]] + [weight[j, s] for j in range(layers, layers + k) for s in range(n)]))
    return ops


@pytest.mark.parametrize("layers,k", [(2, 0), (4, 0), (4, 1), (4, 2), (6, 3)])
def test_hinted_graphs_keep_k_plus_one_buffers(layers, k):
    found = prefetch_order(layer_sharded(layers, k), k=k, num_layers=layers, series=["a", "b"], axis_size=2)
    assert found["ok"], found["problems"]
    assert found["max_live_per_series"] == [k + 1, k + 1] and found["max_live"] == 2 * (k + 1)
    assert [r["waits_for_layer"] for r in found["broadcasts"][::2]] == [
        j - k - 1 if j - k - 1 >= 0 else None for j in range(k, layers + k)
    ]


@pytest.mark.parametrize("layers,k", [(4, 1), (4, 2)])
def test_without_hints_every_bound_is_broken(layers, k):
    found = prefetch_order(
        layer_sharded(layers, k, hints=False), k=k, num_layers=layers, series=["a", "b"], axis_size=2
    )
    assert not found["ok"]
    assert found["max_live_per_series"] == [layers + k] * 2  # every broadcast hoistable
    assert any("stream None" in p for p in found["problems"])
    assert any("can be live at once" in p for p in found["problems"])


def test_a_broadcast_made_to_wait_too_long_is_named():
    found = prefetch_order(layer_sharded(4, 2, late=1), k=2, num_layers=4, series=["a", "b"], axis_size=2)
    assert not found["ok"]
    assert any("bcast4_0 (layer 4) must wait for the uses of layer 2, expected 1" in p for p in found["problems"])
    assert found["max_live_per_series"] == [2, 2]  # fewer buffers, less overlap: k = 2 in name only


def test_a_broadcast_issued_too_early_breaks_the_memory_bound():
    found = prefetch_order(layer_sharded(4, 1, late=-1), k=1, num_layers=4, series=["a", "b"], axis_size=2)
    assert not found["ok"]
    assert found["max_live_per_series"] == [3, 3]
    assert any("can be live at once, bound 2 (4)" in p for p in found["problems"])


def test_a_broadcast_on_the_compute_stream_or_from_the_wrong_root_is_named():
    ops = layer_sharded(4, 1, stream="compute")
    found = prefetch_order(ops, k=1, num_layers=4, series=["a", "b"], axis_size=2)
    assert any("runs on stream 'compute', not 'prefetch'" in p for p in found["problems"])
    found = prefetch_order(layer_sharded(4, 1, dp=1), k=1, num_layers=4, series=["a", "b"], axis_size=2)
    assert any("broadcasts from 0" in p for p in found["problems"])


def test_a_graph_with_other_buffers_than_expected_is_refused():
    found = prefetch_order(layer_sharded(4, 1), k=2, num_layers=4, series=["a", "b"], axis_size=2)
    assert not found["ok"] and "expected 4 carried buffers and 8 broadcasts, found 2 and 8" in found["problems"][0]


def test_hcom_schedule_and_census():
    ops = layer_sharded(2, 1)
    assert group_ranks("tag=ptd:3;rank_list=0,2,4") == [0, 2, 4]
    schedule = hcom_schedule(ops, {(0, 1): "dp"})
    assert len(schedule) == 4 and schedule[0] == {
        "op": "HcomBroadcast",
        "axis": "dp",
        "ranks": [0, 1],
        "bytes": 64,
        "root": 1,
        "stream": "prefetch",
    }
    assert census(ops)["HcomBroadcast"] == 4
    assert list(itertools.islice(census(ops), 2)) == ["Add", "Data"]  # sorted by type
