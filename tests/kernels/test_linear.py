"""linear / linear_silu_mul: every implementation against float64 NumPy.

In the simulator (CI) the shapes are tiny and the tensor-core kernel runs with an emulated ``mma.sync`` (inline PTX
cannot run there); the GPU tests at the bottom run every path, the real mma included, on the Qwen3-4B shapes.
"""
import numpy as np
import pytest

from tests.util import SIMULATOR, bf16_randn, bf16_round, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels import linear as lin
from pegainfer.kernels import norm
from pegainfer.kernels.linear import GemvGeometry, gemv, linear, linear_add_rms_norm, linear_silu_mul


def silu_mul_reference(x, w_gate_up):
    """HF's bf16 MLP activation: g, u rounded, silu(g) rounded, the product rounded."""
    inter = w_gate_up.shape[0] // 2
    g = bf16_round(x @ w_gate_up[:inter].T)
    u = bf16_round(x @ w_gate_up[inter:].T)
    return bf16_round(bf16_round(g / (1.0 + np.exp(-g))) * u)


def run(fn, xb, wb, n_out, **kw):
    out = cuda.to_device(np.zeros((xb.shape[0], n_out), np.uint16))
    fn(cuda.to_device(xb), cuda.to_device(wb), out, **kw)
    return from_bf16_bits(out.copy_to_host()).astype(np.float64)


SIM_IMPLS = ["gemv", "gemm_fma"]


@pytest.mark.parametrize("impl", SIM_IMPLS)
@pytest.mark.parametrize("T,N,K", [(1, 40, 64), (3, 41, 128), (17, 50, 72)])
def test_linear_matches_numpy(impl, T, N, K, rng):
    """N with a tail (41, 50 are not multiples of any tile), K = 72 not a multiple of the 16/32-wide K tiles,
    T = 17 spans several GEMV passes and two GEMM token tiles."""
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.1)
    got = run(linear, xb, wb, N, impl=impl)
    assert rel_l2(got, x @ w.T) < 1e-2
    assert np.array_equal(got, bf16_round(got)), "outputs must be bf16 values"


@pytest.mark.parametrize("impl", SIM_IMPLS)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_linear_silu_mul_matches_hf_rounding(impl, T, rng):
    K, inter = 64, 36
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((2 * inter, K), rng, scale=0.3)
    got = run(linear_silu_mul, xb, wb, inter, impl=impl)
    expected = silu_mul_reference(x, w)
    assert rel_l2(got, expected) < 1e-2
    # the f32 sums differ from float64 only in the last bits: nearly every rounded output is the same bf16
    assert np.mean(got == expected) > 0.9, np.mean(got == expected)


@pytest.mark.parametrize("geometry", [
    GemvGeometry(rows_per_warp=2, warps=2, k_split=2, max_tokens=2),             # warps share K; smem reduction
    GemvGeometry(rows_per_warp=4, warps=1, k_split=1, max_tokens=4, k_chunk=256),  # x staged in 256-wide chunks
    GemvGeometry(rows_per_warp=1, warps=2, k_split=1, max_tokens=1),
    GemvGeometry(rows_per_warp=2, warps=2, k_split=2, max_tokens=1, stage_x=False),   # x read beside the weights
    GemvGeometry(rows_per_warp=4, warps=1, k_split=1, max_tokens=4, stage_x=False),
])
def test_gemv_geometries(geometry, rng):
    """The splits the GPU geometry picker uses (k_split > 1, K staged in several chunks) in small form."""
    T = geometry.max_tokens
    K = 520 if geometry.k_chunk or not geometry.stage_x else 128   # 520: three 256-wide chunks, the last partial
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((9, K), rng, scale=0.1)
    got = run(gemv, xb, wb, 9, geometry=geometry)
    assert rel_l2(got, x @ w.T) < 1e-2


@pytest.mark.parametrize("geometry", [
    GemvGeometry(rows_per_warp=2, warps=2, k_split=1, max_tokens=1, stages=1),                  # no prefetch
    GemvGeometry(rows_per_warp=2, warps=1, k_split=1, max_tokens=2, stage_x=False, stages=3),
    GemvGeometry(rows_per_warp=1, warps=2, k_split=2, max_tokens=1, stages=5, persistent=True),
    GemvGeometry(rows_per_warp=2, warps=2, k_split=1, max_tokens=1, k_chunk=1024, stages=3, persistent=True),
])
def test_gemv_load_rings(geometry, rng):
    """Load rings of several depths over rows of many steps (K = 1800: 225 slices, 7+ steps per lane, the last
    partial), so the ring wraps several times mid-row; persistent grids stride over several tiles each."""
    T, K, N = geometry.max_tokens, 1800, 13
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.05)
    got = run(gemv, xb, wb, N, geometry=geometry)
    assert rel_l2(got, x @ w.T) < 1e-2


@pytest.mark.parametrize("stage_x", [True, False])
def test_gemv_gated_k_split(stage_x, rng):
    xb, x = bf16_randn((2, 128), rng)
    wb, w = bf16_randn((2 * 10, 128), rng, scale=0.3)
    geo = GemvGeometry(rows_per_warp=2, warps=2, k_split=2, max_tokens=2, stage_x=stage_x)
    got = run(gemv, xb, wb, 10, gated=True, geometry=geo)
    assert rel_l2(got, silu_mul_reference(x, w)) < 1e-2


@pytest.mark.parametrize("T", [2, 9])
def test_default_dispatch(T, rng):
    """impl=None: the GEMV for T <= 8, the GEMM above, with the default geometries."""
    xb, x = bf16_randn((T, 64), rng)
    wb, w = bf16_randn((33, 64), rng, scale=0.1)
    assert rel_l2(run(linear, xb, wb, 33), x @ w.T) < 1e-2


def test_rejects_bad_shapes():
    x = np.zeros((2, 12), np.uint16)
    with pytest.raises(ValueError, match="multiple of 8"):
        linear(x, np.zeros((4, 12), np.uint16), np.zeros((2, 4), np.uint16))
    x = np.zeros((2, 16), np.uint16)
    with pytest.raises(ValueError, match="does not match"):
        linear(x, np.zeros((4, 8), np.uint16), np.zeros((2, 4), np.uint16))
    with pytest.raises(ValueError, match="out"):
        linear_silu_mul(x, np.zeros((8, 16), np.uint16), np.zeros((2, 8), np.uint16))
    with pytest.raises(ValueError, match="uint16"):
        linear(x.astype(np.float32), np.zeros((4, 16), np.uint16), np.zeros((2, 4), np.uint16))
    with pytest.raises(ValueError, match="impl"):
        linear(x, np.zeros((4, 16), np.uint16), np.zeros((2, 4), np.uint16), impl="cublas")


@pytest.mark.parametrize("T,N,K,tile,gated", [
    (20, 40, 72, (2, 2, 1, 1), False),   # two warp rows; T, N and K (3 stages of 32, the last partial) all ragged
    (3, 24, 40, (1, 1, 2, 2), False),    # several m16 / n8 tiles per warp
    (5, 40, 64, (1, 2, 1, 2), True),     # SwiGLU epilogue from the accumulator fragment's column pairs
    (20, 40, 232, (2, 2, 1, 1), False),  # 8 K tiles through a ring of 4 stages: every stage reused, K ragged
    (9, 48, 160, (1, 2, 1, 2), True),    # 5 K tiles, gated
])
def test_gemm_mma_kernel(T, N, K, tile, gated, rng):
    """The tensor-core kernel's cp.async stage ring, swizzled fragment indexing and epilogue.  In the simulator
    ``mma.sync`` is emulated from the PTX fragment layout; on a GPU this runs the real instruction."""
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.3)
    got = run(lin.gemm_mma, xb, wb, N // 2 if gated else N, gated=gated, tile=tile)
    expected = silu_mul_reference(x, w) if gated else x @ w.T
    assert rel_l2(got, expected) < 1e-2


@pytest.mark.parametrize("T,N,K,geometry,gated", [
    (1, 24, 64, lin.SkinnyGeometry(n_tiles=1, unroll=1, warps=1, k_split=1), False),   # decode, several tiles
    (5, 41, 72, lin.SkinnyGeometry(n_tiles=2, unroll=2, warps=2, k_split=2), False),   # ragged N and K, split-K
    (11, 20, 96, lin.SkinnyGeometry(n_tiles=1, unroll=1, warps=2, k_split=1), True),   # tokens g+8, SwiGLU pairs
    (20, 17, 40, lin.SkinnyGeometry(n_tiles=1, unroll=2, warps=2, k_split=2), False),  # two m16 token tiles
    # register rings: 2 and 3 iterations, K runs shorter, equal to and longer than the ring
    (16, 24, 200, lin.SkinnyGeometry(n_tiles=2, unroll=1, warps=2, k_split=2, stages=2), True),
    (9, 20, 136, lin.SkinnyGeometry(n_tiles=1, unroll=2, warps=1, k_split=1, stages=3), False),
    (3, 12, 32, lin.SkinnyGeometry(n_tiles=1, unroll=1, warps=2, k_split=2, stages=3), False),
])
def test_linear_skinny(T, N, K, geometry, gated, rng):
    """The skinny tensor-core kernel (weights straight into mma B fragments, permuted K, split-K through shared
    memory, fused SwiGLU) with the emulated ``mma.sync``."""
    xb, x = bf16_randn((T, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.3)
    got = run(lin.linear_skinny, xb, wb, N // 2 if gated else N, gated=gated, geometry=geometry)
    expected = silu_mul_reference(x, w) if gated else x @ w.T
    assert rel_l2(got, expected) < 1e-2
    assert np.array_equal(got, bf16_round(got)), "outputs must be bf16 values"


def test_linear_skinny_default_geometry(rng):
    xb, x = bf16_randn((3, 128), rng)
    wb, w = bf16_randn((20, 128), rng, scale=0.1)
    assert rel_l2(run(lin.linear_skinny, xb, wb, 20), x @ w.T) < 1e-2


def test_default_impl():
    if SIMULATOR:
        assert [lin.default_impl(t) for t in (1, 8, 9)] == ["gemv", "gemv", "gemm_fma"]
    else:
        assert [lin.default_impl(t) for t in (1, 2, 64, 65)] == ["gemv", "skinny", "skinny", "gemm_mma"]


# ------------------------------------------------------------------------------------------------ add + RMSNorm + linear
NORM_FORMS = {"qwen3": {}, "qwen35": {"weight_offset": 1.0, "round_before_weight": False}}


def rms_norm_reference(s, w, eps, weight_offset=0.0, round_before_weight=True):
    """HF's bf16 RMSNorm of the rows of ``s`` in float64 (Qwen3: round, then weight, round; Qwen3.5: one rounding
    of ``n · (1 + w)``)."""
    n = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + eps)
    if round_before_weight:
        n = bf16_round(n)
    return bf16_round(n * (w + weight_offset))


def _separate(rb, db, wnb, wb, gated, form, eps):
    """The unfused ops (``norm.add_rms_norm`` / ``norm.rms_norm`` in place, then ``linear``): (residual, normed,
    out) as uint16 bits."""
    T, H = rb.shape
    residual = cuda.to_device(rb.copy())
    normed = cuda.to_device(np.zeros((T, H), np.uint16))
    if db is None:
        norm.rms_norm(residual, cuda.to_device(wnb), normed, eps, **NORM_FORMS[form])
    else:
        norm.add_rms_norm(residual, cuda.to_device(db), cuda.to_device(wnb), normed, eps, **NORM_FORMS[form])
    out = cuda.to_device(np.zeros((T, wb.shape[0] // 2 if gated else wb.shape[0]), np.uint16))
    (linear_silu_mul if gated else linear)(normed, cuda.to_device(wb), out)
    return residual.copy_to_host(), normed.copy_to_host(), out.copy_to_host()


def _fused(rb, db, wnb, wb, gated, form, eps, **kw):
    """``linear_add_rms_norm``: (residual_in after the call, residual_out, normed_out, out) as uint16 bits;
    residual_out and normed_out start filled with a sentinel."""
    T, H = rb.shape
    residual_in = cuda.to_device(rb.copy())
    residual_out = cuda.to_device(np.full((T, H), 0x7FC1, np.uint16))
    normed_out = cuda.to_device(np.full((T, H), 0x7FC1, np.uint16))
    out = cuda.to_device(np.zeros((T, wb.shape[0] // 2 if gated else wb.shape[0]), np.uint16))
    linear_add_rms_norm(residual_in, None if db is None else cuda.to_device(db), cuda.to_device(wnb), eps,
                        residual_out, cuda.to_device(wb), out, gated=gated, normed_out=normed_out,
                        **NORM_FORMS[form], **kw)
    return (residual_in.copy_to_host(), residual_out.copy_to_host(), normed_out.copy_to_host(),
            out.copy_to_host())


@pytest.mark.parametrize("form", list(NORM_FORMS))
@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
@pytest.mark.parametrize("T,H", [(1, 72), (1, 128), (1, 320), (3, 64)])
def test_linear_add_rms_norm(T, H, with_delta, gated, form, rng):
    """Against float64 NumPy, and bit for bit against the separate ops.  T = 1 is the fused GEMV (in the simulator
    two blocks over several tiles; H = 72 leaves a partial stride of the row, H = 128 fills whole strides, one per
    block, H = 320 five, more than there are blocks: block b writes strides b, b + 2, ... of the residual); T = 3
    the unfused path (``add_rms_norm_into`` + ``linear``)."""
    eps = 1e-6
    n_cols = 40
    rb, r = bf16_randn((T, H), rng)
    db, d = bf16_randn((T, H), rng) if with_delta else (None, 0.0)
    wnb, wn = bf16_randn((H,), rng, scale=0.2 if form == "qwen35" else 1.0)   # (1 + w) or w
    wb, w = bf16_randn((n_cols, H), rng, scale=0.2)
    res_in, res_out, normed, out = _fused(rb, db, wnb, wb, gated, form, eps)

    s = bf16_round(r + d)
    assert np.array_equal(from_bf16_bits(res_out), s), "residual_out must be bf16(residual + delta)"
    assert np.array_equal(res_in, rb), "residual_in must not be written"
    n = rms_norm_reference(s, wn, eps, **NORM_FORMS[form])
    expected = silu_mul_reference(n, w) if gated else n @ w.T
    got = from_bf16_bits(out).astype(np.float64)
    assert rel_l2(got, expected) < 1e-2

    ref_residual, ref_normed, ref_out = _separate(rb, db, wnb, wb, gated, form, eps)
    assert np.array_equal(res_out, ref_residual), "residual_out must equal add_rms_norm's residual bit for bit"
    assert np.array_equal(out, ref_out), "the fused op must equal add_rms_norm + linear bit for bit"
    if T == 1:
        assert np.all(normed == 0x7FC1), "the fused path must not write normed_out"
    else:
        assert np.array_equal(normed, ref_normed)


@pytest.mark.parametrize("form", list(NORM_FORMS))
@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
def test_linear_add_rms_norm_gathers_the_embedding_row(gated, form, rng):
    """``row_ids`` (the first layer of a one-token step): the prologue reads row ``ids[0]`` of the embedding table
    as the residual -- bit for bit ``embedding`` then the fused op; an id outside the table reads as zeros, as
    ``embedding`` gives them."""
    from pegainfer.kernels.embedding import embedding
    V, H, n_cols = 11, 72, 40
    tb, _ = bf16_randn((V, H), rng)
    wnb, _ = bf16_randn((H,), rng, scale=0.2 if form == "qwen35" else 1.0)
    wb, _ = bf16_randn((n_cols, H), rng, scale=0.2)
    table = cuda.to_device(tb)
    assert lin.fuses_add_rms_norm(1, wb, gated) and not lin.fuses_add_rms_norm(2, wb, gated)
    for token in (7, V, -1):
        ids = cuda.to_device(np.array([token], np.int32))
        residual_out = cuda.to_device(np.full((1, H), 0x7FC1, np.uint16))
        out = cuda.to_device(np.zeros((1, n_cols // 2 if gated else n_cols), np.uint16))
        linear_add_rms_norm(table, None, cuda.to_device(wnb), 1e-6, residual_out, cuda.to_device(wb), out,
                            gated=gated, row_ids=ids, **NORM_FORMS[form])
        looked_up = cuda.to_device(np.zeros((1, H), np.uint16))
        embedding(ids, table, looked_up)
        assert np.array_equal(looked_up.copy_to_host(), tb[token:token + 1] if 0 <= token < V else 0 * tb[:1])
        _, ref_res, _, ref_out = _fused(looked_up.copy_to_host(), None, wnb, wb, gated, form, 1e-6)
        assert np.array_equal(residual_out.copy_to_host(), ref_res)
        assert np.array_equal(out.copy_to_host(), ref_out)
    with pytest.raises(ValueError, match="row_ids"):
        linear_add_rms_norm(table, None, cuda.to_device(wnb), 1e-6, cuda.to_device(np.zeros((2, H), np.uint16)),
                            cuda.to_device(wb), cuda.to_device(np.zeros((2, n_cols // 2 if gated else n_cols),
                                                                        np.uint16)),
                            gated=gated, row_ids=cuda.to_device(np.zeros(2, np.int32)), **NORM_FORMS[form])


@pytest.mark.parametrize("tie", [False, True], ids=["distinct", "tied"])
def test_lm_head_argmax(tie, rng):
    """``head=`` (the LM head of a one-sequence step): besides the logits, the launch writes the greedy token --
    the first index of the largest bf16 logit, over every block's columns -- with the sampler's threshold and kept
    count, and leaves its counter at zero for the next replay; the logits are the same bits as without it."""
    from pegainfer.kernels.sampling import HeadArgmax, allocate_sample_workspace, workspace_views
    V, H = 300, 64
    rb, _ = bf16_randn((1, H), rng)
    db, _ = bf16_randn((1, H), rng)
    wnb, _ = bf16_randn((H,), rng)
    wb, _ = bf16_randn((V, H), rng, scale=0.3)
    if tie:      # the same row at several columns, the largest logit among them: the first must win
        _, _, _, plain = _fused(rb, db, wnb, wb, False, "qwen3", 1e-6)
        top = int(np.argmax(from_bf16_bits(plain[0])))
        for j in (3, top, 250):
            wb[j] = wb[top]
    out_ids = cuda.to_device(np.full(1, -5, np.int32))
    workspace = allocate_sample_workspace(1, V)
    head = HeadArgmax(out_ids, workspace)
    _, _, _, ref = _fused(rb, db, wnb, wb, False, "qwen3", 1e-6)
    for replay in range(2):
        _, _, _, got = _fused(rb, db, wnb, wb, False, "qwen3", 1e-6, head=head)
        assert np.array_equal(got, ref)
        logits = from_bf16_bits(ref[0]).astype(np.float32)
        assert out_ids.copy_to_host()[0] == int(np.argmax(logits))
        threshold, kept = workspace_views(workspace)
        assert threshold.copy_to_host()[0] == logits.max() and kept.copy_to_host()[0] == 1
        assert head.part_index.copy_to_host()[-1] == 0, "the counter must be back at zero"
    if tie:
        assert out_ids.copy_to_host()[0] == 3


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
def test_linear_add_rms_norm_geometries(gated, rng):
    """The fused path with other splits of the same block size: two rows per warp (many tiles per block)."""
    H = 96
    rb, _ = bf16_randn((1, H), rng)
    db, _ = bf16_randn((1, H), rng)
    wnb, _ = bf16_randn((H,), rng)
    wb, _ = bf16_randn((34, H), rng, scale=0.2)
    geo = GemvGeometry(rows_per_warp=2, warps=lin.NORM_THREADS // 32, k_split=1, max_tokens=1, stages=4)
    _, res_out, _, out = _fused(rb, db, wnb, wb, gated, "qwen3", 1e-6, geometry=geo)
    ref_residual, _, ref_out = _separate(rb, db, wnb, wb, gated, "qwen3", 1e-6)
    assert np.array_equal(res_out, ref_residual)
    assert np.array_equal(out, ref_out)


@pytest.mark.parametrize("trigger", lin.GEMV_TRIGGERS)
def test_gemv_triggers_same_bits(trigger, monkeypatch):
    """Where the one-token GEMV lets the next kernel launch changes no result: every ``GEMV_TRIGGERS`` choice, for
    the plain GEMV (several tiles per block) and the fused add + RMSNorm one (``before_latency_bound``)."""
    rng = np.random.default_rng(11)
    H = 96
    xb, _ = bf16_randn((1, H), rng)
    rb, _ = bf16_randn((1, H), rng)
    wnb, _ = bf16_randn((H,), rng)
    wb, _ = bf16_randn((34, H), rng, scale=0.2)
    geo = GemvGeometry(rows_per_warp=2, warps=2, k_split=1, max_tokens=1, stages=2, persistent=True)
    plain = run(gemv, xb, wb, 34, geometry=geo)
    fused = _fused(rb, None, wnb, wb, False, "qwen3", 1e-6)[3]
    monkeypatch.setattr(lin, "GEMV_TRIGGER", trigger)
    monkeypatch.setattr(lin, "GEMV_TRIGGER_BEFORE_LATENCY_BOUND", trigger)
    assert np.array_equal(run(gemv, xb, wb, 34, geometry=geo), plain)
    assert np.array_equal(_fused(rb, None, wnb, wb, False, "qwen3", 1e-6, before_latency_bound=True)[3], fused)


def test_gemv_heuristic_for_untuned_shapes(monkeypatch):
    """Shapes without a measured entry: tall one-token matrices that need no K split take 2 rows × a ring of 6
    (the H200 sweeps' winner for such shapes), LM-head-sized ones and split ones keep 4 rows × 3."""
    monkeypatch.setattr(lin, "SIMULATOR", False)
    monkeypatch.setattr(lin, "_sm_count", lambda: 132)
    monkeypatch.setattr(lin, "GEMV_TUNED", {})
    tall = lin.gemv_geometry(2 * 11008, 2048, 1, gated=True)
    assert (tall.rows_per_warp, tall.warps, tall.k_split, tall.stages, tall.persistent) == (2, 8, 1, 6, True)
    head = lin.gemv_geometry(151936, 2048, 1)
    assert (head.rows_per_warp, head.k_split, head.stages) == (4, 1, 3)
    wide = lin.gemv_geometry(2048, 6144, 1)
    assert wide.rows_per_warp == 4 and wide.k_split > 1 and wide.stages == 3
    several = lin.gemv_geometry(2 * 11008, 2048, 4, gated=True)
    assert (several.max_tokens, several.rows_per_warp, several.stages) == (4, 2, 2)


def test_fused_norm_geometry_keeps_the_ring_depth(monkeypatch):
    """The fused path runs the tuned load ring (``GEMV_TUNED``'s stages), in blocks of ``NORM_THREADS``."""
    tuned = GemvGeometry(rows_per_warp=4, warps=4, k_split=4, max_tokens=1, stages=5, persistent=True)
    monkeypatch.setattr(lin, "gemv_geometry", lambda n, k, t, gated=False: tuned)
    geo = lin.fused_norm_geometry(64, 2560)
    assert (geo.stages, geo.rows_per_warp, geo.warps * 32, geo.persistent) == (5, 4, lin.NORM_THREADS, True)
    assert geo.warps % geo.k_split == 0


def test_gemv_bad_trigger_is_a_user_error(monkeypatch):
    from pegainfer.errors import PegainferError
    monkeypatch.setattr(lin, "GEMV_TRIGGER", "early")
    xb, _ = bf16_randn((1, 64), np.random.default_rng(0))
    wb, _ = bf16_randn((8, 64), np.random.default_rng(1))
    with pytest.raises(PegainferError, match="PEGAINFER_GEMV_TRIGGER"):
        run(gemv, xb, wb, 8, geometry=GemvGeometry(rows_per_warp=2, warps=2, k_split=1, max_tokens=1))


def test_linear_add_rms_norm_rejects(rng):
    T, H = 1, 64
    r = cuda.to_device(np.zeros((2, H), np.uint16))
    wn = cuda.to_device(np.zeros(H, np.uint16))
    w = cuda.to_device(np.zeros((8, H), np.uint16))
    out = cuda.to_device(np.zeros((T, 8), np.uint16))
    with pytest.raises(ValueError, match="overlap"):
        linear_add_rms_norm(r[:1], None, wn, 1e-6, r[:1], w, out)
    big = cuda.to_device(np.zeros((2 * H,), np.uint16))
    with pytest.raises(ValueError, match="overlap"):   # views of one buffer that share elements
        linear_add_rms_norm(big[:H].reshape(1, H), None, wn, 1e-6, big[H // 2:H // 2 + H].reshape(1, H), w, out)
    out3 = cuda.to_device(np.zeros((3, 8), np.uint16))
    r3 = cuda.to_device(np.zeros((3, H), np.uint16))
    with pytest.raises(ValueError, match="normed_out"):
        linear_add_rms_norm(r3, None, wn, 1e-6, cuda.to_device(np.zeros((3, H), np.uint16)), w, out3)
    with pytest.raises(ValueError, match="geometry"):
        linear_add_rms_norm(r[:1], None, wn, 1e-6, r[1:], w, out,
                            geometry=GemvGeometry(rows_per_warp=2, warps=lin.NORM_THREADS // 32 + 1, k_split=1,
                                                  max_tokens=1))
    with pytest.raises(ValueError, match="norm_weight"):
        linear_add_rms_norm(r[:1], None, cuda.to_device(np.zeros(H - 8, np.uint16)), 1e-6, r[1:], w, out)


KP = 2 * lin.threads(gpu=lin.PRELOAD_THREADS, sim=32)
"""K of the preloaded GEMV is a multiple of this (two bf16 per lane and block thread): 64 here, 512 on a GPU."""


@pytest.mark.parametrize("bulk,release", [(True, "copies"), (False, "copies"), (True, "dots")])
@pytest.mark.parametrize("N,k_units", [(40, 1), (9, 2), (64, 3)])
def test_linear_preloaded_matches_numpy(N, k_units, bulk, release, rng, monkeypatch):
    """The preloaded one-token GEMV (weights copied into shared memory before the PDL wait, by the copy engine or
    by every thread).  In the simulator (4 SMs counted) N = 40 gives 4 blocks of 10 rows, N = 9 gives 3 blocks of
    3, N = 64 blocks of 16; on a GPU the last block of a run is partial."""
    monkeypatch.setattr(lin, "PRELOAD_BULK", bulk)
    monkeypatch.setattr(lin, "PRELOAD_RELEASE", release)
    K = KP * k_units
    assert lin.preload_rows(N, K) > 0
    xb, x = bf16_randn((1, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.1)
    got = run(lin.linear_preloaded, xb, wb, N)
    assert rel_l2(got, x @ w.T) < 1e-2
    assert np.array_equal(got, bf16_round(got)), "outputs must be bf16 values"
    assert lin.preloads(1, cuda.to_device(wb))


def test_linear_preloaded_falls_back(rng, monkeypatch):
    """More tokens, a K that does not split over the block's lanes, or ``PRELOAD`` off: ``linear`` itself."""
    for T, N, K in ((3, 40, KP), (1, 40, KP + 8)):
        xb, x = bf16_randn((T, K), rng)
        wb, w = bf16_randn((N, K), rng, scale=0.1)
        assert not lin.preloads(T, cuda.to_device(wb))
        assert np.array_equal(run(lin.linear_preloaded, xb, wb, N), run(linear, xb, wb, N))
    monkeypatch.setattr(lin, "PRELOAD", False)
    assert not lin.preloads(1, cuda.to_device(np.zeros((40, KP), np.uint16)))
    assert lin.preload_rows(40, KP) > 0          # the shape itself would fit


def test_linear_preloaded_needs_overlap(monkeypatch):
    """On a GPU without PDL (before sm_90, or ``PEGAINFER_PDL=0``) the copies could overlap nothing: no preload."""
    monkeypatch.setattr(lin, "SIMULATOR", False)
    monkeypatch.setattr(lin, "overlaps", lambda name: False)
    assert not lin._preload_on(1)
    monkeypatch.setattr(lin, "overlaps", lambda name: name == "gemv_preloaded")
    assert lin._preload_on(1) and not lin._preload_on(2)


def test_preload_rows_limits(monkeypatch):
    monkeypatch.setattr(lin, "_sm_count", lambda: 132)
    monkeypatch.setattr(lin, "_shared_optin", lambda: 227 * 1024)
    monkeypatch.setattr(lin, "threads", lambda gpu, sim: gpu)
    assert lin.preload_rows(2560, 4096) == 20      # Qwen3-4B / Qwen3.5-4B o: 160 KB a block, 128 blocks
    assert lin.preload_rows(4096, 4096) == 0       # Qwen3-8B o: 256 KB a block does not fit
    assert lin.preload_rows(2560, 4100) == 0       # K / 2 not a multiple of 256


# ------------------------------------------------------------------------------------------------ GPU only
QWEN3_4B = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728),
            "lm_head": (151936, 2560)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(QWEN3_4B))
def test_qwen3_4b_shapes_every_path(name):
    """Every implementation at decode (1, 5, 8 tokens), small-batch (16) and prefill (130) sizes; one weight per
    shape, uploaded once."""
    rng = np.random.default_rng(7)
    N, K = QWEN3_4B[name]
    gated = name == "gate_up"
    wb, w = bf16_randn((N, K), rng, scale=K ** -0.5)
    w_dev = cuda.to_device(wb)
    failures = []
    for T in (1, 5, 8, 16, 40, 130):
        xb, x = bf16_randn((T, K), rng)
        expected = silu_mul_reference(x, w) if gated else x @ w.T
        x_dev = cuda.to_device(xb)
        for impl in ("gemv", "skinny", "gemm_fma", "gemm_mma") if T <= 64 else ("gemv", "gemm_fma", "gemm_mma"):
            out = cuda.to_device(np.zeros((T, N // 2 if gated else N), np.uint16))
            (linear_silu_mul if gated else linear)(x_dev, w_dev, out, impl=impl)
            err = rel_l2(from_bf16_bits(out.copy_to_host()), expected)
            if not err < 1e-2:
                failures.append((impl, T, err))
    assert not failures, f"{name}: (impl, T, rel L2) over 1e-2: {failures}"


@pytest.mark.gpu
@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "cp_async"])
def test_linear_preloaded_qwen3_4b_o(bulk, monkeypatch):
    """The preloaded GEMV on the o projection it serves (2560 × 4096), against NumPy and the streaming GEMV."""
    monkeypatch.setattr(lin, "PRELOAD_BULK", bulk)
    if bulk and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("cp.async.bulk needs sm_90")
    monkeypatch.setattr(lin, "overlaps", lambda name: True)     # the kernel even where PDL is off (PEGAINFER_PDL=0)
    rng = np.random.default_rng(5)
    N, K = QWEN3_4B["o"]
    assert lin.preloads(1, cuda.to_device(np.zeros((N, K), np.uint16)))
    wb, w = bf16_randn((N, K), rng, scale=K ** -0.5)
    xb, x = bf16_randn((1, K), rng)
    got = run(lin.linear_preloaded, xb, wb, N)
    assert rel_l2(got, x @ w.T) < 1e-2
    assert rel_l2(got, run(linear, xb, wb, N)) < 1e-2


@pytest.mark.gpu
def test_gemv_geometry_covers_all_sms():
    """The heuristic picker gives the short-and-wide matrices enough warps to occupy every SM (shapes with a
    measured entry in GEMV_TUNED use that instead: the H200 sweep found fewer, busier warps faster there)."""
    sms = lin._sm_count()
    for N, K in [(2560, 4096), (2560, 9728), (6144, 2560), (2560, 9216), (12352, 2560), (10240, 2560)]:
        geo = lin.gemv_geometry(N, K, 1)
        if any(key[:2] == (N, K) for key in lin.GEMV_TUNED):
            continue
        warps = -(-N // geo.rows_per_warp) * geo.k_split
        assert warps >= 16 * sms, (N, K, geo)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "gate_up", "lm_head"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
def test_linear_add_rms_norm_qwen3_4b(name, with_delta):
    """The fused one-token path on the Qwen3-4B shapes it serves: bit for bit what add_rms_norm + linear give."""
    rng = np.random.default_rng(11)
    N, H = QWEN3_4B[name]
    gated = name == "gate_up"
    rb, _ = bf16_randn((1, H), rng)
    db = bf16_randn((1, H), rng)[0] if with_delta else None
    wnb, _ = bf16_randn((H,), rng)
    wb, _ = bf16_randn((N, H), rng, scale=H ** -0.5)
    _, res_out, _, out = _fused(rb, db, wnb, wb, gated, "qwen3", 1e-6)
    ref_residual, _, ref_out = _separate(rb, db, wnb, wb, gated, "qwen3", 1e-6)
    assert np.array_equal(res_out, ref_residual)
    assert np.array_equal(out, ref_out), np.mean(out != ref_out)


def test_gemv_tuning_file(tmp_path, monkeypatch):
    """A tuning file (what benchmarks/bench_decode_stream.py --tuning-out writes) overrides the geometry picker."""
    import json
    path = tmp_path / "tuning.json"
    geo = dict(rows_per_warp=2, warps=8, k_split=2, max_tokens=1, k_chunk=None, stage_x=True, stages=6,
               persistent=True)
    monkeypatch.setattr(lin, "GEMV_TUNED", dict(lin.GEMV_TUNED))
    monkeypatch.setattr(lin, "SIMULATOR", False)      # the simulator's picker ignores the table
    monkeypatch.setattr(lin, "_sm_count", lambda: 132)
    skinny = dict(n_tiles=4, unroll=2, warps=8, k_split=4, warps_per_sm=8, stages=2)
    path.write_text(json.dumps([dict(n_cols=777, k=512, max_tokens=1, gated=False, geometry=geo),
                                dict(n_cols=777, k=512, m_tiles=1, gated=True, geometry=skinny)]))
    monkeypatch.setattr(lin, "SKINNY_TUNED", dict(lin.SKINNY_TUNED))
    assert lin.load_gemv_tuning(str(path)) == 2
    assert lin.gemv_geometry(777, 512, 1) == GemvGeometry(**geo)
    assert lin.skinny_geometry(777, 512, 16, gated=True) == lin.SkinnyGeometry(**skinny)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("form", ["qwen3", "qwen35"])
def test_linear_add_rms_norm_residual_ready_is_bit_identical(gated, form, rng, monkeypatch):
    """``residual_ready``: the one-token prologue reads the residual before its PDL wait (at L2); the same bits as
    reading it after, with ``RESIDUAL_EARLY`` on and off."""
    H, n_cols = 72, 40
    rb, _ = bf16_randn((1, H), rng)
    db, _ = bf16_randn((1, H), rng)
    wnb, _ = bf16_randn((H,), rng, scale=0.2)
    wb, _ = bf16_randn((n_cols, H), rng, scale=0.2)
    late = _fused(rb, db, wnb, wb, gated, form, 1e-6)
    early = _fused(rb, db, wnb, wb, gated, form, 1e-6, residual_ready=True)
    monkeypatch.setattr(lin, "RESIDUAL_EARLY", False)
    ignored = _fused(rb, db, wnb, wb, gated, form, 1e-6, residual_ready=True)
    for a, b, c in zip(late, early, ignored):
        assert np.array_equal(a, b) and np.array_equal(a, c)


def test_linear_preloaded_around_busy_sms(rng, monkeypatch):
    """``PRELOAD_AROUND_BUSY_SMS``: the matrix spread over all SMs but ``busy_sms`` (more rows a block, fewer
    blocks), the same bits; off, ``busy_sms`` changes nothing; a count that leaves no SM falls back to all SMs.
    (Three rows per SM: one busy SM makes it four, on the simulator's 4 SMs and on a GPU's hundred-odd.)"""
    N, K = 3 * lin._sm_count(), KP
    assert lin.preload_rows(N, K, 1) > lin.preload_rows(N, K) and lin.preload_rows(N, K, lin._sm_count()) == 0
    xb, x = bf16_randn((1, K), rng)
    wb, w = bf16_randn((N, K), rng, scale=0.1)
    monkeypatch.setattr(lin, "PRELOAD_AROUND_BUSY_SMS", False)
    base = run(lin.linear_preloaded, xb, wb, N)
    assert np.array_equal(run(lin.linear_preloaded, xb, wb, N, busy_sms=1), base)
    monkeypatch.setattr(lin, "PRELOAD_AROUND_BUSY_SMS", True)
    for busy in (1, 2, lin._sm_count()):
        assert np.array_equal(run(lin.linear_preloaded, xb, wb, N, busy_sms=busy), base)


@pytest.mark.parametrize("K", [2040, 2400])
def test_gemv_x_staged_at_once_or_in_a_loop(K, rng, monkeypatch):
    """The plain one-token GEMV stages x with all of a thread's loads at once (``X_SLICES_AT_ONCE``) or, with more
    slices a thread than that, in a loop: the same bits either way (one warp: K = 2040 is 8 slices a thread, the
    last partial; K = 2400 is 10, past the default 8, so the loop)."""
    geo = GemvGeometry(rows_per_warp=2, warps=1, k_split=1, max_tokens=1, stages=3, persistent=True)
    xb, x = bf16_randn((1, K), rng)
    wb, w = bf16_randn((6, K), rng, scale=0.05)
    got = run(gemv, xb, wb, 6, geometry=geo)
    assert rel_l2(got, x @ w.T) < 1e-2
    for at_once in (0, 16):
        monkeypatch.setattr(lin, "X_SLICES_AT_ONCE", at_once)
        assert np.array_equal(run(gemv, xb, wb, 6, geometry=geo), got)
