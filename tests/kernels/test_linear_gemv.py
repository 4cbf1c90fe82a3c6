"""The GEMV (``linear.gemv``) in the splits its geometry picker uses, against the reference kernel; the geometry
pickers and the launch policy's tuning entries."""
import json

import numpy as np
import pytest

from tests.kernels.linear_util import assert_same_bits, exact_inputs, reference_bits, run_bits
from tests.util import launches_during

from numba import cuda

from pegainfer.kernels.linear import GEMV_TUNED, GemvGeometry, SkinnyGeometry, gemv, geometry, linear
from pegainfer.kernels.linear.gemv_multi import _gemv_kernel
from pegainfer.kernels.policy import LaunchPolicy, TuningEntry, load_tuning


@pytest.mark.parametrize("geo,K", [
    (GemvGeometry(rows_per_warp=2, warps=2, k_split=2, max_tokens=2), 128),             # warps share K
    (GemvGeometry(rows_per_warp=4, warps=1, k_split=1, max_tokens=4, k_chunk=256), 520),  # x staged in 3 chunks
    (GemvGeometry(rows_per_warp=1, warps=2, k_split=1, max_tokens=1), 128),             # one token: gemv_decode
    (GemvGeometry(rows_per_warp=2, warps=2, k_split=2, max_tokens=1, stage_x=False), 520),   # x beside weights
    (GemvGeometry(rows_per_warp=4, warps=1, k_split=1, max_tokens=4, stage_x=False), 520),
])
def test_gemv_geometries(geo, K, rng):
    """The splits the GPU geometry picker uses (k_split > 1, K staged in several chunks, the last partial) in
    small form, bit for bit against the reference kernel."""
    (xb, _), (wb, _) = exact_inputs(geo.max_tokens, 9, K, rng)
    assert_same_bits(run_bits(gemv, xb, wb, 9, geometry=geo), reference_bits(xb, wb))


@pytest.mark.parametrize("geo", [
    GemvGeometry(rows_per_warp=2, warps=2, k_split=1, max_tokens=1, stages=1),                  # no prefetch
    GemvGeometry(rows_per_warp=2, warps=1, k_split=1, max_tokens=2, stage_x=False, stages=3),
    GemvGeometry(rows_per_warp=1, warps=2, k_split=2, max_tokens=1, stages=5, persistent=True),
    GemvGeometry(rows_per_warp=2, warps=2, k_split=1, max_tokens=1, k_chunk=1024, stages=3, persistent=True),
])
def test_gemv_load_rings(geo, rng):
    """Load rings of several depths over rows of many steps (K = 1800: 225 slices, 7+ steps per lane, the last
    partial), so the ring wraps several times mid-row; persistent grids stride over several tiles each."""
    (xb, _), (wb, _) = exact_inputs(geo.max_tokens, 13, 1800, rng)
    assert_same_bits(run_bits(gemv, xb, wb, 13, geometry=geo), reference_bits(xb, wb))


@pytest.mark.parametrize("stage_x", [True, False])
def test_gemv_gated_k_split(stage_x, rng):
    (xb, _), (wb, _) = exact_inputs(2, 2 * 10, 128, rng)
    geo = GemvGeometry(rows_per_warp=2, warps=2, k_split=2, max_tokens=2, stage_x=stage_x)
    assert_same_bits(run_bits(gemv, xb, wb, 10, gated=True, geometry=geo), reference_bits(xb, wb, gated=True))


def test_gemv_heuristic_for_untuned_shapes(monkeypatch):
    """Shapes without a measured entry (on a 132-SM GPU): tall one-token matrices that need no K split take
    2 rows × a ring of 6, LM-head-sized ones and split ones keep 4 rows × 3."""
    monkeypatch.setattr(geometry, "SIMULATOR", False)
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    tall = geometry.gemv_geometry(2 * 11008, 2048, 1, gated=True)
    assert (tall.rows_per_warp, tall.warps, tall.k_split, tall.stages, tall.persistent) == (2, 8, 1, 6, True)
    head = geometry.gemv_geometry(151936, 2048, 1)
    assert (head.rows_per_warp, head.k_split, head.stages) == (4, 1, 3)
    wide = geometry.gemv_geometry(2048, 6144, 1)
    assert wide.rows_per_warp == 4 and wide.k_split > 1 and wide.stages == 3
    several = geometry.gemv_geometry(2 * 11008, 2048, 4, gated=True)
    assert (several.max_tokens, several.rows_per_warp, several.stages) == (4, 2, 2)
    assert geometry.gemv_geometry(6144, 2560, 1) == GEMV_TUNED[6144, 2560, 1, False]


def _policy(kind, key, **fields):
    return LaunchPolicy(tuning=(TuningEntry(kind, key, tuple(sorted(fields.items()))),))


def test_policy_tuning_overrides_the_built_in_tables(monkeypatch):
    """``policy.tuned("gemv")`` / ``("skinny")`` entries win over ``GEMV_TUNED`` / ``SKINNY_TUNED`` and the
    heuristics; other shapes keep the built-in choice; the built-in tables are read-only."""
    monkeypatch.setattr(geometry, "SIMULATOR", False)
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    fields = dict(rows_per_warp=4, warps=8, k_split=2, max_tokens=1, stages=5, persistent=True)
    policy = _policy("gemv", (6144, 2560, 1, False), **fields)
    assert geometry.gemv_geometry(6144, 2560, 1, policy=policy) == GemvGeometry(**fields)
    assert geometry.gemv_geometry(6144, 2560, 1) == GEMV_TUNED[6144, 2560, 1, False] != GemvGeometry(**fields)
    assert geometry.gemv_geometry(2560, 9728, 1, policy=policy) == GEMV_TUNED[2560, 9728, 1, False]
    fused = geometry.fused_norm_geometry(6144, 2560, policy=policy)     # the tuned ring, in norm-sized blocks
    assert (fused.rows_per_warp, fused.stages, fused.warps * 32, fused.persistent) == (4, 5, geometry.NORM_THREADS,
                                                                                       True)
    assert fused.warps % fused.k_split == 0
    skinny = dict(n_tiles=4, unroll=2, warps=8, k_split=4, warps_per_sm=8, stages=2)
    policy = _policy("skinny", (19456, 2560, 1, True), **skinny)
    assert geometry.skinny_geometry(19456, 2560, 16, True, policy) == SkinnyGeometry(**skinny)
    assert geometry.skinny_geometry(19456, 2560, 16, True) == geometry.SKINNY_TUNED[19456, 2560, 1, True]
    with pytest.raises(TypeError):
        GEMV_TUNED[1, 2, 1, False] = GemvGeometry(rows_per_warp=2, warps=8, k_split=1, max_tokens=1)


def test_tuning_file_reaches_the_pickers(tmp_path):
    """A tuning file (what benchmarks/bench_gemv.py --cold --tuning-out writes), read by ``load_tuning`` into a
    policy, gives the GEMV and skinny pickers its geometries."""
    path = tmp_path / "tuning.json"
    geo = dict(rows_per_warp=2, warps=8, k_split=2, max_tokens=1, k_chunk=None, stage_x=True, stages=6,
               persistent=True)
    skinny = dict(n_tiles=4, unroll=2, warps=8, k_split=4, warps_per_sm=8, stages=2)
    path.write_text(json.dumps([dict(n_cols=777, k=512, max_tokens=1, gated=False, geometry=geo),
                                dict(n_cols=777, k=512, m_tiles=1, gated=True, geometry=skinny)]))
    policy = LaunchPolicy(tuning=load_tuning(str(path)))
    assert geometry.gemv_geometry(777, 512, 1, policy=policy) == GemvGeometry(**geo)
    assert geometry.skinny_geometry(777, 512, 16, gated=True, policy=policy) == SkinnyGeometry(**skinny)


def test_tuned_geometry_is_launched(rng):
    """``linear(policy=)`` launches the GEMV of the policy's entry for the shape (here two tokens, in the
    simulator), and it computes the reference's bits."""
    fields = dict(rows_per_warp=2, warps=2, k_split=2, max_tokens=2, stages=3)
    policy = _policy("gemv", (20, 128, 2, False), **fields)
    (xb, _), (wb, _) = exact_inputs(2, 20, 128, rng)
    out = cuda.to_device(np.zeros((2, 20), np.uint16))
    launched = launches_during(lambda: linear(cuda.to_device(xb), cuda.to_device(wb), out, policy=policy))
    assert [kernel for kernel, _ in launched] == [_gemv_kernel(2, 2, False, 2, True, 3)]
    assert_same_bits(out.copy_to_host(), reference_bits(xb, wb))
