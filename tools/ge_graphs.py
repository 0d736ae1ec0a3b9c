"""The golden cases as NPU graphs: torchair's own FX-to-GE conversion, run on this host.

Every case of :mod:`tools.aten_graphs` is compiled with ``torch.compile(backend=
torchair.get_npu_backend())`` in GE graph mode (max-autotune), from meta inputs (so every input's
placement reads ``NPU``, as on a device), with the torchair backend's ordering hints
(:func:`functional_npu.runtime.serving.backends.torchair_streams`), rank 0 of a two-rank world of torch's
fake process group. Conversion ends where torchair hands the serialized graph to GE
(:mod:`functional_npu.npu.host`); that graph is the artifact:

- ``ge_graph.pbtxt.gz``: the GE graph in protobuf text format (sorted map keys), named ``graph`` whatever torchair's
  per-process counter numbered it, gzipped;
- ``ge_invariant.json`` (invariant cases): :func:`functional_npu.npu.invariant_graph.ge_check`'s findings: the
  graph's ops by what they do to the bits, its float64 ops, and any op that may reduce or round in its own order
  (the batch mode's cases: :func:`~functional_npu.npu.invariant_graph.ge_batch_check`'s, each MatMul's rows, reduced
  dim and columns too);
- ``ge_census.json``: GE op type -> count;
- ``ge_hcom.json``: the ordered Hcom ops with their group's ranks and mesh axis, bytes, root, stream;
- ``ge_prefetch.json`` (the ring's cases): :func:`functional_npu.npu.ge_graph.ring_check`'s findings: the
  prefetch ring's hazard check over the graph's partial order (its slots bound and its reads' layers read with the
  case's input layout, ``inputs.json``), its slots and bytes, and the prefetch bytes allocated inside the graph (0);
- ``ge_cache_writes.json`` (the paged cases): :func:`functional_npu.npu.ge_graph.cache_writes`: every pool written
  in place (``ScatterNdUpdate`` on its ``RefData`` input), none through a copy;
- ``ge_graph_no_hints.pbtxt.gz`` and ``ge_prefetch_no_hints.json`` (the control, :data:`CONTROL`): the same case
  converted without the ordering hints, and its check, which must fail.

The conversion runs in a subprocess (``python -m tools.ge_graphs SOURCES OUT``) that
never imports ``torch_npu``; :func:`ge_artifacts` starts it and turns its output into artifacts and
problems (a missing converter, an Hcom schedule that differs from the aten one, a prefetch bound
GE could break).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from functional_npu.models import batch_invariant
from functional_npu.npu import TorchairUnavailable, ge_graph, invariant_graph, torchair_sources

from .aten_graphs import CASES, case_function, case_mesh, known_cases
from .conversion import run_conversion

__all__ = ["ge_artifacts", "case_artifacts", "compare_schedules", "convert", "stable_names", "CONTROL", "FIXES"]

CONTROL = "qwen3-dp2-layer_shard-k1-decode"  # also converted without hints: the check must fail there
FIXES = (
    "decompose it into ops that have GE converters, or register a converter "
    "(torchair.register_fx_node_ge_converter) that maps it to a known GE op"
)


# ---- in the conversion subprocess ---------------------------------------------------------------
def convert(fn: Any, args: tuple[Any, ...], *, ordered: bool = True) -> Any:
    """Compile ``fn(*args)`` with torchair's backend (GE graph mode), configured as the torchair backend is
    (:func:`functional_npu.runtime.serving.ge_converters.configure`; ``ordered=False``: the ring's writes lose their
    ``after``), and return the GE GraphDef it hands to GE. Run only in a process set up by
    :func:`functional_npu.npu.host.install`."""
    import torch
    import torchair  # type: ignore[import-not-found]

    from functional_npu.models import invariant_ops
    from functional_npu.npu import host
    from functional_npu.runtime.serving import ge_converters

    # the ring in place, as the backend has it
    config = ge_converters.configure(
        torchair.CompilerConfig(), ordered=ordered
    )  # the ring in place, as the backend has it
    config.mode = "max-autotune"
    torch._dynamo.reset()
    compiled = torch.compile(
        fn,
        backend=torchair.get_npu_backend(compiler_config=config, custom_decompositions=invariant_ops.decompositions()),
        fullgraph=True,
        dynamic=False,
    )
    before = len(host.handed())
    try:
        with torch.no_grad():
            compiled(*args)
    except host.HandedToGE:
        pass
    graphs = host.handed()[before:]
    if len(graphs) != 1:
        raise RuntimeError(f"expected one graph handed to GE, got {len(graphs)}")
    from torchair._ge_concrete_graph.ge_ir_pb2 import ModelDef  # type: ignore[import-not-found]

    model = ModelDef()
    model.ParseFromString(graphs[0][1])
    return stable_names(model.graph[0])


def stable_names(graph: Any) -> Any:
    """``graph`` with each ``RefData`` named after the FX input it replaced (``RefData_arg7_1``): torchair names it
    by shape and the input tensor's ``id()``, which differs from run to run."""
    renamed = {}
    for op in graph.op:
        if op.type == "RefData" and "_origin_data_name" in op.attr:
            renamed[op.name] = "RefData_" + op.attr["_origin_data_name"].s.decode()
            op.name = renamed[op.name]
    for op in graph.op:
        for i, src in enumerate(op.input):
            name, sep, index = src.rpartition(":")
            if sep and name in renamed:
                op.input[i] = f"{renamed[name]}:{index}"
    return graph


def _convert(case: Any, streams: Any, ctx: Any) -> Any:
    from functional_npu.parallel import INLINE

    mesh = case_mesh(case, ctx)
    if not mesh.is_abstract:
        mesh.init_groups()
    fn, args = case_function(case, mesh, device="meta", streams=streams)
    return convert(fn, args, ordered=streams is not INLINE)


def _error(e: BaseException) -> dict[str, str]:
    """The first line of the message (torchair appends tracebacks), and the FX op being converted
    when it failed (torchair's converter frames hold it), if any."""
    out: dict[str, str] = {}
    seen: set[int] = set()
    chain: BaseException | None = e
    while chain is not None and id(chain) not in seen:  # torchair and dynamo re-raise: the cause is the first
        seen.add(id(chain))
        text = str(chain).strip().splitlines()
        out["error"] = f"{type(chain).__name__}: {text[0] if text else ''}"
        tb = chain.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            node = frame.f_locals.get("n") if frame.f_code.co_name == "run_node" else None
            if node is not None and "torchair" in frame.f_code.co_filename and hasattr(node, "target"):
                out["op"] = str(node.target)
            tb = tb.tb_next
        chain = chain.__cause__ or chain.__context__
    return out


def _run(sources: Path, out: Path, names: list[str]) -> None:
    from functional_npu.npu import host

    host.install(sources)
    import torch.distributed as dist
    from google.protobuf import text_format
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchair._ge_concrete_graph.ge_ir_pb2 import DataType  # type: ignore[import-not-found]

    from functional_npu.parallel import INLINE
    from functional_npu.runtime import RankContext
    from functional_npu.runtime.serving import (
        ge_converters,  # noqa: F401 - registers the converters of this library's ops
        torchair_streams,
    )

    hints = torchair_streams()
    results: dict[str, Any] = {}
    cases = [c for c in CASES if not names or c.name in names]
    runs = [(case.name, case, hints) for case in cases]
    runs += [(CONTROL + "-no-hints", c, INLINE) for c in cases if c.name == CONTROL]
    world, ctx = 0, None
    for name, case, streams in sorted(runs, key=lambda r: max(2, r[1].world)):
        if max(2, case.world) != world:  # rank 0 of a fake world of the case's size (one-rank cases: abstract)
            if dist.is_initialized():
                dist.destroy_process_group()
            world = max(2, case.world)
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            ctx = RankContext(0, world)
        try:
            graph = _convert(case, streams, ctx)
        except Exception as e:  # noqa: BLE001 - reported per case, the rest still converts
            results[name] = _error(e)
            continue
        mesh = case_mesh(case, ctx)
        axes = (
            {}
            if mesh.is_abstract
            else {",".join(map(str, mesh.group_ranks(a))): a for a in mesh.axis_names if mesh.axis_size(a) > 1}
        )
        graph.name = "graph"  # torchair numbers its graphs per process: one case alone would read as drift
        results[name] = {
            "pbtxt": text_format.MessageToString(graph),
            "ops": ge_graph.records(graph, DataType.Name),
            "axes": axes,
        }
    out.write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    _run(Path(args[0]), Path(args[1]), args[2:])
    return 0


# ---- in the parent ------------------------------------------------------------------------------
def _aten_op(target: str) -> str:
    return target.split(".")[1]  # "_c10d_functional.all_reduce.default" -> "all_reduce"


def compare_schedules(aten: list[dict[str, Any]], hcom: list[dict[str, Any]]) -> list[str]:
    """Where GE's Hcom schedule differs from the aten collective schedule (op, axis, bytes, root, reduction)."""
    out = []
    if len(aten) != len(hcom):
        out.append(f"{len(aten)} aten collectives but {len(hcom)} Hcom ops")
    for i, (a, h) in enumerate(zip(aten, hcom)):
        want = ge_graph.HCOM_OF.get(_aten_op(a["op"]), "?")
        got = (h["op"], h["axis"], h["bytes"], h.get("root"), h.get("reduce"))
        if (want, a["axis"], a["bytes"], a.get("src"), a.get("reduce")) != got:
            out.append(
                f"#{i}: aten {_aten_op(a['op'])} over {a['axis']}, {a['bytes']} B, src {a.get('src')}, "
                f"reduce {a.get('reduce')}; GE {got}"
            )
    return out


def _prefetch_order(case: Any, ops: list[dict[str, Any]], inputs: list[str | None] | None = None) -> dict[str, Any]:
    # one coalesced write per layer and source carries every series of that source (they share a dtype); ``inputs``:
    # the graph's input layout (the aten graph's: the same inputs in the same order), which binds the slots and reads
    return ge_graph.ring_check(
        ops,
        k=case.k,
        num_layers=case.config.num_layers,
        series=case.ring_groups,
        axis_size=case.axes.get("dp", 1),
        inputs=inputs,
        phase=case.ring_phase,
    )


def case_artifacts(
    case: Any, got: dict[str, Any], aten_schedule: list[dict[str, Any]], inputs: list[str | None] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """One case's GE artifact files and problems, from the conversion process's result ``got``
    (``{"pbtxt", "ops", "axes"}``, or ``{"error"[, "op"]}``); ``inputs``: the case's input layout."""
    where = f"{case.name} (family {case.family}, {case.phase})"
    if "error" in got and "op" in got:
        return {}, [f"{where}: torchair cannot convert {got['op']} ({got['error']}); {FIXES}"]
    if "error" in got:
        return {}, [f"{where}: GE conversion failed: {got['error']}"]
    axes = {tuple(int(r) for r in key.split(",")): axis for key, axis in got["axes"].items()}
    hcom = ge_graph.hcom_schedule(got["ops"], axes)
    files: dict[str, Any] = {
        "ge_graph.pbtxt.gz": got["pbtxt"],
        "ge_census.json": ge_graph.census(got["ops"]),
        "ge_hcom.json": hcom,
    }
    problems = [f"{where}: Hcom schedule != aten schedule: {d}" for d in compare_schedules(aten_schedule, hcom)]
    if case.invariant:  # the invariant functions' ops only: no ReduceSum, no fused kernel; MatMuls pinned in "batch"
        if case.invariant == "batch":
            ops = invariant_graph.ge_batch_check(got["ops"], batch_invariant.ROWS)
        else:
            ops = invariant_graph.ge_check(got["ops"])
        files["ge_invariant.json"] = ops
        problems += [f"{where}: invariant ops: {p}" for p in ops["problems"]]
    if case.paged:  # every pool written in place through the block table
        writes = ge_graph.cache_writes(got["ops"])
        files["ge_cache_writes.json"] = writes
        problems += [f"{where}: cache writes: {p}" for p in writes["problems"]]
    if case.ringed:
        order = _prefetch_order(case, got["ops"], inputs)
        files["ge_prefetch.json"] = order
        problems += [f"{where}: prefetch order: {p}" for p in order["problems"]]
    return files, problems


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def ge_artifacts(
    aten: dict[str, list[dict[str, Any]]],
    names: list[str] | None = None,
    *,
    timeout: float = 900.0,
    inputs: dict[str, list[str | None]] | None = None,
) -> tuple[dict[str, dict[str, Any]], list[str], str | None]:
    """Convert every case (or those ``names``); returns ``(artifacts, problems, skipped)``.

    ``aten`` is each case's aten collective schedule (its ``collectives.json``), ``inputs`` its input layout (its
    ``inputs.json``, for the layer-sharded cases). ``skipped`` is one line
    when torchair's sources cannot be had (then nothing is converted); ``problems`` name the case,
    family, phase and what to do.
    """
    names = known_cases(names)
    missing = [m for m in ("google.protobuf", "packaging") if not _installed(m)]
    if missing:
        return {}, [], f"GE conversion skipped: {', '.join(missing)} not installed (pip install 'functional-npu[ge]')"
    try:
        sources = torchair_sources()
    except TorchairUnavailable as e:
        return {}, [], f"GE conversion skipped: {e}"
    results, failed = run_conversion("tools.ge_graphs", sources, list(names or []), "GE conversion", timeout)
    if results is None:
        return {}, failed, None
    artifacts: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for case in CASES:
        if names and case.name not in names:
            continue
        got = results.get(case.name, {"error": "not converted"})
        files, found = case_artifacts(case, got, aten[case.name], (inputs or {}).get(case.name))
        if files:
            artifacts[case.name] = files
        problems += found
    control = results.get(CONTROL + "-no-hints", {})
    if "ops" in control:
        case = next(c for c in CASES if c.name == CONTROL)
        order = _prefetch_order(case, control["ops"], (inputs or {}).get(CONTROL))
        if order["ok"]:
            problems.append(f"{CONTROL} without ordering hints passes the prefetch check: the check proves nothing")
        artifacts.setdefault(CONTROL, {})["ge_prefetch_no_hints.json"] = order
        artifacts[CONTROL]["ge_graph_no_hints.pbtxt.gz"] = control["pbtxt"]  # so its verdict can be recomputed
    return artifacts, problems, None


if __name__ == "__main__":
    sys.exit(main())
