"""Reasoning content through a live server with the openai SDK (a FakeEngine replying scripted text through the
folder's Qwen3 chat template): ``message.reasoning_content`` and ``delta.reasoning_content``, ``enable_thinking:
false``, stop strings and max_tokens inside the thinking, a prompt that opens the think block itself (Qwen3.5),
thinking before a tool call, and ``--reasoning-parser none``."""
from __future__ import annotations

import json

import openai
import pytest

from pegainfer.text.chat import ChatTemplate
from tests.server.conftest import idle, serve_engine, wait_until
from tests.server.fake_engine import FakeEngine

THOUGHT = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello there!"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
SCRIPTS = {
    "think": THOUGHT,
    "think_then_call": "<think>\nI need to look it up.\n</think>\n\n<tool_call>\n"
                       "{\"name\": \"lookup\", \"arguments\": {\"q\": \"rain\"}}\n</tool_call>",
    "open": "Thinking in an opened block.\n</think>\n\nDone.",  # for a prompt that ends in <think>
}


def reply(prompt: str) -> str:
    return SCRIPTS[prompt.rsplit("say:", 1)[1].split("<|im_end|>")[0]]


@pytest.fixture
def make_client(model_folder):
    servers = []

    def make(**app_kwargs):
        engine = FakeEngine(model_folder, reply=reply, max_model_len=1024)
        ctx = serve_engine(engine, **app_kwargs)
        url, ae = ctx.__enter__()
        servers.append((ctx, ae))
        return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30), engine

    yield make
    for ctx, ae in servers:
        wait_until(lambda: idle(ae), what="the engine to be idle after the test")
        ctx.__exit__(None, None, None)


def ask(key):
    return [{"role": "user", "content": f"say:{key}"}]


def stream_fields(client, **kw):
    """(reasoning, content, finish) accumulated from the raw stream chunks."""
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(model="fake-model", stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish


def test_reasoning_content_split_whole_and_streamed(make_client):
    client, _ = make_client()
    msg = client.chat.completions.create(model="fake-model", messages=ask("think")).choices[0].message
    assert msg.reasoning_content == "The user greets me. I should greet back."
    assert msg.content == "Hello there!"
    assert stream_fields(client, messages=ask("think")) == (msg.reasoning_content, msg.content, "stop")


def test_enable_thinking_false_keeps_everything_in_content(make_client):
    client, engine = make_client()
    r = client.chat.completions.create(model="fake-model", messages=ask("think"),
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = engine.tokenizer.decode(list(engine.prompts.values())[-1], skip_special_tokens=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")     # the template closed the block itself
    assert r.choices[0].message.reasoning_content is None and r.choices[0].message.content == THOUGHT


def test_reasoning_effort_none_turns_thinking_off_and_others_leave_it_on(make_client):
    """OpenAI's reasoning_effort: "none" (and "minimal") close the think block in the prompt as enable_thinking
    false does; "high" leaves the prompt as without it; chat_template_kwargs still wins; the Responses API's
    reasoning.effort does the same."""
    client, engine = make_client()

    def prompt_after(**extra):
        client.chat.completions.create(model="fake-model", messages=ask("think"), max_tokens=2, extra_body=extra)
        return engine.tokenizer.decode(list(engine.prompts.values())[-1], skip_special_tokens=False)

    plain = prompt_after()
    assert prompt_after(reasoning_effort="none").endswith("<think>\n\n</think>\n\n")
    assert prompt_after(reasoning_effort="minimal").endswith("<think>\n\n</think>\n\n")
    assert prompt_after(reasoning_effort="high") == plain and not plain.endswith("</think>\n\n")
    assert prompt_after(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == plain
    client.responses.create(model="fake-model", input="say:think", max_output_tokens=2, reasoning={"effort": "none"})
    assert engine.tokenizer.decode(list(engine.prompts.values())[-1], skip_special_tokens=False).endswith(
        "<think>\n\n</think>\n\n")


def test_stop_strings_and_max_tokens_inside_the_thinking(make_client):
    client, engine = make_client()
    r = client.chat.completions.create(model="fake-model", messages=ask("think"), stop=["greet back"])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert msg.reasoning_content == "The user greets me. I should " and msg.content == ""
    n = len(engine.tokenizer.encode("<think>\nThe user greets"))
    r = client.chat.completions.create(model="fake-model", messages=ask("think"), max_tokens=n)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.reasoning_content == engine.tokenizer.decode(
        engine.tokenizer.encode(THOUGHT)[:n]).removeprefix("<think>\n")
    assert r.choices[0].message.content == ""
    assert stream_fields(client, messages=ask("think"), max_tokens=n) == (r.choices[0].message.reasoning_content,
                                                                          "", "length")


def test_a_prompt_that_opens_the_think_block(make_client):
    client, engine = make_client()
    engine.chat_template = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                        "{% endfor %}<|im_start|>assistant\n<think>\n")
    msg = client.chat.completions.create(model="fake-model", messages=ask("open")).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Thinking in an opened block.", "Done.")
    assert stream_fields(client, messages=ask("open"))[:2] == ("Thinking in an opened block.", "Done.")


def test_thinking_then_a_tool_call(make_client):
    client, _ = make_client()
    r = client.chat.completions.create(model="fake-model", messages=ask("think_then_call"), tools=[TOOL])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "I need to look it up." and msg.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [("lookup", {"q": "rain"})]
    with client.chat.completions.stream(model="fake-model", messages=ask("think_then_call"), tools=[TOOL]) as s:
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls[0].function.name == "lookup"


def test_reasoning_parser_none(make_client):
    client, _ = make_client(reasoning_parser="none")
    msg = client.chat.completions.create(model="fake-model", messages=ask("think")).choices[0].message
    assert msg.content == THOUGHT and getattr(msg, "reasoning_content", None) is None
