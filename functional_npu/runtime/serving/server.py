"""An OpenAI-compatible completions server over an :class:`~.engine.Engine`, on Starlette and uvicorn.

- ``POST /v1/completions``: ``prompt`` as token ids (a list of ints, or a list of such lists) or, with a tokenizer,
  text; ``max_tokens`` (default 16), ``temperature`` (default 1), ``top_p``, ``seed``, ``logprobs`` (the sampled
  token's log-probability: any value >= 0 asks for it), ``stop_token_ids`` (default: the checkpoint's stop ids),
  ``stop`` (a string or up to 4, with a tokenizer: the text ends right before the first that appears, which it never
  contains, :mod:`.stop_text`; the request then ends with ``finish_reason`` ``"stop"``, its tokens those up to the
  one that completed the match), ``stream`` (server-sent events, ``data: [DONE]`` last). Each choice holds ``text``
  (decoded with the tokenizer, else empty) and ``token_ids``. One choice per prompt (``n`` must be 1).
- ``GET /health``: 200 while the engine runs, 503 once a step has failed (every request then answers 503).

When the ranks serving together are gone (one died and the world stopped them all), :func:`serve_unavailable` takes
the port and answers every request 503 with the reason until it is stopped: a client or a load balancer hears why,
and nothing waits on ranks that are gone.

The engine runs in one thread of its own (:class:`EngineLoop`), stepping while it has work; requests reach it
through a queue and their events come back to each request's asyncio queue. A client that disconnects mid-stream
aborts its request (its blocks go back to the pool). A bad request is a 400 naming the field; the others go on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from .engine import Engine, Event, Request, check_request
from .stop_text import StopText, check_stop_strings

__all__ = ["EngineLoop", "completions_app", "serve", "unavailable_app", "serve_unavailable"]


@dataclass
class EngineLoop:
    """The engine's thread: ``submit`` queues a request and returns its id and the asyncio queue its events arrive
    on; ``abort`` ends one; ``failed`` holds the error that stopped the loop (None while it runs)."""

    engine: Engine
    idle_s: float = 0.01
    keepalive_s: float = 5.0  # a lockstep engine's other ranks hear from rank 0 at least this often
    failed: str | None = None
    _inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue, repr=False)
    _subscribers: dict = field(default_factory=dict, repr=False)
    _ids: Any = field(default_factory=itertools.count, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> EngineLoop:
        self._thread = threading.Thread(target=self._run, name="functional-npu-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request) -> tuple[Hashable, asyncio.Queue]:
        """Queue ``request`` (checked first: a ValueError / TypeError naming it, nothing queued)."""
        if self.failed is not None:
            raise RuntimeError(self.failed)
        id = f"cmpl-{next(self._ids)}"
        check_request(request, self.engine.model, id)
        events: asyncio.Queue = asyncio.Queue()
        self._subscribers[id] = (asyncio.get_running_loop(), events)
        self._inbox.put(("add", id, request))
        return id, events

    def abort(self, id: Hashable) -> None:
        self._inbox.put(("abort", id, None))

    def _deliver(self, event: Event) -> None:
        found = self._subscribers.get(event.id)
        if found is None:
            return
        loop, events = found
        loop.call_soon_threadsafe(events.put_nowait, event)
        if event.finished is not None:
            self._subscribers.pop(event.id, None)

    def _run(self) -> None:
        heard = time.monotonic()
        try:
            while not self._stop.is_set():
                self._take_inbox(block=not self.engine.has_work())
                if self.engine.has_work():
                    for event in self.engine.step():
                        self._deliver(event)
                    heard = time.monotonic()
                elif time.monotonic() - heard > self.keepalive_s:
                    self.engine.keepalive()
                    heard = time.monotonic()
        except Exception as e:  # noqa: BLE001 - a failed step ends every request with its reason, and the health
            self.failed = f"the engine stopped: {type(e).__name__}: {e}"
            for id in list(self._subscribers):
                self._deliver(Event(id, finished="error", error=self.failed))

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            op, id, request = item
            if op == "add":
                self.engine.add(request, id)
            elif (event := self.engine.abort(id)) is not None:
                self._deliver(event)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _prompts(body: dict, tokenizer: Any) -> list[tuple[int, ...]]:
    """The request's prompts as token ids; a ValueError naming the field."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        if tokenizer is None:
            raise ValueError("prompt: this checkpoint has no tokenizer; send token ids (a list of ints)")
        texts = [prompt] if isinstance(prompt, str) else prompt
        return [tuple(getattr(ids, "ids", ids)) for ids in map(tokenizer.encode, texts)]  # tokenizers' or a list
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [tuple(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt):
        return [tuple(p) for p in prompt]
    raise ValueError("prompt: give token ids (a list of ints, or a list of such lists) or text")


def _request(body: dict, prompt: tuple[int, ...]) -> Request:
    if body.get("n", 1) != 1:
        raise ValueError("n: one choice per prompt (n = 1)")
    logprobs = body.get("logprobs")
    stop = body.get("stop_token_ids")
    return Request(
        prompt,
        max_new_tokens=body.get("max_tokens", 16),
        stop=tuple(stop) if isinstance(stop, list) else stop,
        temperature=body.get("temperature", 1.0),
        top_p=body.get("top_p"),
        seed=body.get("seed"),
        logprobs=logprobs is not None and logprobs is not False,
    )


def _stop_texts(body: dict, tokenizer: Any, n: int) -> list[StopText | None]:
    """Per prompt, the text its stop strings are matched in (None each where the request has none)."""
    stops = check_stop_strings(body.get("stop"), tokenizer is not None)
    return [StopText(tokenizer.decode, stops) if stops else None for _ in range(n)]


def _choice(
    index: int, tokens: list[int], logprobs: list[float] | None, finished: str | None, tok: Any, text: str | None = None
) -> dict:
    """One choice; ``text`` where the stop strings' matcher made it, else the tokens decoded."""
    if text is None:
        text = tok.decode(tokens) if tok is not None and tokens else ""
    out = {"index": index, "text": text, "token_ids": tokens, "finish_reason": finished, "logprobs": None}
    if logprobs is not None:
        out["logprobs"] = {"tokens": [str(t) for t in tokens], "token_logprobs": logprobs, "top_logprobs": None,
                           "text_offset": []}  # fmt: skip
    return out


def completions_app(loop: EngineLoop, model_name: str, tokenizer: Any = None) -> Any:
    """The Starlette app serving ``loop``'s engine as ``model_name`` (see the module docstring)."""
    from starlette.applications import Starlette
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def health(_: HttpRequest) -> Any:
        if loop.failed is not None:
            return _error(503, loop.failed, "unavailable")
        return JSONResponse({"status": "ok"})

    async def completions(http: HttpRequest) -> Any:
        if loop.failed is not None:
            return _error(503, loop.failed, "unavailable")
        try:
            body = json.loads(await http.body())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            reqs = [_request(body, p) for p in _prompts(body, tokenizer)]
            texts = _stop_texts(body, tokenizer, len(reqs))
            subs = [loop.submit(r) for r in reqs]  # each checked; a refused one queues none of the others
        except (TypeError, ValueError) as e:
            return _error(400, str(e))
        head = {"object": "text_completion", "created": int(time.time()), "model": model_name}
        if body.get("stream"):
            stream = _stream(loop, subs, head, reqs, tokenizer, texts)
            return StreamingResponse(stream, media_type="text/event-stream")
        results = await asyncio.gather(
            *(_collect(events, t, lambda id=id: loop.abort(id)) for (id, events), t in zip(subs, texts))
        )
        choices = [_choice(i, r[0], r[1], r[2], tokenizer, r[4]) for i, r in enumerate(results)]
        if any(c["finish_reason"] == "error" for c in choices):
            return _error(503, next(r[3] for r in results if r[3]), "unavailable")
        used = sum(len(r.prompt) for r in reqs)
        new = sum(len(c["token_ids"]) for c in choices)
        usage = {"prompt_tokens": used, "completion_tokens": new, "total_tokens": used + new}
        return JSONResponse({"id": subs[0][0], **head, "choices": choices, "usage": usage})

    return Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])


def _stopped(
    text: StopText | None, event: Event, abort: Callable[[], None]
) -> tuple[list[int], list[float], str | None, str | None]:
    """``event``'s tokens, log-probs, finish reason and released text under its request's stop strings (``text``;
    None: it has none, and no text is made here). A stop string that matches cuts them at the token that completed it
    and ends the request with ``"stop"`` (``abort``: the engine frees its blocks, unless it had ended anyway); an end
    releases the text held back."""
    tokens, logprobs, finished = list(event.tokens), list(event.logprobs), event.finished
    if text is None:
        return tokens, logprobs, finished, None
    released, kept = text.feed(tokens)
    if kept is not None:
        if finished is None:
            abort()
        return tokens[:kept], logprobs[:kept], "stop", released
    if finished is not None:
        released += text.finish()
    return tokens, logprobs, finished, released


async def _collect(
    events: asyncio.Queue, text: StopText | None, abort: Any
) -> tuple[list[int], list[float] | None, str | None, str | None, str | None]:
    """(tokens, log-probs, finish reason, error, text: the stop strings' matcher's, None without stop strings). A
    stop string that matches ends the request there (``abort``: the engine frees its blocks)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    while True:
        event: Event = await events.get()
        new, new_logprobs, finished, _ = _stopped(text, event, abort)
        tokens += new
        logprobs += new_logprobs
        if finished is not None:
            return tokens, logprobs or None, finished, event.error, text.text if text is not None else None


async def _stream(
    loop: EngineLoop, subs: list, head: dict, reqs: list[Request], tokenizer: Any, texts: list[StopText | None]
) -> AsyncIterator[str]:
    """Server-sent events, one per event of any of the request's prompts; a disconnect aborts what is unfinished. A
    prompt whose stop string matches ends there (its request aborted), and its later events are dropped."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, events: asyncio.Queue) -> None:
        while True:
            event = await events.get()
            await merged.put((index, event))
            if event.finished is not None:
                return

    tasks = [asyncio.ensure_future(pump(i, events)) for i, (_, events) in enumerate(subs)]
    open_ = set(range(len(subs)))
    try:
        while open_:
            index, event = await merged.get()
            if index not in open_:
                continue  # after its stop string matched: the abort's event, or tokens already made
            tokens, logprobs, finished, text = _stopped(texts[index], event, lambda: loop.abort(subs[index][0]))
            choice = _choice(index, tokens, logprobs if reqs[index].logprobs else None, finished, tokenizer, text)
            yield f"data: {json.dumps({'id': subs[index][0], **head, 'choices': [choice]})}\n\n"
            if finished is not None:
                open_.discard(index)
        yield "data: [DONE]\n\n"
    finally:
        for index in open_:  # the client went away mid-stream: its requests end, their blocks go back
            loop.abort(subs[index][0])
        for task in tasks:
            task.cancel()


def serve(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    tokenizer: Any = None,
    keepalive_s: float = 5.0,
) -> None:
    """Serve ``engine`` until interrupted (uvicorn on ``host:port``); a lockstep engine's other ranks hear from rank 0
    at least every ``keepalive_s`` seconds."""
    import uvicorn

    loop = EngineLoop(engine, keepalive_s=keepalive_s).start()
    try:
        uvicorn.run(completions_app(loop, model_name, tokenizer), host=host, port=port, log_level="warning")
    finally:
        loop.stop()
        if loop.failed is None:
            engine.close()  # a lockstep engine's other ranks return from follow()


def unavailable_app(reason: str) -> Any:
    """A Starlette app that answers every request 503 with ``reason`` (the server's ranks are gone)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    async def unavailable(_: Any) -> Any:
        return _error(503, reason, "unavailable")

    return Starlette(
        routes=[Route("/health", unavailable), Route("/v1/completions", unavailable, methods=["POST", "GET"])]
    )


def serve_unavailable(reason: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Answer 503 with ``reason`` on ``host:port`` until interrupted."""
    import uvicorn

    uvicorn.run(unavailable_app(reason), host=host, port=port, log_level="warning")
