"""The real ``Engine`` (its scheduler and page pool, over the hash model in the simulator) behind the server: after
requests finish, are cut off by their client mid-stream, or leave before their answer, no KV page and no slot stays
in use — as the engine counts them and as ``/metrics`` reports them."""
from __future__ import annotations

import threading

import httpx
import pytest

from tests.engine.hash_engine import hash_engine
from tests.server.conftest import serve_engine, wait_until
from tests.server.metrics_text import scrape, value


def pages_and_slots(ae) -> tuple[int, int, int]:
    s = ae.stats()
    return s["kv_pages_used"], s["slots_used"], s["running"] + s["waiting"] + s["pending"]


def held(engine) -> threading.Event:
    """Make ``engine.step`` wait for the returned event (set: run freely), so a test can keep a request unfinished
    until its client has gone."""
    gate = threading.Event()
    gate.set()
    step = engine.step
    engine.step = lambda: (gate.wait(), step())[1]
    return gate


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_no_page_stays_in_use_after_requests_end_or_are_aborted(prefix_caching):
    engine = hash_engine(max_batch=2, max_model_len=128, prefix_caching=prefix_caching)
    gate = held(engine)
    with serve_engine(engine) as (url, ae), httpx.Client(base_url=url, timeout=120) as http:
        total = value(scrape(http), "pegainfer:kv_pages_total")
        assert total > 0 and pages_and_slots(ae) == (0, 0, 0)

        # a whole answer (twice: the second finds the first's full pages in the prefix cache), and a stream read to
        # its end
        for _ in range(2):
            r = http.post("/v1/completions", json={"prompt": list(range(3, 40)), "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with http.stream("POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True,
                                                          "stream": True}) as s:
            assert s.status_code == 200 and list(s.iter_lines())[-2] == "data: [DONE]"

        # a stream its client leaves after the first token, while the engine holds its pages
        with http.stream("POST", "/v1/completions", json={"prompt": list(range(3, 40)), "max_tokens": 80,
                                                          "ignore_eos": True, "stream": True}) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    gate.clear()
                    assert pages_and_slots(ae)[0] > 0
                    break
        wait_until(lambda: ae.stats()["streams"] == 0, what="the server to see the client go")
        gate.set()

        # a non-streamed request whose client gives up (disconnects) before the answer
        gate.clear()
        try:
            httpx.post(f"{url}/v1/completions", json={"prompt": [9] * 30, "max_tokens": 80, "ignore_eos": True},
                       timeout=0.5)
            raise AssertionError("the request should have timed out")
        except httpx.TimeoutException:
            pass
        wait_until(lambda: ae.stats()["streams"] == 0, what="the server to see the client go")
        gate.set()

        wait_until(lambda: pages_and_slots(ae) == (0, 0, 0), timeout=120, what="every page and slot to be free")
        m = scrape(http)
        assert value(m, "pegainfer:kv_pages_used") == 0 and value(m, "vllm:kv_cache_usage_perc") == 0
        assert value(m, "vllm:request_success_total", finished_reason="abort") == 2
        assert value(m, "vllm:request_success_total", finished_reason="length") == 3
        hits = value(m, "vllm:prefix_cache_hits_total")
        assert (hits > 0) == prefix_caching and value(m, "vllm:prefix_cache_queries_total") >= hits
