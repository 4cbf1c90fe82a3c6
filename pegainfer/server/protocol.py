"""The OpenAI wire format: request validation into plain Python values, and the JSON shapes of responses,
stream chunks and errors.  No HTTP and no engine here: ``app.py`` does the plumbing.

Validation is written out by hand rather than generated from a schema so every message can say exactly what is
wrong and how to fix it, with the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``:

* 400 — malformed JSON, wrong types, values out of range, an empty or too-long prompt;
* 401 — a missing or wrong API key;  404 — an unknown model name (or route);  413 — a body over the size limit;
* 422 — a well-formed field with a value pegainfer cannot honour yet (``n > 1``, penalties, images, ...):
  the message names the field;
* 503 (+ ``Retry-After``) — the waiting queue is full or the model is still loading.

Fields pegainfer does not know at all are ignored, as vLLM does (clients such as LangChain send extras).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

MAX_LOGPROBS = 20
MAX_CHOICES = 256                 # most choices (prompts × n) one request may ask for: each is a sequence in the batch
NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; OpenAI and vLLM clamp the same way


class APIError(Exception):
    """An error answered with the OpenAI error shape."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(422, f"'{param}': {message}", param, "unsupported_parameter")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------------------ field readers
def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)


class Fields:
    """Typed access to a JSON object's fields; each reader raises a 400 naming the field on a wrong type.
    ``null`` counts as absent everywhere, as in OpenAI's API."""

    def __init__(self, body: dict):
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def _wrong(self, name: str, want: str) -> APIError:
        return bad(f"'{name}' must be {want}, got {_type_name(self.body[name])}", name, "invalid_type")

    def int(self, name: str, default=None, lo: Optional[int] = None, hi: Optional[int] = None):
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            raise self._wrong(name, "an integer")
        v = int(v)
        if lo is not None and v < lo:
            raise bad(f"'{name}' must be at least {lo}, got {v}", name)
        if hi is not None and v > hi:
            raise bad(f"'{name}' must be at most {hi}, got {v}", name)
        return v

    def number(self, name: str, default=None) -> Optional[float]:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._wrong(name, "a number")
        if not math.isfinite(v):
            raise bad(f"'{name}' must be a finite number", name)
        return float(v)

    def bool(self, name: str, default: bool = False) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._wrong(name, "a boolean")
        return v

    def str(self, name: str, default=None) -> Optional[str]:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._wrong(name, "a string")
        return v

    def dict(self, name: str) -> Optional[dict]:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self._wrong(name, "an object")
        return v

    def int_list(self, name: str) -> list[int]:
        v = self.body.get(name)
        if v is None:
            return []
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise self._wrong(name, "an array of integers")
        if any(x < 0 for x in v):
            raise bad(f"'{name}' holds a negative token id", name)
        return list(v)


# ------------------------------------------------------------------------------------------------ requests
@dataclass
class Sampling:
    """The sampling fields shared by both endpoints, before defaults are filled in (None = not set)."""

    max_tokens: Optional[int]
    temperature: Optional[float]
    top_p: Optional[float]
    top_k: Optional[int]
    min_p: Optional[float]
    seed: Optional[int]
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: Optional[int]          # None → off; N → chosen token + top N
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None   # None → the model's generation_config.json, else 1
    logit_bias: dict = field(default_factory=dict)   # token id → bias
    prompt_logprobs: Optional[int] = None   # the prompt's tokens' logprobs, top N (echo with logprobs, or asked)
    return_prompt_logprobs: bool = False    # vLLM's ``prompt_logprobs`` field: return them as its own field
    allowed_token_ids: list[int] = field(default_factory=list)   # vLLM's: only these tokens may be drawn
    skip_special_tokens: bool = True       # vLLM's: False writes special tokens in the text
    include_stop_str_in_output: bool = False   # vLLM's: keep the stop string that ended the text
    priority: int = 0                      # vLLM's: with --scheduling-policy priority, lower runs first
    truncate_prompt_tokens: Optional[int] = None   # vLLM's: keep only the prompt's last k tokens
    bad_words: list[str] = field(default_factory=list)   # vLLM's: words the output must not contain


@dataclass
class CompletionRequest:
    model: Optional[str]
    prompts: list[tuple[Optional[str], Optional[list[int]]]]   # each prompt: (text, None) or (None, token ids)
    sampling: Sampling
    echo: bool
    stream: bool
    include_usage: bool
    n: int = 1
    response_format: Optional["ResponseFormat"] = None
    continuous_usage: bool = False   # stream_options.continuous_usage_stats: usage so far in every chunk


@dataclass
class ResponseFormat:
    """What the output must follow (beyond tool calls): ``kind`` "json_object" (any JSON object), "json_schema"
    (``schema``), "regex" (``pattern``), "choice" (one of ``choices``) or "grammar" (a Lark ``grammar`` as
    llguidance reads it); ``param``: the request field that asked for it (for error messages)."""

    kind: str
    schema: Optional[dict] = None
    name: Optional[str] = None
    pattern: Optional[str] = None
    choices: Optional[list] = None
    grammar: Optional[str] = None
    param: str = "response_format"


@dataclass
class ChatRequest:
    model: Optional[str]
    messages: list[dict]
    sampling: Sampling
    stream: bool
    include_usage: bool
    add_generation_prompt: bool
    template_kwargs: dict = field(default_factory=dict)
    tools: Optional[list[dict]] = None          # OpenAI tool objects ({"type": "function", "function": {...}})
    tool_choice: Any = "none"                   # "none" | "auto" | "required" | {"name": ...} (one function)
    parallel_tool_calls: bool = True
    response_format: Optional[ResponseFormat] = None
    n: int = 1
    continuous_usage: bool = False   # stream_options.continuous_usage_stats: usage so far in every chunk
    continue_final_message: bool = False   # vLLM's: the last (assistant) message is continued, not answered

    def tool_schemas(self) -> dict[str, dict]:
        """Function name → its ``parameters`` schema, for the tools the model may call."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools or ()}


# value-neutral settings of fields pegainfer does not implement: anything else is a 422 naming the field
_UNSUPPORTED_COMMON = {
    "length_penalty": (lambda v: v == 1, "beam search is not implemented; leave it 1"),
    "use_beam_search": (lambda v: v is False, "beam search is not implemented"),
}
_UNSUPPORTED_COMPLETION = {
    "suffix": (lambda v: v == "", "insertion (suffix) is not supported by these models"),
}
_UNSUPPORTED_CHAT = {
    "functions": (lambda v: v == [], "the legacy 'functions' field is not supported: send 'tools'"),
    "function_call": (lambda v: v in ("none", "auto"), "the legacy 'function_call' field is not supported: send "
                                                       "'tool_choice'"),
    "audio": (lambda v: False, "audio output is not supported"),
    "modalities": (lambda v: v == ["text"], "only text output is supported"),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "web_search_options": (lambda v: False, "web search is not supported"),
    "echo": (lambda v: v is False, "echo is not supported for chat completions"),
}


def _check_unsupported(body: dict, table: dict) -> None:
    for name, (neutral, why) in table.items():
        v = body.get(name)
        if v is not None and not neutral(v):
            raise unsupported(name, why)


def _parse_n(f: Fields) -> int:
    """``n``: choices to generate (each a sequence of its own in the engine); ``best_of`` only as 1 or ``n``."""
    n = f.int("n", 1, lo=1, hi=MAX_CHOICES)
    best_of = f.int("best_of", 1, lo=1)
    if best_of not in (1, n):
        raise unsupported("best_of", f"best_of={best_of}: ranking more candidates than the {n} choices returned "
                                     f"is not implemented; ask for n={best_of} and pick among them")
    return n


def _parse_stop(f: Fields) -> list[str]:
    v = f.body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"'stop' must be a string or an array of strings, got {_type_name(f.body['stop'])}", "stop",
                  "invalid_type")
    return [s for s in v if s]


def _parse_stream(f: Fields) -> tuple[bool, bool, bool]:
    """(stream, include_usage: a usage chunk at the end, continuous_usage_stats: vLLM's usage so far in every
    chunk too)."""
    stream = f.bool("stream")
    opts = f.dict("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        o = Fields(opts)
        include_usage = o.bool("include_usage")
        continuous = include_usage and o.bool("continuous_usage_stats")
    return stream, include_usage, continuous


def _parse_sampling(f: Fields, max_tokens: Optional[int], logprobs: Optional[int]) -> Sampling:
    temperature = f.number("temperature")
    if temperature is not None and temperature < 0:
        raise bad(f"'temperature' must be >= 0 (0 means greedy), got {temperature:g}", "temperature")
    top_p = f.number("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p:g}", "top_p")
    top_k = f.int("top_k", lo=-1)
    min_p = f.number("min_p")
    if min_p is not None and not 0 <= min_p <= 1:
        raise bad(f"'min_p' must be in [0, 1], got {min_p:g}", "min_p")
    seed = f.int("seed", lo=-(1 << 63), hi=(1 << 64) - 1)
    min_tokens = f.int("min_tokens", 0, lo=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad(f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({max_tokens})", "min_tokens")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = f.number(name)
        if v is not None and not -2 <= v <= 2:
            raise bad(f"'{name}' must be in [-2, 2] (0 is off), got {v:g}", name)
        penalties[name] = 0.0 if v is None else float(v)
    repetition_penalty = f.number("repetition_penalty")
    if repetition_penalty is not None and not 0 < repetition_penalty <= 10:
        raise bad(f"'repetition_penalty' must be in (0, 10] (1 is off), got {repetition_penalty:g}",
                  "repetition_penalty")
    prompt_logprobs = f.int("prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
    if prompt_logprobs is not None and f.bool("stream"):
        raise unsupported("prompt_logprobs", "prompt_logprobs is returned with whole answers only: drop 'stream'")
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                    seed=seed, stop=_parse_stop(f), stop_token_ids=f.int_list("stop_token_ids"),
                    ignore_eos=f.bool("ignore_eos"), min_tokens=min_tokens, logprobs=logprobs,
                    repetition_penalty=repetition_penalty, logit_bias=_parse_logit_bias(f),
                    prompt_logprobs=prompt_logprobs, return_prompt_logprobs=prompt_logprobs is not None,
                    allowed_token_ids=f.int_list("allowed_token_ids"),
                    skip_special_tokens=f.bool("skip_special_tokens", True),
                    include_stop_str_in_output=f.bool("include_stop_str_in_output"),
                    priority=f.int("priority", 0, lo=-(1 << 31), hi=(1 << 31) - 1),
                    truncate_prompt_tokens=f.int("truncate_prompt_tokens", lo=1), bad_words=_parse_bad_words(f),
                    **penalties)


def _parse_bad_words(f: Fields) -> list[str]:
    v = f.body.get("bad_words")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(w, str) and w.strip() for w in v):
        raise bad("'bad_words' must be an array of non-empty strings", "bad_words", "invalid_type")
    return list(v)


def _parse_logit_bias(f: Fields) -> dict[int, float]:
    """``logit_bias``: an object from token ids (as strings, as JSON has it) to biases in [-100, 100]."""
    from pegainfer.kernels.penalties import MAX_LOGIT_BIAS
    v = f.dict("logit_bias")
    if not v:
        return {}
    if len(v) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' has {len(v)} entries; at most {MAX_LOGIT_BIAS} are accepted", "logit_bias")
    out = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except ValueError:
            raise bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if token < 0:
            raise bad(f"'logit_bias' holds a negative token id {token}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r} for token {token}",
                      "logit_bias")
        out[token] = float(bias)
    return out


def parse_completion_request(body: dict) -> CompletionRequest:
    f = Fields(body)
    model = f.str("model")
    n = _parse_n(f)
    _check_unsupported(body, _UNSUPPORTED_COMMON)
    _check_unsupported(body, _UNSUPPORTED_COMPLETION)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required", "prompt", "missing_required_parameter")
    prompts = _parse_prompts(body["prompt"])
    if len(prompts) * n > MAX_CHOICES:
        raise bad(f"{len(prompts)} prompts × n={n} is {len(prompts) * n} choices; at most {MAX_CHOICES} per request",
                  "prompt")
    max_tokens = f.int("max_tokens", lo=1)
    if isinstance(body.get("logprobs"), bool):
        raise bad("'logprobs' must be an integer (the number of top tokens, 0-20) for /v1/completions",
                  "logprobs", "invalid_type")
    logprobs = f.int("logprobs", lo=0, hi=MAX_LOGPROBS)
    echo = f.bool("echo")
    stream, include_usage, continuous_usage = _parse_stream(f)
    f.str("user")
    sampling = _parse_sampling(f, max_tokens, logprobs)
    if echo and logprobs is not None:   # the echoed prompt's tokens come with their logprobs, as OpenAI's did
        sampling.prompt_logprobs = max(logprobs, sampling.prompt_logprobs or 0)
    return CompletionRequest(model, prompts, sampling, echo, stream, include_usage, n, _parse_output_format(body),
                             continuous_usage)


def _is_id_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _parse_prompt(p) -> tuple[Optional[str], Optional[list[int]]]:
    """One prompt: a string, or an array of token ids."""
    if isinstance(p, str):
        if p == "":
            raise bad("'prompt' is empty: send some text or token ids", "prompt", "empty_prompt")
        return p, None
    if not isinstance(p, list) or not _is_id_list(p):
        raise bad(f"'prompt' must be a string, an array of token ids, or an array of either; got {_type_name(p)}",
                  "prompt", "invalid_type")
    if len(p) == 0:
        raise bad("'prompt' is empty: send some text or token ids", "prompt", "empty_prompt")
    if any(x < 0 for x in p):
        raise bad("'prompt' holds a negative token id", "prompt")
    return None, list(p)


def _parse_prompts(p) -> list[tuple[Optional[str], Optional[list[int]]]]:
    """``prompt``: one prompt (a string or token ids) or a batch of them (an array of strings or of token-id
    arrays), as OpenAI's API has it."""
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        return [_parse_prompt(x) for x in p]
    return [_parse_prompt(p)]


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _message_text(content, i: int) -> Optional[str]:
    """OpenAI content: a string, null, or an array of parts; text parts are joined with newlines."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"messages[{i}].content must be a string or an array of content parts, got "
                  f"{_type_name(content)}", f"messages[{i}].content", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(kind, str) and kind not in ("text", "input_text"):
            raise unsupported(f"messages[{i}].content[{j}]",
                              f"'{kind}' content is not supported: pegainfer serves text-only models")
        else:
            raise bad(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}}",
                      f"messages[{i}].content[{j}]", "invalid_type")
    return "\n".join(texts)


def _parse_messages(v) -> list[dict]:
    if v is None:
        raise bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(v, list):
        raise bad(f"'messages' must be an array of messages, got {_type_name(v)}", "messages", "invalid_type")
    if not v:
        raise bad("'messages' is empty: send at least one message", "messages", "empty_prompt")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object, got {_type_name(m)}", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}", f"messages[{i}].role")
        content = _message_text(m.get("content"), i)
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise bad(f"messages[{i}].content is required for a {role} message", f"messages[{i}].content",
                      "missing_required_parameter")
        msg = {k: val for k, val in m.items() if val is not None}
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = content if content is not None else ""
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _history_tool_calls(m["tool_calls"], i)
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise bad(f"messages[{i}].tool_call_id must be a string", f"messages[{i}].tool_call_id", "invalid_type")
        out.append(msg)
    return out


def _history_tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's ``tool_calls`` for the chat template: OpenAI sends ``arguments`` as JSON text; the
    templates want the object (Qwen3.5's iterates over its items), as vLLM passes it."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(f"{where} must be an array of tool calls, got {_type_name(calls)}", where, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{at} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": "
                      f"...}}}}", at, "invalid_type")
        if call.get("type", "function") != "function":
            raise bad(f"{at}.type must be \"function\", got {call.get('type')!r}", f"{at}.type")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise bad(f"{at}.function.arguments is not valid JSON ({e}): send the arguments object as JSON "
                          f"text", f"{at}.function.arguments") from None
        if not isinstance(args, dict):
            raise bad(f"{at}.function.arguments must be a JSON object", f"{at}.function.arguments", "invalid_type")
        entry = {k: v for k, v in call.items() if v is not None}
        entry["type"] = "function"
        entry["function"] = {**fn, "arguments": args}
        out.append(entry)
    return out


# ------------------------------------------------------------------------------------------------ tools, formats
def _parse_tools(v) -> Optional[list[dict]]:
    """``tools``: function tools with a JSON-schema ``parameters`` object.  An empty list is no tools."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad(f"'tools' must be an array of tools, got {_type_name(v)}", "tools", "invalid_type")
    names = set()
    for i, tool in enumerate(v):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"{at} must be an object, got {_type_name(tool)}", at, "invalid_type")
        if tool.get("type") != "function":
            raise bad(f"{at}.type must be \"function\" (the only kind of tool a chat model can call), got "
                      f"{tool.get('type')!r}", f"{at}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{at}.function must be an object with 'name' and 'parameters'", f"{at}.function",
                      "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not name or any(c.isspace() or c in "<>\"" for c in name):
            raise bad(f"{at}.function.name must be a non-empty name without spaces, quotes or angle brackets, got "
                      f"{name!r}", f"{at}.function.name")
        if name in names:
            raise bad(f"{at}.function.name {name!r} is used by an earlier tool: names must be unique",
                      f"{at}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{at}.function.parameters must be a JSON schema object, got {_type_name(params)}",
                      f"{at}.function.parameters", "invalid_type")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{at}.function.description must be a string", f"{at}.function.description", "invalid_type")
    return list(v) or None


def _parse_tool_choice(v, tools: Optional[list[dict]]):
    """``tool_choice``: "none", "auto", "required", or {"type": "function", "function": {"name": ...}}; the
    default is "auto" with tools and "none" without.  Returns the string or {"name": ...}."""
    if v is None:
        return "auto" if tools else "none"
    if isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise bad(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                      f"\"function\": {{\"name\": ...}}}}, got {v!r}", "tool_choice")
        if v == "required" and not tools:
            raise bad("'tool_choice' \"required\" needs 'tools': send the tools the model must choose from",
                      "tool_choice")
        return v
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                  "\"function\": {\"name\": ...}}", "tool_choice", "invalid_type")
    known = [t["function"]["name"] for t in tools or ()]
    if name not in known:
        raise bad(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                  f"({', '.join(map(repr, known)) or 'none given'})", "tool_choice")
    return {"name": name}


def _parse_response_format(v) -> Optional[ResponseFormat]:
    """``response_format``: {"type": "text"} (the default), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}.  The schema itself is checked by the grammar compiler."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad(f"'response_format' must be an object, got {_type_name(v)}", "response_format", "invalid_type")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict):
            raise bad("'response_format.json_schema' must be an object with 'name' and 'schema'",
                      "response_format.json_schema", "invalid_type")
        schema = spec.get("schema", {})
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise bad(f"'response_format.json_schema.schema' must be a JSON schema object, got "
                      f"{_type_name(schema)}", "response_format.json_schema.schema", "invalid_type")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise bad("'response_format.json_schema.name' must be a string", "response_format.json_schema.name",
                      "invalid_type")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise bad("'response_format.json_schema.strict' must be a boolean",
                      "response_format.json_schema.strict", "invalid_type")
        return ResponseFormat("json_schema", schema, name, param="response_format.json_schema.schema")
    raise bad(f"'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}",
              "response_format.type")


STRUCTURED_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}
"""``structured_outputs``' fields (vLLM's) and the kind each asks for; the older ``guided_<field>`` names too."""
STRUCTURED_IGNORED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern", "backend")
"""Fields that tune a backend's behaviour: accepted and ignored (JSON is always written compactly here)."""


def _structured_value(kind: str, v, param: str) -> ResponseFormat:
    """One ``structured_outputs`` / ``guided_*`` field as a ``ResponseFormat``."""
    if kind == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise bad(f"'{param}' is a string that is not JSON ({e})", param) from None
        if not isinstance(v, dict):
            raise bad(f"'{param}' must be a JSON schema object, got {_type_name(v)}", param, "invalid_type")
        return ResponseFormat("json_schema", schema=v, param=param)
    if kind == "json_object":
        return ResponseFormat("json_object", param=param)
    if kind in ("regex", "grammar"):
        if not isinstance(v, str) or not v:
            raise bad(f"'{param}' must be a non-empty string", param, "invalid_type")
        return ResponseFormat(kind, param=param, **({"pattern": v} if kind == "regex" else {"grammar": v}))
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise bad(f"'{param}' must be a non-empty array of non-empty strings", param, "invalid_type")
    return ResponseFormat("choice", choices=list(v), param=param)


def _parse_output_format(body: dict) -> Optional[ResponseFormat]:
    """What the output must follow: ``response_format`` (OpenAI's), ``structured_outputs`` (vLLM's: one of
    ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) or vLLM's older ``guided_json`` /
    ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; at most one of them."""
    found = []
    rf = _parse_response_format(body.get("response_format"))
    if rf is not None:
        found.append(rf)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad(f"'structured_outputs' must be an object, got {_type_name(so)}", "structured_outputs",
                      "invalid_type")
        unknown = set(so) - set(STRUCTURED_KINDS) - set(STRUCTURED_IGNORED)
        if unknown:
            raise unsupported("structured_outputs", f"structured_outputs.{sorted(unknown)[0]} is not offered; "
                                                    f"use one of {', '.join(STRUCTURED_KINDS)}")
        for field_name, kind in STRUCTURED_KINDS.items():
            v = so.get(field_name)
            if v is not None and v is not False:
                found.append(_structured_value(kind, v, f"structured_outputs.{field_name}"))
    for field_name, kind in STRUCTURED_KINDS.items():
        v = body.get(f"guided_{field_name}")
        if v is not None and v is not False:
            found.append(_structured_value(kind, v, f"guided_{field_name}"))
    if len(found) > 1:
        raise bad(f"ask for one output format, not several: {', '.join(f.param for f in found)}", found[1].param)
    return found[0] if found else None


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _reasoning_kwargs(effort: Optional[str]) -> dict:
    """OpenAI's ``reasoning_effort`` as chat-template arguments: passed on as ``reasoning_effort`` (as vLLM does, for
    templates that read it), and "none" / "minimal" also turn Qwen3's thinking off (``enable_thinking``: false),
    unless ``chat_template_kwargs`` says otherwise."""
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise bad(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                  "reasoning_effort")
    return {"reasoning_effort": effort, **({"enable_thinking": False} if effort in ("none", "minimal") else {})}


def parse_chat_request(body: dict) -> ChatRequest:
    f = Fields(body)
    model = f.str("model")
    n = _parse_n(f)
    _check_unsupported(body, _UNSUPPORTED_COMMON)
    _check_unsupported(body, _UNSUPPORTED_CHAT)
    messages = _parse_messages(body.get("messages"))
    max_tokens = f.int("max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = f.int("max_tokens", lo=1)
    want_logprobs = f.bool("logprobs")
    top = f.int("top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top is not None and top > 0 and not want_logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    stream, include_usage, continuous_usage = _parse_stream(f)
    kwargs = f.dict("chat_template_kwargs") or {}
    reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(kwargs)
    if reserved:
        raise bad(f"'chat_template_kwargs' must not set {sorted(reserved)}: use the request fields",
                  "chat_template_kwargs")
    kwargs = {**_reasoning_kwargs(f.str("reasoning_effort")), **kwargs}
    f.str("user")
    tools = _parse_tools(body.get("tools"))
    continue_final = f.bool("continue_final_message")
    if continue_final:
        if messages[-1].get("role") != "assistant":
            raise bad("'continue_final_message' needs the last message to be the assistant's (the text to continue)",
                      "continue_final_message")
        if body.get("add_generation_prompt") is True:
            raise bad("'continue_final_message' and 'add_generation_prompt' cannot both be true: a continued message "
                      "has no new turn", "continue_final_message")
    return ChatRequest(model, messages, _parse_sampling(f, max_tokens, logprobs), stream, include_usage,
                       f.bool("add_generation_prompt", not continue_final), dict(kwargs), tools,
                       _parse_tool_choice(body.get("tool_choice"), tools), f.bool("parallel_tool_calls", True),
                       _parse_output_format(body), n, continuous_usage, continue_final)


@dataclass
class TokenizeRequest:
    """``POST /tokenize`` (vLLM's): a ``prompt`` as /v1/completions encodes it, or ``messages`` rendered with the
    chat template as /v1/chat/completions does."""
    model: Optional[str]
    prompt: Optional[str]
    messages: Optional[list[dict]]
    add_special_tokens: bool
    add_generation_prompt: bool
    template_kwargs: dict
    tools: Optional[list[dict]]
    return_token_strs: bool


def parse_tokenize_request(body: dict) -> TokenizeRequest:
    f = Fields(body)
    model = f.str("model")
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad("send either 'prompt' (text) or 'messages' (a chat)", "prompt" if has_prompt else "messages",
                  None if has_prompt else "missing_required_parameter")
    prompt = f.str("prompt") if has_prompt else None
    messages = _parse_messages(body["messages"]) if has_messages else None
    kwargs = f.dict("chat_template_kwargs") or {}
    return TokenizeRequest(model, prompt, messages, f.bool("add_special_tokens", has_prompt),
                           f.bool("add_generation_prompt", True), dict(kwargs), _parse_tools(body.get("tools")),
                           f.bool("return_token_strs"))


def parse_detokenize_request(body: dict) -> tuple[Optional[str], list[int]]:
    """``POST /detokenize`` (vLLM's): (model, token ids)."""
    f = Fields(body)
    model = f.str("model")
    if body.get("tokens") is None:
        raise bad("'tokens' is required: an array of token ids", "tokens", "missing_required_parameter")
    return model, f.int_list("tokens")


# ------------------------------------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(x: float) -> float:
    return max(float(x), NEG_INF_LOGPROB) if x == x else NEG_INF_LOGPROB


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer, text_offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict] = []
        self.text_offset: list[int] = []

    def add_prompt(self, entries, prompt_ids) -> dict:
        """Append the echoed prompt's entries (``RequestOutput.prompt_logprobs``: None for its first token, which
        has no logprob); return the object for just these."""
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if entries:
            s = self.tokenizer.token_str(prompt_ids[0])
            for key, val in (("tokens", s), ("token_logprobs", None), ("top_logprobs", None),
                             ("text_offset", self.offset)):
                part[key].append(val)
                getattr(self, key).append(val)
            self.offset += len(s)
            for key, val in self.add(entries[1:]).items():
                part[key] += val
        return part

    def add(self, entries) -> dict:
        """Append TokenLogprob entries; return the object for just these (for a stream chunk)."""
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries or ():
            s = self.tokenizer.token_str(e.token_id)
            top = {s: _lp(e.logprob)}
            for tid, lp in e.top:
                top.setdefault(self.tokenizer.token_str(tid), _lp(lp))
            for key, val in (("tokens", s), ("token_logprobs", _lp(e.logprob)), ("top_logprobs", top),
                             ("text_offset", self.offset)):
                part[key].append(val)
                getattr(self, key).append(val)
            self.offset += len(s)
        return part

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def prompt_logprobs_json(tokenizer, entries) -> list[Optional[dict]]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {"logprob", "rank",
    "decoded_token"}}`` for the token itself and the top N (ranked 1 .. N)."""
    out: list[Optional[dict]] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": _lp(lp), "rank": k + 1, "decoded_token": tokenizer.token_str(t)}
             for k, (t, lp) in enumerate(e.top)}
        d[str(e.token_id)] = {"logprob": _lp(e.logprob), "rank": e.rank,
                              "decoded_token": tokenizer.token_str(e.token_id)}
        out.append(d)
    return out


def chat_logprobs(tokenizer, entries, top_n: int) -> list[dict]:
    """Chat ``logprobs.content`` entries: token, logprob, bytes, top_logprobs."""
    out = []
    for e in entries or ():
        top = [{"token": tokenizer.token_str(t), "logprob": _lp(lp), "bytes": list(tokenizer.token_bytes(t))}
               for t, lp in e.top[:top_n]]
        out.append({"token": tokenizer.token_str(e.token_id), "logprob": _lp(e.logprob),
                    "bytes": list(tokenizer.token_bytes(e.token_id)), "top_logprobs": top})
    return out


def now() -> int:
    return int(time.time())
