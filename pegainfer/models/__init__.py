"""Model architectures: each turns a config + weights into a forward pass of kernel launches."""
from __future__ import annotations


def model_class(arch: str):
    """The model class for a config's ``arch`` ("qwen3" or "qwen3_5")."""
    if arch == "qwen3":
        from pegainfer.models.qwen3 import Qwen3Model
        return Qwen3Model
    if arch == "qwen3_5":
        from pegainfer.models.qwen35 import Qwen35Model
        return Qwen35Model
    from pegainfer.errors import UnsupportedModelError
    raise UnsupportedModelError(f"unsupported architecture {arch!r}: pegainfer runs Qwen3 and Qwen3.5 models")
