"""The gated RMSNorm after the delta rule (HF ``Qwen3_5RMSNormGated``), for prompts: a warp per (token, head) row."""
from __future__ import annotations

import numpy as np

from pegainfer.kernels.gated_delta.common import check_bf16, gated_norm_value
from pegainfer.kernels.launch import launch
from pegainfer.kernels.norm import inverse_rms
from pegainfer.kernels.policy import DEFAULT_POLICY, LaunchPolicy
from pegainfer.kernels.primitives import (WARP, bf16_to_f32, cuda, float32, grid, kernel, pdl_prologue, threads,
                                          warp_sum)


@kernel
def gated_rms_norm_kernel(x, z, weight, out, eps):
    """HF ``Qwen3_5RMSNormGated`` over each head's ``Dv`` values, gated by SiLU of ``z``.

    x, z, out ``[tokens, Hv·Dv]`` bf16 (x: the rule's output, z: in_proj_z output), weight ``[Dv]`` bf16 (a
    plain weight, initialised to ones: *not* the ``1 + w`` form of the other Qwen3.5 norms).  Per (token, head)
    row, ``r = 1/sqrt(mean(x²) + eps)`` in f32 and, rounding as HF's bf16 forward does::

        out = bf16( bf16(w · bf16(x·r)) · silu(z) )

    Geometry: one warp per (token, head) row (``Dv`` is small: 128 in Qwen3.5), ``W`` rows per block, grid-strided
    with a trip count uniform across the block (the warp reduction needs every thread); lanes stride over ``Dv``.
    Each lane reads back only its own columns, so ``out`` may alias ``x``.
    """
    pdl_prologue()
    group = weight.shape[0]
    heads = x.shape[1] // group
    rows = x.shape[0] * heads
    eps = float32(eps)
    lane = cuda.threadIdx.x % WARP
    warps = cuda.blockDim.x // WARP
    for first in range(cuda.blockIdx.x * warps, rows, cuda.gridDim.x * warps):
        row = first + cuda.threadIdx.x // WARP
        active = row < rows
        t = row // heads
        base = (row % heads) * group
        ss = float32(0.0)
        if active:
            for i in range(lane, group, WARP):
                v = bf16_to_f32(x[t, base + i])
                ss += v * v
        inv_rms = inverse_rms(warp_sum(ss), group, eps)
        if active:
            for i in range(lane, group, WARP):
                out[t, base + i] = gated_norm_value(bf16_to_f32(x[t, base + i]), inv_rms, weight[i], z[t, base + i])


def gated_rms_norm(x, z, weight, out, eps: float, *, policy: LaunchPolicy = DEFAULT_POLICY) -> None:
    """``out = RMSNormGated(x, gate=z)`` per head of ``Dv = weight.shape[0]`` values; x, z, out ``[T, Hv·Dv]``,
    weight ``[Dv]`` bf16 bits (out may be x)."""
    check_bf16(x, 2)
    check_bf16(z, 2)
    check_bf16(weight, 1)
    check_bf16(out, 2)
    assert z.shape == x.shape and out.shape == x.shape, (x.shape, z.shape, out.shape)
    assert x.shape[1] % weight.shape[0] == 0, (x.shape, weight.shape)
    rows = x.shape[0] * (x.shape[1] // weight.shape[0])
    if rows == 0:
        return
    block = threads(gpu=128, sim=64)
    launch(gated_rms_norm_kernel, grid(rows, per_block=block // WARP, sim_cap=2), block, x, z, weight, out,
           np.float32(eps), policy=policy)
