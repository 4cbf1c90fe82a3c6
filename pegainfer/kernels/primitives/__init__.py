"""The few hardware primitives that differ between a real GPU and Numba's CUDA simulator.

Every other kernel module imports its building blocks from here (``from pegainfer.kernels.primitives import ...``)
and never checks which world it runs in; this package is the only place that does.

* ``launch_shape`` -- ``@kernel`` / ``@device_fn``, the scalar types, ``threads`` / ``grid`` (smaller in the simulator),
  ``sm_count``
* ``bf16`` -- bf16 as raw bits: conversions, packed pairs, an f32 split into two bf16, host conversions
* ``loads`` -- 16-byte and 8-byte loads and stores, a bf16 pair in one 4-byte store, ``as_words``
* ``reductions`` -- warp and block reductions (sums, maxima, argmax)
* ``mma`` -- the warp-wide bf16 tensor-core multiply-accumulate and ``ldmatrix``, which loads its fragments
* ``ldmatrix_trans`` -- the transposing ``ldmatrix``: B fragments of ``P · V`` from a row-major V tile
* ``fast_exp2`` -- 2^x in one instruction (softmax probabilities)
* ``warp_vote`` -- ``warp_any``: a predicate of any lane, in every lane
* ``async_copy`` -- ``cp.async`` and the sm_90 bulk copies
* ``barriers`` -- mbarriers (arrivals and copied bytes, phases: the rings of TMA and bulk copies), named barriers
* ``tma`` -- tensor maps and TMA tile copies
* ``wgmma`` -- Hopper's warpgroup MMA from shared-memory descriptors
* ``pdl`` -- programmatic dependent launch (``grid_dependency_wait``, ``launch_dependents``, ``pdl_prologue``, the
  ``reads_before_wait`` declaration) and the clock registers of the timeline stamps
* ``ptx`` (GPU) -- helpers for writing inline-PTX intrinsics; ``simulator`` (simulator) -- a faster simulator: blocks
  on persistent threads, cheap device-function calls, a race-free shared-memory allocator

Conventions every kernel in ``pegainfer/kernels`` follows
---------------------------------------------------------
* **bf16 is raw bits.**  A bf16 tensor is a ``uint16`` device array.  ``bf16_to_f32`` widens one value,
  ``f32_to_bf16`` rounds to nearest-even (NaN stays NaN).  Arithmetic happens in f32; results are rounded back to
  bf16 exactly where Hugging Face's bf16 forward rounds them, so logits line up with the reference.
* **Wide loads.**  ``load_u32x4(a, i)`` reads ``a[i:i+4]`` of a ``uint32`` array as one 16-byte load (8 bf16
  values); ``i`` is an *element* index and must be a multiple of 4 (the address 16-byte aligned).
* **1-D blocks whose size is a multiple of 32**, and grid-/block-stride loops, so the same kernel runs with any
  geometry.  Launch wrappers pick small geometries in the simulator via ``threads(gpu=..)`` and ``grid(...)``.
* **Warp and block reductions** are called by every thread of the block equally often (in the simulator they are
  emulated with the block barrier): ``reductions``.
* **Unsigned indices in hot loops.**  numba wraps negative indices around (``a[-1]``), so every access with a
  signed index costs a compare, a select and 64-bit address arithmetic; in an inner loop that reads shared memory
  that makes the integer ALU the busiest pipe.  Indexing with ``uint32`` values skips the wraparound
  (docs/perf/linear.md).
* Kernels are declared with ``@kernel`` (``cuda.jit`` with on-disk caching on the GPU) and device functions with
  ``@device_fn``.  They are launched only through ``pegainfer.kernels.launch.launch`` (one place for the stream,
  CUDA-graph capture, tracing and the launch policy).
"""
from __future__ import annotations

import math  # (re-exported: math.exp etc. work in both worlds)

from numba import cuda

from pegainfer.device import SIMULATOR

if SIMULATOR:
    from pegainfer.kernels.primitives.simulator import patch_simulator
    patch_simulator()

from pegainfer.kernels.primitives.async_copy import (bulk_barrier_init, bulk_copy, bulk_expect_bytes,
                                                     bulk_wait, cp_async_16, cp_async_commit, cp_async_wait_group)
from pegainfer.kernels.primitives.bf16 import (bf16_to_f32, bf16x2_hi, bf16x2_lo, bits_f32, f32_bits,
                                               f32_to_bf16, from_bf16_bits, pack_bf16x2, split_bf16x2,
                                               to_bf16_bits)
from pegainfer.kernels.primitives.fast_exp2 import exp2_approx
from pegainfer.kernels.primitives.launch_shape import (device_fn, float32, grid, int32, kernel, launch_bounded,
                                                       sm_count, threads, uint16, uint32)
from pegainfer.kernels.primitives.ldmatrix_trans import ldmatrix_x4_trans
from pegainfer.kernels.primitives.loads import (array_address, as_words, load_acquire_u32, load_f32x2, load_f32x4,
                                                load_u32_l2, load_u32x4, prefetch_l2, store_bf16_pair, store_f32x2,
                                                store_f32x4)
from pegainfer.kernels.primitives.mma import ldmatrix_x4, mma_bf16_m16n8k16
from pegainfer.kernels.primitives.pdl import (GRID_DEPENDENCY_CONTROL, global_timer, grid_dependency_wait,
                                              launch_dependents, pdl_prologue, reads_before_wait, sm_id)
from pegainfer.kernels.primitives.reductions import (FULL_MASK, NO_INDEX, WARP, block_argmax, block_max,
                                                     block_sum, lane_group_max, lane_group_sum, warp_argmax, warp_max,
                                                     warp_row_sums_to_shared, warp_sum, warp_sums_to_shared)
from pegainfer.kernels.primitives.warp_vote import warp_any

__all__ = ["as_words", "bf16_to_f32", "bf16x2_hi", "bf16x2_lo", "bits_f32", "block_argmax", "block_max", "block_sum",
           "bulk_barrier_init", "bulk_copy", "bulk_expect_bytes", "bulk_wait", "cp_async_16", "cp_async_commit",
           "cp_async_wait_group", "cuda", "device_fn", "f32_bits", "f32_to_bf16", "float32", "from_bf16_bits",
           "FULL_MASK", "global_timer", "grid", "GRID_DEPENDENCY_CONTROL", "grid_dependency_wait", "int32", "kernel",
           "lane_group_max", "lane_group_sum", "launch_dependents", "ldmatrix_x4", "load_acquire_u32", "load_f32x2",
           "load_f32x4", "load_u32_l2", "load_u32x4", "math", "mma_bf16_m16n8k16", "NO_INDEX", "pack_bf16x2",
           "pdl_prologue", "prefetch_l2", "SIMULATOR", "sm_id", "store_bf16_pair", "store_f32x2", "store_f32x4",
           "threads", "to_bf16_bits", "uint16", "uint32", "WARP",
           "warp_argmax", "warp_max", "warp_row_sums_to_shared", "warp_sum", "warp_sums_to_shared"]
__all__ += ["array_address", "exp2_approx", "launch_bounded", "ldmatrix_x4_trans", "reads_before_wait", "sm_count",
            "split_bf16x2", "warp_any"]
