"""The tool-call parser on hand-written model text: both call forms (Qwen3's JSON, Qwen3.5's XML), several calls,
text around calls, malformed calls given back as text, tags inside JSON strings and code fences, and the same
result however the text is split into streamed pieces."""
import json
import random

import pytest

from pegainfer.text.tool_calls import ToolCall, ToolCallParser, parse_call_body, parse_tool_calls

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"]},
    "search": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
}


def call_text(name, args):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def run(pieces, tools=TOOLS):
    """Feed ``pieces`` one by one; return (text, [(name, arguments dict)]) from the events."""
    parser = ToolCallParser(tools)
    events = []
    for p in pieces:
        events += parser.push(p)
    events += parser.flush()
    text = "".join(e for e in events if isinstance(e, str))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    assert calls == [(c.name, json.loads(c.arguments)) for c in parser.calls]
    return text, calls


def splits(text, seed):
    """``text`` cut at random places (pieces of 1 to 6 characters)."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


CASES = {
    "one call": (call_text("get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    "text then call": ("Let me check the weather.\n\n" + call_text("get_weather", {"city": "Paris", "days": 3}),
                       "Let me check the weather.", [("get_weather", {"city": "Paris", "days": 3})]),
    "two calls": (call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("search", {"query": "rain"}),
                  "", [("get_weather", {"city": "Paris"}), ("search", {"query": "rain"})]),
    "text between and after": ("A " + call_text("search", {"query": "x"}) + "\nB\n" +
                               call_text("search", {"query": "y"}) + "\n\nDone.",
                               "ABDone.", [("search", {"query": "x"}), ("search", {"query": "y"})]),
    "close tag inside an argument": (call_text("search", {"query": "a </tool_call> b"}), "",
                                     [("search", {"query": "a </tool_call> b"})]),
    "arguments as a JSON string": ('<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>',
                                   "", [("search", {"query": "q"})]),
    "unclosed but complete at the end": ('<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n', "",
                                         [("search", {"query": "q"})]),
    "xml form": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n"
                 "2\n</parameter>\n</function>\n</tool_call>", "", [("get_weather", {"city": "New York", "days": 2})]),
    "xml form, JSON and multi-line values": ("<tool_call>\n<function=search>\n<parameter=query>\nline one\nline two\n"
                                             "</parameter>\n<parameter=filters>\n{\"lang\": \"en\"}\n</parameter>\n"
                                             "</function>\n</tool_call>", "",
                                             [("search", {"query": "line one\nline two", "filters": {"lang": "en"}})]),
    "no calls": ("Just an answer.\n", "Just an answer.\n", []),
    "a lone angle bracket": ("1 < 2 and <tool is not a tag", "1 < 2 and <tool is not a tag", []),
}

MALFORMED = {
    "bad JSON": '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>',
    "unknown function": call_text("launch_rockets", {"count": 3}),
    "no name": '<tool_call>{"arguments": {}}</tool_call>',
    "arguments not an object": '<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>',
    "not JSON nor XML": "<tool_call>call search please</tool_call>",
    "cut off mid-call": '<tool_call>\n{"name": "search", "arguments": {"query": "unfini',
    "bad XML": "<tool_call>\n<function=search>\n<parameter=query>\nx\n</tool_call>",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_calls_and_text(name):
    text, want_text, want_calls = CASES[name]
    assert run([text]) == (want_text, want_calls)


@pytest.mark.parametrize("name", sorted(CASES))
def test_any_split_gives_the_same_result(name):
    text, want_text, want_calls = CASES[name]
    assert run(list(text)) == (want_text, want_calls)
    for seed in range(5):
        assert run(splits(text, seed)) == (want_text, want_calls)


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_call_is_given_back_as_text(name):
    bad = MALFORMED[name]
    assert run(["Sure. " + bad]) == ("Sure. " + bad, [])
    assert run(list("Sure. " + bad)) == ("Sure. " + bad, [])


def test_a_malformed_call_does_not_hide_a_good_one_after_it():
    bad = MALFORMED["bad JSON"]
    text, calls = run(splits(bad + "\n" + call_text("search", {"query": "ok"}), 3))
    assert text == bad and calls == [("search", {"query": "ok"})]


def test_tags_inside_code_fences_are_text():
    quoted = "Write it like this:\n```\n" + call_text("search", {"query": "x"}) + "\n```\nThat is all."
    assert run([quoted]) == (quoted, [])
    assert run(list(quoted)) == (quoted, [])
    after = quoted + "\n" + call_text("search", {"query": "real"})   # the fence closed: a real call follows
    assert run(splits(after, 1)) == (quoted, [("search", {"query": "real"})])


def test_text_that_may_start_a_tag_is_held_back_until_decided():
    parser = ToolCallParser(TOOLS)
    assert parser.push("Hello <tool") == ["Hello"]          # the space too: it may precede a call
    assert parser.push("box>") == [" <toolbox>"]
    assert parser.push(" and <tool_call>\n{\"name\": \"search\", ") == [" and"]
    events = parser.push('"arguments": {"query": "q"}}\n</tool_call>\nok')
    assert [type(e) for e in events] == [ToolCall, str] and events[1] == "ok"
    assert parser.flush() == []


def test_tools_none_accepts_any_name_and_ids_are_unique():
    _, calls = parse_tool_calls(call_text("anything", {}) + call_text("anything", {}), None)
    assert [c.name for c in calls] == ["anything", "anything"] and calls[0].id != calls[1].id
    assert calls[0].id.startswith("call_")
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "anything", "arguments": "{}"}}


def test_xml_values_follow_the_schema():
    body = "<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n7\n</parameter>\n</function>"
    call = parse_call_body(body, TOOLS)
    assert json.loads(call.arguments) == {"city": "42", "days": 7}   # city is a string in the schema, days not
    assert json.loads(parse_call_body(body, None).arguments) == {"city": 42, "days": 7}
