"""``serve``'s deployment flags: ``--allowed-origins`` (CORS for browser clients), ``--ssl-keyfile`` /
``--ssl-certfile`` (HTTPS) and ``--chat-template`` (a template in place of the folder's), through the CLI's own
``run_server`` in a child process (``tests.server.serve_fake``) or its app over the fake engine.  ``tls/`` holds a
self-signed certificate for 127.0.0.1 and its key, made for these tests only."""
from __future__ import annotations

import argparse
import signal
import ssl
from pathlib import Path

import httpx
import pytest

from pegainfer.errors import PegainferError
from pegainfer.server import cors_options, tls_files
from tests.server.conftest import serve_engine, wait_until
from tests.server.fake_engine import FakeEngine
from tests.server.test_run_server import free_port, start

TLS = Path(__file__).resolve().parent / "tls"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def preflight(url, origin):
    return httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_answers_listed_origins_only(model_folder):
    """A browser page of a listed origin gets its preflight answered (before the API key is asked for) and the
    allow-origin header on the answer; a page of another origin gets neither; without the flag no CORS at all."""
    args = argparse.Namespace(allowed_origins=["https://app.example"], allowed_methods=["*"],
                              allowed_headers=["*"], allow_credentials=False)
    key = {"Authorization": "Bearer k"}
    cors = cors_options(args)
    with serve_engine(FakeEngine(model_folder), served_model_name="m", api_key="k", cors=cors) as (url, _):
        ok = preflight(url, "https://app.example")
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={**key, "Origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert preflight(url, "https://evil.example").status_code == 400
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={**key, "Origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT,
                          headers={"Origin": "https://app.example"}).status_code == 401
    with serve_engine(FakeEngine(model_folder), served_model_name="m") as (url, _):
        assert preflight(url, "https://app.example").status_code == 405
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert cors_options(argparse.Namespace(allowed_origins=None)) is None


def test_https_and_a_chat_template_through_run_server(model_folder, tmp_path):
    """``serve --ssl-keyfile K --ssl-certfile C --chat-template FILE``: the server speaks HTTPS only (a client that
    trusts the certificate is answered, plain HTTP is not), says so in its log, and renders chat messages with the
    given template (the prompt's token count is that of the template's text)."""
    from pegainfer.text.tokenizer import Tokenizer

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}>> said the user{% endfor %}")
    port = free_port()
    proc = start(str(model_folder), "--port", str(port), "--load-seconds", "0.2", "--ssl-keyfile",
                 str(TLS / "localhost.key"), "--ssl-certfile", str(TLS / "localhost.pem"), "--served-model-name", "m",
                 "--chat-template", str(template))
    trust = ssl.create_default_context(cafile=str(TLS / "localhost.pem"))
    try:
        def health():
            try:
                return httpx.get(f"https://127.0.0.1:{port}/health", verify=trust, timeout=2).status_code
            except httpx.TransportError:
                return None
        wait_until(lambda: health() == 200, timeout=30, what="the HTTPS server to be ready")
        r = httpx.post(f"https://127.0.0.1:{port}/v1/chat/completions", json=CHAT, verify=trust, timeout=10)
        assert r.status_code == 200, r.text
        want = len(Tokenizer.from_folder(model_folder).encode("<<Hi>> said the user"))
        assert r.json()["usage"]["prompt_tokens"] == want
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"listening on https://127.0.0.1:{port}" in out


@pytest.mark.parametrize("key, cert, says", [
    ("localhost.key", None, "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    ("missing.key", "localhost.pem", "--ssl-keyfile"),
    ("localhost.pem", "localhost.pem", "cannot serve HTTPS with --ssl-certfile"),
])
def test_a_bad_key_or_certificate_is_one_line(key, cert, says):
    """Half a pair, a missing file, or a key file that holds no key: a one-line error naming the flags, raised
    before the port is bound."""
    args = argparse.Namespace(ssl_keyfile=str(TLS / key), ssl_certfile=cert and str(TLS / cert))
    with pytest.raises(PegainferError) as e:
        tls_files(args)
    assert says in str(e.value) and "\n" not in str(e.value)
