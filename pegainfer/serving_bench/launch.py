"""A server for the benchmark to talk to when it is given no ``--base-url``: ``python -m pegainfer serve`` in a
subprocess on a free loopback port, its output in a log file, ready once ``GET /health`` answers 200, stopped
(SIGINT, then SIGKILL after a grace period) when the benchmark ends — also on an error or Ctrl-C."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import httpx

from pegainfer.errors import PegainferError

SERVE_COMMAND = (sys.executable, "-m", "pegainfer", "serve")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's pick; the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _last_line(path: str) -> str:
    """The server log's most telling line: its last ``error:`` line, else its last line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1]


class ServerProcess:
    """``with ServerProcess(args) as url:`` runs ``command + args + --host 127.0.0.1 --port N`` until the block
    ends; ``url`` is ``http://127.0.0.1:N``, yielded once the server is ready.  ``command``: tests run a fake
    engine's server this way."""

    def __init__(self, serve_args: Sequence[str], command: Sequence[str] = SERVE_COMMAND,
                 ready_timeout_s: float = 1800.0, stop_timeout_s: float = 30.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [*command, *serve_args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        fd, self.log_path = tempfile.mkstemp(prefix="pegainfer-bench-serve-", suffix=".log")
        os.close(fd)

    def __enter__(self) -> str:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self) -> None:
        """Poll ``/health`` until 200; a one-line error if the process exits or the time runs out first."""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise PegainferError(f"the server exited (status {rc}) before it was ready: "
                                     f"{_last_line(self.log_path) or 'no output'} (its log: {self.log_path})")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass   # not listening yet, or busy loading
            if time.monotonic() > deadline:
                raise PegainferError(f"the server was not ready after {self.ready_timeout_s:.0f} s (its log: "
                                     f"{self.log_path})")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGINT (the server's clean stop), then SIGKILL if it has not exited within ``stop_timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
