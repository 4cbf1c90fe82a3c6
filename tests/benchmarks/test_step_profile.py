"""``benchmarks/step_profile.py``: the modes that read files work without a GPU (``trace`` on a Chrome trace,
``timeline --load`` on saved block records); the modes that run the model say in one line that they need one."""
import json
import os

import numpy as np
import pytest

from tests.benchmarks.scripts import one_line_error, run_script

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.fixture
def sp(bench_modules):
    import step_profile
    return step_profile


def _records(rows):
    """Timeline records from ``(t_entry, t_wait, t_ready, t_end, kind, block, grid, extra)`` tuples (ns)."""
    dtype = [("t_entry", np.int64), ("t_wait", np.int64), ("t_ready", np.int64), ("t_end", np.int64),
             ("kind", np.int32), ("block", np.int32), ("grid", np.int32), ("sm", np.int32), ("extra", np.int64)]
    return np.array([(e, w, r, d, k, b, g, 0, x) for e, w, r, d, k, b, g, x in rows], dtype=dtype)


def _two_layers():
    """Two layers of a 2-block GEMV (kind 1, 64 columns) ending at +1 µs, then a 2-block attention (kind 5)."""
    base = 10**18                       # globaltimer-sized values: differences must stay exact
    rows = []
    for layer in range(2):
        t = base + layer * 100_000
        rows += [(t, t + 100, t + 200, t + 1_000, 1, b, 2, 64) for b in range(2)]
        rows += [(t + 500, t + 1_700, t + 2_000, t + 3_000 + 500 * b, 5, b, 2, 0) for b in range(2)]
    return _records(rows)


def test_timeline_moments_and_walls(sp):
    """Each kernel's moments after the previous kernel's last block end (medians over its launches), and its
    walls: attention enters 0.5 µs before the GEMV's end, waits until +0.7, ends at +2.0 / 2.25 / 2.5."""
    rec = _two_layers()
    att = sp.moments(rec)["attentionx2"]
    assert (att["enter"], att["wait"], att["ready"]) == (-0.5, 0.7, 1.0)
    assert (att["end_first"], att["end"], att["end_last"]) == (2.0, 2.25, 2.5)
    rows = sp.summarize(rec)
    assert [r["label"] for r in rows] == ["gemv[64]x2", "attentionx2"] * 2
    assert [r["wall"] for r in rows if r["label"] == "attentionx2"] == [2.5, 2.5]
    assert rows[0]["wall"] is None and rows[2]["wall"] == pytest.approx(100_000 / 1e3 - 2.5)
    assert all(r["early"] == 0.1 and r["prologue"] == 0.1 for r in rows if r["label"] == "gemv[64]x2")


def test_timeline_load_prints_saved_records_without_a_gpu(sp, tmp_path, capsys):
    path = tmp_path / "t.npy"
    np.save(path, _two_layers())
    assert sp.main(["timeline", "--load", str(path)]) == 0
    out = capsys.readouterr().out
    assert "attentionx2" in out and "gemv[64]x2" in out and "end_last" in out
    assert "sum of walls (first kernel's excluded): 102.5 µs" in out


def _trace(path):
    kernels = "GPU kernels (eager step, CUDA events)"
    events = [{"name": "gemv", "ph": "X", "ts": 0, "dur": 30.0, "pid": 1, "tid": kernels, "args": {"step": "decode"}},
              {"name": "gemv", "ph": "X", "ts": 30, "dur": 10.0, "pid": 1, "tid": kernels, "args": {"step": "decode"}},
              {"name": "sample", "ph": "X", "ts": 40, "dur": 10.0, "pid": 1, "tid": kernels,
               "args": {"step": "decode"}},
              {"name": "decode B=1", "ph": "X", "ts": 0, "dur": 2000.0, "pid": 1, "tid": "engine steps", "args": {}},
              {"name": "decode B=1", "ph": "X", "ts": 0, "dur": 3000.0, "pid": 1, "tid": "engine steps", "args": {}},
              {"name": "req", "ph": "X", "ts": 0, "dur": 9.0, "pid": 1, "tid": "requests", "args": {}}]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_trace_summary_of_a_chrome_trace(sp, tmp_path):
    s = sp.trace_summary(json.loads(_trace(tmp_path / "t.json").read_text())["traceEvents"])
    assert s["kernels"] == {"decode: gemv": [2, 40.0], "decode: sample": [1, 10.0]}
    assert s["total_us"] == 50.0 and s["steps"] == {"decode": [2000.0, 3000.0]}


def test_trace_mode_as_a_user_runs_it(tmp_path):
    out = tmp_path / "summary.json"
    r = run_script("step_profile.py", "trace", str(_trace(tmp_path / "t.json")), "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "decode: gemv" in r.stdout and "80.0%" in r.stdout and "median 2.500 ms" in r.stdout
    assert json.loads(out.read_text())["total_us"] == 50.0
    r = run_script("step_profile.py", "trace", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing.json: not a Chrome trace" in one_line_error(r)


@pytest.mark.skipif(not SIMULATOR, reason="checks the message without a GPU")
@pytest.mark.parametrize("mode", ["timeline", "ablation", "gaps", "kernels"])
def test_gpu_modes_say_they_need_a_gpu(mode):
    r = run_script("step_profile.py", mode, "--model-path", "unused")
    assert r.returncode == 2
    assert one_line_error(r).startswith(f"error: step_profile.py {mode} needs a GPU (")


def test_timeline_refuses_a_bad_policy_field():
    r = run_script("step_profile.py", "timeline", "--model-path", "unused", "--policy", "pdll=none")
    assert r.returncode == 2 and "LaunchPolicy has no field 'pdll'" in one_line_error(r)


def test_kernel_names_from_profiler_records(sp):
    assert sp.short_name("pegainfer::kernels::linear::_gemv_decode_kernel::_3clocals_3e::gemv_decode[abi:c8]"
                         "(Array<unsigned short, 1>, int)") == "gemv_decode"
    assert sp.short_name("_ZN6cudapy9pegainfer7kernels6linear11gemv_decodeB2v1E5ArrayItLi1E") == "gemv_decode"
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "b", "ts": 10.0, "dur": 5.0, "args": {"grid": [4, 1, 1], "block": [256, 1, 1]}},
        {"cat": "kernel", "name": "a", "ts": 0.0, "dur": 8.0, "args": {}},
        {"cat": "cpu_op", "name": "x", "ts": 1.0, "dur": 1.0}]}
    kernels = sp.kernel_events(trace)
    assert kernels == [("a", 0.0, 8.0), ("b 4x256", 10.0, 15.0)]
    assert sp.attribute(kernels) == [("a", 0.0, 8.0, 0.0, 8.0), ("b 4x256", 10.0, 5.0, 2.0, 7.0)]
