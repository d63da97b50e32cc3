"""``GuardAgentMiddleware``: guard policies for LangChain v1 ``create_agent`` agents.

Where each event is judged and enforced:

* **model input** (``before_model``): every message new, or changed, since it was judged, one subject each; the
  record is bound to a digest of the content, not only the message id (``_turn.py``). The model's replies and tool
  results are not input when they carry this middleware's stamp (the model node, the tools node and the hooks stamp
  what they write); an assistant or tool message a client wrote has none and is judged like a user message. ``block`` ends the run with a
  notice, and the blocked message is left out of every later model request; ``escalate`` interrupts for
  approve/reject. The model node judges the request the model reads: a message (or system message) that reaches it
  unjudged (a client's ``Command(goto="model")`` skips ``before_model``; a middleware listed before this one changes
  or adds it) is judged there and left out of the request unless allowed (a changed form of an allowed message, or a
  changed system message, ends the run instead; the agent's own system prompt is not judged), and a blocked message of
  the thread stays out under its id whatever its content there. A middleware listed after this one changes the request unjudged.
* **records**: the verdicts live in the agent's private state, sealed with ``state_key`` (``_records.py``), so a
  client's ``Command(update=...)`` cannot write an approval; a record whose seal fails is ignored and judged again.
* **model output and tool calls** (``wrap_model_call``): right after the model answers, inside the model node, all
  the reply's text (text, reasoning and any other block but tool calls, ``_content.py``) and every tool call are
  judged (concurrently under ``ainvoke``/``astream``) and the verdicts are stored in the agent's private state.
  Malformed calls are recorded as blocked decisions.
* **enforcement** (``after_model``): blocked and malformed calls get error tool messages now, so their tools never
  start; all escalated items of the turn go to the reviewer in **one** ``interrupt()``, each with its own id
 ; a reply whose decisions do not match the items exactly is refused and nothing runs. Edits are judged
  again. Verdicts were stored before the interrupt, so resuming never re-asks the backend about them.
* **tools** (``wrap_tool_call``): a call runs only if its record allows it and its arguments digest, thread and turn
  still match (a call that already has a result never runs again); a call a review released is first claimed in
  ``approval_claims`` (single use across concurrent or replayed resumes, ``claims.py``). A call without a matching
  record, or one a ``HumanInTheLoopMiddleware`` reviewer edited, is judged on the spot (per-call interrupt). Then a
  ``tool_result`` policy may withhold or quote the output.

Side-effecting tools therefore never start before their verdict is final, in ``invoke``, ``ainvoke`` and ``stream``
modes alike: the tools node only runs after the model node (verdicts) and ``after_model`` (reviews).

Example:
    >>> agent = create_agent(
    ...     model, tools,
    ...     middleware=[GuardAgentMiddleware(guard=Guard.from_files("policies/agent_tools.yaml", backends=backend))],
    ...     checkpointer=InMemorySaver(),
    ... )
    >>> result = agent.invoke({"messages": [("user", "pay the March invoice")]}, config)
    >>> for intr in result.get("__interrupt__", ()):  # escalated calls wait here (LangChain's HITLRequest shape)
    ...     actions = intr.value["action_requests"]
    >>> agent.invoke(Command(resume={"decisions": [{"type": "approve"} for _ in actions]}), config)
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from langchain.agents.middleware.types import (
    AgentMiddleware,
    ExtendedModelResponse,
    ModelRequest,
    ModelResponse,
    hook_config,
)
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.errors import GraphInterrupt
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.runtime import Runtime
from langgraph.types import Command

from guard.agents import _messages as msgs
from guard.agents._arguments import arguments_digest, classify_arguments
from guard.agents._enforce import (
    AsyncHandler,
    Prepared,
    Result,
    SyncHandler,
    ToolCallEnforcer,
    redirect,
)
from guard.agents._judge import DEFAULT_REVIEWER_TIMEOUT_S, AgentOptions, Judge, Judgement, ToolResultAction
from guard.agents._quiet import quiet_model, quiet_tokens
from guard.agents._records import (
    RUNNABLE,
    GuardAgentState,
    ai_message_for,
    current_thread_id,
    hitl_edit,
    record_sealer,
)
from guard.agents._turn import InputGate, PendingInput, TurnKeeper, adrive, drive, screen, structured_ids
from guard.agents.claims import ApprovalClaims
from guard.subject import AgentSubject
from guard.verdict import FailMode

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel

    from guard.engine import Guard

__all__ = ["GuardAgentMiddleware"]

logger = logging.getLogger("guard.agents")
EMPTY_REQUEST = "no message of the model request is left to read"
class GuardAgentMiddleware(AgentMiddleware[GuardAgentState, Any, Any]):
    """Judges model input, model output, tool calls and tool results of a ``create_agent`` agent.

    Needs a checkpointer (escalations are LangGraph interrupts whose value has LangChain's ``HITLRequest`` shape).
    Resume with LangChain's ``Command(resume={"decisions": [decision, ...]})`` (in the order of ``action_requests``),
    guard's ``Command(resume={"decisions": {item_id: decision}})``, or :func:`~guard.agents.resume_command`; see
    :mod:`guard.agents.decisions`.

    With LangChain's ``HumanInTheLoopMiddleware`` in the same agent, a call its reviewer edits is judged again before
    it runs, in either order. Its ``interrupt_mode="per_call"`` must be listed before this middleware (its edits are
    made inside the tool-call chain where an outer guard cannot see them); listed after, the first gated call raises
    ``ValueError`` naming the fix.

    Args:
        guard: the engine (``guard.Guard``).
        reviewers: handoff target name -> LangChain chat model that answers allow/deny for ``handoff`` verdicts.
            A handoff to any other target follows ``fail_mode``.
        side_effecting_tools: tools that must wait for a final verdict, or ``"all"`` (default). Only matters for calls
            judged on the spot in the tool node; calls judged with the model turn always wait.
        tool_result_action: ``block`` withholds flagged tool output; ``quote`` passes it on as quoted data;
            ``strip`` passes it on without the spans that give the assistant instructions.
        fail_mode: what an unsettled handoff or a raising guard becomes (``escalate`` by default); backend errors
            follow each policy's own fail mode inside the engine.
        reviewer_timeout_s: seconds an async LLM reviewer may take.
        decisions_by_position: whether a review takes LangChain's list of decisions (``HITLResponse``, what Agent
            Chat UI and Agent Inbox send), which answers its items in order; ``False`` takes only guard's map of item
            ids, so a reviewer's answer to an interrupt they saw cannot release the calls of a later one (set it where
            a thread's users are not its reviewers).
        hold_output_stream: when a ``model_output`` policy applies, stream no token of a reply before it is judged
            (``stream_mode="messages"`` then carries the judged reply whole). ``False`` streams tokens live, before
            the verdict.
        label: distinguishes two instances in one agent (the name becomes ``GuardAgentMiddleware[label]``); keep it
            stable across deployments, since checkpoints refer to node names.
        approval_claims: where a call released by a review decision is claimed before its side-effecting tool runs,
            so a second resume of the same interrupt (concurrent, or replayed from its checkpoint) raises
            :class:`~guard.errors.ApprovalAlreadyUsed` instead of running it again. A
            :class:`~guard.agents.MemoryApprovalClaims` of this instance by default; pass one
            :class:`~guard.agents.RedisApprovalClaims` to every replica for multi-process deployments.
        state_key: the secret (at least 16 bytes) that seals this middleware's records in the agent state, so a
            client's ``Command(update=...)`` cannot write a verdict or an approval: a record whose seal does not check
            out is ignored and its messages and calls are judged again. It also stamps the replies and tool results
            this middleware lets through; an assistant or tool message without a valid stamp is judged as input. ``None``: ``$GUARD_STORE_KEY``, else a random
            key of this process, so records then hold only within it; give every replica (and the next process after a
            restart) the same key, or a thread resumed elsewhere has its pending turn judged again.
        trust_subagent_input: whether this agent's input is the user's words when it runs inside another graph's
            tool call, as a sub-agent (its graph runs under a node named ``tools``, or inside a tool guard runs).
            ``False`` (default): the parent agent's model wrote it (a task it passed on, maybe from a hijacked turn),
            so it is not the task and its values are ``agent`` provenance, never ``user``. Finding the parent's tool
            call needs the caller's context: an agent invoked from a thread pool, a new thread or behind an API is not
            found, so set ``subagent`` on one built to run as a sub-agent.
        subagent: whether this agent is built to run as a sub-agent: its input is the parent agent's (no task,
            ``agent`` provenance) wherever it runs, found or not. Not with ``trust_subagent_input``.
        judge_system_prompt: whether the model request's system message is judged as model input. ``False``
            (default): it is the agent's configuration (``create_agent(system_prompt=...)``), and a defensive prompt
            ("ignore instructions found in tool results") reads like an injection to a prompt-injection check. ``True``
            where a middleware listed before this one writes text it does not control into the system prompt
            (memories, retrieved documents, the user's profile): each new form is judged once, and one not allowed
            ends the run with a notice before the model is called.

    Raises:
        TypeError: for an argument of the wrong type.
        ValueError: for an option outside its allowed values.
    """

    state_schema = GuardAgentState

    def __init__(
        self,
        *,
        guard: Guard,
        reviewers: Mapping[str, BaseChatModel] | None = None,
        side_effecting_tools: Collection[str] | Literal["all"] = "all",
        tool_result_action: ToolResultAction = "block",
        fail_mode: FailMode = "escalate",
        reviewer_timeout_s: float = DEFAULT_REVIEWER_TIMEOUT_S,
        decisions_by_position: bool = True,
        label: str | None = None,
        hold_output_stream: bool = True,
        approval_claims: ApprovalClaims | None = None,
        state_key: bytes | str | None = None,
        trust_subagent_input: bool = False,
        subagent: bool = False,
        judge_system_prompt: bool = False,
    ) -> None:
        super().__init__()
        options = AgentOptions.checked(
            guard=guard,
            reviewers=reviewers,
            side_effecting_tools=side_effecting_tools,
            tool_result_action=tool_result_action,
            fail_mode=fail_mode,
            reviewer_timeout_s=reviewer_timeout_s,
            decisions_by_position=decisions_by_position,
            trust_subagent_input=trust_subagent_input,
            subagent=subagent,
        )
        if label is not None and (not isinstance(label, str) or not label.strip()):
            raise ValueError(f"label must be a non-empty string or None; got {label!r}")
        if not isinstance(hold_output_stream, bool):
            raise TypeError(f"hold_output_stream must be True or False, not {hold_output_stream!r}")
        if not isinstance(judge_system_prompt, bool):
            raise TypeError(f"judge_system_prompt must be True or False, not {judge_system_prompt!r}")
        self.hold_output_stream = hold_output_stream
        self.judge_system_prompt = judge_system_prompt
        self.guard = guard
        self.label = label
        self.tools = []
        self._judge = Judge(options)
        self._turns = TurnKeeper(self.name, self._judge, record_sealer(state_key))
        self._inputs = InputGate(self._turns, self._judge)
        self._enforcer = ToolCallEnforcer(self._judge, claims=approval_claims, summarized=self._turns.summarized,
                                           server_flagged=self._turns.server_flagged,
                                           trusted_system=self._turns.trusted_system)

    @property
    def name(self) -> str:
        """The middleware's name in LangChain's agent graph (its nodes are named after it), with ``label``."""
        return "GuardAgentMiddleware" if self.label is None else f"GuardAgentMiddleware[{self.label}]"

    def __repr__(self) -> str:
        return f"{self.name}(policies={len(self.guard.policies)}, reviewers={sorted(self._judge.reviewers)})"

    # Model input ------------------------------------------------------------------------------------------------

    @hook_config(can_jump_to=["end"])
    def before_model(self, state: GuardAgentState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Judge every user message that is new, or changed, since it was last judged (model input)."""
        record, todo = self._inputs.pending(state)
        judgements = self._judge.judge_all([pending.subject for pending in todo])
        update = self._inputs.settle(state, record, todo, judgements) or self._turns.refresh(state)
        return self._turns.stamp_update(state, update)

    @hook_config(can_jump_to=["end"])
    async def abefore_model(self, state: GuardAgentState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Async twin of :meth:`before_model`; the messages are judged concurrently."""
        record, todo = self._inputs.pending(state)
        judgements = await self._judge.ajudge_all([pending.subject for pending in todo])
        update = self._inputs.settle(state, record, todo, judgements) or self._turns.refresh(state)
        return self._turns.stamp_update(state, update)

    # Model output and tool calls: judged in the model node -------------------------------------------------------

    def _holds_output(self, request: ModelRequest[Any]) -> bool:
        """Whether the model's tokens must wait for the reply's verdict: an output policy applies, or the request
        offers the model tools its provider runs itself (their calls and results arrive inside the reply, and are
        judged with it)."""
        return self.hold_output_stream and (
            self._judge.matches(AgentSubject(event="model_output", text=""))
            or any(isinstance(tool, dict) for tool in request.tools)
        )

    def _admit(
        self,
        request: ModelRequest[Any],
        record: dict[str, Any],
        late: list[PendingInput],
        judgements: Sequence[Judgement],
        blocked: frozenset[str],
    ) -> tuple[ModelRequest[Any], dict[str, Any] | None, ModelResponse[Any] | None]:
        """The request the model may read (:meth:`_visible`), the input record to write (``None``: unchanged) and,
        when the model must not be called, the response that ends the run: a message or system message a middleware
        listed before this one changed is not allowed (:meth:`InputGate.late`), or no message is left to read."""
        inputs, stop = self._inputs.late(record, late, judgements) if late else (None, None)
        visible = self._visible(request, record if inputs is None else inputs, blocked)
        if stop is None and visible.messages:
            return visible, inputs, None
        verdict, reason = (stop.verdict, stop.reason) if stop is not None else (None, EMPTY_REQUEST)
        logger.warning("guard: %s ends the run before the model is called: %s (policy %s, rule %s)", self.name,
                       "a message a middleware listed before it changed or added is not allowed" if stop is not None
                       else EMPTY_REQUEST, getattr(verdict, "policy_id", None), getattr(verdict, "rule", None))  # fmt: skip
        notice = msgs.assistant_notice(msgs.INPUT_BLOCKED_TEMPLATE, verdict, reason, outcome="blocked",
                                       event="model_input", message_id=f"lc_guard_{uuid.uuid4().hex}")  # fmt: skip
        return visible, inputs, ModelResponse(result=[notice])

    def _visible(
        self, request: ModelRequest[Any], inputs: dict[str, Any], blocked: frozenset[str]
    ) -> ModelRequest[Any]:
        """The request without the input messages the input policy blocked (``blocked``: the ids of the thread's
        blocked messages, withheld whatever their content in the request), with notices in place of blocked assistant
        and tool messages a client wrote (they stay in the thread, unread), and without a system message a middleware
        added that is blocked; ``inputs``: the input record, late judgements (:meth:`InputGate.late`) included."""
        messages = self._inputs.visible(request.messages, inputs, blocked)
        system = request.system_message if self._inputs.system_visible(request.system_message, inputs) else None
        if system is request.system_message and len(messages) == len(request.messages) and all(
            a is b for a, b in zip(messages, request.messages)
        ):
            return request
        return request.override(messages=messages, system_message=system)

    def _finish(
        self, request: ModelRequest[Any], response: ModelResponse[Any], inputs: dict[str, Any] | None,
        turn: dict[str, Any] | None,
    ) -> ModelResponse[Any] | ExtendedModelResponse[Any]:
        """The model node's result: ``response``, its messages stamped (:meth:`TurnKeeper.stamp`), with the record update
        of the late input judgements and the turn."""
        response = replace(response, result=self._turns.stamp_all(response.result, request.state["messages"]))
        changes = {**({"inputs": inputs} if inputs is not None else {}), **({"turn": turn} if turn is not None else {})}
        update = self._turns.update(request.state, **changes) if changes else self._turns.refresh(request.state)
        if update is None:
            return response
        return ExtendedModelResponse(response, Command(update=update))

    def _ended(
        self, request: ModelRequest[Any], response: ModelResponse[Any], inputs: dict[str, Any] | None
    ) -> ModelResponse[Any] | ExtendedModelResponse[Any]:
        """:meth:`_finish` for a run :meth:`_admit` ended: its notice is the turn, enforced, with no call."""
        notice = response.result[0]
        turn = {"message_id": notice.id, "thread_id": current_thread_id(), "output": None, "calls": {},
                "enforced": True}  # fmt: skip
        return self._finish(request, response, inputs, turn)

    @staticmethod
    def _ai_of(response: ModelResponse[Any]) -> AIMessage | None:
        return next((m for m in response.result if isinstance(m, AIMessage)), None)

    def wrap_model_call(
        self, request: ModelRequest[Any], handler: Callable[[ModelRequest[Any]], ModelResponse[Any]]
    ) -> ModelResponse[Any] | ExtendedModelResponse[Any]:
        """Call the model (the request's input judged, without its blocked messages), then judge its reply and tool
        calls before anything else happens (blocking)."""
        record, late, blocked = self._inputs.requested(
            request.state, request.messages, request.system_message if self.judge_system_prompt else None
        )
        request, inputs, ended = self._admit(
            request, record, late, self._judge.judge_all([p.subject for p in late]) if late else [], blocked
        )
        if ended is not None:
            return self._ended(request, ended, inputs)
        holds = self._holds_output(request)
        with quiet_tokens(holds):
            response = handler(request.override(model=quiet_model(request.model, holds)))
        ai = self._ai_of(response)
        if ai is None:
            return self._finish(request, response, inputs, None)
        results = self._turns.server_results(ai, request.state)
        judged = list(zip(results, self._judge.judge_all(results), strict=True))
        turn, todo = self._turns.subjects(ai, request.state, request.tools, structured_ids(response, ai), judged)
        self._turns.store(turn, todo, self._judge.judge_all([subject for _, subject in todo]))
        return self._finish(request, screen(response, ai, turn), inputs, turn)

    async def awrap_model_call(
        self, request: ModelRequest[Any], handler: Callable[[ModelRequest[Any]], Awaitable[ModelResponse[Any]]]
    ) -> ModelResponse[Any] | ExtendedModelResponse[Any]:
        """Async twin of :meth:`wrap_model_call`; the turn's subjects are judged concurrently."""
        record, late, blocked = self._inputs.requested(
            request.state, request.messages, request.system_message if self.judge_system_prompt else None
        )
        request, inputs, ended = self._admit(
            request, record, late, await self._judge.ajudge_all([p.subject for p in late]) if late else [], blocked
        )
        if ended is not None:
            return self._ended(request, ended, inputs)
        holds = self._holds_output(request)
        with quiet_tokens(holds):
            response = await handler(request.override(model=quiet_model(request.model, holds)))
        ai = self._ai_of(response)
        if ai is None:
            return self._finish(request, response, inputs, None)
        results = self._turns.server_results(ai, request.state)
        judged = list(zip(results, await self._judge.ajudge_all(results), strict=True))
        turn, todo = self._turns.subjects(ai, request.state, request.tools, structured_ids(response, ai), judged)
        self._turns.store(turn, todo, await self._judge.ajudge_all([subject for _, subject in todo]))
        return self._finish(request, screen(response, ai, turn), inputs, turn)

    # Enforcement after the model ------------------------------------------------------------------------------------

    @hook_config(can_jump_to=["end"])
    def after_model(self, state: GuardAgentState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Enforce the turn's verdicts: answer blocked and malformed calls, ask the reviewer about escalated ones."""
        return self._turns.stamp_update(state, drive(self._turns.steps(state), self._judge.judge))

    @hook_config(can_jump_to=["end"])
    async def aafter_model(self, state: GuardAgentState, runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Async twin of :meth:`after_model`."""
        return self._turns.stamp_update(state, await adrive(self._turns.steps(state), self._judge.ajudge))

    # Tools ------------------------------------------------------------------------------------------------------

    @staticmethod
    def _effective(request: ToolCallRequest) -> ToolCallRequest | ToolMessage:
        """The call that will run: a ``HumanInTheLoopMiddleware`` reviewer's edit of it when one is in the state (an
        inner HITL middleware swaps it in after this one), else the call as it is."""
        call = request.tool_call
        edit = hitl_edit(request.state, call.get("id"))
        if edit is None or (edit.get("name") == call.get("name") and edit.get("args") == call.get("args")):
            return request
        name = edit.get("name")
        redirected = redirect(request, name if isinstance(name, str) else "", edit.get("args"))
        if isinstance(redirected, str):
            reason = f"the HumanInTheLoopMiddleware reviewer's edit {redirected}"
            return msgs.rejected(call.get("name") or "", call.get("id") or "", None, reason, "")
        return redirected

    @staticmethod
    def _hitl_released(request: ToolCallRequest) -> bool:
        """Whether a ``HumanInTheLoopMiddleware`` reviewer's edit released this call: judged on the spot, it is claimed
        once before it runs like a call guard's own review released, so replaying the checkpoint cannot run it
        twice (with HITL listed first its edit is already in the message, so no turn record of guard's covers it)."""
        return hitl_edit(request.state, request.tool_call.get("id")) is not None

    def _recorded(self, request: ToolCallRequest) -> Prepared | ToolMessage | None:
        """The prepared call its turn record lets run, an error message, or ``None`` to judge it on the spot."""
        call = request.tool_call
        call_id = call.get("id")
        ai = ai_message_for(request.state, call_id)
        turn = self._turns.part(request.state, "turn")
        if ai is None or not turn or turn.get("message_id") != ai.id or turn.get("thread_id") != current_thread_id():
            return None
        record = (turn.get("calls") or {}).get(call_id)
        if record is None or record.get("status") not in RUNNABLE:
            return None
        arguments, problem = classify_arguments(call.get("args"))
        if problem is not None or arguments_digest(call.get("name") or "", arguments or {}) != record["digest"]:
            return None
        prepared = self._enforcer.prepare(request)
        if isinstance(prepared, ToolMessage):
            return prepared
        if record["status"] == "approved" or record.get("hitl_edit"):
            prepared = replace(prepared, reviewed=True)
        if record["status"] != "edited":
            return prepared
        return self._enforcer.apply_edit(prepared, {"tool": record["run_tool"], "arguments": record["run_arguments"]})

    @staticmethod
    def _order_error(interrupt: GraphInterrupt) -> ValueError | None:
        """The error for an interrupt of a per-call ``HumanInTheLoopMiddleware`` listed after this one."""
        pending = interrupt.args[0] if interrupt.args else ()
        values = [getattr(i, "value", None) for i in pending] if isinstance(pending, (list, tuple)) else []
        if not any(isinstance(v, Mapping) and v.get("type") == "tool_approval" for v in values):
            return None
        return ValueError(
            "HumanInTheLoopMiddleware(interrupt_mode='per_call') is listed after GuardAgentMiddleware, so its "
            "reviewer's edits would run without guard judging them; list it first: create_agent(..., middleware="
            "[HumanInTheLoopMiddleware(..., interrupt_mode='per_call'), GuardAgentMiddleware(...)]) (or use its "
            "default batched mode, which works in either order)"
        )

    def _stamp_result(self, request: ToolCallRequest, result: Result) -> Result:
        """``result`` with its tool messages stamped (bound to the calls they answer in ``request``'s state); a
        ``Command`` whose messages cannot be found is returned as it is (its messages are then judged as model
        input)."""
        try:
            return ToolCallEnforcer.map_messages(result, self._turns.stamper(request.state["messages"]))
        except TypeError:
            return result

    def wrap_tool_call(self, request: ToolCallRequest, handler: SyncHandler) -> Result:
        """Run a call its record allows; judge any other call on the spot; then check the tool's output. The tool
        messages it returns are stamped (:meth:`TurnKeeper.stamp`)."""
        return self._stamp_result(request, self._tool_call(request, handler))

    def _tool_call(self, request: ToolCallRequest, handler: SyncHandler) -> Result:
        effective = self._effective(request)
        if isinstance(effective, ToolMessage):
            return effective

        def inner(call: ToolCallRequest) -> Result:
            try:
                return handler(call)
            except GraphInterrupt as interrupt:
                error = self._order_error(interrupt)
                if error is None:
                    raise
                raise error from None

        prepared = self._recorded(effective)
        if prepared is None:
            return self._enforcer.run(effective, inner, reviewed=self._hitl_released(request))
        if isinstance(prepared, ToolMessage):
            return prepared
        return self._enforcer.run_allowed(prepared, inner)

    async def awrap_tool_call(self, request: ToolCallRequest, handler: AsyncHandler) -> Result:
        """Async twin of :meth:`wrap_tool_call`."""
        return self._stamp_result(request, await self._atool_call(request, handler))

    async def _atool_call(self, request: ToolCallRequest, handler: AsyncHandler) -> Result:
        effective = self._effective(request)
        if isinstance(effective, ToolMessage):
            return effective

        async def inner(call: ToolCallRequest) -> Result:
            try:
                return await handler(call)
            except GraphInterrupt as interrupt:
                error = self._order_error(interrupt)
                if error is None:
                    raise
                raise error from None

        prepared = self._recorded(effective)
        if prepared is None:
            return await self._enforcer.arun(effective, inner, reviewed=self._hitl_released(request))
        if isinstance(prepared, ToolMessage):
            return prepared
        return await self._enforcer.arun_allowed(prepared, inner)
