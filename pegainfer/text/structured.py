"""Structured output: grammars that constrain decoding (JSON schemas, forced tool calls), compiled and followed by
llguidance.

Why llguidance: a Rust library with abi3 wheels and no PyTorch at run time (pegainfer has none); it computes one
row's allowed-token mask for a 152k-token vocabulary in tens of µs (a lexer over a token trie, an Earley parser,
vocabulary slices precomputed per tokenizer); it reads JSON Schema itself (and Lark grammars that embed JSON
schemas, which the tool-call grammar uses) and reports a schema it cannot follow as an error message instead of
guessing; it is maintained by the guidance project and used by vLLM and llama.cpp.

The pieces:

* ``GrammarCompiler`` -- one per tokenizer: llguidance's view of the vocabulary (``LLTokenizer``, built once from
  the folder's ``tokenizer.json``, sized to the model's embedding rows so the mask covers every id the model can
  emit), and the grammars a request asks for: ``json_schema``, ``json_object``, ``regex``, ``choice``, ``lark``,
  ``allowed_tokens``, ``tool_calls`` and ``json_or_tool_calls``; ``check`` returns why a grammar cannot be followed (None when it
  can).
* ``TokenConstraint`` -- one request's matcher.  The engine asks it for the row's mask before each step that
  samples the request's next token (``fill``) and hands it each token drawn (``accept``); the request ends when the
  grammar is complete (``finished``: nothing but EOS may follow).

JSON is written compactly on one line, ``{"a": 1, "b": [2, 3]}`` (the separators of Python's ``json.dumps``):
flexible whitespace would let a model pad forever.  A tool call is forced in the form the chat template teaches:
Qwen3's JSON, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, its arguments checked against the
tool's schema; or, for a template that writes ``<function=`` (Qwen3.5), the XML form, one ``<parameter=KEY>``
element an argument in the schema's order (the required ones always): a string argument raw text on one line
without ``<`` (of its ``minLength`` .. ``maxLength``), an enum of strings one of them, anything else one-line JSON
valid for its schema.  The tool-call parser reads both forms.

Thinking first: with a reasoning parser on, the grammar applies after the model's ``</think>`` -- from the first
token when the prompt closed the think block itself; after ``</think>`` when the prompt opened it; and when the
output may open one, the first token may also be ``<think>`` (then the grammar waits for ``</think>``).
"""
from __future__ import annotations

import json
import threading
from typing import Callable, Optional

import numpy as np

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
THINK_NO, THINK_YES, THINK_IF_OPENED = "no", "yes", "if_opened"   # SamplingParams.grammar_after_think


def grammar_after_think(start: str) -> str:
    """``SamplingParams.grammar_after_think`` of a chat answer that starts as ``start`` (``reasoning_start``):
    from the first token when it starts with the answer, after ``</think>`` when it starts thinking, after a
    ``</think>`` if it opens a ``<think>`` when either may come."""
    from pegainfer.text.reasoning import CONTENT, REASONING
    return {CONTENT: THINK_NO, REASONING: THINK_YES}.get(start, THINK_IF_OPENED)


def _styled(schema: dict) -> dict:
    """The schema with pegainfer's JSON style (a schema's own ``x-guidance`` options win)."""
    return {**schema, "x-guidance": {**JSON_STYLE, **(schema.get("x-guidance") or {})}}


def _arguments_schema(parameters: Optional[dict]) -> dict:
    """A tool's arguments: its ``parameters`` schema, an object in any case."""
    params = dict(parameters or {})
    if "type" not in params and not any(k in params for k in ("$ref", "anyOf", "oneOf", "allOf")):
        params["type"] = "object"
    return params


def _xml_value_rule(name: str, schema: dict) -> str:
    """Lark rule ``name`` for one argument's value in Qwen3.5's form: a string as raw text on one line without
    ``<``, of its ``minLength`` .. ``maxLength`` characters (an ``enum`` of strings as its choices), anything else as
    one-line JSON valid for its schema."""
    enum = schema.get("enum")
    if enum and all(isinstance(v, str) for v in enum):
        return f"{name}: " + " | ".join(json.dumps(v, ensure_ascii=False) for v in enum) + "\n"
    if schema.get("type") == "string" and not any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref")):
        low, high = max(1, int(schema.get("minLength", 1))), schema.get("maxLength")
        count = "+" if high is None and low == 1 else f"{{{low},{'' if high is None else int(high)}}}"
        return f"{name}: /[^<\\n]{count}/\n"
    return f"{name}: %json {json.dumps(_styled(schema), ensure_ascii=False)}\n"


def _xml_body_rules(tools: dict[str, Optional[dict]]) -> str:
    """Lark rule ``body`` of a call in Qwen3.5's form (``tool_calls.py``'s docstring): one function of ``tools``,
    its arguments as ``<parameter=KEY>`` elements in the schema's order, the required ones always, the others
    optionally."""
    rules, bodies = [], []
    for i, (name, params) in enumerate(tools.items()):
        schema = _arguments_schema(params)
        required = set(schema.get("required") or ())
        parts = []
        for k, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            value = f"v{i}_{k}"
            rules.append(_xml_value_rule(value, sub if isinstance(sub, dict) else {}))
            element = (f'"<parameter=" {json.dumps(key, ensure_ascii=False)} ">\\n" {value} '
                       f'"\\n</parameter>\\n"')
            parts.append(element if key in required else f"({element})?")
        rules.append(f'f{i}: "<function=" {json.dumps(name, ensure_ascii=False)} ">\\n" '
                     f'{" ".join(parts)} "</function>"\n')
        bodies.append(f"f{i}")
    return f"body: {' | '.join(bodies)}\n" + "".join(rules)


class GrammarCompiler:
    """Grammars for one tokenizer (module docstring).  Thread-safe: the server checks grammars in worker threads
    while the engine thread builds matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids] or (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        """llguidance's tokenizer (built at first use: about a second for a 152k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                # only end-of-sequence ids the tokenizer knows (a folder's generation config may name one past a
                # small tokenizer's vocabulary; a constrained request ends when its grammar does, not on EOS)
                eos = [t for t in self.eos_token_ids if t < self.tokenizer.vocab_size]
                if not eos and self.tokenizer.eos_token_id is not None:
                    eos = [self.tokenizer.eos_token_id]
                try:
                    self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                                                eos_token=eos)
                except TypeError:       # llguidance releases before 1.9 take one end-of-sequence id, not a list
                    self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                                                eos_token=eos[0] if eos else None)
            return self._ll_tokenizer

    # -------------------------------------------------------------------------------------------- grammars
    @staticmethod
    def json_schema(schema: dict) -> str:
        from llguidance import LLMatcher
        return LLMatcher.grammar_from_json_schema(_styled(schema))

    def json_object(self) -> str:
        return self.json_schema({"type": "object"})

    @staticmethod
    def regex(pattern: str) -> str:
        """Text matching ``pattern`` (llguidance's regex syntax, Rust's ``regex`` crate: anchored at both ends)."""
        from llguidance import LLMatcher
        return LLMatcher.grammar_from_regex(pattern)

    @staticmethod
    def choice(choices: list[str]) -> str:
        """Exactly one of ``choices``."""
        from llguidance import LLMatcher
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))

    def allowed_tokens(self, token_ids: list[int]) -> str:
        """Any sequence of ``token_ids`` (vLLM's ``allowed_token_ids``): the end of the sequence only when one of
        them is an end-of-sequence id (else it never completes: the request runs to max_tokens or a stop)."""
        from llguidance import LLMatcher
        ids = "<[" + ",".join(str(t) for t in sorted(set(token_ids))) + "]>"
        ends = bool(set(token_ids) & set(self.eos_token_ids))
        return LLMatcher.grammar_from_lark(f"start: {ids}*" if ends else f"start: t\nt: {ids} t")

    @staticmethod
    def lark(grammar: str) -> str:
        """A Lark grammar (llguidance's dialect: ``start`` is the top rule; ``%json`` embeds a JSON schema)."""
        from llguidance import LLMatcher
        return LLMatcher.grammar_from_lark(grammar)

    @staticmethod
    def _calls_rules(tools: dict[str, Optional[dict]], parallel: bool, xml: bool = False) -> str:
        """Lark rules ``calls`` (one call, or several on their own lines with ``parallel``) of the tools given, in
        Qwen3's JSON form, or with ``xml`` in Qwen3.5's (``_xml_body_rules``)."""
        repeat = ' ("\\n" call)*' if parallel else ""
        head = (f"calls: call{repeat}\n"
                f'call: "<tool_call>\\n" body "\\n</tool_call>"\n')
        if xml:
            return head + _xml_body_rules(tools)
        choices = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _arguments_schema(p)},
                    "required": ["name", "arguments"], "additionalProperties": False} for name, p in tools.items()]
        body = _styled({"anyOf": choices} if len(choices) > 1 else choices[0])
        return head + f"body: %json {json.dumps(body, ensure_ascii=False)}\n"

    def tool_calls(self, tools: dict[str, Optional[dict]], parallel: bool = True, xml: bool = False) -> str:
        """Calls (at least one) of ``tools`` (name → ``parameters`` schema), arguments valid for each tool; ``xml``:
        in Qwen3.5's form (for a chat template that teaches it)."""
        from llguidance import LLMatcher
        return LLMatcher.grammar_from_lark("start: calls\n" + self._calls_rules(tools, parallel, xml))

    def json_or_tool_calls(self, schema: dict, tools: dict[str, Optional[dict]], parallel: bool = True,
                           xml: bool = False) -> str:
        """Either JSON valid for ``schema`` or calls of ``tools``: a ``response_format`` with ``tool_choice`` auto."""
        from llguidance import LLMatcher
        return LLMatcher.grammar_from_lark(f"start: answer | calls\nanswer: %json "
                                           f"{json.dumps(_styled(schema), ensure_ascii=False)}\n" +
                                           self._calls_rules(tools, parallel, xml))

    def check(self, grammar: str) -> Optional[str]:
        """Why llguidance cannot follow ``grammar`` (a one-line message), or None when it can."""
        from llguidance import LLMatcher
        error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        return " ".join(error.split()) or None

    def followable(self, what: str, make: Callable[[], str]) -> str:
        """The grammar ``make()`` builds, checked: a ``PegainferError`` "``what`` cannot be followed: why" when it
        cannot be built or followed (the command line's and the Python API's output formats)."""
        from pegainfer.errors import PegainferError
        try:
            grammar = make()
            error = self.check(grammar)
        except ValueError as e:
            error = str(e)
        if error:
            raise PegainferError(f"{what} cannot be followed: {error}")
        return grammar

    def constraint(self, grammar: str, after_think: str = THINK_NO) -> "TokenConstraint":
        """A fresh matcher for one request (raises ``ValueError`` when the grammar cannot be followed)."""
        from llguidance import LLMatcher
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        think_open = self.tokenizer.token_to_id("<think>")
        think_close = self.tokenizer.token_to_id("</think>")
        if think_open is None or think_close is None:
            after_think = THINK_NO
        return TokenConstraint(matcher, after_think, think_open, think_close)


class TokenConstraint:
    """One request's grammar state: which tokens may come next (``fill``), advanced by each token (``accept``)."""

    CONSTRAINED, THINKING, MAY_THINK = "constrained", "thinking", "may_think"

    def __init__(self, matcher, after_think: str = THINK_NO, think_open: Optional[int] = None,
                 think_close: Optional[int] = None):
        self.matcher = matcher
        self.phase = {THINK_NO: self.CONSTRAINED, THINK_YES: self.THINKING,
                      THINK_IF_OPENED: self.MAY_THINK}[after_think]
        self.think_open = think_open
        self.think_close = think_close

    @property
    def masks(self) -> bool:
        """Whether the next token is constrained (not while the model thinks)."""
        return self.phase != self.THINKING

    @property
    def extra_token(self) -> Optional[int]:
        """A token allowed besides the grammar's for the next step: ``<think>``, while the output may open one."""
        return self.think_open if self.phase == self.MAY_THINK else None

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed tokens of the next step into row ``row`` of ``bitmask`` ``[rows, words]`` int32."""
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self.matcher, bitmask, row)
        allow_bit(bitmask, row, self.extra_token)

    def accept(self, token: int) -> bool:
        """Advance by the drawn ``token``; False when the grammar rejects it (``error`` says why)."""
        if self.phase == self.THINKING:
            if token == self.think_close:
                self.phase = self.CONSTRAINED
            return True
        if self.phase == self.MAY_THINK:
            if token == self.think_open:
                self.phase = self.THINKING
                return True
            self.phase = self.CONSTRAINED
        return bool(self.matcher.consume_token(int(token)))

    @property
    def finished(self) -> bool:
        """The grammar is complete: no token but EOS may follow."""
        return self.phase == self.CONSTRAINED and self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def allow_bit(bitmask: np.ndarray, row: int, token: Optional[int]) -> None:
    """Also allow ``token`` (None: nothing) in row ``row`` of an int32 bitmask."""
    if token is not None:
        words = bitmask[row].view(np.uint32)
        words[token // 32] |= np.uint32(1) << np.uint32(token % 32)


def fill_masks(constraints: list[tuple["TokenConstraint", int]], bitmask: np.ndarray, executor=None) -> None:
    """Fill the bitmask rows of several constraints ``[(constraint, row)]``: on llguidance's thread pool
    (``executor``, an ``llguidance.LLExecutor``) when there are several, which computes them in parallel without
    the GIL."""
    grammars = [(c, row) for c, row in constraints if isinstance(c, TokenConstraint)]
    for c, row in constraints:
        if len(grammars) == 1 or executor is None or not isinstance(c, TokenConstraint):
            c.fill(bitmask, row)           # one grammar, or another kind of constraint (``text/bad_words.py``)
    if len(grammars) > 1 and executor is not None:
        from llguidance.numpy import fill_next_token_bitmask_par
        fill_next_token_bitmask_par(executor, [(c.matcher, row) for c, row in grammars], bitmask)
        for c, row in grammars:
            allow_bit(bitmask, row, c.extra_token)
