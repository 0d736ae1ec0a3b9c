"""tools/fx_text.py: a golden graph's printed text read back into the FX graph it prints."""

import re

from tools.aten_graphs import read_artifact
from tools.fx_text import parse_fx_text

from ..support import GRAPHS, golden


def test_the_parsed_graph_is_the_stored_graph():
    """Both printed forms read back to the nodes, targets and arguments they print: ``print_readable``'s code (the
    aten graph) node for node, ``str(graph)`` (the ACL graph) character for character."""
    name = "qwen3-dp2-layer_shard-k1-decode"
    text = read_artifact(GRAPHS, name, "graph.txt")
    printed = re.findall(r"^ +(\w+)(?:: \"[^\"]*\")? = (torch\.ops\.[\w.]+|\w+\[)", text, re.M)
    graph = golden.fx_graph(name)
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    assert [(n.name, "getitem" if n.target.__name__ == "getitem" else str(n.target)) for n in nodes] == [
        (node, "getitem" if target.endswith("[") else target.removeprefix("torch.ops.").removeprefix("higher_order."))
        for node, target in printed
    ]
    assert [n.name for n in graph.nodes if n.op == "placeholder"] == [
        f"arg{i}_1" for i in range(len(golden.inputs(name)))
    ]
    acl = read_artifact(GRAPHS, name, "acl_graph.txt")
    assert str(parse_fx_text(acl)).strip() == acl.strip()
