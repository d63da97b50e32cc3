"""Reload policies when their files change (a Kubernetes ConfigMap update, an edit on disk).

The watcher polls the files' identity (resolved path, size, modification time) every ``interval_s`` seconds and calls
:meth:`guard.policy.PolicySet.reload` once a change has settled: the identity differs from the loaded one and is the
same at two polls in a row, so a file caught while it is being written (an editor's or a writer's partial file, which
may parse as a smaller, more permissive policy) is not loaded. A reload that fails keeps the last good policies active: the
error is logged and counted in ``PolicySet.reload_failures`` (reported by ``Guard.health()``), and the watcher tries
again at the next change. Any other error in a check (an unexpected exception from a reader) is logged and counted in
:attr:`PolicyWatcher.failures` too; the watcher keeps polling. :attr:`PolicyWatcher.alive` says whether its task still
runs (health reports ``watcher_dead`` otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from guard.errors import PolicyError
from guard.policy.loader import PolicySet

__all__ = ["DEFAULT_RELOAD_INTERVAL_S", "PolicyWatcher"]

DEFAULT_RELOAD_INTERVAL_S = 5.0

logger = logging.getLogger("guard.policy")

_Stamp = tuple[tuple[str, int, int], ...]


def _stamp(paths: tuple[Path, ...]) -> _Stamp:
    out = []
    for path in paths:
        try:
            resolved = os.path.realpath(path)  # ConfigMap volumes swap a symlink on update
            info = os.stat(resolved)
            out.append((resolved, info.st_size, info.st_mtime_ns))
        except OSError:
            out.append((str(path), -1, -1))
    return tuple(out)


class PolicyWatcher:
    """Polls a :class:`PolicySet`'s source files and reloads it on change.

    Args:
        policies: the live set (``guard.policies``); it must have been loaded from files.
        interval_s: seconds between polls (> 0).

    Raises:
        ValueError: for a set without source files or a non-positive interval.

    Example:
        >>> watcher = PolicyWatcher(guard.policies, interval_s=5)   # doctest: +SKIP
        >>> watcher.start(); ...; await watcher.aclose()            # doctest: +SKIP
    """

    def __init__(self, policies: PolicySet, *, interval_s: float = DEFAULT_RELOAD_INTERVAL_S) -> None:
        if not policies.sources:
            raise ValueError("PolicyWatcher needs a policy set loaded from files")
        if not interval_s > 0:
            raise ValueError(f"interval_s is {interval_s}; it must be a positive number of seconds")
        self.policies = policies
        self.interval_s = float(interval_s)
        self.reloads = 0
        self.failures = 0
        self.last_error: str | None = None
        self._stamp = _stamp(policies.sources)  # the files as loaded
        self._seen = self._stamp  # the files at the previous check
        self._task: asyncio.Task[None] | None = None
        self._checking: asyncio.Future[bool] | None = None  # the check running in a thread

    def check(self) -> bool:
        """Reload if the files changed and have stayed as they are since the previous check (a change is applied at
        the second check that sees it); returns whether a reload succeeded."""
        stamp = _stamp(self.policies.sources)
        seen, self._seen = self._seen, stamp
        if stamp == self._stamp or stamp != seen:  # unchanged, or still changing: look again at the next poll
            return False
        self._stamp = stamp
        try:
            self.policies.reload()
        except PolicyError as exc:
            logger.error("policy reload failed; keeping the last good policies: %s", exc)
            self.failures += 1
            self.last_error = str(exc)[:300]
            return False
        except Exception as exc:  # a reader's own error must not end the watcher
            logger.exception("policy reload failed unexpectedly; keeping the last good policies")
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            return False
        self.reloads += 1
        self.last_error = None
        logger.info("policies reloaded from %s", ", ".join(str(p) for p in self.policies.sources))
        return True

    @property
    def alive(self) -> bool:
        """Whether the polling task runs (``False`` before :meth:`start`, after :meth:`aclose`, or if it died)."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start polling in the running event loop. Idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="guard-policy-watcher")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            # in a thread: a large or slow policy loads while requests are still served; shielded, so aclose()
            # waits for a reload under way instead of leaving it to finish after it returned
            self._checking = asyncio.ensure_future(asyncio.to_thread(self.check))
            await asyncio.shield(self._checking)

    async def aclose(self) -> None:
        """Stop polling; a reload under way finishes first. Idempotent."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        checking, self._checking = self._checking, None
        if checking is not None and not checking.cancelled():
            await asyncio.shield(checking)  # check() handles its own errors; a cancelled aclose() leaves it running
