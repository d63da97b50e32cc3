"""The decision log's sink never holds or fails a decision: a path is written from a thread of the log's own through a
bounded queue, and whatever a sink raises or however long it blocks, the record is dropped and counted."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.policy import load_text
from guard.subject import HttpSubject
from guard.verdict import Verdict
from tests._backends import ScriptedBackend

POLICY = """
policies:
  - id: api
    version: 1
    match: {http: {paths: ["/v1/**"]}}
    state: {prompt: body:/prompt}
    questions:
      injection: {type: noul, instructions: Injection}
    rules:
      - {id: injection, when: injection.noul >= 0.8, action: block}
"""


def _dropped(reader: InMemoryMetricReader) -> dict[str, int]:
    """``guard.decision_log.dropped`` by reason."""
    data = reader.get_metrics_data()
    return {point.attributes["reason"]: point.value
            for rm in data.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics
            if metric.name == "guard.decision_log.dropped" for point in metric.data.data_points}


def test_decisions_go_on_while_nobody_reads_the_log_fifo(tmp_path: Path) -> None:
    """A FIFO whose reader stopped reading: the first records fill the pipe, the sink blocks, and before, every
    decision (and with them the proxy's health and liveness answers, on the same event loop) waited on it."""
    fifo = tmp_path / "decisions.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, never read: a log shipper that is stopped
    log = DecisionLog(fifo)
    guard = Guard(load_text(POLICY), backends=ScriptedBackend(), decision_log=log)
    subject = HttpSubject(method="POST", path="/v1/chat", body={"prompt": "lorem ipsum " * 20_000})
    actions: list[str] = []

    async def decide() -> None:
        for _ in range(40):  # about 5 MB of records: more than any pipe holds
            actions.append((await guard.aevaluate(subject)).action)

    deciding = threading.Thread(target=asyncio.run, args=(decide(),), daemon=True)
    deciding.start()
    deciding.join(60)  # a bound for the old behaviour, which never returned
    assert actions == ["allow"] * 40
    log.close(timeout=0)  # the writer thread is still stuck in the pipe
    os.close(reader)
    guard.close()


def test_a_full_queue_drops_and_counts_the_record() -> None:
    reader = InMemoryMetricReader()
    release = threading.Event()
    written: list[str] = []

    def blocking(line: str) -> None:  # a producer whose buffer is full until released
        release.wait()
        written.append(line)

    log = DecisionLog(blocking, background=True, queue_chars=1, meter_provider=MeterProvider(metric_readers=[reader]))
    for n in range(3):  # the first is taken (the queue was empty); the others find it full
        log.record(Verdict("allow", f"d{n}", policy_id="p"), None)
    assert log.dropped == 2 and _dropped(reader) == {"queue_full": 2}
    release.set()
    log.close()
    assert [line.split('"decision_id":"')[1][:2] for line in written] == ["d0"]


def test_close_waits_for_a_stuck_sink_only_as_long_as_told(caplog: pytest.LogCaptureFixture) -> None:
    reader = InMemoryMetricReader()
    release = threading.Event()
    log = DecisionLog(lambda line: release.wait(), background=True, meter_provider=MeterProvider(
        metric_readers=[reader]))
    for n in range(3):
        log.record(Verdict("allow", f"d{n}", policy_id="p"), None)
    log.close(timeout=0.05)
    assert log.dropped == 2 and _dropped(reader) == {"shutdown": 2}  # the first is the one stuck in the sink
    assert "2 records not written" in caplog.text
    log.record(Verdict("allow", "d3", policy_id="p"), None)  # a closed log drops, it does not wait
    assert log.dropped == 3
    release.set()


class ProducerError(Exception):
    pass


def test_a_sink_raising_anything_drops_the_record_not_the_decision(caplog: pytest.LogCaptureFixture) -> None:
    """A callable sink raising other than OSError or ValueError (a Kafka producer's own error) made the request 500."""
    reader = InMemoryMetricReader()

    def producer(line: str) -> None:
        raise ProducerError(f"queue full, could not send {line}")

    log = DecisionLog(producer, meter_provider=MeterProvider(metric_readers=[reader]))
    subject = HttpSubject(method="POST", path="/v1/chat", body={"prompt": "hello sk-live-0123456789"})
    with caplog.at_level(logging.ERROR), Guard(load_text(POLICY), backends=ScriptedBackend(), decision_log=log) as g:
        assert g.evaluate(subject).action == "allow"
    assert log.dropped == 1 and _dropped(reader) == {"sink_error": 1}
    assert "write failed (1 dropped; 0 such errors not logged since the last): ProducerError" in caplog.text
    assert "sk-live" not in caplog.text


def test_sink_errors_are_logged_once_per_interval_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    def producer(line: str) -> None:
        raise ProducerError("down")

    log = DecisionLog(producer)
    with caplog.at_level(logging.ERROR):
        for n in range(1000):
            log.record(Verdict("allow", f"d{n}", policy_id="p"), None)
    logged = [r.getMessage() for r in caplog.records if "write failed" in r.getMessage()]
    assert log.dropped == 1000 and len(logged) == 1 and "(1 dropped;" in logged[0]


class _SlowReader:
    """A stream whose first write returns only once the log's close stopped waiting for it (a FIFO whose reader
    reads slowly); it keeps what it was given."""

    def __init__(self) -> None:
        self.log: DecisionLog | None = None
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        while not self.lines and self.log is not None and self.log._stream is not None:
            threading.Event().wait(0.001)
        self.lines.append(text)


def test_lines_the_writer_takes_while_the_log_closes_are_written_or_counted_as_shutdown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The writer thread wrote through the log's stream, which close() cleared while the writer still ran: the lines
    it took then were counted as sink errors, and the warning said the sink took no line."""
    reader = InMemoryMetricReader()
    stream = _SlowReader()
    log = DecisionLog(stream, background=True, meter_provider=MeterProvider(metric_readers=[reader]))
    stream.log = log
    for n in range(30_000):  # about 10 M characters: within the queue's bound
        log.record(Verdict("allow", f"d{n}", policy_id="p"), None)
    writer = log._writer
    log.close(timeout=0.05)
    assert writer is not None
    writer.join(5)  # it ends once it took close's end of the queue
    dropped = _dropped(reader)
    assert "sink_error" not in dropped and "took no line" not in caplog.text
    assert len(stream.lines) + dropped["shutdown"] == 30_000


def test_a_log_file_is_written_by_its_thread_and_complete_once_closed(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path)
    for n in range(50):
        log.record(Verdict("allow", f"d{n}", policy_id="p"), None)
    log.close()
    assert len(path.read_text().splitlines()) == 50 and log.dropped == 0


def test_a_new_log_file_is_not_readable_by_other_users_and_an_existing_one_keeps_its_mode(tmp_path: Path) -> None:
    """The records hold requests' input and state: a file the log creates (at start or on reopen) is 0640 less the
    umask, not 0666 less it (0644, world-readable, under the usual umask 022)."""
    old = os.umask(0o022)
    try:
        path = tmp_path / "decisions.jsonl"
        log = DecisionLog(path, background=False)
        assert path.stat().st_mode & 0o777 == 0o640
        path.rename(tmp_path / "decisions.jsonl.1")
        log.reopen()
        log.close()
        assert path.stat().st_mode & 0o777 == 0o640
        kept = tmp_path / "shared.jsonl"
        kept.touch(mode=0o644)
        kept.chmod(0o644)
        DecisionLog(kept).close()
        assert kept.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


@pytest.mark.parametrize("background", [True, False])
def test_reopen_writes_the_next_records_to_a_new_file_at_the_path(tmp_path: Path, background: bool) -> None:
    """logrotate moves the file, then asks for it to be opened again: the records before go to the moved file, the
    ones after to a new one at the path, none lost."""
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path, background=background)
    for n in range(20):
        log.record(Verdict("allow", f"d{n}", policy_id="p"), None)
    path.rename(tmp_path / "decisions.jsonl.1")
    log.reopen()
    for n in range(20, 30):
        log.record(Verdict("allow", f"d{n}", policy_id="p"), None)
    log.close()
    assert len((tmp_path / "decisions.jsonl.1").read_text().splitlines()) == 20
    assert [json.loads(line)["decision_id"] for line in path.read_text().splitlines()] == [f"d{n}" for n in
                                                                                          range(20, 30)]
    assert log.dropped == 0


class _Announced:
    """A log's lock (re-entrant here) that says when a thread starts waiting for it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.waiting = threading.Event()

    def __enter__(self) -> None:
        self.waiting.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_a_record_written_while_the_file_is_reopened_goes_to_the_new_file(tmp_path: Path) -> None:
    """Without a writer thread, a record whose write waits for the lock while ``reopen`` (logrotate's SIGHUP) swaps
    the file is written to the file opened again, not dropped on the closed one."""
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path, background=False)
    lock = log._lock = _Announced()  # type: ignore[assignment]
    with lock:  # the write waits here, as it would behind another thread's write
        writing = threading.Thread(target=log.record, args=(Verdict("allow", "d0", policy_id="p"), None))
        lock.waiting.clear()
        writing.start()
        assert lock.waiting.wait(10)
        path.rename(tmp_path / "decisions.jsonl.1")
        log.reopen()  # re-entered: the file is swapped while the write still waits
    writing.join(10)
    log.close()
    assert [json.loads(line)["decision_id"] for line in path.read_text().splitlines()] == ["d0"]
    assert log.dropped == 0


def test_a_fifo_with_no_reader_is_refused_not_waited_for(tmp_path: Path) -> None:
    """Opening a FIFO for writing waits for a reader: the log (and guard proxy's start) blocked for ever."""
    fifo = tmp_path / "decisions.fifo"
    os.mkfifo(fifo)
    raised: list[OSError] = []

    def open_log() -> None:
        try:
            DecisionLog(fifo).close()
        except OSError as exc:
            raised.append(exc)

    opening = threading.Thread(target=open_log, daemon=True)
    opening.start()
    opening.join(10)  # a bound for the old behaviour, which never returned
    if opening.is_alive():  # let the old open return
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert [exc.errno for exc in raised] == [errno.ENXIO]
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # with a reader the log opens, and writes block again
    log = DecisionLog(fifo)
    log.record(Verdict("allow", "d1", policy_id="p"), None)
    log.close()
    assert json.loads(os.read(reader, 65536))["decision_id"] == "d1"
    os.close(reader)


@pytest.mark.parametrize("background", [True, False])
def test_a_log_path_that_is_a_symbolic_link_is_refused_at_open_and_on_reopen(
    tmp_path: Path, background: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A link placed at the log's path (to ``/etc/passwd``, another service's file) was followed: the records went
    into its target, at start and when logrotate's SIGHUP opened the path again."""
    target = tmp_path / "target"
    target.write_text("kept\n")
    path = tmp_path / "decisions.jsonl"
    path.symlink_to(target)
    with pytest.raises(OSError, match="is a symbolic link") as raised:
        DecisionLog(path, background=background)
    assert raised.value.errno == errno.ELOOP and raised.value.filename == str(path)
    path.unlink()
    log = DecisionLog(path, background=background)
    path.rename(tmp_path / "decisions.jsonl.1")
    path.symlink_to(target)
    with caplog.at_level(logging.ERROR, logger="guard.telemetry"):
        log.reopen()
        log.record(Verdict("allow", "d1", policy_id="p"), None)
        log.close()
    assert target.read_text() == "kept\n"
    assert [json.loads(line)["decision_id"] for line in (tmp_path / "decisions.jsonl.1").read_text().splitlines()] \
        == ["d1"]
    assert f"decision log {path} could not be opened again (is a symbolic link" in caplog.text


def test_a_log_path_that_is_a_symbolic_link_to_a_stream_is_written_through(tmp_path: Path) -> None:
    """``--decision-log /dev/stdout`` (a link to ``/proc/self/fd/1``: a container's log pipe) was refused once links
    were; a link to a pipe, a FIFO or a character device is followed, and one to nothing is refused, creating
    nothing."""
    reader, writer = os.pipe()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fifo_reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    path = tmp_path / "decisions.jsonl"
    for target, read in [(f"/dev/fd/{writer}", reader), (str(fifo), fifo_reader), (os.devnull, None)]:
        path.unlink(missing_ok=True)
        path.symlink_to(target)
        log = DecisionLog(path)
        log.record(Verdict("allow", "d1", policy_id="p"), None)
        log.close()
        if read is not None:
            assert json.loads(os.read(read, 65536))["decision_id"] == "d1"
    for fd in (reader, writer, fifo_reader):
        os.close(fd)
    path.unlink()
    path.symlink_to(tmp_path / "nothing")
    with pytest.raises(OSError, match="is a symbolic link"):
        DecisionLog(path)
    assert not (tmp_path / "nothing").exists()


def test_a_symbolic_link_to_the_file_stdout_writes_is_written_through(tmp_path: Path) -> None:
    """``guard proxy --decision-log /dev/stdout > out.log`` (systemd's ``StandardOutput=append:``) writes the file the
    process writes already: it is followed where a link to another file is not."""
    script = ("from guard.engine.telemetry import DecisionLog\nfrom guard.verdict import Verdict\n"
              "log = DecisionLog('/dev/stdout')\nlog.record(Verdict('allow', 'd1', policy_id='p'), None)\nlog.close()")
    out = tmp_path / "out.log"
    with out.open("w") as stdout:
        subprocess.run([sys.executable, "-c", script], stdout=stdout, check=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert json.loads(out.read_text())["decision_id"] == "d1"
