"""run_server as the CLI runs it, in a child process: binds 127.0.0.1, answers /health 503 while loading and 200
after, serves, logs one line per request (and uvicorn's access log on demand), stops cleanly on SIGINT; a model that
fails to load ends the process with the error; --port 0 serves on a free port; --log-level quiets the logs."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from tests.server.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.server.serve_fake", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def health(url: str):
    """``/health``'s status code, or None while nothing listens."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def test_serve_lifecycle_and_request_log(model_folder):
    port = free_port()
    proc = start(str(model_folder), "--port", str(port), "--served-model-name", "tiny", "--api-key", "k",
                 "--load-seconds", "1.5", "--access-log")
    try:
        url = f"http://127.0.0.1:{port}"

        assert wait_until(lambda: health(url), timeout=30, what="the server to listen") == 503   # still loading
        wait_until(lambda: health(url) == 200, timeout=30, what="the model to load")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        r = client.completions.create(model="tiny", prompt="Hello", max_tokens=3,
                                      extra_headers={"x-request-id": "lifecycle-1"})
        assert r.usage.completion_tokens == 3 and r.model == "tiny" and r.id == "cmpl-lifecycle-1"
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=2, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"listening on http://127.0.0.1:{port}" in out
    assert "model ready: serving 'tiny'" in out
    request_lines = [line for line in out.splitlines() if "prompt_tokens=" in line]
    assert len(request_lines) == 2, out
    assert "[lifecycle-1] completions prompt_tokens=1 cached_tokens=0 completion_tokens=3 ttft=" in request_lines[0]
    assert "finish=length" in request_lines[0] and "total=" in request_lines[0]
    assert re.fullmatch(r"\[[0-9a-f]{32}\]", request_lines[1].split()[2]), request_lines[1]  # a generated id
    assert request_lines[1].split()[3] == "chat"
    access = [line for line in out.splitlines() if ' - "' in line]   # --access-log: uvicorn's line per HTTP request
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in access), out
    assert any('"POST /v1/chat/completions HTTP/1.1" 200' in line for line in access), out
    assert any('"GET /health HTTP/1.1" 503' in line for line in access), out


def test_a_model_that_fails_to_load_stops_the_server():
    port = free_port()
    proc = start("broken", "--port", str(port), "--load-seconds", "0.2")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert "error: /nowhere has no config.json: download the model into it" in out


def test_port_zero_serves_on_a_free_port(model_folder):
    proc = start(str(model_folder), "--port", "0", "--load-seconds", "0.2")
    try:
        for line in proc.stdout:
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", line)
            if found:
                break
        else:
            raise AssertionError("no 'listening on' line")
        url = f"http://127.0.0.1:{found.group(1)}"
        assert int(found.group(1)) > 0

        wait_until(lambda: health(url) == 200, timeout=30, what="the model to load")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert ' - "' not in out     # no access log unless asked for


def test_log_level_warning_keeps_only_warnings_and_errors():
    proc = start("broken", "--port", str(free_port()), "--load-seconds", "0.2", "--log-level", "warning")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert "INFO" not in out and "listening on" not in out, out      # neither pegainfer's nor uvicorn's info lines
    assert "ERROR pegainfer.engine: the model failed to load: /nowhere has no config.json" in out
    assert "error: /nowhere has no config.json: download the model into it" in out


def _serve_one_completion(model_folder, *flags) -> str:
    """Start the server with ``flags``, send one 5-token completion, wait 0.5 s idle, stop it; its log."""
    port = free_port()
    proc = start(str(model_folder), "--port", str(port), "--load-seconds", "0.2", *flags)
    try:
        url = f"http://127.0.0.1:{port}"

        wait_until(lambda: health(url) == 200, timeout=30, what="the model to load")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        import time
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    return out


def test_the_engines_figures_are_logged_while_it_works(model_folder):
    """The stats line (every 10 s; 0.1 s here): the completion's tokens in a line's generation throughput, then
    silence once idle (one line of zeros, then none)."""
    out = _serve_one_completion(model_folder, "--stats-interval", "0.1")
    lines = [line.split("pegainfer.stats: ", 1)[1] for line in out.splitlines() if "pegainfer.stats: " in line]
    assert lines, out
    for line in lines:
        assert re.fullmatch(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                            r"Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, Prefix cache hit "
                            r"rate: [\d.]+%", line), line
    rates = [float(re.search(r"generation throughput: ([\d.]+)", line).group(1)) for line in lines]
    assert any(rate > 0 for rate in rates), lines
    assert lines[-1].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                                "Running: 0 reqs"), lines
    assert len(lines) < 10, lines                # 0.5 s idle at 0.1 s intervals: not a line each


def test_disable_log_stats_turns_the_line_off(model_folder):
    out = _serve_one_completion(model_folder, "--stats-interval", "0.1", "--disable-log-stats")
    assert "pegainfer.stats" not in out and "Avg generation throughput" not in out, out
