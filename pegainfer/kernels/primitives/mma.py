"""Tensor cores: one warp-wide bf16 matrix multiply-accumulate, and the warp-wide shared-memory load that feeds it.

``mma_bf16_m16n8k16`` is one warp-wide ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: D[16×8] =
A[16×16] · B[16×8] + C in f32.  Fragment layout (PTX ISA; checked on the H200), per lane with g = lane >> 2 and
t = lane & 3, every uint32 holding two bf16 with the lower index in the low half:
  a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]   a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
  b0 = B[2t:2t+2, g]   b1 = B[2t+8:2t+10, g]
  c0, c1 = C[g, 2t:2t+2]   c2, c3 = C[g+8, 2t:2t+2]   (the same for the returned d0..d3)
Every lane of the warp must call it (in the simulator: every thread of the block, equally often, like the warp
reductions).  ``bf16.pack_bf16x2`` builds the A/B fragment words.

``ldmatrix_x4(smem, i)`` is one warp-wide ``ldmatrix.sync.aligned.m8n8.x4.shared.b16``: four 8 × 8 bf16 matrices
from shared memory (``smem``: a uint32 array), one instruction for what would be four 32-bit loads a lane.  Lane
``8j + r`` gives the word index ``i`` of row r of matrix j (8 bf16 = 16 bytes = 4 words, 16-byte aligned); every
lane gets back (r0, r1, r2, r3), where rj holds the words ``smem[i_(8j + g) + t]`` (g = lane >> 2, t = lane & 3):
row g, bf16 columns 2t and 2t + 1 of matrix j -- exactly the fragment layout above.  So rows of a row-major
``[tokens, K]`` tile give A fragments (matrices: rows 0-7 / 8-15 × k 0-7 / 8-15 in the order a0..a3) and rows of a
``[N, K]`` weight tile give B fragments (rows n 0-7 × k 0-7 / 8-15: b0, b1).  Same calling rule as the mma.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn
from pegainfer.kernels.primitives.reductions import WARP

if SIMULATOR:
    # Where each operand element lives: A[r, k] in lane (r % 8)·4 + (k % 8) // 2, register (k >= 8)·2 + (r >= 8),
    # half k % 2; B[k, n] in lane n·4 + (k % 8) // 2, register 4 + (k >= 8), half k % 2.
    _MMA_R, _MMA_K = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    _MMA_A_LANE = (_MMA_R % 8) * 4 + (_MMA_K % 8) // 2
    _MMA_A_REG = (_MMA_K >= 8) * 2 + (_MMA_R >= 8)
    _MMA_A_SHIFT = (16 * (_MMA_K % 2)).astype(np.uint32)
    _MMA_KB, _MMA_N = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    _MMA_B_LANE = _MMA_N * 4 + (_MMA_KB % 8) // 2
    _MMA_B_REG = 4 + (_MMA_KB >= 8)
    _MMA_B_SHIFT = (16 * (_MMA_KB % 2)).astype(np.uint32)

    def _mma_halves(words, shift):
        return ((((words >> shift) & np.uint32(0xFFFF)) << np.uint32(16)).astype(np.uint32)
                .view(np.float32).astype(np.float64))

    @device_fn
    def mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """Emulated warp-wide ``mma.sync.m16n8k16`` (layout above): the warp's fragments meet in block-shared
        scratch; products are exact in float64, added to C and rounded to f32."""
        regs = cuda.shared.array((1024, 6), np.uint32)
        t = int(cuda.threadIdx.x)
        for i, r in enumerate((a0, a1, a2, a3, b0, b1)):
            regs[t, i] = r
        cuda.syncthreads()
        w = regs[t - t % WARP:t - t % WARP + WARP].copy()
        cuda.syncthreads()
        a = _mma_halves(w[_MMA_A_LANE, _MMA_A_REG], _MMA_A_SHIFT)
        b = _mma_halves(w[_MMA_B_LANE, _MMA_B_REG], _MMA_B_SHIFT)
        d = a @ b
        g, q = (t % WARP) >> 2, t & 3
        return (np.float32(c0 + d[g, 2 * q]), np.float32(c1 + d[g, 2 * q + 1]),
                np.float32(c2 + d[g + 8, 2 * q]), np.float32(c3 + d[g + 8, 2 * q + 1]))

    @device_fn
    def ldmatrix_x4(smem, i):
        """Emulated warp-wide ``ldmatrix .x4`` (layout above): the lanes' row addresses meet in block-shared
        scratch, then every lane reads its four words."""
        rows = cuda.shared.array(1024, np.int64)
        t = int(cuda.threadIdx.x)
        rows[t] = int(i)
        cuda.syncthreads()
        w0 = t - t % WARP
        g, q = (t % WARP) >> 2, t & 3
        r = [np.uint32(smem[int(rows[w0 + 8 * j + g]) + q]) for j in range(4)]
        cuda.syncthreads()
        return r[0], r[1], r[2], r[3]
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.ptx import _element_pointer

    @intrinsic
    def mma_bf16_m16n8k16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` (fragment layout above); returns (d0..d3)."""
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            i32, f32 = ir.IntType(32), ir.FloatType()
            ins = [context.cast(builder, v, ty, types.uint32) for v, ty in zip(args[:6], sig.args[:6])]
            ins += [context.cast(builder, v, ty, types.float32) for v, ty in zip(args[6:], sig.args[6:])]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fnty,
                               "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                               "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, ins)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    @intrinsic
    def ldmatrix_x4(typingctx, smem, i):
        """``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` from the row address ``&smem[i]`` (layout above); returns
        (r0, r1, r2, r3).  The address is a 32-bit shared-window address (an LLVM address-space cast, which the
        compiler folds into the array's base) and the asm is volatile, so it stays between the barriers around it."""
        sig = types.UniTuple(types.uint32, 4)(smem, i)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            shared = builder.addrspacecast(p, ir.PointerType(p.type.pointee, 3))
            addr = builder.ptrtoint(shared, i32)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32]),
                               "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
                               "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            res = builder.call(asm, [addr])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, k) for k in range(4)])

        return sig, codegen
