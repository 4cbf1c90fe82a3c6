"""OpenAI's Responses API (``POST /v1/responses``) through a live server with the openai SDK over the real engine
and the hash model: an answer is the chat route's answer for the same conversation (greedy: the same text), as a
``message`` item; cut by ``max_output_tokens`` it is "incomplete"; streamed, the events come in the API's order and
their deltas rebuild the answer; a forced function call is a ``function_call`` item with arguments valid for the
tool, streamed or not; earlier calls and their outputs in ``input`` render as the chat route renders them;
``text.format`` holds the output to a schema; ``previous_response_id`` continues a stored response; what is not
offered is a 422 naming the field."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import serve_hash_engine
from tests.text.schema_check import errors

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}


@pytest.fixture(scope="module")
def server():
    with serve_hash_engine(600) as (client, url, _):
        yield client, url


def test_a_text_answer_is_the_chat_answer(server):
    client, _ = server
    r = client.responses.create(model="demo-qwen3", instructions="Be brief.", input="Say hi", max_output_tokens=8,
                                temperature=0, extra_body=NO_THINKING)
    chat = client.chat.completions.create(model="demo-qwen3", max_tokens=8, temperature=0, extra_body=NO_THINKING,
                                          messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Say hi"}])
    assert r.object == "response" and [o.type for o in r.output] == ["message"]
    assert r.output_text == chat.choices[0].message.content and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    assert r.instructions == "Be brief." and r.max_output_tokens == 8


def test_streamed_events_rebuild_the_answer(server):
    client, _ = server
    kw = dict(model="demo-qwen3", input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}],
              max_output_tokens=8, temperature=0, extra_body=NO_THINKING)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 8


def test_forced_function_call_streamed_and_not(server):
    client, _ = server
    kw = dict(model="demo-qwen3", input="Weather?", tools=[WEATHER], max_output_tokens=60, extra_body=NO_THINKING,
              tool_choice={"type": "function", "name": "get_weather"})
    r = client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        final = s.get_final_response()
    for resp in (r, final):
        (call,) = [o for o in resp.output if o.type == "function_call"]
        assert call.name == "get_weather" and call.call_id.startswith("call_") and resp.status == "completed"
        assert errors(json.loads(call.arguments), WEATHER["parameters"]) == []


def test_earlier_calls_and_outputs_render_as_the_chat_route_renders_them(server):
    """Catches a call or its output dropped from the prompt: the input tokens equal the chat route's prompt for the
    same conversation."""
    client, _ = server
    args = '{"city": "Rome"}'
    r = client.responses.create(model="demo-qwen3", tools=[WEATHER], max_output_tokens=2, extra_body=NO_THINKING,
                                input=[{"role": "user", "content": "Weather in Rome?"},
                                       {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                        "arguments": args},
                                       {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    chat = client.chat.completions.create(
        model="demo-qwen3", tools=[CHAT_WEATHER], max_tokens=2, extra_body=NO_THINKING,
        messages=[{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens > 20


def test_previous_response_id_continues_the_stored_conversation(server):
    """Catches a follow-up that forgets the previous turn (or its answer), or inherits its instructions: the
    follow-up's prompt is the chat route's prompt of [question, answer, follow-up]; streamed responses are kept
    too; a response asked not to be stored cannot be continued."""
    client, url = server
    kw = dict(model="demo-qwen3", max_output_tokens=4, temperature=0, extra_body=NO_THINKING)
    first = client.responses.create(input="Say hi", instructions="Be brief.", **kw)
    with client.responses.stream(previous_response_id=first.id, input="Again", **kw) as s:
        events = list(s)
    second = events[-1].response
    third = client.responses.create(previous_response_id=second.id, input="Once more", **kw)
    chat = client.chat.completions.create(model="demo-qwen3", max_tokens=4, temperature=0, extra_body=NO_THINKING,
                                          messages=[{"role": "user", "content": "Say hi"},
                                                    {"role": "assistant", "content": first.output_text},
                                                    {"role": "user", "content": "Again"},
                                                    {"role": "assistant", "content": second.output_text},
                                                    {"role": "user", "content": "Once more"}])
    assert third.usage.input_tokens == chat.usage.prompt_tokens and third.output_text == chat.choices[0].message.content
    unstored = client.responses.create(input="Say hi", store=False, **kw)
    r = httpx.post(f"{url}/v1/responses", json={"input": "x", "previous_response_id": unstored.id}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_text_format_json_schema(server):
    client, _ = server
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model="demo-qwen3", input="JSON please", max_output_tokens=30, extra_body=NO_THINKING,
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert r.status == "completed" and errors(json.loads(r.output_text), schema) == []


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, 404, "previous_response_id"),
    ({"max_output_tokens": 4}, 400, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}], "instructions": "s"}, 400,
     "input[1].role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 422, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 422,
     "input[0].content[0]"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
])
def test_what_is_not_offered_is_refused(server, body, status, param):
    _, url = server
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_translator_orders_reasoning_text_and_calls_into_items():
    """The stream translator alone, on chat chunks as the chat route writes them: thinking, then text, then a call
    become three items, each opened, filled and closed in turn; the last event holds all three and the usage."""
    from pegainfer.server.responses import StreamTranslator, response_body

    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "Hmm, "}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "weather."}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": "Let me check."}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_7", "type": "function",
                                                                  "function": {"name": "f", "arguments": ""}}]},
                            "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
                            "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}]
    t = StreamTranslator({"input": "x"}, {"model": "m"}, 0)
    events = t.start() + [e for c in chunks for e in t.chunk(c)] + t.end()
    parsed = [json.loads(e.split("data: ", 1)[1]) for e in events]
    kinds = [p["type"] for p in parsed]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert all(e.startswith(f"event: {k}\n") for e, k in zip(events, kinds))
    final = parsed[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hmm, weather."
    assert final["output"][2]["call_id"] == "call_7" and final["output"][2]["arguments"] == '{"a": 1}'
    assert final["usage"]["output_tokens"] == 9 and final["status"] == "completed"
    assert [p["output_index"] for p in parsed if p["type"] == "response.output_item.added"] == [0, 1, 2]
    whole = response_body({"input": "x"}, {}, {"created": 0, "model": "m", "usage": None, "choices": [
        {"finish_reason": "stop", "message": {"content": "ok", "reasoning_content": "think"}}]})
    assert [o["type"] for o in whole["output"]] == ["reasoning", "message"] and whole["status"] == "completed"


def test_translator_reports_an_error_and_a_failed_response():
    from pegainfer.server.responses import StreamTranslator

    t = StreamTranslator({"input": "x"}, {"model": "m"}, 0)
    t.start()
    t.chunk({"choices": [{"index": 0, "delta": {"content": "par"}, "finish_reason": None}]})
    events = t.chunk({"error": {"message": "generation failed: boom", "type": "server_error", "param": None,
                                "code": "engine_error"}}) + t.end()
    parsed = [json.loads(e.split("data: ", 1)[1]) for e in events]
    assert [p["type"] for p in parsed] == ["error", "response.output_text.done", "response.content_part.done",
                                           "response.output_item.done", "response.failed"]
    assert parsed[0]["code"] == "engine_error" and parsed[-1]["response"]["status"] == "failed"
    assert parsed[-1]["response"]["error"]["message"] == "generation failed: boom"
