"""The linear-kernel benchmark's pieces: the bench model's weight shapes, and inductor's answer to a prepacked
oneDNN weight as a graph input (the reason the scoreboard's batch-32 cells keep torch's matmul)."""

import torch


def test_shapes_are_every_linear_weight_of_the_model():
    from benchmarks.configs import FULL, QUICK
    from benchmarks.linears import shapes
    from functional_npu.models.llama import abstract_params

    for cfg in (FULL, QUICK):
        params = abstract_params(cfg)
        leaves = [layer[k] for layer in params["layers"] for k in ("qkv", "o_proj", "gate_up", "down")]
        assert [tuple(x.shape) for x in leaves + [params["lm_head"]]] == shapes(cfg)


def test_a_prepacked_onednn_weight_is_refused_as_a_graph_input():
    """If a torch release accepts it, this fails: the oneDNN path then belongs in linear.py."""
    from benchmarks.linears import onednn_as_input

    if not torch.backends.mkldnn.is_available():
        return
    assert onednn_as_input() != "accepted"
