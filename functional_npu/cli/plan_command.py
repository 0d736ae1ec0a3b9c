"""``plan``: the planner on the command line, and ``generate --plan auto | FILE``.

``python -m functional_npu plan --model DIR --devices 8 --device 910b --memory-gb 32 --batch 64 --context 4096``
prints every candidate ranked by modelled step time (bytes per rank, fits or not), why the winner won, and the
chosen plan as JSON; ``--out FILE`` writes that JSON, which ``generate --plan FILE`` runs. ``generate --plan auto``
plans for this machine (:func:`functional_npu.runtime.planning.host_profile.host_device`, measured once and cached) with
``--devices`` ranks, the memory available to each, and the run's own prompts and new tokens as the workload.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from .args import positive, positive_number

__all__ = ["add_parser", "run_plan", "plan_for_generate"]

_DTYPES = ("bfloat16", "float16", "float32")


def add_parser(sub: Any) -> None:
    """The ``plan`` subcommand's arguments."""
    p = sub.add_parser("plan", help="choose the fastest plan that fits: every candidate ranked, the chosen plan")
    p.add_argument("--model", required=True, help="HF model directory (its config.json and quantization_config)")
    p.add_argument("--devices", type=positive, required=True, help="how many devices the model runs on")
    p.add_argument("--device", default="host", help="device profile: 910b, 910c, h100, or host (this machine)")
    p.add_argument(
        "--memory-gb",
        type=positive_number("gigabytes"),
        default=None,
        help="memory per device in GB (1e9 bytes); default: the profile's (host: what is available now)",
    )
    p.add_argument("--batch", type=positive, default=1, help="sequences per step (decode) or prompts (prefill)")
    work = p.add_mutually_exclusive_group(required=True)
    work.add_argument("--context", type=positive, help="decode: tokens already in each sequence's cache")
    work.add_argument("--prefill", type=positive, metavar="LENGTH", help="prefill prompts of this many tokens")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="weights' and cache's dtype (default bfloat16)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON instead of the table")
    p.add_argument("--out", metavar="FILE", help="write the chosen plan here (for generate --plan FILE)")


def _available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``python -m functional_npu plan``: the ranked table (or ``--json``), why, and the chosen plan's JSON."""
    if args.out is not None:
        _check_out(args.out, parser)
    try:
        chosen, report = _choose(args, parser)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = chosen.to_json()
    if args.json:
        print(json.dumps(report.to_dict() | {"plan_file": json.loads(out)}, indent=1))
    else:
        print(report.table())
        print(f"\nchosen: {report.why()}\n")
        print(out)
    if args.out is not None:
        try:
            _write_atomically(Path(args.out), out + "\n")
        except OSError as e:
            print(f"error: --out {args.out}: cannot write the plan file ({e.strerror or e})", file=sys.stderr)
            return 2
    return 0


def _choose(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, Any]:
    """The planner's choice and report for the ``plan`` command's model, devices, memory and workload."""
    import torch

    from ..parallel.devices import device as device_profile
    from ..runtime.loading import read_config, read_quant
    from ..runtime.planning import MAX_DEVICES, Workload, choose_plan, host_device

    if args.devices > MAX_DEVICES:  # before measuring anything
        raise ValueError(
            f"--devices {args.devices}: the planner weighs at most {MAX_DEVICES} devices (its work grows "
            f"with them); plan one node's or one replica's devices and repeat that plan over the rest"
        )
    cfg, quant = read_config(args.model), read_quant(args.model)
    positions = args.context + 1 if args.context else args.prefill
    if positions > cfg.max_position_embeddings:
        flag = f"--context {args.context}" if args.context else f"--prefill {args.prefill}"
        raise ValueError(
            f"{flag}: the step needs {positions} positions, past the model's {cfg.max_position_embeddings} "
            f"(max_position_embeddings); give at most {cfg.max_position_embeddings - (1 if args.context else 0)}"
        )
    dev = device_profile(args.device)
    if dev.name == "host":
        dev = host_device(args.devices)
    memory = args.memory_gb * 1e9 if args.memory_gb else dev.memory_bytes
    if dev.name == "host" and not args.memory_gb:
        memory = _available_bytes() / args.devices
    if not memory:
        parser.error(f"--memory-gb: the {dev.name} profile states no memory per device; give one")
    dtype = getattr(torch, args.dtype or "bfloat16")
    work = (
        Workload.decode(args.batch, args.context, dtype)
        if args.context
        else Workload.prefill(args.prefill, args.batch, dtype)
    )
    return choose_plan(cfg, args.devices, dev, memory, work, quant=quant)


def _check_out(out: str, parser: argparse.ArgumentParser) -> None:
    """``--out`` names a file that can be written, before anything is planned or printed."""
    path = Path(out)
    if not out:
        parser.error("--out: expected the path of the plan file to write, got ''")
    if path.is_dir():
        parser.error(f"--out {out}: is a directory; give a file path such as {path / 'plan.json'}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        parser.error(f"--out {out}: the directory {parent} does not exist; create it or give another path")
    if not os.access(parent, os.W_OK):
        parser.error(f"--out {out}: the directory {parent} is not writable; give another path")


def _write_atomically(path: Path, text: str) -> None:
    """``text`` to ``path`` through a temporary file beside it: a full device leaves the old file (or none)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        tmp = Path(f.name)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def plan_for_generate(args: argparse.Namespace, cfg: Any, quant: Any, prompts: list) -> Any:
    """The :class:`~functional_npu.placement.Placement` for ``generate --plan auto | FILE``: planned for this machine
    at ``--devices`` ranks with the run's prompts as the workload, or read from the file (refused if it is for
    another model, or another number of ranks than ``--devices``)."""
    import torch

    from ..placement import read_placement
    from ..runtime.planning import Workload, choose_plan, host_device

    if args.plan_from != "auto":
        placed = read_placement(args.plan_from, cfg, quant, where=f"--plan {args.plan_from}")
        n = math.prod(placed.mesh_shape.values())
        if args.devices is not None and args.devices != n:
            raise ValueError(
                f"--plan {args.plan_from}: the plan is for {n} devices ({placed.mesh_shape}), not --devices "
                f"{args.devices}"
            )
        return placed
    devices = args.devices or 1
    dtype = getattr(torch, args.dtype or "float32")
    longest = max(len(p) for p in prompts)
    work = Workload.decode(len(prompts), longest + args.max_new_tokens, dtype)
    chosen, report = choose_plan(cfg, devices, host_device(devices), _available_bytes() / devices, work, quant=quant)
    print(f"plan: {report.why()}", file=sys.stderr)
    return chosen
