"""The tuned RMSNorm, plain and fused with the residual add, in the two bf16 roundings the served models use.

For a row ``x`` of ``hidden`` values, with ``r = 1 / sqrt(mean(x²) + eps)`` computed in f32:

* **Qwen3** (``round_before_weight=True``, ``weight_offset=0``) — HF ``Qwen3RMSNorm`` rounds twice:
  ``n = bf16(x · r)``, ``out = bf16(n · w)``.
* **Qwen3.5** (``round_before_weight=False``, ``weight_offset=1``) — HF ``Qwen3_5RMSNorm`` stores ``w`` as an offset
  from one and rounds once: ``out = bf16((x · r) · (1 + w))``, all in f32.

Both forms are one kernel: the two flags are kernel arguments (constant per model, so safe to bake into a CUDA
graph).  ``add_rms_norm`` is vLLM's ``fused_add_rms_norm``: the decoder layer's residual add and the next norm in one
pass, ``residual = bf16(residual + delta)`` in place, then the norm of the *rounded* sum (as HF computes it).
``add_rms_norm_into`` is the same kernel writing the sum to another buffer (a model that ping-pongs two residual
buffers, see ``linear.linear_add_rms_norm``), optionally without a delta (then it is ``rms_norm`` that also copies
the residual); both are bit-identical to ``add_rms_norm`` / ``rms_norm``.

**Sum order.**  The f32 sum of a row's squares depends on the order of its additions, and a kernel that must be
bit-identical to these norms (``linear``'s fused add + RMSNorm prologue) adds in the same order: thread t of a block of
``BLOCK_THREADS`` = B adds elements 2t, 2t+1, then 2(t+B), 2(t+B)+1, ... (element pairs, so a fused kernel can read
a row as 32-bit words), then ``block_sum`` combines the threads.
"""
from __future__ import annotations

import functools

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, array_address, bf16_to_f32, bf16x2_hi, bf16x2_lo, block_sum, cuda,
                                          device_fn, f32_to_bf16, float32, grid, kernel, math, pdl_prologue, threads,
                                          uint16, uint32, warp_sum)


@device_fn
def normalize_element(x, inv_rms, w_bits, weight_offset, round_before_weight):
    """One normalized output (bf16 bits) from the f32 input ``x``, the row's ``inv_rms`` and the weight's bf16 bits,
    rounded the way the model's HF norm rounds (see the module docstring)."""
    n = float32(x) * inv_rms
    if round_before_weight:
        n = bf16_to_f32(f32_to_bf16(n))
    return f32_to_bf16(n * (bf16_to_f32(w_bits) + weight_offset))


@device_fn
def inverse_rms(sum_squares, count, eps):
    """``1 / sqrt(sum_squares / count + eps)`` in f32 (the simulator's ``math.sqrt`` returns a double: cast)."""
    return float32(1.0) / float32(math.sqrt(float32(sum_squares) / float32(count) + eps))


@device_fn
def add_residual(residual_bits, delta_bits, has_delta):
    """The new residual stream element (bf16 bits): ``bf16(residual + delta)``, or ``residual`` without
    ``has_delta``."""
    if has_delta:
        return f32_to_bf16(bf16_to_f32(residual_bits) + bf16_to_f32(delta_bits))
    return residual_bits


@device_fn
def add_pair(r_word, d_word, has_delta):
    """``add_residual`` of both bf16 of a word (two adjacent elements), packed back into a word."""
    lo = add_residual(uint16(r_word & uint32(0xFFFF)), uint16(d_word & uint32(0xFFFF)), has_delta)
    hi = add_residual(uint16(r_word >> uint32(16)), uint16(d_word >> uint32(16)), has_delta)
    return uint32(lo) | (uint32(hi) << uint32(16))


@device_fn
def normalize_pair(s_word, w_word, inv_rms, weight_offset, round_before_weight):
    """``normalize_element`` of both bf16 of ``s_word`` with the weights in ``w_word``, packed back into a word."""
    lo = normalize_element(bf16x2_lo(s_word), inv_rms, uint16(w_word & uint32(0xFFFF)), weight_offset,
                           round_before_weight)
    hi = normalize_element(bf16x2_hi(s_word), inv_rms, uint16(w_word >> uint32(16)), weight_offset,
                           round_before_weight)
    return uint32(lo) | (uint32(hi) << uint32(16))


def pairs_per_thread(hidden: int) -> int:
    """Element pairs of a row each thread of a ``BLOCK_THREADS`` block holds in registers,
    ``ceil(hidden / 2 / BLOCK_THREADS)`` (a compile-time constant of the kernels that hold a whole row)."""
    return max(1, -(-hidden // (2 * BLOCK_THREADS)))


@functools.cache
def _add_rms_norm_kernel(pairs: int):
    """Build the norm kernel for rows of at most ``2 · pairs · BLOCK_THREADS`` elements (``pairs`` sizes the
    per-thread register arrays)."""
    U = pairs

    @kernel
    def add_rms_norm_rows(residual_in32, delta32, has_delta, weight32, residual_out32, write_residual, out32, eps,
                          weight_offset, round_before_weight):
        """Residual add fused with RMSNorm, or RMSNorm alone: ``s = bf16(residual_in + delta)`` (``s =
        residual_in`` without ``has_delta``; ``delta`` is then not read), ``residual_out = s`` when
        ``write_residual``, ``out = norm(s)``; the norm squares the rounded sum, as HF's bf16 forward does.

        residual_in32, delta32, residual_out32, out32 ``[tokens · hidden/2]`` and weight32 ``[hidden/2]``: the bf16
        tensors ``[tokens, hidden]`` / ``[hidden]`` seen as uint32 words (two adjacent elements each).
        ``residual_out`` may be ``residual_in`` itself (the in-place ``add_rms_norm``) or a buffer that does not
        overlap it (``add_rms_norm_into``).

        Geometry: one block of ``BLOCK_THREADS`` per token row (grid-stride over rows).  Thread t holds words
        t, t + B, ... of the row in registers (the sum order above): all its loads (residual, delta, weight) are issued
        at once — a row is one round trip to memory, not one per element — then ``block_sum`` of the squares, then
        the normalized words from the registers.  Each thread writes only the words it read, so in place is safe.
        """
        pdl_prologue()
        s_w = cuda.local.array(U, uint32)
        d_w = cuda.local.array(U, uint32)
        n_w = cuda.local.array(U, uint32)
        words = weight32.shape[0]
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        eps = float32(eps)
        weight_offset = float32(weight_offset)
        for row in range(cuda.blockIdx.x, residual_in32.shape[0] // words, cuda.gridDim.x):
            base = row * words
            for u in range(U):                      # every load of the row at once
                p = min(tid + u * nthreads, words - 1)
                s_w[u] = residual_in32[base + p]
                d_w[u] = delta32[base + p] if has_delta else uint32(0)
                n_w[u] = weight32[p]
            ss = float32(0.0)
            for u in range(U):
                p = tid + u * nthreads
                if p < words:
                    s_w[u] = add_pair(s_w[u], d_w[u], has_delta)
                    if write_residual:
                        residual_out32[base + p] = s_w[u]
                    v0 = bf16x2_lo(s_w[u])
                    v1 = bf16x2_hi(s_w[u])
                    ss += v0 * v0
                    ss += v1 * v1
            inv_rms = inverse_rms(block_sum(ss), 2 * words, eps)
            for u in range(U):
                p = tid + u * nthreads
                if p < words:
                    out32[base + p] = normalize_pair(s_w[u], n_w[u], inv_rms, weight_offset, round_before_weight)

    return add_rms_norm_rows


@functools.cache
def build_row_norm(pairs: int, nthreads: int):
    """``norm_row``: ``add_rms_norm_rows``'s work on one row, for a kernel of another block size ``nthreads`` (a
    multiple of 32) that must be bit-identical to it: the tensor-core GEMM's add + RMSNorm prologue
    (``linear.gemm_wgmma_ring``).

    The sum order is the norm's (module docstring) whatever ``nthreads`` is: thread ``tid`` plays the norm block's
    threads ``u = tid + j · nthreads`` (``j < ceil(BLOCK_THREADS / nthreads)``, ``u < BLOCK_THREADS``), sums each
    one's elements in its order, and the warp sums of those stand-ins land in the slots the norm block's warps
    would fill (stand-in u is lane ``u % 32`` of warp ``u // 32`` there and here), so ``block_sum``'s last step
    adds the same values in the same lanes.  ``pairs``: ``pairs_per_thread(hidden)``.

    ``norm_row(residual_in32, delta32, has_delta, weight32, residual_out32, out32, row, eps, weight_offset,
    round_before_weight, partial)``: the word views of ``add_rms_norm_rows``; ``partial``: 32 f32 of shared
    scratch.  Block-uniform: every thread calls it."""
    B = BLOCK_THREADS
    V = -(-B // nthreads)                  # norm-block threads a thread stands in for
    U = pairs
    VU = V * U                             # words a thread holds
    warps = nthreads // WARP
    norm_warps = B // WARP

    @device_fn
    def norm_row(residual_in32, delta32, has_delta, weight32, residual_out32, out32, row, eps, weight_offset,
                 round_before_weight, partial):
        s_w = cuda.local.array(VU, uint32)
        n_w = cuda.local.array(VU, uint32)
        words = weight32.shape[0]
        base = row * words
        tid = cuda.threadIdx.x
        lane = tid % WARP
        for j in range(V):                      # every load of the row at once
            for i in range(U):
                p = min(tid + j * nthreads + i * B, words - 1)
                s_w[j * U + i] = add_pair(residual_in32[base + p], delta32[base + p] if has_delta else uint32(0),
                                          has_delta)
                n_w[j * U + i] = weight32[p]
        cuda.syncthreads()                      # the last call's readers of ``partial`` are done
        for j in range(V):
            u = tid + j * nthreads
            ss = float32(0.0)
            for i in range(U):
                p = u + i * B
                if u < B and p < words:
                    residual_out32[base + p] = s_w[j * U + i]
                    v0 = bf16x2_lo(s_w[j * U + i])
                    v1 = bf16x2_hi(s_w[j * U + i])
                    ss += v0 * v0
                    ss += v1 * v1
            ss = warp_sum(ss)
            w = tid // WARP + j * warps
            if lane == 0 and w < norm_warps:
                partial[uint32(w)] = ss
        cuda.syncthreads()
        t = partial[uint32(lane)] if lane < norm_warps else float32(0.0)
        inv_rms = inverse_rms(warp_sum(t), 2 * words, float32(eps))
        for j in range(V):
            u = tid + j * nthreads
            for i in range(U):
                p = u + i * B
                if u < B and p < words:
                    out32[base + p] = normalize_pair(s_w[j * U + i], n_w[j * U + i], inv_rms, float32(weight_offset),
                                                     round_before_weight)

    return norm_row


def _check(x, weight, out):
    assert x.ndim == 2 and x.dtype == np.uint16, (x.shape, x.dtype)
    assert x.shape[1] % 2 == 0, f"hidden size must be even, got {x.shape[1]}"
    assert weight.ndim == 1 and weight.dtype == np.uint16 and weight.shape[0] == x.shape[1], (weight.shape, x.shape)
    assert out.shape == x.shape and out.dtype == np.uint16, (out.shape, out.dtype, x.shape)


BLOCK_THREADS = threads(gpu=256, sim=32)
"""Block size of every kernel here.  It fixes the order in which a row's squares are summed (module docstring): a
kernel that must be bit-identical to these norms (``linear``'s fused add + RMSNorm prologue) sums in blocks of this
size too."""


def _geometry(num_tokens):
    return grid(num_tokens, sim_cap=4), BLOCK_THREADS


def rms_norm(x, weight, out, eps: float, weight_offset: float = 0.0, round_before_weight: bool = True, *,
             policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out = RMSNorm(x) * (weight_offset + weight)`` per token row; x, out ``[T, H]``, weight ``[H]`` bf16 bits.
    Qwen3: defaults; Qwen3.5: ``weight_offset=1.0, round_before_weight=False``."""
    _check(x, weight, out)
    if x.shape[0] == 0:
        return
    _launch_add_rms_norm(x, None, weight, None, out, eps, weight_offset, round_before_weight, "rms_norm", policy)


def _words(a):
    return a.view(np.uint32).reshape(-1)


def _launch_add_rms_norm(residual_in, delta, weight, residual_out, out, eps, weight_offset, round_before_weight,
                         name: str, policy: LaunchPolicy):
    if residual_in.shape[0] == 0:
        return
    r32 = _words(residual_in)
    launch(_add_rms_norm_kernel(pairs_per_thread(residual_in.shape[1])), *_geometry(residual_in.shape[0]), r32,
           r32 if delta is None else _words(delta), delta is not None, _words(weight),
           r32 if residual_out is None else _words(residual_out), residual_out is not None, _words(out),
           np.float32(eps), np.float32(weight_offset), bool(round_before_weight), name=name, policy=policy)


def add_rms_norm(residual, delta, weight, out, eps: float, weight_offset: float = 0.0,
                 round_before_weight: bool = True, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``residual = bf16(residual + delta)`` in place, then ``out = rms_norm(residual)`` (same flags as
    ``rms_norm``); residual, delta, out ``[T, H]``, weight ``[H]`` bf16 bits."""
    _check(residual, weight, out)
    assert delta.shape == residual.shape and delta.dtype == np.uint16, (delta.shape, delta.dtype)
    _launch_add_rms_norm(residual, delta, weight, residual, out, eps, weight_offset, round_before_weight,
                         "add_rms_norm", policy)


def _memory_range(a) -> tuple[int, int]:
    start = array_address(a)
    return start, start + int(a.nbytes)


def check_residual_buffers(residual_in, delta, norm_weight, residual_out) -> None:
    """Raise ``ValueError`` unless the arguments fit ``add_rms_norm_into``: residual_in, residual_out (and delta,
    unless None) ``[T, H]`` uint16, norm_weight ``[H]`` uint16, residual_out not overlapping residual_in."""
    for name, a in (("residual_in", residual_in), ("residual_out", residual_out)):
        if a.ndim != 2 or a.dtype != np.uint16:
            raise ValueError(f"{name} must be a 2-D uint16 array, got shape {a.shape} dtype {a.dtype}")
    if residual_out.shape != residual_in.shape:
        raise ValueError(f"residual_out {residual_out.shape} must match residual_in {residual_in.shape}")
    if delta is not None and (delta.shape != residual_in.shape or delta.dtype != np.uint16):
        raise ValueError(f"delta {delta.shape} {delta.dtype} must match residual_in {residual_in.shape} (uint16)")
    if norm_weight.shape != (residual_in.shape[1],) or norm_weight.dtype != np.uint16:
        raise ValueError(f"norm_weight {norm_weight.shape} {norm_weight.dtype} must be [{residual_in.shape[1]}] "
                         "uint16")
    (a0, a1), (b0, b1) = _memory_range(residual_in), _memory_range(residual_out)
    if a0 < b1 and b0 < a1:
        raise ValueError("residual_out must not overlap residual_in (add_rms_norm is the in-place form; the fused "
                         "linear_add_rms_norm reads all of residual_in while its blocks write residual_out)")


def add_rms_norm_into(residual_in, delta, norm_weight, residual_out, normed_out, eps: float,
                      weight_offset: float = 0.0, round_before_weight: bool = True, *,
                      policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``residual_out = s = bf16(residual_in + delta)`` (``delta=None``: ``s = residual_in``), ``normed_out =
    rms_norm(s)``: ``add_rms_norm`` / ``rms_norm`` with the sum written to another buffer, bit for bit;
    ``residual_in`` is not written.  All ``[T, H]`` but norm_weight ``[H]``, uint16 bf16 bits."""
    check_residual_buffers(residual_in, delta, norm_weight, residual_out)
    if normed_out.shape != residual_in.shape or normed_out.dtype != np.uint16:
        raise ValueError(f"normed_out {normed_out.shape} {normed_out.dtype} must match residual_in "
                         f"{residual_in.shape} (uint16)")
    _launch_add_rms_norm(residual_in, delta, norm_weight, residual_out, normed_out, eps, weight_offset,
                         round_before_weight, "add_rms_norm_into", policy)
