"""Barriers finer than ``syncthreads``: mbarriers, which count arrivals and copied bytes, and named barriers.

**mbarriers** (8 bytes: two words of a shared uint32 array, ``b`` even).  ``mbar_init(bars, b, count)`` (one thread,
then ``mbar_fence_init()`` and a block barrier) makes a barrier whose phase completes when ``count`` threads have
arrived and every byte announced in the phase has landed.  ``mbar_arrive(bars, b)``; ``mbar_arrive_expect_tx(bars,
b, nbytes)`` arrives and announces ``nbytes`` of asynchronous copies (TMA tiles, bulk copies) that count against the
barrier; ``mbar_wait(bars, b, parity)`` returns once the phase of that parity has completed (a fresh barrier is in
phase 0, so waiting for parity 1 returns at once: the usual way to let a producer fill every stage of a ring before
its first wait); ``mbar_wait_first_phase(bars, b)`` is ``mbar_wait(bars, b, 0)`` for a one-shot barrier.

**Named barriers.**  ``named_barrier(id, nthreads)`` (``bar.sync``) waits for ``nthreads`` threads (a multiple of
32) of the block at barrier ``id`` (1 .. 15; 0 is ``syncthreads``): the consumer warps of a warp-specialized kernel
meet without the producer.

In the simulator both are counters under the block's condition variable (``simulator_blocks``): the same phases,
arrivals and byte counts.  The copy twins (``tma``, ``async_copy``) copy at once in the issuing thread, then count
their bytes with ``complete_tx(bars, b, nbytes)`` (the simulator's stand-in for the copy engine's completion).
"""
from __future__ import annotations

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn

if SIMULATOR:
    import threading

    def _block():
        return threading.current_thread().block

    def _key(bars, b):
        """A barrier's identity: the address of its word (every thread may hold its own view of the array)."""
        return bars.__array_interface__["data"][0] + bars.itemsize * int(b)

    def _state(bars, b):
        blk = _block()
        table = blk.__dict__.setdefault("mbarriers", {})
        return blk, table.setdefault(_key(bars, b), [1, 1, 0, 0])   # count, pending, bytes, phase

    def _complete_if_done(blk, st):
        if st[1] == 0 and st[2] == 0:
            st[1] = st[0]
            st[3] ^= 1
            blk.cv.notify_all()

    def complete_tx(bars, b, nbytes):
        """``nbytes`` of a copy counted against the barrier at ``bars[b]`` have landed."""
        blk, st = _state(bars, b)
        with blk.cv:
            st[2] -= int(nbytes)
            _complete_if_done(blk, st)

    @device_fn
    def mbar_init(bars, b, count):
        blk = _block()
        with blk.cv:
            blk.__dict__.setdefault("mbarriers", {})[_key(bars, b)] = [int(count), int(count), 0, 0]

    @device_fn
    def mbar_fence_init():
        pass

    @device_fn
    def mbar_arrive(bars, b):
        blk, st = _state(bars, b)
        with blk.cv:
            st[1] -= 1
            _complete_if_done(blk, st)

    @device_fn
    def mbar_arrive_expect_tx(bars, b, nbytes):
        blk, st = _state(bars, b)
        with blk.cv:
            st[2] += int(nbytes)
            st[1] -= 1
            _complete_if_done(blk, st)

    @device_fn
    def mbar_wait(bars, b, parity):
        blk, st = _state(bars, b)
        me = threading.current_thread()
        with blk.cv:
            while st[3] == int(parity) and not me.abort:
                blk.cv.wait(0.5)
        if me.abort:
            raise RuntimeError("abort flag set while waiting on an mbarrier")

    @device_fn
    def mbar_wait_first_phase(bars, b):
        mbar_wait(bars, b, 0)

    @device_fn
    def named_barrier(barrier_id, nthreads):
        blk = _block()
        me = threading.current_thread()
        with blk.cv:
            st = blk.__dict__.setdefault("named_barriers", {}).setdefault(int(barrier_id), [0, 0])  # waiting, round
            round_ = st[1]
            st[0] += 1
            if st[0] == int(nthreads):
                st[0] = 0
                st[1] += 1
                blk.cv.notify_all()
            else:
                while st[1] == round_ and not me.abort:
                    blk.cv.wait(0.5)
        if me.abort:
            raise RuntimeError("abort flag set at a named barrier")
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.ptx import _asm_statement, _element_pointer, _to_shared

    def _bar_intrinsic(ptx: str, with_value: bool):
        """An intrinsic ``f(bars, b[, value])`` emitting ``ptx`` with ``sb`` = the shared address of ``bars[b]`` and
        ``$1`` = the 32-bit value."""
        def codegen(context, builder, sig, args):
            p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            operands, kinds, constraints = [p], [p.type], "l"
            if with_value:
                operands.append(context.cast(builder, args[2], sig.args[2], types.uint32))
                kinds.append(ir.IntType(32))
                constraints += ",r"
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), kinds), "{ " + _to_shared("$0", "sb") + " " + ptx + " }",
                               constraints + ",~{memory}", side_effect=True)
            builder.call(asm, operands)
            return context.get_dummy_value()

        if with_value:
            @intrinsic
            def f(typingctx, bars, b, value):
                return types.void(bars, b, value), codegen
        else:
            @intrinsic
            def f(typingctx, bars, b):
                return types.void(bars, b), codegen
        return f

    def _try_wait_intrinsic(parity_operand: bool):
        """An intrinsic ``f(bars, b[, parity])`` → 1 once the barrier's phase of that parity (without the operand:
        0, an immediate) has completed, else 0 (``mbarrier.try_wait``, which waits a while in hardware first)."""
        def codegen(context, builder, sig, args):
            p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            operands, kinds, constraints, parity = [p], [p.type], "=r,l", "0"
            if parity_operand:
                operands.append(context.cast(builder, args[2], sig.args[2], types.uint32))
                kinds.append(ir.IntType(32))
                constraints, parity = "=r,l,r", "$2"
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), kinds),
                               "{ .reg .pred p; " + _to_shared("$1", "sb") +
                               f" mbarrier.try_wait.parity.shared::cta.b64 p, [sb], {parity}; selp.u32 $0, 1, 0, p; }}",
                               constraints + ",~{memory}", side_effect=True)
            return builder.call(asm, operands)

        if parity_operand:
            @intrinsic
            def f(typingctx, bars, b, parity):
                return types.uint32(bars, b, parity), codegen
        else:
            @intrinsic
            def f(typingctx, bars, b):
                return types.uint32(bars, b), codegen
        return f

    mbar_init = _bar_intrinsic("mbarrier.init.shared::cta.b64 [sb], $1;", True)
    mbar_fence_init = _asm_statement("fence.mbarrier_init.release.cluster;")
    mbar_arrive = _bar_intrinsic("mbarrier.arrive.shared::cta.b64 _, [sb];", False)
    mbar_arrive_expect_tx = _bar_intrinsic("mbarrier.arrive.expect_tx.shared::cta.b64 _, [sb], $1;", True)
    _mbar_try_wait = _try_wait_intrinsic(True)
    _mbar_try_wait_first_phase = _try_wait_intrinsic(False)

    @device_fn
    def mbar_wait(bars, b, parity):
        """Wait until the barrier's phase of parity ``parity`` has completed (module docstring)."""
        while _mbar_try_wait(bars, b, parity) == 0:
            pass

    @device_fn
    def mbar_wait_first_phase(bars, b):
        """Wait until the barrier's first phase has completed (a one-shot barrier)."""
        while _mbar_try_wait_first_phase(bars, b) == 0:
            pass

    @intrinsic
    def named_barrier(typingctx, barrier_id, nthreads):
        """``bar.sync barrier_id, nthreads``."""
        sig = types.void(barrier_id, nthreads)

        def codegen(context, builder, sig, args):
            i = context.cast(builder, args[0], sig.args[0], types.uint32)
            n = context.cast(builder, args[1], sig.args[1], types.uint32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(32)]),
                               "bar.sync $0, $1;", "r,r,~{memory}", side_effect=True)
            builder.call(asm, [i, n])
            return context.get_dummy_value()

        return sig, codegen
