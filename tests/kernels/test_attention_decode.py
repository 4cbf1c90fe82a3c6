"""The split-K attention kernel (``attention/decode.py``) against the reference kernel: forced splits, the merge of
several splits by the last block (and its counters), several warps and warp pairs over the head dims, decode mode,
Qwen3.5's gate, padding, timeline stamps and the launch policy."""
import math

import numpy as np
import pytest

import pegainfer  # noqa: F401  (before numba)
from numba import cuda

from pegainfer.kernels import timeline
from pegainfer.kernels.attention import SplitGeometry, paged_attention, paged_attention_split
from pegainfer.kernels.gating import sigmoid_gate_mul
from pegainfer.kernels.policy import LaunchPolicy
from tests.kernels.test_attention import PAGE, Case, assert_attention, assert_near_reference, make_cache
from tests.util import bf16_randn


@pytest.mark.parametrize("head_dim,num_splits", [(16, 3), (32, 4)])
def test_split_k_forced(rng, head_dim, num_splits):
    """Split-K with several one-page splits: lengths 10 (3 active splits, the last one partial) and 1 (one active
    split, the others empty)."""
    case = Case(rng, 4, 2, head_dim, slots=[1, 0], positions=[9, 0])
    assert_attention(case, case.run(num_splits=num_splits, min_split_tokens=PAGE, method="split"))


DECODE_CASE = dict(slots=[1, 0, 2], positions=[9, 0, 16], num_slots=3, num_pages=16)
"""Three decode tokens, each its slot's newest: lengths 10, 1 and 17 (the newest key in a second 16-key step)."""


@pytest.mark.parametrize("head_dim,num_splits,min_split", [(16, 1, None), (32, 4, PAGE)])
def test_decode_mode_bit_identical(head_dim, num_splits, min_split):
    """``decode=True`` (older keys read before the PDL wait, the newest key and q after it, the next kernel let
    launch right after the wait) gives the very bits of the plain split kernel, one split or several."""
    case = Case(np.random.default_rng(5), 4, 2, head_dim, **DECODE_CASE)
    plain = case.run(num_splits=num_splits, min_split_tokens=min_split, method="split")
    decode = case.run(num_splits=num_splits, min_split_tokens=min_split, method="split", decode=True)
    np.testing.assert_array_equal(decode, plain)
    assert_attention(case, plain)


def assert_gated_is_attention_then_gate(case, **kwargs):
    """``paged_attention(..., gate=)`` gives the bits of ``paged_attention`` followed by ``sigmoid_gate_mul``, and
    is near the gated reference."""
    gate = case.d_gate
    gated = case.run(**kwargs)
    case.d_gate = None
    plain = cuda.to_device(case.run(**kwargs))
    case.d_gate = gate
    sigmoid_gate_mul(plain, gate, plain)
    np.testing.assert_array_equal(gated, plain.copy_to_host())
    assert_near_reference(gated, case.reference())


@pytest.mark.parametrize("method,num_splits,decode", [("split", 1, True), ("split", 3, False), ("split", 3, True),
                                                      ("prefill", None, False)])
def test_sigmoid_gate_epilogue(method, num_splits, decode):
    """Qwen3.5's output gate applied by the attention call (the split-K kernel as it writes, one split or merged
    from several; the prefill path through ``sigmoid_gate_mul``) gives the bits of the separate gate kernel."""
    case = Case(np.random.default_rng(5), 4, 2, 16, slots=[1, 0], positions=[9, 3], gate=True)
    assert_gated_is_attention_then_gate(case, num_splits=num_splits, min_split_tokens=PAGE if num_splits else None,
                                        method=method, decode=decode)


@pytest.mark.parametrize("head_dim", [16, 32])
def test_split_k_many_splits_repeated(rng, head_dim):
    """Several splits of 4 keys merged by the last block, twice on the same workspace (its counters must be back at
    zero after each call), then a different length on the same workspace."""
    nq, nkv, max_pages = 4, 2, 6
    case = Case(rng, nq, nkv, head_dim, slots=[0, 1], positions=[22, 13], max_pages=max_pages, num_pages=14)
    ws = case.workspace(num_splits=6)
    for slots, positions in (([0, 1], [22, 13]), ([0, 1], [22, 13]), ([1, 0], [5, 23])):
        case.dev[4].copy_to_device(np.array(slots, np.int32))
        case.dev[5].copy_to_device(np.array(positions, np.int32))
        case.slots, case.positions = np.array(slots, np.int32), np.array(positions, np.int32)
        out = cuda.device_array(case.shape, np.uint16)
        paged_attention(*case.dev, out, case.scale, ws, num_splits=6, min_split_tokens=4, method="split")
        assert_attention(case, out.copy_to_host())
        counters = ws.copy_to_host().view(np.int32)[-2 * nkv:]
        assert not counters.any(), counters


WARPS_CASE = dict(slots=[1, 0], positions=[19, 35], max_pages=10, num_pages=21)
"""Lengths 20 and 36: more 16-key steps than a block of two warps (or one pair) takes per round."""


def test_split_k_two_warps(rng):
    """Two warps per block (the block merges its warps' partial states in shared memory), one split and
    several."""
    case = Case(rng, 4, 2, 16, **WARPS_CASE)
    for kwargs in (dict(), dict(num_splits=2, min_split_tokens=16)):
        assert_attention(case, case.run(paged_attention_split, geometry=SplitGeometry(2, False), **kwargs))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_k_merge_padded_rows(rng, head_dim):
    """Head dims of 64 and 128 over two warps: the block's merge goes through the staged O's padded rows (chunks of
    32 dims plus one word, rows of 8 (mod 32) words at D = 128), one split and several, decode and not."""
    case = Case(rng, 4, 2, head_dim, **WARPS_CASE)
    for kwargs in (dict(), dict(num_splits=2, min_split_tokens=16), dict(decode=True)):
        assert_attention(case, case.run(paged_attention_split, geometry=SplitGeometry(2, False), **kwargs))


FULL_STEPS_CASE = dict(slots=[1, 0, 2], positions=[40, 15, 47], num_slots=3, max_pages=4, num_pages=13,
                       page_size=16)
"""16-key pages (the engine's): lengths 41 (two whole steps, then 9 keys), 16 (one step) and 48 (three)."""


@pytest.mark.parametrize("geometry,head_dim", [(SplitGeometry(1, False), 64), (SplitGeometry(2, True), 128)])
def test_whole_steps_in_one_page(rng, geometry, head_dim):
    """A step whose 16 keys all count and share a page loads its K / V rows from the step's first row, with no
    per-key test (``load_full_step``; pages of 16 keys, rows of 16-byte loads: 64-dim rows, or the halves of 128-dim
    ones in warp pairs): near the reference, one split and two, and decode mode (whose first step, read before the
    PDL wait, is such a step only without the newest key: that of the 48-key context, not that of the 16-key one)
    gives the very bits of the plain kernel."""
    case = Case(rng, 4, 2, head_dim, **FULL_STEPS_CASE)
    for kwargs in (dict(), dict(num_splits=2, min_split_tokens=16)):
        plain = case.run(paged_attention_split, geometry=geometry, **kwargs)
        assert_attention(case, plain)
        np.testing.assert_array_equal(case.run(paged_attention_split, geometry=geometry, decode=True, **kwargs),
                                      plain)


@pytest.mark.parametrize("warps,head_dim", [(2, 32), (4, 64)])
def test_split_k_dim_split(rng, warps, head_dim):
    """Warp pairs that split the head dims (the GPU's geometry for Qwen3.5's D = 256): one split and several, keys
    over more rounds than the block has pairs; decode mode gives the very bits of the plain kernel, and the gated
    output those of the separate gate kernel."""
    pairs = SplitGeometry(warps, True)
    case = Case(rng, 4, 2, head_dim, **WARPS_CASE)
    for kwargs in (dict(), dict(num_splits=2, min_split_tokens=16)):
        assert_attention(case, case.run(paged_attention_split, geometry=pairs, **kwargs))
    case = Case(np.random.default_rng(5), 4, 2, head_dim, slots=[1, 0, 2], positions=[40, 0, 16], num_slots=3,
                max_pages=11, num_pages=34)
    plain = case.run(paged_attention_split, geometry=pairs)
    np.testing.assert_array_equal(case.run(paged_attention_split, geometry=pairs, decode=True), plain)
    assert_attention(case, plain)
    gated = Case(np.random.default_rng(5), 4, 2, head_dim, slots=[1, 0], positions=[9, 3], gate=True)
    assert_gated_is_attention_then_gate(gated, fn=paged_attention_split, num_splits=1, geometry=pairs, decode=True)


WALK_CASE = dict(slots=[1, 0, 2, -1, 3, 4], positions=[40, 15, 47, 0, 3, 33], num_slots=5, max_pages=4,
                 num_pages=21, page_size=16)
"""Six tokens (one padding) of 41, 16, 48, 4 and 34 keys: 12 (token, kv head) items, more than a walking grid's
blocks in the simulator (its 4 SMs), most of them several 16-key rounds long."""


@pytest.mark.parametrize("walk", [1, 2])
def test_a_walking_grid_gives_the_bits_of_a_block_per_item(rng, walk):
    """A grid of ``walk`` blocks an SM walking the (token, kv head, split) items, each block asking L2 for its next
    item's first keys in its current item's last round (the simulator's ``prefetch_l2`` checks every address is
    one the kernel may read), gives the very bits of a block per item: one split and two, decode mode and not, a
    padding token among them."""
    case = Case(rng, 4, 2, 16, **WALK_CASE)
    for kwargs in (dict(), dict(num_splits=2, min_split_tokens=16), dict(decode=True)):
        per_item = case.run(paged_attention_split, geometry=SplitGeometry(1, False), **kwargs)
        walked = case.run(paged_attention_split, geometry=SplitGeometry(1, False, walk), **kwargs)
        np.testing.assert_array_equal(walked, per_item)
        assert not per_item[3].any()
        assert_attention(case, per_item)


def test_padding_tokens_dim_split(rng):
    """A padding token under the warp pairs and several splits: zeros, its neighbours unaffected."""
    case = Case(rng, 4, 2, 32, slots=[1, -1, 0], positions=[19, 0, 35], max_pages=10, num_pages=21)
    out = cuda.to_device(np.full(case.shape, 0x3F80, np.uint16))
    paged_attention_split(*case.dev, out, case.scale, case.workspace(2), num_splits=2, min_split_tokens=16,
                    geometry=SplitGeometry(2, True), decode=True)
    got = out.copy_to_host()
    assert not got[1].any()
    assert_attention(case, got)


def test_decode_attention_stamps_the_timeline(rng):
    """``policy.timeline``: every block of a decode launch appends one ``attention`` record (kind 5) with ordered
    stamps, and the output keeps its bits."""
    case = Case(rng, 4, 2, 16, **DECODE_CASE)
    plain = case.run(num_splits=2, min_split_tokens=PAGE, method="split", decode=True)
    timeline.reset()
    try:
        stamped = case.run(num_splits=2, min_split_tokens=PAGE, method="split", decode=True,
                           policy=LaunchPolicy(timeline=True))
        rec = timeline.records()
    finally:
        timeline.reset()
    np.testing.assert_array_equal(stamped, plain)
    assert len(rec) == int(rec["grid"][0]) > 0 and set(rec["kind"].tolist()) == {5}
    assert sorted(rec["block"].tolist()) == list(range(len(rec)))
    worked = rec[rec["t_wait"] > 0]                  # a block whose splits are all empty never waits
    assert len(worked) > 0 and np.all(rec["t_entry"] <= rec["t_end"])
    assert np.all(worked["t_entry"] <= worked["t_wait"]) and np.all(worked["t_wait"] <= worked["t_ready"])
    assert np.all(worked["t_ready"] <= worked["t_end"])


def test_launches_follow_the_policy(rng, monkeypatch):
    """Every launch of a call carries the caller's policy, under the names the policy's PDL set uses: the decode
    launch ``paged_decode_attention`` (and the workspace's one-time counter reset), a prompt chunk's
    ``paged_attention_split`` / ``paged_attention_prefill``."""
    from pegainfer.kernels import launch as launch_module

    seen, real = [], launch_module._launch

    def record(kernel, grid, block, args, shared, policy, name):
        seen.append((name, policy))
        real(kernel, grid, block, args, shared, policy, name)

    monkeypatch.setattr(launch_module, "_launch", record)
    policy = LaunchPolicy(pdl=frozenset())
    case = Case(rng, 4, 2, 16, slots=[1, 0], positions=[9, 0])
    case.run(num_splits=3, min_split_tokens=PAGE, method="split", decode=True, policy=policy)
    case.run(method="split", policy=policy)
    case.run(method="prefill", policy=policy)
    assert [name for name, _ in seen] == ["attention_zero_counters", "paged_decode_attention",
                                          "paged_attention_split", "paged_attention_prefill"]
    assert all(p is policy for _, p in seen)


# ------------------------------------------------------------------------------------------------ GPU shapes
@pytest.mark.gpu
@pytest.mark.parametrize("nq,nkv,head_dim", [(32, 8, 128), (16, 4, 256)])
@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("decode", [False, True])
def test_gpu_decode_long_context(nq, nkv, head_dim, num_tokens, decode):
    """Qwen3-4B (32/8/128) and Qwen3.5 full-attention (16/4/256, warp pairs) shapes, contexts around 4096."""
    case = Case(np.random.default_rng(7), nq, nkv, head_dim, slots=[0, 1, 2][:num_tokens],
                positions=[4095, 1000, 4159][:num_tokens], num_slots=3, max_pages=260, num_pages=787, page_size=16)
    assert_attention(case, case.run(decode=decode))


@pytest.mark.gpu
def test_gpu_batched_decode_takes_four_warp_blocks():
    """A 40-sequence decode step of Qwen3-4B's heads (320 (token, kv head) items: the 4-warp block of a batched
    step) at contexts of 1 to 600 keys (one split, or several of 256-key minimum), against the reference."""
    from pegainfer.kernels.attention import split_geometry
    assert split_geometry(128, 4, 40 * 8).warps == 4 and split_geometry(128, 4, 8).warps == 8
    rng = np.random.default_rng(11)
    positions = [int(p) for p in rng.integers(0, 600, 40)]
    case = Case(rng, 32, 8, 128, slots=list(range(40)), positions=positions, num_slots=40, max_pages=40,
                num_pages=1601, page_size=16)
    assert_attention(case, case.run(decode=True))


@pytest.mark.gpu
def test_gpu_decode_qwen35_short_contexts():
    """Qwen3.5's full-attention shape (16 q / 4 kv heads of 256) at the decode benchmark's contexts (one split of
    1, 5 and 9 16-key steps: one, two and three rounds of the dim-split pairs)."""
    case = Case(np.random.default_rng(9), 16, 4, 256, slots=[0, 1, 2], positions=[15, 79, 143], num_slots=3,
                max_pages=16, num_pages=51, page_size=16)
    assert_attention(case, case.run(decode=True))


@pytest.mark.gpu
@pytest.mark.parametrize("positions", [[127], [4095]])
def test_gpu_sigmoid_gate_epilogue_qwen35(positions):
    """The gated decode attention at Qwen3.5-4B's full-attention shape (16 q / 4 kv heads of 256), one split and
    several: the bits of attention followed by ``sigmoid_gate_mul``."""
    case = Case(np.random.default_rng(5), 16, 4, 256, slots=[0], positions=positions, num_slots=1, max_pages=260,
                num_pages=267, page_size=16, gate=True)
    assert_gated_is_attention_then_gate(case, decode=True)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """A decode call captured once in a CUDA graph, replayed after the positions / slots on the device change:
    nothing per-step may be baked into the launch."""
    from cuda.bindings import driver as drv
    from pegainfer.kernels.launch import on_stream
    from tests.kernels.test_attention import float64_attention
    from tests.util import from_bf16_bits, rel_l2

    def check(res):
        err = res[0] if isinstance(res, tuple) else res
        assert err == drv.CUresult.CUDA_SUCCESS, err
        return res[1] if isinstance(res, tuple) and len(res) == 2 else None

    rng = np.random.default_rng(9)
    nq, nkv, D, page_size, max_pages = 32, 8, 128, 16, 64
    k_bits, k, v_bits, v, tables = make_cache(rng, 2 * max_pages + 1, page_size, nkv, D, 2, max_pages)
    q_bits, q = bf16_randn((2, nq, D), rng)
    args = [cuda.to_device(a) for a in (q_bits, k_bits, v_bits, tables)]
    slots = cuda.to_device(np.array([0, 1], np.int32))
    pos = cuda.to_device(np.array([5, 700], np.int32))
    out = cuda.device_array((2, nq, D), np.uint16)
    from pegainfer.kernels.attention import attention_workspace_size
    ws = cuda.device_array(attention_workspace_size(2, nq, D, max_pages * page_size, nkv=nkv), np.float32)
    scale = 1 / math.sqrt(D)
    stream = cuda.stream()
    call = lambda: paged_attention(*args, slots, pos, out, scale, ws)  # noqa: E731
    with on_stream(stream):
        call()                                   # compile outside the capture
    stream.synchronize()
    cs = drv.CUstream(int(stream.handle))
    with cuda.defer_cleanup(), on_stream(stream):
        check(drv.cuStreamBeginCapture(cs, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        call()
        graph = check(drv.cuStreamEndCapture(cs))
    exe = check(drv.cuGraphInstantiate(graph, 0))
    for new_slots, new_pos in (([1, 0], [1023, 0]), ([0, 0], [300, 301]), ([1, 1], [15, 16])):
        slots.copy_to_device(np.array(new_slots, np.int32), stream=stream)
        pos.copy_to_device(np.array(new_pos, np.int32), stream=stream)
        check(drv.cuGraphLaunch(exe, cs))
        stream.synchronize()
        got = from_bf16_bits(out.copy_to_host())
        want = float64_attention(q, k, v, tables, np.array(new_slots), np.array(new_pos), scale, page_size)
        assert rel_l2(got, want) <= 1e-2, (new_slots, new_pos)
    check(drv.cuGraphExecDestroy(exe))
    check(drv.cuGraphDestroy(graph))
