"""What a tool-call parser does: reads a chat reply's text as it streams and
splits it into plain content and the function calls the model wrote, in
whatever convention its chat template taught it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedCall:
    """A call; or, from a parser that streams arguments, a piece of one: a piece
    with a name starts a call, a piece without one (None) carries the next
    fragment of the arguments of the call started last."""
    name: str | None
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
    """One per choice: feed() each text delta in order, finish() once at the end.
    A parser is made with `incremental`: True when the reply is streamed, so it
    may pass calls on in pieces; False, whole calls only."""

    def __init__(self, incremental: bool = False) -> None:
        self.incremental = incremental

    @abstractmethod
    def feed(self, text: str) -> ParseStep:
        """Implemented per convention."""

    @abstractmethod
    def finish(self) -> ParseStep:
        """Whatever was held back: a call the text ended in, or content."""


@dataclass(frozen=True)
class ToolCall:
    """A call as a choice of the reply carries it: its place among the choice's
    calls and the id the client answers it with. A streamed fragment of a call's
    arguments has the call's index and no id or name."""
    index: int
    id: str | None
    name: str | None
    arguments: str
