"""DCP checkpoints as FSDP2 users save them: a tiny transformers model wrapped with ``fully_shard`` on 2 gloo
ranks, ``state_dict()`` of DTensors written by ``torch.distributed.checkpoint``, loaded into this library's tp
plan (each rank reading only its slices) and generating transformers' tokens; a damaged directory named."""

import re
import shutil
from pathlib import Path

import pytest
import torch

from functional_npu import Mesh, Plan, flatten_with_paths
from functional_npu.runtime.loading.checkpoint import load_checkpoint

from ..support.dcp_workers import save_fsdp2_dcp, save_ids
from ..support.hf_models import hf_greedy, save_tiny
from ..support.workers import llama_generate

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]
NEW = 8


@pytest.fixture(scope="module")
def saved(world2, tmp_path_factory):
    """(DCP directory written under FSDP2 on 2 ranks, transformers' greedy tokens for the same weights)."""
    path = tmp_path_factory.mktemp("dcp")
    world2.run(save_fsdp2_dcp, "qwen3", str(path), 11)
    hf = save_tiny("qwen3", tmp_path_factory.mktemp("hf"), 11)  # the same seed: the same weights
    return path, [hf_greedy(hf, p, NEW) for p in PROMPTS]


def test_fsdp2_dcp_loads_into_the_tp_plan_reading_only_each_ranks_slices(world2, saved):
    path, want = saved
    for rank, (_, tokens, read, _) in enumerate(world2.run(llama_generate, str(path), 2, PROMPTS, NEW, False)):
        assert tokens == want
        local = load_checkpoint(path, Mesh.abstract({"dp": 1, "tp": 2}, rank))
        assert read == sum(x.numel() * x.element_size() for _, x in flatten_with_paths(local))


def test_a_dcp_directory_missing_a_ranks_file_is_named(saved, tmp_path):
    damaged = tmp_path / "dcp"
    shutil.copytree(saved[0], damaged)
    (damaged / "__1_0.distcp").unlink()
    with pytest.raises(FileNotFoundError, match=r"\.metadata names files that are missing: __1_0\.distcp"):
        load_checkpoint(damaged, Mesh.abstract({"tp": 1}, 0))


def test_a_dcp_box_reads_only_the_chunks_it_overlaps(saved):
    from functional_npu.runtime.loading.dcp import DcpHandle

    read: list[int] = []
    handle = DcpHandle(saved[0], on_bytes=lambda _, n: read.append(n))
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 96], FSDP2 chunks: rows 0-31 and 32-63
    t = handle.get_slice(name)
    top = t[(slice(0, 16), slice(0, 96))]
    assert len(read) == 1 and top.shape == (16, 96)
    full = t[(slice(0, 64), slice(0, 96))]
    assert len(read) == 3 and torch.equal(full[:16], top)


def test_fsdp2_state_reshards_straight_to_the_tp_plan(world2, saved, tmp_path):
    """FSDP2's DTensors (rows over dp_shard) to the tp plan ([q|k|v] column blocks, o_proj / down columns), and to
    a layer-sharded plan, each in one planned exchange: transformers' tokens, and each rank receives exactly the
    lower bound (bytes counted at the collectives; the bytes of the loader's slices of the rank that its FSDP2 shards
    do not hold, worked out on a copy of the model whose elements are their ids)."""
    from ..support.dcp_workers import fsdp2_to_tp_generate

    ids = save_ids("qwen3", str(tmp_path))
    for rank, out in enumerate(world2.run(fsdp2_to_tp_generate, "qwen3", 11, PROMPTS, NEW, ids)):
        tokens, counted, need = out["tp"]
        assert tokens == saved[1]
        assert counted == need > 0, (rank, counted, need)
        # layer-sharded over dp 2: each rank receives only its layers of o_proj and down, and broadcasts them
        tokens, counted, need, owned = out["layer_sharded"]
        assert tokens == saved[1] and owned == {"o_proj": 1, "down": 1}
        assert counted == need > 0, (rank, counted, need)


def test_fsdp2_tp_and_hsdp_states_reshard_to_tp_and_dp_tp_plans(world4, saved, tmp_path):
    """FSDP2 + TP (strided shards on the column-parallel weights) and HSDP states on 4 ranks, each to ``tp 4`` and
    to ``dp 2 x tp 2`` in one planned exchange: transformers' tokens, each rank receiving exactly the lower bound."""
    from ..support.dcp_workers import trained_meshes_to_tp_generate

    ids = save_ids("qwen3", str(tmp_path))
    for rank, out in enumerate(world4.run(trained_meshes_to_tp_generate, "qwen3", 11, PROMPTS, NEW, ids)):
        assert sorted({k[0] for k in out}) == ["fsdp2+tp", "hsdp"]
        for (training, serving), (tokens, counted, need, kinds) in out.items():
            where = (rank, training, serving)
            assert tokens == saved[1], where
            assert counted == need > 0, (where, counted, need)
            assert "_StridedShard" in kinds if training == "fsdp2+tp" else "Replicate" in kinds, (where, kinds)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fsdp2_moe_states_reshard_to_tp_and_ep_plans(world2, family, tmp_path):
    """Stacked experts: transformers' fused ``[E, gate|up, D]`` tensors, and one DTensor per expert, each to the
    tp plan (experts replicated, tp inside) and to experts over tp: transformers' tokens, the lower bound."""
    from ..support.dcp_workers import moe_states_to_plans
    from ..support.hf_models import save_tiny_moe

    hf = save_tiny_moe(family, tmp_path, 5)
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    ids = save_ids(family, str(tmp_path / "ids"))
    for out in world2.run(moe_states_to_plans, family, 5, PROMPTS, NEW, str(tmp_path), ids):
        assert sorted(out) == [("fused", "ep"), ("fused", "tp"), ("per_expert", "ep"), ("per_expert", "tp")]
        for where, (tokens, counted, need) in out.items():
            assert tokens == want, where
            assert counted == need > 0, (where, counted, need)


def test_a_dcp_of_fused_experts_loads_into_experts_over_tp(world2, tmp_path):
    """An FSDP2 MoE model's DCP holds transformers' fused expert tensors (``mlp.experts.gate_up_proj``); loaded at
    tp 2 with the experts over tp, each rank reads only its experts and generates transformers' tokens."""
    from ..support.hf_models import save_tiny_moe
    from ..support.workers import moe_generate

    dcp_dir = tmp_path / "dcp"
    world2.run(save_fsdp2_dcp, "qwen3_moe", str(dcp_dir), 5)
    hf = save_tiny_moe("qwen3_moe", tmp_path / "hf", 5)
    from functional_npu.runtime.loading.dcp import DcpHandle

    assert "model.layers.0.mlp.experts.gate_up_proj" in DcpHandle(dcp_dir).keys()
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    runs = world2.run(moe_generate, str(dcp_dir), {"tp": 2}, ("tp",), PROMPTS, NEW, False)
    for rank, (_, _, tokens, read, _) in enumerate(runs):
        assert tokens == want
        local = load_checkpoint(dcp_dir, Mesh.abstract({"tp": 2}, rank), Plan(expert_axes=("tp",)))
        stored = [x for p, x in flatten_with_paths(local) if not p.endswith("expert_map")]  # computed, not read
        assert read == sum(x.numel() * x.element_size() for x in stored)


# ---- a damaged directory: one line naming the file, its bytes and the fix -------------------------------------------
@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A DCP directory written by one process (no process group): a tiny llama's tensors and its config.json."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from ..support.hf_models import save_tiny

    hf = tmp_path_factory.mktemp("hf")
    save_tiny("llama3", hf, 3)
    path = tmp_path_factory.mktemp("dcp1")
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(load_file(hf / "model.safetensors"), checkpoint_id=str(path), no_dist=True)
    shutil.copy(hf / "config.json", path / "config.json")
    return path


def _damaged(single, tmp_path, file: str, edit) -> Path:
    damaged = shutil.copytree(single, tmp_path / "dcp")
    data = (damaged / file).read_bytes()
    (damaged / file).write_bytes(edit(data))
    return damaged


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: b[: len(b) // 2], r"holds \d+ bytes but \.metadata places the chunk of '.*' at bytes \d+\.\.\d+"),
        (
            lambda b: b"",
            r"holds 0 bytes but \.metadata places the chunk of 'model\.embed_tokens\.weight' at bytes 0\.\.",
        ),
        (lambda b: bytes(range(256)) * (len(b) // 256) + b"\0" * (len(b) % 256), r"is not a saved tensor \(\w+\)"),
    ],
    ids=["truncated", "empty", "garbage"],
)
def test_a_damaged_distcp_file_is_named_in_one_line(single, tmp_path, edit, message):
    damaged = _damaged(single, tmp_path, "__0_0.distcp", edit)
    with pytest.raises(ValueError) as error:
        load_checkpoint(damaged, Mesh.abstract({"tp": 1}, 0))
    assert re.search(rf"^{re.escape(str(damaged / '__0_0.distcp'))} .*{message}", _one_line(error))
    assert "copy __0_0.distcp again from where the checkpoint was saved" in str(error.value)


@pytest.mark.parametrize(
    "edit",
    [lambda b: b"", lambda b: b[: len(b) // 2], lambda b: bytes(reversed(b))],
    ids=["empty", "truncated", "garbage"],
)
def test_a_damaged_metadata_file_is_named_in_one_line(single, tmp_path, edit):
    damaged = _damaged(single, tmp_path, ".metadata", edit)
    with pytest.raises(ValueError) as error:
        load_checkpoint(damaged, Mesh.abstract({"tp": 1}, 0))
    assert _one_line(error).startswith(f"{damaged}/.metadata cannot be read as a DCP checkpoint (")
    assert str(error.value).endswith(
        "copy .metadata again from where the checkpoint was saved (or save the checkpoint again)"
    )


def test_a_chunk_holding_another_tensor_than_metadata_says_is_named(tmp_path):
    """The bytes unpickle, but to a tensor of another shape than ``.metadata`` gives the chunk (two checkpoints'
    files mixed up): named with both, never read into the wrong place."""
    import torch.distributed.checkpoint as dcp

    from functional_npu.runtime.loading.dcp import DcpHandle

    for name, shape in [("a", (4, 6)), ("b", (6, 4))]:
        with pytest.warns(UserWarning, match="single process"):
            dcp.save({"w": torch.zeros(shape)}, checkpoint_id=str(tmp_path / name), no_dist=True)
    assert (tmp_path / "a" / "__0_0.distcp").stat().st_size == (tmp_path / "b" / "__0_0.distcp").stat().st_size
    shutil.copy(tmp_path / "b" / "__0_0.distcp", tmp_path / "a" / "__0_0.distcp")
    with pytest.raises(ValueError) as error:
        DcpHandle(tmp_path / "a").get_slice("w")[(slice(0, 4),)]
    assert "holds torch.float32 (6, 4) but .metadata says torch.float32 (4, 6)" in _one_line(error)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process groups are read from /proc (Linux)")
def test_the_cli_names_a_truncated_distcp_file_in_one_line(single, tmp_path):
    """``generate`` on a DCP directory whose rank file was cut short: exit 1, one line naming the file and its
    sizes, no traceback, and no process of the run left behind."""
    from ..support.cli import run_in_own_group

    damaged = _damaged(single, tmp_path, "__0_0.distcp", lambda b: b[:1000])
    code, stderr, left = run_in_own_group(
        ["generate", "--model", str(damaged), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--backend", "none"],
        timeout=120,
    )
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in stderr, stderr
    assert len(errors) == 1 and f"{damaged / '__0_0.distcp'} holds 1000 bytes but .metadata places" in errors[0]
    assert left == []
