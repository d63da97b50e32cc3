"""Fixtures for the HTTP enforcement point: a Guard on the test policy with a scripted backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from guard.engine import Guard
from tests._backends import ScriptedBackend
from tests.asgi._apps import POLICY, scripted_answers


@pytest.fixture
async def make_guard() -> AsyncIterator[Callable[..., Guard]]:
    """``make_guard(backend=None, **from_files_kwargs)``: a Guard on the test policy; closed at teardown."""
    guards: list[Guard] = []

    def factory(backend: Any = None, **kwargs: Any) -> Guard:
        guard = Guard.from_files(POLICY, backends=backend or ScriptedBackend(scripted_answers), **kwargs)
        guards.append(guard)
        return guard

    yield factory
    for guard in guards:
        await guard.aclose()

