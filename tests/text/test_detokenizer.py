"""IncrementalDetokenizer: the streamed pieces add up to the full decode, and no piece splits a character -- through
both of its ways: a ByteLevel tokenizer's bytes through an incremental UTF-8 decoder, and the window of decodes any
other tokenizer takes (the same tokenizer with ``decodes_by_bytes`` off)."""
import copy

import numpy as np
import pytest

from pegainfer.text.detokenizer import IncrementalDetokenizer
from pegainfer.text.tokenizer import Tokenizer
from tests.text.fixtures import make_model_folder

TEXTS = [
    "Hello world! The quick brown fox.",
    "héllo wörld, naïve café — 你好，世界 😀 🚀 done",
    "😀😀😀🚀",
    "<|im_start|>assistant\n<think>\n\n</think>\n\nSure!<|im_end|>",
    "  leading and   repeated   spaces\n\nand newlines\t",
]


@pytest.fixture(scope="module", params=["bytes", "window"])
def tok(request, tmp_path_factory):
    tokenizer = Tokenizer.from_folder(make_model_folder(tmp_path_factory.mktemp("model")))
    assert tokenizer.decodes_by_bytes      # a Qwen-style ByteLevel decoder: the short way is the one taken
    if request.param == "window":
        tokenizer = copy.copy(tokenizer)
        tokenizer.decodes_by_bytes = False
    return tokenizer


def stream(tok, prompt_ids, ids, **kw):
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    pieces = [d.push(i) for i in ids]
    return pieces, d.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_full_decode(tok, text):
    ids = tok.encode(text)
    for prompt in ("", "Hello", "你好 😀"):
        pieces, rest = stream(tok, tok.encode(prompt), ids)
        assert "".join(pieces) + rest == tok.decode(ids)
        assert rest == ""
        for p in pieces:  # never half a character
            assert "\ufffd" not in p


def test_partial_character_is_held_until_complete(tok):
    ids = tok.encode("a😀")
    emoji = ids[1:]
    assert len(emoji) >= 2, "the toy vocabulary must split the emoji across tokens"
    d = IncrementalDetokenizer(tok, [])
    assert d.push(ids[0]) == "a"
    for i in emoji[:-1]:
        assert d.push(i) == ""
    assert d.push(emoji[-1]) == "😀"


def test_flush_releases_an_unfinished_character(tok):
    ids = tok.encode("x😀")
    d = IncrementalDetokenizer(tok, [])
    out = "".join(d.push(i) for i in ids[:-1])
    assert out == "x"
    assert d.flush() == "\ufffd"  # the output ended inside a character: the honest text is U+FFFD
    assert d.flush() == ""


def test_special_tokens_and_unknown_ids(tok):
    ids = tok.encode("<|im_end|>Hi") + [tok.vocab_size + 7, 151935] + tok.encode(" there")
    pieces, rest = stream(tok, [], ids)
    assert "".join(pieces) + rest == "Hi there"
    pieces, rest = stream(tok, [], ids, skip_special_tokens=False)
    assert "".join(pieces) + rest == "<|im_end|>Hi there"


def test_long_random_stream_stays_consistent(tok, rng):
    ids = [int(i) for i in rng.integers(0, tok.vocab_size, size=1500)]
    pieces, rest = stream(tok, [], ids)
    # invalid byte sequences become U+FFFD in both decodes; the streamed text must equal the one-shot decode
    assert "".join(pieces) + rest == tok.decode(ids)
    if not tok.decodes_by_bytes:   # the window holds back any text ending in U+FFFD (the UTF-8 decoder: only
        assert not any(p.endswith("\ufffd") for p in pieces)   # what may still become a character; the equality
                                                                # above shows it never sends one too early)
