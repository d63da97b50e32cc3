"""``expand_policy_paths``: files, folders and globs name policy files by one rule, once each, in finite time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from guard.cli import main
from guard.devtools.testing import expand_policy_paths, run_test_file
from guard.errors import PolicyError

POLICIES = Path(__file__).resolve().parents[2] / "policies"


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "p"
    folder.mkdir()
    shutil.copy(POLICIES / "support_routing.yaml", folder)
    shutil.copy(POLICIES / "support_routing_test.yaml", folder)
    return folder


def test_a_glob_does_not_follow_a_folder_linked_back_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With s/a -> . and s/b -> ., glob.glob('s/**/*.yaml') walked a/b/a/b/... until ELOOP: minutes at 100% CPU, and
    one link loaded the same file ~41 times, each a misleading "policy id ... is already defined"."""
    folder = _folder(tmp_path)
    os.symlink(".", folder / "a")
    os.symlink(".", folder / "b")
    found = expand_policy_paths([f"{folder}/**/*.yaml"])
    assert list(found) == [folder / "support_routing.yaml"]
    assert main(["policy", "check", f"{folder}/**/*.yaml"]) == 0
    assert "already defined" not in capsys.readouterr().err
    assert main(["policy", "test", f"{folder}/**/*_test.yaml"]) == 0


def test_one_file_reached_twice_is_kept_once_as_first_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (tmp_path / "link").symlink_to(folder)
    first = folder / "support_routing.yaml"
    assert list(expand_policy_paths([str(first), str(tmp_path / "link"), f"{tmp_path}/link/*.yaml"])) == [first]
    assert list(expand_policy_paths([str(tmp_path / "link")])) == [tmp_path / "link" / "support_routing.yaml"]


def test_a_glob_keeps_policy_files_and_expands_folders_as_a_folder_argument_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """'policies/*' checked the two .schema.json files as policies, and a folder it matched was 'a folder' error."""
    folder = _folder(tmp_path)
    (folder / "notes.txt").write_text("not a policy")
    (folder / "guard-policy.schema.json").write_text("{}")
    sub = folder / "sub"
    sub.mkdir()
    shutil.copy(POLICIES / "tool_call_guard.yaml", sub)
    assert list(expand_policy_paths([f"{folder}/*"])) == list(expand_policy_paths([str(folder)])) == [
        folder / "sub" / "tool_call_guard.yaml", folder / "support_routing.yaml"]
    assert main(["policy", "check", f"{folder}/*"]) == 0
    assert main(["policy", "check", str(POLICIES / "*")]) == 0  # the shipped folder holds schema files
    capsys.readouterr()
    assert main(["policy", "check", f"{folder}/*.txt"]) == 1
    assert "no file matches (no *.yaml or *.yml file)" in capsys.readouterr().err


def test_a_symlink_loop_is_named_not_a_traceback(tmp_path: Path) -> None:
    """``l1.yaml -> l2.yaml -> l1.yaml`` raised RuntimeError out of ``guard policy check`` (attack finding)."""
    (tmp_path / "l1.yaml").symlink_to("l2.yaml")
    (tmp_path / "l2.yaml").symlink_to("l1.yaml")
    with pytest.raises(FileNotFoundError, match="l1.yaml: a symlink loop"):
        expand_policy_paths([str(tmp_path / "l1.yaml")])


@pytest.mark.parametrize("make", ["fifo", "dangling", "loop"])
def test_an_entry_named_yaml_that_is_not_a_readable_file_is_reported_not_skipped(
    tmp_path: Path, make: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO, a dangling symlink or a symlink loop named *.yaml in a folder (or matched by a glob) was left out, and
    policy check and policy test passed as if the folder held only its readable files."""
    folder = _folder(tmp_path)
    bad = folder / "broken.yaml"
    if make == "fifo":
        os.mkfifo(bad)
    elif make == "dangling":
        bad.symlink_to(folder / "missing.yaml")
    else:
        bad.symlink_to(folder / "other.yaml")
        (folder / "other.yaml").symlink_to(bad)
    (folder / "d.yaml").mkdir()  # a folder so named is still not a policy file
    for name in (str(folder), f"{folder}/*.yaml"):
        if make == "loop":
            with pytest.raises(FileNotFoundError, match="broken.yaml: a symlink loop"):
                expand_policy_paths([name])
        else:
            assert bad in expand_policy_paths([name]) and folder / "d.yaml" not in expand_policy_paths([name])
        for command in ("check", "test"):
            assert main(["policy", command, name]) != 0
            assert "broken.yaml" in capsys.readouterr().err


def test_hidden_names_are_left_out_of_folders_and_globs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An editor's lock file (``.#x.yaml``, a dangling symlink) or a hidden folder's file made policy check and policy
    test of the folder fail; a FIFO or dangling link with an ordinary name is still reported (test above)."""
    folder = _folder(tmp_path)
    (folder / ".#support_routing.yaml").symlink_to("user@host.1234:1700000000")
    hidden = folder / ".trash"
    hidden.mkdir()
    (hidden / "old.yaml").write_text("not: [a policy")
    expected = [folder / "support_routing.yaml"]
    for name in (str(folder), f"{folder}/*.yaml", f"{folder}/**/*.yaml", f"{folder}/*"):
        assert list(expand_policy_paths([name])) == expected
        for command in ("check", "test"):
            assert main(["policy", command, name]) == 0, capsys.readouterr().err
    lock = folder / ".#support_routing.yaml"
    assert list(expand_policy_paths([str(lock)])) == [lock]  # a file named itself is still taken


def _failing_case(test_file: Path) -> None:
    test_file.write_text("cases:\n  - name: wrong on purpose\n    input: {http: {method: POST, path: /support/tickets, "
                         "body: {text: x}}}\n    answers: {queue: billing}\n    expect: {action: escalate}\n")


def test_a_test_file_is_found_beside_any_spelling_and_with_either_suffix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An alias (active.yaml -> x.yaml) sorted first was the spelling kept and its test file, looked for beside it
    only, was missing: the failing x_test.yaml never ran, exit 0; x_test.yml beside x.yaml was not looked for."""
    folder = tmp_path / "p"
    folder.mkdir()
    shutil.copy(POLICIES / "support_routing.yaml", folder / "x.yaml")
    _failing_case(folder / "x_test.yaml")
    (folder / "active.yaml").symlink_to("x.yaml")
    assert main(["policy", "test", str(folder)]) == 1
    assert main(["policy", "test", str(folder / "active.yaml")]) == 1  # beside the file it links to
    assert f"FAIL {folder / 'x_test.yaml'}:2: wrong on purpose" in capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere.yaml"  # two links to a file outside: kept once, as first named
    shutil.copy(folder / "x.yaml", elsewhere)
    (folder / "x.yaml").unlink()
    (folder / "x.yaml").symlink_to(elsewhere)
    for name in (folder, folder / "active.yaml"):  # x_test.yaml is beside a link on the way
        assert expand_policy_paths([str(name)]) == {folder / "active.yaml": [folder / "x_test.yaml"]}
    (folder / "x_test.yaml").rename(folder / "x_test.yml")
    assert main(["policy", "test", str(folder / "x.yaml")]) == 1
    assert main(["policy", "test", str(folder)]) == 1
    assert main(["policy", "check", str(folder)]) == 0
    out, err = capsys.readouterr()
    assert err.count(f"FAIL {folder / 'x_test.yml'}:2: wrong on purpose") == 2 and "cannot read" not in err
    assert f"ok {folder / 'x_test.yml'}: 1 case" in out


def test_a_test_file_without_its_policy_file_is_reported_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was ``x.yaml: cannot read file``, naming a file the user never wrote."""
    _failing_case(tmp_path / "x_test.yaml")
    for command in ("check", "test"):
        assert main(["policy", command, str(tmp_path)]) == 1
        assert f"{tmp_path / 'x_test.yaml'}: no policy file x.yaml (or .yml) beside it" in capsys.readouterr().err


def test_every_test_file_of_a_policy_file_runs_and_a_named_one_runs_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of two test files for one policy file (x_test.yaml and x_test.yml, or through an alias) only the first found
    was read, even the other one named: a failing case in it passed (exit 0), and check printed ``ok`` for the other
    file, or the alias's target's test file as an absolute resolved path."""
    monkeypatch.chdir(tmp_path)
    for folder in (Path("both"), Path("al")):
        folder.mkdir()
        shutil.copy(POLICIES / "support_routing.yaml", folder / "x.yaml")
    passing = Path("both/x_test.yaml")
    shutil.copy(POLICIES / "support_routing_test.yaml", passing)  # 6 cases
    _failing_case(Path("both/x_test.yml"))
    assert main(["policy", "test", "both"]) == main(["policy", "test", "both/x.yaml"]) == 1
    assert main(["policy", "test", "both/x_test.yml"]) == 1
    assert main(["policy", "test", "both/x_test.yaml"]) == 0
    out, err = capsys.readouterr()
    assert err.count("FAIL both/x_test.yml:2: wrong on purpose") == 3 and "x_test.yaml" not in err
    assert out.count("6 passed, 1 failed") == 2 and "0 passed, 1 failed" in out and "6 passed, 0 failed" in out
    assert main(["policy", "check", "both/x_test.yml"]) == 0
    assert "ok both/x_test.yml: 1 case" in (out := capsys.readouterr().out) and "x_test.yaml" not in out
    with pytest.raises(PolicyError, match=r"both/x.yaml: has 2 test files: both/x_test.yaml, both/x_test.yml"):
        run_test_file("both/x.yaml")
    Path("al/active.yaml").symlink_to("x.yaml")
    shutil.copy(passing, "al/active_test.yaml")
    _failing_case(Path("al/x_test.yaml"))
    assert main(["policy", "test", "al"]) == main(["policy", "test", "al/active.yaml"]) == 1
    out, err = capsys.readouterr()
    assert err.count("FAIL al/x_test.yaml:2: wrong on purpose") == 2 and out.count("6 passed, 1 failed") == 2
    Path("al/active_test.yaml").unlink()
    assert main(["policy", "check", "al/active.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok al/active.yaml: 1 policy (") and "\nok al/x_test.yaml: 1 case\n" in out
