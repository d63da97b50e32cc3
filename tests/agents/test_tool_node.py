"""The guarded ToolNode and per-call Send routing on hand-built LangGraph graphs with a checkpointer."""

from __future__ import annotations

import functools
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.messages.tool import invalid_tool_call
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command, Send

from guard.agents import GuardToolWrapper, guarded_tool_node, resume_command, send_tool_calls
from guard.errors import ResumeError
from tests.agents._drive import SYNC_MODES, Outcome, adrive, drive
from tests.agents._fakes import INJECTION, Turn, model

USER = {"messages": [("user", "Please settle my invoices.")]}
MODES = ("invoke", "ainvoke", "stream")
"""The drive modes the tests of one behaviour run in (``astream`` takes ``ainvoke``'s path through the tool node)."""


async def run(graph: Any, value: Any, config: dict[str, Any], mode: str) -> Outcome:
    """Run ``graph`` in ``mode`` (:data:`MODES`), synchronously or not as the mode says."""
    return drive(graph, value, config, mode) if mode in SYNC_MODES else await adrive(graph, value, config, mode)


def build(
    h: Any,
    *turns: Turn | AIMessage,
    routing: Any = send_tool_calls,
    extra_nodes: dict[str, Any] | None = None,
    tools: list[Any] | None = None,
    messages_key: str = "messages",
    interrupt_before: list[str] | None = None,
    **options: Any,
) -> Any:
    """The model / guarded tool node loop; ``messages_key``: the state key of the conversation (``routing`` must
    read it too); ``interrupt_before``: nodes the graph stops before (LangGraph's static interrupts)."""
    chat = model(*turns)
    state_schema: Any = (
        MessagesState
        if messages_key == "messages"
        else TypedDict("State", {messages_key: Annotated[list[AnyMessage], add_messages]})  # type: ignore[misc]
    )

    def call_model(state: dict[str, Any]) -> dict[str, Any]:
        return {messages_key: [chat.invoke(state[messages_key])]}

    graph = StateGraph(state_schema)
    graph.add_node("model", call_model)
    node = guarded_tool_node(tools or h.tools, guard=h.guard, messages_key=messages_key, **options)
    graph.add_node("tools", node)
    for name, node in (extra_nodes or {}).items():
        graph.add_node(name, node)
        graph.add_edge(name, END)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", routing, ["tools", END])
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=InMemorySaver(), interrupt_before=interrupt_before)


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


def _send_calls(state: dict[str, Any]) -> list[Send] | str:
    """Routing that sends all calls of the model's turn in one ``Send``, as a list of calls."""
    calls = state["messages"][-1].tool_calls
    return [Send("tools", [{**call, "type": "tool_call"} for call in calls])] if calls else END


def _send_state(state: dict[str, Any]) -> list[Send] | str:
    """Routing that sends the whole state in one ``Send`` (the tool node runs every call of its last turn)."""
    return [Send("tools", state)] if state["messages"][-1].tool_calls else END


@pytest.mark.anyio
@pytest.mark.parametrize("routing", [_send_calls, _send_state])
@pytest.mark.parametrize("mode", MODES)
async def test_a_send_holding_several_calls_blocks_a_call_needing_review_among_them(
    harness: Any, thread: Any, routing: Any, mode: str
) -> None:
    """A ``Send`` that carries several calls (a list of them, or the whole state) runs them in one task, as
    ``tools_condition`` does: the call that needs review is blocked, not escalated. It was escalated (the task was
    started by ``Send``), and an answer by position went to whichever call asked first on resume, so approving the
    call the reviewer saw could run another one nobody saw."""
    h = harness()
    two = Turn(calls=[("pay", {"amount": 500, "to": "eve"}, "a"), ("pay", {"amount": 900, "to": "carol"}, "b")])
    graph, config = build(h, two, routing=routing), thread()
    out = await run(graph, USER, config, mode)
    assert not out.interrupts and h.runs.calls == []
    assert {k: (m.status, "send_tool_calls" in m.text) for k, m in out.tool_messages().items()} == {
        "a": ("error", True), "b": ("error", True)}


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


def _declared(tools: list[Any], **effects: dict[str, Any]) -> list[Any]:
    """``tools`` with the metadata ``effects`` names for some of them (tool name -> metadata)."""
    for t in tools:
        if t.name in effects:
            t.metadata = effects[t.name]
    return tools


READ_ONLY = {"guard_effect": "read_only"}


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
    tools = _declared(h.tools, read_file=READ_ONLY)
    options = {"side_effecting_tools": ["pay", "refund", "delete_all_records", "fetch"], "tools": tools}
    graph, config = build(h, turn, **options), thread()
    out = drive(graph, USER, config, mode) if mode == "invoke" else await adrive(graph, USER, config, mode)
    assert h.runs.count("delete_all_records") == 0
    # both reads started while the guard decided (declared read-only); each ran once, the blocked one's output dropped
    assert sorted(c[1]["path"] for c in h.runs.calls) == ["notes.txt", "secret.txt"]
    messages = out.tool_messages()
    assert "contents of" not in messages["r"].text and messages["r"].status == "error"
    # the notice says the blocked read ran, and that its output was withheld
    assert "not executed" not in messages["r"].text and "so it ran; its output was withheld" in messages["r"].text
    assert messages["r"].additional_kwargs["lc_data"]["ran_early"] is True
    assert messages["n"].text == "contents of notes.txt"


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
@pytest.mark.parametrize(
    "metadata",
    [{"guard_effect": "side_effecting"}, {"destructiveHint": True}, {"readOnlyHint": False}, {"readOnlyHint": True}, None],
)
async def test_a_tool_not_known_read_only_never_starts_before_its_verdict(
    harness: Any, thread: Any, mode: str, metadata: dict[str, Any] | None
) -> None:
    """``side_effecting_tools`` lists some tools; a tool it leaves out whose metadata says it acts (or says nothing,
    or only an MCP server's ``readOnlyHint`` says it reads: the server sets that) still waits for its verdict:
    blocked, it never ran, as the notice says."""
    h = harness()
    tools = _declared(h.tools, delete_all_records=metadata) if metadata is not None else h.tools
    turn = Turn(calls=[("delete_all_records", {}, "d")])
    graph, config = build(h, turn, tools=tools, side_effecting_tools=["pay"]), thread()
    out = drive(graph, USER, config, mode) if mode == "invoke" else await adrive(graph, USER, config, mode)
    assert h.runs.count("delete_all_records") == 0
    message = out.tool_messages()["d"]
    assert "was not executed" in message.text and "ran_early" not in message.additional_kwargs["lc_data"]


def test_a_policy_declaring_a_tool_read_only_lets_it_start_early(harness: Any, thread: Any) -> None:
    """The policy's ``tools`` says read-only (the tool's metadata says nothing, or only an MCP hint): it starts while
    the guard decides, and blocked, its notice says it ran."""
    import dataclasses

    from guard.engine import Guard
    from guard.policy import load_files
    from guard.policy.provenance import ToolSpec
    from tests.agents.conftest import POLICIES

    h = harness(delay=0.02)
    h.guard.close()
    policies = [
        dataclasses.replace(p, tools={**p.tools, "delete_all_records": ToolSpec(effect="read_only")})
        if p.id == "agent-tools" else p
        for p in load_files(POLICIES)
    ]
    h.guard = Guard(policies, backends=h.backend)
    tools = _declared(h.tools, delete_all_records={"readOnlyHint": True})
    graph, config = build(h, Turn(calls=[("delete_all_records", {}, "d")]), tools=tools, side_effecting_tools=["pay"]), thread()
    out = drive(graph, USER, config, "invoke")
    message = out.tool_messages()["d"]
    assert h.runs.count() == 1 and "so it ran" in message.text and message.additional_kwargs["lc_data"]["ran_early"]


def test_a_policy_declaring_a_tool_side_effecting_keeps_it_from_starting_early(harness: Any, thread: Any) -> None:
    """The tool's metadata says read-only, the policy's ``tools`` says side-effecting: the policy wins."""
    import dataclasses

    from guard.engine import Guard
    from guard.policy import load_files
    from guard.policy.provenance import ToolSpec
    from tests.agents.conftest import POLICIES

    h = harness()
    h.guard.close()
    policies = [
        dataclasses.replace(p, tools={"delete_all_records": ToolSpec(effect="side_effecting")})
        if p.id == "agent-tools" else p
        for p in load_files(POLICIES)
    ]
    h.guard = Guard(policies, backends=h.backend)
    tools = _declared(h.tools, delete_all_records=READ_ONLY)
    graph, config = build(h, Turn(calls=[("delete_all_records", {}, "d")]), tools=tools, side_effecting_tools=["pay"]), thread()
    out = drive(graph, USER, config, "invoke")
    assert h.runs.count() == 0 and "was not executed" in out.tool_messages()["d"].text


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
@pytest.mark.parametrize("decision", [{"type": "approve"}, {"type": "reject", "message": "no"}])
async def test_an_escalated_call_of_an_undeclared_tool_runs_only_once_approved(
    harness: Any, thread: Any, mode: str, decision: dict[str, Any]
) -> None:
    """``side_effecting_tools=["refund"]``: ``pay`` (no declared effect) waits for its verdict, and its resume starts
    nothing early: an approval runs it once, a reject never."""
    h = harness()
    graph, config = build(h, Turn(calls=[("pay", {"amount": 500, "to": "bob"}, "c1")]), side_effecting_tools=["refund"]), thread()
    out = await run(graph, USER, config, mode)
    assert h.runs.count() == 0 and len(out.interrupts) == 1
    answers = {item["id"]: decision for item in out.items()}
    out = await run(graph, resume_command(out.interrupts, answers), config, mode)
    message = out.tool_messages()["c1"]
    if decision["type"] == "approve":
        assert h.runs.calls == [("pay", {"amount": 500, "to": "bob"})] and message.text == "paid 500 to bob"
    else:
        assert h.runs.count() == 0 and "it was not executed" in message.text


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
@pytest.mark.parametrize("decision", [{"type": "approve"}, {"type": "reject", "message": "no"}])
async def test_an_escalated_read_only_call_starts_early_once_and_never_on_its_resume(
    harness: Any, thread: Any, mode: str, decision: dict[str, Any]
) -> None:
    """A tool declared read-only starts while its call is judged; escalated, its output is dropped. The resume does
    not start it again: an approval runs it once more (its output is the answer), and a reject's notice says it may
    have run (the resumed run cannot tell whether the asking run started it), without ``lc_data["ran_early"]``."""
    h = harness(delay=0.05)
    tools = _declared(h.tools, pay=READ_ONLY)
    turn = Turn(calls=[("pay", {"amount": 500, "to": "bob"}, "c1")])
    graph, config = build(h, turn, tools=tools, side_effecting_tools=["refund"]), thread()
    out = await run(graph, USER, config, mode)
    assert h.runs.count() == 1 and len(out.interrupts) == 1 and not out.tool_messages()
    answers = {item["id"]: decision for item in out.items()}
    out = await run(graph, resume_command(out.interrupts, answers), config, mode)
    message = out.tool_messages()["c1"]
    if decision["type"] == "approve":
        assert h.runs.count() == 2 and message.text == "paid 500 to bob"
    else:
        assert h.runs.count() == 1
        assert "not executed" not in message.text and "so it ran" not in message.text
        assert "may have started before the verdict" in message.text
        assert "ran_early" not in message.additional_kwargs["lc_data"]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_a_read_only_call_edited_after_it_started_says_it_may_have_run(harness: Any, thread: Any, mode: str) -> None:
    """The escalated call started early; a reviewer's edit runs another call, and the edited call's notice says the
    original may have run (the resumed run cannot tell), without ``lc_data["ran_early"]``."""
    h = harness(delay=0.05)
    tools = _declared(h.tools, pay=READ_ONLY)
    graph, config = build(h, Turn(calls=[("pay", {"amount": 500, "to": "bob"}, "c1")]), tools=tools, side_effecting_tools=["refund"]), thread()
    out = await run(graph, USER, config, mode)
    assert h.runs.count() == 1 and len(out.interrupts) == 1
    answers = {item["id"]: {"type": "edit", "arguments": {"amount": 50, "to": "bob"}} for item in out.items()}
    out = await run(graph, resume_command(out.interrupts, answers), config, mode)
    message = out.tool_messages()["c1"]
    assert h.runs.calls[-1] == ("pay", {"amount": 50, "to": "bob"}) and "paid 50 to bob" in message.text
    assert "may have started before the verdict" in message.text and "so it ran" not in message.text
    assert "ran_early" not in message.additional_kwargs.get("lc_data", {})


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_a_read_only_call_whose_arguments_its_tool_refuses_never_claims_it_ran(
    harness: Any, thread: Any, mode: str
) -> None:
    """Arguments the tool's schema refuses (``amount="lots"``) never run, so the call does not start early, and
    blocked, its notice says it was not executed."""
    h = harness(delay=0.02)
    tools = _declared(h.tools, pay=READ_ONLY)
    turn = Turn(calls=[("pay", {"amount": "lots", "to": "mallory"}, "c1")])
    graph, config = build(h, turn, tools=tools, side_effecting_tools=["refund"]), thread()
    out = await run(graph, USER, config, mode)
    message = out.tool_messages()["c1"]
    assert h.runs.count() == 0 and "was not executed" in message.text and "so it ran" not in message.text
    assert "ran_early" not in message.additional_kwargs["lc_data"]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_answering_one_of_two_reviews_never_starts_the_other_read_only_call_again(
    harness: Any, thread: Any, mode: str
) -> None:
    """Both read-only calls start early and are escalated. Answering one resumes the run, whose first step runs the
    other call's task again to ask anew: it does not start again. Answered in turn, its notice says it may have run."""
    h = harness(delay=0.02)
    tools = _declared(h.tools, pay=READ_ONLY)
    turn = Turn(calls=[("pay", {"amount": 500, "to": "bob"}, "a"), ("pay", {"amount": 600, "to": "ann"}, "b")])
    graph, config = build(h, turn, tools=tools, side_effecting_tools=["refund"]), thread()
    out = await run(graph, USER, config, mode)
    assert h.runs.count() == 2 and len(out.interrupts) == 2
    first = out.interrupts[0]
    reject = {"type": "reject", "message": "no"}
    out = await run(graph, resume_command([first], {item["id"]: reject for item in first.value["items"]}), config, mode)
    assert h.runs.count() == 2 and len(out.interrupts) == 1
    out = await run(graph, resume_command(out.interrupts, {item["id"]: reject for item in out.items()}), config, mode)
    assert h.runs.count() == 2 and not out.interrupts
    for message in out.tool_messages().values():
        assert "may have started before the verdict" in message.text and "so it ran" not in message.text
        assert "ran_early" not in message.additional_kwargs["lc_data"]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_a_read_only_call_after_a_static_interrupt_never_claims_it_ran(harness: Any, thread: Any, mode: str) -> None:
    """A graph stopped before its tools node (``interrupt_before``) resumes with ``None``: the read-only call first
    runs on the resumed run's first step, so it waits for its verdict, and blocked, its notice says it did not run."""
    h = harness()
    tools = _declared(h.tools, pay=READ_ONLY)
    turn = Turn(calls=[("pay", {"amount": 5, "to": "mallory"}, "c1")])
    graph = build(h, turn, tools=tools, side_effecting_tools=["refund"], interrupt_before=["tools"])
    config = thread()
    await run(graph, USER, config, mode)
    assert h.runs.count() == 0
    out = await run(graph, None, config, mode)
    message = out.tool_messages()["c1"]
    assert h.runs.count() == 0 and "was not executed" in message.text
    assert "ran_early" not in message.additional_kwargs["lc_data"]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_a_read_only_call_reviewed_after_a_static_interrupt_never_claims_it_ran(
    harness: Any, thread: Any, mode: str
) -> None:
    """After ``interrupt_before``, the read-only call is asked about on the resumed run's first step (it does not start
    early there); rejected, it never ran, so its notice does not say it ran and its ``lc_data`` has no ``ran_early``."""
    h = harness()
    tools = _declared(h.tools, pay=READ_ONLY)
    turn = Turn(calls=[("pay", {"amount": 500, "to": "bob"}, "c1")])
    graph = build(h, turn, tools=tools, side_effecting_tools=["refund"], interrupt_before=["tools"])
    config = thread()
    await run(graph, USER, config, mode)
    out = await run(graph, None, config, mode)
    assert h.runs.count() == 0 and len(out.interrupts) == 1
    reject = {"type": "reject", "message": "no"}
    out = await run(graph, resume_command(out.interrupts, {item["id"]: reject for item in out.items()}), config, mode)
    message = out.tool_messages()["c1"]
    assert h.runs.count() == 0 and "so it ran" not in message.text
    assert "ran_early" not in message.additional_kwargs["lc_data"]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_a_later_step_of_a_resumed_subgraph_starts_a_read_only_call_early(harness: Any, thread: Any, mode: str) -> None:
    """The guarded loop runs as a subgraph node; a plain ``Command(resume=...)`` answers its review, and that value
    stays readable in the subgraph's later steps. A read-only call the model makes on a later step is not resumed:
    it starts early as any first call does, and blocked, its notice says it ran (it did)."""
    h = harness(delay=0.02)
    tools = _declared(h.tools, pay=READ_ONLY, read_file=READ_ONLY)
    chat = model(
        Turn(calls=[("pay", {"amount": 500, "to": "bob"}, "c1")]),
        Turn(calls=[("read_file", {"path": "secret.txt"}, "c2")]),
        AIMessage(content="done"),
    )
    inner = StateGraph(MessagesState)
    inner.add_node("model", lambda state: {"messages": [chat.invoke(state["messages"])]})
    inner.add_node("tools", guarded_tool_node(tools, guard=h.guard, side_effecting_tools=["refund"]))
    inner.add_edge(START, "model")
    inner.add_conditional_edges("model", send_tool_calls, ["tools", END])
    inner.add_edge("tools", "model")
    outer = StateGraph(MessagesState)
    outer.add_node("agent", inner.compile())
    outer.add_edge(START, "agent")
    outer.add_edge("agent", END)
    graph, config = outer.compile(checkpointer=InMemorySaver()), thread()
    await run(graph, USER, config, mode)
    out = await run(graph, Command(resume={"decisions": [{"type": "approve"}]}), config, mode)
    message = out.tool_messages()["c2"]
    assert ("read_file", {"path": "secret.txt"}) in h.runs.calls
    assert "so it ran" in message.text and message.additional_kwargs["lc_data"]["ran_early"] is True


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_a_read_only_call_its_tools_own_validator_refuses_never_starts_early(
    harness: Any, thread: Any, mode: str
) -> None:
    """The tool's ``args_schema`` has a validator that refuses an absolute path (its call schema, which LangChain builds
    without validators, accepts it): the call does not start early, and blocked, its notice says it was not executed.
    A call that only leaves out an argument the tool node injects still starts early."""
    from langchain_core.tools import StructuredTool
    from pydantic import BaseModel, field_validator

    class Args(BaseModel):
        path: str
        tool_call_id: Annotated[str, InjectedToolCallId]

        @field_validator("path")
        @classmethod
        def relative(cls, value: str) -> str:
            if value.startswith("/"):
                raise ValueError("absolute paths are not allowed")
            return value

    h = harness(delay=0.05)

    def read(path: str, tool_call_id: str) -> str:
        h.runs.add("read_file", path=path)
        return "contents"

    reader = StructuredTool(name="read_file", description="Read a file.", args_schema=Args, func=read,
                            metadata=READ_ONLY)
    for path, ran in (("/secret.txt", False), ("secret.txt", True)):
        turn = Turn(calls=[("read_file", {"path": path}, "c1")])
        graph, config = build(h, turn, tools=[reader], side_effecting_tools=["pay"]), thread()
        out = await run(graph, USER, config, mode)
        message = out.tool_messages()["c1"]
        assert "blocked by guard policy" in message.text
        assert ("read_file", {"path": path}) in h.runs.calls if ran else h.runs.count() == 0
        assert ("so it ran" in message.text) is ran and ("was not executed" in message.text) is not ran


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_a_tool_whose_validator_needs_an_injected_argument_still_runs(harness: Any, thread: Any, mode: str) -> None:
    """The tool's ``args_schema`` has a before-validator that reads the state the tool node injects: asked without
    it, the validator raised ``KeyError``, which escaped guard's check of the arguments and failed the run. It cannot
    be told, so the call waits for its verdict and then runs once."""
    from langchain_core.tools import StructuredTool
    from langgraph.prebuilt import InjectedState
    from pydantic import BaseModel, model_validator

    class Args(BaseModel):
        path: str
        state: Annotated[dict, InjectedState]

        @model_validator(mode="before")
        @classmethod
        def has_history(cls, data: Any) -> Any:
            data["state"]["messages"]
            return data

    h = harness()

    def read(path: str, state: dict) -> str:
        h.runs.add("read_file", path=path)
        return "contents"

    reader = StructuredTool(name="read_file", description="Read a file.", args_schema=Args, func=read,
                            metadata=READ_ONLY)
    turn = Turn(calls=[("read_file", {"path": "notes.txt"}, "c1")])
    out = await run(build(h, turn, tools=[reader], side_effecting_tools=["pay"]), USER, thread(), mode)
    message = out.tool_messages()["c1"]
    assert (message.status, message.text, h.runs.calls) == ("success", "contents", [("read_file", {"path": "notes.txt"})])


def test_a_read_only_call_blocked_where_no_scratchpad_is_readable_never_claims_it_ran(harness: Any) -> None:
    """Run inside a LangChain runnable that is not a graph task (no scratchpad to read), a read-only call does not start
    early (guard cannot tell whether it is resumed), and blocked, its notice says it was not executed."""
    from langchain_core.runnables import RunnableLambda
    from langgraph.prebuilt.tool_node import ToolCallRequest

    h = harness()
    (read_file,) = _declared([t for t in h.tools if t.name == "read_file"], read_file=READ_ONLY)
    enforcer = GuardToolWrapper(guard=h.guard, side_effecting_tools=["pay"]).enforcer
    call = {"name": "read_file", "args": {"path": "secret.txt"}, "id": "x", "type": "tool_call"}
    request = ToolCallRequest(tool_call=call, tool=read_file, state={}, runtime=None)  # type: ignore[arg-type, typeddict-item]
    message = RunnableLambda(lambda _: enforcer.run(request, lambda r: read_file.invoke(r.tool_call))).invoke(1)
    assert h.runs.count() == 0 and "was not executed" in message.text and "may have started" not in message.text
    assert "ran_early" not in message.additional_kwargs["lc_data"]


@pytest.mark.anyio
@pytest.mark.parametrize("early", [False, True])
async def test_the_guarded_node_streams_no_event_of_a_tool_whose_output_may_be_withheld(
    harness: Any, thread: Any, early: bool
) -> None:
    """``astream_events`` never carries the output a ``tool_result`` policy withholds, whether the tool waited for its
    verdict or started while the guard decided (declared read-only)."""
    from tests.agents._fakes import Runs, counting_tools
    from tests.agents.test_middleware_events import ToolOutputs

    h = harness()
    h.runs = Runs()
    tools = counting_tools(h.runs, fetch_result=f"{INJECTION} SECRETMARK")
    if early:
        _declared(tools, fetch=READ_ONLY)
    turn = Turn(calls=[("fetch", {"url": "http://x"}, "f")])
    graph, config = build(h, turn, tools=tools, side_effecting_tools=["pay"]), thread()
    events = [ev async for ev in graph.astream_events(USER, config, version="v2")]
    assert h.runs.count("fetch") == 1
    assert not [ev for ev in events if "SECRETMARK" in repr(ev.get("data"))]
    assert "rule injected" in (await graph.aget_state(config)).values["messages"][2].text
    # the blocking path: a handler that streams outputs gets nothing of the tool's run
    streaming = ToolOutputs(streams=True)
    build(h, turn, tools=tools, side_effecting_tools=["pay"]).invoke(USER, {**thread(), "callbacks": [streaming]})
    assert h.runs.count("fetch") == 2 and streaming.outputs == []


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
    assert send_tool_calls({}) == END  # no state at all: nothing to route


def test_send_tool_calls_refuses_a_state_without_its_messages_key() -> None:
    """A conversation under another key than ``messages_key`` is an error naming both, as with ``tools_condition``
    (it ended the run with the model's calls unanswered)."""
    ai = AIMessage(content="", tool_calls=[{"name": "pay", "args": {}, "id": "a", "type": "tool_call"}])
    with pytest.raises(ValueError, match=r"the graph state has no 'messages' \(its keys: 'chat'\)"):
        send_tool_calls({"chat": [ai]})


def test_wrapper_validates_and_repr(harness: Any) -> None:
    h = harness()
    assert "GuardToolWrapper(policies=4)" == repr(GuardToolWrapper(guard=h.guard))
    with pytest.raises(ValueError, match="both a reviewer and a handoff node"):
        from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel

        GuardToolWrapper(guard=h.guard, reviewers={"x": FakeMessagesListChatModel(responses=[])}, handoff_nodes=["x"])
    for wrong in (5, None):
        with pytest.raises(TypeError, match="messages_key must be a state key"):
            GuardToolWrapper(guard=h.guard, messages_key=wrong)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="messages_key must be a non-empty state key"):
        GuardToolWrapper(guard=h.guard, messages_key="")


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


CHAT = "chat"
"""A conversation key other than ``messages`` (``ToolNode(messages_key=...)``)."""


def chat_messages(graph: Any, config: dict[str, Any]) -> dict[str, ToolMessage]:
    """The tool messages of the thread's ``chat`` conversation, by call id."""
    return {m.tool_call_id: m for m in graph.get_state(config).values[CHAT] if isinstance(m, ToolMessage)}


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_another_messages_key_gives_the_judge_the_users_task_and_judges_a_commands_messages(
    harness: Any, thread: Any, mode: str
) -> None:
    """With ``messages_key="chat"`` guard reads the conversation where the tool node does: the user's task reaches
    the judge (it read ``state["messages"]`` only, so the task was empty), and a tool result returned in a
    ``Command`` update under ``chat`` is judged and withheld (it passed unjudged)."""
    h = harness()

    @tool
    def fetch_page(url: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        """Fetch a URL."""
        h.runs.add("fetch_page", url=url)
        return Command(update={CHAT: [ToolMessage(INJECTION, tool_call_id=tool_call_id, name="fetch_page")]})

    turn = Turn(calls=[("fetch_page", {"url": "https://example.org"}, "c1")])
    route = functools.partial(send_tool_calls, messages_key=CHAT)
    graph, config = build(h, turn, routing=route, tools=[fetch_page], messages_key=CHAT), thread()
    await run(graph, {CHAT: [("user", "Summarise https://example.org")]}, config, mode)
    assert h.runs.count("fetch_page") == 1
    judged = {d["input"]["event"]: d for d in h.decisions()}
    assert judged["tool_call"]["input"]["user_message"] == "Summarise https://example.org"
    assert judged["tool_result"]["result"]["rule"] == "injected"
    message = chat_messages(graph, config)["c1"]
    assert INJECTION not in message.text and "was withheld by guard" in message.text


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_another_messages_key_finds_the_model_turn_for_answers_sharing_and_handoffs(
    harness: Any, thread: Any, mode: str
) -> None:
    """Under ``messages_key="chat"`` the model's turn is found there: a call needing review among others in one
    ``tools_condition`` task is blocked (it was escalated in the shared task), and a handoff to a graph node writes
    its answer under ``chat`` (it wrote ``messages``, a key the state does not have)."""
    h = harness()
    turn = Turn(calls=[("pay", {"amount": 500, "to": "eve"}, "a"), ("pay", {"amount": 5, "to": "bob"}, "b")])
    route = functools.partial(tools_condition, messages_key=CHAT)
    graph, config = build(h, turn, routing=route, messages_key=CHAT), thread()
    await run(graph, {CHAT: [("user", "pay my invoices")]}, config, mode)
    assert not graph.get_state(config).interrupts
    messages = chat_messages(graph, config)
    assert "send_tool_calls" in messages["a"].text and h.runs.calls == [("pay", {"amount": 5, "to": "bob"})]

    reached: list[str] = []

    def second_opinion(state: dict[str, Any]) -> dict[str, Any]:
        reached.append(state[CHAT][-1].tool_call_id)
        return {}

    handoff = harness()
    turn = Turn(calls=[("pay", {"amount": 50, "to": "reviewer"}, "r")])
    graph = build(handoff, turn, routing=functools.partial(send_tool_calls, messages_key=CHAT), messages_key=CHAT,
                  extra_nodes={"second_opinion": second_opinion}, handoff_nodes=["second_opinion"])  # fmt: skip
    config = thread()
    await run(graph, {CHAT: [("user", "pay my invoices")]}, config, mode)
    assert reached == ["r"] and handoff.runs.count() == 0
    assert "was handed to `second_opinion` for review" in chat_messages(graph, config)["r"].text


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_a_wrapper_whose_messages_key_differs_from_its_tool_nodes_is_refused(
    harness: Any, thread: Any, mode: str
) -> None:
    """``ToolNode(messages_key="chat")`` with a ``GuardToolWrapper`` left at ``"messages"``: guard found no
    conversation and said nothing, so the judge saw no user task and a ``Command`` result under ``chat`` reached the
    model unjudged. The run now fails with an error naming the key before any tool starts."""
    h = harness()

    @tool
    def fetch_page(url: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        """Fetch a URL."""
        h.runs.add("fetch_page", url=url)
        return Command(update={CHAT: [ToolMessage(INJECTION, tool_call_id=tool_call_id, name="fetch_page")]})

    wrapper = GuardToolWrapper(guard=h.guard)
    chat = model(Turn(calls=[("fetch_page", {"url": "https://example.org"}, "c1")]))
    graph = StateGraph(TypedDict("State", {CHAT: Annotated[list[AnyMessage], add_messages]}))  # type: ignore[misc]
    graph.add_node("model", lambda state: {CHAT: [chat.invoke(state[CHAT])]})
    graph.add_node("tools", ToolNode([fetch_page], messages_key=CHAT, wrap_tool_call=wrapper.wrap_tool_call,
                                     awrap_tool_call=wrapper.awrap_tool_call))  # fmt: skip
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", functools.partial(send_tool_calls, messages_key=CHAT), ["tools", END])
    graph.add_edge("tools", "model")
    app = graph.compile(checkpointer=InMemorySaver())
    with pytest.raises(ValueError, match=r"the graph state has no 'messages' \(its keys: 'chat'\): pass the state key"):
        await run(app, {CHAT: [("user", "Summarise https://example.org")]}, thread(), mode)
    assert h.runs.count() == 0 and h.decisions() == []


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_tool_messages_a_command_puts_under_another_key_are_withheld(harness: Any, thread: Any, mode: str) -> None:
    """A tool's ``Command`` that puts tool messages under a key other than the conversation's: guard cannot tell
    which messages the model reads, so the result is withheld as unreadable (they passed unjudged)."""
    h = harness()

    @tool
    def fetch_page(url: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        """Fetch a URL."""
        h.runs.add("fetch_page", url=url)
        return Command(update={CHAT: [ToolMessage("fetched", tool_call_id=tool_call_id, name="fetch_page")],
                               "messages": [ToolMessage(INJECTION, tool_call_id=tool_call_id, name="fetch_page")]})

    turn = Turn(calls=[("fetch_page", {"url": "https://example.org"}, "c1")])
    route = functools.partial(send_tool_calls, messages_key=CHAT)
    graph, config = build(h, turn, routing=route, tools=[fetch_page], messages_key=CHAT), thread()
    await run(graph, {CHAT: [("user", "Summarise https://example.org")]}, config, mode)
    assert h.runs.count("fetch_page") == 1
    message = chat_messages(graph, config)["c1"]
    assert INJECTION not in message.text and "rule unreadable_result" in message.text
    assert "messages" not in graph.get_state(config).values


def test_a_tool_node_outside_a_graph_reads_no_conversation(harness: Any) -> None:
    """A ``ToolNode`` invoked with tool calls outside a graph reads the state as ``{}``: the call is judged without a
    conversation, not refused for lacking ``messages_key``."""
    from langgraph.prebuilt.tool_node import ToolCallRequest

    h = harness()
    (read_file,) = [t for t in h.tools if t.name == "read_file"]
    call = {"name": "read_file", "args": {"path": "notes.txt"}, "id": "x", "type": "tool_call"}
    enforcer = GuardToolWrapper(guard=h.guard, messages_key=CHAT).enforcer
    prepared = enforcer.prepare(ToolCallRequest(tool_call=call, tool=read_file, state={}, runtime=None))
    assert not isinstance(prepared, ToolMessage) and prepared.arguments == {"path": "notes.txt"}
    assert prepared.subject.user_message is None and prepared.turn_calls == 0


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("routing", [send_tool_calls, tools_condition])
async def test_two_calls_sharing_one_id_never_run(harness: Any, thread: Any, routing: Any, mode: str) -> None:
    """Neither call runs, whatever arguments each carries (the second, unlike the first, ran)."""
    h = harness()
    turn = AIMessage(content="", id="m1", tool_calls=[
        {"name": "pay", "args": {"amount": 5, "to": "bob"}, "id": "x", "type": "tool_call"},
        {"name": "pay", "args": {"amount": 60, "to": "carol"}, "id": "x", "type": "tool_call"},
    ])  # fmt: skip
    out = await run(build(h, turn, routing=routing), USER, thread(), mode)
    assert h.runs.count() == 0
    answers = [m for m in out.messages if isinstance(m, ToolMessage)]
    assert len(answers) == 2 and all("another tool call in the same turn has the id 'x'" in m.text for m in answers)
    assert [d["result"]["rule"] for d in h.decisions()] == ["malformed_arguments"] * 2


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])  # the fake model streams no invalid_tool_calls
async def test_calls_that_arrive_as_raw_text_are_answered_never_run(harness: Any, thread: Any, mode: str) -> None:
    """A call LangChain could not parse whose raw text still reads as a JSON object (or is empty, "no arguments"),
    which ``send_tool_calls`` forwards as text, and a call a routing sends with text arguments, are answered with an
    error and a recorded decision (they were judged, allowed and handed to the tool node, which raised)."""
    h = harness()
    turn = AIMessage(
        content="",
        id="m1",
        tool_calls=[{"name": "read_file", "args": {"path": "notes.txt"}, "id": "t", "type": "tool_call"}],
        invalid_tool_calls=[
            invalid_tool_call(name="fetch", args='{"url": "https://example.org"}', id="j", error="unparsed"),
            invalid_tool_call(name="list_records", args="", id="e", error="unparsed"),
        ],
    )

    def route_as_text(state: dict[str, Any]) -> list[Send] | str:
        """``send_tool_calls``, but the valid call goes with its arguments as text."""
        sends = send_tool_calls(state)
        if isinstance(sends, str):
            return sends
        return [Send(s.node, [{**s.arg[0], "args": '{"path": "notes.txt"}'}]) if s.arg[0]["id"] == "t" else s
                for s in sends]  # fmt: skip

    out = await run(build(h, turn, routing=route_as_text), USER, thread(), mode)
    assert h.runs.count() == 0
    messages = out.tool_messages()
    assert all(messages[i].status == "error" and "was not executed" in messages[i].text for i in "tje")
    assert "the model's tool call could not be parsed" in messages["j"].text
    assert "arguments arrived as raw text, not as a parsed object" in messages["t"].text
    assert sorted(d["input"]["tool_name"] for d in h.decisions() if d["result"]["rule"] == "malformed_arguments") == [
        "fetch", "list_records", "read_file"]  # fmt: skip


def test_a_list_of_decisions_is_refused_while_several_per_call_reviews_are_pending(harness: Any, thread: Any) -> None:
    """Per-call interrupts have no order the reviewer is sure to have seen (``invoke``'s ``__interrupt__`` lists them
    as their tasks raised them, ``get_state`` in task order), so ``resume_command`` refuses a list across them and
    nothing runs (a list bound by the other order released a rejected call); the map of item ids answers them."""
    h = harness()
    turn = Turn(calls=[("pay", {"amount": 500, "to": "eve"}, "a"), ("pay", {"amount": 600, "to": "dan"}, "b"),
                       ("pay", {"amount": 700, "to": "zed"}, "c")])  # fmt: skip
    graph, config = build(h, turn), thread()
    out = drive(graph, USER, config, "invoke")
    assert len(out.interrupts) == 3
    listed = [{"type": "approve"}, {"type": "reject"}, {"type": "reject"}]
    with pytest.raises(ResumeError, match=r"a list of decisions answers one guard interrupt, but 3 are pending"):
        resume_command(graph.get_state(config).interrupts, listed)
    assert h.runs.count() == 0 and len(graph.get_state(config).interrupts) == 3
    decisions = {i["id"]: {"type": "approve" if i["tool_call_id"] == "a" else "reject"} for i in out.items()}
    out = drive(graph, resume_command(graph.get_state(config).interrupts, decisions), config, "invoke")
    assert h.runs.calls == [("pay", {"amount": 500, "to": "eve"})] and not out.interrupts


STREAM_MODES = ["values", "updates", "messages", "custom", "debug", "tasks", "checkpoints"]


def _sub_agent_tools(text: str) -> list[Any]:
    """``research`` and ``aresearch``: tools that run a sub-agent (an inner graph whose model replies ``text`` and
    writes it to the custom stream), synchronously and not."""
    from langgraph.config import get_stream_writer

    def sub_model(state: MessagesState) -> dict[str, Any]:
        get_stream_writer()({"progress": text})
        return {"messages": [model(Turn(text=text)).invoke(state["messages"])]}

    inner = StateGraph(MessagesState)
    inner.add_node("sub_model", sub_model)
    inner.add_edge(START, "sub_model")
    inner.add_edge("sub_model", END)
    sub_agent = inner.compile()

    @tool
    def research(question: str) -> str:
        """Ask the research sub-agent."""
        return sub_agent.invoke({"messages": [("user", question)]})["messages"][-1].text

    @tool
    async def aresearch(question: str) -> str:
        """Ask the research sub-agent."""
        return (await sub_agent.ainvoke({"messages": [("user", question)]}))["messages"][-1].text

    return [research, aresearch]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["stream", "astream"])
@pytest.mark.parametrize("early", [False, True])
async def test_a_sub_agent_whose_output_may_be_withheld_streams_nothing_into_the_parents_stream(
    harness: Any, thread: Any, mode: str, early: bool
) -> None:
    """A tool that runs a graph (a sub-agent) under an enforced ``tool_result`` policy: with ``subgraphs=True`` the
    client's stream gets none of the inner graph's chunks in any mode (LangGraph hands the parent's stream to it
    through the config), so the output guard withholds reaches the client only as guard's notice."""
    h = harness()
    tools = _sub_agent_tools(f"{INJECTION} SECRETMARK")
    if early:
        _declared(tools, research=READ_ONLY, aresearch=READ_ONLY)
    name = "research" if mode == "stream" else "aresearch"
    graph, config = build(h, Turn(calls=[(name, {"question": "q"}, "c1")]), tools=tools, side_effecting_tools=["pay"]), thread()
    if mode == "stream":
        chunks = list(graph.stream(USER, config, stream_mode=STREAM_MODES, subgraphs=True))
        messages = graph.get_state(config).values["messages"]
    else:
        chunks = [c async for c in graph.astream(USER, config, stream_mode=STREAM_MODES, subgraphs=True)]
        messages = (await graph.aget_state(config)).values["messages"]
    assert "withheld by guard policy agent-results (rule injected)" in messages[2].text
    assert not [c for c in chunks if "SECRETMARK" in repr(c)]
    assert any(ns == () and stream_mode == "updates" and "tools" in c for ns, stream_mode, c in chunks)


def test_a_sub_agent_that_interrupts_resumes_under_a_tool_result_policy(harness: Any, thread: Any) -> None:
    """The inner graph of a tool whose output may be withheld keeps the parent's checkpointer: its ``interrupt()``
    pauses the run, its state is saved under the tool's task, and the resume completes it."""
    from langgraph.types import interrupt

    def ask_user(state: MessagesState) -> dict[str, Any]:
        return {"messages": [("ai", f"the user said {interrupt('which file?')}")]}

    inner = StateGraph(MessagesState)
    inner.add_node("ask_user", ask_user)
    inner.add_edge(START, "ask_user")
    inner.add_edge("ask_user", END)
    sub_agent = inner.compile()

    @tool
    def research(question: str) -> str:
        """Ask the research sub-agent."""
        return sub_agent.invoke({"messages": [("user", question)]})["messages"][-1].text

    h = harness()
    graph, config = build(h, Turn(calls=[("research", {"question": "q"}, "c1")]), tools=[research]), thread()
    chunks = list(graph.stream(USER, config, stream_mode=["updates"], subgraphs=True))
    assert any("__interrupt__" in c for _, _, c in chunks)
    assert [i.value for i in graph.get_state(config).interrupts] == ["which file?"]
    inner = [  # the inner graph's checkpoints, under the tool's task
        c.checkpoint["channel_values"].get("messages") for c in graph.checkpointer.list(config)
        if c.config["configurable"]["checkpoint_ns"].startswith("tools:")
    ]
    assert any(messages and messages[0].text == "q" for messages in inner)
    out = graph.invoke(Command(resume="notes.txt"), config)
    assert out["messages"][2].text == "the user said notes.txt"
