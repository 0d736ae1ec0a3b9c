"""``python -m functional_npu serve`` as a user runs it: a fresh process on 127.0.0.1, the official ``openai`` client
sending text (the checkpoint's tokenizer) and token ids, the checkpoint's eos id stopping a request, SIGTERM ending the
server; bad flags refused in one line before anything loads."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from ..support.cli import refused
from ..support.hf_models import save_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("serve-qwen2")
    save_tiny("qwen2", path, 3)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_the_openai_client_and_stops_on_sigterm(model):
    from functional_npu import Mesh, compile_model, load_checkpoint

    one = Mesh.abstract({"tp": 1}, 0)
    ref = compile_model(load_checkpoint(str(model), one), one, backend="none", max_seq_len=64, prefill_lengths=[16])
    want = ref.generate([[5, 6, 7]], 6)[0]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": want[2]}))  # stops after 3 tokens
    port = _free_port()
    argv = ["serve", "--model", str(model), "--port", str(port), "--backend", "none", "--max-seq-len", "64",
            "--chunk", "16", "--blocks", "40", "--block-size", "8"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "functional_npu", *argv], stdout=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 120
        while True:
            try:
                out = client.completions.create(model="m", prompt="w5 w6 w7", max_tokens=6, temperature=0)
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == want[:3] and choice.finish_reason == "stop"
        assert choice.text.split() == [f"w{i}" for i in want[:3]]
        ids = client.completions.create(
            model="m", prompt=[5, 6, 7], max_tokens=6, temperature=0, extra_body={"stop_token_ids": []}
        )
        assert ids.choices[0].model_extra["token_ids"] == want  # stop_token_ids=[]: none
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, 143, -signal.SIGTERM)
    assert "serving" in proc.stdout.read()


def test_bad_serve_flags_are_refused_in_one_line(model, capsys):
    refused(["serve", "--model", "/nonexistent"], "--model /nonexistent: no config.json there", capsys)
    refused(["serve", "--model", str(model), "--blocks", "0"], "argument --blocks: expected a positive integer", capsys)
    refused(["serve", "--model", str(model), "--chunk", "128", "--max-seq-len", "64"], "--chunk 128 exceeds", capsys)
    refused(["serve", "--model", str(model), "--backend", "none", "--max-seq-len", "64", "--chunk", "16", "--blocks",
             "3"], "cannot hold one sequence of max_seq_len 64", capsys)  # fmt: skip
    refused(["serve", "--model", str(model), "--layer-shard", "o_proj"], "--layer-shard o_proj: the series are spread "
            "over the --dp ranks; pass --dp 2 or more", capsys)  # fmt: skip
    refused(["serve", "--model", str(model), "--dp", "2", "--layer-shard", "bogus"], "bogus", capsys)
    refused(["serve", "--model", str(model), "--tp", "3"], "cannot shard this", capsys)
    refused(["serve", "--model", str(model), "--prefetch-step", "1"], "--prefetch-step needs --layer-shard", capsys)
    refused(["serve", "--model", str(model), "--dp", "0"], "argument --dp: expected a positive integer", capsys)


@pytest.mark.parametrize(
    "flags, ranks",
    [(["--tp", "2"], "2 rank(s);"), (["--dp", "2", "--layer-shard", "o_proj,down_proj"], "2 rank(s), 2 replicas;")],
    ids=["tp2", "dp2-replicas-layer-shard"],
)
def test_serve_on_two_ranks_in_lockstep_and_no_process_outlives_it(model, flags, ranks):
    """--tp 2: rank 0 serves, rank 1 follows its calls; --dp 2 with o_proj and down layer-sharded over the dp ranks:
    two replicas, each serving requests of its own. The tokens are the one-rank model's; an idle spell longer than
    the ranks' timeout (rank 1 waiting for the next call) is kept alive by rank 0; a SIGTERM to the command ends every
    process of its group."""
    from functional_npu import Mesh, compile_model, load_checkpoint

    one = Mesh.abstract({"tp": 1}, 0)
    ref = compile_model(load_checkpoint(str(model), one), one, backend="none", max_seq_len=64, prefill_lengths=[16])
    port = _free_port()
    argv = ["serve", "--model", str(model), "--port", str(port), "--backend", "none", "--max-seq-len", "64",
            "--chunk", "16", "--blocks", "40", "--block-size", "8", *flags, "--timeout", "4"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "functional_npu", *argv], start_new_session=True, text=True,
                            stdout=subprocess.PIPE)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 180
        while True:
            try:
                out = client.completions.create(model="m", prompt=[[5, 6, 7], [9, 10, 11, 12]], max_tokens=5,
                                                temperature=0, extra_body={"stop_token_ids": []})  # fmt: skip
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.3)
        got = [c.model_extra["token_ids"] for c in out.choices]
        assert got == [ref.generate([p], 5)[0] for p in ([5, 6, 7], [9, 10, 11, 12])]
        time.sleep(6)  # idle past the ranks' 4 s timeout
        again = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=5, temperature=0,
                                          extra_body={"stop_token_ids": []})  # fmt: skip
        assert again.choices[0].model_extra["token_ids"] == got[0]
    finally:
        _stop_and_reap(proc)
    assert ranks in proc.stdout.read()


def test_a_rank_that_dies_ends_every_rank_and_the_port_answers_503(model):
    """--tp 2 with a 4 s timeout: one rank SIGKILLed mid-serve; every rank ends, the command says why in one line
    and the port answers 503 with the reason (the openai client gets an error, not a hang) until a SIGTERM ends
    it, leaving no process."""
    from ..support.cli import live_in_group

    port = _free_port()
    argv = ["serve", "--model", str(model), "--port", str(port), "--backend", "none", "--max-seq-len", "64",
            "--chunk", "16", "--blocks", "40", "--block-size", "8", "--tp", "2", "--timeout", "4"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "functional_npu", *argv], start_new_session=True, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
    ask = dict(model="m", prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_body={"stop_token_ids": []})
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                client.completions.create(**ask)
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.3)
        ranks = [p for p in live_in_group(proc.pid) if p != proc.pid and b"spawn_main" in _cmdline(p)]
        assert len(ranks) == 2
        os.kill(ranks[-1], signal.SIGKILL)
        deadline, seen = time.monotonic() + 60, set()
        while "the server's ranks are gone" not in seen:  # rank 0's engine fails on the dead peer (503), then the
            try:  # world stops rank 0 too, and the command takes the port back (503 again, with the reason)
                client.completions.create(**ask)
                seen.add("a completion")
            except openai.InternalServerError as e:
                assert e.status_code == 503, e
                seen.add("the server's ranks are gone" if "the server's ranks are gone" in str(e) else "the engine")
            except openai.APIConnectionError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, f"no 503 from the command, saw {seen}"
            time.sleep(0.3)
        assert "a completion" not in seen
    finally:
        _stop_and_reap(proc)
    err = proc.stderr.read()
    assert "error: " in err and "answering 503" in err


def _stop_and_reap(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group leader, then wait until no process of its group lives (30 s at most)."""
    from ..support.cli import live_in_group

    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while live_in_group(proc.pid):
        assert time.monotonic() < deadline, f"processes outlived the server: {live_in_group(proc.pid)}"
        time.sleep(0.2)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
