"""What the agent middleware worked out from a message object, remembered while that object lives, so a model step
works only on the messages that are new or changed since the last step (a graph passes the thread's message objects
from node to node within a run; a checkpoint read back, a client's update or a middleware's copy are new objects)."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any


def same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same plain value, type for type: both the very same type of str, int, float,
    bool, None, list, tuple or dict, floats of the same ``repr`` (``-0.0`` is not ``0.0``), dicts with the same keys
    in the same order, items alike throughout. Any other value (a subclass of one of these too) is never the same, so
    ``==`` written to say equal cannot pass for a value that serialises otherwise (``0`` and ``False``, ``1`` and
    ``1.0``, or a ``str`` subclass whose ``__eq__`` says ``True``)."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is str or kind is int or kind is bool or a is None:
        return bool(a == b)
    if kind is float:
        return repr(a) == repr(b)
    if kind is list or kind is tuple:
        return len(a) == len(b) and all(map(same, a, b))
    if kind is dict:
        return len(a) == len(b) and all(same(k, m) and same(v, w) for (k, v), (m, w) in zip(a.items(), b.items()))
    return False


class MessageMemo:
    """Values computed from message objects, by the object and a name: :meth:`get` returns a value only for the same
    object (not an equal one) whose inputs are still the :func:`same` as a deep copy of the inputs it was computed
    from, so a message changed in place, even deep inside its content, is worked out again. An entry goes with its
    object."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], tuple[weakref.ref[Any], Any, Any]] = {}

    def get(self, message: Any, name: str, inputs: Any) -> Any:
        """The value :meth:`put` kept for ``message`` under ``name`` from inputs the :func:`same` as ``inputs``, else
        ``None``."""
        entry = self._entries.get((id(message), name))
        if entry is None or entry[0]() is not message:
            return None
        try:
            return entry[2] if same(entry[1], inputs) else None
        except RecursionError:  # inputs nested too deep to compare are worked out again
            return None

    def put(self, message: Any, name: str, inputs: Any, value: Any) -> None:
        """Keep ``value``, computed from ``inputs`` of ``message``, while ``message`` lives (not kept for inputs that
        cannot be deep-copied, nor for an object without weak references)."""
        key = (id(message), name)
        entries = self._entries

        def forget(ref: weakref.ref[Any]) -> None:
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                entries.pop(key, None)

        try:
            entries[key] = (weakref.ref(message, forget), copy.deepcopy(inputs), value)
        except Exception:  # noqa: BLE001 - such a value is worked out at every step
            return

    def computed(self, message: Any, name: str, inputs: Any, compute: Callable[[Any], Any]) -> Any:
        """``compute(message)`` (never ``None``), from inputs ``inputs`` of ``message``: as kept (:meth:`get`), else
        computed now and kept."""
        value = self.get(message, name, inputs)
        if value is None:
            value = compute(message)
            self.put(message, name, inputs, value)
        return value
