"""Runs whose outputs no client sees while they run: a chat model's reply held for its verdict
(:class:`~guard.agents.GuardAgentMiddleware` with a ``model_output`` policy), an LLM reviewer's answer, and a tool's
output that a ``tool_result`` policy may withhold.

:func:`quiet_tokens` gives the runs inside a block LangGraph's ``nostream`` tag, leaves out the callback handlers that
stream outputs to a client (LangGraph's ``messages`` stream, ``astream_events``, ``astream_log``) and drops the new
tokens (``on_llm_new_token``) of every other handler but tracers; :func:`quiet_model` does the same to the handlers a
model was built with, and :func:`quiet_tool` to the handlers a ``ToolNode`` runs one tool call with.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from langchain_core.callbacks import BaseCallbackManager
from langchain_core.language_models import BaseLanguageModel
from langchain_core.runnables.base import RunnableBindingBase
from langchain_core.runnables.config import ensure_config, var_child_runnable_config
from langchain_core.tracers.base import BaseTracer
from langgraph.constants import TAG_NOSTREAM

__all__ = ["quiet_model", "quiet_tokens", "quiet_tool"]

#: The ``configurable`` key through which LangGraph hands a run's stream to a graph run inside one of its nodes.
_PARENT_STREAM = "__pregel_stream"


def _streams_outputs(handler: Any) -> bool:
    """Whether a callback handler passes a run's outputs on to a client as they come: LangChain's event and log
    streams (``astream_events``, ``astream_log``) and LangGraph's ``messages`` stream tap every output
    (``tap_output_iter``/``tap_output_aiter``); tracers and loggers do not."""
    return hasattr(handler, "tap_output_iter") and hasattr(handler, "tap_output_aiter")


class _WithoutTokens:
    """A callback handler as a chat model run sees it while its reply is held: every callback passed on to
    ``handler`` except ``on_llm_new_token``, dropped (an application's handler would forward the token to its user
    before the verdict). Attributes (``raise_error``, ``run_inline``, ``ignore_llm``, ...) are ``handler``'s."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    def __getattr__(self, name: str) -> Any:
        if name == "handler":  # not set yet (a copy under construction): no endless lookup
            raise AttributeError(name)
        return getattr(self.handler, name)

    def on_llm_new_token(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __eq__(self, other: object) -> bool:  # a manager's dedup (``add_handler``) sees the handler it wraps
        return other is self or other is self.handler or (
            isinstance(other, _WithoutTokens) and other.handler is self.handler
        )

    def __hash__(self) -> int:
        return id(self.handler)


class _WithoutAsyncTokens(_WithoutTokens):
    """:class:`_WithoutTokens` for a handler whose ``on_llm_new_token`` is a coroutine function: the callback manager
    awaits the dropped token rather than handing it to a thread."""

    async def on_llm_new_token(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        return None


def _quiet(handler: Any) -> Any | None:
    """``handler`` as a held chat model run reports to it: ``None`` (left out) when it streams outputs, as it is
    when it is a tracer (``BaseTracer``: it records the run, tokens included, for tracing such as LangSmith's),
    otherwise without ``on_llm_new_token`` (:class:`_WithoutTokens`)."""
    if _streams_outputs(handler):
        return None
    if isinstance(handler, (BaseTracer, _WithoutTokens)):
        return handler
    if inspect.iscoroutinefunction(getattr(handler, "on_llm_new_token", None)):
        return _WithoutAsyncTokens(handler)
    return _WithoutTokens(handler)


def _without_streams(callbacks: Any) -> Any:
    """``callbacks`` (a list of handlers or a callback manager) as :func:`_quiet` makes each handler: without the
    handlers that stream outputs, and without the new tokens for every one but tracers."""
    if isinstance(callbacks, list):
        return [q for q in map(_quiet, callbacks) if q is not None]
    if isinstance(callbacks, BaseCallbackManager):
        manager = callbacks.copy()
        manager.handlers = [q for q in map(_quiet, manager.handlers) if q is not None]
        manager.inheritable_handlers = [q for q in map(_quiet, manager.inheritable_handlers) if q is not None]
        return manager
    return callbacks


@contextmanager
def quiet_tokens(enabled: bool) -> Iterator[None]:
    """Within the block, chat model runs carry the ``nostream`` tag, report to no handler that streams outputs, and
    report their new tokens (``on_llm_new_token``) to tracers only, so neither ``stream_mode="messages"``, nor
    ``astream_events``/``astream_log``, nor an application's own token handler in ``config["callbacks"]`` gets
    their tokens or their reply before it is judged; every other callback reaches the handlers as before."""
    if not enabled:
        yield
        return
    config = ensure_config()
    quiet = {**config, "tags": [*(config.get("tags") or []), TAG_NOSTREAM]}
    if config.get("callbacks") is not None:
        quiet["callbacks"] = _without_streams(config["callbacks"])
    token = var_child_runnable_config.set(quiet)  # type: ignore[arg-type]
    try:
        yield
    finally:
        var_child_runnable_config.reset(token)


def quiet_model(model: Any, enabled: bool) -> Any:
    """``model`` with the handlers it was built with (``ChatOpenAI(streaming=True, callbacks=[...])``) made as
    :func:`quiet_tokens` makes the run's: a copy when it has any and ``enabled``, else ``model`` itself. A model
    wrapped before the agent got it (``.bind(...)``, ``.with_config(...)``) is copied with the model inside it made
    so, at any depth."""
    if not enabled:
        return model
    if isinstance(model, RunnableBindingBase):
        inner = quiet_model(model.bound, enabled)
        return model if inner is model.bound else model.model_copy(update={"bound": inner})
    if not isinstance(model, BaseLanguageModel) or model.callbacks is None:
        return model
    return model.model_copy(update={"callbacks": _without_streams(model.callbacks)})



@contextmanager
def quiet_tool(runtime: Any, enabled: bool) -> Iterator[None]:
    """Within the block, the tool call whose ``ToolRuntime`` is ``runtime`` reports to its handlers as
    :func:`quiet_tokens` makes them (none that streams outputs), so ``astream_events``/``astream_log`` do not carry its
    output (``on_tool_end``) before guard judged it, and a graph it runs (a sub-agent) does not write its chunks into
    the parent run's stream (``stream(..., subgraphs=True)``: LangGraph passes that stream to a graph run inside a
    node through ``configurable["__pregel_stream"]``). A ``ToolNode`` invokes the tool with the config of the call's
    runtime, so its ``callbacks`` are swapped in that config for the block, and its ``configurable`` for a copy
    without that key (every other key, the checkpointer and the checkpoint namespace included, stays as it is); both
    are put back after (the runtime is the call's own: each call of a ``ToolNode`` gets a config of its own).
    Nothing changes when not ``enabled``, or without a runtime config."""
    config = getattr(runtime, "config", None)
    if not enabled or not isinstance(config, dict):
        yield
        return
    callbacks, configurable = config.get("callbacks"), config.get("configurable")
    if callbacks is not None:
        config["callbacks"] = _without_streams(callbacks)
    if isinstance(configurable, dict) and _PARENT_STREAM in configurable:
        config["configurable"] = {k: v for k, v in configurable.items() if k != _PARENT_STREAM}
    try:
        yield
    finally:
        if callbacks is not None:
            config["callbacks"] = callbacks
        if isinstance(configurable, dict):
            config["configurable"] = configurable
