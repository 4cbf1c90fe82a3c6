"""Reference kernels of the projections: the math of ``linear`` and ``linear_silu_mul`` stated line by line, one
thread per output element.  Slow but plain; the tuned kernels are tested against them.

    linear:           out[t, n] = bf16( Σ_k x[t, k] · w[n, k] )                   f32 products and sum, k in order
    linear_silu_mul:  g = bf16( Σ_k x[t, k] · w[j, k] )                           gate row j
                      u = bf16( Σ_k x[t, k] · w[I + j, k] )                       up row I + j
                      out[t, j] = bf16( bf16(silu(g)) · u )                       silu(g) = g / (1 + exp(-g)) in f32

x ``[T, K]``, w ``[N, K]`` (gated: ``[2I, K]``, the gate rows then the up rows), out ``[T, N]`` (``[T, I]``): bf16
bits (``uint16``).  These are the tuned kernels' rounding points: each rounds to bf16 exactly there; they sum the
products in other orders (lanes, warps, tensor-core fragments), so on arbitrary data their f32 sums, and rarely
their bf16 outputs, differ in the last bit.  On data whose sums are exact in f32 every path gives the same bits.
"""
from __future__ import annotations

from pegainfer.kernels.activation import silu
from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import bf16_to_f32, cuda, f32_to_bf16, float32, grid, kernel, threads


@kernel
def linear_reference(x, w, out):
    """``out[t, n] = bf16(Σ_k x[t, k] · w[n, k])``: a grid-stride loop over the ``T · N`` outputs."""
    T, N = out.shape
    K = x.shape[1]
    for i in range(cuda.grid(1), T * N, cuda.gridsize(1)):
        t = i // N
        n = i % N
        acc = float32(0.0)
        for k in range(K):
            acc += bf16_to_f32(x[t, k]) * bf16_to_f32(w[n, k])
        out[t, n] = f32_to_bf16(acc)


@kernel
def linear_silu_mul_reference(x, w_gate_up, out):
    """``out[t, j] = bf16(bf16(silu(g)) · u)``, ``g = bf16(x[t] · w[j])``, ``u = bf16(x[t] · w[I + j])``: a
    grid-stride loop over the ``T · I`` outputs."""
    T, I = out.shape
    K = x.shape[1]
    for i in range(cuda.grid(1), T * I, cuda.gridsize(1)):
        t = i // I
        j = i % I
        g_sum = float32(0.0)
        u_sum = float32(0.0)
        for k in range(K):
            xk = bf16_to_f32(x[t, k])
            g_sum += xk * bf16_to_f32(w_gate_up[j, k])
            u_sum += xk * bf16_to_f32(w_gate_up[I + j, k])
        g = bf16_to_f32(f32_to_bf16(g_sum))
        u = bf16_to_f32(f32_to_bf16(u_sum))
        act = bf16_to_f32(f32_to_bf16(silu(g)))
        out[t, j] = f32_to_bf16(act * u)


def _launch(kern, x, w, out, name: str) -> None:
    nthreads = threads(gpu=256, sim=32)
    launch(kern, grid(out.shape[0] * out.shape[1], nthreads, sim_cap=4), nthreads, x, w, out, name=name)


def reference_linear(x, w, out) -> None:
    """``out = bf16(x @ w.T)`` (module docstring) with the reference kernel; device arrays of bf16 bits."""
    _launch(linear_reference, x, w, out, "linear_reference")


def reference_linear_silu_mul(x, w_gate_up, out) -> None:
    """``out = bf16(bf16(silu(g)) · u)`` (module docstring) with the reference kernel; device arrays of bf16 bits."""
    _launch(linear_silu_mul_reference, x, w_gate_up, out, "linear_silu_mul_reference")
