"""``echo`` with ``logprobs`` on /v1/completions (what evaluation harnesses send to score a text: the prompt's
tokens come back with their logprobs) through a live server over the real engine and the hash model: the prompt's
entries come first (None for its first token), equal to the engine's own scoring of the same ids, then the
generated token's; streamed, the same entries and text arrive in the chunks."""
from __future__ import annotations

import numpy as np
import openai
import pytest

from pegainfer.engine.async_engine import AsyncEngine
from pegainfer.server.app import build_app
from tests.engine.hash_engine import hash_engine
from tests.server.conftest import serve_app

PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]    # longer than the hash engine's 4 logits rows: 3 chunks


@pytest.fixture(scope="module")
def server():
    scorer = hash_engine(max_batch=4)
    x = scorer.score(PROMPT).astype(np.float64)
    lp = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
    want = [lp[p, PROMPT[p + 1]] for p in range(len(PROMPT) - 1)]
    scorer.log_softmax = lp
    ae = AsyncEngine(hash_engine(max_batch=4), max_waiting=16).start()
    assert ae.wait_ready(60)
    try:
        with serve_app(build_app(ae)) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600), scorer, want
    finally:
        ae.shutdown()


def test_echo_with_logprobs_scores_the_prompt(server):
    """Catches prompt logprobs shifted by a position, the first token given a logprob, or the generated token's
    entry missing: lm-evaluation-harness's request shape (max_tokens 1, logprobs 1, echo)."""
    client, scorer, want = server
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    (c,) = r.choices
    lp = c.logprobs
    tok = scorer.tokenizer
    assert lp.tokens == [tok.token_str(t) for t in PROMPT] + lp.tokens[len(PROMPT):] and len(lp.tokens) == 12
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:len(PROMPT)], want, rtol=0, atol=1e-6)
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert c.text.startswith(tok.decode(PROMPT, skip_special_tokens=False)) and r.usage.completion_tokens == 1


def test_streamed_echo_with_logprobs_carries_the_same_entries(server):
    client, _, _ = server
    kw = dict(model=None, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    text, tokens, values = "", [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens and values == whole.logprobs.token_logprobs
    assert len(tokens) == len(PROMPT) + 3


def test_vllm_prompt_logprobs_field(server):
    """vLLM's ``prompt_logprobs``: per choice on /v1/completions (no echo needed), top-level on chat; None for the
    first token, then the token itself (its rank: 1 + how many tokens are likelier) and the top N (rank r: the r-th
    largest logprob; the hash model's logits tie often, so which of equal tokens is listed is not checked);
    streaming with it is refused."""
    client, scorer, want = server
    tok = scorer.tokenizer
    r = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    for p, e in enumerate(entries[1:]):
        row, token = scorer.log_softmax[p], PROMPT[p + 1]
        own = e[str(token)]
        assert abs(own["logprob"] - want[p]) < 1e-6 and own["decoded_token"] == tok.token_str(token)
        assert own["rank"] == 1 + int((row > row[token]).sum())
        ranked = np.sort(row)[::-1]                          # the r-th largest logprob (ties: the same value)
        others = {k: v for k, v in e.items() if k != str(token)}
        assert 1 <= len(others) <= 2 and {v["rank"] for v in others.values()} <= {1, 2}
        assert all(abs(v["logprob"] - ranked[v["rank"] - 1]) < 1e-6 for v in others.values())
    assert r.choices[0].logprobs is None and r.choices[0].text and "prompt_logprobs" not in r.model_extra
    chat = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert chat_entries[0] is None and all(len(e) == 1 for e in chat_entries[1:])
    with pytest.raises(openai.UnprocessableEntityError, match="prompt_logprobs"):
        list(client.completions.create(model=None, prompt=PROMPT, max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 1}))
