"""Reading a named file with a cap on its bytes, for the command line's inputs (policy files, ``--check`` files,
``guard decide`` requests, ``guard policy explain`` inputs).

The file is opened without blocking and checked before anything is read, so a path naming a device (``/dev/zero``),
a FIFO with no writer or a huge file costs no wait and no memory: at most ``limit`` + 1 bytes are ever read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["FileRefused", "read_capped"]


class FileRefused(ValueError):
    """A file that was not read whole: it is not a regular file (``kind`` says what it is) or holds more than
    ``limit`` bytes (``size``: its size, or the bytes seen before the read stopped). ``str()`` is the reason."""

    def __init__(self, reason: str, *, kind: str = "", size: int = 0, limit: int = 0) -> None:
        super().__init__(reason)
        self.kind = kind
        self.size = size
        self.limit = limit


def read_capped(path: str | Path, limit: int, *, streams: bool = False) -> bytes:
    """The bytes of the file at ``path``, at most ``limit`` of them.

    Args:
        path: the file.
        limit: the most bytes accepted; a longer file is refused after ``limit`` + 1 bytes were read.
        streams: also read a FIFO, socket or device (a shell's ``<(...)``, ``/dev/stdin``), blocking, up to
            ``limit`` bytes; without it only a regular file is read.

    Raises:
        OSError: the file cannot be opened or read (``strerror`` says why).
        FileRefused: it is a folder, or (without ``streams``) a FIFO, socket or device, or it is over ``limit``.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise FileRefused("it is a folder, not a file", kind="a folder")
        regular = stat.S_ISREG(info.st_mode)
        if not regular and not streams:
            raise FileRefused("it is a FIFO, socket or device, not a regular file", kind="a FIFO, socket or device")
        if regular and info.st_size > limit:
            raise FileRefused(f"file is {info.st_size} bytes; at most {limit}", size=info.st_size, limit=limit)
        chunks: list[bytes] = []
        if stat.S_ISFIFO(info.st_mode):
            try:  # opened without blocking, a FIFO whose writer has not opened yet reads as empty
                first: bytes | None = os.read(fd, 1 << 16)
            except BlockingIOError:  # a writer is there and has written nothing yet
                first = None
            if first == b"":  # no writer yet: wait for one, as a plain open does (this fd kept open meanwhile, so a
                waiting = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # writer it let in keeps a reader)
                os.close(fd)
                fd = waiting
            chunks.append(first or b"")
        if not regular:
            os.set_blocking(fd, True)  # read as a plain open would: EOF when the writer is done, bytes still capped
        left = limit + 1 - sum(map(len, chunks))
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        size = max(info.st_size, len(data)) if regular else len(data)
        what = f"file is {size} bytes" if regular else f"it holds more than {limit} bytes"
        raise FileRefused(f"{what}; at most {limit}", size=size, limit=limit)
    return data
