"""OpenAI's Responses API (``POST /v1/responses``) as a translation of the chat route, whose pipeline it reuses.

A request's ``input`` (a string, or items: messages with text parts, ``function_call`` and ``function_call_output``
items of earlier turns) and ``instructions`` become chat messages; ``max_output_tokens``, the sampling fields,
``tools`` (flat function tools), ``tool_choice``, ``parallel_tool_calls`` and ``text.format`` become their chat
fields (``to_chat_body``).  The chat answer comes back as output items (``response_body``): a ``reasoning`` item
(the model's thinking, with a reasoning parser on), a ``message`` item with one ``output_text`` part, and a
``function_call`` item per call; ``status`` "completed", or "incomplete" (``max_output_tokens``) when the output
was cut.  Streamed, the chat chunks become the Responses events in their order (``StreamTranslator``):
``response.created``, ``response.in_progress``, per item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``, ``response.content_part.added`` then ``response.output_text.delta``,
``response.function_call_arguments.delta``), their ``.done`` events and ``response.output_item.done``, and last
``response.completed`` (or ``response.incomplete``) with the whole response; an error is an ``error`` event.

``reasoning.effort`` is the chat route's ``reasoning_effort``.  A response (``store``, true by default) is kept
in memory (``ResponseStore``: the most recent ``RESPONSES_KEPT``, a restart forgets them) as its conversation --
the input and the answer, not the instructions -- so a request naming it in ``previous_response_id`` continues it.
Not offered (a 422 naming the field): stored conversations (``conversation``), ``background``, built-in tools (web
search, file search, ...), non-text input parts.
"""
from __future__ import annotations

import json
import re
import uuid
from collections import OrderedDict
from typing import Optional

from pegainfer.server import protocol as P

RESPONSES_KEPT = 1024
"""Responses the server keeps for ``previous_response_id`` (least recently used out first)."""
UNSUPPORTED = {
    "conversation": "stored conversations are not kept: send the whole conversation in 'input'",
    "background": "background responses are not offered",
    "prompt": "stored prompts are not offered",
}
PASSED_ON = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "parallel_tool_calls", "stream",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "top_logprobs", "user",
             "chat_template_kwargs", "stop", "ignore_eos", "min_tokens")
"""Fields a Responses request shares with the chat route (the sampling fields and vLLM's extras)."""


def _text_of(content, at: str) -> str:
    """An input message's content: a string, or text parts (``input_text`` / ``output_text``) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad(f"{at}.content must be a string or an array of text parts", f"{at}.content", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise P.unsupported(f"{at}.content[{j}]", f"only text parts are supported (input_text), got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise P.bad(f"{at}.content[{j}].text must be a string", f"{at}.content[{j}].text", "invalid_type")
        texts.append(part["text"])
    return "\n".join(texts)


class ResponseStore:
    """The conversations of recent responses (chat messages: input and answer), for ``previous_response_id``."""

    def __init__(self, capacity: int = RESPONSES_KEPT):
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict]) -> None:
        self._items[response_id] = messages
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[list[dict]]:
        messages = self._items.get(response_id)
        if messages is not None:
            self._items.move_to_end(response_id)
        return messages


def conversation(chat: dict, output: list[dict]) -> list[dict]:
    """What a stored response continues from: the chat request's messages less its system message (the
    instructions, which a follow-up does not inherit), then the answer as an assistant message."""
    messages = [m for m in chat["messages"] if m.get("_from") != "instructions"]
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    answer = {"role": "assistant", "content": text or None}
    if calls:
        answer["tool_calls"] = calls
    return [{k: v for k, v in m.items() if k != "_from"} for m in messages] + [answer]


def _messages(body: dict, previous: Optional[list[dict]] = None) -> list[dict]:
    """``instructions``, the stored conversation of ``previous_response_id`` and ``input`` as chat messages (the
    system message marked as the instructions)."""
    out = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise P.bad("'instructions' must be a string", "instructions", "invalid_type")
        out.append({"role": "system", "content": instructions, "_from": "instructions"})
    out += [dict(m) for m in previous or ()]
    items = body.get("input")
    if items is None:
        raise P.bad("'input' is required: a string or an array of input items", "input", "missing_required_parameter")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise P.bad(f"'input' must be a string or an array of items, got {P._type_name(items)}", "input",
                    "invalid_type")
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise P.bad(f"{at} must be an object", at, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text_of(item.get("content"), at)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)         # parallel calls of one answer
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output, ensure_ascii=False)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            continue                                       # earlier thinking is not fed back (as the templates do)
        else:
            raise P.unsupported(f"{at}.type", f"input items of type {kind!r} are not offered (message, "
                                              f"function_call, function_call_output)")
    return out


def _tools(v) -> Optional[list[dict]]:
    """Flat function tools (``{"type": "function", "name", "parameters", ...}``) as chat tools."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise P.bad("'tools' must be an array of tools", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(v):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise P.unsupported(f"tools[{i}]", f"only function tools are offered, got {kind!r}")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v):
    if isinstance(v, dict) and v.get("type") == "function" and "function" not in v:
        return {"type": "function", "function": {"name": v.get("name")}}
    return v


def _format(text) -> Optional[dict]:
    """``text.format`` as the chat route's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise P.bad("'text' must be an object", "text", "invalid_type")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict):
        raise P.bad("'text.format' must be an object", "text.format", "invalid_type")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def to_chat_body(body: dict, store: Optional[ResponseStore] = None) -> dict:
    """The chat request a Responses request asks for (module docstring), the conversation of its
    ``previous_response_id`` first (from ``store``); raises an ``APIError`` for what is not offered or not found.
    Its messages' system message, if any, is marked ``_from: instructions`` (``strip_marks`` before the chat route)."""
    for name, why in UNSUPPORTED.items():
        if body.get(name) is not None:
            raise P.unsupported(name, why)
    previous = None
    if body.get("previous_response_id") is not None:
        rid = body["previous_response_id"]
        previous = store.get(rid) if store is not None and isinstance(rid, str) else None
        if previous is None:
            raise P.APIError(404, f"no stored response {rid!r} (the server keeps the {RESPONSES_KEPT} most recent, "
                                  f"in memory): send the whole conversation in 'input'", "previous_response_id",
                             "response_not_found")
    chat = {k: body[k] for k in PASSED_ON if k in body}
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise P.bad("'reasoning' must be an object", "reasoning", "invalid_type")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    chat["messages"] = _messages(body, previous)
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


# ------------------------------------------------------------------------------------------------ the answer
CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort"}
"""The chat route's field names an error may name, as the Responses request calls them."""


def rename_param(param: Optional[str], body: dict) -> Optional[str]:
    """A chat field name in an error, as the Responses request calls it: ``messages[k]`` is ``input[k]`` (less one
    for the system message ``instructions`` became; earlier calls of one answer merge into one message, so past
    them an index is approximate: the field is what matters)."""
    if param is None:
        return None
    for chat_name, name in CHAT_PARAMS.items():
        if param == chat_name or param.startswith(chat_name + "[") or param.startswith(chat_name + "."):
            rest = param[len(chat_name):]
            m = re.match(r"\[(\d+)\](.*)", rest)
            if chat_name == "messages" and m and body.get("instructions") is not None:
                rest = f"[{max(int(m.group(1)) - 1, 0)}]{m.group(2)}"
            return name + rest
    return param


def strip_marks(chat: dict) -> dict:
    """The chat request without ``to_chat_body``'s marks on its messages."""
    return {**chat, "messages": [{k: v for k, v in m.items() if k != "_from"} for m in chat["messages"]]}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(u: Optional[dict], reasoning_tokens: int = 0) -> Optional[dict]:
    if u is None:
        return None
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u["total_tokens"]}


def _shell(rid: str, created: int, body: dict, chat: dict, status: str) -> dict:
    """The response object around its output: what the request asked for, echoed as OpenAI does."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": chat.get("model"),
            "output": [], "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "text": body.get("text") or {"format": {"type": "text"}},
            "usage": None}


def _finished(response: dict, finish: Optional[str]) -> None:
    if finish == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def message_item(text: str, status: str = "completed", item_id: Optional[str] = None) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, item_id: Optional[str] = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: Optional[str] = None) -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_body(body: dict, chat: dict, answer: dict) -> dict:
    """The Responses object of a whole chat answer (``answer``: the chat route's JSON body)."""
    choice = answer["choices"][0]
    message = choice["message"]
    response = _shell(new_id("resp"), answer["created"], body, {**chat, "model": answer["model"]}, "completed")
    if message.get("reasoning_content"):
        response["output"].append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        response["output"].append(message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        response["output"].append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    _finished(response, choice["finish_reason"])
    response["usage"] = _usage(answer.get("usage"))
    return response


class StreamTranslator:
    """The chat route's stream chunks (parsed JSON) in, the Responses events out (module docstring).  One item is
    open at a time: thinking, then the answer's text, then each call (the order the chat parser settles them)."""

    def __init__(self, body: dict, chat: dict, created: int):
        self.response = _shell(new_id("resp"), created, body, chat, "in_progress")
        self.seq = 0
        self.open: Optional[dict] = None        # the item being streamed
        self.text = ""                          # its text (reasoning, answer) or arguments so far
        self.finish: Optional[str] = None
        self.error: Optional[dict] = None

    def event(self, kind: str, **fields) -> str:
        fields = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(fields, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        return [self.event("response.created", response=dict(self.response)),
                self.event("response.in_progress", response=dict(self.response))]

    def _index(self) -> int:
        return len(self.response["output"])

    def _open(self, item: dict) -> list[str]:
        out = self._close()
        self.open, self.text = item, ""
        out.append(self.event("response.output_item.added", output_index=self._index(), item=item))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        return out

    def _close(self) -> list[str]:
        item, out = self.open, []
        if item is None:
            return out
        at = dict(item_id=item["id"], output_index=self._index())
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", content_index=0, text=self.text, **at))
            done = reasoning_item(self.text, item["id"])
        elif item["type"] == "message":
            out.append(self.event("response.output_text.done", content_index=0, text=self.text, logprobs=[], **at))
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            out.append(self.event("response.content_part.done", content_index=0, part=part, **at))
            done = message_item(self.text, "completed", item["id"])
        else:
            out.append(self.event("response.function_call_arguments.done", arguments=self.text, name=item["name"],
                                  **at))
            done = call_item(item["call_id"], item["name"], self.text, "completed", item["id"])
        out.append(self.event("response.output_item.done", output_index=self._index(), item=done))
        self.response["output"].append(done)
        self.open = None
        return out

    def chunk(self, c: dict) -> list[str]:
        """The events of one chat chunk."""
        if c.get("error") is not None:
            self.error = err = c["error"]
            return [self.event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))]
        out = []
        if c.get("usage") is not None:
            self.response["usage"] = _usage(c["usage"])
        for choice in c.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._open({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                                       "status": "in_progress"})
                self.text += delta["reasoning_content"]
                out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                      output_index=self._index(), content_index=0,
                                      delta=delta["reasoning_content"]))
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._open({"type": "message", "id": new_id("msg"), "status": "in_progress",
                                       "role": "assistant", "content": []})
                self.text += delta["content"]
                out.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                      output_index=self._index(), content_index=0, delta=delta["content"],
                                      logprobs=[]))
            for call in delta.get("tool_calls") or ():
                fn = call.get("function") or {}
                if call.get("id") is not None:              # a call's head: its id and name
                    out += self._open(call_item(call["id"], fn.get("name"), "", "in_progress", new_id("fc")))
                elif fn.get("arguments"):
                    self.text += fn["arguments"]
                    out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                          output_index=self._index(), delta=fn["arguments"]))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> list[str]:
        """The events after the last chunk: the open item's end, then the whole response."""
        out = self._close()
        if self.error is not None:
            self.response["status"] = "failed"
            self.response["error"] = {"code": self.error.get("code") or "server_error",
                                      "message": self.error.get("message")}
            return out + [self.event("response.failed", response=self.response)]
        _finished(self.response, self.finish)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        out.append(self.event(kind, response=self.response))
        return out
