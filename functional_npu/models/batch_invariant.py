"""Batch invariance on the fast kernels: every reduction a log-prob depends on keeps its order whatever the batch, a
row's position in it, the cache length or the chunking, while running on the device's matmul kernels.

The plan's ``invariant="batch"`` mode (:class:`~functional_npu.parallel.plan.Plan`) runs the forward through these
functions. They give a row the same bits on one device kind and one kernel build (what on-policy RL needs: the rollout
and the training forward on the same machine); :mod:`functional_npu.models.invariant` (``"portable"``) gives them on
any device that rounds IEEE adds, at many times the cost. Every reduction is a matmul whose shape the batch cannot
change, and everything between the matmuls is elementwise, one IEEE rounding per op. What each pins, and what it rules
out (measured on this machine's kernels in ``tests/models/test_batch_invariant.py``, beside the plain call's
counterexample):

- **matmuls by row tiles** (:func:`linear`): a matmul's rows are padded to a multiple of :data:`ROWS`. The CPU's
  GEMMs (MKL in float32, oneDNN in bfloat16) take another kernel, with another order over the reduced dim, for a
  call of 1 to 3 rows, and for a call whose threads get fewer than 4 rows each (5, 7 or 9 rows on two threads); with
  the rows a multiple of 4 a row's bits are the same at any row count and in any position (a decode step of 1 row
  and a training forward of 512);
- **a row-parallel linear's input dim in fixed chunks** (:func:`linear` with ``chunks``, :func:`row_parallel`):
  summed chunk by chunk (one batched matmul, the chunks' results in float32) and the chunks added by adjacent pairs,
  so a tensor-parallel rank sums its share of the same chunks and :func:`~functional_npu.models.invariant.tp_sum`
  adds the ranks' sums as the top of the same tree: tp 1, 2, 4 and 8 give the same bits (an all-reduce's ring adds
  in an order of its own);
- **attention over fixed key blocks** (:func:`attend`): the cache (or the sequence) is padded to blocks of
  :data:`KEYS` keys; each block's scores and each block's weighted values are one matmul of a pinned shape (``[rows,
  d] x [d, KEYS]``, ``[rows, KEYS] x [KEYS, dv + 1]``: the softmax's denominator is the last column, reduced with the
  values); blocks are added by a tree in which a block past the query's keys is an exact zero. The max is taken
  first over every key (no running rescale). SDPA and a matmul-softmax give a decode query other bits than the same
  query in a training forward;
- **row sums on the matmul unit** (:func:`row_sum`: a matmul with a column of ones, rows in fours) for the norms'
  mean of squares and log-softmax's denominator: torch's row reduction splits a single long row across threads;
- **transcendentals as polynomials** (``exp``, ``log``, ``rsqrt``, SiLU's ``exp``:
  :mod:`~functional_npu.models.invariant`): torch's vector ``exp`` and its scalar tail give an element other bits by
  where it falls in its tensor.

Compiled, a graph of these is ordinary aten ops (but rotary's :func:`sin_cos`, one op run eagerly): inductor calls the
same extern matmul kernels at the same padded shapes as eager (under :data:`INDUCTOR_OPTIONS`: no GEMM template of its
own, no weight prepacking, no fused multiply-add, casts rounded where written) and fuses the elementwise ops around
them, so a compiled rollout and an eager or compiled training forward agree bit for bit. What is not pinned here: the
kernels themselves (another MKL or oneDNN build, another CPU, another thread count may tile otherwise: :func:`probe`
measures the properties the mode rests on), and another device kind (``compile_model`` refuses the mode off the CPU,
naming ``"portable"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.mesh import Mesh
from . import invariant as portable
from .invariant_ops import AttendFunction, LogSoftmaxFunction, RmsNormFunction, SiluFunction
from .invariant_ops import sin_cos as invariant_sin_cos

__all__ = [
    "ROWS",
    "KEYS",
    "DTYPES",
    "INDUCTOR_OPTIONS",
    "pad_rows",
    "linear",
    "row_parallel",
    "row_sum",
    "rms_norm",
    "silu",
    "attend",
    "log_softmax",
    "sin_cos",
    "experts",
    "probe",
]

ROWS = 4  # a matmul's rows are padded to a multiple of this
KEYS = 64  # attention's keys in blocks of this many
DTYPES = (torch.float32, torch.bfloat16)
# inductor: the portable mode's rounding flags, the matmuls as the extern (eager) kernels at the shapes written, no
# prepacked weights (freezing would swap MKL's kernel for oneDNN's)
INDUCTOR_OPTIONS = portable.INDUCTOR_OPTIONS | {"max_autotune_gemm_backends": "ATEN", "freezing": False}


def sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary (sin, cos) by :func:`~functional_npu.models.invariant.sin_cos`'s float64 polynomials, as the portable
    mode's one op (:func:`~functional_npu.models.invariant_ops.sin_cos`): compiled, it runs eagerly inside the graph,
    once a step on ``[B, 1, S, hd]`` angles, the same bits. Traced instead, its kernels were the costliest of a
    graph to generate (a third of inductor's code generation for a one-layer rollout and train step: 10 of 29 s, and
    86 to 77 s for the whole compile); eager, it costs 0.13 ms a step at batch 1 and 0.23 ms at batch 32 on this
    2-core host."""
    return invariant_sin_cos(x)


def pad_rows(x: torch.Tensor, multiple: int = ROWS) -> torch.Tensor:
    """``x [R, ...]`` with zero rows appended up to a multiple of ``multiple``."""
    extra = -x.shape[0] % multiple
    return F.pad(x, (0, 0) * (x.ndim - 1) + (0, extra)) if extra else x


# the forwards below traced as they are (compiled: into the graph, fused), each with the closed-form gradient of
# the portable mode's op: the polynomials' own derivatives are not the functions' (rsqrt's and log's start from bits)


class _PolySilu(SiluFunction):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return portable.silu(x)


class _RmsNormFn(RmsNormFunction):
    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        return _rms_norm(x, weight, eps, offset)


class _LogSoftmaxFn(LogSoftmaxFunction):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _log_softmax(x)


class _AttendFn(AttendFunction):
    @staticmethod
    def forward(q, keys, values, mask, scale: float, groups: int) -> torch.Tensor:
        return _attend(q, keys, values, mask, scale, groups)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU with the polynomial ``exp`` (:func:`~functional_npu.models.invariant.silu`), elementwise (compiled:
    fused), with SiLU's own gradient."""
    return _PolySilu.apply(x)


def linear(x: torch.Tensor, w: torch.Tensor, chunks: int = 1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., in] @ w.T`` by the device's matmul with the rows padded to a multiple of :data:`ROWS`. ``chunks > 1``
    (a row-parallel linear, :func:`row_parallel`): the input dim in that many contiguous chunks, each chunk's product
    one item of a batched matmul, the chunks added in float32 by :func:`~functional_npu.models.invariant.pair_sum`
    (so ``1 / tp`` of the chunks on each rank, then the ranks' sums, is the same tree). Returned in ``dtype``
    (default ``x``'s)."""
    k, n = x.shape[-1], w.shape[0]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    tiles = pad_rows(flat)
    if chunks == 1:
        y = F.linear(tiles, w)
    else:
        y = portable.pair_sum(_chunked(tiles, w, chunks).float(), dim=0)
    return y[:rows].to(dtype or x.dtype).reshape(*x.shape[:-1], n)


def _chunked(x: torch.Tensor, w: torch.Tensor, chunks: int) -> torch.Tensor:
    """``[chunks, R, out]``: chunk ``i`` of ``x [R, in]``'s input dim times the same chunk of ``w [out, in]``, one
    batched matmul over strided views (MKL takes them as they are; oneDNN, in bfloat16, copies the weight's chunks
    first, which measured cheaper than a matmul per chunk)."""
    n, k = w.shape
    part = k // chunks
    return torch.bmm(x.view(-1, chunks, part).transpose(0, 1), w.view(n, chunks, part).permute(1, 2, 0))


def row_parallel(x: torch.Tensor, w: torch.Tensor, mesh: Mesh, tp: str) -> torch.Tensor:
    """A row-parallel linear over ``tp``: this rank's share of the input dim's chunks
    (:func:`~functional_npu.models.invariant.row_chunks`), summed in float32, then the ranks' sums by
    :func:`~functional_npu.models.invariant.tp_sum`: the unsharded linear's bits at tp 1, 2, 4 or 8."""
    n = mesh.axis_size(tp)
    chunks = portable.row_chunks(x.shape[-1] * n, n, tp)
    return portable.tp_sum(linear(x, w, chunks, torch.float32), mesh, tp).to(x.dtype)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """The float32 sum over the last dim of ``x [..., D]``, ``[..., 1]``: a matmul with a column of ones over rows
    padded to a multiple of :data:`ROWS` (torch's own row reduction splits a single long row across threads)."""
    d = x.shape[-1]
    flat = x.reshape(-1, d).float()
    ones = torch.ones(d, 1, dtype=torch.float32, device=x.device)
    return torch.mm(pad_rows(flat), ones)[: flat.shape[0]].reshape(*x.shape[:-1], 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """:func:`~functional_npu.models.norm.rms_norm` in float32: the mean of squares by :func:`row_sum` times ``1 /
    D``, :func:`~functional_npu.models.invariant.rsqrt` (returned in ``x``'s dtype), with RMSNorm's gradient."""
    return _RmsNormFn.apply(x, weight, float(eps), float(offset))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * portable.rsqrt(row_sum(xf * xf) * (1.0 / x.shape[-1]) + eps)
    if offset:
        return (normed * (weight.float() + offset)).to(x.dtype)
    return weight * normed.to(x.dtype)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """Masked attention ``[B, H, S, dv]`` of ``q [B, H, S, d]`` over ``keys [B, H / groups, C, d]`` and ``values
    [B, H / groups, C, dv]`` (``mask [B, 1, S, C]``), in float32, by blocks of :data:`KEYS` keys: per block the
    scores (a matmul over ``d``) and the weighted values with the softmax's denominator (a matmul over the block's
    keys), blocks added by :func:`~functional_npu.models.invariant.tree_sum`. A query's rows (its group's heads and
    positions) go in multiples of :data:`ROWS`; a key the mask hides weighs an exact zero. Attention's gradient
    (:mod:`~functional_npu.models.invariant_ops`')."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _AttendFn.apply(q, keys, values, mask, scale, groups)


def _attend(q, keys, values, mask, scale: float, groups: int) -> torch.Tensor:
    b, h, s, d = q.shape
    kv, c = keys.shape[1], keys.shape[2]
    blocks = -(-c // KEYS)
    extra = blocks * KEYS - c
    rows = groups * s
    tile = rows + -rows % ROWS
    qf = F.pad(q.float().reshape(b * kv, rows, d), (0, 0, 0, tile - rows))  # [B kv, R, d]
    kf = F.pad(keys.float().reshape(b * kv, c, d), (0, 0, 0, extra))  # [B kv, C', d]
    # the scores reduce over d only: a key block's columns get the same bits in one matmul over every block
    scores = torch.bmm(qf, kf.transpose(1, 2)) * scale  # [B kv, R, C']
    hidden = torch.where(mask.reshape(b, 1, 1, s, c), 0.0, float("-inf"))  # added: 0 keeps a score's bits
    hidden = (
        F.pad(hidden, (0, extra), value=float("-inf")).expand(b, kv, groups, s, c + extra).reshape(b * kv, rows, -1)
    )
    scores = scores + F.pad(hidden, (0, 0, 0, tile - rows), value=float("-inf"))  # a padded row sees nothing
    top = scores.max(dim=-1, keepdim=True).values.clamp(min=torch.finfo(torch.float32).min)  # a padded row: no key
    p = portable.exp(scores - top).view(b * kv, tile, blocks, KEYS).transpose(1, 2)  # [B kv, n, R, KEYS]; hidden: 0
    vf = F.pad(values.float().reshape(b * kv, c, -1), (0, 1), value=1.0)  # [B kv, C, dv + 1]: the last column sums p
    vf = F.pad(vf, (0, 0, 0, extra)).view(b * kv, blocks, KEYS, -1)
    sums = portable.tree_sum(torch.matmul(p, vf), dim=1).view(b, kv, tile, -1)  # [B, kv, R, dv + 1]
    out = sums[:, :, :rows, :-1] / sums[:, :, :rows, -1:]
    return out.reshape(b, h, s, -1).to(q.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim in float32: ``x - max - log(sum exp(x - max))`` with the polynomial ``exp``
    and ``log`` (:mod:`~functional_npu.models.invariant`) and the sum by :func:`row_sum`; log-softmax's gradient."""
    return _LogSoftmaxFn.apply(x)


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    z = xf - xf.max(dim=-1, keepdim=True).values  # max, not amax: the NPU's GE graph has no amax
    return z - portable.log(row_sum(portable.exp(z)))


def experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The routed experts before their sum over the k: ``weights[:, k] * expert[ids[:, k]](x)`` as ``[N, k, D]``
    float32 (0 where ``ids`` is -1). Every local expert runs on every row (one batched matmul per projection, the
    rows padded to a multiple of :data:`ROWS`: one shape for any batch, a row's bits its own), then each (token, k)
    takes its expert's row."""
    n = x.shape[0]
    tiles = pad_rows(x)
    gate, up = torch.matmul(tiles, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [S, R, F]
    y = torch.matmul(silu(gate) * up, down.transpose(1, 2))[:, :n]  # [S, N, D]
    chosen = y[ids.clamp(min=0), torch.arange(n, device=x.device)[:, None]]  # [N, k, D]
    return chosen.float() * torch.where(ids >= 0, weights.float(), 0.0)[..., None]


def probe(rows: tuple[int, ...] = (4, 8, 12, 64, 260), shapes=((256, 1536), (1000, 333)), seed: int = 0) -> dict:
    """The two kernel properties the mode rests on, measured here: a matmul row's bits at any multiple of
    :data:`ROWS` rows (and in any position), and at any multiple of :data:`KEYS` columns, for each of
    :data:`DTYPES`; with the counterexamples the pins rule out (a 1-row call, a key block of another length)
    measured beside them. ``{"rows_pinned", "keys_pinned", "one_row_differs", "odd_keys_differ"}`` per dtype."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for dtype in DTYPES:
        rows_ok, single_differs = True, False
        for k, n in shapes:
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(max(rows), k, generator=g).to(dtype)
            ref = F.linear(x, w)
            for r in rows:
                rows_ok &= torch.equal(F.linear(x[:r], w), ref[:r])
                rows_ok &= torch.equal(F.linear(x[:r].flip(0), w).flip(0), ref[:r])
            single_differs |= any(not torch.equal(F.linear(x[i : i + 1], w), ref[i : i + 1]) for i in range(8))
        qf = torch.randn(8, 4, 128, generator=g).to(dtype)
        kf = torch.randn(8, 128, 4 * KEYS, generator=g).to(dtype)
        full = qf @ kf
        keys_ok = all(torch.equal(qf @ kf[..., : j * KEYS], full[..., : j * KEYS]) for j in (1, 2, 3))
        odd = any(not torch.equal(qf @ kf[..., :c], full[..., :c]) for c in (1, 3, 7))
        out[str(dtype).removeprefix("torch.")] = {
            "rows_pinned": bool(rows_ok),
            "keys_pinned": bool(keys_ok),
            "one_row_differs": bool(single_differs),
            "odd_keys_differ": bool(odd),
        }
    return out
