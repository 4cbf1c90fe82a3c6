"""Launch geometries of the projection kernels: how a GEMV, a skinny tensor-core or a tensor-core GEMM launch
splits a weight over warps, blocks and K, per shape.

Each picker looks first at the launch policy's measured entries for this GPU (``policy.tuned("gemv")`` /
``policy.tuned("skinny")`` / ``policy.tuned("mma")`` / ``policy.tuned("wgmma")``, read from a tuning file by ``policy.load_tuning``), then at the
built-in tables measured on the H200 (``GEMV_TUNED``, ``SKINNY_TUNED``, ``MMA_TUNED``; read-only), then falls back to
a heuristic.  In the simulator the built-in tables and the heuristic give way to small blocks (one Python thread per
CUDA thread).  (``load_tuning`` reads every kind from a file: the command line's ``--launch-policy tuning=FILE``.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

from pegainfer.device import SIMULATOR
from pegainfer.kernels import norm
from pegainfer.kernels.linear.common import SMEM_BYTES, WARPS_PER_SM, sm_count
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import WARP, grid

GEMV_MAX_TOKENS = 8
"""Largest token count the GEMV path takes in one pass; above it (``linear(impl=None)``) the GEMM."""

SKINNY_MAX_TOKENS = 16
"""Largest token count of the skinny path (one m16 tile of tokens per warp); above it the tensor-core GEMM, which
streams the weight through shared memory, is faster on every served shape (docs/perf/linear.md)."""

NORM_THREADS = norm.BLOCK_THREADS
"""Block size of ``norm``'s kernels (256 on a GPU, 32 in the simulator).  The one-token GEMV with the fused add +
RMSNorm prologue runs in blocks of exactly this size, so that its sum of squares is added in the same order as
``norm.add_rms_norm``'s."""


@dataclass(frozen=True)
class GemvGeometry:
    """Launch parameters of the GEMV.

    rows_per_warp: weight rows a warp streams together (loads in flight per lane; x reuse).  Even when gated.
    warps: warps per block (a multiple of ``k_split``).
    k_split: warps that share one row group, each taking every ``k_split``-th 256-wide slice of K.
    max_tokens: tokens per pass (1, 2, 4 or 8; a compile-time register tile).
    k_chunk: elements of K staged in shared memory at a time (a multiple of 256); None: as many as fit.
    stage_x: stage x in shared memory (as f32, once per block and chunk: two barriers); False: every lane reads
      its 16 bytes of x per token beside its weight loads (L1 hits; no staging prologue, no barrier in the K loop).
    stages: depth of the load ring (``stages - 1`` steps of loads in flight per lane; 2 = one step ahead).
    persistent: launch at most one resident wave of blocks (``WARPS_PER_SM // warps`` per SM) that grid-stride over
      the tiles, instead of one block per tile (x is then staged once per block, and no block waits for a slot).
    """
    rows_per_warp: int
    warps: int
    k_split: int
    max_tokens: int
    k_chunk: int | None = None
    stage_x: bool = True
    stages: int = 2
    persistent: bool = False


@dataclass(frozen=True)
class SkinnyGeometry:
    """Launch parameters of the skinny tensor-core kernel (few tokens, weights streamed into mma fragments).

    n_tiles: n8 tiles (8 logical columns each) per warp: weight rows a warp streams together.
    unroll: 32-wide K chunks whose loads a lane issues before the first mma (16 bytes per row per chunk).
    warps: warps per block (a multiple of ``k_split``).
    k_split: warps that share one row group, each taking every ``k_split``-th run of ``unroll`` chunks of K; their
      accumulators meet in shared memory.
    warps_per_sm: occupancy the kernel is compiled for (launch bounds: 65536 / (32 · warps_per_sm) registers).
    stages: iterations of loads held in a register ring: 1 = an iteration's loads, then its mma; S > 1 = the loads
      of the next S - 1 iterations are in flight while an iteration's mma runs (S times the registers).
    """
    n_tiles: int
    unroll: int
    warps: int
    k_split: int
    warps_per_sm: int = 16
    stages: int = 1


def _tuned_t1(rows_per_warp: int, warps: int, k_split: int, stages: int) -> GemvGeometry:
    return GemvGeometry(rows_per_warp=rows_per_warp, warps=warps, k_split=k_split, max_tokens=1, stages=stages,
                        persistent=True)


GEMV_TUNED = MappingProxyType({
    # One-token kernel on the H200 with cold weights (benchmarks/bench_gemv.py --cold, docs/perf/linear.md)
    # Qwen3-4B
    (6144, 2560, 1, False): _tuned_t1(4, 8, 1, 3),     # qkv
    (2560, 4096, 1, False): _tuned_t1(2, 4, 4, 6),     # o (also Qwen3.5-4B's o and out_proj)
    (19456, 2560, 1, True): _tuned_t1(2, 8, 1, 6),     # gate_up
    (2560, 9728, 1, False): _tuned_t1(2, 8, 8, 6),     # down
    (151936, 2560, 1, False): _tuned_t1(4, 8, 1, 4),   # lm_head
    # Qwen3-8B (hidden 4096, q 4096, kv 1024, intermediate 12288)
    (6144, 4096, 1, False): _tuned_t1(2, 8, 2, 6),     # qkv
    (4096, 4096, 1, False): _tuned_t1(4, 8, 2, 3),     # o
    (24576, 4096, 1, True): _tuned_t1(4, 8, 1, 4),     # gate_up
    (4096, 12288, 1, False): _tuned_t1(4, 8, 4, 3),    # down
    (151936, 4096, 1, False): _tuned_t1(4, 8, 1, 4),   # lm_head (by analogy)
    # Qwen3.5-4B (hidden 2560, intermediate 9216; Gated DeltaNet in_proj 12352 rows, gated full-attention qkv 10240)
    (12352, 2560, 1, False): _tuned_t1(4, 8, 2, 4),    # in_proj
    (10240, 2560, 1, False): _tuned_t1(2, 8, 1, 6),    # qkv
    (18432, 2560, 1, True): _tuned_t1(2, 8, 1, 6),     # gate_up
    (2560, 9216, 1, False): _tuned_t1(2, 8, 8, 6),     # down
})
"""Measured best GEMV geometries on the H200, ``(n_cols, K, max_tokens, gated) -> GemvGeometry`` (read-only; a
policy's tuning entries override them)."""

SKINNY_TUNED = MappingProxyType({
    # Qwen3-4B gate_up at T <= 16 on the H200 with cold weights (docs/perf/linear.md); for qkv, o and down no swept
    # geometry beat the heuristic's.
    (19456, 2560, 1, True): SkinnyGeometry(n_tiles=2, unroll=2, warps=8, k_split=1, stages=2),
    # Qwen3-8B and Qwen3.5-4B gate_up: the same geometry by analogy (not swept)
    (24576, 4096, 1, True): SkinnyGeometry(n_tiles=2, unroll=2, warps=8, k_split=1, stages=2),
    (18432, 2560, 1, True): SkinnyGeometry(n_tiles=2, unroll=2, warps=8, k_split=1, stages=2),
})
"""Measured best skinny geometries on the H200, ``(n_cols, K, 1, gated) -> SkinnyGeometry`` (the 1: one m16 tile of
tokens; read-only, a policy's tuning entries override them)."""


def _token_tile(n_tokens: int) -> int:
    for tt in (1, 2, 4):
        if n_tokens <= tt:
            return tt
    return GEMV_MAX_TOKENS


def gemv_geometry(n_cols: int, k: int, n_tokens: int, gated: bool = False,
                  policy: LaunchPolicy = DEFAULT_POLICY) -> GemvGeometry:
    """Pick the GEMV split for a ``[n_cols, k]`` weight (n_cols logical columns: 2I when gated).

    ``policy``'s tuning entries first, then ``GEMV_TUNED``, then the heuristic: blocks of 8 warps, compiled for
    ``WARPS_PER_SM`` = 16 resident warps per SM.  Each warp streams 4 rows (2 when the 8-token register tile would
    not fit in 128 registers) through a load ring 3 steps deep for one token (2 otherwise).  Then ``k_split``
    doubles (while every warp keeps at least 4 steps of 256 elements) until there are enough warps to fill every SM
    once: tall matrices (gate_up, lm_head) need no split; on 132 SMs the Qwen3-4B qkv (6144×2560) gets k_split 2,
    o (2560×4096) and down (2560×9728) get 4.  A tall one-token matrix that needs no split and is not an LM head
    (under 65536 columns) takes 2 rows per warp and a ring 6 deep instead (faster on the H200 for every such
    served shape: docs/perf/linear.md).
    """
    tt = _token_tile(n_tokens)
    key = (n_cols, k, tt, gated)
    tuned = policy.tuned("gemv").get(key)
    if tuned is not None:
        return GemvGeometry(**tuned)
    if SIMULATOR:                                  # small blocks: one Python thread per CUDA thread
        return GemvGeometry(rows_per_warp=16, warps=1, k_split=1, max_tokens=tt)
    if key in GEMV_TUNED:
        return GEMV_TUNED[key]
    rows = 4 if tt <= 2 else 2
    slots = WARPS_PER_SM * sm_count()
    k_split = 1
    while (n_cols // rows) * k_split < slots and k_split < 8 and k >= 2048 * k_split:
        k_split *= 2
    if tt == 1 and k_split == 1 and n_cols < 65536:
        return GemvGeometry(rows_per_warp=2, warps=8, k_split=1, max_tokens=1, stages=6, persistent=True)
    return GemvGeometry(rows_per_warp=rows, warps=8, k_split=k_split, max_tokens=tt, stages=3 if tt == 1 else 2,
                        persistent=tt == 1)


def fused_norm_geometry(n_cols: int, k: int, gated: bool = False,
                        policy: LaunchPolicy = DEFAULT_POLICY) -> GemvGeometry:
    """GEMV geometry of the fused add + RMSNorm path (one token): ``gemv_geometry``'s rows per warp, split and load
    ring depth, in blocks of ``NORM_THREADS`` (the prologue's sum of squares then runs in norm's order), x staged
    (the prologue writes it), ``k_split`` reduced until it divides the block's warps."""
    geo = gemv_geometry(n_cols, k, 1, gated, policy)
    warps = NORM_THREADS // WARP
    k_split = geo.k_split
    while warps % k_split:
        k_split //= 2
    return GemvGeometry(rows_per_warp=geo.rows_per_warp, warps=warps, k_split=k_split, max_tokens=1,
                        stages=geo.stages, persistent=True)


def gemv_k_chunk(k: int, geo: GemvGeometry) -> int:
    """Elements of K the multi-token GEMV stages at a time: ``geo.k_chunk``, or the largest multiple of 256 whose
    x (f32, ``max_tokens`` rows) fits in shared memory beside the partial sums; never more than K rounded up to
    256."""
    if geo.k_chunk is not None:
        assert geo.k_chunk % 256 == 0, "k_chunk must be a multiple of 256"
        return geo.k_chunk
    red = geo.warps * geo.rows_per_warp * geo.max_tokens
    fit = (SMEM_BYTES // 4 - red) // geo.max_tokens // 256 * 256
    return max(256, min(fit, -(-k // 256) * 256))


def resident_blocks(n_tiles: int, geo: GemvGeometry) -> int:
    """Grid of a persistent GEMV: at most one resident wave of blocks (``WARPS_PER_SM // warps`` per SM), which then
    grid-stride over the tiles.  The fused GEMV always launches so, so that the norm prologue (a whole-row pass and
    a block reduction) runs once per block rather than once per tile."""
    resident = sm_count() * max(1, WARPS_PER_SM // geo.warps)
    # every block the same number of tiles: 608 tiles on 264 resident blocks would leave 80 blocks a third tile to
    # stream alone (a tail at a third of the bandwidth); 203 blocks of 3 tiles finish together
    resident = -(-n_tiles // -(-n_tiles // resident))
    return grid(min(n_tiles, resident), sim_cap=2)


def skinny_geometry(n_cols: int, k: int, n_tokens: int, gated: bool = False,
                    policy: LaunchPolicy = DEFAULT_POLICY) -> SkinnyGeometry:
    """Pick the skinny kernel's split for a ``[n_cols, k]`` weight (logical columns: 2I when gated) and T <= 16
    tokens (one m16 tile: tuning keys carry ``m_tiles`` = 1).

    ``policy``'s tuning entries first, then ``SKINNY_TUNED``, then the heuristic: per lane, as many 16-byte weight
    loads in flight as fit in the 128 registers of 16 warps/SM without spills (ptxas, sm_90): 2 n8 tiles × 4
    chunks.  Then ``k_split`` doubles (up to 8, while every warp keeps >= 4 iterations of K) until the grid has a
    warp for each of the 16 slots of every SM: the short matrices (o, down: 2560 rows = 160 row groups) need
    k_split 8.
    """
    key = (n_cols, k, 1, gated)
    tuned = policy.tuned("skinny").get(key)
    if tuned is not None:
        return SkinnyGeometry(**tuned)
    if SIMULATOR:
        return SkinnyGeometry(n_tiles=2, unroll=1, warps=2, k_split=2 if k >= 128 else 1)
    if key in SKINNY_TUNED:
        return SKINNY_TUNED[key]
    nt, unroll = 2, 4
    target = 16 * sm_count()
    groups = -(-n_cols // (8 * nt))
    k_split = 1
    while groups * k_split < target and k_split < 8 and k // (32 * unroll * 2 * k_split) >= 4:
        k_split *= 2
    return SkinnyGeometry(n_tiles=nt, unroll=unroll, warps=8, k_split=k_split)


# ------------------------------------------------------------------------------------------------ tensor-core GEMM
@dataclass(frozen=True)
class MmaGeometry:
    """Launch parameters of the tensor-core GEMM (``gemm.gemm_mma``).

    warps_m × warps_n: warps per block; each owns mt × nt m16n8 accumulator tiles, so a block tile is
      ``bm = 16·warps_m·mt`` tokens × ``bn = 8·warps_n·nt`` logical columns.
    stages: depth of the shared-memory ring of 32-wide K tiles of x and W (``stages - 1`` in flight).
    k_splits: blocks that share one output tile, each over its own range of K (split-K, ``splitk``); 1 = none.
    warps_per_sm: occupancy the kernel is compiled for (launch bounds: 65536 / (32 · warps_per_sm) registers).
    """
    warps_m: int
    warps_n: int
    mt: int
    nt: int
    stages: int = 4
    k_splits: int = 1
    warps_per_sm: int = WARPS_PER_SM

    @property
    def bm(self) -> int:
        return 16 * self.warps_m * self.mt

    @property
    def bn(self) -> int:
        return 8 * self.warps_n * self.nt

    @property
    def threads(self) -> int:
        return WARP * self.warps_m * self.warps_n

    @property
    def stage_bytes(self) -> int:
        """One stage of the ring: x ``[bm, 32]`` and W ``[bn, 32]`` bf16."""
        return 64 * (self.bm + self.bn)

    @property
    def shared_bytes(self) -> int:
        """The ring's ``stages`` stages, then 16 bytes holding the split-K flag."""
        return self.stages * self.stage_bytes + 16


def mma_units(geo: MmaGeometry, n_tokens: int, n_cols: int) -> int:
    """Work units of a launch: token tiles × column tiles × K splits (blocks grid-stride over them)."""
    return -(-n_tokens // geo.bm) * -(-n_cols // geo.bn) * geo.k_splits


def mma_token_tile(n_tokens: int) -> int:
    """The token count a tuned GEMM geometry is keyed by: the next power of two >= T, at least 16 (one m16 tile)."""
    t = 16
    while t < n_tokens:
        t *= 2
    return t


MMA_SPLIT_MAX_TOKENS = 256
"""Largest T whose heuristic geometry may split K: up to here the GEMM streams the weight (few tokens, few tiles);
above, a prompt has tiles enough to fill the GPU."""


def _mma(warps_m: int, warps_n: int, mt: int, nt: int, k_splits: int, stages: int = 4) -> MmaGeometry:
    return MmaGeometry(warps_m=warps_m, warps_n=warps_n, mt=mt, nt=nt, stages=stages, k_splits=k_splits)


MMA_TUNED = MappingProxyType({
    # Cold weights on the H200 (benchmarks/bench_gemm.py --sweep, docs/perf/linear.md): the shapes and token tiles
    # where the sweep's best beat the heuristic's geometry by more than 3 % (µs per launch: best / heuristic)
    (19456, 2560, 32, True): _mma(1, 4, 2, 2, k_splits=3, stages=8),    # Qwen3-4B gate_up: 43.6 / 45.6
    (18432, 2560, 32, True): _mma(1, 4, 2, 2, k_splits=3, stages=8),    # Qwen3.5-4B gate_up: 42.2 / 44.3
    (6144, 2560, 128, False): _mma(4, 2, 2, 4, k_splits=2),             # Qwen3-4B qkv: 34.2 / 35.3
    (6144, 4096, 128, False): _mma(2, 2, 4, 4, k_splits=4),             # Qwen3-8B qkv: 44.1 / 48.3
    (10240, 2560, 128, False): _mma(2, 2, 4, 4, k_splits=2),            # Qwen3.5-4B qkv: 50.0 / 53.8
    (12352, 2560, 128, False): _mma(2, 2, 4, 4, k_splits=2),            # Qwen3.5-4B in_proj: 51.6 / 54.3
    (10240, 2560, 256, False): _mma(2, 4, 4, 4, k_splits=2),            # Qwen3.5-4B qkv: 74.4 / 83.7
    (4096, 12288, 256, False): _mma(2, 4, 4, 4, k_splits=4),            # Qwen3-8B down: 101.3 / 112.4
})
"""Measured best tensor-core GEMM geometries on the H200, ``(n_cols, K, mma_token_tile(T), gated) ->
MmaGeometry`` (read-only; a policy's ``tuned("mma")`` entries override them)."""


def best_k_splits(tiles: int, k: int, n_tokens: int, max_splits: int = 16, k_tile: int = 32) -> int:
    """K splits for a launch of ``tiles`` output tiles (1 .. ``max_splits``, every split at least 4 K tiles of
    ``k_tile``).  Up to 128 tokens the GEMM streams the weight, and about two units a SM (every one resident at once)
    streamed fastest on the H200: o / down of the 4B models (40 tiles of 64 columns) take 6, 4096-row weights (64
    tiles) 4, weights of 160 tiles and more none.  Above, the arithmetic is the bottleneck and the units fill one
    balanced wave (at most one a SM)."""
    sms = sm_count()
    if n_tokens <= 128:
        splits = 2 * sms // tiles
    else:
        splits = sms // tiles
    return max(1, min(splits, max_splits, -(-k // k_tile) // 4))


def mma_geometry(n_cols: int, k: int, n_tokens: int, gated: bool = False,
                 policy: LaunchPolicy = DEFAULT_POLICY) -> MmaGeometry:
    """Pick the tensor-core GEMM's geometry for T tokens over a ``[n_cols, k]`` weight (logical columns: 2I gated).

    ``policy``'s ``tuned("mma")`` entries first, then ``MMA_TUNED``, then the heuristic (the tiles that won every
    served shape's sweep on the H200 but the LM heads at 128 tokens: docs/perf/linear.md):

    * T <= 64: one warp row holding all T tokens (``mma_token_tile(T) / 16`` m16 tiles) × 4 warps of 16 columns
      (64-column tiles), a ring of 8 stages (6 for 64 tokens), split-K by ``best_k_splits``.
    * 64 < T <= 128: 128 × 64 tiles, of 8 warps (32 × 32 each) for weights of up to 4096 rows, of 4 (64 × 32) up to
      65536 rows, and 128 × 128 tiles of 8 warps above; a ring of 4; split-K by ``best_k_splits``.
    * 128 < T <= 256: 128 × 128 tiles of 8 warps, a ring of 4, split-K into one balanced wave.
    * prompts: 128 × 128 tiles of 8 warps (64 × 32 per warp) for wide weights (n_cols >= 6144, T >= 128) and long
      prompts (T >= 1024), 64 × 128 (32 × 32 per warp) otherwise, where 128 × 128 tiles would leave SMs idle; a
      ring of 4 stages (deeper was slower: docs/perf/linear.md).

    In the simulator: one-warp blocks of 16 × 16 tiles, a ring of 3, split in two when K has 4 tiles or more.
    """
    key = (n_cols, k, mma_token_tile(n_tokens), gated)
    tuned = policy.tuned("mma").get(key)
    if tuned is not None:
        return MmaGeometry(**tuned)
    if SIMULATOR:
        return MmaGeometry(warps_m=1, warps_n=1, mt=1, nt=2, stages=3, k_splits=2 if k >= 128 else 1)
    if key in MMA_TUNED:
        return MMA_TUNED[key]
    tile = mma_token_tile(n_tokens)
    if tile <= 64:
        geo = MmaGeometry(warps_m=1, warps_n=4, mt=tile // 16, nt=2, stages=6 if tile == 64 else 8)
    elif tile == 128 and n_cols <= 4096:
        geo = MmaGeometry(warps_m=4, warps_n=2, mt=2, nt=4)
    elif tile == 128 and n_cols < 65536:
        geo = MmaGeometry(warps_m=2, warps_n=2, mt=4, nt=4)
    elif n_tokens <= MMA_SPLIT_MAX_TOKENS or (n_cols >= 6144 and n_tokens >= 128) or n_tokens >= 1024:
        geo = MmaGeometry(warps_m=2, warps_n=4, mt=4, nt=4)
    else:
        geo = MmaGeometry(warps_m=2, warps_n=4, mt=2, nt=4)
    splits = 1
    if n_tokens <= MMA_SPLIT_MAX_TOKENS:
        tiles = -(-n_tokens // geo.bm) * -(-n_cols // geo.bn)
        splits = best_k_splits(tiles, k, n_tokens, k_tile=64)
    return dataclasses.replace(geo, k_splits=splits)


@dataclass(frozen=True)
class WgmmaGeometry:
    """Launch parameters of the Hopper GEMM (``gemm_wgmma``).

    warpgroups: consumer warpgroups per block (128 threads each), stacked along tokens: ``bm = 64 · warpgroups``;
      one producer warp more issues the copies.
    bn: logical columns of the block tile, the ``wgmma`` n of every warpgroup: a multiple of 16 per warpgroup
      (every thread copies whole rows' chunks) from 32 to 256.
    stages: depth of the shared-memory ring of 64-wide K tiles of x and W (all of them may be in flight).
    k_splits: blocks that share one output tile, each over its own range of K (split-K, ``splitk``); 1 = none.
    warps_per_sm: occupancy the kernel is compiled for (launch bounds; 0: one block an SM).
    fill: how the ring is filled: "tma" (a producer warp's TMA copies, ``gemm_wgmma``) or "ring" (``cp.async`` from
      every thread, ``stages - 2`` K tiles ahead: ``gemm_wgmma_ring``, the faster at 17-64 tokens).
    persistent: the grid is one resident wave of blocks that walk the units, so a block's next unit starts filling
      the ring while its consumers store the last one (TMA: the producer runs ahead); False: a block a unit.
    """
    warpgroups: int
    bn: int
    stages: int = 4
    k_splits: int = 1
    warps_per_sm: int = 0
    fill: str = "tma"
    persistent: bool = False

    def __post_init__(self):
        if (self.warpgroups not in (1, 2) or not 32 <= self.bn <= 256 or self.bn % (16 * self.warpgroups)
                or self.stages < 3 or self.fill not in ("tma", "ring") or self.shared_bytes > WGMMA_SMEM_MAX):
            raise ValueError(f"unsupported wgmma geometry {self}")
        if self.warps_per_sm == 0:
            object.__setattr__(self, "warps_per_sm", self.threads // 32)

    @property
    def bm(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        """The consumer warpgroups, and the producer warp when TMA fills the ring."""
        return 128 * self.warpgroups + (32 if self.fill == "tma" else 0)

    @property
    def stage_bytes(self) -> int:
        """One stage of the ring: x ``[bm, 64]`` and W ``[bn, 64]`` bf16."""
        return 128 * (self.bm + self.bn)

    @property
    def shared_bytes(self) -> int:
        """1024 bytes of slack (the ring starts 1024-byte aligned), the ring, with TMA a full and an empty mbarrier
        per stage (8 bytes each), 16 bytes holding the split-K flag."""
        return 1024 + self.stages * (self.stage_bytes + (16 if self.fill == "tma" else 0)) + 16


WGMMA_SMEM_MAX = 227 * 1024
SM_SHARED_BYTES = 228 * 1024
"""Shared memory of one Hopper SM (each resident block also holds 1 KB the system reserves)."""


def resident_wave(geo: WgmmaGeometry) -> int:
    """Blocks of ``geo`` resident at once on the GPU (the ``wgmma`` GEMM's counterpart of ``resident_blocks``): per
    SM as many as its warps (``warps_per_sm``) and shared memory allow, at least one."""
    per_sm = min(max(1, geo.warps_per_sm * WARP // geo.threads),
                 max(1, SM_SHARED_BYTES // (geo.shared_bytes + 1024 + 128)))
    return sm_count() * per_sm


def _wave_splits(tiles: int, k: int) -> int:
    """K splits that bring ``tiles`` output tiles closest to one wave of one block an SM (each split at least 4 K
    tiles of 64)."""
    return max(1, min(sm_count() // tiles, -(-k // 64) // 4))


def _wave_geometry(n_cols: int, n_tokens: int, wide_stages: int) -> WgmmaGeometry:
    """Two warpgroups × 128 columns in a ring of 5, or 160-column tiles in a ring of ``wide_stages`` when their waves
    of one tile an SM take less time, counted as waves × columns (Qwen3-4B's gate_up at 256 tokens: 304 tiles of
    128 are 3 waves on 132 SMs, 244 of 160 are 2; its o at 2048 tokens: 320 tiles of 128 are 3 waves, 256 of 160
    are 2)."""
    def cost(bn: int) -> int:
        tiles = -(-n_tokens // 128) * -(-n_cols // bn)
        return -(-tiles // sm_count()) * bn
    if cost(160) < cost(128):
        return WgmmaGeometry(2, 160, stages=wide_stages)
    return WgmmaGeometry(2, 128, stages=5)


def _streamed_geometry(n_cols: int, n_tokens: int, gated: bool) -> WgmmaGeometry:
    """64 < T <= 256 (the weight streamed, K split after): 128-column tiles in a ring of 5; gate/up's 160 columns in
    a ring of 4 where they need fewer waves (``_wave_geometry``)."""
    return _wave_geometry(n_cols, n_tokens, wide_stages=4) if gated else WgmmaGeometry(2, 128, stages=5)


def wgmma_geometry(n_cols: int, k: int, n_tokens: int, gated: bool = False,
                   policy: LaunchPolicy = DEFAULT_POLICY) -> WgmmaGeometry:
    """Pick the Hopper GEMM's geometry for T tokens over a ``[n_cols, k]`` weight (logical columns: 2I gated):
    ``policy``'s ``tuned("wgmma")`` entries first, then the rules the H200 sweep of every served shape gave
    (docs/perf/linear.md):

    * T <= 64 (a weight stream): one warpgroup, the ring filled by every thread's ``cp.async`` (``fill`` "ring": TMA
      from a producer warp streamed 8-22 % slower here) but for the LM heads; weights of up to 4096 columns in
      64-column tiles, a ring of 8, split into about one wave; taller ones unsplit in one wave of tiles (``n_cols /
      SMs`` columns, 48 to 192, a multiple of 16: Qwen3's qkv 48), the LM heads in 192-column tiles; gate/up, and
      weights tall enough for two tiles of 48 columns an SM (Qwen3.5's in_proj and qkv), in two waves of half as
      wide tiles (48 to 96 columns: Qwen3-4B's gate_up 80), a ring of 6 (48 columns) or 5, two blocks an SM (the
      64-sequence step −4 to −5 %: one block's barriers and epilogue overlap the other's stream);
    * 64 < T <= 128: one warpgroup (two token tiles share each weight tile through L2) × 128 columns, a ring of 6,
      split into about one wave; two warpgroups × 128 columns, a ring of 5, from 16384 columns;
    * 128 < T <= 256: two warpgroups × 128 columns, a ring of 5, split into about one wave; the LM heads 256 columns,
      a ring of 4;
    * gate/up at 64 < T <= 256: 160-column tiles in a ring of 4 where they need fewer waves × columns than 128
      (Qwen3-4B's and Qwen3.5-4B's: the 256-sequence step −2.6 %);
    * prompts: two warpgroups; 256-column tiles in a ring of 4 for plain weights of 6144 columns and more; otherwise
      128 columns in a ring of 5, or 160 in a ring of 5 where they need fewer waves × columns (Qwen3-4B's o, down
      and gate_up at 2048 tokens: −17 %, −19 %, −6 %; short weights: more tiles to share the SMs; gate_up: the
      SwiGLU epilogue of 256 columns spills); one resident wave of blocks walking the tiles (``persistent``: a
      block's producer fills the ring with its next tile while its consumers store the last; at 2048 tokens qkv
      −3 %, o −1 %, gate_up −7 %, down −0.4 %, the LM head −5 %).

    * T > 64: TMA from a producer warp (``fill`` "tma": 5-17 % faster than the ring at 2048 tokens).

    In the simulator: one warpgroup × 64 columns, a ring of 3, split in two when K has 4 tiles or more; the fill as
    on the GPU."""
    key = (n_cols, k, mma_token_tile(n_tokens), gated)
    tuned = policy.tuned("wgmma").get(key)
    if tuned is not None:
        return WgmmaGeometry(**tuned)
    fill = "ring" if n_tokens <= 64 and n_cols < 65536 else "tma"
    if SIMULATOR:
        return WgmmaGeometry(warpgroups=1, bn=64, stages=3, k_splits=2 if k >= 256 else 1, fill=fill)
    if n_tokens <= 64:
        two_waves = 16 * -(-n_cols // (32 * sm_count()))      # columns of a tile when two tiles share an SM
        if n_cols <= 4096:
            geo = WgmmaGeometry(1, 64, stages=8, fill=fill)
        elif fill == "ring" and (gated or two_waves >= 48):     # two tiles an SM, two blocks an SM
            bn = min(96, max(48, two_waves))
            return WgmmaGeometry(1, bn, stages=6 if bn == 48 else 5, warps_per_sm=8, fill=fill)
        else:
            bn = min(192, max(48, 16 * -(-n_cols // (16 * sm_count()))))
            return WgmmaGeometry(1, bn, stages=8 if bn <= 96 else 6 if bn <= 160 else 5, fill=fill)
    elif n_tokens <= 128:
        geo = WgmmaGeometry(1, 128, stages=6) if n_cols < 16384 else _streamed_geometry(n_cols, n_tokens, gated)
    elif n_tokens <= MMA_SPLIT_MAX_TOKENS:
        geo = _streamed_geometry(n_cols, n_tokens, gated) if n_cols < 65536 else WgmmaGeometry(2, 256, stages=4)
    elif n_cols >= 6144 and not gated:
        return WgmmaGeometry(2, 256, stages=4, persistent=True)
    else:
        return dataclasses.replace(_wave_geometry(n_cols, n_tokens, wide_stages=5), persistent=True)
    tiles = -(-n_tokens // geo.bm) * -(-n_cols // geo.bn)
    return dataclasses.replace(geo, k_splits=_wave_splits(tiles, k))
