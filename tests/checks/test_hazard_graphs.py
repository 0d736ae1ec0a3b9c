"""The hazard check over the stored golden aten graphs (graphs/<case>/graph.txt, the functionalized FX graph every
compiler starts from), read back from their text with their input layout: every verdict recomputed, and faults
planted in the text found, each by its exact findings. An FX graph's order is its data edges, a partial order: every
claim of the check can fire there. The ring's cases are the layer-sharded ones and those with series kept in host
memory (filled by copies, the same graph op with a group of one)."""

import pytest

from functional_npu.checks import check, from_fx
from tools.aten_graphs import CASES, read_artifact

from ..support import GRAPHS, golden

RINGED = [c for c in CASES if c.ringed]


def _check(case, text=None, phase=None):
    """The hazard check of the case's stored graph (or ``text``) as a step of its ring phase (or ``phase``)."""
    phase = case.ring_phase if phase is None else phase
    graph = golden.fx_graph(case.name, text)
    program = from_fx(graph, case.k, case.ring_groups, copy_back=False, phase=phase)  # the reinplacing compilers'
    return check(program, case.k, case.ring_groups * (case.k + 1)), program


def _case(name):
    return next(c for c in RINGED if c.name == name)


@pytest.mark.parametrize("case", RINGED, ids=lambda c: c.name)
def test_golden_aten_graph_keeps_the_ring_safe(case):
    found, program = _check(case)
    assert found == []
    groups, layers = case.ring_groups, case.config.num_layers
    inputs = sorted(program.slot_index, key=lambda s: int(s[3:-2]))
    assert program.slot_index == {s: i // groups for i, s in enumerate(inputs)} and len(inputs) == groups * (case.k + 1)
    assert sorted({layer for _, layer in program.reads.values() if layer is not None}) == list(range(layers))
    assert [r for r, (_, layer) in program.reads.items() if layer is None] == golden.unpinned(case, program.reads)
    written = sorted(layer for _, layer in program.writes.values())
    assert written == sorted(list(range(case.k, case.k + layers)) * groups)


def _swap(text, a, b):
    assert a in text and b in text
    return text.replace(a, "\0").replace(b, a).replace("\0", b)


def test_golden_aten_graph_with_two_slot_inputs_swapped_reads_and_writes_the_wrong_layers():
    """The k = 2 graph with the input indices of slots 0 and 1 swapped (their places in the signature)."""
    case = _case("qwen3-dp2-layer_shard-k2-decode")
    text = _swap(read_artifact(GRAPHS, case.name, "graph.txt"), 'arg5_1: "f32[12288]"', 'arg6_1: "f32[12288]"')
    assert _check(case, text)[0] == [
        "the right layer: auto_functionalized_v2_1 writes layer 3 into arg5_1 (ring slot 1); layer 3 belongs in ring "
        "slot 0",
        "the right layer: auto_functionalized_v2_2 writes layer 4 into arg6_1 (ring slot 0); layer 4 belongs in ring "
        "slot 1",
        "the right layer: mm_1 reads layer 0 from arg5_1 (ring slot 1), which holds layer 1 then",
        "the right layer: mm_3 reads layer 0 from arg5_1 (ring slot 1), which holds layer 1 then",
        "the right layer: mm_5 reads layer 1 from arg6_1 (ring slot 0), which holds layer 0 then",
        "the right layer: mm_7 reads layer 1 from arg6_1 (ring slot 0), which holds layer 0 then",
    ]


def _edit(text, line_start, old, new):
    """``text`` with ``old`` replaced by ``new`` in its line starting with ``line_start``."""
    lines = text.splitlines(keepends=True)
    (i,) = [i for i, ln in enumerate(lines) if ln.lstrip().startswith(line_start)]
    assert old in lines[i]
    lines[i] = lines[i].replace(old, new, 1)
    return "".join(lines)


UNGATED = {  # case: (the write, its ``after``, the findings without it)
    # layer 3's broadcast into slot 1 without the residual entering layer 2 depends only on layer 1's write: it races
    # layer 1's reads of the slot
    "qwen3-dp2-layer_shard-k1-decode": (
        "auto_functionalized_v2_2",
        "add_15",
        [
            "write after read: auto_functionalized_v2_2 writes arg6_1 unordered with mm_5, which reads it",
            "write after read: auto_functionalized_v2_2 writes arg6_1 unordered with mm_7, which reads it",
        ],
    ),
    # the ring filled from host memory (L = 3, k = 1): layer 2's copy into slot 0 without the residual entering layer
    # 1 depends on nothing the layers compute: it races layer 0's reads of the slot
    "qwen3-tp1-offload-L3-k1-decode": (
        "auto_functionalized_v2_1",
        "add_7",
        [
            "write after read: auto_functionalized_v2_1 writes arg5_1 unordered with mm_1, which reads it",
            "write after read: auto_functionalized_v2_1 writes arg5_1 unordered with mm_3, which reads it",
        ],
    ),
}


@pytest.mark.parametrize("name", UNGATED)
def test_golden_aten_graph_without_a_gate_writes_a_slot_still_read(name):
    """Data edges: a write into a slot without its ``after`` races the reads of the layer the slot held."""
    write, after, found = UNGATED[name]
    text = read_artifact(GRAPHS, name, "graph.txt")
    assert _check(_case(name), _edit(text, f"{write} =", f"after = {after}", "after = None"))[0] == found


def test_golden_aten_graph_with_two_writes_of_a_slot_unordered_is_write_after_write():
    """Data edges: the same write, ungated and written into the slot's input instead of layer 1's version of it, is
    unordered with layer 1's write (write after write) and with its reads."""
    case = _case("qwen3-dp2-layer_shard-k1-decode")
    text = read_artifact(GRAPHS, case.name, "graph.txt")
    text = _edit(text, "auto_functionalized_v2_2 =", "after = add_15", "after = None")
    text = _edit(text, "auto_functionalized_v2_2 =", "_all_bases = [getitem_1]", "_all_bases = [arg6_1]")
    assert _check(case, text)[0] == [
        "write after write: auto_functionalized_v2 and auto_functionalized_v2_2 write arg6_1 unordered",
        "write after read: auto_functionalized_v2_2 writes arg6_1 unordered with mm_5, which reads it",
        "write after read: auto_functionalized_v2_2 writes arg6_1 unordered with mm_7, which reads it",
    ]
