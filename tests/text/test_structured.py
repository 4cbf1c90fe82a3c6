"""Grammars of structured output on their own (no engine): random token walks through the allowed-token masks --
the worst case of a model, any allowed token at any step -- always give JSON that parses and validates against its
schema once the grammar is complete, over many seeds; forced tool calls parse as calls of the right tool with
valid arguments; the think phases; schemas the grammar engine refuses come back as messages."""
import json

import numpy as np
import pytest

from pegainfer.text.structured import GrammarCompiler, TokenConstraint, fill_masks
from pegainfer.text.tokenizer import Tokenizer
from pegainfer.text.tool_calls import parse_tool_calls
from tests.text.fixtures import make_model_folder
from tests.text.schema_check import errors

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "color": {"enum": ["red", "green", "blue"]},
    "tag": {"type": "string", "maxLength": 3},
    "pair": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
}, "required": ["ok", "n", "color", "tag", "pair"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
                                                                                         "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"],
        "additionalProperties": False}
SEEDS = 60


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    tok = Tokenizer.from_folder(make_model_folder(tmp_path_factory.mktemp("structured")))
    return GrammarCompiler(tok, tok.vocab_size + 20, [tok.eos_token_id])   # an embedding with spare rows


def walk(compiler, grammar, seed, max_tokens=400, after_think="no"):
    """Draw uniformly among the allowed tokens until the grammar is complete; returns (text, complete)."""
    rng = np.random.default_rng(seed)
    c = compiler.constraint(grammar, after_think)
    bitmask = np.zeros((2, -(-compiler.vocab_size // 32)), np.int32)
    ids = []
    for _ in range(max_tokens):
        fill_masks([(c, 1)], bitmask)
        allowed = np.flatnonzero(np.unpackbits(bitmask[1].view(np.uint8), bitorder="little")[:compiler.vocab_size])
        token = int(rng.choice(allowed))
        assert c.accept(token), c.error
        ids.append(token)
        if c.finished or token in compiler.eos_token_ids:
            break
    return compiler.tokenizer.decode(ids), c.finished


def test_json_schema_walks_always_parse_and_validate(compiler):
    grammar = compiler.json_schema(SCHEMA)
    assert compiler.check(grammar) is None
    for seed in range(SEEDS):
        text, complete = walk(compiler, grammar, seed)
        assert complete, text
        value = json.loads(text)
        assert errors(value, SCHEMA) == [], (seed, text)
        assert text == json.dumps(value, ensure_ascii=False)      # one line, Python's separators


def test_json_object_walks_parse_when_complete(compiler):
    grammar = compiler.json_object()
    complete = 0
    for seed in range(SEEDS):
        text, done = walk(compiler, grammar, seed, max_tokens=60)
        if done:
            assert isinstance(json.loads(text), dict), text
            complete += 1
        else:
            assert text.startswith("{")
    assert complete > 0


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_calls_parse_with_valid_arguments(compiler, parallel):
    tools = {"get_weather": WEATHER, "note": NOTE}
    grammar = compiler.tool_calls(tools, parallel)
    several = 0
    for seed in range(SEEDS):
        text, complete = walk(compiler, grammar, seed)
        content, calls = parse_tool_calls(text, tools)
        assert calls, text       # complete, or ended by EOS once a call was (or, parallel, cut within a later call)
        assert content is None or (parallel and not complete and content.startswith("<tool_call")), text
        assert len(calls) == 1 or parallel
        several += len(calls) > 1
        for call in calls:
            assert errors(json.loads(call.arguments), tools[call.name]) == [], text
    assert several > 0 or not parallel


WRITE = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 6}, "lines": {"type": "array", "items":
                                                                               {"type": "integer"}, "maxItems": 3},
                                         "append": {"type": "boolean"}},
         "required": ["path"], "additionalProperties": False}


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_calls_in_the_xml_form_parse_with_valid_arguments(compiler, parallel):
    """Qwen3.5's form (``xml``): random walks give calls the parser reads back (``<function=...>`` with
    ``<parameter=...>`` elements), each of a known tool with arguments valid for its schema -- enum strings,
    integers in range, free one-line strings, arrays and booleans as JSON, optional arguments sometimes left out."""
    tools = {"get_weather": WEATHER, "write": WRITE}
    grammar = compiler.tool_calls(tools, parallel, xml=True)
    names, optional_seen, several = set(), 0, 0
    for seed in range(SEEDS):
        text, complete = walk(compiler, grammar, seed)
        assert "<function=" in text, text
        content, calls = parse_tool_calls(text, tools)
        assert calls, text
        assert content is None or (parallel and not complete and content.startswith("<tool_call")), text
        several += len(calls) > 1
        for call in calls:
            args = json.loads(call.arguments)
            assert errors(args, tools[call.name]) == [], (text, args)
            names.add(call.name)
            optional_seen += call.name == "write" and "lines" in args
    assert names == {"get_weather", "write"} and optional_seen > 0 and (several > 0 or not parallel)


def test_json_or_tool_calls(compiler):
    grammar = compiler.json_or_tool_calls(NOTE, {"get_weather": WEATHER})
    kinds = set()
    for seed in range(SEEDS):
        text, _ = walk(compiler, grammar, seed)
        content, calls = parse_tool_calls(text, {"get_weather": WEATHER})
        if calls:
            kinds.add("calls")
            assert all(errors(json.loads(c.arguments), WEATHER) == [] for c in calls)
        else:
            kinds.add("json")
            assert errors(json.loads(content), NOTE) == []
    assert kinds == {"calls", "json"}


def test_think_phases(compiler):
    tok = compiler.tokenizer
    think_open, think_close = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    grammar = compiler.json_schema(NOTE)
    bitmask = np.zeros((1, -(-compiler.vocab_size // 32)), np.int32)

    def allowed(c):
        fill_masks([(c, 0)], bitmask)
        return set(np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")).tolist())

    c = compiler.constraint(grammar, "if_opened")                 # the output may open a think block
    assert c.masks and think_open in allowed(c) and tok.encode("{")[0] in allowed(c)
    assert c.accept(think_open) and not c.masks                   # thinking: free text until </think>
    assert c.accept(tok.encode("hmm")[0]) and not c.masks
    assert c.accept(think_close) and c.masks and think_open not in allowed(c)
    c = compiler.constraint(grammar, "if_opened")                 # ... or answers at once
    assert c.accept(tok.encode("{")[0]) and think_open not in allowed(c)
    c = compiler.constraint(grammar, "yes")                       # the prompt opened the block
    assert not c.masks and c.accept(think_open) and not c.masks and c.accept(think_close) and c.masks
    c = compiler.constraint(grammar)                              # from the first token
    assert think_open not in allowed(c) and not c.accept(think_open) and c.error
    assert isinstance(c, TokenConstraint)


@pytest.mark.parametrize("schema,says", [
    ({"type": "foo"}, "foo"),
    ({"type": "string", "format": "telepathy"}, "telepathy"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"$ref": "#/definitions/missing"}, "missing"),
    ({"type": "integer", "minimum": "one"}, "minimum"),
])
def test_schemas_the_engine_cannot_follow_are_explained(compiler, schema, says):
    error = compiler.check(compiler.json_schema(schema))
    assert error and says in error and "\n" not in error


def test_an_eos_id_past_the_tokenizer_is_left_out(compiler):
    """A folder whose generation config names an end-of-sequence id past its tokenizer's vocabulary (a random-weight
    folder with a small tokenizer and Qwen3's 151645) still gets grammars: llguidance is given only the ids the
    tokenizer knows (it refuses the folder otherwise, and every structured request would fail)."""
    tok = compiler.tokenizer
    far = GrammarCompiler(tok, 151936, [151645, tok.eos_token_id])
    text, complete = walk(far, GrammarCompiler.json_schema(NOTE), seed=1)
    assert complete and not errors(json.loads(text), NOTE)


def test_an_llguidance_that_takes_one_eos_id(compiler, monkeypatch):
    """llguidance before 1.9 takes one end-of-sequence id, not a list (the GPU host's 1.6.1 raised a TypeError on
    every structured request): the compiler falls back to the first id and its grammars still work."""
    import llguidance
    real = llguidance.LLTokenizer

    def one_id_only(text, n_vocab=None, eos_token=None):
        if isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return real(text, n_vocab=n_vocab, eos_token=eos_token)

    monkeypatch.setattr(llguidance, "LLTokenizer", one_id_only)
    tok = compiler.tokenizer
    old = GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])
    text, complete = walk(old, GrammarCompiler.json_schema(NOTE), seed=2)
    assert complete and not errors(json.loads(text), NOTE)


def allowed_now(compiler, c) -> set[int]:
    bitmask = np.zeros((1, -(-compiler.vocab_size // 32)), np.int32)
    fill_masks([(c, 0)], bitmask)
    return set(np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:compiler.vocab_size]))


@pytest.mark.parametrize("with_eos", [False, True])
def test_allowed_tokens_mask_only_them_and_end_only_with_an_eos_among_them(compiler, with_eos):
    """``allowed_tokens``: at every step the mask is exactly the ids (the end-of-sequence id only when listed), and
    the grammar never completes on its own."""
    ids = [7, 11, 12] + ([compiler.eos_token_ids[0]] if with_eos else [])
    c = compiler.constraint(compiler.allowed_tokens(ids))
    for token in (7, 12, 11, 7):
        assert allowed_now(compiler, c) == set(ids)
        assert c.accept(token) and not c.finished
