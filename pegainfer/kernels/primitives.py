"""The few hardware primitives that differ between a real GPU and Numba's CUDA simulator.

Every other kernel module imports its building blocks from here and never checks which world it runs in.

Conventions every kernel in ``pegainfer/kernels`` follows
---------------------------------------------------------
* **bf16 is raw bits.**  A bf16 tensor is a ``uint16`` device array.  ``bf16_to_f32`` widens one value,
  ``f32_to_bf16`` rounds to nearest-even (NaN stays NaN).  Arithmetic happens in f32; results are rounded back to
  bf16 exactly where Hugging Face's bf16 forward rounds them, so logits line up with the reference.
* **Wide loads.**  ``load_u32x4(a, i)`` reads ``a[i:i+4]`` of a ``uint32`` array as one 16-byte load (8 bf16
  values); ``i`` is an *element* index and must be a multiple of 4 (the address 16-byte aligned).
* **1-D blocks whose size is a multiple of 32**, and grid-/block-stride loops, so the same kernel runs with any
  geometry.  Launch wrappers pick small geometries in the simulator via ``threads(gpu=..)`` and ``grid(...)``.
* **Warp reductions** (``warp_sum``, ``warp_max``, ``warp_argmax``; ``lane_group_sum`` / ``lane_group_max`` over
  aligned groups of 2..32 lanes) are butterfly reductions: every lane gets the result.  ``warp_sums_to_shared``
  reduces n values per lane at once into shared memory (lane 0 writes).  In the simulator they are emulated with block-shared scratch and the block barrier, so *every thread of
  the block must call them the same number of times* (keep loop trip counts uniform across the block and guard the
  work inside the loop, not the reduction).
* ``block_sum`` / ``block_max`` / ``block_argmax`` reduce over the whole block (same rule: every thread calls them).
* **Unsigned indices in hot loops.**  numba wraps negative indices around (``a[-1]``), so every access with a
  signed index costs a compare, a select and 64-bit address arithmetic.  In an inner loop that reads shared memory
  this made the integer ALU the busiest pipe (Nsight Compute, H200); indexing with ``uint32`` values skips the
  wraparound (the tensor-core GEMM became 34 % faster, the Gated DeltaNet scan 22 %).
* Kernels are declared with ``@kernel`` (``cuda.jit`` with on-disk caching on the GPU) and device functions with
  ``@device_fn``.  They are launched only through ``pegainfer.kernels.launch.launch`` (one place for the stream,
  CUDA-graph capture and tracing).
"""
from __future__ import annotations

import functools
import math  # noqa: F401  (re-exported for kernels: math.exp etc. work in both worlds)

import numpy as np

from pegainfer.device import SIMULATOR
from numba import cuda  # noqa: E402

float32, int32, uint16, uint32 = np.float32, np.int32, np.uint16, np.uint32

WARP = 32
FULL_MASK = 0xFFFFFFFF
NO_INDEX = 2**31 - 1      # "no index yet" in an argmax state (``block_argmax``, the sampler, the LM head's argmax)

if SIMULATOR:
    kernel = cuda.jit
    device_fn = cuda.jit(device=True)
else:
    kernel = cuda.jit(cache=True)
    device_fn = cuda.jit(device=True, forceinline=True)


def threads(gpu: int = 256, sim: int = 32) -> int:
    """Block size for a launch: ``gpu`` on hardware, ``sim`` (default one warp) in the simulator."""
    return sim if SIMULATOR else gpu


def grid(n: int, per_block: int = 1, sim_cap: int = 64) -> int:
    """Number of blocks to cover ``n`` work items at ``per_block`` each (capped in the simulator, where kernels
    must then use grid-stride loops)."""
    blocks = max(1, -(-n // per_block))
    return min(blocks, sim_cap) if SIMULATOR else blocks


if SIMULATOR:
    # ---------------------------------------------------------------- simulator: plain Python with numpy scalars
    def _patch_simulator_block_manager():
        """Numba's simulator runs each CUDA thread as a Python thread and releases ``syncthreads`` from a manager
        loop that busy-polls every thread, holding the GIL while the threads it waits for cannot run: a barrier
        costs ~12 ms for one warp. Yielding the GIL between polls makes barriers (and our emulated warp
        shuffles) ~10x cheaper without changing what any kernel computes."""
        import time as _time

        from numba.cuda.simulator import kernel as _simk

        def run(self, grid_point, *args):
            threads, live, blocked = set(), set(), set()
            for block_point in np.ndindex(*self._block_dim):
                def target():
                    self._f(*args)
                t = _simk.BlockThread(target, self, grid_point, block_point, self._debug)
                t.start()
                threads.add(t)
                live.add(t)
            while live:
                _time.sleep(0.0001)
                for t in live:
                    if t.syncthreads_blocked:
                        blocked.add(t)
                    elif t.exception:
                        for other in threads:
                            other.abort = True
                            other.syncthreads_blocked = False
                            other.syncthreads_event.set()
                        raise t.exception[0].with_traceback(t.exception[1])
                if live == blocked:
                    for t in blocked:
                        t.syncthreads_blocked = False
                        t.syncthreads_event.set()
                    blocked = set()
                live = {t for t in live if t.is_alive()}
            for t in threads:
                if t.exception:
                    raise t.exception[0].with_traceback(t.exception[1])

        _simk.BlockManager.run = run

        # Shared arrays are keyed by call site. Upstream finds the site with traceback.extract_stack (slow: it
        # reads source lines) and without a lock (two threads can each create "the" array). Same keys, locked.
        import sys as _sys
        import threading as _threading

        from numba.core import types as _types
        from numba.np import numpy_support as _npsup
        from numba.cuda.simulator import kernelapi as _kapi

        _lock = _threading.Lock()
        _orig_array = _kapi.FakeCUDAShared.array

        def shared_array(self, shape, dtype, alignment=None):   # alignment: nothing to do (nothing checks it here)
            if shape == 0:
                return _orig_array(self, shape, dtype, alignment)
            f = _sys._getframe(1)
            caller = (f.f_code.co_filename, f.f_lineno)
            with _lock:
                res = self._allocations.get(caller)
                if res is None:
                    if isinstance(dtype, _types.Type):
                        dtype = _npsup.as_dtype(dtype)
                    res = np.empty(shape, dtype)
                    self._allocations[caller] = res
            return res

        _kapi.FakeCUDAShared.array = shared_array

    _patch_simulator_block_manager()

    @device_fn
    def bf16_to_f32(bits):
        return np.uint32(int(bits) << 16).view(np.float32)

    @device_fn
    def f32_to_bf16(x):
        x = np.float32(x)
        if x != x:
            return np.uint16(0x7FC0)
        u = int(x.view(np.uint32))
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF
        return np.uint16(u >> 16)

    @device_fn
    def f32_bits(x):
        return np.uint32(np.float32(x).view(np.uint32))

    @device_fn
    def bits_f32(u):
        return np.uint32(u).view(np.float32)

    @device_fn
    def load_u32x4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @device_fn
    def load_u32_l2(a, i):
        return a[i]

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

    def _lane_group(width):
        """(this thread's index, first and one-past-last thread of its aligned group of ``width`` lanes)."""
        t = int(cuda.threadIdx.x)
        lo = t - t % int(width)
        return t, lo, min(lo + int(width), int(cuda.blockDim.x))

    def _group_values(v, width):
        """Every lane's ``v`` in this thread's aligned group of ``width`` lanes (float64): one exchange through
        block-shared scratch between two block barriers, which is why every thread of the block must take part."""
        buf = cuda.shared.array(1024, np.float64)
        t, lo, hi = _lane_group(width)
        buf[t] = v
        cuda.syncthreads()
        vals = buf[lo:hi].copy()
        cuda.syncthreads()
        return vals

    def _f32_sum(vals):
        return np.float32(np.sum(vals.astype(np.float32), dtype=np.float32))

    @device_fn
    def warp_sum(v):
        s = _f32_sum(_group_values(v, WARP))
        return type(v)(s) if isinstance(v, (np.floating, float)) else s

    @device_fn
    def warp_max(v):
        m = _group_values(v, WARP).max()
        return type(v)(m) if isinstance(v, (np.floating, float)) else np.float32(m)

    @device_fn
    def lane_group_sum(v, width):
        """Sum of ``v`` over aligned groups of ``width`` lanes (a power of two <= 32); every lane of the group gets
        it."""
        return _f32_sum(_group_values(v, width))

    @device_fn
    def lane_group_max(v, width):
        """Max of ``v`` over aligned groups of ``width`` lanes (a power of two <= 32)."""
        return np.float32(_group_values(v, width).max())

    # Blocks run one after another in the simulator, so one host array can serve as the block's exchange buffer
    # (a ``cuda.shared.array`` here would walk the Python stack on every call to find its allocation).
    _sim_exchange = np.zeros(1 << 16, np.float32)

    @device_fn
    def warp_sums_to_shared(vals, n, dst, base, as_bits):
        """``dst[base + i] = Σ_lanes vals[i]`` for ``i < n`` (its f32 bits when ``as_bits``: ``dst`` a uint32
        array), written by lane 0 of the calling warp; ``dst`` is shared memory, visible to the block after the
        caller's next ``syncthreads``.  Every thread of the block must call it (same n).  Emulated with one
        exchange for all n values (an emulated ``warp_sum`` costs two block barriers)."""
        tid = int(cuda.threadIdx.x)
        _sim_exchange[tid * n:(tid + 1) * n] = vals[:n]
        cuda.syncthreads()
        if tid % WARP == 0:
            hi = min(tid + WARP, int(cuda.blockDim.x))
            for i in range(n):
                v = np.sum(_sim_exchange[tid * n + i:hi * n:n], dtype=np.float32)
                dst[base + i] = v.view(np.uint32) if as_bits else v

    @device_fn
    def warp_argmax(v, i):
        """(max value, its index) over the warp; ties go to the smaller index."""
        vals = cuda.shared.array(1024, np.float64)
        idxs = cuda.shared.array(1025, np.int64)  # different size only so the two allocations are distinct
        t, lo, hi = _lane_group(WARP)
        vals[t] = v
        idxs[t] = i
        cuda.syncthreads()
        best_v, best_i = vals[lo], idxs[lo]
        for j in range(lo + 1, hi):
            if vals[j] > best_v or (vals[j] == best_v and idxs[j] < best_i):
                best_v, best_i = vals[j], idxs[j]
        cuda.syncthreads()
        return np.float32(best_v), np.int32(best_i)

    warp_row_sums_to_shared = warp_sums_to_shared   # the emulation has one order for both


else:
    # ---------------------------------------------------------------- GPU
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic
    from numba.cuda import libdevice

    @device_fn
    def bf16_to_f32(bits):
        return libdevice.int_as_float(int32(uint32(bits) << uint32(16)))

    @device_fn
    def f32_bits(x):
        return uint32(libdevice.float_as_int(float32(x)))

    @device_fn
    def bits_f32(u):
        return libdevice.int_as_float(int32(u))

    @intrinsic
    def _cvt_rn_bf16(typingctx, x):
        """``cvt.rn.bf16.f32``: f32 -> bf16 bits, round to nearest even, in one instruction (NaN: 0x7FFF)."""
        sig = types.uint16(types.float32)

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(16), [ir.FloatType()]), "cvt.rn.bf16.f32 $0, $1;", "=h,f")
            return builder.call(asm, [args[0]])

        return sig, codegen

    @device_fn
    def f32_to_bf16(x):
        """bf16 bits of ``x``, round to nearest even (the hardware conversion), NaN as PyTorch's 0x7FC0."""
        xf = float32(x)
        b = _cvt_rn_bf16(xf)
        return uint16(0x7FC0) if xf != xf else b

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

    # f32 vector loads and stores (global or shared memory: the address is generic): plain LLVM vector accesses,
    # so the compiler orders them against barriers and other accesses as it does any load or store.
    def _f32_vector_args_ok(arr):
        return isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == 1

    def _f32_vector_pointer(context, builder, sig, args, width):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])   # (defined below)
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

    @device_fn
    def warp_sum(v):
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
        return v

    @device_fn
    def warp_max(v):
        for off in (16, 8, 4, 2, 1):
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
        return v

    @device_fn
    def lane_group_sum(v, width):
        """Sum of ``v`` over aligned groups of ``width`` lanes (a power of two <= 32): an xor butterfly that stays
        inside the group; every lane of the group gets the sum."""
        off = width >> 1
        while off > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
            off >>= 1
        return v

    @device_fn
    def lane_group_max(v, width):
        """Max of ``v`` over aligned groups of ``width`` lanes."""
        off = width >> 1
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
            off >>= 1
        return v

    @device_fn
    def warp_sums_to_shared(vals, n, dst, base, as_bits):
        """``dst[base + i] = Σ_lanes vals[i]`` for ``i < n`` (its f32 bits when ``as_bits``: ``dst`` a uint32
        array), written by lane 0 of the calling warp; ``dst`` is shared memory, visible to the block after the
        caller's next ``syncthreads``.  Every thread of the block must call it (same n)."""
        for i in range(n):
            s = warp_sum(vals[i])
            if cuda.threadIdx.x % WARP == 0:
                if as_bits:
                    dst[base + i] = f32_bits(s)
                else:
                    dst[base + i] = s

    @device_fn
    def _halve_rows(t, h, o, upper):
        """One level of ``warp_row_sums_to_shared``: rows ``[0, 2h)`` of ``t`` → ``[0, h)``, this lane keeping the
        upper half (``upper``) or the lower one and adding its xor-``o`` partner's copy of it."""
        for j in range(h):
            a = t[j]
            b = t[j + h]
            t[j] = (b if upper else a) + cuda.shfl_xor_sync(FULL_MASK, a if upper else b, o)

    @device_fn
    def warp_row_sums_to_shared(vals, n, dst, base, as_bits):
        """``warp_sums_to_shared`` for ``n <= 32`` values a lane, by recursive halving: at each of five levels a
        lane keeps half of its rows and adds its partner's copies of them, so 31 shuffles sum 32 rows (against 5 a
        row) and lane ``i`` ends with row ``i``'s sum, which it writes.  A different f32 summation order."""
        lane = cuda.threadIdx.x % WARP
        t = cuda.local.array(WARP, float32)
        for r in range(WARP):
            t[r] = vals[r] if r < n else float32(0.0)
        _halve_rows(t, 16, 16, (lane & 16) != 0)
        _halve_rows(t, 8, 8, (lane & 8) != 0)
        _halve_rows(t, 4, 4, (lane & 4) != 0)
        _halve_rows(t, 2, 2, (lane & 2) != 0)
        _halve_rows(t, 1, 1, (lane & 1) != 0)
        if lane < n:
            if as_bits:
                dst[base + lane] = f32_bits(t[0])
            else:
                dst[base + lane] = t[0]

    @device_fn
    def warp_argmax(v, i):
        """(max value, its index) over the warp; ties go to the smaller index."""
        for off in (16, 8, 4, 2, 1):
            ov = cuda.shfl_xor_sync(FULL_MASK, v, off)
            oi = cuda.shfl_xor_sync(FULL_MASK, i, off)
            if ov > v or (ov == v and oi < i):
                v = ov
                i = oi
        return v, i


@device_fn
def block_sum(v):
    """Sum of ``v`` over every thread of the (1-D, multiple-of-32) block; every thread gets the total."""
    partial = cuda.shared.array(32, float32)
    lane = cuda.threadIdx.x % WARP
    wid = cuda.threadIdx.x // WARP
    nwarps = (cuda.blockDim.x + WARP - 1) // WARP
    s = warp_sum(float32(v))
    cuda.syncthreads()
    if lane == 0:
        partial[uint32(wid)] = s            # (unsigned: no negative-index wraparound code)
    cuda.syncthreads()
    t = partial[uint32(lane)] if lane < nwarps else float32(0.0)
    t = warp_sum(t)
    return t


@device_fn
def block_max(v):
    """Max of ``v`` over every thread of the block; every thread gets it."""
    partial = cuda.shared.array(32, float32)
    lane = cuda.threadIdx.x % WARP
    wid = cuda.threadIdx.x // WARP
    nwarps = (cuda.blockDim.x + WARP - 1) // WARP
    m = warp_max(float32(v))
    cuda.syncthreads()
    if lane == 0:
        partial[uint32(wid)] = m
    cuda.syncthreads()
    t = partial[uint32(lane)] if lane < nwarps else float32(-math.inf)
    t = warp_max(t)
    return t


@device_fn
def block_argmax(v, i):
    """(max of ``v``, its int32 index ``i``) over every thread of the block, ties → the smaller index (NaN never
    wins; no candidate at all gives (-inf, ``NO_INDEX``)); every thread gets the result."""
    part_v = cuda.shared.array(32, float32)
    part_i = cuda.shared.array(32, int32)
    lane = cuda.threadIdx.x % WARP
    wid = cuda.threadIdx.x // WARP
    v, i = warp_argmax(float32(v), int32(i))
    cuda.syncthreads()
    if lane == 0:
        part_v[uint32(wid)] = v
        part_i[uint32(wid)] = i
    cuda.syncthreads()
    v = float32(-math.inf)
    i = int32(NO_INDEX)
    if lane < (cuda.blockDim.x + WARP - 1) // WARP:
        v = part_v[uint32(lane)]
        i = part_i[uint32(lane)]
    return warp_argmax(v, i)


@device_fn
def bf16x2_lo(word):
    """f32 value of the low bf16 of a packed pair (``uint32`` holding two bf16, lower index in the low half)."""
    return bits_f32(uint32(word) << uint32(16))


@device_fn
def bf16x2_hi(word):
    """f32 value of the high bf16 of a packed pair."""
    return bits_f32(uint32(word) & uint32(0xFFFF0000))


# ------------------------------------------------------------------------------------------------ tensor cores
# ``mma_bf16_m16n8k16`` is one warp-wide ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: D[16×8] =
# A[16×16] · B[16×8] + C in f32.  Fragment layout (PTX ISA; measured on the H200), per lane with g = lane >> 2 and
# t = lane & 3, every uint32 holding two bf16 with the lower index in the low half:
#   a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]   a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
#   b0 = B[2t:2t+2, g]   b1 = B[2t+8:2t+10, g]
#   c0, c1 = C[g, 2t:2t+2]   c2, c3 = C[g+8, 2t:2t+2]   (the same for the returned d0..d3)
# Every lane of the warp must call it (in the simulator: every thread of the block, equally often, like the warp
# reductions).  ``pack_bf16x2(lo, hi)`` rounds two f32 to bf16 (nearest even) and packs them, ``lo`` in the low half
# (the A/B fragment word format, and two adjacent bf16 outputs as one 4-byte store).
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
    def pack_bf16x2(lo, hi):
        """Two f32 -> one uint32 of two bf16 (round to nearest even), ``lo`` in the low half."""
        return np.uint32(int(f32_to_bf16(lo)) | (int(f32_to_bf16(hi)) << 16))
else:
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
    def pack_bf16x2(typingctx, lo, hi):
        """``cvt.rn.bf16x2.f32``: two f32 -> one uint32 of two bf16 (round to nearest even), ``lo`` in the low half."""
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            vals = [context.cast(builder, v, ty, types.float32) for v, ty in zip(args, sig.args)]
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32, f32]), "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f")
            return builder.call(asm, vals)

        return sig, codegen


def as_words(a):
    """A contiguous tensor (bf16 as uint16, or f32) seen as a flat uint32 array, for 16-byte loads and ``cp.async``
    (host and device arrays alike; no copy)."""
    return a.reshape(-1).view(np.uint32)


# ------------------------------------------------------------------------------------------------ async copies
# ``cp_async_16(dst, i, src, j, nbytes)`` starts copying 16 bytes ``src[j:j+4]`` (global uint32) to ``dst[i:i+4]``
# (shared uint32) without holding registers: ``cp.async.cg`` (through L2 only); ``nbytes`` = 0 writes zeros instead
# (reads nothing).  Copies issued since the last ``cp_async_commit()`` form a group; ``cp_async_wait_group(n)()``
# waits until at most ``n`` of the thread's groups are still in flight: the thread's own copies are then visible to
# it, and to the block after a ``syncthreads``.  In the simulator the copy happens at once.
# Bulk copies (sm_90's copy engine, ``cp.async.bulk``): one thread ``bulk_barrier_init``s an mbarrier in shared memory,
# announces the bytes with ``bulk_expect_bytes`` and issues ``bulk_copy``s of whole runs; after a ``syncthreads`` (the
# barrier initialised) every thread may ``bulk_wait`` for them.  One-shot: each barrier serves one batch of copies.
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
    def _element_pointer(context, builder, arrty, arr, idx, idxty):
        """LLVM pointer to ``arr[idx]`` (no wraparound)."""
        ary = context.make_array(arrty)(context, builder, value=arr)
        return cgutils.get_item_pointer(context, builder, arrty, ary, [context.cast(builder, idx, idxty, types.intp)],
                                        wraparound=False)

    def _to_shared(operand: str, reg: str) -> str:
        """PTX declaring the 32-bit register ``reg`` and setting it to the shared-memory address of the generic
        pointer ``operand``."""
        return f".reg .u64 {reg}_g; .reg .u32 {reg}; cvta.to.shared.u64 {reg}_g, {operand}; cvt.u32.u64 {reg}, {reg}_g;"

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

    def _asm_statement(text):
        """An intrinsic ``f()`` that emits one PTX statement with no operands (ordered as a memory access)."""
        @intrinsic
        def emit(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return sig, codegen
        return emit

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


# ------------------------------------------------------------------------------------------------ kernel overlap
# Programmatic dependent launch (PDL, sm_90+).  A kernel launched with ``launch(..., pdl=True)`` may start while the
# kernel before it on the stream is still running:
#   * ``grid_dependency_wait()`` blocks until every kernel before it on the stream has finished and its writes are
#     visible.  A PDL-launched kernel calls it before it reads anything an earlier kernel wrote and before it writes
#     anything at all; before it, it may only read what no kernel writes (weights), e.g. to start its weight stream.
#   * ``launch_dependents()`` lets the next PDL-launched kernel start now (its blocks take SMs as ours free them);
#     without it the next kernel starts when this one's blocks exit.
# Both are no-ops when there is nothing to wait for / no dependent, in the simulator and before sm_90.
def _grid_dependency_control() -> bool:
    if SIMULATOR:
        return False
    try:
        return cuda.get_current_device().compute_capability >= (9, 0)
    except Exception:      # no device to ask: an offline PTX build, which targets sm_90
        return True


GRID_DEPENDENCY_CONTROL = _grid_dependency_control()

if GRID_DEPENDENCY_CONTROL:
    grid_dependency_wait = _asm_statement("griddepcontrol.wait;")
    launch_dependents = _asm_statement("griddepcontrol.launch_dependents;")
else:
    @device_fn
    def grid_dependency_wait():
        pass

    @device_fn
    def launch_dependents():
        pass

# Timeline stamps (``pegainfer/kernels/timeline.py``): when a block reached a point of its kernel, and on which SM.
if SIMULATOR:
    import time as _time

    @device_fn
    def global_timer():
        """Nanoseconds of a clock every SM shares (the simulator: the host's ``perf_counter_ns``)."""
        return np.uint64(_time.perf_counter_ns())

    @device_fn
    def sm_id():
        """The SM this block runs on (0 in the simulator)."""
        return np.uint32(0)
else:
    def _read_register(ptx_type: str, register: str, nbtype, bits: int):
        @intrinsic
        def read(typingctx):
            sig = nbtype()

            def codegen(context, builder, sig, args):
                # volatile (side effect): every call reads the register anew, in program order
                asm = ir.InlineAsm(ir.FunctionType(ir.IntType(bits), []), f"mov.{ptx_type} $0, {register};", "=l"
                                   if bits == 64 else "=r", side_effect=True)
                return builder.call(asm, [])

            return sig, codegen
        return read

    global_timer = _read_register("u64", "%globaltimer", types.uint64, 64)   # ns of a clock every SM shares
    sm_id = _read_register("u32", "%smid", types.uint32, 32)                 # the SM this block runs on


@device_fn
def pdl_prologue():
    """The start of a kernel that does nothing before its inputs are ready: let the next PDL kernel launch, then
    wait for the previous one (kernels that stream weights meanwhile call the two primitives themselves)."""
    launch_dependents()
    grid_dependency_wait()


# ------------------------------------------------------------------------------------------------ host helpers
def to_bf16_bits(a) -> np.ndarray:
    """Host array (any float dtype, incl. ml_dtypes.bfloat16) → uint16 bf16 bits, round-to-nearest-even."""
    import ml_dtypes

    a = np.asarray(a)
    if a.dtype == np.uint16:
        return a
    return np.ascontiguousarray(a.astype(ml_dtypes.bfloat16)).view(np.uint16)


def from_bf16_bits(bits) -> np.ndarray:
    """uint16 bf16 bits (host) → float32."""
    bits = np.asarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)
