"""Hypothesis strategies: meshes, and (full tensor, layout) pairs that fit them."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from functional_npu import Block, Cyclic, Layout, Mesh, Shard

AXIS_NAMES = ("dp", "pp", "tp")


@st.composite
def mesh_axes(draw, max_ranks: int = 8, world: int | None = None) -> dict[str, int]:
    """1 to 3 named axes with at most ``max_ranks`` ranks in all (exactly ``world`` if given)."""
    if world is not None:
        sizes = []
        left = world
        for _ in range(draw(st.integers(1, 3)) - 1):
            d = draw(st.sampled_from([k for k in range(1, left + 1) if left % k == 0]))
            sizes.append(d)
            left //= d
        sizes.append(left)
        sizes = draw(st.permutations(sizes))
    else:
        sizes = []
        for _ in range(draw(st.integers(1, 3))):
            sizes.append(draw(st.integers(1, max_ranks // max(1, math.prod(sizes)))))
    names = draw(st.permutations(AXIS_NAMES))[: len(sizes)]
    return dict(zip(names, sizes))


@st.composite
def dim_case(draw, n: int, axes: tuple[str, ...], packed: bool):
    """(spec, stored length) for one dim sharded over ``axes`` of total size ``n``."""
    kind = draw(st.sampled_from(["cyclic", "shard", "fused"] if len(axes) == 1 and not packed else ["shard", "fused"]))
    if kind == "cyclic":
        size = draw(st.integers(1, 2 * n + 1))
        return Cyclic(axes[0], size), size
    pack = draw(st.sampled_from([2, 4, 8])) if packed else 1
    if kind == "shard":
        return Shard(axes, (), pack), n * draw(st.integers(1, 3))
    blocks = []
    for i in range(draw(st.integers(1, 3))):
        unit = pack * draw(st.integers(1, 2))
        if draw(st.booleans()):
            units = n * draw(st.integers(1, 2))
            blocks.append(Block(f"b{i}", units * unit, unit, draw(st.booleans())))
        else:  # fewer units than ranks: replicated units (GQA KV heads)
            units = draw(st.sampled_from([u for u in range(1, n + 1) if n % u == 0]))
            blocks.append(Block(f"b{i}", units * unit, unit, replicate=True))
    return Shard(axes, tuple(blocks), pack), sum(b.size for b in blocks) // pack


@st.composite
def leaf_case(draw, axes: dict[str, int]):
    """(shape, dtype, layout) of a full leaf that ``layout`` can place on a mesh of ``axes``."""
    ndim = draw(st.integers(1, 3))
    free = list(axes)
    dims: list = []
    shape: list[int] = []
    packed = draw(st.booleans()) and draw(st.booleans())
    for _ in range(ndim):
        use = [a for a in free if draw(st.booleans())] if free and draw(st.booleans()) else []
        if not use:
            dims.append(None)
            shape.append(draw(st.integers(1, 4)))
            continue
        free = [a for a in free if a not in use]
        use = draw(st.permutations(use))  # any cut order: mesh order is DTensor's default, others its strided shards
        spec, length = draw(dim_case(math.prod(axes[a] for a in use), tuple(use), packed))
        dims.append(spec)
        shape.append(length)
    while dims and dims[-1] is None:
        dims.pop()
    dtype = (
        torch.int32 if packed else draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.float16]))
    )
    return tuple(shape), dtype, Layout(tuple(dims))


def make_tensor(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(dtype)


def all_coordinates(mesh: Mesh):
    return [mesh.at(r) for r in range(mesh.size)]
