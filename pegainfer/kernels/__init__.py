"""GPU kernels, one package (or one small module) per family.  Every kernel is a ``@cuda.jit`` function with its math,
shapes and launch geometry in its docstring.  A family package has a ``reference.py`` -- plain kernels that state the
math line by line, the oracle its tests compare the tuned kernels with -- and a module per tuned idea; its
``__init__`` lists them.  ``primitives`` is the only package that knows GPU from simulator; ``launch`` launches every
kernel, as the ``policy`` (``LaunchPolicy``) says."""
