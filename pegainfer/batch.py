"""``python -m pegainfer run-batch``: a file of requests in OpenAI's Batch API format, answered offline.

Input: JSONL, one request a line -- ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" (or
"/v1/completions", "/v1/responses"), "body": {...}}``, the body any request to that route may carry.  Output: JSONL,
one line a request in the input's order -- ``{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}``, or for a line that is not a request at all ``"response": null`` and ``"error": {"code",
"message"}`` (OpenAI's and vLLM's ``run-batch`` shapes).

How: the server's app runs in this process over the engine (no port: each request goes through an in-memory ASGI
transport), so a line's answer is exactly what ``serve`` answers, its validation and errors included, and all lines
are in flight at once (up to ``--max-concurrency``): the engine batches them as it batches a server's clients.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid

from pegainfer import argtypes

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input-file", required=True, help="JSONL of requests (OpenAI's Batch API input format)")
    p.add_argument("-o", "--output-file", required=True, help="JSONL of answers, one a request, in the input's order")
    p.add_argument("--max-batch", "--max-num-seqs", type=argtypes.positive, default=64,
                   help="most requests decoded together in one step (default 64)")
    p.add_argument("--max-num-batched-tokens", type=argtypes.positive, default=2048,
                   help="most tokens in one step (default 2048; at least --max-batch)")
    p.add_argument("--max-concurrency", type=argtypes.positive, default=None,
                   help="most requests handed to the engine at once (default: twice --max-batch)")
    p.add_argument("--served-model-name", default=None, help="the model name the bodies may name (default: the "
                                                             "model folder's name)")


def parse_line(k: int, line: str):
    """(custom_id, url, body) of input line ``k`` (1-based), or (custom_id or None, None, error message)."""
    try:
        item = json.loads(line)
    except ValueError as e:
        return None, None, f"line {k} is not JSON: {e}"
    if not isinstance(item, dict):
        return None, None, f"line {k} is not a JSON object"
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str):
        return None, None, f"line {k} has no 'custom_id' string"
    url, body = item.get("url"), item.get("body")
    if item.get("method", "POST") != "POST" or url not in ROUTES:
        return custom_id, None, f"line {k}: 'method' must be POST and 'url' one of {', '.join(ROUTES)}, got " \
                                f"{item.get('method')} {url}"
    if not isinstance(body, dict):
        return custom_id, None, f"line {k}: 'body' must be a JSON object"
    return custom_id, url, body


async def answer_all(app, lines: list[str], concurrency: int) -> list[dict]:
    """Every line's output object, in order."""
    import httpx
    gate = asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app)

    async def one(client, k: int, line: str) -> dict:
        custom_id, url, body = parse_line(k, line)
        out = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": None}
        if url is None:
            out["error"] = {"code": "invalid_request", "message": body}
            return out
        async with gate:
            r = await client.post(url, json={**body, "stream": False})
        out["response"] = {"status_code": r.status_code, "request_id": r.headers.get("x-request-id"),
                           "body": r.json()}
        return out

    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        return await asyncio.gather(*(one(client, k, line) for k, line in enumerate(lines, 1)))


def run_batch(args: argparse.Namespace) -> int:
    from pegainfer.engine.async_engine import AsyncEngine
    from pegainfer.errors import PegainferError
    from pegainfer.server import engine_from_args
    from pegainfer.server.app import build_app

    try:
        with open(args.input_file, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        raise PegainferError(f"cannot read --input-file {args.input_file}: {e.strerror}") from None
    try:
        out_file = open(args.output_file, "w", encoding="utf-8")
    except OSError as e:
        raise PegainferError(f"cannot write --output-file {args.output_file}: {e.strerror}") from None
    logging.getLogger("httpx").setLevel(logging.WARNING)     # a line per request otherwise
    async_engine = AsyncEngine(engine_from_args(args), max_waiting=None).start()
    try:
        if not async_engine.wait_ready():
            raise PegainferError(f"the engine failed to start: {async_engine.load_error}")
        app = build_app(async_engine, args.served_model_name)
        t0 = time.perf_counter()
        results = asyncio.run(answer_all(app, lines, args.max_concurrency or 2 * args.max_batch))
        seconds = time.perf_counter() - t0
    finally:
        async_engine.shutdown()
    with out_file:
        for r in results:
            out_file.write(json.dumps(r, ensure_ascii=False) + "\n")
    ok = sum(1 for r in results if r["response"] is not None and r["response"]["status_code"] == 200)
    tokens = sum((r["response"]["body"].get("usage") or {}).get("completion_tokens",
                 (r["response"]["body"].get("usage") or {}).get("output_tokens", 0))
                 for r in results if r["response"] is not None and r["response"]["status_code"] == 200)
    print(f"[pegainfer] {len(results)} requests: {ok} answered, {len(results) - ok} failed; {tokens} tokens "
          f"generated in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tok/s) -> {args.output_file}",
          file=sys.stderr)
    return 0
