"""Compile kernels to sm_90 PTX on a machine without a GPU (catches typing/lowering errors before a GPU run).

Usage (in a venv with ``numba-cuda[cu13]``, which brings NVVM):
    PEGAINFER_DEVICE=gpu python -c "from tools.ptx_offline import compile_sm90; ..."
``compile_sm90(kernel, argtypes)`` returns the PTX text of a ``@kernel`` (``cuda.jit``) function.
"""
import os

os.environ.setdefault("PEGAINFER_DEVICE", "gpu")

import pegainfer  # noqa: E402,F401
from numba import cuda  # noqa: E402
import numba.cuda.dispatcher as _disp  # noqa: E402


class _FakeDevice:
    compute_capability = (9, 0)


_disp.get_current_device = lambda: _FakeDevice()


def compile_sm90(kern, argtypes):
    fn = getattr(kern, "py_func", kern)
    ptx, _ = cuda.compile_ptx(fn, tuple(argtypes), cc=(9, 0))
    return ptx
