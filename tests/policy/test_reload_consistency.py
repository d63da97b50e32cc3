"""Loading and reloading a set of policy files that change while they are read (a ConfigMap update landing during
start-up or during a reload), how a reload is logged, and the cap on the problems one load collects."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from guard.errors import PolicyError
from guard.policy import PolicyLoadError, PolicySet, load_files, load_text, loader
from guard.policy.watch import PolicyWatcher

POLICY = """\
policies:
  - id: {pid}
    version: "{version}"
    match: {{http: {{paths: ["/{pid}"]}}}}
    rules: [{{id: r, when: "true", action: allow}}]
    default: allow
"""


def _write(path: Path, text: str, bump: int) -> None:
    path.write_text(text)
    stamp = path.stat().st_mtime_ns + bump * 1_000_000_000
    os.utime(path, ns=(stamp, stamp))  # a distinct mtime even on coarse clocks


class _ConfigMap:
    """A Kubernetes ConfigMap volume: ``a.yaml -> ..data/a.yaml``, ``..data -> ..vN``; an update swaps ``..data``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0
        self.swap()
        for name in ("a.yaml", "b.yaml"):
            os.symlink(f"..data/{name}", root / name)

    def swap(self) -> None:
        self.version += 1
        folder = self.root / f"..v{self.version}"
        folder.mkdir()
        for pid in ("a", "b"):
            (folder / f"{pid}.yaml").write_text(POLICY.format(pid=pid, version=self.version))
        os.symlink(folder.name, self.root / "..tmp")
        os.replace(self.root / "..tmp", self.root / "..data")

    @property
    def paths(self) -> tuple[Path, Path]:
        return self.root / "a.yaml", self.root / "b.yaml"


def _versions(policies: PolicySet) -> set[str]:
    return {policy.version for policy in policies}


def test_a_change_landing_between_the_load_and_the_watcher_is_loaded(tmp_path: Path) -> None:
    """The watcher starts from the files as they were read, not as they are when it is created."""
    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(pid="p", version="1"), 0)
    policies = load_files(path)
    _write(path, POLICY.format(pid="p", version="2"), 1)  # lands while the proxy is still starting
    watcher = PolicyWatcher(policies, interval_s=1)
    watcher.check()
    watcher.check()
    assert policies["p"].version == "2" and watcher.reloads == 1
    assert watcher.check() is False  # and then it is known loaded


def test_a_symlink_swap_during_a_load_is_not_served_as_a_mix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    volume = _ConfigMap(tmp_path)
    real_read = loader.read_policy_file
    pending = [True]

    def read_then_swap(path: str | Path) -> bytes:
        raw = real_read(path)
        if Path(path).name == "a.yaml" and pending:  # an update lands right after a.yaml was read
            pending.pop()
            volume.swap()
        return raw

    monkeypatch.setattr(loader, "read_policy_file", read_then_swap)
    policies = load_files(*volume.paths)
    assert _versions(policies) == {"2"}  # never a.yaml from v1 and b.yaml from v2
    assert policies.stamps == tuple(loader.file_stamp(path) for path in volume.paths)

    pending.append(True)
    policies.reload()  # an update lands during the reload
    assert _versions(policies) == {"3"} and not pending


def test_files_that_keep_changing_fail_the_reload_and_keep_the_last_good_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    volume = _ConfigMap(tmp_path)
    policies = load_files(*volume.paths)
    real_read = loader.read_policy_file

    def read_then_swap(path: str | Path) -> bytes:
        raw = real_read(path)
        volume.swap()
        return raw

    monkeypatch.setattr(loader, "read_policy_file", read_then_swap)
    monkeypatch.setattr(loader, "_RETRY_WAIT_S", 0.0, raising=False)
    with pytest.raises(PolicyError, match="changed while the policy files were being read") as caught:
        policies.reload()
    assert caught.value.file == str(volume.paths[0])
    assert _versions(policies) == {"1"} and policies.reload_failures == 1
    with pytest.raises(PolicyLoadError, match="changed while"):
        load_files(*volume.paths)


def test_a_reload_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(pid="p", version="1"), 0)
    policies = load_files(path)
    watcher = PolicyWatcher(policies, interval_s=1)
    caplog.set_level(logging.DEBUG, logger="guard.policy")

    _write(path, POLICY.format(pid="p", version="2"), 1)
    assert watcher.check() is False and watcher.check() is True
    reloaded = [r for r in caplog.records if r.levelno >= logging.INFO and "reloaded" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in reloaded] == [
        (logging.INFO, f"policies reloaded: p@2 digest {policies['p'].digest}")]


def test_a_failed_reload_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.yaml"
    _write(path, POLICY.format(pid="p", version="1"), 0)
    watcher = PolicyWatcher(load_files(path), interval_s=1)
    caplog.set_level(logging.DEBUG, logger="guard.policy")
    _write(path, POLICY.format(pid="p", version="3") + "    bogus: 1\n", 2)
    assert watcher.check() is False and watcher.check() is False
    failed = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(failed) == 1, [r.getMessage() for r in failed]
    assert f"{path}:7 at policies[0].bogus" in failed[0].getMessage()
    assert watcher.failures == 1 and "bogus" in str(watcher.last_error)


def test_the_problems_of_one_load_are_capped(tmp_path: Path) -> None:
    text = POLICY.format(pid="p", version="1") + "".join(f"    zz{i}: 1\n" for i in range(500))
    with pytest.raises(PolicyLoadError) as caught:
        load_text(text, "wide.yaml")
    problems = caught.value.problems
    assert len(problems) == 51  # the first 50 (loader.MAX_PROBLEMS), then how many more
    assert problems[0].key == "policies[0].zz0" and problems[0].line == 7
    assert problems[-1].reason == "... and 450 more errors"
    assert str(caught.value).endswith("(and 499 more)")
