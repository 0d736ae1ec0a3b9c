"""Command line: ``python -m functional_npu demo``. Bad arguments are one clear line and exit code 2."""

from __future__ import annotations

import argparse
import os


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m functional_npu", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="shard a small model-shaped tree over local ranks and verify it (no network)")
    demo.add_argument("--dp", type=_positive, default=2, help="data-parallel ranks (the layer-sharding axis); default 2")
    demo.add_argument("--tp", type=_positive, default=2, help="tensor-parallel ranks; default 2")
    demo.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are stopped; default 600")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        if args.dp * args.tp > 4 * (os.cpu_count() or 1):
            build_parser().error(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} ranks is too many for {os.cpu_count()} cores")
        if 2 % args.tp and args.tp % 2:
            build_parser().error(f"--tp {args.tp}: the demo model has 2 KV heads, so tp must divide 2 or be a multiple of 2")
        from .demo import run_demo

        return run_demo(args.dp, args.tp, timeout=args.timeout)
    return 2  # pragma: no cover - argparse enforces the subcommand
