"""The prefetch ring filled from host memory (``Plan.offload``): each layer reads its own weights, the ring is the same
``k + 1`` slots on every step, and every slot access is ordered, whatever L and k, with host and layer-sharded series
side by side. Values are checked against the host tensors themselves (each layer's weights are its index, so a slot
holding another layer shows), and the order by the hazard check over a recorded run; vLLM's issue 54975 (3 modules,
prefetch 2) is reproduced without the ring's phase and fixed with it. Then loading, tokens against the resident model,
and the bad inputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_npu import Mesh, Plan, compile_model, flatten_with_paths, load_checkpoint
from functional_npu.checks import Recorder, check
from functional_npu.parallel import EmulatedHostLink, prefetch
from functional_npu.parallel.layer_shard import LayerShard
from functional_npu.parallel.offload import check_host_backend, check_host_memory, host_bytes
from functional_npu.parallel.prefetch_ring import RingPhase, coalesced, ring_of

from ..support.delivery import Deliveries, DropWrite, assert_every_write_delivered, ring_reference
from ..support.hf_models import save_tiny
from ..support.offload_workers import resharded_into_host_memory

ONE = Mesh.abstract({"tp": 1}, 0)


def _params(L: int, host: int, peer: int = 0) -> dict:
    """``host`` series kept in host memory and ``peer`` layer-sharded ones over an axis of one rank (every layer
    local, written into the ring by a broadcast of one), float32 and bfloat16; layer ``l``'s every element is ``l``."""
    dtypes = (torch.float32, torch.bfloat16)

    def stacked(j: int) -> torch.Tensor:
        return torch.arange(L, dtype=dtypes[j % 2]).view(L, 1, 1).expand(L, 2 + j, 3).contiguous()

    params = {"layers": [{"norm": torch.ones(3)} for _ in range(L)], "host": {f"h{j}": stacked(j) for j in range(host)}}
    if peer:
        params["series"] = {f"p{j}": stacked(j) for j in range(peer)}
    return params


def _plan(params: dict) -> Plan:
    ls = LayerShard("dp", tuple(params["series"])) if "series" in params else None
    return Plan(layer_shard=ls, offload=tuple(params["host"]))


_MESH = Mesh.abstract({"dp": 1, "tp": 1}, 0)


def _steps(params: dict, k: int, steps: int, turn: bool = True) -> tuple[list[list[int]], list, list]:
    """Run ``steps`` decode steps' layer loops for real; per step, the layer each layer's weights came from (every
    element of every leaf must say the same layer, else -1). ``turn=False``: each step from phase 0."""
    plan = _plan(params)
    layout = ring_of(params, _MESH, plan, k)
    ring = prefetch.start(params, _MESH, layout)
    first = list(ring)
    phase, seen = RingPhase(), []
    for _ in range(steps):
        phase = phase if turn else RingPhase()
        weights = prefetch.layer_weights(params, ring, _MESH, plan, ring=layout, phase=phase)
        x, got = torch.zeros(()), []
        for i in range(len(params["layers"])):
            layer = weights(i, x)
            values = {float(v) for leaf in layer if leaf != "norm" for v in layer[leaf].float().unique()}
            got.append(int(values.pop()) if len(values) == 1 else -1)
            x = x + 1
        seen.append(got)
    return seen, ring, first


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 24), data=st.data(), host=st.integers(1, 3), peer=st.integers(0, 2))
def test_every_layer_reads_its_own_weights_from_host_memory(L, data, host, peer):
    k = data.draw(st.integers(0, L - 1), label="k")
    params = _params(L, host, peer)
    seen, ring, first = _steps(params, k, steps=3)
    assert seen == [list(range(L))] * 3
    groups = len(coalesced(params))
    assert groups == min(host, 2) + min(peer, 2)  # one group per source and dtype
    assert len(ring) == (k + 1) * groups and all(a is b for a, b in zip(ring, first))  # the same slots every step


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 24), data=st.data(), host=st.integers(1, 3), peer=st.integers(0, 2))
def test_every_host_write_is_ordered(L, data, host, peer):
    """The hazard check over a recorded run of two steps (writes recorded, not run)."""
    k = data.draw(st.integers(0, L - 1), label="k")
    params = _params(L, host, peer)
    plan, groups = _plan(params), len(coalesced(params))
    layout = ring_of(params, _MESH, plan, k)
    ring = layout.new("cpu")
    rec, phase = Recorder(ring), RingPhase()
    with rec:
        prefetch.start(params, _MESH, layout, ring)
        for step in range(2):
            weights = prefetch.layer_weights(params, ring, _MESH, plan, ring=layout, phase=phase)
            x = torch.zeros(())
            for i in range(L):
                rec.layer = step * L + i
                x = x + sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(weights(i, x)))
    program = rec.program(0, groups)
    assert len(program.writes) == (2 * L + k) * groups
    assert check(program, k, slots=(k + 1) * groups) == []


def test_vllm_54975_three_modules_at_prefetch_two():
    """vLLM's issue 54975 (found by diverging tokens on a 910B3): 3 offloaded modules and a prefetch step of 2 that
    does not divide them. Read as two slots (k = 1), slots numbered afresh each step put the next step's first layer
    into a slot still holding this step's last: without the ring's phase the second step reads the wrong layers,
    with it every step reads its own. Read as k = 2 (three slots), the ring's k + 1 divides L and the phase stays 0:
    both numberings read the right layers."""
    params = _params(3, host=2)
    assert _steps(params, 1, steps=3)[0] == [[0, 1, 2]] * 3
    wrong, *_ = _steps(params, 1, steps=3, turn=False)
    assert wrong[0] == [0, 1, 2] and wrong[1] != [0, 1, 2], wrong
    assert _steps(params, 2, steps=3)[0] == _steps(params, 2, steps=3, turn=False)[0] == [[0, 1, 2]] * 3


def test_stacking_into_host_memory_and_back_is_the_identity():
    from functional_npu.parallel import stack_host, unstack_host

    layers = [{"o_proj": torch.full((2, 3), float(i)), "norm": torch.ones(3)} for i in range(4)]
    stacked = stack_host({"layers": layers, "embed": torch.zeros(1)}, ("o_proj",))
    assert stacked["host"]["o_proj"].shape == (4, 2, 3) and "o_proj" not in stacked["layers"][0]
    back = unstack_host(stacked)
    assert "host" not in back and all(torch.equal(a["o_proj"], b["o_proj"]) for a, b in zip(back["layers"], layers))


def test_host_bytes_too_large_for_host_memory_is_one_line_with_both_figures():
    check_host_memory(2**30, "load_checkpoint", available=2**31)
    with pytest.raises(ValueError, match=r"^load_checkpoint: the offloaded series take 2\.00 GiB of host memory, "
                                         r"and 1\.00 GiB is available"):  # fmt: skip
        check_host_memory(2 * 2**30, "load_checkpoint", available=2**30)
    with pytest.raises(ValueError, match=r"take 24\.00 KiB of host memory, and 100 bytes is available"):
        check_host_memory(24 * 2**10, "load_checkpoint", available=100)  # once "0.00 GiB of 0.00 GiB"


# ---- a model: loading, tokens, refusals -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-offload")
    save_tiny("qwen3", path, 31, num_hidden_layers=3)
    return str(path)


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7]]


@pytest.fixture(scope="module")
def resident(qwen3):
    return compile_model(load_checkpoint(qwen3, ONE), ONE, backend="none", batch_sizes=[4], max_seq_len=24)


def _deliveries(qwen3: str, model) -> Deliveries:
    """A :class:`Deliveries` for ``model``'s ring, against the weights of the model loaded with nothing offloaded."""
    layers = [dict(flatten_with_paths(layer)) for layer in load_checkpoint(qwen3, ONE)["layers"]]
    return Deliveries(ring_reference(layers, [g.leaves for g in model.ring.groups]))


@pytest.mark.parametrize("k", [0, 1, 2])
def test_offloaded_model_generates_the_resident_models_tokens(qwen3, resident, k):
    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj,down_proj", prefetch_step=k))
    assert sorted(params["host"]) == ["down", "o_proj"] and "o_proj" not in params["layers"][0]
    assert params["host"]["o_proj"].shape[0] == 3 and host_bytes(params) == sum(
        x.numel() * x.element_size() for x in params["host"].values()
    )
    model = compile_model(params, ONE, backend="none", batch_sizes=[4], max_seq_len=24)
    assert model.plan.prefetch_step == k and len(model.new_state(4).prefetched) == (k + 1)
    with _deliveries(qwen3, model) as seen:
        tokens = model.generate(PROMPTS, 6)
    assert tokens == resident.generate(PROMPTS, 6)
    assert_every_write_delivered(seen.summary(), len(model.ring.groups), 3, host_bytes(params), 6)


def test_a_ring_write_that_does_nothing_keeps_the_tokens_and_fails_the_count(qwen3, resident):
    """3 layers at k = 2: each slot holds the same layer every step, so a write that does nothing (write 4, layer 0
    into slot 0, which already holds it) leaves the resident model's tokens: they cannot show it. The count can: the
    slot is poisoned before each write, and what arrives is compared with the layer's bytes."""
    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj,down_proj", prefetch_step=2))
    model = compile_model(params, ONE, backend="none", batch_sizes=[4], max_seq_len=24)
    assert model.ring.slots == model.ring.num_layers == 3
    with DropWrite(4):
        assert model.generate(PROMPTS, 6) == resident.generate(PROMPTS, 6)
    nbytes = host_bytes(params) // 3 // len(model.ring.groups)
    with DropWrite(4), _deliveries(qwen3, model) as seen:
        model.generate(PROMPTS, 6)
    assert seen.failures[0] == f"ring write 4: nothing arrived in its slot of {nbytes} bytes"


def test_ring_writes_are_counted_through_an_aot_functionalized_graph(qwen3, resident):
    """aot_eager runs each ring write as ``auto_functionalized_v2`` (the op writes a clone of the slot, copied back at
    the graph's end): the count sees the op inside it, every write delivers its layer at k = 1 (two ring phases), and
    a dropped write there is named."""
    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj,down_proj", prefetch_step=1))
    model = compile_model(params, ONE, backend="aot_eager", batch_sizes=[4], max_seq_len=24)
    with _deliveries(qwen3, model) as seen:
        tokens = model.generate(PROMPTS, 6)
    assert tokens == resident.generate(PROMPTS, 6)
    assert_every_write_delivered(seen.summary(), len(model.ring.groups), 3, host_bytes(params), 6)
    nbytes = host_bytes(params) // 3 // len(model.ring.groups)
    with DropWrite(5), _deliveries(qwen3, model) as seen:
        model.generate(PROMPTS, 6)
    assert seen.failures == [f"ring write 5: nothing arrived in its slot of {nbytes} bytes"]


def test_the_ring_is_answered_once_and_a_state_of_another_k_is_refused(qwen3, resident, monkeypatch):
    """The compiled model answers the ring's layout at compile time: an 8-token generate derives nothing from the
    params (no ring_of call; the old step checked the ring against the params on every step), its k is the
    placement's resolved step, and a state whose ring has another k's slots is refused naming both."""
    import functional_npu.parallel.prefetch as prefetch_module

    plan = Plan(offload="o_proj,down_proj", prefetch_step=1)
    model = compile_model(load_checkpoint(qwen3, ONE, plan), ONE, backend="none", batch_sizes=[4], max_seq_len=24)
    assert model.ring.k == model.plan.prefetch_step == 1 and model.ring.slots == 2
    assert model.ring.groups[0].source == "host" and model.ring.groups[0].leaves == ("o_proj", "down")
    calls = []
    real = prefetch_module.ring_of
    monkeypatch.setattr(prefetch_module, "ring_of", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    assert model.generate(PROMPTS, 8) == resident.generate(PROMPTS, 8)
    assert calls == []
    other = compile_model(load_checkpoint(qwen3, ONE, dataclasses.replace(plan, prefetch_step=2)), ONE, backend="none")
    state = other.new_state(4)
    with pytest.raises(ValueError, match=r"decode: a model compiled with prefetch_step=1 needs a state from new_state"):
        model.decode(torch.tensor([1, 2]), torch.tensor([0, 0]), state)


def test_offloaded_model_compiled_with_inductor_on_an_emulated_link(qwen3, resident):
    """L = 3 at k = 2 (3 modules, prefetch 2: vLLM 54975's case) through inductor, each host copy delivered by an
    emulated host link (its completion waited in the graph): the resident model's tokens, one transfer per layer
    and forward."""
    params = load_checkpoint(qwen3, ONE, Plan(offload="layer", prefetch_step=2))
    assert "layers" in params and params["layers"][0] == {}
    with EmulatedHostLink(2e9, 5e-6) as link:
        model = compile_model(params, ONE, backend="inductor", batch_sizes=[4], max_seq_len=24, host_link=link)
        with _deliveries(qwen3, model) as seen:
            tokens = model.generate(PROMPTS, 6)
        assert tokens == resident.generate(PROMPTS, 6)
    assert_every_write_delivered(seen.summary(), len(model.ring.groups), 3, host_bytes(params), 6)
    groups = len(model.new_state(4).prefetched) // 3  # one buffer per dtype of the layer, per slot
    assert link.carried["transfers"] == 6 * 3 * groups  # 1 prefill + 5 decode steps, 3 layers each
    with pytest.raises(ValueError, match=r"host_link is given, and no series is kept in host memory"):
        with EmulatedHostLink(2e9) as other:
            compile_model(load_checkpoint(qwen3, ONE), ONE, backend="none", host_link=other)


def test_reshard_from_a_training_plan_into_host_memory(qwen3, world2):
    """Weight sync into a serving plan that keeps series in host memory, on two gloo ranks: every host layer is the
    checkpoint's tensor-parallel shard of it, and the tokens are the resident serving plan's."""
    for r in world2.run(resharded_into_host_memory, qwen3, PROMPTS, 6):
        assert r["same"] and r["host_device"] == "cpu"
        assert r["offloaded"] == r["resident"]


def test_a_series_both_offloaded_and_layer_sharded_is_refused(qwen3):
    mesh = Mesh.abstract({"dp": 2, "tp": 1}, 0)
    with pytest.raises(ValueError, match=r"series \['o_proj'\] are both layer-sharded \(plan.layer_shard\) and kept "
                                         r"in host memory \(plan.offload\)"):  # fmt: skip
        load_checkpoint(qwen3, mesh, Plan(layer_shard="o_proj,down", offload="o_proj"))
    with pytest.raises(ValueError, match=r"offload: a Qwen3ForCausalLM has no series \['nope'\]"):
        load_checkpoint(qwen3, ONE, Plan(offload="nope"))
    with pytest.raises(ValueError, match=r"Plan.offload: expected series names"):
        Plan(offload="o_proj,1x")


def test_a_backend_that_cannot_copy_from_host_inside_a_step_is_refused():
    params = {"host": {"o_proj": torch.zeros(2, 2, 2)}}
    ge = r"compile_model: series \['o_proj'\] are kept in host memory .* backend 'torchair' cannot copy them into "
    with pytest.raises(ValueError, match=ge + r"the ring within a step: torchair takes"):
        check_host_backend(params, "torchair", "max-autotune", False, "npu", "compile_model")
    with pytest.raises(ValueError, match=r"backend 'torchair' .* torchair's captured mode is not checked"):
        check_host_backend(params, "torchair", "reduce-overhead", True, "npu", "compile_model")
    with pytest.raises(ValueError, match=r"backend 'inductor' .* inductor's CUDA graphs skip"):
        check_host_backend(params, "inductor", "reduce-overhead", True, "cuda", "compile_model")
    check_host_backend(params, "inductor", "default", False, "cuda", "compile_model")
    check_host_backend(params, "inductor", "reduce-overhead", False, "cpu", "compile_model")  # the C++ wrapper
    check_host_backend(params, "npugraph_ex", None, True, "npu", "compile_model")
    check_host_backend({}, "torchair", "max-autotune", False, "npu", "compile_model")  # nothing in host memory


def test_a_gradient_through_host_series_is_refused(qwen3):
    from functional_npu.runtime.training.grad import lm_loss, value_and_grad

    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj"))
    with pytest.raises(ValueError, match=r"^value_and_grad: series \['o_proj'\] are kept in host memory"):
        value_and_grad(lm_loss)(params, torch.tensor([[1, 2, 3, 4]]), ONE)
    from functional_npu.runtime.training import token_logprobs

    # once refused naming an internal function (layer_weights) and a gradient the caller never asked for
    with pytest.raises(ValueError, match=r"^token_logprobs: series \['o_proj'\] are kept in host memory .* \(and "
                       r"so does token_logprobs's differentiable forward\)"):  # fmt: skip
        token_logprobs(params, torch.tensor([[1, 2, 3, 4]]), ONE)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x: x.to("meta"), r"params\['host.o_proj'\] is torch.float32 on meta, the compiled model's weights "
         r"torch.float32 on cpu"),
        (lambda x: x.to(torch.bfloat16), r"params\['host.o_proj'\] is torch.bfloat16 on cpu, the compiled model's "
         r"weights torch.float32 on cpu"),
    ],
    ids=["meta", "bf16 beside fp32"],
)  # fmt: skip
def test_host_series_without_data_or_in_another_dtype_are_refused_by_compile_model(qwen3, change, message):
    """Host series on the meta device once compiled and generated tokens unlike the resident model's on every
    backend; bf16 host series beside fp32 weights failed at generate time with a raw dtype error."""
    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj"))
    params["host"]["o_proj"] = change(params["host"]["o_proj"])
    with pytest.raises(ValueError, match=r"^compile_model: " + message):
        compile_model(params, ONE, backend="none", batch_sizes=[4], max_seq_len=24)


def test_a_model_run_after_its_host_link_closed_is_refused(qwen3, resident):
    """A raw c10d "could not resolve the process group" error once: the graphs name the link's group."""
    params = load_checkpoint(qwen3, ONE, Plan(offload="o_proj", prefetch_step=1))
    with EmulatedHostLink(1e9) as link:
        model = compile_model(params, ONE, backend="none", batch_sizes=[4], max_seq_len=24, host_link=link)
        assert model.generate(PROMPTS[:1], 2) == resident.generate(PROMPTS[:1], 2)
    with pytest.raises(RuntimeError, match=r"compiled with an EmulatedHostLink .* whose with block has ended"):
        model.generate(PROMPTS[:1], 2)


@pytest.mark.parametrize("value", [{"o_proj"}, 3, ["o_proj", 5]])
def test_offload_names_of_the_wrong_type_are_one_line(value):
    """A set once raised Python's "unhashable type"."""
    with pytest.raises(ValueError, match=r"^Plan.offload: expected series names like 'o_proj,down_proj' or 'layer', "):
        Plan(offload=value)


def test_a_ring_budget_beside_host_series_is_kept_or_refused(qwen3):
    """``prefetch_step="auto"`` with a budget and series in host memory alone: once the budget was ignored. A budget
    below one layer of the series is refused before any weight is read; a budget of exactly one layer gives a ring of
    one slot (k = 0), where the cost model alone picks k = 1 here."""
    from functional_npu.placement import place
    from functional_npu.placement.ring_memory import check_ring_budget
    from functional_npu.runtime.loading import read_config

    cfg = read_config(qwen3)
    one = place(cfg, {"tp": 1}, Plan(offload="o_proj,down_proj")).stored[0]["layers"][0]
    layer = sum(one[f].numel() * 4 for f in ("o_proj", "down"))
    refused = place(cfg, {"tp": 1}, Plan(offload="o_proj,down_proj", prefetch_step="auto", prefetch_budget=1))
    with pytest.raises(ValueError, match=rf"^--plan f: prefetch_step='auto': the prefetch ring budget of 1 bytes does "
                       rf"not hold one layer of o_proj,down \({layer} bytes, needed even at k = 0\)"):  # fmt: skip
        check_ring_budget(refused, "--plan f", torch.float32)
    for budget, k in ((None, 1), (layer, 0)):
        plan = Plan(offload="o_proj,down_proj", prefetch_step="auto", prefetch_budget=budget)
        model = compile_model(load_checkpoint(qwen3, ONE, plan), ONE, backend="none", batch_sizes=[4], max_seq_len=24)
        assert model.plan.prefetch_step == k and len(model.new_state(4).prefetched) == k + 1
