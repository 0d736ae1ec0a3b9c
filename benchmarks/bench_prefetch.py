"""Layer-sharded decode with prefetch on 2 gloo ranks, on the plain loopback and on an emulated link.

    python -m benchmarks prefetch [--series o_proj] [--batch 16] [--layers 6] [--ks 0,1,2,3]
                                  [--rate BITS] [--json FILE] [--plot FILE]

Writes an embedded Qwen3-style checkpoint (seeded random weights) to a temp dir, runs every
configuration (local weights, the prefetch schedule at each k, inductor's own scheduling choices) in
interleaved rounds on the plain loopback, then again inside a private network namespace whose
loopback runs at ``--rate`` bit/s (default: one layer's broadcast in one layer's measured compute),
where the host permits it. Prints both tables and the cost model's prediction against the
measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile

from functional_npu.models.llama import init_params
from functional_npu.runtime.loading import save_checkpoint

from .configs import QUICK
from .emulated_link import model_check, run_link_bench
from .flags import count
from .prefetch_runs import prefetch_plot, prefetch_table


def _check_table(name, res):
    check = model_check(res)
    rows = [f"| {r['k']} | {r['predicted']:.0%} | {r['measured']:.0%} | {r['error']:+.0%} |" for r in check["rows"]]
    return (
        f"\ncost model on the {name} figures (compute {res['per_layer_compute_s'] * 1e3:.2f} ms, broadcast "
        f"{res['per_layer_comm_s'] * 1e3:.2f} ms per layer): auto picks k = {check['auto_k']}\n"
        "| k | predicted exposed | measured | error |\n|---|---|---|---|\n" + "\n".join(rows)
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks prefetch", description=__doc__.splitlines()[0])
    ap.add_argument("--series", default="o_proj")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--ks", default="0,1,2,3")
    ap.add_argument("--steps", type=count, default=8)
    ap.add_argument("--repeat", type=count, default=5, help="interleaved rounds per configuration")
    ap.add_argument("--rate", type=int, default=None, help="emulated link rate in bit/s")
    ap.add_argument("--json")
    ap.add_argument("--plot", default="prefetch.png")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(QUICK, num_layers=args.layers)
    ks = tuple(int(k) for k in args.ks.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(init_params(cfg, seed=0), tmp)
        res = run_link_bench(
            tmp, series=args.series, ks=ks, batch=args.batch, steps=args.steps, repeat=args.repeat, rate_bits=args.rate
        )
    print("plain loopback:\n" + prefetch_table(res["loopback"]) + _check_table("loopback", res["loopback"]))
    if res["emulated"] is None:
        print(res["skipped"])
    else:
        print(f"\nemulated link, {res['rate_bits'] / 1e9:.2f} Gbit/s:\n" + prefetch_table(res["emulated"]))
        print(_check_table("emulated-link", res["emulated"]))
    if prefetch_plot(res["loopback"], args.plot, res["emulated"]):
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
