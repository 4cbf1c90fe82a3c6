"""Does the server stay healthy under a long mixed load?  A soak test: ``--concurrency`` clients (default 64) send
streamed and whole ``/v1/completions`` requests back to back for ``--duration`` seconds (default 600) — random
prompt and output lengths (prompts as token ids, ``ignore_eos``, so every good answer must have exactly
``max_tokens`` tokens), some streams left by their client mid-answer (``--abort-fraction``), some malformed requests
(``--bad-fraction``: bad JSON, a negative ``max_tokens``, a prompt longer than the context, an unknown model, a
token id outside the vocabulary).  Every ``--sample-every`` seconds it records the server's resident memory (psutil
or /proc when the server runs here, else ``process_resident_memory_bytes`` from ``/metrics``), the GPU memory in use
(``nvidia-smi``, when there is one) and ``/metrics``' running / waiting requests and KV pages in use, and prints a
row.  At the end, once the server is idle, it prints a verdict:

* zero failed good requests (any non-200, missing token, error event or missing ``[DONE]``), every bad request a
  4xx with an OpenAI error body;
* resident memory flat: the last sample within ``--max-rss-drift-mib`` (or ``--max-rss-drift-pct`` of it, the
  larger) of the first sample after ``--warmup``; GPU memory within ``--max-gpu-drift-mib``;
* the page pool back to zero pages in use, and ``/health`` still 200.

It also says how long the server's garbage collections paused it over the soak (``pegainfer:gc_pause_seconds``)
and the longest single pause (``pegainfer:gc_longest_pause_seconds``: every stream waits that long).

Exit status 0 when every check passes, 1 when one fails, 2 on a usage error.

    python benchmarks/soak.py --url http://127.0.0.1:8000 [--server-pid PID]   # a server already running
    python benchmarks/soak.py --model-path ~/models/Qwen3-4B --max-batch 64     # starts `pegainfer serve` (GPU)
    python benchmarks/soak.py --fake-gpu --duration 10 --concurrency 8          # no GPU: a GPU-like fake engine
"""
import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20
BAD_KINDS = 5        # bad JSON, negative max_tokens, a prompt past the context, an unknown model, a bad token id
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def die(message: str):
    """Stop with a one-line error (exit status 2: the soak could not run)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ================================================================================================ measurements
def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text → {sample name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def rss_bytes(pid: int) -> int:
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no resident memory figure for process {pid}")


def gpu_memory_mib(pid) -> float | None:
    """GPU memory in use (MiB): the server process's when its pid is known, else all of GPU 0's; None without
    nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        if pid is not None:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                                  "nounits"], capture_output=True, text=True, timeout=30).stdout
            for line in out.splitlines():
                p, _, used = line.partition(",")
                if p.strip() == str(pid):
                    return float(used)
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


# ================================================================================================ the clients
class Tally:
    def __init__(self):
        self.good = self.good_failed = self.aborted = self.abort_failed = self.bad = self.bad_wrong = 0
        self.tokens = 0
        self.failures: list[str] = []   # the first few, for the report

    def fail(self, kind: str, what: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.failures) < 10:
            self.failures.append(what[:300])


class Load:
    """The clients: each picks a request kind at random, sends it, checks the answer, and goes again."""

    def __init__(self, args, http, max_model_len: int, model: str):
        self.args, self.http, self.model = args, http, model
        self.max_model_len = max_model_len
        self.tally = Tally()
        self.prompt_range = _range(args.prompt_len)
        self.output_range = _range(args.output_len)

    def _lengths(self, rng: random.Random) -> tuple[list[int], int]:
        n_out = rng.randint(*self.output_range)
        n_in = min(rng.randint(*self.prompt_range), self.max_model_len - n_out - 1)
        return [rng.randrange(3, self.args.max_token_id) for _ in range(max(1, n_in))], n_out

    async def client(self, seed: int, deadline: float, first_bad=None) -> None:
        """Requests back to back until ``deadline``; ``first_bad``: open with that kind of bad request (so a soak
        of five or more clients sends every kind, however short it is)."""
        rng = random.Random(seed)
        if first_bad is not None and self.args.bad_fraction > 0:
            await self.bad(rng, first_bad)
        while time.monotonic() < deadline:
            x = rng.random()
            try:
                if x < self.args.bad_fraction:
                    await self.bad(rng)
                elif x < self.args.bad_fraction + self.args.abort_fraction:
                    await self.abort(rng)
                else:
                    await self.good(rng, stream=rng.random() >= self.args.non_stream_fraction)
            except Exception as e:  # noqa: BLE001 - a transport error is a failed request, not a crashed soak
                self.tally.fail("good_failed", f"{type(e).__name__}: {e}")

    async def good(self, rng: random.Random, stream: bool) -> None:
        prompt, n_out = self._lengths(rng)
        body = {"model": self.model, "prompt": prompt, "max_tokens": n_out, "ignore_eos": True, "temperature": 0}
        if not stream:
            r = await self.http.post("/v1/completions", json=body)
            if r.status_code != 200:
                return self.tally.fail("good_failed", f"{r.status_code}: {r.text}")
            got = r.json()["usage"]["completion_tokens"]
        else:
            body.update(stream=True, stream_options={"include_usage": True})
            got, done = None, False
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return self.tally.fail("good_failed", f"{r.status_code}: {(await r.aread()).decode()}")
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            return self.tally.fail("good_failed", f"error event: {event['error']}")
                        if event.get("usage"):
                            got = event["usage"]["completion_tokens"]
            if not done:
                return self.tally.fail("good_failed", "the stream ended without [DONE]")
        if got != n_out:
            return self.tally.fail("good_failed", f"{got} tokens for max_tokens {n_out} with ignore_eos")
        self.tally.good += 1
        self.tally.tokens += got

    async def abort(self, rng: random.Random) -> None:
        prompt, n_out = self._lengths(rng)
        leave_after = rng.randint(1, max(1, n_out // 2))
        body = {"model": self.model, "prompt": prompt, "max_tokens": n_out, "ignore_eos": True, "stream": True}
        seen = 0
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return self.tally.fail("abort_failed", f"{r.status_code}: {(await r.aread()).decode()}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen >= leave_after:
                        break
        self.tally.aborted += 1

    async def bad(self, rng: random.Random, kind=None) -> None:
        kind = rng.randrange(BAD_KINDS) if kind is None else kind
        if kind == 0:
            r = await self.http.post("/v1/completions", content=b"{not json",
                                     headers={"content-type": "application/json"})
        else:
            body = {"model": self.model, "prompt": [5, 6, 7], "max_tokens": 4}
            if kind == 1:
                body["max_tokens"] = -1
            elif kind == 2:
                body["prompt"] = [5] * (self.max_model_len + 1)
            elif kind == 3:
                body["model"] = "no-such-model"
            else:
                body["prompt"] = [5, 10**9]
            r = await self.http.post("/v1/completions", json=body)
        try:
            ok = 400 <= r.status_code < 500 and set(r.json()["error"]) >= {"message", "type", "code"}
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            self.tally.bad += 1
        else:
            self.tally.fail("bad_wrong", f"bad request #{kind} answered {r.status_code}: {r.text}")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        die(f"a length range is LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


# ================================================================================================ the run
async def sample(http, pid, t0: float, tally: Tally) -> dict:
    """One row: the server's memory and /metrics now (None where it did not answer), the clients' tallies."""
    import httpx
    try:
        m = metric_sums((await http.get("/metrics", timeout=30)).text)
    except httpx.HTTPError:
        m = {}   # a server that stopped answering: its figures are missing and the verdict fails
    try:
        rss = rss_bytes(pid) if pid is not None else m.get("process_resident_memory_bytes")
    except (OSError, RuntimeError):   # the process is gone
        rss = None
    gpu = await asyncio.to_thread(gpu_memory_mib, pid)
    return {"t": time.monotonic() - t0, "rss_mib": rss / MiB if rss else None, "gpu_mib": gpu,
            "running": m.get("vllm:num_requests_running"), "waiting": m.get("vllm:num_requests_waiting"),
            "pages_used": m.get("pegainfer:kv_pages_used"), "pages_total": m.get("pegainfer:kv_pages_total"),
            "gc_pause_s": m.get("pegainfer:gc_pause_seconds_total"),
            "gc_full": m.get("pegainfer:gc_full_collections_total"),
            "gc_longest_s": m.get("pegainfer:gc_longest_pause_seconds"),
            "good": tally.good, "failed": tally.good_failed + tally.abort_failed, "aborted": tally.aborted,
            "bad": tally.bad, "tokens": tally.tokens}


def print_row(s: dict, prev: dict | None) -> None:
    dt = s["t"] - prev["t"] if prev else s["t"]
    tok_s = (s["tokens"] - (prev["tokens"] if prev else 0)) / dt if dt > 0 else 0.0
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    pages = "-" if s["pages_used"] is None else f"{s['pages_used']:.0f}" + \
        (f"/{s['pages_total']:.0f}" if s["pages_total"] else "")   # (a fake engine has no page pool size)
    print(f"{s['t']:>7.0f} {fmt(s['rss_mib'], '10.0f')} {fmt(s['gpu_mib'], '9.0f')} {fmt(s['running'], '8.0f')} "
          f"{fmt(s['waiting'], '8.0f')} {pages:>13} {s['good']:>7} {s['failed']:>7} {s['aborted']:>8} {s['bad']:>6} "
          f"{tok_s:>10.0f}", flush=True)


async def soak(args, url: str, pid) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.request_timeout)) as http:
        try:
            r = await http.get("/v1/models", timeout=30)
            card = r.json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            detail = f"{r.status_code} {r.text[:200]}" if "r" in locals() else f"{type(e).__name__}: {e}"
            die(f"{url}/v1/models did not name a model ({detail})")
        load = Load(args, http, int(card.get("max_model_len") or 4096), card["id"])
        print(f"soak: {url}, model {card['id']}, {args.concurrency} clients for {args.duration:.0f} s; prompts "
              f"{args.prompt_len}, outputs {args.output_len} tokens; {args.abort_fraction:.0%} aborted, "
              f"{args.bad_fraction:.0%} bad", flush=True)
        print(f"{'t (s)':>7} {'RSS MiB':>10} {'GPU MiB':>9} {'running':>8} {'waiting':>8} {'pages used':>13} "
              f"{'good':>7} {'failed':>7} {'aborted':>8} {'bad':>6} {'out tok/s':>10}", flush=True)
        t0 = time.monotonic()
        deadline = t0 + args.duration
        clients = [asyncio.create_task(load.client(args.seed * 100003 + i, deadline,
                                                   i if i < BAD_KINDS else None))
                   for i in range(args.concurrency)]
        samples = [await sample(http, pid, t0, load.tally)]
        print_row(samples[-1], None)
        while time.monotonic() < deadline:
            await asyncio.sleep(min(args.sample_every, max(0.0, deadline - time.monotonic())))
            samples.append(await sample(http, pid, t0, load.tally))
            print_row(samples[-1], samples[-2])
        await asyncio.wait(clients, timeout=args.request_timeout)   # the requests under way finish
        for task in clients:
            task.cancel()
        idle_by = time.monotonic() + args.idle_timeout   # then the server must drain to idle
        while True:
            last = await sample(http, pid, t0, load.tally)
            if (last["running"] or 0) == 0 and (last["waiting"] or 0) == 0 and (last["pages_used"] or 0) == 0:
                break
            if time.monotonic() > idle_by:
                break
            await asyncio.sleep(0.5)
        samples.append(last)
        print_row(samples[-1], samples[-2])
        try:
            health = (await http.get("/health", timeout=30)).status_code
        except httpx.HTTPError as e:
            health = f"no answer ({type(e).__name__})"
    return verdict(args, samples, load.tally, health)


def verdict(args, samples: list[dict], tally: Tally, health) -> dict:
    base = next((s for s in samples if s["t"] >= args.warmup), samples[0])
    last = samples[-1]
    checks = {"failed good requests": (tally.good_failed + tally.abort_failed == 0,
                                      f"{tally.good_failed + tally.abort_failed} of "
                                      f"{tally.good + tally.good_failed + tally.aborted + tally.abort_failed}"),
              "bad requests answered 4xx": (tally.bad_wrong == 0, f"{tally.bad} of {tally.bad + tally.bad_wrong}"),
              "/health after the soak": (health == 200, str(health))}
    if base["rss_mib"] is not None and last["rss_mib"] is not None:
        drift = last["rss_mib"] - base["rss_mib"]
        limit = max(args.max_rss_drift_mib, args.max_rss_drift_pct / 100 * base["rss_mib"])
        checks["RSS drift"] = (drift <= limit, f"{drift:+.0f} MiB from t={base['t']:.0f}s (limit {limit:.0f})")
    if base["gpu_mib"] is not None and last["gpu_mib"] is not None:
        drift = last["gpu_mib"] - base["gpu_mib"]
        checks["GPU memory drift"] = (drift <= args.max_gpu_drift_mib,
                                      f"{drift:+.0f} MiB (limit {args.max_gpu_drift_mib:.0f})")
    if last["pages_used"] is not None:
        checks["KV pages in use when idle"] = (last["pages_used"] == 0 and (last["running"] or 0) == 0,
                                               f"{last['pages_used']:.0f} pages, {last['running'] or 0:.0f} running")
    else:
        checks["KV pages in use when idle"] = (False, "no pegainfer:kv_pages_used in the last /metrics")
    print()
    for name, (ok, what) in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {what}")
    for failure in tally.failures:
        print(f"      {failure}")
    gc_pause = gc_full = None      # the server's garbage-collection pauses over the soak (every stream waits)
    gc_longest = last.get("gc_longest_s")      # the longest since the server warmed up
    if samples[0]["gc_pause_s"] is not None and last["gc_pause_s"] is not None:
        gc_pause = last["gc_pause_s"] - samples[0]["gc_pause_s"]
        gc_full = (last["gc_full"] or 0) - (samples[0]["gc_full"] or 0)
        longest = "" if gc_longest is None else f", the longest {gc_longest * 1e3:.1f} ms"
        print(f"      garbage collection: {gc_pause * 1e3:.0f} ms of pauses, {gc_full:.0f} full collections{longest}")
    passed = all(ok for ok, _ in checks.values())
    print(f"verdict: {'PASS' if passed else 'FAIL'}")
    return {"passed": passed, "checks": {k: {"ok": ok, "what": w} for k, (ok, w) in checks.items()},
            "good": tally.good, "failed": tally.good_failed + tally.abort_failed, "aborted": tally.aborted,
            "bad": tally.bad, "bad_wrong": tally.bad_wrong, "output_tokens": tally.tokens, "failures": tally.failures,
            "gc_pause_s": gc_pause, "gc_full_collections": gc_full, "gc_longest_pause_s": gc_longest,
            "samples": samples}


# ================================================================================================ servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if args.fake_gpu:
        cmd = [sys.executable, __file__, "--serve-fake", str(port), "--max-batch", str(args.max_batch),
               "--prefill-ms", str(args.prefill_ms), "--decode-ms", str(args.decode_ms), "--host-us",
               str(args.host_us)]
    else:
        cmd = [sys.executable, "-m", "pegainfer", "serve", "--model-path", args.model_path, "--port", str(port),
               "--max-batch", str(args.max_batch), *args.server_arg]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    import httpx
    deadline = time.monotonic() + args.start_timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            die(f"the server did not become healthy within {args.start_timeout:.0f} s (--server-log FILE says why)")
        time.sleep(0.2)


def serve_fake(args) -> int:
    """The ``--fake-gpu`` server (a child process): run_server over bench_server.py's GPU-like fake engine."""
    import logging
    from bench_server import GpuLikeEngine   # (benchmarks/ is on sys.path when this runs as a script)
    from pegainfer.server import add_serve_arguments, run_server
    from tests.text.fixtures import make_model_folder
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    folder = make_model_folder(Path(tempfile.mkdtemp(prefix="pegainfer-soak-")))
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    sargs = p.parse_args(["--port", str(args.serve_fake), "--max-batch", str(args.max_batch)])
    sargs.model_path, sargs.max_model_len, sargs.cuda_graph, sargs.trace_output_path = None, None, True, None
    sargs.log_level = "warning"
    return run_server(sargs, engine_factory=lambda: GpuLikeEngine(
        folder, args.prefill_ms / 1e3, args.decode_ms / 1e3, args.host_us / 1e6, "block", max_batch=args.max_batch,
        record=False))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_argument_group("the server (one of)")
    where.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--model-path", default=None, help="start `python -m pegainfer serve` on this folder")
    where.add_argument("--fake-gpu", action="store_true", help="start a server over a GPU-like fake engine (no GPU)")
    ap.add_argument("--server-pid", type=int, default=None,
                    help="with --url: the server's process id, when it runs on this machine (RSS from /proc)")
    ap.add_argument("--api-key", default=os.environ.get("PEGAINFER_API_KEY"), help="sent as a bearer token")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--concurrency", type=int, default=64, help="clients sending at once (default 64)")
    ap.add_argument("--prompt-len", default="16:1024", help="prompt tokens, LO:HI, uniform (default 16:1024)")
    ap.add_argument("--output-len", default="16:512", help="output tokens, LO:HI, uniform (default 16:512)")
    ap.add_argument("--max-token-id", type=int, default=300, help="prompt ids are drawn from [3, N) (default 300)")
    ap.add_argument("--abort-fraction", type=float, default=0.1, help="streams left mid-answer (default 0.1)")
    ap.add_argument("--bad-fraction", type=float, default=0.05, help="malformed requests (default 0.05)")
    ap.add_argument("--non-stream-fraction", type=float, default=0.2,
                    help="of the good requests, those answered whole (default 0.2)")
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples (default 10)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds before the memory baseline is taken (default: a fifth of --duration, at most 60)")
    ap.add_argument("--max-rss-drift-mib", type=float, default=64.0, help="allowed RSS growth (default 64 MiB)")
    ap.add_argument("--max-rss-drift-pct", type=float, default=5.0, help="... or this percent of it (default 5)")
    ap.add_argument("--max-gpu-drift-mib", type=float, default=64.0, help="allowed GPU memory growth (default 64)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take (300)")
    ap.add_argument("--idle-timeout", type=float, default=60.0,
                    help="seconds the server may take to drain to idle after the load (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the verdict and every sample as JSON here")
    started = ap.add_argument_group("a server this script starts (--model-path, --fake-gpu)")
    started.add_argument("--max-batch", type=int, default=64, help="the server's --max-batch (default 64)")
    started.add_argument("--server-arg", action="append", default=[],
                         help="one more argument for `pegainfer serve` (repeat it: --server-arg=--max-waiting "
                              "--server-arg=128)")
    started.add_argument("--server-log", default=None, help="write the server's log here")
    started.add_argument("--start-timeout", type=float, default=900.0,
                         help="seconds to wait for /health 200 (loading, compiling; default 900)")
    started.add_argument("--prefill-ms", type=float, default=5.0, help="--fake-gpu: GPU time of a prefill step")
    started.add_argument("--decode-ms", type=float, default=4.5, help="--fake-gpu: GPU time of a decode step")
    started.add_argument("--host-us", type=float, default=300.0, help="--fake-gpu: host Python per step")
    ap.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)  # internal: be the server
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve_fake is not None:
        return serve_fake(args)
    if sum(map(bool, (args.url, args.model_path, args.fake_gpu))) != 1:
        print("error: give one of --url URL (a running server), --model-path DIR or --fake-gpu", file=sys.stderr)
        return 2
    if args.concurrency < 1 or args.duration <= 0 or args.sample_every <= 0:
        print("error: --concurrency, --duration and --sample-every must be positive", file=sys.stderr)
        return 2
    if not 0 <= args.abort_fraction + args.bad_fraction <= 1:
        print("error: --abort-fraction + --bad-fraction must lie in [0, 1]", file=sys.stderr)
        return 2
    _range(args.prompt_len), _range(args.output_len)   # (a bad range is an error before any server starts)
    args.warmup = min(60.0, args.duration / 5) if args.warmup is None else args.warmup
    proc = None
    url, pid = args.url, args.server_pid
    if url is None:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        res = asyncio.run(soak(args, url.rstrip("/"), pid))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
