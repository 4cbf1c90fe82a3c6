"""The MLP's gated activation, SwiGLU: ``out = bf16(bf16(silu(gate)) · up)``.

* ``reference`` -- one thread per output element, the rounding points stated line by line (the tests' oracle)
* ``swiglu`` -- ``silu`` (the device function ``linear.linear_silu_mul`` fuses into its epilogue) and the
  standalone grid-stride kernel
"""
from pegainfer.kernels.activation.reference import reference_silu_mul, reference_silu_mul_kernel
from pegainfer.kernels.activation.swiglu import silu, silu_mul, silu_mul_kernel

__all__ = ["reference_silu_mul", "reference_silu_mul_kernel", "silu", "silu_mul", "silu_mul_kernel"]
