"""Launch geometry of the attention kernels: how many splits a (token, kv head) gets, how many keys a split covers,
the warps of a split-K block, and the tile of the prefill kernel.  Everything here depends only on shapes known
before a CUDA graph is captured; which splits do work is decided on the device from each token's length.
Why these values: ``docs/perf/attention.md``."""
from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

from pegainfer.device import SIMULATOR
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import sm_count, threads

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)

MIN_SPLIT_TOKENS = 256
"""Split lengths are multiples of this many keys for heads of up to 128 dims (two passes of 8 warps x 16 keys)."""
MIN_SPLIT_TOKENS_WIDE = 64
"""... for wider heads (one pass of the dim-split kernel's 4 warp pairs): a 256-dim head has only 4 kv heads' worth
of blocks per token, so long contexts need more splits to fill the GPU."""
MAX_SPLITS = 256
"""Most splits a (token, kv head) may have (the merge keeps one weight per split in shared memory)."""
DECODE_STEP_KEYS = 16
"""Keys one warp (or warp pair) handles per step: two n8 tiles of S, one k16 step of P V."""
DIM_SPLIT_WARPS = 8
"""Warps per block of the dim-split kernel (heads wider than 128 dims): 4 pairs, 64 keys per round."""
BATCHED_SPLIT_ITEMS = 128
"""(token, kv head) items of a split-K launch from which its blocks are 4 warps, not 8: 16 to 256 sequences of
Qwen3-4B's heads (128 to 2,048 items) at 256 keys ran 18-21 % faster so (docs/perf/attention.md)."""
PREFILL_MIN_TOKENS = 128
"""``method="auto"`` takes the tiled prefill kernel from this many query tokens up."""


WALK_BLOCKS_PER_SM = 2
"""Blocks an SM of a batched decode launch's walking grid: two 4-warp blocks fit an SM's registers."""


class SplitGeometry(NamedTuple):
    """Block shape of the split-K kernel: ``warps`` per block; ``dim_split``: the warps work in pairs, each on half
    of every head's dims (``decode.split_kernel``); ``walk``: 0 for a block per work item, else a grid of ``walk``
    blocks an SM that walks the items, each block asking L2 for its next item's first keys while it finishes the
    current one."""
    warps: int
    dim_split: bool
    walk: int = 0


def split_geometry(head_dim: int, group: int, items: int = 1) -> SplitGeometry:
    """The split-K kernel's block for heads of ``head_dim`` (``group`` q heads per kv head) in a launch of ``items``
    (token, kv head) pairs: 8 warps, each taking 16-key steps; 4 warps from ``BATCHED_SPLIT_ITEMS`` items on (a
    batched decode step: each block is a chain of dependent loads, and two blocks an SM hide each other's), in a
    grid of ``WALK_BLOCKS_PER_SM`` blocks an SM walking the items (each item's first keys asked of L2 before it
    starts); heads wider than 128 dims (Qwen3.5's 256) in warp pairs, so that a warp's registers are those of a
    128-dim head (one warp holding a whole 256-dim row of K and V would need more than 255 registers).  In the
    simulator one warp, or one pair."""
    if head_dim > 128:
        return SplitGeometry(threads(gpu=DIM_SPLIT_WARPS, sim=2), True)
    if items >= BATCHED_SPLIT_ITEMS:
        return SplitGeometry(threads(gpu=4, sim=1), False, WALK_BLOCKS_PER_SM)
    return SplitGeometry(threads(gpu=8, sim=1), False)


def min_chunk(min_split_tokens: int | None = None, head_dim: int = 128) -> int:
    """Fewest keys a split covers: the forced value, else ``MIN_SPLIT_TOKENS`` (``MIN_SPLIT_TOKENS_WIDE`` for heads
    wider than 128 dims); at least one key."""
    if min_split_tokens is None:
        min_split_tokens = MIN_SPLIT_TOKENS_WIDE if head_dim > 128 else MIN_SPLIT_TOKENS
    return max(1, min_split_tokens)


def attention_num_splits(num_tokens: int, nkv: int, max_model_len: int, head_dim: int = 128) -> int:
    """Splits per (token, kv head) the split-K launch provides: as many as keep its blocks within one wave of the
    GPU (``sm_count()`` SMs, each holding one block of ``split_geometry``, or ``walk`` blocks of a walking grid),
    but no more than one ``min_chunk(head_dim=)``-key split per ``max_model_len``.  A block then walks a long split
    with the next round's K/V asked of L2, where more, shorter splits would run in waves, each a fresh chain of
    dependent loads, and merge more partials (one sequence at 32,768 keys: 16 splits of Qwen3-4B's 8 kv heads
    41.9 µs, 64 splits 65.5 µs; docs/perf/attention.md).  How many of them do work is decided on the device from
    each token's length, so short contexts use few blocks."""
    items = max(1, num_tokens * nkv)
    resident = sm_count() * (split_geometry(head_dim, 1, items).walk or 1)
    max_splits = max(1, ceil_div(max_model_len, min_chunk(head_dim=head_dim)))
    return max(1, min(resident // items, max_splits, MAX_SPLITS))


class PrefillGeometry(NamedTuple):
    """Tile of the prefill kernel (``prefill.py``): ``warps`` warps of ``m_tiles`` m16 tiles (16 query rows each),
    so ``16 · warps · m_tiles`` query rows a block; K/V tiles of ``block_keys`` keys; a ring of ``stages`` K/V
    tiles in shared memory (``stages - 1`` in flight while one is multiplied)."""
    warps: int
    m_tiles: int
    block_keys: int
    stages: int

    @property
    def rows(self) -> int:
        return 16 * self.warps * self.m_tiles

    def shared_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory of a block: the Q tile ``[rows, D]`` and ``stages`` K and V tiles ``[block_keys,
        D]``, bf16."""
        return 2 * head_dim * (self.rows + 2 * self.stages * self.block_keys)


PREFILL_TILES = MappingProxyType({
    128: PrefillGeometry(warps=4, m_tiles=2, block_keys=64, stages=2),
    256: PrefillGeometry(warps=8, m_tiles=1, block_keys=64, stages=2),
})
"""The prefill tile per head dim on the GPU (any group that divides 128 rows; smaller heads take the 128 tile);
``benchmarks/bench_attention.py --prefill-geometry`` / ``--sweep`` time others against them."""


def prefill_geometry(head_dim: int, group: int = 1, policy: LaunchPolicy = DEFAULT_POLICY) -> PrefillGeometry:
    """The prefill kernel's tile for heads of ``head_dim`` dims, ``group`` q heads per kv head: the policy's
    ``tuned("prefill")`` entry for ``(head_dim, group)`` first, then ``PREFILL_TILES``.

    128 query rows a block on the GPU, which every K/V tile serves (32 tokens × 4 heads at GQA 4).  D = 128: four
    warps of two m16 tiles (a warp reuses every K / V fragment it loads for 32 rows; O takes 128 registers a lane),
    64-key tiles, double-buffered (96 KB, two blocks an SM).  D = 256: the O accumulator of one m16 tile alone is
    128 registers a lane, so eight warps of one m16 tile; 64-key tiles, double-buffered (192 KB, one block an SM).
    In the simulator one warp of one m16 tile, 16-key tiles, two stages.  Why these values:
    ``docs/perf/attention.md``."""
    tuned = policy.tuned("prefill").get((head_dim, group))
    if tuned is not None:
        return PrefillGeometry(**tuned)
    if SIMULATOR:
        return PrefillGeometry(warps=1, m_tiles=1, block_keys=16, stages=2)
    return PREFILL_TILES[256 if head_dim > 128 else 128]


def prefill_supported(group: int, head_dim: int = 128, policy: LaunchPolicy = DEFAULT_POLICY) -> bool:
    """Whether the prefill kernel's tile holds whole tokens for ``group`` q heads per kv head."""
    return prefill_geometry(head_dim, group, policy).rows % group == 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
