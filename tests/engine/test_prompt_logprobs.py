"""Prompt logprobs through the real engine over the tiny history model: a request asking for them is prefilled by
the engine itself in chunks whose every row keeps its logits (several chunks here), each prompt token's logprob
equals the one computed from ``Engine.score`` of the same tokens, its top entries are the row's most likely
tokens; the request then decodes its own stream, and streams running beside it keep their tokens; its first
token still takes the request's logit bias; an abort while it waits leaves nothing in use."""
from __future__ import annotations

import numpy as np
import pytest

from pegainfer.engine.types import SamplingParams
from tests.engine.test_async_scheduling import expected_greedy_stream
from tests.engine.tiny_model import tiny_engine

PROMPT = list(range(3, 30))     # 27 tokens: 7 chunks of the tiny model's 4 logits rows


def reference(engine, ids):
    """Each token's logprob after the ones before it, and each row's log-softmax, from ``score``."""
    x = engine.score(ids).astype(np.float64)
    lp = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
    return [lp[p, ids[p + 1]] for p in range(len(ids) - 1)], lp


def run(engine, requests, abort_after=None):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outs, k = [], 0
    while engine.has_unfinished():
        assert k < 2000, "the engine made no progress"
        outs += engine.step()
        k += 1
        if abort_after is not None and k == abort_after[0]:
            engine.abort(abort_after[1])
    assert engine.stats()["kv_pages_used"] == 0
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_score_and_streams_beside_keep_their_tokens(async_scheduling):
    """Catches a logprob read from the wrong row (off by one position), a chunk's rows lost, a top list that is not
    the row's largest, or the scored prefill disturbing a running stream."""
    engine = tiny_engine(async_scheduling, max_batch=3, max_model_len=64)
    want, lp = reference(engine, PROMPT)
    scored = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    beside = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = run(engine, [("beside", [5, 6, 7], beside), ("scored", PROMPT, scored)])
    by_id = {rid: [o for o in outs if o.request_id == rid] for rid in ("beside", "scored")}
    first = by_id["scored"][0]
    entries = first.prompt_logprobs
    assert entries[0] is None and len(entries) == len(PROMPT)
    assert [e.token_id for e in entries[1:]] == PROMPT[1:]
    np.testing.assert_allclose([e.logprob for e in entries[1:]], want, rtol=0, atol=1e-9)
    for p, e in enumerate(entries[1:]):
        top_ids = [t for t, _ in e.top]
        assert len(top_ids) == 3 and np.allclose(sorted(lp[p][top_ids]), sorted(np.sort(lp[p])[-3:]))
    assert all(o.prompt_logprobs is None for o in by_id["scored"][1:] + by_id["beside"])
    for rid, prompt, n in (("scored", PROMPT, 5), ("beside", [5, 6, 7], 12)):
        assert sum((o.new_token_ids for o in by_id[rid]), []) == expected_greedy_stream(prompt, n), rid


def test_the_first_token_after_scoring_takes_the_logit_bias():
    """Catches the engine's own prefill sampling without the request's processing: a bias of +100 on a token makes
    it every token, the first included."""
    engine = tiny_engine(False, max_batch=2, max_model_len=64)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logit_bias={17: 100})
    outs = run(engine, [("r", PROMPT[:9], params)])
    assert sum((o.new_token_ids for o in outs), []) == [17, 17, 17]
    assert [e.top for e in outs[0].prompt_logprobs[1:]] == [[]] * 8


def test_abort_while_waiting_to_be_scored():
    """A request aborted before its prompt is scored ends with "abort" and leaves no slot or page in use."""
    engine = tiny_engine(False, max_batch=1, max_model_len=64)
    run_first = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = run(engine, [("busy", [4, 5], run_first),
                        ("scored", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=1))], abort_after=(1, "scored"))
    ends = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert ends == {"busy": "length", "scored": "abort"}
    assert engine.stats()["waiting"] == 0


def test_a_prompt_as_long_as_the_pool_is_scored():
    """Catches a request waiting forever: a pool of exactly one full-length sequence (its admission reserve
    included) still scores a prompt of the whole context but one token."""
    engine = tiny_engine(False, max_batch=2, max_model_len=48, num_pages=3)
    assert engine.scheduler.reserve_pages == 1
    prompt = list(range(3, 50))                       # 47 tokens: the 48th is the one generated
    outs = run(engine, [("long", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))])
    assert len(outs[0].prompt_logprobs) == 47 and outs[-1].finish_reason == "length"
