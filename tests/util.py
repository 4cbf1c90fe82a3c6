"""Helpers shared by tests: error metrics, bf16 rounding and random bf16 data."""
import numpy as np

import pegainfer  # noqa: F401  (must come before numba)
from pegainfer.kernels.primitives import from_bf16_bits, to_bf16_bits

SIMULATOR = pegainfer.SIMULATOR


def rel_l2(a, b) -> float:
    """Relative L2 error ||a - b|| / ||b|| in float64."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bf16_round(x):
    """Round float64 values to the nearest bf16 (ties to even), returned as float64."""
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.ldexp(np.round(np.ldexp(m, 8)), e - 8)


def bf16_randn(shape, rng, scale=1.0):
    """Random bf16 values: returns (uint16 bits, the same values as float64)."""
    bits = to_bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32))
    return bits, from_bf16_bits(bits).astype(np.float64)
