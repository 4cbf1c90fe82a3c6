"""Hopper's tensor memory accelerator (TMA): tensor maps and the tile copies they describe.

**Tensor maps.**  ``tensor_map(a, box_rows)`` describes a 2-D bf16 array ``a [rows, K]`` to the copy engine:
its address, its shape and row stride, and the *box* one copy moves, ``box_rows`` rows × ``TMA_BOX_K`` (64) K
elements, i.e. rows of 128 bytes landing in shared memory in the 128-byte-swizzled K-major layout ``wgmma`` reads
(``primitives.wgmma``).  A map is 128 opaque bytes that the driver encodes on the host (``cuTensorMapEncodeTiled``);
it lives in a device table (``TensorMapTable``) whose slots are written once, when first met, by a copy on a stream
of the table's own that the host waits for, and never rewritten: a graph holds the address of its maps, never a
copy of them (a copy node would run at every replay: ~6 µs each in a 64-sequence decode step).  The kernel
receives the table and a slot index.

**Copies.**  ``tma_prefetch_map(table, slot)`` warms the copy engine's descriptor cache with a map (issue it at
the kernel's start, before the first copy).  ``tma_load_2d(smem, dst, table, slot, src32, row0, k0, n_rows, k,
box_rows, bars, b)`` (one thread) copies rows ``row0 .. row0 + box_rows`` × K ``k0 .. k0 + 64`` of the mapped array
into the 1024-byte-aligned tile at ``smem[dst ..]``; rows and K past the array's end land as zeros.  Its bytes count
against the mbarrier at ``bars[b]``.  (``src32``, ``n_rows``, ``k`` and ``box_rows`` repeat what the map holds: the simulator's twin copies
from them, the GPU ignores them.)

The copies complete on an mbarrier (``barriers``: ``mbar_init``, ``mbar_arrive_expect_tx``, ``mbar_wait``); a
warp-specialized kernel's consumers meet on a named barrier.  In the simulator the copy happens at once in the
issuing thread and counts its bytes against the barrier (``barriers.complete_tx``).
"""
from __future__ import annotations

import ctypes

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn

if SIMULATOR:
    from pegainfer.kernels.primitives.barriers import complete_tx

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
        complete_tx(bars, b, 128 * int(box_rows))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.ptx import _element_pointer, _to_shared

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
