"""``GET /metrics``: vLLM's names, the engine's gauges and counters as ``Engine.stats()`` reports them, and token
counters, finished requests and latency histograms that match what was sent; open without the API key; one
registry per app."""
from __future__ import annotations

import threading

import httpx
import pytest

from pegainfer.engine.async_engine import AsyncEngine
from pegainfer.server.app import build_app
from pegainfer.server.metrics import FINISHED_REASONS, finished_reason
from tests.server.conftest import idle, serve_app, serve_engine, wait_until
from tests.server.fake_engine import FakeEngine
from tests.server.metrics_text import present, scrape, value
from tests.server.test_errors import check_error


class StatsEngine(FakeEngine):
    """A FakeEngine that reports every key of ``Engine.stats()``, page pool and prefix cache included."""

    def stats(self) -> dict:
        return {**super().stats(), "kv_pages_total": 100, "num_preemptions": 3, "prefix_cache_queries": 50,
                "prefix_cache_hits": 20, "cuda_graphs": 41, "eager_mixed_steps": 7,
                "cuda_graph_capture_seconds": 2.5, "gc_pause_seconds": 0.75, "gc_full_collections": 4,
                "gc_longest_pause_seconds": 0.125, "prefix_state_snapshots": 6}


def test_engine_gauges_and_counters_come_from_stats(model_folder):
    engine = StatsEngine(model_folder, max_batch=2, step_delay=0.005)
    with serve_engine(engine, served_model_name="m") as (url, ae), httpx.Client(base_url=url, timeout=30) as http:
        body = {"prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True}
        done = []
        threads = [threading.Thread(target=lambda: done.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                          timeout=30))) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: ae.stats()["running"] == 2 and ae.stats()["waiting"] == 1, what="two running, one waiting")
        engine.gate.clear()        # hold the engine in its next step: the stats stay still while they are checked
        wait_until(engine.in_step.is_set)
        m = scrape(http)
        used = engine.stats()["kv_pages_used"]
        assert used > 0 and ae.stats()["running"] == 2
        assert value(m, "vllm:num_requests_running", model_name="m") == 2
        assert value(m, "vllm:num_requests_waiting", model_name="m") == 1
        assert value(m, "pegainfer:kv_pages_used", model_name="m") == used
        assert value(m, "pegainfer:kv_pages_total", model_name="m") == 100
        assert value(m, "vllm:kv_cache_usage_perc", model_name="m") == used / 100
        assert value(m, "vllm:num_preemptions_total", model_name="m") == 3
        assert value(m, "vllm:prefix_cache_queries_total", model_name="m") == 50
        assert value(m, "vllm:prefix_cache_hits_total", model_name="m") == 20
        assert value(m, "pegainfer:cuda_graphs", model_name="m") == 41
        assert value(m, "pegainfer:prefix_state_snapshots", model_name="m") == 6
        assert value(m, "pegainfer:eager_mixed_steps_total", model_name="m") == 7
        assert value(m, "pegainfer:cuda_graph_capture_seconds_total", model_name="m") == 2.5
        assert value(m, "pegainfer:gc_pause_seconds_total", model_name="m") == 0.75
        assert value(m, "pegainfer:gc_full_collections_total", model_name="m") == 4
        assert value(m, "pegainfer:gc_longest_pause_seconds", model_name="m") == 0.125
        assert value(m, "process_resident_memory_bytes") > 0
        engine.gate.set()
        for t in threads:
            t.join(30)
        assert [r.status_code for r in done] == [200] * 3
        wait_until(lambda: idle(ae))
        m = scrape(http)
        assert value(m, "vllm:num_requests_running") == value(m, "pegainfer:kv_pages_used") == 0
        assert value(m, "vllm:kv_cache_usage_perc") == 0
        assert value(m, "vllm:request_success_total", finished_reason="length", model_name="m") == 3


def test_the_request_series_exist_at_0_before_the_first_request(fake_server):
    """As in vLLM: a fresh server exports its token counters and every ``finished_reason`` at 0 (a series that
    appears at 1 hides that first request from ``increase()`` and ``rate()``)."""
    url, ae, engine = fake_server
    with httpx.Client(base_url=url, timeout=30) as http:
        m = scrape(http)
    name = {"model_name": "fake-model"}
    assert value(m, "vllm:prompt_tokens_total", **name) == value(m, "vllm:generation_tokens_total", **name) == 0
    for reason in FINISHED_REASONS:
        assert value(m, "vllm:request_success_total", finished_reason=reason, **name) == 0


def test_counters_and_histograms_match_what_was_sent(fake_server):
    url, ae, engine = fake_server
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
        assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 200})
        chat_usage = chat.json()["usage"]
        assert chat.json()["choices"][0]["finish_reason"] == "stop"
        engine.step_delay = 0.05     # 200 tokens take 10 s: the abort lands long before, even on a busy machine
        with http.stream("POST", "/v1/completions", json={"prompt": [8, 9], "max_tokens": 200, "ignore_eos": True,
                                                          "stream": True}) as s:
            for line in s.iter_lines():
                if '"text"' in line:
                    break    # leave after the first token: the request is aborted
        # back to full speed only once the engine has the abort (else, on a busy machine, the request could finish)
        wait_until(lambda: any(engine.prompts.get(rid) == [8, 9] for rid in engine.aborted),
                   what="the abort reached the engine")
        engine.step_delay = 0.0
        check_error(http.post("/v1/completions", json={"prompt": [5], "max_tokens": -1}), 400)   # never counted
        wait_until(lambda: idle(ae))
        m = scrape(http)
    name = {"model_name": "fake-model"}
    assert value(m, "vllm:request_success_total", finished_reason="length", **name) == 1
    assert value(m, "vllm:request_success_total", finished_reason="stop", **name) == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort", **name) == 1
    assert value(m, "vllm:request_success_total", finished_reason="error", **name) == 0
    assert value(m, "vllm:prompt_tokens_total", **name) == 3 + chat_usage["prompt_tokens"] + 2
    aborted_tokens = value(m, "vllm:generation_tokens_total", **name) - 4 - chat_usage["completion_tokens"]
    [aborted] = [rid for rid, prompt in engine.prompts.items() if prompt == [8, 9]]
    assert engine.finished[aborted] == "abort"
    assert 1 <= aborted_tokens <= engine.generated[aborted]   # what the server saw of it, at most what was made
    assert value(m, "vllm:time_to_first_token_seconds_count", **name) == 3     # every request got a first token
    assert value(m, "vllm:e2e_request_latency_seconds_count", **name) == 2     # stop and length only
    assert value(m, "vllm:request_time_per_output_token_seconds_count", **name) == 2
    ttft_sum = value(m, "vllm:time_to_first_token_seconds_sum", **name)
    assert 0 < ttft_sum < value(m, "vllm:e2e_request_latency_seconds_sum", **name) + 5
    assert value(m, "vllm:e2e_request_latency_seconds_bucket", le="+Inf", **name) == 2
    # the phases of the two requests that ended (stop, length): they add up to e2e, queue + prefill to TTFT
    phases = {p: value(m, f"vllm:request_{p}_time_seconds_sum", **name) for p in ("queue", "prefill", "decode",
                                                                                   "inference")}
    assert all(value(m, f"vllm:request_{p}_time_seconds_count", **name) == 2 for p in phases)
    assert phases["inference"] == pytest.approx(phases["prefill"] + phases["decode"], abs=1e-6)
    ended_e2e = value(m, "vllm:e2e_request_latency_seconds_sum", **name)
    assert phases["queue"] + phases["inference"] == pytest.approx(ended_e2e, abs=1e-6)
    assert value(m, "vllm:request_prompt_tokens_sum", **name) == 3 + chat_usage["prompt_tokens"]
    assert value(m, "vllm:request_generation_tokens_sum", **name) == 4 + chat_usage["completion_tokens"]
    assert value(m, "vllm:request_generation_tokens_bucket", le="5.0", **name) == 1       # the 4-token one


def test_metrics_needs_no_api_key_and_each_app_has_its_own_registry(model_folder):
    engines = [FakeEngine(model_folder), FakeEngine(model_folder)]
    aes = [AsyncEngine(e).start() for e in engines]
    try:
        assert all(ae.wait_ready(30) for ae in aes)
        apps = [build_app(aes[0], "one", api_key="secret"), build_app(aes[1], "two")]
        with serve_app(apps[0]) as url0, serve_app(apps[1]) as url1, \
                httpx.Client(base_url=url0, timeout=30) as a, httpx.Client(base_url=url1, timeout=30) as b:
            check_error(a.get("/v1/models"), 401)
            ok = a.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                        headers={"Authorization": "Bearer secret"})
            assert ok.status_code == 200
            assert b.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200
            ma, mb = scrape(a), scrape(b)     # no key needed
            assert value(ma, "vllm:prompt_tokens_total", model_name="one") == 2   # each app counts its own
            assert value(mb, "vllm:prompt_tokens_total", model_name="two") == 3
            assert not present(ma, "vllm:prompt_tokens_total", model_name="two")
            assert not present(mb, "vllm:prompt_tokens_total", model_name="one")
            assert value(mb, "vllm:num_requests_running", model_name="two") == 0
    finally:
        for ae in aes:
            ae.shutdown()


def test_finished_reason_labels():
    assert [finished_reason(f) for f in ("stop", "tool_calls", "length", "cancelled", "error:503", "error:500")] == \
        ["stop", "stop", "length", "abort", "abort", "error"]
