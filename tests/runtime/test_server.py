"""The OpenAI-compatible server, on 127.0.0.1, driven by the official ``openai`` client: completions (whole and
streamed) give each prompt's tokens run alone with ``generate``; a bad request is a 400 naming the field while others
are served; a client that disconnects mid-stream aborts its request (every block back in the pool); a failed engine
answers 503 on health and completions."""

from __future__ import annotations

import asyncio
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


@pytest.fixture(scope="module")
def server(model):
    """(base url, the engine loop): uvicorn on 127.0.0.1 at a free port, in a thread, stopped at the end."""
    loop = EngineLoop(Engine(model, blocks=40, block_size=4, chunk=8)).start()
    config = uvicorn.Config(completions_app(loop, "tiny"), host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", loop
    srv.should_exit = True
    thread.join(10)
    loop.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


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
