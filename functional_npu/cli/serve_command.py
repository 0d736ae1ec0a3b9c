"""``serve``: an OpenAI-compatible completions server for a checkpoint, on one rank.

``python -m functional_npu serve --model DIR`` loads the checkpoint, compiles it, sizes the paged KV pool from
``--kv-gb`` (or ``--blocks``), and serves ``/v1/completions`` and ``/health`` on 127.0.0.1:8000 until interrupted
(:mod:`functional_npu.runtime.serving.server`). Text prompts need the checkpoint's ``tokenizer.json``; token ids
always work. Requests that name no stop ids stop at the checkpoint's ``eos_token_id``.

With ``--tp N`` the ranks serve in lockstep (rank 0 runs the HTTP server); with ``--dp N`` the data-parallel ranks are
engine replicas, each serving requests of its own (``--layer-shard SERIES``: those series spread over them, each
layer fetched through the prefetch ring). A rank that dies ends every rank within
``--timeout`` (the world stops them all); the command prints why in one line and, when the server had come up, keeps
the port answering 503 with that reason until it is stopped (a client is told, not left waiting).
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from .args import nonnegative, positive, positive_number
from .tokenizer import read_tokenizer

__all__ = ["add_parser", "run_serve", "build_engine", "serve_plan"]


def add_parser(sub: Any) -> None:
    """The ``serve`` subcommand's arguments."""
    p = sub.add_parser("serve", help="serve a HF model directory over an OpenAI-compatible API (one rank)")
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on; default 127.0.0.1 (this machine)")
    p.add_argument("--port", type=positive, default=8000)
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel local ranks serving in lockstep")
    p.add_argument(
        "--dp", type=positive, default=1,
        help="data-parallel local ranks (times --tp): replicas serving requests of their own, in lockstep",
    )  # fmt: skip
    p.add_argument(
        "--layer-shard", metavar="SERIES", default=None,
        help="layer-shard these weight series over the --dp ranks (comma-separated, as generate's --layer-shard)",
    )  # fmt: skip
    p.add_argument(
        "--prefetch-step", type=nonnegative, default=None, metavar="K",
        help="with --layer-shard: fetch layer l+K's weights while layer l computes; default 1",
    )  # fmt: skip
    p.add_argument(
        "--timeout", type=positive_number("seconds"), default=60.0,
        help="seconds a rank waits for another before the server stops (a dead rank: 503 within it); default 60",
    )  # fmt: skip
    p.add_argument("--name", default=None, help="the model's name in responses; default the directory's name")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="read floating weights in this dtype")
    p.add_argument("--backend", default="auto", choices=["auto", "inductor", "torchair", "eager", "aot_eager", "none"])
    p.add_argument("--max-seq-len", type=positive, default=2048, help="the longest prompt plus new tokens")
    p.add_argument("--batch-sizes", type=positive, nargs="+", default=[1, 2, 4, 8, 16], help="decode batch buckets")
    p.add_argument("--chunk", type=positive, default=256, help="the prefill chunk (positions per prefill call)")
    p.add_argument("--block-size", type=positive, default=16, help="positions per KV block")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--kv-gb", type=positive_number("gigabytes"), default=None, help="the KV pool's memory (1e9 B)")
    pool.add_argument("--blocks", type=positive, default=None, help="the KV pool's blocks")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """What every rank needs to build its engine (picklable)."""
    keys = ("model", "dtype", "backend", "max_seq_len", "batch_sizes", "chunk", "block_size", "blocks", "kv_gb", "tp",
            "dp", "layer_shard", "prefetch_step", "timeout")  # fmt: skip
    return {k: getattr(args, k) for k in keys}


def serve_plan(o: dict[str, Any]) -> Any:
    """The plan of the options: tensor parallel over ``tp``, ``layer_shard`` series over ``dp`` fetched
    ``prefetch_step`` layers ahead (default one, as generate's)."""
    from ..parallel.layer_shard import layer_shard
    from ..parallel.plan import Plan
    from ..runtime.loading import read_config

    series = layer_shard(o["layer_shard"], "dp") if o["layer_shard"] else None
    step = o["prefetch_step"]
    if series is not None and step is None:
        step = min(1, read_config(o["model"]).num_layers - 1)
    return Plan(tp="tp", layer_shard=series, prefetch_step=step or 0)


def build_engine(ctx: Any, o: dict[str, Any]) -> Any:
    """This rank's compiled model and engine: in lockstep over ``dp x tp`` ranks when there are several, the ``dp``
    ranks replicas serving requests of their own (``--layer-shard``: the series spread over them)."""
    import torch

    from ..runtime.loading import load_checkpoint
    from ..runtime.serving import Engine, compile_model, stop_ids

    dp = o["dp"]
    mesh = ctx.mesh({"dp": dp, "tp": o["tp"]})
    dtype = getattr(torch, o["dtype"]) if o["dtype"] else None
    params = load_checkpoint(o["model"], mesh, serve_plan(o), dtype=dtype)
    model = compile_model(
        params, mesh, backend=o["backend"], batch_sizes=o["batch_sizes"], max_seq_len=o["max_seq_len"],
        prefill_lengths=sorted({o["chunk"], *(n for n in (16, 64) if n < o["chunk"])}),
    )  # fmt: skip
    kv_bytes = int(o["kv_gb"] * 1e9) if o["kv_gb"] is not None else None
    blocks = o["blocks"]
    if blocks is None and kv_bytes is None:  # neither given: room for 8 sequences of max_seq_len
        blocks = 8 * -(-o["max_seq_len"] // o["block_size"])
    return Engine(model, blocks=blocks, kv_bytes=kv_bytes, block_size=o["block_size"], chunk=o["chunk"],
                  stop=stop_ids(o["model"]), lockstep=dp * o["tp"] > 1, replicas="dp" if dp > 1 else None)  # fmt: skip


def serve_on_rank(ctx: Any, o: dict[str, Any], host: str, port: int, name: str) -> None:
    """A rank of the server: rank 0 serves HTTP until stopped, the others follow its calls."""
    from ..runtime.serving.server import serve

    engine = build_engine(ctx, o)
    if ctx.rank != 0:
        engine.follow()
        return
    tok, _ = read_tokenizer(Path(o["model"]))
    ranks = o["dp"] * o["tp"]
    replicas = f", {o['dp']} replicas" if o["dp"] > 1 else ""
    print(f"serving {name} on http://{host}:{port}/v1 ({ranks} rank(s){replicas}; pool: {engine.pool.size} blocks)",
          flush=True)  # fmt: skip
    serve(engine, name, host=host, port=port, tokenizer=tok, keepalive_s=o["timeout"] / 4)


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..runtime.launch import LocalWorld, RankContext
    from .errors import WORLD_ERRORS, world_failed

    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; pass a HF model directory")
    if args.chunk > args.max_seq_len:
        parser.error(f"--chunk {args.chunk} exceeds --max-seq-len {args.max_seq_len}; use a smaller chunk")
    if args.layer_shard is not None and args.dp < 2:
        parser.error(
            f"--layer-shard {args.layer_shard}: the series are spread over the --dp ranks; pass --dp 2 or more"
        )
    if args.prefetch_step is not None and args.layer_shard is None:
        parser.error("--prefetch-step needs --layer-shard (which weight series to fetch ahead)")
    try:  # the plan on the model's config, before any rank starts (a series it lacks, a tp its heads refuse)
        from ..placement import place
        from ..runtime.loading import read_config, read_quant

        place(read_config(Path(args.model)), {"dp": args.dp, "tp": args.tp}, serve_plan(_options(args)),
              read_quant(Path(args.model)), where=str(args.model))  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    name = args.name or Path(args.model).resolve().name
    if args.tp * args.dp == 1:
        try:
            serve_on_rank(RankContext(0, 1), _options(args), args.host, args.port, name)
        except ValueError as e:
            parser.error(str(e))
        return 0
    up = _Listening(args.host, args.port).start()  # whether rank 0's server came up, before any failure
    try:
        with LocalWorld(args.dp * args.tp, timeout=max(args.timeout, 120.0), pg_timeout=args.timeout) as world:
            world.run(serve_on_rank, _options(args), args.host, args.port, name, timeout=float("inf"))
    except WORLD_ERRORS as e:
        code = world_failed(e)
        if up.stop():  # it was serving: clients hear 503 and why, until the command is stopped
            from ..runtime.serving.server import serve_unavailable

            reason = "the server's ranks are gone: " + " ".join(str(e).split())
            print(f"answering 503 on http://{args.host}:{args.port} until stopped", file=sys.stderr, flush=True)
            serve_unavailable(reason, args.host, args.port)
        return code
    up.stop()
    return 0


class _Listening:
    """A thread that connects to ``host:port`` every half second until something listens there (rank 0's server)."""

    def __init__(self, host: str, port: int) -> None:
        self.address, self.seen, self._done = (host, port), threading.Event(), threading.Event()

    def start(self) -> _Listening:
        threading.Thread(target=self._watch, name="functional-npu-listening", daemon=True).start()
        return self

    def _watch(self) -> None:
        while not (self._done.is_set() or self.seen.is_set()):
            try:
                socket.create_connection(self.address, timeout=0.5).close()
                self.seen.set()
            except OSError:
                self._done.wait(0.5)

    def stop(self) -> bool:
        """Stop watching; whether the server had come up."""
        self._done.set()
        return self.seen.is_set()
