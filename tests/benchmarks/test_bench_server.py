"""``benchmarks/bench_server.py``: the ``--fake-gpu`` mode end to end (a GPU-like fake engine in process and behind
the real server), and the model mode's one-line refusals."""
import json
import os

import pytest

from tests.benchmarks.scripts import one_line_error, run_script

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def test_fake_gpu_mode_runs(tmp_path):
    out = tmp_path / "overhead.json"
    r = run_script("bench_server.py", "--fake-gpu", "--runs", "2", "--output-len", "6", "--prefill-ms", "2",
                   "--decode-ms", "1.5", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["wait"] == "block" and res["hook"] is True and res["async_scheduling"] is True
    for key in ("in_process_ttft_ms", "http_ttft_ms", "floor_ttft_ms"):
        assert res[key] > 0
    # a step takes the fake GPU time (half of it at least: on a busy machine the simulated GPU keeps running
    # while the host is held up, and the next tokens then come closer together)
    assert min(res["in_process_tpot_ms"], res["http_tpot_ms"]) > 0.5 * 1.5
    assert "HTTP + SSE" in r.stdout


def test_fake_gpu_streams_mode_runs(tmp_path):
    """``--streams N``: bench-serve keeps N streams going against the fake server; every request succeeds and the
    server's CPU time per token is reported (the event loop's a part of the process's)."""
    out = tmp_path / "streams.json"
    r = run_script("bench_server.py", "--fake-gpu", "--streams", "4", "--output-len", "8", "--decode-ms", "2",
                   "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["streams"] == 4 and res["requests"] == 16 and res["failed"] == 0 and res["output_tok_s"] > 0
    assert 0 < res["event_loop_cpu_us_per_token"] < res["process_cpu_us_per_token"]
    assert "event-loop CPU per token" in r.stdout


def test_one_mode_at_a_time():
    r = run_script("bench_server.py")
    assert r.returncode == 2 and "give --model-path DIR (a GPU) or --fake-gpu" in one_line_error(r)


@pytest.mark.skipif(not SIMULATOR, reason="checks the message without a GPU")
def test_model_mode_needs_a_gpu():
    r = run_script("bench_server.py", "--model-path", "unused")
    assert r.returncode == 2
    assert one_line_error(r) == "error: bench_server.py --model-path needs a GPU (use --fake-gpu without one)"
