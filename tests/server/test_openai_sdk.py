"""The official openai SDK against a live server (FakeEngine behind it): completions and chat, streaming and not,
stop strings (one split across tokens), logprobs, usage, echo, token-id prompts, UTF-8 safety."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import idle, wait_until
from tests.server.fake_engine import DEFAULT_REPLY


@pytest.fixture
def client(fake_server):
    url, ae, engine = fake_server
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    c.engine, c.ae, c.url = engine, ae, url
    yield c
    wait_until(lambda: idle(ae), what="the engine to be idle after the test")  # nothing leaked


def reply_prefix(tok, n_tokens):
    return tok.decode(tok.encode(DEFAULT_REPLY)[:n_tokens])


def test_completion_non_streaming(client):
    tok = client.engine.tokenizer
    r = client.completions.create(model="fake-model", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "fake-model"
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.text == reply_prefix(tok, 5)
    n_prompt = len(tok.encode("Once upon a time"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 5, n_prompt + 5)
    # the engine got what the request asked for
    (rid,) = client.engine.prompts
    p = client.engine.params[rid]
    assert client.engine.prompts[rid] == tok.encode("Once upon a time")
    assert (p.max_tokens, p.temperature, p.logprobs) == (5, 0.0, None)


def test_completion_default_max_tokens_and_eos(client):
    r = client.completions.create(model="fake-model", prompt="Hi")
    assert len(client.engine.tokenizer.encode(r.choices[0].text)) <= 16 and r.usage.completion_tokens == 16
    r = client.completions.create(model="fake-model", prompt="Hi", max_tokens=100, seed=7, top_p=0.5, temperature=0.7,
                                  extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": False, "min_tokens": 1})
    assert r.choices[0].text == DEFAULT_REPLY and r.choices[0].finish_reason == "stop"
    p = list(client.engine.params.values())[-1]
    assert (p.seed, p.top_p, p.temperature, p.top_k, p.min_p, p.min_tokens) == (7, 0.5, 0.7, 5, 0.1, 1)


def test_penalties_and_logit_bias_reach_the_engine(client):
    """Catches a penalty dropped or renamed on the way, or logit_bias keys left as strings: the engine gets them
    (and the request's priority) as sent (the keys as token ids); a request without them gets the neutral values
    (the fake model folder's generation_config.json sets no repetition penalty)."""
    client.completions.create(model="fake-model", prompt="Hi", max_tokens=3, presence_penalty=1.5,
                              frequency_penalty=-0.5, logit_bias={"7": 4.5, "12": -100},
                              extra_body={"repetition_penalty": 1.2, "priority": -3, "bad_words": ["x y"]})
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                   presence_penalty=0.25, logit_bias={"3": 1})
    client.completions.create(model="fake-model", prompt="Hi", max_tokens=3)
    completion, chat, plain = list(client.engine.params.values())[-3:]
    assert (completion.presence_penalty, completion.frequency_penalty, completion.repetition_penalty,
            completion.logit_bias, completion.priority, completion.bad_words) == (1.5, -0.5, 1.2,
                                                                                {7: 4.5, 12: -100.0}, -3, ["x y"])
    assert (chat.presence_penalty, chat.logit_bias, chat.repetition_penalty) == (0.25, {3: 1.0}, 1.0)
    assert not plain.penalized


def test_continuous_usage_stats_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (completion tokens rising
    by one a token, the prompt's count throughout), then the final usage chunk; without it the chunks say null."""
    n_prompt = len(client.engine.tokenizer.encode("Once"))
    for kind in ("completions", "chat"):
        make = client.completions.create if kind == "completions" else client.chat.completions.create
        ask = {"prompt": "Once"} if kind == "completions" else {"messages": [{"role": "user", "content": "Once"}]}
        chunks = list(make(model="fake-model", max_tokens=4, stream=True, **ask,
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
        counts = [c.usage.completion_tokens for c in chunks[:-1]]
        assert all(c.usage is not None for c in chunks) and chunks[-1].choices == []
        assert counts == sorted(counts) and counts[-1] == 4 == chunks[-1].usage.completion_tokens
        assert len({c.usage.prompt_tokens for c in chunks}) == 1
        if kind == "completions":
            assert chunks[0].usage.prompt_tokens == n_prompt
        plain = list(make(model="fake-model", max_tokens=4, stream=True, **ask, stream_options={"include_usage": True}))
        assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 4


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    """vLLM's truncate_prompt_tokens: the engine gets the prompt's last k tokens (and an echo shows them); a
    shorter prompt is left whole."""
    tok = client.engine.tokenizer
    ids = tok.encode("one two three four five six seven")
    r = client.completions.create(model="fake-model", prompt=ids, max_tokens=1, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert list(client.engine.prompts.values())[-1] == ids[-3:] and r.usage.prompt_tokens == 3
    assert r.choices[0].text.startswith(tok.decode(ids[-3:], skip_special_tokens=False))
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                   extra_body={"truncate_prompt_tokens": 2})
    assert len(list(client.engine.prompts.values())[-1]) == 2
    client.completions.create(model="fake-model", prompt=ids[:2], max_tokens=1,
                              extra_body={"truncate_prompt_tokens": 3})
    assert list(client.engine.prompts.values())[-1] == ids[:2]


def test_continue_final_message_leaves_the_assistant_turn_open(client):
    """vLLM's continue_final_message: the prompt ends with the last (assistant) message's text, its end-of-turn cut
    off, no new turn after it; without it the same messages close that turn; misuse is a 400."""
    tok = client.engine.tokenizer
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    client.chat.completions.create(model="fake-model", messages=messages, max_tokens=1,
                                   extra_body={"continue_final_message": True, "add_generation_prompt": False})
    continued = tok.decode(list(client.engine.prompts.values())[-1], skip_special_tokens=False)
    client.chat.completions.create(model="fake-model", messages=messages, max_tokens=1)
    closed = tok.decode(list(client.engine.prompts.values())[-1], skip_special_tokens=False)
    assert continued.endswith("The color is") and closed.startswith(continued) and len(closed) > len(continued)
    with pytest.raises(openai.BadRequestError, match="assistant"):
        client.chat.completions.create(model="fake-model", messages=messages[:1], max_tokens=1,
                                       extra_body={"continue_final_message": True})
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(model="fake-model", messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": True})


def test_completion_streaming_with_usage(client):
    n = len(client.engine.tokenizer.encode(DEFAULT_REPLY))  # the whole reply, without its EOS
    stream = client.completions.create(model="fake-model", prompt="Once", max_tokens=n, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + n
    text_chunks = chunks[:-1]
    assert all(c.usage is None for c in text_chunks)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    pieces = [c.choices[0].text for c in text_chunks]
    assert "".join(pieces) == DEFAULT_REPLY
    assert len(pieces) < n  # some tokens (the fox emoji's bytes) sent no text of their own
    assert all("\ufffd" not in p for p in pieces)  # the emoji spans several tokens: never split
    assert len({c.id for c in chunks}) == 1


def test_chat_non_streaming_and_enable_thinking(client):
    tok = client.engine.tokenizer
    r = client.chat.completions.create(
        model="fake-model", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == reply_prefix(tok, 4)
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 4
    (rid,) = client.engine.prompts
    assert tok.decode(client.engine.prompts[rid], skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r.usage.prompt_tokens == len(client.engine.prompts[rid])


def test_chat_default_max_tokens_is_the_rest_of_the_context(client):
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert r.choices[0].message.content == DEFAULT_REPLY and r.choices[0].finish_reason == "stop"
    (rid,) = client.engine.prompts
    assert client.engine.params[rid].max_tokens == client.engine.max_model_len - len(client.engine.prompts[rid])


def test_chat_streaming(client):
    stream = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=40, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        client.engine.tokenizer.encode(DEFAULT_REPLY)) + 1  # the reply, then EOS
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-2].choices[0].delta.content is None
    content = "".join(c.choices[0].delta.content or "" for c in chunks[1:-1])
    assert content == DEFAULT_REPLY
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def _stop_split_across_tokens(tok):
    """A stop string of the reply that starts inside one token and ends in a later one."""
    ids = tok.encode(DEFAULT_REPLY)
    ends = [len(tok.decode(ids[:k + 1])) for k in range(10)]  # where each of the first (ASCII) tokens ends
    for a in range(len(ends) - 2):
        start, stop_end = ends[a] - 1, ends[a + 1] + 1  # last char of token a .. first char of token a+2
        candidate = DEFAULT_REPLY[start:stop_end]
        if DEFAULT_REPLY.find(candidate) == start and candidate.strip() == candidate and "\ufffd" not in candidate:
            return candidate
    raise AssertionError("no multi-token stop string found")


@pytest.mark.parametrize("streaming", [False, True])
def test_stop_string_split_across_tokens(client, streaming):
    stop = _stop_split_across_tokens(client.engine.tokenizer)
    expected = DEFAULT_REPLY[:DEFAULT_REPLY.index(stop)]
    kw = dict(model="fake-model", prompt="x", max_tokens=60, stop=[stop, "never appears"])
    if streaming:
        pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kw)]
        text = "".join(pieces)
        # hold-back: no chunk ever carried a piece of the stop string
        sent = ""
        for p in pieces:
            sent += p
            assert sent == expected[:len(sent)]
    else:
        r = client.completions.create(**kw)
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
    assert text == expected


def test_chat_stop_string(client):
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], stop="fox", max_tokens=50)
    assert r.choices[0].message.content == DEFAULT_REPLY[:DEFAULT_REPLY.index("fox")]
    assert r.choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    tok = client.engine.tokenizer
    r = client.completions.create(model="fake-model", prompt="Hi", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    ids = tok.encode(DEFAULT_REPLY)[:3]
    assert lp.tokens == [tok.token_str(i) for i in ids]
    assert lp.token_logprobs == [-0.25] * 3
    assert lp.top_logprobs[0] == {tok.token_str(ids[0]): -0.25, tok.token_str(ids[0] + 1): -1.25}
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    # streamed: each chunk carries the logprobs of its own tokens
    chunks = list(client.completions.create(model="fake-model", prompt="Hi", max_tokens=3, logprobs=1, stream=True))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == 3


def test_chat_logprobs(client):
    tok = client.engine.tokenizer
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    ids = tok.encode(DEFAULT_REPLY)[:2]
    assert [c.token for c in content] == [tok.token_str(i) for i in ids]
    assert [c.logprob for c in content] == [-0.25, -0.25]
    assert content[0].bytes == list(tok.token_bytes(ids[0]))
    assert [t.logprob for t in content[0].top_logprobs] == [-0.25, -1.25, -2.25]
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=True)
    assert len(r.choices[0].logprobs.content) == 2 and r.choices[0].logprobs.content[0].top_logprobs == []
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                                 logprobs=True, top_logprobs=1, stream=True))
    got = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in got] == [tok.token_str(i) for i in ids]


def test_partial_utf8_bytes_in_logprobs(client):
    """The emoji spans several byte-level tokens: each token's text is U+FFFD but its bytes are exact."""
    tok = client.engine.tokenizer
    ids = tok.encode(DEFAULT_REPLY)
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=len(ids),
                                       logprobs=True)
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(c.bytes) for c in content).decode() == DEFAULT_REPLY
    assert any("\ufffd" in c.token for c in content)
    assert r.choices[0].message.content == DEFAULT_REPLY


def test_echo_and_token_prompts(client):
    tok = client.engine.tokenizer
    r = client.completions.create(model="fake-model", prompt="Once upon", max_tokens=2, echo=True)
    assert r.choices[0].text == "Once upon" + reply_prefix(tok, 2)
    ids = tok.encode("Once upon")
    r2 = client.completions.create(model="fake-model", prompt=ids, max_tokens=2)
    r3 = client.completions.create(model="fake-model", prompt=["Once upon"], max_tokens=2)
    assert r2.choices[0].text == r3.choices[0].text == reply_prefix(tok, 2)
    assert r2.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model="fake-model", prompt=ids, max_tokens=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Once upon" + reply_prefix(tok, 2)


def test_models_health_version(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"
    h = httpx.get(f"{client.url}/health")
    assert h.status_code == 200
    v = httpx.get(f"{client.url}/version").json()
    import pegainfer
    assert v == {"version": pegainfer.__version__}


def test_ids_beyond_the_tokenizer_decode_to_nothing(model_folder):
    """Like Qwen3, the fake model's embedding is larger than its tokenizer: such ids add tokens but no text."""
    from tests.server.conftest import serve_engine
    from tests.server.fake_engine import FakeEngine

    engine = FakeEngine(model_folder, script_prefix=[420, 433])
    assert engine.tokenizer.vocab_size <= 420 < engine.vocab_size
    with serve_engine(engine) as (url, ae):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=100, logprobs=True)
        assert r.choices[0].message.content == DEFAULT_REPLY
        assert r.usage.completion_tokens == len(engine.tokenizer.encode(DEFAULT_REPLY)) + 3  # 2 unknown + EOS
        unknown = r.choices[0].logprobs.content[:2]
        assert [(t.token, t.bytes) for t in unknown] == [("", []), ("", [])]
