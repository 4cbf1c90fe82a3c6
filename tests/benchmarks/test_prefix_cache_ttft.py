"""``benchmarks/prefix_cache_ttft.py`` on the demo model (in the simulator on CI), run in-process through its
``main`` with a user's arguments (``test_help.py`` runs it as a script)."""
import json


def test_prefix_cache_benchmark_runs_on_the_demo_model(bench_modules, tmp_path):
    """Catches a prefix-cache benchmark that reports a hit it did not get: on the demo model in the simulator, the
    followers find the 16-token prefix's full page with the cache on and nothing with it off."""
    import prefix_cache_ttft

    out = tmp_path / "prefix.json"
    assert prefix_cache_ttft.main(["--prefix-len", "16", "--suffix-len", "1", "--runs", "1", "--warmup-runs", "0",
                                   "--max-model-len", "32", "--followers", "2", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["on"]["cached_tokens"] == [[16, 16]] and got["off"]["cached_tokens"] == [[0, 0]]
    assert len(got["on"]["ttft_followers_ms"]) == 2 and got["off"]["ttft_first_ms"] > 0
