"""The penalties and logit bias inside the mask launch against the NumPy reference (simulator): a slot set up from a
prompt and an output, then steps that each count the row's newest output token -- with the row split over several
blocks as on the GPU, a repeated launch that must not count it again, a prompt chunk's row that counts nothing; a
grammar mask on the same row after the penalties; the LM head's greedy row 0 re-picked from the penalized row.
(The simulator runs a row's blocks one after another, so that only the block owning the newest token counts it --
what keeps two blocks from racing on the GPU -- does not show here.)"""
import numpy as np
import pytest

import pegainfer  # noqa: F401  (before numba)
from numba import cuda

from pegainfer.kernels import sampling
from pegainfer.kernels.penalties import (MAX_COUNT, PenaltyState, initialize_slot, reference_penalties,
                                         slot_tokens)
from pegainfer.kernels.primitives import from_bf16_bits, to_bf16_bits
from pegainfer.kernels.token_mask import (MASKED, NEG_INF_BF16, PENALIZED, PenaltyInputs, allocate_bitmask,
                                          apply_token_mask, mask_words, token_mask_kernel)

V = 70   # not a multiple of 32: the slot's last seen word is partial
PROMPT = [1, 2, 3, 5, 69, 2]
PARAMS = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={10: 5.0, 64: -3.0})


def logits_rows(B, seed):
    return to_bf16_bits(np.random.default_rng(seed).standard_normal((B, V)).astype(np.float32) * 3)


class Step:
    """Device inputs of a step whose row ``r`` is token ``r`` of slot ``slots[r]`` with input id ``ids[r]`` and
    ``outputs[r]`` output tokens so far (the sampler's step counter)."""

    def __init__(self, state, slots, ids, outputs):
        B = len(slots)
        self.pen = PenaltyInputs(state, cuda.to_device(np.int32(outputs)), cuda.to_device(np.int32(ids)),
                                 cuda.to_device(np.arange(B, dtype=np.int32)), cuda.to_device(np.int32(slots)))

    def run(self, logits, flags, parts, bitmask=None):
        """Launch the mask kernel over ``logits`` (host bits) with ``parts`` blocks a row; the result on the host."""
        B = logits.shape[0]
        d = cuda.to_device(logits)
        st, p = self.pen.state, self.pen
        bitmask = cuda.to_device(bitmask if bitmask is not None else np.zeros((B, mask_words(V)), np.int32))
        flags = cuda.to_device(np.int32(flags))
        temperature = cuda.to_device(np.ones(B, np.float32))
        token_mask_kernel[B * parts, 32](d, bitmask, flags, np.int32(parts), temperature, np.int32(0), flags,
                                         temperature, flags, st.counts, st.seen, st.counted, st.params,
                                         st.bias_tokens, st.bias_values, st.n_bias, p.step, p.ids, p.logit_rows,
                                         p.token_slots)
        return d.copy_to_host()


def test_slot_tokens_counts_the_output_and_adds_the_prompt_only_with_a_repetition_penalty():
    assert [a.tolist() for a in slot_tokens([4, 2, 4], [2, 9, 2], 1.0)] == [[2, 9], [2, 1]]
    assert [a.tolist() for a in slot_tokens([4, 2, 4], [2, 9, 2], 1.1)] == [[2, 4, 9], [2, 0, 1]]
    assert slot_tokens([1], [7] * (MAX_COUNT + 3), 1.0)[1].tolist() == [MAX_COUNT]


@pytest.mark.parametrize("parts", [1, 3])
def test_steps_count_the_newest_token_once_and_match_the_reference(parts):
    """Catches a newest token counted again on a second launch of the same step, a block that penalizes past its
    range or misses part of it, a row penalized with another slot's state: three decode steps of two penalized
    sequences (slots 2 and 0) beside a padding row, each equal to the reference."""
    state = PenaltyState(4, V)
    out = {2: [5, 5, 7], 0: [68]}
    initialize_slot(state, 2, PROMPT, out[2], **PARAMS)
    initialize_slot(state, 0, [9, 9, 11], out[0], 1.0, 1.0, 0.0, {})
    for k, (new2, new0) in enumerate([(40, 68), (5, 3), (40, 40)]):
        out[2].append(new2)
        out[0].append(new0)
        step = Step(state, [2, -1, 0], [new2, 0, new0], [len(out[2]), 0, len(out[0])])
        logits = logits_rows(3, seed=k)
        for repeat in range(2):                      # the second launch finds the token counted
            got = step.run(logits, [PENALIZED, PENALIZED, PENALIZED], parts)
            np.testing.assert_array_equal(got[0], reference_penalties(logits[0], PROMPT, out[2], **PARAMS))
            np.testing.assert_array_equal(got[1], logits[1])          # padding row: slot -1
            np.testing.assert_array_equal(got[2], reference_penalties(logits[2], [9, 9, 11], out[0], 1.0, 1.0))
        assert (got[0] != logits[0]).sum() >= 8
    counts = state.counts.copy_to_host()
    assert counts[2, 40] == 2 and counts[2, 5] == 3 and counts[0, 68] == 2 and counts[0, 40] == 1
    assert state.counted.copy_to_host()[[0, 2]].tolist() == [4, 6]


def test_a_prompt_chunk_row_counts_nothing():
    """Catches a prompt token counted as output: a row whose step counter is the slot's count (a prefill's last
    chunk) leaves the counts alone and applies the penalties of the output so far."""
    state = PenaltyState(1, V)
    initialize_slot(state, 0, PROMPT, [], **PARAMS)
    logits = logits_rows(1, seed=5)
    got = Step(state, [0], [PROMPT[-1]], [0]).run(logits, [PENALIZED], 2)
    np.testing.assert_array_equal(got[0], reference_penalties(logits[0], PROMPT, [], **PARAMS))
    assert state.counts.copy_to_host().sum() == 0


def test_grammar_mask_after_the_penalties():
    """Catches a bias or penalty writing over a masked token: the row is penalized, then its disallowed tokens are
    -inf (a biased token among them)."""
    state = PenaltyState(1, V)
    initialize_slot(state, 0, PROMPT, [7], **PARAMS)
    logits = logits_rows(1, seed=8)
    allowed = np.random.default_rng(8).random(V) < 0.5
    allowed[10] = False                                                # biased by +5, yet disallowed
    bits = np.zeros(mask_words(V) * 32, np.uint8)
    bits[:V] = allowed
    bitmask = np.packbits(bits, bitorder="little").view(np.int32)[None]
    got = Step(state, [0], [7], [1]).run(logits, [PENALIZED | MASKED], 3, bitmask)[0]
    want = reference_penalties(logits[0], PROMPT, [7], **PARAMS)
    want[~allowed] = NEG_INF_BF16
    np.testing.assert_array_equal(got, want)


def test_head_greedy_row_repicked_from_the_penalized_row():
    """Catches the LM head's token of the raw logits kept: a bias makes another token the largest, and the
    kernel writes that token as the greedy pick of row 0."""
    state = PenaltyState(1, V)
    logits = logits_rows(1, seed=9)
    raw_best = int(np.argmax(from_bf16_bits(logits[0])))
    target = (raw_best + 1) % V
    initialize_slot(state, 0, [1], [], 1.0, 0.0, 0.0, {target: 100.0})
    workspace = sampling.allocate_sample_workspace(1, V)
    out_ids = cuda.to_device(np.full(1, -1, np.int32))
    head = sampling.HeadArgmax(out_ids, workspace)
    step = Step(state, [0], [1], [0])
    d = cuda.to_device(logits)
    apply_token_mask(d, allocate_bitmask(1, V), cuda.to_device(np.int32([PENALIZED])),
                     cuda.to_device(np.float32([0.0])), head=head, penalties=step.pen)
    assert int(out_ids.copy_to_host()[0]) == target != raw_best
    want = reference_penalties(logits[0], [1], [], logit_bias={target: 100.0})
    np.testing.assert_array_equal(d.copy_to_host()[0], want)
