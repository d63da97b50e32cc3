"""``guard policy schema|reference --check`` and ``guard policy explain --input|--answers`` read a bounded number of
bytes: a device, a FIFO or a huge file named there ran the process out of memory (``/dev/zero``)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from guard.cli import main
from guard.cli.cmd_policy import MAX_CHECK_BYTES, MAX_INPUT_BYTES
from tests.cli._streams import fed_fifo

POLICIES = Path(__file__).resolve().parents[2] / "policies"
SUBJECT = {"http": {"method": "POST", "path": "/v1/chat", "body": {"prompt": "hello"}}}


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)  # no disk, no memory: the size is what the reader must refuse before reading
    return path


@pytest.mark.parametrize("command", ["schema", "reference"])
def test_check_refuses_a_fifo_or_device_before_reading_it(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with fed_fifo(tmp_path, MAX_CHECK_BYTES + (1 << 20)) as fifo:
        assert main(["policy", command, "--check", str(fifo)]) == 1
    err = capsys.readouterr().err
    assert err == f"{fifo}: cannot read: it is a FIFO, socket or device, not a regular file\n"


@pytest.mark.parametrize("command", ["schema", "reference"])
def test_check_refuses_a_file_over_its_cap(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = _sparse(tmp_path / "big.json", MAX_CHECK_BYTES + 1)
    assert main(["policy", command, "--check", str(big)]) == 1
    assert capsys.readouterr().err == f"{big}: cannot read: file is {MAX_CHECK_BYTES + 1} bytes; at most {MAX_CHECK_BYTES}\n"


def test_check_still_reads_crlf_text_as_before(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    crlf = tmp_path / "schema.json"
    crlf.write_bytes((POLICIES / "guard-policy.schema.json").read_bytes().replace(b"\n", b"\r\n"))
    assert main(["policy", "schema", "--check", str(crlf)]) == 0
    assert capsys.readouterr().out == f"ok {crlf}\n"


@pytest.mark.parametrize("option", ["--input", "--answers"])
def test_explain_reads_at_most_its_cap_from_a_fifo_or_a_file(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = str(POLICIES / "api_abuse.yaml")
    subject = tmp_path / "subject.json"
    subject.write_text(json.dumps(SUBJECT))
    big = _sparse(tmp_path / "big.json", MAX_INPUT_BYTES + 1)
    argv = ["policy", "explain", policy, "--input", str(subject), option, str(big)]
    assert main(argv[:4] + argv[6:] if option == "--input" else argv) == 2
    assert f"{option} {big}: file is {MAX_INPUT_BYTES + 1} bytes; at most {MAX_INPUT_BYTES}" in capsys.readouterr().err
    os.mkdir(tmp_path / "fed")
    with fed_fifo(tmp_path / "fed", MAX_INPUT_BYTES + (1 << 20)) as fifo:  # /dev/zero, with a hard bound
        argv[-1] = str(fifo)
        assert main(argv[:4] + argv[6:] if option == "--input" else argv) == 2
    assert f"{option} {fifo}: it holds more than {MAX_INPUT_BYTES} bytes" in capsys.readouterr().err


def test_explain_still_reads_a_subject_from_a_fifo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--input <(...)`` keeps working: a pipe from the shell is read, only capped."""
    fifo = tmp_path / "subject.fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "wb") as f:
            f.write(json.dumps(SUBJECT).encode())

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    assert main(["policy", "explain", str(POLICIES / "api_abuse.yaml"), "--input", str(fifo)]) == 0
    thread.join(5)
    assert capsys.readouterr().out.startswith("policy     api-abuse@")


@pytest.mark.parametrize(("argv", "usage"), [
    (["eval", "d.jsonl", "--js", "x"], "guard eval"),
    (["policy", "schema", "--out", "s.json"], "guard policy schema"),
    (["worker", "serve", "--model", "m", "--max-b", "4"], "guard worker serve"),
])  # fmt: skip
def test_an_abbreviated_option_is_an_unknown_one_named_by_its_subcommand(
    argv: list[str], usage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--js x was taken as --json x (argparse's prefix matching): a typo chose another option."""
    monkeypatch.chdir(tmp_path)  # where --out s.json was written as --output
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(f"usage: {usage} ")
    assert f"{usage}: error: unrecognized arguments: {' '.join(argv[-2:])}\n" in err


def test_an_unknown_option_before_a_subcommand_is_named_by_the_command_it_was_given_to(
    capsys: pytest.CaptureFixture[str]
) -> None:
    """guard policy --bogus check DIR was reported with the top-level usage (only a parser without subcommands
    raised for its unknown options)."""
    with pytest.raises(SystemExit) as info:
        main(["policy", "--bogus", "check", "policies/"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: guard policy ")
    assert "guard policy: error: unrecognized arguments: --bogus\n" in err


@pytest.mark.parametrize("tests", [[], ["--tests"]])
def test_output_does_not_overwrite_another_draft_2020_12_schema(
    tests: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The test file schema had no $id, so any draft 2020-12 schema opening with "$defs" looked like its output and
    --output replaced it."""
    other = tmp_path / "other.schema.json"
    text = '{\n  "$schema": "https://json-schema.org/draft/2020-12/schema",\n  "$defs": {\n    "A": {}\n  }\n}\n'
    other.write_text(text)
    command = " ".join(["schema", *tests])
    assert main(["policy", "schema", *tests, "--output", str(other)]) == 2
    assert f"--output {other} exists and is not the output of guard policy {command}" in capsys.readouterr().err
    assert other.read_text() == text
    assert main(["policy", "schema", *tests, "--check", str(other)]) == 1
    assert "--output" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["schema", "reference"])
def test_output_never_overwrites_a_file_it_did_not_write_and_check_suggests_it_only_for_one_it_did(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--check p.yaml (a policy) said "run: guard policy schema --output p.yaml", which overwrote the policy; --output
    and --check together silently did --check only."""
    policy = tmp_path / "p.yaml"
    policy.write_text("policies: []\n")
    assert main(["policy", command, "--check", str(policy)]) == 1
    err = capsys.readouterr().err
    assert f"is not the output of guard policy {command}" in err and "--output" not in err
    assert main(["policy", command, "--output", str(policy)]) == 2
    assert f"--output {policy} exists and is not the output of guard policy {command}" in capsys.readouterr().err
    assert policy.read_text() == "policies: []\n"
    generated = tmp_path / "generated"
    assert main(["policy", command, "--output", str(generated)]) == 0
    generated.write_text(generated.read_text() + "an older version's line\n")
    assert main(["policy", command, "--check", str(generated)]) == 1
    assert f"run: guard policy {command} --output {generated}" in capsys.readouterr().err
    assert main(["policy", command, "--output", str(generated)]) == 0  # a file it wrote is replaced
    assert main(["policy", command, "--check", str(generated)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["policy", command, "--output", str(generated), "--check", str(generated)])
    assert info.value.code == 2
    assert "argument --check: not allowed with argument --output" in capsys.readouterr().err


@pytest.mark.parametrize("answers", ['["injection"]', "5", "null", "[]", '"injection"'])
def test_explain_refuses_answers_that_are_not_an_object(
    answers: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An ``--answers`` file holding a list, a number, a string or null is a usage error naming the file: it was a
    traceback, a complaint about "keys" that were list items or characters, or (``null``, ``[]``) no answers at all,
    without the note that the verdict then decides nothing."""
    subject, spec = tmp_path / "subject.json", tmp_path / "answers.json"
    subject.write_text(json.dumps(SUBJECT))
    spec.write_text(answers)
    argv = ["policy", "explain", str(POLICIES / "api_abuse.yaml"), "--input", str(subject), "--answers", str(spec)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"guard policy explain: --answers {spec}: must be a JSON object of question "
                                       'key -> answer spec ({"injection": 0.93})\n')
