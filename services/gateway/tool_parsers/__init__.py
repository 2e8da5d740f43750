"""Tool-call parsers by name (the gateway's TOOL_CALL_PARSER): each reads the
call convention of a family of chat templates. A new convention is a module
with a ToolCallParser subclass, registered here."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ToolCallParser
from services.gateway.tool_parsers.hermes import HermesToolParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
}

