"""An application's own callback handlers (``config["callbacks"]``) while an output policy applies: a handler that
forwards ``on_llm_new_token`` to its user (the FastAPI / ``AsyncIteratorCallbackHandler`` /
``StreamingStdOutCallbackHandler`` pattern) gets no token of the reply before the verdict, and so nothing of a
blocked one; its other callbacks still arrive. Tracers (``BaseTracer``: LangSmith's) keep every callback, tokens
included."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest
from langchain.agents import create_agent
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler, CallbackManager
from langchain_core.tracers.base import BaseTracer
from langchain_core.tracers.schemas import Run
from langgraph.checkpoint.memory import InMemorySaver

from guard.agents import GuardAgentMiddleware
from tests.agents._fakes import ToolModel, Turn

USER = {"messages": [("user", "Tell me the key.")]}
SECRET_REPLY = "Sure. Your API key is sk- 12345 - 6789 , keep it safe."


class StreamingModel(ToolModel):
    """The test model built as ``ChatOpenAI(streaming=True)`` is: ``invoke`` streams and reports each token."""

    streaming: bool = True


class Tokens(BaseCallbackHandler):
    """A sync handler that streams tokens to its user, and notes the other callbacks it gets."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.events: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.events.append("chat_model_start")

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.events.append("llm_end")

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.events.append("chain_start")


class AsyncTokens(AsyncCallbackHandler):
    """The async twin (``AsyncIteratorCallbackHandler`` pattern)."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.events: list[str] = []

    async def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)

    async def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.events.append("chat_model_start")

    async def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.events.append("llm_end")


class RecordingTracer(BaseTracer):
    """A tracer (as LangSmith's ``LangChainTracer`` is): it records runs, tokens included, and streams nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[str] = []

    def _persist_run(self, run: Run) -> None:
        pass

    def on_llm_new_token(self, token: str, *, run_id: UUID, **kwargs: Any) -> Any:
        self.tokens.append(token)
        return super().on_llm_new_token(token, run_id=run_id, **kwargs)


def make_agent(h: Any, text: str, **options: Any) -> Any:
    chat = StreamingModel(turns=iter([Turn(text=text), Turn(text="done")]), messages=iter(()), streaming=True)
    middleware = GuardAgentMiddleware(guard=h.guard, **options)
    return create_agent(chat, h.tools, middleware=[middleware], checkpointer=InMemorySaver())


def _check_blocked(out: Any, app: Tokens | AsyncTokens, tracer: RecordingTracer) -> None:
    assert "withheld by guard policy agent-output" in out["messages"][-1].text
    assert app.tokens == []  # no token of the blocked reply reached the app's handler
    assert {"chat_model_start", "llm_end"} <= set(app.events)  # its other callbacks still arrive
    assert "12345" in "".join(tracer.tokens)  # a tracer records the run as before


def test_app_handler_gets_no_token_of_a_blocked_reply(harness: Any, thread: Any) -> None:
    app, tracer = Tokens(), RecordingTracer()
    out = make_agent(harness(), SECRET_REPLY).invoke(USER, {**thread(), "callbacks": [app, tracer]})
    _check_blocked(out, app, tracer)
    assert "chain_start" in app.events


@pytest.mark.anyio
async def test_async_app_handler_gets_no_token_of_a_blocked_reply(harness: Any, thread: Any) -> None:
    app, tracer = AsyncTokens(), RecordingTracer()
    out = await make_agent(harness(), SECRET_REPLY).ainvoke(USER, {**thread(), "callbacks": [app, tracer]})
    _check_blocked(out, app, tracer)


@pytest.mark.anyio
async def test_sync_handler_under_ainvoke_gets_no_token(harness: Any, thread: Any) -> None:
    app, tracer = Tokens(), RecordingTracer()
    out = await make_agent(harness(), SECRET_REPLY).ainvoke(USER, {**thread(), "callbacks": [app, tracer]})
    _check_blocked(out, app, tracer)


def test_handlers_given_as_a_callback_manager(harness: Any, thread: Any) -> None:
    app, tracer = Tokens(), RecordingTracer()
    manager = CallbackManager(handlers=[app, tracer], inheritable_handlers=[app, tracer])
    out = make_agent(harness(), SECRET_REPLY).invoke(USER, {**thread(), "callbacks": manager})
    _check_blocked(out, app, tracer)


@pytest.mark.parametrize("wrap", ["plain", "bind", "with_config"])
def test_handlers_the_model_was_built_with(harness: Any, thread: Any, wrap: str) -> None:
    """``ChatOpenAI(streaming=True, callbacks=[handler])``: LangChain adds the model's own handlers to its run, so
    the run's config cannot reach them; the model call runs on a copy whose handlers get no new tokens, also when
    the model was wrapped before the agent got it (``.bind(stop=...)`` copied only the wrapper: every token leaked)."""
    app, tracer = Tokens(), RecordingTracer()
    chat = StreamingModel(turns=iter([Turn(text=SECRET_REPLY), Turn(text="done")]), messages=iter(()),
                          streaming=True, callbacks=[app, tracer])
    model = {"plain": chat, "bind": chat.bind(stop=["never"]), "with_config": chat.with_config(tags=["x"])}[wrap]
    h = harness()
    agent = create_agent(model, h.tools, middleware=[GuardAgentMiddleware(guard=h.guard)], checkpointer=InMemorySaver())
    _check_blocked(agent.invoke(USER, thread()), app, tracer)
    assert chat.callbacks == [app, tracer]  # the application's model is not changed


def test_messages_stream_and_app_handler_together(harness: Any, thread: Any) -> None:
    app = Tokens()
    agent = make_agent(harness(), SECRET_REPLY)
    streamed = [payload[0].text for mode, payload in agent.stream(
        USER, {**thread(), "callbacks": [app]}, stream_mode=["messages", "updates"]) if mode == "messages"]
    assert "12345" not in "".join(streamed) and app.tokens == []


def test_without_holding_tokens_the_app_handler_streams_live(harness: Any, thread: Any) -> None:
    """``hold_output_stream=False``: tokens reach the app's handler as they come (the documented trade-off)."""
    app = Tokens()
    make_agent(harness(), SECRET_REPLY, hold_output_stream=False).invoke(USER, {**thread(), "callbacks": [app]})
    assert "12345" in "".join(app.tokens)
