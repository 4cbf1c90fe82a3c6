"""The primitives the prefill attention kernel adds: ``ldmatrix_x4_trans`` hands every lane the documented
(transposed) words, and its fragments of a row-major V tile feed ``mma_bf16_m16n8k16`` as ``P · V``;
``exp2_approx`` is 2^x, 0 at -inf; ``warp_any`` gives every lane of a warp whether any lane's predicate holds.
In the simulator this checks the twins against the layout; on a GPU, the instructions."""
import math

import numpy as np
from numba import cuda
from numba import types as nbtypes

from tests.util import bf16_randn

from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import cuda as kcuda
from pegainfer.kernels.primitives import (exp2_approx, float32, kernel, ldmatrix_x4, ldmatrix_x4_trans,
                                          mma_bf16_m16n8k16, uint32, warp_any)


@kernel
def ldmatrix_trans_words(src, rows, out):
    """One warp: the 32 × 4 words of ``src`` (uint32) into shared memory; lane l loads from row address ``rows[l]``
    with the transposing load; ``out[l, j]`` = its register j."""
    smem = kcuda.shared.array(128, nbtypes.uint32)
    lane = kcuda.threadIdx.x
    for q in range(4):
        smem[lane * 4 + q] = src[lane * 4 + q]
    kcuda.syncthreads()
    r0, r1, r2, r3 = ldmatrix_x4_trans(smem, rows[lane])
    out[lane, 0] = r0
    out[lane, 1] = r1
    out[lane, 2] = r2
    out[lane, 3] = r3


def test_ldmatrix_x4_trans_gives_each_lane_a_column_pair(rng):
    """Lane (g, t) gets, in register j, bf16 g of the rows whose addresses lanes 8j + 2t (low half) and 8j + 2t + 1
    (high half) gave."""
    src = rng.integers(0, 1 << 32, 128, dtype=np.uint64).astype(np.uint32)
    rows = rng.permutation(32).astype(np.int64) * 4
    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    launch(ldmatrix_trans_words, 1, 32, cuda.to_device(src), cuda.to_device(rows), out)
    got = out.copy_to_host()
    halves = src.view(np.uint16)                       # bf16 k of the row at word w: halves[2w + k]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(4):
            lo = halves[2 * rows[8 * j + 2 * t] + g]
            hi = halves[2 * rows[8 * j + 2 * t + 1] + g]
            assert got[lane, j] == np.uint32(lo) | (np.uint32(hi) << 16), (lane, j)


@kernel
def p_times_v(p32, v32, out):
    """One warp: P ``[16, 16]`` (A, row-major) and V ``[16 keys, 16 dims]`` (row-major, one key per row) in shared
    memory; A by ``ldmatrix_x4`` (rows l % 16 at chunk l / 16), B of both 8-dim tiles by one ``ldmatrix_x4_trans``
    (keys l % 16 at chunk l / 16: b0, b1 of dims 0-7, then of dims 8-15); ``out[16, 16]`` = P V in f32."""
    smem = kcuda.shared.array(256, nbtypes.uint32)
    lane = kcuda.threadIdx.x
    for q in range(4):
        smem[lane * 4 + q] = p32[lane * 4 + q]
        smem[128 + lane * 4 + q] = v32[lane * 4 + q]
    kcuda.syncthreads()
    a0, a1, a2, a3 = ldmatrix_x4(smem, uint32((lane & 15) * 8 + 4 * (lane >> 4)))
    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, uint32(128 + (lane & 15) * 8 + 4 * (lane >> 4)))
    z = float32(0.0)
    g, t = lane >> 2, lane & 3
    for n, (x, y) in enumerate(((b0, b1), (b2, b3))):
        d0, d1, d2, d3 = mma_bf16_m16n8k16(a0, a1, a2, a3, x, y, z, z, z, z)
        out[g, 8 * n + 2 * t] = d0
        out[g, 8 * n + 2 * t + 1] = d1
        out[g + 8, 8 * n + 2 * t] = d2
        out[g + 8, 8 * n + 2 * t + 1] = d3


def test_trans_fragments_of_row_major_v_feed_the_mma(rng):
    pb, p = bf16_randn((16, 16), rng)
    vb, v = bf16_randn((16, 16), rng)
    out = cuda.to_device(np.zeros((16, 16), np.float32))
    launch(p_times_v, 1, 32, cuda.to_device(pb.reshape(-1).view(np.uint32)),
           cuda.to_device(vb.reshape(-1).view(np.uint32)), out)
    np.testing.assert_allclose(out.copy_to_host(), p @ v, rtol=1e-5, atol=1e-5)


@kernel
def exp2_all(x, out):
    i = kcuda.grid(1)
    if i < x.shape[0]:
        out[i] = exp2_approx(x[i])


def test_exp2_approx():
    """2^x within 2^-21 relative over the range softmax uses (scores minus their max: <= 0), exactly 1 at 0 and 0
    at -inf (a masked score)."""
    x = np.concatenate([-np.geomspace(1e-6, 120, 200), [0.0, -math.inf, 3.5]]).astype(np.float32)
    out = cuda.to_device(np.zeros_like(x))
    launch(exp2_all, 1, 256, cuda.to_device(x), out)
    got = out.copy_to_host()
    want = np.exp2(x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=2.0 ** -21, atol=0)
    assert got[200] == 1.0 and got[201] == 0.0


@kernel
def any_per_warp(pred, out):
    t = kcuda.threadIdx.x
    out[t] = 1 if warp_any(pred[t] != 0) else 0


def test_warp_any():
    """Three warps: none set, one lane set (the last), every lane set: each lane gets its own warp's answer."""
    pred = np.zeros(96, np.int32)
    pred[63] = 1
    pred[64:] = 1
    out = cuda.to_device(np.full(96, -1, np.int32))
    launch(any_per_warp, 1, 96, cuda.to_device(pred), out)
    assert np.array_equal(out.copy_to_host(), np.repeat([0, 1, 1], 32))
