"""vLLM's bad_words through the real engine over the hash model, the tokens forced with a logit bias: a one-token
word never appears; a longer word's last token is banned only right after its other tokens (so a forced token
alternates with another instead of repeating); the spaced variant of a word is banned too; with async scheduling
the same tokens; combined with a grammar, refused."""
from __future__ import annotations

import pytest

from pegainfer.engine.types import SamplingParams
from pegainfer.errors import RequestError
from pegainfer.text.bad_words import BadWordsConstraint, word_token_sequences
from tests.engine.hash_engine import hash_engine

IN, SPACE_IN, ER = 262, 283, 263     # the demo tokenizer's "in", " in", "er"


def tokens(engine, **params):
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **params))
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    assert engine.stats()["kv_pages_used"] == 0
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request):
    e = hash_engine(max_batch=2)
    e.async_scheduling = request.param
    return e


def test_a_one_token_word_never_appears(engine):
    forced = {"logit_bias": {IN: 100.0}}
    assert tokens(engine, **forced) == [IN] * 8
    got = tokens(engine, bad_words=["in"], **forced)
    assert IN not in got and SPACE_IN not in got and len(got) == 8


def test_a_longer_word_bans_its_last_token_only_after_the_rest(engine):
    got = tokens(engine, bad_words=["inin"], logit_bias={IN: 100.0})
    assert got[0] == IN and got[::2] == [IN] * 4 and IN not in got[1::2]


def test_word_sequences_and_the_mask(engine):
    seqs = word_token_sequences(engine.tokenizer, ["in", "iner"])
    assert [IN] in seqs and [SPACE_IN] in seqs and [IN, ER] in seqs
    c = BadWordsConstraint([[IN], [IN, ER]], 300)       # IN banned always, ER right after IN
    assert c.banned() == [IN] and c.accept(IN) and c.banned() == [IN, ER] and c.accept(5) and c.banned() == [IN]


def test_bad_words_with_a_grammar_is_refused(engine):
    grammar = engine.grammar_compiler.allowed_tokens([IN, ER])
    with pytest.raises(RequestError, match="bad_words cannot be combined"):
        engine.add_request("g", [5], SamplingParams(bad_words=["in"], grammar=grammar))
    assert not engine.has_unfinished()
