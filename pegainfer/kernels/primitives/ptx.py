"""Helpers for the GPU's inline-PTX intrinsics (imported only on the GPU): a pointer to an array element, the
shared-memory address of a generic pointer, and an intrinsic that emits one PTX statement."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda import cgutils
from numba.cuda.extending import intrinsic


def _element_pointer(context, builder, arrty, arr, idx, idxty):
    """LLVM pointer to ``arr[idx]`` (no wraparound)."""
    ary = context.make_array(arrty)(context, builder, value=arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [context.cast(builder, idx, idxty, types.intp)],
                                    wraparound=False)


def _to_shared(operand: str, reg: str) -> str:
    """PTX declaring the 32-bit register ``reg`` and setting it to the shared-memory address of the generic
    pointer ``operand``."""
    return f".reg .u64 {reg}_g; .reg .u32 {reg}; cvta.to.shared.u64 {reg}_g, {operand}; cvt.u32.u64 {reg}, {reg}_g;"


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
