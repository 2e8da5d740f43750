"""What a tool-call parser does: reads a chat reply's text as it streams and
splits it into plain content and the function calls the model wrote, in
whatever convention its chat template taught it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str      # a JSON object's text, as OpenAI's function.arguments carries it


@dataclass
class ParseStep:
    """What a piece of text turned out to be: content to pass on now, and calls
    completed by it. Text that may still become part of a call is held back."""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def then(self, later: ParseStep) -> ParseStep:
        return ParseStep(self.content + later.content, [*self.calls, *later.calls])


class ToolCallParser(ABC):
    """One per choice: feed() each text delta in order, finish() once at the end."""

    @abstractmethod
    def feed(self, text: str) -> ParseStep:
        """Implemented per convention."""

    @abstractmethod
    def finish(self) -> ParseStep:
        """Whatever was held back: a call the text ended in, or content."""


@dataclass(frozen=True)
class ToolCall:
    """A call as a choice of the reply carries it: its place among the choice's
    calls and the id the client answers it with."""
    index: int
    id: str
    name: str
    arguments: str
