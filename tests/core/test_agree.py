"""One rank refuses, every rank refuses: when one rank's input differs (its state dict lacks a tensor, holds an
integer or a differently typed one, its files are damaged, its Megatron chunk lacks a weight), every rank raises the
same one-line error at once, before any exchange, instead of one raising and the others waiting in the exchange until
the process group's timeout. Real gloo ranks, with deadlines; the ranks are gone from /proc afterwards."""

import shutil
import time
from pathlib import Path

import pytest

from functional_npu.runtime.launch import LocalWorld

from ..support.agree_workers import O_PROJ, mixed_dtypes_generate, one_rank_differs
from ..support.hf_models import save_tiny

HANG_GUARD_S = 30  # a hang guard, not a speed claim: the process group's timeout below is 60 s


@pytest.fixture(scope="module")
def world():
    """Two ranks whose collectives would wait 60 s for a missing peer (LocalWorld's default is 120)."""
    with LocalWorld(2, timeout=90, pg_timeout=60) as w:
        yield w


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        text = stat.read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def test_a_stray_bf16_tensor_among_fp32_is_read_in_one_dtype(world):
    for default, bf16 in (out.values() for out in world.run(mixed_dtypes_generate, 4)):
        assert default[0] == ["torch.float32"] and bf16[0] == ["torch.bfloat16"]
        assert len(default[1][0]) == len(bf16[1][0]) == 4


def test_one_ranks_refusal_is_every_ranks_at_once(world, tmp_path):  # last: it stops the world
    save_tiny("qwen3", tmp_path / "model", 0)
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "model", damaged)
    first = sorted(damaged.glob("model-*.safetensors"))[0]
    first.unlink()
    results = world.run(one_rank_differs, str(tmp_path / "model"), str(damaged))
    pids = [pid for _, pid in results]
    want = {
        "lm_head missing on rank 0": (
            "ValueError",
            "rank 0: from_dtensor_state: the state does not match this "
            "Qwen3ForCausalLM config: missing ['lm_head.weight'], unknown []",
        ),
        "o_proj int64 on rank 1": (
            "ValueError",
            f"rank 1: from_dtensor_state: {O_PROJ!r} (for "
            "params['layers.1.o_proj']) is torch.int64, but weights are floating point",
        ),
        "bf16 on rank 1": (
            "ValueError",
            "the ranks disagree on the params' dtype (the embedding's unless dtype= is given): 'lm_head.weight' is "
            "torch.bfloat16 on rank 1 but torch.float32 on rank 0; give every rank the same input",
        ),
        "rank 0's files damaged": ("FileNotFoundError", f"rank 0: {first} is named by the index but does not exist"),
        "megatron output_layer missing on rank 0": (
            "ValueError",
            "rank 0: from_megatron: 'lm_head' needs 1 local "
            "entries on rank 0 {'pp': 0, 'tp': 0} but the state dicts hold 0",
        ),
    }
    for case, (kind, start) in want.items():
        got = [out[case] for out, _ in results]
        assert got[0][:2] == got[1][:2], (case, got)  # the same error on every rank
        assert got[0][0] == kind and got[0][1].startswith(start), (case, got[0])
        assert got[0][1].endswith("every rank stopped before the exchange") and "\n" not in got[0][1], got[0]
        assert max(seconds for _, _, seconds in got) < HANG_GUARD_S, (case, got)
    world.close()
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)), pids
