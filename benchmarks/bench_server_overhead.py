"""The server's own latency, without a GPU: TTFT and TPOT of a GPU-like fake engine driven in-process, against the
same engine behind ``run_server`` (uvicorn + AsyncEngine) with a streaming ``/v1/completions`` client in another
process — the set-up of ``bench_server.py`` on the H200, with the model replaced by a clock.

    python benchmarks/bench_server_overhead.py [--runner proposed|today] [--prefill-ms 5] [--decode-ms 4.5]
        [--host-us 300] [--driver-calls 8] [--output-len 128] [--runs 20] [--json OUT] [--server-log LOG]

The fake step (``GpuLikeEngine``) copies the shape of a real engine step on the GPU, on a simulated GPU timeline:

1. host work (``--host-us`` of Python: building the step inputs, uploads, the graph launch) that holds the GIL
   except for ``--driver-calls`` short breaks, where a CUDA driver call would release and retake it;
2. the GPU time (``--prefill-ms`` for a request's first step, ``--decode-ms`` after), spent waiting one of two ways:
   ``poll`` — a loop of ``time.sleep(0)`` until done, like ``ModelRunner._finish`` polling ``cuEventQuery`` (the
   thread takes the GIL back between polls); ``block`` — one call that waits without the GIL, like a blocking
   ``cuEventSynchronize`` (cuda-bindings >= 12.9.1 / 13.0 release the GIL around every driver call);
3. the fake engine's real host post-processing: detokenization and stop rules of every token.

With ``--async-scheduling`` (the default, as in ``Engine``) a decode step call launches the next step before it
waits for the current one, so the host work of step N+1 runs while the GPU works on step N.

``--runner today`` is ``ModelRunner`` as it is (``poll``); ``--runner proposed`` (the default) is the change this
benchmark argues for: ``block``, plus the ``before_gpu_wait`` slot that ``AsyncEngine`` uses to hand outputs to
the event loop while the GPU works (called after the host work, before the wait).  ``--wait`` / ``--hook`` pick
the two halves separately.

TTFT = request sent → first chunk with a token; TPOT = (last token chunk − first) / (tokens − 1), per run; the
table shows medians over ``--runs`` runs after one warm-up run (in-process: the same formulas on the step loop).
The in-process, HTTP and floor runs take turns, so a change in the machine's load affects them alike.

Two more lines put the numbers in context.  *Floor*: the same client against a bare asyncio server that answers
at once — what any out-of-process server costs on this machine (TCP on loopback, waking an idle server and the
client: 1.2-1.6 ms on the shared 2-vCPU VM this was written on, far less on an idle host).  *Event-loop CPU*: CPU
time of the server's event-loop thread per streamed token (per-request work included), from /proc; on a shared VM
it is noisy too (cold caches and the wake-up of an idle vCPU count as the thread's own time).  On such a machine
run it with ``nice -n -10`` and compare settings run against run rather than trusting one table.
"""
from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import pegainfer  # noqa: E402,F401  (device selection before anything else)
from bench_server import FLOOR_SERVER, free_port, stream_once  # noqa: E402
from tests.server.fake_engine import FakeEngine  # noqa: E402

REPLY = "x " * 600   # every token is a text chunk
_DRIVER_CALL = bytes(4096)


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
    batch cannot change), so the host work hides behind the GPU."""

    def __init__(self, folder, prefill_s: float, decode_s: float, host_s: float, wait: str, driver_calls: int = 0,
                 hook: bool = True, async_scheduling: bool = True, **kw):
        super().__init__(folder, reply=REPLY, max_model_len=4096, max_batch=1, **kw)
        if wait not in ("poll", "block"):
            raise ValueError(f"wait must be 'poll' or 'block', not {wait!r}")
        self.prefill_s, self.decode_s, self.host_s, self.wait = prefill_s, decode_s, host_s, wait
        self.driver_calls = driver_calls
        self.hook = hook
        self.async_scheduling = async_scheduling
        self._gpu_free = 0.0        # when the simulated GPU finishes what was launched so far
        self._ahead_done = None     # end time of a decode step launched ahead, not yet read
        if hook:
            self.before_gpu_wait = None   # AsyncEngine plugs in here (see pegainfer/engine/async_engine.py)

    def _launch(self, gpu_s: float) -> float:
        host_work(self.host_s, self.driver_calls)
        self._gpu_free = max(time.perf_counter(), self._gpu_free) + gpu_s
        return self._gpu_free

    def _wait_for(self, done: float) -> None:
        if self.hook and self.before_gpu_wait is not None:
            self.before_gpu_wait()
        if self.wait == "poll":            # the runner's wait today: poll, yielding the GIL between polls
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
    folder = make_model_folder(Path(tempfile.mkdtemp(prefix="pegainfer-overhead-")))
    return GpuLikeEngine(folder, args.prefill_ms / 1e3, args.decode_ms / 1e3, args.host_us / 1e6, args.wait,
                         args.driver_calls, args.hook, args.async_scheduling)


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
    sargs = p.parse_args(["--port", str(args.serve), "--max-batch", "1"])
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
            raise SystemExit("the server did not come up")
        time.sleep(0.05)


def thread_cpu_s(pid: int) -> float:
    """CPU time (user + system) of the main thread of process ``pid`` — the server's event loop."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(args) -> dict:
    """Runs interleaved — one in-process generation, one streamed HTTP request, one floor request, in turn — so a
    change in the machine's load hits all three alike.  Returns lists of TTFT / TPOT seconds and the loop CPU."""
    from pegainfer.bench import time_generation
    engine = make_engine(args)
    port, floor_port = free_port(), free_port()
    cmd = [sys.executable, __file__, "--serve", str(port), "--wait", args.wait, "--prefill-ms", str(args.prefill_ms),
           "--decode-ms", str(args.decode_ms), "--host-us", str(args.host_us), "--driver-calls", str(args.driver_calls),
           "--hook" if args.hook else "--no-hook",
           "--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runner", choices=("proposed", "today"), default="proposed",
                    help="today: poll, no hook; proposed (default): block + before_gpu_wait hook")
    ap.add_argument("--wait", choices=("block", "poll"), default=None,
                    help="how the engine thread waits for the GPU (overrides --runner)")
    ap.add_argument("--hook", action=argparse.BooleanOptionalAction, default=None,
                    help="offer the before_gpu_wait slot (overrides --runner)")
    ap.add_argument("--prefill-ms", type=float, default=5.0, help="GPU time of the first step (default 5)")
    ap.add_argument("--decode-ms", type=float, default=4.5, help="GPU time of a decode step (default 4.5)")
    ap.add_argument("--host-us", type=float, default=300.0, help="host Python per step before the GPU runs (300)")
    ap.add_argument("--driver-calls", type=int, default=8,
                    help="GIL releases within the host work, like the driver calls of a step (default 8)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="launch the next decode step before reading the current one, as Engine does by default")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the numbers as JSON here")
    ap.add_argument("--server-log", default=None, help="write the server's log here")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # internal: be the server on PORT
    args = ap.parse_args()
    if args.wait is None:
        args.wait = "block" if args.runner == "proposed" else "poll"
    if args.hook is None:
        args.hook = args.runner == "proposed"
    if args.serve is not None:
        return serve(args)

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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
