"""Constrained decoding in the engine (the real scheduler, runner, grammar-mask kernel and sampler over the hash
model of ``tiny_model.py``): a constrained request ends when its grammar is complete, with the same tokens whether
or not the engine schedules asynchronously; a step with constrained rows is launched ahead in two parts (its
forward pass before the previous tokens are read, its masks and sampler after), and unconstrained requests next to
it keep their exact token streams; max_tokens at the grammar's last token still
ends with "stop"; a grammar llguidance cannot follow is refused at add_request."""
from __future__ import annotations

import json

import pytest

from pegainfer.engine.types import SamplingParams
from pegainfer.errors import RequestError
from tests.engine.hash_engine import hash_engine
from tests.text.schema_check import errors

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def run(engine, requests):
    """Add ``requests`` [(id, prompt, params)], step until done; count the launches ahead and whether any held a
    constrained sequence.  Returns {id: (ids, text, finish reason)}."""
    engine.ahead = engine.ahead_constrained = 0
    launch, launch_forward = engine.runner.launch_decode, engine.runner.launch_forward_ahead

    def launch_decode(seqs, ahead=0, force_eager=False, rows_before=None):
        engine.ahead += ahead
        return launch(seqs, ahead=ahead, force_eager=force_eager, rows_before=rows_before)

    def launch_forward_ahead(seqs):
        engine.ahead_constrained += 1
        return launch_forward(seqs)
    engine.runner.launch_decode = launch_decode
    engine.runner.launch_forward_ahead = launch_forward_ahead
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            ids, text, reason = got.setdefault(out.request_id, ([], [], [None]))
            ids += out.new_token_ids
            text.append(out.delta_text)
            if out.finished:
                reason[0] = out.finish_reason
    assert engine.stats()["kv_pages_used"] == 0
    return {k: (ids, "".join(t), r[0]) for k, (ids, t, r) in got.items()}


@pytest.fixture(scope="module")
def engines():
    return hash_engine(max_batch=3, max_model_len=96), hash_engine(max_batch=3, max_model_len=96)


def test_same_streams_sync_and_async_and_constrained_steps_launch_ahead(engines):
    """Catches a mask computed from a stale token, or applied to the wrong step, when the forward pass of a
    constrained step goes ahead of the previous step's read: the same streams as the synchronous engine, valid
    JSON, and both kinds of launch ahead happen."""
    sync_engine, async_engine = engines
    sync_engine.async_scheduling = False
    grammar = sync_engine.grammar_compiler.json_schema(SCHEMA)
    requests = [("json-greedy", [1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar)),
                ("json-seeded", [4, 5], SamplingParams(max_tokens=40, temperature=1.0, seed=7, grammar=grammar)),
                ("free", [6, 7, 8], SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True))]
    sync = run(sync_engine, requests)
    overlapped = run(async_engine, requests)
    assert overlapped == sync
    assert async_engine.ahead > 0 and async_engine.ahead_constrained > 0
    for rid in ("json-greedy", "json-seeded"):
        ids, text, reason = sync[rid]
        assert reason == "stop" and errors(json.loads(text), SCHEMA) == [], text
    assert sync["free"][2] == "length" and len(sync["free"][0]) == 30


def test_max_tokens_at_the_last_token_of_the_grammar(engines):
    engine = engines[0]
    grammar = engine.grammar_compiler.json_schema({"type": "boolean"})
    params = SamplingParams(max_tokens=8, temperature=0.0, grammar=grammar)
    (ids, text, reason), = run(engine, [("b", [9], params)]).values()
    assert reason == "stop" and text in ("true", "false")
    exact = run(engine, [("b", [9], SamplingParams(max_tokens=len(ids), temperature=0.0, grammar=grammar))])
    assert exact["b"] == (ids, text, "stop")                   # complete: "stop", not "length"
    if len(ids) > 1:
        short = run(engine, [("b", [9], SamplingParams(max_tokens=len(ids) - 1, temperature=0.0, grammar=grammar))])
        assert short["b"][2] == "length" and text.startswith(short["b"][1])


def test_grammar_completion_ends_even_with_ignore_eos(engines):
    engine = engines[0]
    grammar = engine.grammar_compiler.json_schema({"enum": ["yes", "no"]})
    got = run(engine, [("e", [3, 3], SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True,
                                                    grammar=grammar))])
    assert got["e"][2] == "stop" and json.loads(got["e"][1]) in ("yes", "no")


def test_a_grammar_that_cannot_be_followed_is_refused(engines):
    with pytest.raises(RequestError, match="grammar cannot be followed"):
        engines[0].add_request("bad", [1], SamplingParams(grammar="start: %json {\"type\": \"foo\"}"))
    assert not engines[0].has_unfinished()
