"""Reasoning content: the model's thinking, split from its answer as the text streams in.

Qwen3 and Qwen3.5 think first, between tags, then answer::

    <think>
    The user wants a color. Blue is common.
    </think>

    Blue.

The ``qwen3`` parser sends the text between the tags to ``reasoning_content`` (vLLM's field) and the rest to
``content``, dropping the tags and the newlines next to them (the chat template writes them back when the answer
returns as history).  Where the output starts depends on the prompt (``reasoning_start``):

* the prompt closed a think block (``enable_thinking: false`` renders ``<think>\\n\\n</think>\\n\\n``): all content;
* the prompt opened one (Qwen3.5's generation prompt ends in ``<think>\\n``): reasoning until ``</think>``;
* otherwise the output is reasoning only if it starts with ``<think>`` (whitespace before it allowed).

Only that first block is reasoning: a ``<think>`` later in the answer is content, and a ``</think>`` inside a
Markdown code fence of the reasoning is quoted text, not its end.  An output that ends before ``</think>`` (max
tokens, a stop string) is all reasoning, and its content is empty.  Tags split across tokens are held back until
the next piece decides.
"""
from __future__ import annotations

from typing import Optional

from pegainfer.text.scan import find_outside_fences

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_PARSERS = ("qwen3",)

DETECT, REASONING, CONTENT = "detect", "reasoning", "content"


def reasoning_start(prompt_text: str) -> str:
    """How the output of a rendered chat prompt starts: ``"content"`` (the prompt closed a think block),
    ``"reasoning"`` (it opened one) or ``"detect"`` (the output may open one)."""
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_CLOSE):
        return CONTENT
    if tail.endswith(THINK_OPEN):
        return REASONING
    return DETECT


class ReasoningParser:
    """Incremental: ``push(text)`` → (reasoning text, content text) settled by it; ``flush()`` at the end."""

    def __init__(self, start: str = DETECT):
        if start not in (DETECT, REASONING, CONTENT):
            raise ValueError(f"start must be {DETECT!r}, {REASONING!r} or {CONTENT!r}, got {start!r}")
        self.mode = start
        self.thought = start == REASONING           # whether the output has a reasoning block
        self._buf = ""                              # text not settled yet
        self._in_fence = False
        self._newlines = ""                         # trailing newlines of the reasoning, dropped before </think>
        self._lead_reasoning = start == REASONING   # drop the newlines that open the reasoning
        self._lead_content = False                  # drop the newlines that follow </think>

    def _reasoning(self, s: str) -> str:
        if self._lead_reasoning:
            s = s.lstrip("\n")
            if not s:
                return ""
            self._lead_reasoning = False
        s = self._newlines + s
        body = s.rstrip("\n")
        self._newlines = s[len(body):]
        return body

    def _content(self, s: str) -> str:
        if self._lead_content:
            s = s.lstrip("\n")
            if s:
                self._lead_content = False
        return s

    def push(self, text: str) -> tuple[str, str]:
        buf = self._buf + text
        self._buf = ""
        reasoning = []
        if self.mode == DETECT:
            head = buf.lstrip()
            if THINK_OPEN.startswith(head):        # nothing yet, or a prefix of <think>: wait
                self._buf = buf
                return "", ""
            if head.startswith(THINK_OPEN):
                self.mode = REASONING
                self.thought = True
                self._lead_reasoning = True
                buf = head[len(THINK_OPEN):]
            else:
                self.mode = CONTENT
        if self.mode == REASONING:
            at, settled, self._in_fence = find_outside_fences(buf, THINK_CLOSE, 0, self._in_fence)
            reasoning.append(self._reasoning(buf[:settled]))
            if at == -1:
                self._buf = buf[settled:]
                return "".join(reasoning), ""
            self.mode = CONTENT
            self._newlines = ""
            self._lead_content = True
            buf = buf[at + len(THINK_CLOSE):]
        return "".join(reasoning), self._content(buf)

    def flush(self) -> tuple[str, str]:
        """Settle what is held back once the output has ended."""
        buf, self._buf = self._buf, ""
        if self.mode == DETECT:
            self.mode = CONTENT
            return "", buf
        if self.mode == REASONING:
            return self._reasoning(buf), ""
        return "", ""


def split_reasoning(text: str, start: str = DETECT) -> tuple[Optional[str], str]:
    """A whole output at once: (reasoning, or None when there was no think block; content)."""
    parser = ReasoningParser(start)
    r1, c1 = parser.push(text)
    r2, c2 = parser.flush()
    return (r1 + r2 if parser.thought else None), c1 + c2
