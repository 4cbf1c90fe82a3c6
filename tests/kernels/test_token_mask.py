"""The grammar-mask kernel against NumPy (simulator): flagged rows masked exactly by their packed bitmask (a
vocabulary that is not a multiple of 32, tokens past the bitmask), unflagged rows untouched; the LM head's greedy
row 0 re-picked from the masked row; the sampler afterwards draws only allowed tokens."""
import numpy as np
import pytest

import pegainfer  # noqa: F401  (before numba)
from numba import cuda

from pegainfer.kernels import sampling
from pegainfer.kernels.primitives import from_bf16_bits, to_bf16_bits
from pegainfer.kernels.token_mask import (NEG_INF_BF16, PenaltyInputs, allocate_bitmask, apply_token_mask,
                                          mask_words, reference_token_mask, token_mask_kernel)

V = 70   # not a multiple of 32: the last word is partial


def pack(allowed: np.ndarray) -> np.ndarray:
    """Bool ``[B, V]`` → the int32 bitmask ``[B, mask_words(V)]`` (llguidance's layout)."""
    B, vocab = allowed.shape
    bits = np.zeros((B, mask_words(vocab) * 32), np.uint8)
    bits[:, :vocab] = allowed
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def random_case(B, seed, density=0.2):
    rng = np.random.default_rng(seed)
    logits = to_bf16_bits(rng.standard_normal((B, V)).astype(np.float32) * 3)
    allowed = rng.random((B, V)) < density
    allowed[:, rng.integers(0, V, B)] = True          # at least one allowed token per row
    return logits, allowed


def test_pack_matches_llguidance_layout():
    from llguidance.numpy import allocate_token_bitmask
    allowed = np.zeros((1, V), bool)
    allowed[0, [0, 31, 32, 69]] = True
    words = pack(allowed)
    assert words.shape == allocate_token_bitmask(1, V).shape and words.dtype == np.int32
    assert [int(w) & 0xFFFFFFFF for w in words[0]] == [1 | 1 << 31, 1, 1 << 5]


@pytest.mark.parametrize("flags", [[1, 0, 1], [0, 0, 0], [1, 1, 1]])
def test_flagged_rows_masked_like_numpy(flags):
    logits, allowed = random_case(3, seed=sum(flags))
    bitmask = pack(allowed)
    flags = np.array(flags, np.int32)
    d_logits = cuda.to_device(logits)
    temperature = cuda.to_device(np.ones(3, np.float32))
    apply_token_mask(d_logits, cuda.to_device(bitmask), cuda.to_device(flags), temperature)
    got = d_logits.copy_to_host()
    np.testing.assert_array_equal(got, reference_token_mask(logits, bitmask, flags))
    for r in range(3):
        if flags[r]:
            assert (got[r, ~allowed[r]] == NEG_INF_BF16).all() and (got[r, allowed[r]] == logits[r, allowed[r]]).all()
        else:
            assert (got[r] == logits[r]).all()


def test_tokens_past_the_bitmask_are_disallowed():
    """A bitmask one word short of the vocabulary (tokens 64.. not covered; ``apply_token_mask`` itself only takes
    full-width masks): the kernel masks them, as the NumPy reference does."""
    logits = to_bf16_bits(np.ones((1, V), np.float32))
    bitmask = np.full((1, mask_words(V) - 1), -1, np.int32)
    want = reference_token_mask(logits, bitmask, np.ones(1, np.int32))
    assert (want[0, :64] == logits[0, :64]).all() and (want[0, 64:] == NEG_INF_BF16).all()
    d_logits, flags, temperature = cuda.to_device(logits), cuda.to_device(np.ones(1, np.int32)), \
        cuda.to_device(np.ones(1, np.float32))
    pen = PenaltyInputs.unused()
    st = pen.state
    token_mask_kernel[1, 32](d_logits, cuda.to_device(bitmask), flags, np.int32(1), temperature, np.int32(0), flags,
                             temperature, flags, st.counts, st.seen, st.counted, st.params, st.bias_tokens,
                             st.bias_values, st.n_bias, pen.step, pen.ids, pen.logit_rows, pen.token_slots)
    np.testing.assert_array_equal(d_logits.copy_to_host(), want)


def test_head_greedy_row_repicked_from_the_masked_row():
    logits, allowed = random_case(1, seed=7)
    row = from_bf16_bits(logits[0])
    allowed[0, int(np.argmax(row))] = False                       # the unmasked argmax is not allowed
    logits[0, np.flatnonzero(allowed[0])[:2]] = to_bf16_bits(np.float32([9.0]))[0]   # a tie: the first index wins
    workspace = sampling.allocate_sample_workspace(1, V)
    out_ids = cuda.to_device(np.full(4, -1, np.int32))
    head = sampling.HeadArgmax(out_ids, workspace)
    for temp, expect_fixed in ((0.0, True), (0.8, False)):
        out_ids.copy_to_device(np.full(4, -1, np.int32))
        d_logits = cuda.to_device(logits)
        apply_token_mask(d_logits, cuda.to_device(pack(allowed)), cuda.to_device(np.ones(1, np.int32)),
                         cuda.to_device(np.float32([temp])), head=head)
        masked = d_logits.copy_to_host()
        np.testing.assert_array_equal(masked, reference_token_mask(logits, pack(allowed), [1]))
        token = int(out_ids.copy_to_host()[0])
        if expect_fixed:
            want = int(np.flatnonzero(allowed[0])[0])
            threshold, kept = sampling.workspace_views(workspace)
            assert token == want and float(threshold.copy_to_host()[0]) == 9.0 and int(kept.copy_to_host()[0]) == 1
        else:
            assert token == -1                                      # a sampled row is the sampler's


def test_sampler_after_the_mask_draws_allowed_tokens_only():
    B = 3
    logits, allowed = random_case(B, seed=3, density=0.1)
    storage = (np.zeros(sampling.SamplingBuffers.nbytes(B), np.uint8),
               cuda.to_device(np.zeros(sampling.SamplingBuffers.nbytes(B), np.uint8)))
    params = sampling.SamplingBuffers(B, storage=storage)
    workspace = sampling.allocate_sample_workspace(B, V)
    out_ids = cuda.to_device(np.zeros(B, np.int32))
    bitmask = cuda.to_device(pack(allowed))
    for step in range(3):
        for r, (temp, top_k) in enumerate([(0.0, 0), (1.0, 0), (0.7, 5)]):
            params.set_row(r, temp, top_k, 1.0, 0.0, seed=11 + r, step=step)
        params.upload(0)
        d_logits = cuda.to_device(logits)
        apply_token_mask(d_logits, bitmask, cuda.to_device(np.ones(B, np.int32)), params.temperature)
        sampling.sample(d_logits, params, out_ids, workspace)
        ids = out_ids.copy_to_host()
        assert all(allowed[r, ids[r]] for r in range(B)), (ids, step)
    masked_row0 = np.where(allowed[0], from_bf16_bits(logits[0]), -np.inf)
    assert ids[0] == int(np.argmax(masked_row0))


def test_allocate_bitmask_shape():
    b = allocate_bitmask(4, 151936)
    assert b.shape == (4, 4748) and b.dtype == np.int32
