"""The figures of a serving benchmark, from the per-request results (``client.RequestResult``), named as
``vllm bench serve`` names them in its JSON so results can be compared key by key:

* ``request_throughput`` (requests/s), ``output_throughput`` (generated tokens/s), ``total_token_throughput``
  (prompt + generated tokens/s): successful requests' counts over ``duration`` — the wall time from the first
  request sent to the last one ended;
* TTFT — request sent → first token event; TPOT — ``(latency - TTFT) / (output tokens - 1)`` per request (the
  mean time per token after the first; requests of one token have none); ITL — every gap between two token events
  of one stream, all streams pooled; E2EL — request sent → ``[DONE]``.  Each as ``mean_*_ms``, ``std_*_ms``,
  ``median_*_ms`` (p50), ``p90_*_ms``, ``p99_*_ms`` and ``max_*_ms``; ``max_itl_ms`` is the worst gap between two
  tokens of one stream;
* ``completed``, ``failed`` (and ``errors``: up to 10 distinct error lines), ``total_input_tokens`` /
  ``total_output_tokens`` (the server's ``usage``), ``total_cached_tokens`` (of the input tokens, those the
  server's prefix cache gave: ``usage.prompt_tokens_details.cached_tokens``), ``mismatched_outputs`` (successful requests whose output token
  count differs from the one asked for: a server that ignores ``ignore_eos``), ``peak_concurrency`` (most
  requests in flight at one time), ``tokens_per_chunk`` (output tokens per token event: above 1 when the server
  bundles tokens or holds some back).

A statistic over no values (no successful request, no request of two tokens) is ``None``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pegainfer.serving_bench.client import RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "std", "median", "p90", "p99", "max")


def latency_stats(name: str, seconds: Sequence[float]) -> dict:
    """``{stat}_{name}_ms`` for every statistic in ``STATS`` over ``seconds`` (None each when empty)."""
    if len(seconds) == 0:
        return {f"{s}_{name}_ms": None for s in STATS}
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    values = (ms.mean(), ms.std(), np.percentile(ms, 50), np.percentile(ms, 90), np.percentile(ms, 99), ms.max())
    return {f"{s}_{name}_ms": float(v) for s, v in zip(STATS, values)}


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """The most requests in flight at one time (a request counts from when it is sent until its last byte)."""
    events = []
    for r in results:
        if r.start:
            events.append((r.start, 1))
            events.append((r.start + r.latency, -1))
    events.sort(key=lambda e: (e[0], e[1]))   # an end before a start at the same instant
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict:
    """Every figure of the module docstring, as one flat JSON-ready dict."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out = {
        "duration_s": float(duration_s),
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": int(total_in),
        "total_output_tokens": int(total_out),
        "total_cached_tokens": int(sum(r.cached_tokens for r in ok)),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": total_out / duration_s if duration_s > 0 else None,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s > 0 else None,
    }
    ttfts = [r.ttft for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [gap for r in ok for gap in r.itls]
    e2els = [r.latency for r in ok]
    for name, values in zip(LATENCIES, (ttfts, tpots, itls, e2els)):
        out.update(latency_stats(name, values))
    chunks = sum(r.chunks for r in ok)
    out["tokens_per_chunk"] = total_out / chunks if chunks else None
    out["mismatched_outputs"] = sum(1 for r in ok if r.output_tokens != r.output_len)
    out["peak_concurrency"] = peak_concurrency(results)
    errors: list[str] = []
    for r in failed:
        if r.error not in errors:
            errors.append(r.error)
    out["errors"] = errors[:10]
    return out


def per_request(results: Sequence[RequestResult]) -> list[dict]:
    """One JSON row per request: lengths asked and served, TTFT / latency / worst gap in ms, chunks, error."""
    def ms(x: Optional[float]) -> Optional[float]:
        return None if x is None else 1e3 * x
    rows = []
    for r in results:
        rows.append({"index": r.index, "input_len": r.input_len, "output_len": r.output_len,
                     "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                     "cached_tokens": r.cached_tokens, "success": r.success,
                     "ttft_ms": ms(r.ttft) if r.success else None, "latency_ms": ms(r.latency) if r.success else None,
                     "max_itl_ms": ms(max(r.itls)) if r.itls else None, "chunks": r.chunks, "error": r.error})
    return rows
