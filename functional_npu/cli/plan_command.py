"""``plan``: the planner on the command line, and ``generate --plan auto | FILE``.

``python -m functional_npu plan --model DIR --devices 8 --device 910b --memory-gb 32 --batch 64 --context 4096``
prints every candidate ranked by modelled step time (bytes per rank, bottleneck, fits or not), why the winner won,
and the chosen plan as JSON; ``--serve CONTEXT`` (with ``--prompt-share`` and ``--max-seqs``) ranks them instead
by the tokens/s per device each serves at the batch the memory admits. ``--out FILE`` writes the JSON, which
``generate --plan FILE`` runs. ``generate --plan auto`` plans for this machine
(:func:`functional_npu.runtime.planning.host_profile.host_device`, measured once and cached) with ``--devices``
ranks, the memory available to each, and the run's own prompts and new tokens as the workload.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

from .args import positive, positive_number

__all__ = ["add_parser", "run_plan", "plan_for_generate", "plan_check", "PLAN_CHECK_TOLERANCE"]

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
    p.add_argument("--batch", type=positive, default=None, help="sequences per step (decode) or prompts (prefill)")
    work = p.add_mutually_exclusive_group(required=True)
    work.add_argument("--context", type=positive, help="decode: tokens already in each sequence's cache")
    work.add_argument("--prefill", type=positive, metavar="LENGTH", help="prefill prompts of this many tokens")
    work.add_argument(
        "--serve",
        type=positive,
        metavar="CONTEXT",
        help="serving: sequences of CONTEXT positions (prompt and generated), as many at once as the memory left "
        "after the weights admits; plans are ranked by tokens/s per device",
    )
    p.add_argument(
        "--prompt-share",
        type=float,
        default=None,
        help="with --serve: the share of the tokens processed that are prompt tokens, in [0, 1) (default 0: "
        "decode alone)",
    )
    p.add_argument("--max-seqs", type=int, default=None, help="with --serve: at most this many sequences at once")
    p.add_argument("--dtype", choices=_DTYPES, default=None, help="weights' and cache's dtype (default bfloat16)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON instead of the table")
    p.add_argument("--out", metavar="FILE", help="write the chosen plan here (for generate --plan FILE)")


def _available_bytes() -> float:
    """The host memory available now, or all of it where that cannot be known."""
    from ..parallel.offload import available_host_bytes

    available = available_host_bytes()
    return float(available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


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
        from ..core.files import write_bytes  # whole or not at all: a full device leaves the old file (or none)

        try:
            write_bytes(Path(args.out), (out + "\n").encode())
        except OSError as e:
            print(f"error: --out {args.out}: cannot write the plan file ({e.strerror or e})", file=sys.stderr)
            return 2
    return 0


def _choose(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, Any]:
    """The planner's choice and report for the ``plan`` command's model, devices, memory and workload."""
    import torch

    from ..parallel.devices import device as device_profile
    from ..runtime.loading import read_config, read_quant
    from ..runtime.planning import MAX_DEVICES, MAX_MEMORY, Workload, choose_plan, host_device

    if args.devices > MAX_DEVICES:  # before measuring anything
        raise ValueError(
            f"--devices {args.devices}: the planner weighs at most {MAX_DEVICES} devices (its work grows "
            f"with them); plan one node's or one replica's devices and repeat that plan over the rest"
        )
    work_options(args, parser)
    cfg, quant = read_config(args.model), read_quant(args.model)
    flag, positions = _positions(args)
    if positions > cfg.max_position_embeddings:
        raise ValueError(
            f"{flag}: the step needs {positions} positions, past the model's {cfg.max_position_embeddings} "
            f"(max_position_embeddings); give at most {cfg.max_position_embeddings - (1 if args.context else 0)}"
        )
    dev = device_profile(args.device)
    if dev.name == "host":
        dev = host_device(args.devices)
    # exact decimal bytes: the figure a refusal names (rounded up) is accepted when given back
    memory = int(Decimal(repr(args.memory_gb)) * 10**9) if args.memory_gb else dev.memory_bytes
    if args.memory_gb and not 1 <= memory <= MAX_MEMORY:
        parser.error(
            f"--memory-gb {args.memory_gb!r}: outside [1e-09, {MAX_MEMORY / 1e9:.0e}] GB (a byte to an exabyte per "
            f"device); give a device's memory in GB (e.g. 64)"
        )
    if dev.name == "host" and not args.memory_gb:
        memory = _available_bytes() / args.devices
    if not memory:
        parser.error(f"--memory-gb: the {dev.name} profile states no memory per device; give one")
    dtype = getattr(torch, args.dtype or "bfloat16")
    if args.serve:
        work = Workload.serve(args.serve, args.prompt_share or 0.0, args.max_seqs, dtype)
    elif args.context:
        work = Workload.decode(args.batch or 1, args.context, dtype)
    else:
        work = Workload.prefill(args.prefill, args.batch or 1, dtype)
    return choose_plan(cfg, args.devices, dev, memory, work, quant=quant)


def work_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The workload's options agree: ``--prompt-share`` and ``--max-seqs`` go with ``--serve`` (which sizes its
    own batch), each in range; one line each, before anything is read."""
    if not args.serve:
        for flag, value in (("--prompt-share", args.prompt_share), ("--max-seqs", args.max_seqs)):
            if value is not None:
                parser.error(f"{flag} goes with --serve CONTEXT (a serving workload); drop it or plan with --serve")
        return
    if args.batch is not None:
        parser.error("--batch: a serving workload sizes its own batch from the memory; cap it with --max-seqs")
    share = args.prompt_share
    if share is not None and not 0 <= share < 1:
        parser.error(
            f"--prompt-share {share}: the share of tokens that are prompt tokens is a number in [0, 1) (0: decode "
            f"alone)"
        )
    if share is not None and round(share * args.serve) >= args.serve:
        parser.error(f"--prompt-share {share}: leaves no generated token in a context of {args.serve}")
    if args.max_seqs is not None and args.max_seqs < 1:
        parser.error(f"--max-seqs {args.max_seqs}: caps the sequences served at once; give a positive number")


def _positions(args: argparse.Namespace) -> tuple[str, int]:
    """The workload's flag and the positions one sequence needs."""
    if args.serve:
        return f"--serve {args.serve}", args.serve
    if args.context:
        return f"--context {args.context}", args.context + 1
    return f"--prefill {args.prefill}", args.prefill


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
    from ..core.files import NotARegularFile, check_target

    try:
        check_target(path)
    except NotARegularFile as e:
        parser.error(f"--out {out}: {e.strerror}")


def plan_for_generate(args: argparse.Namespace, cfg: Any, quant: Any, prompts: list) -> Any:
    """The :class:`~functional_npu.placement.Placement` for ``generate --plan auto | FILE``: planned for this machine
    at ``--devices`` ranks with the run's prompts as a serving workload (their context and prompt share, at most as
    many sequences at once as prompts), or read from the file (refused if it is for
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
    context = longest + args.max_new_tokens  # served: the run's prompts, each to its whole context, all at once
    work = Workload.serve(context, round(longest / context, 6), len(prompts), dtype)
    chosen, report = choose_plan(cfg, devices, host_device(devices), _available_bytes() / devices, work, quant=quant)
    print(f"plan: {report.why()}", file=sys.stderr)
    args.plan_prediction = report.chosen.decode  # the decode step the run's own will be checked against
    return chosen


# a measured decode step further than this from the prediction (as a share of it) is warned about: the host
# profile's validation runs put the step model within -12% to +62% of the measured steps
PLAN_CHECK_TOLERANCE = 0.75


def plan_check(predicted: Any, measured_s: float | None) -> tuple[dict[str, Any], str | None]:
    """``generate --plan auto``'s check of its choice: the run's measured decode step against the planner's
    prediction (``predicted``: the chosen plan's decode :class:`~functional_npu.runtime.planning.Estimate`).
    Returns the JSON record and, when the error passes :data:`PLAN_CHECK_TOLERANCE`, a one-line warning naming
    the term of the model that the step was predicted to wait on (the one that missed)."""
    parts = {k: v * 1e3 for k, v in predicted.parts.items()}
    record: dict[str, Any] = {
        "predicted_decode_ms": predicted.step_s * 1e3,
        "measured_decode_ms": None if measured_s is None else measured_s * 1e3,
        "error": None,
        "tolerance": PLAN_CHECK_TOLERANCE,
        "term": predicted.bottleneck,
        "predicted_parts_ms": parts,
    }
    if measured_s is None:  # one new token: no decode step to time
        return record, None
    record["error"] = error = measured_s / predicted.step_s - 1
    if abs(error) <= PLAN_CHECK_TOLERANCE:
        return record, None
    return record, (
        f"warning: plan check: the decode step took {measured_s * 1e3:.3g} ms against {predicted.step_s * 1e3:.3g} "
        f"ms predicted ({error:+.0%}, tolerance {PLAN_CHECK_TOLERANCE:.0%}); the model's {predicted.bottleneck} "
        f"term missed: the plan was chosen on figures this run does not match (re-measure the host profile by "
        f"removing $FUNCTIONAL_NPU_CACHE/host-profile, or plan with --plan FILE)"
    )
