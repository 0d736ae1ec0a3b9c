"""Golden captured graphs: ``python -m tools.graphs [--check] [--all] [--out DIR] [--no-ge] [--no-acl]``.

Regenerates (or, with ``--check``, compares) the artifacts in graphs/ of every case whose key changed (its sources
and torch's version, :mod:`tools.graph_keys`; ``--all``: every case): its aten graph (:mod:`tools.aten_graphs`) and,
through torchair's own converters, its GE graph (:mod:`tools.ge_graphs`), and through npugraph_ex's own passes, the FX
graph ACL graph capture takes (:mod:`tools.acl_graphs`); a full write records the regenerated cases' keys in
``graphs/keys.json``.
Drift, a failed conversion or a failed check is exit code 1. A SIGTERM stops the run cleanly (exit 143: local
ranks stopped, temporary files removed), a Ctrl-C too, in one line (exit 130).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any, NamedTuple

from functional_npu.models import family_of
from functional_npu.runtime import LocalWorld, RankContext

from .acl_graphs import acl_artifacts
from .aten_graphs import CASES, capture_artifacts, diff_artifacts, known_cases, write_artifacts
from .ge_graphs import ge_artifacts
from .graph_keys import keys, stale, write_keys

__all__ = ["Report", "regenerate", "current_keys", "main"]


def _all_artifacts(world: LocalWorld | None, names: list[str]) -> dict[str, dict[str, Any]]:
    """The aten artifacts of the cases ``names``, each world size's cases on a world of that size (``world`` if it is
    one, else a new one)."""
    out = capture_artifacts(RankContext(0, 1), 1, names) if any(c.world == 1 for c in _cases(names)) else {}
    for size in sorted({c.world for c in _cases(names)} - {1}):
        own = world if world is not None and world.world_size == size else LocalWorld(size)
        try:
            out |= own.run(capture_artifacts, size, names)[0]
        finally:
            if own is not world:
                own.close()
    return out


def _cases(names: list[str]) -> list[Any]:
    return [c for c in CASES if c.name in names]


def current_keys() -> dict[str, str]:
    """Every case's key now (:mod:`tools.graph_keys`): its family's sources, the tools', torch's version."""
    return keys((c.name, family_of(c.config).config.__module__.rsplit(".", 1)[1]) for c in CASES)


class Report(NamedTuple):
    """What :func:`regenerate` found: ``drift`` (files that differ, with ``check``), ``problems``
    (GE conversion failures and failed checks), ``skipped`` (one line when no GE conversion ran) and ``cases``
    (the cases regenerated)."""

    drift: list[str]
    problems: list[str]
    skipped: str | None
    cases: list[str] = []


def regenerate(
    root: Path,
    *,
    check: bool = False,
    world: LocalWorld | None = None,
    ge: bool = True,
    acl: bool = True,
    names: list[str] | None = None,
) -> Report:
    """Capture the artifacts of the cases ``names`` (None: every case; and, with ``ge``, convert them to GE graphs;
    with ``acl``, to ACL graphs); write them and their keys under ``root`` or, with ``check``, report the drifted
    files."""
    names = [c.name for c in CASES] if names is None else known_cases(names)
    if not names:
        return Report([], [], None, [])
    artifacts = _all_artifacts(world, names)
    problems: list[str] = []
    skipped = "GE conversion not requested" if not ge else None
    if ge:
        schedules = {name: files["collectives.json"] for name, files in artifacts.items()}
        layouts = {name: files["inputs.json"] for name, files in artifacts.items() if "inputs.json" in files}
        converted, problems, skipped = ge_artifacts(schedules, names, inputs=layouts)
        for name, files in converted.items():
            artifacts[name] = artifacts.get(name, {}) | files
    if acl:
        captured, found, acl_skipped = acl_artifacts(names)
        problems += found
        skipped = "; ".join(s for s in (skipped, acl_skipped) if s) or None
        for name, files in captured.items():
            artifacts[name] = artifacts.get(name, {}) | files
    if check:
        return Report(diff_artifacts(artifacts, root), problems, skipped, names)
    write_artifacts(artifacts, root)
    if not problems and ge and acl and not skipped:  # a key says every artifact of its case is this source's
        now = current_keys()
        write_keys(root, {n: now[n] for n in names})
    return Report([], problems, skipped, names)


def _terminated(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds like an error: local ranks are stopped, temporary files removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.graphs",
        description="regenerate (or --check) the golden captured graphs in graphs/: the cases whose key (their "
        "sources, torch's version) changed, or --all",
    )
    parser.add_argument("cases", nargs="*", help="these cases only (default: those whose key changed)")
    parser.add_argument("--check", action="store_true", help="fail (exit 1) on drift instead of writing")
    parser.add_argument("--all", action="store_true", help="every case, not only those whose key changed")
    parser.add_argument("--out", default="graphs", help="the artifacts folder; default graphs/")
    parser.add_argument(
        "--no-ge",
        action="store_true",
        help="skip the GE conversion (torchair's converters, from the torch-npu wheel, downloaded once)",
    )
    parser.add_argument(
        "--no-acl", action="store_true", help="skip the ACL graph conversion (npugraph_ex's passes, same wheel)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        chosen = known_cases(args.cases)
    except ValueError as e:
        parser.error(str(e))  # exit 2
    names = chosen or ([c.name for c in CASES] if args.all else stale(out, current_keys()))
    if not names:
        print(f"graphs: every case's key is current ({len(CASES)} cases): nothing to regenerate (--all: every case)")
        return 0
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        report = regenerate(out, check=args.check, ge=not args.no_ge, acl=not args.no_acl, names=names)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _said(report, args, out)


def _said(report: Report, args: argparse.Namespace, out: Path) -> int:
    """Print the report; the exit code."""
    if report.skipped and not args.no_ge:
        print(f"graphs: {report.skipped}", file=sys.stderr)
    for problem in report.problems:
        print(f"graphs: {problem}", file=sys.stderr)
    if report.drift:
        print(
            f"{len(report.drift)} graph artifacts drifted (run: python -m tools.graphs): "
            + ", ".join(report.drift[:10]),
            file=sys.stderr,
        )
    if report.drift or report.problems:
        return 1
    done = "up to date" if args.check else f"written to {out}"
    print(f"graphs: {len(report.cases)} cases regenerated, {done}" + (" (aten only)" if report.skipped else ""))
    if args.check and stale(out, current_keys()):
        print("graphs: their keys are not recorded yet: run python -m tools.graphs to record them", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
