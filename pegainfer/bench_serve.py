"""``python -m pegainfer bench-serve``: how fast does an OpenAI-compatible server serve many users at once?

Sends ``--num-prompts`` streamed ``/v1/completions`` requests (``ignore_eos``, greedy, exactly ``--output-len``
tokens each) to a running server (``--base-url``) or to ``python -m pegainfer serve`` started here on a free port
(``--model-path`` and the other server flags; stopped at the end), and reports what ``vllm bench serve`` reports,
under the same names: requests/s, output and total tokens/s, TTFT / TPOT / inter-token latency (mean, p50, p90,
p99, max), the worst gap between two tokens of one stream, failed requests.  ``--json`` writes all of it with
one row per request.

Load: ``--max-concurrency C`` keeps at most C requests in flight (a new one starts when one ends);
``--request-rate R`` sends requests as a Poisson process of R per second (``inf``, the default: all at once); both
together: Poisson arrivals that wait for a free place.  Several rates (``--request-rate 8,16,32``) make a sweep: one
run per rate against the same server (the same lengths, other prompts, so a prefix cache finds none of them), a
table of them, and with ``--goal-ttft-p99-ms`` the highest rate whose TTFT p99 meets the goal.
Workload (``serving_bench/workload.py``): fixed or random
(``--range-ratio``) lengths, or ``--dataset-name sharegpt`` for a built-in mix of lengths shaped like ShareGPT's,
each prompt after a shared prefix of ``--prefix-len`` tokens if given;
prompts as token ids (exact lengths) or as text (``--prompt-format text``; needs the model's tokenizer).  One
warm-up request (``--num-warmups``) runs before the clock starts.

``--hf`` then runs the same prompts and output lengths through Hugging Face transformers' continuous batching on
the GPU (``serving_bench/hf.py``; after the server started here has stopped, so it has the GPU to itself) and
prints the throughputs side by side.

One Python process parses a few thousand stream events per second, so the requests are shared among several
client processes (``--client-processes``; by default one per 16 requests in flight); when one of them uses most
of a core (``client_cpu_percent``) the client may be what limits the numbers, and the report says so.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pegainfer.errors import PegainferError
from pegainfer.serving_bench import workload
from pegainfer.serving_bench.client import (RequestResult, check_base_url, client_processes, run_in_processes,
                                            run_requests, server_info, step_counters)
from pegainfer.serving_bench.launch import SERVE_COMMAND, ServerProcess
from pegainfer.serving_bench.metrics import LATENCIES, per_request, summarize

WARMUP_OUTPUT_TOKENS = 8
CLIENT_CPU_WARNING = 80.0   # percent of one core


def add_bench_serve_arguments(p) -> None:
    from pegainfer import argtypes
    srv = p.add_argument_group("the server (started here unless --base-url is given)")
    srv.add_argument("--base-url", default=None,
                     help="benchmark the server at this URL (e.g. http://127.0.0.1:8000) instead of starting one")
    srv.add_argument("--model-path", default=None,
                     help="model folder: the server started here serves it (default: the built-in demo model); "
                          "with --base-url, where the tokenizer (for --prompt-format text) and the weights (for "
                          "--hf) come from; a Hub id (Qwen/Qwen3-4B) is fetched into the Hugging Face cache")
    argtypes.add_hub_arguments(srv)
    srv.add_argument("--max-model-len", type=argtypes.max_model_len, default=None,
                     help="the started server's --max-model-len (default: its own)")
    srv.add_argument("--max-batch", type=argtypes.positive, default=None,
                     help="the started server's --max-batch (default: its own)")
    srv.add_argument("--serve-args", default="",
                     help="more flags for the started server, as one string after '=' (e.g. "
                          "--serve-args='--no-cuda-graph --max-waiting 512'); its --max-waiting is set to fit every "
                          "request unless given here")
    srv.add_argument("--word-tokenizer", action="store_true",
                     help="serve a view of the model folder whose tokenizer turns every token id into a word, so "
                          "every token is one stream event (for random-weight models, whose tokens may print "
                          "nothing: such a token's time merges into the next gap); prompts as ids only")
    srv.add_argument("--ready-timeout", type=argtypes.positive_seconds, default=1800.0,
                     help="seconds to wait for the started server's /health (default 1800: a first start compiles "
                          "every kernel)")
    srv.add_argument("--api-key", default=os.environ.get("PEGAINFER_API_KEY"),
                     help="sent as 'Authorization: Bearer KEY' (default: $PEGAINFER_API_KEY, else none)")
    load = p.add_argument_group("the load")
    load.add_argument("--num-prompts", type=argtypes.positive, default=64, help="requests to send (default 64)")
    load.add_argument("--max-concurrency", type=argtypes.positive, default=None,
                      help="most requests in flight at once; the next starts when one ends (default: no limit)")
    load.add_argument("--request-rate", type=argtypes.request_rates, default=(math.inf,),
                      help="requests per second, sent as a Poisson process; inf (default): all at once; several, "
                           "comma-separated (e.g. 8,16,32): one run per rate against the same server, and a table")
    load.add_argument("--goal-ttft-p99-ms", type=argtypes.positive_milliseconds, default=None,
                      help="report the highest --request-rate whose TTFT p99 is at most this many ms (and no "
                           "request failed), after a table of the rates' runs")
    load.add_argument("--num-warmups", type=argtypes.non_negative, default=1,
                      help=f"requests sent one by one before the clock starts (up to {WARMUP_OUTPUT_TOKENS} tokens "
                           f"each; default 1)")
    load.add_argument("--client-processes", type=argtypes.non_negative, default=0,
                      help="client processes sharing the requests (one parses a few thousand stream events per "
                           "second); 0 (default): one per 16 requests in flight, at most 8 and half the cores")
    load.add_argument("--request-timeout", type=argtypes.positive_seconds, default=None,
                      help="seconds a request may take before it counts as failed (default: no limit)")
    work = p.add_argument_group("the requests")
    work.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random",
                      help="random: --input-len / --output-len (± --range-ratio); sharegpt: a built-in mix of "
                           "lengths shaped like ShareGPT's (median 86 in / 257 out, means ≈ 162 / 342, each at most "
                           "1024; no download)")
    work.add_argument("--input-len", type=argtypes.positive, default=128, help="prompt tokens (default 128)")
    work.add_argument("--output-len", type=argtypes.positive, default=256,
                      help="tokens generated per request, exactly (ignore_eos; default 256)")
    work.add_argument("--range-ratio", type=argtypes.range_ratio, default=0.0,
                      help="draw each length uniformly from [len × (1 - r), len × (1 + r)] (default 0: fixed)")
    work.add_argument("--prefix-len", type=argtypes.int_in(0), default=0,
                      help="tokens of a prefix every prompt starts with (a shared system prompt; default 0), before "
                           "its own --input-len tokens")
    work.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                      help="ids (default): prompts as token ids, exact lengths; text: text of the model's word "
                           "pieces (needs its tokenizer: --model-path)")
    work.add_argument("--seed", type=argtypes.seed, default=0, help="seed of the lengths, prompts and arrivals")
    out = p.add_argument_group("the report")
    out.add_argument("--hf", action="store_true",
                     help="also run the same requests through Hugging Face transformers' continuous batching on "
                          "the GPU (torch + transformers; the weights of --model-path or the demo model)")
    out.add_argument("--json", type=argtypes.output_file, default=None,
                     help="write every figure, the settings and one row per request as JSON to this path")
    out.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning",
                     help="least severe log messages of this command shown on stderr (default warning)")


# ------------------------------------------------------------------------------------------------ set-up
def _check_args(args) -> None:
    if args.base_url is not None:
        check_base_url(args.base_url)
        for flag, value in (("--max-model-len", args.max_model_len), ("--max-batch", args.max_batch),
                            ("--serve-args", args.serve_args)):
            if value:
                raise PegainferError(f"{flag} sets up the server bench-serve starts, but --base-url points at a "
                                     f"running one: drop {flag} or --base-url")
    if args.word_tokenizer and (args.base_url is not None or args.prompt_format != "ids"):
        raise PegainferError("--word-tokenizer changes the tokenizer of the server bench-serve starts, so it needs "
                             "--prompt-format ids and no --base-url")
    if args.prompt_format == "text" and args.base_url is not None and args.model_path is None:
        raise PegainferError("--prompt-format text needs the model's tokenizer: pass --model-path with --base-url")
    if args.hf and args.base_url is not None and args.model_path is None:
        raise PegainferError("--hf needs the model's weights: pass --model-path with --base-url")


def model_folder(args) -> Optional[Path]:
    """Where prompts' tokenizer and --hf's weights come from: --model-path, else the demo model when the server is
    started here (it serves the demo), else None."""
    if args.model_path is not None:
        return Path(args.model_path).expanduser()
    if args.base_url is None:
        from pegainfer.demo import ensure_demo_model
        return ensure_demo_model()
    return None


def serve_args(args, view: Optional[Path] = None, name: Optional[str] = None) -> list[str]:
    """The flags of the server started here (ours first, so ``--serve-args`` can override them); ``view``: serve
    this folder (the word-tokenizer view) instead of --model-path, under the model's ``name``."""
    out = ["--max-waiting", str(max(64, args.num_prompts + args.num_warmups))]
    if view is not None:
        out += ["--model-path", str(view), "--served-model-name", name]
    elif args.model_path is not None:
        out += ["--model-path", str(args.model_path)]
    if args.max_model_len is not None:
        out += ["--max-model-len", str(args.max_model_len)]
    if args.max_batch is not None:
        out += ["--max-batch", str(args.max_batch)]
    return out + shlex.split(args.serve_args or "")


def make_requests(args, tokenizer, run: int = 0) -> tuple[list, np.ndarray]:
    """The workload's requests and their send times (seeded by --seed) for the ``run``-th rate of
    ``--request-rate``: every run has the same lengths; a later run has prompts of its own (a server's prefix cache
    must not find them) and its rate's arrivals."""
    rng = np.random.default_rng(args.seed)
    lengths = workload.request_lengths(args.dataset_name, args.num_prompts, args.input_len, args.output_len,
                                       args.range_ratio, rng)
    if run:
        rng = np.random.default_rng([args.seed, run])
    requests = workload.build_prompts(lengths, args.prompt_format, tokenizer, rng, args.prefix_len)
    return requests, workload.arrival_times(len(requests), args.request_rate[run], rng)


def _check_fits(requests, max_model_len) -> None:
    if not max_model_len:
        return
    worst = max(requests, key=lambda r: r.input_len + r.output_len)
    if worst.input_len + worst.output_len > int(max_model_len):
        raise PegainferError(f"a request needs {worst.input_len} + {worst.output_len} tokens but the server's max "
                             f"model len is {max_model_len}: shorten --input-len / --output-len or start the server "
                             f"with a larger --max-model-len")


# ------------------------------------------------------------------------------------------------ the run
def _warm_up(url, model, requests, n, api_key, timeout) -> list[RequestResult]:
    """``n`` short requests, one at a time, with the first prompts reversed (a server with a prefix cache must not
    find the timed requests' prompts in it)."""
    results = []
    for req in requests[:n]:
        short = workload.BenchRequest(-1, req.prompt[::-1], req.input_len, min(req.output_len, WARMUP_OUTPUT_TOKENS))
        got, _ = asyncio.run(run_requests(url, model, [short], [0.0], 1, api_key, timeout))
        results += got
    return results


def bench_against(url: str, args, requests, arrivals) -> dict:
    """Warm up, then send the workload to ``url``; the summary plus the server's model and settings."""
    info = server_info(url, args.api_key)
    _check_fits(requests, info.get("max_model_len"))
    model = str(info["id"])
    warm = _warm_up(url, model, requests, args.num_warmups, args.api_key, args.request_timeout)
    bad = [r for r in warm if not r.success]
    if bad:
        raise PegainferError(f"the warm-up request failed: {bad[0].error}")
    processes = client_processes(args.client_processes, args.max_concurrency or len(requests))
    before = step_counters(url)
    results, duration, cpus = run_in_processes(processes, url, model, requests, arrivals, args.max_concurrency,
                                               args.api_key, args.request_timeout)
    after = step_counters(url)
    res = {"model": model, "max_model_len": info.get("max_model_len")}
    for key in ("cuda_graphs", "eager_mixed_steps"):     # what the server met for the first time during the run
        if key in before and key in after:
            res[f"server_new_{key}"] = int(after[key] - before[key])
    if "cuda_graph_capture_seconds" in before and "cuda_graph_capture_seconds" in after:
        res["server_capture_s"] = round(after["cuda_graph_capture_seconds"] - before["cuda_graph_capture_seconds"], 3)
    res.update(summarize(results, duration))
    res["arrival_span_s"] = float(arrivals[-1]) if len(arrivals) else 0.0    # the last request's arrival time
    res["client_processes"] = len(cpus)
    res["client_cpu_percent"] = 100.0 * max(cpus) / duration if duration > 0 else None
    res["requests"] = per_request(results)
    return res


def run_hf(folder: Path, requests, tokenizer) -> dict:
    """``--hf`` on the same prompt ids and output lengths; ``hf_error`` instead when it cannot run."""
    prompts = [workload.prompt_token_ids(r, tokenizer) for r in requests]
    try:
        from pegainfer.serving_bench.hf import hf_continuous_batching
        return hf_continuous_batching(str(folder), prompts, [r.output_len for r in requests])
    except ImportError as e:
        return {"hf_error": f"transformers/torch not importable: {e}"}
    except Exception as e:  # noqa: BLE001 - the peer failing is a line of the report, not the end of it
        return {"hf_error": f"{type(e).__name__}: {e}".splitlines()[0]}


def run_bench_serve(args, serve_command: Sequence[str] = SERVE_COMMAND) -> int:
    """The ``bench-serve`` command on parsed ``args``.  ``serve_command``: what starts a server (tests start a fake
    engine's)."""
    _check_args(args)
    if args.base_url is not None:
        server_info(check_base_url(args.base_url), args.api_key)    # an unreachable server: say so before any work
    folder = model_folder(args)
    tokenizer = None
    if folder is not None:
        from pegainfer.text.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_folder(folder)
    if tokenizer is None:
        print(f"[bench-serve] no --model-path: prompt token ids drawn from [0, {workload.FALLBACK_VOCAB}) (the byte "
              f"tokens); pass --model-path for the model's own vocabulary", file=sys.stderr)
    started_here = args.base_url is None
    launch_args = None
    runs = []
    with contextlib.ExitStack() as stack:
        if started_here:
            view = None
            if args.word_tokenizer:
                from pegainfer.serving_bench.word_tokenizer import word_tokenizer_view
                view = word_tokenizer_view(folder)
                stack.callback(shutil.rmtree, view, True)
            print(f"[bench-serve] starting {' '.join(['python', *serve_command[1:]])} on {folder} ...", file=sys.stderr)
            launch_args = serve_args(args, view, folder.name)
            server = ServerProcess(launch_args, serve_command, ready_timeout_s=args.ready_timeout)
            url = stack.enter_context(server)
            print(f"[bench-serve] server ready at {url} (log: {server.log_path})", file=sys.stderr)
        else:
            url = check_base_url(args.base_url)
        for run, rate in enumerate(args.request_rate):
            requests, arrivals = make_requests(args, tokenizer, run)
            print(f"[bench-serve] sending {len(requests)} requests to {url}"
                  f"{'' if math.isinf(rate) else f' at {rate:g}/s'} ...", file=sys.stderr)
            res = bench_against(url, args, requests, arrivals)
            res.update({"base_url": url, "server_started_here": started_here, "dataset_name": args.dataset_name,
                        "prompt_format": args.prompt_format, "num_prompts": args.num_prompts,
                        "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
                        "prefix_len": args.prefix_len,
                        "request_rate": None if math.isinf(rate) else rate,
                        "max_concurrency": args.max_concurrency, "num_warmups": args.num_warmups,
                        "seed": args.seed, "word_tokenizer": bool(args.word_tokenizer), "serve_args": launch_args})
            print_report(res)
            runs.append(res)
    sweep = len(runs) > 1 or args.goal_ttft_p99_ms is not None      # a table, and the goal's verdict
    out = sweep_summary(runs, args.goal_ttft_p99_ms) if sweep else runs[0]
    if args.hf:       # every request at once: one run, whatever the rates (the first run's prompts)
        out.update(run_hf(folder, make_requests(args, tokenizer)[0], tokenizer))
    if sweep:
        print_sweep(out)
    if args.hf:       # beside HF's every-request-at-once run: the sweep's run of the highest throughput
        print_hf(max(runs, key=lambda r: r["output_throughput"] or 0.0), out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def sweep_summary(runs: list[dict], goal_ttft_p99_ms: Optional[float]) -> dict:
    """The runs of a rate sweep, and the highest rate whose TTFT p99 met ``goal_ttft_p99_ms`` with no failed
    request (``best``: that run's rate, throughputs and TTFT p99; None when none did or there is no goal).
    ``limit_above``: the best rate is the highest finite rate tried, so the rate at which TTFT p99 crosses the goal
    lies above every rate tried (None without a best)."""
    def rate(r):
        return math.inf if r["request_rate"] is None else r["request_rate"]
    met = [r for r in runs if goal_ttft_p99_ms is not None and r["failed"] == 0
           and r["p99_ttft_ms"] is not None and r["p99_ttft_ms"] <= goal_ttft_p99_ms]
    top = max(met, key=rate) if met else None
    best = None if top is None else {k: top[k] for k in ("request_rate", "request_throughput", "output_throughput",
                                                         "total_token_throughput", "p99_ttft_ms")}
    limit_above = None if top is None else not math.isinf(rate(top)) and rate(top) == max(rate(r) for r in runs)
    return {"goal_ttft_p99_ms": goal_ttft_p99_ms, "best": best, "limit_above": limit_above, "runs": runs}


# ------------------------------------------------------------------------------------------------ the report
def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(res: dict, out=None) -> None:
    w = (out or sys.stdout).write
    rate = "inf" if res["request_rate"] is None else f"{res['request_rate']:g}/s"
    lengths = ("ShareGPT-like mix" if res["dataset_name"] == "sharegpt" else
               f"{res['input_len']} in / {res['output_len']} out"
               + (f" (± {100 * res['range_ratio']:g} %)" if res["range_ratio"] else ""))
    if res.get("prefix_len"):
        lengths += f" after a shared {res['prefix_len']}-token prefix"
    w(f"\n{' serving benchmark ':=^72}\n")
    w(f"{res['model']} at {res['base_url']}{' (started here)' if res['server_started_here'] else ''}\n")
    w(f"{res['num_prompts']} requests, {lengths}, prompts as {res['prompt_format']}, request rate {rate}, "
      f"max concurrency {res['max_concurrency'] or 'none'}\n\n")
    rows = (("successful requests", res["completed"], "d"), ("failed requests", res["failed"], "d"),
            ("duration (s)", res["duration_s"], ".2f"), ("total input tokens", res["total_input_tokens"], "d"),
            ("  of them from the prefix cache", res["total_cached_tokens"], "d"),
            ("total generated tokens", res["total_output_tokens"], "d"),
            ("request throughput (req/s)", res["request_throughput"], ".2f"),
            ("output token throughput (tok/s)", res["output_throughput"], ".1f"),
            ("total token throughput (tok/s)", res["total_token_throughput"], ".1f"),
            ("peak concurrent requests", res["peak_concurrency"], "d"),
            ("output tokens per stream event", res["tokens_per_chunk"], ".2f"))
    for name, value, spec in rows:
        w(f"{name:<40}{_fmt(value, spec):>14}\n")
    w(f"\n{'ms':<12}" + "".join(f"{s:>10}" for s in ("mean", "p50", "p90", "p99", "max")) + "\n")
    for name in LATENCIES:
        keys = ("mean", "median", "p90", "p99", "max")
        w(f"{name.upper():<12}" + "".join(f"{_fmt(res[f'{k}_{name}_ms']):>10}" for k in keys) + "\n")
    w(f"worst gap between two tokens of one stream: {_fmt(res['max_itl_ms'])} ms\n")
    if res["mismatched_outputs"]:
        w(f"{res['mismatched_outputs']} requests got a different number of tokens than asked for (does the server "
          f"honour ignore_eos?)\n")
    for err in res["errors"]:
        w(f"error: {err}\n")
    if res.get("client_cpu_percent") is not None and res["client_cpu_percent"] > CLIENT_CPU_WARNING:
        w(f"note: a client process used {res['client_cpu_percent']:.0f} % of a core: the client may be what limits "
          f"these numbers (more --client-processes, or a machine with more free cores)\n")
    span, duration = res.get("arrival_span_s"), res["duration_s"]
    if res["request_rate"] is not None and span is not None and duration and span < duration / 2:
        w(f"note: the last request arrived {span:.2f} s into a {duration:.2f} s run: most of it drained a backlog, "
          f"so it measures a burst more than this rate (more --num-prompts make the arrivals last longer)\n")
    if res.get("server_new_cuda_graphs") or res.get("server_new_eager_mixed_steps"):
        spent = f" ({res['server_capture_s']:.2f} s of capture, every stream waiting)" \
            if res.get("server_capture_s") else ""
        w(f"note: during the run the server captured {res.get('server_new_cuda_graphs', 0)} CUDA graphs of step "
          f"shapes it met for the first time{spent} and ran {res.get('server_new_eager_mixed_steps', 0)} mixed "
          f"steps without one: a second run against it measures its steady state\n")


def print_hf(ours: dict, hf: dict, out=None) -> None:
    """pegainfer's run (``ours``) beside Hugging Face's (``hf``'s ``hf_*`` fields), or why HF did not run."""
    w = (out or sys.stdout).write
    if "hf_output_throughput" in hf:
        w(f"\nside by side, the same prompts and output lengths (Hugging Face: {hf['hf_class']} continuous "
          f"batching, bf16, every request at once, no HTTP):\n")
        w(f"{'':<32}{'pegainfer':>12}{'HF':>12}{'ours / HF':>12}\n")
        for name, key in (("requests/s", "request_throughput"), ("output tok/s", "output_throughput"),
                          ("total tok/s", "total_token_throughput")):
            mine, theirs = ours[key], hf[f"hf_{key}"]
            ratio = mine / theirs if mine and theirs else None
            w(f"{name:<32}{_fmt(mine, '.1f'):>12}{_fmt(theirs, '.1f'):>12}{_fmt(ratio, '.2f'):>11}x\n")
    if "hf_error" in hf:
        w(f"hf: {hf['hf_error']}\n")


def print_sweep(sweep: dict, out=None) -> None:
    """One line per rate of a sweep, then the highest rate that met the TTFT goal."""
    w = (out or sys.stdout).write
    w(f"\n{' request-rate sweep ':=^72}\n")
    w(f"{'rate/s':>8}{'req/s':>8}{'out tok/s':>11}{'TTFT p99':>10}{'TPOT p99':>10}{'worst gap':>11}{'failed':>8}\n")
    for r in sweep["runs"]:
        rate = "inf" if r["request_rate"] is None else f"{r['request_rate']:g}"
        w(f"{rate:>8}{_fmt(r['request_throughput']):>8}{_fmt(r['output_throughput'], '.1f'):>11}"
          f"{_fmt(r['p99_ttft_ms'], '.1f'):>10}{_fmt(r['p99_tpot_ms']):>10}{_fmt(r['max_itl_ms'], '.1f'):>11}"
          f"{r['failed']:>8}\n")
    goal, best = sweep["goal_ttft_p99_ms"], sweep["best"]
    if goal is not None:
        if best is None:
            w(f"no rate kept TTFT p99 within {goal:g} ms\n")
        else:
            rate = "inf" if best["request_rate"] is None else f"{best['request_rate']:g}/s"
            w(f"highest rate with TTFT p99 <= {goal:g} ms: {rate} ({best['output_throughput']:.1f} output tok/s, "
              f"TTFT p99 {best['p99_ttft_ms']:.1f} ms)\n")
            if sweep.get("limit_above"):
                w(f"the highest rate tried met the goal: the server's limit lies above {rate} (add higher rates, or "
                  f"inf: every request at once)\n")
