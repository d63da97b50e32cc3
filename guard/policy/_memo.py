"""A memo of a function's results bounded by the characters it holds, not only by its number of entries.

The provenance and instruction tables remember results per message text: a conversation's texts come back on every
later call of its turn, so each is read once. ``functools.lru_cache`` bounds such a table by entries only, and 2,048
texts of 1 MB each keep gigabytes alive; :func:`text_memo` also evicts the least recently used entries while the
characters they hold are over its ``max_chars``, so a table stays at tens of megabytes while a long text that every
call of a conversation reads stays remembered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import update_wrapper
from typing import Any, Generic, NamedTuple, ParamSpec, Protocol, TypeVar, cast

__all__ = ["MemoInfo", "Memoised", "TextMemo", "text_memo"]

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class MemoInfo(NamedTuple):
    """A memo's counters: calls that computed a result (``misses``), its entry bound (``maxsize``, as
    ``functools.lru_cache`` names it), the entries (``currsize``) and characters (``chars``) it holds now, and its
    character bound (``max_chars``)."""

    misses: int
    maxsize: int
    currsize: int
    chars: int
    max_chars: int


class TextMemo(Generic[R]):
    """The table of a :func:`text_memo` function: results per positional arguments, least recently used first.

    Two bounds hold after every call: at most :attr:`max_entries` entries, and at most :attr:`max_chars` characters
    in all, an entry counting the characters of its ``str`` arguments plus ``result_chars(result)`` (0 without it).
    A Python string takes 1, 2 or 4 bytes a character (by the widest character it holds) plus about 50, so
    ``max_chars`` characters are ``max_chars`` to ``4 * max_chars`` bytes, plus what ``result_chars`` leaves
    uncounted. A result that alone counts more than ``max_chars`` is not put in the table; the last such result is
    kept apart (:attr:`oversize`, one per table, replaced by the next), so a long text read for every argument of a
    call, and by the calls after it, is computed once while no other long text comes between.

    Thread-safe: a lookup is one ``OrderedDict`` read and one move to the end, each atomic under the GIL (a key
    evicted between the two is still returned); storing and evicting run under a lock, and the function runs outside
    it, so two threads that miss the same key at once both compute it (the first result stays).
    """

    def __init__(
        self,
        function: Callable[..., R],
        *,
        max_entries: int,
        max_chars: int,
        result_chars: Callable[[R], int] | None = None,
    ) -> None:
        self.function = function
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.result_chars = result_chars
        self.entries: OrderedDict[Any, tuple[R, int]] = OrderedDict()
        self.oversize: tuple[Any, R] | None = None
        self.chars = 0
        self.misses = 0
        self._lock = threading.Lock()

    def compute(self, key: Any, args: tuple[Any, ...]) -> R:
        """The function's result for ``args`` (a lookup of ``key`` missed), remembered within the bounds."""
        result = self.function(*args)
        chars = sum(len(arg) for arg in args if isinstance(arg, str))
        if self.result_chars is not None:
            chars += self.result_chars(result)
        with self._lock:
            self.misses += 1
            if chars > self.max_chars:
                self.oversize = (key, result)
            elif key not in self.entries:
                self.entries[key] = (result, chars)
                self.chars += chars
                while self.chars > self.max_chars or len(self.entries) > self.max_entries:
                    _, (_, dropped) = self.entries.popitem(last=False)
                    self.chars -= dropped
        return result

    def cache_info(self) -> MemoInfo:
        with self._lock:
            return MemoInfo(self.misses, self.max_entries, len(self.entries), self.chars, self.max_chars)

    def cache_clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.oversize = None
            self.chars = self.misses = 0


class Memoised(Protocol[P, R_co]):
    """A function :func:`text_memo` made: called as the function was, its table in ``memo``; ``cache_info`` and
    ``cache_clear`` as ``functools.lru_cache`` names them."""

    memo: TextMemo[Any]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def cache_info(self) -> MemoInfo: ...

    def cache_clear(self) -> None: ...


def text_memo(
    *, max_entries: int, max_chars: int, result_chars: Callable[[R], int] | None = None
) -> Callable[[Callable[P, R]], Memoised[P, R]]:
    """A decorator that remembers a function's results in a :class:`TextMemo` with these bounds. The function takes
    positional arguments only, all hashable."""

    def decorate(function: Callable[P, R]) -> Memoised[P, R]:
        memo = TextMemo(function, max_entries=max_entries, max_chars=max_chars, result_chars=result_chars)
        look_up, move_to_end, compute = memo.entries.get, memo.entries.move_to_end, memo.compute

        def remembered(*args: Any) -> R:
            key = args[0] if len(args) == 1 else args
            entry = look_up(key)
            if entry is None:
                oversize = memo.oversize
                if oversize is not None and oversize[0] == key:
                    return oversize[1]
                return compute(key, args)
            try:
                move_to_end(key)
            except KeyError:  # evicted by another thread since the lookup
                pass
            return entry[0]

        wrapper = cast("Memoised[P, R]", update_wrapper(remembered, function))
        wrapper.memo = memo
        wrapper.cache_info = memo.cache_info  # type: ignore[method-assign]
        wrapper.cache_clear = memo.cache_clear  # type: ignore[method-assign]
        return wrapper

    return decorate
