"""CUDA-graph capture and replay of whole engine steps.

A numba launch costs ~20 µs of host time and a Qwen3-4B step has hundreds of kernels, so launching them one by
one would cost more than the GPU work. Instead, each step shape is captured once into a CUDA graph and replayed:

* decode steps of B sequences for B in ``decode_graph_sizes`` (1, 2, 4, 8, then steps of 8, 16, 32 up to
  ``max_batch``): T = B tokens, B logits rows; a batch between two sizes runs as the larger, padded with empty rows
  (slot -1), as vLLM does;
* prefill chunks padded up to a bucket of T tokens (16, 32, ... 512, 768, 1024, 1536, 2048: ``prefill_buckets``),
  one logits row;
* mixed steps (every running decode plus prompt chunks, ``engine/scheduler.py``) of models whose ``pads_mixed``
  says so, padded to ``mixed_shape``'s (Dp, Cp, Rp): D decodes run as Dp = ``mixed_decode_rows`` (powers of two,
  then 1.5 times one: coarser than the decode graphs' sizes), the chunks' L tokens as Cp = a prefill bucket, their
  logits rows as Rp = a power of two, at least ``MIXED_MIN_ROWS``.  These graphs are keyed ``("mixed", Dp, Cp,
  Rp)`` and captured lazily (``replay_or_capture``: the first time a shape is met, at most ``MIXED_GRAPHS_MAX`` of
  them), besides those ``capture_all`` takes at warm-up (``mixed_warmup_shapes``: the shapes a load of many
  streams meets).
  Padding tokens carry slot -1: their K/V are not written, their attention output is ignored, and Qwen3.5's
  Gated DeltaNet layers neither read nor write a recurrent state for them (``models/qwen35.py``, "Padding").

Everything that changes per step — token ids, positions, slots, block tables, sampling parameters — lives in
device buffers that the runner refreshes with asynchronous copies on the same stream before ``cuGraphLaunch``, so
a captured graph never changes.
"""
from __future__ import annotations

import logging
import time

from pegainfer.kernels.launch import on_stream

log = logging.getLogger("pegainfer.engine")

PREFILL_GRAPH_MAX = 2048
"""Largest prompt chunk replayed from a graph (the default token budget): an eager chunk pays the host cost of its
~500 launches (tens of µs each), which a 2048-token Qwen3-4B chunk measured at about as much as its GPU time."""


def decode_graph_sizes(max_batch: int) -> list[int]:
    """The decode batch sizes that get a graph: every size up to 8, then steps of 8 to 64, 16 to 128, 32 beyond,
    and ``max_batch`` itself (padding wastes at most a few rows' work; each graph costs capture time and memory)."""
    sizes, b = [], 1
    while b <= max_batch:
        sizes.append(b)
        b += 1 if b < 8 else 8 if b < 64 else 16 if b < 128 else 32
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def prefill_buckets(max_tokens: int) -> list[int]:
    """The padded prompt-chunk sizes that get a graph: powers of two from 16 to 512, then 768, 1024, 1536, 2048 (half
    steps: above 512 a chunk pads by less than half), up to ``max_tokens``."""
    out, t = [], 16
    while t <= min(PREFILL_GRAPH_MAX, max_tokens):
        out.append(t)
        t = t * 2 if t < 512 else t + t // 2 if t & (t - 1) == 0 else t + t // 3    # 512 768 1024 1536 2048
    return out


def prefill_bucket(length: int, max_tokens: int):
    """The padded size of a prefill chunk of ``length`` tokens, or None when it is run unpadded (too long)."""
    for t in prefill_buckets(max_tokens):
        if length <= t:
            return t
    return None


MIXED_GRAPHS_MAX = 128
"""Most mixed-step graphs captured at run time (each holds a step's ~500 kernel nodes); past it, mixed steps of new
shapes run eagerly."""


MIXED_SPARE_ROWS = 32
"""Logits rows a model that pads mixed steps holds beyond ``max_batch``: a full decode batch still leaves rows for
the chunks' (padded) rows, so such steps keep a graph."""

MIXED_MIN_ROWS = 16
"""Fewest logits rows a mixed step's chunks run as, and the most chunks the engine's scheduler puts in one step
(``Scheduler.max_chunks``): every mixed step's rows are then one size, a shape the warm-up captures.  Sixteen rows
cost a replay what eight do (the LM head streams its weight once for any few rows; H200, 2026-12-03: 8, 16 and 32
rows within 0.3 % of each other from 6 to 37 ms steps, docs/perf/engine.md)."""


def mixed_decode_rows(decodes: int, max_batch: int) -> int:
    """The decode rows a mixed step of ``decodes`` decodes runs with: the next power of two, or from 32 on the next
    of 32 48 64 96 128 192 ... (a power of two or 1.5 times one), at most ``max_batch``; 0 for none.  Coarser than
    the decode graphs' sizes: beside a prompt chunk a padding decode row costs only its share of the projections
    (its attention is skipped), while every distinct size multiplies the shapes a load meets (each one a graph to
    capture, or an eager step of ~500 launches)."""
    if decodes <= 0:
        return 0
    size = 1
    while size < decodes:
        if size < 32:
            size *= 2
        elif size & (size - 1) == 0:    # a power of two: 1.5 times it next
            size = size * 3 // 2
        else:                           # 1.5 times a power of two: the next power of two
            size = size * 4 // 3
    return min(size, max_batch)


def mixed_rows(num_chunks: int) -> int:
    """The logits rows a mixed step's ``num_chunks`` chunks take: the next power of two, at least
    ``MIXED_MIN_ROWS`` (0 for none)."""
    return 0 if num_chunks == 0 else max(MIXED_MIN_ROWS, 1 << (num_chunks - 1).bit_length())


def mixed_shape(padded_decodes: int, chunk_tokens: int, num_chunks: int, max_tokens: int, max_rows: int):
    """(Dp, Cp, Rp): the padded shape a mixed step of ``padded_decodes`` (Dp, already ``mixed_decode_rows``) decode
    rows and ``num_chunks`` chunks of ``chunk_tokens`` tokens in all runs as, or None when it runs unpadded (chunks
    longer than ``PREFILL_GRAPH_MAX``, or more rows than the buffers hold).  Cp is the chunks' prefill bucket within
    the tokens left after the decodes (or all of them: a full step); Rp the chunks' rows (``mixed_rows``) within
    ``max_rows``.  The step's launches depend only on this shape, so it names the step's graph."""
    room = max_tokens - padded_decodes
    if chunk_tokens > min(PREFILL_GRAPH_MAX, room) or num_chunks == 0:
        return None
    Cp = prefill_bucket(chunk_tokens, room) or room
    Rp = min(mixed_rows(num_chunks), max_rows - padded_decodes)
    if Rp < num_chunks:
        return None
    return padded_decodes, Cp, Rp


def mixed_warmup_shapes(max_batch: int, max_tokens: int, max_rows: int) -> list:
    """The mixed shapes captured at warm-up, so that a load of many streams meets no capture (every stream waits
    ~0.2 s while one is taken): every decode-row size a step can pad to (none, and each ``mixed_decode_rows`` size
    up to ``max_batch``) beside the chunks of every prefill bucket, as the one to ``MIXED_MIN_ROWS`` chunks a step
    carries.  The small buckets matter as much as the large ones: a prompt whose prefix is cached runs only its last
    few tokens.  With a token budget of 2048: 90 shapes for ``max_batch`` 64, 130 for 256."""
    sizes = sorted({mixed_decode_rows(d, max_batch) for d in range(max_batch + 1)})
    shapes = []
    for Dp in sizes:
        room = max_tokens - Dp
        for L in prefill_buckets(room) + [room]:
            shape = mixed_shape(Dp, L, 1, max_tokens, max_rows)
            if shape is not None and shape not in shapes:
                shapes.append(shape)
    return shapes


def _check(result):
    from cuda.bindings import driver as drv
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA graph call failed: {err}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


class StepGraphs:
    """Instantiated graphs keyed by (tokens T, logits rows B) for decode steps and prompt chunks, and by tuples
    naming their kind for the others (``("forward", B)``, ``("sample", B)``, ``("mixed", Dp, Cp, Rp)``)."""

    def __init__(self, runner, max_lazy: int = MIXED_GRAPHS_MAX):
        self.runner = runner
        self.execs: dict[tuple, object] = {}
        self._graphs: list = []
        pads = getattr(runner.model, "pads_prefill", False)
        self.prefill_buckets = prefill_buckets(runner.model.max_tokens) if pads else []
        self.mixed_shapes: list[tuple] = []     # captured by capture_all (set by the engine's warm-up)
        self.max_lazy = max_lazy
        self._lazy: set = set()                 # keys captured by replay_or_capture
        self._failed: dict = {}                 # key → captures that failed (two: eager from then on)
        self.eager_steps = 0                    # steps ``replay_or_run`` launched kernel by kernel
        self.capture_seconds = 0.0              # host time ``replay_or_capture`` spent capturing (streams wait)

    def has(self, *key) -> bool:
        return key in self.execs

    def _cu_stream(self):
        from cuda.bindings import driver as drv
        return drv.CUstream(int(self.runner.stream.handle))

    def capture(self, T: int, B: int, decode: bool = False) -> None:
        """Capture a whole step (forward pass, grammar mask, sampler) of T tokens and B logits rows."""
        self.capture_fn((T, B), lambda: self.runner.forward_and_sample(T, B, decode=decode))

    def capture_fn(self, key: tuple, run) -> None:
        """Capture the launches of ``run()`` under ``key`` (also the two halves of a decode step launched ahead
        with grammar masks: ``("forward", B)`` and ``("sample", B)``, captured at their first use)."""
        from cuda.bindings import driver as drv
        from numba import cuda

        s = self._cu_stream()
        with cuda.defer_cleanup(), on_stream(self.runner.stream):
            _check(drv.cuStreamBeginCapture(s, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
            try:
                run()
            finally:
                graph = _check(drv.cuStreamEndCapture(s))
        self._graphs.append(graph)
        self.execs[key] = _check(drv.cuGraphInstantiate(graph, 0))

    def replay_or_capture(self, key: tuple, run) -> bool:
        """Replay ``key``'s graph, capturing it from ``run()`` the first time the key is met; False when the caller
        must run the step eagerly: ``max_lazy`` graphs captured already, or a capture that failed (logged once;
        the key is tried once more at its next step, after an eager run has compiled whatever the shape needed,
        then stays eager).  The warm-up has compiled every kernel variant a step can use, so a capture rarely
        meets a compilation.  The host time of these captures adds up in ``capture_seconds`` (on ``/metrics``):
        every running stream waits while one is taken."""
        if key in self.execs:
            self.replay(*key)
            return True
        if self._failed.get(key, 0) >= 2 or len(self._lazy) >= self.max_lazy:
            return False
        t0 = time.perf_counter()
        captured = self.try_capture(key, run)
        self.capture_seconds += time.perf_counter() - t0
        if not captured:
            return False
        self._lazy.add(key)
        self.replay(*key)
        return True

    def replay_or_run(self, key, run) -> None:
        """Replay (or first capture) ``key``'s graph, or run the step eagerly: when ``key`` is None (a step no graph
        holds) or ``replay_or_capture`` declines.  Eager steps are counted (``eager_steps``, on ``/metrics``): each
        costs the host hundreds of launches."""
        if key is None or not self.replay_or_capture(key, run):
            self.eager_steps += 1
            run()

    def try_capture(self, key: tuple, run, quiet: bool = False) -> bool:
        """``capture_fn``, where a failure is logged once and leaves ``key`` eager instead of raising: a step the
        graph cannot hold must not take the server down.  ``quiet``: a first try that the caller follows with an
        eager run and a second try (nothing logged or counted)."""
        try:
            self.capture_fn(key, run)
        except Exception as e:
            if quiet:
                return False
            self._failed[key] = self._failed.get(key, 0) + 1
            if self._failed[key] == 1:
                log.warning("CUDA graph capture of step %s failed (%s): such steps run eagerly", key, e)
            return False
        return True

    def capture_all(self) -> None:
        for B in self.runner.decode_sizes:
            if not self.has(B, B):
                self.capture(B, B, decode=True)
        for T in self.prefill_buckets:
            if not self.has(T, 1):
                self.capture(T, 1)
        for Dp, Cp, Rp in self.mixed_shapes:
            if not self.has("mixed", Dp, Cp, Rp) and ("mixed", Dp, Cp, Rp) not in self._failed:
                self.runner.warm_mixed(Dp, Cp, Rp)
        self.runner.stream.synchronize()

    def replay(self, *key) -> None:
        from cuda.bindings import driver as drv
        _check(drv.cuGraphLaunch(self.execs[key], self._cu_stream()))
