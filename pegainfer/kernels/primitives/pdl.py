"""Kernel overlap and the clocks a kernel can read.

Programmatic dependent launch (PDL, sm_90+).  A kernel launched with a policy that lets it overlap
(``launch(..., policy=)``) may start while the kernel before it on the stream is still running:
* ``grid_dependency_wait()`` blocks until every kernel before it on the stream has finished and its writes are
  visible.  A PDL-launched kernel calls it before it reads anything an earlier kernel wrote and before it writes
  anything at all; before it, it may only read what no kernel writes (weights), e.g. to start its weight stream.
* ``launch_dependents()`` lets the next PDL-launched kernel start now (its blocks take SMs as ours free them);
  without it the next kernel starts when this one's blocks exit.
Both are no-ops when there is nothing to wait for / no dependent, in the simulator and before sm_90.

``reads_before_wait(*names)``: the one statement of what a kernel reads before its wait -- the names of the kernel
arguments whose memory it may read there, each one no kernel of a step writes (or, like a ready residual, one whose
writer has completed when the launch starts: the launch policy's ``residual_ready``).  A kernel that declares
nothing may read nothing before its wait.  ``tools/pdl_early_reads.py`` checks every overlapped launch's compiled
code against it (``tests/kernels/test_pdl_wait_position.py``): no argument read before the wait that is not
declared, no global write before it on any path.

``global_timer`` / ``sm_id``: the GPU's global nanosecond clock and the SM a block runs on, for the timeline stamps
(``pegainfer/kernels/timeline.py``).
"""
from __future__ import annotations

import inspect

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.primitives.launch_shape import device_fn


def _grid_dependency_control() -> bool:
    if SIMULATOR:
        return False
    try:
        return cuda.get_current_device().compute_capability >= (9, 0)
    except Exception:      # no device to ask: an offline PTX build, which targets sm_90
        return True


GRID_DEPENDENCY_CONTROL = _grid_dependency_control()
if GRID_DEPENDENCY_CONTROL:
    from pegainfer.kernels.primitives.ptx import _asm_statement

    grid_dependency_wait = _asm_statement("griddepcontrol.wait;")
    launch_dependents = _asm_statement("griddepcontrol.launch_dependents;")
else:
    @device_fn
    def grid_dependency_wait():
        pass

    @device_fn
    def launch_dependents():
        pass


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
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

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


def reads_before_wait(*names: str):
    """Declare, on a ``@kernel``, the arguments it may read before its ``grid_dependency_wait`` (module docstring):
    the decorated kernel gets ``pdl_early_reads``, a frozenset of those names.  A name that is not one of the
    kernel's parameters is a TypeError at once."""
    def declare(kern):
        unknown = set(names) - set(inspect.signature(kern.py_func).parameters)
        if unknown:
            raise TypeError(f"reads_before_wait: {kern.py_func.__name__} has no argument {sorted(unknown)}")
        kern.pdl_early_reads = frozenset(names)
        return kern
    return declare
