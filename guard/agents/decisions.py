"""What a reviewer sees when guard escalates, what they answer, and how an approval is bound to the call.

An escalation raises ``langgraph.types.interrupt(GuardReviewRequest)``: one request holds one :class:`PendingItem`
per held tool call (or model input/output), each with its own ``id``. The id is bound to the thread, the model turn,
the ``tool_call_id`` and a digest of the exact arguments, so a decision can only release the call it was made for.

The run continues with ``Command(resume={"decisions": {item_id: decision}})`` (or, when several guard interrupts
are pending at once, the ``Command`` that :func:`resume_command` builds). Each decision is one of::

    {"type": "approve"}
    {"type": "reject", "message": "why"}                       # message optional
    {"type": "edit", "arguments": {...}, "tool": "other_tool"} # tool optional; the edit is judged again

The resume value is validated inside LangGraph's ``response_schema`` check: a value that misses an item, names an
unknown or stale item, or uses a decision the item does not allow raises ``pydantic.ValidationError`` wrapping a
:class:`~guard.errors.ResumeError`; LangGraph then saves nothing, nothing runs, and the thread can be answered again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, NotRequired

from langgraph.types import Command, Interrupt
from pydantic import AfterValidator, ConfigDict, Discriminator, with_config
from typing_extensions import TypedDict

from guard.errors import ResumeError
from guard.subject import AgentEvent, digest_of

__all__ = [
    "REVIEW_REQUEST_TYPE",
    "ApproveDecision",
    "Decision",
    "DecisionType",
    "EditDecision",
    "GuardReviewRequest",
    "GuardReviewResponse",
    "PendingItem",
    "RejectDecision",
    "guard_interrupts",
    "pending_id",
    "resume_command",
]

REVIEW_REQUEST_TYPE: Literal["guard_review"] = "guard_review"
"""``GuardReviewRequest["type"]``: tells clients an interrupt came from guard."""

DecisionType = Literal["approve", "reject", "edit"]
TOOL_DECISIONS: tuple[DecisionType, ...] = ("approve", "reject", "edit")
TEXT_DECISIONS: tuple[DecisionType, ...] = ("approve", "reject")


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


class GuardReviewRequest(TypedDict):
    """The value of a guard interrupt: ``type`` is always ``"guard_review"``; ``items`` are the held calls."""

    type: Literal["guard_review"]
    items: list[PendingItem]


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


Decision = Annotated[ApproveDecision | RejectDecision | EditDecision, Discriminator("type")]


@with_config(ConfigDict(extra="forbid"))
class GuardReviewResponse(TypedDict):
    """The resume value: one decision per pending item id."""

    decisions: dict[str, Decision]


def pending_id(*, thread_id: str | None, scope: str, key: str, digest: str) -> str:
    """The id of one pending item: ``gp_`` + the first 24 hex digits of a digest of its binding.

    Args:
        thread_id: the LangGraph thread (``""`` when unknown).
        scope: what is held and in which turn, e.g. ``"tool_call:<ai message id>"``.
        key: the ``tool_call_id`` (or the message id for model input/output).
        digest: SHA-256 of the exact content that would be released.
    """
    return "gp_" + digest_of("pending", thread_id or "", scope, key, digest)[:24]


def _check(value: dict[str, Any], *, items: Sequence[PendingItem], exact: bool) -> dict[str, Any]:
    decisions: Mapping[str, Any] = value["decisions"]
    by_id = {item["id"]: item for item in items}
    expected = tuple(by_id)
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
                f"decision {kind!r} is not allowed for {item_id}; allowed: {', '.join(item['allowed_decisions'])}",
                expected=expected,
                given=given,
            )
    return value


def response_schema(items: Sequence[PendingItem], *, exact: bool = True) -> Any:
    """The ``response_schema`` for ``interrupt()``: a :class:`GuardReviewResponse` that must answer every item.

    Args:
        items: the pending items of this interrupt.
        exact: also refuse decisions for ids that are not pending (one interrupt holding a whole turn). Per-call
            interrupts pass ``False``, so the same full decision map can be sent to each of them.
    """
    frozen = tuple(items)

    def guard_review_decisions(value: dict[str, Any]) -> dict[str, Any]:
        return _check(value, items=frozen, exact=exact)

    return Annotated[GuardReviewResponse, AfterValidator(guard_review_decisions)]


def guard_interrupts(interrupts: Iterable[Interrupt]) -> list[Interrupt]:
    """The interrupts raised by guard (value ``type == "guard_review"``), in the order given."""
    return [i for i in interrupts if isinstance(i.value, Mapping) and i.value.get("type") == REVIEW_REQUEST_TYPE]


def resume_command(
    interrupts: Iterable[Interrupt],
    decisions: Mapping[str, Decision],
    *,
    others: Mapping[str, Any] | None = None,
) -> Command[Any]:
    """Build the ``Command`` that answers every pending guard item, after checking the decisions match them exactly.

    Args:
        interrupts: the thread's pending interrupts (``graph.get_state(config).interrupts`` or the
            ``"__interrupt__"`` entry of a result).
        decisions: ``{item_id: decision}``, one per pending item across all guard interrupts.
        others: resume values for interrupts that are not guard's, ``{interrupt_id: value}``.

    Returns:
        ``Command(resume={interrupt_id: {"decisions": {...}}, ...})``, each interrupt getting its own items' decisions.

    Raises:
        ResumeError: when an item has no decision or a decision names no pending item (a count mismatch
            runs nothing).
    """
    pending = guard_interrupts(interrupts)
    expected = tuple(item["id"] for i in pending for item in i.value["items"])
    given = tuple(decisions)
    if set(expected) != set(given) or len(expected) != len(set(expected)):
        missing = sorted(set(expected) - set(given))
        unknown = sorted(set(given) - set(expected))
        raise ResumeError(
            f"{len(given)} decision(s) given for {len(expected)} pending review item(s)"
            + (f"; no decision for {', '.join(missing)}" if missing else "")
            + (f"; not pending: {', '.join(unknown)}" if unknown else ""),
            expected=expected,
            given=given,
        )
    resume: dict[str, Any] = dict(others or {})
    for intr in pending:
        resume[intr.id] = {"decisions": {item["id"]: decisions[item["id"]] for item in intr.value["items"]}}
    return Command(resume=resume)
