"""``guard worker serve`` as a real process on a Unix socket: ready, answers, drains on SIGTERM, refuses bad options."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from guard.cli import build_parser, main
from tests.worker._requests import ticket_body
from tests.worker._serve import worker_process


def test_serves_until_sigterm_then_exits_cleanly(golden_checkpoint: Path, tmp_path: Path) -> None:
    options = ("--model", str(golden_checkpoint), "--dtype", "float32", "--max-batch", "4", "--model-name", "clef-tiny",
               "--model-alias", "clef-flash", "--log-level", "warning")  # fmt: skip
    uds = tmp_path / "worker.sock"
    with worker_process(str(uds), *options) as worker, worker.client() as client:
        answer = client.post("/v1/systemone", json=ticket_body(0))
        models = client.get("/v1/models").json()
        mode = uds.stat().st_mode & 0o777  # a worker without keys on a socket: only its owner and group may ask
        returncode = worker.stop()
    assert mode == 0o660, oct(mode)  # uvicorn made it 0666: any local user used the GPU (new-user trial)
    assert answer.status_code == 200 and set(answer.json()["answers"]) == {"churn_risk", "queue", "urgency"}
    assert models["models"][0]["name"] == "clef-tiny" and models["models"][0]["dtype"] == "float32"
    assert returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once its graceful shutdown is done


def test_a_connection_that_does_not_send_its_head_in_time_is_closed(golden_checkpoint: Path, tmp_path: Path) -> None:
    """A slow or idle client (one header line now and then) cannot hold a connection, and so a file descriptor."""
    uds = str(tmp_path / "worker.sock")
    options = ("--model", str(golden_checkpoint), "--dtype", "float32", "--header-timeout", "0.5",
               "--log-level", "warning")  # fmt: skip
    with worker_process(uds, *options), socket.socket(socket.AF_UNIX) as slow:
        slow.connect(uds)
        slow.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: worker\r\n")  # never the blank line
        slow.settimeout(5)
        started, data = time.monotonic(), b""
        with contextlib.suppress(OSError):
            while chunk := slow.recv(4096):
                data += chunk
        took = time.monotonic() - started
    assert data.startswith(b"HTTP/1.1 408") and took < 3, (data, took)


def test_a_port_in_use_is_one_line_before_the_weights_load(
    golden_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker loaded the weights at startup, then uvicorn failed to bind (Errno 98, exit 3); guard proxy says
    this in one line, exit 2, before anything loads."""
    from guard.backends.local import LocalBackend

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(LocalBackend, "from_pretrained", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["worker", "serve", "--model", str(golden_checkpoint), "--port", str(port)])
    assert code == 2
    assert capsys.readouterr().err == f"guard worker serve: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_port_in_use_sends_no_metrics_to_an_otlp_collector(
    golden_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker that could not listen served nothing: its exit made the metrics provider's last OTLP export, and
    waited for a collector that never answers (``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s by default)."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    with socket.socket() as collector, socket.socket() as taken:
        collector.bind(("127.0.0.1", 0))
        collector.listen()
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"http://127.0.0.1:{collector.getsockname()[1]}/v1/metrics")
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["worker", "serve", "--model", str(golden_checkpoint), "--port", str(port)]) == 2
        collector.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing connected to the collector
            collector.accept()
    assert capsys.readouterr().err == f"guard worker serve: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_bad_otel_metrics_variable_is_one_line_before_the_weights_load(
    golden_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The SDK refuses an unknown ``OTEL_METRICS_EXEMPLAR_FILTER`` when the worker's meter provider is made, which
    was outside the checks of the ``OTEL_*`` variables: a traceback and exit 1 (``guard proxy`` said it in one line)."""
    from guard.backends.local import LocalBackend

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(LocalBackend, "from_pretrained", never)
    monkeypatch.setenv("OTEL_METRICS_EXEMPLAR_FILTER", "sometimes")
    assert main(["worker", "serve", "--model", str(golden_checkpoint), "--port", "0"]) == 2
    assert capsys.readouterr().err == "guard worker serve: Unknown exemplar filter 'sometimes'.\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--uds", "/tmp/x.sock", "--port", "9000"], "--uds cannot be combined with --host/--port"),
        (["--max-pending-body-bytes", "1000"],
         "--max-pending-body-bytes must be an integer >= --max-body-bytes (8388608), got 1000"),
        (["--default-timeout-ms", "300001"], "--default-timeout-ms must be at most 300000"),
        (["--release-date", "2025-13-01"], "--release-date must be a YYYY-MM-DD date, got '2025-13-01'"),
        (["--max-image-pixels", str(1 << 40)], "--max-image-pixels must be at most"),
        (["--uds", "/nonexistent-guard-dir/worker.sock"], "folder /nonexistent-guard-dir does not exist"),
        (["--uds", "/tmp/" + "w" * 200 + ".sock"], "is 210 bytes long; a socket path must be shorter than"),
        (["--device", "tpu"], "--device 'tpu': expected cpu, cuda or cuda:N"),
        pytest.param(["--device", "cuda"], "this torch build has no CUDA device",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    ],
)  # fmt: skip
def test_bad_options_exit_2_naming_the_option(
    golden_checkpoint: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What only the configs can check (one option against another) is named by the flag, not the config field."""
    parsed = build_parser().parse_args(["worker", "serve", "--model", str(golden_checkpoint), *args])
    assert parsed.handler(parsed) == 2
    err = capsys.readouterr().err
    assert message in err and "Config." not in err, err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--default-timeout-ms", "-5"], "'-5' is not a number of milliseconds above 0"),
        (["--default-timeout-ms", "0"], "'0' is not a number of milliseconds above 0"),
        (["--body-idle-timeout", "-1"], "'-1' is not a number of seconds above 0"),
        (["--canary-interval", "-1"], "'-1' is not a number of seconds (0 or more)"),
        (["--canary-interval", "nan"], "'nan' is not a number of seconds (0 or more)"),
        (["--canary-timeout", "0"], "'0' is not a number of seconds above 0"),
        (["--header-timeout", "0"], "'0' is not a number of seconds above 0"),
        (["--model-alias", ""], "'' is empty; give a name"),
        (["--model-name", " "], "' ' is empty; give a name"),
        (["--max-batch", "0"], "'0' is not a whole number of 1 or more"),
        (["--max-batch-tokens", "0"], "'0' is not a whole number of 1 or more"),
        (["--max-queue", "-1"], "'-1' is not a whole number of 1 or more"),
        (["--max-wait-ms", "-1"], "'-1' is not a number of milliseconds (0 or more)"),
        (["--max-length-ratio", "0.5"], "'0.5' is not a ratio of 1 or more (inf: no limit)"),
        (["--max-body-bytes", "0"], "'0' is not a whole number of 1 or more"),
        (["--max-pending-body-bytes", "0"], "'0' is not a whole number of 1 or more"),
        (["--max-image-pixels", "0"], "'0' is not a whole number of 1 or more"),
        (["--max-length", "0"], "'0' is not a whole number of 1 or more"),
        (["--torch-threads", "0"], "'0' is not a whole number of 1 or more"),
        (["--body-idle-timeout", "soon"], "invalid positive_seconds value: 'soon'"),
    ],
)  # fmt: skip
def test_a_number_out_of_its_range_is_a_usage_error_naming_the_flag(
    golden_checkpoint: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """New-user trial: --default-timeout-ms -5 said "--default-timeout-s must be ... got -0.005" (a flag that does not
    exist, in other units), --body-idle-timeout and --canary-interval named --body-idle-timeout-s and
    --canary-interval-s, --model-alias '' said "--model-aliases must be a tuple"."""
    with pytest.raises(SystemExit) as info:
        main(["worker", "serve", "--model", str(golden_checkpoint), *args])
    last = capsys.readouterr().err.splitlines()[-1]
    assert info.value.code == 2
    assert last == f"guard worker serve: error: argument {args[0]}: {message}", last


def test_the_canary_options_reach_the_worker_config(golden_checkpoint: Path) -> None:
    from guard.cli.cmd_worker import _configs

    args = ["--canary-interval", "15", "--canary-timeout", "2.5"]
    _, config = _configs(build_parser().parse_args(["worker", "serve", "--model", str(golden_checkpoint), *args]))
    assert (config.canary_interval_s, config.canary_timeout_s) == (15, 2.5)
    _, default = _configs(build_parser().parse_args(["worker", "serve", "--model", str(golden_checkpoint)]))
    assert default.canary_timeout_s == 10  # the startup self-test's 120 s bounded every run before


def test_missing_checkpoint_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parsed = build_parser().parse_args(["worker", "serve", "--model", str(tmp_path)])
    assert parsed.handler(parsed) == 2
    assert "config.json is missing" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("tokenizer.json", "is not a Clef checkpoint: tokenizer.json is missing"),
        ("joint_head.safetensors", "is not a Clef checkpoint: joint_head.safetensors is missing"),
        ("{}", "joint_head_config.json: joint head config must set hidden_size"),
        ("{not json", "joint_head_config.json: Expecting property name"),
    ],
)
def test_a_damaged_checkpoint_exits_2_before_listening(
    golden_checkpoint: Path, tmp_path: Path, damage: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only config.json was checked: the worker opened its socket, logged a traceback and ran on, never ready."""
    model = tmp_path / "model"
    model.mkdir()
    for item in golden_checkpoint.iterdir():
        (model / item.name).write_bytes(item.read_bytes())
    if damage.endswith((".json", ".safetensors")):
        (model / damage).unlink()
    else:
        (model / "joint_head_config.json").write_text(damage)
    uds = tmp_path / "w.sock"
    parsed = build_parser().parse_args(["worker", "serve", "--model", str(model), "--uds", str(uds)])
    assert parsed.handler(parsed) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"guard worker serve: --model: {model}") and message in err, err
    assert not uds.exists()


@pytest.mark.parametrize("args", [["--canary-margin", "2"], ["--device", "tpu"], ["--max-pending-body-bytes", "1000"]])
def test_a_usage_error_leaves_no_socket_file(
    golden_checkpoint: Path, tmp_path: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The socket file was made as soon as --uds was checked, and left there by a later usage error."""
    uds = tmp_path / "w.sock"
    parsed = build_parser().parse_args(["worker", "serve", "--model", str(golden_checkpoint), "--uds", str(uds), *args])
    assert parsed.handler(parsed) == 2
    assert capsys.readouterr().err.startswith("guard worker serve: ")
    assert not uds.exists()
