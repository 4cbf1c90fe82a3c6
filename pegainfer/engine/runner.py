"""Model runner: turns a scheduled step into device inputs, runs the forward pass and the sampler, and brings the
sampled token ids back to the host.

Decode steps of a given batch size can be captured once into a CUDA graph and replayed (``CudaGraphs``); the
per-step values (token ids, positions, slots, sampling parameters) live in device buffers that are refreshed
before each replay, so the graph itself never changes.
"""
from __future__ import annotations

import time

import numpy as np
from numba import cuda

from pegainfer.device import SIMULATOR
from pegainfer.engine.cuda_graph import prefill_bucket
from pegainfer.kernels import sampling
from pegainfer.kernels.launch import on_stream
from pegainfer.engine.step_inputs import StepInputs


class ModelRunner:
    def __init__(self, model, pool, max_batch: int, use_cuda_graph: bool = True):
        self.model = model
        self.pool = pool
        self.max_batch = max_batch
        self.stream = cuda.stream() if not SIMULATOR else 0
        T, R = model.max_tokens, model.max_rows
        self.step = StepInputs(T, R)
        self.h_ids, self.h_pos, self.h_slots, self.h_rows = (self.step.h_ids, self.step.h_pos, self.step.h_slots,
                                                             self.step.h_rows)
        self.sampling = sampling.SamplingBuffers(R)
        self.out_ids = cuda.to_device(np.zeros(R, dtype=np.int32))
        self.h_out = _pinned(R)
        self.done = cuda.event(timing=False) if not SIMULATOR else None
        self.sample_workspace = cuda.device_array(max(1, sampling.sample_workspace_size(R, model.V)), np.float32)
        self.graphs = None
        if use_cuda_graph and not SIMULATOR:
            from pegainfer.engine.cuda_graph import StepGraphs
            self.graphs = StepGraphs(self)

    # -------------------------------------------------------------------------------------------- inputs
    def _upload(self) -> None:
        s = self.stream
        self.pool.sync(s)
        self.step.upload(s)
        self.sampling.upload(s)

    def _set_sampling(self, row: int, seq) -> None:
        p = seq.params
        self.sampling.set_row(row, p.temperature, p.top_k, p.top_p, p.min_p, seq.seed, len(seq.output_ids))

    def forward_and_sample(self, T: int, B: int):
        """Run the model on the uploaded step and sample B tokens (device); returns the logits view."""
        logits = self.model.forward(self.step, self.pool.block_tables, T, B)
        sampling.sample(logits, self.sampling, self.out_ids[:B], self.sample_workspace)
        return logits

    def _finish(self, B: int) -> np.ndarray:
        """Copy the B sampled ids to pinned host memory and wait for them. The wait polls an event and yields the
        GIL between polls: a blocking synchronize would hold the GIL for the whole step, starving the server's
        event loop (in the same process) so streamed chunks would only go out when the engine idles."""
        self.out_ids[:B].copy_to_host(self.h_out[:B], stream=self.stream)
        if not SIMULATOR:
            self.done.record(self.stream)
            while not _event_done(self.done):
                time.sleep(0)
        return np.array(self.h_out[:B])

    # -------------------------------------------------------------------------------------------- steps
    def prefill(self, seq, start: int, length: int, want_logits: bool = False, force_eager: bool = False):
        """Run prompt tokens [start, start+length) of one sequence. Returns the sampled next token when this chunk
        ends the prompt (else None), and the logits rows if ``want_logits`` (all rows of the chunk).

        Without ``want_logits`` a chunk of at most PREFILL_GRAPH_MAX tokens is padded to its bucket (padding tokens
        have slot -1: no K/V written, output ignored) and replayed from the bucket's CUDA graph when captured."""
        T = length
        ids = seq.prompt_ids[start:start + length]
        self.h_ids[:T] = ids
        self.h_pos[:T] = np.arange(start, start + length, dtype=np.int32)
        self.h_slots[:T] = seq.slot
        bucket = None
        if want_logits:
            assert T <= self.model.max_rows, "want_logits prefill needs max_rows >= chunk length"
            B = T
            self.h_rows[:B] = np.arange(T, dtype=np.int32)
            for r in range(B):
                self._set_sampling(r, seq)
        else:
            B = 1
            self.h_rows[0] = T - 1
            self._set_sampling(0, seq)
            # Pad to a fixed bucket whether or not graphs are on, so both paths run the very same kernels.
            pads = getattr(self.model, "pads_prefill", False)   # model kernels skip tokens whose slot is -1
            bucket = prefill_bucket(T, self.model.max_tokens) if pads and not SIMULATOR else None
            if bucket is not None:
                self.h_ids[T:bucket] = 0
                self.h_pos[T:bucket] = 0
                self.h_slots[T:bucket] = -1
        with on_stream(self.stream):
            if bucket is not None:
                self._upload()
                if self.graphs is not None and not force_eager and self.graphs.has(bucket, B):
                    self.graphs.replay(bucket, B)
                    logits = self.model.logits[:B]
                else:
                    logits = self.forward_and_sample(bucket, B)
            else:
                self._upload()
                logits = self.forward_and_sample(T, B)
        out = self._finish(B)
        seq.num_cached = start + length
        last = seq.num_cached >= len(seq.prompt_ids)
        token = int(out[B - 1]) if last else None
        return token, (logits if want_logits else None)

    def decode(self, seqs, force_eager: bool = False):
        """One token for each sequence in ``seqs`` (their last token goes in; the sampled next token comes out)."""
        B = len(seqs)
        for r, seq in enumerate(seqs):
            self.h_ids[r] = seq.last_token()
            self.h_pos[r] = seq.num_tokens - 1
            self.h_slots[r] = seq.slot
            self.h_rows[r] = r
            self._set_sampling(r, seq)
        with on_stream(self.stream):
            self._upload()
            if self.graphs is not None and not force_eager and self.graphs.has(B, B):
                self.graphs.replay(B, B)
            else:
                self.forward_and_sample(B, B)
        out = self._finish(B)
        for seq in seqs:
            seq.num_cached = seq.num_tokens
        return [int(x) for x in out]

    def logits_host(self, B: int) -> np.ndarray:
        """The last step's logits rows as float32 on the host (for logprobs and tests)."""
        from pegainfer.kernels.primitives import from_bf16_bits
        return from_bf16_bits(self.model.logits[:B].copy_to_host())


def _event_done(event) -> bool:
    """cuEventQuery without numba's wrapper (which logs an ERROR line for every not-yet-ready poll)."""
    from cuda.bindings import driver as drv
    (err,) = drv.cuEventQuery(event.handle)
    if err == drv.CUresult.CUDA_SUCCESS:
        return True
    if err == drv.CUresult.CUDA_ERROR_NOT_READY:
        return False
    raise RuntimeError(f"cuEventQuery failed: {err}")


def _pinned(n: int) -> np.ndarray:
    if SIMULATOR:
        return np.zeros(n, dtype=np.int32)
    return cuda.pinned_array(n, dtype=np.int32)
