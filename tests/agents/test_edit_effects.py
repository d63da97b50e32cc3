"""A reviewer's edit that renames a call is judged with its new tool's declared effect (``call.effect``), in the
guarded tool node and in the middleware, whichever reviewer made it (guard's own or ``HumanInTheLoopMiddleware``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command

from guard.agents import GuardAgentMiddleware, guarded_tool_node, resume_command, send_tool_calls
from guard.engine import Guard
from guard.policy import load_files
from tests._backends import ScriptedBackend
from tests.agents._fakes import Turn, model

POLICY = """\
policies:
  - id: effects
    version: "1"
    match: {agent: {events: [tool_call]}}
    state: {task: user_message, arguments: arguments}
    questions: {serves: {catalog: guard.tool_call_serves_task}}
    rules:
      - {id: destructive, when: call.effect == "side_effecting", action: block, message: no side effects}
      - {id: unsure, when: serves.noul < 0.6, action: escalate}
    default: allow
"""
EDIT = {"type": "edit", "edited_action": {"name": "wipe", "args": {"q": "all"}}}


def effect_tools(ran: list[str]) -> list[BaseTool]:
    """``lookup`` (MCP ``readOnlyHint``) and ``wipe`` (``destructiveHint``), each recording its runs in ``ran``."""

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        ran.append(f"lookup {q}")
        return "found"

    @tool
    def wipe(q: str) -> str:
        """Delete the records matching q."""
        ran.append(f"wipe {q}")
        return "wiped"

    lookup.metadata = {"readOnlyHint": True}
    wipe.metadata = {"destructiveHint": True}
    return [lookup, wipe]


@pytest.fixture
def engine(tmp_path: Path) -> Any:
    path = tmp_path / "effects.yaml"
    path.write_text(POLICY)
    unsure = ScriptedBackend(lambda request: {"guard.tool_call_serves_task": 0.5})  # every call goes to a reviewer
    with Guard(load_files(path), backends=unsure) as guard:
        yield guard


def _blocked(result: dict[str, Any]) -> list[str]:
    return [str(m.content) for m in result["messages"] if isinstance(m, ToolMessage) and "destructive" in str(m.content)]


def test_a_tool_node_judges_an_edit_to_another_tool_with_that_tools_effect(engine: Guard, thread: Any) -> None:
    ran: list[str] = []
    tools = effect_tools(ran)
    turn = model(Turn(calls=[("lookup", {"q": "maybe"}, "c1")]))
    graph = StateGraph(MessagesState)
    graph.add_node("model", lambda state: {"messages": [turn.invoke(state["messages"])]})
    graph.add_node("tools", guarded_tool_node(tools, guard=engine))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", send_tool_calls, ["tools", END])
    graph.add_edge("tools", "model")
    app = graph.compile(checkpointer=InMemorySaver())
    config = thread()
    app.invoke({"messages": [("user", "look up maybe")]}, config)
    result = app.invoke(resume_command(app.get_state(config).interrupts, [EDIT]), config)
    assert ran == []  # wipe is side-effecting by its own metadata: the edit is blocked
    assert _blocked(result)


@pytest.mark.parametrize("hitl", [False, True], ids=["guard-review", "hitl-review"])
def test_the_middleware_judges_an_edit_to_another_tool_with_that_tools_effect(
    engine: Guard, thread: Any, hitl: bool
) -> None:
    ran: list[str] = []
    middleware: list[Any] = [GuardAgentMiddleware(guard=engine)]
    if hitl:  # listed after guard: guard reads its edit from the state
        middleware.append(HumanInTheLoopMiddleware(interrupt_on={"lookup": True}))
    agent = create_agent(model(Turn(calls=[("lookup", {"q": "maybe"}, "c1")])), effect_tools(ran),
                         middleware=middleware, checkpointer=InMemorySaver())  # fmt: skip
    config = thread()
    result = agent.invoke({"messages": [("user", "look up maybe")]}, config)
    if hitl:
        pending = result["__interrupt__"]
        decision = {"type": "edit", "edited_action": EDIT["edited_action"]}
        result = agent.invoke(Command(resume={pending[0].id: {"decisions": [decision]}}), config)
    else:
        result = agent.invoke(resume_command(agent.get_state(config).interrupts, [EDIT]), config)
    assert ran == []
    assert _blocked(result)
