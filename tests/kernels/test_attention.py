"""Paged attention: the reference kernel against float64 NumPy, ``paged_attention`` (both paths) against the
reference kernel, the tiled prefill kernel, and the workspace / geometry helpers.  The split-K kernel's own cases
are in ``test_attention_decode.py``.

How close the tuned kernels are to the reference (``assert_near_reference``): they round at the same points (bf16
probabilities in ``P V``, one bf16 rounding of the output) but take each probability relative to a running max and
sum in another order, so an output element differs by about one bf16 step of its row's scale (two are allowed;
bit-identical while a split has at most 16 keys)."""
import math

import numpy as np
import pytest

import pegainfer  # noqa: F401  (before numba)
from numba import cuda

from pegainfer.kernels import attention
from pegainfer.kernels.attention import (PrefillGeometry, attention_workspace_size, paged_attention,
                                         paged_attention_prefill, reference_paged_attention)
from tests.util import bf16_randn, from_bf16_bits, rel_l2, to_bf16_bits

PAGE = 4


def make_cache(rng, num_pages, page_size, nkv, head_dim, num_slots, max_pages):
    """Random K/V cache and a block table whose pages are a shuffled, non-contiguous subset of the pool."""
    k_bits, k = bf16_randn((num_pages, page_size, nkv, head_dim), rng)
    v_bits, v = bf16_randn((num_pages, page_size, nkv, head_dim), rng)
    perm = rng.permutation(num_pages).astype(np.int32)
    tables = perm[: num_slots * max_pages].reshape(num_slots, max_pages).copy()
    return k_bits, k, v_bits, v, tables


def float64_attention(q, k, v, tables, slots, positions, scale, page_size, gate=None):
    """float64 attention of every query token over keys 0..positions[t] of its slot (zeros for a padding token),
    times ``sigmoid(gate)`` per head when given."""
    T, nq, D = q.shape
    group = nq // k.shape[2]
    out = np.zeros((T, nq, D))
    for t in range(T):
        if slots[t] < 0:
            continue
        p = np.arange(positions[t] + 1)
        pages = tables[slots[t], p // page_size]
        keys, vals = k[pages, p % page_size], v[pages, p % page_size]      # [n, nkv, D]
        for h in range(nq):
            s = keys[:, h // group] @ q[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ vals[:, h // group]
            if gate is not None:
                out[t, h] /= 1.0 + np.exp(-gate[t, h * 2 * D + D: h * 2 * D + 2 * D])
    return out


class Case:
    """The inputs of one attention call (host float64 values and device bf16 bits): a shuffled paged cache, q,
    slots / positions, optionally Qwen3.5's gate (the q_proj output, ``[T, 2·nq·D + 8]``)."""

    def __init__(self, rng, nq, nkv, head_dim, slots, positions, num_slots=2, max_pages=5, num_pages=13,
                 page_size=PAGE, gate=False):
        self.k_bits, self.k, self.v_bits, self.v, self.tables = make_cache(rng, num_pages, page_size, nkv, head_dim,
                                                                           num_slots, max_pages)
        T = len(slots)
        self.q_bits, self.q = bf16_randn((T, nq, head_dim), rng)
        self.slots, self.positions = np.asarray(slots, np.int32), np.asarray(positions, np.int32)
        self.gate_bits, self.gate = bf16_randn((T, 2 * nq * head_dim + 8), rng, scale=2.0) if gate else (None, None)
        self.scale = 1.0 / math.sqrt(head_dim)
        self.page_size, self.max_len = page_size, max_pages * page_size
        self.shape = (T, nq, head_dim)
        self.dev = [cuda.to_device(a) for a in (self.q_bits, self.k_bits, self.v_bits, self.tables, self.slots,
                                                self.positions)]
        self.d_gate = cuda.to_device(self.gate_bits) if gate else None

    def workspace(self, num_splits=None):
        T, nq, D = self.shape
        return cuda.device_array(attention_workspace_size(T, nq, D, self.max_len, nkv=self.k_bits.shape[2],
                                                          num_splits=num_splits), np.float32)

    def run(self, fn=paged_attention, with_workspace=True, **kwargs):
        """bf16 bits of ``fn(q, k, v, tables, slots, positions, out, scale, [workspace], gate=, **kwargs)``."""
        out = cuda.device_array(self.shape, np.uint16)
        ws = (self.workspace(kwargs.get("num_splits")),) if with_workspace else ()
        fn(*self.dev, out, self.scale, *ws, **(dict(gate=self.d_gate) if self.d_gate is not None else {}), **kwargs)
        return out.copy_to_host()

    def reference(self):
        out = cuda.device_array(self.shape, np.uint16)
        reference_paged_attention(*self.dev, out, self.scale, gate=self.d_gate)
        return out.copy_to_host()

    def float64(self):
        return float64_attention(self.q, self.k, self.v, self.tables, self.slots, self.positions, self.scale,
                                 self.page_size, self.gate)


def bf16_step(x):
    """The spacing of bf16 values at magnitude ``x`` (8 significant bits)."""
    return 2.0 ** (np.floor(np.log2(max(x, 1e-30))) - 7)


def assert_near_reference(got_bits, ref_bits, rows=None):
    """The tuned kernel's output against the reference kernel's (module docstring): relative L2 <= 4e-3 and, in
    every (token, head) row, every element within two bf16 steps of the row's largest magnitude."""
    got, ref = from_bf16_bits(got_bits).astype(np.float64), from_bf16_bits(ref_bits).astype(np.float64)
    assert rel_l2(got, ref) <= 4e-3, rel_l2(got, ref)
    for t in range(got.shape[0]) if rows is None else rows:
        for h in range(got.shape[1]):
            err = np.abs(got[t, h] - ref[t, h]).max()
            assert err <= 2 * bf16_step(np.abs(ref[t, h]).max()), (t, h, err, np.abs(ref[t, h]).max())


def assert_attention(case, got_bits):
    """The reference within ``rel_l2 <= 4e-3`` of float64 (its bf16 output rounding), and ``got`` near it."""
    ref = case.reference()
    want = case.float64()
    assert rel_l2(from_bf16_bits(ref), want) <= 4e-3, rel_l2(from_bf16_bits(ref), want)
    assert_near_reference(got_bits, ref)


# ------------------------------------------------------------------------------------------------ reference kernel
@pytest.mark.parametrize("head_dim,gate", [(16, False), (32, True)])
def test_reference_against_float64(rng, head_dim, gate):
    """The reference kernel: two slots (one at length 10 across three pages, one at length 1), a padding token
    (zeros), gated and not: within its bf16 output rounding of float64 attention, every row."""
    case = Case(rng, 4, 2, head_dim, slots=[1, -1, 0], positions=[9, 0, 0], gate=gate)
    ref = from_bf16_bits(case.reference()).astype(np.float64)
    want = case.float64()
    assert not ref[1].any()
    for t in (0, 2):
        assert rel_l2(ref[t], want[t]) <= 4e-3, t
        for h in range(4):   # the bf16 rounding of the output and of the probabilities: ~2 bf16 steps at most
            assert np.abs(ref[t, h] - want[t, h]).max() <= 2 * bf16_step(np.abs(want[t, h]).max()), (t, h)


# ------------------------------------------------------------------------------------------------ both paths
METHODS = ["split", "prefill"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("head_dim", [16, 32])
def test_decode_two_slots(rng, head_dim, method):
    """T=2 tokens of two slots: one at length 10 (crosses two page boundaries), one at length 1."""
    case = Case(rng, 4, 2, head_dim, slots=[1, 0], positions=[9, 0])
    assert_attention(case, case.run(method=method))


@pytest.mark.parametrize("method", METHODS)
def test_prefill_causal(rng, method):
    """T=7 tokens of one slot at positions 0..6: each attends only to keys up to its own position."""
    case = Case(rng, 4, 2, 32, slots=[0] * 7, positions=list(range(7)))
    assert_attention(case, case.run(method=method))


@pytest.mark.parametrize("method", METHODS)
def test_prefix_plus_chunk(rng, method):
    """A chunk at positions 5..9 whose prefix (keys 0..4) was written by an earlier step."""
    case = Case(rng, 4, 2, 16, slots=[1] * 5, positions=list(range(5, 10)))
    assert_attention(case, case.run(method=method))


@pytest.mark.parametrize("method", METHODS)
def test_padding_tokens(rng, method):
    """Tokens with ``token_slots[t] < 0`` (padding of a fixed-size batch) get zeros and read no block table row;
    the real tokens around them are unaffected.  The padding rows of ``out`` start as garbage."""
    case = Case(rng, 4, 2, 16, slots=[0, 0, -1, 1, -1, -1], positions=[3, 4, 0, 9, 10 ** 6, 0])  # nonsense position
    out = cuda.to_device(np.full(case.shape, 0x3F80, np.uint16))   # 1.0 everywhere
    paged_attention(*case.dev, out, case.scale, case.workspace(3), method=method,
                    **(dict(num_splits=3, min_split_tokens=4) if method == "split" else {}))
    got = out.copy_to_host()
    assert not got[[2, 4, 5]].any()
    assert_attention(case, got)


def test_auto_method_picks_prefill_from_the_threshold(rng, monkeypatch):
    """``method="auto"``: split-K below ``PREFILL_MIN_TOKENS`` tokens, the tiled kernel from there up."""
    calls = []
    monkeypatch.setattr(attention, "paged_attention_prefill", lambda *a, **k: calls.append("prefill"))
    monkeypatch.setattr(attention, "paged_attention_split", lambda *a, **k: calls.append("split"))
    for T in (attention.PREFILL_MIN_TOKENS - 1, attention.PREFILL_MIN_TOKENS):
        q = cuda.device_array((T, 4, 16), np.uint16)
        cache = cuda.device_array((4, PAGE, 2, 16), np.uint16)
        i32 = cuda.to_device(np.zeros(T, np.int32))
        paged_attention(q, cache, cache, cuda.to_device(np.zeros((1, 4), np.int32)), i32, i32, q, 0.25, None)
    assert calls == ["split", "prefill"]


def test_a_decode_step_of_many_sequences_takes_split_k(monkeypatch):
    """A decode step of ``PREFILL_MIN_TOKENS`` sequences or more (batched decode at 128+ streams) is one query per
    sequence: split-K, never the tiled prompt kernel (which spent ~0.5 ms a layer on a 256-sequence step); a mixed
    step's decodes too, its chunks by their own count."""
    calls = []
    monkeypatch.setattr(attention, "paged_attention_prefill", lambda q, *a, **k: calls.append(("prefill", len(q))))
    monkeypatch.setattr(attention, "paged_attention_split", lambda q, *a, **k: calls.append(("split", len(q))))
    T = 2 * attention.PREFILL_MIN_TOKENS
    q = cuda.device_array((T, 4, 16), np.uint16)
    cache = cuda.device_array((4, PAGE, 2, 16), np.uint16)
    i32 = cuda.to_device(np.zeros(T, np.int32))
    tables = cuda.to_device(np.zeros((1, 4), np.int32))
    paged_attention(q, cache, cache, tables, i32, i32, q, 0.25, None, decode=True)
    paged_attention(q, cache, cache, tables, i32, i32, q, 0.25, None, num_decode=T - attention.PREFILL_MIN_TOKENS)
    assert calls == [("split", T), ("split", T - attention.PREFILL_MIN_TOKENS),
                     ("prefill", attention.PREFILL_MIN_TOKENS)]


# ------------------------------------------------------------------------------------------------ tiled prefill
def test_prefill_mixed_tile(rng):
    """The tiled kernel with a tile holding runs of two slots and a decode token (runs 2 + 1 + 5 tokens, then a
    second, partial tile): rows of one run must ignore the other runs' keys."""
    case = Case(rng, 4, 2, 16, slots=[0, 0, 1, 0, 0, 0, 0, 0, 1, 1], positions=[3, 4, 17, 0, 1, 2, 3, 4, 18, 19])
    assert_attention(case, case.run(method="prefill"))


LONG_CHUNK = dict(slots=[1] * 11, positions=list(range(16, 27)), max_pages=7, num_pages=15)
"""11 tokens after a 16-token prefix: in the simulator's tiled geometry (8 tokens x 2 heads per tile, 16-key tiles)
the first token tile has a fully visible key tile (no mask) and a causal one, the second is partial."""


def test_long_chunk(rng):
    case = Case(rng, 4, 2, 32, **LONG_CHUNK)
    assert_attention(case, case.run(method="prefill"))


def run_prefill(case, geometry):
    """bf16 bits of the tiled kernel alone, forced to ``geometry``."""
    return case.run(paged_attention_prefill, with_workspace=False, geometry=geometry)


DEEP_RING = PrefillGeometry(warps=1, m_tiles=2, block_keys=16, stages=3)
"""Two m16 tiles a warp (32 rows) and a ring of three 16-key stages: two tiles in flight while one is computed."""


@pytest.mark.parametrize("geometry", [DEEP_RING, PrefillGeometry(warps=2, m_tiles=1, block_keys=32, stages=2)],
                         ids=["2m16-3stages", "2warps-32keys"])
def test_prefill_geometries_after_a_prefix(rng, geometry):
    """A 13-token chunk after a 37-token prefix (up to four key tiles, the last crossing the diagonal) with the
    ring deeper than two stages, two m16 tiles a warp, two warps sharing the copies, 32-key tiles."""
    case = Case(rng, 4, 2, 32, slots=[1] * 13, positions=list(range(37, 50)), max_pages=13, num_pages=29)
    assert_attention(case, run_prefill(case, geometry))


def test_prefill_head_dim_256(rng):
    """Qwen3.5's 256-dim heads (32 chunks a row, the swizzle over 8 of them), GQA 2, a chunk after a prefix that
    crosses a key-tile boundary."""
    case = Case(rng, 4, 2, 256, slots=[0] * 3, positions=[15, 16, 17], max_pages=5, num_pages=11)
    assert_attention(case, case.run(method="prefill"))


@pytest.mark.parametrize("nq,nkv", [(2, 2), (8, 2), (16, 1)], ids=["G1", "G4", "G16"])
def test_prefill_gqa_groups(rng, nq, nkv):
    """Every group size that divides the tile's rows: 1 (16 tokens a tile), 4, 16 (one token a tile, all its heads
    on one kv head)."""
    case = Case(rng, nq, nkv, 16, slots=[0] * 6 + [1] * 4, positions=list(range(3, 9)) + list(range(8, 12)),
                num_pages=17)
    assert_attention(case, case.run(method="prefill"))


def test_prefill_several_slots_and_padding_in_one_chunk(rng):
    """One chunk of three sequences with cached prefixes of different lengths (two in the same tile, one crossing
    into the next) and padding tokens between and after them (a fixed-size batch): each run sees only its slot's
    keys, the padding rows get zeros."""
    slots = [2, 2, 2, -1, 0, 0, 0, 0, 0, -1, 1, 1, 1, 1, -1, -1]
    positions = [9, 10, 11, 0, 20, 21, 22, 23, 24, 7, 0, 1, 2, 3, 0, 5]
    case = Case(rng, 4, 2, 32, slots=slots, positions=positions, num_slots=3, max_pages=7, num_pages=23)
    out = cuda.to_device(np.full(case.shape, 0x3F80, np.uint16))       # 1.0 everywhere: padding must be cleared
    paged_attention_prefill(*case.dev, out, case.scale, geometry=DEEP_RING)
    got = out.copy_to_host()
    assert not got[[3, 9, 14, 15]].any()
    assert_attention(case, got)


def test_prefill_running_max_jumps(rng):
    """Keys whose pages are scaled by 1 .. 2^6 (exact in bf16): scores jump by far more than the kernel's rescale
    threshold between key tiles, so rows rescale O mid-sequence as well as taking probabilities above 1 against an
    older base."""
    case = Case(rng, 4, 2, 32, slots=[0] * 12, positions=list(range(50, 62)), max_pages=16, num_pages=33)
    case.k = case.k * (2.0 ** rng.integers(0, 7, size=case.k.shape[0]))[:, None, None, None]
    case.k_bits = to_bf16_bits(case.k.astype(np.float32))
    case.dev[1] = cuda.to_device(case.k_bits)
    assert_attention(case, run_prefill(case, DEEP_RING))


def test_prefill_then_gate_kernel(rng):
    """Gated prompt chunks: the tiled kernel followed by ``sigmoid_gate_mul`` (its rounding is the reference's)."""
    case = Case(rng, 4, 2, 16, slots=[1] * 5, positions=list(range(5, 10)), gate=True)
    assert_attention(case, case.run(method="prefill"))


def test_prefill_tile_errors(rng):
    """A forced tile that is not one (keys not a multiple of 16, one stage), cannot hold whole tokens of the group,
    or needs more shared memory than a block gets: one ValueError naming the fix."""
    case = Case(rng, 6, 2, 16, slots=[0] * 2, positions=[0, 1])          # G = 3 does not divide 16 rows
    with pytest.raises(ValueError, match="divide"):
        run_prefill(case, PrefillGeometry(1, 1, 16, 2))
    for bad in (PrefillGeometry(1, 1, 24, 2), PrefillGeometry(1, 1, 16, 1)):
        with pytest.raises(ValueError, match="multiple of 16"):
            run_prefill(case, bad)
    case = Case(rng, 4, 2, 256, slots=[0] * 2, positions=[0, 1])
    with pytest.raises(ValueError, match="shared memory"):
        run_prefill(case, PrefillGeometry(8, 1, 256, 4))


# ------------------------------------------------------------------------------------------------ host helpers
def test_workspace_holds_every_launch_and_the_counters():
    """``attention_workspace_size``: the partials of the largest launch up to ``max_tokens`` plus one counter per
    (token, q head); a launch with one split needs none."""
    from pegainfer.kernels.attention.workspace import workspace_parts

    assert workspace_parts(3, 4, 16, 1) == (0, 0)
    assert workspace_parts(3, 4, 16, 5) == (3 * 4 * 5 * 16, 3 * 4 * 5)
    assert attention_workspace_size(3, 4, 16, 64, nkv=2, num_splits=5) == 3 * 4 * 5 * (16 + 2) + 3 * 4
    split_counts = [attention.attention_num_splits(t, 1, 1024, 128) for t in (1, 2, 3)]
    want = max(t * 4 * s * (128 + 2) for t, s in zip((1, 2, 3), split_counts))
    assert attention_workspace_size(3, 4, 128, 1024, nkv=1) == want + 3 * 4


def test_split_counts_fill_the_gpu_within_the_context(monkeypatch):
    """``attention_num_splits``: blocks within one wave (one a block an SM, or the walking grid's), at most one
    ``min_chunk``-key split per ``max_model_len`` and ``MAX_SPLITS``; 256-dim heads split every 64 keys.  Counted
    for an H200's 132 SMs."""
    import pegainfer.kernels.attention.geometry as geometry
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    splits = attention.attention_num_splits
    assert splits(1, 8, 32768, 128) == 16               # Qwen3-4B, one sequence: 128 blocks of 8 warps
    assert splits(1, 8, 1024, 128) == 4                 # 1024 / 256 keys
    assert splits(1, 4, 1024, 256) == 16                # 1024 / 64 keys
    assert splits(1, 4, 32768, 256) == 33               # Qwen3.5-4B's full attention, one sequence
    assert splits(4, 8, 32768, 128) == 4                # four sequences: 128 blocks
    assert splits(16, 8, 32768, 128) == 2               # 128 items walked by two blocks an SM
    assert splits(64, 4, 32768, 256) == 1               # a batched step of wide heads
    assert splits(64, 8, 32768, 128) == 1
    monkeypatch.setattr(geometry, "sm_count", lambda: 1024)
    assert splits(1, 1, 10 ** 6, 16) == attention.MAX_SPLITS
    assert attention.min_chunk(None, 128) == 256 and attention.min_chunk(None, 256) == 64
    assert attention.min_chunk(0, 128) == 1 and attention.min_chunk(4, 256) == 4


def test_geometries():
    """The split-K block (pairs over the dims for heads wider than 128) and the prefill tile: 128 rows on the GPU
    (two m16 tiles a warp at D = 128, one at 256), one warp in the simulator, a policy's ``tuned("prefill")`` entry
    over both; whether a group fits the tile."""
    from pegainfer.device import SIMULATOR
    from pegainfer.kernels.policy import LaunchPolicy, TuningEntry

    assert attention.split_geometry(256, 4).dim_split and not attention.split_geometry(128, 4).dim_split
    assert attention.split_geometry(128, 4).warps == (1 if SIMULATOR else 8)          # one sequence: long splits
    assert attention.split_geometry(128, 4, attention.BATCHED_SPLIT_ITEMS).warps == (1 if SIMULATOR else 4)
    assert attention.split_geometry(256, 4).warps == (2 if SIMULATOR else attention.DIM_SPLIT_WARPS)
    for D in (128, 256):
        geo = attention.prefill_geometry(D, 4)
        assert geo.rows == (16 if SIMULATOR else 128)
        assert geo.shared_bytes(D) == 2 * D * (geo.rows + 2 * geo.stages * geo.block_keys)
    if not SIMULATOR:
        assert attention.prefill_geometry(128, 4).m_tiles == 2 and attention.prefill_geometry(256, 4).m_tiles == 1
    tuned = PrefillGeometry(warps=2, m_tiles=2, block_keys=32, stages=3)
    policy = LaunchPolicy(tuning=(TuningEntry("prefill", (128, 4), tuple(sorted(tuned._asdict().items()))),))
    assert attention.prefill_geometry(128, 4, policy) == tuned
    assert attention.prefill_geometry(128, 2, policy) == attention.prefill_geometry(128, 2)
    assert attention.prefill_supported(4) and attention.prefill_supported(16) and not attention.prefill_supported(3)


# ------------------------------------------------------------------------------------------------ GPU shapes
@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("nq,nkv,head_dim,gate", [(32, 8, 128, False), (16, 4, 256, True)])
def test_gpu_prefill(nq, nkv, head_dim, gate, method):
    """A 300-token chunk after a 100-token prefix, one slot, real shapes (and a few rows checked one by one)."""
    case = Case(np.random.default_rng(8), nq, nkv, head_dim, slots=[1] * 300, positions=list(range(100, 400)),
                num_slots=2, max_pages=32, num_pages=67, page_size=16, gate=gate)
    got, ref = case.run(method=method), case.reference()
    assert rel_l2(from_bf16_bits(ref), case.float64()) <= 4e-3
    assert_near_reference(got, ref, rows=(0, 1, 63, 64, 299))
