"""Helpers for the parsers that split a model's streamed text at tags (``reasoning.py``, ``tool_calls.py``).

Text arrives a token's worth at a time, so a tag can straddle two pieces (``"</thi"`` + ``"nk>"``).  A parser keeps
back the tail of what it has that could still become a tag (``partial_tail``) and decides once the next piece shows.
Tags inside Markdown code fences (between two ```` ``` ```` lines) are text the model is quoting, not markup: the
parsers find the next tag *outside* a fence with ``find_outside_fences``, carrying whether a fence is open across
pieces.
"""
from __future__ import annotations

from typing import Iterable

CODE_FENCE = "```"


def partial_tail(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers`` (0: none)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_outside_fences(text: str, tag: str, start: int, in_fence: bool) -> tuple[int, int, bool]:
    """Scan ``text`` from ``start`` for ``tag`` outside code fences, a fence being open at ``start`` if
    ``in_fence``.  Returns ``(at, scanned_to, in_fence)``: ``at`` the tag's index (-1 when not found); everything
    before ``scanned_to`` is settled (a tail that may be the start of the tag or of a fence is not), and
    ``in_fence`` is the fence state at ``scanned_to``."""
    i = start
    while True:
        fence = text.find(CODE_FENCE, i)
        if in_fence:
            if fence == -1:
                return -1, len(text) - partial_tail(text[i:], (CODE_FENCE,)), True
            i, in_fence = fence + len(CODE_FENCE), False
            continue
        at = text.find(tag, i)
        if at != -1 and (fence == -1 or at < fence):
            return at, at, False
        if fence == -1:
            return -1, len(text) - partial_tail(text[i:], (tag, CODE_FENCE)), False
        i, in_fence = fence + len(CODE_FENCE), True
