"""Stop strings over streamed text, with hold-back.

Text arrives in pieces (one token's worth at a time) and a stop string may straddle pieces: with stop ``"END"``
the model can produce ``"E"``, ``"N"``, ``"D"``.  To never send a fragment of a stop string, the matcher holds
back the longest tail of the text that is a prefix of some stop string, and releases it as soon as the next piece
shows it is not one.  On a match, the text before the match is released and everything from the match on is
dropped (the stop string itself is never sent).  When several stop strings occur, the earliest one in the text wins.
"""
from __future__ import annotations

from typing import Iterable, Optional


class StopStringMatcher:
    """``push(text) -> (safe_text, matched)``; after a match every push returns ``("", True)``.  The text ends before
    the stop string, or with it when ``include_stop`` (vLLM's ``include_stop_str_in_output``)."""

    def __init__(self, stops: Iterable[str], include_stop: bool = False):
        self.stops = [s for s in dict.fromkeys(stops) if s]  # drop empty strings and duplicates, keep order
        self.include_stop = include_stop
        self._held = ""
        self.matched: Optional[str] = None  # the stop string that ended the text

    def _held_back_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def push(self, text: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        first, found = len(buf), None
        for stop in self.stops:
            at = buf.find(stop)
            if at != -1 and at < first:
                first, found = at, stop
        if found is not None:
            self.matched = found
            self._held = ""
            return buf[:first + (len(found) if self.include_stop else 0)], True
        hold = self._held_back_length(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """The held-back tail, once the text has ended without completing a stop string."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
