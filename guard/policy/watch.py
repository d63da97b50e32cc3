"""Reload policies when their files change (a Kubernetes ConfigMap update, an edit on disk).

The watcher polls the files' identity (resolved path, device, inode, size, modification time) every ``interval_s``
seconds and calls :meth:`guard.policy.PolicySet.reload` once a change has settled: the identity differs from the one
the active set was read from (``PolicySet.stamps``, recorded as each file was read, so a change that lands between a
load and the watcher's start is still seen) and is the same at two polls in a row, so a file caught while it is being
written (an editor's or a writer's partial file, which may parse as a smaller, more permissive policy) is not loaded.
A file left cut short (a writer that died mid-write) stays the same and is loaded if it parses; the reload logs the
policies it dropped at WARNING and counts them (:meth:`~guard.policy.PolicySet.reload`).
A reload that fails keeps the last good policies active: the error is logged (once, by
:meth:`~guard.policy.PolicySet.reload`) and counted in ``PolicySet.reload_failures`` (reported by
``Guard.health()``), and the watcher tries again at the next change. When the files become again those the active
policies were read from (a ConfigMap rolled back to the last good version), the watcher's and the set's
``last_error`` are cleared: health is no longer degraded by a change that was undone. Any other error in a check (an
unexpected exception from a reader) is logged and counted in :attr:`PolicyWatcher.failures` too; the watcher keeps
polling.
:attr:`PolicyWatcher.started` says whether :meth:`~PolicyWatcher.start` ran (health reports ``starting`` until then)
and :attr:`PolicyWatcher.alive` whether its task still runs (health reports ``watcher_dead`` once it ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from guard.errors import PolicyError
from guard.policy.loader import FileStamp, PolicySet, file_stamp

__all__ = ["DEFAULT_RELOAD_INTERVAL_S", "PolicyWatcher"]

DEFAULT_RELOAD_INTERVAL_S = 5.0

logger = logging.getLogger("guard.policy")

_Stamp = tuple[FileStamp, ...]


def _stamp(paths: tuple[Path, ...]) -> _Stamp:
    return tuple(file_stamp(path) for path in paths)  # ConfigMap volumes swap a symlink on update: resolved


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
        # the files as the active set read them (a set built without stamps is reloaded once, at the second poll)
        self._seen: _Stamp = policies.stamps  # the files at the previous check
        self._failed: _Stamp | None = None  # the files a reload last failed on: not retried until they change
        self._refused: PolicyError | None = None  # that reload's error (the set's ``last_error`` until it clears)
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._checking: asyncio.Future[bool] | None = None  # the check running in a thread

    def check(self) -> bool:
        """Reload if the files changed and have stayed as they are since the previous check (a change is applied at
        the second check that sees it); returns whether a reload succeeded."""
        stamp = _stamp(self.policies.sources)
        seen, self._seen = self._seen, stamp
        if stamp == self.policies.stamps:  # loaded (by this watcher or a caller's reload), or a refused change undone
            if self._failed is not None:  # the files are again those the last good policies came from: healthy
                self._failed, self.last_error = None, None
                if self._refused is not None:
                    self.policies.forget_error(self._refused)
                    self._refused = None
            return False
        if stamp == self._failed or stamp != seen:
            return False  # refused already, or still changing
        try:
            self.policies.reload()  # logs its outcome: "policies reloaded: ..." or the error, once
        except PolicyError as exc:
            self._failed, self._refused = stamp, exc
            self.failures += 1
            self.last_error = str(exc)[:300]
            return False
        except Exception as exc:  # a reader's own error must not end the watcher (reload() logs only its own)
            logger.exception("policy reload failed unexpectedly; keeping the last good policies")
            self._failed = stamp
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            return False
        self._failed, self._refused = None, None
        self.reloads += 1
        self.last_error = None
        return True

    @property
    def alive(self) -> bool:
        """Whether the polling task runs (``False`` before :meth:`start`, after :meth:`aclose`, or if it died)."""
        return self._task is not None and not self._task.done()

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran (it stays true after :meth:`aclose`)."""
        return self._started

    def start(self) -> None:
        """Start polling in the running event loop. Idempotent."""
        self._started = True
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
