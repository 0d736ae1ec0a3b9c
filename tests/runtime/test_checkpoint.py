"""load_checkpoint: reads exactly this rank's slices, converts dtypes, and refuses every bad input clearly."""

import json
import re
import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from functional_npu import Mesh, greedy_generate, local_shape
from functional_npu.core.shard import leaf_specs
from functional_npu.core.tree import flatten_with_paths
from functional_npu.models import llama
from functional_npu.runtime.loading.checkpoint import load_checkpoint, read_quant
from functional_npu.runtime.loading.save import save_checkpoint

from ..support.hf_models import hf_greedy


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    cfg = T.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = tmp_path_factory.mktemp("qwen2")
    T.Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture
def ckpt(base, tmp_path):
    """A private copy of the checkpoint to break."""
    return shutil.copytree(base, tmp_path / "model")


def _edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_reads_exactly_its_shard(base, tp):
    cfg = llama.LlamaConfig.from_hf(json.loads((base / "config.json").read_text()))
    full = llama.abstract_params(cfg)
    layouts = leaf_specs(llama.param_specs(cfg), full)
    for rank in range(tp):
        mesh = Mesh.abstract({"tp": tp}, rank)
        read = []
        params = load_checkpoint(base, mesh, on_read=lambda name, n, read=read: read.append(n))
        local_bytes = 0
        for path, x in flatten_with_paths(params):
            want = local_shape(dict(flatten_with_paths(full))[path].shape, layouts[path], mesh)
            assert tuple(x.shape) == want, path
            local_bytes += x.numel() * x.element_size()
        assert sum(read) == local_bytes  # never a byte it does not own


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_conversion(base, dtype):
    params = load_checkpoint(base, Mesh.abstract({"tp": 2}, 1), dtype=dtype)
    assert {x.dtype for _, x in flatten_with_paths(params)} == {dtype}
    assert params.config.architecture == "Qwen2ForCausalLM"


def test_params_are_put_on_the_device_asked_for(base):
    params = load_checkpoint(base, Mesh.abstract({"tp": 2}, 0), device="meta")  # every leaf, none read twice
    assert {x.device.type for _, x in flatten_with_paths(params)} == {"meta"}
    with pytest.raises(ValueError, match=r"^load_checkpoint: device 'gpu0' is not usable here \(.*\); pass 'cpu'"):
        load_checkpoint(base, Mesh.abstract({"tp": 2}, 0), device="gpu0")


def test_progress_is_a_bar_on_rank_0_only(base, capsys):
    load_checkpoint(base, Mesh.abstract({"tp": 2}, 1), progress=True)
    assert capsys.readouterr().err == ""
    load_checkpoint(base, Mesh.abstract({"tp": 2}, 0), progress=True)
    assert re.search(r"loading \S+: 100%\|.*\| 17/17 ", capsys.readouterr().err)  # tqdm's bar, every leaf read
    load_checkpoint(base, Mesh.abstract({"tp": 2}, 0))  # stderr is not a terminal here: quiet
    assert capsys.readouterr().err == ""


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError,
        match=r"does not match its Qwen2ForCausalLM config.json:\n"
        r"  missing tensors \(1\): model.layers.1.mlp.up_proj.weight",
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_unexpected_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \(1\): model.layers.0.mlp.extra.weight"):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_shape_mismatch(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(31, 64)}))
    with pytest.raises(
        ValueError,
        match=r"tensor 'model.layers.1.self_attn.k_proj.weight' \(for params\['layers.1.qkv'\]\) "
        r"has shape \(31, 64\) but config.json implies \(32, 64\)",
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_config_and_weights_disagree(ckpt):
    _edit_config(ckpt, intermediate_size=80)
    with pytest.raises(
        ValueError,
        match=r"has shape \(96, 64\) but config.json implies \(80, 64\) \(.*intermediate_size=80.*\); "
        r"the config and the weights disagree",
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_unsupported_architecture(ckpt):
    _edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ValueError,
        match=r"unsupported architecture 'GPT2LMHeadModel'; "
        r"supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_unsupported_rope(ckpt):
    _edit_config(ckpt, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match=r"rope_type 'yarn' is not supported; supported: default, linear, llama3"):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: cannot read the safetensors file .*; "
        r"it is truncated or corrupted, download it again",
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_corrupted_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(b"\x07" * 64 + f.read_bytes()[64:])
    with pytest.raises(ValueError, match=r"it is truncated or corrupted, download it again"):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_mesh_cannot_shard_config(ckpt):
    with pytest.raises(
        ValueError,
        match=r"the mesh \{'tp': 3\} cannot shard this Qwen2ForCausalLM config: "
        r".*specs\['embed'\] shards dim 0 \(size 128\) over mesh axis 'tp' \(size 3\): 3 does not divide 128",
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 3}, 0))
    with pytest.raises(
        ValueError,
        match=r"the mesh \{'tp': 8\} cannot shard .*block 'q' has 4 units of 16 \(size 64\) "
        r"sharded over mesh axis 'tp' \(size 8\): 8 must divide 4",
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 8}, 0))


def test_mesh_without_tp_axis(ckpt):
    with pytest.raises(ValueError, match=r"the mesh \{'dp': 2\} has no 'tp' axis; add one"):
        load_checkpoint(ckpt, Mesh.abstract({"dp": 2}, 0))


def test_missing_files(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config.json not found: expected a HF model directory"):
        load_checkpoint(tmp_path, Mesh.abstract({"tp": 1}, 0))
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"neither model.safetensors, model.safetensors.index.json nor a DCP .metadata is present",
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_index_names_a_missing_shard(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in tensors} | {
        "model.norm.weight": "model-00002-of-00002.safetensors"
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        FileNotFoundError, match=r"model-00002-of-00002.safetensors is named by the index but does not exist"
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_index_names_a_shard_that_lacks_the_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    norm = tensors.pop("model.norm.weight")
    save_file(tensors, ckpt / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"other.weight": norm}, ckpt / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (ckpt / "model.safetensors").unlink()
    weight_map = {n: "model-00001-of-00002.safetensors" for n in tensors} | {
        "model.norm.weight": "model-00002-of-00002.safetensors"
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    message = r"the index says tensor 'model.norm.weight' is in model-00002-of-00002.safetensors, but that file"
    with pytest.raises(ValueError, match=message):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


@pytest.mark.parametrize(
    "content, message",
    [
        (b"{not json", "is not valid JSON (Expecting property name"),
        (b"", "is not valid JSON (Expecting value: line 1 column 1"),
        (b'{"architectures": ["\xff\xfe"]}', "is not valid JSON ('utf-8' codec can't decode byte 0xff"),
        (b"[1, 2]", "holds a JSON array, not an object of the model's settings"),
        (b"null", "holds a JSON null, not an object of the model's settings"),
    ],
    ids=["not-json", "empty", "not-utf8", "array", "null"],
)
def test_a_malformed_config_json_is_named_in_one_line(ckpt, content, message):
    (ckpt / "config.json").write_bytes(content)
    for read in (lambda: load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0)), lambda: read_quant(ckpt)):
        with pytest.raises(ValueError) as error:
            read()
        assert str(error.value).startswith(f"{ckpt / 'config.json'} {message}") and "\n" not in str(error.value)
        assert str(error.value).endswith("; download the model's config.json again")


@pytest.mark.parametrize(
    "index", [b"[]", b'{"metadata": {}}', b'{"weight_map": ["a"]}', b'{"weight_map": {"x": 3}}', b"\xff"]
)
def test_a_malformed_safetensors_index_is_named_in_one_line(ckpt, index):
    (ckpt / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(ValueError) as error:
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))
    assert str(error.value).startswith(f"{ckpt / 'model.safetensors.index.json'} is not ") and "\n" not in str(
        error.value
    )
    assert str(error.value).endswith("; download the index again")


def test_a_safetensors_header_whose_offsets_overrun_the_file_is_named(ckpt):
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4  # one tensor claims 4 bytes more than its shape and the file hold
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    f.write_bytes(bytes(data[:8]) + text.ljust(n) + bytes(data[8 + n :]))
    with pytest.raises(ValueError, match=r"model.safetensors: cannot read the safetensors file .*download it again"):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


def test_save_checkpoint_roundtrips_through_transformers(base, tmp_path):
    params = load_checkpoint(base, Mesh.abstract({"tp": 1}, 0))
    out = load_checkpoint(save_checkpoint(params, tmp_path / "copy"), Mesh.abstract({"tp": 1}, 0))
    for (p, a), (_, b) in zip(flatten_with_paths(params), flatten_with_paths(out)):
        assert torch.equal(a, b), p
    hf = T.AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    ref = T.AutoModelForCausalLM.from_pretrained(base)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ref(ids).logits)


def test_a_mixed_dtype_checkpoint_loads_in_the_embeddings_dtype_and_matches_transformers(ckpt):
    down = "model.layers.0.mlp.down_proj.weight"
    _edit_tensors(ckpt, lambda t: t.update({down: t[down].half()}))  # one fp16 tensor among fp32 ones
    params = load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))
    assert {x.dtype for _, x in flatten_with_paths(params)} == {torch.float32}
    assert torch.equal(params["layers"][0]["down"], load_file(ckpt / "model.safetensors")[down].float())
    hf = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert greedy_generate(params, [[3, 1, 4, 1, 5]], 6, Mesh.abstract({"tp": 1}, 0)) == [
        hf_greedy(hf, [3, 1, 4, 1, 5], 6)
    ]
    assert load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0), dtype=torch.bfloat16)["norm"].dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [torch.int32, torch.bool])
def test_non_float_weights_are_refused_naming_the_tensor(ckpt, bad):
    name = "model.layers.1.self_attn.o_proj.weight"
    _edit_tensors(ckpt, lambda t: t.update({name: t[name].to(bad)}))
    with pytest.raises(
        ValueError, match=rf"tensor '{name}' \(for params\['layers.1.o_proj'\]\) is stored as (I32|BOOL), "
    ):
        load_checkpoint(ckpt, Mesh.abstract({"tp": 1}, 0))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_holds_only_its_shards_bytes(tmp_path, tp):
    """A row-parallel weight (o_proj, down: the input dim cut) is a column slice of the stored rows: the loaded
    shard owns just its bytes, not a view of every row it was read from (which held 2.1x the shard at tp 4)."""
    from functional_npu.core.mesh import Mesh
    from functional_npu.core.tree import flatten_with_paths
    from functional_npu.models import family_of
    from functional_npu.parallel.layer_shard import resident_bytes
    from functional_npu.runtime.loading.save import save_checkpoint

    from ..support.configs import DENSE

    save_checkpoint(family_of(DENSE).init_params(DENSE, seed=0), tmp_path)
    params = load_checkpoint(str(tmp_path), Mesh.abstract({"tp": tp}, tp - 1))
    leaves = params.tree
    assert resident_bytes(leaves) == sum(x.numel() * x.element_size() for _, x in flatten_with_paths(leaves))
