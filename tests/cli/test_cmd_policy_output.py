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



@pytest.mark.parametrize("char", ["\u034f", "\ufe0f", "\u180b", "\u3164", "\u115f", "\u1160", "\uffa0",
                                  "\u200c", "\u200d", "\u00ad", "\U000e0067"])
def test_every_default_ignorable_character_is_escaped_in_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], char: str
) -> None:
    """Variation selectors, the combining grapheme joiner and the Hangul fillers are no format characters (Unicode Cf)
    and were printed as they are, so ``default`` with one after it read as a known key."""
    (tmp_path / "p.yaml").write_text(POLICY.replace("}]}", f"}}], defa\u00e9{char}\u00e9ult: allow}}"),
                                     encoding="utf-8")
    assert main(["policy", "check", str(tmp_path / "p.yaml")]) == 1
    err = capsys.readouterr().err
    escaped = char.encode("unicode_escape").decode()  # \\xad, \\u034f, \\U000e0067
    assert char not in err and f"policies[0].defa\u00e9{escaped}\u00e9ult: unknown key" in err


def test_free_text_keeps_the_joiners_words_and_emoji_need_and_every_line_is_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A case name in Persian or Devanagari (a zero-width non-joiner or joiner between letters), an emoji ZWJ
    sequence, a subdivision flag (tag characters) or a soft hyphen in a word was printed with escapes; the overlap
    line and the upper-case path and unknown method warnings printed a file name's bidi override as it is."""
    name = ("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 \u0915\u094d\u200d\u0937 "
            "\U0001f468\u200d\U0001f469\u200d\U0001f467 \u2764\ufe0f\u200d\U0001f525 "
            "\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f Zucker\u00adwatte")
    (tmp_path / "p.yaml").write_text(POLICY)
    (tmp_path / "p_test.yaml").write_text(f'cases:\n  - name: "{name}"\n'
                                          "    input: {http: {method: POST, path: /x/a}}\n    expect: {action: allow}\n",
                                          encoding="utf-8")
    assert main(["policy", "test", str(tmp_path / "p.yaml")]) == 1
    assert f": {name}\n" in capsys.readouterr().err
    (tmp_path / "p_test.yaml").write_text('cases:\n  - name: "a\u200cb \u200d\u0645 a\ufe0f \U000e0067"\n'
                                          "    input: {http: {method: POST, path: /x/a}}\n    expect: {action: allow}\n",
                                          encoding="utf-8")
    assert main(["policy", "test", str(tmp_path / "p.yaml")]) == 1
    assert ": a\\u200cb \\u200d\u0645 a\\ufe0f \\U000e0067\n" in capsys.readouterr().err
    (tmp_path / "p_test.yaml").unlink()
    (tmp_path / "a\u202egpj.yaml").write_text(POLICY.replace("id: p,", "id: q,").replace("['/x/**']", "['/X/**']")
                                              .replace("http: {", "http: {methods: [POTS], "), encoding="utf-8")
    assert main(["policy", "check", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "\u202e" not in out + err and out.count("a\\u202egpj.yaml") == 2  # its ok line, the overlap line
    assert err.count("a\\u202egpj.yaml") == 2  # the upper-case path and the unknown method warnings

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


@pytest.mark.parametrize("encoding", ["latin-1", "ascii"])
@pytest.mark.parametrize("argv", [["test", "--format", "junit"], ["test", "--format", "json"], ["reference"]])
def test_reports_on_stdout_are_utf_8_whatever_the_locale_encoding(
    encoding: str, argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report redirected to a file under a Windows code page, Latin-1 or ASCII was written in that encoding (an
    XML file declaring UTF-8 holding Latin-1 bytes does not parse) or stopped with a traceback on a character it
    lacks; JSON, JUnit, the schema and the reference are UTF-8."""
    import io
    import json
    import xml.etree.ElementTree as ET

    (tmp_path / "p.yaml").write_text(POLICY)
    (tmp_path / "p_test.yaml").write_text("cases:\n  - name: café ≥ 1\n    input: {http: {path: /x/a}}\n"
                                          "    expect: {action: block}\n", encoding="utf-8")
    stdout = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    monkeypatch.setattr("sys.stdout", stdout)
    assert main(["policy", *argv, *([str(tmp_path)] if argv[0] == "test" else [])]) == 0
    stdout.flush()
    text = stdout.buffer.getvalue().decode("utf-8")
    if argv[-1] == "junit":
        assert ET.fromstring(text.encode("utf-8")).find(".//testcase").get("name") == "café ≥ 1"
    elif argv[-1] == "json":
        assert json.loads(text)["results"][0]["name"] == "café ≥ 1"
    else:
        assert "≥" in text


@pytest.mark.parametrize("argv", [["test", "--format", "junit"], ["test", "--format", "json"], ["reference"],
                                  ["schema"]])
def test_reports_with_stdout_closed_are_no_traceback(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started with stdout closed (``>&-``), Python has no ``sys.stdout``: the schema and the reference stopped with
    a traceback; like the text output, nothing is written and the exit status is the command's."""
    (tmp_path / "p.yaml").write_text(POLICY)
    (tmp_path / "p_test.yaml").write_text("cases:\n  - name: a\n    input: {http: {path: /x/a}}\n"
                                          "    expect: {action: block}\n")
    monkeypatch.setattr("sys.stdout", None)
    assert main(["policy", *argv, *([str(tmp_path)] if argv[0] == "test" else [])]) == 0


@pytest.mark.parametrize("argv", [["test", "-v"], ["check"], ["explain"]])
def test_text_reports_escape_what_the_locale_encoding_lacks(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A case name, a file name or a state value outside the locale's encoding (ASCII, a Windows code page when
    stdout is a file) stopped the text report with a traceback; like stderr, stdout writes it escaped."""
    import io
    import json

    folder = tmp_path / "café"
    folder.mkdir()
    (folder / "p.yaml").write_text(POLICY)
    (folder / "p_test.yaml").write_text("cases:\n  - name: café ≥ 1\n    input: {http: {path: /x/a}}\n"
                                        "    expect: {action: block}\n", encoding="utf-8")
    (tmp_path / "in.json").write_text(json.dumps({"http": {"path": "/x/Привет"}}))
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr("sys.stdout", stdout)
    where = [str(folder / "p.yaml"), "--input", str(tmp_path / "in.json")] if argv == ["explain"] else [str(folder)]
    assert main(["policy", *argv, *where]) == 0
    stdout.flush()
    out = stdout.buffer.getvalue().decode("ascii")
    assert {"test": "PASS", "check": "ok", "explain": "verdict    block"}[argv[0]] in out
    assert "caf\\xe9" in out


def test_explain_json_is_utf_8_whatever_the_locale_encoding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file name outside ASCII stopped ``explain --json`` with a traceback under ASCII (or was Latin-1 bytes)."""
    import io
    import json

    (tmp_path / "café.yaml").write_text(POLICY)
    (tmp_path / "in.json").write_text(json.dumps({"http": {"path": "/x/a"}}))
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr("sys.stdout", stdout)
    assert main(["policy", "explain", str(tmp_path / "café.yaml"), "--input", str(tmp_path / "in.json"), "--json"]) == 0
    stdout.flush()
    report = json.loads(stdout.buffer.getvalue().decode("utf-8"))
    assert report["policy"]["file"] == str(tmp_path / "café.yaml")
