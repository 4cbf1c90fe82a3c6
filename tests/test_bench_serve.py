"""``python -m pegainfer bench-serve`` against the fake engine's server (no GPU, seconds): both load modes in
process, the server it starts itself as a subprocess, the JSON's fields, and one-line errors."""
from __future__ import annotations

import io
import json
import math
import os
import sys
import time

import numpy as np
import pytest

from pegainfer.__main__ import build_parser
from pegainfer.bench_serve import WARMUP_OUTPUT_TOKENS, make_requests, print_report, run_bench_serve
from pegainfer.errors import PegainferError
from pegainfer.serving_bench import workload
from pegainfer.serving_bench.metrics import LATENCIES, STATS
from pegainfer.text.tokenizer import Tokenizer
from tests.server.conftest import free_socket, serve_engine
from tests.server.fake_engine import FakeEngine

SUMMARY_KEYS = ("duration_s", "completed", "failed", "total_input_tokens", "total_output_tokens", "total_cached_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "tokens_per_chunk",
                "mismatched_outputs", "peak_concurrency", "errors", "client_cpu_percent", "model", "requests")


def parse(*argv):
    return build_parser().parse_args(["bench-serve", *argv])


@pytest.fixture(scope="module")
def fake_server(model_folder):
    """A server over a FakeEngine whose every token is a word (so every token is one stream event), 4 at once;
    yields (base URL, the engine: it records every prompt and its sampling parameters)."""
    engine = FakeEngine(model_folder, reply="x " * 600, max_batch=4, step_delay=0.002)
    with serve_engine(engine, max_waiting=64) as (url, _ae):
        yield url, engine


@pytest.fixture(scope="module")
def fake_url(fake_server):
    return fake_server[0]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from tests.text.fixtures import make_model_folder
    return make_model_folder(tmp_path_factory.mktemp("bench-serve-tokenizer"))


def check_result(res, num, lengths):
    """Every field there, every request served with exactly its tokens, percentiles in order, and the run's TTFT,
    TPOT and end-to-end figures those of its per-request rows."""
    for key in SUMMARY_KEYS:
        assert key in res, key
    for name in LATENCIES:
        for stat in STATS:
            assert f"{stat}_{name}_ms" in res, (stat, name)
    assert res["completed"] == num and res["failed"] == 0 and res["errors"] == []
    assert res["mismatched_outputs"] == 0
    rows = res["requests"]
    assert [r["output_tokens"] for r in rows] == [out for _, out in lengths]
    assert [r["prompt_tokens"] for r in rows] == [inp for inp, _ in lengths]
    assert res["total_output_tokens"] == sum(out for _, out in lengths)
    assert res["total_input_tokens"] == sum(inp for inp, _ in lengths)
    for name in LATENCIES:
        values = [res[f"{s}_{name}_ms"] for s in ("median", "p90", "p99", "max")]
        assert 0 <= values[0] <= values[1] <= values[2] <= values[3], (name, values)
        assert 0 < res[f"mean_{name}_ms"] <= values[3]
    assert res["max_itl_ms"] == max(r["max_itl_ms"] for r in rows)
    ttft = np.array([r["ttft_ms"] for r in rows])
    e2el = np.array([r["latency_ms"] for r in rows])
    tpot = np.array([(r["latency_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1) for r in rows
                     if r["output_tokens"] > 1])
    for name, values in (("ttft", ttft), ("e2el", e2el), ("tpot", tpot)):
        for stat, want in (("mean", values.mean()), ("median", np.median(values)),
                           ("p90", np.percentile(values, 90)), ("p99", np.percentile(values, 99)),
                           ("max", values.max())):
            assert res[f"{stat}_{name}_ms"] == pytest.approx(want), (stat, name)
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration_s"])
    assert res["request_throughput"] == pytest.approx(num / res["duration_s"])
    assert res["total_token_throughput"] == pytest.approx(
        (res["total_input_tokens"] + res["total_output_tokens"]) / res["duration_s"])
    assert res["tokens_per_chunk"] == pytest.approx(1.0)     # every fake token is a word: one event each
    assert [r["chunks"] for r in rows] == [out for _, out in lengths]


def lengths_of(args, folder):
    requests, _ = make_requests(args, Tokenizer.from_folder(folder))
    return [(r.input_len, r.output_len) for r in requests]


def test_fixed_concurrency_against_a_running_server(fake_server, model_folder, tmp_path, capsys):
    """``--max-concurrency 2`` with token-id prompts of random lengths: the server gets each request's own ids
    (after one reversed warm-up prompt) asking greedily for exactly its output length, never more than 2 at once;
    the JSON and the printed report carry the same figures."""
    fake_url, engine = fake_server
    seen = set(engine.prompts)
    out = tmp_path / "r.json"
    args = parse("--base-url", fake_url, "--model-path", str(model_folder), "--num-prompts", "6",
                 "--max-concurrency", "2", "--input-len", "5", "--output-len", "7", "--range-ratio", "0.5",
                 "--json", str(out))
    assert run_bench_serve(args) == 0
    res = json.loads(out.read_text())
    requests, _ = make_requests(args, Tokenizer.from_folder(model_folder))
    lengths = [(r.input_len, r.output_len) for r in requests]
    assert len(set(lengths)) > 1                        # --range-ratio varied the lengths
    check_result(res, 6, lengths)
    assert res["peak_concurrency"] == 2 and res["max_concurrency"] == 2 and res["request_rate"] is None
    new = [rid for rid in engine.prompts if rid not in seen]
    sent = sorted((engine.prompts[rid], engine.params[rid].max_tokens) for rid in new)
    warm = (requests[0].prompt[::-1], min(requests[0].output_len, WARMUP_OUTPUT_TOKENS))
    assert sent == sorted([warm] + [(r.prompt, r.output_len) for r in requests])
    assert all(len(r.prompt) == r.input_len and all(isinstance(t, int) for t in r.prompt) for r in requests)
    assert all(engine.params[rid].temperature == 0 and engine.params[rid].ignore_eos for rid in new)
    printed = capsys.readouterr().out
    assert f"{'output token throughput (tok/s)':<40}{res['output_throughput']:>14.1f}" in printed.splitlines()
    assert f"worst gap between two tokens of one stream: {res['max_itl_ms']:.2f} ms" in printed
    assert f"{'TTFT':<12}" + "".join(f"{res[f'{k}_ttft_ms']:>10.2f}" for k in ("mean", "median", "p90", "p99",
                                                                                "max")) in printed.splitlines()
    assert res["server_new_cuda_graphs"] == res["server_new_eager_mixed_steps"] == 0    # counts that never move
    assert "steady state" not in printed


class GraphCountingEngine(FakeEngine):
    """A FakeEngine that, like the real one meeting new step shapes, captures a graph every 4th step and runs a mixed
    step eagerly every 10th (``Engine.stats()``' ``cuda_graphs`` and ``eager_mixed_steps``)."""

    steps = 0

    def step(self):
        self.steps += 1
        return super().step()

    def stats(self) -> dict:
        return {**super().stats(), "cuda_graphs": 40 + self.steps // 4, "eager_mixed_steps": self.steps // 10,
                "cuda_graph_capture_seconds": 0.05 * (self.steps // 4)}


def test_graphs_the_server_captured_during_the_run_are_reported(model_folder, tmp_path, capsys):
    """Catches a first run after a server's start (graphs captured, steps run eagerly) reported as if it were the
    steady state: the counts the server's /metrics grew by during the run are in the JSON and a note says so;
    a server whose counts do not move gets no note."""
    engine = GraphCountingEngine(model_folder, reply="x " * 600, max_batch=4, step_delay=0.002)
    with serve_engine(engine, max_waiting=64) as (url, _ae):
        out = tmp_path / "r.json"
        args = parse("--base-url", url, "--model-path", str(model_folder), "--num-prompts", "4",
                     "--max-concurrency", "2", "--input-len", "4", "--output-len", "30", "--json", str(out))
        assert run_bench_serve(args) == 0
    res = json.loads(out.read_text())
    assert res["server_new_cuda_graphs"] >= 30 // 4 and res["server_new_eager_mixed_steps"] >= 30 // 10
    assert res["server_capture_s"] == pytest.approx(0.05 * res["server_new_cuda_graphs"], abs=1e-6)
    printed = capsys.readouterr().out
    assert "a second run against it measures its steady state" in printed and "s of capture" in printed


def test_requests_shared_among_client_processes(fake_url, model_folder, tmp_path):
    """Client processes with one common start: every request once, its own tokens, the concurrency limit kept
    overall (each process holds its share of it; more processes than places asked for: one per place)."""
    out = tmp_path / "r.json"
    args = parse("--base-url", fake_url, "--model-path", str(model_folder), "--num-prompts", "6",
                 "--max-concurrency", "2", "--input-len", "4", "--output-len", "6", "--range-ratio", "0.3",
                 "--client-processes", "3", "--json", str(out))
    assert run_bench_serve(args) == 0
    res = json.loads(out.read_text())
    assert res["client_processes"] == 2 and [r["index"] for r in res["requests"]] == list(range(6))
    check_result(res, 6, lengths_of(args, model_folder))
    assert res["peak_concurrency"] == 2


def test_poisson_rate_with_text_prompts(fake_server, model_folder, tmp_path, monkeypatch):
    """``--request-rate 50 --prompt-format text``: each request is sent no earlier than its Poisson arrival time
    (the first at once), and the server gets its text, which encodes to the input length counted."""
    from pegainfer.serving_bench import client
    fake_url, engine = fake_server
    sent_at = {}
    send_request = client.send_request

    async def recording_send_request(http, url, body, res):
        sent_at[res.index] = time.perf_counter()
        return await send_request(http, url, body, res)
    monkeypatch.setattr(client, "send_request", recording_send_request)
    seen = set(engine.prompts)
    out = tmp_path / "r.json"
    args = parse("--base-url", fake_url, "--model-path", str(model_folder), "--num-prompts", "5",
                 "--request-rate", "50", "--input-len", "6", "--output-len", "4", "--prompt-format", "text",
                 "--num-warmups", "0", "--json", str(out))
    assert run_bench_serve(args) == 0
    res = json.loads(out.read_text())
    tok = Tokenizer.from_folder(model_folder)
    requests, arrivals = make_requests(args, tok)
    assert all(isinstance(r.prompt, str) for r in requests) and arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    check_result(res, 5, [(len(tok.encode(r.prompt, True)), r.output_len) for r in requests])
    assert res["request_rate"] == 50
    assert arrivals[-1] > 0.03                       # the schedule spans tens of milliseconds
    offsets = np.array([sent_at[i] - sent_at[0] for i in range(5)])
    assert np.all(offsets >= arrivals - 0.005), (offsets, arrivals)
    assert sorted(engine.prompts[rid] for rid in engine.prompts if rid not in seen) == \
        sorted(tok.encode(r.prompt, True) for r in requests)


def test_a_rate_sweep_runs_each_rate_and_names_the_highest_within_the_goal(fake_url, model_folder, tmp_path,
                                                                           capsys):
    """``--request-rate 40,inf``: one run per rate against the same server, with the same lengths but prompts of
    their own (a prefix cache must not find a later run's), a table, and the highest rate whose TTFT p99 met the
    goal (every rate meets a goal of a minute; none meets one of a microsecond)."""
    out = tmp_path / "sweep.json"
    argv = ("--base-url", fake_url, "--model-path", str(model_folder), "--num-prompts", "6", "--input-len", "5",
            "--output-len", "6", "--range-ratio", "0.4", "--num-warmups", "0", "--request-rate", "40,inf")
    assert run_bench_serve(parse(*argv, "--goal-ttft-p99-ms", "60000", "--json", str(out))) == 0
    sweep = json.loads(out.read_text())
    args = parse(*argv)
    tok = Tokenizer.from_folder(model_folder)
    (first, arrivals), (second, at_once) = make_requests(args, tok, 0), make_requests(args, tok, 1)
    lengths = [(r.input_len, r.output_len) for r in first]
    assert [(r.input_len, r.output_len) for r in second] == lengths
    assert [r.prompt for r in first] != [r.prompt for r in second]
    assert arrivals[-1] > 0 and not at_once.any()
    assert [r["request_rate"] for r in sweep["runs"]] == [40, None]
    for run in sweep["runs"]:
        check_result(run, 6, lengths)
    assert sweep["goal_ttft_p99_ms"] == 60000 and sweep["best"]["request_rate"] is None   # inf: the highest
    assert sweep["limit_above"] is False                                                  # nothing is above inf
    assert sweep["best"]["output_throughput"] == sweep["runs"][1]["output_throughput"]
    paced, at_once_run = sweep["runs"]
    assert 0 < paced["arrival_span_s"] == pytest.approx(float(arrivals[-1])) and at_once_run["arrival_span_s"] == 0
    for span, burst in ((paced["duration_s"] / 4, True), (paced["duration_s"], False)):   # when the backlog dominates
        out_text = io.StringIO()
        print_report(dict(paced, arrival_span_s=span), out_text)
        assert ("measures a burst more than this rate" in out_text.getvalue()) == burst
    printed = capsys.readouterr().out
    assert "request-rate sweep" in printed and "highest rate with TTFT p99 <= 60000 ms: inf" in printed
    assert run_bench_serve(parse(*argv, "--goal-ttft-p99-ms", "0.001")) == 0
    assert "no rate kept TTFT p99 within 0.001 ms" in capsys.readouterr().out
    one = [a if a != "40,inf" else "inf" for a in argv]            # one rate and a goal: a verdict on it too
    assert run_bench_serve(parse(*one, "--goal-ttft-p99-ms", "60000", "--json", str(out))) == 0
    assert json.loads(out.read_text())["best"]["request_rate"] is None
    printed = capsys.readouterr().out
    assert "highest rate with TTFT p99 <= 60000 ms: inf" in printed and "limit lies above" not in printed
    one = [a if a != "40,inf" else "40" for a in argv]             # the highest rate tried met it: say so
    assert run_bench_serve(parse(*one, "--goal-ttft-p99-ms", "60000", "--json", str(out))) == 0
    assert json.loads(out.read_text())["limit_above"] is True
    assert "the server's limit lies above 40/s" in capsys.readouterr().out


def test_bench_serve_starts_and_stops_its_own_server(model_folder, tmp_path):
    """The subprocess path: a free port, /health polled until ready, the requests, SIGINT at the end (here the
    fake engine's server, ``tests.server.serve_fake``, stands in for ``python -m pegainfer serve``)."""
    out = tmp_path / "r.json"
    args = parse("--model-path", str(model_folder), "--num-prompts", "4", "--input-len", "3", "--output-len", "5",
                 "--max-batch", "2", "--serve-args", "--load-seconds 0.2", "--json", str(out))
    command = (sys.executable, "-m", "tests.server.serve_fake", str(model_folder))
    assert run_bench_serve(args, serve_command=command) == 0
    res = json.loads(out.read_text())
    assert res["server_started_here"] and res["completed"] == 4 and res["failed"] == 0
    assert [r["output_tokens"] for r in res["requests"]] == [5] * 4
    assert res["serve_args"] == ["--max-waiting", "64", "--model-path", str(model_folder), "--max-batch", "2",
                                 "--load-seconds", "0.2"]
    port = int(res["base_url"].rsplit(":", 1)[1])
    import socket
    with socket.socket() as s:               # stopped: the port is free again
        s.bind(("127.0.0.1", port))


def test_word_tokenizer_serves_a_view_of_the_folder(tmp_path):
    """--word-tokenizer: the started server gets the view (under the model's own name), removed at the end."""
    from tests.text.fixtures import make_model_folder
    folder = make_model_folder(tmp_path / "model")
    (folder / "config.json").write_text(json.dumps({"vocab_size": Tokenizer.from_folder(folder).vocab_size + 8}))
    out = tmp_path / "r.json"
    args = parse("--model-path", str(folder), "--num-prompts", "2", "--input-len", "3", "--output-len", "4",
                 "--word-tokenizer", "--serve-args", "--load-seconds 0.1", "--json", str(out))
    command = (sys.executable, "-m", "tests.server.serve_fake", str(folder))
    assert run_bench_serve(args, serve_command=command) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 2 and res["word_tokenizer"] and res["model"] == "model"
    flags = res["serve_args"]
    view = flags[flags.index("--model-path") + 1]
    assert view != str(folder) and not os.path.exists(view)
    with pytest.raises(PegainferError, match="--word-tokenizer .* needs --prompt-format ids and no --base-url"):
        run_bench_serve(parse("--word-tokenizer", "--prompt-format", "text"))


def test_word_tokenizer_view_gives_every_id_a_word(tmp_path):
    from pegainfer.demo import ensure_demo_model
    from pegainfer.serving_bench.word_tokenizer import word_tokenizer_view
    demo = ensure_demo_model()
    view = word_tokenizer_view(demo, str(tmp_path / "view"))
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    tok = Tokenizer.from_folder(view)
    assert tok.vocab_size == vocab
    assert all(tok.decode([i]) == f"w{i}" for i in range(vocab))
    assert tok.decode([3, 4, 5]) == "w3 w4 w5"
    assert (view / "config.json").resolve() == (demo / "config.json").resolve()
    assert (view / "model.safetensors").is_symlink()


def test_word_tokenizer_view_can_be_remade_in_the_same_folder(tmp_path):
    """Catches a view folder that only works once (a second view there, e.g. of another model, failed on its
    existing links): the second view points at the second model, with none of the first one's links left."""
    from pegainfer.demo import ensure_demo_model
    from pegainfer.serving_bench.word_tokenizer import word_tokenizer_view
    demo = ensure_demo_model()
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (other / name).symlink_to(demo / name)
    (tmp_path / "first-only.txt").write_text("x")
    first = tmp_path / "view"
    word_tokenizer_view(demo, str(first))
    (first / "first-only.txt").symlink_to(tmp_path / "first-only.txt")
    view = word_tokenizer_view(other, str(first))
    assert (view / "config.json").readlink() == other / "config.json"
    assert not (view / "first-only.txt").exists()
    assert Tokenizer.from_folder(view).decode([3, 4]) == "w3 w4"


def test_a_server_that_cannot_start_is_one_line(model_folder):
    args = parse("--model-path", str(model_folder), "--num-prompts", "1")
    command = (sys.executable, "-m", "tests.server.serve_fake", "broken")
    with pytest.raises(PegainferError, match=r"^the server exited \(status 2\) before it was ready: error: "):
        run_bench_serve(args, serve_command=command)


def test_unreachable_server_and_bad_url_are_one_line(model_folder):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()                              # nothing listens there now
    with pytest.raises(PegainferError, match="cannot reach the server at http://127.0.0.1:"):
        run_bench_serve(parse("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"))
    with pytest.raises(PegainferError, match="is not an http:// or https:// URL"):
        run_bench_serve(parse("--base-url", "localhost:8000"))
    with pytest.raises(PegainferError, match="--max-batch sets up the server bench-serve starts"):
        run_bench_serve(parse("--base-url", "http://127.0.0.1:1", "--max-batch", "2"))


def test_cli_errors_are_one_line_without_traceback():
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    for argv, says in ((["--base-url", f"http://127.0.0.1:{port}"], "error: cannot reach the server at "),
                       (["--base-url", "localhost:8000"], "error: --base-url 'localhost:8000' is not an http://")):
        r = subprocess.run([sys.executable, "-m", "pegainfer", "bench-serve", *argv], capture_output=True, text=True,
                           timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(says), r.stderr


def test_requests_longer_than_the_context_are_refused_up_front(fake_url, model_folder):
    """The server's model card says its context (the fake engine's: 256): a workload that cannot fit is a one-line
    error before any request is sent."""
    args = parse("--base-url", fake_url, "--model-path", str(model_folder), "--num-prompts", "2",
                 "--input-len", "300", "--output-len", "2")
    with pytest.raises(PegainferError, match="max model len is 256"):
        run_bench_serve(args)


def test_refused_requests_are_counted_as_failed(model_folder, tmp_path):
    """A server with room for one request waiting and one running answers the rest of an all-at-once burst of 4
    with 503: they count as failed, with the server's reason, and the run still reports the rest."""
    engine = FakeEngine(model_folder, reply="x " * 600, max_batch=1, step_delay=0.01)
    out = tmp_path / "r.json"
    with serve_engine(engine, max_waiting=1) as (url, _ae):
        args = parse("--base-url", url, "--model-path", str(model_folder), "--num-prompts", "4", "--input-len", "3",
                     "--output-len", "20", "--json", str(out))
        assert run_bench_serve(args) == 0
    res = json.loads(out.read_text())
    assert res["failed"] >= 1 and res["completed"] == 4 - res["failed"] and res["completed"] >= 1
    assert any(e.startswith("HTTP 503: ") for e in res["errors"]), res["errors"]
    failed = [r for r in res["requests"] if not r["success"]]
    assert len(failed) == res["failed"] and all(r["ttft_ms"] is None and r["error"] for r in failed)


def test_sharegpt_mix_random_lengths_and_poisson_arrivals(model_folder):
    """The ShareGPT-like mix has the docstring's medians, means, p90s and clipped shares (and ``--dataset-name
    sharegpt`` builds requests of those lengths); random lengths are fixed at ratio 0, else uniform over the whole
    [len × (1 - r), len × (1 + r)]; arrivals at a rate are a Poisson process (exponential gaps: the standard
    deviation equals the mean, 1 - 1/e of the gaps are shorter than it), at inf all at once."""
    rng = np.random.default_rng(0)
    mix = np.array(workload.request_lengths("sharegpt", 4000, 0, 0, 0.0, rng))
    assert mix.min() >= 4 and mix.max() <= 1024
    assert 140 < mix[:, 0].mean() < 185 and 310 < mix[:, 1].mean() < 375      # the docstring's means
    assert 75 < np.median(mix[:, 0]) < 100 and 230 < np.median(mix[:, 1]) < 285
    assert 360 < np.percentile(mix[:, 0], 90) < 440 and 700 < np.percentile(mix[:, 1], 90) < 850
    assert 0.01 < (mix[:, 0] == 1024).mean() < 0.03 and 0.035 < (mix[:, 1] == 1024).mean() < 0.07
    args = parse("--dataset-name", "sharegpt", "--num-prompts", "20", "--seed", "3")
    requests, _ = make_requests(args, Tokenizer.from_folder(model_folder))
    assert [(r.input_len, r.output_len) for r in requests] == \
        workload.request_lengths("sharegpt", 20, 128, 256, 0.0, np.random.default_rng(3))
    assert all(len(r.prompt) == r.input_len for r in requests) and len({r.input_len for r in requests}) > 10
    fixed = workload.request_lengths("random", 5, 10, 20, 0.0, rng)
    assert fixed == [(10, 20)] * 5
    spread = np.array(workload.request_lengths("random", 500, 100, 10, 0.5, rng))
    assert (spread[:, 0].min(), spread[:, 0].max(), spread[:, 1].min(), spread[:, 1].max()) == (50, 150, 5, 15)
    assert len(set(spread[:, 0])) == 101 and spread[:, 0].mean() == pytest.approx(100, abs=3)
    assert parse("--request-rate", "inf").request_rate == (math.inf,)
    assert parse("--request-rate", "4,8.5,inf").request_rate == (4.0, 8.5, math.inf)
    times = workload.arrival_times(2000, 100.0, rng)
    gaps = np.diff(times)
    assert times[0] == 0 and gaps.mean() == pytest.approx(0.01, rel=0.1) and np.all(gaps >= 0)
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.1)
    assert (gaps < gaps.mean()).mean() == pytest.approx(1 - math.exp(-1), abs=0.03)
    assert workload.arrival_times(4, math.inf, rng).tolist() == [0.0] * 4


def test_a_shared_prefix_starts_every_prompt(fake_url, model_folder, tmp_path):
    """``--prefix-len``: every prompt (ids or text) starts with the same prefix, drawn once, and its input length
    counts it; the report carries the prefix length and the server's cached prompt tokens (none from the fake)."""
    tok = Tokenizer.from_folder(model_folder)
    for fmt in ("ids", "text"):
        args = parse("--model-path", str(model_folder), "--num-prompts", "4", "--input-len", "5", "--prefix-len", "12",
                     "--prompt-format", fmt)
        requests, _ = make_requests(args, tok)
        ids = [workload.prompt_token_ids(r, tok) for r in requests]
        prefix = ids[0][:10]          # text: the pieces' first tokens (a join may merge at the boundary)
        assert all(p[:10] == prefix for p in ids) and len({tuple(p) for p in ids}) == 4, fmt
        assert all(r.input_len == len(p) for r, p in zip(requests, ids)), fmt
        assert all(r.input_len >= 16 for r in requests), [r.input_len for r in requests]
    out = tmp_path / "r.json"
    args = parse("--base-url", fake_url, "--model-path", str(model_folder), "--num-prompts", "3", "--input-len", "4",
                 "--prefix-len", "8", "--output-len", "3", "--json", str(out))
    assert run_bench_serve(args) == 0
    res = json.loads(out.read_text())
    assert res["prefix_len"] == 8 and res["total_input_tokens"] == 3 * 12 and res["total_cached_tokens"] == 0


def test_summary_figures_are_those_computed_by_hand():
    """``summarize`` and ``per_request`` on six hand-made results (three served, three failed) over 2 s: counts,
    throughputs, tokens per event, the requests that got another length, the peak in flight (a request that starts
    as another ends does not overlap it) and every statistic of TTFT, TPOT, ITL and E2EL, all worked out by hand;
    failed requests count in flight but in no latency."""
    from pegainfer.serving_bench.client import RequestResult
    from pegainfer.serving_bench.metrics import per_request, summarize
    ok = dict(success=True)
    results = [
        RequestResult(0, 7, 5, prompt_tokens=7, output_tokens=5, cached_tokens=4, start=10.0, ttft=0.1, latency=0.5,
                      itls=[0.1, 0.1, 0.1, 0.1], chunks=5, **ok),
        RequestResult(1, 8, 4, prompt_tokens=8, output_tokens=4, start=10.2, ttft=0.3, latency=0.9,
                      itls=[0.25, 0.35], chunks=3, **ok),                    # one event carried two tokens
        RequestResult(2, 9, 2, prompt_tokens=9, output_tokens=1, start=10.5, ttft=0.2, latency=0.2, chunks=1,
                      **ok),                                                 # 1 token of 2 asked for: no TPOT
        RequestResult(3, 9, 3, error="the stream ended without data: [DONE]", output_tokens=2, start=10.1,
                      ttft=0.05, latency=0.7, itls=[9.0]),
        RequestResult(4, 9, 3, error="HTTP 503: full", start=10.6),
        RequestResult(5, 9, 3, error="HTTP 503: full", start=10.6),
    ]
    res = summarize(results, 2.0)
    assert (res["completed"], res["failed"]) == (3, 3)
    assert res["errors"] == ["the stream ended without data: [DONE]", "HTTP 503: full"]
    assert (res["total_input_tokens"], res["total_output_tokens"], res["total_cached_tokens"]) == (24, 10, 4)
    assert res["request_throughput"] == 1.5 and res["output_throughput"] == 5.0
    assert res["total_token_throughput"] == 17.0
    assert res["tokens_per_chunk"] == pytest.approx(10 / 9) and res["mismatched_outputs"] == 1
    assert res["peak_concurrency"] == 3        # 10.2 s: 0, 3 and 1; at 10.5 s 0 ends as 2 starts
    want = {"ttft": ([100, 300, 200], 200, 200, 280, 298, 300),
            "tpot": ([100, 200], 150, 150, 190, 199, 200),
            "itl": ([100, 100, 100, 100, 250, 350], 1000 / 6, 100, 300, 345, 350),
            "e2el": ([500, 900, 200], 1600 / 3, 500, 820, 892, 900)}
    for name, (values, mean, median, p90, p99, most) in want.items():
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        got = [res[f"{stat}_{name}_ms"] for stat in STATS]
        assert got == pytest.approx([mean, std, median, p90, p99, most]), name
    assert res["max_itl_ms"] == pytest.approx(350)
    rows = per_request(results)
    assert rows[1] == pytest.approx({"index": 1, "input_len": 8, "output_len": 4, "prompt_tokens": 8,
                                     "output_tokens": 4, "cached_tokens": 0, "success": True, "ttft_ms": 300,
                                     "latency_ms": 900, "max_itl_ms": 350, "chunks": 3, "error": ""})
    assert rows[2]["max_itl_ms"] is None
    assert (rows[3]["success"], rows[3]["ttft_ms"], rows[3]["latency_ms"]) == (False, None, None)
    none = summarize(results[3:], 2.0)         # nothing served: no statistic, no throughput
    assert none["completed"] == 0 and none["request_throughput"] == 0 and none["tokens_per_chunk"] is None
    assert all(none[f"{stat}_{name}_ms"] is None for stat in STATS for name in LATENCIES)
    assert summarize(results, 0.0)["output_throughput"] is None


def test_cached_prompt_tokens_are_read_from_the_usage():
    """A server's ``usage.prompt_tokens_details.cached_tokens`` (the last stream event) becomes the request's
    ``cached_tokens`` and the run's ``total_cached_tokens``."""
    from pegainfer.serving_bench.client import RequestResult, _read_event
    from pegainfer.serving_bench.metrics import summarize
    res = RequestResult(0, 40, 2)
    _read_event(json.dumps({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2,
                                                     "prompt_tokens_details": {"cached_tokens": 32}}}).encode(), res)
    assert (res.prompt_tokens, res.output_tokens, res.cached_tokens) == (40, 2, 32)
    res.success, res.latency, res.ttft = True, 0.2, 0.1
    assert summarize([res], 1.0)["total_cached_tokens"] == 32


def test_bad_values_are_refused_while_parsing(capsys):
    for argv, says in ((("--request-rate", "0"), "must be > 0, or inf"), (("--range-ratio", "1"), "[0, 1)"),
                       (("--request-rate", "4,4"), "a rate is given twice"),
                       (("--goal-ttft-p99-ms", "0"), "milliseconds > 0"),
                       (("--num-prompts", "0"), "at least 1"), (("--prompt-format", "words"), "invalid choice"),
                       (("--prefix-len", "-1"), "at least 0")):
        with pytest.raises(SystemExit):
            parse(*argv)
        assert says in capsys.readouterr().err


def test_hf_peer_runs_the_same_requests_on_cpu(monkeypatch):
    """transformers' continuous batching through the manager behind ``generate_batch``, one output length per
    request, end-of-sequence off (on the CPU with the demo model: the code path, not the speed).  The manager is
    driven outside inference mode: its thread updates in place tensors made by the caller's thread, which inference
    mode would make inference tensors (transformers 5.17 then fails every request)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import ContinuousBatchingManager
    modes, added = [], []
    add_request = ContinuousBatchingManager.add_request

    def recording_add_request(self, *a, **kw):
        modes.append(torch.is_inference_mode_enabled())
        added.append((list(a[0]), kw["max_new_tokens"], kw["eos_token_id"]))
        return add_request(self, *a, **kw)
    monkeypatch.setattr(ContinuousBatchingManager, "add_request", recording_add_request)

    from pegainfer.demo import ensure_demo_model
    from pegainfer.serving_bench.hf import hf_continuous_batching
    res = hf_continuous_batching(str(ensure_demo_model()), [[1, 2, 3], [4, 5, 6, 7], [8, 9]], [3, 5, 2],
                                 device="cpu", cb_config=ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64,
                                                                                  page_size=16))
    assert res["hf_completed"] == 3 and res["hf_failed"] == 0 and res["hf_total_output_tokens"] == 3 + 5 + 2
    assert res["hf_output_throughput"] == pytest.approx(10 / res["hf_duration_s"])
    assert res["hf_total_token_throughput"] == pytest.approx((9 + 10) / res["hf_duration_s"])
    assert len(modes) == 3 + 3 and not any(modes)     # warm-up and timed requests, none under inference mode
    assert added[3:] == [([1, 2, 3], 3, -1), ([4, 5, 6, 7], 5, -1), ([8, 9], 2, -1)]    # each its own length


def test_hf_gets_the_served_requests_and_is_printed_beside_them(fake_url, model_folder, tmp_path, capsys,
                                                               monkeypatch):
    """``--hf``: the peer gets the prompt ids and output lengths of the requests the server got (text prompts
    encoded as the server encodes them) and the model folder; its figures join the JSON and a side-by-side table
    prints each throughput of both and their ratio."""
    from pegainfer.serving_bench import hf
    calls = []

    def peer(folder, prompts, output_lens):
        calls.append((folder, prompts, output_lens))
        return {"hf_class": "Qwen3ForCausalLM", "hf_request_throughput": 2.0, "hf_output_throughput": 40.0,
                "hf_total_token_throughput": 80.0}
    monkeypatch.setattr(hf, "hf_continuous_batching", peer)
    out = tmp_path / "r.json"
    args = parse("--base-url", fake_url, "--model-path", str(model_folder), "--num-prompts", "3", "--input-len", "5",
                 "--output-len", "4", "--range-ratio", "0.5", "--prompt-format", "text", "--num-warmups", "0",
                 "--hf", "--json", str(out))
    assert run_bench_serve(args) == 0
    res = json.loads(out.read_text())
    tok = Tokenizer.from_folder(model_folder)
    requests, _ = make_requests(args, tok)
    assert calls == [(str(model_folder), [tok.encode(r.prompt, True) for r in requests],
                      [r.output_len for r in requests])]
    assert res["hf_output_throughput"] == 40.0 and res["completed"] == 3
    printed = capsys.readouterr().out.splitlines()
    for name, key, theirs in (("requests/s", "request_throughput", 2.0), ("output tok/s", "output_throughput", 40.0),
                              ("total tok/s", "total_token_throughput", 80.0)):
        ours = res[key]
        assert f"{name:<32}{ours:>12.1f}{theirs:>12.1f}{ours / theirs:>11.2f}x" in printed, name


def test_hf_without_a_gpu_is_a_line_of_the_report(fake_url, model_folder, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = parse("--base-url", fake_url, "--model-path", str(model_folder), "--num-prompts", "2", "--input-len", "3",
                 "--output-len", "2", "--num-warmups", "0", "--hf", "--json", str(out))
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available():
        pytest.skip("checks the report without a GPU")
    assert run_bench_serve(args) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 2 and res["hf_error"] == "RuntimeError: torch sees no CUDA GPU"
    assert "hf: RuntimeError: torch sees no CUDA GPU" in capsys.readouterr().out
