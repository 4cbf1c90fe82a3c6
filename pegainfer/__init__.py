"""pegainfer: LLM inference in pure Python with readable Numba-CUDA kernels."""
from pegainfer import device as _device  # noqa: F401  (must run before numba is imported)

__version__ = "0.1.0"
SIMULATOR = _device.SIMULATOR
