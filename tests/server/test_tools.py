"""Tool calls through a live server with the official openai SDK (a FakeEngine that replies scripted text): the
calls in ``message.tool_calls`` and in the stream (the SDK's stream accumulation rebuilds the same calls), several
calls, text around calls, a malformed call under "auto" answered as text, ``tool_choice`` "none", the history of a
tool round trip rendered by the folder's template exactly as transformers renders it, and the 400s of bad tool
requests."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from tests.server.conftest import idle, serve_engine, wait_until
from tests.server.fake_engine import FakeEngine
from tests.text.fixtures import QWEN3_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                     "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]


def call(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


SCRIPTS = {   # the reply to a last user message "say:KEY"
    "one": "I will look it up.\n\n" + call("get_weather", {"city": "Paris", "unit": "C"}),
    "two": call("get_weather", {"city": "Paris"}) + "\n" + call("search", {"query": "umbrella"}),
    "malformed": 'Calling: <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
    "plain": "Paris is sunny.",
}


def reply(prompt: str) -> str:
    key = prompt.rsplit("say:", 1)[1].split("<|im_end|>")[0]
    return SCRIPTS[key]


@pytest.fixture
def server(model_folder):
    engine = FakeEngine(model_folder, reply=reply, max_model_len=1024)
    with serve_engine(engine) as (url, ae):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        yield client, engine, url
        wait_until(lambda: idle(ae), what="the engine to be idle after the test")


def ask(key):
    return [{"role": "user", "content": f"say:{key}"}]


def check_weather_args(arguments: str):
    args = json.loads(arguments)
    assert set(args) <= {"city", "unit"} and isinstance(args["city"], str) and args.get("unit", "C") in ("C", "F")


def test_one_call_not_streamed(server):
    client, _, _ = server
    r = client.chat.completions.create(model="fake-model", messages=ask("one"), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "get_weather"
    check_weather_args(tc.function.arguments)
    assert json.loads(tc.function.arguments) == {"city": "Paris", "unit": "C"}


def test_streamed_calls_rebuild_to_the_same_message(server):
    client, _, _ = server
    for key in ("one", "two", "plain"):
        whole = client.chat.completions.create(model="fake-model", messages=ask(key), tools=TOOLS).choices[0]
        with client.chat.completions.stream(model="fake-model", messages=ask(key), tools=TOOLS) as stream:
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == whole.finish_reason
        assert final.message.content == whole.message.content
        got = [(t.id.startswith("call_"), t.type, t.function.name, json.loads(t.function.arguments))
               for t in final.message.tool_calls or []]
        want = [(True, t.type, t.function.name, json.loads(t.function.arguments))
                for t in whole.message.tool_calls or []]
        assert got == want


def test_stream_chunks_have_openai_shapes(server):
    client, _, _ = server
    chunks = list(client.chat.completions.create(model="fake-model", messages=ask("two"), tools=TOOLS, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # per call: id, type and name with empty arguments first, then the arguments under the same index
    assert [(p.index, p.id is not None, p.type, p.function.name, p.function.arguments) for p in pieces[::2]] == \
        [(0, True, "function", "get_weather", ""), (1, True, "function", "search", "")]
    assert [(p.index, p.id, p.function.name) for p in pieces[1::2]] == [(0, None, None), (1, None, None)]
    assert json.loads(pieces[3].function.arguments) == {"query": "umbrella"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_several_calls(server):
    client, _, _ = server
    msg = client.chat.completions.create(model="fake-model", messages=ask("two"), tools=TOOLS).choices[0].message
    assert msg.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("search", {"query": "umbrella"})]
    assert len({t.id for t in msg.tool_calls}) == 2


def test_malformed_call_under_auto_is_plain_content(server):
    client, _, _ = server
    for stream in (False, True):
        if stream:
            with client.chat.completions.stream(model="fake-model", messages=ask("malformed"), tools=TOOLS) as s:
                choice = s.get_final_completion().choices[0]
        else:
            choice = client.chat.completions.create(model="fake-model", messages=ask("malformed"),
                                                    tools=TOOLS).choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content == SCRIPTS["malformed"]


def test_tool_choice_none_leaves_tools_out(server):
    client, engine, _ = server
    r = client.chat.completions.create(model="fake-model", messages=ask("one"), tools=TOOLS, tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == SCRIPTS["one"]
    prompt = engine.tokenizer.decode(list(engine.prompts.values())[-1], skip_special_tokens=False)
    assert "<tools>" not in prompt and "get_weather" not in prompt


def test_tool_round_trip_renders_like_transformers(server):
    client, engine, _ = server
    history = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\",\"unit\":\"C\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "18 C"}]},
        {"role": "user", "content": "say:plain"},
    ]
    r = client.chat.completions.create(model="fake-model", messages=history, tools=TOOLS)
    assert r.choices[0].message.content == SCRIPTS["plain"]
    # transformers with the same conversation: arguments as objects (what templates iterate over), text content
    hf_history = json.loads(json.dumps(history))
    for c in hf_history[2]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    hf_history[4]["content"] = "18 C"
    rendered, _ = render_jinja_template([hf_history], chat_template=QWEN3_TEMPLATE, tools=TOOLS,
                                        add_generation_prompt=True)
    assert "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\", \"unit\": \"C\"}}" in \
        rendered[0] and "<tool_response>\n18 C\n</tool_response>" in rendered[0]
    assert list(engine.prompts.values())[-1] == engine.tokenizer.encode(rendered[0])


BAD = [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "only kind of tool"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters",
     "JSON schema"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "unique"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in 'tools'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "an object please"}}},
     "response_format.json_schema.schema", "JSON schema object"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
]


@pytest.mark.parametrize("change,param,says", BAD, ids=[b[1] for b in BAD])
def test_bad_tool_requests_are_400_naming_the_field(server, change, param, says):
    _, _, url = server
    body = {"model": "fake-model", "messages": ask("plain"), **change}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"] and err["type"] == "invalid_request_error"
