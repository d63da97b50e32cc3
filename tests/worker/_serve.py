"""A real worker for tests: uvicorn serving ``create_app`` in a thread, on loopback TCP or a Unix socket; or
``guard worker serve`` as its own process, as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette

from guard.backends.batcher import MicroBatcher
from guard.backends.local import LocalBackend
from guard.worker.app import WorkerConfig, create_app
from tests.asgi._servers import _Server

ROOT = Path(__file__).resolve().parents[2]


class ServerThread:
    """uvicorn (lifespan on, more ``uvicorn.Config`` settings in ``options``) serving ``app`` in a thread, on loopback
    TCP (a free port) or a Unix socket."""

    def __init__(self, app: Starlette, *, uds: str | None = None, options: Mapping[str, Any] | None = None) -> None:
        if uds:
            config = uvicorn.Config(app, uds=uds, log_level="warning", lifespan="on", **(options or {}))
        else:
            config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                    **(options or {}))
        self.app = app
        self.uds = uds
        self.server = _Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="test-uvicorn")
        self.url = ""

    def start(self, ready_path: str | None = "/readyz", timeout: float = 60.0) -> str:
        """Start; return the base URL once ``ready_path`` answers 200 (``http://worker`` over a Unix socket)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        if self.uds:
            self.url = "http://worker"
        else:
            self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        if ready_path:
            with httpx.Client(base_url=self.url, transport=self.sync_transport()) as client:
                while (response := client.get(ready_path)).status_code != 200:
                    if client.get("/healthz").status_code != 200 or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"worker never became ready: {response.text}")
                    time.sleep(0.02)
        return self.url

    def sync_transport(self) -> httpx.HTTPTransport:
        return httpx.HTTPTransport(uds=self.uds) if self.uds else httpx.HTTPTransport()

    def stop(self) -> None:
        """Ask uvicorn to exit (it finishes in-flight requests, then runs the lifespan shutdown) and wait."""
        self.server.should_exit = True
        self.thread.join(60)


@contextmanager
def serve_app_in_thread(app: Starlette, *, uds: str | None = None, ready_path: str | None = "/readyz") -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread; yield its base URL once ``ready_path`` answers 200."""
    server = ServerThread(app, uds=uds)
    try:
        yield server.start(ready_path)
    finally:
        server.stop()


@dataclass
class RunningWorker:
    """A started worker: its URL (``http://worker`` over ``uds``), app, backend and server thread."""

    url: str
    uds: str | None
    app: Starlette
    backend: LocalBackend
    server: ServerThread

    @property
    def batcher(self) -> MicroBatcher[Any, Any]:
        return self.backend.batcher

    def transport(self) -> httpx.AsyncHTTPTransport:
        return httpx.AsyncHTTPTransport(uds=self.uds) if self.uds else httpx.AsyncHTTPTransport()

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        """An async client for the worker (60 s timeout unless given: CI machines can be slow)."""
        kwargs.setdefault("timeout", 60)
        return httpx.AsyncClient(base_url=self.url, transport=self.transport(), **kwargs)


@contextmanager
def serve_worker(
    backend: LocalBackend,
    *,
    config: WorkerConfig | None = None,
    uds: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Iterator[RunningWorker]:
    """Serve ``backend`` through the worker app; the app closes the backend when the server stops. ``options`` are
    more ``uvicorn.Config`` settings (``server_options()`` serves as ``guard worker serve`` does).

    Without ``config`` the worker serves the checkpoint as ``clef-flash``, the model name policies send by default,
    and runs its canaries at start-up only (a periodic run would add forward passes that tests count).
    """
    app = create_app(backend, config=config or WorkerConfig(model_name="clef-flash", canary_interval_s=0))
    server = ServerThread(app, uds=uds, options=options)
    try:
        url = server.start()
        yield RunningWorker(url=url, uds=uds, app=app, backend=backend, server=server)
    finally:
        server.stop()


@dataclass
class WorkerProcess:
    """A running ``guard worker serve`` on a Unix socket: the process and a client factory for its socket."""

    process: subprocess.Popen[bytes]
    uds: str

    def client(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 60)
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), base_url="http://worker", **kwargs)

    def stop(self) -> int:
        """SIGTERM (finish the queued requests, run the lifespan shutdown, exit); the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(60)


@contextmanager
def worker_process(uds: str, *args: str, env: Mapping[str, str] | None = None) -> Iterator[WorkerProcess]:
    """``python -m guard worker serve --uds UDS ARGS...`` with ``env`` added to this process's environment; yields
    once ``/readyz`` answers 200 (up to 120 s), stops it with SIGTERM on exit."""
    command = [sys.executable, "-m", "guard", "worker", "serve", "--uds", uds, *args]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    worker = WorkerProcess(process, uds)
    try:
        with worker.client() as client:
            deadline = time.monotonic() + 120
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"worker exited {process.returncode}: {process.stderr.read().decode()}")
                if time.monotonic() > deadline:
                    raise RuntimeError("worker never became ready")
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        yield worker
    finally:
        worker.stop()
