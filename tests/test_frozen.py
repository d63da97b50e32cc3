"""Frozen dataclasses built on the hot path without their ``__init__`` (guard/_frozen.py)."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest

from guard._frozen import frozen_builder
from guard.subject import HttpSubject
from guard.verdict import Verdict


@dataclass(frozen=True)
class _Checked:
    value: int

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError("negative")


@dataclass(frozen=True, slots=True)
class _Slotted:
    value: int


@pytest.mark.parametrize(
    ("cls", "values"),
    [
        (HttpSubject, {"method": "POST", "path": "/v1", "query": {"q": ["1"]}, "headers": {"a": "b"}, "host": "h",
                       "client": "127.0.0.1", "content_type": "application/json", "body": {"x": [1]},
                       "body_text": "x", "kind": "http"}),
        (Verdict, {f.name: None for f in dataclasses.fields(Verdict)}
         | {"action": "block", "decision_id": "d", "answers": {}, "cache_hit": True, "latency_ms": 1.5, "flags": {}}),
    ],
)  # fmt: skip
def test_the_built_object_is_the_one_the_constructor_makes(cls: type, values: dict[str, Any]) -> None:
    built = frozen_builder(cls)(dict(values))
    made = cls(**values)
    assert type(built) is cls and built == made and repr(built) == repr(made)
    assert dataclasses.asdict(built) == dataclasses.asdict(made) and pickle.loads(pickle.dumps(built)) == made
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.kind = "x"  # type: ignore[misc]


def test_anything_but_exactly_the_fields_goes_through_the_constructor() -> None:
    build = frozen_builder(HttpSubject)
    # A missing field gets its default, as the constructor gives it; a misspelt one is a TypeError, never skipped.
    assert build({"method": "GET", "path": "/"}) == HttpSubject(method="GET", path="/")
    every = {f.name: getattr(HttpSubject("GET", "/"), f.name) for f in dataclasses.fields(HttpSubject)}
    with pytest.raises(TypeError, match="pth"):
        build({**{k: v for k, v in every.items() if k != "path"}, "pth": "/"})
    # __post_init__ and __slots__ classes always use their constructor.
    with pytest.raises(ValueError, match="negative"):
        frozen_builder(_Checked)({"value": -1})
    assert frozen_builder(_Slotted)({"value": 3}) == _Slotted(3)
    with pytest.raises(TypeError):
        frozen_builder(dict)  # type: ignore[arg-type]


def test_default_factories_are_not_shared() -> None:
    @dataclass(frozen=True)
    class Box:
        items: list[int] = field(default_factory=list)

    a, b = frozen_builder(Box)({}), frozen_builder(Box)({})
    assert a.items == [] and a.items is not b.items

