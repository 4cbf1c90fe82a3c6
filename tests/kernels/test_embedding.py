"""Embedding gather: exact row copies, zeros for out-of-range ids."""
import numpy as np

from tests.util import bf16_randn  # (tests.util imports pegainfer before numba)
from numba import cuda

from pegainfer.kernels.embedding import embedding


def assert_gathers(rng, vocab, hidden, ids):
    """Gather ``ids`` from a random ``[vocab, hidden]`` table: every row an exact copy, zeros for bad ids."""
    table, _ = bf16_randn((vocab, hidden), rng)
    ids = np.asarray(ids, dtype=np.int32)
    out = cuda.to_device(np.full((len(ids), hidden), 0xBEEF, dtype=np.uint16))
    embedding(cuda.to_device(ids), cuda.to_device(table), out)
    got = out.copy_to_host()
    for t, token in enumerate(ids):
        expected = table[token] if 0 <= token < vocab else np.zeros(hidden, np.uint16)
        np.testing.assert_array_equal(got[t], expected, err_msg=f"hidden {hidden}, token {t} (id {token})")


def test_embedding_gathers_rows_and_zeroes_bad_ids(rng):
    assert_gathers(rng, 50, 72, [3, 0, 49, -1, 50, 7, 3, 1 << 30])


def test_embedding_rows_not_sixteen_bytes_use_the_scalar_gather(rng):
    """A hidden size that is not a multiple of 8 (rows not 16-byte aligned) takes the one-bf16-at-a-time kernel;
    a row longer than one round of the block's 16-byte loads takes several rounds.  Both are exact copies."""
    assert_gathers(rng, 20, 70, [5, 19, -3, 0])
    assert_gathers(rng, 12, 8 * 32 * 3 + 16, [5, 11, -3, 0])   # 3 rounds + a partial one in the simulator
