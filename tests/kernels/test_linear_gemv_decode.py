"""The one-token GEMV (``linear.gemv_decode``): plain, with the fused add + RMSNorm prologue (``linear_add_rms_norm``),
the embedding-row gather and the LM head's argmax."""
import numpy as np
import pytest

from tests.kernels.linear_util import (NORM_FORMS, assert_same_bits, exact_inputs, fused_op, reference_bits,
                                       rms_norm_reference, run_bits, separate_ops, silu_mul_reference)
from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels.linear import (NORM_THREADS, X_SLICES_AT_ONCE, GemvGeometry, fuses_add_rms_norm, gemv,
                                      linear_add_rms_norm)


@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
@pytest.mark.parametrize("geo", [
    GemvGeometry(rows_per_warp=2, warps=2, k_split=1, max_tokens=1, stages=2, persistent=True),   # 9+ tiles a block
    GemvGeometry(rows_per_warp=2, warps=4, k_split=2, max_tokens=1, stages=4),          # one block per tile, split
    GemvGeometry(rows_per_warp=4, warps=1, k_split=1, max_tokens=1, stages=3, persistent=True),
])
def test_one_token_gemv_matches_reference(geo, gated, rng):
    """The plain one-token GEMV: persistent grids over many tiles, a grid of one block per tile, K split over warps;
    K = 328 ends in a partial 32-slice group."""
    (xb, _), (wb, _) = exact_inputs(1, 38, 328, rng)
    got = run_bits(gemv, xb, wb, 19 if gated else 38, gated=gated, geometry=geo)
    assert_same_bits(got, reference_bits(xb, wb, gated))


@pytest.mark.parametrize("K", [2040, 2400])
def test_x_staged_at_once_or_in_a_loop(K, rng):
    """The plain one-token GEMV stages x with all of a thread's loads at once when a thread has at most
    ``X_SLICES_AT_ONCE`` slices, else in a loop: one warp, K = 2040 is 8 slices a thread (the last partial), at
    once; K = 2400 is 10, the loop."""
    assert -(-2040 // (8 * 32)) <= X_SLICES_AT_ONCE < -(-2400 // (8 * 32))
    geo = GemvGeometry(rows_per_warp=2, warps=1, k_split=1, max_tokens=1, stages=3, persistent=True)
    (xb, _), (wb, _) = exact_inputs(1, 6, K, rng)
    assert_same_bits(run_bits(gemv, xb, wb, 6, geometry=geo), reference_bits(xb, wb))


# ------------------------------------------------------------------------------------------------ add + RMSNorm + linear
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
    res_in, res_out, normed, out = fused_op(rb, db, wnb, wb, gated, form, eps)

    s = bf16_round(r + d)
    assert np.array_equal(from_bf16_bits(res_out), s), "residual_out must be bf16(residual + delta)"
    assert np.array_equal(res_in, rb), "residual_in must not be written"
    n = rms_norm_reference(s, wn, eps, **NORM_FORMS[form])
    expected = silu_mul_reference(n, w) if gated else n @ w.T
    got = from_bf16_bits(out).astype(np.float64)
    assert rel_l2(got, expected) < 1e-2

    ref_residual, ref_normed, ref_out = separate_ops(rb, db, wnb, wb, gated, form, eps)
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
    assert fuses_add_rms_norm(1, wb, gated) and not fuses_add_rms_norm(2, wb, gated)
    for token in (7, V, -1):
        ids = cuda.to_device(np.array([token], np.int32))
        residual_out = cuda.to_device(np.full((1, H), 0x7FC1, np.uint16))
        out = cuda.to_device(np.zeros((1, n_cols // 2 if gated else n_cols), np.uint16))
        linear_add_rms_norm(table, None, cuda.to_device(wnb), 1e-6, residual_out, cuda.to_device(wb), out,
                            gated=gated, row_ids=ids, **NORM_FORMS[form])
        looked_up = cuda.to_device(np.zeros((1, H), np.uint16))
        embedding(ids, table, looked_up)
        assert np.array_equal(looked_up.copy_to_host(), tb[token:token + 1] if 0 <= token < V else 0 * tb[:1])
        _, ref_res, _, ref_out = fused_op(looked_up.copy_to_host(), None, wnb, wb, gated, form, 1e-6)
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
        _, _, _, plain = fused_op(rb, db, wnb, wb, False, "qwen3", 1e-6)
        top = int(np.argmax(from_bf16_bits(plain[0])))
        for j in (3, top, 250):
            wb[j] = wb[top]
    out_ids = cuda.to_device(np.full(1, -5, np.int32))
    workspace = allocate_sample_workspace(1, V)
    head = HeadArgmax(out_ids, workspace)
    _, _, _, ref = fused_op(rb, db, wnb, wb, False, "qwen3", 1e-6)
    for replay in range(2):
        _, _, _, got = fused_op(rb, db, wnb, wb, False, "qwen3", 1e-6, head=head)
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
    geo = GemvGeometry(rows_per_warp=2, warps=NORM_THREADS // 32, k_split=1, max_tokens=1, stages=4)
    _, res_out, _, out = fused_op(rb, db, wnb, wb, gated, "qwen3", 1e-6, geometry=geo)
    ref_residual, _, ref_out = separate_ops(rb, db, wnb, wb, gated, "qwen3", 1e-6)
    assert np.array_equal(res_out, ref_residual)
    assert np.array_equal(out, ref_out)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("form", ["qwen3", "qwen35"])
def test_linear_add_rms_norm_residual_ready_is_bit_identical(gated, form, rng):
    """``residual_ready``: the one-token prologue reads the residual before its PDL wait (at L2); the same bits as
    reading it after."""
    H, n_cols = 72, 40
    rb, _ = bf16_randn((1, H), rng)
    db, _ = bf16_randn((1, H), rng)
    wnb, _ = bf16_randn((H,), rng, scale=0.2)
    wb, _ = bf16_randn((n_cols, H), rng, scale=0.2)
    late = fused_op(rb, db, wnb, wb, gated, form, 1e-6)
    early = fused_op(rb, db, wnb, wb, gated, form, 1e-6, residual_ready=True)
    for a, b in zip(late, early):
        assert np.array_equal(a, b)


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
                            geometry=GemvGeometry(rows_per_warp=2, warps=NORM_THREADS // 32 + 1, k_split=1,
                                                  max_tokens=1))
    with pytest.raises(ValueError, match="norm_weight"):
        linear_add_rms_norm(r[:1], None, cuda.to_device(np.zeros(H - 8, np.uint16)), 1e-6, r[1:], w, out)
    with pytest.raises(ValueError, match="head"):
        linear_add_rms_norm(r3, None, wn, 1e-6, cuda.to_device(np.zeros((3, H), np.uint16)), w, out3,
                            normed_out=cuda.to_device(np.zeros((3, H), np.uint16)), head=object())
