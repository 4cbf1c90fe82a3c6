"""Request ids: the client's ``x-request-id`` comes back in the response header (a fresh one when it sent none or an
unusable one), names the request in the engine and the response's ``id``, and starts every log line about it."""
from __future__ import annotations

import json
import logging
import re
import threading

import httpx
import pytest

from pegainfer.server.request_context import REQUEST_ID, RequestIdFilter, request_id_from
from tests.server.conftest import idle, wait_until
from tests.server.test_errors import check_error

COMPLETION = {"model": "fake-model", "prompt": "Hello", "max_tokens": 3}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
GENERATED = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
def http(fake_server):
    url, ae, engine = fake_server
    with httpx.Client(base_url=url, timeout=30) as c:
        c.ae, c.engine = ae, engine
        yield c


def request_lines(caplog, request_id: str) -> list[logging.LogRecord]:
    """The server's per-request log lines of ``request_id``."""
    return [r for r in caplog.records if r.name == "pegainfer.server" and "prompt_tokens=" in r.getMessage()
            and getattr(r, "request_id", None) == request_id]


def test_the_client_id_round_trips_and_names_the_request(http, caplog):
    with caplog.at_level(logging.INFO, logger="pegainfer.server"):
        r = http.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "trace-42"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
        assert r.json()["id"] == "cmpl-trace-42"
        assert "cmpl-trace-42" in http.engine.prompts   # the engine's request id

        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                         headers={"x-request-id": "trace-43"}) as s:
            assert s.headers["x-request-id"] == "trace-43"
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert {c["id"] for c in chunks} == {"chatcmpl-trace-43"}
        wait_until(lambda: idle(http.ae))
    [line] = request_lines(caplog, "trace-42")
    assert line.getMessage().startswith("[trace-42] completions prompt_tokens=1 cached_tokens=0 completion_tokens=3 ")
    [line] = request_lines(caplog, "trace-43")
    assert line.getMessage().startswith("[trace-43] chat prompt_tokens=")


def test_without_a_usable_id_the_server_makes_one(http):
    r = http.post("/v1/completions", json=COMPLETION)
    made = r.headers["x-request-id"]
    assert GENERATED.fullmatch(made) and r.json()["id"] == f"cmpl-{made}"
    for unusable in ("has space", "x" * 129, "quote\"d", ""):
        r = http.post("/v1/completions", json=COMPLETION, headers={"x-request-id": unusable})
        assert r.status_code == 200 and GENERATED.fullmatch(r.headers["x-request-id"]), unusable
    ok = "a" * 128   # the longest kept
    assert http.post("/v1/completions", json=COMPLETION, headers={"x-request-id": ok}).headers["x-request-id"] == ok


def test_errors_carry_the_id_in_the_header_and_the_log(http, caplog):
    with caplog.at_level(logging.INFO, logger="pegainfer.server"):
        r = http.post("/v1/completions", json={**COMPLETION, "max_tokens": -1}, headers={"x-request-id": "bad-1"})
        check_error(r, 400, param="max_tokens")
        assert r.headers["x-request-id"] == "bad-1"
        r = http.get("/no/such/route", headers={"x-request-id": "bad-2"})
        assert r.status_code == 404 and r.headers["x-request-id"] == "bad-2"
        assert http.get("/health", headers={"x-request-id": "h"}).headers["x-request-id"] == "h"
    [line] = [r for r in caplog.records if getattr(r, "request_id", None) == "bad-1"]
    assert line.getMessage().startswith("[bad-1] POST /v1/completions -> 400 ")


def test_a_reused_id_gets_a_unique_engine_id(http, caplog):
    """Two requests in flight with the same x-request-id: both are served; the second's engine id (and response
    id) gets a suffix, and its log line names it."""
    http.engine.gate.clear()   # hold the first request in the engine
    results = {}

    def first():
        results["a"] = http.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "same"})

    t = threading.Thread(target=first)
    t.start()
    wait_until(http.engine.in_step.is_set)
    with caplog.at_level(logging.INFO, logger="pegainfer.server"):
        with httpx.Client(base_url=str(http.base_url), timeout=30) as other:
            pending = threading.Thread(target=lambda: results.__setitem__(
                "b", other.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "same"})))
            pending.start()
            wait_until(lambda: http.ae.stats()["streams"] == 2)
            http.engine.gate.set()
            pending.join(30)
        t.join(30)
    a, b = results["a"], results["b"]
    assert a.status_code == b.status_code == 200
    assert a.headers["x-request-id"] == b.headers["x-request-id"] == "same"
    assert a.json()["id"] == "cmpl-same"
    assert re.fullmatch(r"cmpl-same-[0-9a-f]{8}", b.json()["id"])
    lines = sorted(r.getMessage() for r in request_lines(caplog, "same"))
    assert len(lines) == 2 and lines[1].startswith("[same] completions prompt_tokens=")
    assert lines[0].startswith(f"[same] completions id={b.json()['id']} prompt_tokens=")


def test_the_log_filter_prefixes_only_inside_a_request(caplog):
    logger = logging.getLogger("pegainfer.test-request-ids")
    logger.addFilter(RequestIdFilter())
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("outside %d%%", 5)
        token = REQUEST_ID.set("r%1")   # a '%' in the id must not break %-formatting
        try:
            logger.info("inside %d%%", 5)
            logger.info("no args 100%")
        finally:
            REQUEST_ID.reset(token)
    assert [r.getMessage() for r in caplog.records] == ["outside 5%", "[r%1] inside 5%", "[r%1] no args 100%"]
    assert [r.request_id for r in caplog.records] == [None, "r%1", "r%1"]
    assert request_id_from("abc") == "abc" and GENERATED.fullmatch(request_id_from(None))
