"""Hopper's tensor memory accelerator (TMA) and the mbarrier pipelines it feeds.

**Tensor maps.**  ``tensor_map(a, box_rows)`` describes a 2-D bf16 array ``a [rows, K]`` to the copy engine:
its address, its shape and row stride, and the *box* one copy moves, ``box_rows`` rows × ``TMA_BOX_K`` (64) K
elements, i.e. rows of 128 bytes landing in shared memory in the 128-byte-swizzled K-major layout ``wgmma`` reads
(``primitives.wgmma``).  A map is 128 opaque bytes that the driver encodes on the host (``cuTensorMapEncodeTiled``);
it lives in a device table (``TensorMapTable``) whose slots are written once, when first met, by a copy on a stream
of the table's own that the host waits for, and never rewritten: a graph holds the address of its maps, never a
copy of them (a copy node would run at every replay: ~6 µs each in a 64-sequence decode step).  The kernel
receives the table and a slot index.

**Copies.**  ``tma_prefetch_map(table, slot)`` warms the copy engine's descriptor cache with a map (issue it at
the kernel's start, before the first copy).  ``tma_load_2d(smem, dst, table, slot, src32, row0, k0, n_rows, k, box_rows, bars, b)`` (one thread)
copies rows ``row0 .. row0 + box_rows`` × K ``k0 .. k0 + 64`` of the mapped array into the 1024-byte-aligned tile at
``smem[dst ..]``; rows and K past the array's end land as zeros.  Its bytes count against the mbarrier at
``bars[b]``.  (``src32``, ``n_rows``, ``k`` and ``box_rows`` repeat what the map holds: the simulator's twin copies
from them, the GPU ignores them.)

**mbarriers** (8 bytes: two words of a shared uint32 array, ``b`` even).  ``mbar_init(bars, b, count)`` (one thread,
then ``mbar_fence_init()`` and a block barrier) makes a barrier whose phase completes when ``count`` threads have
arrived and every byte announced in the phase has landed.  ``mbar_arrive(bars, b)``; ``mbar_arrive_expect_tx(bars,
b, nbytes)`` arrives and announces ``nbytes`` of TMA copies; ``mbar_wait(bars, b, parity)`` returns once the phase
of that parity has completed (a fresh barrier is in phase 0, so waiting for parity 1 returns at once: the usual way
to let a producer fill every stage of a ring before its first wait).

**Named barriers.**  ``named_barrier(id, nthreads)`` (``bar.sync``) waits for ``nthreads`` threads (a multiple of
32) of the block at barrier ``id`` (1 .. 15; 0 is ``syncthreads``): the consumer warps of a warp-specialized kernel
meet without the producer.

In the simulator the copy happens at once in the issuing thread, and the mbarriers and named barriers are counters
under the block's condition variable (``simulator_blocks``): the same phases, arrivals and byte counts.
"""
from __future__ import annotations

import ctypes

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn

TMA_BOX_K = 64                # K elements of a box row: 128 bytes, one row of the 128-byte swizzle
MAP_WORDS = 16                # uint64 words of one tensor map (128 bytes, 64-byte aligned)


class TensorMapTable:
    """Device-resident tensor maps, 128 bytes a slot, found by what they describe (module docstring): chunks of
    ``chunk`` slots, a new chunk when the last is full (each map of a served model's buffers and token counts: a few
    thousand at most, under a MB)."""

    def __init__(self, chunk: int = 1024):
        self.chunk = chunk
        self.tables: list = []
        self._host: list = []
        self._index: dict = {}
        self._stream = None            # the stream the slots are written on (``_write``)

    def slot(self, a, box_rows: int):
        """(table, slot) of the map of ``a`` ([rows, K] bf16 bits, contiguous) with boxes of ``box_rows`` × 64."""
        key = (int(a.__cuda_array_interface__["data"][0]), a.shape[0], a.shape[1], box_rows)
        i = self._index.get(key)
        if i is None:
            i = len(self._index)
            c, j = divmod(i, self.chunk)
            if c == len(self.tables):
                self.tables.append(cuda.device_array(self.chunk * MAP_WORDS, np.uint64))
                self._host.append(cuda.pinned_array((self.chunk, MAP_WORDS), np.uint64))
            self._host[c][j] = _encode(a, box_rows)
            self._write(self.tables[c][j * MAP_WORDS:(j + 1) * MAP_WORDS], self._host[c][j])
            self._index[key] = i
        c, j = divmod(i, self.chunk)
        return self.tables[c], j

    def _write(self, dst, src) -> None:
        """Copy one encoded map into its slot and wait for it, on a non-blocking stream of the table's own: legal
        while the launch's stream is being captured into a graph (the engine captures in relaxed mode), and kept
        out of the graph."""
        if self._stream is None:
            from cuda.bindings import driver as drv
            err, handle = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
            if err != drv.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuStreamCreate failed ({err})")
            self._stream = cuda.external_stream(int(handle))
            self._handle = handle          # keeps the stream's handle alive with the table
        dst.copy_to_device(src, stream=self._stream)
        self._stream.synchronize()


_tables: dict = {}
_SIM_TABLE = np.zeros(MAP_WORDS, np.uint64)


def tensor_map(a, box_rows: int):
    """(table, slot) of the tensor map of ``a`` for boxes of ``box_rows`` rows (one set of tables per device).  In
    the simulator there are no maps (the copy twin reads ``a`` itself): a stand-in table and slot 0."""
    if SIMULATOR:
        return _SIM_TABLE, 0
    dev = cuda.get_current_device().id
    t = _tables.get(dev)
    if t is None:
        t = _tables[dev] = TensorMapTable()
    return t.slot(a, box_rows)


def _encode(a, box_rows: int) -> np.ndarray:
    """The driver's encoding of a bf16 ``[rows, K]`` map with 128-byte-swizzled ``box_rows × 64`` boxes and zero fill
    out of bounds."""
    from cuda.bindings import driver as drv
    rows, k = a.shape
    if a.dtype.itemsize != 2 or (k * 2) % 16 or not 1 <= box_rows <= 256:
        raise ValueError(f"tensor map: need bf16 rows of a multiple of 16 bytes and 1-256 box rows; got {a.shape} "
                         f"{a.dtype}, {box_rows}")
    ptr = int(a.__cuda_array_interface__["data"][0])
    err, tmap = drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr,
        [drv.cuuint64_t(k), drv.cuuint64_t(rows)], [drv.cuuint64_t(2 * k)],
        [drv.cuuint32_t(TMA_BOX_K), drv.cuuint32_t(box_rows)], [drv.cuuint32_t(1), drv.cuuint32_t(1)],
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for {a.shape} box {box_rows}")
    return np.frombuffer(ctypes.string_at(tmap.getPtr(), 8 * MAP_WORDS), np.uint64).copy()


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

    @device_fn
    def tma_prefetch_map(table, slot):
        pass

    @device_fn
    def tma_load_2d(smem, dst, table, slot, src32, row0, k0, n_rows, k, box_rows, bars, b):
        kw = int(k) // 2
        rows = np.arange(int(box_rows))
        grow = int(row0) + rows
        for c in range(TMA_BOX_K // 8):                      # 16-byte chunks: 8 bf16 of K
            kk = int(k0) + 8 * c
            ok = (grow < int(n_rows)) & (kk < int(k))
            src = np.where(ok[:, None], (np.minimum(grow, int(n_rows) - 1) * kw + min(kk, int(k) - 8) // 2)[:, None]
                           + np.arange(4)[None, :], 0)
            vals = np.where(ok[:, None], np.asarray(src32)[src], np.uint32(0))
            word = int(dst) + rows * 32 + 4 * (c ^ (rows & 7))
            smem[(word[:, None] + np.arange(4)[None, :]).ravel()] = vals.ravel()
        blk, st = _state(bars, b)
        with blk.cv:
            st[2] -= 128 * int(box_rows)
            _complete_if_done(blk, st)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.ptx import _asm_statement, _element_pointer, _to_shared

    def _bar_intrinsic(ptx: str, with_value: bool):
        """An intrinsic ``f(bars, b[, value])`` emitting ``ptx`` with ``sb`` = the shared address of ``bars[b]`` and
        ``$1`` = the 32-bit value."""
        if with_value:
            @intrinsic
            def f(typingctx, bars, b, value):
                sig = types.void(bars, b, value)

                def codegen(context, builder, sig, args):
                    p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                    v = context.cast(builder, args[2], sig.args[2], types.uint32)
                    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [p.type, ir.IntType(32)]),
                                       "{ " + _to_shared("$0", "sb") + " " + ptx + " }", "l,r,~{memory}",
                                       side_effect=True)
                    builder.call(asm, [p, v])
                    return context.get_dummy_value()
                return sig, codegen
        else:
            @intrinsic
            def f(typingctx, bars, b):
                sig = types.void(bars, b)

                def codegen(context, builder, sig, args):
                    p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
                    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [p.type]),
                                       "{ " + _to_shared("$0", "sb") + " " + ptx + " }", "l,~{memory}",
                                       side_effect=True)
                    builder.call(asm, [p])
                    return context.get_dummy_value()
                return sig, codegen
        return f

    mbar_init = _bar_intrinsic("mbarrier.init.shared::cta.b64 [sb], $1;", True)
    mbar_fence_init = _asm_statement("fence.mbarrier_init.release.cluster;")
    mbar_arrive = _bar_intrinsic("mbarrier.arrive.shared::cta.b64 _, [sb];", False)
    mbar_arrive_expect_tx = _bar_intrinsic("mbarrier.arrive.expect_tx.shared::cta.b64 _, [sb], $1;", True)

    @intrinsic
    def _mbar_try_wait(typingctx, bars, b, parity):
        sig = types.uint32(bars, b, parity)

        def codegen(context, builder, sig, args):
            p = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            par = context.cast(builder, args[2], sig.args[2], types.uint32)
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [p.type, ir.IntType(32)]),
                               "{ .reg .pred p; " + _to_shared("$1", "sb") +
                               " mbarrier.try_wait.parity.shared::cta.b64 p, [sb], $2; selp.u32 $0, 1, 0, p; }",
                               "=r,l,r,~{memory}", side_effect=True)
            return builder.call(asm, [p, par])

        return sig, codegen

    @device_fn
    def mbar_wait(bars, b, parity):
        """Wait until the barrier's phase of parity ``parity`` has completed (module docstring)."""
        while _mbar_try_wait(bars, b, parity) == 0:
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

    @intrinsic
    def tma_prefetch_map(typingctx, table, slot):
        """``prefetch.tensormap``: bring the map into the copy engine's descriptor cache ahead of its first copy."""
        sig = types.void(table, slot)

        def codegen(context, builder, sig, args):
            slot_word = builder.mul(context.cast(builder, args[1], sig.args[1], types.intp),
                                    context.get_constant(types.intp, MAP_WORDS))
            m = _element_pointer(context, builder, sig.args[0], args[0], slot_word, types.intp)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [m.type]), "prefetch.tensormap [$0];", "l,~{memory}",
                               side_effect=True)
            builder.call(asm, [m])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def tma_load_2d(typingctx, smem, dst, table, slot, src32, row0, k0, n_rows, k, box_rows, bars, b):
        """``cp.async.bulk.tensor.2d`` of one box (module docstring)."""
        sig = types.void(smem, dst, table, slot, src32, row0, k0, n_rows, k, box_rows, bars, b)

        def codegen(context, builder, sig, args):
            d = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            slot_word = builder.mul(context.cast(builder, args[3], sig.args[3], types.intp),
                                    context.get_constant(types.intp, MAP_WORDS))
            m = _element_pointer(context, builder, sig.args[2], args[2], slot_word, types.intp)
            bp = _element_pointer(context, builder, sig.args[10], args[10], args[11], sig.args[11])
            r = context.cast(builder, args[5], sig.args[5], types.int32)
            c = context.cast(builder, args[6], sig.args[6], types.int32)
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [d.type, m.type, ir.IntType(32), ir.IntType(32), bp.type]),
                "{ " + _to_shared("$0", "db") + " " + _to_shared("$4", "bb") +
                " cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                " [db], [$1, {$2, $3}], [bb]; }",
                "l,l,r,r,l,~{memory}", side_effect=True)
            builder.call(asm, [d, m, c, r, bp])
            return context.get_dummy_value()

        return sig, codegen
