"""Rotary position embedding, with the per-head q/k RMSNorm and the paged KV store it is fused with.

RoPE here is Hugging Face's "rotate half" form on the first ``rotary_dim`` dims of a head (``half = rotary_dim/2``)::

    out[i]        = x[i]        · cos[i] − x[i + half] · sin[i]      for i < half
    out[i + half] = x[i + half] · cos[i] + x[i]        · sin[i]
    out[j]        = x[j]                                             for j ≥ rotary_dim (partial rotary, Qwen3.5)

with HF's bf16 rounding: each product is rounded to bf16, then their sum (``q*cos + rotate_half(q)*sin`` on bf16
tensors), and ``cos``/``sin`` are themselves bf16 (HF casts them to the activation dtype).  ``x`` is the head after
its RMSNorm (``norm.normalize_element``'s rounding).

Modules:

* ``tables.py`` -- ``rope_tables``: the cos / sin tables (host, as transformers computes them).
* ``reference.py`` -- the plain kernel: one thread per (token, head), the formulas above (the tests' oracle).
* ``store.py`` -- ``qk_norm_rope_store``: q/k norm + RoPE + the K/V write into the paged cache, one warp per
  (token, group of heads of one kind: ``choose_heads_per_warp``), one launch between the QKV projection and
  attention.
"""
from pegainfer.kernels.rope.reference import reference_qk_norm_rope_store
from pegainfer.kernels.rope.store import (QK_NORM_THREADS, choose_heads_per_warp, head_geometry, head_inverse_rms,
                                          norm_rope_pair, qk_norm_rope_kernel, qk_norm_rope_store, rope_rotate_pair)
from pegainfer.kernels.rope.tables import rope_tables

__all__ = ["rope_tables", "qk_norm_rope_store", "reference_qk_norm_rope_store", "qk_norm_rope_kernel",
           "QK_NORM_THREADS", "choose_heads_per_warp", "head_geometry", "head_inverse_rms", "norm_rope_pair",
           "rope_rotate_pair"]
