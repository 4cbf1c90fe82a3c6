"""pegainfer: LLM inference in pure Python with readable Numba-CUDA kernels."""
from pegainfer import device as _device  # noqa: F401  (must run before numba is imported)

__version__ = "0.1.0"
SIMULATOR = _device.SIMULATOR


def __getattr__(name):
    """``from pegainfer import LLM, SamplingParams``: the offline API (``llm.py``), imported on first use (it
    imports numba and the kernels; ``import pegainfer`` alone stays light for the command line)."""
    if name in ("LLM", "AsyncLLM", "Generation", "Completion", "StreamDelta"):
        from pegainfer import llm
        return getattr(llm, name)
    if name == "SamplingParams":
        from pegainfer.engine.types import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'pegainfer' has no attribute {name!r}")
