"""``benchmarks/soak.py``: a few seconds of the soak against the GPU-like fake engine's server (started by the
script), with its verdict; and the one-line refusal without a server."""
import json

from tests.benchmarks.scripts import one_line_error, run_script


def test_a_short_soak_against_the_fake_gpu_server_passes(tmp_path):
    out = tmp_path / "soak.json"
    r = run_script("soak.py", "--fake-gpu", "--duration", "3", "--concurrency", "6", "--sample-every", "1",
                   "--prompt-len", "4:48", "--output-len", "2:40", "--max-batch", "4", "--abort-fraction", "0.2",
                   "--bad-fraction", "0.1", "--json", str(out), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["passed"] and res["failed"] == 0 and res["bad_wrong"] == 0
    assert res["good"] > 0 and res["aborted"] > 0 and res["output_tokens"] > 0
    assert res["bad"] >= 5            # every kind of bad request: the first five clients open with one each
    assert {"failed good requests", "bad requests answered 4xx", "/health after the soak", "RSS drift",
            "KV pages in use when idle"} <= set(res["checks"])
    last = res["samples"][-1]
    assert last["pages_used"] == 0 and last["running"] == 0 and last["rss_mib"] > 0
    assert len(res["samples"]) >= 4            # one per second, and the idle one at the end
    assert "verdict: PASS" in r.stdout and "RSS MiB" in r.stdout
    assert res["gc_pause_s"] > 0 and res["gc_full_collections"] >= 0   # the server process's collections, timed
    assert 0 < res["gc_longest_pause_s"] <= res["gc_pause_s"] + (res["samples"][0]["gc_pause_s"] or 0)
    assert "garbage collection: " in r.stdout


def test_it_needs_one_server():
    r = run_script("soak.py", "--duration", "1")
    assert r.returncode == 2
    assert one_line_error(r) == "error: give one of --url URL (a running server), --model-path DIR or --fake-gpu"


def test_a_bad_length_range_is_refused_before_any_server_starts():
    r = run_script("soak.py", "--fake-gpu", "--prompt-len", "8:4")
    assert r.returncode == 2
    assert one_line_error(r) == "error: a length range is LO:HI with 1 <= LO <= HI, got '8:4'"
