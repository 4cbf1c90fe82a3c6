"""``python -m pegainfer serve`` with nothing faked: the CLI's own engine factory (``server.run_server``) loads the
demo model, the server answers a completion from the real engine, and stops cleanly on SIGINT."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_serve_runs_the_real_engine_factory_on_the_demo_model():
    """Catches a break in the engine factory that ``serve`` builds from its flags (every other server test hands
    the server a ready engine): wrong argument names, a flag not passed on, a load error swallowed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pegainfer", "serve", "--port", "0", "--max-batch", "2",
                             "--max-model-len", "64", "--served-model-name", "demo"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", line)
            if found:
                break
        else:
            raise AssertionError("no 'listening on' line:\n" + "".join(seen))
        url = f"http://127.0.0.1:{found.group(1)}"

        def health():
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code
            except httpx.TransportError:
                return None
        wait_until(lambda: health() == 200, timeout=300, what="the demo model to load")
        r = httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": "Hello", "max_tokens": 2,
                                                      "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "demo" and body["usage"]["completion_tokens"] == 2
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["demo"]
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    out = "".join(seen) + out
    assert proc.returncode == 0, out
    assert "model ready: serving 'demo' (max model len 64)" in out and "RANDOM weights" in out, out
