"""``guard tiny``: a tiny random Clef checkpoint from the command line, byte-identical to ``write_tiny_checkpoint``
for the same seed, loadable by ``guard decide``, and never written over existing files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guard.clef import write_tiny_checkpoint
from guard.cli import main

REQUEST = {
    "model": "clef-flash",
    "state": {"ticket": "Card charged twice. Refund today or I cancel."},
    "questions": {"churn_risk": {"type": "noul", "instructions": "Does the customer threaten to leave?"}},
}


def _files(root: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(root.iterdir())}


def test_writes_the_same_checkpoint_as_the_api_and_guard_decide_loads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "empty"
    target.mkdir()  # an existing empty directory is fine
    assert main(["tiny", str(target), "--seed", "1"]) == 0
    assert capsys.readouterr().out == f"wrote a tiny Clef checkpoint (text-only, seed 1) to {target}\n"
    reference = write_tiny_checkpoint(tmp_path / "api", seed=1)
    assert _files(target) == _files(reference) and "processor_config.json" not in _files(target)
    request = tmp_path / "request.json"
    request.write_text(json.dumps(REQUEST))
    assert main(["decide", "--model", str(target), str(request)]) == 0
    answer = json.loads(capsys.readouterr().out)["answers"]["churn_risk"]
    assert answer["type"] == "noul" and 0.0 <= answer["noul"] <= 1.0


def test_vision_adds_the_processor_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "new" / "clef-tiny-vl"  # parents are created
    assert main(["tiny", str(target), "--vision"]) == 0
    assert "with a vision tower, seed 0" in capsys.readouterr().out
    processor = json.loads((target / "processor_config.json").read_text())
    assert processor["processor_class"] == "Qwen3VLProcessor"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "--seed must be an integer from 0 to"),
        (["--seed", str(2**63)], "--seed must be an integer from 0 to"),
    ],
)
def test_bad_seeds_are_one_line(argv: list[str], message: str, tmp_path: Path, capsys) -> None:
    assert main(["tiny", str(tmp_path / "t"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"guard tiny: {message}") and err.count("\n") == 1
    assert not (tmp_path / "t").exists()


def test_existing_files_are_never_written_over(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    release = tmp_path / "clef-flash"
    release.mkdir()
    (release / "config.json").write_text('{"real": true}')
    assert main(["tiny", str(release)]) == 2
    assert capsys.readouterr().err == (
        f"guard tiny: {release} is not empty; give a new or empty directory (a checkpoint is never written over "
        "files)\n"
    )
    assert _files(release) == {"config.json": b'{"real": true}'}
    a_file = tmp_path / "notes.txt"
    a_file.write_text("n")
    assert main(["tiny", str(a_file)]) == 2
    assert capsys.readouterr().err == f"guard tiny: {a_file} exists and is not a directory\n"
    assert main(["tiny", str(a_file / "below")]) == 2
    assert "guard tiny: cannot write" in capsys.readouterr().err


def test_ctrl_c_while_a_command_runs_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from guard.cli import cmd_tiny, main

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cmd_tiny, "run", interrupted)
    assert main(["tiny", str(tmp_path / "t")]) == 130
    assert capsys.readouterr().err == "guard: interrupted\n"


def test_output_to_a_reader_that_went_away_ends_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``guard policy test policies --format json | head -c 400`` ended in a BrokenPipeError traceback (new-user
    trial): a command whose reader went away stops quietly, as Unix tools do."""
    from guard.cli import cmd_tiny, main

    def reader_gone(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cmd_tiny, "run", reader_gone)
    assert main(["tiny", str(tmp_path / "t")]) == 1
    assert capsys.readouterr().err == ""
