"""The guarded ToolNode and per-call Send routing on hand-built LangGraph graphs with a checkpointer."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command

from guard.agents import GuardToolWrapper, guarded_tool_node, resume_command, send_tool_calls
from guard.errors import ResumeError
from tests.agents._drive import adrive, drive
from tests.agents._fakes import Turn, model

USER = {"messages": [("user", "Please settle my invoices.")]}


def build(
    h: Any, *turns: Turn, routing: Any = send_tool_calls, extra_nodes: dict[str, Any] | None = None, **options: Any
) -> Any:
    chat = model(*turns)

    def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [chat.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", guarded_tool_node(h.tools, guard=h.guard, **options))
    for name, node in (extra_nodes or {}).items():
        graph.add_node(name, node)
        graph.add_edge(name, END)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", routing, ["tools", END])
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=InMemorySaver())


MIXED = Turn(
    calls=[
        ("pay", {"amount": 5, "to": "bob"}, "a"),
        ("pay", {"amount": 500, "to": "eve"}, "b"),
        ("read_file", {"path": "notes.txt"}, "c"),
    ]
)


def test_resuming_one_call_never_reruns_finished_siblings(harness: Any, thread: Any) -> None:
    h = harness()
    graph, config = build(h, MIXED), thread()
    out = drive(graph, USER, config, "invoke")
    assert sorted(c[0] for c in h.runs.calls) == ["pay", "read_file"]  # the allowed siblings ran at once
    (item,) = out.items()
    assert item["tool_call_id"] == "b" and item["arguments"] == {"amount": 500, "to": "eve"}
    out = drive(graph, Command(resume={"decisions": {item["id"]: {"type": "approve"}}}), config, "invoke")
    assert sorted((c[0], c[1].get("to")) for c in h.runs.calls) == [("pay", "bob"), ("pay", "eve"), ("read_file", None)]
    assert sorted(out.tool_messages()) == ["a", "b", "c"] and out.last_ai().text == "done"


def test_under_tools_condition_a_call_needing_review_among_others_is_blocked_not_escalated(
    harness: Any, thread: Any
) -> None:
    """With plain ``tools_condition`` the calls of one message share one tool-node task. Their interrupts resume in
    no stable order (LangGraph hands an answer to whichever call asks first: LangChain's list of decisions released,
    in about one run in four, the call no reviewer had seen) and every resume ran the finished siblings again. So
    there a call that needs review is blocked with a message naming the fix, the others run once, and the turn ends
    without an interrupt; the Send routing (``send_tool_calls``) escalates it."""
    h = harness()
    graph, config = build(h, MIXED, routing=tools_condition), thread()
    out = drive(graph, USER, config, "invoke")
    assert not out.interrupts
    assert sorted(c[0] for c in h.runs.calls) == ["pay", "read_file"]  # each allowed sibling once
    assert ("pay", {"amount": 500, "to": "eve"}) not in h.runs.calls
    assert "send_tool_calls" in out.tool_messages()["b"].text and out.tool_messages()["b"].status == "error"
    single = harness()  # one call in the task: nothing to confuse it with, so it is escalated as usual
    graph, config = build(single, Turn(calls=[("pay", {"amount": 500, "to": "eve"}, "b")]), routing=tools_condition), \
        thread()
    out = drive(graph, USER, config, "invoke")
    (item,) = out.items()
    drive(graph, Command(resume={"decisions": [{"type": "approve"}]}), config, "invoke")
    assert single.runs.calls == [("pay", {"amount": 500, "to": "eve"})] and item["tool_call_id"] == "b"


@pytest.mark.anyio
async def test_parallel_per_call_escalations_async(harness: Any, thread: Any) -> None:
    h = harness()
    turn = Turn(
        calls=[
            ("pay", {"amount": 500, "to": "eve"}, "a"),
            ("pay", {"amount": 600, "to": "sam"}, "b"),
            ("pay", {"amount": 700, "to": "kim"}, "c"),
        ]
    )
    graph, config = build(h, turn), thread()
    out = await adrive(graph, USER, config, "ainvoke")
    assert len(out.interrupts) == 3 and len({i.id for i in out.interrupts}) == 3  # one interrupt per call
    items = {item["tool_call_id"]: item["id"] for item in out.items()}
    with pytest.raises(ResumeError):
        resume_command(out.interrupts, {items["a"]: {"type": "approve"}, items["b"]: {"type": "approve"}})
    decisions = {
        items["a"]: {"type": "approve"},
        items["b"]: {"type": "reject", "message": "no"},
        items["c"]: {"type": "edit", "arguments": {"amount": 10, "to": "kim"}},
    }
    out = await adrive(graph, resume_command(out.interrupts, decisions), config, "ainvoke")
    assert sorted(c[1]["amount"] for c in h.runs.calls) == [10, 500]
    assert out.tool_messages()["b"].status == "error" and not out.interrupts


def test_a_decision_sent_to_the_wrong_call_is_refused(harness: Any, thread: Any) -> None:
    h = harness()
    turn = Turn(calls=[("pay", {"amount": 500, "to": "eve"}, "a"), ("pay", {"amount": 600, "to": "sam"}, "b")])
    graph, config = build(h, turn), thread()
    out = drive(graph, USER, config, "invoke")
    by_call = {i.value["items"][0]["tool_call_id"]: i for i in out.interrupts}
    swapped = {
        by_call["a"].id: {"decisions": {by_call["b"].value["items"][0]["id"]: {"type": "approve"}}},
        by_call["b"].id: {"decisions": {by_call["a"].value["items"][0]["id"]: {"type": "approve"}}},
    }
    with pytest.raises(Exception, match="no decision for"):
        graph.invoke(Command(resume=swapped), config)
    assert h.runs.count() == 0
    assert len(graph.get_state(config).interrupts) == 2  # still answerable


def test_malformed_calls_are_answered_and_logged(harness: Any, thread: Any) -> None:
    h = harness()
    turn = AIMessage(
        content="",
        tool_calls=[{"name": "pay", "args": {"amount": 5, "to": "bob"}, "id": "ok", "type": "tool_call"}],
        invalid_tool_calls=[
            {"name": "pay", "args": "null", "id": "bad", "error": None, "type": "invalid_tool_call"},
            {"name": "pay", "args": '{"amount": 5', "id": "cut", "error": None, "type": "invalid_tool_call"},
        ],
    )
    out = drive(build(h, turn), USER, thread(), "invoke")
    assert h.runs.calls == [("pay", {"amount": 5, "to": "bob"})]
    messages = out.tool_messages()
    assert "arguments are null" in messages["bad"].text and "arguments are truncated" in messages["cut"].text
    assert len([d for d in h.decisions() if d["result"]["rule"] == "malformed_arguments"]) == 2


def test_handoff_to_a_graph_node(harness: Any, thread: Any) -> None:
    h = harness()
    reached: list[str] = []

    def second_opinion(state: MessagesState) -> dict[str, Any]:
        reached.append(state["messages"][-1].tool_call_id)
        return {}

    turn = Turn(calls=[("pay", {"amount": 50, "to": "reviewer"}, "a")])
    graph = build(h, turn, extra_nodes={"second_opinion": second_opinion}, handoff_nodes=["second_opinion"])
    out = drive(graph, USER, thread(), "invoke")
    assert h.runs.count() == 0 and reached == ["a"]
    assert "was handed to `second_opinion` for review" in out.tool_messages()["a"].text


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_read_only_tools_may_start_early_side_effecting_ones_never(harness: Any, thread: Any, mode: str) -> None:
    h = harness(delay=0.2)
    turn = Turn(
        calls=[
            ("read_file", {"path": "secret.txt"}, "r"),
            ("delete_all_records", {}, "d"),
            ("read_file", {"path": "notes.txt"}, "n"),
        ]
    )
    graph, config = build(h, turn, side_effecting_tools=["pay", "refund", "delete_all_records", "fetch"]), thread()
    out = drive(graph, USER, config, mode) if mode == "invoke" else await adrive(graph, USER, config, mode)
    assert h.runs.count("delete_all_records") == 0
    # both reads started while the guard decided (read-only); each ran once, the blocked one's output was dropped
    assert sorted(c[1]["path"] for c in h.runs.calls) == ["notes.txt", "secret.txt"]
    messages = out.tool_messages()
    assert "contents of" not in messages["r"].text and messages["r"].status == "error"
    assert messages["n"].text == "contents of notes.txt"


def test_send_tool_calls_routes_only_unanswered_calls() -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    ai = AIMessage(content="", tool_calls=[{"name": "pay", "args": {}, "id": i, "type": "tool_call"} for i in "ab"])
    state = {"messages": [HumanMessage("x"), ai, ToolMessage("done", tool_call_id="a")]}
    sends = send_tool_calls(state, node="guarded")
    assert isinstance(sends, list) and [(s.node, s.arg[0]["id"]) for s in sends] == [("guarded", "b")]
    state["messages"].append(ToolMessage("done", tool_call_id="b"))
    assert send_tool_calls(state) == END
    assert send_tool_calls({"messages": [HumanMessage("x")]}) == END
    custom = functools.partial(send_tool_calls, node="t", messages_key="history")
    assert [s.node for s in custom({"history": [ai]})] == ["t", "t"]


def test_wrapper_validates_and_repr(harness: Any) -> None:
    h = harness()
    assert "GuardToolWrapper(policies=4)" == repr(GuardToolWrapper(guard=h.guard))
    with pytest.raises(ValueError, match="both a reviewer and a handoff node"):
        from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel

        GuardToolWrapper(guard=h.guard, reviewers={"x": FakeMessagesListChatModel(responses=[])}, handoff_nodes=["x"])


@pytest.mark.parametrize(
    ("turn", "problem"),
    [
        (Turn(calls=[("wire", "", "x")]), "arguments are empty, but tool `wire` requires iban"),
        (Turn(calls=[("wire", "{}", "x")]), "arguments are empty, but tool `wire` requires iban"),
        (Turn(calls=[("list_records", "", "x")], finish_reason="length"), "the output was cut off"),
    ],
)
def test_the_tool_node_refuses_empty_arguments_that_cannot_mean_no_arguments(
    harness: Any, thread: Any, turn: Turn, problem: str
) -> None:
    h = harness()
    out = drive(build(h, turn), USER, thread(), "invoke")
    assert h.runs.count() == 0
    message = out.tool_messages()["x"]
    assert message.status == "error" and problem in message.text


def test_the_tool_node_runs_empty_arguments_of_a_tool_that_requires_nothing(harness: Any, thread: Any) -> None:
    h = harness()
    drive(build(h, Turn(calls=[("list_records", "", "x")])), USER, thread(), "invoke")
    assert h.runs.calls == [("list_records", {"limit": 10})]
