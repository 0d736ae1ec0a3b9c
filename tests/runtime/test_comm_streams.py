"""On the NPU's graph backends a layer-sharded ring's broadcasts (its prefetch stream) beside collectives on the
compute stream are refused by name; the same plans run on the CPU's backends, and a ring of host copies or a ring
with no other collective runs on the NPU's (``compile_policy.check_comm_streams``; the golden graphs that show why:
tests/npu/test_capture_checks.py)."""

import pytest

from functional_npu.core.mesh import Mesh
from functional_npu.parallel.layer_shard import layer_shard
from functional_npu.parallel.plan import Plan
from functional_npu.runtime.serving import Backend, check_comm_streams

RING = layer_shard("o_proj", "dp")
NPU = [Backend("npugraph_ex", "npu"), Backend("torchair", "npu", "max-autotune")]


@pytest.mark.parametrize("backend", NPU, ids=lambda b: b.name)
@pytest.mark.parametrize(
    "axes, plan, named",
    [
        ({"dp": 2, "tp": 2}, Plan(layer_shard=RING), "tp over 'tp' (2 ranks)"),
        ({"dp": 4, "tp": 1}, Plan(layer_shard=RING, expert_axes=("dp", "tp")), "expert_axes ('dp', 'tp') (4 ranks)"),
    ],
)
def test_a_ring_beside_compute_stream_collectives_is_refused_on_the_npu(backend, axes, plan, named):
    with pytest.raises(ValueError) as e:
        check_comm_streams(plan, Mesh.abstract(axes, 0), backend, "compile_model")
    message = str(e.value)
    assert message.startswith(f"compile_model: on backend {backend.name!r} the layer-sharded ring broadcasts over 'dp'")
    assert named in message and "Plan(offload=...)" in message and "\n" not in message


@pytest.mark.parametrize(
    "axes, plan, backend",
    [
        ({"dp": 2, "tp": 2}, Plan(layer_shard=RING), Backend("inductor", "cpu")),  # gloo: no vector cores
        ({"dp": 2, "tp": 1}, Plan(layer_shard=RING), NPU[0]),  # the ring alone communicates
        ({"dp": 1, "tp": 2}, Plan(offload="o_proj"), NPU[0]),  # host copies are not collectives
        ({"dp": 2, "tp": 2}, Plan(), NPU[1]),  # no ring
    ],
)
def test_the_plans_with_one_communicating_stream_pass(axes, plan, backend):
    check_comm_streams(plan, Mesh.abstract(axes, 0), backend, "compile_model")
