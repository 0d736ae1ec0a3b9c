"""Whether layer sharding saves memory: ``ring_memory``'s figures against the real tensors a rank loads (its series
and a ring made by ``new_ring``) and the same series loaded replicated; the one warning on load or compile when it
does not save, none when it does; the change it suggests saves when placed and loaded."""

import dataclasses
import re
import warnings

import pytest

from functional_npu import Mesh, Plan, compile_model, load_checkpoint, place, save_checkpoint
from functional_npu.models import llama
from functional_npu.parallel import coalesced as prefetch_groups
from functional_npu.parallel import new_ring
from functional_npu.placement import RingMemoryWarning, ring_memory

from ..support.configs import DENSE

O_DOWN = "o_proj,down_proj"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny dense model's checkpoint per layer count, made when first asked for."""
    made = {}

    def ckpt(layers):
        if layers not in made:
            cfg = dataclasses.replace(DENSE, num_layers=layers)
            made[layers] = save_checkpoint(llama.init_params(cfg, seed=layers), tmp_path_factory.mktemp(f"l{layers}"))
        return made[layers]

    return ckpt


def _counted(path, axes, plan):
    """Every rank's (bytes of the series it holds: the stacked owned layers it loads plus a ring of k + 1 slots as
    the compiled model allocates it; bytes of the same series loaded with no layer sharding), from real tensors."""
    mesh = Mesh.abstract(axes)
    rows = []
    for r in range(mesh.size):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RingMemoryWarning)
            params = load_checkpoint(path, mesh.at(r), plan)
        resolved = params.placement.plan
        ring = new_ring(params, mesh.at(r), resolved, resolved.prefetch_step)
        held = sum(x.nbytes for x in params["series"].values()) + sum(t.nbytes for t in ring)
        full = load_checkpoint(path, mesh.at(r), dataclasses.replace(plan, layer_shard=None))
        leaves = resolved.layer_shard.leaves
        rows.append((held, sum(layer[leaf].nbytes for layer in full["layers"] for leaf in leaves)))
    return rows


def _load_and_compile(path, axes, plan):
    """The RingMemoryWarnings of loading rank 0 and compiling it (the plain forward), and the compiled model."""
    mesh = Mesh.abstract(axes, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = compile_model(load_checkpoint(path, mesh, plan), mesh, backend="none")
    return [str(w.message) for w in caught if issubclass(w.category, RingMemoryWarning)], model


CASES = [  # (layers, series, prefetch step, axes)
    (4, O_DOWN, 1, {"dp": 2, "tp": 1}),  # 2 owned + 2 slots = 4 layers: 100%
    (5, "layer", 2, {"dp": 2, "tp": 1}),  # rank 0: 3 owned + 3 slots = 6 of 5 layers: 120%
    (6, O_DOWN, 1, {"dp": 2, "tp": 1}),  # 3 owned + 2 slots = 5 of 6: saves
    (5, "layer", 1, {"dp": 2, "tp": 2}),  # tp shards counted on every rank
    (4, "o_proj", 0, {"dp": 4, "tp": 1}),  # 1 owned + 1 slot of 4
    (4, O_DOWN, 1, {"dp": 1, "tp": 2}),  # one rank on the axis: every layer local, no ring
]


@pytest.mark.parametrize("layers, series, k, axes", CASES)
def test_the_figures_are_the_worst_ranks_real_tensors(ckpts, layers, series, k, axes):
    plan = Plan(layer_shard=series, prefetch_step=k)
    rows = _counted(ckpts(layers), axes, plan)
    found = ring_memory(place(dataclasses.replace(DENSE, num_layers=layers), axes, plan))
    worst = max(range(len(rows)), key=lambda r: rows[r][0] / rows[r][1])
    assert (found.rank, found.held, found.replicated) == (worst, *rows[worst])
    assert found.saves == (rows[worst][0] < rows[worst][1]) and (found.change is None) == found.saves


@pytest.mark.parametrize(
    "layers, series, share, change",
    [
        (4, O_DOWN, "100%", "the smallest change that saves: 4 ranks on mesh axis 'dp'"),
        (5, "layer", "120%", "the smallest change that saves: 5 ranks on mesh axis 'dp'"),
    ],
)
def test_a_plan_that_saves_nothing_warns_once_on_load_not_again_on_compile(ckpts, layers, series, share, change):
    k = 1 if series == O_DOWN else 2
    axes, plan = {"dp": 2, "tp": 1}, Plan(layer_shard=series, prefetch_step=k)
    held, replicated = _counted(ckpts(layers), axes, plan)[0]
    assert held >= replicated  # rank 0 holds at least the replicated series
    caught, _ = _load_and_compile(ckpts(layers), axes, plan)
    assert len(caught) == 1 and "\n" not in caught[0], caught
    assert caught[0].startswith("load_checkpoint: layer_shard ") and f"prefetch_step {k} saves no memory" in caught[0]
    assert f"rank 0 holds {held} bytes" in caught[0] and f"against {replicated} bytes replicated ({share})" in caught[0]
    assert f"{held / replicated:.0%}" == share and "mesh axis 'dp' of size 2" in caught[0] and change in caught[0]


def test_a_plan_that_saves_does_not_warn(ckpts):
    axes, plan = {"dp": 2, "tp": 1}, Plan(layer_shard=O_DOWN, prefetch_step=1)
    held, replicated = _counted(ckpts(6), axes, plan)[0]
    assert held < replicated
    caught, model = _load_and_compile(ckpts(6), axes, plan)
    assert caught == [] and ring_memory(model.placement).saves


def _changed(found, axes, plan):
    """(axes, plan) under the change ``found`` names."""
    if m := re.search(r"saves: (\d+) ranks on mesh axis '(\w+)'", found.change):
        return axes | {m[2]: int(m[1])}, plan
    if m := re.search(r"saves: prefetch_step (\d+) ", found.change):
        return axes, dataclasses.replace(plan, prefetch_step=int(m[1]))
    m = re.search(r"saves: layer_shard '(\w+)'", found.change)
    return axes, dataclasses.replace(plan, layer_shard=m[1])


@pytest.mark.parametrize(
    "layers, series, k, axes",
    [
        (4, O_DOWN, 1, {"dp": 2, "tp": 1}),
        (5, "layer", 2, {"dp": 2, "tp": 1}),
        (4, O_DOWN, 1, {"dp": 1, "tp": 2}),
        (8, "o_proj", 7, {"dp": 8, "tp": 1}),  # no more ranks helps (1 owned + 8 slots): a smaller k does
    ],
)
def test_the_suggested_change_saves_when_loaded(ckpts, layers, series, k, axes):
    plan = Plan(layer_shard=series, prefetch_step=k)
    found = ring_memory(place(dataclasses.replace(DENSE, num_layers=layers), axes, plan))
    assert not found.saves
    new_axes, new_plan = _changed(found, axes, plan)
    rows = _counted(ckpts(layers), new_axes, new_plan)
    assert all(held < replicated for held, replicated in rows), (found.change, rows)
    held, replicated = max(rows, key=lambda row: row[0] / row[1])
    assert f"would hold {held} of {replicated} bytes" in found.change


def test_when_no_single_change_saves_it_says_so(ckpts):
    """3 layers over 2 ranks, k 2: 2 owned + 3 slots; over 3 ranks 1 + 3, k 1: 2 + 2, k 0: 2 + 1 = 3 of 3."""
    axes, plan = {"dp": 2, "tp": 1}, Plan(layer_shard="layer", prefetch_step=2)
    found = ring_memory(place(dataclasses.replace(DENSE, num_layers=3), axes, plan))
    assert "no single change saves" in found.change and "layer_shard=None" in found.change
    for other_axes, other in [({"dp": 3, "tp": 1}, plan), (axes, dataclasses.replace(plan, prefetch_step=0))]:
        assert all(held >= replicated for held, replicated in _counted(ckpts(3), other_axes, other)[:1])


def test_prefetch_step_auto_is_counted_where_compile_model_resolves_it(ckpts):
    axes, plan = {"dp": 2, "tp": 1}, Plan(layer_shard=O_DOWN, prefetch_step="auto")
    placed = place(dataclasses.replace(DENSE, num_layers=4), axes, plan)
    with pytest.raises(ValueError, match=r"prefetch_step 'auto'; .* pass step=k"):
        ring_memory(placed)
    caught, model = _load_and_compile(ckpts(4), axes, plan)  # the loader cannot count it: compile_model does
    k = model.plan.prefetch_step
    found = ring_memory(placed, step=k)
    assert found == ring_memory(model.placement) and found.step == k
    assert caught == ([] if found.saves else [found.message("compile_model")])


def test_a_plan_with_no_layer_sharding_has_no_figures():
    assert ring_memory(place(DENSE, {"dp": 2, "tp": 1}, Plan())) is None


@pytest.mark.parametrize("layers, k, warns", [(3, 2, True), (3, 1, False), (4, 3, True), (1, 0, True)])
def test_a_host_ring_that_holds_every_layer_warns_on_load(ckpts, layers, k, warns):
    """Series kept in host memory save device memory only while their ring of k + 1 slots is shorter than the
    model: at k = L - 1 the device holds every layer (vLLM 54975's 3 modules at prefetch 2 among them)."""
    mesh = Mesh.abstract({"tp": 1}, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params = load_checkpoint(ckpts(layers), mesh, Plan(offload=O_DOWN, prefetch_step=k))
    said = [str(w.message) for w in caught if issubclass(w.category, RingMemoryWarning)]
    ring = len(new_ring(params, mesh, params.placement.plan, k)) // len(prefetch_groups(params))
    assert (ring >= layers) == warns  # the ring the compiled model allocates, counted in slots
    if not warns:
        assert said == []
        return
    fix = f"use prefetch_step {layers - 2} or less" if layers > 1 else "keep the series on the device"
    assert len(said) == 1 and said[0].startswith(
        f"load_checkpoint: offload o_proj,down with prefetch_step {k} over {layers} layers keeps a ring of "
        f"{k + 1} slots on the device, every layer of the series: keeping them in host memory saves no device memory; "
        f"{fix}"
    )
