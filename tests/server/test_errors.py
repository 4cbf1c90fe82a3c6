"""Every kind of bad input gets the OpenAI error shape with the right status, and the server keeps serving: each
case is followed by a good request that still succeeds, and the engine ends idle (nothing leaked)."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from pegainfer.engine.async_engine import AsyncEngine
from pegainfer.server.app import build_app
from tests.server.conftest import idle, serve_app, serve_engine, wait_until
from tests.server.fake_engine import FakeEngine

GOOD_COMPLETION = {"model": "fake-model", "prompt": "Hello", "max_tokens": 2}
GOOD_CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def check_error(resp: httpx.Response, status: int, param=None, code=None, says=None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if says is not None:
        assert says in err["message"], err
    return err


def still_serving(http: httpx.Client):
    r = http.post("/v1/completions", json=GOOD_COMPLETION)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    r = http.post("/v1/chat/completions", json=GOOD_CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


@pytest.fixture(scope="module")
def shared_server(model_folder):
    """One server for the many one-request cases (starting one per case would dominate the run time)."""
    engine = FakeEngine(model_folder)
    with serve_engine(engine) as (url, ae), httpx.Client(base_url=url, timeout=30) as c:
        c.ae, c.engine = ae, engine
        yield c


@pytest.fixture
def http(shared_server):
    yield shared_server
    wait_until(lambda: idle(shared_server.ae), what="the engine to be idle")


COMPLETION_CASES = [
    # (body changes, status, param, code, words in the message)
    ({"max_tokens": "5"}, 400, "max_tokens", "invalid_type", "must be an integer"),
    ({"max_tokens": 0}, 400, "max_tokens", None, "at least 1"),
    ({"max_tokens": -3}, 400, "max_tokens", None, "at least 1"),
    ({"max_tokens": 2.5}, 400, "max_tokens", "invalid_type", None),
    ({"max_tokens": 10_000}, 400, "max_tokens", "context_length_exceeded", "maximum context length is 256"),
    ({"temperature": -0.1}, 400, "temperature", None, ">= 0"),
    ({"temperature": "hot"}, 400, "temperature", "invalid_type", None),
    ({"top_p": 0}, 400, "top_p", None, "(0, 1]"),
    ({"top_p": 1.5}, 400, "top_p", None, "(0, 1]"),
    ({"min_p": 2}, 400, "min_p", None, None),
    ({"top_k": -2}, 400, "top_k", None, None),
    ({"logprobs": 21}, 400, "logprobs", None, "at most 20"),
    ({"logprobs": True}, 400, "logprobs", "invalid_type", None),
    ({"stop": 5}, 400, "stop", "invalid_type", None),
    ({"stop": ["a", 1]}, 400, "stop", "invalid_type", None),
    ({"stream": "yes"}, 400, "stream", "invalid_type", None),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", None, "only allowed when 'stream'"),
    ({"stop_token_ids": [1, -4]}, 400, "stop_token_ids", None, None),
    ({"stop_token_ids": [10**6]}, 400, "stop_token_ids", None, "outside the vocabulary"),
    ({"min_tokens": 5}, 400, "min_tokens", None, "must not exceed"),
    ({"seed": "x"}, 400, "seed", "invalid_type", None),
    ({"model": "gpt-4"}, 404, "model", "model_not_found", "'gpt-4' does not exist"),
    ({"prompt": ""}, 400, "prompt", "empty_prompt", "empty"),
    ({"prompt": []}, 400, "prompt", "empty_prompt", "empty"),
    ({"prompt": None}, 400, "prompt", "missing_required_parameter", "required"),
    ({"prompt": {"text": "x"}}, 400, "prompt", "invalid_type", None),
    ({"prompt": [1, "a"]}, 400, "prompt", "invalid_type", None),
    ({"prompt": [5, -1]}, 400, "prompt", None, "negative"),
    ({"prompt": "word " * 300}, 400, "prompt", "context_length_exceeded", "maximum context length is 256"),
    ({"prompt": [1] * 256}, 400, "prompt", "context_length_exceeded", None),
    ({"prompt": [1, 10**6]}, 400, None, "invalid_request", "prompt token ids must be integers in [0, 434)"),
    # well-formed, but not something pegainfer can honour: 422 naming the field
    ({"n": 257}, 400, "n", None, "at most 256"),
    ({"prompt": ["a"] * 9, "n": 30}, 400, "prompt", None, "270 choices"),
    ({"prompt": ["a", ""]}, 400, "prompt", "empty_prompt", None),
    ({"prompt": [[1, 2], "a", 3]}, 400, "prompt", "invalid_type", None),
    ({"n": 0}, 400, "n", None, None),
    ({"best_of": 3}, 422, "best_of", "unsupported_parameter", "n=3"),
    ({"n": 2, "best_of": 4}, 422, "best_of", "unsupported_parameter", None),
    ({"presence_penalty": 2.5}, 400, "presence_penalty", None, "[-2, 2]"),
    ({"frequency_penalty": "1"}, 400, "frequency_penalty", "invalid_type", None),
    ({"repetition_penalty": 0}, 400, "repetition_penalty", None, "(0, 10]"),
    ({"logit_bias": {"x": 1}}, 400, "logit_bias", None, "token ids"),
    ({"logit_bias": {"5": 101}}, 400, "logit_bias", None, "[-100, 100]"),
    ({"logit_bias": {"5": "up"}}, 400, "logit_bias", None, "[-100, 100]"),
    ({"logit_bias": {"-3": 1}}, 400, "logit_bias", None, "negative"),
    ({"logit_bias": {"100000": 1}}, 400, "logit_bias", None, "outside the vocabulary"),
    ({"logit_bias": [1, 2]}, 400, "logit_bias", "invalid_type", None),
    ({"bad_words": ["ok", ""]}, 400, "bad_words", "invalid_type", None),
    ({"suffix": "tail"}, 422, "suffix", "unsupported_parameter", None),
    ({"response_format": {"type": "json_object"}}, 422, "response_format", "unsupported_parameter", "cannot constrain"),
]


@pytest.mark.parametrize("change,status,param,code,says", COMPLETION_CASES,
                         ids=[f"{list(c[0])[0]}={str(list(c[0].values())[0])[:12]}" for c in COMPLETION_CASES])
def test_bad_completion_requests(http, change, status, param, code, says):
    check_error(http.post("/v1/completions", json={**GOOD_COMPLETION, **change}), status, param, code, says)
    still_serving(http)


def test_neutral_values_of_unsupported_fields_are_accepted(http):
    body = {**GOOD_COMPLETION, "n": 1, "best_of": 1, "suffix": None, "user": "me", "response_format": {"type": "text"},
            "some_future_field": [1, 2]}
    assert http.post("/v1/completions", json=body).status_code == 200


CHAT_CASES = [
    ({"messages": []}, 400, "messages", "empty_prompt", None),
    ({"messages": None}, 400, "messages", "missing_required_parameter", None),
    ({"messages": "hi"}, 400, "messages", "invalid_type", None),
    ({"messages": ["hi"]}, 400, "messages[0]", "invalid_type", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None, "must be one of"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", "missing_required_parameter", None),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     422, "messages[0].content[0]", "unsupported_parameter", "text-only"),
    ({"messages": [{"role": "user", "content": "hi " * 300}]}, 400, "messages", "context_length_exceeded", None),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens", None, None),
    ({"max_tokens": 1000}, 400, "max_tokens", "context_length_exceeded", None),
    ({"top_logprobs": 3}, 400, "top_logprobs", None, "needs 'logprobs'"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None, "at most 20"),
    ({"logprobs": 2}, 400, "logprobs", "invalid_type", None),
    ({"chat_template_kwargs": "nope"}, 400, "chat_template_kwargs", "invalid_type", None),
    ({"chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs", None, None),
    ({"model": "other"}, 404, "model", "model_not_found", None),
    ({"n": 1.5}, 400, "n", "invalid_type", None),
    ({"functions": [{"name": "f"}]}, 422, "functions", "unsupported_parameter", "send 'tools'"),
    ({"reasoning_effort": "extreme"}, 400, "reasoning_effort", None, "one of none, minimal"),
    ({"temperature": -1}, 400, "temperature", None, None),
]


@pytest.mark.parametrize("change,status,param,code,says", CHAT_CASES,
                         ids=[f"{list(c[0])[0]}-{i}" for i, c in enumerate(CHAT_CASES)])
def test_bad_chat_requests(http, change, status, param, code, says):
    check_error(http.post("/v1/chat/completions", json={**GOOD_CHAT, **change}), status, param, code, says)
    still_serving(http)


def test_chat_template_that_rejects_messages(model_folder, tmp_path):
    engine = FakeEngine(model_folder)
    from pegainfer.text.chat import ChatTemplate
    engine.chat_template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first!') }}"
                                        "{% endif %}{{ messages[0].content }}")
    with serve_engine(engine) as (url, ae), httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={**GOOD_CHAT, "messages": [{"role": "assistant", "content": "x"}]})
        check_error(r, 400, code="invalid_request", says="user first!")
        still_serving(http)
        engine.chat_template = None
        check_error(http.post("/v1/chat/completions", json=GOOD_CHAT), 400, code="no_chat_template")
        assert http.post("/v1/completions", json=GOOD_COMPLETION).status_code == 200


def test_malformed_bodies(http):
    for raw, says in [(b"{not json", "not valid JSON"), (b"", "empty"), (b"[1, 2]", "must be a JSON object"),
                      (b"\xff\xfe", "not UTF-8"), (b'"text"', "must be a JSON object")]:
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        check_error(r, 400, code="invalid_json", says=says)
        still_serving(http)
    r = http.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}')  # Python's json reads NaN
    check_error(r, 400, "temperature", says="finite")


def test_content_type_must_be_json(http):
    """A JSON body typed as anything but JSON is refused (415) before it is read, on both routes; JSON with a
    charset, a ``+json`` type, or no type at all is read as JSON."""
    import json
    for route, body in (("/v1/completions", GOOD_COMPLETION), ("/v1/chat/completions", GOOD_CHAT)):
        raw = json.dumps(body).encode()
        seen = len(http.engine.prompts)
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = http.post(route, content=raw, headers={"content-type": content_type})
            check_error(r, 415, code="unsupported_media_type", says=f"got '{content_type}'")
            assert "Content-Type: application/json" in r.json()["error"]["message"]
        assert len(http.engine.prompts) == seen          # none of them reached the engine
        for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                             "application/vnd.api+json", None):
            headers = {"content-type": content_type} if content_type else {}
            r = http.post(route, content=raw, headers=headers)
            assert r.status_code == 200, (content_type, r.text)
    still_serving(http)


def test_unknown_routes_and_methods(http):
    check_error(http.get("/v1/nothing"), 404, code="not_found")
    check_error(http.get("/v1/completions"), 405, code="method_not_allowed")
    check_error(http.get("/v1/models/other-model"), 404, code="model_not_found")
    still_serving(http)


def test_body_over_the_size_limit(model_folder):
    engine = FakeEngine(model_folder)
    with serve_engine(engine, max_body_bytes=2000) as (url, ae), httpx.Client(base_url=url, timeout=30) as http:
        big = {**GOOD_COMPLETION, "prompt": "x" * 5000}
        check_error(http.post("/v1/completions", json=big), 413, code="request_too_large")

        def chunked():  # no Content-Length: the limit is enforced while reading
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}'
        check_error(http.post("/v1/completions", content=chunked()), 413, code="request_too_large")
        still_serving(http)
        wait_until(lambda: idle(ae))


def test_api_key(model_folder):
    engine = FakeEngine(model_folder)
    with serve_engine(engine, api_key="sekrit") as (url, ae):
        with httpx.Client(base_url=url, timeout=30) as http:
            check_error(http.post("/v1/completions", json=GOOD_COMPLETION), 401, code="invalid_api_key")
            check_error(http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
            check_error(http.post("/v1/chat/completions", json=GOOD_CHAT,
                                  headers={"Authorization": "Basic sekrit"}), 401)
            check_error(http.post("/tokenize", json={"prompt": "Hi"}), 401)
            check_error(http.post("/detokenize", json={"tokens": [1]}), 401)
            assert http.post("/tokenize", json={"prompt": "Hi"},
                             headers={"Authorization": "Bearer sekrit"}).json()["count"] > 0
            assert http.get("/health").status_code == 200  # health and version stay open
            assert http.get("/version").status_code == 200
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="fake-model", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        assert not engine.prompts or len(engine.prompts) == 1  # the rejected requests never reached the engine


def test_sdk_raises_typed_errors(fake_server):
    url, ae, engine = fake_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-model", prompt="Hi", max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.completions.create(model="fake-model", prompt="Hi", n=2, best_of=5)
    assert "best_of=5" in e.value.message
    assert client.completions.create(model="fake-model", prompt="Hi", max_tokens=2).choices[0].text


def test_queue_full_gets_503_with_retry_after(model_folder):
    engine = FakeEngine(model_folder, max_batch=1, step_delay=0.01)
    long_one = {**GOOD_COMPLETION, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with serve_engine(engine, max_waiting=1) as (url, ae), httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=long_one) as a:
            lines = a.iter_lines()
            assert next(lines).startswith("data: ")   # A runs
            engine.gate.clear()                         # pause the engine inside its next step
            wait_until(engine.in_step.is_set, what="the engine to pause")
            results = {}
            b = threading.Thread(target=lambda: results.setdefault(
                "b", http.post("/v1/completions", json=GOOD_COMPLETION)))
            b.start()                                   # B is queued: one request waiting
            wait_until(lambda: ae.stats()["pending"] == 1, what="B to be queued")
            c = http.post("/v1/completions", json=GOOD_COMPLETION)
            check_error(c, 503, code="queue_full", says="--max-waiting 1")
            assert c.headers["retry-after"] == "1"
            engine.gate.set()
        b.join(30)
        assert results["b"].status_code == 200          # the queued request was served
        still_serving(http)
        wait_until(lambda: idle(ae))


def test_max_waiting_counts_only_requests_not_admitted(model_folder):
    """``--max-waiting 1 --max-batch 1``: while A is being prefilled (the engine admits it inside the step), B may
    still wait for its place; only C, a second one waiting, gets 503."""
    engine = FakeEngine(model_folder, max_batch=1)
    engine.gate.clear()                                  # the engine pauses inside its first step: A's prefill
    with serve_engine(engine, max_waiting=1) as (url, ae), httpx.Client(base_url=url, timeout=30) as http:
        results = {}

        def post(name):
            results[name] = http.post("/v1/completions", json=GOOD_COMPLETION)
        a = threading.Thread(target=post, args=("a",))
        a.start()
        wait_until(engine.in_step.is_set, what="A's first step")
        assert ae.stats()["not_admitted"] == 0          # A is running (in prefill), not waiting
        b = threading.Thread(target=post, args=("b",))
        b.start()
        wait_until(lambda: ae.stats()["pending"] == 1, what="B to be queued")
        assert ae.stats()["not_admitted"] == 1
        c = http.post("/v1/completions", json=GOOD_COMPLETION)
        check_error(c, 503, code="queue_full", says="1 requests are already waiting for a place in the batch "
                                                   "(--max-waiting 1)")
        engine.gate.set()
        a.join(30)
        b.join(30)
        assert results["a"].status_code == 200 and results["b"].status_code == 200, results
        assert engine.max_running_seen == 1 and len(engine.finished) == 2
        still_serving(http)
        wait_until(lambda: idle(ae))


def test_health_is_503_until_the_model_is_loaded(model_folder):
    release = threading.Event()

    def slow_factory():
        release.wait(30)
        return FakeEngine(model_folder)

    ae = AsyncEngine(engine_factory=slow_factory).start()
    try:
        with serve_app(build_app(ae, "my-model")) as url, httpx.Client(base_url=url, timeout=30) as http:
            r = http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["retry-after"]
            check_error(http.post("/v1/completions", json={**GOOD_COMPLETION, "model": "my-model"}), 503,
                        code="model_not_ready", says="still loading")
            release.set()
            assert ae.wait_ready(30)
            assert http.get("/health").status_code == 200
            r = http.post("/v1/completions", json={**GOOD_COMPLETION, "model": "my-model"})
            assert r.status_code == 200 and r.json()["model"] == "my-model"
            assert http.get("/v1/models").json()["data"][0] == {
                "id": "my-model", "object": "model", "created": http.get("/v1/models").json()["data"][0]["created"],
                "owned_by": "pegainfer", "max_model_len": 256}
    finally:
        release.set()
        ae.shutdown()


def test_failed_load_reports_on_health(model_folder):
    from pegainfer.errors import ModelFolderError

    def broken():
        raise ModelFolderError("config.json in /models/x is not valid JSON")

    ae = AsyncEngine(engine_factory=broken).start()
    assert not ae.wait_ready(10) and ae.state == "failed"
    with serve_app(build_app(ae)) as url, httpx.Client(base_url=url, timeout=30) as http:
        r = http.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "failed",
                                                    "error": "config.json in /models/x is not valid JSON"}
        check_error(http.post("/v1/completions", json={"prompt": "x"}), 503, says="not valid JSON")
