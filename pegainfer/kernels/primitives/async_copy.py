"""Copies into shared memory that run while the thread goes on.

``cp_async_16(dst, i, src, j, nbytes)`` starts copying 16 bytes ``src[j:j+4]`` (global uint32) to ``dst[i:i+4]``
(shared uint32) without holding registers: ``cp.async.cg`` (through L2 only); ``nbytes`` = 0 writes zeros instead
(reads nothing).  Copies issued since the last ``cp_async_commit()`` form a group; ``cp_async_wait_group(n)()``
waits until at most ``n`` of the thread's groups are still in flight: the thread's own copies are then visible to
it, and to the block after a ``syncthreads``.  In the simulator the copy happens at once.

Bulk copies (sm_90's copy engine, ``cp.async.bulk``): one thread ``bulk_barrier_init``s an mbarrier in shared memory,
announces the bytes with ``bulk_expect_bytes`` and issues ``bulk_copy``s of whole runs; after a ``syncthreads`` (the
barrier initialised) every thread may ``bulk_wait`` for them.  One-shot: each barrier serves one batch of copies.
The barrier is an mbarrier of ``barriers`` (one arrival, its first phase); in the simulator the copy happens at once
and counts its bytes against it.
"""
from __future__ import annotations

import functools

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.barriers import mbar_arrive_expect_tx, mbar_init, mbar_wait_first_phase
from pegainfer.kernels.primitives.launch_shape import device_fn

if SIMULATOR:
    from pegainfer.kernels.primitives.barriers import complete_tx

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
        mbar_init(bar, i, 1)

    bulk_expect_bytes = mbar_arrive_expect_tx

    @device_fn
    def bulk_copy(dst, i, src, j, nbytes, bar, b):
        n = int(nbytes) // 4
        dst[int(i):int(i) + n] = src[int(j):int(j) + n]
        complete_tx(bar, b, nbytes)

    bulk_wait = mbar_wait_first_phase
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.barriers import _bar_intrinsic
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

    bulk_barrier_init = _bar_intrinsic("mbarrier.init.shared::cta.b64 [sb], 1; fence.mbarrier_init.release.cluster; "
                                       "fence.proxy.async.shared::cta;", False)
    """``mbarrier.init`` of the 8-byte barrier at words ``bar[i:i+2]`` (shared, ``i`` even) for one arrival, and the
    fences that make it visible to the copy engine; one thread, then a block barrier before others wait."""
    bulk_expect_bytes = mbar_arrive_expect_tx    # the barrier's phase completes once ``nbytes`` have landed
    bulk_wait = mbar_wait_first_phase            # every byte announced has landed and is visible to the caller

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

    @functools.cache
    def cp_async_wait_group(n: int):
        return _asm_statement(f"cp.async.wait_group {int(n)};")
