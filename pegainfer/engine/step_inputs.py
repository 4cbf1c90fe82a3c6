"""The per-step inputs of a forward pass and of its sampler, staged in one pinned host buffer and copied to the
device in one copy.

Layout (one byte buffer): the sampling parameters (``SamplingBuffers``' fields for ``max_rows`` rows) first, then
int32 rows of ``max(max_tokens, max_rows)``: positions, slots (-1 = padding token), which token rows produce
logits (first ``max_rows`` entries), which logits rows a grammar constrains (first ``max_rows``: 1 = apply the
row's bitmask, ``TokenMasks``), and last the token ids.  The ids come last because a decode step launched
ahead already has its ids on the device -- the sampler of the step before writes the ids it draws over that step's
input ids (``ModelRunner.forward_and_sample``) -- so it uploads everything before them, one prefix of the buffer.
The device views stay fixed for the life of the engine, so CUDA graphs captured over them remain valid; only their
contents change between replays.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.kernels.sampling import SamplingBuffers


class StepInputs:
    POSITIONS, SLOTS, LOGIT_ROWS, MASKED, IDS = range(5)

    def __init__(self, max_tokens: int, max_rows: int):
        n = max(max_tokens, max_rows)
        head = SamplingBuffers.nbytes(max_rows)                  # a multiple of 8
        nbytes = head + 4 * 5 * n
        self.host_bytes = np.zeros(nbytes, np.uint8) if SIMULATOR else cuda.pinned_array(nbytes, dtype=np.uint8)
        self.device_bytes = cuda.to_device(np.zeros(nbytes, np.uint8))
        self.sampling = SamplingBuffers(max_rows, storage=(self.host_bytes[:head], self.device_bytes[:head]))
        self.host = self.host_bytes[head:].view(np.int32).reshape(5, n)
        self.device = self.device_bytes[head:].view(np.int32).reshape(5, n)
        self._ids_at = head + 4 * self.IDS * n                   # bytes before the ids row
        # device views read by the model (and ``ids`` written by the sampler)
        self.ids = self.device[self.IDS]
        self.positions = self.device[self.POSITIONS]
        self.token_slots = self.device[self.SLOTS]
        self.logit_rows = self.device[self.LOGIT_ROWS, :max_rows]
        self.masked_rows = self.device[self.MASKED, :max_rows]
        # host views written by the runner
        self.h_ids = self.host[self.IDS]
        self.h_pos = self.host[self.POSITIONS]
        self.h_slots = self.host[self.SLOTS]
        self.h_rows = self.host[self.LOGIT_ROWS, :max_rows]
        self.h_masked = self.host[self.MASKED, :max_rows]

    def upload(self, stream=0, with_ids: bool = True) -> None:
        """One asynchronous host→device copy of every input (a few KB), or of all but the ids (``with_ids=False``:
        a step whose ids the previous step's sampler wrote on the device)."""
        end = self.host_bytes.nbytes if with_ids else self._ids_at
        self.device_bytes[:end].copy_to_device(self.host_bytes[:end], stream=stream)


    def upload_rows(self, which: int, n: int, stream=0) -> None:
        """Copy the first ``n`` entries of one int32 row (``POSITIONS`` ... ``IDS``) to the device."""
        self.device[which, :n].copy_to_device(self.host[which, :n], stream=stream)


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


def wait_event(event) -> None:
    """Block until ``event`` has completed (a never-recorded event counts as complete). cuda-bindings (>= 12.9.1 /
    13.0) releases the GIL for the whole ``cuEventSynchronize``, so the server's event loop in the same process runs
    meanwhile (numba's wrapper would log an ERROR per NOT_READY poll, and polling made the loop wait for the GIL
    through every step). Not called in the simulator, where every copy and launch is synchronous."""
    from cuda.bindings import driver as drv
    (err,) = drv.cuEventSynchronize(event.handle)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuEventSynchronize failed: {err}")
