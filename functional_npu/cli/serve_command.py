"""``serve``: an OpenAI-compatible completions server for a checkpoint, on one rank.

``python -m functional_npu serve --model DIR`` loads the checkpoint, compiles it, sizes the paged KV pool from
``--kv-gb`` (or ``--blocks``), and serves ``/v1/completions`` and ``/health`` on 127.0.0.1:8000 until interrupted
(:mod:`functional_npu.runtime.serving.server`). Text prompts need the checkpoint's ``tokenizer.json``; token ids
always work. Requests that name no stop ids stop at the checkpoint's ``eos_token_id``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .args import positive, positive_number
from .tokenizer import read_tokenizer

__all__ = ["add_parser", "run_serve", "build_engine"]


def add_parser(sub: Any) -> None:
    """The ``serve`` subcommand's arguments."""
    p = sub.add_parser("serve", help="serve a HF model directory over an OpenAI-compatible API (one rank)")
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on; default 127.0.0.1 (this machine)")
    p.add_argument("--port", type=positive, default=8000)
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


def build_engine(args: argparse.Namespace) -> Any:
    """The compiled model and its engine for ``args`` (one rank)."""
    import torch

    from ..core.mesh import Mesh
    from ..runtime.loading import load_checkpoint
    from ..runtime.serving import Engine, compile_model, stop_ids

    one = Mesh.abstract({"tp": 1}, 0)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    params = load_checkpoint(args.model, one, dtype=dtype)
    model = compile_model(
        params, one, backend=args.backend, batch_sizes=args.batch_sizes, max_seq_len=args.max_seq_len,
        prefill_lengths=sorted({args.chunk, *(n for n in (16, 64) if n < args.chunk)}),
    )  # fmt: skip
    blocks = args.blocks if args.kv_gb is None else None
    blocks = blocks if blocks is not None or args.kv_gb is not None else 8 * -(-args.max_seq_len // args.block_size)
    kv_bytes = int(args.kv_gb * 1e9) if args.kv_gb is not None else None
    return Engine(model, blocks=blocks, kv_bytes=kv_bytes, block_size=args.block_size, chunk=args.chunk,
                  stop=stop_ids(args.model))  # fmt: skip


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..runtime.serving.server import serve

    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; pass a HF model directory")
    if args.chunk > args.max_seq_len:
        parser.error(f"--chunk {args.chunk} exceeds --max-seq-len {args.max_seq_len}; use a smaller chunk")
    try:
        engine = build_engine(args)
    except ValueError as e:
        parser.error(str(e))
    tok, _ = read_tokenizer(Path(args.model))
    name = args.name or Path(args.model).resolve().name
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (pool: {engine.pool.size} blocks)", flush=True)
    serve(engine, name, host=args.host, port=args.port, tokenizer=tok)
    return 0
