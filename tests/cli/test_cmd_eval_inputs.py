"""``guard eval`` on hostile or broken inputs and outputs: every fault is an error naming the file (and line), never
a traceback, a lost report, an overwritten data file or a partial run reported as a success. A fake backend stands
in for the model, so no weights are loaded."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from guard.cli import main
from guard.errors import UnsupportedQuestion

NOUL = {"guard.prompt_injection": {"type": "noul"}}


def record(state: Any = "hello", label: Any = "true", **extra: Any) -> dict[str, Any]:
    return {"state": state, "questions": NOUL, "labels": {"guard.prompt_injection": label}, **extra}


def write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


class FakeBackend:
    """Answers every noul question with P(true) 0.7 (other questions uniformly); refuses a request whose state is the string ``"refuse"``."""

    name = "fake"
    model_revision = "0"

    def __init__(self) -> None:
        self.asked = 0

    async def decide(self, request: Any, timeout: float | None = None) -> Any:
        self.asked += 1
        if request.state == "refuse":
            raise UnsupportedQuestion("custom", "fake", "not a catalog question")
        return SimpleNamespace(answers={q.id: SimpleNamespace(probabilities=self.probabilities(q))
                                        for q in request.questions})

    @staticmethod
    def probabilities(question: Any) -> dict[str, float]:
        if question.type == "noul":
            return {"true": 0.7, "false": 0.3}
        ids = [option_id for option_id, _ in question.options()]
        return dict.fromkeys(ids, 1 / len(ids))

    async def aclose(self) -> None:
        pass


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    fake = FakeBackend()
    monkeypatch.setattr("guard.cli.cmd_eval.open_eval_backend", lambda args: fake)
    return fake


def test_the_report_never_overwrites_a_data_file(tmp_path: Path, backend: FakeBackend,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    data = write(tmp_path / "victim.jsonl", [record(), record(label="false")])
    before = data.read_bytes()
    other = write(tmp_path / "other.jsonl", [record()])
    link = tmp_path / "link.jsonl"
    link.symlink_to(data)
    for target in (str(data), str(link), f"{tmp_path}/./victim.jsonl"):
        assert main(["eval", str(other), str(data), "--no-progress", "--json", target]) == 2
        err = capsys.readouterr().err
        assert "--json" in err and "victim.jsonl" in err and target in err
    assert data.read_bytes() == before and backend.asked == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_report_that_cannot_be_written_goes_to_stdout(tmp_path: Path, backend: FakeBackend,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    data = write(tmp_path / "d.jsonl", [record(), record(label="false")])
    assert main(["eval", str(data), "--no-progress", "--json", "/dev/full"]) == 1
    out, err = capsys.readouterr()
    assert "cannot write the JSON report to /dev/full" in err and "stdout" in err
    report = json.loads(out[out.index("{"):])
    assert report["records"] == 2 and report["questions"]["guard.prompt_injection"]["n"] == 2


def _hostile_lines() -> list[tuple[str, bytes, str]]:
    good = json.dumps(record()).encode()
    deep = b'{"state": ' + b"[" * 100_000 + b"]" * 100_000 + b', "questions": {"q": {"type": "noul"}}}'
    return [
        ("surrogate", b'{"state": "hi \\ud800 there", "questions": {"q": {"type": "noul"}}}', "surrogate"),
        ("deep", deep, "nest"),
        ("non-utf8", b'{"state": "caf\xff", "questions": {"q": {"type": "noul"}}}', "not valid UTF-8"),
        ("bigint", b'{"state": ' + b"9" * 5000 + b', "questions": {"q": {"type": "noul"}}}', "digits"),
        ("dup-key", b'{"state": "a", "state": "b", "questions": {"q": {"type": "noul"}}}', "duplicate key"),
        ("text-line", good.replace(b'"hello"', b'"\\udfff"'), "surrogate"),
    ]


@pytest.mark.parametrize(("name", "line", "message"), _hostile_lines(), ids=[c[0] for c in _hostile_lines()])
def test_hostile_records_are_errors_naming_file_and_line(
    name: str, line: bytes, message: str, tmp_path: Path, backend: FakeBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "h.jsonl"
    data.write_bytes(json.dumps(record()).encode() + b"\n" + line + b"\n")
    assert main(["eval", str(data), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:2:" in err and message in err and "Traceback" not in err
    assert backend.asked == 0


def test_text_label_line_with_a_lone_surrogate(tmp_path: Path, backend: FakeBackend,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "t.jsonl"
    data.write_bytes(b'{"text": "a", "label": "x"}\n{"text": "hi \\ud800", "label": "y"}\n')
    assert main(["eval", str(data), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:2:" in err and "surrogate" in err


@pytest.mark.skipif(sys.platform == "win32" or not os.path.exists("/dev/zero"), reason="needs /dev/zero and mkfifo")
def test_devices_and_fifos_are_refused_before_reading(tmp_path: Path, backend: FakeBackend,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "/dev/zero", "--no-progress"]) == 2  # read before: until memory ran out
    assert "/dev/zero" in (err := capsys.readouterr().err) and "not a regular file" in err
    fifo = tmp_path / "f.jsonl"
    os.mkfifo(fifo)
    assert main(["eval", str(fifo), "--no-progress"]) == 2  # opened without blocking: no writer, no hang
    assert "not a regular file" in capsys.readouterr().err


def test_a_file_over_the_size_cap_is_refused(tmp_path: Path, backend: FakeBackend,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("guard.compact.records.MAX_RECORDS_BYTES", 100)
    data = write(tmp_path / "big.jsonl", [record(), record(label="false")])
    assert main(["eval", str(data), "--no-progress"]) == 2
    assert "big.jsonl" in (err := capsys.readouterr().err) and "at most 100" in err


def test_any_refused_record_fails_the_run_and_keeps_the_report(tmp_path: Path, backend: FakeBackend,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = write(tmp_path / "p.jsonl", [record(), record("refuse"), record("refuse", label="false")])
    report_path = tmp_path / "r.json"
    assert main(["eval", str(data), "--no-progress", "--json", str(report_path)]) == 1  # was 0
    assert "refused 2 of 3 records" in capsys.readouterr().err
    report = json.loads(report_path.read_text())
    assert report["refused"] == 2 and report["questions"]["guard.prompt_injection"]["n"] == 1


def test_by_a_field_the_records_lack_warns(tmp_path: Path, backend: FakeBackend,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    data = write(tmp_path / "s.jsonl", [record(source="a"), record(label="false"), record()])
    assert main(["eval", str(data), "--no-progress", "--by", "source", "--json", str(tmp_path / "r.json")]) == 0
    assert "2 of 3 records have no 'source'" in capsys.readouterr().err
    assert main(["eval", str(data), "--no-progress", "--by", "fold", "--json", str(tmp_path / "r.json")]) == 0
    assert "3 of 3 records have no 'fold'" in capsys.readouterr().err


@pytest.mark.parametrize("row", [{"questions": NOUL, "labels": {}}, {"state": None, "questions": NOUL}])
def test_a_record_without_a_state_is_refused(row: dict[str, Any], tmp_path: Path, backend: FakeBackend,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    data = write(tmp_path / "n.jsonl", [record(), row])
    assert main(["eval", str(data), "--no-progress"]) == 2
    assert f"{data}:2:" in (err := capsys.readouterr().err) and "'state'" in err
    assert backend.asked == 0


def test_duplicate_ids_with_conflicting_labels_warn(tmp_path: Path, backend: FakeBackend,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = write(tmp_path / "d.jsonl", [record(id="r1"), record(id="r2"), record(id="r1", label="false"),
                                        record(id="r2")])
    assert main(["eval", str(data), "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert f"'r1' at {data}:1 and {data}:3" in err and "'r2'" not in err  # r2 repeats the same label: no warning


@pytest.mark.parametrize("label", [1, True, {"x": 1}, [1], "", None, 1.5])
def test_text_label_lines_need_a_non_empty_string_label(label: Any, tmp_path: Path, backend: FakeBackend,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``1`` and ``"1"``, ``true`` and ``"True"`` were merged into one option; objects became their Python repr."""
    data = write(tmp_path / "l.jsonl", [{"text": "a", "label": "1"}, {"text": "b", "label": "True"},
                                        {"text": "c", "label": label}])
    assert main(["eval", str(data), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:3:" in err and "non-empty string 'label'" in err and backend.asked == 0


@pytest.mark.parametrize("labels", [{}, None, "absent"])
def test_a_record_that_labels_nothing_warns_that_it_is_not_scored(labels: Any, tmp_path: Path, backend: FakeBackend,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    unlabelled = {"state": "x", "questions": NOUL} if labels == "absent" else {"state": "x", "questions": NOUL,
                                                                                "labels": labels}
    data = write(tmp_path / "u.jsonl", [record(), unlabelled, record(label="false")])
    assert main(["eval", str(data), "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert f"{data}:2" in err and "label no question" in err and "decided but not scored" in err
    assert backend.asked == 3


def test_data_files_are_checked_before_the_backend_opens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A misspelt data file was reported only after the backend had loaded (9.5 s for the compact model): here the
    backend would fail to open, so its error showing means the data file was not checked first."""
    good = write(tmp_path / "good.jsonl", [record()])
    missing = tmp_path / "missing.jsonl"
    assert main(["eval", str(good), str(missing), "--backend", f"local:{tmp_path / 'no-model'}"]) == 2
    assert capsys.readouterr().err == f"guard eval: {missing}: cannot read file: No such file or directory\n"
