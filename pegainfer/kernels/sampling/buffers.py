"""What the sampler reads and writes besides the logits: the per-row parameters (``SamplingBuffers``), its workspace,
and where the LM head leaves the greedy token of a one-sequence step (``HeadArgmax``)."""
from __future__ import annotations

import types as _pytypes

import numpy as np

from pegainfer.kernels.launch import current_stream
from pegainfer.kernels.primitives import cuda, math, threads

GREEDY_BELOW = 1e-5                # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
GREEDY_PARTS = threads(gpu=16, sim=3)   # blocks per greedy row in ``sample`` (each takes 1/GREEDY_PARTS of V)


class SamplingBuffers:
    """Per-row sampling parameters as device arrays (read by ``sample`` inside the captured decode graph), with a
    pinned host mirror: ``set_row`` writes the mirror, ``upload`` copies all of it to the device in one copy.

    Device arrays ``[max_batch]``: ``temperature`` f32 (0 = greedy), ``top_k`` i32 (0 = off), ``top_p`` f32
    (1 = off), ``min_p`` f32 (0 = off), ``seed`` uint64, ``step`` i32 (the draw's position, so every step of a
    seeded request gets a fresh but reproducible variate).  The host mirror is ``host.<same name>``.  Rows start
    greedy.  ``storage``: (pinned host bytes, device bytes) of ``nbytes(max_batch)`` each to lay the fields out in
    (the engine's ``StepInputs`` passes a prefix of its own buffer, so one copy uploads a whole step's inputs);
    by default the buffers allocate their own.
    """

    FIELDS = (("temperature", np.float32, 0.0), ("top_k", np.int32, 0), ("top_p", np.float32, 1.0),
              ("min_p", np.float32, 0.0), ("seed", np.uint64, 0), ("step", np.int32, 0))

    @classmethod
    def _layout(cls, max_batch: int) -> tuple[list[int], int]:
        """Byte offset of each field (8-byte aligned slices) and the total."""
        offsets, nbytes = [], 0
        for _, dtype, _ in cls.FIELDS:
            offsets.append(nbytes)
            nbytes += -(-int(max_batch) * np.dtype(dtype).itemsize // 8) * 8
        return offsets, nbytes

    @classmethod
    def nbytes(cls, max_batch: int) -> int:
        """Bytes of the fields for ``max_batch`` rows (the size of ``storage``)."""
        return cls._layout(max_batch)[1]

    def __init__(self, max_batch: int, storage=None):
        self.max_batch = int(max_batch)
        self.host = _pytypes.SimpleNamespace()
        # All fields live in one byte buffer so ``upload`` is a single copy per step.
        offsets, nbytes = self._layout(self.max_batch)
        if storage is None:
            self._host_bytes = cuda.pinned_array(nbytes, dtype=np.uint8)
            self._device_bytes = cuda.to_device(self._host_bytes)
        else:
            self._host_bytes, self._device_bytes = storage
            assert self._host_bytes.nbytes == nbytes == self._device_bytes.nbytes, (nbytes, self._host_bytes.nbytes)
        for (name, dtype, default), off in zip(self.FIELDS, offsets):
            n = self.max_batch * np.dtype(dtype).itemsize
            mirror = self._host_bytes[off:off + n].view(dtype)
            mirror[:] = default
            setattr(self.host, name, mirror)
            setattr(self, name, self._device_bytes[off:off + n].view(dtype))
        self._device_bytes.copy_to_device(self._host_bytes)

    def set_row(self, i: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                seed: int = 0, step: int = 0) -> None:
        """Set row ``i`` of the host mirror.  ``temperature`` below 1e-5 means greedy (as in vLLM), ``top_k <= 0``
        means off (vLLM's -1), any int seed is taken mod 2^64."""
        if not 0 <= i < self.max_batch:
            raise IndexError(f"row {i} outside [0, {self.max_batch})")
        if not (math.isfinite(temperature) and temperature >= 0.0):
            raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        if not 0 <= step < 2**31:
            raise ValueError(f"step must be in [0, 2^31), got {step}")
        h = self.host
        h.temperature[i] = temperature if temperature >= GREEDY_BELOW else 0.0
        h.top_k[i] = min(max(int(top_k), 0), 2**31 - 1)
        h.top_p[i] = top_p
        h.min_p[i] = min_p
        h.seed[i] = int(seed) % 2**64
        h.step[i] = step

    def upload(self, stream=None) -> None:
        """Copy the host mirror to the device arrays (asynchronous on ``stream``, default: the launch stream)."""
        stream = current_stream() if stream is None else stream
        self._device_bytes.copy_to_device(self._host_bytes, stream=stream)


_WORDS_PER_ROW = 3 + 2 * GREEDY_PARTS   # threshold, kept, greedy counter + each part's (max, index)


def sample_workspace_size(max_rows: int, vocab: int = 0) -> int:
    """f32 elements of the ``workspace`` that ``sample`` needs for up to ``max_rows`` rows: per-row statistics
    (``workspace_views``) and the greedy rows' per-part maxima and counters.  Allocate it with
    ``allocate_sample_workspace`` (the counters must start at zero)."""
    return _WORDS_PER_ROW * int(max_rows)


def allocate_sample_workspace(max_rows: int, vocab: int = 0):
    """A zeroed device workspace for ``sample`` (``sample_workspace_size`` elements, at least one)."""
    return cuda.to_device(np.zeros(max(1, sample_workspace_size(max_rows, vocab)), np.float32))


def _workspace_parts(workspace):
    """(threshold ``[R]`` f32, kept ``[R]`` i32, part_max ``[R · P]`` f32, part_index ``[R · P]`` i32, counters
    ``[R]`` i32) views, ``R = size // (3 + 2P)``, ``P = GREEDY_PARTS``."""
    assert workspace.ndim == 1 and workspace.dtype == np.float32, (workspace.shape, workspace.dtype)
    r = workspace.shape[0] // _WORDS_PER_ROW
    rp = r * GREEDY_PARTS
    return (workspace[:r], workspace[r:2 * r].view(np.int32), workspace[2 * r:2 * r + rp],
            workspace[2 * r + rp:2 * r + 2 * rp].view(np.int32),
            workspace[2 * r + 2 * rp:3 * r + 2 * rp].view(np.int32))


def workspace_views(workspace):
    """(threshold ``[R]`` f32, kept ``[R]`` int32) views of a ``sample`` workspace: after ``sample``, row ``r``
    kept exactly the ``kept[r]`` tokens whose logit is ≥ ``threshold[r]`` (greedy rows: the max and 1) — for
    tests, tracing and debugging."""
    return _workspace_parts(workspace)[:2]


MAX_HEAD_BLOCKS = 1024
"""The most blocks an LM head launch may have when it also finds the greedy token (``HeadArgmax``'s pair arrays)."""


class HeadArgmax:
    """Where the LM head of a one-sequence step (``linear.linear_add_rms_norm(head=)``) writes the greedy token of
    its logits row, so that ``sample(head=)`` has nothing left to do for a greedy row: the head's blocks' (max,
    column) pairs with a counter after them (zero at rest), and views of what ``sample`` writes for a greedy row 0
    -- the token (``out_ids[0]``), the workspace's threshold and kept count.  The head's blocks merge the pairs
    with ``sample``'s rules (the first index of the largest logit, NaN never wins), so the token is the same."""

    def __init__(self, out_ids, workspace):
        threshold, kept, *_ = _workspace_parts(workspace)
        self.token, self.threshold, self.kept = out_ids[:1], threshold[:1], kept[:1]
        self.part_max = cuda.to_device(np.zeros(MAX_HEAD_BLOCKS, np.float32))
        self.part_index = cuda.to_device(np.zeros(MAX_HEAD_BLOCKS + 1, np.int32))
