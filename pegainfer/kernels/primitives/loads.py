"""Wide loads and stores: ``load_u32x4(a, i)`` reads ``a[i:i+4]`` of a ``uint32`` array as one 16-byte read-only
load (8 bf16 values; ``i`` an element index, a multiple of 4); ``load_u32_l2`` reads one word at L2;
``load_acquire_u32`` reads one word with acquire semantics at GPU scope (the load of a spin-wait on a counter
other blocks of the launch raise); ``prefetch_l2(a, i)`` asks L2 for the 128-byte line holding ``a[i]`` and
returns at once (no register waits on it); ``load_f32x2`` / ``load_f32x4`` and ``store_f32x2`` / ``store_f32x4``
move 8 / 16 bytes of f32 at once (global or shared memory); ``store_bf16_pair(out, t, j, word)`` writes two
adjacent bf16 values of a 2-D uint16 array (at a 4-byte aligned ``out[t, j]``) in one 4-byte store; ``as_words``
views a tensor as the flat uint32 array they read."""
from __future__ import annotations

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn

if SIMULATOR:
    @device_fn
    def load_u32x4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @device_fn
    def load_u32_l2(a, i):
        return a[i]

    @device_fn
    def load_acquire_u32(a, i):
        return a[i]

    @device_fn
    def prefetch_l2(a, i):
        if not 0 <= i < a.shape[0]:      # a hint that reads nothing, but its address must be one the kernel may read
            raise IndexError(f"prefetch_l2 of element {i} of an array of {a.shape[0]}")

    @device_fn
    def load_f32x2(a, i):
        return a[i], a[i + 1]

    @device_fn
    def store_f32x2(a, i, x, y):
        a[i] = x
        a[i + 1] = y

    @device_fn
    def load_f32x4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @device_fn
    def store_f32x4(a, i, x, y, z, w):
        a[i] = x
        a[i + 1] = y
        a[i + 2] = z
        a[i + 3] = w

    @device_fn
    def store_bf16_pair(out, t, j, word):
        out[t, j] = np.uint16(word & 0xFFFF)
        out[t, j + 1] = np.uint16(word >> 16)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.ptx import _element_pointer

    @intrinsic
    def _ld_global_nc_v4_u32(typingctx, arr, idx):
        """``ld.global.nc.v4.u32``: one 16-byte read-only load of a[idx:idx+4] (idx a multiple of 4)."""
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint32 and arr.ndim == 1):
            return None
        sig = types.UniTuple(types.uint32, 4)(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32, i32, i32, i32]), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
            res = builder.call(asm, [ptr])
            elems = [builder.extract_value(res, k) for k in range(4)]
            return context.make_tuple(builder, sig.return_type, elems)

        return sig, codegen

    @device_fn
    def load_u32x4(a, i):
        return _ld_global_nc_v4_u32(a, i)

    @intrinsic
    def load_u32_l2(typingctx, arr, idx):
        """``ld.global.cg.u32``: ``a[idx]`` read at L2, the point where every SM's writes meet (no L1 line, so no
        stale copy): for data an earlier, completed kernel wrote, read before this kernel's PDL wait."""
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint32 and arr.ndim == 1):
            return None
        sig = types.uint32(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ptr.type]), "ld.global.cg.u32 $0, [$1];", "=r,l",
                               side_effect=True)
            return builder.call(asm, [ptr])

        return sig, codegen

    @intrinsic
    def load_acquire_u32(typingctx, arr, idx):
        """``ld.acquire.gpu.global.u32``: ``a[idx]`` as a GPU-scope acquire, for a loop that waits until another
        block's release (its writes, a fence, then its atomic) shows.  A weak load such as ``load_u32_l2`` must not
        be spun on: ptxas may assume its value never changes and delete the loop (it did: the ring GEMM's norm
        prologue ran on before its rows were written)."""
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint32 and arr.ndim == 1):
            return None
        sig = types.uint32(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ptr.type]), "ld.acquire.gpu.global.u32 $0, [$1];",
                               "=r,l,~{memory}", side_effect=True)
            return builder.call(asm, [ptr])

        return sig, codegen

    @intrinsic
    def prefetch_l2(typingctx, arr, idx):
        """``prefetch.global.L2``: bring the line of ``a[idx]`` into L2 for a later load; nothing waits on it.
        L2 is where every SM's writes meet, so a line prefetched before its writer finished is still read fresh
        by a load after the PDL wait."""
        if not (isinstance(arr, types.Array) and arr.ndim == 1):
            return None
        sig = types.void(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type]), "prefetch.global.L2 [$0];", "l",
                               side_effect=True)
            builder.call(asm, [ptr])
            return context.get_dummy_value()

        return sig, codegen

    # f32 vector loads and stores (global or shared memory: the address is generic): plain LLVM vector accesses,
    # so the compiler orders them against barriers and other accesses as it does any load or store.
    def _f32_vector_args_ok(arr):
        return isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == 1

    def _f32_vector_pointer(context, builder, sig, args, width):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.bitcast(ptr, ir.VectorType(ir.FloatType(), width).as_pointer())

    def _f32_vector_load(width):
        def typer(typingctx, arr, idx):
            if not _f32_vector_args_ok(arr):
                return None
            sig = types.UniTuple(types.float32, width)(arr, idx)

            def codegen(context, builder, sig, args):
                v = builder.load(_f32_vector_pointer(context, builder, sig, args, width), align=4 * width)
                elems = [builder.extract_element(v, ir.Constant(ir.IntType(32), k)) for k in range(width)]
                return context.make_tuple(builder, sig.return_type, elems)

            return sig, codegen
        return typer

    def _f32_vector_store(width):
        def codegen(context, builder, sig, args):
            v = ir.Constant(ir.VectorType(ir.FloatType(), width), ir.Undefined)
            for k in range(width):
                v = builder.insert_element(v, args[2 + k], ir.Constant(ir.IntType(32), k))
            builder.store(v, _f32_vector_pointer(context, builder, sig, args, width), align=4 * width)
            return context.get_dummy_value()
        return codegen

    @intrinsic
    def _ld_f32x2(typingctx, arr, idx):
        """One 8-byte load of a[idx], a[idx + 1] (idx even)."""
        return _f32_vector_load(2)(typingctx, arr, idx)

    @intrinsic
    def _ld_f32x4(typingctx, arr, idx):
        """One 16-byte load of a[idx : idx + 4] (idx a multiple of 4)."""
        return _f32_vector_load(4)(typingctx, arr, idx)

    @intrinsic
    def _st_f32x2(typingctx, arr, idx, x, y):
        """One 8-byte store of (x, y) to a[idx], a[idx + 1] (idx even)."""
        if not _f32_vector_args_ok(arr):
            return None
        return types.void(arr, idx, types.float32, types.float32), _f32_vector_store(2)

    @intrinsic
    def _st_f32x4(typingctx, arr, idx, x, y, z, w):
        """One 16-byte store of (x, y, z, w) to a[idx : idx + 4] (idx a multiple of 4)."""
        if not _f32_vector_args_ok(arr):
            return None
        return types.void(arr, idx, types.float32, types.float32, types.float32, types.float32), _f32_vector_store(4)

    @device_fn
    def load_f32x2(a, i):
        return _ld_f32x2(a, i)

    @device_fn
    def store_f32x2(a, i, x, y):
        _st_f32x2(a, i, x, y)

    @device_fn
    def load_f32x4(a, i):
        return _ld_f32x4(a, i)

    @device_fn
    def store_f32x4(a, i, x, y, z, w):
        _st_f32x4(a, i, x, y, z, w)

    @intrinsic
    def store_bf16_pair(typingctx, out, t, j, word):
        """``out[t, j], out[t, j + 1] = low, high half of word`` in one 4-byte store, for a 2-D uint16 array whose
        ``out[t, j]`` is 4-byte aligned (an even column of a row that starts 4-byte aligned)."""
        if not (isinstance(out, types.Array) and out.dtype == types.uint16 and out.ndim == 2):
            return None
        sig = types.void(out, t, j, word)

        def codegen(context, builder, sig, args):
            from numba.cuda import cgutils
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            idx = [context.cast(builder, args[k], sig.args[k], types.intp) for k in (1, 2)]
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, idx, wraparound=False)
            value = context.cast(builder, args[3], sig.args[3], types.uint32)
            builder.store(value, builder.bitcast(ptr, ir.IntType(32).as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen


def array_address(a) -> int:
    """The address of an array's first byte: a device array's (``__cuda_array_interface__``), else a host array's
    (the simulator's arrays are host arrays)."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return int(iface["data"][0])


def as_words(a):
    """A contiguous tensor (bf16 as uint16, or f32) seen as a flat uint32 array, for 16-byte loads and ``cp.async``
    (host and device arrays alike; no copy)."""
    return a.reshape(-1).view(np.uint32)
