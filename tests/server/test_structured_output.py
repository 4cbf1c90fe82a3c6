"""Structured output through a live server with the openai SDK, over the real engine: its scheduler, runner, the
grammar-mask kernel and the sampler, in the simulator.  The model is ``tests/engine/tiny_model.py``'s hash model
(its logits are a hash of the sequence's history: as good as random weights, and cheap to run), so validity comes
from the grammar alone.  ``json_schema`` output parses and validates over several seeds at once (one batch);
``json_object`` output parses whenever it is complete (at max_tokens it is cut like any output: finish_reason
"length"); a forced tool call, streamed or not, has arguments valid for the tool's schema; schemas the grammar
engine cannot follow are 400s naming the field.  One request runs on the demo model (a real transformer with
random weights) end to end."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pegainfer.engine.async_engine import AsyncEngine
from pegainfer.server.app import build_app
from tests.server.conftest import serve_app, serve_hash_engine
from tests.text.schema_check import errors

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ANSWER = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 9},
    "color": {"enum": ["red", "blue"]},
}, "required": ["ok", "n", "color"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "hot": {"type": "boolean"}},
    "required": ["city", "hot"], "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
TIMEOUT = 900   # the simulator is slow, and slower on a busy machine


@pytest.fixture(scope="module")
def server():
    with serve_hash_engine(TIMEOUT) as (client, url, _):
        yield client, url


def ask(text="Answer in JSON."):
    return [{"role": "user", "content": text}]


def all_at_once(fn, seeds):
    """``fn(seed)`` for every seed concurrently, so the engine decodes them in one batch."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(fn, seeds))


def test_json_schema_output_validates_over_seeds(server):
    client, _ = server
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}

    def one(seed):
        return client.chat.completions.create(model="demo-qwen3", messages=ask(), response_format=fmt, seed=seed,
                                              temperature=1.0, max_tokens=60, extra_body=NO_THINKING).choices[0]

    choices = all_at_once(one, list(range(8)))
    texts = {c.message.content for c in choices}
    for c in choices:
        assert c.finish_reason == "stop", c
        assert errors(json.loads(c.message.content), ANSWER) == [], c.message.content
    assert len(texts) > 1          # different seeds, different draws


def test_json_object_output_parses_when_complete(server):
    client, _ = server

    def one(seed):
        return client.chat.completions.create(model="demo-qwen3", messages=ask(), seed=seed, max_tokens=16,
                                              response_format={"type": "json_object"}, extra_body=NO_THINKING)

    for r in all_at_once(one, [0, 1, 2]):
        c = r.choices[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:   # cut by max_tokens: a beginning of a JSON object
            assert c.finish_reason == "length" and r.usage.completion_tokens == 16
            assert c.message.content.startswith("{")


def test_forced_tool_call_streamed_and_not(server):
    client, _ = server
    named = {"type": "function", "function": {"name": "get_weather"}}

    def whole(seed):
        return client.chat.completions.create(model="demo-qwen3", messages=ask("Weather?"), tools=[WEATHER, OTHER],
                                              tool_choice=named, seed=seed, max_tokens=80, extra_body=NO_THINKING)

    def streamed(seed):
        with client.chat.completions.stream(model="demo-qwen3", messages=ask("Weather?"), tools=[WEATHER, OTHER],
                                            tool_choice="required", parallel_tool_calls=False, seed=seed,
                                            max_tokens=80, extra_body=NO_THINKING) as s:
            return s.get_final_completion()

    results = all_at_once(lambda job: job[0](job[1]), [(whole, 3), (streamed, 4)])
    for r in results:
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "other": OTHER}[call.function.name]
        assert errors(json.loads(call.function.arguments), tool["function"]["parameters"]) == []
    assert results[0].choices[0].message.tool_calls[0].function.name == "get_weather"


BAD_SCHEMAS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "telepathy"}}}}, "response_format.json_schema.schema", "telepathy"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"}, "tools[0].function.parameters", "nowhere"),
]


def test_completions_follow_each_kind_of_output_format(server):
    """Catches a format parsed but not handed to the engine, or the wrong grammar built from it: over several seeds
    at once, /v1/completions output matches a regex (structured_outputs), is one of the choices (the older
    guided_choice), follows a Lark grammar, and is JSON valid for a schema (response_format, which completions
    take too); each ends because its grammar is complete."""
    client, _ = server
    grammar = 'start: "id=" NUM ("," NUM)*\nNUM: /[1-9][0-9]?/'
    pattern, choices = r"[a-c]{2,4}-[0-9]{1,2}", ["red pill", "blue pill", "née"]
    formats = [({"structured_outputs": {"regex": pattern}}, lambda t: re.fullmatch(pattern, t)),
               ({"guided_choice": choices}, lambda t: t in choices),
               ({"structured_outputs": {"grammar": grammar}},
                lambda t: re.fullmatch(r"id=[1-9][0-9]?(,[1-9][0-9]?)*", t)),
               ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}},
                lambda t: errors(json.loads(t), ANSWER) == [])]

    def one(job):
        (fmt, _), seed = job
        return client.completions.create(model="demo-qwen3", prompt="Answer:", seed=seed, temperature=1.0,
                                         max_tokens=60, extra_body=fmt).choices[0]

    jobs = [(f, seed) for f in formats for seed in (1, 2)]
    for ((fmt, ok), seed), c in zip(jobs, all_at_once(one, jobs)):
        assert c.finish_reason == "stop" and ok(c.text), (fmt, seed, c.text)


BAD_FORMATS = [
    ({"structured_outputs": {"regex": "(unclosed"}}, 400, "structured_outputs.regex", "unclosed"),
    ({"guided_grammar": 'start: "a" missing'}, 400, "guided_grammar", "missing"),
    ({"structured_outputs": {"choice": []}}, 400, "structured_outputs.choice", "non-empty"),
    ({"guided_json": "{not json"}, 400, "guided_json", "not JSON"),
    ({"structured_outputs": {"regex": "a+"}, "guided_choice": ["a"]}, 400, "guided_choice", "one output format"),
    ({"structured_outputs": {"structural_tag": "{}"}}, 422, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"regex": "a+"}, "tools": [WEATHER], "tool_choice": "auto"}, 422,
     "structured_outputs.regex", "tool_choice"),
]


@pytest.mark.parametrize("change,status,param,says", BAD_FORMATS, ids=[b[2] + "-" + b[3] for b in BAD_FORMATS])
def test_formats_that_cannot_be_followed_are_refused(server, change, status, param, says):
    _, url = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ask(), **change}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize("change,param,says", BAD_SCHEMAS, ids=[b[2] for b in BAD_SCHEMAS])
def test_schemas_that_cannot_be_followed_are_400(server, change, param, says):
    _, url = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ask(), **change}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"] and err["code"] == "invalid_schema"


def test_demo_model_json_schema():
    """The real transformer (random weights) end to end: the grammar holds whatever the weights."""
    from pegainfer.engine.engine import Engine
    ae = AsyncEngine(Engine.from_folder(None, max_model_len=96, max_batch=1)).start()
    try:
        assert ae.wait_ready(120)
        with serve_app(build_app(ae)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                      "additionalProperties": False}
            r = client.chat.completions.create(
                model="demo-qwen3", messages=ask(), temperature=0, max_tokens=20, extra_body=NO_THINKING,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
            assert r.choices[0].finish_reason == "stop"
            assert errors(json.loads(r.choices[0].message.content), schema) == []
    finally:
        ae.shutdown()



def test_allowed_token_ids(server):
    """vLLM's allowed_token_ids: every token drawn is one of them (over seeds at once); without an end-of-sequence id
    among them the answer runs to max_tokens; combined with an output format, a 400."""
    from pegainfer.demo import ensure_demo_model
    from pegainfer.text.tokenizer import Tokenizer

    client, url = server
    tok = Tokenizer.from_folder(ensure_demo_model())
    allowed = [40, 41, 77]
    strings = {tok.token_str(t) for t in allowed}

    def one(seed):
        return client.completions.create(model="demo-qwen3", prompt="Pick:", seed=seed, temperature=1.0, max_tokens=12,
                                         logprobs=0, extra_body={"allowed_token_ids": allowed}).choices[0]

    for c in all_at_once(one, [1, 2, 3]):
        assert c.finish_reason == "length" and len(c.logprobs.tokens) == 12
        assert set(c.logprobs.tokens) <= strings, c.logprobs.tokens
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": ask(), "allowed_token_ids": [1], "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_forced_calls_take_the_xml_form_a_template_teaches():
    """A chat template that writes ``<function=`` (Qwen3.5's) gets its calls forced in that form: the raw output
    (the logprobs' tokens) holds ``<function=get_weather>`` and ``<parameter=...>`` elements, and the answer's
    tool_calls parse with arguments valid for the tool."""
    with serve_hash_engine(TIMEOUT) as (client, _, engine):
        engine.chat_template.source += "\n{# calls: <function=name> #}"
        for seed in (1, 2):
            r = client.chat.completions.create(model="demo-qwen3", messages=ask("Weather?"), tools=[WEATHER],
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                               seed=seed, max_tokens=160, logprobs=True, extra_body=NO_THINKING)
            c = r.choices[0]
            raw = "".join(t.token for t in c.logprobs.content)
            assert "<function=get_weather>" in raw and "<parameter=city>" in raw, raw
            (call,) = c.message.tool_calls
            assert c.finish_reason == "tool_calls" and call.function.name == "get_weather"
            assert errors(json.loads(call.function.arguments), WEATHER["function"]["parameters"]) == []
