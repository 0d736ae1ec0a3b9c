"""Gradients of the sharded forward against transformers' ``loss.backward()``, in float64.

Every family's tiny random model (saved with ``save_pretrained``) runs transformers' causal-LM loss over the
whole batch; its gradients are written back into the model and saved with ``save_pretrained`` too, so
``load_checkpoint`` reads each rank's expected gradient shard with the same plan: a reference laid out by the
loader (checked against transformers' outputs elsewhere), not by the gradient code. Plans: tp 1 and 2 for
every family (fused q|k|v and gate|up, GQA heads replicated at tp 2 for one KV head, tied embeddings, MoE
routing), experts over dp 2 (the token exchange), module TP over dp 2 and layer sharding over dp 2 (each dp
rank its own batch: the gradient of the mean). One case drops the replica sums and must fail.
"""

import pytest
import torch

from ..support.grad_workers import grad_errors
from ..support.hf_models import (
    DEEPSEEK_FAMILIES,
    FAMILIES,
    GEMMA3_FAMILIES,
    MOE_FAMILIES,
    causal_lm_loss,
    float64_norms,
    save_tiny,
    save_tiny_deepseek,
    save_tiny_gemma3,
    save_tiny_moe,
)

SAVERS = (
    {f: save_tiny for f in FAMILIES}
    | {f: save_tiny_moe for f in MOE_FAMILIES}
    | {f: save_tiny_deepseek for f in DEEPSEEK_FAMILIES}
    | {f: save_tiny_gemma3 for f in GEMMA3_FAMILIES}
)
# float64 on both sides (transformers' norms and loss computed in float64 too: float64_norms, causal_lm_loss): the
# dense families agree to ~2e-15 (seen); transformers' MoE routers still score in float32 (their own code: Qwen's
# and Mixtral's softmax, DeepSeek's router linear), up to ~4e-8 in the loss and ~2e-7 in a gradient (DeepSeek-V2's
# embedding, seen), against which the experts' families are held
TOL = 1e-12
ROUTER_TOL = 1e-6
B, S = 2, 10  # rows per data-parallel batch, tokens per row


def _four_layers(name, path, seed):
    return save_tiny(name, path, seed, num_hidden_layers=4)


def hf_grad_dir(model, batch: torch.Tensor, path) -> float:
    """transformers' loss on ``batch`` (labels = inputs) in float64; its gradients saved as a checkpoint at ``path``
    (every parameter's ``.grad`` in place of its value, with ``save_pretrained``). Returns the loss."""
    model = float64_norms(model.double())
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    model.zero_grad()
    loss = causal_lm_loss(model, batch)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    model.save_pretrained(path)
    return loss.item()


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """{name: (model dir, grad dir, batches, hf loss)}: two batches (one per data-parallel rank), the reference
    gradient that of the mean loss over both."""
    out = {}
    g = torch.Generator().manual_seed(3)
    for i, (name, save) in enumerate((SAVERS | {"qwen3-4l": _four_layers}).items()):
        model_dir, grad_dir = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(f"{name}-grad")
        model = save(name.removesuffix("-4l"), model_dir, 500 + i)
        batches = [torch.randint(0, 128, (B, S), generator=g) for _ in range(2)]
        loss = hf_grad_dir(model, torch.cat(batches), grad_dir)
        out[name] = (str(model_dir), str(grad_dir), batches, loss)
    return out


def _check(results, ref, *, buffers=()):
    tol = ROUTER_TOL if any("router" in p for p in results[0]["errors"]) else TOL
    for rank, r in enumerate(results):
        assert abs(r["loss"] - ref[3]) < tol, f"rank {rank}: loss {r['loss']} vs transformers' {ref[3]}"
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] < tol * max(1.0, r["scale"]), f"rank {rank}: {worst} off by {r['errors'][worst]}"
        assert [p for p in r["none"] if not p.endswith("expert_map")] == sorted(buffers)


def _buffers(name, model_dir):
    import json

    cfg = json.loads(open(f"{model_dir}/config.json").read())
    if name.startswith("deepseek_v3"):
        first = cfg["first_k_dense_replace"]
        return [f"layers.{i}.router_bias" for i in range(first, cfg["num_hidden_layers"])]
    return []


@pytest.mark.parametrize("name", list(SAVERS))
def test_grad_tp1_matches_transformers(refs, name):
    model_dir, grad_dir, batches, loss = refs[name]
    # one process, both batches as one: the mean over every token
    r = grad_errors(None, model_dir, grad_dir, {"tp": 1}, {}, [torch.cat(batches)])
    _check([r], refs[name], buffers=_buffers(name, model_dir))


@pytest.mark.parametrize("name", list(SAVERS))
def test_grad_tp2_matches_transformers(world2, refs, name):
    model_dir, grad_dir, batches, _ = refs[name]
    results = world2.run(grad_errors, model_dir, grad_dir, {"tp": 2}, {}, [torch.cat(batches)])
    _check(results, refs[name], buffers=_buffers(name, model_dir))


@pytest.mark.parametrize("name", list(MOE_FAMILIES) + ["deepseek_v3"])
def test_grad_ep2_matches_transformers(world2, refs, name):
    """Experts over dp 2, each rank its own batch: the tokens cross ranks both ways (all_to_all and its transpose)."""
    model_dir, grad_dir, batches, _ = refs[name]
    results = world2.run(grad_errors, model_dir, grad_dir, {"dp": 2, "tp": 1}, {"expert_axes": ("dp",)}, batches)
    _check(results, refs[name], buffers=_buffers(name, model_dir))


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_grad_module_tp_over_dp2_matches_transformers(world2, refs, name):
    """o_proj, lm_head, embed and mlp tensor-parallel over the two dp ranks, each with its own batch (llama3: tied)."""
    model_dir, grad_dir, batches, _ = refs[name]
    every = {"o_proj": 2, "lm_head": 2, "embed": 2, "mlp": 2}
    results = world2.run(grad_errors, model_dir, grad_dir, {"dp": 2, "tp": 1}, {}, batches, module_tp=every)
    _check(results, refs[name])


def test_grad_layer_sharded_over_dp2_matches_transformers(world2, refs):
    """q|k|v, o_proj and down layer-sharded over dp 2 (layer l on rank l % 2), fetched one layer ahead."""
    model_dir, grad_dir, batches, _ = refs["qwen3-4l"]
    fields = {"layer_shard": "q_proj,o_proj,down_proj", "prefetch_step": 1}
    _check(world2.run(grad_errors, model_dir, grad_dir, {"dp": 2, "tp": 1}, fields, batches), refs["qwen3-4l"])


def test_grad_check_fails_without_replica_sums(world2, refs):
    """qwen2's one KV head is replicated at tp 2 and the norms on both ranks: dropping the sums of the holders'
    shares must show up as a gradient off by about the shares left out."""
    model_dir, grad_dir, batches, _ = refs["qwen2"]
    results = world2.run(grad_errors, model_dir, grad_dir, {"tp": 2}, {}, [torch.cat(batches)], drop_sums=True)
    for r in results:
        bad = {p for p, e in r["errors"].items() if e > 1e-3}
        assert "norm" in bad and any(p.endswith("qkv") for p in bad), sorted(bad)
