"""``python -m pegainfer env``: what a bug report needs about this machine, and why kernels run where they do (the
GPU or the simulator), without loading a model.  Like ``vllm collect-env``: one ``name: value`` line each, or JSON.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

PACKAGES = ("numba-cuda", "numpy", "ml_dtypes", "safetensors", "tokenizers", "huggingface_hub", "llguidance",
            "starlette", "uvicorn", "prometheus-client", "cuda-bindings", "cuda-pathfinder", "torch", "transformers")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device_reason() -> str:
    """Why ``device.py`` chose the GPU or the simulator (its rules, in order)."""
    if os.environ.get("PEGAINFER_DEVICE", "").lower() in ("sim", "gpu"):
        return f"PEGAINFER_DEVICE={os.environ['PEGAINFER_DEVICE']}"
    from pegainfer import device
    if device.SIMULATOR:
        count = device._driver_device_count()
        return "NUMBA_ENABLE_CUDASIM=1 was set" if count else "no CUDA driver or no GPU (libcuda.so.1 reports none)"
    return "the CUDA driver reports a GPU"


def _gpu() -> list[tuple[str, str]]:
    from numba import cuda

    from pegainfer.device import MIN_COMPUTE_CAPABILITY, has_wgmma
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    cc = tuple(dev.compute_capability)
    free, total = cuda.current_context().get_memory_info()
    rows = [("gpu", name), ("compute capability", f"{cc[0]}.{cc[1]}" + ("" if cc >= MIN_COMPUTE_CAPABILITY else
                                                                         " (too old: pegainfer needs 8.0)")),
            ("gpu memory", f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"),
            ("streaming multiprocessors", str(dev.MULTIPROCESSOR_COUNT)),
            ("projection GEMMs", "Hopper wgmma + TMA" if has_wgmma() else "mma.sync (no wgmma on this GPU)")]
    try:
        from cuda.bindings import driver
        err, version = driver.cuDriverGetVersion()
        rows.append(("cuda driver", f"{version // 1000}.{version % 1000 // 10}"))
    except Exception:  # noqa: BLE001 - a report line, not a failure
        pass
    return rows


def _compiler() -> str:
    """Whether numba finds the CUDA compiler libraries it compiles kernels with (the ``[gpu]`` extra)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return "cuda-pathfinder not installed: pip install -e '.[gpu]'"
    missing = []
    for lib in ("nvvm", "nvrtc"):
        try:
            load_nvidia_dynamic_lib(lib)
        except Exception:  # noqa: BLE001 - DynamicLibNotFoundError, or a library that does not load
            missing.append(f"lib{lib}")
    return "NVVM and NVRTC found" if not missing else f"{', '.join(missing)} not found: pip install -e '.[gpu]'"


def _hf_cache() -> str:
    """Where ``--model-path owner/name`` fetches to (``HF_HUB_CACHE``, from ``HF_HOME``)."""
    try:
        from huggingface_hub import constants
        return str(constants.HF_HUB_CACHE)
    except ImportError:
        return "huggingface_hub not installed"


def report() -> list[tuple[str, str]]:
    """The report's (name, value) lines."""
    import pegainfer
    from pegainfer.device import SIMULATOR
    rows = [("pegainfer", f"{pegainfer.__version__} ({os.path.dirname(pegainfer.__file__)})"),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("platform", platform.platform()),
            ("kernels run on", "Numba's CUDA simulator" if SIMULATOR else "the GPU"),
            ("because", _device_reason())]
    if not SIMULATOR:
        try:
            rows += _gpu()
        except Exception as e:  # noqa: BLE001 - what could not be read is itself the report
            rows.append(("gpu", f"could not be read ({type(e).__name__}: {e})"))
        rows.append(("cuda compiler", _compiler()))
    rows += [(package, _version(package)) for package in PACKAGES]
    rows += [("numba cache", os.environ.get("NUMBA_CACHE_DIR", "next to the kernels' source (NUMBA_CACHE_DIR unset)")),
             ("hugging face cache", _hf_cache())]
    return rows


def run_env(args) -> int:
    rows = report()
    if getattr(args, "json", False):
        import json
        print(json.dumps(dict(rows), indent=1))
    else:
        width = max(len(name) for name, _ in rows)
        for name, value in rows:
            print(f"{name:<{width}}  {value}")
    return 0
