"""Golden captured graphs: ``python -m tools.graphs [--check] [--out DIR] [--no-ge] [--no-acl]``.

Regenerates (or, with ``--check``, compares) the artifacts in graphs/: every case's aten graph
(:mod:`tools.aten_graphs`) and, through torchair's own converters, its GE graph (:mod:`tools.ge_graphs`), and
through npugraph_ex's own passes, the FX graph ACL graph capture takes (:mod:`tools.acl_graphs`).
Drift, a failed conversion or a failed check is exit code 1. A SIGTERM stops the run cleanly (exit 143: local
ranks stopped, temporary files removed), a Ctrl-C too, in one line (exit 130).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any, NamedTuple

from functional_npu.runtime import LocalWorld, RankContext

from .acl_graphs import acl_artifacts
from .aten_graphs import CASES, capture_artifacts, diff_artifacts, write_artifacts
from .ge_graphs import ge_artifacts

__all__ = ["Report", "regenerate", "main"]


def _all_artifacts(world: LocalWorld | None) -> dict[str, dict[str, Any]]:
    out = capture_artifacts(RankContext(0, 1), 1)
    for size in sorted({c.world for c in CASES} - {1}):
        own = world if world is not None and world.world_size == size else LocalWorld(size)
        try:
            out |= own.run(capture_artifacts, size)[0]
        finally:
            if own is not world:
                own.close()
    return out


class Report(NamedTuple):
    """What :func:`regenerate` found: ``drift`` (files that differ, with ``check``), ``problems``
    (GE conversion failures and failed checks) and ``skipped`` (one line when no GE conversion ran)."""

    drift: list[str]
    problems: list[str]
    skipped: str | None


def regenerate(
    root: Path, *, check: bool = False, world: LocalWorld | None = None, ge: bool = True, acl: bool = True
) -> Report:
    """Capture every artifact (and, with ``ge``, convert every case to a GE graph); write them under
    ``root`` or, with ``check``, report the drifted files."""
    artifacts = _all_artifacts(world)
    problems: list[str] = []
    skipped = "GE conversion not requested" if not ge else None
    if ge:
        schedules = {name: files["collectives.json"] for name, files in artifacts.items()}
        converted, problems, skipped = ge_artifacts(schedules)
        for name, files in converted.items():
            artifacts[name] = artifacts.get(name, {}) | files
    if acl:
        captured, found, acl_skipped = acl_artifacts()
        problems += found
        skipped = "; ".join(s for s in (skipped, acl_skipped) if s) or None
        for name, files in captured.items():
            artifacts[name] = artifacts.get(name, {}) | files
    if check:
        return Report(diff_artifacts(artifacts, root), problems, skipped)
    write_artifacts(artifacts, root)
    return Report([], problems, skipped)


def _terminated(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds like an error: local ranks are stopped, temporary files removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.graphs", description="regenerate (or --check) the golden captured graphs in graphs/"
    )
    parser.add_argument("--check", action="store_true", help="fail (exit 1) on drift instead of writing")
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
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        drift, problems, skipped = regenerate(Path(args.out), check=args.check, ge=not args.no_ge, acl=not args.no_acl)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if skipped and not args.no_ge:
        print(f"graphs: {skipped}", file=sys.stderr)
    for problem in problems:
        print(f"graphs: {problem}", file=sys.stderr)
    if drift:
        print(
            f"{len(drift)} graph artifacts drifted (run: python -m tools.graphs): " + ", ".join(drift[:10]),
            file=sys.stderr,
        )
    if drift or problems:
        return 1
    print(f"graphs: {'up to date' if args.check else 'written to ' + args.out}" + (" (aten only)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
