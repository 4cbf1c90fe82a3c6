"""GPU kernels, one module per family. Every kernel is a ``@cuda.jit`` function with its math, shapes and launch
geometry in its docstring; ``primitives`` is the only module that knows GPU from simulator."""
