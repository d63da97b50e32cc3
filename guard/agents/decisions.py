"""What a reviewer sees when guard escalates, what they answer, and how an approval is bound to the call.

An escalation raises ``langgraph.types.interrupt(GuardReviewRequest)``. The value has LangChain's
``HumanInTheLoopMiddleware`` request shape (``HITLRequest``), so Agent Chat UI, Agent Inbox and any client written for
that middleware can show and answer it, plus guard's own details::

    {"action_requests": [{"name": "pay", "args": {...}, "description": "..."}, ...],  # one per held item, in order
     "review_configs": [{"action_name": "pay", "allowed_decisions": ["approve", "edit", "reject"]}, ...],
     "type": "guard_review",                                                         # tells clients it is guard's
     "items": [PendingItem, ...],                                                    # verdict details, same order
     "positional": True}                                   # False: a list of decisions is refused, item ids only

Each :class:`PendingItem` has its own ``id``, bound to the thread, the model turn, the ``tool_call_id`` and a digest
of the exact arguments, so a decision can only release the call it was made for. Held model input or output is an
action named ``guard.model_input`` / ``guard.model_output`` with ``args == {"text": ...}`` (approve or reject only).

The run continues with ``Command(resume=value)`` where ``value`` is either shape:

* LangChain's ``HITLResponse``: ``{"decisions": [decision, ...]}``, one per action request, in order; decisions are
  ``{"type": "approve"}``, ``{"type": "reject", "message": "why"}`` (message optional) and
  ``{"type": "edit", "edited_action": {"name": tool, "args": {...}}}`` (an edit replaces all the arguments);
* guard's map: ``{"decisions": {item_id: decision}}``, where an edit may also be written
  ``{"type": "edit", "arguments": {...}, "tool": "other_tool"}`` (``tool`` optional).

An edit is judged again before it runs. With several interrupts pending at once (per-call reviews), key each value by
its interrupt id; :func:`resume_command` builds that ``Command`` from either shape.

The resume value is validated inside LangGraph's ``response_schema`` check: a value that misses an item, names an
unknown or stale item, has the wrong number of decisions, uses a decision the item does not allow, has a decision
of the wrong shape, or edits a call into a tool the agent does not have (by the item's ``tools``) raises
``pydantic.ValidationError`` wrapping one :class:`~guard.errors.ResumeError` that names the decision where the value
put it (``decisions[0]``, ``decisions['gp_...']``); LangGraph then saves nothing, nothing runs, and the same
interrupt can be answered again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, NotRequired, cast

from langchain.agents.middleware.human_in_the_loop import Action, ActionRequest, HITLRequest, ReviewConfig
from langgraph.types import Command, Interrupt
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Tag,
    TypeAdapter,
    ValidationError,
    with_config,
)
from typing_extensions import TypedDict

from guard.agents._arguments import shape_problem
from guard.errors import ResumeError
from guard.subject import AgentEvent, digest_of

__all__ = [
    "REVIEW_REQUEST_TYPE",
    "ApproveDecision",
    "Decision",
    "DecisionType",
    "EditDecision",
    "EditedActionDecision",
    "GuardReviewRequest",
    "GuardReviewResponse",
    "PendingItem",
    "RejectDecision",
    "guard_interrupts",
    "pending_id",
    "resume_command",
    "review_request",
]

REVIEW_REQUEST_TYPE: Literal["guard_review"] = "guard_review"
"""``GuardReviewRequest["type"]``: tells clients an interrupt came from guard."""

DecisionType = Literal["approve", "reject", "edit"]
TOOL_DECISIONS: tuple[DecisionType, ...] = ("approve", "reject", "edit")
TEXT_DECISIONS: tuple[DecisionType, ...] = ("approve", "reject")
TEXT_ACTION_PREFIX = "guard."
"""Held model input/output is the action ``guard.model_input`` / ``guard.model_output``."""


class PendingItem(TypedDict):
    """One held tool call (or model input/output) waiting for a reviewer.

    Attributes:
        id: the item's id (``gp_`` + 24 hex digits), bound to thread, turn, ``tool_call_id`` and arguments digest.
        event: ``tool_call``, ``model_input`` or ``model_output``.
        tool: the tool name (tool calls).
        tool_call_id: the model's id for the call (tool calls).
        arguments: the exact arguments that would run (tool calls).
        text: the held text (model input/output).
        digest: SHA-256 of the tool name and arguments (or of the text).
        thread_id: the LangGraph thread.
        decision_id: the escalating verdict's decision id.
        policy: the policy that escalated, ``policy_version`` its version, ``rule`` the rule that fired.
        message: the rule's message for the reviewer.
        answers: each question's probabilities, ``{question_id: {option_id: probability}}``.
        fail_mode: ``escalate`` when the backend failed and the fail mode escalated, else ``None``.
        error: the backend error behind a fail-mode escalation.
        allowed_decisions: which decision types this item accepts.
        tools: the names of the tools the agent can run (tool calls, where guard knows them): an edit that names a
            tool not among them is refused like any malformed resume, and the item stays pending.
    """

    id: str
    event: AgentEvent
    tool: str | None
    tool_call_id: str | None
    arguments: dict[str, Any] | None
    text: str | None
    digest: str
    thread_id: str | None
    decision_id: str
    policy: str | None
    policy_version: str | None
    rule: str | None
    message: str | None
    answers: dict[str, dict[str, float]]
    fail_mode: str | None
    error: str | None
    allowed_decisions: list[DecisionType]
    tools: NotRequired[list[str]]


class GuardReviewRequest(HITLRequest):
    """The value of a guard interrupt: LangChain's ``HITLRequest`` (``action_requests`` and ``review_configs``, one
    per held item, in order) plus ``type`` (always ``"guard_review"``), ``items`` (guard's details, same order) and
    ``positional`` (whether the interrupt takes a list of decisions answering the items in order; ``False`` with
    ``decisions_by_position=False`` or after an abandoned review, when only the map of item ids answers it)."""

    type: Literal["guard_review"]
    items: list[PendingItem]
    positional: bool


@with_config(ConfigDict(extra="forbid"))
class ApproveDecision(TypedDict):
    """Run the held call as it is."""

    type: Literal["approve"]


@with_config(ConfigDict(extra="forbid"))
class RejectDecision(TypedDict):
    """Do not run it; the model gets an error tool message with ``message`` as the reason."""

    type: Literal["reject"]
    message: NotRequired[str]


@with_config(ConfigDict(extra="forbid"))
class EditDecision(TypedDict):
    """Run these ``arguments`` instead (and ``tool``, when renamed) once the policy allows the edited call."""

    type: Literal["edit"]
    arguments: dict[str, Any]
    tool: NotRequired[str]


@with_config(ConfigDict(extra="forbid"))
class EditedActionDecision(TypedDict):
    """LangChain's edit: run ``edited_action`` (``{"name": tool, "args": {...}}``) once the policy allows it."""

    type: Literal["edit"]
    edited_action: Action


def _decision_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "edit" and "edited_action" in value:
        return "edited_action"
    return kind if isinstance(kind, str) else None


Decision = Annotated[
    Annotated[ApproveDecision, Tag("approve")]
    | Annotated[RejectDecision, Tag("reject")]
    | Annotated[EditDecision, Tag("edit")]
    | Annotated[EditedActionDecision, Tag("edited_action")],
    Discriminator(_decision_tag),
]


@with_config(ConfigDict(extra="forbid"))
class GuardReviewResponse(TypedDict):
    """The resume value: decisions in the order of ``action_requests`` (LangChain's ``HITLResponse``), or keyed by
    pending item id."""

    decisions: dict[str, Decision] | list[Decision]


def pending_id(*, thread_id: str | None, scope: str, key: str, digest: str) -> str:
    """The id of one pending item: ``gp_`` + the first 24 hex digits of a digest of its binding.

    Args:
        thread_id: the LangGraph thread (``""`` when unknown).
        scope: what is held and in which turn, e.g. ``"tool_call:<ai message id>"``.
        key: the ``tool_call_id`` (or the message id for model input/output).
        digest: SHA-256 of the exact content that would be released.
    """
    return "gp_" + digest_of("pending", thread_id or "", scope, key, digest)[:24]


def _description(item: PendingItem) -> str:
    text = f"guard holds this {item['event'].replace('_', ' ')} for review"
    where = ", ".join(f"{key} {value}" for key, value in (("policy", item["policy"]), ("rule", item["rule"])) if value)
    if where:
        text += f" ({where})"
    reason = item["message"] or (f"the decision backend failed: {item['error']}" if item["error"] else "")
    return f"{text}: {reason}" if reason else text


def review_request(items: Sequence[PendingItem], *, positional: bool = True) -> GuardReviewRequest:
    """The interrupt value for ``items``: one action request and one review config per item, in order;
    ``positional`` as :func:`response_schema` takes it (``False``: a list of decisions is refused)."""
    actions: list[ActionRequest] = []
    configs: list[ReviewConfig] = []
    for item in items:
        if item["event"] == "tool_call":
            name, args = item["tool"] or "", dict(item["arguments"] or {})
        else:
            name, args = TEXT_ACTION_PREFIX + item["event"], {"text": item["text"] or ""}
        actions.append(ActionRequest(name=name, args=args, description=_description(item)))
        configs.append(ReviewConfig(action_name=name, allowed_decisions=list(item["allowed_decisions"])))
    return GuardReviewRequest(
        action_requests=actions,
        review_configs=configs,
        type=REVIEW_REQUEST_TYPE,
        items=list(items),
        positional=positional,
    )


def _plain(decision: Mapping[str, Any]) -> dict[str, Any]:
    """A decision in guard's own form (a LangChain ``edited_action`` edit becomes ``arguments`` and ``tool``)."""
    if "edited_action" not in decision:
        return dict(decision)
    action = decision["edited_action"]
    return {"type": "edit", "arguments": dict(action["args"]), "tool": action["name"]}


#: Why a list of decisions is refused (:func:`response_schema` with ``positional=False``; :func:`resume_command` for
#: an interrupt whose value's ``positional`` is not ``True``).
BY_POSITION_REFUSED = (
    "this review takes decisions by item id only, not a list answered by position (the middleware's "
    "decisions_by_position=False, or the thread took new input while an earlier review was pending, so a list could "
    "be meant for the items the reviewer saw then, or an older guard raised it without saying it takes a list): send {{\"decisions\": {{<item id>: <decision>}}}} "
    "(guard.agents.resume_command) for {ids}"
)


def _check(
    value: dict[str, Any], *, items: Sequence[PendingItem], exact: bool, positional: bool = True
) -> dict[str, Any]:
    by_id = {item["id"]: item for item in items}
    expected = tuple(by_id)
    decisions: Mapping[str, Any] | list[Any] = value["decisions"]
    if isinstance(decisions, list) and not positional:
        raise ResumeError(BY_POSITION_REFUSED.format(ids=", ".join(expected)), expected=expected)
    if isinstance(decisions, list):
        if len(decisions) != len(items):
            raise ResumeError(
                f"{len(decisions)} decision(s) given for {len(items)} pending review item(s); a list of decisions "
                f"answers the interrupt's action_requests in order, one each",
                expected=expected,
            )
        decisions = {item["id"]: decision for item, decision in zip(items, decisions, strict=True)}
        named = {item["id"]: f"decisions[{at}] ({item['id']})" for at, item in enumerate(items)}
    else:
        named = {item_id: item_id for item_id in expected}
    given = tuple(decisions)
    unknown = [key for key in given if key not in by_id]
    missing = [key for key in expected if key not in decisions]
    if (exact and unknown) or missing:
        parts = []
        if missing:
            parts.append(f"no decision for {', '.join(missing)}")
        if exact and unknown:
            parts.append(f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not pending (unknown or stale)")
        raise ResumeError(
            f"{len(given)} decision(s) given for {len(expected)} pending review item(s): {'; '.join(parts)}; "
            f"answer each of {', '.join(expected)} exactly once",
            expected=expected,
            given=given,
        )
    for item_id, item in by_id.items():
        kind = decisions[item_id]["type"]
        if kind not in item["allowed_decisions"]:
            raise ResumeError(
                f"decision {kind!r} is not allowed for {named[item_id]}; allowed: "
                f"{', '.join(item['allowed_decisions'])}",
                expected=expected,
                given=given,
            )
    plain = {key: _plain(decision) for key, decision in decisions.items()}
    for item_id, decision in plain.items():
        name = named.get(item_id, item_id)
        problem = shape_problem(decision["arguments"]) if decision["type"] == "edit" else None
        if problem is not None:
            raise ResumeError(f"the edit for {name} cannot be judged: its {problem}", expected=expected, given=given)
        item = by_id.get(item_id)
        problem = _unknown_tool(decision, item) if item is not None else None
        if problem is not None:
            raise ResumeError(f"the edit for {name} {problem}", expected=expected, given=given)
    return {"decisions": plain}


def _unknown_tool(decision: Mapping[str, Any], item: PendingItem) -> str | None:
    """Why an edit cannot run (it names a tool the agent does not have, by the item's ``tools``), or ``None``."""
    tool = decision.get("tool") if decision["type"] == "edit" else None
    tools = item.get("tools")
    if not tool or tool == item.get("tool") or tools is None or tool in tools:
        return None
    return f"names tool {tool!r}, which this agent does not have; its tools: {', '.join(tools) or '(none)'}"


def response_schema(items: Sequence[PendingItem], *, exact: bool = True, positional: bool = True) -> Any:
    """The ``response_schema`` for ``interrupt()``: a :class:`GuardReviewResponse` that must answer every item; the
    validated value always comes back as guard's map, ``{"decisions": {item_id: decision}}``, edits as
    ``{"type": "edit", "arguments": ..., "tool": ...}``.

    Args:
        items: the pending items of this interrupt.
        exact: also refuse decisions for ids that are not pending (one interrupt holding a whole turn). Per-call
            interrupts pass ``False``, so the same full decision map can be sent to each of them.
        positional: also accept LangChain's list of decisions, answering the items in order; ``False`` refuses it
            (:data:`BY_POSITION_REFUSED`).
    """
    frozen = tuple(items)
    expected = tuple(item["id"] for item in frozen)

    def guard_review_shape(value: Any) -> Any:
        return _well_formed(value, expected=expected)

    def guard_review_decisions(value: dict[str, Any]) -> dict[str, Any]:
        return _check(value, items=frozen, exact=exact, positional=positional)

    return Annotated[GuardReviewResponse, BeforeValidator(guard_review_shape), AfterValidator(guard_review_decisions)]


_DECISION: TypeAdapter[Any] = TypeAdapter(Decision)
_SHAPES = 'send {"decisions": [decision, ...]} or {"decisions": {item_id: decision}}'


def _well_formed(value: Any, *, expected: tuple[str, ...]) -> Any:
    """``value`` unchanged, after refusing (:class:`ResumeError`) one that is not ``{"decisions": [...]}`` or
    ``{"decisions": {...}}``, or that holds a decision a reviewer cannot send: a ``type`` other than approve, reject
    and edit, or a field missing, extra or of the wrong type (pydantic's own message would list every shape the
    schema takes). A decision is named where the value puts it: ``decisions[0]``, ``decisions['gp_...']``."""
    if not isinstance(value, Mapping):
        raise ResumeError(f"the resume value is a {type(value).__name__}; {_SHAPES}", expected=expected)
    if set(value) != {"decisions"}:
        keys = ", ".join(repr(key) for key in value) or "no key"
        raise ResumeError(f"the resume value has {keys}; {_SHAPES}", expected=expected)
    decisions = value["decisions"]
    if not isinstance(decisions, Mapping | list):
        raise ResumeError(f"the resume value's decisions are a {type(decisions).__name__}; {_SHAPES}",
                          expected=expected)
    entries = list(decisions.items()) if isinstance(decisions, Mapping) else list(enumerate(decisions))
    for where, decision in entries:
        kind = decision.get("type") if isinstance(decision, Mapping) else None
        if kind not in TOOL_DECISIONS:
            raise ResumeError(f"decisions[{where!r}] has type {kind!r}; a decision's type is one of "
                              f"{', '.join(TOOL_DECISIONS)}", expected=expected)
        try:
            _DECISION.validate_python(decision)
        except ValidationError as refused:
            error = refused.errors()[0]
            field = ".".join(str(part) for part in error["loc"][1:])  # (decision tag, field, ...)
            raise ResumeError(f"decisions[{where!r}]: the {kind!r} decision is invalid: "
                              f"{field + ': ' if field else ''}{error['msg']}", expected=expected) from None
    return value


def _interrupt_value(interrupt: Any) -> Any:
    return interrupt.get("value") if isinstance(interrupt, Mapping) else getattr(interrupt, "value", None)


def _interrupt_id(interrupt: Any) -> str:
    if isinstance(interrupt, Mapping):
        found = interrupt.get("id") or interrupt.get("interrupt_id")
    else:
        found = getattr(interrupt, "id", None)
    if not isinstance(found, str) or not found:
        raise ResumeError(f"a guard interrupt has no id to resume it by: {interrupt!r}")
    return found


def guard_interrupts(interrupts: Iterable[Interrupt | Mapping[str, Any]]) -> list[Interrupt | Mapping[str, Any]]:
    """The interrupts raised by guard (value ``type == "guard_review"``), in the order given: ``Interrupt`` objects,
    or the plain ``{"value": ..., "id": ...}`` dicts the LangGraph SDK returns."""
    out = []
    for interrupt in interrupts:
        value = _interrupt_value(interrupt)
        if isinstance(value, Mapping) and value.get("type") == REVIEW_REQUEST_TYPE:
            out.append(interrupt)
    return out


def resume_command(
    interrupts: Iterable[Interrupt | Mapping[str, Any]],
    decisions: Mapping[str, Decision] | Sequence[Decision],
    *,
    others: Mapping[str, Any] | None = None,
) -> Command[Any]:
    """Build the ``Command`` that answers every pending guard item, after checking the decisions match them exactly.

    Args:
        interrupts: the thread's pending interrupts: ``Interrupt`` objects (``graph.get_state(config).interrupts``,
            the ``"__interrupt__"`` entry of a result) or the plain dicts of the LangGraph SDK
            (``(await client.threads.get_state(thread_id))["interrupts"]``).
        decisions: ``{item_id: decision}``, one per pending item across all guard interrupts; or, while one guard
            interrupt is pending and its value's ``positional`` is ``True``, a list of decisions in the order
            of its ``action_requests``, one per action request (an interrupt raised before guard wrote
            ``positional``, pending in an older checkpoint, takes the map only).
        others: resume values for interrupts that are not guard's, ``{interrupt_id: value}``.

    Returns:
        ``Command(resume={interrupt_id: {"decisions": {item_id: decision}}, ...})``, each interrupt getting its own
        items' decisions keyed by item id whatever the form given, so an answer that reaches another call's interrupt
        (calls sharing one task resume in no stable order) is refused there, not applied to it. Through the LangGraph
        SDK send ``command={"resume": resume_command(...).resume}``.

    Raises:
        ResumeError: when ``decisions`` is not a map or a list, a list is given while more than one guard interrupt
            is pending (they have no order a reviewer is sure to have seen them in: ``invoke``'s ``__interrupt__``
            lists them as their tasks raised them, ``get_state`` in task order) or to an interrupt that refuses one
            (``positional`` not ``True``: :data:`BY_POSITION_REFUSED`), an item has no decision or a
            decision names no pending item (a count mismatch runs nothing), a decision is one the graph would refuse
            (a type the item does not allow, a missing or extra field, a wrong type, an edit naming a tool not among
            the item's ``tools``: checked with the interrupt's own ``response_schema``, the decision named where
            ``decisions`` puts it, ``decisions[0]`` in a list), or an interrupt has no id.
    """
    pending = guard_interrupts(interrupts)
    per_interrupt = [(_interrupt_id(i), cast(GuardReviewRequest, _interrupt_value(i))["items"]) for i in pending]
    expected = tuple(item["id"] for _, items in per_interrupt for item in items)
    if isinstance(decisions, str | bytes) or not isinstance(decisions, Mapping | Sequence):
        raise ResumeError(
            f"decisions must be a map {{item_id: decision}} or a list of decisions, not {type(decisions).__name__}",
            expected=expected,
        )
    if isinstance(decisions, Mapping):
        given = tuple(decisions)
        if set(expected) != set(given) or len(expected) != len(set(expected)):
            missing = sorted(set(expected) - set(given))
            unknown = sorted(set(map(str, given)) - set(expected))
            raise ResumeError(
                f"{len(given)} decision(s) given for {len(expected)} pending review item(s)"
                + (f"; no decision for {', '.join(missing)}" if missing else "")
                + (f"; not pending: {', '.join(unknown)}" if unknown else "")
                + ("; an item id repeats in the pending interrupts: a map cannot tell its items apart (answer one "
                   "interrupt at a time)" if
                   len(set(expected)) < len(expected) else ""),
                expected=expected,
                given=tuple(map(str, given)),
            )
        per_item: list[Mapping[str, Any] | list[Any]] = [
            {item["id"]: decisions[item["id"]] for item in items} for _, items in per_interrupt
        ]
    else:
        listed = list(decisions)
        if len(per_interrupt) > 1:
            raise ResumeError(
                f"a list of decisions answers one guard interrupt, but {len(per_interrupt)} are pending, in no order "
                f"a reviewer is sure to have seen: send a map {{item_id: decision}} (each item's 'id'), or answer one "
                f"interrupt at a time (resume_command([interrupt], decisions))",
                expected=expected,
            )
        if per_interrupt and _interrupt_value(pending[0]).get("positional") is not True:
            raise ResumeError(BY_POSITION_REFUSED.format(ids=", ".join(expected)), expected=expected)
        if len(listed) != len(expected):
            raise ResumeError(
                f"{len(listed)} decision(s) given for {len(expected)} pending review item(s); a list of decisions "
                f"answers the action_requests of the pending guard interrupt in order, one each",
                expected=expected,
            )
        if len(set(expected)) < len(expected):  # the answer is keyed by item id: one of two decisions would be lost
            raise ResumeError(f"interrupt {per_interrupt[0][0]} holds two items of the same id; they cannot be "
                              f"answered apart", expected=expected)
        per_item = [listed] if per_interrupt else []  # the one pending interrupt's answers (none pending: none)
    resume: dict[str, Any] = dict(others or {})
    for (interrupt_id, items), answers in zip(per_interrupt, per_item, strict=True):
        _validate_resume(items, {"decisions": answers}, expected=expected)  # as given: a problem named where it is
        if isinstance(answers, list):  # keyed by item id: an answer names the item it is for
            answers = {item["id"]: answer for item, answer in zip(items, answers, strict=True)}
        resume[interrupt_id] = {"decisions": answers}
    return Command(resume=resume)


def _validate_resume(items: Sequence[PendingItem], value: dict[str, Any], *, expected: tuple[str, ...]) -> None:
    """Check one interrupt's resume value with its ``response_schema``, as the graph will; a refusal is the
    schema's :class:`ResumeError` (naming the decision and the problem), ``expected`` being every pending item."""
    try:
        TypeAdapter(response_schema(items)).validate_python(value)
    except ValidationError as refused:
        for error in refused.errors():
            cause = error.get("ctx", {}).get("error")
            if isinstance(cause, ResumeError):
                raise ResumeError(cause.reason, expected=expected, given=cause.given) from None
        raise ResumeError(str(refused), expected=expected) from None
