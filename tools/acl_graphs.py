"""The golden cases as ACL graphs: the FX graph npugraph_ex would capture, after its own passes, on this host.

Every case of :mod:`tools.aten_graphs` is compiled with npugraph_ex's backend (what
``torch.compile(backend="npugraph_ex")`` runs; this library's config,
:func:`functional_npu.runtime.serving.backends.npugraph_ex_config`) and the backend's ordering hints
(:func:`functional_npu.runtime.serving.backends.npugraph_ex_streams`), rank 0 of a world of torch's fake process
group, from CPU inputs standing in for NPU ones (meta inputs make inductor's pattern matcher, which
npugraph_ex's ``decompose_auto_functionalized`` uses, skip every node). Conversion ends where npugraph_ex
would start capturing (:mod:`functional_npu.npu.acl_graph`); that graph is the artifact:

- ``acl_graph.txt``: the FX graph after every npugraph_ex pass;
- ``acl_streams.json``: its ops per stream in capture order, and the event edges between streams;
- ``acl_invariant.json`` (invariant cases): :func:`functional_npu.npu.invariant_graph.acl_check`'s findings: the
  graph's aten ops by what they do to the bits, and any that may reduce or round in its own order (the batch
  mode's cases: :func:`~functional_npu.npu.invariant_graph.acl_batch_check`'s, matmuls a class of their own);
- ``acl_prefetch.json`` (the ring's cases: layer-sharded and host series): the ring's hazard check over capture order
  (:func:`functional_npu.npu.acl_graph.prefetch_report`): violations, ring slots and bytes, and the
  prefetch bytes the graph allocates (zero: the ring is the graph's input);
- ``acl_checks.json``: what capture needs of the graph (:mod:`functional_npu.npu.capture_checks`): side streams
  joined back, no transfer or copy of an input inside it, the streams that run communication at once against each
  device profile's budget, and npugraph_ex's own ``deadlock_check`` run on the same capture order;
- ``acl_replay.json`` (the ring's cases and the paged ones): the forward compiled again and called
  :data:`REPLAY_STEPS` times with the same state through npugraph_ex's generated graph module
  (:mod:`functional_npu.npu.acl_replay`): per graph, its calls, the distinct tuples of its written-in-place inputs'
  addresses and how often npugraph_ex would capture it again;
- ``acl_prefetch_no_events.json`` and ``acl_checks_no_events.json`` (:data:`CONTROL` only): the hazard check and
  the capture checks on the graph compiled with the side stream but no events, where npugraph_ex clones the ring's
  slots: both must fail there.

A failed join or copy check and a graph the replay captures again are problems of the case (``python -m
tools.graphs`` then writes no keys); the communication budget is a problem except on a plan the NPU backends refuse
for it (:func:`_check_problems`).

The conversion runs in a subprocess (``python -m tools.acl_graphs SOURCES OUT [CASE ...]``) that never
imports the real ``torch_npu``; :func:`acl_artifacts` starts it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from functional_npu.npu import TorchairUnavailable, torchair_sources

from .aten_graphs import CASES, case_function, case_inputs, case_mesh, known_cases
from .conversion import run_conversion

__all__ = ["acl_artifacts", "CONTROL", "REPLAY_STEPS"]

CONTROL = "qwen3-dp2-layer_shard-k1-decode"  # also captured without events: the check must fail there
REPLAY_STEPS = 6  # calls of each layer-sharded forward: every ring phase (k + 1 <= 3) twice
ARG_NAMES = ("params", "tokens", "positions", "state", "mesh", "last")


# ---- in the conversion subprocess ---------------------------------------------------------------
def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _checks(gm: Any) -> dict[str, Any]:
    """:mod:`functional_npu.npu.capture_checks` on one graph, and npugraph_ex's own ``deadlock_check`` rule on its
    capture order (the pairs of communication kernels it finds deadlocking, per device profile)."""
    from npugraph_ex.tools.aclgraph_check import deadlock_check as dc  # type: ignore[import-not-found]

    from functional_npu.models import NPU_KERNELS
    from functional_npu.npu import capture_checks as cc
    from functional_npu.npu import capture_ops, op_table

    comm = cc.concurrent_comm(gm)
    budgets = {}
    for name, budget in cc.COMM_BUDGETS.items():
        trace = cc.deadlock_trace(gm, budget.collective_cores)
        tasks = dc._build_stream_tasks(trace)
        vc, index = dc._compute_vector_clocks(tasks, dc._build_sync_pairs(tasks))
        pairs = dc._find_deadlock_tasks(tasks, vc, index, budget.vector_cores)
        budgets[name] = {
            "streams": budget.streams,
            "problems": cc.comm_problems(gm, budget),
            "deadlock_check_pairs": sorted(sorted(t["name"][len("aiv_") :] for t in pair) for pair in pairs),
        }
    table = capture_ops.parse_table(op_table().read_text())
    return {
        "join": cc.unjoined_streams(gm),
        "copies": cc.copies(gm),
        "ops": capture_ops.problems(capture_ops.kernels_of(gm), table, NPU_KERNELS),
        "comm": {
            "ops_per_stream": {s: len(ops) for s, ops in comm["streams"].items()},
            "max_concurrent": comm["max_concurrent"],
            "at_once": comm["at_once"],
            "budgets": budgets,
        },
    }


def _run(sources: Path, out: Path, names: list[str]) -> None:
    from functional_npu.npu import acl_graph, acl_replay, invariant_graph

    acl_replay.install(sources)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from functional_npu.models import invariant_ops
    from functional_npu.parallel import prefetch
    from functional_npu.runtime import RankContext
    from functional_npu.runtime.serving import npugraph_ex_config, npugraph_ex_streams

    hints = npugraph_ex_streams()
    cases = [c for c in CASES if (not names or c.name in names) and c.phase != "train"]  # forwards only
    runs = [(c.name, c, hints) for c in cases]
    runs += [(CONTROL + "-no-events", c, acl_graph.unordered_streams()) for c in cases if c.name == CONTROL]
    results: dict[str, Any] = {}
    world = 0
    for name, case, streams in sorted(runs, key=lambda r: max(2, r[1].world)):
        if max(2, case.world) != world:
            if dist.is_initialized():
                dist.destroy_process_group()
            world = max(2, case.world)
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            ctx = RankContext(0, world)
        start = time.perf_counter()
        try:
            mesh = case_mesh(case, ctx)
            if not mesh.is_abstract:
                mesh.init_groups()
            fn, args = case_function(case, mesh, streams=streams)  # the ring's layout a constant, as compiled
            got = acl_graph.capture(fn, args, npugraph_ex_config(), invariant_ops.decompositions())
        except Exception as e:  # noqa: BLE001 - reported per case, the rest still converts
            results[name] = {"error": _error(e)}
            continue
        gm = got["gm"]
        entry: dict[str, Any] = {
            "graph": str(gm.graph),
            "streams": acl_graph.streams_summary(gm) | {"labels": got["stream_labels"]},
        }
        entry["checks"] = _checks(gm)
        if case.invariant:
            check = invariant_graph.acl_batch_check if case.invariant == "batch" else invariant_graph.acl_check
            entry["invariant"] = check(gm.graph)
        if case.ringed:
            entry["prefetch"] = acl_graph.prefetch_report(gm, case.k, phase=case.ring_phase)
        if (case.ringed or case.paged) and name == case.name:  # inputs written in place: stable across replays
            try:
                args = case_inputs(case, mesh, device="cpu")
                replayed = acl_replay.replay(fn, args, npugraph_ex_config(), REPLAY_STEPS, names=ARG_NAMES)
                prefetch.drain(args[3].prefetched)
            except Exception as e:  # noqa: BLE001 - reported per case
                entry["replay"] = {"error": _error(e)}
            else:
                entry["replay"] = replayed | {"problems": acl_replay.recapture_problems(replayed)}
        entry["seconds"] = round(time.perf_counter() - start, 2)
        results[name] = entry
    out.write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    _run(Path(args[0]), Path(args[1]), args[2:])
    return 0


# ---- in the parent ------------------------------------------------------------------------------
def _check_problems(checks: dict[str, Any], case: Any) -> list[str]:
    """The capture checks that make a problem of the case: joins, copies, an op capture cannot take (an aclop, a
    format cast, no NPU kernel: :mod:`functional_npu.npu.capture_ops`), and two streams communicating at once on
    a plan the NPU backends compile. A plan they refuse for exactly that (``compile_policy.check_comm_streams``: the
    module-TP case, its TP collectives on main beside the prefetch broadcasts) is the counterexample, recorded; the
    refusal itself must then hold (a refused plan with no such pair is a problem: the refusal would be stale)."""
    from functional_npu.core import Mesh
    from functional_npu.runtime.serving import Backend, check_comm_streams

    try:
        check_comm_streams(case.plan, Mesh.abstract(case.axes, 0), Backend("npugraph_ex", "npu"), case.name)
        refused = False
    except ValueError:
        refused = True
    comm = [p for b in checks["comm"]["budgets"].values() for p in b["problems"]]
    if refused:  # the counterexample: its pairs are why the plan is refused
        comm = [] if comm else ["the NPU backends refuse this plan for two streams communicating, yet none do"]
    return checks["join"] + checks["copies"] + checks["ops"] + comm


def acl_artifacts(
    names: list[str] | None = None, *, timeout: float = 1800.0
) -> tuple[dict[str, dict[str, Any]], list[str], str | None]:
    """Convert every case (or those ``names``); returns ``(artifacts, problems, skipped)``: ``skipped`` is one line
    when npugraph_ex's sources cannot be had; ``problems`` name the case and what failed."""
    names = known_cases(names)
    try:
        sources = torchair_sources()
    except TorchairUnavailable as e:
        return {}, [], f"ACL graph conversion skipped: {e}"
    results, failed = run_conversion("tools.acl_graphs", sources, list(names or []), "ACL graph conversion", timeout)
    if results is None:
        return {}, failed, None
    artifacts: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for case in CASES:
        if (names and case.name not in names) or case.phase == "train":  # ACL graph capture serves inference
            continue
        got = results.get(case.name, {"error": "not converted"})
        where = f"{case.name} (family {case.family}, {case.phase})"
        if "error" in got:
            problems.append(f"{where}: npugraph_ex conversion failed: {got['error']}")
            continue
        files: dict[str, Any] = {
            "acl_graph.txt": got["graph"],
            "acl_streams.json": got["streams"],
            "acl_checks.json": got["checks"],
        }
        problems += [f"{where}: ACL graph capture: {p}" for p in _check_problems(got["checks"], case)]
        if "invariant" in got:
            files["acl_invariant.json"] = got["invariant"]
            problems += [f"{where}: ACL graph invariant ops: {p}" for p in got["invariant"]["problems"]]
        if "prefetch" in got:
            files["acl_prefetch.json"] = got["prefetch"]
            problems += [f"{where}: ACL graph prefetch: {p}" for p in got["prefetch"]["problems"]]
        if "replay" in got:
            if "error" in got["replay"]:
                problems.append(f"{where}: ACL graph replay failed: {got['replay']['error']}")
            else:
                files["acl_replay.json"] = got["replay"]
                problems += [f"{where}: ACL graph replay: {p}" for p in got["replay"]["problems"]]
        artifacts[case.name] = files
    control = results.get(CONTROL + "-no-events", {})
    if "prefetch" in control:
        if control["prefetch"]["ok"]:
            problems.append(f"{CONTROL} without events passes the ACL graph hazard check: the check proves nothing")
        artifacts.setdefault(CONTROL, {})["acl_prefetch_no_events.json"] = control["prefetch"]
    if "checks" in control:
        if not control["checks"]["copies"]:
            problems.append(f"{CONTROL} without events passes the ACL graph copy check: the check proves nothing")
        artifacts.setdefault(CONTROL, {})["acl_checks_no_events.json"] = control["checks"]
    return artifacts, problems, None


if __name__ == "__main__":
    sys.exit(main())
