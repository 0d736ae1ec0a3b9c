"""Parity on quantized checkpoints written by compressed-tensors (tests/support/ct_models.py) from tiny random
transformers models: int8 per channel with dynamic per-token int8 activations (W8A8, ``int-quantized``),
int8 weight-only (``pack-quantized``, four to a word), int4 with groups of 32, symmetric and with zero points.

The reference is transformers on the same checkpoint: decompressed by compressed-tensors' own code into a float
checkpoint (weight-only schemes), or for W8A8 transformers' compressed-tensors forward, which rounds the
activations per token. fp32 checkpoints: prefill logits to 1e-4 and 16 greedy tokens, at tp 1 and 2 (dense),
experts replicated and expert-parallel over 2 ranks (MoE), eager, and compiled (inductor) for a few. bf16:
a float checkpoint stored in bf16, and bf16 W8A8 and int4 ones (what llm-compressor writes) run with the
weights in Ascend's kernels' forms (their CPU references), all against transformers in bf16."""

import pytest
import torch

from ..support.ct_models import dequantized_checkpoint, quantize_checkpoint
from ..support.hf_models import hf_greedy, save_tiny, save_tiny_moe
from ..support.workers import llama_generate, moe_generate

PROMPT_LENS = (5, 12, 9)
NEW = 16
DENSE = ("w8a8", "w8a16", "w4a16", "w4a16_asym")
MOE = ("w8a16", "w4a16", "w4a16_asym")
ASCEND = ("w8a8", "w4a16_asym")  # QuantBatchMatmulV3, WeightQuantBatchMatmulV2 with offsets
BF16_TOL = 2e-2  # bf16 end to end: both sides round every activation to 8 bits of mantissa


def _reference(model_dir, prompts, dtype=torch.float32):
    """transformers' prefill logits and greedy tokens for each prompt (a compressed-tensors checkpoint runs
    through transformers' compressed-tensors integration)."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        logits = [model(torch.tensor([p])).logits[0].float() for p in prompts]
        tokens = [hf_greedy(model, p, NEW) for p in prompts]
        margins = []  # the gap between the best two logits at each greedy step
        for p, t in zip(prompts, tokens):
            top = model(torch.tensor([p + t])).logits[0, len(p) - 1 : -1].float().topk(2, -1).values
            margins.append((top[:, 0] - top[:, 1]).tolist())
    return logits, tokens, margins


def _as_bf16(src, dst):
    """A copy of the HF directory ``src`` with every tensor stored in bf16 (and config.json saying so)."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state |= load_file(f)
    save_file({k: v.bfloat16() for k, v in state.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text()) | {"dtype": "bfloat16", "torch_dtype": "bfloat16"}
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (quantized dir, prompts, reference logits, reference tokens)} for every case, built once."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]
    out = {}
    root = tmp_path_factory.mktemp("quant")
    save_tiny("qwen3", root / "qwen3", 300, intermediate_size=128)  # groups of 32 split at tp 2
    save_tiny_moe("qwen3_moe", root / "qwen3_moe", 301)
    for family in ("qwen3", "qwen3_moe"):  # the same weights stored in bf16, run by transformers in bf16
        path = _as_bf16(root / family, root / f"{family}-bf16")
        out[f"{family}-bf16"] = (str(path), prompts, *_reference(path, prompts, torch.bfloat16))
    for scheme in ASCEND:  # bf16 quantized checkpoints, for Ascend's kernels (16-bit activations only)
        path = quantize_checkpoint(root / "qwen3-bf16", root / f"qwen3-bf16-{scheme}", scheme)
        src = path if scheme == "w8a8" else dequantized_checkpoint(path, root / f"qwen3-bf16-{scheme}-ref")
        out[f"qwen3-bf16-{scheme}"] = (str(path), prompts, *_reference(src, prompts, torch.bfloat16))
    for family, schemes in (("qwen3", DENSE), ("qwen3_moe", MOE)):
        for scheme in schemes:
            path = quantize_checkpoint(root / family, root / f"{family}-{scheme}", scheme)
            if scheme == "w8a8":  # transformers runs it with compressed-tensors' per-token activation rounding
                ref = _reference(path, prompts)
            else:
                ref = _reference(dequantized_checkpoint(path, root / f"{family}-{scheme}-ref"), prompts)
            out[f"{family}-{scheme}"] = (str(path), prompts, *ref)
    return out


def _check(logits, tokens, reference, order=None):
    path, prompts, ref_logits, ref_tokens, margins = reference
    # W8A8: an activation on a rounding boundary may land one int8 step apart (about 1e-4 in the logits), so
    # greedy decoding may part where transformers' best two tokens are that close (each logit off by up to
    # the tolerance: a gap of twice it), and only there
    w8a8, bf16 = path.endswith("w8a8"), "bf16" in path.rsplit("/", 1)[-1]
    tol = BF16_TOL if bf16 else 5e-4 if w8a8 else 1e-4
    for row, i in enumerate(order or range(len(prompts))):
        n = len(prompts[i])
        diff = (logits[row, :n].float() - ref_logits[i]).abs().max().item()
        assert diff < tol, f"prompt {i}: prefill logits differ by {diff}"
        parted = next((j for j, (a, b) in enumerate(zip(tokens[row], ref_tokens[i])) if a != b), None)
        if parted is not None:
            assert (w8a8 or bf16) and margins[i][parted] < 2 * tol, (
                f"prompt {i}: greedy tokens differ from step {parted} (transformers' margin there: "
                f"{margins[i][parted]:.2e}): {tokens[row]} != {ref_tokens[i]}"
            )


def _check_moe(result, reference):
    rot, logits, tokens, _, _ = result
    order = list(range(len(reference[1])))
    _check(logits, tokens, reference, order[rot:] + order[:rot])


@pytest.mark.parametrize("scheme", DENSE)
def test_dense_tp1(models, scheme):
    ref = models[f"qwen3-{scheme}"]
    logits, tokens, _, _ = llama_generate(None, ref[0], 1, ref[1], NEW, False)
    _check(logits, tokens, ref)


@pytest.mark.parametrize("scheme", DENSE)
def test_dense_tp2(world2, models, scheme):
    """Each rank reads only its slices: the bytes read equal the bytes of its shards."""
    from safetensors import safe_open

    from functional_npu import Mesh
    from functional_npu.core.tree import flatten_with_paths
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    ref = models[f"qwen3-{scheme}"]
    results = world2.run(llama_generate, ref[0], 2, ref[1], NEW, False)
    with safe_open(f"{ref[0]}/model.safetensors", "pt") as f:
        total = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    for rank, (logits, tokens, read, _) in enumerate(results):
        _check(logits, tokens, ref)
        local = load_checkpoint(ref[0], Mesh.abstract({"dp": 1, "tp": 2}, rank))
        held = sum(x.numel() * x.element_size() for _, x in flatten_with_paths(local))
        assert read == held < 0.7 * total, (read, held, total)


@pytest.mark.parametrize("scheme", ("w8a8", "w4a16"))
def test_dense_compiled(models, scheme):
    ref = models[f"qwen3-{scheme}"]
    logits, tokens, _, ops = llama_generate(None, ref[0], 1, ref[1], NEW, True)
    _check(logits, tokens, ref)
    kernel = "_int_mm" if scheme == "w8a8" else "_weight_int4pack_mm_for_cpu"
    assert any(kernel in op for op in ops), f"the compiled graph does not call {kernel}: {sorted(set(ops))[:20]}"


@pytest.mark.parametrize("scheme", MOE)
def test_moe_replicated(models, scheme):
    ref = models[f"qwen3_moe-{scheme}"]
    _check_moe(moe_generate(None, ref[0], {"tp": 1}, (), ref[1], NEW, False), ref)


@pytest.mark.parametrize("scheme", MOE)
def test_moe_ep2(world2, models, scheme):
    ref = models[f"qwen3_moe-{scheme}"]
    for r in world2.run(moe_generate, ref[0], {"dp": 2, "tp": 1}, ("dp",), ref[1], NEW, False):
        _check_moe(r, ref)


def test_w8a8_rounds_the_activations(models, tmp_path):
    """The W8A8 reference is not the weight-only one: the per-token activation rounding is what parity checks."""
    ref = models["qwen3-w8a8"]
    weight_only, *_ = _reference(dequantized_checkpoint(ref[0], tmp_path / "ref"), ref[1])
    assert max((a - b).abs().max().item() for a, b in zip(weight_only, ref[2])) > 2e-3


@pytest.mark.parametrize("backend", ["none", "inductor"], ids=["eager", "compiled"])
def test_dense_layer_sharded(world2, models, backend):
    """o_proj and down layer-sharded over dp = 2 (int4 weights, scales and packed words broadcast per layer)."""
    from functional_npu import Plan
    from functional_npu.cli.runner import generate_on_rank, in_prompt_order

    path, prompts, _, ref_tokens, _ = models["qwen3-w4a16"]
    plan = Plan(layer_shard="o_proj,down_proj")
    results = world2.run(generate_on_rank, path, {"dp": 2, "tp": 1}, prompts, NEW, backend=backend, plan=plan)
    assert in_prompt_order(results, len(prompts)) == ref_tokens


@pytest.mark.parametrize("scheme", ("w8a8", "w4a16"))
def test_dense_module_tp(world2, models, scheme):
    """o_proj, the MLP, the embedding and lm_head TP'd over both dp ranks: quantized shards of the group's
    slices (int4 groups of 32 split over the ranks); W8A8 rounds each token with its whole row's scale."""
    from functional_npu import Plan, split_dp
    from functional_npu.cli.runner import generate_on_rank, in_prompt_order

    path, prompts, _, ref_tokens, margins = models[f"qwen3-{scheme}"]
    axes, module_tp = split_dp({"dp": 2, "tp": 1}, dict.fromkeys(("o_proj", "mlp", "embed", "lm_head"), 2))
    results = world2.run(generate_on_rank, path, axes, prompts, NEW, backend="none", plan=Plan(module_tp=module_tp))
    for i, (got, want) in enumerate(zip(in_prompt_order(results, len(prompts)), ref_tokens)):
        parted = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert parted is None or (scheme == "w8a8" and margins[i][parted] < 1e-3), (i, got, want)


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_dense(world2, models, tp):
    ref = models["qwen3-bf16"]
    runs = (
        [llama_generate(None, ref[0], 1, ref[1], NEW, False)]
        if tp == 1
        else world2.run(llama_generate, ref[0], 2, ref[1], NEW, False)
    )
    for logits, tokens, _, _ in runs:
        assert logits.dtype == torch.bfloat16
        _check(logits, tokens, ref)


def test_bf16_moe_ep2(world2, models):
    ref = models["qwen3_moe-bf16"]
    _check_moe(moe_generate(None, ref[0], {"tp": 1}, (), ref[1], NEW, False), ref)
    for r in world2.run(moe_generate, ref[0], {"dp": 2, "tp": 1}, ("dp",), ref[1], NEW, False):
        _check_moe(r, ref)


def test_moe_w8a8_tp2_rounds_as_tp1(world2, tmp_path_factory, models):
    """W8A8 experts tensor-parallel over tp = 2 (down row-parallel): each row's int8 scale is reduced over tp, so
    the logits equal the unsharded model's (transformers has no W8A8 MoE forward to compare with)."""
    root = tmp_path_factory.mktemp("moe-w8a8")
    save_tiny_moe("qwen3_moe", root / "float", 301)
    path = str(quantize_checkpoint(root / "float", root / "w8a8", "w8a8"))
    prompts = models["qwen3_moe-w4a16"][1]
    _, one, _, _, _ = moe_generate(None, path, {"tp": 1}, (), prompts, 4, False)
    for _, logits, _, _, _ in world2.run(moe_generate, path, {"dp": 1, "tp": 2}, (), prompts, 4, False):
        assert (logits - one).abs().max().item() < 1e-5


@pytest.mark.parametrize("scheme", ASCEND)
def test_ascend_kernels_tp2(world2, models, scheme):
    """Weights prepared for Ascend's kernels (input-major, int4 as two's complement words, offsets for zero
    points), run through the ops' CPU references at tp 2, as a GE graph would call the kernels."""
    from functional_npu import Mesh, compile_model
    from functional_npu.models.linear import kernel_of
    from functional_npu.runtime.loading.checkpoint import load_checkpoint

    ref = models[f"qwen3-bf16-{scheme}"]
    mesh = Mesh.abstract({"dp": 1, "tp": 2}, 1)
    held = compile_model(load_checkpoint(ref[0], mesh), mesh, backend="none", kernels="npu").params
    kinds = {kernel_of(held["layers"][0][leaf]) for leaf in ("qkv", "o_proj", "gate_up", "down")}
    assert kinds == {"qbmm" if scheme == "w8a8" else "wqbmm"}
    for logits, tokens, _, _ in world2.run(llama_generate, ref[0], 2, ref[1], NEW, False, "npu"):
        assert logits.dtype == torch.bfloat16
        _check(logits, tokens, ref)
