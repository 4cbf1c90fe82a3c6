"""Embedding gather: exact row copies, zeros for out-of-range ids."""
import numpy as np

from tests.util import bf16_randn  # (tests.util imports pegainfer before numba)
from numba import cuda

from pegainfer.kernels.embedding import embedding


def test_embedding_gathers_rows_and_zeroes_bad_ids(rng):
    vocab, hidden = 50, 72
    table, _ = bf16_randn((vocab, hidden), rng)
    ids = np.array([3, 0, 49, -1, 50, 7, 3, 1 << 30], dtype=np.int32)
    out = cuda.to_device(np.full((len(ids), hidden), 0xBEEF, dtype=np.uint16))
    embedding(cuda.to_device(ids), cuda.to_device(table), out)
    got = out.copy_to_host()
    for t, token in enumerate(ids):
        expected = table[token] if 0 <= token < vocab else np.zeros(hidden, np.uint16)
        np.testing.assert_array_equal(got[t], expected, err_msg=f"token {t} (id {token})")


def test_embedding_rows_not_sixteen_bytes_use_the_scalar_gather(rng):
    """A hidden size that is not a multiple of 8 (rows not 16-byte aligned) takes the one-bf16-at-a-time kernel;
    a row longer than one round of the block's 16-byte loads takes several rounds.  Both are exact copies."""
    for vocab, hidden in ((20, 70), (12, 8 * 32 * 3 + 16)):   # the second: 3 rounds + a partial one in the simulator
        table, _ = bf16_randn((vocab, hidden), rng)
        ids = np.array([5, 19 if vocab > 19 else 11, -3, 0], dtype=np.int32)
        out = cuda.to_device(np.full((len(ids), hidden), 0xBEEF, dtype=np.uint16))
        embedding(cuda.to_device(ids), cuda.to_device(table), out)
        got = out.copy_to_host()
        for t, token in enumerate(ids):
            expected = table[token] if 0 <= token < vocab else np.zeros(hidden, np.uint16)
            np.testing.assert_array_equal(got[t], expected, err_msg=f"hidden {hidden}, token {t} (id {token})")
