"""Shared fixtures. Importing pegainfer first decides GPU vs simulator before numba loads."""
import numpy as np
import pytest

import pegainfer

SIMULATOR = pegainfer.SIMULATOR


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
