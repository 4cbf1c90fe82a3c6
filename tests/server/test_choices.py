"""``n`` choices per request through a live server with the openai SDK, over the real engine and the hash model of
``tests/engine/tiny_model.py`` (its logits are a hash of the sequence so far): choice ``i`` of a seeded request is
the answer a one-choice request with seed ``seed + i`` gets (vLLM's rule), streamed or not, for completions and
chat; greedy choices are all the same answer; usage counts the prompt once and every choice's tokens; a client
that leaves a streamed many-choice request aborts every choice (no page left in use); ``best_of`` other than 1 or
``n`` is refused."""
from __future__ import annotations

from collections import defaultdict

import httpx
import openai
import pytest

from tests.server.conftest import serve_hash_engine, wait_until

TIMEOUT = 600
PROMPT = [11, 12, 13, 14]
SAMPLED = dict(max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server():
    with serve_hash_engine(TIMEOUT, max_batch=4) as served:
        yield served


def one_choice(client, seed):
    return client.completions.create(model=None, prompt=PROMPT, seed=seed, **SAMPLED).choices[0].text


def test_completion_choices_are_the_single_requests_of_consecutive_seeds(server):
    """Catches choices sharing one seed (identical answers), a choice's text in another's slot, or usage counting
    the prompt per choice: three choices of seed 40 are the answers of seeds 40, 41, 42 in their order."""
    client, _, _ = server
    r = client.completions.create(model=None, prompt=PROMPT, n=3, seed=40, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [one_choice(client, 40 + i) for i in range(3)]
    assert len({c.text for c in r.choices}) > 1 and all(c.finish_reason == "length" for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 18, 22)


def test_streamed_choices_interleave_and_end_with_one_usage(server):
    """Catches a streamed chunk with the wrong index, a choice's end lost, a usage chunk per choice: the text of
    each index is that choice's answer, each index finishes once, one usage chunk comes last."""
    client, _, _ = server
    chunks = list(client.completions.create(model=None, prompt=PROMPT, n=2, seed=7, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLED))
    text, finishes = defaultdict(str), defaultdict(list)
    for c in chunks[:-1]:
        (choice,) = c.choices
        text[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert dict(text) == {0: one_choice(client, 7), 1: one_choice(client, 8)}
    assert dict(finishes) == {0: ["length"], 1: ["length"]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_choices_streamed_and_not(server):
    """Chat: greedy choices are one answer n times; seeded choices streamed equal the same request not streamed."""
    client, _, _ = server
    ask = [{"role": "user", "content": "Say something."}]
    greedy = client.chat.completions.create(model=None, messages=ask, n=3, max_tokens=5, temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1 and len(greedy.choices) == 3
    kw = dict(model=None, messages=ask, n=2, max_tokens=5, temperature=1.0, seed=3)
    whole = client.chat.completions.create(**kw)
    streamed = defaultdict(str)
    for c in client.chat.completions.create(stream=True, **kw):
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert dict(streamed) == {i: c.message.content for i, c in enumerate(whole.choices)}
    assert whole.choices[0].message.content != whole.choices[1].message.content
    assert whole.usage.completion_tokens == 10


def test_a_client_leaving_aborts_every_choice(server):
    """Catches choices left running when the client goes away mid-stream: after the first chunk the connection
    closes, and every page comes back."""
    _, url, engine = server
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    wait_until(lambda: not engine.has_unfinished() and engine.stats()["kv_pages_used"] == 0, timeout=120,
               what="every choice aborted and its pages freed")


def test_a_batch_of_prompts_gets_each_prompts_answers_in_order(server):
    """Catches prompts answered out of order or usage counting a prompt per choice: two prompts (token ids and
    text) × two choices, choice 2j + i is prompt j's answer with seed + i, echo puts each choice's own prompt first,
    and the prompt tokens are counted once per prompt."""
    client, _, engine = server
    text = "Once upon"
    n_text = len(engine.tokenizer.encode(text))
    r = client.completions.create(model=None, prompt=[PROMPT, text], n=2, seed=5, echo=True, **SAMPLED)
    singles = [client.completions.create(model=None, prompt=p, seed=5 + i, **SAMPLED).choices[0].text
               for p in (PROMPT, text) for i in range(2)]
    echoes = [engine.tokenizer.decode(PROMPT)] * 2 + [text] * 2
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [e + s for e, s in zip(echoes, singles)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT) + n_text, 24)


def test_best_of_other_than_n_is_refused(server):
    client, _, _ = server
    with pytest.raises(openai.UnprocessableEntityError, match="best_of=4"):
        client.completions.create(model=None, prompt=PROMPT, n=2, best_of=4, max_tokens=2)
