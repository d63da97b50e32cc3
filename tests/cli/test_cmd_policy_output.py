"""``guard policy check|test`` output: what is printed for each file and case."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard.cli import main
from guard.policy import load_text

POLICY = "policies:\n  - {id: p, version: 1, match: {http: {paths: ['/x/**']}}, rules: [{id: r, when: 'true', action: block}]}\n"


def test_check_prints_no_ok_for_a_file_whose_policy_id_is_already_defined(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "p.yaml").write_text(POLICY)
    (tmp_path / "p.yml").write_text(POLICY)
    assert main(["policy", "check", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    (policy,) = load_text(POLICY)
    assert out.splitlines() == [f"ok {tmp_path / 'p.yaml'}: 1 policy ({policy.label})"]
    assert f"{tmp_path / 'p.yml'}:2: policies[0].id: policy id 'p' is already defined in {tmp_path / 'p.yaml'}:2" in err


def test_check_reports_a_duplicate_id_in_each_file_that_repeats_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("a.yaml", "b.yaml", "c.yaml"):
        (tmp_path / name).write_text(POLICY)
    assert main(["policy", "check", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out.count("ok ") == 1 and err.count("is already defined in") == 2


def test_test_escapes_control_characters_in_text_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.yaml").write_text(POLICY)
    (tmp_path / "p_test.yaml").write_text(
        'cases:\n  - name: "ctl \\x01\\x1b[31m \\u009b name"\n'
        '    input: {http: {method: POST, path: /x/a}}\n    expect: {action: allow, rule: "x\\x02"}\n'
    )
    assert main(["policy", "test", str(tmp_path / "p.yaml")]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x01" not in err and "\x9b" not in err
    assert ": ctl \\x01\\x1b[31m \\x9b name\n" in err
    assert "rule: expected 'x\\x02', got 'r'" in err


def test_invisible_characters_are_escaped_in_text_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A zero-width space in a key was printed as it is (``policies[0].default: unknown key``, the key looking like a
    known one); format characters (Unicode Cf: zero-width, bidi controls, U+FEFF) are escaped as control ones are."""
    (tmp_path / "p.yaml").write_text(POLICY.replace("}]}", "}], default\u200b: allow}"), encoding="utf-8")
    assert main(["policy", "check", str(tmp_path / "p.yaml")]) == 1
    err = capsys.readouterr().err
    assert "\u200b" not in err and "policies[0].default\\u200b: unknown key" in err
    (tmp_path / "p.yaml").write_text(POLICY)
    (tmp_path / "p_test.yaml").write_text('cases:\n  - name: "a \\u202eb\\ufeff c\\u2028 d\\u00e9"\n'
                                          "    input: {http: {method: POST, path: /x/a}}\n    expect: {action: allow}\n")
    assert main(["policy", "test", str(tmp_path / "p.yaml")]) == 1
    assert ": a \\u202eb\\ufeff c\\u2028 d\u00e9\n" in capsys.readouterr().err  # a letter is shown as it is


def test_a_lone_surrogate_in_a_case_name_is_a_load_error_printed_in_text_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A YAML ``"\\ud800"`` in a case name stopped ``-v`` and ``--format json`` with a UnicodeEncodeError on a real
    stdout, leaving CI an empty report (attack finding). Only a case's ``input.agent`` may hold one now: elsewhere it
    is a load error naming file, line and key, printed without the surrogate."""
    import json

    (tmp_path / "p.yaml").write_text(POLICY)
    (tmp_path / "p_test.yaml").write_text(
        'cases:\n  - name: "odd \\ud800 name"\n    input: {http: {method: POST, path: /x/a}}\n'
        '    expect: {action: block}\n'
    )
    assert main(["policy", "test", str(tmp_path / "p.yaml"), "-v"]) == 1
    err = capsys.readouterr().err
    assert "\ud800" not in err and f"{tmp_path / 'p_test.yaml'}:2: cases[0].name: the value holds U+D800" in err
    assert main(["policy", "test", str(tmp_path / "p.yaml"), "--format", "json"]) == 1
    out = capsys.readouterr().out
    assert "\ud800" not in out
    assert [(e["line"], e["key"]) for e in json.loads(out)["errors"]] == [(2, "cases[0].name")]
