"""The Hopper GEMM ``gemm_wgmma`` (warpgroup MMAs reading 128-byte-swizzled tiles through shared-memory descriptors,
a ring of TMA copies between a producer warp and the consumer warpgroups, split-K), against the reference kernel and
float64 NumPy.  In the simulator ``wgmma`` is
emulated from the descriptor and swizzle rules of ``primitives.wgmma``: what this checks there is that the kernel
writes its tiles where its descriptors say they are, and reads its accumulators in the documented layout; on a GPU
it runs the real instructions."""
import numpy as np
import pytest
from numba import cuda

from tests.kernels.linear_util import assert_same_bits, exact_inputs, reference_bits, run, run_bits
from tests.util import bf16_randn, from_bf16_bits

from pegainfer.kernels.linear.gemm_wgmma import gemm_wgmma
from pegainfer.kernels.linear.geometry import WgmmaGeometry


def workspace(n=1 << 16):
    return cuda.to_device(np.full(n, np.nan, np.float32))


@pytest.mark.parametrize("T,N,K,geo,gated", [
    (5, 40, 72, WgmmaGeometry(1, 64, stages=3), False),              # one tile: tokens, columns and K ragged
    (70, 72, 200, WgmmaGeometry(1, 64, stages=4, k_splits=2), True),  # two token tiles, split-K, SwiGLU pairs
    (9, 48, 520, WgmmaGeometry(1, 32, stages=3), True),               # 9 K tiles: three rounds of the ring
    (5, 40, 72, WgmmaGeometry(1, 64, stages=3, fill="ring"), False),  # the same with every thread's cp.async
    (70, 72, 200, WgmmaGeometry(1, 64, stages=4, k_splits=2, fill="ring"), True),
    (20, 200, 136, WgmmaGeometry(1, 80, stages=5, warps_per_sm=8, fill="ring"), True),  # gate/up's 80-column tiles
    (70, 200, 136, WgmmaGeometry(2, 160, stages=4), True),           # gate/up's 160-column tiles at 65-256 tokens
])
def test_gemm_wgmma_matches_reference(T, N, K, geo, gated, rng):
    """Bit for bit on data whose sums are exact in f32: the swizzled ring, the descriptors of each k16 step, the
    accumulator layout in the epilogue, the split partials."""
    (xb, _), (wb, _) = exact_inputs(T, N, K, rng)
    got = run_bits(gemm_wgmma, xb, wb, N // 2 if gated else N, gated=gated, geometry=geo, workspace=workspace())
    assert_same_bits(got, reference_bits(xb, wb, gated))


def test_gemm_wgmma_matches_numpy(rng):
    """Arbitrary bf16 data, within one bf16 ulp of the float64 product."""
    T, N, K = 9, 64, 128
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.3)
    exact = x @ w.T
    ref = from_bf16_bits(reference_bits(xb, wb)).astype(np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)
    for fill in ("tma", "ring"):
        got = run(gemm_wgmma, xb, wb, N, geometry=WgmmaGeometry(1, 64, stages=3, fill=fill))
        assert np.all(np.abs(got - exact) <= ulp), fill


@pytest.mark.parametrize("n_cols,k,bn", [
    (2 * 9728, 2560, 160),      # Qwen3-4B gate_up: 304 tiles of 128 columns at 256 tokens are 3 waves, 244 of 160 two
    (2 * 9216, 2560, 160),      # Qwen3.5-4B gate_up
    (2 * 12288, 4096, 128),     # Qwen3-8B gate_up: 308 tiles of 160 would be 3 waves as well
])
def test_gate_up_of_a_batch_takes_the_tiles_of_fewer_waves(monkeypatch, n_cols, k, bn):
    """The rule for 65-256 tokens on a 132-SM H200: gate/up in 160-column tiles where their waves × columns are
    fewer than 128-column tiles' (docs/perf/linear.md); other weights keep 128."""
    from pegainfer.kernels.linear import geometry
    monkeypatch.setattr(geometry, "SIMULATOR", False)
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    for tokens in (65, 128, 129, 256):
        geo = geometry.wgmma_geometry(n_cols, k, tokens, True)
        assert (geo.warpgroups, geo.bn, geo.fill) == (2, bn, "tma"), (tokens, geo)
        assert geo.shared_bytes + 1024 <= 228 * 1024
    for tokens in (129, 256):
        assert geometry.wgmma_geometry(n_cols, k, tokens, False).bn == 128


@pytest.mark.parametrize("n_cols,k,gated,bn", [
    (2 * 9728, 2560, True, 80),      # Qwen3-4B gate_up
    (2 * 9216, 2560, True, 80),      # Qwen3.5-4B gate_up
    (2 * 12288, 4096, True, 96),     # Qwen3-8B gate_up
    (12352, 2560, False, 48),        # Qwen3.5-4B in_proj
    (10240, 2560, False, 48),        # Qwen3.5-4B full-attention qkv
])
def test_tall_weights_of_a_batch_take_two_blocks_an_sm(monkeypatch, n_cols, k, gated, bn):
    """The rule for 17-64 tokens on a 132-SM H200: gate/up and weights tall enough for 48-column tiles run two
    waves of tiles in two blocks an SM (docs/perf/linear.md), so two blocks' shared memory (and the 1 KB the GPU
    keeps per block) must fit the SM's 228 KB; Qwen3's 6144-column qkv keeps one wave, one block."""
    from pegainfer.kernels.linear import geometry
    monkeypatch.setattr(geometry, "SIMULATOR", False)
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    for tokens in (17, 32, 64):
        geo = geometry.wgmma_geometry(n_cols, k, tokens, gated)
        assert (geo.bn, geo.k_splits, geo.warps_per_sm, geo.fill) == (bn, 1, 8, "ring"), geo
        assert 2 * (geo.shared_bytes + 1024) <= 228 * 1024, geo.shared_bytes
        assert 132 < -(-n_cols // bn) <= 2 * 132
    qkv = geometry.wgmma_geometry(6144, 2560, 64, False)
    assert (qkv.bn, qkv.stages, qkv.warps_per_sm) == (48, 8, 4) and -(-6144 // qkv.bn) <= 132
