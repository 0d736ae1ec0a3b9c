"""Golden captured graphs: each family's prefill and decode graph at the aten level, per mesh config.

The graphs are captured as the torchair path traces them (math attention, see ``compile_model``),
so the op census is what torchair must convert. Besides each family at tp 1 and 2, a layer-sharded
Qwen3 (``o_proj`` and ``down`` over dp = 2, prefetch step 1, rank 0's graph) shows the prefetch
broadcasts and the carried weights in program order; a Qwen3 of :data:`OFFLOAD_LAYERS` layers with ``o_proj`` and
``down`` kept in host memory (one rank; k = 0, 1, 2, and k = 1's second ring phase) shows the ring filled by copies
from host memory, and one on dp = 2 both sources side by side; and a bf16 Qwen3 at tp 2 with quantized weights
(:data:`GRAPH_QUANTS`: W8A8, and int4 with group scales), prepared for Ascend's kernels, shows their
ops (``functional_npu.quant_matmul`` / ``weight_quant_matmul``) where the matmuls were. The paged cases (Qwen3's
grouped KV heads, DeepSeek's latent, Gemma 3's sliding layers over ring tables; decode, and a prefill chunk at
position :data:`PAGED_CHUNK_AT`) are the serving engine's steps: the pools and block tables are inputs, each step's
keys written into the pool in place (``index_put_`` by block and offset) and read back gathered through the table.

For every artifact ``graphs/<family>-tp<N>-<phase>/``: ``census.json`` (op -> count),
``collectives.json`` (the ordered collective schedule: op, mesh axis, bytes), ``summary.json``
(node and collective counts) and ``graph.txt`` (the FX graph); for the ring's cases ``inputs.json``
(the graph's input layout: each input's path, from dynamo's sources, which the hazard check binds slots and
layers by). ``python -m tools.graphs`` regenerates
them (and the GE graphs of the same cases, :mod:`tools.ge_graphs`); ``--check`` (and the test suite)
fails on drift that was not regenerated.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import re
import zlib
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from functional_npu.core import BROADCAST_INTO, Mesh, Quant, quantize, shard
from functional_npu.models import (
    Routing,
    deepseek,
    family_of,
    forward,
    gemma3,
    init_state,
    invariant_ops,
    llama,
    moe,
    paged,
    prepare_params,
)
from functional_npu.parallel import (
    INLINE,
    Plan,
    RingPhase,
    Streams,
    host_specs,
    layer_shard,
    prefetch,
    ring_of,
    series_specs,
    split_dp,
    stack_host,
    stack_series,
)
from functional_npu.placement import QuantConfig, place, quantize_plan, resolved
from functional_npu.runtime import RankContext
from functional_npu.runtime.training import AdamW, compile_train_step, token_logprobs

__all__ = [
    "known_cases",
    "GRAPH_CONFIGS",
    "GRAPH_QUANTS",
    "CASES",
    "Case",
    "case_inputs",
    "case_function",
    "TRAIN",
    "case_mesh",
    "capture_artifacts",
    "write_artifacts",
    "diff_artifacts",
    "read_artifact",
]

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
_MOE = dict(num_experts=8, top_k=2, moe_intermediate_size=32, moe_layers=(0, 1))
EXPERTS_OVER_TP = ("qwen3_moe", "deepseek_v3", "mixtral")  # these families' plans put the experts over tp
GRAPH_CONFIGS: dict[str, llama.LlamaConfig | moe.MoeConfig | deepseek.DeepseekConfig | gemma3.Gemma3Config] = {
    "llama": llama.LlamaConfig(
        architecture="LlamaForCausalLM", tie_word_embeddings=True, rope_type="llama3", rope_factor=8.0, **_BASE
    ),
    "mistral": llama.LlamaConfig(architecture="MistralForCausalLM", sliding_window=8, **_BASE),
    "qwen2": llama.LlamaConfig(architecture="Qwen2ForCausalLM", qkv_bias=True, **_BASE),
    "qwen3": llama.LlamaConfig(architecture="Qwen3ForCausalLM", qk_norm=True, **_BASE),
    # prefill (16 tokens per rank) takes the all_to_all dispatch, decode (1 per rank) the gather / reduce-scatter path
    "qwen3_moe": moe.MoeConfig(
        architecture="Qwen3MoeForCausalLM",
        qk_norm=True,
        **_BASE,
        norm_topk_prob=True,
        **_MOE,
    ),
    # MLA (low-rank query, interleaved rope), the first layer dense, sigmoid routing over 2 groups with shared
    # experts; experts over tp. Prefill attends through the expanded keys, decode in the latent space
    "deepseek_v3": deepseek.DeepseekConfig(
        architecture="DeepseekV3ForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=256,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routing=Routing(scoring="sigmoid", group_limit="top2", n_group=2, topk_group=1, scale=2.5),
    ),
    "mixtral": moe.MoeConfig(
        architecture="MixtralForCausalLM",
        **_BASE,
        norm_topk_prob=True,
        **_MOE,
    ),
    # a sliding and a full layer, each with its rope (full: linear scaling), Gemma's norms, soft-capped logits
    "gemma3": gemma3.Gemma3Config(
        architecture="Gemma3ForCausalLM",
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=8,
        rope_local_base_freq=1e4,
        rope_type="linear",
        rope_factor=8.0,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        **(_BASE | {"rope_theta": 1e6}),
    ),
}
PHASES = {"prefill": (2, 16), "decode": (2, 1)}  # (batch, tokens per sequence)
TRAIN = (2, 16)  # a train step's batch: forward, backward and the AdamW update in one graph
TRAIN_FAMILIES = ("qwen3", "qwen3_moe")  # one dense, one MoE (experts over tp: the token exchange and its transpose)
CACHE_LEN = 32
PAGED_BLOCK = 4  # a paged case's block size: CACHE_LEN // PAGED_BLOCK blocks per row, and the null block
PAGED_FAMILIES = ("qwen3", "deepseek_v3", "gemma3")  # grouped KV heads, MLA's latent, sliding layers' ring tables
PAGED_CHUNK_AT = 8  # a paged prefill is a chunk of a longer prompt: its positions start here
TP_SIZES = (1, 2)
LAYER_SHARD_SERIES = "o_proj,down_proj"
LAYER_SHARD_LAYERS = 4  # enough layers for every prefetch step k = 0, 1, 2 (k <= num_layers - 2)
LAYER_SHARD_STEPS = (0, 1, 2)
OFFLOAD_SERIES = "o_proj,down_proj"  # kept whole in host memory, the ring filled by copies (a world of one)
OFFLOAD_LAYERS = 3  # vLLM 54975's 3 modules: at k = 1 the ring's k + 1 does not divide L (two phases)
OFFLOAD_STEPS = (0, 1, 2)
MIXED = ("o_proj", "down_proj")  # the mixed case: o_proj layer-sharded over dp = 2, down_proj in host memory
MODULE_TP = {"o_proj": 2, "lm_head": 2, "embed": 2, "mlp": 2}  # the composed case: every module over 2 dp ranks
MODULE_TP_DP = 4  # of 4: dp -> (dp 2, dp2 2), o_proj and down also layer-sharded over the outer dp
INVARIANT_FAMILY = "qwen3"  # Plan.invariant's cases: a dense family, its ops decomposed as the NPU backends get them
GRAPH_QUANTS = {  # every linear but lm_head, as compressed-tensors stores them; the model in bf16
    "w8a8": Quant(8, "channel", activations="token"),
    "w4a16": Quant(4, "group", group_size=32, symmetric=False),
}


@dataclass(frozen=True)
class Case:
    """One golden graph: a family at one mesh config and phase; ``series`` layer-shards those leaves
    over ``dp`` = 2 (then ``tp`` is 1) with prefetch step ``k``; ``offload`` keeps those in host memory (alone: a
    world of one, :data:`OFFLOAD_LAYERS` layers; beside ``series``: the dp = 2 case's), the step captured at ring
    phase ``ring_phase`` (:class:`functional_npu.parallel.RingPhase`); ``quant`` names a scheme of
    :data:`GRAPH_QUANTS` (bf16 activations, weights in Ascend's kernels' forms); ``module_tp``: dp is
    :data:`MODULE_TP_DP` ranks split for :data:`MODULE_TP`, and ``series`` are layer-sharded over the outer dp;
    ``paged``: the serving engine's step over a paged KV cache (:mod:`functional_npu.models.paged`): pools and block
    tables as inputs, the prefill a chunk at position :data:`PAGED_CHUNK_AT`; ``invariant``: ``Plan.invariant``
    (``True``, the portable mode's cases, named ``-invariant-``; ``"batch"``, named ``-batch_invariant-``)."""

    family: str
    phase: str
    tp: int = 1
    series: str | None = None
    k: int = 0
    quant: str | None = None
    module_tp: bool = False
    invariant: bool | str = False
    offload: str | None = None
    ring_phase: int = 0
    paged: bool = False

    @property
    def ringed(self) -> bool:
        """The case's forward fetches weights through the prefetch ring (layer-sharded or host series)."""
        return self.series is not None or self.offload is not None

    @property
    def ring_groups(self) -> int:
        """The ring's buffers per slot: one per source (peer, host), every series of a source in one dtype."""
        return (self.series is not None) + (self.offload is not None)

    @property
    def name(self) -> str:
        if self.phase == "train":
            return f"{self.family}-tp{self.tp}-train"
        if self.module_tp:
            return f"{self.family}-dp{MODULE_TP_DP}-module_tp-layer_shard-k{self.k}-{self.phase}"
        if self.series is not None and self.offload is not None:
            return f"{self.family}-dp2-layer_shard-offload-k{self.k}-{self.phase}"
        if self.offload is not None:
            at = f"-phase{self.ring_phase}" if self.ring_phase else ""
            return f"{self.family}-tp{self.tp}-offload-L{OFFLOAD_LAYERS}-k{self.k}{at}-{self.phase}"
        if self.series is not None:
            return f"{self.family}-dp2-layer_shard-k{self.k}-{self.phase}"
        if self.quant is not None:
            return f"{self.family}-tp{self.tp}-{self.quant}-{self.phase}"
        if self.invariant == "batch":
            return f"{self.family}-tp{self.tp}-batch_invariant-{self.phase}"
        if self.invariant:
            return f"{self.family}-tp{self.tp}-invariant-{self.phase}"
        if self.paged:
            return f"{self.family}-tp{self.tp}-paged-{self.phase}"
        return f"{self.family}-tp{self.tp}-{self.phase}"

    @property
    def world(self) -> int:
        """Ranks the case runs on (its graph is rank 0's)."""
        if self.module_tp:
            return MODULE_TP_DP * self.tp
        return 2 if self.series is not None else self.tp

    @property
    def axes(self) -> dict[str, int]:
        """The mesh axes (a world of one rank: none)."""
        if self.module_tp:
            return split_dp({"dp": MODULE_TP_DP, "tp": self.tp}, MODULE_TP)[0]
        return {"tp": self.tp} if self.series is None else {"dp": self.world, "tp": 1}

    @property
    def config(self) -> llama.LlamaConfig | moe.MoeConfig | deepseek.DeepseekConfig | gemma3.Gemma3Config:
        cfg = GRAPH_CONFIGS[self.family]
        if self.series is not None:
            return dataclasses.replace(cfg, num_layers=LAYER_SHARD_LAYERS)
        return cfg if self.offload is None else dataclasses.replace(cfg, num_layers=OFFLOAD_LAYERS)

    @property
    def plan(self) -> Plan:
        """The case's plan, its series resolved for the config (leaf names)."""
        return resolved(
            self.config,
            Plan(
                expert_axes=("tp",) if self.family in EXPERTS_OVER_TP else (),
                module_tp=split_dp({"dp": MODULE_TP_DP, "tp": self.tp}, MODULE_TP)[1] if self.module_tp else {},
                layer_shard=None if self.series is None else layer_shard(self.series, "dp"),
                prefetch_step=self.k,
                offload=self.offload or (),
                invariant=self.invariant,
            ),
        )


CASES: tuple[Case, ...] = (
    tuple(Case(fam, phase, tp) for tp in TP_SIZES for fam in GRAPH_CONFIGS for phase in PHASES)
    + tuple(Case("qwen3", phase, 1, LAYER_SHARD_SERIES, k) for k in LAYER_SHARD_STEPS for phase in PHASES)
    + tuple(Case("qwen3", phase, 2, quant=q) for q in GRAPH_QUANTS for phase in PHASES)
    + tuple(Case("qwen3", phase, 1, LAYER_SHARD_SERIES, 1, module_tp=True) for phase in PHASES)
    + tuple(Case(fam, "train", 2) for fam in TRAIN_FAMILIES)
    + tuple(Case(INVARIANT_FAMILY, phase, tp, invariant=True) for tp in TP_SIZES for phase in PHASES)
    + tuple(Case(INVARIANT_FAMILY, phase, tp, invariant="batch") for tp in TP_SIZES for phase in PHASES)
    + tuple(Case("qwen3", "decode", 1, k=k, offload=OFFLOAD_SERIES) for k in OFFLOAD_STEPS)
    + (
        Case("qwen3", "decode", 1, k=1, offload=OFFLOAD_SERIES, ring_phase=1),  # L = 3, k = 1: the second phase
        Case("qwen3", "prefill", 1, k=1, offload=OFFLOAD_SERIES),
        Case("qwen3", "decode", 1, MIXED[0], 1, offload=MIXED[1]),
    )
    + tuple(Case(fam, "decode", 1, paged=True) for fam in PAGED_FAMILIES)
    + (Case("qwen3", "prefill", 1, paged=True),)
)


def known_cases(names: Collection[str] | None) -> list[str] | None:
    """``names`` as a list, each checked to be a golden case (None stays None: every case).

    Raises:
        ValueError: a name that is no case, naming it and the cases there are.
    """
    if names is None:
        return None
    if isinstance(names, str):
        names = [names]
    have = {c.name for c in CASES}
    unknown = [n for n in names if n not in have]
    if unknown:
        raise ValueError(
            f"unknown golden case {', '.join(map(repr, unknown))}; the cases are: {', '.join(c.name for c in CASES)}"
        )
    return list(names)


def case_mesh(case: Case, ctx: RankContext) -> Mesh:
    """The case's mesh on this rank (abstract for one-rank cases, whatever world this process is in)."""
    if case.world == 1:
        return Mesh.abstract({"tp": 1}, 0)
    return ctx.mesh(case.axes)


def _math_lm_loss(params: dict, tokens: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The causal-LM loss with math attention, as the torchair path traces it."""
    return -token_logprobs(params, tokens, mesh, attention="math").mean()


def case_function(
    case: Case, mesh: Mesh, *, device: str | torch.device = "cpu", streams: Streams = INLINE
) -> tuple[Any, tuple[Any, ...]]:
    """``(fn, args)``: the function the case captures and its arguments on ``device``: the forward (math attention,
    ``streams`` its ordering hints) for a prefill or decode, the whole train step (AdamW over
    :func:`_math_lm_loss`) for a train case."""
    if case.phase != "train":
        inputs = case_inputs(case, mesh, device=device)
        plan = inputs[0].placement.plan
        ring = ring_of(inputs[0], mesh, plan)  # as compile_model answers it: once, a constant of the graph
        return functools.partial(forward, attention="math", streams=streams, plan=plan, ring=ring), inputs
    cfg, plan = case.config, case.plan
    model = family_of(cfg)
    full = model.init_params(cfg, seed=0) if device != "meta" else model.abstract_params(cfg, plan)
    params = shard(full, model.param_specs(cfg, plan), mesh, placement=place(cfg, mesh, plan))
    step = compile_train_step(_math_lm_loss, AdamW(), params, mesh, backend="none")
    tokens = torch.ones(*TRAIN, dtype=torch.long, device=device)
    return step.plain, step.inputs(params, step.init(params), tokens)


def case_inputs(case: Case, mesh: Mesh, *, device: str | torch.device = "cpu") -> tuple[Any, ...]:
    """``(params, tokens, positions, state, mesh)`` for the case's forward, on ``device`` ("meta" for
    shapes only), and for a prefill ``last``: the position of each row's last prompt token, whose logits alone the
    head computes, as ``compile_model``'s prefill and the engine's chunks do (the second row's prompt the shorter).
    Starting the carried prefetch issues broadcasts: run it on every rank of the world."""
    cfg, plan = case.config, case.plan
    model = family_of(cfg)
    specs = model.param_specs(cfg, plan)
    if case.quant is not None:
        params = _quantized(case, mesh)  # quantizing needs values: built on the CPU, then moved for shapes only
        if device == "meta":
            params = pytree.tree_map(lambda t: t.to("meta"), params)
    else:
        full = model.init_params(cfg, seed=0) if device != "meta" else model.abstract_params(cfg, plan)
        if plan.layer_shard is not None:
            ls = plan.layer_shard
            full, specs = stack_series(full, ls), series_specs(specs, ls, cfg.num_layers)
        if plan.offload:
            full, specs = stack_host(full, plan.offload), host_specs(specs, plan.offload, cfg.num_layers)
        params = shard(full, specs, mesh, placement=place(cfg, mesh, plan))
    plan = params.placement.plan  # its series resolved
    b, s = PHASES[case.phase]
    positions = torch.arange(s).expand(b, s) if case.phase == "prefill" else torch.full((b, 1), 5)
    tokens = torch.ones(b, s, dtype=torch.long)
    last = (torch.tensor([s - 1] + [s // 2] * (b - 1)),) if case.phase == "prefill" else ()
    state = init_state(cfg, mesh, b, CACHE_LEN, params["embed"].dtype, plan=plan)
    if case.paged:
        positions = positions + (PAGED_CHUNK_AT if case.phase == "prefill" else 0)
        state = state._replace(kv=_paged_kv(model.blocks(cfg, plan), mesh, b, params["embed"].dtype))
    if device == "meta":
        tokens, positions, state, last = pytree.tree_map_only(
            torch.Tensor, lambda t: t.to("meta"), (tokens, positions, state, last)
        )
    ring = prefetch.start(params, mesh, ring_of(params, mesh, plan))  # k: the placement's, the case's
    state = state._replace(prefetched=ring, phase=RingPhase(case.ring_phase))
    return (params, tokens, positions, state, mesh, *last)


def _paged_kv(blocks: Any, mesh: Mesh, batch: int, dtype: torch.dtype) -> list[paged.PagedKV]:
    """A paged cache as the serving engine keeps it: a block table per row (rows hold blocks 1, 2, ... in turn), a
    ring table for sliding layers (:func:`~functional_npu.models.paged.ring_width` of a chunk of the prefill's
    length), one pool per layer."""
    layout = paged.layout_of(blocks.init_kv(mesh, 1, CACHE_LEN, dtype, "meta"), CACHE_LEN)
    width = CACHE_LEN // PAGED_BLOCK
    rings = paged.ring_width(layout, PHASES["prefill"][1], PAGED_BLOCK, width)
    table = torch.arange(1, batch * width + 1).reshape(batch, width)
    ring = torch.arange(1, batch * rings + 1).reshape(batch, rings)
    pools = paged.init_pools(layout, batch * width + 1, batch * rings + 1, PAGED_BLOCK, dtype)
    return [paged.PagedKV(k, v, table if w is None else ring) for (k, v), w in zip(pools, layout.windows)]


def _quantized(case: Case, mesh: Mesh) -> dict[str, Any]:
    """The case's bf16 params with every linear but ``lm_head`` quantized (compressed-tensors' stored tensors,
    bit for bit), this rank's shard of them, prepared for Ascend's kernels."""
    cfg, plan = case.config, case.plan
    model = family_of(cfg)
    full = model.init_params(cfg, seed=0, dtype=torch.bfloat16)
    qc = QuantConfig.of(GRAPH_QUANTS[case.quant], ("lm_head",))
    stored, specs = quantize_plan(model, cfg, qc, full, model.param_specs(cfg, plan))
    full = pytree.tree_map(  # a stored leaf (a dict of meta tensors) gets its weight's quantized tensors
        lambda w, s: quantize(w, qc.quant) if isinstance(s, dict) else w,
        full,
        stored,
        is_leaf=lambda x: isinstance(x, dict) and "weight_scale" in x,
    )
    return prepare_params(shard(full, specs, mesh, placement=place(cfg, mesh, plan, qc)), qc, target="npu")


def _capture(case: Case, ctx: RankContext) -> tuple[torch.fx.GraphModule, list[str | None]]:
    """The case's AOT graph, and its input layout (each input's path, from dynamo's sources)."""
    from torch._dynamo.backends.common import aot_autograd

    from functional_npu.checks import dynamo_inputs

    mesh = case_mesh(case, ctx)
    graphs: list[torch.fx.GraphModule] = []
    layouts: list[list[str | None]] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    aot = aot_autograd(fw_compiler=keep, decompositions=invariant_ops.decompositions())  # as the NPU backends do

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        layouts.append(dynamo_inputs(gm))
        return aot(gm, example_inputs)

    if not mesh.is_abstract:
        mesh.init_groups()
    fn, args = case_function(case, mesh)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(*args)
    if case.phase != "train":
        prefetch.drain(args[3].prefetched)
    if len(graphs) != 1:  # pragma: no cover - fullgraph=True makes a break an error first
        raise RuntimeError(f"{case.name}: expected one graph, captured {len(graphs)}")
    return graphs[0], layouts[0]


def _summarize(gm: torch.fx.GraphModule, axis_of_group: dict[str, str]) -> dict[str, Any]:
    census = Counter(  # a functionalized in-place op counts as itself (what the converters see)
        str(n.args[0]) if str(n.target) == "auto_functionalized_v2" else str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
    )
    schedule = []
    for n in gm.graph.nodes:
        target = str(n.target)
        if n.op == "call_function" and target == "auto_functionalized_v2" and str(n.args[0]) == BROADCAST_INTO:
            kw = n.kwargs  # a prefetch ring's in-place broadcast: its slot, group and source
            if kw["size"] > 1:
                val = kw["_all_bases"][kw["_slot_base_index"]].meta["val"]
                group = kw["group_name"]
                schedule.append(
                    {
                        "op": BROADCAST_INTO,
                        "axis": axis_of_group.get(group, group),
                        "bytes": val.numel() * val.element_size(),
                        "src": kw["src"],
                    }
                )
            continue
        if n.op == "call_function" and target.startswith("_c10d_functional.") and "wait_tensor" not in target:
            group = next(a for a in reversed(n.args) if isinstance(a, str))
            val = n.args[0].meta["val"]
            entry = {"op": target, "axis": axis_of_group.get(group, group), "bytes": val.numel() * val.element_size()}
            if "broadcast" in target:
                entry["src"] = n.args[1]
            if "all_reduce" in target or "reduce_scatter" in target:
                entry["reduce"] = n.args[1]  # "sum", "max", ...
            schedule.append(entry)
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    text = re.sub(r"# File: \S+:\d+ in ", "# in ", text)  # no checkout paths or line numbers: stable across machines
    return {
        "census.json": dict(sorted(census.items())),
        "collectives.json": schedule,
        "summary.json": {"nodes": len(gm.graph.nodes), "collectives": len(schedule)},
        "graph.txt": text,
    }


def capture_artifacts(ctx: RankContext, world: int, names: Collection[str] | None = None) -> dict[str, dict[str, Any]]:
    """Every artifact of the cases (of ``names``; None: all) that run on ``world`` ranks, as ``{name: {file:
    content}}`` (run on each rank)."""
    names = known_cases(names)
    out = {}
    for case in CASES:
        if case.world != world or (names is not None and case.name not in names):
            continue
        mesh = case_mesh(case, ctx)
        axes = {} if mesh.is_abstract else {mesh.group_name(a): a for a in mesh.axis_names if mesh.axis_size(a) > 1}
        gm, layout = _capture(case, ctx)
        out[case.name] = _summarize(gm, axes)
        if case.ringed:  # which input is which: the ring's slots, each layer's own inputs
            out[case.name]["inputs.json"] = layout
    return out


def _render(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content, indent=1) + "\n"


def _write(path: Path, text: str) -> None:
    if path.suffix == ".gz":  # deterministic bytes: no name, no mtime
        path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    else:
        path.write_text(text)


def _read(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def write_artifacts(artifacts: dict[str, dict[str, Any]], root: Path) -> None:
    for name, files in artifacts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for file, content in files.items():
            _write(root / name / file, _render(content))


def diff_artifacts(artifacts: dict[str, dict[str, Any]], root: Path) -> list[str]:
    """The artifact files that differ from (or are missing in) ``root`` (gzipped ones compared unzipped); a file that
    cannot be read as its kind (a binary in place of text, a ``.gz`` that is not gzip) has drifted too."""
    out = []
    for name, files in artifacts.items():
        for file, content in files.items():
            path = root / name / file
            try:
                same = path.is_file() and _read(path) == _render(content)
            except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile, zlib.error):
                same = False
            if not same:
                out.append(f"{name}/{file}")
    return out


def read_artifact(root: Path, name: str, file: str) -> Any:
    """One artifact file's content (JSON parsed, gzip undone)."""
    text = _read(root / name / file)
    return json.loads(text) if file.endswith(".json") else text
