"""Resume values: validated against the pending items, routed by item id, refused on any mismatch (case C18)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from langgraph.types import Interrupt
from pydantic import TypeAdapter, ValidationError

from guard.agents import resume_command
from guard.agents._arguments import MAX_ARGUMENT_DEPTH
from guard.agents.decisions import pending_id, response_schema
from guard.errors import ResumeError


def _item(item_id: str, allowed: tuple[str, ...] = ("approve", "reject", "edit")) -> dict:
    return {"id": item_id, "allowed_decisions": list(allowed)}


def test_pending_id_binds_thread_turn_call_and_digest() -> None:
    base = pending_id(thread_id="t", scope="tool_call:m1", key="c1", digest="d")
    assert base.startswith("gp_") and len(base) == 27
    assert base == pending_id(thread_id="t", scope="tool_call:m1", key="c1", digest="d")
    for other in [
        pending_id(thread_id="t2", scope="tool_call:m1", key="c1", digest="d"),
        pending_id(thread_id="t", scope="tool_call:m2", key="c1", digest="d"),
        pending_id(thread_id="t", scope="tool_call:m1", key="c2", digest="d"),
        pending_id(thread_id="t", scope="tool_call:m1", key="c1", digest="e"),
    ]:
        assert other != base


def _validate(items: list[dict], value: object, *, exact: bool = True) -> dict:
    return TypeAdapter(response_schema(items, exact=exact)).validate_python(value)


def test_a_complete_answer_passes() -> None:
    value = {
        "decisions": {
            "a": {"type": "approve"},
            "b": {"type": "reject", "message": "no"},
            "c": {"type": "edit", "arguments": {"amount": 1}, "tool": "refund"},
        }
    }
    assert _validate([_item("a"), _item("b"), _item("c")], value) == value


@pytest.mark.parametrize(
    ("decisions", "fragment"),
    [
        ({"a": {"type": "approve"}}, "no decision for b"),
        ({"a": {"type": "approve"}, "b": {"type": "approve"}, "z": {"type": "approve"}}, "z is not pending"),
        ({"a": {"type": "approve"}, "b": {"type": "edit", "arguments": {}}}, "'edit' is not allowed for b"),
        ({"a": {"type": "edit", "arguments": []}, "b": {"type": "approve"}}, "valid dictionary"),
        ({"a": {"type": "approve", "note": 1}, "b": {"type": "approve"}}, "Extra inputs"),
        ({"a": {"type": "maybe"}, "b": {"type": "approve"}}, "decisions\\['a'\\] has type 'maybe'; a decision's type is one of approve, reject, edit"),
    ],
)
def test_mismatched_answers_are_refused(decisions: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        _validate([_item("a"), _item("b", ("approve", "reject"))], {"decisions": decisions})


@pytest.mark.parametrize("form", ["guard", "langchain"])
def test_an_edit_too_deep_to_judge_is_refused_like_a_models_call(form: str) -> None:
    memo: object = "x"
    for _ in range(MAX_ARGUMENT_DEPTH):
        memo = {"k": memo}
    arguments = {"amount": 1, "memo": memo}
    edit = {"type": "edit", "arguments": arguments} if form == "guard" else {
        "type": "edit", "edited_action": {"name": "pay", "args": arguments}}
    with pytest.raises(ValidationError, match=f"the edit for a cannot be judged: its arguments nest deeper than "
                                              f"{MAX_ARGUMENT_DEPTH} levels"):
        _validate([_item("a")], {"decisions": {"a": edit}})
    shallow = {"type": "edit", "arguments": {"amount": 1, "memo": memo["k"]}}  # type: ignore[index]
    assert _validate([_item("a")], {"decisions": {"a": shallow}})["decisions"]["a"] == shallow
    huge = {"type": "edit", "arguments": {"amount": 10**30, "to": "bob"}}  # the checkpoint could not store it
    with pytest.raises(ValidationError, match="an integer outside the 64-bit range"):
        _validate([_item("a")], {"decisions": {"a": huge}})


def test_bare_values_are_refused() -> None:
    for value in ["approve", {"type": "approve"}, {"decisions": []}, None]:
        with pytest.raises(ValidationError):
            _validate([_item("a")], value)


def test_per_call_schema_accepts_the_full_map_but_needs_its_own_item() -> None:
    full = {"decisions": {"a": {"type": "approve"}, "b": {"type": "approve"}}}
    assert _validate([_item("a")], full, exact=False) == full
    with pytest.raises(ValidationError, match="no decision for a"):
        _validate([_item("a")], {"decisions": {"b": {"type": "approve"}}}, exact=False)


def _interrupt(interrupt_id: str, *item_ids: str, positional: bool | None = True) -> Interrupt:
    value = {"type": "guard_review", "items": [_item(i) for i in item_ids], "positional": positional}
    return Interrupt(value={k: v for k, v in value.items() if v is not None}, id=interrupt_id)


def test_resume_command_routes_each_decision_to_its_interrupt() -> None:
    pending = [_interrupt("i1", "a"), _interrupt("i2", "b", "c"), Interrupt(value="not guard", id="i3")]
    decisions = {"a": {"type": "approve"}, "b": {"type": "reject"}, "c": {"type": "approve"}}
    command = resume_command(pending, decisions, others={"i3": "yes"})
    assert command.resume == {
        "i3": "yes",
        "i1": {"decisions": {"a": {"type": "approve"}}},
        "i2": {"decisions": {"b": {"type": "reject"}, "c": {"type": "approve"}}},
    }


@pytest.mark.parametrize("count", [2, 4])
def test_resume_command_refuses_a_count_mismatch(count: int) -> None:
    pending = [_interrupt("i1", "a"), _interrupt("i2", "b"), _interrupt("i3", "c")]
    decisions = {k: {"type": "approve"} for k in ["a", "b", "c", "d"][:count]}
    with pytest.raises(ResumeError) as caught:
        resume_command(pending, decisions)  # type: ignore[arg-type]
    assert caught.value.expected == ("a", "b", "c") and len(caught.value.given) == count


@pytest.mark.parametrize(
    ("decision", "fragment"),
    [
        ({"type": "respond", "message": "hi"}, " has type 'respond'; a decision's type is one of approve, reject, edit"),
        ({"type": "ignore"}, " has type 'ignore'"),
        ({"type": "approve", "extra": 1}, ": the 'approve' decision is invalid: extra: Extra inputs"),
        ({"type": "reject", "message": 5}, ": the 'reject' decision is invalid: message: Input should be a valid str"),
        ({"type": "edit"}, ": the 'edit' decision is invalid: arguments: Field required"),
        ({"type": "edit", "edited_action": {"name": "pay"}}, ": the 'edit' decision is invalid: edited_action.args"),
    ],
)
@pytest.mark.parametrize("form", ["map", "list"])
def test_resume_command_refuses_a_decision_the_graph_would_refuse(decision: dict, fragment: str, form: str) -> None:
    """The decision is named where the caller put it: by its item id in a map, by its position in a list."""
    pending = [_interrupt("i1", "a"), _interrupt("i2", "b")] if form == "map" else [_interrupt("i1", "a", "b")]
    decisions = {"a": {"type": "approve"}, "b": decision}
    where = "decisions['b']" if form == "map" else "decisions[1]"
    with pytest.raises(ResumeError, match=re.escape(where) + fragment) as caught:
        resume_command(pending, decisions if form == "map" else list(decisions.values()))
    assert caught.value.expected == ("a", "b")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({"decisions": [{"type": "edit", "edited_action": {"name": "pay"}}]},
         "decisions[0]: the 'edit' decision is invalid: edited_action.args: Field required"),
        ({"decisions": {"a": {"type": "reject", "message": 5}}},
         "decisions['a']: the 'reject' decision is invalid: message: Input should be a valid string"),
        ({"decisions": "approve"}, "the resume value's decisions are a str; send {\"decisions\": [decision, ...]}"),
        ({"decision": [{"type": "approve"}]}, "the resume value has 'decision'; send "),
        (["approve"], "the resume value is a list; send "),
    ],
)
def test_a_malformed_resume_value_is_one_resume_error(value: object, reason: str) -> None:
    """Sent raw (``Command(resume=...)``), a value of the wrong shape is refused with one error, a ResumeError saying
    what is wrong where, not pydantic's error for each shape the schema takes."""
    with pytest.raises(ValidationError) as caught:
        _validate([_item("a")], value)
    (error,) = caught.value.errors()
    assert isinstance(error["ctx"]["error"], ResumeError) and error["ctx"]["error"].reason.startswith(reason)


def test_resume_command_refuses_a_decision_the_item_does_not_allow() -> None:
    pending = [Interrupt(value={"type": "guard_review", "items": [_item("a", ("approve", "reject"))]}, id="i1")]
    with pytest.raises(ResumeError, match="decision 'edit' is not allowed for a; allowed: approve, reject"):
        resume_command(pending, {"a": {"type": "edit", "arguments": {"amount": 1}}})


@pytest.mark.parametrize("decisions", ["approve", None, 3])
def test_resume_command_wants_a_map_or_a_list(decisions: object) -> None:
    with pytest.raises(ResumeError, match="decisions must be a map {item_id: decision} or a list of decisions, not "):
        resume_command([_interrupt("i1", "a")], decisions)  # type: ignore[arg-type]


def test_a_list_answers_one_pending_guard_interrupt_only() -> None:
    """Several guard interrupts (per-call reviews) have no order a reviewer is sure to have seen: ``invoke``'s
    ``__interrupt__`` lists them as their tasks raised them, ``get_state`` in task order. So a list, which carries no
    ids, is refused across them, naming what to send instead; a map, or one interrupt at a time, answers them."""
    pending = [_interrupt("i1", "a"), _interrupt("i2", "b"), Interrupt(value="not guard", id="i3")]
    with pytest.raises(ResumeError, match=r"a list of decisions answers one guard interrupt, but 2 are pending.*send "
                                          r"a map \{item_id: decision\}.*or answer one interrupt at a time") as caught:
        resume_command(pending, [{"type": "approve"}, {"type": "reject"}])
    assert caught.value.expected == ("a", "b")
    command = resume_command(pending, {"a": {"type": "approve"}, "b": {"type": "reject"}})
    assert command.resume == {"i1": {"decisions": {"a": {"type": "approve"}}},
                              "i2": {"decisions": {"b": {"type": "reject"}}}}
    command = resume_command(pending[1:], [{"type": "reject"}], others={"i3": "yes"})  # one guard interrupt: a list
    assert command.resume == {"i3": "yes", "i2": {"decisions": {"b": {"type": "reject"}}}}


@pytest.mark.parametrize("positional", [False, None])
@pytest.mark.parametrize("form", ["interrupt", "sdk"])
def test_a_list_is_refused_for_an_interrupt_that_does_not_say_it_takes_one(positional: bool | None, form: str) -> None:
    """``positional`` false, or missing (a review pending in a checkpoint an older guard wrote, perhaps with
    ``decisions_by_position=False``): a list is refused, the map of item ids answers."""
    pending: list[Any] = [_interrupt("i1", "a", positional=positional)]
    if form == "sdk":
        pending = [{"id": "i1", "value": pending[0].value}]
    with pytest.raises(ResumeError, match="decisions by item id only") as caught:
        resume_command(pending, [{"type": "approve"}])
    assert caught.value.expected == ("a",)
    assert resume_command(pending, {"a": {"type": "approve"}}).resume == {"i1": {"decisions": {"a": {"type": "approve"}}}}


def test_interrupts_whose_item_ids_repeat_are_answered_one_at_a_time() -> None:
    """Two interrupts may hold an item of the same id: a map cannot tell them apart (refused with a message saying
    so), a list is refused across interrupts, one interrupt at a time answers each; two items of one id in one
    interrupt cannot be answered apart; a map with a key that is not a string is refused, not a TypeError."""
    pending = [_interrupt("i1", "a"), _interrupt("i2", "a")]
    with pytest.raises(ResumeError, match=r"an item id repeats in the pending interrupts.*answer one interrupt at a"):
        resume_command(pending, {"a": {"type": "approve"}})
    with pytest.raises(ResumeError, match="a list of decisions answers one guard interrupt"):
        resume_command(pending, [{"type": "approve"}, {"type": "reject"}])
    first = resume_command(pending[:1], {"a": {"type": "approve"}})
    second = resume_command(pending[1:], [{"type": "reject"}])
    assert first.resume == {"i1": {"decisions": {"a": {"type": "approve"}}}}
    assert second.resume == {"i2": {"decisions": {"a": {"type": "reject"}}}}
    with pytest.raises(ResumeError, match="interrupt i1 holds two items of the same id"):  # one answer would be lost
        resume_command([_interrupt("i1", "a", "a")], [{"type": "reject"}, {"type": "approve"}])
    with pytest.raises(ResumeError, match="not pending: 1"):
        resume_command([_interrupt("i1", "a")], {"a": {"type": "approve"}, 1: {"type": "approve"}})  # type: ignore[dict-item]


def _tool_item(item_id: str, tools: list[str] | None) -> dict:
    item = {**_item(item_id), "event": "tool_call", "tool": "pay"}
    return item if tools is None else {**item, "tools": tools}


@pytest.mark.parametrize(
    "decision",
    [
        {"type": "edit", "tool": "wire_all", "arguments": {"amount": 1}},
        {"type": "edit", "edited_action": {"name": "wire_all", "args": {"amount": 1}}},
    ],
)
def test_an_edit_naming_a_tool_the_agent_does_not_have_is_refused(decision: dict) -> None:
    """Refused like any malformed resume (the graph saves nothing, the item stays pending), not used up as a rejection."""
    items = [_tool_item("a", ["pay", "refund"])]
    fragment = "names tool 'wire_all', which this agent does not have; its tools: pay, refund"
    with pytest.raises(ValidationError, match="the edit for a " + fragment):
        _validate(items, {"decisions": {"a": decision}})
    with pytest.raises(ResumeError, match=re.escape("the edit for decisions[0] (a) ") + fragment) as caught:
        resume_command([Interrupt(value={"type": "guard_review", "items": items, "positional": True}, id="i1")],
                       [decision])
    assert caught.value.expected == ("a",)


def test_an_edit_naming_one_of_the_agents_tools_or_tools_unknown_passes() -> None:
    edit = {"type": "edit", "tool": "refund", "arguments": {"amount": 1}}
    assert _validate([_tool_item("a", ["pay", "refund"])], {"decisions": {"a": edit}})["decisions"]["a"] == edit
    unknown = {"type": "edit", "tool": "wire_all", "arguments": {"amount": 1}}
    assert _validate([_tool_item("a", None)], {"decisions": {"a": unknown}})["decisions"]["a"] == unknown
