"""from_dtensor_state's meshes and refusals, without a world: which common mesh a training mesh and a serving mesh
share, and the one-line errors before any byte moves."""

import pytest
import torch

from functional_npu import Mesh
from functional_npu.runtime.loading.dtensor_state import _common_mesh, from_dtensor_state


class _DeviceMesh:
    """What from_dtensor_state reads of a DeviceMesh: its dim names and its rank grid."""

    def __init__(self, names, sizes, ranks=None):
        self.mesh_dim_names = tuple(names)
        n = int(torch.tensor(sizes).prod())
        self.mesh = (torch.arange(n) if ranks is None else torch.tensor(ranks)).reshape(sizes)


@pytest.mark.parametrize(
    "train, serve, common, runs, train_runs",
    [
        # FSDP2 over the world, served at dp x tp: each serving axis is a run of the one training dim
        (
            {"dp_shard": 4},
            {"dp": 2, "tp": 2},
            {"dp": 2, "tp": 2},
            {"dp": ("dp",), "tp": ("tp",)},
            {"dp_shard": ("dp", "tp")},
        ),
        # FSDP2 + TP on (2, 2) served at tp 4: tp splits into tp, tp_1
        (
            {"dp_shard": 2, "tp": 2},
            {"tp": 4},
            {"tp": 2, "tp_1": 2},
            {"tp": ("tp", "tp_1")},
            {"dp_shard": ("tp",), "tp": ("tp_1",)},
        ),
        # HSDP (2, 2) served at (1, 4): the size-1 axis stays
        (
            {"dp_replicate": 2, "dp_shard": 2},
            {"dp": 1, "tp": 4},
            {"dp": 1, "tp": 2, "tp_1": 2},
            {"dp": ("dp",), "tp": ("tp", "tp_1")},
            {"dp_replicate": ("tp",), "dp_shard": ("tp_1",)},
        ),
        # both cut the other: 2 x 6 under 4 x 3 needs 2 x 2 x 3
        (
            {"a": 2, "b": 6},
            {"dp": 4, "tp": 3},
            {"dp": 2, "dp_1": 2, "tp": 3},
            {"dp": ("dp", "dp_1"), "tp": ("tp",)},
            {"a": ("dp",), "b": ("dp_1", "tp")},
        ),
    ],
)
def test_the_common_mesh_refines_both(train, serve, common, runs, train_runs):
    mesh = Mesh.abstract(serve, 0)
    out, got_runs, got_train = _common_mesh(mesh, _DeviceMesh(train, list(train.values())), "w")
    assert out.shape == common and got_runs == runs and got_train == train_runs


def test_meshes_that_do_not_nest_are_refused_by_name():
    with pytest.raises(
        ValueError,
        match=r"w: training mesh axis 'a' \(size 2\) and serving mesh axis 'dp' \(size 3\) cut the ranks at "
        r"different places: the training mesh \{'a': 2, 'b': 3\} and the mesh \{'dp': 3, 'tp': 2\} do not nest",
    ):
        _common_mesh(Mesh.abstract({"dp": 3, "tp": 2}, 0), _DeviceMesh("ab", [2, 3]), "w")
    with pytest.raises(ValueError, match=r"w: the training mesh \{'dp_shard': 2\} does not hold ranks 0 .. 3"):
        _common_mesh(Mesh.abstract({"tp": 4}, 0), _DeviceMesh(["dp_shard"], [2]), "w")
    with pytest.raises(ValueError, match=r"does not hold ranks 0 .. 3 in row-major order"):
        _common_mesh(Mesh.abstract({"tp": 4}, 0), _DeviceMesh(["dp_shard"], [4], [0, 2, 1, 3]), "w")


def test_a_state_that_is_not_dtensors_or_not_this_model_is_refused_before_any_exchange(tmp_path):
    from functional_npu.runtime.loading.checkpoint import read_config

    from ..support.hf_models import save_tiny

    hf = save_tiny("qwen3", tmp_path, 0)
    cfg, mesh = read_config(tmp_path), Mesh.abstract({"tp": 1}, 0)
    state = hf.state_dict()
    with pytest.raises(TypeError, match=r"'model.embed_tokens.weight' is a Tensor, not a DTensor"):
        from_dtensor_state(state, cfg, mesh)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\], unknown \['model.norm.wieght'\]"):
        from_dtensor_state(state | {"model.norm.wieght": state.pop("model.norm.weight")}, cfg, mesh)


def test_layers_sharded_over_an_axis_the_training_mesh_cuts_are_refused():
    from functional_npu.core.layout import Cyclic, Layout, Shard
    from functional_npu.runtime.loading.dtensor_state import _over

    runs = {"dp": ("dp", "dp_1"), "tp": ("tp",)}
    assert _over(Layout((Shard(("dp", "tp")),)), runs, "w") == Layout((Shard(("dp", "dp_1", "tp")),))
    with pytest.raises(ValueError, match=r"w: layers are sharded over mesh axis 'dp', which the training mesh cuts"):
        _over(Layout((Cyclic("dp", 4),)), runs, "w")
