"""The stored golden graphs (graphs/), read back for their checks: every verdict is recomputed from a graph's stored
text (``ge_graph.pbtxt.gz``, ``acl_graph.txt``, ``graph.txt``) and its input layout (``inputs.json``), without the
torch-npu wheel; the JSON stored beside it is only compared with the result."""

from __future__ import annotations

import re

import torch

from functional_npu.npu import ge_graph
from tools.aten_graphs import read_artifact
from tools.fx_text import parse_fx_text

from . import GRAPHS


def inputs(name: str) -> list[str | None]:
    """Case ``name``'s input layout: each graph input's path (``args.3.prefetched.0``, ...), in input order."""
    return read_artifact(GRAPHS, name, "inputs.json")


def ge_ops(name: str, text: str | None = None) -> list[dict]:
    """The GE op records of case ``name``'s stored graph (or of ``text``, an edit of it)."""
    return ge_graph.records_from_text(read_artifact(GRAPHS, name, "ge_graph.pbtxt.gz") if text is None else text)


def ge_ring_check(case, text: str | None = None) -> dict:
    """:func:`functional_npu.npu.ge_graph.ring_check` of the case's stored GE graph (or of ``text``)."""
    return ge_graph.ring_check(
        ge_ops(case.name, text),
        k=case.k,
        num_layers=case.config.num_layers,
        series=case.ring_groups,  # one coalesced write per layer and source carries its series (they share a dtype)
        axis_size=case.axes.get("dp", 1),
        inputs=inputs(case.name),
        phase=case.ring_phase,
    )


def ge_with_index(text: str, op: str, index: int) -> str:
    """A GE graph's text with graph input ``op``'s ``index`` attribute set to ``index``."""
    start = text.index(f'name: "{op}"')
    end = text.index("\nop {", start)
    block, n = re.subn(r'(key: "index"\s+value \{\s+i: )\d+', rf"\g<1>{index}", text[start:end])
    assert n == 1, op
    return text[:start] + block + text[end:]


def acl_module(name: str, text: str | None = None) -> torch.fx.GraphModule:
    """Case ``name``'s stored ACL graph (or ``text``), rebuilt from its text, with its input layout."""
    text = read_artifact(GRAPHS, name, "acl_graph.txt") if text is None else text
    return torch.fx.GraphModule(torch.nn.Module(), parse_fx_text(text, inputs(name)))


def fx_graph(name: str, text: str | None = None) -> torch.fx.Graph:
    """Case ``name``'s stored aten graph (``graph.txt``, or ``text``), rebuilt from its text, with its input layout."""
    return parse_fx_text(read_artifact(GRAPHS, name, "graph.txt") if text is None else text, inputs(name))


def unpinned(case, reads: dict[str, tuple[str, int | None]]) -> list[str]:
    """The reads of a case's ring (``reads``: read -> (slot, layer), the slot a graph input ``argN_1`` or
    ``RefData_argN_1``) whose layer the compute around them cannot pin, in ``reads``' order: none, but in the mixed
    case (``o_proj`` layer-sharded, ``down`` in host memory): the host group holds ``down`` alone, so a read of it lies
    between its own layer's inputs and the next layer's and no other read of the same slot value pins it; the last
    layer's is pinned (no layer follows). Those are the host group's reads (``state.prefetched[s * 2 + 1]``) of
    every layer but the last."""
    if case.series is None or case.offload is None:
        return []
    layout = inputs(case.name)

    def group(slot: str) -> int:
        return int(layout[int(slot.removeprefix("RefData_")[3:-2])].rsplit(".", 1)[1]) % case.ring_groups

    host = [r for r, (slot, _) in reads.items() if group(slot) == 1]
    last = [r for r in host if reads[r][1] == case.config.num_layers - 1]
    assert len(host) - len(last) == case.config.num_layers - 1, (host, last)
    return [r for r in host if r not in last]
