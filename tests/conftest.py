"""Shared fixtures. Importing pegainfer first decides GPU vs simulator before numba loads."""
import numpy as np
import pytest

import pegainfer

SIMULATOR = pegainfer.SIMULATOR   # (in the simulator, kernels.primitives speeds it up: primitives/simulator.py)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly in the simulator (CI); on a GPU they run."""
    if not SIMULATOR:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (running in the simulator)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_configure(config):
    """In CI (``CI`` set) the Hugging Face oracle must be there: tests that ``importorskip`` torch or transformers
    would otherwise skip silently and the oracle layer would check nothing."""
    import os
    if os.environ.get("CI"):
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except Exception as exc:        # missing, or broken by an incompatible version
            raise pytest.UsageError(f"CI needs the test oracle (torch + transformers, pyproject's [test] extra): "
                                    f"{type(exc).__name__}: {exc}") from None
