"""SwiGLU on the output of a gate/up projection: ``out = bf16(bf16(silu(gate)) · up)`` (``silu`` in f32), a
grid-stride loop over the outputs; ``silu`` is also the activation of ``linear.linear_silu_mul``'s epilogue."""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (bf16_to_f32, cuda, device_fn, f32_to_bf16, float32, grid, kernel, math,
                                          pdl_prologue, threads)


@device_fn
def silu(g):
    """``g · sigmoid(g)`` in f32 (written as torch writes it: ``g / (1 + exp(-g))``)."""
    return g / (float32(1.0) + float32(math.exp(-g)))


@kernel
def silu_mul_kernel(gate_up, out):
    """SwiGLU: ``out[t, i] = bf16(bf16(silu(gate_up[t, i])) · gate_up[t, I + i])``.

    gate_up ``[tokens, 2·I]`` bf16 bits (gate in columns ``[0, I)``, up in ``[I, 2I)``); out ``[tokens, I]`` bf16 bits.

    Geometry: 1-D grid-stride loop over the ``tokens · I`` outputs (consecutive threads take consecutive columns,
    so loads and stores coalesce).
    """
    pdl_prologue()
    inter = out.shape[1]
    n = out.shape[0] * inter
    for k in range(cuda.grid(1), n, cuda.gridsize(1)):
        t = k // inter
        i = k - t * inter
        g = bf16_to_f32(gate_up[t, i])
        act = bf16_to_f32(f32_to_bf16(silu(g)))
        out[t, i] = f32_to_bf16(act * bf16_to_f32(gate_up[t, inter + i]))


def silu_mul(gate_up, out, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out = bf16(bf16(silu(gate)) * up)`` where ``gate, up = gate_up[:, :I], gate_up[:, I:]`` (uint16 bf16 bits,
    gate_up ``[T, 2I]``, out ``[T, I]``)."""
    assert gate_up.ndim == 2 and gate_up.dtype == np.uint16, (gate_up.shape, gate_up.dtype)
    assert out.ndim == 2 and out.dtype == np.uint16, (out.shape, out.dtype)
    assert gate_up.shape == (out.shape[0], 2 * out.shape[1]), (gate_up.shape, out.shape)
    n = out.shape[0] * out.shape[1]
    if n == 0:
        return
    block = threads(gpu=256, sim=32)
    launch(silu_mul_kernel, grid(n, per_block=block, sim_cap=4), block, gate_up, out, policy=policy)
