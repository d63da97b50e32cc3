"""The example agent's tools: real file and shell-like tools confined to a sandbox folder, an HTTP fetch limited to a
local server, and a payment stub that writes a ledger. Every run is recorded in :attr:`Sandbox.runs`, so the replay
can show what actually executed."""

from __future__ import annotations

import json
import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from langchain_core.tools import BaseTool, StructuredTool, ToolException, tool

SHELL_COMMANDS = ("ls", "cat", "head", "wc", "grep", "rm", "echo")
"""The commands ``run_shell`` understands (implemented in Python, inside the sandbox; nothing is spawned)."""
LOCAL_HOSTS = ("127.0.0.1", "localhost")


class SandboxError(ToolException):
    """A tool was asked to leave its sandbox (a path outside the folder, a host other than the local server)."""


def _errors_to_model(tools: list[BaseTool]) -> list[BaseTool]:
    # A failing tool answers the model with its error (like a real tool would), instead of ending the run.
    for t in tools:
        t.handle_tool_error = True
    return tools


def _checked(run: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except (OSError, httpx.HTTPError, UnicodeDecodeError, IndexError) as exc:
            raise ToolException(f"{type(exc).__name__}: {exc}") from exc

    return wrapper


@dataclass
class Sandbox:
    """A folder the file and shell tools may touch, and the log of every tool run.

    Attributes:
        root: the sandbox folder (created if missing).
        runs: ``(tool name, arguments)`` for every tool that actually ran, in order.
    """

    root: Path
    runs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.root = self.root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def record(self, name: str, **arguments: Any) -> None:
        with self.lock:
            self.runs.append((name, arguments))

    def path(self, relative: str) -> Path:
        """``relative`` resolved inside the sandbox.

        Raises:
            SandboxError: for an absolute path or one that escapes the folder.
        """
        candidate = (self.root / relative).resolve()
        if candidate != self.root and self.root not in candidate.parents:
            raise SandboxError(f"path {relative!r} is outside the sandbox")
        return candidate


def _shell(sandbox: Sandbox, command: str) -> str:
    words = shlex.split(command)
    if not words or words[0] not in SHELL_COMMANDS:
        raise SandboxError(f"unknown command {words[0] if words else ''!r}; allowed: {', '.join(SHELL_COMMANDS)}")
    name, args = words[0], words[1:]
    if name == "echo":
        return " ".join(args)
    if name == "ls":
        folder = sandbox.path(args[0] if args else ".")
        return "\n".join(sorted(p.name for p in folder.iterdir()))
    if name == "grep":
        pattern, files = args[0], args[1:]
        return "\n".join(
            f"{f}:{line}" for f in files for line in sandbox.path(f).read_text().splitlines() if pattern in line
        )
    if name == "rm":
        removed = []
        for f in args:
            target = sandbox.path(f)
            if target.is_file():
                target.unlink()
                removed.append(f)
        return f"removed {', '.join(removed) or 'nothing'}"
    texts = [sandbox.path(f).read_text() for f in args]
    if name == "head":
        return "\n".join("\n".join(t.splitlines()[:10]) for t in texts)
    if name == "wc":
        return "\n".join(
            f"{len(t.splitlines())} {len(t.split())} {len(t)} {f}" for t, f in zip(texts, args, strict=True)
        )
    return "".join(texts)  # cat


def sandbox_tools(sandbox: Sandbox) -> list[BaseTool]:
    """``read_file``, ``write_file``, ``run_shell``, ``http_fetch`` and ``send_money`` bound to ``sandbox``."""

    @tool
    def read_file(file_path: str) -> str:
        """Read a text file from the user's folder."""
        sandbox.record("read_file", file_path=file_path)
        return _checked(lambda: sandbox.path(file_path).read_text())()

    @tool
    def write_file(file_path: str, content: str) -> str:
        """Write a text file in the user's folder."""
        sandbox.record("write_file", file_path=file_path)
        _checked(sandbox.path(file_path).write_text)(content)
        return f"wrote {len(content)} characters to {file_path}"

    @tool
    def run_shell(command: str) -> str:
        """Run a shell-like command (ls, cat, head, wc, grep, rm, echo) in the user's folder."""
        sandbox.record("run_shell", command=command)
        return _checked(_shell)(sandbox, command)

    @tool
    def http_fetch(url: str) -> str:
        """Fetch a web page and return its text."""
        sandbox.record("http_fetch", url=url)
        if urlsplit(url).hostname not in LOCAL_HOSTS:
            raise SandboxError(f"this example only fetches from the local server, not {url!r}")
        return _checked(lambda: httpx.get(url, timeout=5.0).text)()

    @tool
    def send_money(recipient: str, amount: float, subject: str, date: str) -> str:
        """Send a transaction to the recipient (IBAN) with the amount, subject and date."""
        sandbox.record("send_money", recipient=recipient, amount=amount, subject=subject, date=date)
        with sandbox.path("ledger.jsonl").open("a") as ledger:
            ledger.write(
                json.dumps({"recipient": recipient, "amount": amount, "subject": subject, "date": date}) + "\n"
            )
        return f"sent {amount} to {recipient}"

    return _errors_to_model([read_file, write_file, run_shell, http_fetch, send_money])


def stub_tools(sandbox: Sandbox, specs: list[dict[str, Any]], skip: set[str]) -> list[BaseTool]:
    """Tools for the AgentDojo functions the example has no real implementation of: each records its run and returns
    a short acknowledgement (``specs`` are ``tools.json`` entries: name, description, JSON-schema parameters)."""

    def make(name: str) -> Any:
        def run(**arguments: Any) -> str:
            sandbox.record(name, **arguments)
            return f"{name}: ok"

        return run

    return _errors_to_model(
        [
            StructuredTool.from_function(
                func=make(spec["name"]),
                name=spec["name"],
                description=spec["description"],
                args_schema=spec["parameters"],
            )
            for spec in specs
            if spec["name"] not in skip
        ]
    )
