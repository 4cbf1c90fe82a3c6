"""When a request stops, and what text a new token releases: the one place for the stop rules."""
from __future__ import annotations

from typing import Optional

from pegainfer.engine.types import SamplingParams


def text_and_finish_reason(token: int, params: SamplingParams, n_out: int, n_tokens: int, max_model_len: int,
                           eos_token_ids, detokenizer, stop_matcher) -> tuple[str, Optional[str]]:
    """Feed the request's ``n_out``-th generated ``token`` (``n_tokens`` = prompt + output so far) through its
    detokenizer and stop-string matcher; return (text safe to send, finish reason or None).

    EOS / stop token ids end the request ("stop", not before ``min_tokens``; their own text is never sent);
    ``max_tokens`` or a full context end it with "length"; a matched stop string ends it with "stop" and is cut
    from the text; text that might start a stop string is held back until the request ends."""
    p = params
    is_stop_token = n_out >= p.min_tokens and (
        (not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids)
    text = detokenizer.flush() if is_stop_token else detokenizer.push(token)
    reason = "stop" if is_stop_token else None
    if reason is None and (n_out >= p.max_tokens or n_tokens >= max_model_len):
        reason = "length"
        text += detokenizer.flush()
    if stop_matcher is not None:
        text, matched = stop_matcher.push(text)
        if matched:
            reason = "stop"
        elif reason is not None:
            text += stop_matcher.flush()
    return text, reason
