"""bf16 as raw bits: a bf16 tensor is a ``uint16`` array; arithmetic happens in f32.

``bf16_to_f32`` widens one value, ``f32_to_bf16`` rounds to nearest even (NaN as PyTorch's 0x7FC0); ``f32_bits`` /
``bits_f32`` reinterpret an f32 as its uint32 bits and back; ``bf16x2_lo`` / ``bf16x2_hi`` read the two halves of a
packed pair (a ``uint32`` holding two bf16, the lower index in the low half) and ``pack_bf16x2`` builds one;
``to_bf16_bits`` / ``from_bf16_bits`` convert host arrays.  ``split_bf16x2`` writes two f32 as two packed pairs,
a rounded pair and the pair of what it missed, for tensor-core products that keep close to f32.
"""
from __future__ import annotations

import numpy as np

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn, float32, int32, uint16, uint32

if SIMULATOR:
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
    def pack_bf16x2(lo, hi):
        """Two f32 -> one uint32 of two bf16 (round to nearest even), ``lo`` in the low half."""
        return np.uint32(int(f32_to_bf16(lo)) | (int(f32_to_bf16(hi)) << 16))
else:
    from llvmlite import ir
    from numba import types
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
    def pack_bf16x2(typingctx, lo, hi):
        """``cvt.rn.bf16x2.f32``: two f32 -> one uint32 of two bf16 (round to nearest even), ``lo`` in the low half."""
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            vals = [context.cast(builder, v, ty, types.float32) for v, ty in zip(args, sig.args)]
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32, f32]), "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f")
            return builder.call(asm, vals)

        return sig, codegen


@device_fn
def bf16x2_lo(word):
    """f32 value of the low bf16 of a packed pair (``uint32`` holding two bf16, lower index in the low half)."""
    return bits_f32(uint32(word) << uint32(16))


@device_fn
def bf16x2_hi(word):
    """f32 value of the high bf16 of a packed pair."""
    return bits_f32(uint32(word) & uint32(0xFFFF0000))


@device_fn
def split_bf16x2(x0, x1):
    """Two f32 as ``(hi, lo)``, two packed bf16 pairs (``x0`` in the low halves) with ``x ≈ hi + lo``: ``hi`` rounds
    ``x`` to bf16, ``lo`` rounds the remainder ``x − hi`` (exact in f32).  ``hi + lo`` misses ``x`` by at most
    2⁻¹⁶·|x| (normal numbers; ``hi`` by 2⁻⁸·|x|), so tensor-core products of ``hi`` and ``lo`` with an exact bf16
    operand, summed in f32, carry ~16 bits where one bf16 operand carries 8."""
    hi = pack_bf16x2(x0, x1)
    lo = pack_bf16x2(float32(x0) - bf16x2_lo(hi), float32(x1) - bf16x2_hi(hi))
    return hi, lo


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
