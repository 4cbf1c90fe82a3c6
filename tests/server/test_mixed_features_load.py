"""A bounded concurrent load over the real engine (hash model, 4 slots, few pages) that mixes every per-request
feature a client can ask for at once: n choices, penalties and logit bias, prompt logprobs (echo and vLLM's
field), a regex and a JSON schema to follow, seeds and greedy, clients that leave mid-stream.  Every request that
stays gets a well-formed answer, and the engine ends idle with every page back."""
from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import pytest

from pegainfer.engine.async_engine import AsyncEngine
from pegainfer.server.app import build_app
from tests.engine.hash_engine import hash_engine
from tests.server.conftest import serve_app, wait_until

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def body_for(k: int, rng: random.Random) -> tuple[dict, str]:
    prompt = [rng.randrange(3, 300) for _ in range(rng.randint(2, 30))]
    body = {"prompt": prompt, "max_tokens": rng.randint(2, 24), "seed": k, "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.8])}
    kind = ["n", "penalties", "echo", "prompt_logprobs", "regex", "json", "plain"][k % 7]
    if kind == "n":
        body["n"] = 3
    elif kind == "penalties":
        body.update(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={"5": 2.0})
    elif kind == "echo":
        body.update(echo=True, logprobs=1, max_tokens=1)
    elif kind == "prompt_logprobs":
        body["prompt_logprobs"] = 1
    elif kind == "regex":
        body.update(structured_outputs={"regex": "[ab]{1,6}"}, max_tokens=20, ignore_eos=False)
    elif kind == "json":
        body.update(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
                    max_tokens=30, ignore_eos=False)
    return body, kind


async def one(http: httpx.AsyncClient, k: int, rng: random.Random) -> str:
    body, kind = body_for(k, rng)
    leave = k % 5 == 4 and kind not in ("echo", "prompt_logprobs")
    if leave:                                   # a client that reads one event and goes away
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True, "max_tokens": 60}) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                break
        return "left"
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choices = out["choices"]
    assert len(choices) == body.get("n", 1) and [c["index"] for c in choices] == list(range(len(choices)))
    assert out["usage"]["completion_tokens"] >= len(choices)
    c = choices[0]
    if kind == "regex":
        assert c["finish_reason"] == "length" or re.fullmatch("[ab]{1,6}", c["text"]), c
    if kind == "json" and c["finish_reason"] == "stop":
        assert json.loads(c["text"]) in ({"ok": True}, {"ok": False})
    if kind == "echo":
        assert c["logprobs"]["token_logprobs"][0] is None and len(c["logprobs"]["tokens"]) == len(body["prompt"]) + 1
    if kind == "prompt_logprobs":
        assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == len(body["prompt"])
    return kind


def test_every_feature_at_once_under_a_bounded_load():
    engine = hash_engine(max_batch=4, max_model_len=96)
    ae = AsyncEngine(engine, max_waiting=64).start()
    assert ae.wait_ready(60)
    try:
        with serve_app(build_app(ae)) as url:
            async def run():
                rng = random.Random(0)
                async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                    return await asyncio.gather(*(one(http, k, rng) for k in range(21)))
            kinds = asyncio.run(run())
            assert kinds.count("left") == 3 and len(set(kinds)) == 8      # (k = 4, 14, 19: echo stays whole)
            wait_until(lambda: not engine.has_unfinished() and engine.stats()["kv_pages_used"] == 0, timeout=120,
                       what="the engine idle with every page back")
    finally:
        ae.shutdown()
