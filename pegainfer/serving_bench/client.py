"""The benchmark's HTTP client: streamed ``POST /v1/completions`` requests sent on a schedule, each timed chunk by
chunk (``httpx``, async, one connection per request in flight).

A request asks for exactly its output length: ``max_tokens`` = the length, ``ignore_eos``, greedy, ``stream`` with
``stream_options.include_usage`` so the last event carries the server's own token counts.  Its timings, all on
the client's clock from the moment the request is sent:

* TTFT — until the first event that carries a token (text, or a ``logprobs`` entry);
* the inter-token gaps (ITL) — between consecutive token events; events that arrive in the same network read get
  the same time (a gap of 0), which is what a user sees;
* latency — until ``data: [DONE]``.

A server sends no event for a token whose text is empty or held back (a partial UTF-8 character, a special
token), so such a token's time is counted in the next event's gap; ``chunks`` per request shows how often.

A request fails (and is counted as failed, never raised) on a refused connection, an HTTP status other than 200,
an error event inside the stream, or a stream that ends without ``[DONE]``; ``error`` holds one line saying which.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence
from urllib.parse import urlsplit

import httpx

from pegainfer.errors import PegainferError
from pegainfer.serving_bench.workload import BenchRequest

STREAMS_PER_PROCESS = 16   # requests in flight per client process when their number is chosen automatically
MAX_AUTO_PROCESSES = 8


@dataclass
class RequestResult:
    """What one request measured (seconds on ``time.perf_counter``'s clock)."""
    index: int
    input_len: int                 # tokens the benchmark meant to send
    output_len: int                # tokens it asked for
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0         # the server's usage.prompt_tokens (input_len when it sends no usage)
    output_tokens: int = 0         # the server's usage.completion_tokens (the token events when it sends none)
    cached_tokens: int = 0         # the server's usage.prompt_tokens_details.cached_tokens (prefix cache hits)
    start: float = 0.0             # when the request was sent
    ttft: float = 0.0
    latency: float = 0.0
    itls: list = field(default_factory=list)   # gaps between consecutive token events
    chunks: int = 0                # token events received


def check_base_url(url: str) -> str:
    """``url`` without a trailing slash, or a one-line error when it is not ``http(s)://host[:port]``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise PegainferError(f"--base-url {url!r} is not an http:// or https:// URL: give e.g. "
                             f"http://127.0.0.1:8000")
    return url.rstrip("/")


def _headers(api_key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_info(base_url: str, api_key: Optional[str] = None, timeout: float = 10.0) -> dict:
    """The first model card of ``GET /v1/models`` (``id``, and ``max_model_len`` when the server says it), or a
    one-line ``PegainferError`` saying why the server cannot be used."""
    try:
        r = httpx.get(f"{base_url}/v1/models", headers=_headers(api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise PegainferError(f"cannot reach the server at {base_url} ({type(e).__name__}: {e}): is it running, "
                             f"and is the URL right?") from None
    if r.status_code == 401:
        raise PegainferError(f"the server at {base_url} wants an API key: pass --api-key (or set "
                             f"PEGAINFER_API_KEY)")
    if r.status_code != 200:
        raise PegainferError(f"GET {base_url}/v1/models answered HTTP {r.status_code}: is this an OpenAI-compatible "
                             f"server?")
    try:
        data = r.json()["data"]
        return dict(data[0])
    except (ValueError, KeyError, IndexError, TypeError):
        raise PegainferError(f"GET {base_url}/v1/models did not list a model: is this an OpenAI-compatible "
                             f"server?") from None


STEP_COUNTERS = {"pegainfer:cuda_graphs": "cuda_graphs", "pegainfer:eager_mixed_steps": "eager_mixed_steps",
                 "pegainfer:cuda_graph_capture_seconds": "cuda_graph_capture_seconds"}
"""The ``/metrics`` families that say how the server ran its steps (a pegainfer server's; others have none)."""


def step_counters(base_url: str, timeout: float = 10.0) -> dict:
    """The server's ``STEP_COUNTERS`` now (summed over models), or {} when ``/metrics`` has none of them (not a
    pegainfer server, or no ``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        r = httpx.get(f"{base_url}/metrics", timeout=timeout)
        if r.status_code != 200:
            return {}
        out = {}
        for family in text_string_to_metric_families(r.text):
            key = STEP_COUNTERS.get(family.name)
            if key is not None:
                out[key] = sum(s.value for s in family.samples if not s.name.endswith("_created"))
        return out
    except (httpx.HTTPError, ValueError):
        return {}


def _error_line(status: int, body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body[:200].decode("utf-8", "replace").strip()
    return f"HTTP {status}: {msg}"


def request_body(model: str, req: BenchRequest, extra: Optional[dict] = None) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    body.update(extra or {})
    return body


def _read_event(payload: bytes, res: RequestResult) -> int:
    """Apply one ``data:`` event to ``res``; return the tokens it carries (0 for none)."""
    obj = json.loads(payload)
    if "error" in obj and not obj.get("choices"):
        err = obj["error"]
        raise _StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
    usage = obj.get("usage")
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens", res.prompt_tokens))
        res.output_tokens = int(usage.get("completion_tokens", res.output_tokens))
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens") or 0)
    choices = obj.get("choices") or ()
    if not choices:
        return 0
    c = choices[0]
    lp = c.get("logprobs")
    if lp and lp.get("tokens"):
        return len(lp["tokens"])
    return 1 if c.get("text") else 0


class _StreamError(Exception):
    pass


async def send_request(client: httpx.AsyncClient, url: str, body: dict, res: RequestResult) -> RequestResult:
    """Send one streamed completion and fill ``res`` with its timings (never raises for a failed request)."""
    res.start = time.perf_counter()
    last = None
    counted = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = _error_line(r.status_code, await r.aread())
                return res
            buf = b""
            done = False
            async for data in r.aiter_bytes():
                now = time.perf_counter()
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            done = True
                            continue
                        n = _read_event(payload, res)
                        if n:
                            if last is None:
                                res.ttft = now - res.start
                            else:
                                res.itls.append(now - last)
                            last = now
                            res.chunks += 1
                            counted += n
            res.latency = time.perf_counter() - res.start
            if not done:
                res.error = "the stream ended without data: [DONE]"
                return res
    except _StreamError as e:
        res.error = f"error in the stream: {e}"
        return res
    except (httpx.HTTPError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}".strip()
        return res
    except ValueError as e:   # an event that is not JSON
        res.error = f"a stream event is not valid JSON ({e})"
        return res
    if not res.output_tokens:
        res.output_tokens = counted
    if not res.prompt_tokens:
        res.prompt_tokens = res.input_len
    res.success = last is not None
    if not res.success:
        res.error = "the stream carried no token"
    return res


async def run_requests(base_url: str, model: str, requests: Sequence[BenchRequest], arrivals: Sequence[float],
                       max_concurrency: Optional[int], api_key: Optional[str] = None,
                       timeout_s: Optional[float] = None, extra_body: Optional[dict] = None,
                       start_at: Optional[float] = None) -> tuple[list[RequestResult], float]:
    """Send ``requests``, the i-th no earlier than ``arrivals[i]`` seconds after the start and, with
    ``max_concurrency``, only while fewer than that many are in flight (a request that waits for a place is sent
    when one frees: its timings start then).  The start is now, or ``start_at`` (a ``time.perf_counter()`` value:
    the clock every process of the machine shares).  Returns the results in request order and the wall time from
    the start until the last request ended."""
    limit = max_concurrency or max(1, len(requests))
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = f"{base_url}/v1/completions"
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=_headers(api_key)) as client:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        t0 = time.perf_counter() if start_at is None else start_at

        async def one(req: BenchRequest, at: float) -> RequestResult:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            res = RequestResult(req.index, req.input_len, req.output_len)
            body = request_body(model, req, extra_body)
            if gate is None:
                return await send_request(client, url, body, res)
            async with gate:
                return await send_request(client, url, body, res)

        results = await asyncio.gather(*(one(r, float(a)) for r, a in zip(requests, arrivals)))
        duration = time.perf_counter() - t0
    return list(results), duration


# ------------------------------------------------------------------------------------------------ several processes
def client_processes(requested: int, in_flight: int) -> int:
    """How many client processes to use: ``requested``, or when 0, one per ``STREAMS_PER_PROCESS`` requests that
    can be in flight, at most ``MAX_AUTO_PROCESSES`` and half the machine's cores (at least 1)."""
    if requested:
        return requested
    cores = max(1, (os.cpu_count() or 1) // 2)
    return max(1, min(-(-in_flight // STREAMS_PER_PROCESS), MAX_AUTO_PROCESSES, cores))


def _worker(conn, args: tuple) -> None:
    """One client process: say it is ready, wait for the common start time, run its share, send the results,
    the time its last request ended and its CPU seconds back."""
    conn.send("ready")
    start_at = conn.recv()
    cpu0 = time.process_time()
    results, duration = asyncio.run(run_requests(*args, start_at=start_at))
    conn.send((results, start_at + duration, time.process_time() - cpu0))
    conn.close()


def run_in_processes(processes: int, base_url: str, model: str, requests: Sequence[BenchRequest],
                     arrivals: Sequence[float], max_concurrency: Optional[int], api_key: Optional[str] = None,
                     timeout_s: Optional[float] = None, extra_body: Optional[dict] = None
                     ) -> tuple[list[RequestResult], float, list[float]]:
    """``run_requests`` spread over ``processes`` client processes (one Python process parses a few thousand
    stream events per second: more would make the client what is measured).  Process k sends requests k, k + P,
    k + 2P, ... at their arrival times from one common start, and keeps its share of ``max_concurrency`` (so there
    are at most ``max_concurrency`` processes: each holds at least one place).  Returns the results in request
    order, the wall time from the start until the last request ended, and each process's CPU seconds."""
    processes = min(processes, len(requests), max_concurrency or len(requests))
    if processes <= 1:
        cpu0 = time.process_time()
        results, duration = asyncio.run(run_requests(base_url, model, requests, arrivals, max_concurrency, api_key,
                                                     timeout_s, extra_body))
        return results, duration, [time.process_time() - cpu0]
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")    # a fresh interpreter: the caller may hold threads or a GPU
    workers = []
    for k in range(processes):
        share = None
        if max_concurrency:
            share = max(1, max_concurrency // processes + (k < max_concurrency % processes))
        args = (base_url, model, list(requests[k::processes]), list(arrivals[k::processes]), share, api_key,
                timeout_s, extra_body)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, args), daemon=True)
        proc.start()
        child.close()
        workers.append((proc, parent))
    try:
        for proc, conn in workers:
            if conn.recv() != "ready":
                raise PegainferError("a client process did not start")
        start_at = time.perf_counter() + 0.05
        for _, conn in workers:
            conn.send(start_at)
        results, ends, cpus = [], [], []
        for proc, conn in workers:
            got, end, cpu = conn.recv()
            results += got
            ends.append(end)
            cpus.append(cpu)
    except EOFError:
        raise PegainferError("a client process ended without its results (out of memory?)") from None
    finally:
        for proc, conn in workers:
            conn.close()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    results.sort(key=lambda r: r.index)
    return results, max(ends) - start_at, cpus
