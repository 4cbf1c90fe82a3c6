"""Attention over the paged KV cache: one kernel family for prefill and decode (a vLLM-style flat token batch).

The step has ``T`` query tokens.  Token ``t`` belongs to the sequence in slot ``token_slots[t]`` and sits at position
``positions[t]``; it attends to every key of its slot at positions ``0 .. positions[t]`` inclusive (causality falls
out of the positions).  The K/V of all ``T`` tokens are already in the cache when attention runs.

KV cache layout (per layer)::

    k_cache, v_cache : [num_pages, page_size, num_kv_heads, head_dim]  uint16 (bf16 bits)
    block_tables     : [num_slots, max_pages_per_seq] int32  (logical page of a slot -> physical page)
    key of position p of slot s, kv head g:  k_cache[block_tables[s, p // page_size], p % page_size, g, :]

Math, for query head ``h`` of token ``t`` (GQA: ``h`` reads kv head ``h // (nq // nkv)``), in f32::

    out[t, h, :] = bf16( softmax_p( scale * q[t, h, :] . K[p, :] ) @ V )      p = 0 .. positions[t]

and with Qwen3.5's gate ``gate`` (its q_proj output): ``out = bf16(out · bf16(sigmoid(gate)))`` (``gating.py``).
The tuned kernels compute it with the *online softmax* (``merge.py``).

Modules:

* ``reference.py`` -- the plain kernel: one thread per output element, the formula above (the tests' oracle).
* ``decode.py`` -- split-K ("flash-decoding") on tensor cores: one block per (token, kv head, split), every ``T``
  (decode batches, short chunks); for heads wider than 128 dims warps in pairs over the dims; the gate applied as
  it writes.
* ``merge.py`` -- partial softmax states and how they merge: the block's warps, then the splits (the last block of
  a (token, kv head) merges, in the same launch).
* ``prefill.py`` -- the tiled (FlashAttention-2 style) tensor-core kernel for prompt chunks.
* ``geometry.py`` -- split counts and lengths, the blocks' warps, the prefill tile.
* ``workspace.py`` -- the split-K partials and merge counters (``attention_workspace_size``).

Nothing allocates per call (the split-K partials and counters live in the caller's ``workspace``), and every
per-step value comes from device arrays, so both paths can be captured in a CUDA graph.  A token with
``token_slots[t] < 0`` (padding of a fixed-size batch) reads nothing and gets zeros, on both paths.
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.attention.decode import paged_attention_split, split_kernel
from pegainfer.kernels.attention.geometry import (BATCHED_SPLIT_ITEMS, DECODE_STEP_KEYS, DIM_SPLIT_WARPS,
                                                  MAX_SPLITS, MIN_SPLIT_TOKENS, MIN_SPLIT_TOKENS_WIDE,
                                                  PREFILL_MIN_TOKENS, SUPPORTED_HEAD_DIMS,
                                                  PrefillGeometry, SplitGeometry,
                                                  attention_num_splits, min_chunk, prefill_geometry,
                                                  prefill_supported, split_geometry)
from pegainfer.kernels.attention.prefill import paged_attention_prefill, prefill_kernel
from pegainfer.kernels.attention.reference import reference_paged_attention
from pegainfer.kernels.attention.workspace import attention_workspace_size
from pegainfer.kernels.gating import sigmoid_gate_mul
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy

__all__ = ["paged_attention", "attention_workspace_size", "attention_num_splits", "paged_attention_split",
           "paged_attention_prefill", "reference_paged_attention", "split_geometry", "prefill_geometry", "min_chunk",
           "SplitGeometry", "PrefillGeometry", "split_kernel", "prefill_kernel", "SUPPORTED_HEAD_DIMS",
           "MIN_SPLIT_TOKENS", "MIN_SPLIT_TOKENS_WIDE", "MAX_SPLITS", "DECODE_STEP_KEYS",
           "DIM_SPLIT_WARPS", "PREFILL_MIN_TOKENS", "prefill_supported", "BATCHED_SPLIT_ITEMS"]


def paged_attention(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, workspace, *,
                    num_splits: int | None = None, min_split_tokens: int | None = None,
                    method: str = "auto", decode: bool = False, num_decode: int = 0, gate=None,
                    policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out[t, h] = bf16(softmax(scale * q[t, h] . K_slot^T) V_slot)`` over keys ``0 .. positions[t]`` of slot
    ``token_slots[t]`` (module docstring).

    q, out ``[T, nq, D]`` uint16; k_cache, v_cache ``[num_pages, page_size, nkv, D]`` uint16; block_tables
    ``[num_slots, max_pages]``, token_slots ``[T]``, positions ``[T]`` int32; workspace: f32 device array of at least
    ``attention_workspace_size(...)`` elements (may be None when the split-K path uses one split).
    ``num_splits`` / ``min_split_tokens`` force the split-K launch (tests); ``method``: "auto" (the tiled prefill
    kernel from ``PREFILL_MIN_TOKENS`` prompt tokens up, else split-K: always for ``decode``), "split" or "prefill".
    ``decode``: every token is its sequence's newest (a decode step), so of the cache only the key / value at
    ``positions[t]`` was written by the kernel before; the split-K kernel then reads the older ones before its PDL
    wait (``decode.py``).  Wrong when a token's earlier positions were stored in the same step (a prompt chunk).
    ``num_decode``: a mixed step (``engine/scheduler.py``): its first ``num_decode`` tokens are decodes, the rest
    prompt chunks; the decodes run as a ``decode`` split-K launch and the chunks as their own launch (the tiled
    kernel when they are many), so neither kind of token slows the other.
    ``gate``: Qwen3.5's q_proj output ``[T, row]`` (``row ≥ 2·nq·D``): the output is then
    ``gating.sigmoid_gate_mul``'s ``bf16(attn · bf16(sigmoid(gate)))``, applied by the split-K kernel as it writes
    (the tiled prefill kernel is followed by ``sigmoid_gate_mul``).
    ``policy``: how the kernels launch (``policy.py``: PDL, timeline stamps).
    """
    T, nq, D = q.shape
    num_pages, page_size, nkv, Dk = k_cache.shape
    if q.dtype != np.uint16 or out.dtype != np.uint16 or k_cache.dtype != np.uint16 or v_cache.dtype != np.uint16:
        raise TypeError("q, out, k_cache and v_cache must be uint16 (bf16 bits)")
    if tuple(v_cache.shape) != tuple(k_cache.shape) or Dk != D or tuple(out.shape) != (T, nq, D):
        raise ValueError(f"shape mismatch: q {q.shape}, out {out.shape}, k {k_cache.shape}, v {v_cache.shape}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} not in {SUPPORTED_HEAD_DIMS}")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size {page_size} must be a power of two")
    if nq % nkv:
        raise ValueError(f"nq={nq} is not a multiple of nkv={nkv}")
    for name, a, n in (("token_slots", token_slots, T), ("positions", positions, T)):
        if a.dtype != np.int32 or a.shape != (n,):
            raise ValueError(f"{name} must be int32 [{n}], got {a.dtype} {a.shape}")
    if block_tables.dtype != np.int32 or block_tables.ndim != 2:
        raise ValueError("block_tables must be int32 [num_slots, max_pages]")
    if method not in ("auto", "split", "prefill"):
        raise ValueError(f"unknown method {method!r}")
    for name, a in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not a.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous")
    if 0 < num_decode < T and not decode:
        nd = num_decode
        for part, part_decode in ((slice(0, nd), True), (slice(nd, T), False)):
            paged_attention(q[part], k_cache, v_cache, block_tables, token_slots[part], positions[part], out[part],
                            scale, workspace, num_splits=num_splits, min_split_tokens=min_split_tokens,
                            method="split" if part_decode else method, decode=part_decode,
                            gate=None if gate is None else gate[part], policy=policy)
        return
    if method == "auto":       # a decode step's tokens are one query each, of as many sequences: split-K, whatever T
        method = ("prefill" if not decode and T >= PREFILL_MIN_TOKENS and prefill_supported(nq // nkv, D, policy)
                  else "split")
    if gate is not None and (gate.dtype != np.uint16 or gate.ndim != 2 or gate.shape[0] != T
                             or gate.shape[1] < 2 * nq * D):
        raise ValueError(f"gate must be uint16 [{T}, >= {2 * nq * D}], got {gate.dtype} {gate.shape}")
    if method == "prefill":
        paged_attention_prefill(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, policy=policy)
        if gate is not None:
            sigmoid_gate_mul(out, gate, out, policy=policy)
    else:
        paged_attention_split(q, k_cache, v_cache, block_tables, token_slots, positions, out, scale, workspace,
                        num_splits=num_splits, min_split_tokens=min_split_tokens, decode=decode, gate=gate,
                        policy=policy)
