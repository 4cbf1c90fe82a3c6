"""The server's low-latency paths: chunk templates serialize exactly like the dicts they replace, a stream's last
token, usage and [DONE] leave in one write that ends the body, a long prompt is tokenized off the event loop like
a short one on it, and a client that leaves while its request is still queued never reaches the engine (the CPU
overhead benchmark, ``benchmarks/bench_server.py --fake-gpu``, is run by tests/benchmarks/test_bench_server.py)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pegainfer.engine.async_engine import AsyncEngine
from pegainfer.server import app as server_app
from pegainfer.server.app import ChunkTemplate, build_app, sse
from tests.server.conftest import idle, serve_engine, wait_until
from tests.server.fake_engine import FakeEngine


@pytest.mark.parametrize("text", ["", " x", 'say "hi"\\n', "tab\there\nnewline", "\x00\x1f\u2028", "你好 🦊", "é"])
def test_chunk_template_matches_the_dict(text):
    def chunk(t):
        return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": 'm"odel\\',
                "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": None}], "usage": None}
    assert ChunkTemplate(chunk).fill(text) == sse(chunk(text))


def run_asgi(app, body: dict) -> list[dict]:
    """One POST to the app, straight through ASGI; returns the messages it sent."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": body.pop("_path"), "raw_path": b"", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}

    async def main():
        sent, gone = [], asyncio.Event()
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
        await app(scope, receive, send)
        return sent
    return asyncio.run(main())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_last_token_usage_and_done_leave_in_one_write(model_folder, path):
    engine = FakeEngine(model_folder, reply="one two three")
    ae = AsyncEngine(engine).start()
    try:
        body = {"_path": path, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        body.update({"prompt": "Hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "Hi"}]})
        sent = run_asgi(build_app(ae), body)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        bodies = [m for m in sent[1:]]
        assert all(m["more_body"] for m in bodies[:-1]) and not bodies[-1]["more_body"]
        last = bodies[-1]["body"].decode().split("\n\n")
        events = [json.loads(e[6:]) for e in last if e.startswith("data: {")]
        assert last[-2] == "data: [DONE]"
        assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["choices"] == []
        finish = [c["finish_reason"] for e in events[:-1] for c in e["choices"]]
        assert finish[-1] == "length"   # the finishing chunk rides in the same write
        for m in bodies[:-1]:           # every earlier write is one event
            assert m["body"].decode().count("data: ") == 1
        wait_until(lambda: idle(ae))
    finally:
        ae.shutdown()


def test_a_long_prompt_is_tokenized_off_the_loop_with_the_same_result(model_folder, monkeypatch):
    off_loop = []
    real = server_app.run_in_threadpool

    async def spy(fn, *args):
        off_loop.append(fn)
        return await real(fn, *args)
    monkeypatch.setattr(server_app, "run_in_threadpool", spy)
    engine = FakeEngine(model_folder, max_model_len=4096)
    short = "Hello world! " * 3
    long = "Hello world! " * (server_app.INLINE_TEXT_CHARS // 13 + 5)
    assert len(short) <= server_app.INLINE_TEXT_CHARS < len(long)
    with serve_engine(engine) as (url, ae), httpx.Client(base_url=url, timeout=30) as http:
        for prompt, threads in ((short, 0), (long, 1)):
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(prompt, True))
            assert len(off_loop) == threads
        wait_until(lambda: idle(ae))


def test_a_client_that_leaves_before_its_request_is_accepted(model_folder):
    engine = FakeEngine(model_folder, max_batch=1, step_delay=0.005)   # A lasts ~1 s: still running at the pause
    with serve_engine(engine) as (url, ae), httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "A", "max_tokens": 200, "ignore_eos": True,
                                                          "stream": True}) as a:
            a_lines = a.iter_lines()   # keep the iterator: closing it would close A's response
            next(a_lines)
            engine.gate.clear()   # the engine pauses inside a step: new requests stay queued for its thread
            wait_until(engine.in_step.is_set)
            with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.3)) as other:
                with pytest.raises(httpx.ReadTimeout):
                    other.post("/v1/completions", json={"prompt": "B", "max_tokens": 5})
            wait_until(lambda: ae.stats()["pending"] == 1 and ae.stats()["streams"] == 1,  # A's only
                       what="B's stream to be dropped while its add is still queued")
            engine.gate.set()
        wait_until(lambda: idle(ae))
        assert len(engine.prompts) == 1   # B never reached the engine
