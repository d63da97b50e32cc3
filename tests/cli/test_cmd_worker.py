"""``guard worker serve`` as a real process on a Unix socket: ready, answers, drains on SIGTERM, refuses bad options."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from guard.cli import build_parser
from tests.worker._requests import ticket_body

ROOT = Path(__file__).resolve().parents[2]


def _guard(*args: str) -> list[str]:
    return [sys.executable, "-m", "guard", "worker", "serve", *args]


def test_serves_until_sigterm_then_exits_cleanly(golden_checkpoint: Path, tmp_path: Path) -> None:
    sock = str(tmp_path / "worker.sock")
    process = subprocess.Popen(
        _guard(
            "--model",
            str(golden_checkpoint),
            "--uds",
            sock,
            "--dtype",
            "float32",
            "--max-batch",
            "4",
            "--model-name",
            "clef-tiny",
            "--model-alias",
            "clef-flash",
            "--log-level",
            "warning",
        ),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://worker", timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
                assert time.monotonic() < deadline, "worker never became ready"
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            answer = client.post("/v1/systemone", json=ticket_body(0))
            models = client.get("/v1/models").json()
        assert answer.status_code == 200 and set(answer.json()["answers"]) == {"churn_risk", "queue", "urgency"}
        assert models["models"][0]["name"] == "clef-tiny" and models["models"][0]["dtype"] == "float32"
    finally:
        process.send_signal(signal.SIGTERM)
        returncode = process.wait(60)
    assert returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once its graceful shutdown is done


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-batch", "0"], "--max-batch must be an integer >= 1, got 0"),
        (["--max-wait-ms", "-1"], "--max-wait-ms must be a finite number >= 0"),
        (["--uds", "/tmp/x.sock", "--port", "9000"], "--uds cannot be combined with --host/--port"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be an integer >= 1"),
        (["--uds", "/nonexistent-guard-dir/worker.sock"], "folder /nonexistent-guard-dir does not exist"),
    ],
)
def test_bad_options_exit_2_naming_the_option(
    golden_checkpoint: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parsed = build_parser().parse_args(["worker", "serve", "--model", str(golden_checkpoint), *args])
    assert parsed.handler(parsed) == 2
    assert message in capsys.readouterr().err


def test_missing_checkpoint_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parsed = build_parser().parse_args(["worker", "serve", "--model", str(tmp_path)])
    assert parsed.handler(parsed) == 2
    assert "config.json is missing" in capsys.readouterr().err
