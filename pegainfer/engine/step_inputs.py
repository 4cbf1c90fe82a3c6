"""The per-step inputs of a forward pass and of its sampler, staged in one pinned host buffer and copied to the
device in one copy.

Layout (one byte buffer): first the grammar flags (int32 per logits row, first ``max_rows``: 1 = apply the row's
bitmask, ``TokenMasks``), then the sampling parameters (``SamplingBuffers``' fields for ``max_rows`` rows), then
int32 rows of ``max(max_tokens, max_rows)``: positions, slots (-1 = padding token), which token rows produce
logits (first ``max_rows`` entries), and last the token ids.  The ids come last because a decode step launched
ahead already has its ids on the device -- the sampler of the step before writes the ids it draws over that step's
input ids (``ModelRunner.forward_and_sample``) -- so it uploads everything before them, one prefix of the buffer.
The flags come first because a decode step with grammar-constrained rows is launched ahead in two parts: its
forward pass uploads everything but the flags and the ids (one middle range), and its sampler, launched later, the
flags alone (``upload_flags``); so the host may fill the next step's inputs while the sampler's flags are still
waiting to be copied, and the reverse.
The device views stay fixed for the life of the engine, so CUDA graphs captured over them remain valid; only their
contents change between replays.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.sampling import SamplingBuffers


class StepInputs:
    POSITIONS, SLOTS, LOGIT_ROWS, IDS = range(4)

    def __init__(self, max_tokens: int, max_rows: int):
        n = max(max_tokens, max_rows)
        flags = 8 * ((4 * max_rows + 7) // 8)                    # the grammar flags, padded to 8 bytes
        head = flags + SamplingBuffers.nbytes(max_rows)          # a multiple of 8
        nbytes = head + 4 * 4 * n
        self.host_bytes = np.zeros(nbytes, np.uint8) if SIMULATOR else cuda.pinned_array(nbytes, dtype=np.uint8)
        self.device_bytes = cuda.to_device(np.zeros(nbytes, np.uint8))
        self.sampling = SamplingBuffers(max_rows, storage=(self.host_bytes[flags:head], self.device_bytes[flags:head]))
        self.host = self.host_bytes[head:].view(np.int32).reshape(4, n)
        self.device = self.device_bytes[head:].view(np.int32).reshape(4, n)
        self._flags_end = flags                                  # bytes of the flags
        self._ids_at = head + 4 * self.IDS * n                   # bytes before the ids row
        # device views read by the model (and ``ids`` written by the sampler)
        self.ids = self.device[self.IDS]
        self.positions = self.device[self.POSITIONS]
        self.token_slots = self.device[self.SLOTS]
        self.logit_rows = self.device[self.LOGIT_ROWS, :max_rows]
        self.masked_rows = self.device_bytes[:flags].view(np.int32)[:max_rows]
        # host views written by the runner
        self.h_ids = self.host[self.IDS]
        self.h_pos = self.host[self.POSITIONS]
        self.h_slots = self.host[self.SLOTS]
        self.h_rows = self.host[self.LOGIT_ROWS, :max_rows]
        self.h_masked = self.host_bytes[:flags].view(np.int32)[:max_rows]

    def upload(self, stream=0, with_ids: bool = True, with_flags: bool = True) -> None:
        """One asynchronous host→device copy of every input (a few KB); without the ids (``with_ids=False``: a
        step whose ids the previous step's sampler wrote on the device), without the grammar flags
        (``with_flags=False``: a forward pass whose sampler uploads them later, ``upload_flags``)."""
        start = 0 if with_flags else self._flags_end
        end = self.host_bytes.nbytes if with_ids else self._ids_at
        self.device_bytes[start:end].copy_to_device(self.host_bytes[start:end], stream=stream)

    def upload_flags(self, n: int, stream=0) -> None:
        """Copy the grammar flags of the first ``n`` logits rows to the device."""
        self.masked_rows[:n].copy_to_device(self.h_masked[:n], stream=stream)


class TokenMasks:
    """The grammar bitmasks of a step's logits rows (``kernels/token_mask.py``): a pinned host mirror ``[max_rows,
    words]`` int32 the engine fills for the constrained rows, and the device array the mask kernel reads (fixed for
    the life of the engine, so captured graphs read it).  Which rows apply theirs is ``StepInputs.masked_rows``."""

    def __init__(self, max_rows: int, vocab: int):
        from pegainfer.kernels.token_mask import allocate_bitmask, mask_words
        shape = (int(max_rows), mask_words(vocab))
        self.host = np.zeros(shape, np.int32) if SIMULATOR else cuda.pinned_array(shape, dtype=np.int32)
        self.device = allocate_bitmask(max_rows, vocab)

    def upload(self, rows: int, stream=0) -> None:
        """Copy the first ``rows`` rows to the device (asynchronous on ``stream``)."""
        self.device[:rows].copy_to_device(self.host[:rows], stream=stream)


class UploadFence:
    """An event recorded after an asynchronous upload from a pinned host mirror, and whether one is outstanding:
    ``wait`` blocks until that upload has executed, so the mirror may be rewritten (a no-op in the simulator,
    where every copy is synchronous)."""

    def __init__(self):
        self.event = cuda.event(timing=False) if not SIMULATOR else None
        self.pending = False

    def record(self, stream) -> None:
        if self.event is not None:
            self.event.record(stream)
            self.pending = True

    def wait(self) -> None:
        if self.pending:
            wait_event(self.event)
            self.pending = False


def wait_event(event) -> None:
    """Block until ``event`` has completed (a never-recorded event counts as complete). cuda-bindings (>= 12.9.1 /
    13.0) releases the GIL for the whole ``cuEventSynchronize``, so the server's event loop in the same process runs
    meanwhile (numba's wrapper would log an ERROR per NOT_READY poll, and polling made the loop wait for the GIL
    through every step). Not called in the simulator, where every copy and launch is synchronous."""
    from cuda.bindings import driver as drv
    (err,) = drv.cuEventSynchronize(event.handle)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuEventSynchronize failed: {err}")
