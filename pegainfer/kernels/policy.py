"""The launch policy: every choice of *how* the kernels of a step launch, in one frozen object.

The engine builds one ``LaunchPolicy`` when it starts (``LaunchPolicy.from_options``) and hands it to the model,
which passes it to every kernel entry point it calls (``policy=``); the runner passes it to the sampler.  No kernel
module reads an environment variable or another module's globals to decide how it launches, so a benchmark can
build two policies in one process and compare them (``benchmarks/ab_policy.py``).  The command line's
``--launch-policy FIELD=VALUE,...`` changes fields of the default (``policy_text.py``: the text form, shared with
``ab_policy.py``'s variants).

What the policy decides:

* ``pdl`` -- which launches may overlap the kernel before them through programmatic dependent launch (PDL, sm_90+;
  ``launch.py`` says what a kernel may do before its wait; each kernel's ``reads_before_wait``, what it reads
  there).  By name: the ``name=`` of each ``launch``.  The default set is the weight-streaming kernels plus the
  latency-bound kernels of a decode step whose early start measured faster (``docs/perf/launch.md``).  ``None`` lets
  every launch that follows the contract overlap; an empty set none.  Where the GPU cannot (the simulator, before
  sm_90) no launch overlaps, whatever the policy says.
* ``preload_o`` -- the one-token o / out_proj projection copies its weights into the SMs' shared memory while the
  kernel before it still runs (``linear.linear_preloaded``): Qwen3-4B TPOT −2.1 %, Qwen3.5-4B −0.8 %.
* ``head_argmax`` -- the LM head of a one-sequence step also picks the greedy token (``linear.linear_add_rms_norm``
  with ``head=``), so the sampler has nothing left to do for a greedy row: Qwen3.5-4B −0.15 %, Qwen3-4B −0.04 %.
* ``tuning`` -- measured projection geometries for this GPU, overriding the built-in tables
  (``linear.geometry``); read from a tuning file (``load_tuning``) that ``benchmarks/bench_gemv.py --cold
  --tuning-out`` writes.
* ``gemm_norm_prologue`` -- the residual add + RMSNorm of a 17-64-token step (before qkv / in_proj and gate/up)
  runs as the ring GEMM's prologue (``linear.gemm_wgmma_add_rms_norm``: one launch, bit-identical) instead of a
  launch of its own before the GEMM.  Off by default until it measures faster (``docs/perf/launch.md``).
* ``timeline`` -- the decode kernels stamp every block's entry, wait, ready and end (``kernels/timeline.py``,
  ``benchmarks/step_profile.py``); off for serving.

Where each kernel releases the next one (``launch_dependents``) is fixed in its kernel: the one-token GEMV when its
blocks start their last tile, qk-norm/RoPE at its start, decode attention and the Gated DeltaNet step right after
their PDL wait, the preloaded GEMV once its copies are issued.  ``residual_ready`` reasons from those points (the
residual read before the wait it allows: Qwen3-4B −0.36 %, Qwen3.5-4B −0.6 %).  The numbers: docs/perf/launch.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

PDL_DEFAULT = frozenset({"gemv", "gemv_add_rms_norm", "gemv_preloaded", "linear_skinny",
                         "qk_norm_rope_store_decode", "paged_decode_attention", "gated_delta_decode_step"})
"""Launch names that overlap the kernel before them by default (``docs/perf/launch.md``: PDL on every launch made a
Qwen3-4B step 8.6 % slower than on this set; the add + RMSNorm of a step of several tokens, overlapped, made a
64-sequence step 3 % slower)."""

TUNING_KINDS = ("gemv", "skinny", "mma", "wgmma")
TOKENS_FIELD = {"gemv": "max_tokens", "skinny": "m_tiles", "mma": "tokens", "wgmma": "tokens"}
"""The field of a tuning entry that holds the token count its geometry is for."""


@dataclass(frozen=True)
class TuningEntry:
    """One measured geometry: ``kind`` ("gemv": ``key`` = (n_cols, K, max_tokens, gated); "skinny": (n_cols, K,
    m_tiles, gated); "mma" / "wgmma": (n_cols, K, token tile, gated)) and the geometry's fields as sorted
    ``(name, value)`` pairs."""
    kind: str
    key: tuple
    fields: tuple

    def geometry_fields(self) -> dict:
        return dict(self.fields)


@dataclass(frozen=True)
class LaunchPolicy:
    """How the kernels of a step launch (module docstring).  Build it once; pass it down; never mutate it
    (``dataclasses.replace`` makes a variant)."""

    pdl: frozenset[str] | None = PDL_DEFAULT
    preload_o: bool = True
    head_argmax: bool = True
    tuning: tuple[TuningEntry, ...] = ()
    gemm_norm_prologue: bool = False
    timeline: bool = False

    def overlaps(self, name: str | None) -> bool:
        """Whether a launch named ``name`` may overlap the kernel before it (if the GPU can: ``launch.py``)."""
        return self.pdl is None or (name is not None and name in self.pdl)

    def residual_ready(self, after: str, decode: bool) -> bool:
        """Whether the residual a one-token ``linear.linear_add_rms_norm`` reads was written by a kernel that has
        completed when that launch starts, so it may read it before its PDL wait (``residual_ready=``).

        ``after="down"``: the launch follows the MLP's down projection, a one-token GEMV that lets it launch only
        when its blocks start their last tile -- past its own wait, so the gate/up launch that wrote the residual
        has completed.  ``after="mixer"``: the MLP's gate/up after the attention (or Gated DeltaNet) block.  In a
        decode step the preloaded o / out_proj before it launches once decode attention (or the Gated DeltaNet step)
        has passed its PDL wait, so the layer's first projection, which wrote the residual, has completed.  A prompt
        chunk's attention kernels release at their start: not ready."""
        if after == "down":
            return True
        if after == "mixer":
            return decode
        raise ValueError(f"residual_ready: after must be 'down' or 'mixer', got {after!r}")

    def tuned(self, kind: str) -> dict:
        """``{key: geometry fields}`` of the tuning entries of ``kind``."""
        return {e.key: e.geometry_fields() for e in self.tuning if e.kind == kind}

    @classmethod
    def from_options(cls, *, pdl: bool = True, tuning_file: str | None = None) -> "LaunchPolicy":
        """The engine's policy: the defaults, without PDL when ``pdl`` is False, with the measured geometries of
        ``tuning_file`` when given."""
        return cls(pdl=PDL_DEFAULT if pdl else frozenset(), tuning=load_tuning(tuning_file) if tuning_file else ())


def load_tuning(path: str) -> tuple[TuningEntry, ...]:
    """Read a tuning file: ``[{"n_cols", "k", "max_tokens", "gated", "geometry": {...}}, ...]`` for GEMV entries,
    with ``"m_tiles"`` instead of ``"max_tokens"`` for skinny tensor-core entries (what
    ``benchmarks/bench_gemv.py --cold --tuning-out`` writes), and ``"kind": "mma"`` or ``"wgmma"`` with ``"tokens"``
    (the token tile: the next power of two >= T, at least 16) for the tensor-core GEMMs (what ``bench_gemm.py
    --sweep --tuning-out`` writes)."""
    from pegainfer.errors import PegainferError
    try:
        with open(path) as f:
            entries = json.load(f)
        out = []
        for e in entries:
            kind = e.get("kind") or ("skinny" if "m_tiles" in e else "gemv")
            if kind not in TUNING_KINDS:
                raise ValueError(f"unknown kind {kind!r} (expected one of {', '.join(TUNING_KINDS)})")
            tokens = e[TOKENS_FIELD[kind]]
            key = (int(e["n_cols"]), int(e["k"]), int(tokens), bool(e["gated"]))
            out.append(TuningEntry(kind, key, tuple(sorted(e["geometry"].items()))))
        return tuple(out)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PegainferError(f"tuning file {path}: {exc} -- expected the JSON list that "
                             "benchmarks/bench_gemv.py --cold --tuning-out or bench_gemm.py --tuning-out writes") from None


DEFAULT_POLICY = LaunchPolicy()
"""The policy of a kernel called without one (tests, micro-benchmarks): the engine's defaults."""
