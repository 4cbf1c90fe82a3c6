"""The Hopper GEMM ``gemm_wgmma`` (warpgroup MMAs reading 128-byte-swizzled tiles through shared-memory descriptors,
a ring of TMA copies between a producer warp and the consumer warpgroups, split-K), against the reference kernel and
float64 NumPy.  In the simulator ``wgmma`` is
emulated from the descriptor and swizzle rules of ``primitives.wgmma``: what this checks there is that the kernel
writes its tiles where its descriptors say they are, and reads its accumulators in the documented layout; on a GPU
it runs the real instructions."""
import numpy as np
import pytest
from numba import cuda

from tests.kernels.linear_util import NORM_FORMS, assert_same_bits, exact_inputs, reference_bits, run, run_bits
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
    (130, 200, 136, WgmmaGeometry(2, 160, stages=5), False),         # a prompt's 160-column tiles, plain weight
    # one resident wave of blocks walking a prompt's tiles (on the GPU 132 blocks, 256 tiles)
    pytest.param(2048, 2560, 4096, WgmmaGeometry(2, 160, stages=5, persistent=True), False, marks=pytest.mark.gpu),
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



@pytest.mark.parametrize("n_cols,k,gated,tokens,bn", [
    (2560, 4096, False, 2048, 160),     # Qwen3-4B o: 320 tiles of 128 columns are 3 waves on 132 SMs, 256 of 160 two
    (2560, 9728, False, 1024, 160),     # its down at 1024 tokens: 160 tiles of 128 (2 waves), 128 of 160 (one)
    (2560, 4096, False, 512, 128),      # 512 tokens: one wave either way, the narrower tiles
    (2 * 9728, 2560, True, 2048, 160),  # gate_up: 19 waves × 128 columns against 15 × 160
    (4096, 4096, False, 2048, 128),     # Qwen3-8B o: 4 waves either way
    (6144, 2560, False, 2048, 256),     # plain weights of 6144 columns and more: 256 × 4
])
def test_prompt_tiles_of_fewer_waves(monkeypatch, n_cols, k, gated, tokens, bn):
    """The prompt rule on a 132-SM H200: 160-column tiles in a ring of 5 where their waves × columns are fewer than
    128-column tiles' (docs/perf/linear.md), 256 columns for wide plain weights, every ring within the SM, one
    resident wave of blocks walking the tiles."""
    from pegainfer.kernels.linear import geometry
    monkeypatch.setattr(geometry, "SIMULATOR", False)
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    geo = geometry.wgmma_geometry(n_cols, k, tokens, gated)
    assert (geo.warpgroups, geo.bn, geo.k_splits, geo.fill, geo.persistent) == (2, bn, 1, "tma", True), geo
    assert not geometry.wgmma_geometry(n_cols, k, 256, gated).persistent      # a batch: split K, a block a unit
    assert geo.stages == {128: 5, 160: 5, 256: 4}[bn]
    assert geo.shared_bytes + 1024 <= 228 * 1024

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


# ------------------------------------------------------------------------------------------------ add + RMSNorm prologue
@pytest.mark.parametrize("form", list(NORM_FORMS))
@pytest.mark.parametrize("T,N,K,gated,with_delta", [
    (5, 320, 136, False, True),    # 5 column tiles on a grid of 4 blocks (the simulator's): a block's second unit
    (20, 200, 264, True, True),    # SwiGLU pairs; K = 264 splits in two: split-K counters beside the handoff's
    (9, 96, 136, False, False),    # no delta: the norm of the residual alone
    # Qwen3-4B's qkv (128 blocks, 64 write rows) and gate/up (244 blocks, two an SM)
    pytest.param(64, 6144, 2560, False, True, marks=pytest.mark.gpu),
    pytest.param(40, 19456, 2560, True, True, marks=pytest.mark.gpu),
])
def test_ring_gemm_with_the_add_rms_norm_prologue(T, N, K, gated, with_delta, form, rng):
    """``linear_add_rms_norm`` of 17-64 tokens as one ring-GEMM launch (``policy.gemm_norm_prologue``) equals the
    separate ``add_rms_norm_into`` + ring GEMM bit for bit -- residual, normed rows and output -- on arbitrary bf16
    data, and leaves the workspace's counters at zero (a graph replays it without a reset).  On a GPU the rows are
    written by several blocks and the others wait for them; in the simulator block 0 writes them all."""
    from dataclasses import replace
    from pegainfer.kernels.linear import linear_add_rms_norm
    from pegainfer.kernels.linear.gemm_wgmma import fuses_ring_norm
    from pegainfer.kernels.policy import DEFAULT_POLICY

    fused_policy = replace(DEFAULT_POLICY, gemm_norm_prologue=True)
    n_cols = N
    assert fuses_ring_norm(T, n_cols, K, gated, fused_policy) and not fuses_ring_norm(T, n_cols, K, gated,
                                                                                        DEFAULT_POLICY)
    rb, _ = bf16_randn((T, K), rng)
    db = bf16_randn((T, K), rng)[0] if with_delta else None
    wnb, _ = bf16_randn((K,), rng, scale=0.2 if form == "qwen35" else 1.0)
    wb, _ = bf16_randn((N, K), rng, scale=0.2)
    n_out = N // 2 if gated else N
    results = []
    for policy in (DEFAULT_POLICY, fused_policy):
        ws = workspace()
        bufs = [cuda.to_device(np.full((T, K), 0x7FC1, np.uint16)) for _ in range(2)]   # residual_out, normed
        out = cuda.to_device(np.zeros((T, n_out), np.uint16))
        linear_add_rms_norm(cuda.to_device(rb), None if db is None else cuda.to_device(db), cuda.to_device(wnb),
                            1e-6, bufs[0], cuda.to_device(wb), out, gated=gated, normed_out=bufs[1],
                            impl="gemm_wgmma", workspace=ws, policy=policy, **NORM_FORMS[form])
        results.append([b.copy_to_host() for b in bufs] + [out.copy_to_host()])
        if policy is fused_policy:
            tail = ws.copy_to_host().view(np.int32)[-2:]
            assert np.all(tail == 0), f"the handoff counters must be back at zero, got {tail}"
    for name, separate, fused in zip(("residual_out", "normed", "out"), *results):
        assert np.array_equal(fused, separate), f"{name}: the prologue must give the separate launches' bits"
