"""An exception inside the engine thread: every request in flight (running, waiting in the engine, or still queued
to the thread) gets a 500 with the OpenAI error body — streamed ones an SSE error event, then ``[DONE]`` — ``/health``
turns 503, later requests get 503 at once, the traceback is logged once, and no client hangs."""
from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import pytest

from pegainfer.engine.async_engine import AsyncEngine, EngineNotReadyError, EngineStepError
from pegainfer.engine.types import SamplingParams
from tests.server.conftest import serve_engine, wait_until
from tests.server.fake_engine import FakeEngine
from tests.server.metrics_text import scrape, value
from tests.server.test_errors import check_error

COMPLETION = {"model": "fake-model", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True}
TIMEOUT = httpx.Timeout(20)   # a hang fails the test instead of blocking it


def tracebacks(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info and r.name == "pegainfer.engine"]


def check_out_of_service(http: httpx.Client) -> None:
    """/health is 503 naming the failure; new requests get 503 at once, streamed or not."""
    r = http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "failed", r.text
    assert "injected step failure" in r.json()["error"] and "restart the server" in r.json()["error"]
    check_error(http.post("/v1/completions", json=COMPLETION), 503, code="model_not_ready", says="injected")
    check_error(http.post("/v1/completions", json={**COMPLETION, "stream": True}), 503, code="model_not_ready")


def test_a_failed_step_answers_500_then_the_server_is_out_of_service(model_folder, caplog):
    engine = FakeEngine(model_folder)
    with caplog.at_level(logging.INFO), serve_engine(engine) as (url, ae), \
            httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        assert http.get("/health").status_code == 200
        engine.fail_next_step = True
        check_error(http.post("/v1/completions", json=COMPLETION), 500, code="engine_error",
                    says="injected step failure")
        check_out_of_service(http)
        m = scrape(http)
        assert value(m, "vllm:request_success_total", finished_reason="error") == 1
        assert value(m, "vllm:num_requests_running") == 0
    [record] = tracebacks(caplog)   # logged once, with the traceback
    assert "injected step failure" in caplog.text and "Traceback" in caplog.text
    assert "failing 1 request(s) in flight" in record.getMessage()


def test_the_requests_a_failure_ends_count_under_the_served_model_name(model_folder):
    """The 500s of an engine failure are counted in ``vllm:request_success_total{finished_reason="error"}`` of the
    model that was served, beside its earlier requests, and its gauges keep that name."""
    engine = FakeEngine(model_folder)
    with serve_engine(engine) as (url, ae), httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        assert http.post("/v1/completions", json={**COMPLETION, "max_tokens": 2}).status_code == 200
        engine.fail_next_step = True
        check_error(http.post("/v1/completions", json=COMPLETION), 500, code="engine_error")
        m = scrape(http)
    name = {"model_name": "fake-model"}
    assert value(m, "vllm:request_success_total", finished_reason="length", **name) == 1
    assert value(m, "vllm:request_success_total", finished_reason="error", **name) == 1
    assert value(m, "vllm:num_requests_running", **name) == 0


def test_a_failed_step_ends_a_stream_with_an_error_event_then_done(model_folder, caplog):
    engine = FakeEngine(model_folder, step_delay=0.005)   # 40 tokens: the stream is still running when it fails
    with caplog.at_level(logging.INFO), serve_engine(engine) as (url, ae), \
            httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if not line:
                    continue
                if not events:
                    engine.fail_next_step = True   # after the first token
                events.append(line)
        assert events[-1] == "data: [DONE]"
        assert '"code":"engine_error"' in events[-2] and "injected step failure" in events[-2], events[-3:]
        assert any('"text"' in e for e in events[:-2])   # tokens went out before the failure
        check_out_of_service(http)
    assert len(tracebacks(caplog)) == 1


def test_every_request_in_flight_fails_running_waiting_and_queued(model_folder, caplog):
    """max_batch 1, the engine run one step at a time: request 0 is admitted and running, 1 and 2 wait in the
    engine for a place in the batch, 3 and 4 are still queued to the engine thread; when the next step raises, all
    five get the 500 — none hangs."""
    engine = FakeEngine(model_folder, max_batch=1)
    step = engine.step

    def one_step_then_hold():
        outputs = step()
        engine.gate.clear()
        return outputs

    engine.step = one_step_then_hold
    with caplog.at_level(logging.INFO), serve_engine(engine) as (url, ae):
        engine.gate.clear()
        results: dict[int, httpx.Response] = {}

        def post(i: int) -> None:
            with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
                results[i] = c.post("/v1/completions", json=COMPLETION)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(5)]
        threads[0].start()
        wait_until(engine.in_step.is_set, what="the step that will admit request 0")
        for t in threads[1:3]:
            t.start()
        wait_until(lambda: ae.stats()["pending"] == 2, what="requests 1 and 2 queued to the engine thread")
        engine.gate.set()
        wait_until(lambda: ae.stats()["running"] == 1 and ae.stats()["waiting"] == 2 and engine.in_step.is_set(),
                   what="request 0 running, 1 and 2 waiting in the engine, the next step held")
        for t in threads[3:]:
            t.start()
        wait_until(lambda: ae.stats()["pending"] == 2 and ae.stats()["streams"] == 5,
                   what="requests 3 and 4 queued to the engine thread")
        assert list(engine.generated.values()) == [1]   # request 0 ran one step; the others never ran
        engine.fail_next_step = True
        engine.gate.set()
        for t in threads:
            t.join(30)
        assert sorted(results) == [0, 1, 2, 3, 4]
        for r in results.values():
            check_error(r, 500, code="engine_error", says="injected step failure")
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            check_out_of_service(http)
            assert value(scrape(http), "vllm:request_success_total", finished_reason="error") == 5
    [record] = tracebacks(caplog)
    assert "failing 5 request(s) in flight" in record.getMessage()


def test_a_failure_between_steps_is_handled_like_a_failed_step(model_folder, caplog):
    """Not only step(): any call into the engine on its thread (here stats()) that raises fails the requests and
    takes the engine out of service."""
    engine = FakeEngine(model_folder, max_batch=1, step_delay=0.002)   # the stream cannot end before stats fails
    ae = AsyncEngine(engine).start()
    try:
        async def main():
            stream = await ae.add("a", [5, 6], SamplingParams(max_tokens=100_000, ignore_eos=True))
            await stream.__anext__()
            engine.stats = lambda: 1 / 0
            with pytest.raises(EngineStepError, match="ZeroDivisionError"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineNotReadyError, match="ZeroDivisionError"):
                await ae.add("b", [5], SamplingParams())

        with caplog.at_level(logging.INFO):
            asyncio.run(asyncio.wait_for(main(), 20))
        assert ae.state == "failed" and isinstance(ae.load_error, EngineStepError)
        assert ae.stats()["running"] == 0 and ae.stats()["streams"] == 0
        assert len(tracebacks(caplog)) == 1
    finally:
        ae.shutdown()
