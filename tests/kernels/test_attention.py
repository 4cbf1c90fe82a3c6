"""Paged attention (split-K and tiled prefill paths) against a float64 NumPy reference."""
import math

import numpy as np
import pytest

import pegainfer  # noqa: F401  (before numba)
from numba import cuda

from pegainfer.kernels import attention
from pegainfer.kernels.attention import DecodeRope, attention_workspace_size, paged_attention
from pegainfer.kernels.rope import qk_norm_rope_store, rope_tables
from pegainfer.kernels.gating import sigmoid_gate_mul
from tests.util import bf16_randn, rel_l2

PAGE = 4


def make_cache(rng, num_pages, page_size, nkv, head_dim, num_slots, max_pages):
    """Random K/V cache and a block table whose pages are a shuffled, non-contiguous subset of the pool."""
    k_bits, k = bf16_randn((num_pages, page_size, nkv, head_dim), rng)
    v_bits, v = bf16_randn((num_pages, page_size, nkv, head_dim), rng)
    perm = rng.permutation(num_pages).astype(np.int32)
    tables = perm[: num_slots * max_pages].reshape(num_slots, max_pages).copy()
    return k_bits, k, v_bits, v, tables


def reference(q, k, v, tables, slots, positions, scale, page_size):
    """float64 attention of every query token over keys 0..positions[t] of its slot."""
    T, nq, D = q.shape
    nkv = k.shape[2]
    group = nq // nkv
    out = np.zeros((T, nq, D))
    for t in range(T):
        n = positions[t] + 1
        p = np.arange(n)
        pages = tables[slots[t], p // page_size]
        keys = k[pages, p % page_size]          # [n, nkv, D]
        vals = v[pages, p % page_size]
        for h in range(nq):
            s = keys[:, h // group] @ q[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ vals[:, h // group]
    return out


def run_attention(rng, nq, nkv, head_dim, slots, positions, num_slots=2, max_pages=5, num_pages=13, page_size=PAGE,
                  **kwargs):
    k_bits, k, v_bits, v, tables = make_cache(rng, num_pages, page_size, nkv, head_dim, num_slots, max_pages)
    T = len(slots)
    q_bits, q = bf16_randn((T, nq, head_dim), rng)
    slots = np.asarray(slots, np.int32)
    positions = np.asarray(positions, np.int32)
    scale = 1.0 / math.sqrt(head_dim)
    ws_size = attention_workspace_size(T, nq, head_dim, max_pages * page_size, page_size,
                                       num_splits=kwargs.get("num_splits"))
    d_out = cuda.device_array((T, nq, head_dim), np.uint16)
    paged_attention(cuda.to_device(q_bits), cuda.to_device(k_bits), cuda.to_device(v_bits), cuda.to_device(tables),
                    cuda.to_device(slots), cuda.to_device(positions), d_out, scale,
                    cuda.device_array(ws_size, np.float32), **kwargs)
    got = (d_out.copy_to_host().astype(np.uint32) << 16).view(np.float32)
    want = reference(q, k, v, tables, slots, positions, scale, page_size)
    return got, want


METHODS = ["split", "prefill"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("head_dim", [16, 32])
def test_decode_two_slots(rng, head_dim, method):
    """T=2 tokens of two slots: one at length 10 (crosses two page boundaries), one at length 1."""
    got, want = run_attention(rng, 4, 2, head_dim, slots=[1, 0], positions=[9, 0], method=method)
    assert rel_l2(got, want) <= 1e-2
    for t in range(2):
        assert rel_l2(got[t], want[t]) <= 1e-2, t


@pytest.mark.parametrize("method", METHODS)
def test_prefill_causal(rng, method):
    """T=7 tokens of one slot at positions 0..6: each attends only to keys up to its own position."""
    got, want = run_attention(rng, 4, 2, 32, slots=[0] * 7, positions=list(range(7)), method=method)
    assert rel_l2(got, want) <= 1e-2
    for t in range(7):
        assert rel_l2(got[t], want[t]) <= 1e-2, t


@pytest.mark.parametrize("method", METHODS)
def test_prefix_plus_chunk(rng, method):
    """A chunk at positions 5..9 whose prefix (keys 0..4) was written by an earlier step."""
    got, want = run_attention(rng, 4, 2, 16, slots=[1] * 5, positions=list(range(5, 10)), method=method)
    assert rel_l2(got, want) <= 1e-2


def test_prefill_mixed_tile(rng):
    """The tiled kernel with a tile holding runs of two slots and a decode token (runs 2 + 1 + 5 tokens, then a
    second, partial tile): rows of one run must ignore the other runs' keys."""
    slots = [0, 0, 1, 0, 0, 0, 0, 0, 1, 1]
    positions = [3, 4, 17, 0, 1, 2, 3, 4, 18, 19]
    got, want = run_attention(rng, 4, 2, 16, slots=slots, positions=positions, method="prefill")
    for t in range(len(slots)):
        assert rel_l2(got[t], want[t]) <= 1e-2, t


LONG_CHUNK = dict(slots=[1] * 11, positions=list(range(16, 27)), max_pages=7, num_pages=15)
"""11 tokens after a 16-token prefix: in the simulator's tiled geometry (8 tokens x 2 heads per tile, 16-key tiles)
the first token tile has a fully visible key tile (no mask) and a causal one, the second is partial."""


def test_long_chunk(rng):
    got, want = run_attention(rng, 4, 2, 32, method="prefill", **LONG_CHUNK)
    assert rel_l2(got, want) <= 1e-2


def test_prefill_q_from_memory(rng, monkeypatch):
    """The tiled kernel's D=256 variant (Q fragments re-read from memory per tile instead of held in registers)."""
    from pegainfer.kernels import attention

    warps, block_keys, _ = attention._prefill_geometry(32)
    monkeypatch.setattr(attention, "_prefill_geometry", lambda head_dim: (warps, block_keys, False))
    got, want = run_attention(rng, 4, 2, 32, slots=[1] * 4, positions=list(range(14, 18)), method="prefill")
    assert rel_l2(got, want) <= 1e-2


@pytest.mark.parametrize("head_dim,num_splits", [(16, 3), (32, 4)])
def test_split_k_forced(rng, head_dim, num_splits):
    """Split-K with several one-page splits: lengths 10 (3 active splits, the last one partial) and 1 (one active
    split, the others empty)."""
    got, want = run_attention(rng, 4, 2, head_dim, slots=[1, 0], positions=[9, 0],
                              num_splits=num_splits, min_split_tokens=PAGE, method="split")
    assert rel_l2(got, want) <= 1e-2
    for t in range(2):
        assert rel_l2(got[t], want[t]) <= 1e-2, t


@pytest.mark.parametrize("release", attention.DECODE_RELEASES)
@pytest.mark.parametrize("head_dim,num_splits,min_split", [(16, 1, None), (32, 4, PAGE)])
def test_decode_mode_bit_identical(head_dim, num_splits, min_split, release, monkeypatch):
    """``decode=True`` (older keys read before the PDL wait, the newest key and q after it; the next kernel let
    launch where ``DECODE_RELEASE`` says) gives the very bits of the plain split kernel: three decode tokens, each its
    slot's newest, one split or several."""
    monkeypatch.setattr(attention, "DECODE_RELEASE", release)
    outs = []
    for decode in (False, True):
        got, want = run_attention(np.random.default_rng(5), 4, 2, head_dim, slots=[1, 0, 2], positions=[9, 0, 16],
                                  num_slots=3, num_pages=16, num_splits=num_splits, min_split_tokens=min_split,
                                  method="split",
                                  decode=decode)
        assert rel_l2(got, want) <= 1e-2
        outs.append(got)
    np.testing.assert_array_equal(outs[0], outs[1])


def gated_equals_attention_then_gate(nq, nkv, head_dim, slots, positions, **kwargs):
    """``paged_attention(..., gate=qg)`` against ``paged_attention`` followed by ``sigmoid_gate_mul``: the same bits
    (same seed, so the same q and cache)."""
    T = len(slots)
    qg_bits, _ = bf16_randn((T, 2 * nq * head_dim + 8), np.random.default_rng(11), scale=2.0)
    plain, _ = run_attention(np.random.default_rng(5), nq, nkv, head_dim, slots, positions, **kwargs)
    gated, want = run_attention(np.random.default_rng(5), nq, nkv, head_dim, slots, positions,
                                gate=cuda.to_device(qg_bits), **kwargs)
    d_plain = cuda.to_device((plain.view(np.uint32) >> 16).astype(np.uint16))
    sigmoid_gate_mul(d_plain, cuda.to_device(qg_bits), d_plain)
    np.testing.assert_array_equal((gated.view(np.uint32) >> 16).astype(np.uint16), d_plain.copy_to_host())
    assert rel_l2(plain, want) <= 1e-2


@pytest.mark.parametrize("gate_early", [False, True])
@pytest.mark.parametrize("method,num_splits,decode", [("split", 1, True), ("split", 3, False), ("prefill", None, False),
                                                      ("split", 3, True)])
def test_sigmoid_gate_epilogue(method, num_splits, decode, gate_early, monkeypatch):
    """Qwen3.5's output gate applied by the attention call (the split-K kernel as it writes, one split or merged
    from several, its gates loaded late or early: ``GATE_EARLY``; the prefill path through ``sigmoid_gate_mul``)
    gives the bits of the separate gate kernel."""
    monkeypatch.setattr(attention, "GATE_EARLY", gate_early)
    gated_equals_attention_then_gate(4, 2, 16, slots=[1, 0], positions=[9, 3], num_splits=num_splits,
                                     min_split_tokens=PAGE if num_splits else None, method=method, decode=decode)


@pytest.mark.parametrize("head_dim", [16, 32])
def test_split_k_many_splits_repeated(rng, head_dim):
    """Several splits of 4 keys merged by the last block, twice on the same workspace (its counters must be back at
    zero after each call), then a different length on the same workspace."""
    from pegainfer.kernels import attention

    nq, nkv, page, max_pages = 4, 2, PAGE, 6
    k_bits, k, v_bits, v, tables = make_cache(rng, 14, page, nkv, head_dim, 2, max_pages)
    q_bits, q = bf16_randn((2, nq, head_dim), rng)
    scale = 1.0 / math.sqrt(head_dim)
    ws = cuda.device_array(attention_workspace_size(2, nq, head_dim, max_pages * page, page, num_splits=6),
                           np.float32)
    dev = [cuda.to_device(a) for a in (q_bits, k_bits, v_bits, tables)]
    out = cuda.device_array((2, nq, head_dim), np.uint16)
    for slots, positions in (([0, 1], [22, 13]), ([0, 1], [22, 13]), ([1, 0], [5, 23])):
        slots, positions = np.array(slots, np.int32), np.array(positions, np.int32)
        paged_attention(*dev, cuda.to_device(slots), cuda.to_device(positions), out, scale, ws,
                        num_splits=6, min_split_tokens=4, method="split")
        got = (out.copy_to_host().astype(np.uint32) << 16).view(np.float32)
        want = reference(q, k, v, tables, slots, positions, scale, page)
        for t in range(2):
            assert rel_l2(got[t], want[t]) <= 1e-2, (positions, t)
        counters = ws.copy_to_host().view(np.int32)[-2 * nkv:]
        assert not counters.any(), counters


@pytest.mark.parametrize("late_v", [False, True])
def test_split_k_two_warps(rng, monkeypatch, late_v):
    """Two warps per block (the block merges its warps' partial states in shared memory), with and without
    several splits, V loaded with K or after S."""
    from pegainfer.kernels import attention

    monkeypatch.setattr(attention, "_split_geometry", lambda head_dim, group: (2, late_v, 0))
    for kwargs in (dict(), dict(num_splits=2, min_split_tokens=16)):
        got, want = run_attention(rng, 4, 2, 16, slots=[1, 0], positions=[19, 35], max_pages=10, num_pages=21,
                                  method="split", **kwargs)
        for t in range(2):
            assert rel_l2(got[t], want[t]) <= 1e-2, (kwargs, t)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_k_merge_padded_rows(rng, monkeypatch, head_dim):
    """Head dims of 64 and 128 over two warps: the block's merge goes through ``sm_o``'s padded rows (chunks of 32
    dims plus one word, rows of 8 (mod 32) words at D = 128), one split and several, decode and not."""
    from pegainfer.kernels import attention

    monkeypatch.setattr(attention, "_split_geometry", lambda head_dim, group: (2, False, 0))
    for kwargs in (dict(), dict(num_splits=2, min_split_tokens=16), dict(decode=True)):
        got, want = run_attention(rng, 4, 2, head_dim, slots=[1, 0], positions=[19, 35], max_pages=10, num_pages=21,
                                  method="split", **kwargs)
        for t in range(2):
            assert rel_l2(got[t], want[t]) <= 1e-2, (kwargs, t)


@pytest.mark.parametrize("warps,head_dim", [(2, 32), (4, 64)])
def test_split_k_dim_split(rng, monkeypatch, warps, head_dim):
    """Warp pairs that split the head dims (the GPU's geometry for Qwen3.5's D = 256): one split and several,
    keys over more rounds than the block has pairs; decode mode gives the very bits of the plain kernel, and the
    gated output those of the separate gate kernel."""
    from pegainfer.kernels import attention

    monkeypatch.setattr(attention, "_split_geometry", lambda head_dim, group: (warps, False, 0, True))
    for kwargs in (dict(), dict(num_splits=2, min_split_tokens=16)):
        got, want = run_attention(rng, 4, 2, head_dim, slots=[1, 0], positions=[19, 35], max_pages=10, num_pages=21,
                                  method="split", **kwargs)
        for t in range(2):
            assert rel_l2(got[t], want[t]) <= 1e-2, (kwargs, t)
    outs = []
    for decode in (False, True):
        got, want = run_attention(np.random.default_rng(5), 4, 2, head_dim, slots=[1, 0, 2], positions=[40, 0, 16],
                                  num_slots=3, max_pages=11, num_pages=34, method="split", decode=decode)
        assert rel_l2(got, want) <= 1e-2
        outs.append(got)
    np.testing.assert_array_equal(outs[0], outs[1])
    gated_equals_attention_then_gate(4, 2, head_dim, slots=[1, 0], positions=[9, 3], num_splits=1, method="split",
                                     decode=True)


@pytest.mark.parametrize("method", METHODS)
def test_padding_tokens(rng, method):
    """Tokens with ``token_slots[t] < 0`` (padding of a fixed-size batch) get zeros and read no block table row;
    the real tokens around them are unaffected.  The padding rows of ``out`` start as garbage."""
    nq, nkv, D = 4, 2, 16
    k_bits, k, v_bits, v, tables = make_cache(rng, 13, PAGE, nkv, D, 2, 5)
    slots = np.array([0, 0, -1, 1, -1, -1], np.int32)
    positions = np.array([3, 4, 0, 9, 0, 0], np.int32)
    positions[4] = 10 ** 6   # nonsense position of a padding token: must not be used
    q_bits, q = bf16_randn((6, nq, D), rng)
    scale = 1.0 / math.sqrt(D)
    out = cuda.to_device(np.full((6, nq, D), 0x3F80, np.uint16))   # 1.0 everywhere
    ws = cuda.device_array(attention_workspace_size(6, nq, D, 5 * PAGE, PAGE, num_splits=3), np.float32)
    paged_attention(cuda.to_device(q_bits), cuda.to_device(k_bits), cuda.to_device(v_bits), cuda.to_device(tables),
                    cuda.to_device(slots), cuda.to_device(positions), out, scale, ws, method=method,
                    **(dict(num_splits=3, min_split_tokens=4) if method == "split" else {}))
    got = (out.copy_to_host().astype(np.uint32) << 16).view(np.float32)
    real = [0, 1, 3]
    want = reference(q[real], k, v, tables, slots[real], positions[real], scale, PAGE)
    for i, t in enumerate(real):
        assert rel_l2(got[t], want[i]) <= 1e-2, t
    assert not got[[2, 4, 5]].any()


# ------------------------------------------------------------------------------------------------ GPU shapes
@pytest.mark.gpu
@pytest.mark.parametrize("nq,nkv,head_dim", [(32, 8, 128), (16, 4, 256)])
@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("decode", [False, True])
def test_gpu_decode_long_context(nq, nkv, head_dim, num_tokens, decode):
    """Qwen3-4B (32/8/128) and Qwen3.5 full-attention (16/4/256) shapes, contexts around 4096."""
    rng = np.random.default_rng(7)
    page_size, max_pages = 16, 260
    positions = [4095, 1000, 4159][:num_tokens]
    slots = [0, 1, 2][:num_tokens]
    got, want = run_attention(rng, nq, nkv, head_dim, slots=slots, positions=positions, num_slots=3,
                              max_pages=max_pages, num_pages=3 * max_pages + 7, page_size=page_size, decode=decode)
    assert rel_l2(got, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dim_split", [False, True])
def test_gpu_decode_qwen35_short_contexts(monkeypatch, dim_split):
    """Qwen3.5's full-attention shape (16 q / 4 kv heads of 256) at the decode benchmark's contexts (one split of
    1, 5 and 9 16-key steps: one, two and three rounds of the dim-split pairs), with and without the pairs."""
    from pegainfer.kernels import attention

    monkeypatch.setattr(attention, "DIM_SPLIT_WIDE_HEADS", dim_split)
    got, want = run_attention(np.random.default_rng(9), 16, 4, 256, slots=[0, 1, 2], positions=[15, 79, 143],
                              num_slots=3, max_pages=16, num_pages=51, page_size=16, decode=True)
    for t in range(3):
        assert rel_l2(got[t], want[t]) <= 1e-2, t


@pytest.mark.gpu
@pytest.mark.parametrize("gate_early", [False, True])
@pytest.mark.parametrize("positions", [[127], [4095]])
def test_gpu_sigmoid_gate_epilogue_qwen35(positions, gate_early, monkeypatch):
    """The gated decode attention at Qwen3.5-4B's full-attention shape (16 q / 4 kv heads of 256), one split and
    several, gates loaded late or early: the bits of attention followed by ``sigmoid_gate_mul``."""
    monkeypatch.setattr(attention, "GATE_EARLY", gate_early)
    gated_equals_attention_then_gate(16, 4, 256, slots=[0], positions=positions, num_slots=1, max_pages=260,
                                     num_pages=267, page_size=16, decode=True)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("nq,nkv,head_dim", [(32, 8, 128), (16, 4, 256)])
def test_gpu_prefill(nq, nkv, head_dim, method):
    """A 300-token chunk after a 100-token prefix, one slot, real shapes (and a few rows checked one by one)."""
    rng = np.random.default_rng(8)
    page_size, max_pages = 16, 32
    positions = list(range(100, 400))
    got, want = run_attention(rng, nq, nkv, head_dim, slots=[1] * len(positions), positions=positions,
                              num_slots=2, max_pages=max_pages, num_pages=2 * max_pages + 3, page_size=page_size,
                              method=method)
    assert rel_l2(got, want) <= 1e-2
    for t in (0, 1, 63, 64, 299):
        assert rel_l2(got[t], want[t]) <= 1e-2, t


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """A decode call captured once in a CUDA graph, replayed after the positions / slots on the device change:
    nothing per-step may be baked into the launch."""
    from cuda.bindings import driver as drv
    from pegainfer.kernels.launch import on_stream

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
    ws = cuda.device_array(attention_workspace_size(2, nq, D, max_pages * page_size, page_size), np.float32)
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
        got = (out.copy_to_host().astype(np.uint32) << 16).view(np.float32)
        want = reference(q, k, v, tables, np.array(new_slots), np.array(new_pos), scale, page_size)
        assert rel_l2(got, want) <= 1e-2, (new_slots, new_pos)
    check(drv.cuGraphExecDestroy(exe))
    check(drv.cuGraphDestroy(graph))


# ------------------------------------------------------------------------------------------------ fused decode rope
def run_decode_rope(fused, head_dim, rotary_dim, q_stride_mult, weight_offset, round_before_weight, positions,
                    slots, num_splits=None, min_split=None, nq=4, nkv=2, page_size=PAGE, max_pages=7):
    """One decode step of attention from the raw projection: ``qk_norm_rope_store`` then
    ``paged_attention(decode=True)``, or (``fused``) ``paged_attention(decode=True, rope=...)``.  Same seed, so
    the same inputs; returns (out, k_cache, v_cache) as bf16 bits."""
    rng = np.random.default_rng(3)
    T, D = len(slots), head_dim
    num_pages = 3 * max_pages + 2
    k_bits, _, v_bits, _, tables = make_cache(rng, num_pages, page_size, nkv, D, 3, max_pages)
    qkv, _ = bf16_randn((T, nq * q_stride_mult * D + 2 * nkv * D), rng, scale=2.0)
    qn, _ = bf16_randn((D,), rng, scale=0.5)
    kn, _ = bf16_randn((D,), rng, scale=0.5)
    cos, sin = rope_tables(max_pages * page_size, rotary_dim, 10000.0)
    dev = {name: cuda.to_device(a) for name, a in
           dict(k=k_bits, v=v_bits, tables=tables, qkv=qkv, qn=qn, kn=kn, cos=cos, sin=sin,
                slots=np.asarray(slots, np.int32), pos=np.asarray(positions, np.int32)).items()}
    q = cuda.to_device(np.zeros((T, nq, D), np.uint16))
    out = cuda.device_array((T, nq, D), np.uint16)
    ws = cuda.device_array(attention_workspace_size(T, nq, D, max_pages * page_size, page_size,
                                                    num_splits=num_splits), np.float32)
    knobs = dict(weight_offset=weight_offset, round_before_weight=round_before_weight)
    if fused:
        rope = DecodeRope(dev["qkv"], dev["qn"], dev["kn"], dev["cos"], dev["sin"], 1e-6, rotary_dim,
                          q_stride_mult * D, **knobs)
    else:
        rope = None
        qk_norm_rope_store(dev["qkv"], dev["qn"], dev["kn"], dev["cos"], dev["sin"], dev["pos"], dev["slots"],
                           dev["tables"], dev["k"], dev["v"], q, 1e-6, rotary_dim, q_head_stride=q_stride_mult * D,
                           **knobs)
    paged_attention(q, dev["k"], dev["v"], dev["tables"], dev["slots"], dev["pos"], out, 1.0 / math.sqrt(D), ws,
                    num_splits=num_splits, min_split_tokens=min_split, method="split", decode=True, rope=rope)
    return out.copy_to_host(), dev["k"].copy_to_host(), dev["v"].copy_to_host()


def assert_decode_rope_fused_equals_separate(*args, **kwargs):
    separate = run_decode_rope(False, *args, **kwargs)
    fused = run_decode_rope(True, *args, **kwargs)
    for name, a, b in zip(("out", "k_cache", "v_cache"), fused, separate):
        np.testing.assert_array_equal(a, b, err_msg=name)
    return separate


@pytest.mark.parametrize("head_dim,rotary_dim,q_stride_mult,weight_offset,rbw,num_splits,min_split", [
    (16, 16, 1, 0.0, True, None, None),     # Qwen3's form, one split
    (32, 32, 1, 0.0, True, 3, PAGE),        # several splits: the newest key in the last one
    (32, 16, 2, 1.0, False, None, None),    # Qwen3.5's form: partial rotary, gate after each q head, (1 + w) norm
])
def test_decode_rope_fused_equals_separate(head_dim, rotary_dim, q_stride_mult, weight_offset, rbw, num_splits,
                                           min_split):
    """``paged_attention(decode=True, rope=...)`` (norm + RoPE + KV store inside the attention launch) leaves the
    very bits of ``qk_norm_rope_store`` + ``paged_attention(decode=True)`` in the output and both caches: three
    decode tokens (positions 9, 0 and 20 -- the newest key of the last in a later 16-key pass) and a padding
    token."""
    out = assert_decode_rope_fused_equals_separate(head_dim, rotary_dim, q_stride_mult, weight_offset, rbw,
                                                   [9, 0, 20, 0], [1, 0, 2, -1], num_splits, min_split)[0]
    assert np.any(out[:3] != 0) and np.all(out[3] == 0)


def test_decode_rope_fused_one_role_per_warp(monkeypatch):
    """The fused path when every warp has at most one role (the GPU's 8 warps for Qwen3's 4 q heads + k + v; here
    4 warps for 2 q heads + k + v) loads its norm weights and cos/sin before the PDL wait: still the very bits of
    the separate kernels, one split and several, o released after the wait or after the norm phase."""
    monkeypatch.setattr(attention, "_split_geometry", lambda head_dim, group: (4, False, 0, False))
    for release in ("after_wait", "after_norm"):     # where o may launch: FUSED_DECODE_ROPE_RELEASE
        monkeypatch.setattr(attention, "FUSED_DECODE_ROPE_RELEASE", release)
        for num_splits, min_split in ((None, None), (3, PAGE)):
            out = assert_decode_rope_fused_equals_separate(16, 16, 1, 0.0, True, [9, 20], [1, 0], num_splits,
                                                           min_split)[0]
            assert np.any(out != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("positions", [[127], [4095], [300, 17]])
def test_gpu_decode_rope_fused_qwen3_shapes(positions, monkeypatch):
    """Qwen3-4B's attention shape (32 q / 8 kv heads of 128) on the GPU, one split and several, o released after
    the wait or after the norm phase: fused and separate give the same bits in the output and both caches."""
    for release in ("after_wait", "after_norm"):
        monkeypatch.setattr(attention, "FUSED_DECODE_ROPE_RELEASE", release)
        assert_decode_rope_fused_equals_separate(128, 128, 1, 0.0, True, positions, list(range(len(positions))),
                                                 nq=32, nkv=8, page_size=16, max_pages=260)
