"""The compile policy: what ``compile_model`` decides before anything is traced, each decision a pure function of the
placement, the backend and the options.

- the shape buckets (batch, cache length, prompt lengths), the graphs a ring's phases multiply them by, and the
  serving batch sizes they cover;
- how float linears multiply (``streamed``, inductor's reductions on the CPU, or ``matmul``) and the forms the
  loaded weights are prepared in for their kernels;
- the prefetch step resolved to an int (the cost model's for ``"auto"``) and inductor's options for the ring;
- the invariant mode's options, and where it is refused;
- on the NPU backends, a plan whose ring's broadcasts and compute-stream collectives communicate on two streams at
  once, refused.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from ...core.mesh import Mesh
from ...core.tree import flatten_with_paths
from ...models import FAMILIES, check_invariant, family_of
from ...models import batch_invariant as batch_inv
from ...models import invariant as inv
from ...models.linear import KINDS, prepare_params
from ...parallel.layer_shard import series_of
from ...parallel.offload import host_of
from ...parallel.plan import Plan
from ...parallel.prefetch import check_prefetch_step
from ...parallel.prefetch_cost import auto_step
from ...parallel.prefetch_ring import phases, ring_used
from ...placement.placement import Placement
from ...placement.quant_layouts import tensor_blocks
from .backends import Backend

__all__ = [
    "cache_length",
    "shape_buckets",
    "check_phases",
    "check_graphs",
    "batch_coverage",
    "uncovered",
    "check_wrapper",
    "check_comm_streams",
    "NPU_CAPTURE_BACKENDS",
    "LINEARS",
    "streamed_linears",
    "check_streamed",
    "preparer",
    "with_step",
    "prefetch_options",
    "invariant_options",
    "INVARIANT_BACKENDS",
    "NPU_INVARIANT_MODE",
    "GRAPH_BUDGET",
]

# the graphs one compiled forward may hold (the recompile limit compile_model sets): a graph per shape and ring phase
GRAPH_BUDGET = 256


def cache_length(tokens: int, minimum: int = 64, limit: int | None = None) -> int:
    """A KV-cache length for ``tokens`` positions: the smallest power of two that fits, at least ``minimum``, at
    most ``limit`` (the model's positions, where ``tokens`` fit them).

    Raises:
        ValueError / TypeError naming the argument: ``tokens``, ``minimum`` or ``limit`` (when given) not an int >= 1.
    """
    for name, x in (("tokens", tokens), ("minimum", minimum), ("limit", 1 if limit is None else limit)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"cache_length: {name} must be an int >= 1, got {type(x).__name__} {x!r}")
        if x < 1:
            raise ValueError(f"cache_length: {name} must be an int >= 1, got {x}")
    n = max(minimum, 1 << (tokens - 1).bit_length())
    return n if limit is None else min(n, max(limit, tokens))


def _buckets(limit: int, start: int = 1) -> tuple[int, ...]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out + [limit])


LINEARS = ("streamed", "matmul")  # how float linear weights multiply (compile_model's ``linear``)


# inductor realizes a value read by several kernels' loops instead of recomputing it in each: a streamed linear's
# rows each read their input row, which then comes from a buffer, not from its producers (the embedding gather with
# its bounds check, the residual and the RMSNorm with a square root) recomputed per output row and batch row; at
# 8 rows of float32 that took a decode step from 34 to 20 ms (benchmarks/README.md)
REALIZE_INPUTS = {"realize_reads_threshold": 0}


# inductor's own pass that moves each wait down to right before its first consumer
SINK_WAITS = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits_iterative"],
}


def prefetch_options(params: dict, mesh: Mesh, plan: Plan) -> dict[str, Any]:
    """Inductor's options for a model that prefetches into a ring: its ``sink_waits_iterative`` pass. The ring's data
    edges keep every write after the reads it overwrites, but inductor's default order hoists each wait to right
    after its write, which stalls the step until the layer arrives (the overlap check finds it,
    :mod:`functional_npu.checks.hazard`); the pass moves each wait down to its first consumer."""
    return dict(SINK_WAITS) if ring_used(params, mesh, plan) else {}


def shape_buckets(
    cfg: Any, batch_sizes: Sequence[int] | None, max_seq_len: int | None, prefill_lengths: Sequence[int] | None
) -> tuple:
    """(batch buckets, cache length, prompt-length buckets), checked against the model (the sizes' own types and
    ranges are :class:`~.compile.CompileOptions`' to check, as it is made)."""
    sizes = tuple(sorted(set((1, 2, 4, 8) if batch_sizes is None else batch_sizes)))
    if max_seq_len is not None and max_seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"compile_model: max_seq_len {max_seq_len} exceeds the model's {cfg.max_position_embeddings} positions "
            f"(max_position_embeddings); pass max_seq_len <= {cfg.max_position_embeddings}"
        )
    seq = max_seq_len or min(cfg.max_position_embeddings, 2048)
    lengths = tuple(sorted(set(prefill_lengths))) if prefill_lengths else _buckets(seq, min(16, seq))
    if lengths[-1] > seq:
        raise ValueError(f"compile_model: prefill length bucket {lengths[-1]} exceeds max_seq_len {seq}")
    return sizes, seq, lengths


def check_graphs(sizes: Sequence[int], lengths: Sequence[int], greedy: bool) -> int:
    """The graphs one compiled forward holds (a decode and a prefill per prompt length at each batch bucket, twice
    with the greedy head), refused past :data:`GRAPH_BUDGET`: dynamo's recompile limit, which this library sets to
    it, makes every shape past it run eagerly with nothing said but a log line. Returns the count."""
    graphs = len(sizes) * (len(lengths) + 1) * (1 + greedy)
    if graphs > GRAPH_BUDGET:
        raise ValueError(
            f"compile_model: {len(sizes)} batch buckets x ({len(lengths)} prompt lengths + decode)"
            f"{' x 2 (greedy head)' if greedy else ''} = {graphs} graphs, over the budget of {GRAPH_BUDGET}: the "
            f"shapes past it would run eagerly, not compiled or captured; pass fewer batch_sizes or prefill_lengths"
        )
    return graphs


def batch_coverage(buckets: Sequence[int], sizes: Sequence[int]) -> dict[int, dict[str, Any]]:
    """For each serving batch size in ``sizes``: the compiled bucket it runs at (padded up: ``padded`` is the share
    of the bucket's rows that are padding), or ``bucket`` None where it exceeds the largest (``generate`` refuses
    it; the engine never runs that many at once, it admits up to the largest bucket).

    Raises:
        ValueError naming ``buckets`` (the compiled ``batch_sizes``) or ``serving_batches`` that are not positive ints
        (at least one bucket).
    """
    if not buckets or not all(not isinstance(b, bool) and isinstance(b, int) and b >= 1 for b in buckets):
        raise ValueError(
            f"batch_coverage: buckets must be the compiled batch_sizes, positive ints (at least one), got "
            f"{list(buckets)}"
        )
    out: dict[int, dict[str, Any]] = {}
    for n in sorted(set(sizes)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"compile_model: serving_batches must be positive ints, got {n!r}")
        fit = [b for b in buckets if b >= n]
        bucket = min(fit) if fit else None
        out[n] = {"bucket": bucket, "padded": (bucket - n) / bucket if bucket else None}
    return out


def uncovered(buckets: Sequence[int], sizes: Sequence[int]) -> str | None:
    """One line naming the serving batch sizes past the largest bucket (None: every size has a graph)."""
    missing = [n for n, c in batch_coverage(buckets, sizes).items() if c["bucket"] is None]
    if not missing:
        return None
    return (
        f"compile_model: serving batch sizes {missing} have no compiled graph (batch_sizes {list(buckets)}): generate "
        f"refuses them and the engine runs at most {max(buckets)} sequences at once; add a bucket of at least "
        f"{max(missing)} to batch_sizes to serve them in one step"
    )


def check_phases(k: int, num_layers: int, shapes: int) -> None:
    """Refuse a ring whose phases times the shapes compiled exceed :data:`GRAPH_BUDGET` graphs, in one line naming
    ``k``, ``L`` and the graphs, with the prefetch steps that need one graph per shape."""
    n = phases(num_layers, k)
    if n * shapes > GRAPH_BUDGET:
        whole = [j for j in range(num_layers) if num_layers % (j + 1) == 0]
        raise ValueError(
            f"compile_model: prefetch_step {k} over {num_layers} layers turns a ring of {k + 1} slots through {n} "
            f"phases, one graph each: {n} x {shapes} shapes = {n * shapes} graphs, over the budget of {GRAPH_BUDGET}; "
            f"use a prefetch_step k with k + 1 dividing {num_layers} (one phase: k in {whole}), or fewer batch and "
            f"prefill buckets"
        )


def check_wrapper(backend: Backend, mesh: Mesh) -> None:
    """On the CPU, mode ``reduce-overhead`` is inductor's C++ wrapper, which refuses a graph with collectives (torch
    2.13: ``arg type Any is not yet supported by custom_op_wrapper``) only after compiling it: refused here."""
    if (
        backend.name == "inductor"
        and backend.device_type == "cpu"
        and backend.mode == "reduce-overhead"
        and mesh.size > 1
    ):
        raise ValueError(
            f"compile_model: mode 'reduce-overhead' on the CPU is inductor's C++ wrapper, which cannot compile the "
            f"collectives of a {mesh.size}-rank mesh {mesh.shape}; use mode 'default' (the CPU's fastest) or one rank"
        )


NPU_CAPTURE_BACKENDS = ("torchair", "npugraph_ex")  # the NPU's graph compilers: their streams run HCCL's kernels


def _compute_stream_collectives(plan: Plan, mesh: Mesh) -> list[str]:
    """The plan fields that put collectives on the compute stream, with their group sizes."""
    out = []
    if mesh.axis_size(plan.tp) > 1:
        out.append(f"tp over {plan.tp!r} ({mesh.axis_size(plan.tp)} ranks)")
    for module, axes in plan.module_tp.items():
        if axes and mesh.axis_size(axes) > 1:
            out.append(f"module_tp {module} over {axes!r} ({mesh.axis_size(axes)} ranks)")
    if plan.expert_axes and mesh.axis_size(plan.expert_axes) > 1:
        out.append(f"expert_axes {tuple(plan.expert_axes)!r} ({mesh.axis_size(plan.expert_axes)} ranks)")
    return out


def check_comm_streams(plan: Plan, mesh: Mesh, backend: Backend, where: str) -> None:
    """Refuse, on the NPU's graph backends (:data:`NPU_CAPTURE_BACKENDS`), a plan whose layer-sharded ring
    broadcasts on its prefetch stream while collectives run on the compute stream (tensor parallelism, module TP or
    expert parallelism over more than one rank): nothing orders the two streams' communication, and npugraph_ex's
    own ``deadlock_check`` finds the pairs that may run at once (18 in the golden module-TP case,
    ``graphs/qwen3-dp4-module_tp-layer_shard-k1-*/acl_checks.json``). HCCL's AIV kernels each may take every
    vector core of the device, so two at once on two streams can deadlock under capture; how many cores they take
    there only a device shows. Series kept in host memory (``Plan.offload``) are copies, not collectives: allowed."""
    if backend.name not in NPU_CAPTURE_BACKENDS and backend.device_type != "npu":
        return
    ls = plan.layer_shard
    if ls is None or mesh.axis_size(ls.axis) <= 1:
        return
    main = _compute_stream_collectives(plan, mesh)
    if main:
        raise ValueError(
            f"{where}: on backend {backend.name!r} the layer-sharded ring broadcasts over {ls.axis!r} "
            f"({mesh.axis_size(ls.axis)} ranks) on its prefetch stream while {', '.join(main)} run collectives on "
            f"the compute stream: HCCL's AIV collectives on two streams at once may deadlock the device's vector "
            f"cores under capture (npugraph_ex's deadlock_check finds such pairs), and nothing orders them; on the "
            f"NPU layer-shard with no other collective (tp 1, no module TP or EP), keep the series in host memory "
            f"(Plan(offload=...): copies, not collectives), or drop the layer sharding"
        )


def streamed_linears(
    linear: str | None, chosen: Backend, placed: Placement, params: dict, mesh: Mesh, target: str
) -> bool:
    """Whether float linears take their ``streamed`` form (the ``linear`` argument of :func:`compile_model`): where
    inductor compiles for the CPU, the weights are float and no layer arrives by broadcast within the step (fused
    into one kernel with the streamed reductions, the earlier layers' work moves after the broadcast's wait: the
    hazard check's overlap finding), and not in the invariant mode (its linears are trees of their own).
    ``linear="streamed"`` where that does not hold is refused, naming what exists."""
    if placed.plan.invariant:
        if linear == "streamed":
            raise ValueError(
                "compile_model: linear='streamed' reduces in inductor's order, not the invariant mode's; pass "
                "linear=None"
            )
        return False
    ring = ring_used(params, mesh, placed.plan)
    device = params["embed"].device.type
    exists = chosen.name == "inductor" and device == "cpu" and target == "cpu" and not ring
    if linear == "streamed" and not exists:
        why = (
            f"backend {chosen.name!r}" if chosen.name != "inductor"
            else f"device {device!r}" if device != "cpu"
            else f"kernels {target!r}" if target != "cpu"
            else "layer-sharded weights fetched within the step"
        )  # fmt: skip
        raise ValueError(
            f"compile_model: linear='streamed' is inductor's reduction on the CPU, which {why} does not run; "
            f"here linear weights take 'matmul' (torch's matmul{', or the quantized kernels' if placed.quant else ''})"
            f"; pass linear=None or 'matmul'"
        )
    return exists and linear != "matmul"


def check_streamed(linear: str | None, params: dict) -> None:
    """``linear="streamed"`` on params none of whose linear weights is float (every one quantized) is refused, naming
    the kernels they take."""
    if linear != "streamed":
        return
    kinds = {path.rsplit(".", 1)[-1] for path, _ in flatten_with_paths(params)} & set(KINDS)
    if "streamed" not in kinds:
        raise ValueError(
            f"compile_model: linear='streamed' streams float weights, and every linear weight of this model is "
            f"quantized (kernels {sorted(kinds - {'streamed'})}); pass linear=None"
        )


def preparer(placed: Placement, mesh: Mesh, target: str, streamed: bool) -> Callable[[dict], dict]:
    """Loaded params -> the forms the graphs read: stored quantized weights in ``target``'s kernels' forms, float32
    linears (with ``streamed``) in the layout that streams fastest; applied once by ``compile_model`` and to every
    ``with_params``."""
    weight = placed.quant.quant.weight_name if placed.quant is not None else None
    blocks = functools.partial(tensor_blocks, weight=weight, layouts=placed.layouts, full=placed.meta, mesh=mesh)
    linears = family_of(placed.config).linears if streamed else ()
    return functools.partial(prepare_params, quant=placed.quant, blocks=blocks, target=target, linears=linears)


def with_step(placed: Placement, params: dict, device: Any) -> Placement:
    """``placed`` with its plan's prefetch step an int: 0 without layer-sharded or host series, the cost model's for
    ``"auto"`` (:func:`~functional_npu.parallel.prefetch_cost.auto_step`), else the plan's, checked."""
    plan = placed.plan
    k = plan.prefetch_step
    if not series_of(params) and not host_of(params):
        k = 0
    elif k == "auto":  # the cost model reads the series the plan names, or the host link for host series alone
        k = auto_step(params, plan, placed.quant, device=device, budget_bytes=plan.prefetch_budget)
    k = check_prefetch_step(k, placed.config.num_layers)
    return placed if k == plan.prefetch_step else placed.with_plan(dataclasses.replace(plan, prefetch_step=k), "")


# backends whose graphs are checked to keep each add and multiply one rounding (models.invariant): inductor's C++ with
# its contraction flag off, the Python forward, and on the NPU the GE graph (torchair's max-autotune) and the ACL graph
# (npugraph_ex) of the families whose graphs are golden (Family.npu_invariant), their ops the invariant functions'
# own; Triton is not
INVARIANT_BACKENDS = {
    "cpu": ("inductor", "aot_eager", "eager", "none"),
    "cuda": ("aot_eager", "eager", "none"),
    "npu": ("torchair", "npugraph_ex"),
}


NPU_INVARIANT_MODE = "max-autotune"  # torchair's mode whose graphs are golden: the GE graph


def invariant_options(params: dict, placed: Placement, chosen: Backend, where: str) -> dict[str, Any]:
    """The inductor options of ``Plan.invariant`` (:data:`~functional_npu.models.invariant.INDUCTOR_OPTIONS`; none
    when it is off). Refused where it does not hold, naming why: an op without an invariant form
    (:func:`~functional_npu.models.check_invariant`), a backend not checked to keep each add and multiply one
    rounding (:data:`INVARIANT_BACKENDS`; on the NPU, ``Family.npu_invariant`` and :data:`NPU_INVARIANT_MODE`)."""
    if not placed.plan.invariant:
        return {}
    check_invariant(params.placed(placed), placed.plan, where)
    device = chosen.device_type
    if chosen.name not in INVARIANT_BACKENDS.get(device, ()):
        raise ValueError(
            f"{where}: Plan.invariant on backend {chosen.name!r} ({device}): its generated kernels are not "
            f"checked to round every add and multiply on its own (Triton may fuse a multiply-add); the backends "
            f"that run it on {device} are {list(INVARIANT_BACKENDS.get(device, ()))}"
        )
    if placed.plan.invariant == "batch" and device != "cpu":
        raise ValueError(
            f"{where}: Plan.invariant='batch' on {device}: its pinned tiles (matmul rows in multiples of "
            f"{batch_inv.ROWS}, attention keys in blocks of {batch_inv.KEYS}) are measured on the CPU's kernels (MKL, "
            f"oneDNN), not on {device}'s matmuls (batch_invariant.probe() on the device measures them); use "
            f"Plan(invariant='portable') there, or run on the CPU"
        )
    if device == "npu":
        _check_npu_invariant(placed.config, chosen, where)
    options = batch_inv.INDUCTOR_OPTIONS if placed.plan.invariant == "batch" else inv.INDUCTOR_OPTIONS
    return dict(options) if chosen.name == "inductor" else {}


def _check_npu_invariant(cfg: Any, chosen: Backend, where: str) -> None:
    """Refuse the invariant mode on an NPU graph that is not golden: a family whose graphs' ops are unchecked
    (``Family.npu_invariant``), torchair's captured mode (not its GE graph)."""
    if not family_of(cfg).npu_invariant:
        have = " / ".join(a for f in FAMILIES if f.npu_invariant for a in f.architectures)
        raise ValueError(
            f"{where}: Plan.invariant on backend {chosen.name!r}: the NPU graphs checked to hold only the invariant "
            f"functions' adds and multiplies are those of {have}, not {cfg.architecture}'s; run it on the CPU "
            f"(backend 'inductor' or 'none') or leave Plan.invariant off"
        )
    if chosen.name == "torchair" and chosen.mode != NPU_INVARIANT_MODE:
        raise ValueError(
            f"{where}: Plan.invariant on backend 'torchair' in mode {chosen.mode!r}: its captured graph is not the "
            f"GE graph checked to hold only the invariant functions' adds and multiplies; use mode "
            f"{NPU_INVARIANT_MODE!r} or backend 'npugraph_ex'"
        )
