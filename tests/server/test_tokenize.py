"""vLLM's ``/tokenize`` and ``/detokenize`` over the fake engine: a prompt's ids are those /v1/completions would
send the engine, a chat's those /v1/chat/completions would (the same template rendering), the count and the
context limit come with them, token strings on request; ids decode back to the text; bad input is a 400."""
from __future__ import annotations

import httpx
import pytest

from tests.server.test_errors import check_error

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture
def http(fake_server):
    url, ae, engine = fake_server
    with httpx.Client(base_url=url, timeout=30) as client:
        client.engine = engine
        yield client


def test_prompt_ids_are_what_completions_sends(http):
    """Catches special tokens added on one route and not the other, or a different encoding."""
    text = "Once upon a time <|im_end|>"
    got = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert http.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).status_code == 200
    (sent,) = http.engine.prompts.values()
    assert got["tokens"] == sent and got["count"] == len(sent) == len(got["token_strs"])
    assert got["max_model_len"] == http.engine.max_model_len
    assert "".join(got["token_strs"]) == http.engine.tokenizer.decode(sent, skip_special_tokens=False)


def test_chat_ids_are_what_chat_completions_sends(http):
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    got = http.post("/tokenize", json=body).json()
    assert http.post("/v1/chat/completions", json={**body, "max_tokens": 1}).status_code == 200
    (sent,) = http.engine.prompts.values()
    assert got["tokens"] == sent and got["token_strs"] is None
    without = http.post("/tokenize", json={**body, "add_generation_prompt": False}).json()
    assert without["count"] < got["count"] and got["tokens"][:without["count"]] == without["tokens"]


def test_detokenize_gives_the_text_back(http):
    ids = http.post("/tokenize", json={"prompt": "a cat <|im_start|> sat"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "a cat <|im_start|> sat"}


@pytest.mark.parametrize("route, body, param, says", [
    ("/tokenize", {}, "messages", "either"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt", "either"),
    ("/tokenize", {"prompt": 5}, "prompt", None),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model", "does not exist"),
    ("/detokenize", {}, "tokens", "required"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens", "negative"),
    ("/detokenize", {"tokens": [10 ** 7]}, "tokens", "outside the vocabulary"),
])
def test_bad_requests(http, route, body, param, says):
    r = http.post(route, json=body)
    check_error(r, 404 if param == "model" else 400, param, None, says)
