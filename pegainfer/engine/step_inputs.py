"""The per-step inputs of a forward pass, staged in one pinned host array and copied to the device in one copy.

Rows of ``[4, max_tokens]`` int32: token ids, positions, slots (-1 = padding token), and — in the first
``max_rows`` entries of the last row — which token rows produce logits. The device views stay fixed for the life
of the engine, so CUDA graphs captured over them remain valid; only their contents change between replays.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR


class StepInputs:
    IDS, POSITIONS, SLOTS, LOGIT_ROWS = range(4)

    def __init__(self, max_tokens: int, max_rows: int):
        shape = (4, max(max_tokens, max_rows))
        self.host = np.zeros(shape, np.int32) if SIMULATOR else cuda.pinned_array(shape, dtype=np.int32)
        self.device = cuda.to_device(np.zeros(shape, np.int32))
        # device views read by the model
        self.ids = self.device[self.IDS]
        self.positions = self.device[self.POSITIONS]
        self.token_slots = self.device[self.SLOTS]
        self.logit_rows = self.device[self.LOGIT_ROWS, :max_rows]
        # host views written by the runner
        self.h_ids = self.host[self.IDS]
        self.h_pos = self.host[self.POSITIONS]
        self.h_slots = self.host[self.SLOTS]
        self.h_rows = self.host[self.LOGIT_ROWS, :max_rows]

    def upload(self, stream=0) -> None:
        """One asynchronous host→device copy of every input (a few KB)."""
        self.device.copy_to_device(self.host, stream=stream)


def wait_event(event) -> None:
    """Block until ``event`` has completed (a never-recorded event counts as complete). cuda-bindings (>= 12.9.1 /
    13.0) releases the GIL for the whole ``cuEventSynchronize``, so the server's event loop in the same process runs
    meanwhile (numba's wrapper would log an ERROR per NOT_READY poll, and polling made the loop wait for the GIL
    through every step). Not called in the simulator, where every copy and launch is synchronous."""
    from cuda.bindings import driver as drv
    (err,) = drv.cuEventSynchronize(event.handle)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuEventSynchronize failed: {err}")
