"""Client disconnects cancel their requests at once (asserted on the engine's own accounting), a client that
does not read never stalls the others, and concurrent streaming clients all get their own, correct outputs."""
from __future__ import annotations

import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import idle, serve_engine, wait_until
from tests.server.fake_engine import FakeEngine
from tests.server.metrics_text import scrape, value

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


class WideTextEngine(FakeEngine):
    """A FakeEngine whose every token comes out with 64 KiB of text."""

    def _append(self, req, token):
        out = super()._append(req, token)
        out.delta_text += "x" * 65536
        return out


def finished_at_the_server(http: httpx.Client) -> float:
    """Requests the server has finished answering (``/metrics``; none yet: no series)."""
    return value(scrape(http), "vllm:request_success_total", finished_reason="length", default=0.0)


def test_a_client_that_does_not_read_never_stalls_the_others(model_folder):
    """A stream of 24 MiB — six times the most a loopback socket's send buffer holds (``tcp_wmem``), with the
    reader's receive buffer fixed at 64 KiB — whose client reads nothing: the engine finishes it, the server's send
    to that client stays blocked, and other requests are still answered at once.  Once it reads, the slow client
    gets its whole stream."""
    send_buffer_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    n_tokens = 384
    assert n_tokens * 65536 >= 6 * send_buffer_max
    engine = WideTextEngine(model_folder, max_model_len=1024)
    small_receive_buffer = httpx.HTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)])
    with serve_engine(engine) as (url, ae), httpx.Client(base_url=url, timeout=30, transport=small_receive_buffer) \
            as http:
        body = {"model": "fake-model", "prompt": "slow reader", "max_tokens": n_tokens, "ignore_eos": True,
                "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            wait_until(lambda: engine.finished, what="the unread stream to be generated")
            [(rid, finish)] = engine.finished.items()
            assert finish == "length" and engine.generated[rid] == n_tokens
            assert finished_at_the_server(http) == 0   # its outputs are still waiting for the server to send them
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=5)
            t0 = time.monotonic()
            for _ in range(3):
                out = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=3)
                assert out.usage.completion_tokens == 3
            assert time.monotonic() - t0 < 5
            assert finished_at_the_server(http) == 3   # the three others; the unread stream is still being sent
            received = b"".join(r.iter_bytes())
        assert received.count(b"x" * 65536) == n_tokens and received.endswith(b"data: [DONE]\n\n")
        wait_until(lambda: finished_at_the_server(http) == 4)
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
