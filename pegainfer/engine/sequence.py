"""One request's life inside the engine: its tokens, its slot and pages, its text stream and stop rules."""
from __future__ import annotations

import enum
import random
import time
from typing import Optional

from pegainfer.engine.types import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, detokenizer, stop_matcher):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.token_ids = list(prompt_ids)    # prompt then output: what the K/V cache holds, in order
        self.params = params
        self.seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.status = Status.WAITING
        self.slot: Optional[int] = None
        self.num_cached = 0                  # tokens whose K/V are in the cache (computed, or shared cached pages)
        self.cached_tokens = 0               # prompt tokens the prefix cache gave at admission (reported in usage)
        self.page_keys: list[bytes] = []     # prefix-cache keys of the full pages of token_ids so far
        self.pages_indexed = 0               # full pages already offered to the prefix cache
        self.snapshot_points: list[int] = []     # hybrid models: token counts after which its state is kept
        self.preemptions = 0
        self.detokenizer = detokenizer
        self.stop_matcher = stop_matcher
        self.finish_reason: Optional[str] = None
        self.arrival = time.perf_counter()
        self.scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.aborted = False
        self.constraint = None               # a text.structured.TokenConstraint when params.grammar is set

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V are not in the cache yet: 1 while decoding (the newest token), more while its prompt
        (or, after a preemption, its prompt and output) is being prefilled."""
        return self.num_tokens - self.num_cached

    def append_token(self, token: int) -> None:
        self.output_ids.append(token)
        self.token_ids.append(token)

    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]
