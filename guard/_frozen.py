"""Building frozen dataclasses on the decision hot path without their ``__init__``.

A frozen dataclass's ``__init__`` pays one ``object.__setattr__`` per field. The subject and the verdict are built on
every guarded request (the verdict has 20 fields: about 4 us of a cache hit that costs tens of microseconds), so the
hot path fills the new object's ``__dict__`` instead, which gives an equal object (same ``==``, ``repr``, ``hash``,
``dataclasses.asdict`` and pickle) in about a quarter of the time. Where that would not be the same object (a class
with ``__slots__``, ``__post_init__`` or ``init=False`` fields, or names that are not exactly the fields) the ordinary
constructor is called instead, so a field added later or a misspelt name is never skipped silently: a builder's
first full set of names is compared with the fields, later ones by their number (see :func:`frozen_builder`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["frozen_builder"]

T = TypeVar("T")

_PLAIN: dict[type, frozenset[str] | None] = {}


def _plain_fields(cls: type) -> frozenset[str] | None:
    """``cls``'s field names when its instances can be filled through ``__dict__``, else ``None`` (remembered).

    Raises:
        TypeError: when ``cls`` is not a dataclass.
    """
    try:
        return _PLAIN[cls]
    except KeyError:
        pass
    fields = dataclasses.fields(cls)
    plain = "__slots__" not in vars(cls) and not hasattr(cls, "__post_init__") and all(f.init for f in fields)
    names = _PLAIN[cls] = frozenset(f.name for f in fields) if plain else None
    return names


def frozen_builder(cls: type[T]) -> Callable[[dict[str, Any]], T]:
    """A function ``values -> instance of cls`` for a frozen dataclass, where ``values`` maps field names to values.

    Each builder is meant for one dict display (one call site, the same names every time). The first ``values`` with
    as many names as the class has fields has its names compared with the fields one by one; after that, the number
    of names is checked (a dict display's names cannot change from one call to the next, and comparing 20 names is
    about 40 % of building a verdict).

    Args:
        cls: a dataclass (frozen or not).

    Returns:
        ``build(values)``: when the names in ``values`` are exactly the class's fields, an object whose ``__dict__``
        is filled from ``values`` (``values`` itself is not kept); else ``cls(**values)``, which fills defaults and
        raises ``TypeError`` for an unknown name.

    Raises:
        TypeError: when ``cls`` is not a dataclass.
    """
    names = _plain_fields(cls)
    count = -1 if names is None else len(names)
    new = object.__new__
    checked = False

    def build(values: dict[str, Any]) -> T:
        nonlocal checked
        if len(values) != count:
            return cls(**values)
        if not checked:
            if values.keys() != names:
                return cls(**values)
            checked = True
        obj = new(cls)
        obj.__dict__.update(values)
        return obj

    return build
