"""Golden captured graphs: each family's prefill and decode graph at the aten level, per mesh config.

The graphs are captured as the torchair path traces them (math attention, see ``compile_model``),
so the op census is what torchair must convert. Besides each family at tp 1 and 2, a layer-sharded
Qwen3 (``o_proj`` and ``down`` over dp = 2, prefetch step 1, rank 0's graph) shows the prefetch
broadcasts and the carried weights in program order.

For every artifact ``graphs/<family>-tp<N>-<phase>/``: ``census.json`` (op -> count),
``collectives.json`` (the ordered collective schedule: op, mesh axis, bytes), ``summary.json``
(node and collective counts) and ``graph.txt`` (the FX graph). ``python -m functional_npu graphs``
regenerates them; ``--check`` (and the test suite) fails on drift that was not regenerated.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ..core.shard import shard
from ..models import family_of, forward, init_state, llama, moe
from ..parallel import prefetch
from ..parallel.layer_shard import layer_shard, series_specs, stack_series
from ..runtime.launch import LocalWorld, RankContext

__all__ = ["GRAPH_CONFIGS", "capture_artifacts", "write_artifacts", "diff_artifacts", "regenerate"]

_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=256,
)
_MOE = dict(num_experts=8, top_k=2, moe_intermediate_size=32, moe_layers=(0, 1), expert_axes=("tp",))  # experts over tp
GRAPH_CONFIGS: dict[str, llama.LlamaConfig | moe.MoeConfig] = {
    "llama": llama.LlamaConfig(
        architecture="LlamaForCausalLM", tie_word_embeddings=True, rope_type="llama3", rope_factor=8.0, **_BASE
    ),
    "mistral": llama.LlamaConfig(architecture="MistralForCausalLM", sliding_window=8, **_BASE),
    "qwen2": llama.LlamaConfig(architecture="Qwen2ForCausalLM", qkv_bias=True, **_BASE),
    "qwen3": llama.LlamaConfig(architecture="Qwen3ForCausalLM", qk_norm=True, **_BASE),
    # prefill (16 tokens per rank) takes the all_to_all dispatch, decode (1 per rank) the gather / reduce-scatter path
    "qwen3_moe": moe.MoeConfig(
        architecture="Qwen3MoeForCausalLM",
        base=llama.LlamaConfig(architecture="Qwen3ForCausalLM", qk_norm=True, **_BASE),
        norm_topk_prob=True,
        **_MOE,
    ),
    "mixtral": moe.MoeConfig(
        architecture="MixtralForCausalLM",
        base=llama.LlamaConfig(architecture="MistralForCausalLM", **_BASE),
        norm_topk_prob=True,
        **_MOE,
    ),
}
PHASES = {"prefill": (2, 16), "decode": (2, 1)}  # (batch, tokens per sequence)
CACHE_LEN = 32
TP_SIZES = (1, 2)
LAYER_SHARD_SERIES = "o_proj,down_proj"


def _capture(family: str, phase: str, ctx: RankContext, tp: int, series: str | None = None) -> torch.fx.GraphModule:
    from torch._dynamo.backends.common import aot_autograd

    mesh = ctx.mesh({"tp": tp} if series is None else {"dp": ctx.world_size, "tp": 1})
    cfg = GRAPH_CONFIGS[family]
    model = family_of(cfg)
    full, specs = model.init_params(cfg, seed=0), model.param_specs(cfg)
    if series is not None:
        ls = layer_shard(series, "dp")
        full, specs = stack_series(full, ls), series_specs(specs, ls, cfg.num_layers)
    params = shard(full, specs, mesh)
    b, s = PHASES[phase]
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    if not mesh.is_abstract:
        mesh.init_groups()
    torch._dynamo.reset()
    fn = torch.compile(
        functools.partial(forward, attention="math"),
        backend=aot_autograd(fw_compiler=keep),
        fullgraph=True,
        dynamic=False,
    )
    positions = torch.arange(s).expand(b, s) if phase == "prefill" else torch.full((b, 1), 5)
    state = init_state(cfg, mesh, b, CACHE_LEN)._replace(prefetched=prefetch.start(params, mesh, 1 if series else 0))
    with torch.no_grad():
        fn(params, torch.ones(b, s, dtype=torch.long), positions, state, mesh)
    prefetch.drain(state.prefetched)
    if len(graphs) != 1:  # pragma: no cover - fullgraph=True makes a break an error first
        raise RuntimeError(f"{family} {phase}: expected one graph, captured {len(graphs)}")
    return graphs[0]


def _summarize(gm: torch.fx.GraphModule, axis_of_group: dict[str, str]) -> dict[str, Any]:
    census = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    schedule = []
    for n in gm.graph.nodes:
        target = str(n.target)
        if n.op == "call_function" and target.startswith("_c10d_functional.") and "wait_tensor" not in target:
            group = next(a for a in reversed(n.args) if isinstance(a, str))
            val = n.args[0].meta["val"]
            entry = {"op": target, "axis": axis_of_group.get(group, group), "bytes": val.numel() * val.element_size()}
            schedule.append(entry | ({"src": n.args[1]} if "broadcast" in target else {}))
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    text = re.sub(r"# File: \S+:\d+ in ", "# in ", text)  # no checkout paths or line numbers: stable across machines
    return {
        "census.json": dict(sorted(census.items())),
        "collectives.json": schedule,
        "summary.json": {"nodes": len(gm.graph.nodes), "collectives": len(schedule)},
        "graph.txt": text,
    }


def capture_artifacts(ctx: RankContext, tp: int) -> dict[str, dict[str, Any]]:
    """Every family x phase artifact for one tp size, as ``{name: {file: content}}`` (run on each rank)."""
    mesh = ctx.mesh({"tp": tp})
    axis_of_group = {} if mesh.is_abstract else {mesh.group_name("tp"): "tp"}
    out = {
        f"{fam}-tp{tp}-{phase}": _summarize(_capture(fam, phase, ctx, tp), axis_of_group)
        for fam in GRAPH_CONFIGS
        for phase in PHASES
    }
    if tp == 2:
        dp = ctx.mesh({"dp": ctx.world_size, "tp": 1})
        dp.init_groups()
        dp_groups = {dp.group_name("dp"): "dp"}
        for phase in PHASES:
            out[f"qwen3-dp2-layer_shard-k1-{phase}"] = _summarize(
                _capture("qwen3", phase, ctx, tp, series=LAYER_SHARD_SERIES), dp_groups
            )
    return out


def _render(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content, indent=1) + "\n"


def write_artifacts(artifacts: dict[str, dict[str, Any]], root: Path) -> None:
    for name, files in artifacts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for file, content in files.items():
            (root / name / file).write_text(_render(content))


def diff_artifacts(artifacts: dict[str, dict[str, Any]], root: Path) -> list[str]:
    """The artifact files that differ from (or are missing in) ``root``."""
    out = []
    for name, files in artifacts.items():
        for file, content in files.items():
            path = root / name / file
            if not path.is_file() or path.read_text() != _render(content):
                out.append(f"{name}/{file}")
    return out


def _all_artifacts(world: LocalWorld | None) -> dict[str, dict[str, Any]]:
    out = capture_artifacts(RankContext(0, 1), 1)
    for tp in TP_SIZES[1:]:
        own = world or LocalWorld(tp)
        try:
            out |= own.run(capture_artifacts, tp)[0]
        finally:
            if world is None:
                own.close()
    return out


def regenerate(root: Path, *, check: bool = False, world: LocalWorld | None = None) -> list[str]:
    """Capture every artifact; write them under ``root`` or, with ``check``, return the drifted files."""
    artifacts = _all_artifacts(world)
    if check:
        return diff_artifacts(artifacts, root)
    write_artifacts(artifacts, root)
    return []
