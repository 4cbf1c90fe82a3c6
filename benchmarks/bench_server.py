"""What does the OpenAI HTTP server add to time-to-first-token and time-per-output-token?  TTFT and TPOT through
``POST /v1/completions`` (streaming, concurrency 1) against the same numbers measured in process, on one of two
engines:

* a model folder on a GPU (``--model-path``): ``python -m pegainfer bench`` in its own process, then
  ``python -m pegainfer serve`` on the same folder and a streaming client.  The folder is seen through a view whose
  tokenizer maps every id to a word, so a random-weight model's every token becomes an SSE chunk.
* ``--fake-gpu`` (no GPU needed): a GPU-like fake engine (``GpuLikeEngine``) driven in process and behind
  ``run_server`` (uvicorn + AsyncEngine), the model replaced by a clock.  Each step copies the shape of a real one
  on a simulated GPU timeline: host work (``--host-us`` of Python holding the GIL, with ``--driver-calls`` short
  releases, as the driver calls of a step), the GPU time (``--prefill-ms`` for a request's first step,
  ``--decode-ms`` after), waited for as ``ModelRunner`` does (``--wait block``: one call that releases the GIL,
  like ``cuEventSynchronize``; ``--wait poll``: a ``time.sleep(0)`` loop) after the ``before_gpu_wait`` slot that
  ``AsyncEngine`` uses to hand outputs to the event loop (``--no-hook`` leaves it out), then the fake engine's
  real detokenization and stop rules.  With ``--async-scheduling`` (the default, as in ``Engine``) a decode step
  launches the next one before it waits.  The in-process, HTTP and floor requests take turns, so a change in the
  machine's load affects them alike; the event-loop thread's CPU time per token comes from /proc.
* ``--fake-gpu --streams N``: the server's cost per token under many streams -- ``bench-serve`` keeps N streams
  going against the fake server (``--max-batch N``), and the event loop's and the whole server process's CPU time
  per token (from /proc) print beside the throughput and inter-token latencies.

TTFT = request sent on an open connection (connected beforehand, as keep-alive clients are) -> first SSE chunk
carrying a token; TPOT = (last token chunk - first) / (completion tokens - 1), the count from the final usage
chunk.  The client is the standard library.  *Floor*: the same client against a bare asyncio server that answers
at once -- what any out-of-process server costs on this host (loopback TCP, waking an idle server and client:
0.56 ms on the H200 host, 1.2-1.6 ms on a shared 2-vCPU VM).  On a busy machine run it with ``nice -n -10`` and
compare settings run against run rather than trusting one table.

    python benchmarks/bench_server.py --model-path DIR [--prompt-len 16] [--output-len 128] [--runs 5] [--json OUT]
    python benchmarks/bench_server.py --fake-gpu [--prefill-ms 5] [--decode-ms 4.5] [--host-us 300] [--runs 20]
    python benchmarks/bench_server.py --fake-gpu --streams 64 [--decode-ms 5] [--output-len 256]
"""
import argparse
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import pegainfer  # noqa: E402,F401  (device selection before anything imports numba)
from tests.server.fake_engine import FakeEngine  # noqa: E402

REPLY = "x " * 600   # every token of the fake engine is a text chunk
_DRIVER_CALL = bytes(4096)


# ================================================================================================ the client
def with_word_tokenizer(folder: str) -> str:
    """A view of ``folder`` (weights and config symlinked) whose tokenizer maps every id of the embedding to a
    word ("w123 "), so a random-weight model's tokens all decode to text and every token becomes an SSE chunk
    (the server sends no chunk for a token whose text is empty or held back)."""
    from pegainfer.serving_bench.word_tokenizer import word_tokenizer_view
    return str(word_tokenizer_view(folder))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_once(port, prompt_ids, output_len):
    body = json.dumps({"prompt": prompt_ids, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.connect()       # an open connection, as keep-alive clients (the openai SDK's httpx pool) have
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first = last = None
    usage = None
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ").strip()
            if data == "[DONE]":
                continue
            obj = json.loads(data)
            now = time.perf_counter()
            if obj.get("choices"):
                if first is None:
                    first = now
                last = now
            if obj.get("usage"):
                usage = obj["usage"]
    conn.close()
    n = usage["completion_tokens"]
    return first - t0, (last - first) / max(n - 1, 1), n


FLOOR_SERVER = r'''
import asyncio, sys
BODY = (b'data: {"choices":[{"text":"x"}]}\n\ndata: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
        b'data: [DONE]\n\n')
async def handle(reader, writer):
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:  # a connect-only probe
        return writer.close()
    length = [line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    await reader.readexactly(int(length[0].split(b":")[1]) if length else 0)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
asyncio.run(main())
'''


def floor_ttfts(prompts) -> list:
    """TTFT (s) of ``stream_once`` against FLOOR_SERVER, one request per prompt (idle gaps between them)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(port)])
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise SystemExit("the floor server did not start")
                time.sleep(0.05)
        out = []
        for prompt in prompts:
            out.append(stream_once(port, prompt, 1)[0])
            time.sleep(0.02)
        return out
    finally:
        server.terminate()
        server.wait(timeout=30)


# ================================================================================================ --fake-gpu
def host_work(seconds: float, driver_calls: int) -> None:
    """Run Python for ``seconds`` (holding the GIL, interruptible at the switch interval like any Python code),
    with ``driver_calls`` evenly spaced GIL releases (cuda-bindings releases the GIL around every driver call)."""
    for i in range(driver_calls + 1):
        end = time.perf_counter() + seconds / (driver_calls + 1)
        while time.perf_counter() < end:
            pass
        if i < driver_calls:
            hashlib.sha1(_DRIVER_CALL)  # releases and retakes the GIL (hashlib does above 2 KiB), no syscall


class GpuLikeEngine(FakeEngine):
    """A FakeEngine whose steps take the time of GPU steps, on a simulated GPU timeline: host work with the GIL
    launches a step (it runs once the GPU is free), then the thread waits for it.  With ``async_scheduling`` it
    copies the engine's: a decode step call launches the next step before it waits for the current one (when the
    batch cannot change), so the host work hides behind the GPU.  Like the engine, it reports the process's
    garbage-collection pauses (``engine/heap.py``)."""

    def __init__(self, folder, prefill_s: float, decode_s: float, host_s: float, wait: str, driver_calls: int = 0,
                 hook: bool = True, async_scheduling: bool = True, max_batch: int = 1, **kw):
        super().__init__(folder, reply=REPLY, max_model_len=4096, max_batch=max_batch, **kw)
        if wait not in ("poll", "block"):
            raise ValueError(f"wait must be 'poll' or 'block', not {wait!r}")
        self.prefill_s, self.decode_s, self.host_s, self.wait = prefill_s, decode_s, host_s, wait
        self.driver_calls = driver_calls
        self.hook = hook
        self.async_scheduling = async_scheduling
        self._gpu_free = 0.0        # when the simulated GPU finishes what was launched so far
        self._ahead_done = None     # end time of a decode step launched ahead, not yet read
        from pegainfer.engine.heap import GcPauses
        self.gc_pauses = GcPauses.install()
        if hook:
            self.before_gpu_wait = None   # AsyncEngine plugs in here (see pegainfer/engine/async_engine.py)

    def stats(self) -> dict:
        from pegainfer.engine.heap import pause_stats
        return {**super().stats(), **pause_stats(self.gc_pauses)}

    def _launch(self, gpu_s: float) -> float:
        host_work(self.host_s, self.driver_calls)
        self._gpu_free = max(time.perf_counter(), self._gpu_free) + gpu_s
        return self._gpu_free

    def _wait_for(self, done: float) -> None:
        if self.hook and self.before_gpu_wait is not None:
            self.before_gpu_wait()
        if self.wait == "poll":            # a polling wait: the thread takes the GIL back between polls
            while time.perf_counter() < done:
                time.sleep(0)
        else:                              # a blocking wait that releases the GIL
            left = done - time.perf_counter()
            if left > 0:
                time.sleep(left)

    def step(self):
        if not (self._waiting or self._running):
            return super().step()
        if self._waiting:                  # a request enters: this step is its prefill
            done = self._launch(self.prefill_s)
        else:
            done = self._ahead_done if self._ahead_done is not None else self._launch(self.decode_s)
            self._ahead_done = None
            if self.async_scheduling and not self._to_abort and all(
                    len(r.out_ids) + 1 < r.params.max_tokens for r in self._running):
                self._ahead_done = self._launch(self.decode_s)   # the next step, launched before this one is read
        self._wait_for(done)
        outputs = super().step()
        if self._ahead_done is not None and not self._running:   # nobody left for the step in flight: drain it
            self._wait_for(self._ahead_done)
            self._ahead_done = None
        return outputs


def make_engine(args) -> GpuLikeEngine:
    from tests.text.fixtures import make_model_folder
    folder = make_model_folder(Path(tempfile.mkdtemp(prefix="pegainfer-fake-gpu-")))
    return GpuLikeEngine(folder, args.prefill_ms / 1e3, args.decode_ms / 1e3, args.host_us / 1e6, args.wait,
                         args.driver_calls, args.hook, args.async_scheduling, max_batch=args.streams or 1,
                         record=not args.streams)


def prompts(args):
    rng = np.random.default_rng(0)
    return [rng.integers(3, 300, size=args.prompt_len).tolist() for _ in range(args.runs + 1)]


def serve(args) -> int:
    """The server side (a child process): run_server over a GpuLikeEngine, exactly as the CLI runs it."""
    import logging
    from pegainfer.server import add_serve_arguments, run_server
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    sargs = p.parse_args(["--port", str(args.serve), "--max-batch", str(args.streams or 1), "--max-waiting", "65536"])
    sargs.model_path, sargs.max_model_len, sargs.cuda_graph, sargs.trace_output_path = None, None, True, None
    return run_server(sargs, engine_factory=lambda: make_engine(args))


def wait_listening(port: int, proc: subprocess.Popen, path: str = "/health") -> None:
    deadline = time.time() + 60
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path) if path else c.connect()
            if not path or c.getresponse().status == 200:
                return
        except OSError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise SystemExit("error: the fake server did not come up within 60 s (--server-log LOG says why)")
        time.sleep(0.05)


def thread_cpu_s(pid: int) -> float:
    """CPU time (user + system) of the main thread of process ``pid`` — the server's event loop."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU time (user + system) of all threads of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_command(args, port: int) -> list[str]:
    """The fake server's command line (``serve`` in a child process) for ``args``."""
    return [sys.executable, __file__, "--fake-gpu", "--serve", str(port), "--wait", args.wait, "--prefill-ms",
            str(args.prefill_ms), "--decode-ms", str(args.decode_ms), "--host-us", str(args.host_us),
            "--driver-calls", str(args.driver_calls), "--hook" if args.hook else "--no-hook",
            "--async-scheduling" if args.async_scheduling else "--no-async-scheduling"] + (
        ["--streams", str(args.streams)] if args.streams else [])


def measure_streams(args) -> dict:
    """``--streams N``: ``bench-serve`` (its own processes) keeps N streams of ``--output-len`` tokens going
    against the fake server, 4N requests; the server's event-loop thread's and whole process's CPU time, per
    token, from /proc, beside bench-serve's throughput and inter-token latencies."""
    port = free_port()
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    server = subprocess.Popen(server_command(args, port), cwd=ROOT, stdout=log, stderr=log)
    try:
        wait_listening(port, server)
        loop0, proc0 = thread_cpu_s(server.pid), process_cpu_s(server.pid)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "serve.json"
            r = subprocess.run([sys.executable, "-m", "pegainfer", "bench-serve", "--base-url",
                                f"http://127.0.0.1:{port}", "--max-concurrency", str(args.streams), "--num-prompts",
                                str(4 * args.streams), "--input-len", str(args.prompt_len), "--output-len",
                                str(args.output_len), "--prompt-format", "ids", "--json", str(out)],
                               cwd=ROOT, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"error: bench-serve failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
            served = json.loads(out.read_text())
        loop, proc = thread_cpu_s(server.pid) - loop0, process_cpu_s(server.pid) - proc0
    finally:
        server.terminate()
        server.wait(timeout=30)
    tokens = 4 * args.streams * args.output_len
    return {"streams": args.streams, "requests": 4 * args.streams, "output_len": args.output_len,
            "decode_ms": args.decode_ms, "host_us": args.host_us, "output_tok_s": served["output_throughput"],
            "itl_ms_p50": served["median_itl_ms"], "itl_ms_p99": served["p99_itl_ms"],
            "failed": served["failed"], "event_loop_cpu_us_per_token": 1e6 * loop / tokens,
            "process_cpu_us_per_token": 1e6 * proc / tokens,
            "ideal_tok_s": args.streams / (args.decode_ms / 1e3)}


def measure(args) -> dict:
    """Runs interleaved — one in-process generation, one streamed HTTP request, one floor request, in turn — so a
    change in the machine's load hits all three alike.  Returns lists of TTFT / TPOT seconds and the loop CPU."""
    from pegainfer.bench import time_generation
    engine = make_engine(args)
    port, floor_port = free_port(), free_port()
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    server = subprocess.Popen(server_command(args, port), cwd=ROOT, stdout=log, stderr=log)
    floor_server = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(floor_port)])
    res = {k: [] for k in ("in_ttft", "in_tpot", "http_ttft", "http_tpot", "floor_ttft")}
    try:
        wait_listening(port, server)
        wait_listening(floor_port, floor_server, path="")
        for run, prompt in enumerate(prompts(args)):
            if run == 1:
                cpu0 = thread_cpu_s(server.pid)
            ttft, gaps = time_generation(engine, prompt, args.output_len)
            time.sleep(0.02)
            http_ttft, http_tpot, n = stream_once(port, prompt, args.output_len)
            assert n == args.output_len, n
            time.sleep(0.02)   # the server goes idle between requests, as at concurrency 1
            floor_ttft, _, _ = stream_once(floor_port, prompt, 1)
            time.sleep(0.02)
            if run > 0:
                for k, v in (("in_ttft", ttft), ("in_tpot", float(np.mean(gaps))), ("http_ttft", http_ttft),
                             ("http_tpot", http_tpot), ("floor_ttft", floor_ttft)):
                    res[k].append(v)
        res["loop_cpu_per_token"] = (thread_cpu_s(server.pid) - cpu0) / (args.runs * args.output_len)
        return res
    finally:
        for proc in (server, floor_server):
            proc.terminate()
            proc.wait(timeout=30)


# ================================================================================================ the command
def run_model(args) -> dict:
    """The ``--model-path`` mode: in-process ``bench``, then the same requests through ``serve``."""
    py = sys.executable
    folder = with_word_tokenizer(args.model_path)

    # 1. in-process numbers (separate process, so the two never share the GPU)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([py, "-m", "pegainfer", "bench", "--model-path", folder, "--max-model-len",
                        str(args.max_model_len), "--prompt-len", str(args.prompt_len), "--output-len",
                        str(args.output_len), "--runs", str(args.runs), "--json", f.name], check=True,
                       stdout=subprocess.DEVNULL)
        inproc = json.load(open(f.name))

    # 2. the same through HTTP
    port = free_port()
    server = subprocess.Popen([py, "-m", "pegainfer", "serve", "--model-path", folder, "--port", str(port),
                               "--max-model-len", str(args.max_model_len), "--max-batch", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("error: the server did not become healthy within 300 s")
        rng = np.random.default_rng(0)
        ttfts, tpots = [], []
        for run in range(args.runs + 1):
            prompt = rng.integers(0, 400, size=args.prompt_len).tolist()
            ttft, tpot, n = stream_once(port, prompt, args.output_len)
            if run > 0:
                ttfts.append(ttft)
                tpots.append(tpot)
    finally:
        server.terminate()
        server.wait(timeout=60)
    floor = floor_ttfts([rng.integers(0, 400, size=args.prompt_len).tolist() for _ in range(args.runs + 1)])[1:]
    res = {"in_process_ttft_ms_p50": inproc["ttft_ms"]["p50"], "in_process_tpot_ms_p50": inproc["tpot_ms"]["p50"],
           "http_ttft_ms_p50": 1e3 * float(np.median(ttfts)), "http_tpot_ms_p50": 1e3 * float(np.median(tpots))}
    res["ttft_overhead_ms"] = res["http_ttft_ms_p50"] - res["in_process_ttft_ms_p50"]
    res["tpot_overhead_pct"] = 100 * (res["http_tpot_ms_p50"] / res["in_process_tpot_ms_p50"] - 1)
    res["floor_ttft_ms_p50"] = 1e3 * float(np.median(floor))
    res["ttft_overhead_above_floor_ms"] = res["ttft_overhead_ms"] - res["floor_ttft_ms_p50"]
    for k, v in res.items():
        print(f"{k:<28}{v:>10.3f}")
    return res


def run_streams(args) -> dict:
    """The ``--fake-gpu --streams N`` mode (module docstring)."""
    res = measure_streams(args)
    print(f"fake GPU step: decode {args.decode_ms} ms, host {args.host_us:.0f} µs; {args.streams} streams, "
          f"{res['requests']} requests of {args.output_len} tokens through bench-serve")
    print(f"{'output tok/s':<34}{res['output_tok_s']:>10.0f}  (the fake GPU's pace: {res['ideal_tok_s']:.0f})")
    print(f"{'ITL p50 / p99 ms':<34}{res['itl_ms_p50']:>10.2f} / {res['itl_ms_p99']:.2f}")
    print(f"{'event-loop CPU per token':<34}{res['event_loop_cpu_us_per_token']:>9.1f}µs")
    print(f"{'server process CPU per token':<34}{res['process_cpu_us_per_token']:>9.1f}µs")
    return res


def run_fake(args) -> dict:
    """The ``--fake-gpu`` mode (module docstring)."""
    if args.streams:
        return run_streams(args)
    m = measure(args)
    med = lambda xs: 1e3 * float(np.median(xs))  # noqa: E731
    res = {"wait": args.wait, "hook": args.hook, "async_scheduling": args.async_scheduling,
           "prefill_ms": args.prefill_ms, "decode_ms": args.decode_ms, "host_us": args.host_us,
           "driver_calls": args.driver_calls, "runs": args.runs, "output_len": args.output_len,
           "in_process_ttft_ms": med(m["in_ttft"]), "in_process_tpot_ms": med(m["in_tpot"]),
           "http_ttft_ms": med(m["http_ttft"]), "http_tpot_ms": med(m["http_tpot"]),
           "floor_ttft_ms": med(m["floor_ttft"]), "event_loop_cpu_us_per_token": 1e6 * m["loop_cpu_per_token"]}
    res["ttft_overhead_ms"] = res["http_ttft_ms"] - res["in_process_ttft_ms"]
    res["tpot_overhead_pct"] = 100 * (res["http_tpot_ms"] / res["in_process_tpot_ms"] - 1)
    res["ttft_overhead_above_floor_ms"] = res["ttft_overhead_ms"] - res["floor_ttft_ms"]
    print(f"fake GPU step: prefill {args.prefill_ms} ms, decode {args.decode_ms} ms, host {args.host_us:.0f} µs "
          f"({args.driver_calls} GIL breaks), wait={args.wait}, hook={args.hook}, async={args.async_scheduling}; "
          f"prompt {args.prompt_len}, "
          f"output {args.output_len}, {args.runs} runs (medians)")
    print(f"{'':<34}{'TTFT ms':>10}{'TPOT ms':>10}")
    print(f"{'in-process':<34}{res['in_process_ttft_ms']:>10.3f}{res['in_process_tpot_ms']:>10.3f}")
    print(f"{'HTTP + SSE':<34}{res['http_ttft_ms']:>10.3f}{res['http_tpot_ms']:>10.3f}")
    print(f"{'overhead':<34}{res['ttft_overhead_ms']:>+10.3f}{res['tpot_overhead_pct']:>+9.1f}%")
    print(f"{'floor (bare asyncio server)':<34}{res['floor_ttft_ms']:>10.3f}")
    print(f"{'overhead above the floor':<34}{res['ttft_overhead_above_floor_ms']:>+10.3f}")
    print(f"{'event-loop CPU per token':<34}{res['event_loop_cpu_us_per_token']:>9.0f}µs")
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="model folder (GPU)")
    ap.add_argument("--fake-gpu", action="store_true", help="a GPU-like fake engine instead of a model (no GPU)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=None, help="timed requests after one warm-up (default 5; fake 20)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--json", default=None, help="write the numbers as JSON here")
    fake = ap.add_argument_group("--fake-gpu")
    fake.add_argument("--prefill-ms", type=float, default=5.0, help="GPU time of a request's first step (default 5)")
    fake.add_argument("--decode-ms", type=float, default=4.5, help="GPU time of a decode step (default 4.5)")
    fake.add_argument("--host-us", type=float, default=300.0, help="host Python per step before the GPU runs (300)")
    fake.add_argument("--driver-calls", type=int, default=8,
                      help="GIL releases within the host work, like the driver calls of a step (default 8)")
    fake.add_argument("--wait", choices=("block", "poll"), default="block",
                      help="how the engine thread waits for the GPU (default block, as ModelRunner)")
    fake.add_argument("--hook", action=argparse.BooleanOptionalAction, default=True,
                      help="offer the before_gpu_wait slot AsyncEngine uses (default on, as Engine)")
    fake.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                      help="launch the next decode step before reading the current one (default on, as Engine)")
    fake.add_argument("--streams", type=int, default=None, metavar="N",
                      help="instead of concurrency 1: N concurrent streams through bench-serve (4N requests); the "
                           "server's CPU time per token")
    fake.add_argument("--server-log", default=None, help="write the fake server's log here")
    fake.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # internal: be the server on PORT
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.fake_gpu == bool(args.model_path):
        print("error: give --model-path DIR (a GPU) or --fake-gpu (no GPU), one of the two", file=sys.stderr)
        return 2
    args.runs = args.runs or (20 if args.fake_gpu else 5)
    if args.fake_gpu and args.serve is not None:
        return serve(args)
    if not args.fake_gpu:
        import graph_timing   # (benchmarks/ is on sys.path when this runs as a script)
        graph_timing.require_gpu("bench_server.py --model-path", "use --fake-gpu without one")
    res = run_fake(args) if args.fake_gpu else run_model(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
