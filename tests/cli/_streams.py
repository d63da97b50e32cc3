"""Endless-looking inputs for the bounded-read tests, each with a hard byte bound (never ``/dev/zero``)."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def fed_fifo(folder: Path, total: int, byte: bytes = b" ") -> Iterator[Path]:
    """A FIFO in ``folder`` that a thread fills with ``total`` bytes (a stand-in for ``/dev/zero`` or a shell's
    ``<(...)``); the thread stops when they are sent or the reader goes away."""
    path = folder / "fifo"
    os.mkfifo(path)
    chunk = byte * (1 << 16)

    def feed() -> None:
        sent = 0
        try:
            with open(path, "wb", buffering=0) as fifo:
                while sent < total:
                    sent += fifo.write(chunk[: total - sent]) or 0
        except OSError:  # BrokenPipeError: the reader stopped reading
            pass

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a writer still waiting for a reader opens, then fails
        os.close(fd)
        thread.join(10)


class BoundedZeros(io.RawIOBase):
    """A raw stream of ``total`` bytes of ``byte`` then end of file: stdin as ``/dev/zero`` with a hard bound."""

    def __init__(self, total: int, byte: bytes = b" ") -> None:
        self.left = total
        self.byte = byte
        self.served = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), self.left)
        buffer[:n] = self.byte * n
        self.left -= n
        self.served += n
        return n
