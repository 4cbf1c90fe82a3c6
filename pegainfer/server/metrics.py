"""Prometheus metrics for ``GET /metrics``: engine gauges and counters, token counters and latency histograms.

Names: a metric vLLM also exports keeps vLLM's name, ``vllm:`` prefix included (``vllm:num_requests_running``,
``vllm:time_to_first_token_seconds``, ...), with the same type, unit and ``model_name`` label, so vLLM's Grafana
dashboard, autoscaling rules (KEDA / HPA on ``vllm:num_requests_waiting``) and routers that read
``vllm:kv_cache_usage_perc`` work against pegainfer unchanged — a ``pegainfer:`` copy of the same series would make
every one of them need editing.  What vLLM has no name for is ``pegainfer:`` (the KV page counts).  ``process_*``
are prometheus-client's usual process metrics (resident memory, CPU, open files).

Where the numbers come from:

* gauges and the engine's cumulative counters (preemptions, prefix-cache queries / hits) are read at scrape time
  from ``AsyncEngine.stats()``: the copy of ``Engine.stats()`` the engine thread refreshes between steps, so a
  scrape never calls into the engine or waits for a step;
* token counters, finished requests and the latency histograms are observed by the server, once per request,
  when it ends: TTFT from the request's arrival at the server to its first token; e2e to its last output; TPOT
  (per request, vLLM's ``request_time_per_output_token``) = (e2e − TTFT) / (completion tokens − 1); queue time
  from arrival to the request's first step (the engine reports when that was), prefill to the first token, decode
  from there to the last, inference from the first step to the last token; and each request's prompt and
  generation token counts.  Nothing is
  observed per token: the streaming path stays as cheap as it was.  Latencies are observed for requests that ended
  with ``stop`` / ``length`` (an aborted stream's e2e says nothing about the server); TTFT for every request that
  got a first token.

Each app has its own ``CollectorRegistry`` (not prometheus-client's global one), so one process can hold several
apps (tests) and the global registry's contents never leak into ``/metrics``.
"""
from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE_LATEST", "FINISHED_REASONS", "ServerMetrics", "finished_reason"]

FINISHED_REASONS = ("stop", "length", "abort", "error")   # vLLM's ``finished_reason`` label values
LABELS = ["model_name"]

# vLLM's buckets, with sub-10 ms ones added for TPOT (pegainfer's single-stream TPOT is ~2.3 ms on an H200)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5) + E2E_BUCKETS[4:]   # queue, prefill, decode, ...
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def finished_reason(finish: str) -> str:
    """The ``finished_reason`` label of a request the server logged as ending with ``finish``: ``stop`` (also for
    ``tool_calls``), ``length``, ``abort`` (the client went away, or the server dropped it: a 503) or ``error``."""
    if finish in ("stop", "tool_calls"):
        return "stop"
    if finish == "length":
        return "length"
    if finish == "cancelled" or finish == "error:503":
        return "abort"
    return "error"


class _EngineCollector:
    """Reads the engine's gauges and cumulative counters from ``AsyncEngine.stats()`` at scrape time."""

    def __init__(self, async_engine, model_name: Callable[[], str]):
        self.async_engine = async_engine
        self.model_name = model_name

    def describe(self):
        return self._families({})

    def collect(self):
        return self._families(self.async_engine.stats())

    def _families(self, s: dict):
        name = [self.model_name()] if s else None
        get = lambda key: float(s.get(key, 0) or 0)   # noqa: E731  (fake engines may leave keys out)
        used, total = get("kv_pages_used"), get("kv_pages_total")

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(metric, doc, labels=LABELS)
            if name:
                g.add_metric(name, value)
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(metric, doc, labels=LABELS)
            if name:
                c.add_metric(name, value)
            return c

        return [
            gauge("vllm:num_requests_running", "Number of requests in the batch (prefilling or decoding).",
                  get("running")),
            gauge("vllm:num_requests_waiting", "Number of requests waiting for a place in the batch (queued to the "
                                               "engine thread, or in the engine's waiting list).",
                  get("waiting") + get("pending")),
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  used / total if total else 0.0),
            gauge("pegainfer:kv_pages_used", "KV-cache pages held by requests (prefix-cache pages no request holds "
                                              "are reclaimable and not counted).", used),
            gauge("pegainfer:kv_pages_total", "KV-cache pages in the page pool.", total),
            counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                    get("num_preemptions")),
            counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                    get("prefix_cache_queries")),
            counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                    get("prefix_cache_hits")),
            gauge("pegainfer:prefix_state_snapshots", "Copies of a hybrid model's recurrent state kept at page "
                                                      "boundaries for the prefix cache (Qwen3.5; 0 otherwise).",
                  get("prefix_state_snapshots")),
            gauge("pegainfer:cuda_graphs", "CUDA graphs of whole steps instantiated (decode batch sizes, prompt-chunk "
                                           "buckets, mixed-step shapes).", get("cuda_graphs")),
            counter("pegainfer:eager_mixed_steps", "Mixed steps (decodes beside prompt chunks) launched kernel by "
                                                   "kernel instead of replayed from a CUDA graph.",
                    get("eager_mixed_steps")),
            counter("pegainfer:cuda_graph_capture_seconds", "Seconds the engine spent capturing CUDA graphs of step "
                                                            "shapes it met for the first time while serving (every "
                                                            "running stream waits meanwhile).",
                    get("cuda_graph_capture_seconds")),
            counter("pegainfer:gc_pause_seconds", "Seconds the process spent in Python garbage collections (the "
                                                  "engine thread, so every stream, waits meanwhile).",
                    get("gc_pause_seconds")),
            counter("pegainfer:gc_full_collections", "Full (generation-2) Python garbage collections.",
                    get("gc_full_collections")),
            gauge("pegainfer:gc_longest_pause_seconds", "The longest single Python garbage collection since the "
                                                        "engine finished warming up, in seconds.",
                  get("gc_longest_pause_seconds")),
        ]


class ServerMetrics:
    """The metrics of one app.  ``request_finished`` is called once per request that reached the engine;
    ``render`` is the body of ``GET /metrics``.  Used on the event loop (prometheus-client is thread-safe anyway)."""

    def __init__(self, async_engine, model_name: Callable[[], str], known_model_name: Callable[[], Optional[str]]):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.known_model_name = known_model_name
        ProcessCollector(registry=self.registry)
        self.registry.register(_EngineCollector(async_engine, model_name))
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS,
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Count of finished requests, by finish reason.",
                                       LABELS + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds (from the request's arrival).", LABELS,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", LABELS,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=E2E_BUCKETS, registry=r)
        phase = lambda name, doc: Histogram(name, doc, LABELS, buckets=PHASE_BUCKETS, registry=r)  # noqa: E731
        self.queue = phase("vllm:request_queue_time_seconds",
                           "Histogram of time spent waiting before the request's first step, in seconds.")
        self.prefill = phase("vllm:request_prefill_time_seconds",
                             "Histogram of time from the request's first step to its first token, in seconds.")
        self.decode = phase("vllm:request_decode_time_seconds",
                            "Histogram of time from the request's first token to its last, in seconds.")
        self.inference = phase("vllm:request_inference_time_seconds",
                               "Histogram of time from the request's first step to its last token, in seconds.")
        self.prompt_hist = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", LABELS,
                                     buckets=TOKEN_BUCKETS, registry=r)
        self.generation_hist = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                         LABELS, buckets=TOKEN_BUCKETS, registry=r)
        self._children: dict[str, tuple] = {}   # model name → its labelled series (``labels()`` costs a lookup)

    def _series(self, name: str) -> tuple:
        series = self._children.get(name)
        if series is None:
            reasons = {reason: self.request_success.labels(name, reason) for reason in FINISHED_REASONS}
            series = self._children[name] = (self.prompt_tokens.labels(name), self.generation_tokens.labels(name),
                                             reasons, self.ttft.labels(name), self.tpot.labels(name),
                                             self.e2e.labels(name),
                                             tuple(h.labels(name) for h in (self.queue, self.prefill, self.decode,
                                                                            self.inference, self.prompt_hist,
                                                                            self.generation_hist)))
        return series

    def request_finished(self, finish: str, prompt_tokens: int, completion_tokens: int, arrival: float,
                         first_token: Optional[float], end: float, scheduled: Optional[float] = None) -> None:
        """Count one request that ended with ``finish`` (the server's log word: ``stop``, ``tool_calls``,
        ``length``, ``cancelled``, ``error:<status>``); times from ``time.perf_counter()`` (``scheduled``: its
        first step, None when it never ran)."""
        prompt, generation, reasons, ttft, tpot, e2e, phases = self._series(self.model_name())
        queue, prefill, decode, inference, prompt_hist, generation_hist = phases
        reason = finished_reason(finish)
        prompt.inc(prompt_tokens)
        generation.inc(completion_tokens)
        reasons[reason].inc()
        if first_token is not None:
            ttft.observe(first_token - arrival)
        if reason in ("stop", "length"):
            e2e.observe(end - arrival)
            prompt_hist.observe(prompt_tokens)
            generation_hist.observe(completion_tokens)
            if first_token is not None and completion_tokens > 1:
                tpot.observe((end - first_token) / (completion_tokens - 1))
            if scheduled is not None:
                queue.observe(max(scheduled - arrival, 0.0))
                inference.observe(end - scheduled)
                if first_token is not None:
                    prefill.observe(max(first_token - scheduled, 0.0))
                    decode.observe(end - first_token)

    def render(self) -> bytes:
        """The scrape's body.  The request series of the served model exist from the first scrape on, at 0 until a
        request counts (as vLLM's: a series born at 1 hides that request from ``increase()`` and ``rate()``); while
        the engine loads and no name was given, the name is not known yet and they wait."""
        name = self.known_model_name()
        if name is not None:
            self._series(name)
        return generate_latest(self.registry)
