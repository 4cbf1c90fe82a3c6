"""Tokenizer.from_folder: ids, decoding, special tokens, bytes of partial characters, and bad folders."""
import json

import pytest

from pegainfer.errors import ModelFolderError
from pegainfer.text.tokenizer import Tokenizer
from tests.text.fixtures import QWEN3_TEMPLATE, make_model_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tok(folder):
    return Tokenizer.from_folder(folder)


def test_round_trip_and_special_tokens(tok):
    text = "Hello world! héllo 你好 😀"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # special-token strings in text become their ids; skip_special_tokens drops them from decoded text
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "user\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>"
    # <think> is an added but non-special token in Qwen3: one id each, and it stays in the text
    ids = tok.encode("<think>x</think>")
    assert ids[0] == tok.token_to_id("<think>") and ids[-1] == tok.token_to_id("</think>")
    assert tok.decode(ids) == "<think>x</think>"


def test_config_fields(tok):
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.bos_token_id is None
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.vocab_size == 402
    assert tok.special_ids == {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert tok.chat_template == QWEN3_TEMPLATE


def test_unknown_ids_decode_to_nothing(tok):
    ids = tok.encode("Hello")
    for bad in (tok.vocab_size, tok.vocab_size + 5000, 151935, -1):
        assert tok.decode([bad]) == ""
        assert tok.decode(ids + [bad] + ids) == "HelloHello"
        assert tok.token_str(bad) == "" and tok.token_bytes(bad) == b""


def test_token_str_and_bytes_of_partial_characters(tok):
    ids = tok.encode("😀")  # not a merge in the toy vocabulary: split across byte-level tokens
    assert len(ids) >= 2
    assert b"".join(tok.token_bytes(i) for i in ids) == "😀".encode()
    assert "\ufffd" in tok.token_str(ids[0])
    assert tok.token_str(tok.token_to_id("<|im_end|>")) == "<|im_end|>"
    assert tok.token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"
    for i in tok.encode("Hello world héllo"):  # whole characters: bytes are the text's UTF-8
        assert tok.token_bytes(i) == tok.token_str(i).encode()


def test_chat_template_from_jinja_file_wins(tmp_path):
    folder = make_model_folder(tmp_path, chat_template="{{ 'from config' }}")
    (folder / "chat_template.jinja").write_text("{{ 'from file' }}")
    assert Tokenizer.from_folder(folder).chat_template == "{{ 'from file' }}"


def test_eos_token_written_as_object(tmp_path):
    folder = make_model_folder(tmp_path)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|endoftext|>", "lstrip": False, "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_id == tok.token_to_id("<|endoftext|>")


def test_bad_folders_raise_model_folder_error(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        Tokenizer.from_folder(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFolderError, match="no tokenizer.json"):
        Tokenizer.from_folder(empty)
    corrupt = make_model_folder(tmp_path / "corrupt")
    (corrupt / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ModelFolderError, match="tokenizer.json"):
        Tokenizer.from_folder(corrupt)
    bad_cfg = make_model_folder(tmp_path / "badcfg")
    (bad_cfg / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match="not valid JSON"):
        Tokenizer.from_folder(bad_cfg)


def test_folder_without_tokenizer_config(tmp_path):
    folder = make_model_folder(tmp_path)
    (folder / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_id is None and tok.chat_template is None
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
