from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from tests.unit.gateway.fakes import EOS_ID, FakeScheduler, ServerThread

REPLY_TEXT = "Paris is 東京 🙂 nice."


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from tests.fixtures.tiny_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def reply_ids(tokenizer: Any) -> list[int]:
    return [*tokenizer.encode(REPLY_TEXT, add_special_tokens=False), EOS_ID]


@pytest.fixture
def fake(reply_ids: list[int]) -> FakeScheduler:
    return FakeScheduler(reply_ids=reply_ids)


@pytest.fixture
def make_app(tokenizer: Any) -> Callable[..., Any]:
    def build(backend: FakeScheduler, **settings: Any) -> Any:
        return create_app(GatewaySettings(**settings), backend, tokenizer)
    return build


@pytest.fixture
async def client(make_app: Callable[..., Any], fake: FakeScheduler) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app(fake))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http


@pytest.fixture
def server(make_app: Callable[..., Any], fake: FakeScheduler) -> Iterator[ServerThread]:
    """The app served on a free port, for clients that need a real server (openai, streams)."""
    with ServerThread(make_app(fake)) as running:
        yield running


@pytest.fixture
def serve(make_app: Callable[..., Any]) -> Iterator[Callable[..., ServerThread]]:
    """Starts apps on free ports (a fake scheduler and settings each), all stopped at the end."""
    servers: list[ServerThread] = []

    def start(fake: FakeScheduler, **settings: Any) -> ServerThread:
        server = ServerThread(make_app(fake, **settings)).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__()
