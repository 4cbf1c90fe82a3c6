"""Token embedding lookup, the first kernel of every forward step: ``out[t, :] = table[ids[t], :]``.

* ``reference`` -- one thread per output element, the math plainly (the tests' oracle)
* ``gather`` -- the tuned gather: a block per token, every 16-byte load of a row issued before its stores
"""
from pegainfer.kernels.embedding.gather import EMBEDDING_THREADS, embedding, embedding_kernel
from pegainfer.kernels.embedding.reference import reference_embedding, reference_embedding_kernel

__all__ = ["EMBEDDING_THREADS", "embedding", "embedding_kernel", "reference_embedding", "reference_embedding_kernel"]
