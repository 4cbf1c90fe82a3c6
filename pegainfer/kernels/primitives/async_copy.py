"""Copies into shared memory that run while the thread goes on.

``cp_async_16(dst, i, src, j, nbytes)`` starts copying 16 bytes ``src[j:j+4]`` (global uint32) to ``dst[i:i+4]``
(shared uint32) without holding registers: ``cp.async.cg`` (through L2 only); ``nbytes`` = 0 writes zeros instead
(reads nothing).  Copies issued since the last ``cp_async_commit()`` form a group; ``cp_async_wait_group(n)()``
waits until at most ``n`` of the thread's groups are still in flight: the thread's own copies are then visible to
it, and to the block after a ``syncthreads``.  In the simulator the copy happens at once.

Bulk copies (sm_90's copy engine, ``cp.async.bulk``): one thread ``bulk_barrier_init``s an mbarrier in shared memory,
announces the bytes with ``bulk_expect_bytes`` and issues ``bulk_copy``s of whole runs; after a ``syncthreads`` (the
barrier initialised) every thread may ``bulk_wait`` for them.  One-shot: each barrier serves one batch of copies.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn

if SIMULATOR:
    @device_fn
    def cp_async_16(dst, i, src, j, nbytes):
        for q in range(4):
            dst[i + q] = src[j + q] if nbytes else np.uint32(0)

    @device_fn
    def cp_async_commit():
        pass

    def cp_async_wait_group(n: int):
        @device_fn
        def wait():
            pass
        return wait

    @device_fn
    def bulk_barrier_init(bar, i):
        pass

    @device_fn
    def bulk_expect_bytes(bar, i, nbytes):
        pass

    @device_fn
    def bulk_copy(dst, i, src, j, nbytes, bar, b):
        n = int(nbytes) // 4
        dst[int(i):int(i) + n] = src[int(j):int(j) + n]

    @device_fn
    def bulk_wait(bar, i):
        # every caller waits with its whole block (a block-uniform call), and the simulator's bulk_copy copied at
        # once in the issuing thread: a block barrier is what makes the bytes visible to the others
        cuda.syncthreads()
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.ptx import _asm_statement, _element_pointer, _to_shared

    @intrinsic
    def cp_async_16(typingctx, dst, i, src, j, nbytes):
        """``cp.async.cg.shared.global [dst + 4i], [src + 4j], 16, nbytes``."""
        sig = types.void(dst, i, src, j, nbytes)

        def codegen(context, builder, sig, args):
            d = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            s = _element_pointer(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            n = context.cast(builder, args[4], sig.args[4], types.uint32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [d.type, s.type, ir.IntType(32)]),
                               "{ " + _to_shared("$0", "sb") + " cp.async.cg.shared.global [sb], [$1], 16, $2; }",
                               "l,l,r,~{memory}", side_effect=True)
            builder.call(asm, [d, s, n])
            return context.get_dummy_value()

        return sig, codegen

    cp_async_commit = _asm_statement("cp.async.commit_group;")

    @intrinsic
    def bulk_barrier_init(typingctx, bar, i):
        """``mbarrier.init`` of the 8-byte barrier at words ``bar[i:i+2]`` (shared, ``i`` even) for one arrival, and
        the fences that make it visible to the copy engine; one thread, then a block barrier before others wait."""
        sig = types.void(bar, i)

        def codegen(context, builder, sig, args):
            b = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [b.type]),
                               "{ " + _to_shared("$0", "sb") + " mbarrier.init.shared::cta.b64 [sb], 1; "
                               "fence.mbarrier_init.release.cluster; fence.proxy.async.shared::cta; }",
                               "l,~{memory}", side_effect=True)
            builder.call(asm, [b])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def bulk_expect_bytes(typingctx, bar, i, nbytes):
        """``mbarrier.arrive.expect_tx``: the barrier's phase completes once ``nbytes`` have landed (one thread, before
        it issues the ``bulk_copy``s that count against it)."""
        sig = types.void(bar, i, nbytes)

        def codegen(context, builder, sig, args):
            b = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            n = context.cast(builder, args[2], sig.args[2], types.uint32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [b.type, ir.IntType(32)]),
                               "{ " + _to_shared("$0", "sb") + " mbarrier.arrive.expect_tx.shared::cta.b64 _, [sb], $1; }", "l,r,~{memory}",
                               side_effect=True)
            builder.call(asm, [b, n])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def bulk_copy(typingctx, dst, i, src, j, nbytes, bar, b):
        """``cp.async.bulk`` (the Hopper copy engine, one instruction for the whole run): ``nbytes`` (a multiple of 16,
        both ends 16-byte aligned) from ``src[j:]`` (global uint32) to ``dst[i:]`` (shared uint32), counted against
        the barrier at ``bar[b]``."""
        sig = types.void(dst, i, src, j, nbytes, bar, b)

        def codegen(context, builder, sig, args):
            d = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            s_ = _element_pointer(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            bp = _element_pointer(context, builder, sig.args[5], args[5], args[6], sig.args[6])
            n = context.cast(builder, args[4], sig.args[4], types.uint32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [d.type, s_.type, ir.IntType(32), bp.type]),
                               "{ " + _to_shared("$0", "db") + " " + _to_shared("$3", "bb") + " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [db], [$1], $2, [bb]; }",
                               "l,l,r,l,~{memory}", side_effect=True)
            builder.call(asm, [d, s_, n, bp])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def _bulk_try_wait(typingctx, bar, i):
        sig = types.uint32(bar, i)

        def codegen(context, builder, sig, args):
            b = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [b.type]),
                               "{ .reg .pred p; " + _to_shared("$1", "sb") + " mbarrier.try_wait.parity.shared::cta.b64 p, [sb], 0; "
                               "selp.u32 $0, 1, 0, p; }", "=r,l,~{memory}", side_effect=True)
            return builder.call(asm, [b])

        return sig, codegen

    @device_fn
    def bulk_wait(bar, i):
        """Wait until the barrier's first phase has completed: every byte announced with ``bulk_expect_bytes``
        has landed and is visible to the calling thread."""
        while _bulk_try_wait(bar, i) == 0:
            pass

    @functools.cache
    def cp_async_wait_group(n: int):
        return _asm_statement(f"cp.async.wait_group {int(n)};")
