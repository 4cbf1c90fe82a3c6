"""Which sequences run in the next step.

Policy (nano-vllm's): a waiting sequence is admitted when a slot and pages for its prompt are free; admitted
sequences prefill first, in chunks of at most ``max_prefill_tokens`` (one sequence per prefill step), then all
running sequences decode together, one token each, in one batched step of up to ``max_batch`` sequences.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pegainfer.engine.kv_cache import PagePool
from pegainfer.engine.sequence import Sequence, Status


@dataclass
class ScheduledStep:
    kind: str                    # "prefill" | "decode"
    seqs: list[Sequence]
    start: int = 0               # prefill: first prompt position of this chunk
    length: int = 0              # prefill: tokens in this chunk


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int, max_prefill_tokens: int):
        self.pool = pool
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        # 1. finish prefilling an admitted sequence
        for seq in self.running:
            if not seq.prefill_done:
                return self._prefill_chunk(seq)
        # 2. admit a waiting sequence if it fits
        if self.can_admit_waiting():
            seq = self.waiting.popleft()
            seq.slot = self.pool.acquire_slot()
            self.pool.ensure_capacity(seq.slot, len(seq.prompt_ids) + 1)
            seq.status = Status.RUNNING
            self.running.append(seq)
            return self._prefill_chunk(seq)
        # 3. decode every running sequence (pages for the next token are reserved here)
        batch = []
        for seq in self.running[: self.max_batch]:
            if self.pool.ensure_capacity(seq.slot, seq.num_tokens + 1):
                batch.append(seq)
        if batch:
            return ScheduledStep("decode", batch)
        return None

    def can_admit_waiting(self) -> bool:
        """Whether the next ``schedule`` would admit (and prefill) the first waiting sequence."""
        return bool(self.waiting) and len(self.running) < self.max_batch and \
            self.pool.can_admit(len(self.waiting[0].prompt_ids) + 1)

    def _prefill_chunk(self, seq: Sequence) -> ScheduledStep:
        start = seq.num_cached
        length = min(len(seq.prompt_ids) - start, self.max_prefill_tokens)
        return ScheduledStep("prefill", [seq], start, length)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and return its slot and pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.pool.release(seq.slot)
            seq.slot = None
        seq.status = Status.FINISHED
