"""Server test harness: a real uvicorn server on a free loopback port, in a thread of the test process (so tests
can look at the engine's own accounting), serving an AsyncEngine over a FakeEngine or the demo model."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from pegainfer.engine.async_engine import AsyncEngine
from pegainfer.server.app import build_app
from tests.server.fake_engine import FakeEngine
from tests.text.fixtures import make_model_folder


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("fake-model"))


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def serve_app(app):
    """Run ``app`` under uvicorn on a free loopback port; yield its base URL."""
    sock = free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextlib.contextmanager
def serve_engine(engine, max_waiting=None, **app_kwargs):
    """An AsyncEngine over ``engine`` behind a live server; yields (base_url, async_engine)."""
    ae = AsyncEngine(engine, max_waiting=max_waiting).start()
    assert ae.wait_ready(30)
    try:
        with serve_app(build_app(ae, **app_kwargs)) as url:
            yield url, ae
    finally:
        engine_gate = getattr(engine, "gate", None)
        if engine_gate is not None:
            engine_gate.set()
        ae.shutdown()


def wait_until(predicate, timeout=20.0, what="condition"):
    """Wait for a state change (not for a fixed time): poll ``predicate`` until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def idle(ae) -> bool:
    s = ae.stats()
    return (s.get("waiting") == 0 and s.get("running") == 0 and s.get("kv_pages_used") == 0
            and s.get("slots_used") == 0 and s["pending"] == 0 and s["streams"] == 0)


@pytest.fixture
def fake_server(model_folder):
    """A server over a fresh FakeEngine (max_batch 2); yields (url, async_engine, fake_engine)."""
    engine = FakeEngine(model_folder)
    with serve_engine(engine) as (url, ae):
        yield url, ae, engine


@contextlib.contextmanager
def serve_hash_engine(timeout: float = 900, **engine_kwargs):
    """The real engine over the hash model (``tests/engine/hash_engine.py``) behind a live server: yields (an
    openai client, the base url, the engine)."""
    import openai

    from tests.engine.hash_engine import hash_engine
    engine = hash_engine(**engine_kwargs)
    ae = AsyncEngine(engine, max_waiting=16).start()
    assert ae.wait_ready(60)
    try:
        with serve_app(build_app(ae)) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout), url, engine
    finally:
        ae.shutdown()
