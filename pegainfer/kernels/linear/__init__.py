"""Matrix products with bf16 weights: ``out = x @ W.T`` (the projections of every layer and the LM head).

Shapes: ``x [tokens, K]``, ``W [N, K]`` (row-major as in Hugging Face checkpoints, K the input dimension),
``out [tokens, N]``, all bf16 bits (``uint16``), products summed in f32 and rounded to bf16 once.  K a multiple of
8 (16-byte loads of whole rows); N arbitrary; x, W, out contiguous.  No kernel allocates and none takes a per-step
value, so every launch can be captured in a CUDA graph.  Why each kernel is shaped as it is, with measurements:
docs/perf/linear.md.

Modules:

* ``reference``: the math, one thread per output (the oracle of the tests).
* ``api``: ``linear``, ``linear_silu_mul`` (the MLP's gate/up + SwiGLU), ``linear_add_rms_norm`` (the decoder's
  residual add + RMSNorm in front of a projection) and ``default_impl``: for T tokens, on a GPU the one-token GEMV
  for T = 1, the skinny tensor-core kernel for 2 <= T <= 16, a GEMM above (``gemm_wgmma`` on Hopper, ``gemm_mma``
  elsewhere); in the simulator the GEMV up to 8 tokens and the FMA tiles above.
* ``geometry``: how a GEMV, skinny or GEMM launch splits a weight, per shape (built-in measured tables, the launch
  policy's tuning entries, heuristics).
* ``gemv_multi``: the GEMV for up to 8 tokens a pass, streaming every weight byte once.
* ``gemv_decode``: the one-token GEMV of a decode step, with the fused add + RMSNorm prologue, the embedding-row
  gather and the LM head's argmax.
* ``gemv_preloaded``: the one-token GEMV whose weights are copied into shared memory while the kernel before runs
  (``linear_preloaded``: o after attention, out_proj after the Gated DeltaNet step).
* ``skinny``: up to 16 tokens on tensor cores, weights streamed straight into mma fragments.
* ``gemm``: the ``mma.sync`` GEMM (``gemm_mma``, GPUs without ``wgmma``): a ``cp.async`` shared-memory ring,
  ``ldmatrix`` fragments; tiles from all tokens of a decode batch × 64 columns to 128 × 128 for prompts.
* ``gemm_wgmma``: the Hopper GEMM (``wgmma`` from 128-byte-swizzled shared-memory tiles that a producer warp fills
  with TMA copies).
* ``gemm_wgmma_ring``: the same GEMM with the ring filled by every thread's ``cp.async`` (17-64 tokens), and its
  form with the add + RMSNorm as a prologue (``gemm_wgmma_add_rms_norm``, ``LaunchPolicy.gemm_norm_prologue``).
* ``splitk``: split-K for both GEMMs (blocks sharing a tile's K, the last one summing their partials in a fixed
  order) and the caller's workspace (``linear_workspace_size``; its last words are the prologue's handoff counters).
* ``gemm_fma``: the FMA-tiled GEMM (the simulator's path above 8 tokens).
* ``common``: the gate/up column layout, the SwiGLU epilogue, launch bounds, the inner loop the GEMVs share.
"""
from pegainfer.kernels.linear.api import (IMPLS, check_shapes, default_impl, fuses_add_rms_norm, linear,
                                          linear_add_rms_norm, linear_silu_mul)
from pegainfer.kernels.linear.common import SMEM_BYTES, WARPS_PER_SM
from pegainfer.kernels.linear.gemm import gemm_mma
from pegainfer.kernels.linear.gemm_fma import gemm_fma
from pegainfer.kernels.linear.gemm_wgmma import gemm_wgmma
from pegainfer.kernels.linear.gemv_multi import gemv
from pegainfer.kernels.linear.gemv_decode import X_SLICES_AT_ONCE
from pegainfer.kernels.linear.gemv_preloaded import (BULK_CHUNK_BYTES, PRELOAD_THREADS, linear_preloaded,
                                                     preload_rows, preloads)
from pegainfer.kernels.linear.geometry import (GEMV_MAX_TOKENS, GEMV_TUNED, MMA_TUNED, NORM_THREADS,
                                               SKINNY_MAX_TOKENS, SKINNY_TUNED, GemvGeometry, MmaGeometry,
                                               SkinnyGeometry, WgmmaGeometry, fused_norm_geometry, gemv_geometry,
                                               gemv_k_chunk, mma_geometry, skinny_geometry, wgmma_geometry)
from pegainfer.kernels.linear.reference import reference_linear, reference_linear_silu_mul
from pegainfer.kernels.linear.skinny import linear_skinny
from pegainfer.kernels.linear.splitk import linear_workspace_size

__all__ = ["BULK_CHUNK_BYTES", "GEMV_MAX_TOKENS", "GEMV_TUNED", "IMPLS", "MMA_TUNED", "NORM_THREADS",
           "PRELOAD_THREADS", "SKINNY_MAX_TOKENS", "SKINNY_TUNED", "SMEM_BYTES", "WARPS_PER_SM", "X_SLICES_AT_ONCE",
           "GemvGeometry", "MmaGeometry", "SkinnyGeometry", "WgmmaGeometry", "check_shapes", "default_impl", "fused_norm_geometry",
           "fuses_add_rms_norm", "gemm_fma", "gemm_mma", "gemm_wgmma", "gemv", "gemv_geometry", "gemv_k_chunk", "linear",
           "linear_add_rms_norm", "linear_preloaded", "linear_silu_mul", "linear_skinny", "linear_workspace_size",
           "mma_geometry", "preload_rows", "preloads", "reference_linear", "reference_linear_silu_mul",
           "skinny_geometry", "wgmma_geometry"]
