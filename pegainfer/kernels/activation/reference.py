"""The reference SwiGLU: one thread per output element, each op rounded to bf16 where HF's bf16 forward rounds.

HF computes ``act_fn(gate_proj(x)) * up_proj(x)`` on bf16 tensors, so::

    gate, up = gate_up[t, i], gate_up[t, I + i]          (bf16)
    act      = bf16(gate / (1 + exp(-gate)))             (silu in f32, rounded: torch's silu returns bf16)
    out[t, i] = bf16(act · up)                           (the product in f32, rounded)

gate_up ``[tokens, 2·I]`` (gate in columns ``[0, I)``, up in ``[I, 2I)``) and out ``[tokens, I]``, uint16 bf16 bits.
The tuned kernel (``swiglu.py``) evaluates the same f32 expressions: the tests compare the two bit for bit.
"""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import bf16_to_f32, cuda, f32_to_bf16, float32, grid, kernel, math, threads


@kernel
def reference_silu_mul_kernel(gate_up, out):
    """``out[t, i] = bf16(bf16(silu(gate)) · up)``; a thread per element ``(t, i)`` (grid-stride, for the
    simulator's small grids)."""
    tokens, inter = out.shape
    for k in range(cuda.grid(1), tokens * inter, cuda.gridsize(1)):
        t = k // inter
        i = k - t * inter
        gate = bf16_to_f32(gate_up[t, i])
        up = bf16_to_f32(gate_up[t, inter + i])
        act = bf16_to_f32(f32_to_bf16(gate / (float32(1.0) + float32(math.exp(-gate)))))
        out[t, i] = f32_to_bf16(act * up)


def reference_silu_mul(gate_up, out) -> None:
    """``out = bf16(bf16(silu(gate)) · up)`` with ``gate, up = gate_up[:, :I], gate_up[:, I:]`` (uint16 bf16 bits,
    device arrays: gate_up ``[T, 2I]``, out ``[T, I]``)."""
    assert gate_up.dtype == out.dtype == np.uint16 and gate_up.shape == (out.shape[0], 2 * out.shape[1]), (
        gate_up.shape, out.shape)
    n = out.shape[0] * out.shape[1]
    if n == 0:
        return
    block = threads(gpu=256, sim=32)
    launch(reference_silu_mul_kernel, grid(n, per_block=block, sim_cap=4), block, gate_up, out)
