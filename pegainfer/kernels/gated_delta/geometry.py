"""Launch geometry of the tensor-core chunked delta rule (``chunked_mma.py``): the chunk length, the warps of a scan
block and how many chunks' tiles a scan block holds in shared memory.  Everything here depends only on shapes known
before a CUDA graph is captured."""
from __future__ import annotations

from typing import NamedTuple

from pegainfer.device import SIMULATOR
from pegainfer.kernels.gated_delta.common import MAX_CHUNK, MAX_KEY_DIM
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives.launch_shape import sm_count

MMA_TILE = 16
"""Tokens of an m16 / k16 tensor-core tile: a chunk is worked on in whole tiles (the last one zero-filled)."""

SCAN_COLUMNS_PER_WARP = 16
"""Value columns a scan warp owns: one m16 tile of the transposed state ``Sᵀ [columns, Dk]``."""


class ChunkGeometry(NamedTuple):
    """How ``chunked_mma.gated_delta_chunked`` launches.

    chunk: tokens per chunk C (1 .. ``MAX_CHUNK``); the kernels work on ``tiles = ceil(C / 16)`` tiles of 16 tokens
      (``padded = 16 · tiles`` rows, those past C zero).  The prepare kernel runs ``tiles`` warps, one per tile.
    scan_warps: warps per scan block; each owns 16 value columns of one head, so a block carries a ``[Dk,
      16 · scan_warps]`` slice of the state and shares the chunk's staged tiles among its warps.
    scan_stages: 1 or 2 chunks' tiles in shared memory (2: the next chunk's copies fly while one is computed).
    prepare_split: prepare blocks that share one (sequence, chunk, key head), each taking its share of the value
      heads reading that key head (and computing the key head's Gram products itself); 0: ``prepare_parts()``
      decides by the launch's size.
    """
    chunk: int
    scan_warps: int
    scan_stages: int
    prepare_split: int = 0

    @property
    def tiles(self) -> int:
        return -(-self.chunk // MMA_TILE)

    @property
    def padded(self) -> int:
        return MMA_TILE * self.tiles

    @property
    def scan_columns(self) -> int:
        return SCAN_COLUMNS_PER_WARP * self.scan_warps

    def prepare_parts(self, key_items: int, heads_per_key: int) -> int:
        """Prepare blocks a (sequence, chunk, key head) item is split over, for a launch whose tokens fill
        ``key_items`` such items (``chunked_mma``: the chunks of T tokens × key heads; padding sequences have no
        work) and whose key heads each serve ``heads_per_key`` value heads: the geometry's ``prepare_split`` if
        set, else one a value head while the items alone would leave SMs idle (a short prompt: a block's work is a
        chain of dependent steps, so more blocks finish sooner; docs/perf/gated_delta.md), one an item otherwise."""
        parts = self.prepare_split or (heads_per_key if key_items < sm_count() else 1)
        if parts < 1 or heads_per_key % parts:
            raise ValueError(f"gated delta prepare_split {parts}: must divide the {heads_per_key} value heads of a "
                             "key head")
        return parts

    def prepare_shared_words(self, key_dim: int) -> int:
        """uint32 words of the prepare kernel's shared memory: the chunk's k and q rows (``key_dim / 2 + 4`` words
        each), ``L`` and ``(I+L)⁻¹`` (``padded + 1`` f32 a row), a 16-row block of partial products, 4 scalars a
        token."""
        cp = self.padded
        return 2 * cp * (key_dim // 2 + 4) + (2 * cp + MMA_TILE) * (cp + 1) + 4 * cp

    def scan_stage_words(self, key_dim: int) -> int:
        """uint32 words of one scan stage: k and q rows, ``(I+L)⁻¹`` and intra as hi / lo bf16 rows (``padded / 2 +
        4`` words each), the v tile (``scan_columns / 2 + 4`` words a row), 4 scalars a token."""
        cp = self.padded
        return (2 * cp * (key_dim // 2 + 4) + 4 * cp * (cp // 2 + 4) + cp * (self.scan_columns // 2 + 4)
                + 4 * cp)

    def scan_shared_words(self, key_dim: int) -> int:
        """All of a scan block's words: its stages, then the f32 output tile ``[padded, scan_columns + 4]``."""
        return self.scan_stages * self.scan_stage_words(key_dim) + self.padded * (self.scan_columns + 4)

    def check(self, key_dim: int, value_dim: int) -> None:
        """One-line errors for a geometry or head shape the kernels cannot take."""
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ValueError(f"gated delta chunk {self.chunk}: must be 1..{MAX_CHUNK}")
        if self.prepare_split < 0:
            raise ValueError(f"gated delta prepare_split {self.prepare_split}: 0 (by the launch's size) or a count")
        if self.scan_warps < 1 or self.scan_stages not in (1, 2):
            raise ValueError(f"gated delta scan geometry {tuple(self)}: needs scan_warps >= 1 and scan_stages 1 or 2")
        if key_dim % MMA_TILE or key_dim > MAX_KEY_DIM:
            raise ValueError(f"key head dim {key_dim}: the tensor-core chunked rule needs a multiple of 16, at most "
                             f"{MAX_KEY_DIM}")
        if value_dim % 8:
            raise ValueError(f"value head dim {value_dim}: the tensor-core chunked rule needs a multiple of 8")


CHUNK_GEOMETRY_GPU = ChunkGeometry(chunk=MAX_CHUNK, scan_warps=4, scan_stages=2)
"""On the GPU: 64-token chunks (HF and FLA use 64); scan blocks of 4 warps, i.e. 64 value columns: Qwen3.5-4B's 32
value heads × 2 column slices = 64 blocks for one prompt; two stages (~180 KB of shared memory at Dk = 128).  Each
chunk's staged k / q / (I+L)⁻¹ tiles serve twice the columns of 2-warp blocks, which beat the fuller grid by 1.2×
(``docs/perf/gated_delta.md``)."""


def chunk_geometry(key_dim: int, value_dim: int, chunk: int = MAX_CHUNK,
                   policy: LaunchPolicy = DEFAULT_POLICY) -> ChunkGeometry:
    """The geometry for heads of ``key_dim`` / ``value_dim`` dims and chunks of ``chunk`` tokens: the policy's
    ``tuned("gated_delta_chunk")`` entry for ``(key_dim, value_dim, chunk)`` (fields ``scan_warps``,
    ``scan_stages``) first, then ``CHUNK_GEOMETRY_GPU`` with that chunk; in the simulator one warp a scan block."""
    tuned = policy.tuned("gated_delta_chunk").get((key_dim, value_dim, chunk))
    if tuned is not None:
        return ChunkGeometry(chunk=chunk, **tuned)
    if SIMULATOR:
        return ChunkGeometry(chunk=chunk, scan_warps=1, scan_stages=2)
    return CHUNK_GEOMETRY_GPU._replace(chunk=chunk)
