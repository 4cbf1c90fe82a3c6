"""Plain data passed between the server / CLI and the engine. No GPU state lives here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per request (OpenAI / vLLM meanings)."""

    max_tokens: int = 16
    temperature: float = 1.0      # 0 → greedy
    top_p: float = 1.0            # 1 → off
    top_k: int = 0                # 0 or -1 → off
    min_p: float = 0.0            # 0 → off
    seed: Optional[int] = None    # None → a fresh random seed per request
    stop: list[str] = field(default_factory=list)          # stop strings (never sent to the client)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0           # EOS / stop ids / stop strings are ignored before this many tokens
    logprobs: Optional[int] = None  # None → off; N ≥ 0 → the chosen token's logprob plus the top N
    prompt_logprobs: Optional[int] = None   # None → off; N ≥ 0 → each prompt token's logprob (given the tokens
    #                                         before it) plus the top N, with the request's first output
    grammar: Optional[str] = None   # an llguidance grammar the output must follow (``text/structured.py``)
    grammar_after_think: str = "no"  # "no": from the first token; "yes": after </think>; "if_opened": after
    #                                  </think> if the output opens a <think> block first, else from the first token
    repetition_penalty: float = 1.0   # > 1 discourages tokens of the prompt and the output (1 → off)
    frequency_penalty: float = 0.0    # subtracted once per time a token is in the output (0 → off)
    presence_penalty: float = 0.0     # subtracted once if a token is in the output at all (0 → off)
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id → added to its logit
    skip_special_tokens: bool = True        # False: special tokens (``<|im_start|>``) are written in the text
    include_stop_str_in_output: bool = False   # True: the stop string that ended the text is kept at its end
    priority: int = 0                       # with the priority scheduling policy: lower runs first (vLLM's)
    bad_words: list[str] = field(default_factory=list)   # words the output must not contain (``text/bad_words.py``)

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits (``kernels/penalties.py``)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias))


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the top-N tokens, most likely first
    rank: Optional[int] = None    # 1 + how many tokens are more likely (prompt logprobs)


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str                       # safe to send: whole UTF-8 characters, stop strings held back / removed
    logprobs: Optional[list[TokenLogprob]]  # one per new token when requested
    finished: bool = False
    finish_reason: Optional[str] = None   # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0                # prompt tokens whose K/V came from the prefix cache (not recomputed)
    error: Optional[str] = None           # set with finish_reason "error"
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None   # with the first output when asked for:
    #                                       one per prompt token, None for the first (nothing comes before it)
    scheduled_time: Optional[float] = None  # ``time.perf_counter()`` when its first step was scheduled (the
    #                                       finishing output of a request that ran; for the queue-time metric)
