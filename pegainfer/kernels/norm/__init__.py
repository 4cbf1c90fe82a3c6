"""RMSNorm, plain and fused with the residual add, in the two bf16 roundings the served models use (Qwen3: round
before the weight; Qwen3.5: ``1 + w``, one rounding).

* ``reference`` -- one thread per token row, the math and its rounding points line by line (the tests' oracle)
* ``row_kernel`` -- the tuned kernel (a block per row, every load of the row issued at once) with its device functions
  (``normalize_element``, ``inverse_rms``, ``add_pair``, ``normalize_pair``) that the fused kernels of ``linear``,
  ``rope``, ``attention`` and ``gated_delta`` share, so they round exactly as these norms do, and ``build_row_norm``:
  a row's whole norm, in this kernel's sum order, from blocks of another size
"""
from pegainfer.kernels.norm.reference import (reference_add_rms_norm, reference_add_rms_norm_kernel,
                                              reference_rms_norm)
from pegainfer.kernels.norm.row_kernel import (BLOCK_THREADS, add_pair, add_residual, add_rms_norm,
                                               add_rms_norm_into, build_row_norm, check_residual_buffers, inverse_rms,
                                               normalize_element, normalize_pair, pairs_per_thread, rms_norm)

__all__ = ["BLOCK_THREADS", "add_pair", "add_residual", "add_rms_norm", "add_rms_norm_into", "build_row_norm",
           "check_residual_buffers", "inverse_rms", "normalize_element", "normalize_pair", "pairs_per_thread",
           "reference_add_rms_norm", "reference_add_rms_norm_kernel", "reference_rms_norm", "rms_norm"]
