"""``python -m guard.compact.data SRC OUT`` on broken input: one line naming the file (and line and field), exit 2,
never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard.compact import data
from guard.compact.data import main

FIRST = Path("prompt_injection") / "garak_probes.jsonl"  # the first file build_splits reads


def _source(tmp_path: Path, content: bytes) -> Path:
    root = tmp_path / "data"
    (root / FIRST).parent.mkdir(parents=True)
    (root / FIRST).write_bytes(content)
    return root


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_a_missing_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _run([str(tmp_path / "nowhere"), str(tmp_path / "out")], capsys)
    assert "nowhere" in err and "not a folder" in err
    assert not (tmp_path / "out").exists()


def test_a_missing_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "data").mkdir()
    err = _run([str(tmp_path / "data"), str(tmp_path / "out")], capsys)
    assert str(FIRST) in err and "cannot read" in err


@pytest.mark.parametrize(("content", "line", "what"), [
    (b'{"id": "a", "text": "hi", "label": "benign"}\n{"id": "b", "text": \n', 2,
     "not valid JSON: Expecting value (column 21)"),
    (b'{"id": "a", "text": "hi', 1, "not valid JSON: Unterminated string starting at (column 21)\n"),
    (b'{"id": "a", "text": "hi", "label": "benign"}\n\n{"id": "b", "text": "caf\xe9", "label": "benign"}\n', 3,
     "not UTF-8"),
    (b'{"id": "a", "text": "hi", "label": "benign"}\n{"text": "hi", "label": "benign"}\n', 2, "no 'id' field"),
    (b'["id", "text"]\n', 1, "not a JSON object"),
])  # fmt: skip
def test_a_bad_line_is_named_with_its_file_and_line(content: bytes, line: int, what: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root = _source(tmp_path, content)
    err = _run([str(root), str(tmp_path / "out")], capsys)
    assert f"{root / FIRST}:{line}: {what}" in err


def test_rows_read_as_before(tmp_path: Path) -> None:
    """Lines end as text mode ends them (``\\r\\n`` and a lone ``\\r`` too); a line separator inside a string is
    not a line end."""
    path = tmp_path / "r.jsonl"
    path.write_bytes('{"id": 1, "text": "a\u2028b"}\r\n\n{"id": 2}\r{"id": 3}'.encode())
    rows = data._rows(path)
    assert rows == [{"id": 1, "text": "a\u2028b"}, {"id": 2}, {"id": 3}]
