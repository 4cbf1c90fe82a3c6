"""OpenAI-compatible HTTP server: ``python -m pegainfer serve``.

``run_server(args)`` binds the port first (a port in use is a one-line error before anything loads), then starts
the engine thread (which loads and warms up the model) and uvicorn at once, so ``GET /health`` answers 503 while
the model loads and 200 once it is ready; if loading fails, the server stops and the error is raised to the CLI.  ``build_app`` (in ``app.py``) is the Starlette app on its own, for tests and for
embedding in other ASGI servers.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import socket
import sys
import threading
from typing import Callable, Optional

from pegainfer import argtypes
from pegainfer.errors import PegainferError
from pegainfer.server.app import DEFAULT_MAX_BODY_BYTES, build_app
from pegainfer.argtypes import add_chat_template_argument

__all__ = ["add_serve_arguments", "build_app", "run_server"]

log = logging.getLogger("pegainfer.server")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The serve-only flags (the CLI adds --model-path, --max-model-len, --cuda-graph itself)."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=argtypes.port, default=8000, help="TCP port (default 8000; 0: any free port)")
    p.add_argument("--api-key", default=os.environ.get("PEGAINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (default: "
                        "$PEGAINFER_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: the model folder's name)")
    p.add_argument("--max-waiting", type=argtypes.max_waiting, default=64,
                   help="most requests waiting for a place in the batch (not yet admitted: a request being "
                        "prefilled or decoded counts as running, up to --max-batch of them); beyond that new ones "
                        "get 503 + Retry-After (default 64)")
    p.add_argument("--max-batch", "--max-num-seqs", type=argtypes.positive, default=256,
                   help="most requests running at once, decoded together in one step (default 256; --max-num-seqs is "
                        "vLLM's name); KV cache pages "
                        "are taken as sequences grow, and when they run out the newest request is paused and "
                        "recomputed later (preemption)")
    p.add_argument("--max-num-batched-tokens", type=argtypes.positive, default=2048,
                   help="most tokens in one step: every running decode plus chunks of at most 16 prompts being "
                        "prefilled (default 2048; at least --max-batch). Smaller: shorter pauses between tokens while "
                        "prompts arrive; larger: faster prompts")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: requests are admitted in arrival order (default); priority: by the request's "
                        "'priority' field (lower first, then arrival), and a full KV cache pauses the running "
                        "request of the highest value first")
    p.add_argument("--gpu-memory-utilization", type=argtypes.memory_fraction, default=0.9,
                   help="fraction of the GPU's memory pegainfer may use (default 0.9); the KV cache gets what the "
                        "weights and buffers leave")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV cache of prompts that start with the same tokens as an earlier one (their "
                        "prefill is skipped; usage.prompt_tokens_details.cached_tokens says how many). Default: on "
                        "for Qwen3, off for Qwen3.5 (on, Qwen3.5 also keeps --prefix-state-snapshots copies of its "
                        "recurrent state at page boundaries: where each sequence first reaches one, and where a "
                        "shared prefix's cached pages end)")
    p.add_argument("--prefix-state-snapshots", type=argtypes.positive, default=None,
                   help="Qwen3.5 with --enable-prefix-caching: copies of the recurrent state kept for the prefix "
                        "cache, least recently used out first (default 16; ~50 MB each for Qwen3.5-4B, ~26 MB with a "
                        "bf16 state; taken from the KV cache). More: more conversations find the state of their last "
                        "turn")
    p.add_argument("--max-body-bytes", type=argtypes.positive, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted, in bytes (default {DEFAULT_MAX_BODY_BYTES}); bigger → 413")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="do not log the engine's figures every 10 s while it works (prompt and generation "
                        "throughput, requests running and waiting, KV cache usage, prefix cache hit rate)")
    p.add_argument("--access-log", action="store_true",
                   help="also log one line per HTTP request in uvicorn's access-log format (pegainfer logs one "
                        "line per completion either way)")
    add_chat_template_argument(p)
    p.add_argument("--allowed-origins", type=argtypes.origins, default=None, metavar="ORIGINS",
                   help="let web pages of these origins call the API from a browser (CORS): a JSON list "
                        "'[\"https://a.example\"]' or comma-separated, * for any (default: none, so a page of "
                        "another origin cannot read the answers)")
    p.add_argument("--allowed-methods", type=argtypes.origins, default=["*"], metavar="METHODS",
                   help="with --allowed-origins: the HTTP methods allowed across origins (default *)")
    p.add_argument("--allowed-headers", type=argtypes.origins, default=["*"], metavar="HEADERS",
                   help="with --allowed-origins: the request headers allowed across origins (default *)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="with --allowed-origins: let browsers send cookies and HTTP authentication across origins")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key file (PEM; with "
                                                       "--ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate file (PEM; with "
                                                        "--ssl-keyfile)")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "qwen3", "none"],
                   help="split the model's <think>...</think> from its answer into message.reasoning_content "
                        "(delta.reasoning_content when streamed). Default auto: on (qwen3) for Qwen3 / Qwen3.5 "
                        "folders, whose chat template writes <think> blocks; off for others. none: the thinking "
                        "stays in content")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (IPv6 when ``host`` has a colon, as uvicorn binds), or a one-line
    ``PegainferError`` naming the address (a port in use, a host that is not this machine's, ...)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # (a port in TIME_WAIT is free; one in use not)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = (": is another server running there? Stop it, or choose another port with --port"
                if e.errno == errno.EADDRINUSE else "")
        raise PegainferError(f"cannot listen on {host}:{port} ({e.strerror}){hint}") from None
    return sock


def cors_options(args: argparse.Namespace) -> Optional[dict]:
    """``CORSMiddleware``'s arguments from ``--allowed-origins`` and its companions; None without origins."""
    origins = getattr(args, "allowed_origins", None)
    if not origins:
        return None
    return dict(allow_origins=origins, allow_methods=getattr(args, "allowed_methods", ["*"]),
                allow_headers=getattr(args, "allowed_headers", ["*"]),
                allow_credentials=getattr(args, "allow_credentials", False))


def tls_files(args: argparse.Namespace) -> tuple[Optional[str], Optional[str]]:
    """(key file, certificate file) of ``--ssl-keyfile`` / ``--ssl-certfile``: both or neither, each readable."""
    key, cert = getattr(args, "ssl_keyfile", None), getattr(args, "ssl_certfile", None)
    if bool(key) != bool(cert):
        raise PegainferError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert)):
        if path and not os.path.isfile(path):
            raise PegainferError(f"{flag} {path}: no such file")
    if key:   # read now, as uvicorn will: a bad pair is a one-line error before the port is bound
        import ssl
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise PegainferError(f"cannot serve HTTPS with --ssl-certfile {cert} and --ssl-keyfile {key} ({e}): "
                                 f"give a PEM certificate and its private key") from None
    return key, cert


def engine_from_args(args: argparse.Namespace):
    """The engine ``serve`` loads: the model folder, limits, scheduling and launch policy of its arguments."""
    from pegainfer.engine.engine import Engine, engine_policy
    return Engine.from_folder(args.model_path, args.max_model_len, max_batch=getattr(args, "max_batch", 1),
                              use_cuda_graph=getattr(args, "cuda_graph", True),
                              async_scheduling=getattr(args, "async_scheduling", True),
                              max_num_batched_tokens=getattr(args, "max_num_batched_tokens", 2048),
                              gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
                              enable_prefix_caching=getattr(args, "enable_prefix_caching", None),
                              prefix_state_snapshots=getattr(args, "prefix_state_snapshots", None),
                              scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
                              chat_template=getattr(args, "chat_template", None),
                              mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "auto"),
                              policy=engine_policy(getattr(args, "launch_policy", None)))


def run_server(args: argparse.Namespace, engine_factory: Optional[Callable[[], object]] = None,
               sock: Optional[socket.socket] = None) -> int:
    """Serve until interrupted.  ``engine_factory`` (tests) replaces loading ``args.model_path``; ``sock`` is an
    already-bound listening socket to serve on instead of ``--host``/``--port``."""
    import uvicorn

    import pegainfer
    from pegainfer.engine.async_engine import AsyncEngine
    from pegainfer.engine.stats_log import StatsLogger

    if args.max_waiting is not None and args.max_waiting < 0:
        raise PegainferError("--max-waiting must be >= 0")
    if getattr(args, "max_batch", 1) < 1:
        raise PegainferError("--max-batch must be at least 1")
    ssl_files = tls_files(args)
    own_socket = sock is None
    if own_socket:   # bind before anything loads: a port in use fails here, at once
        sock = bind(args.host, args.port)
    # The engine thread runs Python between GPU steps every few ms; with the default 5 ms GIL switch interval the
    # event loop could wait a whole step for the GIL and streamed chunks would bunch up (measured on the H200: a
    # 128-token stream arrived all at once). 0.5 ms lets the loop in between steps.
    sys.setswitchinterval(0.0005)
    if engine_factory is None:
        def engine_factory():
            return engine_from_args(args)

    tracing = contextlib.ExitStack()
    trace_folder = getattr(args, "trace_output_path", None)
    if trace_folder:
        load_engine = engine_factory

        def engine_factory():  # trace every step of the server's life; written when the server stops
            from pegainfer.trace import maybe_trace
            engine = load_engine()
            tracing.enter_context(maybe_trace(trace_folder, engine))
            return engine

    async_engine = AsyncEngine(engine_factory=engine_factory, max_waiting=args.max_waiting)
    app = build_app(async_engine, args.served_model_name, api_key=args.api_key,
                    max_body_bytes=getattr(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES),
                    reasoning_parser=getattr(args, "reasoning_parser", "auto"), cors=cors_options(args))
    config = uvicorn.Config(app, access_log=getattr(args, "access_log", False),
                            log_level=getattr(args, "log_level", "info"), timeout_graceful_shutdown=5,
                            ssl_keyfile=ssl_files[0], ssl_certfile=ssl_files[1])
    server = uvicorn.Server(config)

    def report_when_loaded():
        if async_engine.wait_ready():
            eng = async_engine.engine
            name = args.served_model_name or getattr(eng, "model_name", "?")
            log.info("model ready: serving '%s' (max model len %s)%s", name, getattr(eng, "max_model_len", "?"),
                     " — the built-in demo model: RANDOM weights, gibberish text" if getattr(eng, "is_demo", False)
                     else "")
        elif async_engine.state == "failed":
            server.should_exit = True  # /health said 503 while loading; now give up

    bound = sock.getsockname()
    where = f"[{bound[0]}]:{bound[1]}" if sock.family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"
    log.info("%s", pegainfer.device.describe())
    log.info("listening on %s://%s (loading %s; GET /health answers 200 when ready)",
             "https" if ssl_files[0] else "http", where,
             getattr(args, "model_path", None) or "the built-in demo model")
    async_engine.start()
    threading.Thread(target=report_when_loaded, name="pegainfer-load-watch", daemon=True).start()
    stats_log = None if getattr(args, "disable_log_stats", False) else StatsLogger(async_engine.stats).start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: a normal way to stop
        pass
    finally:
        if stats_log is not None:
            stats_log.stop()
        async_engine.shutdown()
        tracing.close()
        if own_socket:
            sock.close()
        log.info("server stopped")
    if async_engine.load_error is not None:
        if isinstance(async_engine.load_error, PegainferError):
            raise async_engine.load_error
        raise RuntimeError(f"the engine failed: {async_engine.load_error!r}") from async_engine.load_error
    return 0
