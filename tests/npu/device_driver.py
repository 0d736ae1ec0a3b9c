"""The lines only an NPU runs, run here against the vendor's own Python with a stand-in for the device alone:
``python -m tests.npu.device_driver SOURCES OUT WHICH``, started by :func:`tools.conversion.run_conversion` in a
process of its own (each stand-in changes the import system), under line coverage.

- ``torchair``: torchair's sources on the path (:func:`functional_npu.npu.host.install`: its native module a
  stand-in that ends conversion where GE would take the graph). The backend is resolved as on a device
  (``resolve_backend("torchair", ...)`` with an NPU probe that says yes: the device is the one thing stood in),
  in both of torchair's modes, and a function calling this library's Ascend ops and the ring's in-place broadcast
  under the backend's own stream hints is compiled with it down to the GE graph.
- ``npugraph_ex``: npugraph_ex's sources on the path with the stand-ins of :mod:`functional_npu.npu.acl_replay`
  (``torch_npu`` an empty package, ``torch.npu`` streams and events that hold ids, the capture replayed op by op on
  the CPU). The backend is resolved as on a device and a function using its side stream and tagged events is
  compiled and run through npugraph_ex's own passes and generated module; the options the library refuses are
  refused by npugraph_ex's own ``CompilerConfig``.

``OUT`` receives what each run saw (GE op types, stream labels, events, values) and the line coverage of the
package's files (:func:`coverage_of`), which ``tests/npu/test_device_lines.py`` reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import coverage

WHICH = ("torchair", "npugraph_ex")


def _standin_npu() -> tuple[bool, str]:
    return True, "stand-in NPU (the device is the one thing not run)"


def _ascend_program(x: Any, w8: Any, scale: Any, w4: Any, scale4: Any, slot: Any, part: Any, *, mesh: Any, hints: Any):
    """A prefill-sized slice of what a quantized, layer-sharded model runs: the Ascend matmuls, then a ring slot
    written in place by its broadcast on the prefetch stream, ordered after the matmuls' result."""
    import torch

    from functional_npu.core import broadcast_into
    from functional_npu.models import ascend_ops

    q = torch.ops.aten.round(x.float()).clamp(-128, 127).to(torch.int8)
    y = ascend_ops.quant_matmul(q, w8, scale, torch.ones(x.shape[0], device=x.device), torch.bfloat16)
    z = ascend_ops.weight_quant_matmul(y, w4, scale4, None, 0)
    with hints.side("prefetch"):
        broadcast_into(slot, [hints.after(part, z)], mesh, "dp", src=0, after=z)
    return z.sum() + slot.sum()


def _resolutions(resolve: Any) -> dict[str, str]:
    """What ``resolve_backend`` gives for each name, mode and device on a host whose NPU the probe stands in for (and on
    one without): the backend's name and mode, or the first words of the refusal."""
    calls = {
        "torchair on cpu": dict(name="torchair", device_type="cpu"),
        "npugraph_ex on cpu": dict(name="npugraph_ex", device_type="cpu"),
        "npugraph_ex with a mode": dict(name="npugraph_ex", mode="max-autotune"),
        "torchair, bad mode": dict(name="torchair", mode="default"),
        "inductor with options": dict(name="inductor", options={"capture_limit": 1}),
        "auto on cpu": dict(name="auto", device_type="cpu"),
        "eager": dict(name="eager", device_type="cpu"),
        "aot_eager": dict(name="aot_eager", device_type="cpu"),
        "none": dict(name="none", device_type="cpu"),
        "unknown": dict(name="tvm"),
    }
    out = {}
    for what, kwargs in calls.items():
        try:
            got = resolve(**kwargs, probe=_standin_npu)
            out[what] = f"{got.name} {got.mode}"
        except ValueError as e:
            out[what] = "refused: " + str(e)
    for what, kwargs in {"no npu, torchair": dict(name="torchair"), "no npu, npu": dict(device_type="npu")}.items():
        try:
            resolve(**kwargs, probe=lambda: (False, "no device"))
        except ValueError as e:
            out[what] = "refused: " + str(e)
    out["no npu, auto"] = resolve("auto", probe=lambda: (False, "no device")).name
    return out


def _torchair(out: dict[str, Any], sources: Path) -> None:
    from functional_npu.npu import host

    host.install(sources)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchair._ge_concrete_graph.ge_ir_pb2 import ModelDef  # type: ignore[import-not-found]

    from functional_npu.core import Mesh, make_mesh
    from functional_npu.runtime.serving.backends import npu_status, resolve_backend

    captured = resolve_backend("torchair", mode="reduce-overhead", device_type="npu", probe=_standin_npu)
    out["reduce_overhead"] = {"name": captured.name, "mode": captured.mode, "streams": captured.streams.name}
    chosen = resolve_backend("auto", probe=_standin_npu)  # on a device, "auto" is torchair's GE graph
    out["auto"] = {"name": chosen.name, "mode": chosen.mode, "streams": chosen.streams.name, "kernels": chosen.kernels}
    out["status"] = list(npu_status())  # the real probe: torch_npu is blocked in this process
    out["resolved"] = _resolutions(resolve_backend)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = make_mesh({"dp": 2})
    mesh.init_groups()
    meta = {"device": "meta"}
    args = (
        torch.randn(4, 16, **meta).to(torch.bfloat16),
        torch.zeros(16, 8, dtype=torch.int8, **meta),
        torch.ones(8, **meta),
        torch.zeros(8, 1, dtype=torch.int32, **meta),  # int4: eight to a word along N
        torch.ones(8, **meta).to(torch.bfloat16),
        torch.zeros(32, **meta),
        torch.zeros(32, **meta),
    )
    compiled = chosen.compile(lambda *a: _ascend_program(*a, mesh=mesh, hints=chosen.streams), dynamic=False)
    try:
        with torch.no_grad():
            compiled(*args)
    except host.HandedToGE:
        pass
    model = ModelDef()
    model.ParseFromString(host.handed()[-1][1])
    ops = model.graph[0].op
    out["ge_ops"] = sorted({op.type for op in ops})
    out["ge_stream_labels"] = sorted(
        {op.attr["_user_stream_label"].s.decode() for op in ops if "_user_stream_label" in op.attr}
    )
    out["mesh_abstract"] = Mesh.abstract({"dp": 2}).is_abstract


def _npugraph_ex(out: dict[str, Any], sources: Path) -> None:
    from functional_npu.npu import acl_graph

    acl_graph.install(sources)
    import npugraph_ex  # type: ignore[import-not-found]
    import torch

    from functional_npu.runtime.serving.backends import (
        EVENT_PREFIX,
        REFUSED_NPUGRAPH_EX_OPTIONS,
        check_npugraph_ex_config,
        npu_status,
        npugraph_ex_config,
        resolve_backend,
    )

    # pattern_fusion_pass: npugraph_ex's fusion patterns are written with torch_npu's native ops (the device's op
    # library, torch.ops.npu.npu_add_rms_norm, ...): the one pass not run here (functional_npu.npu.acl_graph)
    chosen = resolve_backend("npugraph_ex", probe=_standin_npu, options={"pattern_fusion_pass": False})
    out["status"] = list(npu_status())  # the real probe: torch_npu (the stand-in) imports, and sees no device
    out["backend"] = {"name": chosen.name, "streams": chosen.streams.name, "kernels": chosen.kernels}
    hints = chosen.streams

    def program(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        y = x * 2
        hints.signal("made")
        with hints.side("prefetch"):
            hints.wait("made")
            buf.add_(y)
            hints.signal("done")
        hints.wait("done")
        return buf.sum() + y.sum()

    compiled = chosen.compile(program, dynamic=False)
    try:
        compiled(torch.ones(8), torch.zeros(8))
    except Exception as e:  # noqa: BLE001 - dynamo wraps the stand-in's stop in its own errors
        if "HandedToCapture" not in repr(e) and "handed to capture" not in str(e):
            raise
    got = acl_graph.handed()[-1]
    # the hints once more as plain Python (dynamo traced them symbolically, where line coverage cannot see), on the
    # events the compile's pre-pass created
    x, buf = torch.ones(8), torch.zeros(8)
    out["eager"] = [float(program(x, buf)), buf.tolist()[0]]
    out["stream_labels"] = got["stream_labels"]
    out["tagged_events"] = sorted(t for t in got["tagged_events"] if t.startswith(EVENT_PREFIX))
    out["graph_ops"] = sorted({str(n.target) for n in got["gm"].graph.nodes if n.op == "call_function"})
    refused = {}
    for name, (value, _) in REFUSED_NPUGRAPH_EX_OPTIONS.items():
        config = npugraph_ex.CompilerConfig()
        setattr(config, name, value)
        try:
            check_npugraph_ex_config(config)
            refused[name] = "accepted"
        except ValueError as e:
            refused[name] = str(e)
    try:
        npugraph_ex_config(post_grad_custom_pre_pass=print)
    except ValueError as e:
        refused["post_grad_custom_pre_pass"] = str(e)
    out["refused"] = refused


def coverage_of(cov: coverage.Coverage, package: Path) -> dict[str, dict[str, list[int]]]:
    """``{file relative to the package's parent: {"statements": [...], "missing": [...]}}`` for every file of the
    package this process ran."""
    data = cov.get_data()
    out = {}
    for file in sorted(data.measured_files()):
        path = Path(file)
        if package in path.parents:
            _, statements, _, missing, _ = cov.analysis2(file)
            out[str(path.relative_to(package.parent))] = {"statements": statements, "missing": missing}
    return out


def main(argv: list[str]) -> int:
    sources, target, which = Path(argv[0]), Path(argv[1]), argv[2]
    package = Path(__file__).resolve().parents[2] / "functional_npu"
    cov = coverage.Coverage(data_file=None, include=[f"{package}/*"], branch=False)
    cov.start()
    out: dict[str, Any] = {}
    try:
        {"torchair": _torchair, "npugraph_ex": _npugraph_ex}[which](out, sources)
    finally:
        cov.stop()
    out["coverage"] = coverage_of(cov, package)
    target.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
