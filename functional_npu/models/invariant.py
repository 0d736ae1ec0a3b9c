"""Invariant numerics: every reduction of the forward in one fixed order, whatever the batch, the position, the cache
length, the padding or the neighbours in a batch, on every backend that rounds each add and multiply as IEEE 754 says.

The plan's ``invariant`` mode (:class:`~functional_npu.parallel.plan.Plan`) runs the forward through these functions,
so that a rollout's log-probabilities (a prefill and decode steps over a KV cache, batched with other prompts) equal
the training forward's (the whole sequence at once) bit for bit. They are written in aten ops whose results are
fixed element by element, never in a kernel that chooses its own order:

- **sums are trees** (:func:`tree_sum`): the reduced dim is padded with zeros to a power of two and halved, ``x[:h] +
  x[h:]``, until one element is left; every add is one rounding of two defined operands. Zeros at the end change
  nothing (``x + 0 == x``), so a query's keys reduce to the same bits over a cache of 64 slots or of 2048, in a
  prefill, a decode step or the training forward;
- **transcendental functions are polynomials** (:func:`exp`, :func:`log`, rotary :func:`sin_cos`, and
  :func:`rsqrt` by Newton's steps): a library's ``exp`` takes its vector path or its scalar tail by where an element
  sits in its tensor, and the two may differ in the last bit (eager's ``sqrt`` on the CPU is MKL's, which measured
  an ulp away from inductor's); these take adds, multiplies, a round and bit operations only;
- **no division by a constant**: inductor turns ``x / c`` into ``x * (1 / c)``, eager does not; the functions
  multiply by the reciprocal themselves (divisions of tensor by tensor are kept: both round them once).

What uses them: linears (:func:`linear`, the reduction over the input dim), :func:`rms_norm`, attention
(:func:`attend`: scores, softmax and the weighted sum of values, keys reduced by one tree for any cache length),
:func:`log_softmax`, :func:`silu`, and the tensor-parallel sum (:func:`tp_sum`: gathered, then added by adjacent pairs
in rank order, not the order a ring all-reduce picks). Everything computes in float32 (bfloat16 inputs are widened,
results rounded to their dtype once); float64 params are refused. Compiled with inductor, the C++ compiler must not
contract a multiply and an add into one fused multiply-add nor reassociate: :data:`INDUCTOR_OPTIONS`.

The cost: a linear is a multiply and a tree of adds over ``[rows, out, in]`` instead of a matmul's blocked kernel,
attention materializes its products per key; ``benchmarks/results/invariant.json`` measures it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core.collectives import all_gather
from ..core.mesh import Mesh

__all__ = [
    "INDUCTOR_OPTIONS",
    "DTYPES",
    "tree_sum",
    "exp",
    "log",
    "silu",
    "rsqrt",
    "sin_cos",
    "rms_norm",
    "linear",
    "row_chunks",
    "pair_sum",
    "split_of",
    "SPLIT",
    "attend",
    "log_softmax",
    "tp_sum",
    "check_dtype",
]

# inductor's C++ flags that keep each add and multiply one IEEE rounding (they are its defaults; an environment
# variable may change a default, not an option given to torch.compile), and casts rounded where they are written
INDUCTOR_OPTIONS = {
    "cpp.enable_floating_point_contract_flag": "off",
    "cpp.enable_unsafe_math_opt_flag": False,
    "emulate_precision_casts": True,
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPLIT = 8  # a linear's input dim is summed in up to this many chunks: tensor parallelism up to 8 keeps the bits
_ROWS_BUDGET = 1 << 24  # elements of one linear's product [rows, out, in] held at once (64 MiB of float32)


def check_dtype(dtype: torch.dtype, where: str) -> None:
    """Refuse a dtype the invariant functions do not compute in (their polynomials are float32's)."""
    if dtype not in DTYPES:
        raise ValueError(
            f"{where}: the invariant mode computes in float32 (its exp, log and rotary polynomials are float32's) "
            f"and takes params in {', '.join(str(d).removeprefix('torch.') for d in DTYPES)}, not {dtype}; load the "
            f"params in float32, or leave Plan.invariant off"
        )


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """The sum over ``dim`` as a tree of pairwise adds: zero-padded to a power of two, then halved (``x[:h] + x[h:]``)
    until one element is left. The result depends on the values and their positions only, and trailing zeros do not
    change it."""
    dim = dim % x.ndim
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = [0, 0] * (x.ndim - 1 - dim) + [0, width - n]
        x = F.pad(x, pad)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x if keepdim else x.squeeze(dim)


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """``2 ** n`` in float32 for integral ``n`` in [-126, 127], built from its exponent bits."""
    return ((n.to(torch.int32) + 127) * (1 << 23)).view(torch.float32)


_EXP_LO, _EXP_HI = -87.0, 88.0  # below: 0 (under float32's smallest normal); above: clamped (no overflow)
_LOG2E, _LN2_HI, _LN2_LO = 1.44269504088896341, 0.693359375, -2.12194440e-4
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e ** x`` in float32 from adds, multiplies and a floor (Cephes' ``expf``, about 1 ulp): ``2 ** n * p(r)``.
    Below -87 it is 0 (``-inf`` included), above 88 it is ``e ** 88``."""
    x = x.float()
    low = x < _EXP_LO
    x = x.clamp(_EXP_LO, _EXP_HI)
    n = torch.floor(x * _LOG2E + 0.5)
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO
    p = torch.full_like(r, _EXP_P[0])
    for c in _EXP_P[1:]:
        p = p * r + c
    y = p * (r * r) + r + 1.0
    return torch.where(low, torch.zeros_like(y), y * _pow2(n))


_SQRT_HALF = 0.707106781186547524
_LOG_P = (
    7.0376836292e-2,
    -1.1514610310e-1,
    1.1676998740e-1,
    -1.2420140846e-1,
    1.4249322787e-1,
    -1.6668057665e-1,
    2.0000714765e-1,
    -2.4999993993e-1,
    3.3333331174e-1,
)


def log(x: torch.Tensor) -> torch.Tensor:
    """The natural log of positive, normal float32 ``x`` from its exponent bits and a polynomial (Cephes' ``logf``,
    about 1 ulp). What it is given here is a sum of ``exp`` values that holds a 1: at least 1."""
    x = x.float()
    bits = x.view(torch.int32)
    biased = bits // (1 << 23)  # the exponent bits (the sign bit is 0): bits >> 23
    e = biased - 126
    m = (bits - biased * (1 << 23) + 0x3F000000).view(torch.float32)  # x = m * 2 ** e, m in [0.5, 1)
    small = m < _SQRT_HALF
    e = (e - small.to(torch.int32)).float()
    f = torch.where(small, m + m, m) - 1.0
    z = f * f
    p = torch.full_like(f, _LOG_P[0])
    for c in _LOG_P[1:]:
        p = p * f + c
    y = p * f * z
    y = y + e * _LN2_LO
    y = y + z * -0.5
    return (f + y) + e * _LN2_HI


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` as ``x / (1 + e ** -x)`` with :func:`exp`, in float32, returned in ``x``'s dtype."""
    xf = x.float()
    return (xf / (exp(-xf) + 1.0)).to(x.dtype)


# pi / 2 in two parts: the first of 33 bits, so that j * _PIO2_HI is exact for |j| < 2 ** 20
_PIO2_HI, _PIO2_LO = 1.5707963267341256, 6.077100506506192e-11
_SIN_P = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(9, 0, -1))  # x^19 .. x^3 over their factorials
_COS_P = tuple((-1) ** k / math.factorial(2 * k) for k in range(9, 0, -1))  # x^18 .. x^2


def _odd_even(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = r * r
    s = torch.full_like(r, _SIN_P[0])
    c = torch.full_like(r, _COS_P[0])
    for a, b in zip(_SIN_P[1:], _COS_P[1:]):
        s, c = s * z + a, c * z + b
    return r + r * z * s, 1.0 + z * c


def sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos) of float32 ``x`` (rotary angles), computed in float64 from adds and multiplies (a quarter-turn
    reduction, then Taylor polynomials to degree 19 on [-pi/4, pi/4]) and rounded to float32 once: within half an
    ulp but for double rounding, for ``|x| < 1.6e6``."""
    a = x.double()
    j = torch.round(a * (2 / math.pi))
    r = a - j * _PIO2_HI
    r = r - j * _PIO2_LO
    s, c = _odd_even(r)
    q = torch.remainder(j, 4.0)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin.float(), cos.float()


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(x)`` of positive, normal float32 ``x`` from its bits and three Newton steps (within 2 ulp). Not
    ``torch.sqrt``: eager's takes MKL's vector math on the CPU, which is not correctly rounded, and inductor's is."""
    x = x.float()
    y = (-(x.view(torch.int32) // 2) + 0x5F375A86).view(torch.float32)  # the constant less bits >> 1 (sign bit 0)
    half = x * 0.5
    for _ in range(3):
        y = y * (-(half * y * y) + 1.5)  # 1.5 - t as -t + 1.5, the same bits (GE converts an rsub to Sxpy)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """:func:`~functional_npu.models.norm.rms_norm` with the mean of squares a :func:`tree_sum` times ``1 / D`` and
    :func:`rsqrt` (float32, returned in ``x``'s dtype)."""
    xf = x.float()
    ms = tree_sum(xf * xf, keepdim=True) * (1.0 / x.shape[-1])
    normed = xf * rsqrt(ms + eps)
    if offset:
        return (normed * (weight.float() + offset)).to(x.dtype)
    return weight * normed.to(x.dtype)


def pair_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The sum over ``dim`` (a power of two long) by adjacent pairs, level by level: the last add is the first half's
    sum plus the second half's, so the sum over ``n`` ranks' contiguous slices, each summed so, is the same tree."""
    dim = dim % x.ndim
    n = x.shape[dim]
    if n & (n - 1):
        raise ValueError(f"pair_sum: the summed dim must be a power of two long, got {n}")
    while x.shape[dim] > 1:
        x = x.unflatten(dim, (x.shape[dim] // 2, 2))
        x = x.select(dim + 1, 0) + x.select(dim + 1, 1)
    return x.squeeze(dim)


def split_of(k: int) -> int:
    """The chunks a linear's input dim of ``k`` is summed in (:func:`linear`): the largest power of two up to
    :data:`SPLIT` that divides ``k``."""
    return math.gcd(k, SPLIT)


def linear(
    x: torch.Tensor, w: torch.Tensor, chunks: int | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x [..., in] @ w.T`` as float32 products summed over ``in`` in ``chunks`` contiguous chunks (default
    :func:`split_of` ``in``): each chunk by :func:`tree_sum`, then the chunks by :func:`pair_sum`. A row-parallel
    rank holding ``1 / tp`` of the input dim sums its ``chunks / tp`` chunks the same way and :func:`tp_sum` adds
    the ranks' sums as the top of the same tree, so tp 1, 2, 4 and 8 give the same bits
    (:func:`~functional_npu.models.invariant_ops.row_parallel`). Rows
    go in groups whose product ``[rows, out, in]`` holds at most 2 ** 24 elements; returned in ``dtype`` (default
    ``x``'s)."""
    k = x.shape[-1]
    chunks = split_of(k) if chunks is None else chunks
    flat = x.reshape(-1, k).float()
    wide = w.float()
    step = max(1, _ROWS_BUDGET // max(1, w.numel()))

    def rows(part: torch.Tensor) -> torch.Tensor:
        products = (part[:, None, :] * wide).unflatten(-1, (chunks, k // chunks))  # [rows, out, chunks, in / chunks]
        return pair_sum(tree_sum(products))

    parts = [rows(flat[i : i + step]) for i in range(0, flat.shape[0], step)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.to(dtype or x.dtype).reshape(*x.shape[:-1], w.shape[0])


def row_chunks(whole: int, n: int, tp: str) -> int:
    """The chunks of a row-parallel linear's input dim one of ``n`` ranks sums (``whole``: the unsharded dim's
    size): its share of :func:`split_of` ``whole``, which ``n`` must divide."""
    chunks = split_of(whole)
    if chunks % n:
        raise ValueError(
            f"invariant linear: an input dim of {whole} is summed in {chunks} chunks, which {n} tensor-parallel ranks "
            f"({tp!r}) cannot split; use tp in {[t for t in (1, 2, 4, 8) if chunks % t == 0]} for this model"
        )
    return chunks // n


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """Masked attention ``[B, H, S, dv]`` of ``q [B, H, S, d]`` over ``keys [B, H / groups, C, d]`` and ``values
    [B, H / groups, C, dv]`` (``mask [B, 1, S, C]``): scores by a tree over ``d``, the softmax's max (exact in any
    order), :func:`exp`, its denominator and the weighted values by trees over the ``C`` keys. A key the mask hides
    adds an exact zero wherever it sits, so a query gets the same bits over any cache length."""
    b, h, s, d = q.shape
    kv, c = keys.shape[1], keys.shape[2]
    qf = q.float().reshape(b, kv, groups, s, 1, d)
    kf = keys.float().reshape(b, kv, 1, 1, c, d)
    scores = tree_sum(qf * kf) * (d**-0.5 if scale is None else scale)  # [B, kv, g, S, C]
    seen = mask.reshape(b, 1, 1, s, c)
    scores = scores.masked_fill(~seen, float("-inf"))
    p = exp(scores - scores.max(-1, keepdim=True).values)  # hidden keys: exp(-inf) = 0
    den = tree_sum(p, keepdim=True)[..., None]  # [B, kv, g, S, 1, 1]
    vf = values.float().reshape(b, kv, 1, 1, c, -1)
    num = tree_sum(torch.where(seen[..., None], p[..., None] * vf, 0.0), dim=-2, keepdim=True)  # [B, kv, g, S, 1, dv]
    return (num / den).reshape(b, h, s, -1).to(q.dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim in float32: ``x - max - log(sum exp(x - max))`` with :func:`exp`,
    :func:`tree_sum` and :func:`log`."""
    z = x.float() - x.float().max(-1, keepdim=True).values
    return z - log(tree_sum(exp(z), keepdim=True))


def tp_sum(y: torch.Tensor, mesh: Mesh, tp: str) -> torch.Tensor:
    """The sum of every ``tp`` rank's ``y`` in rank order, the same on every rank: gathered, then one
    :func:`pair_sum` over the ranks (an all-reduce's ring adds in an order of its own)."""
    n = mesh.axis_size(tp)
    if n == 1:
        return y
    return pair_sum(all_gather(y, mesh, tp).reshape(n, *y.shape), dim=0)
