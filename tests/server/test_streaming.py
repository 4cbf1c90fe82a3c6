"""Client disconnects cancel their requests at once (asserted on the engine's own accounting), a client that
does not read never stalls the others, and concurrent streaming clients all get their own, correct outputs."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import idle, serve_engine, wait_until
from tests.server.fake_engine import FakeEngine

LONG = {"model": "fake-model", "max_tokens": 200, "ignore_eos": True}  # ~200 steps: far longer than the test


def first_event(lines) -> dict:
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("no event")


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {**LONG, "prompt": "Once upon a time", "stream": True}),
    ("/v1/chat/completions", {**LONG, "messages": [{"role": "user", "content": "Hi"}], "stream": True}),
])
def test_disconnect_mid_stream_cancels_the_request(model_folder, route, body):
    engine = FakeEngine(model_folder, step_delay=0.01)
    with serve_engine(engine) as (url, ae):
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", route, json=body) as r:
                lines = r.iter_lines()
                rid = first_event(lines)["id"]
                first_event(lines)
                wait_until(lambda: ae.stats()["running"] == 1 and ae.stats()["kv_pages_used"] > 0)
            # leaving the block closed the connection mid-stream
        wait_until(lambda: idle(ae), what="the cancelled request to free its slot and pages")
        assert engine.aborted == [rid] and engine.finished[rid] == "abort"
        assert engine.generated[rid] < 200
        steps_after_cancel = ae.stats()["steps"]
        # nothing is left running: the engine went back to sleep
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/health").status_code == 200
        assert ae.stats()["steps"] == steps_after_cancel


def test_disconnect_of_a_non_streamed_request(model_folder):
    engine = FakeEngine(model_folder, step_delay=0.01)
    with serve_engine(engine) as (url, ae):
        with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.3)) as http:
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
                http.post("/v1/completions", json={**LONG, "prompt": "Hi"})
        wait_until(lambda: idle(ae), what="the abandoned request to be cancelled")
        (rid,) = engine.aborted
        assert engine.finished[rid] == "abort" and engine.generated[rid] < 200


def test_disconnect_while_waiting_in_the_queue(model_folder):
    engine = FakeEngine(model_folder, max_batch=1, step_delay=0.01)
    with serve_engine(engine) as (url, ae), httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "prompt": "A", "stream": True}) as a:
            a_lines = a.iter_lines()  # keep the iterator: closing it would close A's response
            a_id = first_event(a_lines)["id"]
            with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.5)) as other:
                with pytest.raises(httpx.ReadTimeout):  # B waits behind A (max_batch 1) and its client gives up
                    with other.stream("POST", "/v1/completions", json={**LONG, "prompt": "B", "stream": True}) as b:
                        b_lines = b.iter_lines()
                        first_event(b_lines)
            wait_until(lambda: len(engine.aborted) == 1 and ae.stats()["waiting"] == 0, what="B to be dropped")
            (b_id,) = engine.aborted
            assert engine.generated.get(b_id, 0) == 0  # B never ran
            assert ae.stats()["running"] == 1          # A still does
        wait_until(lambda: idle(ae))
        assert set(engine.aborted) == {a_id, b_id}


def test_a_client_that_does_not_read_never_stalls_the_others(model_folder):
    engine = FakeEngine(model_folder, step_delay=0.002)
    with serve_engine(engine) as (url, ae), httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "prompt": "slow reader", "stream": True}) as r:
            # r is never read while others are served
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            for _ in range(3):
                out = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=3)
                assert out.usage.completion_tokens == 3
            assert r.status_code == 200
        wait_until(lambda: idle(ae))


def test_concurrent_streaming_clients(model_folder):
    def reply(prompt):  # each client gets its own answer: "Reply to client 3, with 🦊 and done."
        number = re.search(r"client number (\d+)", prompt).group(1)
        return f"Reply to client {number}, with 🦊 and done."

    engine = FakeEngine(model_folder, reply=reply, max_batch=3, step_delay=0.002)
    with serve_engine(engine) as (url, ae):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)

        def run(i):
            prompt = f"client number {i}"
            if i % 2:
                stream = client.completions.create(model="fake-model", prompt=prompt, max_tokens=100, stream=True,
                                                   stream_options={"include_usage": True})
                chunks = list(stream)
                text = "".join(c.choices[0].text for c in chunks if c.choices)
            else:
                stream = client.chat.completions.create(model="fake-model", max_tokens=100, stream=True,
                                                        messages=[{"role": "user", "content": prompt}],
                                                        stream_options={"include_usage": True})
                chunks = list(stream)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return i, text, chunks[-1].usage

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(run, range(8)))
        tok = engine.tokenizer
        for i, text, usage in results:
            (rid,) = [r for r, ids in engine.prompts.items() if re.search(rf"client number {i}\b", tok.decode(ids))]
            expected = f"Reply to client {i}, with 🦊 and done."
            assert text == expected
            assert usage.completion_tokens == len(tok.encode(expected)) + 1  # + EOS
            assert usage.prompt_tokens == len(engine.prompts[rid])
        assert engine.max_running_seen == 3  # they really ran side by side
        wait_until(lambda: idle(ae))
