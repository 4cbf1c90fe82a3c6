"""Tool calls in a model's answer, found as the text streams in and turned into OpenAI ``tool_calls``.

Qwen3 writes a call as JSON inside tags (the Hermes form its chat template teaches)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and Qwen3.5 as XML inside the same tags, one element per argument (values are raw text; the tool's JSON schema
says which are strings and which are JSON)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Both forms are read, whatever the model.  ``ToolCallParser.push(text)`` returns what the new text settles, in order:
plain text (``str``) and complete calls (``ToolCall``).  The rules:

* Text that may be the start of ``<tool_call>`` is held back until the next piece decides.  A ``<tool_call>``
  inside a Markdown code fence is quoted text, not a call.
* A call ends at the first ``</tool_call>`` that is not inside a JSON string of its body.  A body that is not a
  call to one of the request's tools (bad JSON, no name, an unknown function) is given back as plain text, tags
  included: a malformed call is never an error.  A call the output ends in without its closing tag counts when
  its body is complete.
* Whitespace next to a call (the newlines around the tags) is dropped, so the text around calls is what the model
  said to the user; ``content`` is None when nothing else is left.
* Several calls in one answer come out in order.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pegainfer.text.scan import find_outside_fences

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_XML_CALL = re.compile(r"<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI sends ``arguments`` as a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _string_typed(schema: Any) -> bool:
    """Whether a parameter's JSON schema says its value is a string (so an XML value is taken verbatim)."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and kind and all(k in ("string", "null") for k in kind)):
        return True
    return kind is None and "enum" in schema and all(isinstance(v, str) for v in schema["enum"])


def _xml_value(text: str, schema: Any) -> Any:
    if _string_typed(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_call_body(body: str, tools: Optional[dict[str, dict]]) -> Optional[ToolCall]:
    """The call written between the tags, or None when it is not a well-formed call.  ``tools``: name → the
    function's ``parameters`` schema; a call to a name not in it is not a call (None: any name)."""
    text = body.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):          # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        name = obj["name"]
    elif text.startswith("<function="):
        m = _XML_CALL.fullmatch(text)
        if m is None:
            return None
        name = m.group(1).strip()
        params = (tools or {}).get(name) or {}
        props = params.get("properties", {}) if isinstance(params, dict) else {}
        args = {}
        for key, value in _XML_PARAM.findall(m.group(2)):
            key = key.strip()
            args[key] = _xml_value(value, props.get(key) if isinstance(props, dict) else None)
    else:
        return None
    if not isinstance(args, dict) or not name or (tools is not None and name not in tools):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _close_outside_json_string(body: str, close_at: int) -> bool:
    """Whether position ``close_at`` of a JSON-form body lies outside every JSON string (so a ``</tool_call>``
    there ends the call; inside a string it is part of an argument)."""
    start = body.find("{")
    if start == -1 or body[:start].strip():
        return True
    in_string = escaped = False
    for ch in body[start:close_at]:
        if escaped:
            escaped = False
        elif in_string and ch == "\\":
            escaped = True
        elif ch == '"':
            in_string = not in_string
    return not in_string


Event = Union[str, ToolCall]


class ToolCallParser:
    """Incremental: ``push(text)`` → the settled events (``str`` text, ``ToolCall``); ``flush()`` at the end."""

    def __init__(self, tools: Optional[dict[str, dict]] = None):
        self.tools = tools
        self.calls: list[ToolCall] = []
        self._buf = ""            # text not settled yet
        self._in_call = False     # _buf is the body of a call (after its opening tag)
        self._in_fence = False    # a code fence is open (text before _buf)
        self._ws = ""             # trailing whitespace of the text, held back in case a call follows
        self._after_call = False  # drop the whitespace that follows a call

    # -------------------------------------------------------------------------------------------- text out
    def _text(self, s: str, out: list) -> None:
        if self._after_call:
            s = s.lstrip()
            if not s:
                return
            self._after_call = False
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body):]
        if body:
            out.append(body)

    def _call(self, call: ToolCall, out: list) -> None:
        self._ws = ""
        self._after_call = True
        self.calls.append(call)
        out.append(call)

    # -------------------------------------------------------------------------------------------- parsing
    def push(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._buf:
            if not self._in_call:
                at, settled, self._in_fence = find_outside_fences(self._buf, TOOL_CALL_OPEN, 0, self._in_fence)
                if settled:
                    self._text(self._buf[:settled], out)
                if at == -1:
                    self._buf = self._buf[settled:]
                    break
                self._buf = self._buf[at + len(TOOL_CALL_OPEN):]
                self._in_call = True
            else:
                if not self._end_call(out):
                    break
        return out

    def _end_call(self, out: list) -> bool:
        """Close the call in ``_buf`` at its first ``</tool_call>`` outside a JSON string; False while none."""
        body = self._buf
        at = body.find(TOOL_CALL_CLOSE)
        while at != -1 and not _close_outside_json_string(body, at):
            at = body.find(TOOL_CALL_CLOSE, at + 1)
        if at == -1:
            return False
        call = parse_call_body(body[:at], self.tools)
        end = at + len(TOOL_CALL_CLOSE)
        if call is not None:
            self._call(call, out)
        else:
            self._text(TOOL_CALL_OPEN + body[:end], out)
        self._buf = body[end:]
        self._in_call = False
        return True

    def flush(self) -> list[Event]:
        """Settle everything held back once the output has ended."""
        out: list[Event] = []
        if self._in_call:
            call = parse_call_body(self._buf, self.tools)
            if call is not None:
                self._call(call, out)
            else:
                self._text(TOOL_CALL_OPEN + self._buf, out)
        elif self._buf:
            self._text(self._buf, out)
        self._buf, self._in_call = "", False
        if self._ws and not self._after_call:
            out.append(self._ws)
        self._ws = ""
        return out


def parse_tool_calls(text: str, tools: Optional[dict[str, dict]] = None) -> tuple[Optional[str], list[ToolCall]]:
    """A whole answer at once: (the text outside the calls, or None when there is none; the calls)."""
    parser = ToolCallParser(tools)
    events = parser.push(text) + parser.flush()
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None), parser.calls
