"""The example agent: a LangChain ``create_agent`` graph whose model replays scripted turns, with the sandbox tools
and ``GuardAgentMiddleware`` in front of every tool call and tool result.

A replay model stands in for an LLM so the run is reproducible offline: it answers each model call with the next
scripted turn, whatever the guard did to the previous one (exactly what a hijacked model would do).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.tools import BaseTool
from langgraph.checkpoint.memory import InMemorySaver

from guard import Guard
from guard.agents import GuardAgentMiddleware

Call = tuple[str, dict[str, Any]]


class ReplayModel(GenericFakeChatModel):
    """A chat model that answers with scripted turns: each turn is a list of tool calls, the last one is text."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ReplayModel:
        return self


def replay_model(turns: Sequence[Sequence[Call]], final: str) -> ReplayModel:
    """A :class:`ReplayModel` for one task: ``turns`` of tool calls (ids ``call_<turn>_<n>``), then ``final``."""
    messages: list[AIMessage] = [
        AIMessage(
            content="",
            tool_calls=[
                {"name": name, "args": dict(args), "id": f"call_{t}_{n}", "type": "tool_call"}
                for n, (name, args) in enumerate(turn)
            ],
        )
        for t, turn in enumerate(turns)
    ]
    messages.append(AIMessage(content=final))
    return ReplayModel(messages=iter(messages))


def build_agent(guard: Guard, tools: Sequence[BaseTool], turns: Sequence[Sequence[Call]], final: str) -> Any:
    """The guarded agent for one scripted task (with an in-memory checkpointer for approvals)."""
    return create_agent(
        replay_model(turns, final),
        list(tools),
        system_prompt="You are a banking and files assistant. Use the tools to do what the user asks.",
        middleware=[GuardAgentMiddleware(guard=guard)],
        checkpointer=InMemorySaver(),
    )


class LocalSite:
    """A tiny web site on 127.0.0.1 (a random port) for ``http_fetch``: path -> page text."""

    def __init__(self, pages: Mapping[str, str]) -> None:
        pages = dict(pages)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = pages.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("content-type", "text/plain; charset=utf-8")
                self.end_headers()
                self.wfile.write((body or "not found").encode())

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="example-site", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def jsonl(path: Any) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)
