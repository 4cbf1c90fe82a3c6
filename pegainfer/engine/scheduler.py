"""Which tokens of which sequences run in the next step (vLLM's v1 policy: one token budget, mixed steps).

Every sequence has ``num_tokens`` tokens (prompt, then output) of which ``num_cached`` have their K/V in the cache;
a step computes the next ``num_uncomputed`` or fewer of them, and when a sequence's computed tokens reach its end
the step samples its next token.  A decoding sequence has one uncomputed token (the one sampled last); a
prefilling one has the rest of its prompt (and after a preemption its output too).

Each step, under a budget of ``max_num_batched_tokens`` tokens:

1. **every decoding sequence** gets its one token (decodes are never skipped for a prompt).  A sequence that needs
   a new page when none is left preempts the newest running sequence (possibly itself): its slot and pages are
   freed, it goes back to the front of the waiting queue, and it is recomputed (prompt and output so far, as one
   prefill) when it comes back -- the tokens it produces are the ones it would have produced;
2. **prefilling sequences** get chunks of what budget is left, oldest first;
3. **waiting sequences** are admitted while a slot, budget and pages for their first chunk are free (plus a small
   reserve of pages so running sequences can grow); with prefix caching their first pages may come from the
   cache (``kv_cache.PagePool.match_prefix``) and are not computed again.

A hybrid model (Qwen3.5) reuses cached pages only up to a boundary where a copy of its recurrent state was kept
(``kv_cache.StateSnapshots``), and keeps new copies at two boundaries of each sequence: where the cached pages it
found end, when no copy is kept there (a prefix other prompts share: its prefill's chunk ends there, so that the
state there exists between two steps), and at the first page boundary its tokens reach, at the end of its prefill
or a few decode steps later (what a follow-up request, e.g. the next turn of a chat, starts with).  The engine
copies a slot's state after the step that reached such a boundary (``snapshot_copies``; a decode step reaching
one is not launched ahead of the one before it), and a snapshot into an admitted sequence's slot before its
first step (``restores``).

A step carries at most ``max_chunks`` prompt chunks (the engine's: ``cuda_graph.MIXED_MIN_ROWS``, the chunk rows
every mixed-step graph holds): a burst of short or mostly cached prompts then spreads over a few steps of shapes
captured at warm-up instead of one step of a shape that would be captured while every stream waits.

A step's flat token batch puts the decode tokens first, then each chunk's tokens in order (``ScheduledStep``).

With ``priority`` (vLLM's priority scheduling policy) the waiting queue is ordered by (``SamplingParams.priority``,
arrival) instead of arrival alone -- lower values first, a preempted sequence back in its place -- and pages run
out by preempting the running sequence of the highest value (the newest of those).
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pegainfer.engine.kv_cache import PagePool, StateSnapshots
from pegainfer.engine.sequence import Sequence, Status


@dataclass
class ScheduledStep:
    decodes: list[Sequence] = field(default_factory=list)     # one token each: their newest
    chunks: list[tuple[Sequence, int, int]] = field(default_factory=list)   # (sequence, first token, length)

    @property
    def kind(self) -> str:
        """"decode" (decodes only), "prefill" (one chunk, nothing else) or "mixed"."""
        if not self.chunks:
            return "decode"
        return "prefill" if not self.decodes and len(self.chunks) == 1 else "mixed"

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, _, n in self.chunks)


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int, max_num_batched_tokens: int,
                 reserve_pages: int | None = None, max_chunks: int | None = None,
                 snapshots: StateSnapshots | None = None, priority: bool = False):
        self.pool = pool
        self.priority = priority         # order by (params.priority, arrival), not arrival alone (module docstring)
        self.snapshots = snapshots       # a hybrid model's state snapshots (prefix caching on), else None
        self.restores: list[tuple[int, int]] = []          # (row, slot) to copy before the step being scheduled
        self.snapshot_copies: list[tuple[int, int]] = []   # (slot, row) to copy after it
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_chunks = max_chunks or max_batch        # prompt chunks in one step (module docstring)
        # pages left free at admission so running sequences can grow before anyone is preempted (vLLM: 1 %); none
        # when the pool holds every slot's sequence at full length (nobody can be short of pages)
        if reserve_pages is None:
            roomy = pool.num_pages >= max_batch * pool.max_pages_per_seq
            reserve_pages = 0 if roomy else max(1, pool.num_pages // 100)
        self.reserve_pages = reserve_pages
        self.hold_admissions = False
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # in order of admission: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if self.priority:
            self._insert_waiting(seq)
        else:
            self.waiting.append(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        """Into the waiting queue at its place by (priority, arrival)."""
        at = bisect.bisect_right(self.waiting, (seq.params.priority, seq.arrival),
                                 key=lambda s: (s.params.priority, s.arrival))
        self.waiting.insert(at, seq)

    def _victim(self) -> Sequence:
        """The running sequence a short pool preempts: the newest, or with ``priority`` the newest of the highest
        priority value."""
        if not self.priority:
            return self.running[-1]
        return self.running[max(range(len(self.running)), key=lambda i: (self.running[i].params.priority, i))]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledStep | None:
        step = ScheduledStep()
        budget = self.max_num_batched_tokens
        # 1. every decoding sequence, preempting the newest running sequences when pages run out
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_uncomputed != 1:
                continue
            while not self.pool.ensure_capacity(seq.slot, seq.num_tokens):
                victim = self._victim()
                self.preempt(victim)
                if victim is seq:
                    break
                if victim in step.decodes:
                    step.decodes.remove(victim)
            if seq.status is Status.RUNNING:
                step.decodes.append(seq)
        budget -= len(step.decodes)
        # 2. and 3. chunks of the sequences being prefilled, then of admitted waiting sequences
        self._chunks_into(step, budget)
        if not step.decodes and not step.chunks:
            return None
        return step

    def chunks_beside(self, num_decodes: int) -> list[tuple[Sequence, int, int]]:
        """Steps 2 and 3 of ``schedule`` alone, for a step of ``num_decodes`` decodes the engine plans itself
        (launched ahead of the step before's read): the next chunks of the sequences being prefilled, then waiting
        sequences admitted, in what budget the decodes leave."""
        step = ScheduledStep()
        self._chunks_into(step, self.max_num_batched_tokens - num_decodes)
        return step.chunks

    def prefilling(self) -> list[Sequence]:
        """The running sequences with more than one token to compute (a prompt, or a preempted sequence's prompt and
        output, in chunks)."""
        return [seq for seq in self.running if seq.num_uncomputed > 1]

    def _chunks_into(self, step: ScheduledStep, budget: int) -> None:
        for seq in self.running:
            if budget <= 0 or len(step.chunks) >= self.max_chunks:
                break
            if seq.num_uncomputed > 1:
                budget -= self._add_chunk(step, seq, budget)
        while budget > 0 and len(step.chunks) < self.max_chunks and self.can_admit_waiting():
            seq = self.waiting.popleft()
            self._admit(seq)
            budget -= self._add_chunk(step, seq, budget)

    def _add_chunk(self, step: ScheduledStep, seq: Sequence, budget: int) -> int:
        """Schedule the next chunk of ``seq`` (at most ``budget`` tokens, as many as pages allow); returns its
        length (0: no page for even one token)."""
        start = seq.num_cached
        length = min(seq.num_uncomputed, budget)
        if seq.snapshot_points:                          # end at the next boundary whose state is kept
            length = min(length, seq.snapshot_points[0] - start)
        while length > 0 and not self.pool.ensure_capacity(seq.slot, start + length):
            # as many tokens as the pages it has plus every available page hold
            room = (self.pool.pages_held(seq.slot) + self.pool.pages_available) * self.pool.page_size - start
            length = min(length - 1, room)
        if length > 0:
            step.chunks.append((seq, start, length))
        return max(length, 0)

    def can_admit_waiting(self) -> bool:
        """Whether a step could admit the first waiting sequence now: a slot is free and pages for its first chunk
        (beyond the reserve) are available, and admissions are not held (``hold_admissions``: the engine frees room
        for a request it prefills itself)."""
        if self.hold_admissions or not self.waiting or len(self.running) >= self.max_batch:
            return False
        if not self.pool.has_free_slot:
            return False
        seq = self.waiting[0]
        first = min(seq.num_tokens, self.max_num_batched_tokens)
        return self.pool.pages_needed(first) + self.reserve_pages <= self.pool.pages_available

    def _admit(self, seq: Sequence) -> None:
        seq.slot = self.pool.acquire_slot()
        seq.num_cached = 0
        if self.pool.prefix_caching:
            pages = self.pool.match_prefix(seq.token_ids, seq.page_keys)
            if self.snapshots is not None:
                pages = self._with_state(seq, pages)
            self.pool.attach(seq.slot, pages)
            seq.num_cached = len(pages) * self.pool.page_size
            seq.pages_indexed = len(pages)
            if not seq.output_ids and seq.preemptions == 0:
                seq.cached_tokens = seq.num_cached
        seq.status = Status.RUNNING
        self.running.append(seq)

    def admit_without_cache(self, seq: Sequence) -> None:
        """Take ``seq`` (not in the waiting queue) into the running batch with a slot and no cached pages: its
        whole prompt is computed (a request for its prompt's logprobs, which the engine prefills itself)."""
        seq.slot = self.pool.acquire_slot()
        seq.num_cached = 0
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _with_state(self, seq: Sequence, pages: list[int]) -> list[int]:
        """A hybrid model's share of the cached ``pages``: up to the longest boundary with a state snapshot (which
        ``seq``'s slot then gets before the step: ``restores``); and the boundaries where ``seq``'s state is to be
        kept (module docstring)."""
        ps = self.pool.page_size
        used, row = self.snapshots.longest(seq.page_keys, len(pages))
        if row is not None:
            self.restores.append((row, seq.slot))
        first_boundary = -(-seq.num_tokens // ps) * ps    # the first page boundary its tokens reach (decoding)
        seq.snapshot_points = ([len(pages) * ps] if len(pages) > used else []) + [first_boundary]
        return pages[:used]

    def take_restores(self) -> list[tuple[int, int]]:
        """The (snapshot row, slot) state copies of the sequences the last ``schedule`` admitted, to be made before
        its step (before any later copy can reuse the row); cleared."""
        copies, self.restores = self.restores, []
        return copies

    def take_snapshot_copies(self) -> list[tuple[int, int]]:
        """The (slot, row) state copies the last scheduled step's sequences are due (``computed``), to be made after
        that step; cleared."""
        copies, self.snapshot_copies = self.snapshot_copies, []
        return copies

    # ------------------------------------------------------------------------------------------------ preemption
    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's slot and pages and queue it first among the waiting: it is recomputed when it
        comes back (its full pages stay in the prefix cache meanwhile, when that is on)."""
        self.running.remove(seq)
        self.pool.release(seq.slot)
        seq.slot = None
        seq.num_cached = 0
        seq.pages_indexed = 0
        seq.snapshot_points = []
        seq.preemptions += 1
        seq.status = Status.WAITING
        if self.priority:
            self._insert_waiting(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def computed(self, seq: Sequence, num_cached: int) -> None:
        """A step computed ``seq``'s tokens up to ``num_cached``: offer its newly full pages to the prefix cache."""
        seq.num_cached = num_cached
        if self.pool.prefix_caching and seq.slot is not None:
            seq.pages_indexed = self.pool.cache_full_pages(seq.slot, seq.token_ids, num_cached, seq.page_keys,
                                                           seq.pages_indexed)
        while seq.snapshot_points and seq.snapshot_points[0] <= num_cached:   # boundaries reached (or passed)
            if seq.snapshot_points.pop(0) == num_cached and seq.slot is not None:
                row = self.snapshots.store(seq.page_keys[num_cached // self.pool.page_size - 1])
                if row is not None:
                    self.snapshot_copies.append((seq.slot, row))

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and return its slot and pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.pool.release(seq.slot)
            seq.slot = None
        seq.snapshot_points = []
        seq.status = Status.FINISHED
