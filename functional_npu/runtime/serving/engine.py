"""Serve a stream of requests: continuous batching over a paged KV cache, through a compiled model's graphs.

An :class:`Engine` holds the requests waiting and running, the KV pool (:mod:`.kv_blocks` over
:mod:`functional_npu.models.paged`'s pools) and one state per batch bucket. Each :meth:`Engine.step`:

1. **admits** waiting requests, oldest first, while a row of the largest batch bucket is free and the pool has
   the blocks of the request's tokens (its prompt, and after a preemption what it had generated);
2. **prefills** one chunk (``chunk`` positions, a compiled prompt-length bucket) of every admitted request whose
   tokens are not all in the cache yet, in one call at the smallest batch bucket that holds them: a long prompt takes
   several steps and never stalls the running decodes;
3. **decodes** one token of every request whose tokens are all cached, in one call at the smallest batch bucket
   that holds them. A request that needs a new block when none is free preempts the request admitted last (its
   blocks are returned and it waits again, to recompute its tokens later): nothing fails, nothing is truncated;
4. picks each new token with the request's own sampler (its temperature, top-k, top-p and seed: a generator of its
   own, so its tokens do not depend on who shares its steps), ends the request at a stop id or at
   ``max_new_tokens``, and returns its blocks.

A request's tokens do not depend on which others share its steps: its rows read only its own blocks, padding
writes only the null block, and every decode step's shapes are a compiled bucket's.

Example:
    >>> engine = Engine(model, blocks=256)                                                       # doctest: +SKIP
    >>> for event in engine.run([Request((1, 2, 3), max_new_tokens=8)]):                          # doctest: +SKIP
    ...     print(event.id, event.tokens, event.finished)
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...models import family_of
from ...models.paged import Layout, PagedKV, init_pools, layout_of, pool_bytes, ring_width
from ...parallel.offload import available_host_bytes
from . import kv_blocks
from .generate import check_sampling, check_token_ids, logprobs_of, sampler
from .replicas import check_replicas, gather_logits, padded, replica_ranks

__all__ = ["Request", "Event", "Engine", "stop_ids", "layout"]


@dataclass(frozen=True)
class Request:
    """One request: ``prompt`` token ids, at most ``max_new_tokens`` new ones, ending early at any of ``stop`` (None:
    the engine's stop ids, the checkpoint's ``eos_token_id``; ``()``: none); sampling as
    :func:`~.generate.sampler`'s; ``logprobs``: each new token's log-probability under the logits it was drawn
    from."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    stop: tuple[int, ...] | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: bool = False


@dataclass(frozen=True)
class Event:
    """What a step gave request ``id``: its new ``tokens`` (and their ``logprobs`` when asked for), and
    ``finished``: None while it runs, else ``"stop"`` (a stop id, kept as its last token), ``"length"``
    (``max_new_tokens``) or ``"abort"``; ``error``: the one-line reason a request was refused (then finished)."""

    id: Hashable
    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finished: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Call:
    """One model call of a step, what every rank of a lockstep group runs: ``kind`` (``"extend"``: a prefill chunk,
    ``tokens``/``positions`` ``[batch, chunk]``; ``"decode"``: ``[n]``), the ``batch`` bucket, the block table
    ``rows [batch, width]`` and, for a model with ring layers, their ring table ``ring_rows [batch, ring width]``; for
    an extend, ``last [batch]``: the chunk position of each row whose logits are wanted (its part's last token)."""

    kind: str
    batch: int
    tokens: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    ring_rows: torch.Tensor | None = None
    last: torch.Tensor | None = None


@dataclass
class _Seq:
    """A request in the engine: its tokens so far (prompt, then generated), how many are cached, its sampler."""

    id: Hashable
    request: Request
    stop: frozenset[int]
    pick: Callable[[torch.Tensor], torch.Tensor]
    tokens: list[int]
    cached: int = 0
    generated: int = 0
    order: int = 0  # admission order: the last admitted is preempted first

    @property
    def prefilling(self) -> bool:
        """Tokens to put in the cache before a decode step can take the last one: a new request's whole prompt (its
        first token comes from the prefill's logits), a preempted one's all but the last."""
        return self.cached < len(self.tokens) - 1 or self.generated == 0 and self.cached < len(self.tokens)


def stop_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The checkpoint's stop ids: ``eos_token_id`` of ``generation_config.json`` when present, else of
    ``config.json`` (an int or a list; none: ``()``).

    Raises:
        ValueError: ``model_dir`` is not a directory, or its ``eos_token_id`` is not an int >= 0 or a list of them.
    """
    if not Path(model_dir).is_dir():
        raise ValueError(f"stop_ids: {str(model_dir)!r} is not a directory; give the checkpoint's directory")
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids = tuple(eos) if isinstance(eos, list) else (eos,)
                if not all(_token_id(t) for t in ids):
                    raise ValueError(
                        f"stop_ids: eos_token_id of {path} must be an int >= 0 or a list of them, got {eos!r}"
                    )
                return ids
    return ()


def _token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def check_stop(stop: Any, vocab_size: int, where: str) -> tuple[int, ...]:
    """``stop`` as a tuple of ids, refused in one line (naming ``where``) unless it is a list of token ids in
    ``[0, vocab_size)``."""
    if isinstance(stop, (str, bytes)) or not isinstance(stop, (Sequence, Set)):
        raise TypeError(
            f"{where}: stop must be a tuple of int token ids (() for none), got {type(stop).__name__} {stop!r}"
        )
    bad = [t for t in stop if not (_token_id(t) and t < vocab_size)]
    if bad:
        raise ValueError(f"{where}: stop ids {bad} are not in the vocabulary [0, {vocab_size})")
    return tuple(stop)


def layout(model: Any) -> Layout:
    """``model``'s paged cache on this rank (:func:`~functional_npu.models.paged.layout_of`, from the family's own
    contiguous cache of one sequence, made on the meta device): which layers keep every position, which a ring of
    their window."""
    blocks = family_of(model.config).blocks(model.config, model.plan)
    return layout_of(blocks.init_kv(model.mesh, 1, model.max_seq_len, _dtype(model), "meta"), model.max_seq_len)


def _dtype(model: Any) -> torch.dtype:
    return model.params["embed"].dtype


@dataclass
class Engine:
    """Continuous batching over a paged KV cache (see the module docstring).

    Attributes:
        model: a :class:`~.compiled_model.CompiledModel`; its batch buckets are the decode batches, its prompt-length
            buckets the prefill chunks.
        blocks: the pool's blocks (block 0 the null block); or ``kv_bytes``: a budget on each rank, what the ring
            layers' pools take (a ring row per batch row) set aside, the rest in blocks
            (:func:`~functional_npu.models.paged.pool_bytes`, the rule the planner prices with).
        block_size: positions per block.
        chunk: the prefill chunk (default: the largest prompt-length bucket); must be one of the buckets.
        stop: the stop ids of a request that names none (default: none; :func:`stop_ids` reads a checkpoint's).
        lockstep: the ranks of ``torch.distributed``'s default group serve one model together (tensor, expert or
            module parallel, layer-sharded series): rank 0 schedules, samples and yields the events, and sends each
            step's calls to the others, which run them in :meth:`follow` (the same calls, the same shapes) until
            rank 0's :meth:`close`. Every wait has the process group's timeout.
        replicas: with ``lockstep``, the data-parallel mesh axis (or axes: a split one, as module TP makes) whose
            ranks serve requests of their own (:mod:`.replicas`): rank 0 keeps a scheduler per index along them and
            gives each new request to the one with the fewest, each step's calls run together at the largest of their
            batch buckets, and every rank runs its own replica's; None: every rank runs rank 0's batch. Refused for
            the plan's tensor-parallel axis.

    Raises:
        ValueError / TypeError in one line naming the field, before anything is built: ``blocks`` or ``block_size``
        that is not an int >= 1, ``kv_bytes`` that is not a finite number >= 0, a pool too small for one sequence or
        larger than the memory free on the model's device, ``stop`` ids outside the vocabulary (as a request's).
    """

    model: Any
    blocks: int | None = None
    kv_bytes: int | None = None
    block_size: int = 16
    chunk: int | None = None
    stop: tuple[int, ...] = ()
    lockstep: bool = False
    replicas: str | tuple[str, ...] | None = None
    _shadow: bool = field(default=False, repr=False)  # another replica's bookkeeping on rank 0: no pools of its own
    _pool: kv_blocks.BlockPool = field(init=False, repr=False)
    _ring: kv_blocks.BlockPool | None = field(init=False, repr=False, default=None)
    _pools: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False, repr=False, default_factory=list)
    _states: dict[int, Any] = field(init=False, repr=False, default_factory=dict)
    _waiting: deque = field(init=False, repr=False, default_factory=deque)
    _running: dict = field(init=False, repr=False, default_factory=dict)
    _ids: Iterator[int] = field(init=False, repr=False, default_factory=itertools.count)
    _order: Iterator[int] = field(init=False, repr=False, default_factory=itertools.count)
    _me: int = field(init=False, repr=False, default=0)  # this rank's replica
    _firsts: list[int] = field(init=False, repr=False, default_factory=list)  # each replica's first rank
    _others: list = field(init=False, repr=False, default_factory=list)  # rank 0: every replica's engine, in order

    def __post_init__(self) -> None:
        model = self.model
        if (self.blocks is None) == (self.kv_bytes is None):
            raise ValueError("Engine: give the pool as blocks=N or as a budget kv_bytes=B (one of the two)")
        check_sizes(self.blocks, self.kv_bytes, self.block_size)
        self.stop = check_stop(self.stop, model.config.vocab_size, "Engine")
        self.layout, dtype, bs = layout(model), _dtype(model), self.block_size
        self.width = kv_blocks.blocks_for(model.max_seq_len, bs)  # a table row: the longest sequence
        self.chunk = self.chunk or max(model.prefill_lengths)
        if self.chunk not in model.prefill_lengths:
            raise ValueError(
                f"Engine: chunk {self.chunk} is not a compiled prompt-length bucket {list(model.prefill_lengths)}; "
                f"pass one of them, or compile_model(prefill_lengths=[..., {self.chunk}])"
            )
        self.ring_width = ring_width(self.layout, self.chunk, bs, self.width)
        ring_blocks = max(model.batch_sizes) * self.ring_width + 1 if self.ring_width else 0  # every row's ring
        rings = pool_bytes(self.layout, 0, bs, dtype, ring_blocks)
        one = pool_bytes(self.layout, 1, bs, dtype)
        blocks = self.blocks if self.blocks is not None else int(max(0, self.kv_bytes - rings) // max(one, 1))
        if blocks < self.width + 1:
            least = pool_bytes(self.layout, self.width + 1, bs, dtype, ring_blocks)
            raise ValueError(
                f"Engine: a pool of {blocks} blocks of {bs} positions cannot hold one sequence of "
                f"max_seq_len {model.max_seq_len} ({self.width} blocks, and the null block): give at least "
                f"blocks={self.width + 1} (kv_bytes={least} on each rank), or compile with a smaller max_seq_len"
            )
        if not self._shadow:  # (a shadow's pool is its rank's twin, checked there)
            self._check_fits(blocks, ring_blocks, dtype)  # before the bookkeeping of a pool that cannot exist
        self._pool = kv_blocks.new_pool(blocks, bs)
        self._ring = kv_blocks.new_pool(ring_blocks, bs) if ring_blocks else None
        self.kv_bytes_used = pool_bytes(self.layout, blocks, bs, dtype, ring_blocks)
        if self._shadow:
            return
        if self.lockstep and not torch.distributed.is_initialized():
            raise ValueError(
                "Engine(lockstep=True): the ranks' process group is not initialized (run under a launcher)"
            )
        if self.replicas is not None:
            self._start_replicas(blocks)
        self._pools = init_pools(self.layout, blocks, ring_blocks, bs, dtype, model.device)

    def _start_replicas(self, blocks: int) -> None:
        """Every rank: its replica along ``replicas`` and each replica's first rank (gathered from every rank); rank
        0: a scheduler per replica, this engine its own replica's (:mod:`.replicas`)."""
        axes, n = check_replicas(self.model.plan, self.model.mesh, self.replicas)
        if not self.lockstep:
            raise ValueError(
                f"Engine: replicas={self.replicas!r} serve in lockstep across ranks: pass lockstep=True (under a "
                f"launcher)"
            )
        self._me = self.model.mesh.axis_index(axes)
        ranks: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, self._me)
        self._firsts = replica_ranks(ranks, n)
        if _rank() == 0:
            kin = dict(blocks=blocks, block_size=self.block_size, chunk=self.chunk, stop=self.stop, _shadow=True)
            self._others = [self if r == self._me else Engine(self.model, **kin) for r in range(n)]

    def _check_fits(self, blocks: int, ring_blocks: int, dtype: torch.dtype) -> None:
        """Refuse, before anything is built, a pool larger than the memory free on the model's device."""
        bs, device = self.block_size, self.model.device
        need, free = pool_bytes(self.layout, blocks, bs, dtype, ring_blocks), free_bytes(device)
        if free is None or need <= free:
            return
        given = f"blocks={_shown(blocks)}" if self.blocks is not None else f"kv_bytes={_shown(self.kv_bytes)}"
        one, rings = pool_bytes(self.layout, 1, bs, dtype), pool_bytes(self.layout, 0, bs, dtype, ring_blocks)
        most = (free - rings) // max(one, 1)
        room = (
            f"blocks={most} (or kv_bytes={free})" if self.blocks is not None else f"kv_bytes={free} (or blocks={most})"
        )
        fix = f"give at most {room}" if most >= self.width + 1 else "use a smaller block_size, or a smaller max_seq_len"
        raise ValueError(
            f"Engine: {given} asks for a KV pool of {_shown(need)} bytes ({_shown(blocks)} blocks of block_size={bs} "
            f"positions), more than the {free} bytes free on {device}; {fix}"
        )

    # ---- the requests ------------------------------------------------------------------------------------------

    def add(self, request: Request, id: Hashable | None = None) -> Hashable:
        """Queue ``request`` (rank 0 of a lockstep group); returns its id. Refused in one line naming the request
        (nothing else changes), and so is an ``id`` already waiting or running."""
        if self.lockstep and _rank() != 0:
            raise ValueError(
                f"Engine.add: rank {_rank()} follows rank 0's calls (Engine.follow); add requests on rank 0"
            )
        id = next(self._ids) if id is None else id
        if not isinstance(id, Hashable):
            raise TypeError(f"Engine.add: id must be hashable (a str or an int), got {type(id).__name__}")
        engines = self._engines()
        if any(id in e._running or any(s.id == id for s in e._waiting) for e in engines):
            raise ValueError(
                f"Engine.add: request id {id!r} is already in the engine; give each request its own id (or none: the "
                f"engine numbers them), or abort the first"
            )
        check_request(request, self.model, id)
        stop = frozenset(self.stop if request.stop is None else request.stop)
        pick = sampler(request.temperature, request.top_k, request.top_p, request.seed)
        least = min(engines, key=lambda e: len(e._running) + len(e._waiting))  # the replica with the fewest requests
        least._waiting.append(_Seq(id, request, stop, pick, list(request.prompt)))
        return id

    def _engines(self) -> list[Engine]:
        """Every replica's engine, in replica order (rank 0 of an engine with replicas), else this one."""
        return self._others or [self]

    def replica_of(self, id: Hashable) -> int | None:
        """The replica request ``id`` is served by (0 without replicas); None: not in the engine."""
        for r, e in enumerate(self._engines()):
            if id in e._running or any(s.id == id for s in e._waiting):
                return r
        return None

    def abort(self, id: Hashable) -> Event | None:
        """End request ``id`` wherever it is, returning its blocks; its final event (None: not in the engine)."""
        for e in self._engines():
            for seq in list(e._waiting):
                if seq.id == id:
                    e._waiting.remove(seq)
                    return Event(id, finished="abort")
            if id in e._running:
                e._release(id)
                return Event(id, finished="abort")
        return None

    @property
    def pool(self) -> kv_blocks.BlockPool:
        """The KV pool's bookkeeping now (an immutable value): this rank's replica's, with ``replicas``."""
        return self._pool

    def has_work(self) -> bool:
        return any(e._waiting or e._running for e in self._engines())

    def run(self, requests: Iterable[Request]) -> Iterator[Event]:
        """Serve ``requests`` (ids 0, 1, ... in order unless the engine has given ids already) and yield their
        events as they come; a refused request yields one event with its ``error``."""
        for request in requests:
            id = next(self._ids)
            try:
                self.add(request, id)
            except (TypeError, ValueError) as e:
                yield Event(id, finished="error", error=str(e))
        while self.has_work():
            yield from self.step()

    # ---- one step ----------------------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Admit, prefill a chunk, decode a token (see the module docstring); the events of this step. With
        ``replicas``, every replica's step, their calls run together (one call of each kind at the largest of their
        batch buckets, a replica without one running padding)."""
        if self._others:
            return self._step_replicas()
        self._admit()
        events: dict[Hashable, Event] = {}
        for build, done in ((self._prefill_call, self._prefill_done), (self._decode_call, self._decode_done)):
            built = build(events)
            if built is not None:
                done(built[1], self._execute(built[0]), events)
        self._check_pools()
        return list(events.values())

    def _step_replicas(self) -> list[Event]:
        engines = self._others
        events: list[dict[Hashable, Event]] = [{} for _ in engines]
        for e in engines:
            e._admit()
        for kind, build, done in (
            ("extend", "_prefill_call", "_prefill_done"),
            ("decode", "_decode_call", "_decode_done"),
        ):
            built = [getattr(e, build)(ev) for e, ev in zip(engines, events)]
            if all(b is None for b in built):
                continue
            batch = max(b[0].batch for b in built if b is not None)
            calls = [padded(b and b[0], kind, batch, self.width, self.ring_width, self.chunk) for b in built]
            logits = self._execute_replicas(calls)
            for e, b, got, ev in zip(engines, built, logits, events):
                if b is not None:
                    getattr(e, done)(b[1], got, ev)
        for e in engines:
            e._check_pools()
        return [event for ev in events for event in ev.values()]

    def _check_pools(self) -> None:
        kv_blocks.check(self._pool)
        if self._ring is not None:
            kv_blocks.check(self._ring)

    def _admit(self) -> None:
        rows = max(self.model.batch_sizes)
        while self._waiting and len(self._running) < rows:
            seq = self._waiting[0]
            if not self._grow(seq):
                return
            self._waiting.popleft()
            seq.cached, seq.order = 0, next(self._order)
            self._running[seq.id] = seq

    def _make_room(self, decoding: list[_Seq]) -> list[_Seq]:
        """Blocks for every decoding request's next position, preempting the last admitted while there are none."""
        for seq in sorted(decoding, key=lambda s: s.order):
            while seq.id in self._running:
                if self._grow(seq):
                    break
                self._preempt(max(self._running.values(), key=lambda s: s.order))
        return [s for s in decoding if s.id in self._running]

    def _grow(self, seq: _Seq) -> bool:
        """Blocks for all of ``seq``'s tokens (a ring layer's: those of its ring's slots at most); False when the pool
        has too few (nothing taken)."""
        grown = kv_blocks.grow(self._pool, seq.id, len(seq.tokens))
        ring = self._ring
        if ring is not None and grown is not None:
            ring = kv_blocks.grow(ring, seq.id, min(len(seq.tokens), self.ring_width * self.block_size))
        if grown is None or ring is None and self._ring is not None:
            return False
        self._pool, self._ring = grown, ring
        return True

    def _release(self, id: Hashable) -> None:
        del self._running[id]
        self._pool = kv_blocks.release(self._pool, id)
        if self._ring is not None:
            self._ring = kv_blocks.release(self._ring, id)

    def _preempt(self, seq: _Seq) -> None:
        """Return ``seq``'s blocks; it waits first in line, to recompute its tokens."""
        self._release(seq.id)
        seq.cached = 0
        self._waiting.appendleft(seq)

    def _state(self, batch: int) -> Any:
        """The decode state of a batch bucket: the shared pools and this bucket's block tables (one address each)."""
        if batch not in self._states:
            table = torch.zeros(batch, self.width, dtype=torch.long, device=self.model.device)
            ring = torch.zeros(batch, self.ring_width, dtype=torch.long, device=self.model.device)
            kv = [PagedKV(k, v, table if w is None else ring) for (k, v), w in zip(self._pools, self.layout.windows)]
            like = next(iter(self._states.values()), None)  # one prefetch ring and phase through every bucket
            self._states[batch] = self.model.paged_state(batch, kv, like)
        return self._states[batch]

    def _tables(self, seqs: Sequence[_Seq], batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block table rows of ``seqs`` (and their ring table rows), padded to ``batch`` with the null block."""

        def rows(pool: kv_blocks.BlockPool, width: int) -> torch.Tensor:
            got = [kv_blocks.table_row(pool, s.id, width) for s in seqs]
            return torch.tensor(got + [[0] * width] * (batch - len(got)), dtype=torch.long)

        return rows(self._pool, self.width), rows(self._ring, self.ring_width) if self._ring is not None else None

    def _execute(self, call: Call) -> torch.Tensor:
        """Run ``call`` here (and, in lockstep, on every other rank first told of it): its logits."""
        if self.lockstep:
            _send(call)
        return self._run_call(call)

    def _execute_replicas(self, calls: list[Call]) -> list[torch.Tensor]:
        """Rank 0 of an engine with replicas: each replica's call run by its ranks; each replica's logits."""
        _send(("replicas", calls))
        return gather_logits(self._run_call(calls[self._me]), calls, self._firsts)

    def _run_call(self, call: Call) -> torch.Tensor:
        state = self._state(call.batch)
        tables = {w is None: layer.table for layer, w in zip(state.kv, self.layout.windows)}
        if True in tables:
            tables[True].copy_(call.rows)
        if call.ring_rows is not None:
            tables[False].copy_(call.ring_rows)
        if call.kind == "extend":
            return self.model.extend(call.tokens, call.positions, state, last=call.last)
        return self.model.decode(call.tokens, call.positions, state)

    def follow(self) -> None:
        """A lockstep group's other ranks: run each call rank 0 sends, until its :meth:`close`."""
        if not self.lockstep or _rank() == 0:
            raise ValueError("Engine.follow: only the other ranks of a lockstep engine follow rank 0's calls")
        while (call := _receive()) is not None:
            if isinstance(call, tuple):  # ("replicas", a call per replica): this rank's, then every rank's logits
                gather_logits(self._run_call(call[1][self._me]), call[1], self._firsts)
            elif call != "idle":
                self._run_call(call)

    def keepalive(self) -> None:
        """Rank 0 of a lockstep group with nothing to run: tell the others it is alive (their wait for the next call
        has the process group's timeout; an idle server sends this well within it)."""
        if self.lockstep and _rank() == 0:
            _send("idle")

    def close(self) -> None:
        """Rank 0 of a lockstep group: release the ranks in :meth:`follow` (nothing to do on one rank)."""
        if self.lockstep and _rank() == 0:
            _send(None)

    def _prefill_call(self, events: dict[Hashable, Event]) -> tuple[Call, list[_Seq]] | None:
        """The call that puts the next chunk of the admitted requests still prefilling into the cache (at most the
        largest batch bucket of them), and those requests; None: none is prefilling."""
        seqs = [s for s in self._running.values() if s.prefilling][: max(self.model.batch_sizes)]
        if not seqs:
            return None
        batch = _bucket(self.model.batch_sizes, len(seqs))
        tokens = torch.zeros(batch, self.chunk, dtype=torch.long)
        positions = torch.zeros(batch, self.chunk, dtype=torch.long)
        last = [0] * batch
        for r, s in enumerate(seqs):
            part = s.tokens[s.cached : s.cached + self.chunk]
            tokens[r, : len(part)] = torch.tensor(part)
            end = s.cached + len(part)  # pads at the position after the part's last: overwritten later
            positions[r] = torch.minimum(torch.arange(s.cached, s.cached + self.chunk), torch.tensor(end))
            last[r] = len(part) - 1
            s.cached = end
        # the logits of each row's last token of the chunk alone: the head's D x V product on one row, not a chunk's
        return Call("extend", batch, tokens, positions, *self._tables(seqs, batch), last=torch.tensor(last)), seqs

    def _prefill_done(self, seqs: list[_Seq], logits: torch.Tensor, events: dict[Hashable, Event]) -> None:
        for r, s in enumerate(seqs):
            if s.cached == len(s.tokens):  # the whole sequence is cached: its next token comes from this chunk
                self._emit(s, logits[r], events)

    def _decode_call(self, events: dict[Hashable, Event]) -> tuple[Call, list[_Seq]] | None:
        """The call that decodes one token of every request whose tokens are all cached (and had no token this step),
        blocks made for them first; None: none is decoding."""
        seqs = [s for s in self._running.values() if not s.prefilling and s.id not in events]
        seqs = self._make_room(seqs)
        if not seqs:
            return None
        batch = _bucket(self.model.batch_sizes, len(seqs))
        tokens = torch.tensor([s.tokens[-1] for s in seqs])
        positions = torch.tensor([len(s.tokens) - 1 for s in seqs])
        return Call("decode", batch, tokens, positions, *self._tables(seqs, batch)), seqs

    def _decode_done(self, seqs: list[_Seq], logits: torch.Tensor, events: dict[Hashable, Event]) -> None:
        for r, s in enumerate(seqs):
            s.cached = len(s.tokens)
            self._emit(s, logits[r], events)

    def _emit(self, seq: _Seq, logits: torch.Tensor, events: dict[Hashable, Event]) -> None:
        """Pick ``seq``'s next token from its ``logits [V]``; end it at a stop id or its length."""
        token = int(seq.pick(logits[None])[0])
        temperature = seq.request.temperature or 1.0  # a greedy token's under softmax(logits), as sample() gives it
        invariant = self.model.plan.invariant
        logprob = logprobs_of(logits, torch.tensor(token), temperature, invariant) if seq.request.logprobs else None
        logprob = (float(logprob),) if logprob is not None else ()
        seq.tokens.append(token)
        seq.generated += 1
        finished = "stop" if token in seq.stop else "length" if seq.generated >= seq.request.max_new_tokens else None
        if finished is not None:
            self._release(seq.id)
        events[seq.id] = Event(seq.id, (token,), logprob, finished)


def check_sizes(blocks: Any, kv_bytes: Any, block_size: Any) -> None:
    """Refuse, in one line naming the parameter, ``blocks`` or ``block_size`` that is not an int, ``block_size``
    below 1, and ``kv_bytes`` that is not a finite number >= 0."""
    for name, x in (("blocks", blocks), ("block_size", block_size)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
            raise TypeError(f"Engine: {name} must be an int, got {type(x).__name__} {x!r}")
    if block_size < 1:
        raise ValueError(f"Engine: block_size={block_size} must be an int >= 1 (positions per block), e.g. 16")
    if kv_bytes is None:
        return
    if isinstance(kv_bytes, bool) or not isinstance(kv_bytes, numbers.Real):
        raise TypeError(
            f"Engine: kv_bytes must be a number of bytes (the KV budget on each rank), got {type(kv_bytes).__name__} "
            f"{kv_bytes!r}"
        )
    if not (math.isfinite(kv_bytes) and kv_bytes >= 0):
        raise ValueError(
            f"Engine: kv_bytes={kv_bytes!r} must be a finite number of bytes >= 0 (the KV budget on each rank), "
            f"e.g. kv_bytes=2**30"
        )


def free_bytes(device: torch.device) -> int | None:
    """The memory free on ``device`` now (the host's available memory for the CPU); None where it cannot be known."""
    if device.type == "cpu":
        return available_host_bytes()
    try:
        return int(getattr(torch, device.type).mem_get_info(device)[0])
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def _shown(n: float) -> str:
    """A byte or block count: exact, or in scientific notation past 10**15."""
    return f"{n:.3g}" if n >= 10**15 else f"{n}"


def _bucket(sizes: Sequence[int], n: int) -> int:
    return min(b for b in sizes if b >= n)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _send(call: Call | tuple | str | None) -> None:
    """Rank 0: ``call`` (None: the end) to every rank of the default group."""
    torch.distributed.broadcast_object_list([call], src=0)


def _receive() -> Call | str | None:
    got: list[Any] = [None]
    torch.distributed.broadcast_object_list(got, src=0)
    return got[0]


def check_request(request: Any, model: Any, id: Hashable) -> None:
    """Raise a one-line ValueError / TypeError naming request ``id`` and what is wrong with it."""
    if not isinstance(request, Request):
        raise TypeError(f"request {id!r}: expected a Request, got {type(request).__name__}")
    try:
        check_token_ids([request.prompt], model.config.vocab_size)
        check_sampling(request.temperature, request.top_k, request.top_p, request.seed)
    except (TypeError, ValueError) as e:
        raise type(e)(f"request {id!r}: {str(e).removeprefix('generate: ').removeprefix('sampling: ')}") from None
    n = request.max_new_tokens
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise ValueError(f"request {id!r}: max_new_tokens must be an int >= 1, got {n!r}")
    if len(request.prompt) + n > model.max_seq_len:
        raise ValueError(
            f"request {id!r}: {len(request.prompt)} prompt tokens + {n} new exceed the engine's context of "
            f"{model.max_seq_len} positions (compile_model's max_seq_len); shorten it or lower max_new_tokens"
        )
    if request.stop is not None:
        check_stop(request.stop, model.config.vocab_size, f"request {id!r}")
