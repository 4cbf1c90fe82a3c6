"""The LM head (Qwen3-4B: 151,936 × 2560) on every linear path, on a GPU, held per token row and per block of 4096
output columns of each row against float64 NumPy, so one bad tile or column block cannot hide in a mean over
151,936 columns.  Skipped without a GPU."""
import numpy as np
import pytest

from tests.kernels.test_linear_gpu import GEMM_IMPLS, IMPLS, QWEN3_4B, _run
from tests.util import bf16_randn, bf16_round, from_bf16_bits, rel_l2

pytestmark = pytest.mark.gpu

COLUMN_BLOCK = 4096
ROUNDING_MARGIN = 1.5


def _rounding_floor(expected):
    """Relative L2 of rounding the exact outputs to bf16 once, per row ``[T]`` and per (row, column block)
    ``[T, blocks]``: what an exact f32-accumulating kernel that rounds its output once sits at."""
    diff, ref = bf16_round(expected) - expected, expected
    T, N = expected.shape
    blocks = -(-N // COLUMN_BLOCK)
    per_block = np.empty((T, blocks))
    for b in range(blocks):
        cols = slice(b * COLUMN_BLOCK, (b + 1) * COLUMN_BLOCK)
        per_block[:, b] = np.linalg.norm(diff[:, cols], axis=1) / np.linalg.norm(ref[:, cols], axis=1)
    return np.linalg.norm(diff, axis=1) / np.linalg.norm(ref, axis=1), per_block


def test_lm_head_every_path_per_row_and_column_block():
    """Catches a wrong tile, column block or row of the LM head on any path (GEMV, skinny, FMA, mma, wgmma, split-K)
    at decode, small-batch and prompt sizes: each row, and each 4096-column block of each row, must be within 1.5x
    of one bf16 rounding of the exact result (a kernel that sums in f32 and rounds once sits at ~1.0x; one column
    of garbage in a block is ~10x)."""
    from numba import cuda

    rng = np.random.default_rng(13)
    N, K = QWEN3_4B["lm_head"]
    wb, w = bf16_randn((N, K), rng, scale=K ** -0.5)
    w_dev = cuda.to_device(wb)
    worst = {}
    failures = []
    for T in (1, 8, 16, 40, 130, 256):
        xb, x = bf16_randn((T, K), rng)
        expected = x @ w.T
        row_floor, block_floor = _rounding_floor(expected)
        x_dev = cuda.to_device(xb)
        # the GEMV up to the 130 tokens its own tests cover; the GEMMs also at a 256-token prompt step
        for impl in IMPLS if T <= 16 else GEMM_IMPLS if T <= 130 else [i for i in GEMM_IMPLS if i != "gemv"]:
            got = from_bf16_bits(_run(x_dev, w_dev, T, N, False, impl)).astype(np.float64)
            row_ratio = np.array([rel_l2(got[t], expected[t]) for t in range(T)]) / row_floor
            blocks = block_floor.shape[1]
            block_ratio = np.empty_like(block_floor)
            for b in range(blocks):
                cols = slice(b * COLUMN_BLOCK, (b + 1) * COLUMN_BLOCK)
                block_ratio[:, b] = (np.linalg.norm(got[:, cols] - expected[:, cols], axis=1)
                                     / np.linalg.norm(expected[:, cols], axis=1)) / block_floor[:, b]
            worst[(impl, T)] = (round(float(row_ratio.max()), 3), round(float(block_ratio.max()), 3))
            bad_rows = np.flatnonzero(~(row_ratio <= ROUNDING_MARGIN))
            bad_blocks = np.argwhere(~(block_ratio <= ROUNDING_MARGIN))
            if len(bad_rows) or len(bad_blocks):
                failures.append((impl, T, "rows", bad_rows[:4].tolist(), "(row, block)", bad_blocks[:4].tolist(),
                                 "worst ratio", float(block_ratio.max())))
    print("LM head, (impl, T): (max row error, max block error) / one bf16 rounding:", worst)
    assert not failures, failures
