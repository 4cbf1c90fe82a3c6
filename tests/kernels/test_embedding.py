"""Embedding gather: the tuned gather against the reference kernel (bit for bit), the reference against NumPy."""
import numpy as np

from tests.util import bf16_randn, launches_during  # (tests.util imports pegainfer before numba)
from numba import cuda

from pegainfer.kernels.embedding import embedding, reference_embedding
from pegainfer.kernels.embedding.gather import _embedding_rows_kernel, embedding_kernel


def numpy_gather(table, ids):
    """``table[ids]`` with zero rows for ids outside ``[0, vocab)``."""
    rows = [table[t] if 0 <= t < table.shape[0] else np.zeros(table.shape[1], table.dtype) for t in ids]
    return np.stack(rows)


def gathered(fn, table, ids):
    out = cuda.to_device(np.full((len(ids), table.shape[1]), 0xBEEF, dtype=np.uint16))
    fn(cuda.to_device(np.asarray(ids, np.int32)), cuda.to_device(table), out)
    return out.copy_to_host()


def assert_gathers(rng, vocab, hidden, ids):
    """Gather ``ids`` from a random ``[vocab, hidden]`` table with both kernels: every row an exact copy of the
    table's, zeros for bad ids."""
    table, _ = bf16_randn((vocab, hidden), rng)
    expected = numpy_gather(table, ids)
    np.testing.assert_array_equal(gathered(reference_embedding, table, ids), expected, err_msg=f"reference, {hidden}")
    np.testing.assert_array_equal(gathered(embedding, table, ids), expected, err_msg=f"tuned, hidden {hidden}")


def test_embedding_gathers_rows_and_zeroes_bad_ids(rng):
    assert_gathers(rng, 50, 72, [3, 0, 49, -1, 50, 7, 3, 1 << 30])


def test_embedding_rows_not_sixteen_bytes_use_the_scalar_gather(rng):
    """A hidden size that is not a multiple of 8 (rows not 16-byte aligned) takes the one-bf16-at-a-time kernel;
    a row longer than one round of the block's 16-byte loads takes several rounds.  Both are exact copies."""
    assert_gathers(rng, 20, 70, [5, 19, -3, 0])
    assert_gathers(rng, 12, 8 * 32 * 3 + 16, [5, 11, -3, 0])   # 3 rounds + a partial one in the simulator
    for hidden, kernel in ((70, embedding_kernel), (8 * 32 * 3 + 16, _embedding_rows_kernel(4))):
        table, _ = bf16_randn((4, hidden), rng)
        assert [k for k, _ in launches_during(lambda: gathered(embedding, table, [1]))] == [kernel], hidden
