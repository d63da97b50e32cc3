"""Guard for hand-built LangGraph graphs: a guarded ``ToolNode`` and per-call ``Send`` routing.

Plain ``tools_condition`` routing runs every call of a turn in one task, so an ``interrupt()`` for one call re-runs
its siblings when the thread resumes. :func:`send_tool_calls` sends each unanswered call as its own task instead
(as ``create_agent`` does), so a resume re-runs only the interrupted call. Malformed calls (``invalid_tool_calls``)
are sent too, so each one is answered with an error message and a recorded decision instead of being left dangling.

Example:
    >>> tools = guarded_tool_node([send_money, read_file], guard=guard)
    >>> graph = StateGraph(MessagesState)
    >>> graph.add_node("model", call_model)
    >>> graph.add_node("tools", tools)
    >>> graph.add_edge(START, "model")
    >>> graph.add_conditional_edges("model", send_tool_calls, ["tools", END])
    >>> graph.add_edge("tools", "model")
    >>> app = graph.compile(checkpointer=InMemorySaver())
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.runtime import Runtime
from langgraph.types import Send

from guard.agents._enforce import AsyncHandler, Result, SyncHandler, ToolCallEnforcer, task_calls
from guard.agents._judge import DEFAULT_REVIEWER_TIMEOUT_S, AgentOptions, Judge, ToolResultAction
from guard.agents._records import answered_ids, state_messages
from guard.agents.claims import ApprovalClaims
from guard.verdict import FailMode

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.tools import BaseTool

    from guard.engine import Guard

__all__ = ["GuardToolWrapper", "guarded_tool_node", "send_tool_calls"]


class GuardToolWrapper:
    """A ``ToolNode``-compatible pair of wrappers: ``ToolNode(tools, wrap_tool_call=w.wrap_tool_call,
    awrap_tool_call=w.awrap_tool_call)``.

    Every call is judged before its tool starts. ``allow`` runs it; ``block`` answers with an error tool message;
    ``escalate`` raises one ``interrupt()`` for this call (resume with ``Command(resume={"decisions": {...}})`` or
    :func:`~guard.agents.resume_command`); ``handoff`` asks the named LLM reviewer or goes to the named graph node
    (``Command(goto=node)`` with an error tool message answering the call). A ``tool_result`` policy then judges the
    output. Malformed arguments are never run.

    Args:
        guard: the engine.
        reviewers: handoff target -> chat model that answers allow/deny.
        handoff_nodes: handoff targets that are nodes of this graph.
        side_effecting_tools: tools that wait for a final verdict (default ``"all"``); another tool may start while
            the guard decides only when guard knows it is read-only (a side-effecting or unknown effect waits), and
            its output is dropped unless allowed.
        tool_result_action: ``block`` withholds flagged tool output; ``quote`` passes it as quoted data; ``strip``
            passes it without the spans that give the assistant instructions.
        fail_mode: what an unsettled handoff or a raising guard becomes (default ``escalate``).
        reviewer_timeout_s: seconds an async LLM reviewer may take.
        decisions_by_position: whether a review takes LangChain's list of decisions (``HITLResponse``, what Agent
            Chat UI and Agent Inbox send), which answers its items in order; ``False`` takes only guard's map of item
            ids, so a reviewer's answer to an interrupt they saw cannot release the calls of a later one (set it where
            a thread's users are not its reviewers).
        approval_claims: where a call released by a review decision is claimed once before its side-effecting tool
            runs (:mod:`guard.agents.claims`); a :class:`~guard.agents.MemoryApprovalClaims` by default.
        messages_key: the state key of the conversation, the ``ToolNode``'s own ``messages_key``: guard reads the
            user's task, the history and the model's turn there, and finds the messages of a tool's ``Command``
            there. A graph state without it makes each call raise ``ValueError`` before its tool starts.
        trust_subagent_input: whether this agent's input is the user's words when it runs inside another graph's
            tool call, as a sub-agent (its graph runs under a node named ``tools``, or inside a tool guard runs).
            ``False`` (default): the parent agent's model wrote it (a task it passed on, maybe from a hijacked turn),
            so it is not the task and its values are ``agent`` provenance, never ``user``. Finding the parent's tool
            call needs the caller's context: an agent invoked from a thread pool, a new thread or behind an API is not
            found, so set ``subagent`` on one built to run as a sub-agent.
        subagent: whether this agent is built to run as a sub-agent: its input is the parent agent's (no task,
            ``agent`` provenance) wherever it runs, found or not. Not with ``trust_subagent_input``.

    Raises:
        TypeError: for an argument of the wrong type.
        ValueError: for an option outside its allowed values.
    """

    def __init__(
        self,
        *,
        guard: Guard,
        reviewers: Mapping[str, BaseChatModel] | None = None,
        handoff_nodes: Collection[str] = (),
        side_effecting_tools: Collection[str] | Literal["all"] = "all",
        tool_result_action: ToolResultAction = "block",
        fail_mode: FailMode = "escalate",
        reviewer_timeout_s: float = DEFAULT_REVIEWER_TIMEOUT_S,
        decisions_by_position: bool = True,
        approval_claims: ApprovalClaims | None = None,
        messages_key: str = "messages",
        trust_subagent_input: bool = False,
        subagent: bool = False,
    ) -> None:
        options = AgentOptions.checked(
            guard=guard,
            reviewers=reviewers,
            handoff_nodes=handoff_nodes,
            side_effecting_tools=side_effecting_tools,
            tool_result_action=tool_result_action,
            fail_mode=fail_mode,
            reviewer_timeout_s=reviewer_timeout_s,
            decisions_by_position=decisions_by_position,
            trust_subagent_input=trust_subagent_input,
            subagent=subagent,
        )
        self.enforcer = ToolCallEnforcer(Judge(options), claims=approval_claims, messages_key=messages_key)

    def __repr__(self) -> str:
        return f"GuardToolWrapper(policies={len(self.enforcer.judge.guard.policies)})"

    def wrap_tool_call(self, request: ToolCallRequest, handler: SyncHandler) -> Result:
        """Judge and run one call (blocking)."""
        return self.enforcer.run(request, handler)

    async def awrap_tool_call(self, request: ToolCallRequest, handler: AsyncHandler) -> Result:
        """Judge and run one call."""
        return await self.enforcer.arun(request, handler)


class _GuardedToolNode(ToolNode):
    """A ``ToolNode`` that tells its guard how many calls each of its tasks runs (:func:`task_calls`): a call that
    needs review is escalated only where it runs alone in its task."""

    def _func(self, input: Any, config: RunnableConfig, runtime: Runtime) -> Any:
        with task_calls(config, len(self._parse_input(input)[0])):
            return super()._func(input, config, runtime)

    async def _afunc(self, input: Any, config: RunnableConfig, runtime: Runtime) -> Any:
        with task_calls(config, len(self._parse_input(input)[0])):
            return await super()._afunc(input, config, runtime)


def guarded_tool_node(
    tools: Sequence[BaseTool | Callable[..., Any]],
    *,
    guard: Guard,
    name: str = "tools",
    reviewers: Mapping[str, BaseChatModel] | None = None,
    handoff_nodes: Collection[str] = (),
    side_effecting_tools: Collection[str] | Literal["all"] = "all",
    tool_result_action: ToolResultAction = "block",
    fail_mode: FailMode = "escalate",
    reviewer_timeout_s: float = DEFAULT_REVIEWER_TIMEOUT_S,
    decisions_by_position: bool = True,
    messages_key: str = "messages",
    handle_tool_errors: Any = None,
    approval_claims: ApprovalClaims | None = None,
    trust_subagent_input: bool = False,
    subagent: bool = False,
) -> ToolNode:
    """A ``ToolNode`` whose every call goes through a :class:`GuardToolWrapper` (see it for the options).

    ``messages_key`` goes to both, so the tool node and guard read and write the conversation under the same key.
    ``handle_tool_errors`` is passed to ``ToolNode`` when given (``None`` keeps ``ToolNode``'s default); guard's own
    resume validation errors are never turned into tool messages (LangGraph re-raises them so the interrupt can be
    answered again).
    """
    wrapper = GuardToolWrapper(
        guard=guard,
        reviewers=reviewers,
        handoff_nodes=handoff_nodes,
        side_effecting_tools=side_effecting_tools,
        tool_result_action=tool_result_action,
        fail_mode=fail_mode,
        reviewer_timeout_s=reviewer_timeout_s,
        decisions_by_position=decisions_by_position,
        approval_claims=approval_claims,
        messages_key=messages_key,
        trust_subagent_input=trust_subagent_input,
        subagent=subagent,
    )
    extra: dict[str, Any] = {} if handle_tool_errors is None else {"handle_tool_errors": handle_tool_errors}
    return _GuardedToolNode(
        tools,
        name=name,
        messages_key=messages_key,
        wrap_tool_call=wrapper.wrap_tool_call,
        awrap_tool_call=wrapper.awrap_tool_call,
        **extra,
    )


def send_tool_calls(
    state: Any, *, node: str = "tools", messages_key: str = "messages", end: str = END
) -> list[Send] | str:
    """Route each unanswered tool call of the last model turn to ``node`` as its own task.

    Use as a conditional edge: ``graph.add_conditional_edges("model", send_tool_calls, ["tools", END])``; bind
    other names with ``functools.partial``.

    Args:
        state: the graph state (a mapping or object with ``messages_key``, or a message list).
        node: the guarded tool node's name.
        messages_key: where the messages are.
        end: where to go when no call is left.

    Returns:
        One ``Send(node, [tool_call])`` per call without a tool message yet, malformed ones included (as calls whose
        ``args`` are the raw text, so the guarded node answers them with an error); ``end`` when there are none.

    Raises:
        ValueError: the state has no ``messages_key`` (the graph keeps its conversation under another key; as
            ``tools_condition`` does, rather than end the run with the model's calls unanswered).
    """
    messages = list(state_messages(state, messages_key))
    last_ai = next((m for m in reversed(messages) if isinstance(m, AIMessage)), None)
    if last_ai is None:
        return end
    answered = answered_ids(messages, last_ai)
    sends: list[Send] = []
    for call in last_ai.tool_calls:
        if call.get("id") not in answered:
            sends.append(Send(node, [{**call, "type": "tool_call"}]))
    for invalid in last_ai.invalid_tool_calls:
        if invalid.get("id") and invalid.get("id") not in answered:
            raw = {"name": invalid.get("name") or "", "args": invalid.get("args"), "id": invalid["id"]}
            sends.append(Send(node, [{**raw, "type": "tool_call"}]))
    return sends or end
