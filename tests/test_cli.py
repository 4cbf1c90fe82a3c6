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
