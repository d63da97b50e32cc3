"""Tool arguments that arrive already parsed: a depth and a size limit, so a call nested ~5,000
levels deep (or holding too many values) gets a recorded block decision and an error tool message, never an exception
out of ``agent.invoke`` with no decision recorded. Real create_agent graphs with a checkpointer, and a tool node."""

from __future__ import annotations

import time
from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver

from guard.agents import GuardAgentMiddleware, guarded_tool_node
from guard.agents._arguments import MAX_ARGUMENT_DEPTH, MAX_ARGUMENT_VALUES, SURROGATE_KEY, classify_arguments
from tests.agents._drive import SYNC_MODES, adrive, drive
from tests.agents._fakes import Turn, model, tool_node_graph

USER = {"messages": [("user", "Please pay bob.")]}


def nested(levels: int) -> dict[str, Any]:
    """``{"amount": 5, "to": "bob", "x": {"x": {...}}}``: ``levels`` objects deep."""
    root: dict[str, Any] = {"amount": 5, "to": "bob"}
    node = root
    for _ in range(levels - 1):
        node["x"] = {}
        node = node["x"]
    return root


def deep_turn(arguments: dict[str, Any]) -> AIMessage:
    return AIMessage(
        content="",
        tool_calls=[
            {"name": "pay", "args": arguments, "id": "deep"},
            {"name": "pay", "args": {"amount": 5, "to": "ann"}, "id": "fine"},
        ],
    )


def test_limits_on_parsed_arguments() -> None:
    assert classify_arguments(nested(MAX_ARGUMENT_DEPTH))[1] is None
    assert classify_arguments(nested(MAX_ARGUMENT_DEPTH + 1)) == (
        None,
        f"arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels",
    )
    assert classify_arguments({"a": [[[]]] * 10})[1] is None
    wide = {"items": list(range(MAX_ARGUMENT_VALUES))}
    assert classify_arguments(wide) == (None, f"arguments hold more than {MAX_ARGUMENT_VALUES} values")
    too_big = "arguments hold an integer outside the 64-bit range a checkpoint can store"
    assert classify_arguments({"amount": 10**30, "to": "bob"}) == (None, too_big)
    assert classify_arguments({"deep": {"list": [1, -(2**63) - 1]}}) == (None, too_big)
    assert classify_arguments({"amount": 2**64 - 1, "low": -(2**63), "flag": True})[1] is None
    # parsed arguments meet what raw JSON text meets: no NaN or infinity, no value JSON cannot carry, string keys
    not_finite = "arguments hold a number that is not finite (NaN or Infinity)"
    for number in (float("nan"), float("inf"), -float("inf")):
        assert classify_arguments({"x": number}) == (None, not_finite)
        assert classify_arguments({"x": [{"y": number}]}) == (None, not_finite)
    for value, kind in ((b"\xff", "bytes"), ({1, 2}, "set"), (Decimal("1.5"), "Decimal"), (object(), "object"),
                        (datetime(2020, 1, 1), "datetime")):
        assert classify_arguments({"x": {"y": [value]}}) == (None, f"arguments hold a {kind} value, which JSON cannot carry")
    for keyed in ({1: "a"}, {"x": {None: 1}}, {"x": [{(1, 2): 1}]}, {"x": {True: 1}}):
        assert classify_arguments(keyed) == (None, "arguments hold a mapping key that is not a string")
    assert classify_arguments({"x": 1.5, "y": [None, True, "s", -0.0, (1, 2)]})[1] is None
    looped: dict[str, Any] = {}
    looped["self"] = looped
    assert classify_arguments(looped)[1] is not None  # a value holding itself ends at a limit, never loops
    started = time.perf_counter()
    assert classify_arguments(nested(5000))[1] is not None
    assert time.perf_counter() - started < 0.5


def _check(h: Any, out: Any) -> None:
    assert h.runs.calls == [("pay", {"amount": 5, "to": "ann"})]  # the sibling is judged on its own
    answer = out.tool_messages()["deep"]
    assert answer.status == "error" and f"arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels" in answer.text
    blocked = [d for d in h.decisions() if (d.get("input") or {}).get("tool_call_id") == "deep"]
    assert [d["result"]["action"] for d in blocked] == ["block"]
    assert "deeper than" in (blocked[0]["error"] or blocked[0]["result"]["message"] or "")
    stored = next(m for m in out.messages if isinstance(m, AIMessage) and m.invalid_tool_calls)
    assert stored.invalid_tool_calls[0]["id"] == "deep" and len(stored.invalid_tool_calls[0]["args"]) < 200


# The parsed-arguments turns below are whole AIMessages, which the test model can only return, not stream (a provider
# streams argument text, checked by the raw-text test after them).


def test_deep_arguments_get_a_recorded_block(harness: Any, thread: Any) -> None:
    h = harness()
    middleware = GuardAgentMiddleware(guard=h.guard)
    agent = create_agent(model(deep_turn(nested(5000))), h.tools, middleware=[middleware], checkpointer=InMemorySaver())
    _check(h, drive(agent, USER, thread(), "invoke"))


@pytest.mark.anyio
async def test_deep_arguments_get_a_recorded_block_async(harness: Any, thread: Any) -> None:
    h = harness()
    middleware = GuardAgentMiddleware(guard=h.guard)
    agent = create_agent(model(deep_turn(nested(5000))), h.tools, middleware=[middleware], checkpointer=InMemorySaver())
    _check(h, await adrive(agent, USER, thread(), "ainvoke"))


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_deep_argument_text_gets_a_recorded_block(harness: Any, thread: Any, mode: str) -> None:
    h = harness()
    raw = '{"amount": 5, "to": "bob", "x": ' + '{"x": ' * 5000 + "{}" + "}" * 5000 + "}"
    turn = Turn(calls=[("pay", raw, "deep"), ("pay", {"amount": 5, "to": "ann"}, "fine")])
    agent = create_agent(
        model(turn), h.tools, middleware=[GuardAgentMiddleware(guard=h.guard)], checkpointer=InMemorySaver()
    )
    out = drive(agent, USER, thread(), mode)
    assert h.runs.calls == [("pay", {"amount": 5, "to": "ann"})]
    assert "nesting exceeds the limit of 64 levels" in out.tool_messages()["deep"].text
    blocked = [d for d in h.decisions() if (d.get("input") or {}).get("tool_call_id") == "deep"]
    assert [d["result"]["action"] for d in blocked] == ["block"]


def test_tool_node_blocks_deep_arguments(harness: Any) -> None:
    h = harness()
    chat = model(deep_turn(nested(5000)))
    graph = tool_node_graph(chat, guarded_tool_node(h.tools, guard=h.guard))
    result = graph.compile().invoke(USER)  # no checkpointer: the state holds the deep arguments as the model sent them
    answer = next(m for m in result["messages"] if getattr(m, "tool_call_id", None) == "deep")
    assert answer.status == "error" and "deeper than" in answer.text
    assert h.runs.calls == [("pay", {"amount": 5, "to": "ann"})]
    assert [d["result"]["action"] for d in h.decisions() if (d.get("input") or {}).get("tool_call_id") == "deep"] == [
        "block"
    ]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), b"\xff\xfe hi", {1, 2}, Decimal("1.5"), {1: "a"}],
                         ids=["nan", "inf", "bytes", "set", "decimal", "int-key"])
def test_parsed_arguments_json_cannot_carry_get_a_recorded_block(harness: Any, thread: Any, value: Any) -> None:
    """A value a provider's JSON could not have sent (a custom integration or another middleware wrote it) is
    refused as malformed, never run and never handed to the engine, where building the state would fail."""
    h = harness()
    middleware = GuardAgentMiddleware(guard=h.guard)
    agent = create_agent(model(deep_turn({"amount": 5, "to": value})), h.tools, middleware=[middleware],
                         checkpointer=InMemorySaver())
    out = drive(agent, USER, thread(), "invoke")
    assert h.runs.calls == [("pay", {"amount": 5, "to": "ann"})]
    assert out.tool_messages()["deep"].status == "error"
    blocked = [d for d in h.decisions() if (d.get("input") or {}).get("tool_call_id") == "deep"]
    assert [(d["result"]["action"], d["result"]["rule"]) for d in blocked] == [("block", "malformed_arguments")]


SURROGATE_KEYS = [{"\ud800": "x"}, {"k": {"\udc80": 1}}, {"k": [{"a\udfffb": 1}]}, {"\ud83d\ude00": 1}]


def test_parsed_arguments_with_a_surrogate_in_a_key_are_malformed() -> None:
    """A checkpointer's serializer (msgpack) refuses a mapping key holding a UTF-16 surrogate (a value holding one is
    stored as ``?``): such arguments are malformed, at any level."""
    for keyed in SURROGATE_KEYS:
        assert classify_arguments({"amount": 5, **keyed}) == (None, SURROGATE_KEY)
    assert classify_arguments({"k": "\ud800", "emoji \U0001f600": ["\udc80"]})[1] is None


def _surrogate_agent(h: Any, keyed: dict[str, Any]) -> Any:
    return create_agent(model(deep_turn({"amount": 5, "to": "bob", **keyed})), h.tools,
                        middleware=[GuardAgentMiddleware(guard=h.guard)], checkpointer=InMemorySaver())


def _check_surrogate(h: Any, out: Any) -> None:
    assert h.runs.calls == [("pay", {"amount": 5, "to": "ann"})]
    assert "surrogate" in out.tool_messages()["deep"].text
    blocked = [d for d in h.decisions() if (d.get("input") or {}).get("tool_call_id") == "deep"]
    assert [(d["result"]["action"], d["result"]["rule"]) for d in blocked] == [("block", "malformed_arguments")]
    stored = next(m for m in out.messages if isinstance(m, AIMessage) and m.invalid_tool_calls)
    assert stored.invalid_tool_calls[0]["id"] == "deep"
    assert stored.invalid_tool_calls[0]["args"].startswith("<withheld by guard: ")


@pytest.mark.parametrize("keyed", SURROGATE_KEYS, ids=["top", "nested", "in-list", "pair"])
@pytest.mark.parametrize("mode", SYNC_MODES)
def test_a_surrogate_key_gets_a_recorded_block(harness: Any, thread: Any, keyed: Any, mode: str) -> None:
    """Parsed arguments with such a key are moved to ``invalid_tool_calls`` before the model node's output is
    checkpointed: a recorded block and an error tool message, never ``TypeError`` out of ``agent.invoke``."""
    h = harness()
    _check_surrogate(h, drive(_surrogate_agent(h, keyed), USER, thread(), mode))


@pytest.mark.anyio
@pytest.mark.parametrize("keyed", SURROGATE_KEYS[:2], ids=["top", "nested"])
async def test_a_surrogate_key_gets_a_recorded_block_async(harness: Any, thread: Any, keyed: Any) -> None:
    h = harness()
    _check_surrogate(h, await adrive(_surrogate_agent(h, keyed), USER, thread(), "ainvoke"))


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_a_surrogate_key_in_argument_text_gets_a_recorded_block(harness: Any, thread: Any, mode: str) -> None:
    """The raw text ``{"\\ud800": ...}`` (a provider streams the escape): its parsed form holds the key too."""
    h = harness()
    turn = Turn(calls=[("pay", '{"amount": 5, "to": "bob", "\\ud800": "x"}', "deep"),
                       ("pay", {"amount": 5, "to": "ann"}, "fine")])
    agent = create_agent(model(turn), h.tools, middleware=[GuardAgentMiddleware(guard=h.guard)],
                         checkpointer=InMemorySaver())
    out = drive(agent, USER, thread(), mode)
    assert h.runs.calls == [("pay", {"amount": 5, "to": "ann"})]
    assert out.tool_messages()["deep"].status == "error"
    blocked = [d for d in h.decisions() if (d.get("input") or {}).get("tool_call_id") == "deep"]
    assert [d["result"]["action"] for d in blocked] == ["block"]
