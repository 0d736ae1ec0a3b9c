"""Command line: ``python -m functional_npu {demo,plan,serve,generate}``, what a user runs for a model.

Bad arguments are one clear line and exit code 2. ``generate`` starts ``dp x tp`` local gloo ranks
itself, or joins the world of ``torchrun`` (env:// init, so it also works across nodes). The
benchmarks and the golden-graph tool live outside the package, in the repository: ``python -m
benchmarks NAME`` and ``python -m tools.graphs``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from .args import positive, positive_number
from .plan_command import add_parser as add_plan_parser
from .serve_command import add_parser as add_serve_parser
from .tokenizer import read_tokenizer

_seconds = positive_number("seconds")


def _step(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or 'auto', got {text!r}") from None


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids like 1,2,3, got {text!r}")
    return ids


_MODULE_FLAGS = {"o_proj": "--otp", "lm_head": "--lmhead-tp", "embed": "--embed-tp", "mlp": "--mlp-tp"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m functional_npu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="embedded model: eager on 1 rank vs compiled on tp ranks (no network)")
    demo.add_argument("--tp", type=positive, default=2, help="tensor-parallel ranks for the compiled run; default 2")
    demo.add_argument("--max-new-tokens", type=positive, default=24)
    demo.add_argument(
        "--timeout", type=_seconds, default=600.0, help="seconds before the ranks are stopped; default 600"
    )
    demo.add_argument(
        "--quant",
        choices=("int8", "int4"),
        help="run the model from a compressed-tensors checkpoint: int8 per channel or int4 in groups of 32 "
        "(weight-only), instead of the layer-sharded part",
    )
    demo.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="save the compiled runs' graphs here; a later demo with the same flags loads them",
    )
    demo.add_argument(
        "--post-train",
        action="store_true",
        help="instead: one round of the post-training loop on 2 ranks (sample, reward, GRPO train step, reshard "
        "to the inference plan, sample again)",
    )

    add_plan_parser(sub)
    add_serve_parser(sub)
    gen = sub.add_parser(
        "generate", help="generate from a HF model directory on dp x tp local ranks (or under torchrun)"
    )
    gen.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    gen.add_argument("--dp", type=positive, default=1, help="data-parallel ranks: prompts are split across them")
    gen.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="read floating weights in this dtype (default: as stored; a quantized checkpoint's integer "
        "tensors keep theirs, its scales and activations take this one)",
    )
    gen.add_argument("--tp", type=positive, default=1, help="tensor-parallel ranks")
    gen.add_argument(
        "--ep",
        type=positive,
        default=1,
        help="expert-parallel ranks (MoE models): 1 (experts on every rank) or dp x tp (the flattened dp, tp ranks)",
    )
    for module, flag in _MODULE_FLAGS.items():
        gen.add_argument(
            flag,
            type=positive,
            default=1,
            dest=f"{module}_tp",
            metavar="N",
            help=f"{module} tensor-parallel over this many consecutive dp ranks too (module TP; divides --dp)",
        )
    gen.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "inductor", "torchair", "eager", "aot_eager", "none"],
        help="compiler backend ('none': the plain eager forward, no compile)",
    )
    gen.add_argument(
        "--mode",
        default=None,
        help="the backend's mode (default: the one measured fastest on the device); inductor: default (Python "
        "wrapper), reduce-overhead (C++ wrapper on CPU, CUDA graphs on CUDA), max-autotune, "
        "max-autotune-no-cudagraphs; torchair: max-autotune (GE graph), reduce-overhead (captured graph)",
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", nargs="+", metavar="TEXT", help="prompt texts (needs the model's tokenizer.json)")
    src.add_argument(
        "--prompt-ids", type=_ids, action="append", metavar="1,2,3", help="a prompt as token ids; repeat for more"
    )
    gen.add_argument("--max-new-tokens", type=positive, required=True)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-k", type=positive, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--layer-shard",
        metavar="SERIES",
        default=None,
        help=(
            "layer-shard these weight series over --layer-shard-axis: comma-separated from q_proj (qkv), o_proj, "
            "gate_up, down_proj, q_b_proj and kv_b_proj (MLA), layer (the whole block)"
        ),
    )
    gen.add_argument(
        "--layer-shard-axis",
        default=None,
        choices=["dp", "tp"],
        help="the mesh axis layer l's weights are spread over (l %% n); default dp (with module TP: the dp "
        "ranks outside the module TP groups, so a module-TP'd weight is layer-sharded over its replicas)",
    )
    gen.add_argument(
        "--offload",
        metavar="SERIES",
        default=None,
        help=(
            "keep these weight series whole in host memory (pinned on an accelerator) and copy each layer's into the "
            "prefetch ring --prefetch-step layers ahead: names as for --layer-shard"
        ),
    )
    gen.add_argument(
        "--prefetch-step",
        type=_step,
        default=None,
        metavar="K",
        help=(
            "with --layer-shard or --offload: fetch layer l+K's weights while layer l computes (0 <= K <= layers-2), "
            "or 'auto' (the cost model picks K); default 1 (0 for a 2-layer model)"
        ),
    )
    gen.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="save the compiled graphs here (a subdirectory per rank) and load them in a later run of the same "
        "model, plan, ranks, shapes and backend: a warm start skips the compiler",
    )
    gen.add_argument(
        "--plan",
        dest="plan_from",
        metavar="auto|FILE",
        default=None,
        help="run the planner's choice for this machine ('auto', over --devices ranks) or a plan file written by "
        "python -m functional_npu plan --out; it sets the mesh and the plan (no --dp, --tp, --ep, module TP or "
        "--layer-shard with it)",
    )
    gen.add_argument("--devices", type=positive, default=None, help="with --plan: the ranks to plan for")
    gen.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": [...], "timings": {...}}')
    gen.add_argument("--timeout", type=_seconds, default=1800.0, help="seconds before local ranks are stopped")
    return parser


def _prepare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[list[int]], Any]:
    """Validate everything a rank would trip on, before any rank starts: the flags, the model, the prompts and the
    sampling; ``args.placement`` is then the run's mesh and plan, checked on the model."""
    from ..runtime.loading import read_config, read_quant

    model = Path(args.model)
    module_tp = _check_flags(args, parser)
    try:
        cfg, quant = read_config(model), read_quant(model)
        if args.plan_from is None:
            args.placement = _placement_of_flags(args, cfg, quant, module_tp)
    except (OSError, ValueError) as e:
        parser.error(" ".join(str(e).split()))  # one line, whatever the message
    prompts, tok = _prompts(args, parser, model)
    _check_generation(args, parser, cfg, prompts)
    if args.plan_from is not None:  # the planner's (or a plan file's) mesh and plan replace the flags'
        from .plan_command import plan_for_generate

        try:
            args.placement = plan_for_generate(args, cfg, quant, prompts)
        except (OSError, ValueError) as e:
            parser.error(" ".join(str(e).split()))
    from ..models import check_invariant_model

    try:  # the invariant mode's refusals that need no weights: here, not after every rank has loaded
        where = f"--plan {args.plan_from}" if args.plan_from is not None else str(args.model)
        check_invariant_model(cfg, quant, args.placement.plan, where)
    except ValueError as e:
        parser.error(" ".join(str(e).split()))
    if args.plan_from is not None:  # in --dtype, else as stored (a 1-byte budget once got past this to the ranks)
        import torch

        from ..placement.ring_memory import check_ring_budget

        try:
            dtype = getattr(torch, args.dtype) if args.dtype is not None else None
            check_ring_budget(args.placement, f"--plan {args.plan_from}", dtype)
        except ValueError as e:
            parser.error(str(e))
    return prompts, tok


def _check_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The flags' own consistency (no file read); returns the module-TP plan the flags give."""
    from ..parallel.module_tp import MODULES

    sizes = {m: getattr(args, f"{m}_tp") for m in MODULES if getattr(args, f"{m}_tp") > 1}
    if args.plan_from is not None:
        given = [f for f, v in (("--dp", args.dp > 1), ("--tp", args.tp > 1), ("--ep", args.ep > 1)) if v]
        given += [_MODULE_FLAGS[m] for m in sizes]
        given += [
            f
            for f, v in (
                ("--layer-shard", args.layer_shard),
                ("--offload", args.offload),
                ("--prefetch-step", args.prefetch_step),
            )
            if v
        ]
        if given:
            parser.error(f"--plan {args.plan_from} sets the mesh and the plan; drop {', '.join(given)}")
    elif args.devices is not None:
        parser.error("--devices is the number of ranks --plan plans for; without --plan give --dp and --tp")
    module_tp = _module_tp(args, parser, sizes)
    if args.offload is not None and not args.offload.replace(",", "").strip():  # Plan(offload="") is no offload
        parser.error(
            f"--offload {args.offload!r}: names no weight series; give them (e.g. --offload o_proj,down) or drop it"
        )
    if args.layer_shard is None and args.offload is None and args.prefetch_step is not None:
        parser.error("--prefetch-step needs --layer-shard or --offload (which weight series to fetch ahead)")
    if args.layer_shard is None and args.layer_shard_axis is not None:
        parser.error("--layer-shard-axis needs --layer-shard (which weight series to spread over the axis)")
    if args.temperature == 0:
        unused = [
            f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed)) if v is not None
        ]
        if unused:
            parser.error(
                f"{', '.join(unused)}: greedy decoding (--temperature 0, the default) does not sample; "
                "pass --temperature > 0 to sample, or drop them"
            )
    if args.cache_dir is not None and args.backend == "none":
        parser.error("--cache-dir saves compiled graphs, but --backend none compiles nothing; drop one of them")
    if args.cache_dir == "":
        parser.error("--cache-dir: expected a directory for the saved graphs, got ''")
    ranks = args.dp * args.tp if args.plan_from is None else (args.devices or 1)
    if args.mode == "reduce-overhead" and args.backend in ("auto", "inductor") and ranks > 1:
        parser.error(
            f"--mode reduce-overhead on the CPU is inductor's C++ wrapper, which cannot compile the collectives of "
            f"{ranks} ranks; use --mode default (the CPU's fastest) or one rank"
        )
    return module_tp


def _module_tp(args: argparse.Namespace, parser: argparse.ArgumentParser, sizes: dict[str, int]) -> Any:
    """The mesh's axes (``args.axes``: dp split for module TP) and the module-TP plan of ``--otp`` and the like,
    checked against ``--dp`` and ``--ep``."""
    from ..parallel.module_tp import split_dp

    for m, n in sizes.items():
        if n > args.dp or args.dp % n:
            divisors = [d for d in range(1, args.dp + 1) if args.dp % d == 0]
            parser.error(
                f"{_MODULE_FLAGS[m]} {n}: the {m} TP group is a chunk of dp ranks, so it must divide --dp {args.dp}; "
                f"use one of {divisors}"
            )
    if sizes and args.ep > 1:
        parser.error(
            f"--ep {args.ep} with module TP ({', '.join(_MODULE_FLAGS[m] for m in sizes)}): experts and module TP "
            "over the same dp ranks is not supported; drop one of them"
        )
    if args.ep not in (1, args.dp * args.tp):
        parser.error(
            f"--ep {args.ep}: the expert group is the flattened dp x tp ranks, so --ep must be 1 (experts "
            f"replicated) or --dp {args.dp} x --tp {args.tp} = {args.dp * args.tp}"
        )
    try:
        args.axes, module_tp = split_dp({"dp": args.dp, "tp": args.tp}, sizes)
    except ValueError as e:
        parser.error(str(e))
    return module_tp


def _placement_of_flags(args: argparse.Namespace, cfg: Any, quant: Any, module_tp: Any) -> Any:
    """The placement ``--dp --tp --ep``, module TP and ``--layer-shard`` give, checked on the model."""
    from ..parallel.layer_shard import layer_shard
    from ..parallel.plan import Plan
    from ..placement import place

    series = layer_shard(args.layer_shard, args.layer_shard_axis or "dp") if args.layer_shard else None
    step = args.prefetch_step
    if (series is not None or args.offload) and step is None:
        step = min(1, cfg.num_layers - 1)
    plan = Plan(
        expert_axes=("dp", "tp") if args.ep > 1 else (),
        module_tp=module_tp,
        layer_shard=series,
        offload=args.offload,
        prefetch_step=step or 0,
    )
    return place(cfg, args.axes, plan, quant, where=str(args.model))


def _prompts(args: argparse.Namespace, parser: argparse.ArgumentParser, model: Path) -> tuple[list[list[int]], Any]:
    """The prompts as token ids, and the tokenizer (None without one)."""
    tok, why = read_tokenizer(model)
    if args.prompt is not None:
        if tok is None:
            parser.error(f"--prompt needs the model's tokenizer, but {why}; pass --prompt-ids instead")
        return [tok.encode(t).ids for t in args.prompt], tok
    if tok is None and (model / "tokenizer.json").is_file():  # ids need no tokenizer: without one, ids only
        print(f"warning: {why}; printing token ids only", file=sys.stderr)
    return args.prompt_ids, tok


def _check_generation(args: argparse.Namespace, parser: argparse.ArgumentParser, cfg: Any, prompts: list) -> None:
    """The API's own checks, before any rank starts or any cache is allocated, in the flags' names."""
    from ..runtime.serving.backends import resolve_backend
    from ..runtime.serving.generate import check_length, check_sampling, check_token_ids

    try:
        resolve_backend(args.backend, mode=args.mode)
        check_token_ids(prompts, cfg.vocab_size)
        check_length(max(len(p) for p in prompts), args.max_new_tokens, cfg.max_position_embeddings)
        check_sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        flags = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k"}
        flags |= {"top_p": "--top-p", "seed": "--seed"}
        parser.error(re.sub("|".join(flags), lambda m: flags[m.group(0)], str(e)))


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..runtime.launch import LocalWorld, RankContext
    from .errors import WORLD_ERRORS, world_failed
    from .runner import generate_on_rank, in_prompt_order

    prompts, tok = _prepare(args, parser)
    placed = args.placement
    axes = placed.mesh_shape  # dp split for module TP, if any
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
    job = (generate_on_rank, str(args.model), axes, prompts, args.max_new_tokens)
    extra = {
        "backend": args.backend,
        "mode": args.mode,
        "sampling": sampling,
        "plan": placed,
        "dtype": args.dtype,
        "progress": False if args.json else None,  # a bar on a terminal, never under --json
        "cache_dir": args.cache_dir,
        "time_steps": getattr(args, "plan_prediction", None) is not None,
    }
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: join its world
        import torch.distributed as dist

        world = int(os.environ["WORLD_SIZE"])
        if world != math.prod(axes.values()):
            parser.error(f"torchrun started {world} ranks but the mesh {axes} has {math.prod(axes.values())}")
        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=args.timeout))
        results: list[Any] = [None] * world
        try:
            mine = job[0](RankContext(dist.get_rank(), world), *job[1:], **extra)
            dist.all_gather_object(results, mine)
            rank = dist.get_rank()
        finally:  # tear the group down here, not in the interpreter's exit (a gloo thread there can abort it)
            dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        try:
            with LocalWorld(math.prod(axes.values()), timeout=args.timeout) as world_:
                results = world_.run(*job, **extra)
        except WORLD_ERRORS as e:  # one line: the rank's whole message, not its traceback
            return world_failed(e)
    tokens = in_prompt_order(results, len(prompts))
    text = [tok.decode(t) for t in tokens] if tok is not None else [None] * len(tokens)
    names = dict.fromkeys(k for r in results for k in r["timings"])  # every rank's, in the order they were taken
    timings = {k: max(r["timings"].get(k, 0.0) for r in results) for k in names}
    step = results[0].get("prefetch_step", 0) if placed.plan.layer_shard is not None else None
    check = _plan_check(args, timings)
    if args.json:
        out = {"token_ids": tokens, "text": text, "timings": timings} | check
        print(json.dumps(out if step is None else out | {"prefetch_step": step}))
    else:
        for i, (t, s) in enumerate(zip(tokens, text)):
            print(f"[{i}] {t}" + (f"  {s!r}" if s is not None else ""))
        if step is not None and args.prefetch_step == "auto":
            print(f"prefetch step: {step} (chosen by the cost model)")
        print("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    return 0


def _plan_check(args: argparse.Namespace, timings: dict[str, float]) -> dict[str, Any]:
    """``--plan auto``: the measured decode step against the prediction, for the JSON (``plan_check``); a miss past
    the tolerance is one warning line on stderr."""
    predicted = getattr(args, "plan_prediction", None)
    if predicted is None:
        return {}
    from .plan_command import plan_check

    record, warning = plan_check(predicted, timings.get("decode_step_s"))
    if warning:
        print(warning, file=sys.stderr)
    return {"plan_check": record}


def _check_post_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``demo --post-train`` runs its own round on 2 ranks: the demo's other options would be silently unused."""
    defaults = {"tp": 2, "max_new_tokens": 24, "quant": None, "cache_dir": None}
    given = [f"--{k.replace('_', '-')}" for k, v in defaults.items() if getattr(args, k) != v]
    if given:
        parser.error(f"demo --post-train runs one fixed round on 2 ranks; it takes no {', '.join(given)} (drop them)")


def _terminated(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds like an error: local ranks are stopped, temporary files removed


def main(argv: list[str] | None = None) -> int:
    """The command line; a SIGTERM stops the run cleanly (exit 143), a Ctrl-C too, in one line (exit 130)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _run(args, parser)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command == "serve":
        from .serve_command import run_serve

        return run_serve(args, parser)
    if args.command == "plan":
        from .plan_command import run_plan

        return run_plan(args, parser)
    if args.command == "demo":
        if not args.post_train and (args.tp > 2 * (os.cpu_count() or 1) or 4 % args.tp):
            parser.error(f"--tp {args.tp}: the demo model has 4 heads; use 1, 2 or 4 ranks")
        if args.post_train:
            from .post_train import run_post_train

            _check_post_train(args, parser)

            return run_post_train(timeout=args.timeout)
        from .demo import run_demo

        return run_demo(args.tp, args.max_new_tokens, timeout=args.timeout, quant=args.quant, cache_dir=args.cache_dir)
    return _generate(args, parser)
