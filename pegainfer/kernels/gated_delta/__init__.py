"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5's hybrid layers (three of every four layers).

One layer, for a token with hidden state ``x`` (HF ``Qwen3_5GatedDeltaNet.forward``; the projections are GEMVs
elsewhere)::

    mixed = in_proj_qkv(x)                 # [conv_dim] = [q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv)], bf16
    mixed = silu(causal_conv1d(mixed))     # depthwise, kernel K=4, over this sequence's last K inputs
    q, k  = l2norm(q), l2norm(k)           # per key head, f32; q also scaled by 1/sqrt(Dk)
    g     = -exp(A_log) · softplus(a + dt_bias)     # log decay per value head, a = in_proj_a(x)
    beta  = sigmoid(b)                              # write strength per value head, b = in_proj_b(x)
    o     = gated delta rule(q, k, v, g, beta; state S)
    y     = out_proj(RMSNormGated(o, z = in_proj_z(x)))

Modules:

* ``reference`` -- the gated delta rule token by token, its math line by line (``reference_gated_delta``): the
  oracle of the tuned kernels.
* ``conv`` -- the causal conv1d + SiLU for prompts, and the conv ring by position (``causal_conv1d_silu``).
* ``chunked_mma`` -- the rule for prompts in chunks, its products on tensor cores (``gated_delta_chunked``,
  ``allocate_chunk_scratch``); ``geometry`` -- its launch geometry (``ChunkGeometry``, ``chunk_geometry``).
* ``gated_norm`` -- the gated RMSNorm for prompts (``gated_rms_norm``).
* ``decode_step`` -- conv, rule and gated norm of a decode step in one launch (``gated_delta_decode_step``).
* ``state`` -- the per-sequence table and state slots (``sequence_table``, ``clear_state_slots``,
  ``copy_state_slots``).
* ``common`` -- what they share: size limits, the per-token scalar math, argument checks.

**Sequences, slots, padding.**  Every kernel takes a batch of sequences (``slot_ids [B]``, ``token_offsets [B+1]``
int32: ``state.py``); a decode step is B sequences of one token each.  Empty sequences (equal offsets) are skipped
and leave their slot alone.  Padding tokens (slot -1: a prefill chunk padded to a CUDA-graph bucket, a mixed step
padded to its graph's shape) belong to no sequence: ``sequence_table`` ends the table after the last real token,
and a run of padding tokens between real ones (a mixed step's padding decode rows) becomes a *padding sequence*
(slot -1) that every kernel skips like an empty one, so the state after the step is bit for bit the state an
unpadded step leaves.  The rule kernels write zeros to the output rows of padding tokens (from
``token_offsets[B]`` on, and a padding sequence's: what reads them downstream stays finite); the conv leaves its
rows there as they were.
State buffers::

    conv_state [slots, conv_dim, K]    bf16   ring of the conv's inputs by position (``conv.py``)
    ssm_state  [slots, Hv, Dk, Dv]     f32    S per value head, HF's layout (``recurrent_states``); or bf16 bits
                                              (``--mamba-ssm-cache-dtype bfloat16``: widened on load, rounded on
                                              store, ``common.state_codec``)

**bf16 rounding** follows HF's bf16 forward: conv output rounded, then SiLU rounded; ``beta = bf16(sigmoid(b))``;
``g`` in f32 from bf16 ``a``; the rule runs in f32 and its output is rounded to bf16; the gated norm rounds
``bf16(x·r)``, then ``bf16(w · that)``, then ``bf16(that · silu(z))``.
"""
from pegainfer.kernels.gated_delta.chunked_mma import ChunkScratch, allocate_chunk_scratch, gated_delta_chunked
from pegainfer.kernels.gated_delta.common import MAX_CHUNK, MAX_KEY_DIM
from pegainfer.kernels.gated_delta.conv import causal_conv1d_silu
from pegainfer.kernels.gated_delta.decode_step import DECODE_TILES_PER_THREAD, gated_delta_decode_step
from pegainfer.kernels.gated_delta.gated_norm import gated_rms_norm
from pegainfer.kernels.gated_delta.geometry import ChunkGeometry, chunk_geometry
from pegainfer.kernels.gated_delta.reference import RULE_WARPS, reference_gated_delta
from pegainfer.kernels.gated_delta.state import clear_state_slots, copy_state_slots, sequence_table

__all__ = ["causal_conv1d_silu", "reference_gated_delta", "gated_delta_chunked", "gated_rms_norm",
           "gated_delta_decode_step", "clear_state_slots", "copy_state_slots", "sequence_table", "ChunkScratch", "allocate_chunk_scratch",
           "ChunkGeometry", "chunk_geometry",
           "MAX_KEY_DIM", "MAX_CHUNK", "RULE_WARPS", "DECODE_TILES_PER_THREAD"]
