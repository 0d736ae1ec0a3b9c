"""Bytes each rank reads from a checkpoint with ``load_checkpoint``, for tp = 1, 2, 4.

    python -m benchmarks load [--layers 8] [--hidden 512]

Saves a random Qwen3-style model with transformers into a temp dir (no network), then loads every
coordinate's shard (each load is exactly what that rank does) and prints a markdown table of
bytes read against ``sharded_bytes / tp + replicated_bytes``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import transformers as T

from functional_npu import Mesh
from functional_npu.core import flatten_with_paths, leaf_specs
from functional_npu.models import llama
from functional_npu.runtime.loading import load_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks load", description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    hf_cfg = T.Qwen3Config(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        T.Qwen3ForCausalLM(hf_cfg).save_pretrained(tmp)
        cfg = llama.LlamaConfig.from_hf(json.loads((Path(tmp) / "config.json").read_text()))
        full = dict(flatten_with_paths(llama.abstract_params(cfg)))
        layouts = leaf_specs(llama.param_specs(cfg), llama.abstract_params(cfg))
        total = sum(x.numel() * 4 for x in full.values())
        replicated = sum(x.numel() * 4 for p, x in full.items() if layouts[p].is_replicated)
        print(
            f"Qwen3-style model: {sum(x.numel() for x in full.values()) / 1e6:.1f}M params, "
            f"{total / 2**20:.1f} MiB fp32, "
            f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, {cfg.num_layers} layers\n"
        )
        print("| tp | rank | bytes read | sharded/tp + replicated | read / full | load time |")
        print("|---|---|---|---|---|---|")
        for tp in args.tp:
            for rank in range(tp):
                read: list[int] = []
                t0 = time.perf_counter()
                load_checkpoint(tmp, Mesh.abstract({"tp": tp}, rank), on_read=lambda _, n, read=read: read.append(n))
                dt = time.perf_counter() - t0
                expect = (total - replicated) / tp + replicated
                print(f"| {tp} | {rank} | {sum(read):,} | {expect:,.0f} | {sum(read) / total:.3f} | {dt:.2f}s |")
