"""Server-sent events framing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    # Starlette cancels the iterator when the client disconnects; closing it
    # cancels the scheduler stream.
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
