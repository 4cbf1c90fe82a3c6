"""The entry points the models call: ``linear``, ``linear_silu_mul`` and ``linear_add_rms_norm``, and which kernel
each takes for T tokens (``default_impl``)."""
from __future__ import annotations

import numpy as np

from pegainfer.device import SIMULATOR, has_wgmma
from pegainfer.kernels.linear.common import is_contiguous
from pegainfer.kernels.linear.gemm import gemm_mma
from pegainfer.kernels.linear.gemm_fma import gemm_fma
from pegainfer.kernels.linear.gemm_wgmma import fuses_ring_norm, gemm_wgmma, gemm_wgmma_add_rms_norm
from pegainfer.kernels.linear.gemv_multi import gemv
from pegainfer.kernels.linear.gemv_decode import gemv_decode_add_rms_norm
from pegainfer.kernels.linear.geometry import (GEMV_MAX_TOKENS, NORM_THREADS, SKINNY_MAX_TOKENS, GemvGeometry,
                                               fused_norm_geometry, gemv_k_chunk)
from pegainfer.kernels.linear.skinny import linear_skinny
from pegainfer.kernels.norm import add_rms_norm_into, check_residual_buffers
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import WARP, array_address

IMPLS = ("gemv", "skinny", "gemm_fma", "gemm_mma", "gemm_wgmma")


def check_shapes(x, w, out, gated: bool, impl) -> None:
    """Raise ``ValueError`` naming the problem unless x ``[T, K]``, w ``[N, K]`` (``[2I, K]`` gated) and out
    ``[T, N]`` (``[T, I]``) are contiguous uint16 arrays, out starting at a 4-byte boundary, K a multiple of 8, and
    ``impl`` one of ``IMPLS`` or None."""
    for name, a in (("x", x), ("w", w), ("out", out)):
        if a.ndim != 2 or a.dtype != np.uint16:
            raise ValueError(f"{name} must be a 2-D uint16 (bf16 bits) array, got shape {a.shape} dtype {a.dtype}")
        if not is_contiguous(a):
            raise ValueError(f"{name} must be C-contiguous (shape {a.shape})")
    T, k = x.shape
    if k % 8 != 0:
        raise ValueError(f"K = {k} must be a multiple of 8 (the kernels read 16-byte runs of 8 bf16)")
    if w.shape[1] != k:
        raise ValueError(f"weight {w.shape} does not match x {x.shape}: both need K = {k} columns")
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    if gated and w.shape[0] % 2:
        raise ValueError(f"w_gate_up {w.shape} must have an even number of rows (gate rows then up rows)")
    if out.shape != (T, n_out):
        raise ValueError(f"out {out.shape} must be {(T, n_out)} for x {x.shape} and weight {w.shape}")
    if array_address(out) % 4:
        raise ValueError("out must start at a 4-byte boundary (the GEMMs write two bf16 values in one store)")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")


def default_impl(n_tokens: int) -> str:
    """The path ``linear(impl=None)`` takes for T tokens.  GPU: the GEMV for T = 1, the skinny tensor-core kernel
    for 2 <= T <= 16 (weights straight into mma fragments), a GEMM above (weights staged in shared memory once for
    all tokens; split-K when given a workspace): the Hopper ``wgmma`` GEMM on sm_90, the ``mma.sync`` GEMM on
    other GPUs -- the fastest on the H200 at each T for the served shapes (docs/perf/linear.md).  Simulator: the
    GEMV up to ``GEMV_MAX_TOKENS``, the FMA tiles above (cheap to emulate; the tensor-core kernels have their own
    tests)."""
    if SIMULATOR:
        return "gemv" if n_tokens <= GEMV_MAX_TOKENS else "gemm_fma"
    if n_tokens <= 1:
        return "gemv"
    if n_tokens <= SKINNY_MAX_TOKENS:
        return "skinny"
    return "gemm_wgmma" if has_wgmma() else "gemm_mma"


def run_linear(x, w, out, gated: bool, impl, policy: LaunchPolicy, workspace=None) -> None:
    """``linear`` (``gated``: ``linear_silu_mul``) on the path ``impl`` (None: ``default_impl``)."""
    check_shapes(x, w, out, gated, impl)
    if x.shape[0] == 0 or out.shape[1] == 0:
        return
    if impl is None:
        impl = default_impl(x.shape[0])
    if impl == "gemv":
        gemv(x, w, out, gated=gated, policy=policy)
    elif impl == "skinny":
        linear_skinny(x, w, out, gated=gated, policy=policy)
    elif impl == "gemm_fma":
        gemm_fma(x, w, out, gated=gated, policy=policy)
    elif impl == "gemm_wgmma":
        gemm_wgmma(x, w, out, gated=gated, workspace=workspace, policy=policy)
    else:
        gemm_mma(x, w, out, gated=gated, workspace=workspace, policy=policy)


def linear(x, w, out, impl: str | None = None, *, workspace=None, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out = bf16(x @ w.T)`` with f32 accumulation.

    x ``[T, K]``, w ``[N, K]``, out ``[T, N]``: contiguous uint16 bf16 bits; K a multiple of 8.
    ``impl``: ``None`` picks the path for T tokens (``default_impl``); ``"gemv"``, ``"skinny"``, ``"gemm_fma"``,
    ``"gemm_mma"`` force one (tests compare them all).
    ``workspace``: an f32 device array of at least ``linear_workspace_size`` elements, allocated once by the caller:
    the split-K partials of the tensor-core GEMM (``splitk``).  Without it that GEMM runs unsplit (slower for few
    tokens on short-and-wide weights); results are the same up to the f32 sum order (``splitk``: the bound).
    """
    run_linear(x, w, out, False, impl, policy, workspace)


def linear_silu_mul(x, w_gate_up, out, impl: str | None = None, *, workspace=None,
                    policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """The MLP's fused gate/up projection + SwiGLU: ``out = bf16(bf16(silu(g)) · u)`` with ``g = bf16(x @ Wg.T)``,
    ``u = bf16(x @ Wu.T)``.

    x ``[T, K]``, w_gate_up ``[2I, K]`` (gate rows ``[0, I)`` then up rows ``[I, 2I)``), out ``[T, I]``; ``impl`` and
    ``workspace`` as in ``linear``.  Every kernel sees the weight as 2I logical columns interleaved in pairs (``common.weight_row``:
    column ``2j`` is gate row ``j``, ``2j + 1`` up row ``I + j``), so a pair always lands in one thread, which
    writes the SwiGLU output; neither g nor u is ever written to memory.
    """
    run_linear(x, w_gate_up, out, True, impl, policy, workspace)


def _fusable(n_tokens: int, k: int, impl, geo: GemvGeometry) -> bool:
    return (n_tokens == 1 and impl in (None, "gemv") and default_impl(1) == "gemv"
            and geo.warps * WARP == NORM_THREADS and geo.warps % geo.k_split == 0 and geo.max_tokens == 1
            and geo.stage_x and gemv_k_chunk(k, geo) >= k)


def fuses_add_rms_norm(n_tokens: int, w, gated: bool = False, policy: LaunchPolicy = DEFAULT_POLICY) -> bool:
    """Whether ``linear_add_rms_norm`` over ``n_tokens`` tokens and weight ``w`` is one launch (the one-token GEMV
    with the norm as its prologue), which is also when it takes ``row_ids``."""
    n, k = w.shape
    return n > 0 and _fusable(n_tokens, k, None, fused_norm_geometry(n, k, gated, policy))


def linear_add_rms_norm(residual_in, delta, norm_weight, eps: float, residual_out, w, out, *, gated: bool = False,
                        weight_offset: float = 0.0, round_before_weight: bool = True, normed_out=None,
                        impl: str | None = None, geometry: GemvGeometry | None = None, row_ids=None, head=None,
                        residual_ready: bool = False, workspace=None, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """The decoder's residual add and RMSNorm followed by a projection:

        s = bf16(residual_in + delta)       (delta=None: s = residual_in)      -> residual_out
        n = rms_norm(s) · norm_weight       (``norm``'s two roundings: ``weight_offset``, ``round_before_weight``)
        out = linear(n, w)                  (gated: linear_silu_mul(n, w))

    residual_in, delta, residual_out ``[T, H]``, norm_weight ``[H]``, w ``[N, H]`` (``[2I, H]`` gated), out
    ``[T, N]`` (``[T, I]``): uint16 bf16 bits.  ``residual_in`` is never written; ``residual_out`` must be another
    buffer (a model ping-pongs two).  Results are bit-identical to ``norm.add_rms_norm`` (or ``norm.rms_norm``)
    followed by ``linear`` / ``linear_silu_mul``, on every path.

    One token (``fuses_add_rms_norm``): a single launch; the norm is the one-token GEMV's x-staging prologue
    (``gemv_decode``), computed by every block from the whole row (at most a few KB, from L2); n is never written to
    memory and ``normed_out`` is not touched.  ``geometry`` (tests, benchmarks) overrides ``fused_norm_geometry``
    and must keep its block size.
    ``row_ids`` ``[1]`` int32 (one-token path only; ``delta`` None): ``residual_in`` is an embedding table
    ``[V, H]`` and the residual its row ``row_ids[0]`` -- the first layer's embedding lookup, done by the GEMV's
    prologue instead of a launch of its own (bit-identical to ``embedding`` first).
    ``head`` (``sampling.HeadArgmax``; one-token path only, not gated): the launch is the LM head of a one-sequence
    step, and also writes the greedy token of its logits row, which the sampler then takes as it is
    (``sampling.sample(head=)``).
    ``residual_ready`` (one-token path): ``residual_in`` was written by a kernel that has completed by the time this
    launch starts (``LaunchPolicy.residual_ready``), so the prologue reads it before its PDL wait, leaving only
    ``delta`` for after it.
    17-64 tokens on the ``wgmma`` GEMM with ``policy.gemm_norm_prologue`` (and a ``workspace``): one launch of the
    ring GEMM whose blocks first write ``residual_out`` and ``normed_out`` (``gemm_wgmma_add_rms_norm``).
    Otherwise: ``add_rms_norm_into`` into ``normed_out`` (required then: a ``[T, H]`` scratch), then ``linear`` with
    ``impl`` and ``workspace``.  Nothing is allocated; every launch can be captured in a CUDA graph.
    """
    if row_ids is not None:
        if delta is not None or row_ids.shape != (1,) or row_ids.dtype != np.int32 or not fuses_add_rms_norm(
                1, w, gated, policy) or impl not in (None, "gemv") or geometry is not None:
            raise ValueError("row_ids: one token, no delta, the one-token GEMV path (fuses_add_rms_norm)")
        check_shapes(residual_out, w, out, gated, impl)              # residual_out [1, H] as the x of the GEMV
        if (residual_in.ndim != 2 or residual_in.dtype != np.uint16 or not is_contiguous(residual_in)
                or residual_in.shape[1] != residual_out.shape[1]):
            raise ValueError(f"with row_ids, residual_in is the embedding table: a contiguous [V, "
                             f"{residual_out.shape[1]}] uint16 array, got {residual_in.shape} {residual_in.dtype}")
        if norm_weight.shape != (residual_out.shape[1],) or norm_weight.dtype != np.uint16:
            raise ValueError(f"norm_weight {norm_weight.shape} {norm_weight.dtype} must be [{residual_out.shape[1]}] "
                             "uint16")
        gemv_decode_add_rms_norm(residual_in, None, norm_weight, eps, residual_out, w, out, gated, weight_offset,
                                 round_before_weight, fused_norm_geometry(*w.shape, gated, policy), policy,
                                 row_ids=row_ids, head=head)
        return
    check_residual_buffers(residual_in, delta, norm_weight, residual_out)
    check_shapes(residual_in, w, out, gated, impl)
    T, k = residual_in.shape
    if T == 0:
        return
    geo = geometry or fused_norm_geometry(w.shape[0], k, gated, policy)
    fused = _fusable(T, k, impl, geo)
    if geometry is not None and not fused:
        raise ValueError(f"geometry {geometry} does not give the fused one-token path (T = {T}, impl = {impl!r})")
    if fused and out.shape[1] > 0:         # (no columns: no blocks, which would leave residual_out unwritten)
        gemv_decode_add_rms_norm(residual_in, delta, norm_weight, eps, residual_out, w, out, gated, weight_offset,
                                 round_before_weight, geo, policy, head=head, residual_early=residual_ready)
        return
    if head is not None:
        raise ValueError(f"head: the one-token path only (fuses_add_rms_norm), got T = {T}")
    if normed_out is None:
        raise ValueError(f"normed_out (a [{T}, {k}] scratch) is needed: T = {T} takes the unfused path")
    if (workspace is not None and (impl or default_impl(T)) == "gemm_wgmma" and out.shape[1] > 0
            and fuses_ring_norm(T, w.shape[0], k, gated, policy)):
        check_shapes(normed_out, w, out, gated, impl)
        gemm_wgmma_add_rms_norm(residual_in, delta, norm_weight, eps, residual_out, normed_out, w, out, gated=gated,
                                weight_offset=weight_offset, round_before_weight=round_before_weight,
                                workspace=workspace, policy=policy)
        return
    add_rms_norm_into(residual_in, delta, norm_weight, residual_out, normed_out, eps, weight_offset,
                      round_before_weight, policy=policy)
    run_linear(normed_out, w, out, gated, impl, policy, workspace)
