"""The transposing warp-wide shared-memory load: the B fragments of ``P · V`` straight from a row-major V tile.

``ldmatrix_x4_trans(smem, i)`` is one warp-wide ``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16``: four 8 × 8 bf16
matrices from shared memory (``smem``: a uint32 array), each delivered transposed.  As for ``mma.ldmatrix_x4``, lane
``8j + r`` gives the word index ``i`` of row r of matrix j (8 bf16 = 16 bytes = 4 words, 16-byte aligned); every lane
gets back (r0, r1, r2, r3), where rj packs the bf16 at column ``g`` of rows ``2t`` (low half) and ``2t + 1`` (high
half) of matrix j (g = lane >> 2, t = lane & 3).

Why: the B operand of ``mma.m16n8k16`` wants, per lane, ``B[2t:2t+2, g]``: two consecutive k for one n.  With
``P · V`` the k index is the key and n the head dim, but a V tile is stored as the cache holds it, one key per row
(``[keys, D]``), so the two k of a fragment word sit in two different rows.  The ``.trans`` load reads 8 rows of
8 dims and hands lane (g, t) keys 2t, 2t + 1 of dim g -- exactly ``b0`` (rows = keys 0-7) or ``b1`` (keys 8-15) of
the n8 tile of those 8 dims -- so V needs no transposed staging.  Same calling rule as the mma: every lane of the
warp calls it (in the simulator every thread of the block, equally often, like the warp reductions).
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn
from pegainfer.kernels.primitives.reductions import WARP

if SIMULATOR:
    @device_fn
    def ldmatrix_x4_trans(smem, i):
        """Emulated warp-wide ``ldmatrix .x4 .trans`` (layout above): the lanes' row addresses meet in block-shared
        scratch, then lane (g, t) gathers column g of rows 2t and 2t + 1 of each matrix."""
        rows = cuda.shared.array(1024, np.int64)
        t = int(cuda.threadIdx.x)
        rows[t] = int(i)
        cuda.syncthreads()
        w0 = t - t % WARP
        g, q = (t % WARP) >> 2, t & 3
        word, shift = g >> 1, 16 * (g & 1)
        r = []
        for j in range(4):
            lo = (int(smem[int(rows[w0 + 8 * j + 2 * q]) + word]) >> shift) & 0xFFFF
            hi = (int(smem[int(rows[w0 + 8 * j + 2 * q + 1]) + word]) >> shift) & 0xFFFF
            r.append(np.uint32(lo | (hi << 16)))
        cuda.syncthreads()
        return r[0], r[1], r[2], r[3]
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.ptx import _element_pointer

    @intrinsic
    def ldmatrix_x4_trans(typingctx, smem, i):
        """``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` from the row address ``&smem[i]`` (layout above);
        returns (r0, r1, r2, r3).  A 32-bit shared-window address, volatile asm: as ``mma.ldmatrix_x4``."""
        sig = types.UniTuple(types.uint32, 4)(smem, i)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            shared = builder.addrspacecast(p, ir.PointerType(p.type.pointee, 3))
            addr = builder.ptrtoint(shared, i32)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32]),
                               "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
                               "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            res = builder.call(asm, [addr])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, k) for k in range(4)])

        return sig, codegen
