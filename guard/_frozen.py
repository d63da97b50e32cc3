"""Building frozen dataclasses on the decision hot path without their ``__init__``.

A frozen dataclass's ``__init__`` pays one ``object.__setattr__`` per field. The subject and the verdict are built on
every guarded request (the verdict has 20 fields: about 4 us of a cache hit that costs tens of microseconds), so the
hot path fills the new object's ``__dict__`` from a dict that names every field, which gives an equal object (same
``==``, ``repr``, ``hash`` and ``dataclasses.asdict``) in about a quarter of the time. Where that would not be the
same object (a class with ``__slots__`` or ``__post_init__``, or a dict whose names are not exactly the fields) the
ordinary constructor is called instead, so a field added later or a misspelt name is never skipped silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["frozen_builder"]

T = TypeVar("T")


def frozen_builder(cls: type[T]) -> Callable[[dict[str, Any]], T]:
    """A function ``values -> instance of cls`` for a frozen dataclass, where ``values`` maps field names to values.

    Args:
        cls: a dataclass (frozen or not).

    Returns:
        ``build(values)``: when the names in ``values`` are exactly the class's fields, an object whose ``__dict__``
        is filled from ``values`` (``values`` itself is not kept); else ``cls(**values)``, which fills defaults and
        raises ``TypeError`` for an unknown name.

    Raises:
        TypeError: when ``cls`` is not a dataclass.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # TypeError for a non-dataclass
    names = frozenset(f.name for f in fields)
    plain = "__slots__" not in vars(cls) and not hasattr(cls, "__post_init__") and all(f.init for f in fields)
    new = object.__new__

    def build(values: dict[str, Any]) -> T:
        if not plain or values.keys() != names:
            return cls(**values)
        obj = new(cls)
        obj.__dict__.update(values)
        return obj

    return build
