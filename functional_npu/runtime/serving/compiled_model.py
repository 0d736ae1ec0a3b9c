"""A compiled model: params bound to a mesh and a compiled forward, and what runs it (a decode state with its KV cache
and prefetch ring, prefill, decode, generation, new weights for the same graphs). Built by
:func:`~functional_npu.runtime.serving.compile.compile_model`.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.mesh import Mesh
from ...core.tree import flatten_with_paths
from ...models import init_state
from ...models.decoder import DecodeState
from ...models.paged import PagedKV
from ...parallel import prefetch
from ...parallel.plan import Plan
from ...parallel.prefetch_ring import Ring, RingPhase
from ...placement.placement import Placement, placement_of
from .backends import Backend
from .compile_policy import GRAPH_BUDGET
from .generate import Lockstep, Samples, check_token_ids, generate, sample
from .step_graph import StepGraphs

__all__ = ["CompiledModel", "GraphBreakError", "static_addresses"]


class GraphBreakError(RuntimeError):
    """The forward could not be traced as one graph; the message names the cause."""


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
    # the prefetch ring's layout, answered once at compile time from the params in the graphs' forms (None: no ring);
    # its k is the placement's resolved prefetch_step, and the forwards take it as a constant
    ring: Ring | None = None
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
    # the emulated host link the graphs name (compile_model(host_link=...)); a step outside its with block is refused
    host_link: Any = field(default=None, repr=False, compare=False)
    # the library's own graphs around each step (a ring filled from host memory on a GPU, where inductor's CUDA graphs
    # would skip the step): :mod:`.step_graph`; None where the backend captures, or nothing does
    _graphs: StepGraphs | None = field(default=None, repr=False, compare=False)

    @property
    def captured(self) -> str | None:
        """Who replays the steps as captured graphs: ``"backend"`` (inductor's CUDA graphs), ``"library"`` (the
        library's own graph around each step, :mod:`.step_graph`: series kept in host memory on a GPU), or None. A
        captured step reads its inputs at the addresses it was captured with, so the KV cache of a bucket and the ring
        are then one buffer each, reused by every state."""
        if self.backend.captures:
            return "backend"
        return "library" if self._graphs is not None else None

    @property
    def config(self) -> Any:
        return self.params.config

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
        self,
        phase: str,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        state: DecodeState,
        forward: Any = None,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.host_link is not None and not self.host_link.entered:
            raise RuntimeError(
                f"{phase}: the model was compiled with an EmulatedHostLink ({self.host_link.name!r}) whose with block "
                f"has ended: its graphs copy through it; run the model inside `with link:`, or compile it again "
                f"without host_link"
            )
        if self.ring is not None:  # the state's buffers against the layout answered at compile time
            try:
                self.ring.check(state.prefetched)
            except ValueError as e:
                raise ValueError(
                    f"{phase}: a model compiled with prefetch_step={self.ring.k} needs a state from new_state(): {e}"
                ) from None
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        args = (self.params, tokens, positions, state, self.mesh) + (() if last is None else (last.to(self.device),))
        try:
            with torch.no_grad(), self._recompiles:
                if self._graphs is not None:
                    out = self._graphs(forward or self.forward, *args)
                elif not self.backend.captures:
                    out = (forward or self.forward)(*args)
                else:
                    torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs were copied out
                    out = (forward or self.forward)(*args).clone()
        except torch._dynamo.exc.Unsupported as e:
            raise GraphBreakError(
                f"{phase} graph of {self.config.architecture} breaks under fullgraph tracing: {e}"
            ) from e
        if self.host_link is not None:
            self.host_link.check()  # a link thread's failure, raised here rather than lost
        return out

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
        same_tensors(params, self.params["embed"], "with_params", reference=self.params)
        new = self._prepare(params)
        if self.backend.captures:
            static_addresses(new)
        graphs = StepGraphs(self._graphs.api) if self._graphs is not None else None  # captured on the old weights
        return dataclasses.replace(self, params=new.placed(self.placement), _graphs=graphs)

    def new_state(self, batch: int) -> DecodeState:
        """A fresh decode state for a batch bucket (``batch`` is rounded up to a bucket): a zeroed KV
        cache and, with layer-sharded params, the prefetch ring (``k + 1`` slots, layers ``0 .. k-1`` issued now).

        Where steps are captured graphs (:attr:`captured`) the KV cache of a bucket is one buffer at a fixed
        address, zeroed by each ``new_state``, and the ring's slots are the same tensors in every state, as a captured
        graph replays on the addresses it was captured with: a state from an earlier ``new_state`` of the same bucket
        is then this one. The ring starts at phase 0 (one graph per phase, :attr:`~.prefetch_ring.Ring.phases`). All
        ranks of the series axis must make the same sequence of calls.

        Raises:
            ValueError: ``batch`` below 1 or past the largest bucket; TypeError: not an int.
        """
        if not isinstance(batch, int) or isinstance(batch, bool):
            raise TypeError(f"new_state: batch must be an int >= 1, got {type(batch).__name__} {batch!r}")
        if batch < 1:
            raise ValueError(
                f"new_state: batch must be an int >= 1 (it is rounded up to a bucket of {list(self.batch_sizes)}), "
                f"got {batch}"
            )
        b = self._bucket(self.batch_sizes, batch, "batch size", "batch_sizes")
        state = self._kv.get(b) if self.captured else None
        if state is None:
            dtype = self.params["embed"].dtype
            state = init_state(self.config, self.mesh, b, self.max_seq_len, dtype, plan=self.plan, device=self.device)
        if self.captured:
            for t in (t for layer in state.kv for t in layer):
                torch._dynamo.mark_static_address(t.zero_())
            self._kv[b] = state
        return self._with_ring(state)

    def paged_state(self, batch: int, kv: list, like: DecodeState | None = None) -> DecodeState:
        """A decode state of a batch bucket over a paged KV cache ``kv`` (per layer a
        :class:`~functional_npu.models.paged.PagedKV`: pools shared by every bucket, this bucket's block table), and
        the prefetch ring as :meth:`new_state` gives it, or ``like``'s ring and phase (the states of one engine carry
        one ring through its steps, whichever bucket each step runs at). On a backend that captures graphs the pools
        and the table are inputs at fixed addresses (the engine writes the table in place before each call)."""
        b = self._bucket(self.batch_sizes, batch, "batch size", "batch_sizes")
        if kv[0].table.shape[0] != b:
            raise ValueError(f"paged_state: the block table has {kv[0].table.shape[0]} rows; the bucket is {b}")
        if self.captured:
            for t in {id(t): t for layer in kv for t in layer}.values():
                torch._dynamo.mark_static_address(t)
        if like is not None:
            return DecodeState(kv, like.prefetched, like.phase)
        return self._with_ring(DecodeState(kv, [], RingPhase()))

    def _with_ring(self, state: DecodeState) -> DecodeState:
        """``state`` with the prefetch ring started for a first step (the model's one ring on a capturing backend)."""
        if self.captured:
            if not self._ring and self.ring is not None:
                self._ring[:] = self.ring.new(self.device)
                for t in self._ring:
                    torch._dynamo.mark_static_address(t)
        ring = prefetch.start(self.params, self.mesh, self.ring, list(self._ring) if self._ring else None)
        return state._replace(prefetched=ring, phase=RingPhase())

    def prefill(self, prompts: Sequence[Sequence[int]], state: DecodeState, *, length: int = 0) -> torch.Tensor:
        """Run the prompts (right-padded to the bucket of their longest, or of ``length``; the pads at the position
        after their prompt's last) into ``state``; returns each prompt's last logits ``[B, V]``.

        Raises:
            ValueError naming the prompt: no tokens, or a token id outside ``[0, vocab_size)``; TypeError: ids that
            are not ints.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prefill: every prompt needs at least one token")
        try:
            check_token_ids(prompts, self.config.vocab_size)
        except (TypeError, ValueError) as e:
            raise type(e)(f"prefill: {str(e).removeprefix('generate: ')}") from None
        b, width = _rows(state), max(length, *(len(p) for p in prompts))
        if len(prompts) > b:
            raise ValueError(f"prefill: {len(prompts)} prompts do not fit a cache of batch {b}")
        s = self._bucket(self.prefill_lengths, width, "prompt length", "prefill_lengths")
        tokens = torch.zeros(b, s, dtype=torch.long)  # built here, moved to the params' device once
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.as_tensor(p)
        # pads at the position after their prompt: the slot the first decode step overwrites (a ring cache's too)
        ends = torch.tensor([len(p) for p in prompts] + [s] * (b - len(prompts)))
        positions = torch.minimum(torch.arange(s), ends[:, None])
        last = torch.tensor([len(p) - 1 for p in prompts] + [0] * (b - len(prompts)))
        return self._run("prefill", tokens, positions, state, last=last)[: len(prompts), 0]

    def extend(
        self, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState, *, last: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Put ``tokens [B, S]`` at ``positions [B, S]`` into ``state`` (B the state's batch, S a prompt-length bucket:
        a prefill chunk, which may start past position 0 over a cache holding the earlier ones); returns their logits
        ``[B, S, V]``, or with ``last [B]`` (an index into each row's ``S`` tokens) the logits at those positions alone,
        ``[B, V]``: the head runs on one row per sequence (a graph of its own per shape).

        Raises:
            ValueError: ``tokens`` and ``positions`` not both ``[B, a prompt-length bucket]``, a position past
                ``max_seq_len``, ``last`` not ``[B]`` integers in ``[0, S)``.
        """
        b, s = _rows(state), tokens.shape[1]
        if tokens.shape != (b, s) or positions.shape != (b, s) or s not in self.prefill_lengths:
            raise ValueError(
                f"extend: tokens {tuple(tokens.shape)} and positions {tuple(positions.shape)} must both be [batch {b}, "
                f"a prompt-length bucket {list(self.prefill_lengths)}]"
            )
        if int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"extend: position {int(positions.max())} is past max_seq_len {self.max_seq_len}")
        if last is None:
            return self._run("prefill", tokens, positions, state)
        if (
            not isinstance(last, torch.Tensor)
            or last.shape != (b,)
            or last.dtype.is_floating_point
            or last.dtype == torch.bool
            or int(last.min()) < 0
            or int(last.max()) >= s
        ):
            got = f"{tuple(last.shape)} {last.dtype} {last.tolist()}" if isinstance(last, torch.Tensor) else repr(last)
            raise ValueError(f"extend: last must be [batch {b}] integer indices in [0, {s}), got {got}")
        return self._run("prefill", tokens, positions, state, last=last.long())[:, 0]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One step: ``tokens [n]`` at ``positions [n]`` (n <= the state's batch); returns logits ``[n, V]``.

        Raises:
            TypeError: ``tokens`` or ``positions`` not an integer tensor; ValueError: not both ``[n]`` with
            ``1 <= n <=`` the state's batch, a position outside ``[0, max_seq_len)``, and, where the tokens are on
            the host (the CPU), a token id outside ``[0, vocab_size)`` (tokens on an accelerator are not read: that
            would wait for the device on every step).
        """
        return self._step("decode", tokens, positions, state, self.forward)

    def decode_greedy(self, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One greedy step through the argmax head: the next ``tokens [n]`` (-1 where the largest logit is
        not finite), no logits moved between the ranks of a vocab-parallel head. Checked as :meth:`decode` is, but
        for -1 (the step before's non-finite mark: its steps run on, and generation raises at the end)."""
        if self.greedy_forward is None:
            raise ValueError("decode_greedy: compile the model with compile_model(..., greedy_head=True)")
        return self._step("decode", tokens, positions, state, self.greedy_forward, lowest=-1)

    def _step(
        self,
        phase: str,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        state: DecodeState,
        forward: Any,
        lowest: int = 0,
    ) -> torch.Tensor:
        b = _rows(state)
        n = check_step(tokens, positions, b, self.max_seq_len, phase)
        check_ids(tokens, lowest, self.config.vocab_size, phase)
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


def check_step(tokens: Any, positions: Any, batch: int, max_seq_len: int, where: str) -> int:
    """Raise a one-line TypeError / ValueError unless ``tokens`` and ``positions`` are integer tensors ``[n]``,
    ``1 <= n <= batch``, with every position in ``[0, max_seq_len)`` (read on any device, as before); returns n."""
    for name, x in (("tokens", tokens), ("positions", positions)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a 1-d integer tensor [n], got {type(x).__name__}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{where}: {name} are {x.dtype}; give an integer tensor (torch.long)")
    n = tokens.shape[0] if tokens.dim() == 1 else -1
    if tokens.dim() != 1 or positions.shape != tokens.shape or not 1 <= n <= batch:
        raise ValueError(
            f"{where}: tokens {list(tokens.shape)} and positions {list(positions.shape)} must both be [n] with "
            f"1 <= n <= the state's batch {batch}"
        )
    low, high = int(positions.min()), int(positions.max())  # on an accelerator too: a cache write past its end
    if low < 0 or high >= max_seq_len:  # there would land in another buffer's memory
        raise ValueError(
            f"{where}: positions must be in [0, max_seq_len {max_seq_len}), got {low if low < 0 else high}"
        )
    return n


def check_ids(tokens: torch.Tensor, lowest: int, vocab_size: int, where: str) -> None:
    """Raise a one-line ValueError naming the first row of ``tokens [n]`` whose id is outside ``[lowest,
    vocab_size)``, where ``tokens`` is on the host (on an accelerator: nothing, no wait for the device)."""
    if tokens.device.type != "cpu":
        return
    bad = ((tokens < lowest) | (tokens >= vocab_size)).nonzero()
    if len(bad):
        row = int(bad[0, 0])
        raise ValueError(
            f"{where}: tokens[{row}] is {int(tokens[row])}, outside the vocabulary [0, {vocab_size}); "
            f"tokenize with this model's tokenizer"
        )


def _rows(state: DecodeState) -> int:
    """The batch a state serves: its cache's rows (a paged cache's: its block table's)."""
    layer = state.kv[0]
    return layer.table.shape[0] if isinstance(layer, PagedKV) else layer[0].shape[0]


def static_addresses(params: dict) -> None:
    """Mark every tensor of ``params`` as an input whose address never changes (no guard on it), so that CUDA graphs
    read the weights where they are. Unmarked, every replay first copies each weight into the graph's own input
    buffer: on an H200 that was about 100 device-to-device copies per decode step, half the step's time
    (benchmarks/results/gpu.json). Inductor's FX graph cache does not key on the mark: a graph cached unmarked keeps
    its copies."""
    for _, t in flatten_with_paths(params):
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_static_address(t, guard=False)


def same_tensors(
    params: dict, like: torch.Tensor, where: str, *, dtypes: bool = True, reference: dict | None = None
) -> None:
    """Every leaf of ``params`` on ``like``'s device, every float leaf in its dtype (the graphs are compiled for
    those; ``dtypes=False``: only the series kept in host memory, which the ring copies into slots of the weights'
    dtype); the series kept in host memory (``params["host"]``, :mod:`~functional_npu.parallel.offload`) on the host.
    A leaf on the meta device (shapes without data) is refused wherever it is: the graphs would compute on whatever
    memory stood in for it. ``reference``: the model's own params; a leaf that is floating there must be here too
    (an int64 leaf in a float one's place once ran)."""
    floating = {
        p for p, r in flatten_with_paths(reference or {}) if isinstance(r, torch.Tensor) and r.is_floating_point()
    }
    for path, x in flatten_with_paths(params):
        if not isinstance(x, torch.Tensor):
            continue
        host = path.startswith("host.")
        device = torch.device("cpu") if host else like.device
        wrong_dtype = x.is_floating_point() and x.dtype != like.dtype and (dtypes or host)
        wrong_dtype = wrong_dtype or (path in floating and not x.is_floating_point())
        if x.device != device or wrong_dtype or x.is_meta:
            shown = x.is_floating_point() or path in floating
            what = f"{x.dtype} on {x.device}" if shown else f"on {x.device}"
            want = f"{like.dtype} on {device}" if shown else f"on {device}"
            raise ValueError(
                f"{where}: params[{path!r}] is {what}, the compiled model's weights {want}; load them in that dtype "
                f"on that device (load_checkpoint(dtype=..., device=...))"
            )
