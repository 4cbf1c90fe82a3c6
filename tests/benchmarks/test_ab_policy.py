"""``benchmarks/ab_policy.py``: variants parse into ``LaunchPolicy`` values, bad ones are refused in one line, graph
mode needs a GPU, bench mode runs each variant's ``pegainfer bench`` in its own process with that policy."""
import json
import os

import pytest

from pegainfer.kernels.policy import PDL_DEFAULT, LaunchPolicy, load_tuning
from tests.benchmarks.scripts import one_line_error, run_script

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.fixture
def ab(bench_modules):
    import ab_policy
    return ab_policy


def test_a_bare_label_is_the_default_policy(ab):
    label, fields = ab.parse_variant("base")
    assert (label, fields) == ("base", {})
    assert ab.policy_with(LaunchPolicy(), fields) == LaunchPolicy()


@pytest.mark.parametrize("spec, pdl", [
    ("x:pdl=none", frozenset()),
    ("x:pdl=all", None),
    ("x:pdl=default", PDL_DEFAULT),
    ("x:pdl=gemv+gemv_preloaded", frozenset({"gemv", "gemv_preloaded"})),
    ("x:pdl=default-qk_norm_rope_store_decode+sample", (PDL_DEFAULT - {"qk_norm_rope_store_decode"}) | {"sample"}),
    ("x:pdl=none+sample", frozenset({"sample"})),
])
def test_pdl_values(ab, spec, pdl):
    _, fields = ab.parse_variant(spec)
    policy = ab.policy_with(LaunchPolicy(), fields)
    assert policy.pdl == pdl
    assert policy.preload_o and policy.head_argmax and not policy.timeline and policy.tuning == ()


def test_several_fields_and_booleans(ab):
    label, fields = ab.parse_variant("lean:preload_o=false, head_argmax=0,timeline=on")
    policy = ab.policy_with(LaunchPolicy(), fields)
    assert label == "lean"
    assert (policy.preload_o, policy.head_argmax, policy.timeline, policy.pdl) == (False, False, True, PDL_DEFAULT)
    assert ab.describe(fields) == "preload_o=False, head_argmax=False, timeline=True"
    assert ab.describe(ab.parse_variant("x:pdl=default-gemv+sample")[1]) == "pdl=default+sample-gemv"


def test_tuning_file_becomes_the_policys_tuning(ab, tmp_path):
    path = tmp_path / "tuning.json"
    entries = [{"n_cols": 6144, "k": 2560, "max_tokens": 1, "gated": False,
                "geometry": {"rows_per_warp": 2, "warps": 8, "k_split": 1, "max_tokens": 1, "stages": 6,
                             "persistent": True}}]
    path.write_text(json.dumps(entries))
    _, fields = ab.parse_variant(f"geo:tuning={path}")
    policy = ab.policy_with(LaunchPolicy(), fields)
    assert policy.tuning == load_tuning(str(path))
    assert policy.tuned("gemv")[(6144, 2560, 1, False)]["stages"] == 6
    assert ab.policy_with(policy, ab.parse_fields("tuning=none")).tuning == ()


@pytest.mark.parametrize("spec, needle", [
    ("x:foo=1", "LaunchPolicy has no field 'foo' (its fields: pdl, preload_o, head_argmax, tuning, "
                "gemm_norm_prologue, timeline)"),
    ("x:preload_o=maybe", "preload_o: 'maybe' is not true or false"),
    ("x:pdl=gemv+no way", "is not a launch name"),
    ("x:preload_o", "expected FIELD=VALUE"),
    ("base=", "expected LABEL or LABEL:FIELD=VALUE"),
    (":pdl=none", "expected LABEL or LABEL:FIELD=VALUE"),
])
def test_bad_variants_are_refused(ab, spec, needle):
    with pytest.raises(ab.VariantError, match="^--variant ") as e:
        ab.parse_variant(spec)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_command_refuses_a_bad_field_in_one_line():
    r = run_script("ab_policy.py", "--model-path", "unused", "--variant", "base", "--variant", "x:foo=1")
    assert r.returncode == 2
    assert one_line_error(r) == ("error: --variant 'x:foo=1': LaunchPolicy has no field 'foo' "
                                 "(its fields: pdl, preload_o, head_argmax, tuning, gemm_norm_prologue, timeline)")
    r = run_script("ab_policy.py", "--model-path", "unused", "--variant", "a", "--variant", "a:pdl=none")
    assert r.returncode == 2 and "share a label" in one_line_error(r)


@pytest.mark.skipif(not SIMULATOR, reason="checks the message without a GPU")
def test_graph_mode_needs_a_gpu():
    r = run_script("ab_policy.py", "--model-path", "unused", "--variant", "base", "--variant", "x:pdl=none")
    assert r.returncode == 2
    assert one_line_error(r) == "error: ab_policy.py --mode graph needs a GPU (the simulator has no CUDA graphs)"


def test_bench_mode_alternates_variants_round_by_round(ab, monkeypatch, tmp_path, capsys):
    """Each round runs every variant once, in order; each run gets its own variant's spec and the bench arguments;
    the table compares medians with the first variant's."""
    calls = []

    def fake_run(spec, bench_args, timeout):
        calls.append((spec, list(bench_args)))
        tpot = {"base": 2.0, "x:pdl=none": 2.2}[spec]
        return {"ttft_ms": {"p50": 5.0}, "tpot_ms": {"p50": tpot}, "floor_ratio": 0.8}

    monkeypatch.setattr(ab, "run_bench_variant", fake_run)
    out = tmp_path / "ab.json"
    assert ab.main(["--mode", "bench", "--rounds", "2", "--variant", "base", "--variant", "x:pdl=none",
                    "--json", str(out), "--", "--prompt-len", "4"]) == 0
    assert [spec for spec, _ in calls] == ["base", "x:pdl=none", "base", "x:pdl=none"]
    assert all(args == ["--prompt-len", "4"] for _, args in calls)
    runs = json.loads(out.read_text())["runs"]
    assert [(r["variant"], r["round"]) for r in runs] == [("base", 1), ("x", 1), ("base", 2), ("x", 2)]
    assert "+10.00%" in capsys.readouterr().out


def test_bench_mode_runs_pegainfer_bench_with_the_variants_policy(tmp_path):
    """One real run on the demo model (in the simulator: slow kernels, tiny model): the child builds the engine
    with the variant's policy, and bench's JSON records it."""
    out = tmp_path / "ab.json"
    r = run_script("ab_policy.py", "--mode", "bench", "--rounds", "1", "--variant", "lean:pdl=none,head_argmax=false",
                   "--json", str(out), "--", "--prompt-len", "4", "--output-len", "2", "--runs", "1", timeout=900)
    assert r.returncode == 0, r.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["variant"] == "lean" and run["tpot_ms"] > 0 and run["ttft_ms"] > 0
    assert run["bench"]["policy"] == {"pdl": [], "preload_o": True, "head_argmax": False, "tuning": 0,
                                      "gemm_norm_prologue": False, "timeline": False}
    assert "tpot vs first" in r.stdout
