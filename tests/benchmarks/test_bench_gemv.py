"""``benchmarks/bench_gemv.py``: ``--cold``'s candidate geometries and shapes, the tuning file it writes (read back
by ``policy.load_tuning``), and both modes as smoke runs in the simulator."""
import json
import os
from types import SimpleNamespace

import pytest

from pegainfer.kernels.policy import LaunchPolicy, load_tuning

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.fixture
def bg(bench_modules):
    import bench_gemv
    return bench_gemv


@pytest.fixture
def L(bg):
    return bg.linear_api()


def test_explicit_geometries_replace_the_candidates(bg, L):
    """``--geometry NAME=R,WARPS,K_SPLIT,STAGES`` is that projection's whole candidate list."""
    name, geo = bg.parse_geometry(L, "o=2,4,4,6")
    assert name == "o"
    assert (geo.rows_per_warp, geo.warps, geo.k_split, geo.stages, geo.max_tokens, geo.persistent) == \
        (2, 4, 4, 6, 1, True)
    with pytest.raises(SystemExit, match="NAME=ROWS,WARPS,K_SPLIT,STAGES"):
        bg.parse_geometry(L, "o=2,4")
    assert list(bg.candidates(L, SimpleNamespace(name="o", tokens=1), False, {"o": [geo]})) == [geo]
    down = SimpleNamespace(name="down", tokens=1, gated=False, fused=False, k=9216)
    others = list(bg.candidates(L, down, True, {"o": [geo]}))
    assert len(others) > 1 and geo not in others
    assert all(g.warps % g.k_split == 0 and 9216 // g.k_split >= 512 for g in others)


def test_fused_and_gated_candidates(bg, L):
    """Fused projections keep the norm's block size; gated ones take an even number of rows per warp; more than
    one token sweeps the skinny kernel."""
    gate_up = SimpleNamespace(name="gate_up", tokens=1, gated=True, fused=True, k=2560)
    geos = list(bg.candidates(L, gate_up, False, {}))
    assert geos and all(g.warps == L.fused_warps and g.rows_per_warp % 2 == 0 for g in geos)
    skinny = list(bg.candidates(L, SimpleNamespace(name="qkv", tokens=16, gated=False, fused=False, k=2560), True, {}))
    assert skinny and all(isinstance(g, L.SkinnyGeometry) for g in skinny)


def test_qwen35_shapes_are_the_ones_the_model_streams(bg):
    from tests.models.test_qwen35_oracle import QWEN35_4B as c
    shapes = bg.MODELS["3.5-4b"]["shapes"]
    key = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    H, D = c["hidden_size"], c["head_dim"]
    assert shapes["in_proj"][:2] == (2 * key + 2 * value + 2 * c["linear_num_value_heads"], H)
    assert shapes["qkv"][:2] == (2 * c["num_attention_heads"] * D + 2 * c["num_key_value_heads"] * D, H)
    assert shapes["o"][:2] == (H, c["num_attention_heads"] * D) == (H, value)
    assert shapes["gate_up"][:2] == (2 * c["intermediate_size"], H)
    assert shapes["down"][:2] == (H, c["intermediate_size"])


def test_tuning_entries_are_what_the_policy_reads(bg, L, tmp_path):
    """The tuning file ``--tuning-out`` writes loads into ``LaunchPolicy.tuning`` with the swept geometries' fields,
    GEMV entries keyed by one token, skinny entries by 16-token tiles."""
    qkv = SimpleNamespace(name="qkv", n=6144, k=2560, gated=False)
    gate_up = SimpleNamespace(name="gate_up", n=19456, k=2560, gated=True)
    gemv = L.GemvGeometry(rows_per_warp=4, warps=8, k_split=1, max_tokens=1, stages=3, persistent=True)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(bg.tuning_entries([qkv, gate_up], {"qkv": gemv}, tokens=1)))
    policy = LaunchPolicy(tuning=load_tuning(str(path)))
    assert policy.tuned("gemv") == {(6144, 2560, 1, False): {f: getattr(gemv, f) for f in gemv.__dataclass_fields__}}
    skinny = L.SkinnyGeometry(n_tiles=2, unroll=2, warps=8, k_split=1, stages=2)
    path.write_text(json.dumps(bg.tuning_entries([gate_up], {"gate_up": skinny}, tokens=16)))
    assert set(LaunchPolicy(tuning=load_tuning(str(path))).tuned("skinny")) == {(19456, 2560, 1, True)}


@pytest.mark.skipif(not SIMULATOR, reason="a smoke run of the simulator's tiny shapes")
def test_cold_mode_smoke_run(bg, tmp_path, capsys):
    out = tmp_path / "cold.json"
    assert bg.main(["--cold", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == "cold" and res["model"] == "sim"
    assert [r["label"] for r in res["rows"] if r["kind"] == "step"] == ["default"]
    assert "projections of one decode step" in capsys.readouterr().out
