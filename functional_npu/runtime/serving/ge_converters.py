"""torchair converters for :mod:`functional_npu.models.ascend_ops`: each op becomes Ascend's own GE op.

Importing this module registers them (torchair's ``register_fx_node_ge_converter``), so import it
only where ``torchair`` imports: :mod:`functional_npu.runtime.serving.backends` does before it hands torchair
a graph, and so does the CPU conversion process of ``python -m tools.graphs``.

- ``functional_npu::quant_matmul`` -> ``QuantBatchMatmulV3(x1 int8, x2 int8, scale, pertoken_scale)``
  with the output dtype as its ``dtype`` attribute;
- ``functional_npu::weight_quant_matmul`` -> ``WeightQuantBatchMatmulV2(x, weight, antiquant_scale,
  antiquant_offset, antiquant_group_size)``; packed int4 words are bitcast to ``DT_INT4`` and
  reshaped to ``[K, N]`` first (the op reads a ``DT_INT4`` weight, as torchair's own converter for
  torch-npu's ``npu_quant_matmul`` does for int4);
- ``functional_npu::broadcast_into`` (a prefetch ring's in-place broadcast, see
  :func:`functional_npu.core.collectives.broadcast_into`) -> on the source rank, one ``ViewCopy`` per part
  into the slot (in place: ``ViewCopy``'s ``dst`` is its output), then ``HcomBroadcast`` of the slot;
  each op gets a control edge on ``after``. It reaches the converter through :func:`reinplace_ring`
  (torchair's ``post_grad_custom_pre_pass``), never through torchair's own ``auto_functionalized_v2``
  converter, which hands the op a ``TensorMove`` copy of the slot (a second ring) and removes that copy
  only for a fixed list of GE op types that ``HcomBroadcast`` is not on, and never for a slot written
  twice in one graph (``k + 1 < L``);
- ``aten.index_put`` / ``index_put_`` of two index tensors (a paged KV cache's write, ``pool[block, offset] =
  values``, :func:`functional_npu.models.paged.paged`) -> ``ScatterNdUpdate`` with ``[N, 2]`` indices, as torchair
  converts torch-npu's ``npu_scatter_nd_update`` (torchair has no converter for ``index_put``); any other
  ``index_put`` still fails to convert, naming itself.

With :func:`configure` (``experimental_config.enable_ref_data`` and :func:`reinplace_ring` as the
pre-pass), each ring slot is a ``RefData`` input: the broadcasts write it in place, and the slot's
last value is a graph output bound to the input's own address (torchair's ``_graph_output_ref_input``,
what its ``copy_`` converter's ``Assign`` into an input becomes); no ``TensorMove``, no ``Assign``.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torchair import register_fx_node_ge_converter  # type: ignore[import-not-found]
from torchair._ge_concrete_graph import ge_apis as ge  # type: ignore[import-not-found]
from torchair._ge_concrete_graph.hcom_utils import get_group_name_and_record  # type: ignore[import-not-found]
from torchair.ge import DataType  # type: ignore[import-not-found]
from torchair.ge._ge_graph import (  # type: ignore[import-not-found]
    _ge_dtype_to_ge_proto_dtype,
    dont_prune_me,  # type: ignore[import-not-found]
    torch_type_to_ge_type,
)

from ...core import collectives  # noqa: F401 - defines functional_npu::broadcast_into
from ...models import ascend_ops  # noqa: F401 - defines the ops converted here

__all__ = ["reinplace_ring", "configure", "RING_WRITE"]

_LIB = torch.library.Library("functional_npu", "FRAGMENT")
_LIB.define("ring_write(Tensor slot, Tensor[] parts, Tensor? after, int src, str group_name, int size) -> Tensor")
RING_WRITE = "functional_npu.ring_write.default"  # the op as FX graphs name it


def _ring_write_meta(
    slot: torch.Tensor, parts: list[torch.Tensor], after: torch.Tensor | None, src: int, group_name: str, size: int
) -> torch.Tensor:
    return torch.empty_like(slot)


_LIB.impl("ring_write", _ring_write_meta, "Meta")


def reinplace_ring(gm: torch.fx.GraphModule, *_: Any, ordered: bool = True, **__: Any) -> None:
    """torchair's ``post_grad_custom_pre_pass``: each ``auto_functionalized_v2(functional_npu.broadcast_into, ...,
    _all_bases=[slot])`` and its new-slot ``getitem`` become one ``functional_npu.ring_write(slot, ...)`` node, the
    slot's value after the in-place write (what inductor's reinplace pass does, for GE): the GE converter writes
    into the slot itself. The ``copy_`` of the slot's last value into the graph input stays: torchair binds that
    output to the input's address. ``ordered=False`` drops each write's ``after`` (the no-hints control: nothing
    orders a write after the reads of the layer its slot held).

    Raises:
        NotImplementedError: a slot passed as a view of a larger buffer (the ring passes whole flat buffers).
    """
    graph = gm.graph
    hop = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
    target = torch.ops.functional_npu.broadcast_into.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop or node.args[0] is not target:
            continue
        kw = dict(node.kwargs)
        bases, index = kw.pop("_all_bases"), kw.pop("_slot_base_index", None)
        if index is None or set(kw) != {"parts", "after", "src", "group_name", "size"}:
            raise NotImplementedError(
                f"ring_write: {node.name} writes a view of its slot ({sorted(kw)}): not supported"
            )
        slot = bases[index]
        with graph.inserting_before(node):
            new = graph.call_function(
                torch.ops.functional_npu.ring_write.default,
                (slot, kw["parts"], kw["after"] if ordered else None, kw["src"], kw["group_name"], kw["size"]),
            )
        new.meta = dict(node.meta)
        new.meta["val"] = slot.meta["val"]
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise NotImplementedError(f"ring_write: {node.name} is used by {user.format_node()}")
            if user.args[1] == 1 + index:  # (op output, *new bases)
                user.replace_all_uses_with(new)
            graph.erase_node(user)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


def configure(config: Any, *, ordered: bool = True) -> Any:
    """Set what the prefetch ring needs on a ``torchair.CompilerConfig`` (GE graph mode); returns it.

    - ``post_grad_custom_pre_pass`` = :func:`reinplace_ring`, so the ring's writes reach GE in place;
    - ``experimental_config.enable_ref_data``: an input a graph writes (a ring slot) becomes a ``RefData``, GE's
      input that ops may write in place; as a plain ``Data``, GE owns no right to write it and torchair's run
      copies the written value back into the input after GE returns.
    """
    config.post_grad_custom_pre_pass = reinplace_ring if ordered else functools.partial(reinplace_ring, ordered=False)
    config.experimental_config.enable_ref_data = True
    return config


@register_fx_node_ge_converter(torch.ops.functional_npu.quant_matmul.default)
def _quant_matmul(
    x: Any, weight: Any, scale: Any, pertoken_scale: Any, dtype: torch.dtype, meta_outputs: Any = None
) -> Any:
    return ge.QuantBatchMatmulV3(
        x,
        weight,
        scale,
        offset=None,
        bias=None,
        pertoken_scale=pertoken_scale,
        dtype=torch_type_to_ge_type(dtype),
        transpose_x1=False,
        transpose_x2=False,
    )


@register_fx_node_ge_converter(torch.ops.functional_npu.weight_quant_matmul.default)
def _weight_quant_matmul(
    x: Any, weight: Any, scale: Any, offset: Any, group_size: int, meta_outputs: Any = None
) -> Any:
    if weight.dtype == DataType.DT_INT32:  # [K, N / 8] words -> [K, N] int4
        k, words = weight.symsize
        shape = ge.Const([k, words * 8], dtype=DataType.DT_INT64)
        weight = ge.Reshape(ge.Bitcast(weight, type=DataType.DT_INT4), shape)
        weight.desc.dtype = _ge_dtype_to_ge_proto_dtype(DataType.DT_INT4)  # what GE would infer, stated
    return ge.WeightQuantBatchMatmulV2(
        x,
        weight,
        scale,
        antiquant_offset=offset,
        quant_scale=None,
        quant_offset=None,
        bias=None,
        transpose_x=False,
        transpose_weight=False,
        antiquant_group_size=group_size,
    )


@register_fx_node_ge_converter(torch.ops.functional_npu.ring_write.default)
def _ring_write(
    slot: Any, parts: Any, after: Any, src: int, group_name: str, size: int, meta_outputs: Any = None
) -> Any:
    """The slot after the write: ``ViewCopy`` of each part into it (the source rank), then ``HcomBroadcast`` of
    it (a group of more than one rank), every op after ``after``."""
    deps = [after] if after is not None else []
    offset = 0
    for part in parts or []:
        n = 1
        for d in part.symsize:
            n *= d
        flat = ge.Reshape(part, ge.Const([n], dtype=DataType.DT_INT64))
        one = ge.Const([1], dtype=DataType.DT_INT64)
        meta = slot.meta
        slot = ge.ViewCopy(
            slot,
            ge.Const([n], dtype=DataType.DT_INT64),
            one,
            ge.Const(offset, dtype=DataType.DT_INT64),
            flat,
            ge.Const([n], dtype=DataType.DT_INT64),
            one,
            ge.Const(0, dtype=DataType.DT_INT64),
            dependencies=deps,
        )
        slot.set_meta(meta)  # the slot, written: its shape and dtype stay
        offset += n
    if size <= 1:
        return slot if parts else ge.Identity(slot, dependencies=deps)
    group = torch.distributed.distributed_c10d._resolve_process_group(group_name)
    ranks = torch.distributed.get_process_group_ranks(group)
    tag = torch.distributed.distributed_c10d._get_group_tag(group)
    return ge.HcomBroadcast(
        [slot], root_rank=src, group=get_group_name_and_record(tag, ranks, len(ranks)), fusion=0, dependencies=deps
    )[0]


def _block_rows(indices: Any) -> Any:
    """A paged write's ``(block, offset)`` index tensors as ``ScatterNdUpdate``'s ``[N, 2]`` indices."""
    if len(indices) != 2 or any(i is None for i in indices):
        raise NotImplementedError(
            "index_put: only a paged cache's write, pool[block, offset] = values (two index tensors), converts"
        )
    return ge.Pack(list(indices), N=2, axis=-1)


@register_fx_node_ge_converter(torch.ops.aten.index_put.default)
def _index_put(self: Any, indices: Any, values: Any, accumulate: bool = False, meta_outputs: Any = None) -> Any:
    """A paged KV write (:func:`functional_npu.models.paged.paged`), functional: ``ScatterNdUpdate`` of a
    ``TensorMove`` of the pool, as torchair converts torch-npu's ``npu_scatter_nd_update`` (the write Ascend serving
    puts a step's keys into its block-table cache with)."""
    if accumulate:
        raise NotImplementedError("index_put: accumulate=True has no converter")
    return ge.ScatterNdUpdate(ge.TensorMove(self), _block_rows(indices), values)


@register_fx_node_ge_converter(torch.ops.aten.index_put_.default)
def _index_put_(self: Any, indices: Any, values: Any, accumulate: bool = False, meta_outputs: Any = None) -> Any:
    """The same write in place (a graph pass re-inplaced it): ``ScatterNdUpdate`` of the pool itself, kept."""
    if accumulate:
        raise NotImplementedError("index_put_: accumulate=True has no converter")
    op = ge.ScatterNdUpdate(self, _block_rows(indices), values)
    dont_prune_me(op)
    return op
