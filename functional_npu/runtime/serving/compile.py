"""``compile_model(params, mesh)``: the model's forward traced whole, prefill and decode, on static shapes.

Decode runs on batch-size buckets (like vllm-ascend's ``graph_batch_sizes``): a batch is padded up
to the next bucket. Prefill is bucketed by batch and by length (powers of two). Every graph is
traced with ``fullgraph=True``; a graph break is an error that names its cause.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.mesh import Mesh
from ...core.tree import flatten_with_paths
from ...models import FAMILIES, check_invariant, family_of, init_state
from ...models import invariant as inv
from ...models.decoder import DecodeState, decode
from ...models.linear import KINDS, TARGETS, prepare_params
from ...parallel import prefetch
from ...parallel.host_link import EmulatedHostLink, check_host_link
from ...parallel.layer_shard import series_of
from ...parallel.offload import check_host_backend, host_of
from ...parallel.plan import Plan
from ...parallel.prefetch import check_prefetch_step
from ...parallel.prefetch_cost import auto_step
from ...placement.placement import Placement, placement_of
from ...placement.quant_layouts import tensor_blocks
from ...placement.ring_memory import warn_ring_memory
from .backends import Backend, resolve_backend
from .compile_cache import SAVABLE, SavedGraphs, cache_key, open_graph_dir, saved_guards
from .generate import Lockstep, Samples, check_length, generate, sample
from .inductor_cache import sweep

__all__ = ["CompiledModel", "compile_model", "greedy_generate", "cache_length", "GraphBreakError", "invariant_options"]

log = logging.getLogger("functional_npu")


class GraphBreakError(RuntimeError):
    """The forward could not be traced as one graph; the message names the cause."""


def cache_length(tokens: int, minimum: int = 64, limit: int | None = None) -> int:
    """A KV-cache length for ``tokens`` positions: the smallest power of two that fits, at least ``minimum``, at
    most ``limit`` (the model's positions, where ``tokens`` fit them)."""
    n = max(minimum, 1 << (tokens - 1).bit_length())
    return n if limit is None else min(n, max(limit, tokens))


def _buckets(limit: int, start: int = 1) -> tuple[int, ...]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out + [limit])


# the graphs one compiled forward may hold (the recompile limit compile_model sets): a graph per shape and ring phase
GRAPH_BUDGET = 256


@dataclass(frozen=True)
class CompiledModel:
    """A model bound to a mesh and a compiled forward. Build it with :func:`compile_model`.

    The forward's contract is :mod:`functional_npu.models.decoder`'s: ``prefill`` and ``decode``
    update the :class:`~functional_npu.models.DecodeState` from :meth:`new_state` in place.
    """

    params: dict = field(repr=False)
    mesh: Mesh
    backend: Backend
    batch_sizes: tuple[int, ...]
    max_seq_len: int
    prefill_lengths: tuple[int, ...]
    forward: Callable[..., torch.Tensor] = field(repr=False)
    placement: Placement  # the params' placement, its plan's prefetch step resolved (never "auto")
    greedy_forward: Callable[..., torch.Tensor] | None = field(default=None, repr=False)
    # one bucket per graph: more recompiles than dynamo's default limit. Built once: making a
    # config patch costs far more than entering one, and this is entered on every step.
    _recompiles: Any = field(
        default_factory=lambda: torch._dynamo.config.patch(recompile_limit=GRAPH_BUDGET), repr=False, compare=False
    )
    # loaded params -> the forms the graphs read (quantized kernels' forms, streamed linears), as compile_model did
    _prepare: Callable[[dict], dict] = field(default=lambda params: params, repr=False, compare=False)
    # a captured backend's KV cache, one per batch bucket, and its prefetch ring (one for every bucket): a captured
    # graph reads its inputs at fixed addresses
    _kv: dict = field(default_factory=dict, repr=False, compare=False)
    _ring: list = field(default_factory=list, repr=False, compare=False)

    @property
    def config(self) -> Any:
        return self.params["config"]

    @property
    def device(self) -> torch.device:
        """Where the params are, and so the graphs run (``load_checkpoint(device=...)``)."""
        return self.params["embed"].device

    @property
    def plan(self) -> Plan:
        """The placement's plan; its ``prefetch_step`` is the distance the graphs were built for (an int: 0 without
        layer-sharded series)."""
        return self.placement.plan

    def _bucket(self, values: Sequence[int], n: int, what: str, knob: str) -> int:
        i = bisect.bisect_left(values, n)
        if i == len(values):
            raise ValueError(
                f"{what} {n} exceeds the largest bucket {values[-1]} (the compiled buckets: {list(values)}); pass "
                f"{knob} with a bucket of at least {n} to compile_model"
            )
        return values[i]

    @property
    def greedy_head(self) -> bool:
        """Whether greedy decode steps run the head reduced to its argmax (``compile_model(greedy_head=True)``)."""
        return self.greedy_forward is not None

    def _run(
        self, phase: str, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState, forward: Any = None
    ) -> torch.Tensor:
        if series_of(self.params):
            try:
                prefetch.check_ring(self.params, self.mesh, self.plan, state.prefetched, self.plan.prefetch_step)
            except ValueError as e:
                raise ValueError(
                    f"{phase}: a model compiled with prefetch_step={self.plan.prefetch_step} needs a state from "
                    f"new_state(): {e}"
                ) from None
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        try:
            with torch.no_grad(), self._recompiles:
                if not self.backend.captures:
                    return (forward or self.forward)(self.params, tokens, positions, state, self.mesh)
                torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs were copied out
                return (forward or self.forward)(self.params, tokens, positions, state, self.mesh).clone()
        except torch._dynamo.exc.Unsupported as e:
            raise GraphBreakError(
                f"{phase} graph of {self.config.architecture} breaks under fullgraph tracing: {e}"
            ) from e

    def with_params(self, params: dict) -> CompiledModel:
        """The same model and graphs over other weights of the same model, placement and shapes (a post-training
        step's updated params, resharded to this plan): checked against the model's own placement (its config, every
        constant the graphs baked in, and its quantization, plan and mesh), then put in the forms the graphs read.
        No recompile: the weights are the graphs' inputs.

        Raises:
            ValueError / TypeError naming the field or the leaf, for params of another model, plan or mesh.
        """
        placed = placement_of(params, self.mesh, self.plan, where="with_params")
        self.placement.same_model(placed, "with_params")
        _same_tensors(params, self.params["embed"], "with_params")
        new = self._prepare(params)
        if self.backend.captures:
            _static(new)
        return dataclasses.replace(self, params=new | {"placement": self.placement})

    def new_state(self, batch: int) -> DecodeState:
        """A fresh decode state for a batch bucket (``batch`` is rounded up to a bucket): a zeroed KV
        cache and, with layer-sharded params, the prefetch ring (``k + 1`` slots, layers ``0 .. k-1`` issued now).

        On a backend that captures graphs (inductor's CUDA graphs) the KV cache of a bucket is one buffer at a fixed
        address, zeroed by each ``new_state``, and the ring's slots are the same tensors in every state, as a captured
        graph replays on the addresses it was captured with: a state from an earlier ``new_state`` of the same bucket
        is then this one. The ring starts at phase 0 (one graph per phase, :func:`~.prefetch.phases`). All ranks of
        the series axis must make the same sequence of calls.
        """
        b = self._bucket(self.batch_sizes, batch, "batch size", "batch_sizes")
        state = self._kv.get(b) if self.backend.captures else None
        if state is None:
            dtype = self.params["embed"].dtype
            state = init_state(self.config, self.mesh, b, self.max_seq_len, dtype, plan=self.plan, device=self.device)
        k = self.plan.prefetch_step
        if self.backend.captures:
            for t in (t for layer in state.kv for t in layer):
                torch._dynamo.mark_static_address(t.zero_())
            self._kv[b] = state
            if not self._ring:
                self._ring[:] = prefetch.new_ring(self.params, self.mesh, self.plan, k)
                for t in self._ring:
                    torch._dynamo.mark_static_address(t)
        ring = prefetch.start(self.params, self.mesh, self.plan, k, list(self._ring) if self._ring else None)
        return state._replace(prefetched=ring, phase=prefetch.RingPhase())

    def prefill(self, prompts: Sequence[Sequence[int]], state: DecodeState, *, length: int = 0) -> torch.Tensor:
        """Run the prompts (right-padded to the bucket of their longest, or of ``length``; the pads at the position
        after their prompt's last) into ``state``; returns each prompt's last logits ``[B, V]``."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill: every prompt needs at least one token")
        b, width = state.kv[0][0].shape[0], max(length, *(len(p) for p in prompts))
        if len(prompts) > b:
            raise ValueError(f"prefill: {len(prompts)} prompts do not fit a cache of batch {b}")
        s = self._bucket(self.prefill_lengths, width, "prompt length", "prefill_lengths")
        tokens = torch.zeros(b, s, dtype=torch.long)  # built here, moved to the params' device once
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.as_tensor(p)
        # pads at the position after their prompt: the slot the first decode step overwrites (a ring cache's too)
        ends = torch.tensor([len(p) for p in prompts] + [s] * (b - len(prompts)))
        positions = torch.minimum(torch.arange(s), ends[:, None])
        logits = self._run("prefill", tokens, positions, state)
        last = torch.tensor([len(p) - 1 for p in prompts] + [0] * (b - len(prompts)))
        return logits[torch.arange(b), last][: len(prompts)]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One step: ``tokens [n]`` at ``positions [n]`` (n <= the state's batch); returns logits ``[n, V]``."""
        return self._step("decode", tokens, positions, state, self.forward)

    def decode_greedy(self, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One greedy step through the argmax head: the next ``tokens [n]`` (-1 where the largest logit is
        not finite), no logits moved between the ranks of a vocab-parallel head."""
        if self.greedy_forward is None:
            raise ValueError("decode_greedy: compile the model with compile_model(..., greedy_head=True)")
        return self._step("decode", tokens, positions, state, self.greedy_forward)

    def _step(self, phase: str, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState, forward: Any):
        b, n = state.kv[0][0].shape[0], tokens.shape[0]
        if int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"decode: position {int(positions.max())} is past max_seq_len {self.max_seq_len}")
        pad = b - n
        tok = (torch.cat([tokens, tokens.new_zeros(pad)]) if pad else tokens)[:, None]
        pos = (torch.cat([positions, positions.new_zeros(pad)]) if pad else positions)[:, None]
        return self._run(phase, tok, pos, state, forward)[:n, -1]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        lockstep: Lockstep | None = None,
    ) -> list[list[int]]:
        """``max_new_tokens`` new ids per prompt: greedy unless ``temperature > 0`` (then top-k / top-p sampling).

        Prompts run in chunks of the largest batch bucket. Ranks that share collective steps (a
        layer-sharded series axis, experts over data-parallel ranks) pass the same ``lockstep``
        (:meth:`Lockstep.over`): each runs as many chunks of the same shapes, with dummy prompts
        where it has fewer. See :func:`functional_npu.runtime.serving.generate.generate`.
        """
        return generate(
            self,
            prompts,
            max_new_tokens,
            lockstep=lockstep,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        )

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        lockstep: Lockstep | None = None,
    ) -> Samples:
        """:meth:`generate` (sampling at ``temperature`` 1 unless told), and each new token's log-probability from
        the logits it was drawn from: a rollout's behaviour log-probabilities (see
        :func:`functional_npu.runtime.serving.generate.sample`)."""
        return sample(
            self, prompts, max_new_tokens, lockstep=lockstep, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed,
        )  # fmt: skip


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
    :mod:`functional_npu.parallel.hazard`); the pass moves each wait down to its first consumer."""
    return dict(SINK_WAITS) if prefetch.ring_used(params, mesh, plan) else {}


def _shape_buckets(
    cfg: Any, batch_sizes: Sequence[int] | None, max_seq_len: int | None, prefill_lengths: Sequence[int] | None
) -> tuple:
    """(batch buckets, cache length, prompt-length buckets), checked."""
    sizes = tuple(sorted(set(batch_sizes or (1, 2, 4, 8))))
    if not sizes or not all(isinstance(b, int) and b >= 1 for b in sizes):
        raise ValueError(f"compile_model: batch_sizes must be positive ints, got {batch_sizes}")
    if max_seq_len is not None and not (isinstance(max_seq_len, int) and max_seq_len >= 1):
        raise ValueError(f"compile_model: max_seq_len must be a positive int (None: the default), got {max_seq_len!r}")
    if max_seq_len is not None and max_seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"compile_model: max_seq_len {max_seq_len} exceeds the model's {cfg.max_position_embeddings} positions "
            f"(max_position_embeddings); pass max_seq_len <= {cfg.max_position_embeddings}"
        )
    seq = max_seq_len or min(cfg.max_position_embeddings, 2048)
    lengths = tuple(sorted(set(prefill_lengths))) if prefill_lengths else _buckets(seq, min(16, seq))
    if not all(isinstance(n, int) and n >= 1 for n in lengths):
        raise ValueError(f"compile_model: prefill_lengths must be positive ints, got {prefill_lengths}")
    if lengths[-1] > seq:
        raise ValueError(f"compile_model: prefill length bucket {lengths[-1]} exceeds max_seq_len {seq}")
    return sizes, seq, lengths


def compile_model(
    params: dict,
    mesh: Mesh,
    *,
    plan: Plan | None = None,
    backend: str = "auto",
    mode: str | None = None,
    batch_sizes: Sequence[int] | None = None,
    max_seq_len: int | None = None,
    prefill_lengths: Sequence[int] | None = None,
    prefetch_device: Any = None,
    kernels: str | None = None,
    linear: str | None = None,
    greedy_head: bool = False,
    cache_dir: str | os.PathLike | None = None,
    host_link: EmulatedHostLink | None = None,
) -> CompiledModel:
    """Bind local params to a mesh and a compiler; graphs are traced on first use of each shape.

    Args:
        params: this rank's params with ``params["config"]`` and ``params["placement"]`` (from ``load_checkpoint``;
            params with no placement, ``shard`` of a family's full params, are placed here under ``plan``);
            quantized weights as stored (the placement's quantization) are put in their kernels' forms here, and
            float32 linear weights input-major on the CPU (:func:`functional_npu.models.linear.prepare_params`),
            once: the model's ``params`` are then its own, and the loaded ones may be dropped.
        mesh: the mesh they were sharded for (the placement's axes; other axes hold replicas).
        plan: the parallel plan (default: the placement's). A plan given beside placed params may differ from
            theirs only in fields that decide no layout (``prefetch_step``, ``prefetch_budget``,
            ``dispatch_threshold``, ``absorb``, ``mla_cache``, ``model``;
            :meth:`~functional_npu.placement.Placement.with_plan`).
            With layer-sharded params, ``plan.prefetch_step`` ``k`` fetches layer ``l + k``'s weights while
            layer ``l`` computes (``0 <= k <= num_layers - 1``; 0 is synchronous), into a ring of ``k + 1`` slots
            that :meth:`CompiledModel.new_state` allocates outside the graph: each broadcast writes its layer in
            place, after the reads of the layer its slot held (:mod:`functional_npu.parallel.prefetch`), so
            nothing in the graph allocates a prefetch buffer and the order is in the graph's data edges (under
            inductor with its ``sink_waits_iterative`` pass, so that each wait sits at its first use:
            :func:`prefetch_options`). ``"auto"`` picks ``k`` with the cost model
            (:func:`functional_npu.parallel.prefetch_cost.auto_step`) within ``plan.prefetch_budget``.
        backend: "auto" (torchair on NPU, inductor elsewhere), "inductor", "torchair", "eager",
            "aot_eager", or "none" (the plain Python forward, no ``torch.compile``).
        mode: the backend's mode (see :func:`functional_npu.runtime.serving.backends.resolve_backend`).
        batch_sizes: decode/prefill batch buckets (default 1, 2, 4, 8).
        max_seq_len: KV-cache length (default min(max_position_embeddings, 2048)).
        prefill_lengths: prompt-length buckets (default powers of two from 16 up to max_seq_len).
        prefetch_device: for ``plan.prefetch_step="auto"``: a device name of
            :data:`functional_npu.parallel.prefetch_cost.DEVICES` or a ``Device`` (default: by the
            params' device type).
        kernels: whose quantized matmuls the weights are prepared for (``"cpu"``, ``"npu"`` or ``"dense"``,
            see :func:`functional_npu.models.linear.prepare`); default: the backend's
            (:attr:`functional_npu.runtime.serving.backends.Backend.kernels`). ``"npu"`` off an NPU runs Ascend's
            kernels' CPU references (:mod:`functional_npu.models.ascend_ops`): the NPU's numerics, checked here.
        linear: how float linear weights multiply (:data:`LINEARS`): ``"streamed"``, inductor's reductions on the
            CPU, one pass over each weight for a decode step's rows (up to 8 in float32, one in other dtypes:
            :func:`functional_npu.models.linear.streamed`); ``"matmul"``, torch's matmul. Default: ``"streamed"``
            where it exists (inductor on the CPU, float weights, no layer-sharded ring), else ``"matmul"``. Asking
            for ``"streamed"`` where it does not exist is an error listing what does.
        greedy_head: greedy generation's decode steps run the head reduced to its argmax where the logits are
            computed (the family's ``Blocks.argmax``): a vocab-parallel head (tp, lm_head module TP) then moves
            a (max, index) pair per rank and token instead of its logits. The first token still comes from
            the prefill's logits; a step whose largest logit is not finite still raises.
        cache_dir: save each compiled graph under this directory (in ``<cache_dir>/<rank>/``, one subdirectory
            per mesh coordinate, ``dp1of2-tp0of4``), and load it from there in a later process that compiles the
            same model: the same config and param shapes, plan, mesh shape and coordinate, shape buckets, backend
            and mode, kernels, greedy_head, dtype, torch, python and library (the key of its ``manifest.json``). A
            warm process then skips dynamo, inductor and the C++ compiler (:mod:`.compile_cache`,
            docs/warm_start.md). A graph is saved right after its first compile; nothing is checked per step. A
            directory holding another key's graphs, a graph that cannot be loaded, a directory that cannot be
            written: one warning on the ``functional_npu`` logger, then a clean compile. Backends ``inductor`` and
            ``aot_eager`` save their graphs; ``none`` ignores ``cache_dir``; others warn and compile as usual.
        host_link: on a CPU host, an entered :class:`~functional_npu.parallel.host_link.EmulatedHostLink` that
            delivers the copies of the series kept in host memory (``plan.offload``) at its bandwidth and latency,
            so that the prefetch step's overlap can be measured there. Refused on another device, without host
            series, and with ``cache_dir`` (the graphs name the link).

    Example:
        >>> model = compile_model(load_checkpoint(path, mesh), mesh)     # doctest: +SKIP
        >>> model.generate([[1, 2, 3]], max_new_tokens=16)               # doctest: +SKIP
    """
    if kernels not in (None, *TARGETS):
        raise ValueError(f"compile_model: kernels={kernels!r} is not one of {TARGETS} (or None: the backend's)")
    if linear not in (None, *LINEARS):
        raise ValueError(f"compile_model: linear={linear!r} is not one of {LINEARS} (or None: the fastest that exists)")
    if cache_dir is not None and not str(cache_dir):
        raise ValueError("compile_model: cache_dir is '': give a directory for the saved graphs (None: save nothing)")
    placed = placement_of(params, mesh, plan, where="compile_model")
    carried = params.get("placement")  # the one its loader made (and warned about), if any
    cfg = placed.config
    chosen = resolve_backend(backend, mode=mode, device_type=params["embed"].device.type)
    _check_wrapper(chosen, mesh)
    check_host_backend(params, chosen.name, chosen.mode, chosen.captures, chosen.device_type, "compile_model")
    check_host_link(params, host_link, chosen.device_type, cache_dir, "compile_model")
    if chosen.name == "inductor":
        sweep()  # inductor would trust an object a killed compile left half-written in its cache
    # the streamed forms are for inductor's reductions: a forward that is not compiled keeps the plain ones, and so
    # does a model whose layers are fetched by broadcast within the step: fused into one kernel with the streamed
    # reductions, the earlier layers' work moves after the broadcast's wait (the hazard check's overlap finding)
    exact = invariant_options(params, placed, chosen, "compile_model")
    streamed = _streamed(linear, chosen, placed, params, mesh, kernels or chosen.kernels)
    prepare = _preparer(placed, mesh, kernels or chosen.kernels, streamed)
    params = prepare(params)
    _check_streamed(linear, params)
    if chosen.captures:  # the weights are inputs at fixed addresses: a captured graph reads them in place
        _static(params)
    sizes, seq, lengths = _shape_buckets(cfg, batch_sizes, max_seq_len, prefill_lengths)
    placed = _with_step(placed, params, prefetch_device)
    if chosen.name != "none" and prefetch.ring_used(params, mesh, placed.plan):
        _check_phases(placed.plan.prefetch_step, cfg.num_layers, len(sizes) * (len(lengths) + 1) * (1 + greedy_head))
    if placed != carried:  # a placement its loader made was warned about there (load_checkpoint, from_dtensor_state)
        warn_ring_memory(placed, "compile_model")  # the series' owned layers plus the ring against replication
    params = params | {"placement": placed}
    plan = placed.plan
    if not mesh.is_abstract:
        mesh.init_groups()  # collectively, before any tracing
        mesh.init_groups(*placed.axis_groups())  # and groups over several axes (expert parallelism)
    attention = "math" if chosen.name == "torchair" else "sdpa"  # every op of math attention has a GE converter
    options = prefetch_options(params, mesh, plan) if chosen.name == "inductor" else {}
    if streamed:
        options |= REALIZE_INPUTS
    options |= exact
    static = {"blocks": family_of(cfg).blocks(cfg, plan), "plan": plan, "attention": attention}
    linked = {"host_link": host_link.name} if host_link is not None else {}
    static["streams"] = dataclasses.replace(chosen.streams, **linked)
    where = _graph_dir(
        cache_dir, params, mesh, chosen, placed, (sizes, seq, lengths), kernels=kernels or chosen.kernels,
        greedy_head=greedy_head, options=options, linear="streamed" if streamed else "matmul",
    )  # fmt: skip
    fwd = _forward(chosen, static, options, where, "forward")
    greedy = _forward(chosen, static | {"greedy": True}, options, where, "greedy") if greedy_head else None
    # the plain forward never recompiles: no config patch to make (making one costs about a third of a millisecond)
    recompiles = (
        contextlib.nullcontext() if chosen.name == "none" else torch._dynamo.config.patch(recompile_limit=GRAPH_BUDGET)
    )
    return CompiledModel(params, mesh, chosen, sizes, seq, lengths, fwd, placed, greedy, recompiles, prepare)


def _check_phases(k: int, num_layers: int, shapes: int) -> None:
    """Refuse a ring whose phases times the shapes compiled exceed :data:`GRAPH_BUDGET` graphs, in one line naming
    ``k``, ``L`` and the graphs, with the prefetch steps that need one graph per shape."""
    n = prefetch.phases(num_layers, k)
    if n * shapes > GRAPH_BUDGET:
        whole = [j for j in range(num_layers) if num_layers % (j + 1) == 0]
        raise ValueError(
            f"compile_model: prefetch_step {k} over {num_layers} layers turns a ring of {k + 1} slots through {n} "
            f"phases, one graph each: {n} x {shapes} shapes = {n * shapes} graphs, over the budget of {GRAPH_BUDGET}; "
            f"use a prefetch_step k with k + 1 dividing {num_layers} (one phase: k in {whole}), or fewer batch and "
            f"prefill buckets"
        )


def _static(params: dict) -> None:
    """Mark every tensor of ``params`` as an input whose address never changes (no guard on it), so that CUDA graphs
    read the weights where they are. Unmarked, every replay first copies each weight into the graph's own input
    buffer: on an H200 that was about 100 device-to-device copies per decode step, half the step's time
    (benchmarks/results/gpu.json). Inductor's FX graph cache does not key on the mark: a graph cached unmarked keeps
    its copies."""
    for _, t in flatten_with_paths(params):
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_static_address(t, guard=False)


def _same_tensors(params: dict, like: torch.Tensor, where: str) -> None:
    """Every float leaf of ``params`` in ``like``'s dtype and on its device (the graphs were compiled for those); the
    series kept in host memory (``params["host"]``, :mod:`~functional_npu.parallel.offload`) on the host."""
    for path, x in flatten_with_paths(params):
        device = torch.device("cpu") if path.startswith("host.") else like.device
        if isinstance(x, torch.Tensor) and x.is_floating_point() and (x.dtype, x.device) != (like.dtype, device):
            raise ValueError(
                f"{where}: params[{path!r}] is {x.dtype} on {x.device}, the compiled model's weights {like.dtype} on "
                f"{device}; load them in that dtype on that device (load_checkpoint(dtype=..., device=...))"
            )


def _check_wrapper(backend: Backend, mesh: Mesh) -> None:
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


def _streamed(linear: str | None, chosen: Backend, placed: Placement, params: dict, mesh: Mesh, target: str) -> bool:
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
    ring = prefetch.ring_used(params, mesh, placed.plan)
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
    check_invariant(params | {"placement": placed}, placed.plan, where)
    device = chosen.device_type
    if chosen.name not in INVARIANT_BACKENDS.get(device, ()):
        raise ValueError(
            f"{where}: Plan.invariant on backend {chosen.name!r} ({device}): its generated kernels are not "
            f"checked to round every add and multiply on its own (Triton may fuse a multiply-add); the backends "
            f"that run it on {device} are {list(INVARIANT_BACKENDS.get(device, ()))}"
        )
    if device == "npu":
        _check_npu_invariant(placed.config, chosen, where)
    return dict(inv.INDUCTOR_OPTIONS) if chosen.name == "inductor" else {}


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


def _check_streamed(linear: str | None, params: dict) -> None:
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


def _preparer(placed: Placement, mesh: Mesh, target: str, streamed: bool) -> Callable[[dict], dict]:
    """Loaded params -> the forms the graphs read: stored quantized weights in ``target``'s kernels' forms, float32
    linears (with ``streamed``) in the layout that streams fastest; applied once by ``compile_model`` and to every
    ``with_params``."""
    weight = placed.quant.quant.weight_name if placed.quant is not None else None
    blocks = functools.partial(tensor_blocks, weight=weight, layouts=placed.layouts, full=placed.meta, mesh=mesh)
    linears = family_of(placed.config).linears if streamed else ()
    return functools.partial(prepare_params, quant=placed.quant, blocks=blocks, target=target, linears=linears)


def _with_step(placed: Placement, params: dict, device: Any) -> Placement:
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


def _graph_dir(cache_dir: Any, params: dict, mesh: Mesh, backend: Backend, *key: Any, **fields: Any) -> Any:
    """This rank's :class:`~.compile_cache.GraphDir` under ``cache_dir`` (None: no saving)."""
    if cache_dir is None or backend.name == "none":
        return None
    if backend.name not in SAVABLE:
        log.warning(
            "compile_model: cache_dir %s is not used: backend %r cannot save its graphs (%s can); compiling as usual",
            cache_dir,
            backend.name,
            " and ".join(SAVABLE),
        )
        return None
    return open_graph_dir(cache_dir, mesh, cache_key(params, mesh, *key, backend, **fields))


def _forward(backend: Backend, static: dict, options: dict, where: Any, name: str) -> Callable[..., Any]:
    """The compiled forward with ``static`` keywords: through saved graphs when ``where`` is a graph directory."""
    if where is None:
        return backend.compile(functools.partial(decode, **static), dynamic=False, inductor_options=options)
    precompile = backend.compile(decode, dynamic=False, inductor_options=options, guard_filter=saved_guards)
    fallback = backend.compile(decode, dynamic=False, inductor_options=options)
    return SavedGraphs(precompile, fallback, static, name, where)


def greedy_generate(
    params: dict,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    mesh: Mesh,
    *,
    max_seq_len: int | None = None,
    plan: Plan | None = None,
) -> list[list[int]]:
    """Greedy continuation of each prompt with the plain (uncompiled) forward: ``max_new_tokens`` ids per prompt.

    The same generation path as :meth:`CompiledModel.generate`, on backend ``"none"`` with one batch of
    all prompts, padded to the longest.

    Args:
        params: local params with ``params["config"]`` (from ``load_checkpoint`` or ``shard``).
        prompts: token id lists, any lengths >= 1.
        mesh: the mesh the params were sharded for.
        max_seq_len: KV-cache length (default: longest prompt + max_new_tokens).
        plan: the parallel plan (default: the params' own); with layer-sharded params its ``prefetch_step``
            ``k`` fetches layer ``l + k``'s weights during layer ``l`` (eager broadcasts overlap until first
            use); 0 is synchronous.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"greedy_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    width = max(len(p) for p in prompts)
    if isinstance(params, dict) and "config" in params:
        check_length(width, max_new_tokens, params["config"].max_position_embeddings)
    total = max_seq_len or width + max_new_tokens
    if width + max_new_tokens > total:
        raise ValueError(
            f"greedy_generate: prompts of {width} tokens + {max_new_tokens} "
            f"new need max_seq_len >= {width + max_new_tokens}, got {total}"
        )
    model = compile_model(
        params,
        mesh,
        backend="none",
        batch_sizes=[len(prompts)],
        max_seq_len=total,
        prefill_lengths=[width],
        plan=plan,
    )
    return model.generate(prompts, max_new_tokens)
