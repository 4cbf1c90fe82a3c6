"""``exp2_approx(x)``: 2^x in one instruction, for softmax probabilities.

On the GPU it is ``ex2.approx.ftz.f32`` (the SFU's ``MUFU.EX2``; relative error about 2^-22, results below 2^-126
flushed to zero).  ``math.exp2`` on f32 goes through libdevice's ``exp2f``, which wraps the same instruction in a
range test and two multiplies to keep subnormal results: three more instructions per probability, in the inner loop
of the prefill kernel, for values that are rounded to bf16 next to a 1 (the row maximum's) anyway.  ``-inf`` gives
0, as a masked score needs.  In the simulator it is ``math.exp2`` in f32.
"""
from __future__ import annotations

import math

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn

if SIMULATOR:
    @device_fn
    def exp2_approx(x):
        return np.float32(math.exp2(float(x)))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def exp2_approx(typingctx, x):
        """``ex2.approx.ftz.f32``."""
        sig = types.float32(x)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.call(ir.InlineAsm(ir.FunctionType(f32, [f32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f"), [v])

        return sig, codegen
