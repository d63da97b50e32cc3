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
shared :mod:`~guard.agents.claims` store right before its side-effecting tool runs, so a second resume of the same
interrupt (concurrent, or replayed from its checkpoint) raises instead of running it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from langchain_core.messages import ToolMessage
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, interrupt

from guard.agents import _messages as msgs
from guard.agents._arguments import (
    arguments_digest,
    classify_arguments,
    empty_arguments_problem,
    parse_calls,
    tool_effect,
)
from guard.agents._content import message_text
from guard.agents._judge import Judge, Judgement
from guard.agents._records import (
    ai_message_for,
    answered_ids,
    current_thread_id,
    tool_item,
    turn_history,
    user_text,
)
from guard.agents.claims import ApprovalClaims, MemoryApprovalClaims, claim_id
from guard.agents.decisions import response_schema, review_request
from guard.policy.instructions import find_instructions, strip_spans
from guard.subject import AgentSubject

__all__ = ["DEFAULT_MAX_REVIEW_ROUNDS", "Prepared", "ToolCallEnforcer", "redirect"]

DEFAULT_MAX_REVIEW_ROUNDS = 3
"""How many times an edited call may be escalated again before it is refused."""
TOO_MANY_ROUNDS = "the edited call still needs approval after {rounds} review rounds"

Result = ToolMessage | Command[Any]
SyncHandler = Callable[[ToolCallRequest], Result]
AsyncHandler = Callable[[ToolCallRequest], Awaitable[Result]]


def redirect(request: ToolCallRequest, tool: str, arguments: Any) -> ToolCallRequest | str:
    """``request`` with its call replaced by ``tool(arguments)`` (the tool looked up in the runtime's tools when the
    name changes), or why it cannot be (``"names tool 'x', which this agent does not have ..."``)."""
    call = {**request.tool_call, "name": tool, "args": arguments}
    if tool == request.tool_call.get("name"):
        return request.override(tool_call=call)  # type: ignore[arg-type]
    runtime_tools = getattr(request.runtime, "tools", None) or []
    found = next((t for t in runtime_tools if t.name == tool), None)
    if found is None:
        names = ", ".join(sorted(t.name for t in runtime_tools)) or "(none)"
        return f"names tool {tool!r}, which this agent does not have (tools: {names})"
    return request.override(tool_call=call, tool=found)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Prepared:
    """One well-formed call, ready to judge: the request, its subject and the binding facts. ``edited``: a reviewer
    changed it; ``reviewed``: a review decision released it (it is claimed once before it runs)."""

    request: ToolCallRequest
    tool_call_id: str
    tool: str
    arguments: dict[str, Any]
    digest: str
    message_id: str | None
    thread_id: str | None
    subject: AgentSubject
    edited: bool = False
    reviewed: bool = False


class ToolCallEnforcer:
    """Judges and runs one tool call at a time (sync and async twins share everything but I/O).

    Args:
        judge: evaluates subjects and settles handoffs.
        side_effecting_tools: tool names that must wait for a final verdict, or ``"all"``. Other tools (read-only)
            may start while the guard decides; their output is discarded unless the verdict allows it.
        tool_result_action: what a non-allow ``tool_result`` verdict does: ``block`` (withhold the output),
            ``strip`` (pass it on without the spans that give the agent instructions; withheld when none is found) or
            ``quote`` (pass it on as quoted data with a warning).
        max_review_rounds: escalations of an edited call before it is refused.
        claims: where calls released by a review decision are claimed before a side-effecting tool runs (single
            use; :mod:`guard.agents.claims`); a :class:`~guard.agents.claims.MemoryApprovalClaims` by default.
    """

    def __init__(
        self,
        judge: Judge,
        *,
        max_review_rounds: int = DEFAULT_MAX_REVIEW_ROUNDS,
        claims: ApprovalClaims | None = None,
    ) -> None:
        if claims is not None and not isinstance(claims, ApprovalClaims):
            raise TypeError(f"approval_claims must have claim() and aclaim(), not {type(claims).__name__}")
        self.judge = judge
        self.claims: ApprovalClaims = claims if claims is not None else MemoryApprovalClaims()
        side = judge.options.side_effecting_tools
        self.side_effecting = None if side == "all" else side
        self.tool_result_action = judge.options.tool_result_action
        self.max_review_rounds = max_review_rounds

    # Preparation (no I/O) -------------------------------------------------------------------------------------

    def prepare(self, request: ToolCallRequest) -> Prepared | ToolMessage:
        """Check the call's arguments and build its subject; a malformed or already answered call gets its error
        message instead (the decision for a malformed call is recorded)."""
        call = request.tool_call
        call_id = call.get("id") or ""
        name = call.get("name") or ""
        ai = ai_message_for(request.state, call_id or None)
        if call_id and call_id in answered_ids(request.state, ai):
            return msgs.already_answered(name, call_id)
        arguments, problem = classify_arguments(call.get("args"))
        args = call.get("args")
        raw: str | None = args if isinstance(args, str) else None
        if problem is None and ai is not None and self._as_the_model_sent_it(ai, call_id, name, arguments):
            model_call = next((c for c in parse_calls(ai) if c.id == call_id), None)
            if model_call is not None and model_call.problem:
                problem, raw = model_call.problem, model_call.raw
        if problem is None and arguments is not None:
            problem = empty_arguments_problem(request.tool, arguments)
        if problem is None and not call_id:
            problem = "the tool call has no id"
        thread_id = current_thread_id()
        subject = AgentSubject(
            event="tool_call",
            tool_name=name,
            tool_call_id=call_id,
            arguments=arguments if problem is None else None,
            user_message=user_text(request.state),
            thread_id=thread_id,
            history=turn_history(request.state),
            tool_effect=tool_effect(request.tool),
        )
        if problem is not None or arguments is None:
            verdict = self.judge.malformed(subject, problem or "arguments are missing", raw)
            return msgs.malformed(name, call_id, problem or "arguments are missing", verdict)
        return Prepared(
            request,
            call_id,
            name,
            arguments,
            arguments_digest(name, arguments),
            ai.id if ai is not None else None,
            thread_id,
            subject,
        )

    @staticmethod
    def _as_the_model_sent_it(ai: Any, call_id: str, name: str, arguments: Any) -> bool:
        """Whether the call still has the name and (as LangChain parsed them) arguments of the model's message; a
        call another middleware replaced is judged as it is now, not by the model's raw text."""
        sent = next((c for c in ai.tool_calls if c.get("id") == call_id), None)
        return sent is not None and sent.get("name") == name and sent.get("args") == arguments

    def _speculative(self, prepared: Prepared) -> bool:
        return self.side_effecting is not None and prepared.tool not in self.side_effecting

    def apply_edit(self, prepared: Prepared, decision: Mapping[str, Any]) -> Prepared | ToolMessage:
        """The call a reviewer edited (``arguments`` and maybe ``tool``), or an error message when the new tool does
        not exist. The edited call is not judged here."""
        tool = decision.get("tool") or prepared.tool
        arguments = decision["arguments"]
        new_request = redirect(prepared.request, tool, arguments)
        if isinstance(new_request, str):
            return msgs.rejected(prepared.tool, prepared.tool_call_id, None, f"the reviewer's edit {new_request}", "")
        subject = replace(prepared.subject, tool_name=tool, arguments=arguments)
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
        """The claim id of a call a review decision released to a side-effecting tool (``None`` for any other
        call)."""
        if not (prepared.reviewed or prepared.edited) or self._speculative(prepared):
            return None
        return claim_id(
            thread_id=prepared.thread_id,
            message_id=prepared.message_id,
            tool_call_id=prepared.tool_call_id,
            digest=prepared.digest,
        )

    def _review(self, prepared: Prepared, judgement: Judgement) -> dict[str, Any]:
        item = tool_item(
            judgement,
            thread_id=prepared.thread_id,
            message_id=prepared.message_id,
            tool_call_id=prepared.tool_call_id,
            tool=prepared.tool,
            arguments=prepared.arguments,
            digest=prepared.digest,
        )
        request = review_request([item])
        answer = interrupt(request, response_schema=response_schema([item], exact=False))
        decision: dict[str, Any] = answer["decisions"][item["id"]]
        return decision | {"_item": item["id"]}

    def _stop(self, prepared: Prepared, judgement: Judgement) -> Result:
        if judgement.outcome == "route":
            node = judgement.node or ""
            message = msgs.handed_off(prepared.tool, prepared.tool_call_id, judgement.verdict, node)
            return Command(goto=node, update={"messages": [message]})
        return msgs.blocked(prepared.tool, prepared.tool_call_id, judgement.verdict, judgement.reason)

    def _annotate(self, result: Result, prepared: Prepared) -> Result:
        if not prepared.edited or not isinstance(result, ToolMessage):
            return result
        notice = msgs.edit_notice(prepared.tool, prepared.arguments)
        if isinstance(result.content, str):
            return result.model_copy(update={"content": f"{notice}\n\nTool response:\n{result.content}"})
        return result.model_copy(update={"content": [{"type": "text", "text": notice}, *result.content]})

    def _result_subject(self, message: ToolMessage, prepared: Prepared) -> AgentSubject | None:
        text = message_text(message)
        if not text:
            return None
        subject = AgentSubject(
            event="tool_result",
            tool_name=prepared.tool,
            tool_call_id=prepared.tool_call_id,
            arguments=prepared.arguments,
            tool_result=text,
            user_message=prepared.subject.user_message,
            thread_id=prepared.thread_id,
        )
        return subject if self.judge.matches(subject) else None

    def _replace_result(self, message: ToolMessage, prepared: Prepared, judgement: Judgement) -> ToolMessage:
        if judgement.outcome == "allow":
            return message
        verdict = judgement.verdict
        if self.tool_result_action == "quote":
            return msgs.result_quoted(prepared.tool, prepared.tool_call_id, message_text(message), verdict)
        if self.tool_result_action == "strip":
            text = message_text(message)
            spans = find_instructions(text)
            if spans:  # the rest of the output is passed on; without spans to cut, the output is withheld
                return msgs.result_stripped(prepared.tool, prepared.tool_call_id, strip_spans(text, spans), verdict)
        return msgs.result_withheld(prepared.tool, prepared.tool_call_id, verdict)

    @staticmethod
    def _tool_messages(result: Result, call_id: str) -> list[ToolMessage]:
        if isinstance(result, ToolMessage):
            return [result]
        update = result.update if isinstance(result, Command) else None
        if isinstance(update, dict) and isinstance(update.get("messages"), list):
            return [m for m in update["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == call_id]
        return []

    @staticmethod
    def _swap(result: Result, old: ToolMessage, new: ToolMessage) -> Result:
        if old is new:
            return result
        if isinstance(result, ToolMessage):
            return new
        assert isinstance(result, Command) and isinstance(result.update, dict)
        messages = [new if m is old else m for m in result.update["messages"]]
        return replace(result, update={**result.update, "messages": messages})

    # Sync -------------------------------------------------------------------------------------------------------

    def check_result(self, result: Result, prepared: Prepared) -> Result:
        """Judge the tool's output with the ``tool_result`` policy, if one applies (blocking)."""
        for message in self._tool_messages(result, prepared.tool_call_id):
            subject = self._result_subject(message, prepared)
            if subject is not None:
                result = self._swap(result, message, self._replace_result(message, prepared, self.judge.judge(subject)))
        return result

    def run_allowed(self, prepared: Prepared, handler: SyncHandler) -> Result:
        """Run a call whose verdict is final and allows it (claimed first when a review released it); then check its
        output.

        Raises:
            ApprovalAlreadyUsed: the release was claimed before (the tool does not run).
        """
        key = self.claim_key(prepared)
        if key is not None:
            self.claims.claim(key)
        return self._annotate(self.check_result(handler(prepared.request), prepared), prepared)

    def _judge_speculating(self, prepared: Prepared, handler: SyncHandler) -> tuple[Judgement, Result | None]:
        context = contextvars.copy_context()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="guard-speculative") as pool:
            future = pool.submit(context.run, handler, prepared.request)
            judgement = self.judge.judge(prepared.subject)
            try:
                result = future.result()
            except Exception:
                if judgement.outcome == "allow":
                    raise
                result = None
        return judgement, result if judgement.outcome == "allow" else None

    def run(self, request: ToolCallRequest, handler: SyncHandler) -> Result:
        """Judge the call, then run, block, route or escalate it (blocking). ``ToolNode``'s ``wrap_tool_call``."""
        prepared = self.prepare(request)
        if isinstance(prepared, ToolMessage):
            return prepared
        early: Result | None = None
        if self._speculative(prepared):
            judgement, early = self._judge_speculating(prepared, handler)
        else:
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
            if judgement.outcome != "escalate":
                return self._stop(prepared, judgement)
            decision = self._review(prepared, judgement)
            if decision["type"] == "approve":
                return self.run_allowed(replace(prepared, reviewed=True), handler)
            if decision["type"] == "reject":
                return msgs.rejected(
                    prepared.tool, prepared.tool_call_id, judgement.verdict, decision.get("message"), decision["_item"]
                )
            edited = self.apply_edit(prepared, decision)
            if isinstance(edited, ToolMessage):
                return edited
            prepared, early = edited, None
            judgement = self.judge.judge(prepared.subject)
        reason = TOO_MANY_ROUNDS.format(rounds=self.max_review_rounds)
        return msgs.blocked(prepared.tool, prepared.tool_call_id, judgement.verdict, reason)

    # Async ------------------------------------------------------------------------------------------------------

    async def acheck_result(self, result: Result, prepared: Prepared) -> Result:
        """Async twin of :meth:`check_result`."""
        for message in self._tool_messages(result, prepared.tool_call_id):
            subject = self._result_subject(message, prepared)
            if subject is not None:
                judgement = await self.judge.ajudge(subject)
                result = self._swap(result, message, self._replace_result(message, prepared, judgement))
        return result

    async def arun_allowed(self, prepared: Prepared, handler: AsyncHandler) -> Result:
        """Async twin of :meth:`run_allowed`."""
        key = self.claim_key(prepared)
        if key is not None:
            await self.claims.aclaim(key)
        return self._annotate(await self.acheck_result(await handler(prepared.request), prepared), prepared)

    async def _ajudge_speculating(self, prepared: Prepared, handler: AsyncHandler) -> tuple[Judgement, Result | None]:
        task = asyncio.ensure_future(handler(prepared.request))
        try:
            judgement = await self.judge.ajudge(prepared.subject)
        except BaseException:
            task.cancel()
            raise
        if judgement.outcome == "allow":
            return judgement, await task
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return judgement, None

    async def arun(self, request: ToolCallRequest, handler: AsyncHandler) -> Result:
        """Async twin of :meth:`run`. ``ToolNode``'s ``awrap_tool_call``."""
        prepared = self.prepare(request)
        if isinstance(prepared, ToolMessage):
            return prepared
        early: Result | None = None
        if self._speculative(prepared):
            judgement, early = await self._ajudge_speculating(prepared, handler)
        else:
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
            if judgement.outcome != "escalate":
                return self._stop(prepared, judgement)
            decision = self._review(prepared, judgement)
            if decision["type"] == "approve":
                return await self.arun_allowed(replace(prepared, reviewed=True), handler)
            if decision["type"] == "reject":
                return msgs.rejected(
                    prepared.tool, prepared.tool_call_id, judgement.verdict, decision.get("message"), decision["_item"]
                )
            edited = self.apply_edit(prepared, decision)
            if isinstance(edited, ToolMessage):
                return edited
            prepared, early = edited, None
            judgement = await self.judge.ajudge(prepared.subject)
        reason = TOO_MANY_ROUNDS.format(rounds=self.max_review_rounds)
        return msgs.blocked(prepared.tool, prepared.tool_call_id, judgement.verdict, reason)
