"""Policy hot reload: a changed file is reloaded; a broken one keeps the last good policies (case C21)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from guard.errors import PolicyError
from guard.policy import load_files
from guard.policy.watch import PolicyWatcher

POLICY = """\
policies:
  - id: p
    version: "{version}"
    match: {{http: {{methods: [POST]}}}}
    questions:
      spam: {{type: noul, instructions: "Is this spam?"}}
    rules:
      - {{id: spam, when: "spam.noul >= {threshold}", action: block}}
    default: allow
"""


def _write(path: Path, text: str, bump: int) -> None:
    path.write_text(text)
    stamp = path.stat().st_mtime_ns + bump * 1_000_000_000
    os.utime(path, ns=(stamp, stamp))  # a distinct mtime even on coarse clocks


def test_reload_on_change_and_keep_last_good_on_error(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(version="1", threshold=0.9), 0)
    policies = load_files(path)
    watcher = PolicyWatcher(policies, interval_s=0.05)
    assert watcher.check() is False  # nothing changed yet

    _write(path, POLICY.format(version="2", threshold=0.5), 1)
    assert watcher.check() is False  # seen once: it may still be being written
    assert watcher.check() is True  # the same at the next poll: loaded
    assert policies["p"].version == "2" and watcher.reloads == 1

    _write(path, POLICY.format(version="3", threshold=0.5) + "data: {}\ndata: {}\n", 2)  # duplicate key
    assert watcher.check() is False and watcher.check() is False
    assert policies["p"].version == "2"  # the last good set stays active
    assert policies.reload_failures == 1
    assert "duplicate" in str(policies.last_error)
    assert watcher.check() is False  # no retry until the file changes again


def test_a_refused_change_rolled_back_clears_the_reload_error(tmp_path: Path) -> None:
    """A ConfigMap swapped to a broken version and back to the active one: health stayed degraded, since the watcher
    returned early on the active files and never cleared the errors of the change that was undone."""
    for version, text in (("v1", POLICY.format(version="1", threshold=0.9)), ("v2", "policies: [{id: p}]\n")):
        (tmp_path / version).mkdir()
        (tmp_path / version / "p.yaml").write_text(text)

    def swap(target: str) -> None:  # as the kubelet does: a new link renamed over the old one
        (tmp_path / "tmp").symlink_to(target)
        os.replace(tmp_path / "tmp", tmp_path / "cur")

    swap("v1")
    policies = load_files(tmp_path / "cur" / "p.yaml")
    watcher = PolicyWatcher(policies, interval_s=0.05)
    swap("v2")
    assert watcher.check() is False and watcher.check() is False
    assert policies.last_error is not None and watcher.last_error is not None and watcher.failures == 1
    swap("v1")
    assert watcher.check() is False  # nothing to load: the active set came from these files
    assert policies.last_error is None and watcher.last_error is None
    assert (policies["p"].version, policies.reload_failures, watcher.failures) == ("1", 1, 1)  # counts are kept
    swap("v2")  # the same broken version again is refused again
    assert watcher.check() is False and watcher.check() is False and watcher.failures == 2
    assert policies.last_error is not None


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY.format(version="1", threshold=0.9))
    with pytest.raises(ValueError, match="positive"):
        PolicyWatcher(load_files(path), interval_s=0)


@pytest.mark.anyio
async def test_background_polling_reloads(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(version="1", threshold=0.9), 0)
    policies = load_files(path)
    watcher = PolicyWatcher(policies, interval_s=0.02)
    watcher.start()
    watcher.start()  # idempotent
    try:
        _write(path, POLICY.format(version="7", threshold=0.9), 1)
        for _ in range(200):
            if policies["p"].version == "7":
                break
            await asyncio.sleep(0.01)
        assert policies["p"].version == "7"
    finally:
        await watcher.aclose()
        await watcher.aclose()


def test_a_control_character_is_a_policy_error_and_later_changes_still_apply(tmp_path: Path) -> None:
    """A control character is a PolicyError naming file and line (not a raw YAML ReaderError), so a watcher keeps
    the last good policies and applies the next valid change."""
    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(version="1", threshold=0.9), 0)
    policies = load_files(path)
    watcher = PolicyWatcher(policies, interval_s=0.05)
    _write(path, POLICY.format(version="2", threshold=0.5).replace("Is this spam?", "Is this\x01 spam?"), 1)
    assert watcher.check() is False and watcher.check() is False and policies["p"].version == "1"
    assert f"{path}:6" in str(policies.last_error) and "U+0001" in str(policies.last_error)
    _write(path, POLICY.format(version="3", threshold=0.5), 2)
    assert watcher.check() is False and watcher.check() is True and policies["p"].version == "3"


def test_a_file_caught_while_it_is_written_is_not_loaded(tmp_path: Path) -> None:
    """A poll that lands mid-write sees a partial file, which can parse as a smaller policy (rules cut off: the
    default allows everything). It is loaded only once it has stayed the same for a poll."""
    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(version="1", threshold=0.9), 0)
    policies = load_files(path)
    watcher = PolicyWatcher(policies, interval_s=0.05)
    full = POLICY.format(version="2", threshold=0.5)
    _write(path, full[: full.index("    rules:")], 1)  # the writer has got this far
    assert watcher.check() is False and policies["p"].version == "1"
    _write(path, full, 2)  # the write completes before the next poll
    assert watcher.check() is False and policies["p"].version == "1"
    assert watcher.check() is True and policies["p"].version == "2" and len(policies["p"].rules) == 1


def test_a_file_cut_short_and_left_so_is_loaded_with_a_warning_naming_the_dropped_policies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer that dies mid-write leaves a stable file that can parse as fewer policies: it is loaded (a removal
    may be meant), but the reload was logged only at INFO. It is now a WARNING naming each dropped policy and its
    file, and counted on the set (health reports it under ``policy_reload``)."""
    path = tmp_path / "p.yaml"
    two = POLICY.format(version="1", threshold=0.9) + POLICY.format(version="1", threshold=0.9).replace(
        "policies:\n", "").replace("id: p", "id: q")
    _write(path, two, 0)
    policies = load_files(path)
    watcher = PolicyWatcher(policies, interval_s=0.05)
    _write(path, two[: two.index("  - id: q")], 1)
    with caplog.at_level("INFO", logger="guard.policy"):
        assert watcher.check() is False and watcher.check() is True
    assert [p.id for p in policies] == ["p"]
    assert policies.policies_removed == 1 and policies.last_removed == (f"q ({path})",)
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"q ({path})" in warned[0].getMessage()
    caplog.clear()
    _write(path, POLICY.format(version="2", threshold=0.9), 2)  # a reload that drops nothing warns of nothing
    with caplog.at_level("INFO", logger="guard.policy"):
        assert watcher.check() is False and watcher.check() is True
    assert not [r for r in caplog.records if r.levelname == "WARNING"] and policies.policies_removed == 1


@pytest.mark.anyio
async def test_a_slow_reload_does_not_stop_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload runs in a thread: the event loop (requests, health) keeps running while a large policy loads."""
    import time

    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(version="1", threshold=0.9), 0)
    policies = load_files(path)
    reload = policies.reload

    def slow_reload() -> None:
        time.sleep(0.5)
        reload()

    monkeypatch.setattr(policies, "reload", slow_reload)
    watcher = PolicyWatcher(policies, interval_s=0.02)
    watcher.start()
    try:
        _write(path, POLICY.format(version="2", threshold=0.9), 1)
        gaps, last = [], time.monotonic()
        while policies["p"].version != "2" and len(gaps) < 400:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        assert policies["p"].version == "2" and max(gaps) < 0.3, max(gaps)
    finally:
        await watcher.aclose()


def test_a_reload_error_of_any_kind_keeps_the_last_good_set_and_is_counted(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only a PolicyError: a MemoryError while reading (a path swapped for /dev/zero before reads were bounded)
    is a failed reload that health reports, not an ``ok`` policy check next to a failing watcher."""
    from guard.policy import loader

    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(version="1", threshold=0.9), 0)
    policies = load_files(path)

    def out_of_memory(_: object) -> bytes:
        raise MemoryError

    monkeypatch.setattr(loader, "read_policy_file", out_of_memory)
    with pytest.raises(PolicyError, match="could not be loaded: MemoryError"):
        policies.reload()
    assert policies.reload_failures == 1 and policies["p"].version == "1"


@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "large"])
def test_only_a_regular_file_of_bounded_size_is_read(tmp_path: Path, kind: str) -> None:
    """A path swapped for a FIFO (the read would wait for a writer forever), a device (/dev/zero: reading never
    ends) or a huge file (read whole before its size was checked) is refused at once, naming the file."""
    import time

    path = tmp_path / "p.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(b"#" * (8 << 20))
    started = time.monotonic()
    with pytest.raises(PolicyError) as caught:
        load_files(path)
    assert time.monotonic() - started < 2 and caught.value.file == str(path)
    assert ("at most" if kind == "large" else "not a regular file") in caught.value.reason


class _SlowReloads:
    """A policy file under a started watcher whose reloads take ``seconds`` (in the validator), counting how many
    run at once; :meth:`next` changes the file and waits until the watcher's reload of it has begun."""

    def __init__(self, tmp_path: Path, seconds: float) -> None:
        self.path = tmp_path / "p.yaml"
        _write(self.path, POLICY.format(version="1", threshold=0.9), 0)
        self.policies = load_files(self.path)
        self.policies.validator = self._validate
        self.seconds, self.running, self.peak, self.version = seconds, 0, 0, 1
        self.started = threading.Event()
        self.watcher = PolicyWatcher(self.policies, interval_s=0.02)
        self.watcher.start()

    def _validate(self, _: object) -> None:
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.started.set()
        time.sleep(self.seconds)
        self.running -= 1

    async def next(self) -> None:
        self.version += 1
        self.started.clear()
        _write(self.path, POLICY.format(version=str(self.version), threshold=0.9), self.version)
        while not self.started.is_set():
            await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_aclose_waits_for_a_reload_under_way_and_reloads_never_overlap(tmp_path: Path) -> None:
    """The watcher's reload runs in a thread; aclose() returns only once it has finished (nothing is swapped in
    after), and a caller's own reload waits for it rather than running beside it."""
    slow = _SlowReloads(tmp_path, 0.4)
    await slow.next()
    await asyncio.to_thread(slow.policies.reload)  # waits for the watcher's reload, then runs its own
    await slow.next()
    await slow.watcher.aclose()
    assert slow.policies["p"].version == "3" and slow.peak == 1
    assert not slow.watcher.alive


def test_a_read_error_names_the_file_and_an_unexpected_reload_error_logs_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno

    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(version="1", threshold=0.9), 0)
    policies = load_files(path)

    def broken_read(fd: int, size: int) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as patch:
        patch.setattr(os, "read", broken_read)
        with pytest.raises(PolicyError, match="cannot read file: Input/output error") as caught:
            load_files(path)
    assert caught.value.file == str(path)

    def bug(_: object) -> None:
        raise KeyError("bug")

    policies.validator = bug
    with pytest.raises(PolicyError, match="could not be loaded: KeyError"):
        policies.reload()
    assert any(record.exc_info for record in caplog.records if "reload failed" in record.getMessage())


@pytest.mark.anyio
async def test_aclose_stays_idempotent_when_a_first_aclose_is_cancelled(tmp_path: Path) -> None:
    """A shutdown deadline that cancels aclose() while a reload runs in its thread: a later aclose() returns."""
    slow = _SlowReloads(tmp_path, 0.5)
    await slow.next()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(slow.watcher.aclose(), 0.05)
    await slow.watcher.aclose()
    await slow.watcher.aclose()


class _Panic(BaseException):
    """Like pyo3's PanicException, which the CEL runtime raises: a BaseException, not an Exception."""


@pytest.mark.anyio
async def test_a_base_exception_while_reloading_is_a_failed_reload_and_the_watcher_lives_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A panic of the CEL runtime while loading ended the watcher's task silently: later good edits never loaded."""
    from guard.policy import loader

    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(version="1", threshold=0.9), 0)
    policies = load_files(path)
    real = loader.load_files

    def panics(*sources: object) -> object:
        if "0.5" in path.read_text():
            raise _Panic("Formatting argument out of range")
        return real(*sources)  # type: ignore[arg-type]

    monkeypatch.setattr(loader, "load_files", panics)
    watcher = PolicyWatcher(policies, interval_s=0.02)
    watcher.start()
    try:
        _write(path, POLICY.format(version="2", threshold=0.5), 1)
        for _ in range(200):
            if watcher.failures:
                break
            await asyncio.sleep(0.01)
        assert watcher.failures == 1 and watcher.alive and policies["p"].version == "1"
        assert "could not be loaded: _Panic: Formatting argument out of range" in (watcher.last_error or "")
        _write(path, POLICY.format(version="3", threshold=0.9), 2)
        for _ in range(200):
            if policies["p"].version == "3":
                break
            await asyncio.sleep(0.01)
        assert policies["p"].version == "3" and watcher.alive
    finally:
        await watcher.aclose()


@pytest.mark.anyio
async def test_health_says_starting_until_the_watcher_is_started_and_dead_once_its_task_ended(tmp_path: Path) -> None:
    from guard.engine import Guard
    from guard.engine.health import health_report
    from tests._backends import ScriptedBackend

    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(version="1", threshold=0.9), 0)
    guard = Guard(load_files(path), backends=ScriptedBackend())
    watcher = PolicyWatcher(guard.policies, interval_s=0.05)
    before = health_report(guard, watcher=watcher)
    watcher.start()
    running = health_report(guard, watcher=watcher)
    await watcher.aclose()
    ended = health_report(guard, watcher=watcher)
    await guard.aclose()
    # not started yet is not a task that ended: reported like a backend still starting (not ready yet)
    assert (before["checks"]["policy_watcher"], before["status"], before["ready"]) == ("starting", "failing", False)
    assert (running["checks"]["policy_watcher"], running["status"], running["ready"]) == ("ok", "ok", True)
    assert (ended["checks"]["policy_watcher"], ended["status"]) == ("watcher_dead", "degraded")
