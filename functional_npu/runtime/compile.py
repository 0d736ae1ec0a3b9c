"""``compile_model(params, mesh)``: the model's forward traced whole, prefill and decode, on static shapes.

Decode runs on batch-size buckets (like vllm-ascend's ``graph_batch_sizes``): a batch is padded up
to the next bucket. Prefill is bucketed by batch and by length (powers of two). Every graph is
traced with ``fullgraph=True``; a graph break is an error that names its cause.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..parallel import prefetch
from .backends import Backend, resolve_backend
from .checkpoint import check_plan
from ..core.layout import Layout
from ..core.mesh import Mesh
from ..models import family_of
from ..parallel.prefetch import check_prefetch_step
from ..parallel.schedule import PrefetchSchedule
from ..core.shard import local_shape
from ..core.tree import flatten_with_paths

__all__ = ["CompiledModel", "compile_model", "cache_length", "GraphBreakError"]


class GraphBreakError(RuntimeError):
    """The forward could not be traced as one graph; the message names the cause."""


def cache_length(tokens: int, minimum: int = 64) -> int:
    """A KV-cache length for ``tokens`` positions: the smallest power of two that fits, at least ``minimum``."""
    return max(minimum, 1 << (tokens - 1).bit_length())


def _buckets(limit: int, start: int = 1) -> tuple[int, ...]:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out + [limit])


@dataclass(frozen=True)
class CompiledModel:
    """A model bound to a mesh and a compiled forward. Build it with :func:`compile_model`."""

    params: dict = field(repr=False)
    mesh: Mesh
    backend: Backend
    batch_sizes: tuple[int, ...]
    max_seq_len: int
    prefill_lengths: tuple[int, ...]
    forward: Callable[..., torch.Tensor] = field(repr=False)
    prefetch_step: int = 0
    # one bucket per graph: more recompiles than dynamo's default limit. Built once: making a
    # config patch costs far more than entering one, and this is entered on every step.
    _recompiles: Any = field(default_factory=lambda: torch._dynamo.config.patch(recompile_limit=256), repr=False, compare=False)

    @property
    def config(self) -> Any:
        return self.params["config"]

    def _bucket(self, values: Sequence[int], n: int, what: str) -> int:
        i = bisect.bisect_left(values, n)
        if i == len(values):
            raise ValueError(f"{what} {n} exceeds the largest bucket {values[-1]}; pass larger batch_sizes / max_seq_len to compile_model")
        return values[i]

    def _run(self, phase: str, tokens: torch.Tensor, positions: torch.Tensor, cache: list, prefetched: list | None) -> torch.Tensor:
        if "series" in self.params and (prefetched is None) != (self.prefetch_step == 0):
            raise ValueError(f"{phase}: a model compiled with prefetch_step={self.prefetch_step} needs the state from new_prefetch() (None for 0)")
        try:
            with torch.no_grad(), self._recompiles:
                return self.forward(self.params, tokens, positions, cache, self.mesh, prefetched)
        except torch._dynamo.exc.Unsupported as e:
            raise GraphBreakError(f"{phase} graph of {self.config.architecture} breaks under fullgraph tracing: {e}") from e

    def new_cache(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A zeroed KV cache for a batch bucket (``batch`` is rounded up to a bucket)."""
        b = self._bucket(self.batch_sizes, batch, "batch size")
        return family_of(self.config).init_cache(self.config, self.mesh, b, self.max_seq_len, self.params["embed"].dtype)

    def new_prefetch(self) -> list[torch.Tensor] | None:
        """The carried prefetch state for a first step: layers ``0 .. k-1`` issued now (on every rank).

        None when nothing is layer-sharded or ``prefetch_step`` is 0. Prefill and decode replace
        its contents in place, like the KV cache; all ranks of the series axis must make the same
        sequence of calls.
        """
        if "series" not in self.params or not self.prefetch_step:
            return None
        return prefetch.start(self.params, self.mesh, self.prefetch_step)

    def prefill(self, prompts: Sequence[Sequence[int]], cache: list, prefetched: list | None = None) -> torch.Tensor:
        """Run the prompts (right-padded to a bucket) into ``cache``; returns each prompt's last logits ``[B, V]``."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill: every prompt needs at least one token")
        b, width = cache[0][0].shape[0], max(len(p) for p in prompts)
        if len(prompts) > b:
            raise ValueError(f"prefill: {len(prompts)} prompts do not fit a cache of batch {b}")
        s = self._bucket(self.prefill_lengths, width, "prompt length")
        tokens = torch.zeros(b, s, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.as_tensor(p)
        logits = self._run("prefill", tokens, torch.arange(s).expand(b, s), cache, prefetched)
        last = torch.tensor([len(p) - 1 for p in prompts] + [0] * (b - len(prompts)))
        return logits[torch.arange(b), last][: len(prompts)]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: list, prefetched: list | None = None) -> torch.Tensor:
        """One step: ``tokens [n]`` at ``positions [n]`` (n <= the cache's batch); returns logits ``[n, V]``."""
        b, n = cache[0][0].shape[0], tokens.shape[0]
        if int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"decode: position {int(positions.max())} is past max_seq_len {self.max_seq_len}")
        pad = b - n
        tok = (torch.cat([tokens, tokens.new_zeros(pad)]) if pad else tokens)[:, None]
        pos = (torch.cat([positions, positions.new_zeros(pad)]) if pad else positions)[:, None]
        return self._run("decode", tok, pos, cache, prefetched)[:n, -1]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        lockstep_chunks: int = 0,
    ) -> list[list[int]]:
        """``max_new_tokens`` new ids per prompt: greedy unless ``temperature > 0`` (then top-k / top-p sampling).

        Prompts run in chunks of the largest batch bucket. With layer-sharded weights the ranks of
        the series axis share every broadcast, so they must step together: ``lockstep_chunks`` is
        the number of chunks the busiest of them runs, and a rank with fewer runs dummy chunks
        (prefill and decode of a one-token prompt, results dropped) until then.
        """
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens > self.max_seq_len:
            raise ValueError(f"generate: {longest} prompt tokens + {max_new_tokens} new exceed max_seq_len {self.max_seq_len}")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        pick = _sampler(temperature, top_k, top_p, gen)
        width = self.batch_sizes[-1]
        chunks = [prompts[i : i + width] for i in range(0, len(prompts), width)]
        real = len(chunks)
        chunks += [[[0]]] * (lockstep_chunks - real)
        out: list[list[int]] = []
        for c, chunk in enumerate(chunks):
            cache, carried = self.new_cache(len(chunk)), self.new_prefetch()
            step = pick(self.prefill(chunk, cache, carried))
            pos, steps = torch.tensor([len(p) for p in chunk]), [step]
            for _ in range(max_new_tokens - 1):
                step = pick(self.decode(step, pos, cache, carried))
                pos = pos + 1
                steps.append(step)
            prefetch.drain(carried)
            if c < real:
                out += torch.stack(steps, dim=1).tolist()
        return out


def _sampler(temperature: float, top_k: int | None, top_p: float | None, gen: torch.Generator | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise ValueError(f"sampling: need temperature >= 0, top_k >= 1, 0 < top_p <= 1; got {temperature}, {top_k}, {top_p}")
    if temperature == 0:
        return lambda logits: logits.argmax(-1)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float() / temperature
        if top_k is not None:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]

    return sample


def _check_params(params: dict, mesh: Mesh) -> Any:
    cfg = params.get("config") if isinstance(params, dict) else None
    try:
        family_of(cfg)
    except (TypeError, ValueError):
        raise TypeError("compile_model: params carry no model config (params['config']); load them with load_checkpoint or add one") from None
    full, layouts = check_plan(cfg, mesh, where="compile_model", layer_shard=params.get("layer_shard"))
    got = dict(flatten_with_paths(params))
    for path, x in flatten_with_paths(full):
        if path not in got:
            raise ValueError(f"compile_model: params[{path!r}] is missing")
        want = local_shape(x.shape, layouts[path], mesh, path=path)
        if tuple(got[path].shape) != want:
            raise ValueError(
                f"compile_model: params[{path!r}] has shape {tuple(got[path].shape)} but mesh {mesh.shape} at "
                f"{mesh.coordinate} expects {want}; were the params sharded for another mesh?"
            )
    return cfg


def _axis_groups(specs: Any) -> list[tuple[str, ...]]:
    """The multi-axis tuples some layout shards over (their collectives need a group of their own)."""
    layouts = [x for _, x in flatten_with_paths(specs, is_leaf=lambda x: isinstance(x, Layout))]
    return sorted({d.axes for lay in layouts for d in lay.dims if d is not None and len(d.axes) > 1})


def _inductor_options(params: dict, mesh: Mesh, k: int) -> dict[str, Any]:
    """The prefetch scheduling pass, when layer-sharded series are fetched over a real axis."""
    series = params.get("series") or {}
    if not series or mesh.axis_size(params["layer_shard"].axis) == 1:
        return {}
    n, layers = len(series), params["config"].num_layers
    return {"reorder_for_compute_comm_overlap": True, "reorder_for_compute_comm_overlap_passes": [PrefetchSchedule(k * n, layers * n)]}


def compile_model(
    params: dict,
    mesh: Mesh,
    *,
    backend: str = "auto",
    mode: str | None = None,
    batch_sizes: Sequence[int] | None = None,
    max_seq_len: int | None = None,
    prefill_lengths: Sequence[int] | None = None,
    prefetch_step: int = 0,
) -> CompiledModel:
    """Bind local params to a mesh and a compiler; graphs are traced on first use of each shape.

    Args:
        params: this rank's params with ``params["config"]`` (from ``load_checkpoint``).
        mesh: the mesh they were sharded for (a ``tp`` axis; other axes hold replicas).
        backend: "auto" (torchair on NPU, inductor elsewhere), "inductor", "torchair", "eager", "aot_eager".
        mode: the backend's mode (see :func:`functional_npu.backends.resolve_backend`).
        batch_sizes: decode/prefill batch buckets (default 1, 2, 4, 8).
        max_seq_len: KV-cache length (default min(max_position_embeddings, 2048)).
        prefill_lengths: prompt-length buckets (default powers of two from 16 up to max_seq_len).
        prefetch_step: for layer-sharded params (``load_checkpoint(..., layer_shard=...)``), fetch
            layer ``l + k``'s weights while layer ``l`` computes (``0 <= k <= num_layers - 2``;
            0 is synchronous). Under inductor a scheduling pass keeps that order with ``k + 1``
            live buffers (:class:`functional_npu.schedule.PrefetchSchedule`).

    Example:
        >>> model = compile_model(load_checkpoint(path, mesh), mesh)     # doctest: +SKIP
        >>> model.generate([[1, 2, 3]], max_new_tokens=16)               # doctest: +SKIP
    """
    cfg = _check_params(params, mesh)
    if not mesh.is_abstract:
        mesh.init_groups()  # collectively, before any tracing
        mesh.init_groups(*_axis_groups(family_of(cfg).param_specs(cfg)))  # and groups over several axes (expert parallelism)
    sizes = tuple(sorted(set(batch_sizes or (1, 2, 4, 8))))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"compile_model: batch_sizes must be positive ints, got {batch_sizes}")
    seq = max_seq_len or min(cfg.max_position_embeddings, 2048)
    lengths = tuple(sorted(set(prefill_lengths))) if prefill_lengths else _buckets(seq, min(16, seq))
    if lengths[-1] > seq:
        raise ValueError(f"compile_model: prefill length bucket {lengths[-1]} exceeds max_seq_len {seq}")
    k = check_prefetch_step(prefetch_step, cfg.num_layers)
    chosen = resolve_backend(backend, mode=mode, device_type=params["embed"].device.type)
    attention = "math" if chosen.name == "torchair" else "sdpa"  # every op of math attention has a GE converter
    options = _inductor_options(params, mesh, k) if chosen.name == "inductor" else {}
    fwd = chosen.compile(functools.partial(family_of(cfg).forward, attention=attention), dynamic=False, inductor_options=options)
    return CompiledModel(params, mesh, chosen, sizes, seq, lengths, fwd, k)
