"""Megatron training layouts: checked against Megatron's conventions written out independently here,
the name table round trip, and parity: a tiny transformers Qwen3 model in Megatron TP=2 x PP=2
(virtual pipeline chunks) layout on 4 gloo ranks, resharded to tp=2, tp=1 and layer-sharded
inference layouts, generates the same greedy tokens as transformers."""

import pytest
import torch
import transformers as T

from functional_npu import Mesh, shard
from functional_npu.interop.megatron import (
    from_megatron,
    megatron_pipeline_specs,
    pipeline_dim,
    stack_layers,
    stacked_specs,
    to_megatron,
    unstack_layers,
)
from functional_npu.models import family_of
from functional_npu.models.llama import LlamaConfig, init_params, param_specs

from ..support.hf_models import COMMON, hf_greedy
from ..support.reshard_workers import megatron_parity

CFG = LlamaConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    qk_norm=True,
)
NEW = 12


def _megatron_rank(params, cfg, tp, pp, vpp, t, p):
    """Megatron-Core's per-rank tensors, written from its conventions (not from layouts)."""
    h, k, hd, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    per_chunk = cfg.num_layers // (vpp * pp)
    chunks = []
    for v in range(vpp):
        sd = {}
        for j in range(per_chunk):
            layer = params["layers"][
                v * cfg.num_layers // vpp + p * per_chunk + j
            ]  # the interleaved schedule's numbering
            q, kk, vv = layer["qkv"].split([h * hd, k * hd, k * hd])
            grouped = torch.cat([q.view(k, h // k * hd, -1), kk.view(k, hd, -1), vv.view(k, hd, -1)], dim=1).reshape(
                -1, cfg.hidden_size
            )
            gate, up = layer["gate_up"].split([f, f])
            sd[f"decoder.layers.{j}.self_attention.linear_qkv.weight"] = grouped.chunk(tp)[t]
            sd[f"decoder.layers.{j}.mlp.linear_fc1.weight"] = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
            sd[f"decoder.layers.{j}.mlp.linear_fc2.weight"] = layer["down"].chunk(tp, dim=1)[t]
        chunks.append(sd)
    if p == 0:
        chunks[0]["embedding.word_embeddings.weight"] = params["embed"].chunk(tp)[t]
    if p == pp - 1:
        chunks[-1]["output_layer.weight"] = params["lm_head"].chunk(tp)[t]
    return chunks


@pytest.mark.parametrize("tp,pp,vpp", [(2, 1, 1), (2, 2, 2), (1, 4, 2), (2, 2, 1)])
def test_layout_matches_megatron_conventions(tp, pp, vpp):
    params = init_params(CFG, seed=1)
    stacked = stack_layers(params)
    specs = megatron_pipeline_specs(CFG, pp=pp, vpp=vpp)
    mesh = Mesh.abstract({"pp": pp, "tp": tp})
    for p in range(pp):
        for t in range(tp):
            local = shard(stacked, specs, mesh, coordinate={"pp": p, "tp": t})
            ours = to_megatron(local, vpp)
            ref = _megatron_rank(params, CFG, tp, pp, vpp, t, p)
            for v in range(vpp):
                for name, x in ref[v].items():
                    assert torch.equal(ours[v][name], x), (p, t, v, name)
            back = from_megatron(ours, CFG, specs, mesh.at({"pp": p, "tp": t}))
            assert all(torch.equal(back["layers"][n], local["layers"][n]) for n in local["layers"])
            assert back["embed"].shape[0] == (p == 0) and back["lm_head"].shape[0] == (p == pp - 1)


def test_pipeline_dim_is_vpp_blocks_over_pp():
    dim = pipeline_dim(8, "pp", vpp=2)
    assert repr(dim) == "shard(pp [chunk0:4|chunk1:4])"
    with pytest.raises(ValueError, match=r"8 layers cannot be cut into vpp=3 virtual chunks"):
        pipeline_dim(8, "pp", vpp=3)


def test_name_table_covers_every_leaf_and_stacking_round_trips():
    params = init_params(CFG, seed=2)
    ours = {v.split(".")[-1] for v in family_of(CFG).megatron.names.values()}
    assert ours >= set(params["layers"][0]) | {k for k in params if k not in ("config", "layers")}
    back = unstack_layers(stack_layers(params))
    assert all(
        torch.equal(back["layers"][i][k], params["layers"][i][k])
        for i in range(CFG.num_layers)
        for k in params["layers"][0]
    )
    assert torch.equal(back["embed"], params["embed"]) and back.config == CFG
    specs = stacked_specs(param_specs(CFG))
    assert specs["layers"]["qkv"].dims[0] is None and specs["embed"].dims == (None, param_specs(CFG)["embed"].dims[0])


def test_from_megatron_errors_name_the_parameter():
    mesh = Mesh.abstract({"pp": 1, "tp": 2}, 0)
    specs = megatron_pipeline_specs(CFG, pp=1)
    with pytest.raises(
        ValueError,
        match=r"no entry for Megatron parameter 'decoder.layers.0.mlp.linear_fc3.weight' in the family's Megatron",
    ):
        from_megatron([{"decoder.layers.0.mlp.linear_fc3.weight": torch.zeros(1)}], CFG, specs, mesh)
    with pytest.raises(
        ValueError, match=r"'embed' needs 1 local entries on rank 0 \{'pp': 0, 'tp': 0\} but the state dicts hold 0"
    ):
        from_megatron([{}], CFG, specs, mesh)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_4l")
    torch.manual_seed(7)
    model = T.Qwen3ForCausalLM(
        T.Qwen3Config(**(COMMON | {"num_hidden_layers": 4}), num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    ).eval()
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 11)]
    return str(path), prompts, [hf_greedy(model, p, NEW) for p in prompts]


def test_megatron_tp2_pp2_vpp2_resharded_generates_transformers_tokens(world4, tiny_qwen3):
    path, prompts, ref = tiny_qwen3
    for rank, result in enumerate(world4.run(megatron_parity, path, prompts, NEW, 2)):
        for target, (tokens, equal, received, allgather) in result.items():
            assert equal, (rank, target)
            assert tokens == ref, (rank, target)
            assert received < allgather or target == "tp1", (rank, target, received, allgather)


def test_stacking_errors_name_the_leaf():
    params = init_params(CFG, seed=3)
    ragged = params | {"layers": [params["layers"][0], {k: v for k, v in params["layers"][1].items() if k != "down"}]}
    with pytest.raises(ValueError, match=r"stack_layers: layer 1 has leaves .* but layer 0 has"):
        stack_layers(ragged)
    stage = stack_layers(params) | {"embed": torch.zeros(0, 64, 16)}
    with pytest.raises(
        ValueError,
        match=r"unstack_layers: 'embed' has leading dim \(0,\), expected \(1,\); "
        r"is this a pipeline stage that does not hold it\?",
    ):
        unstack_layers(stage)
    specs = param_specs(CFG)
    with pytest.raises(ValueError, match=r"stacked_specs: every layer must have the same specs"):
        stacked_specs(specs | {"layers": [specs["layers"][0], {}]})


def test_from_megatron_wrong_shape_names_the_leaf():
    mesh = Mesh.abstract({"pp": 1, "tp": 2}, 0)
    specs = megatron_pipeline_specs(CFG, pp=1)
    chunks = to_megatron(shard(stack_layers(init_params(CFG, seed=4)), specs, mesh), 1)
    chunks[0]["decoder.layers.0.mlp.linear_fc2.weight"] = torch.zeros(16, 24)  # a tp=1 shard in a tp=2 run
    with pytest.raises(
        ValueError,
        match=r"from_megatron: 'decoder.layers.0.mlp.linear_fc2.weight' \('layers.down'\) is \(16, 24\) on rank 0 "
        r"but its layout gives \(16, 12\) per entry",
    ):
        from_megatron(chunks, CFG, specs, mesh)


def test_cyclic_offset_must_be_an_int():
    from functional_npu import cyclic

    with pytest.raises(ValueError, match=r"cyclic offset must be an int \(the coordinate holding layer 0\), got 0.5"):
        shard(torch.zeros(2), cyclic(0, "pp", 2, offset=0.5), Mesh.abstract({"pp": 2}), coordinate=0)
