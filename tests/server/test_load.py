"""A bounded concurrent load against the fake engine's server: 28 requests at once — streamed and whole, completions
and chat, random lengths, some cut off by their client mid-stream, some malformed.  Every good request succeeds,
every bad one is a 4xx with an error body, ``/metrics`` counts exactly what was sent, and the engine ends idle
with no pages in use."""
from __future__ import annotations

import asyncio
import json
import random

import httpx

from tests.server.conftest import idle, serve_engine, wait_until
from tests.server.fake_engine import FakeEngine
from tests.server.metrics_text import scrape, value

N_GOOD_STREAMED, N_GOOD_WHOLE, N_ABORTED, N_BAD = 16, 4, 4, 4
MAX_MODEL_LEN = 256
REPLY, REPLY_TOKENS = "x " * 15, 30   # every token carries text, so each SSE chunk holds at least one token


def bad_requests() -> list[tuple[str, dict | str, int]]:
    """(route, body, expected status): malformed bodies and values out of range."""
    return [("/v1/completions", {"prompt": [5, 6], "max_tokens": -1}, 400),
            ("/v1/completions", "{not json", 400),
            ("/v1/completions", {"prompt": [7] * MAX_MODEL_LEN, "max_tokens": 4}, 400),   # longer than the context
            ("/v1/chat/completions", {"model": "other-model", "messages": [{"role": "user", "content": "x"}]}, 404)]


async def read_events(response: httpx.Response) -> list[dict]:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


async def good(http: httpx.AsyncClient, rng: random.Random, stream: bool, chat: bool) -> dict:
    """One request that must succeed; returns what it sent and got (prompt tokens, completion tokens, finish)."""
    prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
    max_tokens, ignore_eos = rng.randint(1, 60), rng.random() < 0.5
    body = {"max_tokens": max_tokens, "ignore_eos": ignore_eos, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": " ".join(map(str, prompt))}]
        route = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        route = "/v1/completions"
    if stream:
        body["stream_options"] = {"include_usage": True}
        async with http.stream("POST", route, json=body) as r:
            assert r.status_code == 200, await r.aread()
            events = await read_events(r)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events[-3:]
        usage = events[-2]["usage"]
        finish = [c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["finish_reason"]]
        assert len(finish) == 1, events
        finish = finish[0]
    else:
        r = await http.post(route, json=body)
        assert r.status_code == 200, r.text
        usage, finish = r.json()["usage"], r.json()["choices"][0]["finish_reason"]
    if not chat:
        assert usage["prompt_tokens"] == len(prompt)
    if ignore_eos or max_tokens <= REPLY_TOKENS:
        assert finish == "length" and usage["completion_tokens"] == max_tokens, (finish, usage)
    else:   # the reply and its EOS fit
        assert finish == "stop" and usage["completion_tokens"] == REPLY_TOKENS + 1, (finish, usage)
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "finish": finish}


async def aborted(http: httpx.AsyncClient, rng: random.Random) -> dict:
    """A stream its client leaves after a few tokens; returns its prompt and the tokens the client saw."""
    prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
    leave_after = rng.randint(1, 4)
    seen = 0
    async with http.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 200, "ignore_eos": True,
                                                            "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == leave_after:
                    break
    return {"prompt": prompt, "seen": seen}


async def bad(http: httpx.AsyncClient, route: str, body, status: int) -> None:
    if isinstance(body, str):
        r = await http.post(route, content=body, headers={"content-type": "application/json"})
    else:
        r = await http.post(route, json=body)
    assert r.status_code == status, r.text
    assert 400 <= r.status_code < 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_concurrent_mixed_load(model_folder):
    engine = FakeEngine(model_folder, reply=REPLY, max_model_len=MAX_MODEL_LEN, max_batch=8, step_delay=0.002)
    assert len(engine.tokenizer.encode(REPLY)) == REPLY_TOKENS
    rng = random.Random(32)
    with serve_engine(engine, max_waiting=64) as (url, ae):
        async def main():
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
                jobs = ([good(http, rng, True, i % 3 == 0) for i in range(N_GOOD_STREAMED)]
                        + [good(http, rng, False, i % 2 == 0) for i in range(N_GOOD_WHOLE)]
                        + [aborted(http, rng) for _ in range(N_ABORTED)]
                        + [bad(http, *case) for case in bad_requests()])
                rng.shuffle(jobs)
                return await asyncio.gather(*jobs)

        results = asyncio.run(main())
        wait_until(lambda: idle(ae), what="the engine to be idle")
        with httpx.Client(base_url=url, timeout=30) as http:
            m = scrape(http)
    goods = [r for r in results if r and "finish" in r]
    cut = [r for r in results if r and "seen" in r]
    assert len(goods) == N_GOOD_STREAMED + N_GOOD_WHOLE and len(cut) == N_ABORTED
    assert engine.max_running_seen == 8           # the load really ran concurrently (the batch filled)
    assert sorted(engine.aborted) == sorted(rid for rid, r in engine.finished.items() if r == "abort")
    assert len(engine.aborted) == N_ABORTED

    name = {"model_name": "fake-model"}
    success = lambda reason: value(m, "vllm:request_success_total", finished_reason=reason, **name)  # noqa: E731
    finishes = [g["finish"] for g in goods]
    assert "stop" in finishes and "length" in finishes   # the load ended requests both ways
    assert success("length") == finishes.count("length") and success("stop") == finishes.count("stop")
    assert success("abort") == N_ABORTED and success("error") == 0
    assert value(m, "vllm:prompt_tokens_total", **name) == \
        sum(g["prompt_tokens"] for g in goods) + sum(len(c["prompt"]) for c in cut)
    aborted_generated = value(m, "vllm:generation_tokens_total", **name) - sum(g["completion_tokens"] for g in goods)
    made = sum(engine.generated[rid] for rid in engine.aborted)
    assert sum(c["seen"] for c in cut) <= aborted_generated <= made   # seen by the server: between the two
    assert value(m, "vllm:e2e_request_latency_seconds_count", **name) == len(goods)
    assert value(m, "vllm:num_requests_running", **name) == value(m, "vllm:num_requests_waiting", **name) == 0
    assert value(m, "pegainfer:kv_pages_used", **name) == 0
