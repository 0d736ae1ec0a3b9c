"""``compile_model(params, mesh, options)``: the model's forward traced whole, prefill and decode, on static shapes,
in one top-to-bottom path over the options read once (:class:`CompileOptions`).

Decode runs on batch-size buckets (like vllm-ascend's ``graph_batch_sizes``): a batch is padded up
to the next bucket. Prefill is bucketed by batch and by length (powers of two). Every graph is
traced with ``fullgraph=True``; a graph break is an error that names its cause. What is decided before tracing is
:mod:`.compile_policy`'s; the compiled model is :mod:`.compiled_model`'s; saved graphs are :mod:`.compile_cache`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...core.mesh import Mesh
from ...models import family_of
from ...models.linear import TARGETS
from ...parallel.host_link import EmulatedHostLink, check_host_link
from ...parallel.offload import check_host_backend, host_of
from ...parallel.plan import Plan
from ...parallel.prefetch_ring import ring_of
from ...placement.placement import placement_of
from ...placement.ring_memory import warn_ring_memory
from .backends import BACKENDS, MODES, Backend, resolve_backend
from .compile_cache import compiled_forward, graph_dir
from .compile_policy import (
    GRAPH_BUDGET,
    LINEARS,
    REALIZE_INPUTS,
    check_comm_streams,
    check_graphs,
    check_phases,
    check_streamed,
    check_wrapper,
    invariant_options,
    prefetch_options,
    preparer,
    shape_buckets,
    streamed_linears,
    uncovered,
    with_step,
)
from .compiled_model import CompiledModel, same_tensors, static_addresses
from .generate import check_length
from .inductor_cache import sweep
from .step_graph import StepGraphs

__all__ = ["CompileOptions", "compile_model", "greedy_generate"]


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How ``compile_model`` compiles: one value, read once, that the CLI and the planner build.

    Attributes:
        plan: the parallel plan (default: the params' placement's). A plan given beside placed params may differ from
            theirs only in fields that decide no layout (``prefetch_step``, ``prefetch_budget``,
            ``dispatch_threshold``, ``absorb``, ``mla_cache``, ``model``;
            :meth:`~functional_npu.placement.Placement.with_plan`).
            With layer-sharded params, ``plan.prefetch_step`` ``k`` fetches layer ``l + k``'s weights while
            layer ``l`` computes (``0 <= k <= num_layers - 1``; 0 is synchronous), into a ring of ``k + 1`` slots
            that :meth:`CompiledModel.new_state` allocates outside the graph: each broadcast writes its layer in
            place, after the reads of the layer its slot held (:mod:`functional_npu.parallel.prefetch`), so
            nothing in the graph allocates a prefetch buffer and the order is in the graph's data edges (under
            inductor with its ``sink_waits_iterative`` pass, so that each wait sits at its first use:
            :func:`~.compile_policy.prefetch_options`). ``"auto"`` picks ``k`` with the cost model
            (:func:`functional_npu.parallel.prefetch_cost.auto_step`) within ``plan.prefetch_budget``.
        backend: "auto" (torchair on NPU, inductor elsewhere), "inductor", "torchair", "npugraph_ex", "eager",
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
        linear: how float linear weights multiply (:data:`~.compile_policy.LINEARS`): ``"streamed"``, inductor's
            reductions on the CPU, one pass over each weight for a decode step's rows (up to 8 in float32, one in other
            dtypes: :func:`functional_npu.models.linear.streamed`); ``"matmul"``, torch's matmul. Default:
            ``"streamed"`` where it exists (inductor on the CPU, float weights, no layer-sharded ring), else
            ``"matmul"``. Asking for ``"streamed"`` where it does not exist is an error listing what does.
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
        serving_batches: the batch sizes the model will serve (sequences decoding at once): a warning names those
            past the largest of ``batch_sizes``, which have no compiled graph
            (:func:`~.compile_policy.batch_coverage` reports the bucket each one pads to).

    Raises:
        ValueError (one line naming the field, the value and what it takes) for a field no compile could use.
    """

    plan: Plan | None = None
    backend: str = "auto"
    mode: str | None = None
    batch_sizes: Sequence[int] | None = None
    max_seq_len: int | None = None
    prefill_lengths: Sequence[int] | None = None
    prefetch_device: Any = None
    kernels: str | None = None
    linear: str | None = None
    greedy_head: bool = False
    cache_dir: str | os.PathLike | None = None
    host_link: EmulatedHostLink | None = None
    serving_batches: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.plan is not None and not isinstance(self.plan, Plan):
            raise TypeError(
                f"CompileOptions: plan must be a Plan (or None: the params'), got {type(self.plan).__name__}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"compile_model: backend={self.backend!r} is not one of {BACKENDS}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(
                f"compile_model: mode={self.mode!r} is no backend's mode; give one of {MODES} (or None: the one "
                f"measured fastest there)"
            )
        if not isinstance(self.greedy_head, bool):
            raise TypeError(
                f"compile_model: greedy_head must be a bool, got {type(self.greedy_head).__name__} {self.greedy_head!r}"
            )
        if self.max_seq_len is not None and (
            isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int)
        ):
            raise TypeError(
                f"compile_model: max_seq_len must be a positive int (None: the default), got "
                f"{type(self.max_seq_len).__name__} {self.max_seq_len!r}"
            )
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(
                f"compile_model: max_seq_len must be a positive int (None: the default), got {self.max_seq_len}"
            )
        if self.kernels not in (None, *TARGETS):
            raise ValueError(
                f"compile_model: kernels={self.kernels!r} is not one of {TARGETS} (or None: the backend's)"
            )
        if self.linear not in (None, *LINEARS):
            raise ValueError(
                f"compile_model: linear={self.linear!r} is not one of {LINEARS} (or None: the fastest that exists)"
            )
        if self.cache_dir is not None and not str(self.cache_dir):
            raise ValueError(
                "compile_model: cache_dir is '': give a directory for the saved graphs (None: save nothing)"
            )
        for name in ("batch_sizes", "prefill_lengths", "serving_batches"):  # held as a tuple: the value stays frozen
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive_ints(name, getattr(self, name), name != "serving_batches"))

    @classmethod
    def of(cls, options: CompileOptions | None = None, **fields: Any) -> CompileOptions:
        """``options`` (default: the defaults) with ``fields`` replaced.

        Raises:
            TypeError: a field that is not one of the options', naming the ones there are.
        """
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"compile_model: options must be a CompileOptions, got {type(options).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(names))
        if unknown:
            raise TypeError(f"compile_model: no option {', '.join(map(repr, unknown))}; the options are {names}")
        return dataclasses.replace(options or cls(), **fields)


def _positive_ints(name: str, value: Any, nonempty: bool) -> tuple[int, ...]:
    """``value`` as a tuple, refused in one line unless it is a list of positive ints (``nonempty``: at least one)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"compile_model: {name} must be a list of positive ints, got {type(value).__name__} {value!r}")
    got = tuple(value)
    wrong = next((x for x in got if isinstance(x, bool) or not isinstance(x, int)), None)
    if wrong is not None:
        raise TypeError(
            f"compile_model: {name} must be positive ints, got {list(got)} ({wrong!r} is a {type(wrong).__name__})"
        )
    if any(x < 1 for x in got) or nonempty and not got:
        raise ValueError(
            f"compile_model: {name} must be positive ints, got {list(got)}"
            + ("; give at least one (None: the default)" if not got else "")
        )
    return got


def compile_model(params: dict, mesh: Mesh, options: CompileOptions | None = None, /, **fields: Any) -> CompiledModel:
    """Bind local params to a mesh and a compiler; graphs are traced on first use of each shape.

    Args:
        params: this rank's :class:`~functional_npu.core.params.Params` (from ``load_checkpoint``: placed; params
            with no placement, ``shard`` of a family's full params, are placed here under the options' plan);
            quantized weights as stored (the placement's quantization) are put in their kernels' forms here, and
            float32 linear weights input-major on the CPU (:func:`functional_npu.models.linear.prepare_params`),
            once: the model's ``params`` are then its own, and the loaded ones may be dropped.
        mesh: the mesh they were sharded for (the placement's axes; other axes hold replicas).
        options: how to compile (:class:`CompileOptions`; default its defaults).
        fields: options fields given one by one (``backend="inductor", batch_sizes=[1]``), over ``options``.

    Example:
        >>> options = CompileOptions(batch_sizes=[1, 8])                   # doctest: +SKIP
        >>> model = compile_model(load_checkpoint(path, mesh), mesh, options)  # doctest: +SKIP
        >>> model.generate([[1, 2, 3]], max_new_tokens=16)                 # doctest: +SKIP
    """
    o = CompileOptions.of(options, **fields)
    placed = placement_of(params, mesh, o.plan, where="compile_model")
    carried = params.placement  # the one its loader made (and warned about), if any
    cfg = placed.config
    chosen = resolve_backend(o.backend, mode=o.mode, device_type=params["embed"].device.type)
    chosen, step_graphs = library_graphs(params, chosen)
    check_wrapper(chosen, mesh)
    same_tensors(params, params["embed"], "compile_model", dtypes=False)
    check_comm_streams(placed.plan, mesh, chosen, "compile_model")
    check_host_backend(params, chosen.name, chosen.mode, chosen.captures, chosen.device_type, "compile_model")
    check_host_link(params, o.host_link, chosen.device_type, o.cache_dir, "compile_model")
    if chosen.name == "inductor":
        sweep()  # inductor would trust an object a killed compile left half-written in its cache
    # the streamed forms are for inductor's reductions: a forward that is not compiled keeps the plain ones, and so
    # does a model whose layers are fetched by broadcast within the step: fused into one kernel with the streamed
    # reductions, the earlier layers' work moves after the broadcast's wait (the hazard check's overlap finding)
    exact = invariant_options(params, placed, chosen, "compile_model")
    kernels = o.kernels or chosen.kernels
    streamed = streamed_linears(o.linear, chosen, placed, params, mesh, kernels)
    prepare = preparer(placed, mesh, kernels, streamed)
    params = prepare(params)
    check_streamed(o.linear, params)
    if chosen.captures:  # the weights are inputs at fixed addresses: a captured graph reads them in place
        static_addresses(params)
    sizes, seq, lengths = shape_buckets(cfg, o.batch_sizes, o.max_seq_len, o.prefill_lengths)
    placed = with_step(placed, params, o.prefetch_device)
    ring = ring_of(params, mesh, placed.plan)  # once: its layout and k are constants of every graph
    if chosen.name != "none":
        graphs = check_graphs(sizes, lengths, o.greedy_head)
        if ring is not None:
            check_phases(ring.k, cfg.num_layers, graphs)
    if o.serving_batches is not None and (missing := uncovered(sizes, o.serving_batches)):
        warnings.warn(missing, stacklevel=2)
    if placed != carried:  # a placement its loader made was warned about there (load_checkpoint, from_dtensor_state)
        warn_ring_memory(placed, "compile_model")  # the series' owned layers plus the ring against replication
    params = params.placed(placed)
    if not mesh.is_abstract:
        mesh.init_groups()  # collectively, before any tracing
        mesh.init_groups(*placed.axis_groups())  # and groups over several axes (expert parallelism)
    inductor = prefetch_options(params, mesh, placed.plan) if chosen.name == "inductor" else {}
    inductor = inductor | (REALIZE_INPUTS if streamed else {}) | exact
    shapes = (sizes, seq, lengths)
    fwd, greedy = _forwards(o, params, mesh, chosen, placed, ring, shapes, kernels, streamed, inductor)
    # the plain forward never recompiles: no config patch to make (making one costs about a third of a millisecond)
    recompiles = (
        contextlib.nullcontext() if chosen.name == "none" else torch._dynamo.config.patch(recompile_limit=GRAPH_BUDGET)
    )
    return CompiledModel(
        params, mesh, chosen, sizes, seq, lengths, fwd, placed, greedy, ring=ring, _recompiles=recompiles,
        _prepare=prepare, host_link=o.host_link, _graphs=step_graphs,
    )  # fmt: skip


# a capturing inductor mode, and the same mode without CUDA graphs
UNCAPTURED_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def library_graphs(params: dict, chosen: Backend) -> tuple[Backend, StepGraphs | None]:
    """The backend to compile with, and the library's own step graphs where it captures them: for series kept in host
    memory under inductor's CUDA graphs, which would skip (run uncaptured) every step reading them, the same inductor
    mode without CUDA graphs and a :class:`~.step_graph.StepGraphs` on the device's graphs; else ``chosen`` and None."""
    if not host_of(params) or not chosen.captures:
        return chosen, None
    uncaptured = dataclasses.replace(chosen, mode=UNCAPTURED_MODES[chosen.mode])
    return uncaptured, StepGraphs(torch.get_device_module(chosen.device_type))


def _forwards(
    o: CompileOptions,
    params: dict,
    mesh: Mesh,
    chosen: Any,
    placed: Any,
    ring: Any,
    shapes: tuple,
    kernels: str,
    streamed: bool,
    inductor: dict[str, Any],
) -> tuple[Any, Any]:
    """The compiled forward and, with ``greedy_head``, the greedy one: through saved graphs under ``cache_dir``."""
    cfg, plan = placed.config, placed.plan
    attention = "math" if chosen.name == "torchair" else "sdpa"  # every op of math attention has a GE converter
    static = {"blocks": family_of(cfg).blocks(cfg, plan), "plan": plan, "attention": attention, "ring": ring}
    linked = {"host_link": o.host_link.name} if o.host_link is not None else {}
    static["streams"] = dataclasses.replace(chosen.streams, **linked)
    where = graph_dir(
        o.cache_dir, params, mesh, chosen, placed, shapes, kernels=kernels, greedy_head=o.greedy_head,
        options=inductor, linear="streamed" if streamed else "matmul",
    )  # fmt: skip
    fwd = compiled_forward(chosen, static, inductor, where, "forward")
    greedy = compiled_forward(chosen, static | {"greedy": True}, inductor, where, "greedy") if o.greedy_head else None
    return fwd, greedy


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
        params: local :class:`~functional_npu.core.params.Params` (from ``load_checkpoint`` or ``shard``).
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
    if getattr(params, "config", None) is not None:
        check_length(width, max_new_tokens, params.config.max_position_embeddings)
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
