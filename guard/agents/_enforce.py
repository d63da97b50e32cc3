"""Per-call enforcement inside a tool node: the verdict is final before a side-effecting tool starts.

:class:`ToolCallEnforcer` is what the guarded ``ToolNode`` runs for every call, and what
:class:`~guard.agents.GuardAgentMiddleware` falls back to when a call reaches the tool node without a record from the
model turn (another middleware changed it, or it came from elsewhere). It checks the arguments, judges the
call, and then runs it, blocks it, hands it to a graph node, or raises one ``interrupt()`` for this call alone. After
the tool ran, a ``tool_result`` policy may withhold or quote its output.

An interrupt here is per call: each call runs as its own task (``Send``), so resuming one never re-runs a sibling
that already finished. On resume the task starts again and the call is judged again (a probability cache makes that
cheap); the pending item's id depends only on thread, turn, call id and arguments, so the reviewer's decision still
applies, and an approval can never release different arguments. A call a review released is claimed once in the
shared :mod:`~guard.agents.claims` store right before its side-effecting tool runs, under the id of the call as it
was held (an edit does not change it), so a second resume of the same interrupt (concurrent, or replayed from its
checkpoint, with the same decision or another) raises instead of running the tool again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage, convert_to_messages
from langgraph.config import get_config
from langgraph.errors import GraphBubbleUp, GraphInterrupt
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, interrupt
from pydantic import BaseModel, ValidationError

from guard.agents import _messages as msgs
from guard.agents._arguments import (
    ParsedCall,
    arguments_digest,
    classify_arguments,
    empty_arguments_problem,
    guard_effect,
    parse_calls,
    tool_effect,
)
from guard.agents._content import message_text, unread_media
from guard.agents._judge import Judge, Judgement
from guard.agents._quiet import quiet_tool
from guard.agents._records import (
    ai_message_for,
    answered_ids,
    conversation,
    current_thread_id,
    running_tool,
    tool_item,
)
from guard.agents.claims import ApprovalClaims, MemoryApprovalClaims, claim_id
from guard.agents.decisions import pending_id, response_schema, review_request
from guard.errors import ApprovalAlreadyUsed
from guard.policy.instructions import find_instructions, strip_spans
from guard.policy.provenance import DETECTOR_MAX_CHARS, resolved_effect
from guard.subject import AgentSubject

__all__ = ["DEFAULT_MAX_REVIEW_ROUNDS", "Prepared", "ToolCallEnforcer", "redirect", "task_calls"]

DEFAULT_MAX_REVIEW_ROUNDS = 3
"""How many times an edited call may be escalated again before it is refused."""
TOO_MANY_ROUNDS = "the edited call still needs approval after {rounds} review rounds"

Result = ToolMessage | Command[Any] | list[ToolMessage | Command[Any]]
SyncHandler = Callable[[ToolCallRequest], Result]
AsyncHandler = Callable[[ToolCallRequest], Awaitable[Result]]


def redirect(request: ToolCallRequest, tool: str, arguments: Any) -> ToolCallRequest | str:
    """``request`` with its call replaced by ``tool(arguments)`` (the tool looked up in the runtime's tools when the
    name changes), or why it cannot be (``"names a tool which this agent does not have (tools: ...)"``: the name
    itself is not quoted, since the message the model reads must not carry text nobody judged)."""
    call = {**request.tool_call, "name": tool, "args": arguments}
    if tool == request.tool_call.get("name"):
        return request.override(tool_call=call)  # type: ignore[arg-type]
    runtime_tools = getattr(request.runtime, "tools", None) or []
    found = next((t for t in runtime_tools if t.name == tool), None)
    if found is None:
        names = ", ".join(sorted(t.name for t in runtime_tools)) or "(none)"
        return f"names a tool which this agent does not have (tools: {names})"
    return request.override(tool_call=call, tool=found)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Prepared:
    """One well-formed call, ready to judge: the request, its subject and the binding facts. ``turn_calls``: how many
    calls (valid and invalid) the model's turn that made this one holds (0 when that turn is not in the state);
    ``edited``: a reviewer changed it; ``reviewed``: a review decision released it (it is claimed once before it
    runs); ``rewritten``: a wrapper listed before guard changed its name or arguments (claimed too, but the claim is
    given back when the tool raises, so a retry can run it); ``held_digest``: the digest of the call as the model's turn holds it (as prepared when that turn is not in
    the state), which an edit leaves as it is: every decision on one review item makes the same claim;
    ``ran_early``: its tool started before the verdict in this run (:meth:`ToolCallEnforcer.run`), so a message saying
    the call did not pass says it ran; ``may_have_run``: it could start early in the run that asked for the review this
    one resumes, which this run cannot tell, so such a message says it may have run."""

    request: ToolCallRequest
    tool_call_id: str
    tool: str
    arguments: dict[str, Any]
    digest: str
    message_id: str | None
    thread_id: str | None
    subject: AgentSubject
    turn_calls: int = 0
    edited: bool = False
    reviewed: bool = False
    rewritten: bool = False
    held_digest: str = ""
    ran_early: bool = False
    may_have_run: bool = False


logger = logging.getLogger("guard.agents")

#: The trigger LangGraph gives a task started by ``Send`` (its ``langgraph_triggers`` metadata).
_SENT_TASK = "__pregel_push"
#: The ``configurable`` key of LangGraph's per-task scratchpad, where ``interrupt()`` finds its resume values.
_SCRATCHPAD = "__pregel_scratchpad"
#: The ``configurable`` key LangGraph sets on the first step of a resumed run (``Command`` or ``None`` input), whose
#: tasks include those that stopped on an interrupt, answered or not.
_RESUMING = "__pregel_resuming"
#: The ``configurable`` key of the id of the graph task this runs in.
_TASK_ID = "__pregel_task_id"
#: The graph task a guarded tool node runs and how many calls its input holds (:func:`task_calls`).
_TASK_CALLS: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("guard_task_calls", default=None)


@contextlib.contextmanager
def task_calls(config: Mapping[str, Any], count: int) -> Iterator[None]:
    """Within the block the calls of a tool-node task run: ``count`` calls in the task ``config`` names, which
    :meth:`ToolCallEnforcer._shares_its_task` reads (a ``Send`` may carry several calls, or the whole state)."""
    token = _TASK_CALLS.set(((config.get("configurable") or {}).get(_TASK_ID) or "", count))
    try:
        yield
    finally:
        _TASK_CALLS.reset(token)


def _configurable() -> dict[str, Any] | None:
    """The ``configurable`` of the graph task this runs in; ``None`` outside a graph run."""
    try:
        return get_config().get("configurable") or {}
    except RuntimeError:  # not inside a graph run
        return None


def _resume_values() -> list[Any] | None:
    """The resume values LangGraph holds for this task: those answering its interrupts by id, and the value of a plain
    ``Command(resume=value)``, which counts only on the first step of a resumed run (in a subgraph it stays readable
    by the tasks of later steps, which answer nothing). ``[]`` outside a graph run; ``None`` when the task's
    scratchpad cannot be read."""
    configurable = _configurable()
    if configurable is None:
        return []
    scratchpad = configurable.get(_SCRATCHPAD)
    try:
        values = list(scratchpad.resume)
        null = scratchpad.get_null_resume(False) if configurable.get(_RESUMING) else None
    except (AttributeError, TypeError):
        return None
    return values if null is None else [*values, null]


def _answered() -> bool:
    """Whether this task runs again with an answer to an interrupt it asked (LangGraph holds a resume value for it,
    :func:`_resume_values`: the answer to a review of its call, or to its tool's own ``interrupt()``). ``False``
    outside a graph run; ``True`` when the task's scratchpad cannot be read."""
    values = _resume_values()
    return values is None or bool(values)


def _review_answered(item_id: str) -> bool:
    """Whether this task runs again with an answer to guard's own review of one call: a resume value LangGraph holds
    for it (:func:`_resume_values`) is a decisions map holding ``item_id`` (the call's pending item) or a list of
    decisions. An answer to another interrupt (a ``HumanInTheLoopMiddleware`` listed before guard, the tool's own
    ``interrupt()``) does not count. ``False`` outside a graph run and when the task's scratchpad cannot be read
    (nothing then shows that guard asked)."""
    for value in _resume_values() or ():
        decisions = value.get("decisions") if isinstance(value, Mapping) else None
        if isinstance(decisions, list) or (isinstance(decisions, Mapping) and item_id in decisions):
            return True
    return False


def _resuming() -> bool:
    """Whether this task may run again after an interrupt: it holds an answer (:func:`_answered`), or it runs in the
    first step of a resumed run, where a task whose review is still unanswered (another was answered) runs again
    too. ``False`` outside a graph run."""
    configurable = _configurable()
    return configurable is not None and (bool(configurable.get(_RESUMING)) or _answered())


def _holds_tool_message(value: Any) -> bool:
    """Whether a ``Command`` update's value is a ``ToolMessage`` or a list or tuple holding one."""
    items = value if isinstance(value, list | tuple) else [value]
    return any(isinstance(item, ToolMessage) for item in items)


class ToolCallEnforcer:
    """Judges and runs one tool call at a time (sync and async twins share everything but I/O).

    Args:
        judge: evaluates subjects and settles handoffs.
        side_effecting_tools: tool names that must wait for a final verdict, or ``"all"``. A tool it does not name
            may start while the guard decides only if guard knows it is read-only (:meth:`_speculative`), and never
            when the call is resumed; its output is discarded unless the verdict allows it.
        tool_result_action: what a non-allow ``tool_result`` verdict does: ``block`` (withhold the output),
            ``strip`` (pass it on without the spans that give the agent instructions; withheld when none is found) or
            ``quote`` (pass it on as quoted data with a warning).
        max_review_rounds: escalations of an edited call before it is refused.
        claims: where calls released by a review decision are claimed before a side-effecting tool runs (single
            use; :mod:`guard.agents.claims`); a :class:`~guard.agents.claims.MemoryApprovalClaims` by default.
        messages_key: the state key of the conversation (the tool node's ``messages_key``): where the user's task,
            the history and the model's turn are read, where a tool's ``Command`` update holds its messages, and
            where a handoff's ``Command`` writes its answer.
        summarized: the ids of the state's ``agent`` messages that summarize flagged tool results
            (:func:`~guard.agents._records.turn_history`), as the middleware's record keeps them; none by default.
        server_flagged: the keys of the state's server tool results that were not allowed
            (:func:`~guard.agents._records.server_key`), as the middleware's record keeps them; none by default.
        trusted_system: the digests of the state's trusted system messages
            (:func:`~guard.agents._records.opening_system`), as the middleware's record keeps them; by default only
            where a system message stands counts.

    Raises:
        TypeError: ``claims`` is not an approval claims store, or ``messages_key`` is not a string.
        ValueError: ``messages_key`` is empty.
    """

    def __init__(
        self,
        judge: Judge,
        *,
        max_review_rounds: int = DEFAULT_MAX_REVIEW_ROUNDS,
        claims: ApprovalClaims | None = None,
        messages_key: str = "messages",
        summarized: Callable[[Any], Collection[str]] | None = None,
        server_flagged: Callable[[Any], Collection[str]] | None = None,
        trusted_system: Callable[[Any], Collection[str]] | None = None,
    ) -> None:
        if claims is not None and not isinstance(claims, ApprovalClaims):
            raise TypeError("approval_claims must be an ApprovalClaims (claim, release and fail, sync and async), "
                            f"not {type(claims).__name__}")
        if not isinstance(messages_key, str):
            raise TypeError(f"messages_key must be a state key (a string), not {type(messages_key).__name__}")
        if not messages_key:
            raise ValueError("messages_key must be a non-empty state key")
        self.messages_key = messages_key
        self.judge = judge
        self.claims: ApprovalClaims = claims if claims is not None else MemoryApprovalClaims()
        side = judge.options.side_effecting_tools
        self.side_effecting = None if side == "all" else side
        self.tool_result_action = judge.options.tool_result_action
        self.max_review_rounds = max_review_rounds
        self.summarized = summarized
        self.server_flagged = server_flagged
        self.trusted_system = trusted_system

    # Preparation (no I/O) -------------------------------------------------------------------------------------

    def prepare(self, request: ToolCallRequest) -> Prepared | ToolMessage:
        """Check the call's arguments and build its subject; a malformed or already answered call gets its error
        message instead (the decision for a malformed call is recorded).

        Malformed: arguments that are not one JSON object (:func:`~guard.agents._arguments.classify_arguments`), or
        that are not a parsed mapping (raw text, as :func:`~guard.agents.send_tool_calls` forwards a call LangChain
        could not parse: the tool node runs only a mapping); a call the model's turn made malformed
        (:meth:`_model_call`: among its ``invalid_tool_calls``, an id two of its calls share, or the model's raw
        text refused); empty arguments for a tool with required parameters; no id.

        Raises:
            ValueError: the graph state does not hold ``messages_key`` (:func:`~guard.agents._records.state_messages`:
                guard would judge the call without the user's task, the history and the model's turn).
        """
        state = request.state
        call = request.tool_call
        call_id = call.get("id") or ""
        name = call.get("name") or ""
        ai = ai_message_for(state, call_id or None, messages_key=self.messages_key)
        if call_id and call_id in answered_ids(state, ai, messages_key=self.messages_key):
            return msgs.already_answered(name, call_id)
        args = call.get("args")
        arguments, problem = classify_arguments(args)
        raw: str | None = args if isinstance(args, str) else None
        model_call = self._model_call(ai, call_id, name, arguments) if ai is not None and call_id else None
        if problem is None and model_call is not None and model_call.problem:
            problem, raw = model_call.problem, model_call.raw
        if problem is None and not isinstance(args, dict):
            problem = "arguments arrived as raw text, not as a parsed object"
        if problem is None and arguments is not None:
            problem = empty_arguments_problem(request.tool, arguments)
        if problem is None and not call_id:
            problem = "the tool call has no id"
        thread_id = current_thread_id()
        task, history = conversation(
            state,
            messages_key=self.messages_key,
            trust_subagent_input=self.judge.options.trust_subagent_input,
            subagent=self.judge.options.subagent,
            summarized=self.summarized(state) if self.summarized is not None else (),
            server_flagged=self.server_flagged(state) if self.server_flagged is not None else (),
            trusted_system=self.trusted_system(state) if self.trusted_system is not None else None,
        )
        subject = AgentSubject(
            event="tool_call",
            tool_name=name,
            tool_call_id=call_id,
            arguments=arguments if problem is None else None,
            user_message=task,
            thread_id=thread_id,
            history=history,
            tool_effect=tool_effect(request.tool),
        )
        if problem is not None or arguments is None:
            verdict = self.judge.malformed(subject, problem or "arguments are missing", raw)
            return msgs.malformed(name, call_id, problem or "arguments are missing", verdict)
        digest = arguments_digest(name, arguments)
        held = next((c for c in ai.tool_calls if c.get("id") == call_id), None) if ai is not None else None
        return Prepared(
            request,
            call_id,
            name,
            arguments,
            digest,
            ai.id if ai is not None else None,
            thread_id,
            subject,
            len(ai.tool_calls) + len(ai.invalid_tool_calls) if ai is not None else 0,
            held_digest=arguments_digest(held["name"], held["args"]) if held is not None else digest,
        )

    @staticmethod
    def _model_call(ai: AIMessage, call_id: str, name: str, arguments: Any) -> ParsedCall | None:
        """The model's call ``call_id`` as :func:`~guard.agents._arguments.parse_calls` checked it, where the model's
        turn decides about the call: always when two of the turn's calls share the id or the call is one of its
        ``invalid_tool_calls`` (neither ever runs, whatever arguments it carries now), else when the call still has
        the name and (as LangChain parsed them) arguments the model sent. ``None`` for a call another middleware
        replaced (judged as it is now, not by the model's raw text)."""
        parsed = [c for c in parse_calls(ai) if c.id == call_id]
        if not parsed:
            return None
        invalid = any(c.get("id") == call_id for c in ai.invalid_tool_calls)
        sent = next((c for c in ai.tool_calls if c.get("id") == call_id), None)
        as_sent = sent is not None and sent.get("name") == name and sent.get("args") == arguments
        return parsed[0] if len(parsed) > 1 or invalid or as_sent else None

    def _speculative(self, prepared: Prepared) -> bool:
        """Whether ``prepared``'s tool may start while the guard decides: ``side_effecting_tools`` is a list that does
        not name it, and its effect is ``read_only`` as every policy matching the call reads it (the policy's
        ``tools`` entry, else the application's ``guard_effect`` metadata, :func:`~guard.agents._arguments.guard_effect`;
        that metadata alone when none matches). An MCP server's ``readOnlyHint`` does not count here (the server
        sets it). A side-effecting tool, or one whose effect is unknown, waits for its verdict, as does a call whose
        arguments the tool refuses or may refuse (:meth:`_refuses`: it would not run, so nothing starts)."""
        if self.side_effecting is None or prepared.tool in self.side_effecting or self._refuses(prepared) is not False:
            return False
        declared = guard_effect(prepared.request.tool)
        policies = self.judge.guard.matching(prepared.subject)
        effects = {resolved_effect(policy.tools, prepared.tool, declared) for policy in policies} or {declared}
        return effects == {"read_only"}

    def apply_edit(self, prepared: Prepared, decision: Mapping[str, Any]) -> Prepared | ToolMessage:
        """The call a reviewer edited (``arguments`` and maybe ``tool``), or an error message when the new tool does
        not exist or cannot run with the arguments (empty, for a tool with required parameters: the check a model's
        call gets). A renamed call's subject takes the new tool's declared effect. The edited call is not judged
        here."""
        tool = decision.get("tool") or prepared.tool
        arguments = decision["arguments"]
        new_request = redirect(prepared.request, tool, arguments)
        if isinstance(new_request, str):
            reason = f"the reviewer's edit {new_request}"
            return msgs.rejected(prepared.tool, prepared.tool_call_id, None, reason, "", **self._started(prepared))
        problem = empty_arguments_problem(new_request.tool, arguments)
        if problem is not None:
            reason = f"the reviewer's edit cannot run: {problem}"
            return msgs.rejected(prepared.tool, prepared.tool_call_id, None, reason, "", **self._started(prepared))
        subject = replace(prepared.subject, tool_name=tool, arguments=arguments, tool_effect=tool_effect(new_request.tool))
        return replace(
            prepared,
            request=new_request,
            tool=tool,
            arguments=arguments,
            digest=arguments_digest(tool, arguments),
            subject=subject,
            edited=True,
        )

    def claim_key(self, prepared: Prepared) -> str | None:
        """The claim id of a call a review decision released (or a wrapper rewrote) to a side-effecting tool
        (``None`` for any other call): the held call's, so an approval and an edit of one review item claim the same
        id."""
        if not (prepared.reviewed or prepared.edited or prepared.rewritten) or self._speculative(prepared):
            return None
        return claim_id(
            thread_id=prepared.thread_id,
            message_id=prepared.message_id,
            tool_call_id=prepared.tool_call_id,
            digest=prepared.held_digest,
        )

    @staticmethod
    def _gives_back(prepared: Prepared, problem: Exception) -> bool:
        """Whether the claim of a call whose tool raised ``problem`` is given back: when the tool asked for input
        itself (``GraphInterrupt``: it runs again from its start when resumed), and for any error of a call only a
        wrapper rewrote (no review released it, so a retry of a failed run is not a second use of a release)."""
        return isinstance(problem, GraphInterrupt) or (prepared.rewritten and not (prepared.reviewed or prepared.edited))

    def _shares_its_task(self, prepared: Prepared) -> bool:
        """Whether this call runs in one tool-node task with other calls of its message (a graph routing them with
        ``tools_condition`` rather than :func:`~guard.agents.send_tool_calls`, which sends each alone, or a ``Send``
        that carries several calls or the whole state). Such a call is not escalated (:meth:`_stop` blocks it): the
        task's interrupts resume in no stable order (LangGraph matches answers to them by position, so LangChain's
        list of decisions released a call no reviewer saw), and every resume runs the task's other calls again. A
        guarded tool node counts its task's calls (:func:`task_calls`); in another tool node, a task ``Send`` started
        is taken to hold one call."""
        try:
            config = get_config()
        except RuntimeError:  # not inside a graph run
            return False
        known = _TASK_CALLS.get()
        if known is not None and known[0] == (config.get("configurable") or {}).get(_TASK_ID):
            return known[1] > 1
        triggers = config.get("metadata", {}).get("langgraph_triggers") or ()
        return _SENT_TASK not in triggers and prepared.turn_calls > 1

    @staticmethod
    def _item_id(prepared: Prepared) -> str:
        """The id of the pending item a review of ``prepared`` has (:func:`~guard.agents._records.tool_item`)."""
        scope = f"tool_call:{prepared.message_id or ''}"
        return pending_id(thread_id=prepared.thread_id, scope=scope, key=prepared.tool_call_id, digest=prepared.digest)

    def _review(self, prepared: Prepared, judgement: Judgement) -> dict[str, Any]:
        item = tool_item(
            judgement,
            thread_id=prepared.thread_id,
            message_id=prepared.message_id,
            tool_call_id=prepared.tool_call_id,
            tool=prepared.tool,
            arguments=prepared.arguments,
            digest=prepared.digest,
            tools=[tool.name for tool in getattr(prepared.request.runtime, "tools", None) or []] or None,
        )
        positional = self.judge.options.decisions_by_position
        request = review_request([item], positional=positional)
        schema = response_schema([item], exact=False, positional=positional)
        answer = interrupt(request, response_schema=schema)
        decision: dict[str, Any] = answer["decisions"][item["id"]]
        self.judge.reviewed(item, decision)
        return decision | {"_item": item["id"]}

    def _stop(self, prepared: Prepared, judgement: Judgement) -> Result:
        """The answer to a call that does not run: handed to a node, or blocked (an escalation that cannot be
        reviewed where it runs, see :meth:`_shares_its_task`, included)."""
        started = self._started(prepared)
        if judgement.outcome == "route":
            node = judgement.node or ""
            message = msgs.handed_off(prepared.tool, prepared.tool_call_id, judgement.verdict, node, **started)
            return Command(goto=node, update={self.messages_key: [message]})
        reason = judgement.reason
        if judgement.outcome == "escalate":
            logger.warning("tool call %r needs review but shares its tool-node task with other calls; blocked (route "
                           "tool calls with guard.agents.send_tool_calls)", prepared.tool)
            reason = msgs.UNREVIEWABLE_REASON
        return msgs.blocked(prepared.tool, prepared.tool_call_id, judgement.verdict, reason, **started)

    @staticmethod
    def _started(prepared: Prepared) -> dict[str, bool]:
        """What a message saying ``prepared`` did not pass tells about its tool starting before the verdict."""
        return {"ran_early": prepared.ran_early, "may_have_run": prepared.may_have_run}

    def _rejected(self, prepared: Prepared, judgement: Judgement, decision: Mapping[str, Any]) -> ToolMessage:
        """The answer to a call a reviewer rejected."""
        return msgs.rejected(prepared.tool, prepared.tool_call_id, judgement.verdict, decision.get("message"),
                             decision["_item"], **self._started(prepared))

    def _too_many_rounds(self, prepared: Prepared, judgement: Judgement) -> ToolMessage:
        """The answer to an edited call that still needs approval after :attr:`max_review_rounds` reviews."""
        reason = TOO_MANY_ROUNDS.format(rounds=self.max_review_rounds)
        return msgs.blocked(prepared.tool, prepared.tool_call_id, judgement.verdict, reason, **self._started(prepared))

    def _annotate(self, result: Result, prepared: Prepared) -> Result:
        """An edited call's tool message with the edit's notice before its content, and ``lc_data["ran_early"]``
        where the original call started before its verdict; any other result as it is."""
        if not prepared.edited or not isinstance(result, ToolMessage):
            return result
        refused = result.status == "error" and self._refuses(prepared) is True
        notice = msgs.edit_notice(prepared.tool, prepared.arguments, refused=refused, **self._started(prepared))
        update: dict[str, Any] = {}
        if prepared.ran_early:
            data = result.additional_kwargs.get("lc_data")
            data = {**(data if isinstance(data, dict) else {}), "ran_early": True}
            update["additional_kwargs"] = {**result.additional_kwargs, "lc_data": data}
        if isinstance(result.content, str):
            joint = "\n" if refused else "\n\nTool response:\n"
            update["content"] = f"{notice}{joint}{result.content}"
        else:
            update["content"] = [{"type": "text", "text": notice}, *result.content]
        return result.model_copy(update=update)

    @staticmethod
    def _refuses(prepared: Prepared) -> bool | None:
        """Whether the tool refuses the call's arguments, so it does not run: its ``args_schema`` (with the tool's own
        validators) does not validate them, leaving aside missing arguments the tool node injects (those its call
        schema leaves out); its call schema when ``args_schema`` is not a pydantic model. ``False`` when there is no
        schema to ask (no tool, neither schema a pydantic model); ``None`` when a validator of the tool's raised
        something other than a validation error (one that reads an injected argument the call does not hold yet):
        it cannot be told."""
        tool = prepared.request.tool
        schemas = [getattr(tool, "args_schema", None), getattr(tool, "tool_call_schema", None)]
        models = [s if isinstance(s, type) and issubclass(s, BaseModel) else None for s in schemas]
        args_model, call_model = models
        schema = args_model or call_model
        if schema is None:
            return False
        injected = set(args_model.model_fields) - set(call_model.model_fields) if args_model and call_model else set()
        try:
            schema.model_validate(prepared.arguments)
        except ValidationError as exc:
            return any(not (e["type"] == "missing" and e["loc"] and e["loc"][0] in injected) for e in exc.errors())
        except Exception:  # noqa: BLE001 - the tool's own validator failed without the injected arguments
            return None
        return False

    @staticmethod
    def _output_subject(prepared: Prepared, text: str | None) -> AgentSubject:
        """The ``tool_result`` subject of ``prepared``'s call with output ``text``."""
        return AgentSubject(
            event="tool_result",
            tool_name=prepared.tool,
            tool_call_id=prepared.tool_call_id,
            arguments=prepared.arguments,
            tool_result=text,
            user_message=prepared.subject.user_message,
            thread_id=prepared.thread_id,
        )

    def _withholds(self, prepared: Prepared) -> bool:
        """Whether an enforced ``tool_result`` policy applies to ``prepared``'s tool (its output may be withheld), so
        its run reports to no handler that streams outputs to a client (:func:`~guard.agents._quiet.quiet_tool`)."""
        policy = self.judge.accountable(self._output_subject(prepared, None))
        return policy is not None and policy.mode != "shadow"

    def _result_subject(self, message: BaseMessage, prepared: Prepared) -> AgentSubject | None:
        text = message_text(message)
        if not text:
            return None
        subject = self._output_subject(prepared, text)
        return subject if self.judge.matches(subject) else None

    def _stripped(self, message: BaseMessage, judgement: Judgement) -> str | None:
        """What ``strip`` would pass on of a flagged output: its text with the instruction spans cut (``None`` when the
        output is allowed, the action is not ``strip``, there is nothing to cut, or the output is longer than the
        detector reads, :data:`~guard.policy.provenance.DETECTOR_MAX_CHARS`). The caller judges it again."""
        if judgement.outcome == "allow" or self.tool_result_action != "strip":
            return None
        text = message_text(message)
        if len(text) > DETECTOR_MAX_CHARS:
            return None
        spans = find_instructions(text)
        return strip_spans(text, spans) if spans else None

    @staticmethod
    def _cut(message: BaseMessage) -> str:
        """The instructions :meth:`_stripped` cuts out of ``message``, joined (``find_instructions`` caches)."""
        text = message_text(message)
        return "\n".join(text[span.start : span.end] for span in find_instructions(text))

    def _replace_result(self, message: BaseMessage, prepared: Prepared, judgement: Judgement,
                        stripped: str | None) -> BaseMessage:
        """The message the model gets in place of a judged output: the output itself when allowed; else quoted,
        ``stripped`` (when given: the caller judged it allowed) or withheld. A message other than the call's own
        result keeps its type and ids and takes the replacement's content."""
        if judgement.outcome == "allow":
            return message
        verdict = judgement.verdict
        call_id = message.tool_call_id if isinstance(message, ToolMessage) else prepared.tool_call_id
        if self.tool_result_action == "quote":
            new = msgs.result_quoted(prepared.tool, call_id, message_text(message), verdict)
        elif stripped is not None and len(cut := self._cut(message)) <= msgs.MAX_CUT_CHARS:
            new = msgs.result_stripped(prepared.tool, call_id, stripped, verdict, cut)
        else:  # nothing to strip, or more instructions than the message can carry for provenance: withheld
            new = msgs.result_withheld(prepared.tool, call_id, verdict)
        if isinstance(message, ToolMessage):
            return new
        return message.model_copy(update={"content": new.content, "additional_kwargs": new.additional_kwargs})

    @staticmethod
    def map_messages(
        result: Result, change: Callable[[BaseMessage], BaseMessage], messages_key: str = "messages"
    ) -> Result:
        """``result`` with every message it adds to the conversation passed through ``change``: a tool message, each
        item of a list of them (a tool may return several), and the messages of a ``Command``'s update (under
        ``messages_key`` in a dict update; a list update is the messages). Entries in another form (a dict, a tuple)
        are read as LangGraph's reducer reads them (``convert_to_messages``).

        Raises:
            TypeError: a ``Command`` whose update is neither a dict nor a list (guard cannot find its messages).
            ValueError: a ``Command`` whose dict update holds a ``ToolMessage`` under a key other than
                ``messages_key`` (the conversation is kept under a key guard was not given: it cannot tell which
                messages the model reads).
        """
        if isinstance(result, list):
            return [ToolCallEnforcer.map_messages(item, change, messages_key) for item in result]  # type: ignore[misc]
        if isinstance(result, BaseMessage):
            return change(result)  # type: ignore[return-value]
        if not isinstance(result, Command) or result.update is None:
            return result
        update = result.update
        if isinstance(update, dict):
            elsewhere = sorted(str(key) for key, value in update.items()
                               if key != messages_key and _holds_tool_message(value))
            if elsewhere:
                raise ValueError(f"a Command update holds tool messages under {', '.join(map(repr, elsewhere))}, "
                                 f"not under messages_key {messages_key!r}")
            if messages_key not in update:
                return result
            messages = update[messages_key]
            single = not isinstance(messages, list | tuple)
            changed = [change(m) for m in convert_to_messages([messages] if single else messages)]
            return replace(result, update={**update, messages_key: changed[0] if single else changed})
        if isinstance(update, list):
            return replace(result, update=[change(m) for m in convert_to_messages(update)])
        raise TypeError(f"a Command update of type {type(update).__name__} holds messages guard cannot find")

    def _unread_media(self, message: BaseMessage, prepared: Prepared, media: list[str]) -> BaseMessage:
        """An output holding content guard cannot read (:func:`~guard.agents._content.unread_media`: an image, a PDF)
        where an enforced ``tool_result`` policy applies to this tool (any of them, whatever the file order): withheld
        (block, rule ``unreadable_result``), since the model could read instructions in it that no policy judged;
        where only shadow policies apply, passed on, the block recorded as their shadow verdict; elsewhere as it is."""
        subject = self._output_subject(prepared, message_text(message))
        verdict = self.judge.unread(subject, media)
        if verdict is None:
            return message
        if verdict.shadow_action is not None:  # every matching policy is shadow: they compute and record, never withhold
            logger.info("shadow policy %s: a %r output holds content guard cannot read (%r); passed on",
                        verdict.policy_id, prepared.tool, ", ".join(sorted(set(media))))  # fmt: skip
            return message
        return self._replace_result(message, prepared, Judgement(outcome="block", verdict=verdict), None)

    def _unreadable(self, result: Result, prepared: Prepared, problem: Exception) -> Result:
        """The call's result when its messages cannot be found: withheld when a ``tool_result`` policy applies to
        this tool (fail closed), else as it is."""
        subject = self._output_subject(prepared, None)
        if not self.judge.matches(subject):
            return result
        verdict = self.judge.unreadable(subject, str(problem))
        return msgs.result_withheld(prepared.tool, prepared.tool_call_id, verdict)

    # Sync -------------------------------------------------------------------------------------------------------

    def check_result(self, result: Result, prepared: Prepared) -> Result:
        """Judge the tool's output with the ``tool_result`` policy, if one applies (blocking): every message it adds
        (see :meth:`map_messages`)."""

        def judged(message: BaseMessage) -> BaseMessage:
            media = unread_media(message)
            if media:
                return self._unread_media(message, prepared, media)
            subject = self._result_subject(message, prepared)
            if subject is None:
                return message
            judgement = self.judge.judge(subject)
            stripped = self._stripped(message, judgement)
            if stripped is not None and self.judge.judge(replace(subject, tool_result=stripped)).outcome != "allow":
                stripped = None  # what is left is still flagged: withheld
            return self._replace_result(message, prepared, judgement, stripped)

        try:
            return self._mark_added(self.map_messages(result, judged, self.messages_key), prepared)
        except (TypeError, ValueError, NotImplementedError) as exc:
            return self._unreadable(result, prepared, exc)

    def _mark_added(self, result: Result, prepared: Prepared) -> Result:
        """``result`` with every message it adds that is not a tool message marked as this call's
        (:func:`~guard.agents._messages.tool_added`)."""
        def mark(message: BaseMessage) -> BaseMessage:
            return msgs.tool_added(message, prepared.tool, prepared.tool_call_id)

        return self.map_messages(result, mark, self.messages_key)

    def run_allowed(self, prepared: Prepared, handler: SyncHandler) -> Result:
        """Run a call whose verdict is final and allows it (claimed first when a review released it or a wrapper
        rewrote it); then check its output.

        Raises:
            ApprovalAlreadyUsed: the release was claimed before (the tool does not run), unless the run that claimed
                it raised: then the call is answered with an error tool message.
        """
        key = self.claim_key(prepared)
        if key is not None:
            try:
                self.claims.claim(key)
            except ApprovalAlreadyUsed as exc:
                if exc.status != "failed":
                    raise
                return msgs.approval_failed(prepared.tool, prepared.tool_call_id)
        try:
            with running_tool(), quiet_tool(prepared.request.runtime, self._withholds(prepared)):
                result = handler(prepared.request)
        except Exception as exc:
            if key is not None and self._gives_back(prepared, exc):
                self.claims.release(key)
            elif key is not None and not isinstance(exc, GraphBubbleUp):
                self.claims.fail(key)
            raise
        return self._annotate(self.check_result(result, prepared), prepared)

    def _judge_speculating(self, prepared: Prepared, handler: SyncHandler) -> tuple[Judgement, Result | None, bool]:
        """Judge the call while its tool runs: the verdict, the tool's result when the verdict allows it (else
        ``None``), and whether the tool ran (always: it is waited for)."""
        with running_tool():  # the tool runs in a copy of the context as it is now
            context = contextvars.copy_context()
        quiet = quiet_tool(prepared.request.runtime, self._withholds(prepared))
        with quiet, ThreadPoolExecutor(max_workers=1, thread_name_prefix="guard-speculative") as pool:
            future = pool.submit(context.run, handler, prepared.request)
            judgement = self.judge.judge(prepared.subject)
            try:
                result = future.result()
            except Exception:
                if judgement.outcome == "allow":
                    raise
                result = None
        return judgement, result if judgement.outcome == "allow" else None, True

    def run(self, request: ToolCallRequest, handler: SyncHandler, *, reviewed: bool = False) -> Result:
        """Judge the call, then run, block, route or escalate it (blocking). ``ToolNode``'s ``wrap_tool_call``. A
        tool that may start early (:meth:`_speculative`) runs while the call is judged, unless the task may run again
        after an interrupt (:func:`_resuming`: the run that asked for a review started it).
        ``reviewed``: a reviewer outside guard released this call. It is claimed once before it runs (under the call
        the model's turn holds, :meth:`claim_key`), as is a call whose arguments differ from that one: a wrapper
        listed before this one changed it, as a per-call ``HumanInTheLoopMiddleware`` edit does without a trace in
        the state, so replaying its resume cannot run the tool again. Such a call's claim is given back when the
        tool raises (a retry middleware runs it again)."""
        prepared = self.prepare(request)
        if isinstance(prepared, ToolMessage):
            return prepared
        if reviewed:
            prepared = replace(prepared, reviewed=True)
        elif prepared.digest != prepared.held_digest:
            prepared = replace(prepared, rewritten=True)
        early: Result | None = None
        speculative = self._speculative(prepared)
        if speculative and not _resuming():
            judgement, early, started = self._judge_speculating(prepared, handler)
            prepared = replace(prepared, ran_early=started)
        else:
            # no early start where the task may run again; a call whose review was answered may have started in the
            # run that asked for it (unless that run was itself a resumed one), which this run cannot tell, so its notice
            # says it may have run; another task of a resumed run's first step may never have run (the graph stopped
            # before its node), so its notice does not say it ran
            prepared = replace(prepared, may_have_run=speculative and _review_answered(self._item_id(prepared)))
            judgement = self.judge.judge(prepared.subject)
        return self.settle(prepared, judgement, handler, early)

    def settle(
        self, prepared: Prepared, judgement: Judgement, handler: SyncHandler, early: Result | None = None
    ) -> Result:
        """Carry out a judgement, asking a reviewer (``interrupt``) as often as edits need (blocking)."""
        for _ in range(self.max_review_rounds + 1):
            if judgement.outcome == "allow":
                if early is not None:
                    return self.check_result(early, prepared)
                return self.run_allowed(prepared, handler)
            if judgement.outcome != "escalate" or self._shares_its_task(prepared):
                return self._stop(prepared, judgement)
            decision = self._review(prepared, judgement)
            if decision["type"] == "approve":
                return self.run_allowed(replace(prepared, reviewed=True), handler)
            if decision["type"] == "reject":
                return self._rejected(prepared, judgement, decision)
            edited = self.apply_edit(prepared, decision)
            if isinstance(edited, ToolMessage):
                return edited
            prepared, early = edited, None
            judgement = self.judge.judge(prepared.subject)
        return self._too_many_rounds(prepared, judgement)

    # Async ------------------------------------------------------------------------------------------------------

    async def acheck_result(self, result: Result, prepared: Prepared) -> Result:
        """Async twin of :meth:`check_result`: the messages are judged first, then put in place."""
        found: list[BaseMessage] = []

        def collect(message: BaseMessage) -> BaseMessage:
            found.append(message)
            return message

        try:
            self.map_messages(result, collect, self.messages_key)
        except (TypeError, ValueError, NotImplementedError) as exc:
            return self._unreadable(result, prepared, exc)
        replacements: list[BaseMessage] = []
        for message in found:
            media = unread_media(message)
            if media:
                replacements.append(self._unread_media(message, prepared, media))
                continue
            subject = self._result_subject(message, prepared)
            if subject is None:
                replacements.append(message)
                continue
            judgement = await self.judge.ajudge(subject)
            stripped = self._stripped(message, judgement)
            if stripped is not None and (await self.judge.ajudge(replace(subject, tool_result=stripped))).outcome != "allow":
                stripped = None  # what is left is still flagged: withheld
            replacements.append(self._replace_result(message, prepared, judgement, stripped))
        queue = iter(replacements)
        return self._mark_added(self.map_messages(result, lambda message: next(queue), self.messages_key), prepared)

    async def arun_allowed(self, prepared: Prepared, handler: AsyncHandler) -> Result:
        """Async twin of :meth:`run_allowed`."""
        key = self.claim_key(prepared)
        if key is not None:
            try:
                await self.claims.aclaim(key)
            except ApprovalAlreadyUsed as exc:
                if exc.status != "failed":
                    raise
                return msgs.approval_failed(prepared.tool, prepared.tool_call_id)
        try:
            with running_tool(), quiet_tool(prepared.request.runtime, self._withholds(prepared)):
                result = await handler(prepared.request)
        except Exception as exc:
            if key is not None and self._gives_back(prepared, exc):
                await self.claims.arelease(key)
            elif key is not None and not isinstance(exc, GraphBubbleUp):
                await self.claims.afail(key)
            raise
        return self._annotate(await self.acheck_result(result, prepared), prepared)

    async def _ajudge_speculating(
        self, prepared: Prepared, handler: AsyncHandler
    ) -> tuple[Judgement, Result | None, bool]:
        """Async twin of :meth:`_judge_speculating`; a tool the verdict does not allow is cancelled, and whether it
        ran says whether it had started by then."""
        started = False

        async def early() -> Result:
            nonlocal started
            started = True
            return await handler(prepared.request)

        with quiet_tool(prepared.request.runtime, self._withholds(prepared)):
            with running_tool():  # the task takes a copy of the context as it is now
                task = asyncio.ensure_future(early())
            try:
                judgement = await self.judge.ajudge(prepared.subject)
            except BaseException:
                task.cancel()
                raise
            if judgement.outcome == "allow":
                return judgement, await task, True
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return judgement, None, started

    async def arun(self, request: ToolCallRequest, handler: AsyncHandler, *, reviewed: bool = False) -> Result:
        """Async twin of :meth:`run`. ``ToolNode``'s ``awrap_tool_call``."""
        prepared = self.prepare(request)
        if isinstance(prepared, ToolMessage):
            return prepared
        if reviewed:
            prepared = replace(prepared, reviewed=True)
        elif prepared.digest != prepared.held_digest:
            prepared = replace(prepared, rewritten=True)
        early: Result | None = None
        speculative = self._speculative(prepared)
        if speculative and not _resuming():
            judgement, early, started = await self._ajudge_speculating(prepared, handler)
            prepared = replace(prepared, ran_early=started)
        else:
            # no early start where the task may run again; a call whose review was answered may have started in the
            # run that asked for it (unless that run was itself a resumed one), which this run cannot tell, so its notice
            # says it may have run; another task of a resumed run's first step may never have run (the graph stopped
            # before its node), so its notice does not say it ran
            prepared = replace(prepared, may_have_run=speculative and _review_answered(self._item_id(prepared)))
            judgement = await self.judge.ajudge(prepared.subject)
        return await self.asettle(prepared, judgement, handler, early)

    async def asettle(
        self, prepared: Prepared, judgement: Judgement, handler: AsyncHandler, early: Result | None = None
    ) -> Result:
        """Async twin of :meth:`settle`."""
        for _ in range(self.max_review_rounds + 1):
            if judgement.outcome == "allow":
                if early is not None:
                    return await self.acheck_result(early, prepared)
                return await self.arun_allowed(prepared, handler)
            if judgement.outcome != "escalate" or self._shares_its_task(prepared):
                return self._stop(prepared, judgement)
            decision = self._review(prepared, judgement)
            if decision["type"] == "approve":
                return await self.arun_allowed(replace(prepared, reviewed=True), handler)
            if decision["type"] == "reject":
                return self._rejected(prepared, judgement, decision)
            edited = self.apply_edit(prepared, decision)
            if isinstance(edited, ToolMessage):
                return edited
            prepared, early = edited, None
            judgement = await self.judge.ajudge(prepared.subject)
        return self._too_many_rounds(prepared, judgement)
