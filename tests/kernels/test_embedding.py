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
