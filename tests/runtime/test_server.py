"""The OpenAI-compatible server, on 127.0.0.1, driven by the official ``openai`` client: completions (whole and
streamed) give each prompt's tokens run alone with ``generate``; a bad request is a 400 naming the field while others
are served; a client that disconnects mid-stream aborts its request (every block back in the pool); a failed engine
answers 503 on health and completions."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import openai
import pytest
import uvicorn

try:  # the openai client's own HTTP stack (httpx2 from openai 3, httpx before)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

from functional_npu import Mesh, compile_model, load_checkpoint
from functional_npu.runtime.serving import Engine
from functional_npu.runtime.serving.server import EngineLoop, completions_app

from ..support.hf_models import save_tiny

ONE = Mesh.abstract({"tp": 1}, 0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-qwen3")
    save_tiny("qwen3", path, 11, num_hidden_layers=2)
    params = load_checkpoint(str(path), ONE)
    shapes = dict(batch_sizes=[1, 2, 4], max_seq_len=48, prefill_lengths=[8, 16, 32])
    return compile_model(params, ONE, backend="none", **shapes)


@contextlib.contextmanager
def _serving(model, tokenizer=None):
    """(base url, the engine loop): uvicorn on 127.0.0.1 at a free port, in a thread, stopped at the end."""
    loop = EngineLoop(Engine(model, blocks=40, block_size=4, chunk=8)).start()
    config = uvicorn.Config(completions_app(loop, "tiny", tokenizer), host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = srv.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", loop
    finally:
        srv.should_exit = True
        thread.join(10)
        loop.stop()


@pytest.fixture(scope="module")
def server(model):
    with _serving(model) as got:
        yield got


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer of the ``tokenizers`` package over the model's 128 ids: id ``i`` is the word ``w{i}``,
    words joined by spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture(scope="module")
def text_server(model, tokenizer):
    with _serving(model, tokenizer) as got:
        yield got


def test_completions_are_each_prompts_alone_tokens(client, model):
    prompts = [[5, 6, 7], list(range(1, 20))]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0, logprobs=0)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, prompt in zip(out.choices, prompts):
        assert choice.model_extra["token_ids"] == model.generate([prompt], 6)[0]
        assert choice.finish_reason == "length" and len(choice.logprobs.token_logprobs) == 6
    assert out.usage.prompt_tokens == 22 and out.usage.completion_tokens == 12


def test_a_streamed_completion_arrives_token_by_token(client, model):
    chunks = list(client.completions.create(model="tiny", prompt=[9, 8, 7], max_tokens=5, temperature=0, stream=True))
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == model.generate([[9, 8, 7]], 5)[0]
    assert len(chunks) == 5 and chunks[-1].choices[0].finish_reason == "length"


def test_a_bad_request_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match=r"request 'cmpl-\d+': 40 prompt tokens \+ 20 new exceed"):
        client.completions.create(model="tiny", prompt=list(range(40)), max_tokens=20)
    with pytest.raises(openai.BadRequestError, match=r"temperature must be 0 \(greedy\)"):
        client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"prompt: this checkpoint has no tokenizer"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"stop: this checkpoint has no tokenizer to turn tokens into"):
        client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, stop=["w1"])
    assert client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, temperature=0).choices


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server):
    url, loop = server
    body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    deadline = time.monotonic() + 30
    while loop.engine.has_work() or loop.engine.pool.used:
        assert time.monotonic() < deadline, "the aborted request still holds blocks"
        time.sleep(0.02)
    assert loop.engine.pool.used == 0


def test_health_answers_503_once_the_engine_fails(model):
    loop = EngineLoop(Engine(model, blocks=40, block_size=4, chunk=8))
    loop.failed = "the engine stopped: RuntimeError: rank 1 is gone"
    app = completions_app(loop, "tiny")

    async def ask() -> tuple:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as http:
            health = await http.get("/health")
            response = await http.post("/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 1})
            return health, response

    health, response = asyncio.run(ask())
    assert health.status_code == 503
    assert response.status_code == 503 and "rank 1 is gone" in response.json()["error"]["message"]


def _stopped(tokenizer, tokens: list[int], stop: str) -> tuple[str, list[int]]:
    """The reference, counted apart from the server's matcher: the whole text decoded at once, cut before the stop
    string's first place, and the fewest tokens whose text holds it."""
    full = tokenizer.decode(tokens)
    kept = next(n for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n]))
    return full[: full.find(stop)], tokens[:kept]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_before_it_and_frees_the_request(text_server, tokenizer, model, stream):
    url, loop = text_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    prompt, new = [5, 6, 7], 16
    tokens = model.generate([prompt], new)[0]
    full = tokenizer.decode(tokens)
    start = len(tokenizer.decode(tokens[:3])) + 2  # from inside the fourth word, across the space after it
    stop = full[start : start + 4]
    want_text, want_tokens = _stopped(tokenizer, tokens, stop)
    assert len(want_tokens) < new  # the stop string ends it early
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=new, temperature=0, stop=[stop],
                                    stream=stream)  # fmt: skip
    choices = [c.choices[0] for c in out] if stream else out.choices
    assert "".join(c.text for c in choices) == want_text and stop not in want_text
    assert [t for c in choices for t in c.model_extra["token_ids"]] == want_tokens
    assert choices[-1].finish_reason == "stop"
    deadline = time.monotonic() + 30
    while loop.engine.has_work() or loop.engine.pool.used:
        assert time.monotonic() < deadline, "the stopped request still holds blocks"
        time.sleep(0.02)


def test_without_a_match_the_whole_text_arrives(text_server, tokenizer, model):
    client = openai.OpenAI(base_url=text_server[0] + "/v1", api_key="none", max_retries=0, timeout=60)
    tokens = model.generate([[9, 8, 7]], 6)[0]
    chunks = list(client.completions.create(model="tiny", prompt=[9, 8, 7], max_tokens=6, temperature=0,
                                            stop=["no such text"], stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(tokens)
    assert chunks[-1].choices[0].finish_reason == "length"
