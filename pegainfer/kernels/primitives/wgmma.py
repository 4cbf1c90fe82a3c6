"""Hopper's warpgroup tensor-core multiply (``wgmma``), fed from shared memory through matrix descriptors.

``wgmma_bf16_m64k16(n)(acc, smem, desc_a, desc_b)`` is one ``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16``
issued by the four warps of a warpgroup (128 threads) together: D[64 × n] += A[64 × 16] · B[16 × n], A and B read
straight from shared memory (no registers), D in f32 registers spread over the warpgroup.  Both operands are
*K-major*: A is 64 rows × 16 K (``x``'s rows), B is n rows × 16 K (the weight's rows, ``out = x @ W.T``).

Accumulator layout (PTX ISA, "wgmma register fragments"): warp w of the warpgroup holds rows 16w .. 16w + 15;
in it, lane (g = lane >> 2, t = lane & 3) holds for every n8 column block j = 0 .. n/8 - 1

    acc[4j], acc[4j + 1] = D[16w + g, 8j + 2t : 8j + 2t + 2]      acc[4j + 2], acc[4j + 3] = D[16w + g + 8, ...]

-- the ``mma.sync`` m16n8 C layout (``primitives.mma``) repeated along n: ``n / 2`` f32 values a thread.

Shared-memory layout (the only one used here, "128-byte swizzle", K-major): an operand tile of R rows × 64 K
(bf16) is R rows of 128 bytes, row r at byte ``128 r``; its 16-byte chunk c (K ``8c .. 8c + 7``) is stored at chunk
``c ^ (r & 7)`` (``swizzled_word``).  The tile must start at a 1024-byte-aligned shared address (eight rows: the
swizzle's period).  ``smem_desc`` builds its descriptor (start address >> 4 in bits 0-13, leading-dimension offset
16 bytes >> 4 in bits 16-29 (unused with this swizzle), stride 1024 bytes (one 8-row group) >> 4 in bits 32-45,
swizzle mode 1 = 128 B in bits 62-63); the k16 slice kk of the 64-wide tile starts 32·kk bytes further: descriptor
+ 2·kk.

Ordering (all warpgroup-wide, every thread calls them equally often):

* ``fence_proxy_async()`` after shared-memory writes by ordinary stores or ``cp.async`` and before the barrier that
  precedes the ``wgmma`` reading them (``wgmma`` reads through the async proxy);
* ``wgmma_fence()`` before the first ``wgmma`` of a batch (orders the accumulator registers' earlier writes);
* ``wgmma_commit()`` closes a batch into a group; ``wgmma_wait(n, m)(acc)`` waits until at most ``n`` groups are in
  flight and passes the ``m`` accumulators ``acc`` through (the registers a later instruction reads are the waited-for ones).

In the simulator the multiply happens at once, in float64 per k16 step, rounded to f32 when added (the twin reads
the tile back through the same descriptor and swizzle rules); the fences, commits and waits do nothing.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn, uint32

WARPGROUP = 128
SWIZZLE_ROW_BYTES = 128      # one operand row of a 64-wide K tile
SWIZZLE_PERIOD_BYTES = 1024  # eight rows: a tile starts 1024-byte aligned

_DESC_FIXED = (1 << 16) | ((SWIZZLE_PERIOD_BYTES >> 4) << 32) | (1 << 62)


@device_fn
def swizzled_word(row, chunk):
    """uint32 word offset, inside a 128-byte-swizzled tile, of 16-byte chunk ``chunk`` (0 .. 7) of row ``row``."""
    return row * uint32(32) + uint32(4) * (chunk ^ (row & uint32(7)))


if SIMULATOR:
    @device_fn
    def shared_address(smem, i):
        """Byte address of ``smem[i]`` in the block's shared window (the simulator's: the array starts at 0)."""
        return uint32(4 * int(i))

    @device_fn
    def smem_desc(addr):
        return np.uint64((int(addr) & 0x3FFFF) >> 4) | np.uint64(_DESC_FIXED)

    def _tile(smem, desc, rows):
        """The ``[rows, 16]`` bf16 K-slice a descriptor points at, as float64 (128-byte swizzle, K-major)."""
        d = int(desc)
        start, stride = (d & 0x3FFF) << 4, ((d >> 32) & 0x3FFF) << 4
        r = np.arange(rows)[:, None]
        addr = start + (r >> 3) * stride + (r & 7) * SWIZZLE_ROW_BYTES + 2 * np.arange(16)[None, :]
        addr = addr ^ (((addr >> 7) & 7) << 4)
        words = np.asarray(smem)[addr >> 2]
        bits = ((words >> (16 * ((addr >> 1) & 1)).astype(np.uint32)) & np.uint32(0xFFFF)).astype(np.uint32)
        return (bits << np.uint32(16)).view(np.float32).astype(np.float64)

    @functools.cache
    def wgmma_bf16_m64k16(n: int):
        @device_fn
        def wgmma(acc, smem, desc_a, desc_b):
            """Emulated ``wgmma ... m64n{n}k16`` (layout in the module docstring)."""
            d = _tile(smem, desc_a, 64) @ _tile(smem, desc_b, n).T          # [64, n]
            t = int(cuda.threadIdx.x) % WARPGROUP
            r = 16 * (t // 32) + ((t % 32) >> 2)
            c = 2 * (t & 3)
            for j in range(n // 8):
                for h in range(4):
                    acc[4 * j + h] = np.float32(acc[4 * j + h] + d[r + 8 * (h >> 1), 8 * j + c + (h & 1)])
        return wgmma

    @device_fn
    def wgmma_fence():
        pass

    @device_fn
    def wgmma_commit():
        pass

    @device_fn
    def fence_proxy_async():
        pass

    @functools.cache
    def wgmma_wait(n_pending: int, m: int):
        @device_fn
        def wait(acc):
            pass
        return wait
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.ptx import _asm_statement, _element_pointer

    @intrinsic
    def shared_address(typingctx, smem, i):
        """32-bit shared-window byte address of ``smem[i]`` (a shared array)."""
        sig = types.uint32(smem, i)

        def codegen(context, builder, sig, args):
            p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            shared = builder.addrspacecast(p, ir.PointerType(p.type.pointee, 3))
            return builder.ptrtoint(shared, ir.IntType(32))

        return sig, codegen

    @device_fn
    def smem_desc(addr):
        """Descriptor of a 128-byte-swizzled K-major tile starting at shared byte address ``addr`` (docstring)."""
        return np.uint64((addr & uint32(0x3FFFF)) >> uint32(4)) | np.uint64(_DESC_FIXED)

    def _acc_pointers(context, builder, arrty, arr, n):
        return [_element_pointer(context, builder, arrty, arr, context.get_constant(types.intp, i), types.intp)
                for i in range(n)]

    @functools.cache
    def wgmma_bf16_m64k16(n: int):
        m = n // 2                       # f32 accumulators a thread
        regs = ", ".join(f"${i}" for i in range(m))
        text = ("{ .reg .pred p; setp.ne.b32 p, $" + str(m + 2) + ", 0; "
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, ${m}, ${m + 1}, p, 1, 1, 0, 0; }}")
        constraints = ",".join(["=f"] * m + ["l", "l", "r"] + [str(i) for i in range(m)])

        @intrinsic
        def wgmma(typingctx, acc, smem, desc_a, desc_b):
            """``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16`` accumulating into ``acc[0 : n/2]``."""
            sig = types.void(acc, smem, desc_a, desc_b)

            def codegen(context, builder, sig, args):
                f32, i64 = ir.FloatType(), ir.IntType(64)
                ptrs = _acc_pointers(context, builder, sig.args[0], args[0], m)
                ins = [builder.load(p) for p in ptrs]
                da = context.cast(builder, args[2], sig.args[2], types.uint64)
                db = context.cast(builder, args[3], sig.args[3], types.uint64)
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * m), [i64, i64, ir.IntType(32)] + [f32] * m)
                res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True),
                                   [da, db, ir.Constant(ir.IntType(32), 1)] + ins)
                for i, p in enumerate(ptrs):
                    builder.store(builder.extract_value(res, i), p)
                return context.get_dummy_value()

            return sig, codegen
        return wgmma

    wgmma_fence = _asm_statement("wgmma.fence.sync.aligned;")
    wgmma_commit = _asm_statement("wgmma.commit_group.sync.aligned;")
    fence_proxy_async = _asm_statement("fence.proxy.async.shared::cta;")

    @functools.cache
    def wgmma_wait(n_pending: int, m: int):
        text = f"wgmma.wait_group.sync.aligned {int(n_pending)};"
        constraints = ",".join(["=f"] * m + [str(i) for i in range(m)] + ["~{memory}"])

        @intrinsic
        def wait(typingctx, acc):
            """``wgmma.wait_group.sync.aligned n_pending`` with the ``m`` accumulators ``acc[0 : m]`` tied through
            it, so no read of them is scheduled before the wait."""
            sig = types.void(acc)

            def codegen(context, builder, sig, args):
                f32 = ir.FloatType()
                ptrs = _acc_pointers(context, builder, sig.args[0], args[0], m)
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * m), [f32] * m)
                res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True),
                                   [builder.load(p) for p in ptrs])
                for i, p in enumerate(ptrs):
                    builder.store(builder.extract_value(res, i), p)
                return context.get_dummy_value()

            return sig, codegen
        return wait
