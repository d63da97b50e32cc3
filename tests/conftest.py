"""Shared fixtures: a real Redis (found or started), the golden tiny Clef checkpoint, and anyio on asyncio."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._redis_server import RedisServer, find_redis_url

FIXTURES = Path(__file__).parent / "fixtures"
STORE_KEY = "test-store-key-0123456789abcdef"
os.environ.setdefault("GUARD_STORE_KEY", STORE_KEY)  # what a deployment sets: Redis stores seal what they write
GOLDEN = FIXTURES / "clef-golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis-url", default=None, help="Redis for integration tests (default: $REDIS_URL, "
                     "then redis://127.0.0.1:6379/0, else a private redis-server is started)")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    url, server = find_redis_url(request.config.getoption("--redis-url") or os.environ.get("REDIS_URL"))
    yield url
    if server is not None:
        server.stop()


@pytest.fixture
async def create_redis(redis_url: str) -> AsyncIterator[Callable[..., Any]]:
    """Factory for redis.asyncio clients on a test-private key prefix; flushes those keys and closes on teardown."""
    import uuid

    import redis.asyncio as aioredis

    clients: list[Any] = []
    prefix = f"guard-test-{uuid.uuid4().hex[:8]}:"

    def factory(**kwargs: Any) -> Any:
        client = aioredis.Redis.from_url(redis_url, **kwargs)
        clients.append(client)
        return client

    factory.prefix = prefix  # type: ignore[attr-defined]
    yield factory
    cleaner = aioredis.Redis.from_url(redis_url)
    async for key in cleaner.scan_iter(match=prefix + "*"):
        await cleaner.delete(key)
    await cleaner.aclose()
    for client in clients:
        await client.aclose()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server owned by one test, which the test may stop (for 'Redis down' cases)."""
    server = RedisServer.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def golden_checkpoint() -> Path:
    return GOLDEN / "checkpoint"


@pytest.fixture(scope="session")
def clef_fp32(golden_checkpoint: Path) -> Any:
    """The golden tiny checkpoint loaded once (float32), for the worker and local-backend tests."""
    import torch

    from guard.clef.model import ClefModel

    return ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float32)
