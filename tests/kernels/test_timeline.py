"""``timeline``: the per-block stamps of the instrumented decode kernels (what
``benchmarks/step_profile.py timeline`` reads on a GPU).  In the simulator the clock is the host's, so only the records' shape and order are checked."""
import numpy as np
import pytest

from tests.util import bf16_randn, from_bf16_bits, rel_l2
from numba import cuda

from pegainfer.kernels import linear as lin
from pegainfer.kernels import timeline
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import global_timer, kernel, threads

STAMPING = LaunchPolicy(timeline=True)


@pytest.fixture
def stamping():
    """The policy that builds the stamping kernels, with an empty buffer before and after the test."""
    timeline.reset()
    yield STAMPING
    timeline.reset()


@kernel
def _stamp_blocks(stamps, out):
    """Every block writes its index to ``out`` and appends one record (kind 1, extra 42) from thread 0."""
    t_entry = global_timer()
    out[cuda.blockIdx.x] = cuda.blockIdx.x
    t_wait = global_timer()
    if cuda.threadIdx.x == 0:
        timeline.record(stamps, 1, t_entry, t_wait, t_wait, 42)


def test_record_appends_one_ordered_record_per_block(stamping):
    """``record`` / ``records`` / ``reset`` / ``stamps_arg``: a record per block with its index, the grid, the kind
    and extra it was given, stamps in order; a policy without stamping gets the one-word placeholder."""
    blocks = 3
    out = cuda.to_device(np.zeros(blocks, np.int32))
    _stamp_blocks[blocks, 32](timeline.stamps_arg(stamping), out)
    rec = timeline.records()
    assert sorted(rec["block"].tolist()) == list(range(blocks)) and set(rec["grid"].tolist()) == {blocks}
    assert set(rec["kind"].tolist()) == {1} and set(rec["extra"].tolist()) == {42}
    assert np.all(rec["t_entry"] <= rec["t_wait"]) and np.all(rec["t_wait"] <= rec["t_end"])
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(blocks))
    timeline.reset()
    assert len(timeline.records()) == 0
    placeholder = timeline.stamps_arg(DEFAULT_POLICY)
    assert placeholder is timeline.unused() and placeholder.shape == (1,)


def _one_token_gemv(rng, policy, n_out=40, k=64):
    xb, x = bf16_randn((1, k), rng)
    wb, w = bf16_randn((n_out, k), rng, scale=0.1)
    out = cuda.to_device(np.zeros((1, n_out), np.uint16))
    lin.linear(cuda.to_device(xb), cuda.to_device(wb), out, policy=policy)
    return from_bf16_bits(out.copy_to_host()).astype(np.float64), x @ w.T


def test_gemv_blocks_append_ordered_records(stamping, rng):
    got, expected = _one_token_gemv(rng, stamping)
    assert rel_l2(got, expected) < 1e-2, "stamping must not change the result"
    rec = timeline.records()
    assert len(rec) > 0
    grid = int(rec["grid"][0])
    assert sorted(rec["block"].tolist()) == list(range(grid)), "one record per block"
    assert set(rec["kind"].tolist()) == {1} and set(rec["extra"].tolist()) == {40}
    assert np.all(rec["t_entry"] <= rec["t_wait"]) and np.all(rec["t_wait"] <= rec["t_ready"])
    assert np.all(rec["t_ready"] <= rec["t_end"])


def test_preloaded_gemv_records_its_kind(stamping, rng):
    K = 2 * threads(gpu=lin.PRELOAD_THREADS, sim=32)
    xb, x = bf16_randn((1, K), rng)
    wb, w = bf16_randn((40, K), rng, scale=0.1)
    out = cuda.to_device(np.zeros((1, 40), np.uint16))
    lin.linear_preloaded(cuda.to_device(xb), cuda.to_device(wb), out, policy=stamping)
    assert rel_l2(from_bf16_bits(out.copy_to_host()), x @ w.T) < 1e-2
    rec = timeline.records()
    assert set(rec["kind"].tolist()) == {3} and len(rec) == int(rec["grid"][0])
    assert np.all(rec["t_entry"] <= rec["t_end"])


def test_nothing_recorded_when_off(rng):
    assert not DEFAULT_POLICY.timeline
    timeline.reset()
    _one_token_gemv(rng, DEFAULT_POLICY)
    assert len(timeline.records()) == 0


def test_gated_delta_decode_step_records(stamping, rng):
    """The Gated DeltaNet decode step (kind ``gdn_step``): one record per block, ordered stamps, the same bits as
    without stamping."""
    from tests.util import to_bf16_bits
    from pegainfer.kernels.gated_delta import gated_delta_decode_step, sequence_table
    num_k_heads, num_v_heads, key_dim, value_dim, taps, num_slots = 1, 2, 16, 16, 4, 3
    conv_dim = 2 * num_k_heads * key_dim + num_v_heads * value_dim
    slots = np.array([2, 0], np.int32)
    tokens = len(slots)
    x, z = bf16_randn((tokens, conv_dim), rng)[0], bf16_randn((tokens, num_v_heads * value_dim), rng)[0]
    a, b = bf16_randn((tokens, num_v_heads), rng)[0], bf16_randn((tokens, num_v_heads), rng, scale=2.0)[0]
    conv_w = bf16_randn((conv_dim, taps), rng, scale=0.5)[0]
    norm_w = to_bf16_bits((1.0 + 0.3 * rng.standard_normal(value_dim)).astype(np.float32))
    a_log = rng.uniform(-1.0, 1.0, num_v_heads).astype(np.float32)
    dt_bias = rng.uniform(-1.0, 1.0, num_v_heads).astype(np.float32)
    ring = bf16_randn((num_slots, conv_dim, taps), rng)[0]
    state = (rng.standard_normal((num_slots, num_v_heads, key_dim, value_dim)) * 0.3).astype(np.float32)
    seq_slots = cuda.to_device(np.zeros(tokens, np.int32))
    seq_offsets = cuda.to_device(np.zeros(tokens + 1, np.int32))
    sequence_table(cuda.to_device(slots), seq_slots, seq_offsets)
    positions = cuda.to_device(np.array([5, 1], np.int32))

    def step(policy):
        d_ring, d_state = cuda.to_device(ring), cuda.to_device(state)
        out = cuda.to_device(np.zeros_like(z))
        gated_delta_decode_step(cuda.to_device(x), cuda.to_device(conv_w), d_ring, cuda.to_device(z),
                                cuda.to_device(a), cuda.to_device(b), cuda.to_device(a_log), cuda.to_device(dt_bias),
                                cuda.to_device(norm_w), 1e-6, d_state, seq_slots, seq_offsets, positions, out,
                                decode_token_slots=cuda.to_device(slots), policy=policy)
        return d_ring.copy_to_host(), d_state.copy_to_host(), out.copy_to_host()

    for got, want in zip(step(stamping), step(DEFAULT_POLICY)):
        np.testing.assert_array_equal(got, want, err_msg="stamping must not change the result")
    rec = timeline.records()
    rec = rec[rec["kind"] == 6]
    assert len(rec) == int(rec["grid"][0]) > 0, "one record per block of the decode step"
    assert sorted(rec["block"].tolist()) == list(range(len(rec)))
    assert np.all(rec["t_entry"] <= rec["t_wait"]) and np.all(rec["t_wait"] <= rec["t_ready"])
    assert np.all(rec["t_ready"] <= rec["t_end"])
