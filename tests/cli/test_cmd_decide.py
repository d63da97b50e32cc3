"""``guard decide`` end to end: golden answers, --raw, stdin, and one-line errors for bad input."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from guard.cli import main
from tests.clef.conftest import error_cases, load_case


def _decide(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    code = main(["decide", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def _write(tmp_path: Path, body: Any, name: str = "request.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(body, ensure_ascii=False), encoding="utf-8")
    return str(path)


def _close(ours: Any, reference: Any, tolerance: float) -> bool:
    if isinstance(reference, dict):
        return list(ours) == list(reference) and all(_close(ours[k], v, tolerance) for k, v in reference.items())
    if isinstance(reference, float):
        return abs(ours - reference) <= tolerance
    return ours == reference


def test_golden_case_from_a_file_float32(golden_checkpoint: Path, tmp_path: Path, capsys) -> None:
    case = load_case("01-three-types")
    code, body, err = _decide(
        ["--model", str(golden_checkpoint), "--dtype", "float32", _write(tmp_path, case["request"])], capsys
    )
    assert code == 0, err
    assert _close(body, case["response_fp32"], 2e-4 * 3)


def test_raw_adds_prompt_order_logits_and_probabilities(golden_checkpoint: Path, tmp_path: Path, capsys) -> None:
    case = load_case("02-choice-caller-order")
    code, body, _ = _decide(["--model", str(golden_checkpoint), "--raw", _write(tmp_path, case["request"])], capsys)
    assert code == 0
    raw = body["raw"]
    assert raw["input_tokens"] == case["input_ids_len"] == body["usage"]["input_tokens"]
    for qid, entry in raw["questions"].items():
        assert entry["option_ids"] == case["option_order"][qid]
        assert all(abs(a - b) <= 1e-4 for a, b in zip(entry["logits"], case["logits_fp32"][qid], strict=True))
        assert all(
            abs(a - b) <= 1e-4 for a, b in zip(entry["probabilities"], case["probabilities_fp32"][qid], strict=True)
        )


def test_request_from_stdin_with_a_confidence_profile(golden_checkpoint: Path, capsys, monkeypatch) -> None:
    case = load_case("01-three-types")
    stdin = io.TextIOWrapper(io.BytesIO(json.dumps(case["request"]).encode()), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    code, body, _ = _decide(["--model", str(golden_checkpoint), "--confidence", "jev", "--max-length", "16384"], capsys)
    assert code == 0
    seating = body["answers"]["seating"]
    n = len(seating["probabilities"])
    assert abs(seating["confidence"] - (n * max(seating["probabilities"].values()) - 1) / (n - 1)) < 1e-3


@pytest.mark.parametrize("error", error_cases(), ids=lambda e: e["name"])
def test_reference_errors_exit_2_with_the_reference_message(
    error: dict[str, Any], golden_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    argv = [
        "--model",
        str(golden_checkpoint),
        "--max-length",
        str(error["max_length"]),
        _write(tmp_path, error["request"]),
    ]
    code, body, err = _decide(argv, capsys)
    assert code == 2 and body is None
    assert err.count("\n") == 1 and err.rstrip().endswith(error["error"]["message"])


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ('{"model": "m", "model": "n", "state": "s"}', "duplicate key 'model'"),
        ('{"model": "m", "state": ', "invalid JSON"),
        ('{"model": "m", "state": NaN, "questions": {}}', "NaN"),
        ('{"model": "m", "state": "s", "questions": {"q": {"type": "poll"}}}', "questions.q.type"),
    ],
)
def test_bad_input_is_one_line_naming_the_problem(
    payload: str, message: str, golden_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(payload, encoding="utf-8")
    code, _, err = _decide(["--model", str(golden_checkpoint), str(path)], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_workers_ai_profile_requires_instructions(golden_checkpoint: Path, tmp_path: Path, capsys) -> None:
    request = load_case("09-no-instructions")["request"]
    argv = ["--model", str(golden_checkpoint), "--profile", "workers-ai", _write(tmp_path, request)]
    code, _, err = _decide(argv, capsys)
    assert code == 2 and ".instructions" in err


def test_unusable_model_directory_and_arguments(tmp_path: Path, capsys) -> None:
    request = _write(tmp_path, {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}})
    (tmp_path / "empty").mkdir()
    code, _, err = _decide(["--model", str(tmp_path / "empty"), request], capsys)
    assert code == 2 and "config.json is missing" in err
    code, _, err = _decide(["--model", str(tmp_path), "--max-length", "0", request], capsys)
    assert code == 2 and "--max-length" in err
    code, _, err = _decide(["--model", str(tmp_path), str(tmp_path / "absent.json")], capsys)
    assert code == 2 and "cannot read" in err


def test_subprocess_bad_request_has_no_traceback(golden_checkpoint: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "guard", "decide", "--model", str(golden_checkpoint)],
        input=b'{"model": "m", "state": "s", "questions": {"level": {"type": "score", "criteria": []}}}',
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2 and result.stdout == b""
    assert result.stderr.decode().strip() == (
        "guard decide: invalid request: questions.level.criteria: level: criteria must not be empty"
    )


@pytest.mark.parametrize("stdin", [b"", b"  \n", b"\t\r\n"])
def test_empty_stdin_says_so_once(stdin: bytes, golden_checkpoint: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    code, body, err = _decide(["--model", str(golden_checkpoint)], capsys)
    assert (code, body) == (2, None)
    assert err == "guard decide: stdin is empty: expected one System One request (a JSON object)\n"


def test_a_closed_stdin_says_so(golden_checkpoint: Path, capsys, monkeypatch) -> None:
    """Started with stdin closed (``guard decide --model DIR <&-``), Python has no ``sys.stdin``: that was a
    traceback."""
    monkeypatch.setattr(sys, "stdin", None)
    code, body, err = _decide(["--model", str(golden_checkpoint)], capsys)
    assert (code, body) == (2, None)
    assert err == "guard decide: cannot read stdin: it is closed; give the request as FILE\n"


@pytest.mark.parametrize("encoding", ["latin-1", "ascii"])
def test_the_response_is_utf_8_whatever_the_locale_encoding(
    encoding: str, golden_checkpoint: Path, tmp_path: Path, monkeypatch
) -> None:
    """An option id outside ASCII was written in the locale's encoding (Latin-1 bytes JSON readers refuse) or
    stopped the output with a traceback (ASCII, a Windows code page lacking the character)."""
    request = {"model": "clef-flash", "state": "une tasse",
               "questions": {"q": {"type": "choice", "instructions": "Which?", "criteria": {"café": None, "thé": None}}}}
    stdout = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["decide", "--model", str(golden_checkpoint), _write(tmp_path, request)]) == 0
    stdout.flush()
    response = json.loads(stdout.buffer.getvalue().decode("utf-8"))
    assert response["answers"]["q"]["choice"] in ("café", "thé")


def test_an_empty_file_is_named(golden_checkpoint: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "empty.json"
    path.write_bytes(b"")
    code, _, err = _decide(["--model", str(golden_checkpoint), str(path)], capsys)
    assert code == 2 and err == f"guard decide: {path} is empty: expected one System One request (a JSON object)\n"


@pytest.mark.parametrize(
    ("stdin", "expected"),
    [
        (
            b"{",
            "guard decide: stdin: invalid JSON: Expecting property name enclosed in double quotes (line 1, column 2)",
        ),
        (b"not json", "guard decide: stdin: invalid JSON: Expecting value (line 1, column 1)"),
        (b'{"state": "hi', "guard decide: stdin: invalid JSON: Unterminated string starting at (line 1, column 11)"),
        (b'{"a": 1, "a": 2}', "guard decide: stdin: duplicate key 'a' in an object; each key may appear once"),
        (b'{"a": Infinity}', "guard decide: stdin: the constant Infinity is not JSON; numbers must be finite"),
    ],
)
def test_json_errors_are_named_once(stdin: bytes, expected: str, golden_checkpoint: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    code, _, err = _decide(["--model", str(golden_checkpoint)], capsys)
    assert code == 2 and err == expected + "\n"


@pytest.mark.parametrize(
    ("device", "message"),
    [("gpu", "--device 'gpu': expected cpu, cuda or cuda:N"), ("cuda:x", "--device 'cuda:x': expected cpu")],
)
def test_a_bad_device_is_one_line(device: str, message: str, golden_checkpoint: Path, tmp_path: Path, capsys) -> None:
    request = _write(tmp_path, load_case("01-three-types")["request"])
    code, _, err = _decide(["--model", str(golden_checkpoint), "--device", device, request], capsys)
    assert code == 2 and err.startswith(f"guard decide: {message}") and err.count("\n") == 1


def test_cuda_without_a_cuda_build_is_one_line(golden_checkpoint: Path, tmp_path: Path, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch build has CUDA")
    request = _write(tmp_path, load_case("01-three-types")["request"])
    code, _, err = _decide(["--model", str(golden_checkpoint), "--device", "cuda", request], capsys)
    assert code == 2 and "--device cuda: this torch build has no CUDA device" in err and err.count("\n") == 1


def test_a_damaged_checkpoint_is_a_one_line_error(
    golden_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config.json holding a list, or an empty tokenizer.json, raised a TypeError or a tokenizers exception out of
    guard decide as a traceback."""
    import shutil

    request = '{"model": "m", "state": "hi", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}'
    for name, content in (("config.json", "[1]"), ("tokenizer.json", "")):
        damaged = tmp_path / name
        shutil.copytree(golden_checkpoint, damaged)
        (damaged / name).write_text(content)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(request.encode()), encoding="utf-8"))
        assert main(["decide", "--model", str(damaged)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"guard decide: cannot load model from {damaged}") and "Traceback" not in err


def test_a_model_directory_that_does_not_exist_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A misspelt --model said "config.json is missing", as if the folder were there."""
    request = _write(
        tmp_path, {"model": "m", "state": "hi", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}
    )
    missing = tmp_path / "chekpoint"
    code, _, err = _decide(["--model", str(missing), request], capsys)
    assert code == 2 and err == f"guard decide: --model {missing}: the directory does not exist\n"
    code, _, err = _decide(["--model", request, request], capsys)
    assert code == 2 and err == f"guard decide: --model {request}: not a directory\n"


# Bounded reads and a cut state -------------------------------------------------------------------------------------

#: The worker's largest request body, which ``guard decide`` reads at most (``MAX_REQUEST_BYTES``).
CAP = 8 << 20


def test_the_request_cap_is_the_workers_largest_body() -> None:
    from guard.cli.cmd_decide import MAX_REQUEST_BYTES
    from guard.worker.app import DEFAULT_MAX_BODY_BYTES

    assert MAX_REQUEST_BYTES == DEFAULT_MAX_BODY_BYTES == CAP


def test_an_endless_request_is_refused_after_the_cap(tmp_path: Path, capsys, monkeypatch) -> None:
    """``guard decide --model M /dev/zero`` (or ``< /dev/zero``) read until memory ran out; stand-ins with a hard bound."""
    from tests.cli._streams import BoundedZeros, fed_fifo

    model = tmp_path / "model"  # the request is read (and refused) before the model loads
    model.mkdir()
    with fed_fifo(tmp_path, CAP + (1 << 20)) as fifo:
        code, body, err = _decide(["--model", str(model), str(fifo)], capsys)
    assert (code, body) == (2, None)
    assert err == f"guard decide: cannot read {fifo}: it holds more than {CAP} bytes; at most {CAP}\n"
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(CAP + 1)  # sparse: refused from its size, before a byte is read
    code, body, err = _decide(["--model", str(model), str(big)], capsys)
    assert (code, err) == (2, f"guard decide: cannot read {big}: file is {CAP + 1} bytes; at most {CAP}\n")
    zeros = BoundedZeros(64 << 20)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(zeros), encoding="utf-8"))
    code, body, err = _decide(["--model", str(model)], capsys)
    assert (code, err) == (2, f"guard decide: cannot read stdin: it holds more than {CAP} bytes; at most {CAP}\n")
    assert zeros.served <= CAP + (1 << 20)


def test_a_request_from_a_pipe_still_works(golden_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """``guard decide --model M <(...)``: a FIFO from the shell is read, only capped."""
    import os
    import threading

    fifo = tmp_path / "request.fifo"
    os.mkfifo(fifo)
    request = json.dumps(load_case("01-three-types")["request"]).encode()

    def feed() -> None:
        with open(fifo, "wb") as f:
            f.write(request)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    code, body, err = _decide(["--model", str(golden_checkpoint), str(fifo)], capsys)
    thread.join(5)
    assert code == 0, err
    assert body["usage"]["input_tokens"] > 0 and "state_tokens_dropped" not in body["usage"] and err == ""


def test_a_state_cut_to_fit_is_reported_on_stdout_and_stderr(golden_checkpoint: Path, tmp_path: Path, capsys) -> None:
    """A ~1M-character state came back with input_tokens 16384, exit 0 and no sign that most of it was not read."""
    request = {"model": "clef-flash", "state": {"ticket": "Card charged twice. " * 200},
               "questions": {"churn_risk": {"type": "noul", "instructions": "Does the customer threaten to leave?"}}}
    code, body, err = _decide(["--model", str(golden_checkpoint), "--max-length", "300", _write(tmp_path, request)],
                              capsys)
    assert code == 0
    dropped = body["usage"]["state_tokens_dropped"]
    assert body["usage"]["input_tokens"] == 300 and dropped > 1000
    assert err == (f"guard decide: warning: the state was cut to fit --max-length (300 tokens): {dropped} state "
                   "tokens were not read (usage.state_tokens_dropped)\n")
