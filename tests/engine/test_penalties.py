"""Repetition / frequency / presence penalties and logit bias through the real engine over the tiny history model
(``tiny_model.py``: its logits are a hash of the sequence so far, in [-4, 4), so both branches of the repetition
penalty run): each greedy stream equals the one computed in plain Python with the NumPy reference of the penalties
(``kernels/penalties.py``) applied at every step; the same with synchronous and asynchronous scheduling, through
preemptions (a slot's state kept, or set up again from the prompt and output so far when another penalized
sequence took the slot), and beside unpenalized streams that keep their exact tokens; values outside the accepted
ranges are refused at ``add_request``."""
from __future__ import annotations

import numpy as np
import pytest

from pegainfer.engine.types import SamplingParams
from pegainfer.errors import RequestError
from pegainfer.kernels.penalties import reference_penalties
from pegainfer.kernels.primitives import from_bf16_bits, to_bf16_bits
from tests.engine.test_async_scheduling import expected_greedy_stream
from tests.engine.test_scheduler import drain
from tests.engine.tiny_model import HASH_MOD, tiny_engine

VOCAB = 96


def expected_stream(prompt, params: SamplingParams) -> list[int]:
    """The tiny model's greedy stream in plain Python, each step's logits through ``reference_penalties``."""
    ids, out = list(prompt), []
    for _ in range(params.max_tokens):
        h = 17
        for tok in ids:
            h = (h * 31 + tok + 7) % HASH_MOD
        scores = np.array([((h + 1) * (2 * v + 1) * 40503) % 64 for v in range(VOCAB)], np.float32) / 8 - 4
        row = reference_penalties(to_bf16_bits(scores), prompt, out, params.repetition_penalty,
                                  params.frequency_penalty, params.presence_penalty, params.logit_bias)
        tok = int(np.argmax(from_bf16_bits(row)))          # the first largest, as the sampler picks
        ids.append(tok)
        out.append(tok)
    return out


def greedy(n, **penalties):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **penalties)


REQUESTS = [
    ("rep", [7, 8, 9, 7], greedy(24, repetition_penalty=1.7)),
    ("freq-pres", [10, 11], greedy(24, frequency_penalty=0.6, presence_penalty=0.5)),
    ("bias", [12, 13, 14], greedy(20, logit_bias={3: 2.5, 40: -1.0})),
    ("all", [15, 16, 15, 16, 17], greedy(26, repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.2,
                                         logit_bias={0: 0.75})),
    ("plain", [18, 19], greedy(24)),
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalized_greedy_streams_match_the_reference_computed_by_hand(async_scheduling):
    """Catches a penalty on the wrong token, a newest token counted twice or never, a bias applied to another row:
    each stream is the one computed step by step with the NumPy reference; the penalties change every penalized
    stream (so the comparison has teeth), and the unpenalized stream beside them is the model's own."""
    engine = tiny_engine(async_scheduling, max_batch=5, max_model_len=64)
    got = drain(engine, REQUESTS)
    for rid, prompt, params in REQUESTS:
        assert got[rid] == expected_stream(prompt, params), rid
        plain = expected_greedy_stream(prompt, params.max_tokens)
        assert (got[rid] == plain) == (rid == "plain"), rid


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_same_penalized_tokens_through_preemptions(async_scheduling):
    """Catches a preempted sequence whose counts are lost, doubled, or read from a slot another sequence wrote:
    with pages for barely two of four growing penalized sequences the newest are preempted and recomputed (their
    slots taken by the others meanwhile), and every stream is the one computed by hand."""
    requests = [(f"r{i}", [2 + i] * (5 + 3 * i),
                 greedy(30 + i, repetition_penalty=1.3 + 0.1 * i, frequency_penalty=0.25 * i, presence_penalty=0.5))
                for i in range(4)]
    engine = tiny_engine(async_scheduling, max_batch=4, max_model_len=64, num_pages=6, max_num_batched_tokens=32)
    got = drain(engine, requests)
    assert engine.stats()["num_preemptions"] > 0
    for rid, prompt, params in requests:
        assert got[rid] == expected_stream(prompt, params), rid


def test_a_slot_reused_by_a_penalized_request_starts_from_its_own_prompt():
    """Catches counts left in a slot by the request before: one slot, two penalized requests in turn (the second's
    prompt holds the first's tokens), each stream as computed by hand."""
    engine = tiny_engine(True, max_batch=1, max_model_len=64)
    first = ("a", [20, 21, 22], greedy(16, frequency_penalty=1.5, presence_penalty=0.5))
    got_a = drain(engine, [first])["a"]
    second = ("b", [20, 21, 22] + got_a[:4], greedy(16, repetition_penalty=1.5, frequency_penalty=0.5))
    got_b = drain(engine, [second])["b"]
    assert got_a == expected_stream(first[1], first[2])
    assert got_b == expected_stream(second[1], second[2])


@pytest.mark.parametrize("params, message", [
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(frequency_penalty=2.5), "frequency_penalty"),
    (SamplingParams(presence_penalty=float("nan")), "presence_penalty"),
    (SamplingParams(logit_bias={VOCAB: 1.0}), "outside the vocabulary"),
    (SamplingParams(logit_bias={1: 101.0}), "[-100, 100]"),
    (SamplingParams(logit_bias={i: 1.0 for i in range(1025)}), "at most 1024"),
])
def test_bad_penalties_are_refused_at_add_request(params, message):
    engine = tiny_engine(False, max_batch=1)
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.add_request("x", [1, 2], params)
    assert not engine.has_unfinished()
