"""The tensor-core primitives (``primitives.mma``): ``ldmatrix_x4`` hands every lane the words of the documented
layout, and its fragments fed to ``mma_bf16_m16n8k16`` give the product NumPy gives.  In the simulator this checks
the twins against the layout; on a GPU, the instructions."""
import numpy as np
from numba import cuda
from numba import types as nbtypes

from tests.util import bf16_randn

from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import cuda as kcuda
from pegainfer.kernels.primitives import float32, kernel, ldmatrix_x4, mma_bf16_m16n8k16, uint32


@kernel
def ldmatrix_words(src, rows, out):
    """One warp: the 32 × 4 words of ``src`` (uint32) into shared memory; lane l loads from row address
    ``rows[l]``; ``out[l, j]`` = its register j."""
    smem = kcuda.shared.array(128, nbtypes.uint32)
    lane = kcuda.threadIdx.x
    for q in range(4):
        smem[lane * 4 + q] = src[lane * 4 + q]
    kcuda.syncthreads()
    r0, r1, r2, r3 = ldmatrix_x4(smem, rows[lane])
    out[lane, 0] = r0
    out[lane, 1] = r1
    out[lane, 2] = r2
    out[lane, 3] = r3


@kernel
def ldmatrix_mma(a32, b32, out):
    """One warp: A ``[16, 16]`` and B^T ``[8, 16]`` (bf16 rows of 8 words) in shared memory, fragments by
    ``ldmatrix_x4`` (A: rows l % 16 at chunk l / 16; B: rows l % 8 at chunk l / 8, the first two matrices), one
    mma; ``out[16, 8]`` f32."""
    smem = kcuda.shared.array(192, nbtypes.uint32)
    lane = kcuda.threadIdx.x
    for q in range(4):
        smem[lane * 4 + q] = a32[lane * 4 + q]
    for q in range(2):
        smem[128 + lane * 2 + q] = b32[lane * 2 + q]
    kcuda.syncthreads()
    a0, a1, a2, a3 = ldmatrix_x4(smem, uint32((lane & 15) * 8 + 4 * (lane >> 4)))
    b0, b1, _, _ = ldmatrix_x4(smem, uint32(128 + (lane & 7) * 8 + 4 * ((lane >> 3) & 1)))
    z = float32(0.0)
    d0, d1, d2, d3 = mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, z, z, z, z)
    g, t = lane >> 2, lane & 3
    out[g, 2 * t] = d0
    out[g, 2 * t + 1] = d1
    out[g + 8, 2 * t] = d2
    out[g + 8, 2 * t + 1] = d3


def test_ldmatrix_x4_gives_each_lane_its_rows_words(rng):
    """Lane l gets, in register j, word l % 4 of the row whose address lane 8j + l / 4 gave."""
    src = np.arange(128, dtype=np.uint32) * 7 + 3
    rows = rng.permutation(32).astype(np.int64) * 4            # each lane names some 16-byte row
    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    launch(ldmatrix_words, 1, 32, cuda.to_device(src), cuda.to_device(rows), out)
    got = out.copy_to_host()
    lanes = np.arange(32)
    for j in range(4):
        assert np.array_equal(got[:, j], src[rows[8 * j + lanes // 4] + lanes % 4]), j


def test_ldmatrix_fragments_feed_the_mma(rng):
    ab, a = bf16_randn((16, 16), rng)
    bb, b = bf16_randn((8, 16), rng)            # B^T: the weight rows
    out = cuda.to_device(np.zeros((16, 8), np.float32))
    launch(ldmatrix_mma, 1, 32, cuda.to_device(ab.reshape(-1).view(np.uint32)),
           cuda.to_device(bb.reshape(-1).view(np.uint32)), out)
    np.testing.assert_allclose(out.copy_to_host(), a @ b.T, rtol=1e-5, atol=1e-5)
