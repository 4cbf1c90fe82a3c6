"""The command line as a user runs it: `python -m pegainfer ...` in a subprocess, on the built-in demo model
(in the simulator on CI)."""
import json
import os
import subprocess
import sys

import pytest


def run_cli(*args, timeout=900):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "pegainfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_help_explains_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for word in ("generate", "serve", "bench"):
        assert word in r.stdout
    r = run_cli("generate", "--help")
    assert r.returncode == 0
    for flag in ("--model-path", "--prompt", "--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p",
                 "--seed", "--ignore-eos", "--max-model-len", "--cuda-graph"):
        assert flag in r.stdout


def test_generate_on_demo_model_streams_and_summarises():
    r = run_cli("generate", "--prompt", "Hello", "--max-tokens", "3", "--temperature", "0", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert "random" in r.stderr.lower()                     # the demo model is labelled as random
    summary = [line for line in r.stderr.splitlines() if "TTFT" in line]
    assert summary and "generated tokens 3" in summary[-1] and "TPOT" in summary[-1] and "tok/s" in summary[-1]
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or "simulator" in r.stderr:
        assert "simulator" in r.stderr.lower()


def test_seeded_sampling_is_reproducible():
    args = ("generate", "--prompt", "The", "--max-tokens", "3", "--temperature", "1.0", "--top-k", "20",
            "--seed", "11", "--ignore-eos")
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout


@pytest.mark.parametrize("args, needle", [
    (("generate", "--model-path", "/nonexistent/model"), "/nonexistent/model"),
    (("generate", "--max-tokens", "0"), "--max-tokens"),
])
def test_bad_input_is_one_line_without_traceback(args, needle):
    r = run_cli(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and needle in err[0], r.stderr


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    r = run_cli("generate", "--model-path", str(tmp_path))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "Qwen3" in r.stderr and "llama" in r.stderr.lower()


def test_bench_runs_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    r = run_cli("bench", "--prompt-len", "4", "--output-len", "2", "--runs", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["output_len"] == 2 and res["ttft_ms"]["p50"] > 0 and "tpot_ms" in res
    assert "TTFT" in r.stdout.upper() or "ttft" in r.stdout
    floor = res["floor_bytes"]   # the demo Qwen3: tied embedding (read in full as the LM head), no recurrent state
    assert floor["weights_read"] == res["weight_bytes"] and floor["recurrent_state_rw"] == 0
    assert floor["kv_context_tokens"] == 4 + 2 / 2 and floor["kv_read"] > 0
    assert floor["total"] == floor["weights_read"] + floor["kv_read"]
    assert "recurrent state r+w" in r.stdout


def test_bench_floor_counts_recurrent_state_and_untied_embedding_rows():
    """decode_floor_bytes on a stand-in model: an untied embedding is read one row per token (the LM head in full),
    and a hybrid model's state buffers ``[layers, slots, ...]`` are read and written once per step for one slot."""
    from types import SimpleNamespace

    import numpy as np

    from pegainfer.bench import decode_floor_bytes

    V, H, slots = 100, 8, 2
    model = SimpleNamespace(V=V, H=H, embed=object(), lm_head=object(), num_slots=slots,
                            conv_state=np.zeros((3, slots, 24, 3), np.uint16),
                            ssm_state=np.zeros((3, slots, 2, 4, 4), np.float32),
                            weight_bytes=lambda: 2 * (2 * V * H + 500), kv_bytes_per_token=lambda: 64)
    floor = decode_floor_bytes(model, context_tokens=10.5)
    assert floor["weights_read"] == 2 * (V * H + H + 500)
    assert floor["recurrent_state_rw"] == 2 * 3 * (24 * 3 * 2 + 2 * 4 * 4 * 4)
    assert floor["kv_read"] == 672 and floor["kv_context_tokens"] == 10.5
    assert floor["total"] == floor["weights_read"] + floor["recurrent_state_rw"] + floor["kv_read"]


def test_ab_bench_alternates_patched_variants(tmp_path):
    """``benchmarks/ab_bench.py``: every variant's statements run in its own interpreter before the engine (here a
    patch that marks the floor dict bench reports), rounds alternate variants, the JSON holds every run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "ab.json"
    marked = ("import pegainfer.bench as b; f = b.decode_floor_bytes; "
              "b.decode_floor_bytes = lambda m, c: dict(f(m, c), marker=7)")
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "ab_bench.py"), "--rounds", "1",
                        "--variant", "base=", "--variant", f"marked={marked}", "--json", str(out), "--",
                        "--prompt-len", "4", "--output-len", "2", "--runs", "1"],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [run["variant"] for run in runs] == ["base", "marked"]
    assert all(run["tpot_ms"] > 0 and run["ttft_ms"] > 0 for run in runs)
    assert "marker" not in runs[0]["bench"]["floor_bytes"] and runs[1]["bench"]["floor_bytes"]["marker"] == 7
    assert "tpot vs first" in r.stdout


def test_ab_bench_rejects_a_variant_without_label():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "ab_bench.py"), "--variant", "no label"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "LABEL=STATEMENTS" in r.stderr


def test_graph_sweep_puts_every_setting_back_between_variants(monkeypatch):
    """``benchmarks/graph_sweep.py``: what one variant patches -- a setting, an entry of a tuning table, a module
    function -- is back as it was before the next variant's statements run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    import graph_sweep
    import pegainfer.kernels.attention as attention
    import pegainfer.kernels.gated_delta as gated_delta
    import pegainfer.kernels.linear as linear

    geometry, tuned = attention._split_geometry, dict(linear.GEMV_TUNED)
    early, chunk = gated_delta.DECODE_EARLY_GATES, linear.BULK_CHUNK_BYTES
    snapshot = graph_sweep.settings_snapshot()
    exec("import pegainfer.kernels.linear as l; l.GEMV_TUNED[1, 2, 1, True] = l._tuned_t1(2, 8, 1, 4); "
         "l.GEMV_TUNED.pop(next(iter(l.GEMV_TUNED))); l.BULK_CHUNK_BYTES = 1\n"
         "import pegainfer.kernels.gated_delta as g; g.DECODE_EARLY_GATES = not g.DECODE_EARLY_GATES\n"
         "import pegainfer.kernels.attention as a; a._split_geometry = lambda d, g: (8, True, 0, False)", {})
    assert linear.BULK_CHUNK_BYTES == 1 and attention._split_geometry is not geometry
    graph_sweep.restore(snapshot)
    assert linear.GEMV_TUNED == tuned and linear.BULK_CHUNK_BYTES == chunk
    assert gated_delta.DECODE_EARLY_GATES == early and attention._split_geometry is geometry


def test_graph_sweep_says_it_needs_a_gpu():
    """Without a GPU (the simulator has no CUDA graphs) ``graph_sweep.py`` says so and exits 0; a variant without a
    label is refused first, with the expected form."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "graph_sweep.py")
    r = subprocess.run([sys.executable, script, "--model-path", "unused", "--variant", "no label"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode != 0 and "Traceback" not in r.stderr and "LABEL=STATEMENTS" in r.stderr
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        r = subprocess.run([sys.executable, script, "--model-path", "unused", "--variant", "base="],
                           capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=root))
        assert r.returncode == 0 and "needs a GPU" in r.stdout, r.stderr


def test_bench_decode_stream_sweeps_only_the_given_geometries(monkeypatch):
    """``benchmarks/bench_decode_stream.py --geometry NAME=R,WARPS,K_SPLIT,STAGES`` replaces that projection's
    candidate list; its Qwen3.5-4B shapes are the ones the model streams."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    import bench_decode_stream as bds
    from types import SimpleNamespace

    from tests.models.test_qwen35_oracle import QWEN35_4B as c

    name, geo = bds.parse_geometry("o=2,4,4,6")
    assert name == "o"
    assert (geo.rows_per_warp, geo.warps, geo.k_split, geo.stages, geo.max_tokens, geo.persistent) == \
        (2, 4, 4, 6, 1, True)
    with pytest.raises(SystemExit, match="NAME=ROWS,WARPS,K_SPLIT,STAGES"):
        bds.parse_geometry("o=2,4")
    monkeypatch.setitem(bds.EXPLICIT, "o", [geo])
    assert list(bds.candidates(SimpleNamespace(name="o", tokens=1), quick=False)) == [geo]
    others = list(bds.candidates(SimpleNamespace(name="down", tokens=1, gated=False, fused=False, k=9216), True))
    assert len(others) > 1 and geo not in others

    shapes = bds.MODELS["3.5-4b"]["shapes"]
    key, value = c["linear_num_key_heads"] * c["linear_key_head_dim"], \
        c["linear_num_value_heads"] * c["linear_value_head_dim"]
    H, D = c["hidden_size"], c["head_dim"]
    assert shapes["in_proj"][:2] == (2 * key + 2 * value + 2 * c["linear_num_value_heads"], H)
    assert shapes["qkv"][:2] == (2 * c["num_attention_heads"] * D + 2 * c["num_key_value_heads"] * D, H)
    assert shapes["o"][:2] == (H, c["num_attention_heads"] * D) == (H, value)
    assert shapes["gate_up"][:2] == (2 * c["intermediate_size"], H)
    assert shapes["down"][:2] == (H, c["intermediate_size"])

