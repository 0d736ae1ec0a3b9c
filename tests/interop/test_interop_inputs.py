"""The interop faces refuse a hostile argument in one line naming the function, the argument, the bad value and a fix:
Megatron's stacking, pipeline specs and state dicts (to_megatron), and the DTensor conversions. Tiny llama, one
process, nothing compiled."""

import re

import pytest
import torch

from functional_npu import Mesh, replicated, shard, sharded
from functional_npu.interop import (
    layout_from_dtensor,
    megatron_pipeline_specs,
    mesh_from_device_mesh,
    placements_of,
    stack_layers,
    to_dtensor,
    to_megatron,
    unstack_layers,
)
from functional_npu.interop.megatron import pipeline_dim
from functional_npu.models.llama import init_params

from ..support.configs import TINY as CFG

PARAMS = init_params(CFG, seed=0)
MESH = Mesh.abstract({"tp": 1}, 0)
LOCAL = shard(stack_layers(PARAMS), megatron_pipeline_specs(CFG, pp=1), Mesh.abstract({"pp": 1, "tp": 1}, 0))

STAGE = "to_megatron: this stage's 2 layers cannot be cut into vpp={} virtual chunks; use a vpp that divides 2 (the "
STAGE += "vpp its layout was made with: megatron_pipeline_specs(cfg, pp=..., vpp=...))"
UNSTACKED = "params['layers'] must be stacked, a dict of [num_layers, ...] leaves, got a list of 2 entries; stack the "
UNSTACKED += "params first: stack_layers(params)"
STACK = "stack_layers: params['layers'] must be a list of per-layer dicts (the unstacked form init_params and "
STACK += "load_checkpoint give), got {}; a dict of stacked leaves is stacked already"
PP_VPP = "megatron_pipeline_specs: 2 layers cannot be cut into vpp={} chunks over pp={} stages (every stage holds "
PP_VPP += "num_layers / (pp * vpp) layers of each chunk); use a pp * vpp that divides 2"
AXIS = "{}: tensor's layout Layout(dim0=shard(zz)) names mesh axis 'zz', which the mesh {{'tp': 1}} does not have; "
AXIS += "use one of its axes ['tp'] or a mesh with that axis"

REFUSED = [
    # row 4: a vpp that does not divide the stage's layers (every layer was dropped), or is no int >= 1
    (lambda: to_megatron(LOCAL, 3), ValueError, STAGE.format(3)),
    (lambda: to_megatron(LOCAL, vpp=0), ValueError, "to_megatron: vpp must be an int >= 1, got 0"),
    (lambda: to_megatron(LOCAL, vpp=-1), ValueError, "to_megatron: vpp must be an int >= 1, got -1"),
    (lambda: to_megatron(LOCAL, vpp="2"), TypeError, "to_megatron: vpp must be an int >= 1, got str '2'"),
    # row 38: params that are not stacked, or carry no config
    (lambda: to_megatron(PARAMS), ValueError, "to_megatron: " + UNSTACKED),
    (
        lambda: to_megatron(dict(LOCAL.items())),
        TypeError,
        "to_megatron: local must be a functional_npu.Params with its model config (from_megatron's, or "
        "shard(stack_layers(params), specs, mesh)), got dict",
    ),
    # also seen: stacking and the pipeline specs
    (lambda: stack_layers({}), ValueError, STACK.format("params with no 'layers'")),
    (lambda: stack_layers(None), ValueError, STACK.format("params of type NoneType")),
    (lambda: stack_layers(LOCAL), ValueError, STACK.format("a dict of 6 entries")),
    (
        lambda: unstack_layers({"layers": {"qkv": torch.tensor(1.0)}}),
        ValueError,
        "unstack_layers: params['layers']['qkv'] is (); a stacked layer leaf is a tensor [num_layers, ...] "
        "(stack_layers' form)",
    ),
    (lambda: unstack_layers(PARAMS), ValueError, "unstack_layers: " + UNSTACKED),
    (lambda: megatron_pipeline_specs(CFG, pp=0), ValueError, "megatron_pipeline_specs: pp must be an int >= 1, got 0"),
    (
        lambda: megatron_pipeline_specs(CFG, pp=-2),
        ValueError,
        "megatron_pipeline_specs: pp must be an int >= 1, got -2",
    ),
    (lambda: megatron_pipeline_specs(CFG, pp=2**70), ValueError, PP_VPP.format(1, 2**70)),
    (lambda: megatron_pipeline_specs(CFG, pp=2, vpp=2), ValueError, PP_VPP.format(2, 2)),
    (
        lambda: megatron_pipeline_specs(CFG, pp="2"),
        TypeError,
        "megatron_pipeline_specs: pp must be an int >= 1, got str '2'",
    ),
    (
        lambda: megatron_pipeline_specs(CFG, vpp=0),
        ValueError,
        "megatron_pipeline_specs: vpp must be an int >= 1, got 0",
    ),
    (lambda: pipeline_dim(8, "pp", vpp=0), ValueError, "pipeline_dim: vpp must be an int >= 1, got 0"),
    (
        lambda: pipeline_dim(8, "pp", vpp=3),
        ValueError,
        "pipeline_dim: 8 layers cannot be cut into vpp=3 virtual chunks; use a vpp that divides 8",
    ),
    # row 39: the DTensor conversions
    (lambda: placements_of(sharded(0, "zz"), MESH), ValueError, AXIS.format("placements_of")),
    (lambda: to_dtensor(torch.ones(2), sharded(0, "zz"), MESH), ValueError, AXIS.format("to_dtensor")),
    (
        lambda: placements_of(None, MESH),
        TypeError,
        "placements_of: layout must be a functional_npu.Layout (sharded(0, 'tp'), replicated(), ...), got NoneType",
    ),
    (
        lambda: placements_of(sharded(0, "tp"), {"tp": 1}),
        TypeError,
        "placements_of: mesh must be a functional_npu.Mesh (Mesh.abstract({'tp': 2}, 0), make_mesh(...)), got dict",
    ),
    (
        lambda: mesh_from_device_mesh(None),
        TypeError,
        "mesh_from_device_mesh: device_mesh must be a torch DeviceMesh (init_device_mesh(device_type, shape, "
        "mesh_dim_names=...)), got NoneType",
    ),
    (
        lambda: layout_from_dtensor(torch.ones(2)),
        TypeError,
        "layout_from_dtensor: tensor is a Tensor, not a DTensor; a plain tensor has no placement (place it with "
        "distribute_tensor or DTensor.from_local)",
    ),
    (
        lambda: to_dtensor(None, replicated(), MESH),
        TypeError,
        "to_dtensor: local must be this rank's shard as a torch.Tensor, got NoneType; pass the tensor shard(...) "
        "gives this rank",
    ),
]


@pytest.mark.parametrize("call, error, message", REFUSED, ids=range(len(REFUSED)))
def test_a_hostile_argument_is_refused_in_one_line(call, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        call()


@pytest.mark.parametrize("vpp", [1, 2])
def test_to_megatron_of_a_dividing_vpp_is_as_before(vpp):
    """Every leaf once: layer ``v * per + j`` as chunk ``v``'s layer ``j``; the embedding on chunk 0, the final norm
    and output layer on the last."""
    chunks = to_megatron(LOCAL, vpp)
    assert len(chunks) == vpp and sum(map(len, chunks)) == 3 + 6 * CFG.num_layers
    per = CFG.num_layers // vpp
    got = chunks[vpp - 1]["decoder.layers.0.mlp.linear_fc2.weight"]
    assert torch.equal(got, LOCAL["layers"]["down"][(vpp - 1) * per])
    assert torch.equal(chunks[0]["embedding.word_embeddings.weight"], LOCAL["embed"][0])
    assert torch.equal(chunks[-1]["output_layer.weight"], LOCAL["lm_head"][0])


def test_placements_of_a_known_axis_is_as_before():
    from torch.distributed.tensor import Replicate, Shard

    assert placements_of(sharded(0, "tp"), MESH) == (Shard(0),)
    assert placements_of(replicated(), MESH) == (Replicate(),)
