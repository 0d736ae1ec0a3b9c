"""Layer-sharded decode with prefetch on 2 gloo ranks: step time, exposed communication, resident memory.

    python benchmarks/bench_prefetch.py [--series o_proj] [--batch 8] [--layers 12] [--json FILE] [--plot FILE]

Writes an embedded Qwen3-style checkpoint (seeded random weights) to a temp dir first.
"""

import argparse
import dataclasses
import json
import tempfile

from functional_npu.cli.bench import FULL
from functional_npu.cli.bench_prefetch import prefetch_plot, prefetch_table, run_prefetch_bench
from functional_npu.models.llama import init_params
from functional_npu.runtime.save import save_checkpoint

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", default="o_proj")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=FULL.num_layers)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--plot", default="prefetch.png")
    args = ap.parse_args()
    cfg = dataclasses.replace(FULL, num_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(init_params(cfg, seed=0), tmp)
        res = run_prefetch_bench(tmp, series=args.series, batch=args.batch, steps=args.steps)
    print(prefetch_table(res))
    if prefetch_plot(res, args.plot):
        print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
