"""Running a reshard's plan (:mod:`.reshard_plan`) on a rank: its buckets one after another, each packed into one
flat byte buffer per peer, exchanged with one ``all_to_all_single`` over the plan's axes and unpacked into the
destination leaves before the next bucket's buffers are made.

A leaf cut into slabs across buckets is made when its first slab is unpacked, each slab written at its rows, and
handed over when its last one is: beside one bucket's buffers a rank holds at most that one unfinished destination
leaf. The source is asked for a leaf once per use, or for a slab's rows only (``source(path, (start, count))``), so
a caller can build what it hands in on demand. Traceable with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed._functional_collectives as funcol

from . import collectives
from .mesh import Mesh
from .reshard_plan import ReshardPlan
from .reshard_program import Box, LeafSteps, ReshardProgram

__all__ = ["Source", "pack", "unpack", "simulate", "run_buckets", "source_of", "device_of"]

# this rank's local shard of a leaf: (path, (start, count) of its dim-0 rows, or None for all of them) -> tensor
Source = Callable[[str, tuple[int, int] | None], torch.Tensor]


def _box(x: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (start, n) in enumerate(box):
        x = x.narrow(d, start, n)
    return x


def _in(box: Box, window: tuple[int, int] | None) -> Box:
    """``box`` in the coordinates of the source rows ``window`` (its dim 0 shifted)."""
    return box if window is None else ((box[0][0] - window[0], box[0][1]), *box[1:])


def source_of(local: Mapping[str, torch.Tensor]) -> Source:
    """A source over a mapping of local shards: a slab's rows are a view."""

    def source(path: str, window: tuple[int, int] | None) -> torch.Tensor:
        return local[path] if window is None else local[path].narrow(0, *window)

    return source


def _pack(source: Source, program: ReshardProgram, device: torch.device) -> torch.Tensor:
    """The send buffer, filled a leaf at a time (``source`` once per leaf that sends, dropped after)."""
    buf = torch.empty(sum(program.send_sizes), dtype=torch.uint8, device=device)
    for at, n in program.pads:
        buf[at : at + n].zero_()  # alignment padding
    for step in program.steps:
        if step.send:
            x = source(step.path, step.window)
            for box, at in step.send:
                part = _box(x, _in(box, step.window))
                n = part.numel() * part.element_size()
                buf[at : at + n].view(part.dtype).view(part.shape).copy_(part)
            del x, part
    return buf


def pack(local: Mapping[str, torch.Tensor], program: ReshardProgram) -> torch.Tensor:
    """This rank's outgoing bytes as one flat uint8 buffer: a section per group peer (``program.send_sizes``).

    Each box is copied once, straight into its place in the buffer (viewed as the leaf's dtype).
    """
    return _pack(source_of(local), program, device_of(local))


def device_of(local: Mapping[str, torch.Tensor]) -> torch.device:
    """The device of the first local shard (CPU when there is none)."""
    return next(iter(local.values())).device if local else torch.device("cpu")


def _fill(source: Source, received: torch.Tensor, step: LeafSteps, out: torch.Tensor) -> None:
    """Write ``step``'s local copies and received boxes into the destination leaf ``out``."""
    if step.local:
        x = source(step.path, step.window)
        for sbox, dbox in step.local:
            _box(out, dbox).copy_(_box(x, _in(sbox, step.window)))
        del x
    for dbox, at, nbytes in step.recv:
        chunk = received[at : at + nbytes].view(step.dtype).view(tuple(n for _, n in dbox))
        _box(out, dbox).copy_(chunk)


def _unpack(
    source: Source,
    received: torch.Tensor,
    program: ReshardProgram,
    partial: dict[str, torch.Tensor],
    done: Callable[[str, torch.Tensor], None],
) -> None:
    """Each destination leaf (or slab) in turn: made (or taken from ``partial``, where an earlier bucket left it),
    filled, and handed to ``done`` once complete (else left in ``partial`` for the next bucket)."""
    for step in program.steps:
        if step.opens:
            out = torch.empty(step.shape, dtype=step.dtype, device=received.device)
        else:
            out = partial.pop(step.path)
        _fill(source, received, step, out)
        if step.closes:
            done(step.path, out)
        else:
            partial[step.path] = out
        del out


def unpack(
    local: Mapping[str, torch.Tensor],
    received: torch.Tensor,
    program: ReshardProgram,
    partial: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The destination leaves of one rank that ``program`` completes: its local copies from ``local`` plus the
    boxes in ``received``. ``partial``: the leaves earlier buckets began (filled further here; a leaf this bucket
    does not complete is left in it)."""
    out: dict[str, torch.Tensor] = {}
    _unpack(source_of(local), received, program, {} if partial is None else partial, out.__setitem__)
    return out


def simulate(local_trees: Sequence[Mapping[str, torch.Tensor]], plan: ReshardPlan) -> list[dict[str, torch.Tensor]]:
    """Run ``plan`` for every rank in one process, bucket by bucket (each exchange done by slicing buffers):
    ``[dst leaves of rank r]``."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in local_trees]
    partial: list[dict[str, torch.Tensor]] = [{} for _ in local_trees]
    for progs in plan.buckets or (plan.programs,):
        packed = [pack(local_trees[r], progs[r]) for r in range(len(progs))]
        for r, prog in enumerate(progs):
            parts = []
            for peer in prog.group:
                j = progs[peer].group.index(r)
                offsets = progs[peer].send_sizes
                parts.append(packed[peer][sum(offsets[:j]) : sum(offsets[: j + 1])])
            out[r] |= unpack(local_trees[r], torch.cat(parts), prog, partial[r])
    return out


def run_buckets(
    plan: ReshardPlan,
    mesh: Mesh,
    source: Source,
    done: Callable[[str, torch.Tensor], None],
    device: torch.device,
) -> None:
    """This rank's part of ``plan``, bucket by bucket: each bucket's buffers are packed (``source(path, rows)``:
    this rank's local shard of a leaf, or its dim-0 rows ``(start, count)`` for a slab; asked once per use and not
    kept), exchanged with one ``all_to_all_single`` and unpacked (``done(path, tensor)``: each destination leaf, in
    leaf order, once its last slab is in) before the next bucket's are made. A bucket in which no rank moves a byte
    runs no collective. Collective: every rank calls it with the plan."""
    partial: dict[str, torch.Tensor] = {}
    for progs in plan.buckets or (plan.programs,):
        program = progs[mesh.rank]
        moves = any(sum(p.send_sizes) for p in progs)
        received = _exchange(source, program, plan.axes if moves else (), mesh, device)
        _unpack(source, received, program, partial, done)
        del received


def _exchange(
    source: Source, program: ReshardProgram, axes: tuple[str, ...], mesh: Mesh, device: torch.device
) -> torch.Tensor:
    """The bytes this rank receives: one ``all_to_all_single`` over ``axes`` (none when ``axes`` is empty)."""
    if not axes:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if not torch.compiler.is_compiling():
        mesh.init_groups(axes)
    buf = _pack(source, program, device)
    received = collectives.all_to_all_single(buf, mesh, axes, program.recv_sizes, program.send_sizes)
    if isinstance(received, funcol.AsyncCollectiveTensor):
        received = received.wait()
        _released(buf)
    return received


def _released(buf: torch.Tensor, timeout: float = 1.0) -> None:
    """Eager: return once the collective's work has let go of ``buf``, so the send buffer is freed before the next
    bucket's buffers are made. A rank that receives nothing never reads its result, so the wait is not left to
    that; and gloo's worker thread drops its reference to the work (which holds ``buf``) just after the wait
    returns."""
    end = time.monotonic() + timeout
    while buf._use_count() > 1 and time.monotonic() < end:
        time.sleep(0)
