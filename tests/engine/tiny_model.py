"""A tiny stand-in model for engine tests: two small kernels instead of a transformer, but with the real engine
plumbing around it (paged KV cache through the block table, StepInputs, the real sampler, CUDA-graph-safe device
inputs). Each token's "K/V" is its id, written to its page; a row's logits are a hash of every id the sequence has
cached so far (read back through the block table), so the next token depends on the whole history, and a wrong
page, position, slot or input id changes the token stream. Rows are independent of the batch (unlike real bf16
GEMMs, whose rounding may depend on the batch size), so token streams can be compared exactly across schedules."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

import pegainfer  # noqa: F401  (before numba)
from numba import cuda

from pegainfer.kernels.launch import launch
from pegainfer.kernels.policy import DEFAULT_POLICY
from pegainfer.kernels.primitives import f32_to_bf16, grid, threads

HASH_MOD = 1000003


@cuda.jit
def write_cache_kernel(ids, positions, token_slots, block_tables, cache, T, page_size):
    """cache[page(slot, pos) * page_size + pos % page_size] = ids[t] for each token t < T with slot ≥ 0.
    One thread per token, grid-stride."""
    t = cuda.grid(1)
    while t < T:
        slot = token_slots[t]
        if slot >= 0:
            pos = positions[t]
            page = block_tables[slot, pos // page_size]
            cache[page * page_size + pos % page_size] = ids[t]
        t += cuda.gridsize(1)


@cuda.jit
def history_logits_kernel(positions, token_slots, logit_rows, block_tables, cache, logits, B, V, page_size):
    """logits[b, v] (bf16 bits) = a hash of (the ids cached at positions 0..pos of row b's sequence, v), in
    [-4, 4) on a grid of 1/8 (exact in bf16). One thread per row, grid-stride."""
    b = cuda.grid(1)
    while b < B:
        t = logit_rows[b]
        slot = token_slots[t]
        pos = positions[t]
        h = np.int64(17)
        for i in range(pos + 1):
            tok = cache[block_tables[slot, i // page_size] * page_size + i % page_size]
            h = (h * np.int64(31) + np.int64(tok) + np.int64(7)) % np.int64(HASH_MOD)
        for v in range(V):
            k = ((h + np.int64(1)) * np.int64(v * 2 + 1) * np.int64(40503)) % np.int64(64)
            logits[b, v] = f32_to_bf16(np.float32(k) / np.float32(8.0) - np.float32(4.0))
        b += cuda.gridsize(1)


class TinyHistoryModel:
    pads_prefill = False

    def __init__(self, vocab: int, max_tokens: int, max_rows: int):
        self.V, self.max_tokens, self.max_rows = vocab, max_tokens, max_rows
        self.logits = cuda.to_device(np.zeros((max_rows, vocab), np.uint16))
        self.cache = None
        self.page_size = None
        self.policy = DEFAULT_POLICY          # the runner reads it (head_argmax); these kernels never overlap

    def allocate(self, num_pages: int, page_size: int, num_slots: int | None = None) -> None:
        self.page_size = page_size
        self.cache = cuda.to_device(np.full(num_pages * page_size, -1, np.int32))

    def reset_slot(self, slot: int) -> None:
        """No per-slot state besides KV pages."""

    def lm_head_argmax(self, T: int, B: int) -> bool:
        """No LM head here: the sampler always picks (``DecoderModel.lm_head_argmax``)."""
        return False

    def forward(self, step, block_tables, T: int, B: int, decode: bool = False, head=None, num_decode: int = 0,
                mixed: bool = False):
        assert head is None
        launch(write_cache_kernel, grid(T), threads(gpu=128, sim=32), step.ids, step.positions, step.token_slots,
               block_tables, self.cache, T, self.page_size)
        launch(history_logits_kernel, grid(B), threads(gpu=128, sim=32), step.positions, step.token_slots,
               step.logit_rows, block_tables, self.cache, self.logits, B, self.V, self.page_size)
        return self.logits[:B]


@cuda.jit
def recurrent_state_kernel(ids, token_slots, state, T):
    """For each state row (one thread per row, grid-stride): fold the ids of the step's tokens of that slot, in
    order, into ``state[row]`` (the same hash as ``history_logits_kernel``'s), the way a linear-attention layer folds
    its tokens into one state."""
    row = cuda.grid(1)
    while row < state.shape[0]:
        h = state[row]
        for t in range(T):
            if token_slots[t] == row:
                h = (h * np.int64(31) + np.int64(ids[t]) + np.int64(7)) % np.int64(HASH_MOD)
        state[row] = h
        row += cuda.gridsize(1)


@cuda.jit
def state_logits_kernel(positions, token_slots, logit_rows, state, logits, B, V):
    """logits[b, v] = a hash of (the state of row b's slot after its tokens, its position, v), as
    ``history_logits_kernel``'s.  One thread per row, grid-stride."""
    b = cuda.grid(1)
    while b < B:
        t = logit_rows[b]
        h = (state[token_slots[t]] * np.int64(131) + np.int64(positions[t])) % np.int64(HASH_MOD)
        for v in range(V):
            k = ((h + np.int64(1)) * np.int64(v * 2 + 1) * np.int64(40503)) % np.int64(64)
            logits[b, v] = f32_to_bf16(np.float32(k) / np.float32(8.0) - np.float32(4.0))
        b += cuda.gridsize(1)


class TinyRecurrentModel(TinyHistoryModel):
    """A hybrid stand-in: its next token depends only on a per-slot state that every token of the sequence is
    folded into, in order (and on the position), as a Gated DeltaNet layer's: a prefix-cache hit that skips tokens
    without restoring the state after them, a wrong snapshot, or a snapshot taken at another point changes the
    stream.  Its K/V pages are still written (the engine's page bookkeeping runs as for a hybrid model)."""
    has_recurrent_state = True

    def allocate(self, num_pages: int, page_size: int, num_slots: int, num_snapshots: int = 0):
        super().allocate(num_pages, page_size, num_slots)
        self.state = cuda.to_device(np.zeros(num_slots + num_snapshots, np.int64))

    def reset_slot(self, slot: int) -> None:
        self.state[slot:slot + 1].copy_to_device(np.zeros(1, np.int64))

    def copy_state(self, src: int, dst: int) -> None:
        self.state[dst:dst + 1].copy_to_device(self.state[src:src + 1])

    def forward(self, step, block_tables, T: int, B: int, decode: bool = False, head=None, num_decode: int = 0,
                mixed: bool = False):
        assert head is None
        launch(write_cache_kernel, grid(T), threads(gpu=128, sim=32), step.ids, step.positions, step.token_slots,
               block_tables, self.cache, T, self.page_size)
        launch(recurrent_state_kernel, grid(self.state.shape[0]), threads(gpu=128, sim=32), step.ids,
               step.token_slots, self.state, T)
        launch(state_logits_kernel, grid(B), threads(gpu=128, sim=32), step.positions, step.token_slots,
               step.logit_rows, self.state, self.logits, B, self.V)
        return self.logits[:B]


def tiny_engine(async_scheduling: bool, max_batch: int = 3, max_model_len: int = 64, vocab: int = 96,
                num_pages: int | None = None, eos_token_ids=(5,), max_num_batched_tokens: int = 32,
                prefix_caching: bool = False, state_snapshots: int = 0, scheduling_policy: str = "fcfs"):
    """A real ``Engine`` (scheduler, page pool, runner, sampler, detokenizer and stop rules) over the tiny model,
    with the demo model's tokenizer; with ``state_snapshots``, over ``TinyRecurrentModel`` (a hybrid stand-in) with
    that many state snapshots for the prefix cache (an off cache still runs the recurrent model)."""
    from pegainfer.demo import ensure_demo_model
    from pegainfer.engine.engine import PAGE_SIZE, Engine
    from pegainfer.text.chat import ChatTemplate
    from pegainfer.text.tokenizer import Tokenizer

    folder = Path(ensure_demo_model())
    Model = TinyRecurrentModel if state_snapshots else TinyHistoryModel
    model = Model(vocab, max_tokens=max(max_num_batched_tokens, max_batch), max_rows=max(max_batch, 4))
    pages = num_pages if num_pages is not None else max_batch * -(-max_model_len // PAGE_SIZE)
    model.allocate(pages, PAGE_SIZE, **({"num_slots": max_batch, "num_snapshots": state_snapshots}
                                        if state_snapshots else {}))
    cfg = SimpleNamespace(raw={}, eos_token_ids=list(eos_token_ids), max_position_embeddings=max_model_len)
    gen = SimpleNamespace(eos_token_ids=list(eos_token_ids))
    return Engine(folder, model, cfg, gen, Tokenizer.from_folder(folder), ChatTemplate.from_folder(folder),
                  max_model_len, max_batch, max(max_num_batched_tokens, max_batch), pages, use_cuda_graph=False,
                  async_scheduling=async_scheduling, prefix_caching=prefix_caching,
                  state_snapshots=state_snapshots if prefix_caching else 0, scheduling_policy=scheduling_policy)
