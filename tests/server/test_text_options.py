"""vLLM's text options through a live server over the real engine and the hash model, the tokens forced with a logit
bias: ``skip_special_tokens: false`` writes special tokens in the text (by default they are left out);
``include_stop_str_in_output`` keeps the stop string that ended the text (by default it is cut)."""
from __future__ import annotations

import pytest

from tests.server.conftest import serve_hash_engine

IM_START, IN = 449, 262        # the demo tokenizer's <|im_start|> and "in"


@pytest.fixture(scope="module")
def client():
    with serve_hash_engine(600) as (c, _, _):
        yield c


def complete(client, **extra):
    return client.completions.create(model=None, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True, **extra}).choices[0]


def test_skip_special_tokens(client):
    forced = {"logit_bias": {str(IM_START): 100}}
    assert complete(client, **forced).text == ""
    assert complete(client, skip_special_tokens=False, **forced).text == "<|im_start|>" * 3


def test_include_stop_str_in_output(client):
    forced = {"logit_bias": {str(IN): 100}}
    assert complete(client, **forced).text == "ininin"
    cut = complete(client, stop=["nin"], **forced)
    kept = complete(client, stop=["nin"], include_stop_str_in_output=True, **forced)
    assert (cut.text, cut.finish_reason) == ("i", "stop") and (kept.text, kept.finish_reason) == ("inin", "stop")
