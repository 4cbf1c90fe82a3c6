"""A chat answer's text split into what OpenAI clients read separately: ``reasoning_content``, ``content`` and
``tool_calls``.  The reasoning parser (``reasoning.py``) runs first; the tool-call parser (``tool_calls.py``) reads
only the content that follows the reasoning, so a call the model merely thinks about is not made.

The same object serves both answers: the streamed one pushes each engine output's text and sends what comes back;
the whole one pushes everything and joins it, so both give the same fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pegainfer.text.reasoning import ReasoningParser
from pegainfer.text.tool_calls import ToolCall, ToolCallParser


@dataclass
class ChatDelta:
    """What a piece of text settled: reasoning text, content text, complete tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, other: "ChatDelta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


class ChatOutputParser:
    """``push(text) -> ChatDelta``; ``flush() -> ChatDelta`` once the output has ended.  With neither parser the
    text is all content, unchanged."""

    def __init__(self, reasoning: Optional[ReasoningParser] = None, tool_calls: Optional[ToolCallParser] = None):
        self.reasoning = reasoning
        self.tool_parser = tool_calls

    @property
    def calls(self) -> list[ToolCall]:
        return self.tool_parser.calls if self.tool_parser is not None else []

    def _content(self, text: str, final: bool) -> ChatDelta:
        if self.tool_parser is None:
            return ChatDelta(content=text)
        events = self.tool_parser.push(text) if text else []
        if final:
            events += self.tool_parser.flush()
        out = ChatDelta()
        for e in events:
            if isinstance(e, str):
                out.content += e
            else:
                out.tool_calls.append(e)
        return out

    def push(self, text: str) -> ChatDelta:
        if self.reasoning is None:
            return self._content(text, False)
        reasoning, content = self.reasoning.push(text)
        out = self._content(content, False)
        out.reasoning = reasoning
        return out

    def flush(self) -> ChatDelta:
        if self.reasoning is None:
            return self._content("", True)
        reasoning, content = self.reasoning.flush()
        out = self._content(content, True)
        out.reasoning = reasoning
        return out
