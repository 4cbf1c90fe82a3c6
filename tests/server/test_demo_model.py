"""The server over the real engine and the built-in demo model (a random-weight tiny Qwen3; in CI every kernel
runs in the simulator, so each test generates only a couple of tokens).  Greedy outputs through HTTP must equal the
engine's own greedy outputs, a disconnect must give the request's pages and slot back (the engine's accounting),
and concurrent clients must each get their own output."""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from pegainfer.engine.async_engine import AsyncEngine
from pegainfer.engine.types import SamplingParams
from pegainfer.server.app import build_app
from tests.server.conftest import serve_app, wait_until

PROMPTS = ("The quick brown fox", "Once upon a time")
N = 2  # tokens per greedy output: a prefill step and one decode step
CHAT = [{"role": "user", "content": "Tell me about the river."}]
NO_THINKING = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
TIMEOUT = 900  # seconds; the simulator is slow, and slower still on a busy machine


def engine_idle(ae) -> bool:
    s = ae.stats()
    return (s["waiting"], s["running"], s["kv_pages_used"], s["slots_used"], s["pending"], s["streams"]) == \
        (0, 0, 0, 0, 0, 0)


def greedy_direct(engine, prompt_ids):
    """The engine's own greedy output, stepped synchronously before the server's engine thread owns it."""
    engine.add_request("reference", list(prompt_ids),
                       SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=2))
    ids, deltas, logprobs = [], [], []
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            deltas.append(out.delta_text)
            logprobs += out.logprobs or []
    return ids, "".join(deltas), logprobs, deltas


@pytest.fixture(scope="module")
def demo():
    from pegainfer.engine.engine import Engine
    engine = Engine.from_folder(None, max_model_len=64, max_batch=2)
    refs = {p: greedy_direct(engine, engine.tokenizer.encode(p)) for p in PROMPTS}
    refs["chat"] = greedy_direct(engine, chat_prompt_ids(engine))
    assert engine.stats()["kv_pages_used"] == 0
    ae = AsyncEngine(engine, max_waiting=8).start()
    try:
        with serve_app(build_app(ae)) as url:
            yield url, ae, engine, refs
    finally:
        ae.shutdown()


def chat_prompt_ids(engine):
    return engine.tokenizer.encode(engine.chat_template.render(CHAT, enable_thinking=False))


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def test_completion_with_logprobs_matches_the_engine(demo):
    url, ae, engine, refs = demo
    prompt = PROMPTS[0]
    ids, text, logprobs, _ = refs[prompt]
    r = client(url).completions.create(model=engine.model_name, prompt=prompt, max_tokens=N, temperature=0,
                                       logprobs=2, extra_body={"ignore_eos": True})
    assert r.model == "demo-qwen3"
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    got = r.choices[0].logprobs
    assert got.tokens == [engine.tokenizer.token_str(i) for i in ids]
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in logprobs], abs=1e-4)
    assert len(got.top_logprobs) == len(logprobs)
    for top, lp in zip(got.top_logprobs, logprobs):   # the engine's top tokens, and the chosen one among them
        assert len(lp.top) == 2
        want = {engine.tokenizer.token_str(i): v for i, v in lp.top}
        want.setdefault(engine.tokenizer.token_str(lp.token_id), lp.logprob)
        assert top == pytest.approx(want, abs=1e-4)
    wait_until(lambda: engine_idle(ae))


def test_streamed_chat_matches_the_engine(demo):
    url, ae, engine, refs = demo
    chunks = list(client(url).chat.completions.create(
        model=engine.model_name, messages=CHAT, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_THINKING))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert refs["chat"][1], "the reference reply should have text"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == refs["chat"][1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert chunks[-1].usage.prompt_tokens == len(chat_prompt_ids(engine))  # rendered with enable_thinking=False
    wait_until(lambda: engine_idle(ae))


def test_stop_string_across_the_token_boundary(demo):
    """A stop string made of the first token's last character and the second token's first character."""
    url, ae, engine, refs = demo
    prompt = PROMPTS[0]
    _, text, _, deltas = refs[prompt]
    assert len(deltas) == N and all(deltas), f"each token of the greedy reply should carry text: {deltas!r}"
    stop = text[len(deltas[0]) - 1:len(deltas[0]) + 1]
    r = client(url).completions.create(model=engine.model_name, prompt=prompt, max_tokens=N, temperature=0,
                                       stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    wait_until(lambda: engine_idle(ae))


def test_disconnect_frees_the_pages_and_the_slot(demo):
    url, ae, engine, refs = demo
    body = {"model": engine.model_name, "prompt": PROMPTS[1], "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            s = ae.stats()
            assert s["running"] == 1 and s["kv_pages_used"] > 0 and s["slots_used"] == 1
    wait_until(lambda: engine_idle(ae), timeout=TIMEOUT, what="the cancelled request's pages and slot to be freed")


def test_concurrent_streaming_clients(demo):
    url, ae, engine, refs = demo
    results, errors = {}, []

    def run(prompt):
        try:
            stream = client(url).completions.create(model=engine.model_name, prompt=prompt, max_tokens=N,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
            results[prompt] = "".join(ch.choices[0].text for ch in stream)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    assert results == {p: refs[p][1] for p in PROMPTS}
    wait_until(lambda: engine_idle(ae))


def test_prefix_cache_reports_cached_prompt_tokens(demo):
    """Catches a prefix-cache hit that is not reported, or that changes the output: the second of two requests
    with the same 33-token prompt reports its two full pages (32 tokens) in usage.prompt_tokens_details and gets
    the first one's text."""
    url, ae, engine, _ = demo
    prompt = [(7 * i + 3) % 500 for i in range(33)]       # two full pages and the one token a request must compute
    got = [client(url).completions.create(model=engine.model_name, prompt=prompt, max_tokens=1, temperature=0,
                                          extra_body={"ignore_eos": True}) for _ in range(2)]
    assert got[0].usage.prompt_tokens_details.cached_tokens == 0
    assert got[1].usage.prompt_tokens_details.cached_tokens == 32
    assert got[1].choices[0].text == got[0].choices[0].text
    wait_until(lambda: engine_idle(ae))
