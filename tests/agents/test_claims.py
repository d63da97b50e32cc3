"""Single-use approvals: a reviewer's approval runs its side-effecting tool once, whether the
interrupt is resumed twice at the same time (two threads, ``asyncio.gather`` of two ``ainvoke``) or replayed from
the checkpoint saved at the interrupt; the second claimant gets ``ApprovalAlreadyUsed``. Memory and real Redis."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest
import redis
from langchain.agents import create_agent
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, RetryPolicy, interrupt

from guard.agents import (
    GuardAgentMiddleware,
    MemoryApprovalClaims,
    RedisApprovalClaims,
    guarded_tool_node,
    resume_command,
)
from guard.errors import ApprovalAlreadyUsed, ReviewStoreUnavailable
from tests.agents._fakes import Turn, model, tool_node_graph

USER = {"messages": [("user", "Please settle my invoices.")]}
KEY = "k" * 32
APPROVE = Command(resume={"decisions": [{"type": "approve"}]})


def escalated_pay(call_id: str = "a") -> Turn:
    return Turn(calls=[("pay", {"amount": 500, "to": "eve"}, call_id)])


def agent_for(h: Any, checkpointer: Any, claims: Any = None, turn: Turn | None = None) -> Any:
    middleware = GuardAgentMiddleware(guard=h.guard, approval_claims=claims)
    return create_agent(model(turn or escalated_pay()), h.tools, middleware=[middleware], checkpointer=checkpointer)


def at_interrupt(agent: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The config pinned to the checkpoint saved at the pending interrupt."""
    state = agent.get_state(config)
    assert state.interrupts
    return state.config


def test_replayed_resume_runs_the_tool_once(harness: Any, thread: Any) -> None:
    h = harness()
    agent, config = agent_for(h, InMemorySaver()), thread()
    agent.invoke(USER, config)
    saved = at_interrupt(agent, config)
    agent.invoke(APPROVE, saved)
    assert h.runs.calls == [("pay", {"amount": 500, "to": "eve"})]
    with pytest.raises(ApprovalAlreadyUsed, match="already used") as caught:
        agent.invoke(APPROVE, saved)  # replayed from the checkpoint saved at the interrupt
    assert caught.value.review_id.startswith("ga_") and caught.value.status == "claimed"
    assert h.runs.count() == 1


@pytest.mark.parametrize("second", ["approve", "edit"])
def test_two_threads_resume_one_interrupt_the_tool_runs_once(harness: Any, thread: Any, second: str) -> None:
    """Two threads resume one interrupt at once, with the same decision or an approve and an edit: one runs."""
    h = harness()
    agent, config = agent_for(h, InMemorySaver()), thread()
    agent.invoke(USER, config)
    saved = at_interrupt(agent, config)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def resume(decision: Command[Any]) -> None:
        barrier.wait()
        try:
            agent.invoke(decision, saved)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    decisions = (APPROVE, APPROVE if second == "approve" else edit_to(5))
    workers = [threading.Thread(target=resume, args=(d,)) for d in decisions]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert h.runs.count() == 1
    assert [type(e) for e in errors] == [ApprovalAlreadyUsed]


@pytest.mark.anyio
async def test_gather_of_two_ainvoke_runs_the_tool_once(harness: Any, thread: Any) -> None:
    h = harness()
    agent, config = agent_for(h, InMemorySaver()), thread()
    await agent.ainvoke(USER, config)
    results = await asyncio.gather(
        agent.ainvoke(APPROVE, config), agent.ainvoke(APPROVE, config), return_exceptions=True
    )
    assert h.runs.count() == 1
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], ApprovalAlreadyUsed)


def edit_to(amount: int) -> Command[Any]:
    """The resume that edits the held payment to ``amount``."""
    return Command(resume={"decisions": [{"type": "edit", "edited_action": {"name": "pay",
                                                                            "args": {"amount": amount, "to": "eve"}}}]})


def test_an_approved_edit_is_single_use_too(harness: Any, thread: Any) -> None:
    h = harness()
    agent, config = agent_for(h, InMemorySaver()), thread()
    agent.invoke(USER, config)
    saved = at_interrupt(agent, config)
    agent.invoke(edit_to(5), saved)
    with pytest.raises(ApprovalAlreadyUsed):
        agent.invoke(edit_to(5), saved)
    assert h.runs.calls == [("pay", {"amount": 5, "to": "eve"})]


@pytest.mark.anyio
@pytest.mark.parametrize("second", [5, 6], ids=["edit", "another-edit"])
@pytest.mark.parametrize("first", ["approve", 7])
async def test_gather_of_different_decisions_runs_the_tool_once(
    harness: Any, thread: Any, first: Any, second: int
) -> None:
    """Two resumes of one review item with different decisions make the same claim: one runs, one is refused."""
    h = harness()
    agent, config = agent_for(h, InMemorySaver()), thread()
    await agent.ainvoke(USER, config)
    decisions = [APPROVE if first == "approve" else edit_to(first), edit_to(second)]
    results = await asyncio.gather(*(agent.ainvoke(d, config) for d in decisions), return_exceptions=True)
    assert h.runs.count() == 1
    assert [type(r) for r in results if isinstance(r, BaseException)] == [ApprovalAlreadyUsed]


@pytest.mark.anyio
async def test_per_call_review_approve_and_edit_gathered_runs_once(harness: Any, thread: Any) -> None:
    """The tool node's own review: an approve and an edit of one interrupt, resumed at once, run the tool once."""
    h = harness()
    chat = model(escalated_pay())
    graph = tool_node_graph(chat, guarded_tool_node(h.tools, guard=h.guard))
    app, config = graph.compile(checkpointer=InMemorySaver()), thread()
    await app.ainvoke(USER, config)
    state = await app.aget_state(config)
    edit = {"type": "edit", "edited_action": {"name": "pay", "args": {"amount": 5, "to": "eve"}}}
    commands = [resume_command(state.interrupts, [decision]) for decision in ({"type": "approve"}, edit)]
    results = await asyncio.gather(*(app.ainvoke(c, state.config) for c in commands), return_exceptions=True)
    assert h.runs.count() == 1
    assert [type(r) for r in results if isinstance(r, BaseException)] == [ApprovalAlreadyUsed]


def test_policy_allowed_calls_make_no_claim(harness: Any, thread: Any) -> None:
    h = harness()
    claims = MemoryApprovalClaims()
    agent = agent_for(h, InMemorySaver(), claims, Turn(calls=[("pay", {"amount": 5, "to": "bob"}, "a")]))
    agent.invoke(USER, thread())
    assert h.runs.count() == 1 and "claims=0" in repr(claims)


def test_per_call_review_in_a_tool_node_is_single_use(harness: Any, thread: Any) -> None:
    h = harness()
    chat = model(escalated_pay())
    graph = tool_node_graph(chat, guarded_tool_node(h.tools, guard=h.guard))
    app, config = graph.compile(checkpointer=InMemorySaver()), thread()
    app.invoke(USER, config)
    state = app.get_state(config)
    command = resume_command(state.interrupts, [{"type": "approve"}])
    app.invoke(command, state.config)
    with pytest.raises(ApprovalAlreadyUsed):
        app.invoke(command, state.config)
    assert h.runs.count() == 1


def _otp_pay(ran: list[tuple[int, str, str]]) -> Any:
    @tool
    def pay(amount: int, to: str) -> str:
        """Pay ``amount`` to ``to`` (asks the user for a one-time code first)."""
        code = interrupt({"type": "otp", "question": "Enter the one-time code"})
        ran.append((amount, to, code))
        return f"paid {amount} to {to}"

    return pay


@pytest.mark.anyio
@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_an_approved_tool_that_interrupts_itself_runs_once_when_resumed(
    harness: Any, thread: Any, redis_url: str, claim_prefix: str, store: str, mode: str
) -> None:
    """The claim of a call whose tool stops at its own ``interrupt()`` is given back (the tool runs again from its
    start on resume, as LangGraph runs it); a replay of the finished resume still runs nothing."""
    h = harness()
    ran: list[tuple[int, str, str]] = []
    claims = _redis_claims(redis_url, claim_prefix) if store == "redis" else MemoryApprovalClaims()
    middleware = GuardAgentMiddleware(guard=h.guard, approval_claims=claims)
    agent = create_agent(model(escalated_pay()), [_otp_pay(ran)], middleware=[middleware],
                         checkpointer=InMemorySaver())  # fmt: skip
    config = thread()

    async def run(value: Any, where: dict[str, Any]) -> Any:
        return await agent.ainvoke(value, where) if mode == "ainvoke" else agent.invoke(value, where)

    await run(USER, config)
    await run(APPROVE, config)
    asking = agent.get_state(config)
    assert [i.value.get("type") for i in asking.interrupts] == ["otp"] and ran == []
    saved = asking.config
    await run(Command(resume="123456"), saved)
    assert ran == [(500, "eve", "123456")]
    assert not agent.get_state(config).interrupts
    with pytest.raises(ApprovalAlreadyUsed):
        await run(Command(resume="123456"), saved)  # replayed from the checkpoint at the tool's own interrupt
    assert len(ran) == 1
    if store == "redis":
        await claims.aclose()
        claims.close()


def _flaky_pay(ran: list[tuple[int, str]]) -> Any:
    @tool
    def pay(amount: int, to: str) -> str:
        """Pay ``amount`` to ``to`` (the bank times out on the first try)."""
        ran.append((amount, to))
        if len(ran) == 1:
            raise ConnectionError("bank timeout")
        return f"paid {amount} to {to}"

    return pay


@pytest.mark.anyio
@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("node", ["middleware", "tool_node"])
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_an_approved_call_whose_tool_raised_is_answered_not_run_again(
    harness: Any, thread: Any, redis_url: str, claim_prefix: str, store: str, node: str, mode: str
) -> None:
    """The one use of an approval whose tool raised is kept (the tool may have taken effect) and recorded as failed:
    a retry of the task (``invoke(None)``, a retry policy) does not run the tool again and does not raise, it answers
    the call with an error tool message, so the thread goes on. A replayed resume is answered the same way."""
    h = harness()
    ran: list[tuple[int, str]] = []
    claims = _redis_claims(redis_url, claim_prefix) if store == "redis" else MemoryApprovalClaims()
    if node == "middleware":
        middleware = GuardAgentMiddleware(guard=h.guard, approval_claims=claims)
        agent = create_agent(model(escalated_pay()), [_flaky_pay(ran)], middleware=[middleware],
                             checkpointer=InMemorySaver())  # fmt: skip
    else:
        tools = guarded_tool_node([_flaky_pay(ran)], guard=h.guard, approval_claims=claims)
        agent = tool_node_graph(model(escalated_pay()), tools).compile(checkpointer=InMemorySaver())
    config = thread()

    async def run(value: Any, where: dict[str, Any]) -> Any:
        return await agent.ainvoke(value, where) if mode == "ainvoke" else agent.invoke(value, where)

    await run(USER, config)
    state = agent.get_state(config)
    command = resume_command(state.interrupts, [{"type": "approve"}])
    with pytest.raises(ConnectionError):
        await run(command, config)
    out = await run(None, config)
    assert ran == [(500, "eve")] and not agent.get_state(config).next
    answer = next(m for m in out["messages"] if getattr(m, "tool_call_id", None) == "a")
    assert answer.status == "error" and "may have taken effect" in answer.text and "new review" in answer.text
    assert out["messages"][-1].text == "done"
    replayed = await run(command, state.config)
    assert ran == [(500, "eve")] and replayed["messages"][-2].status == "error"
    if store == "redis":
        await claims.aclose()
        claims.close()


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
async def test_a_retry_policy_on_the_tool_node_gets_the_failed_approval_answered(
    harness: Any, thread: Any, mode: str
) -> None:
    """A ``RetryPolicy`` that retries the tool node on the tool's error gets the approved call answered with an error
    tool message on its second attempt (it raised ``ApprovalAlreadyUsed`` on every attempt, and the run failed)."""
    h = harness()
    ran: list[tuple[int, str]] = []
    retry = RetryPolicy(max_attempts=3, initial_interval=0.01, retry_on=ConnectionError)
    graph = tool_node_graph(model(escalated_pay()), guarded_tool_node([_flaky_pay(ran)], guard=h.guard),
                            retry_policy=retry)  # fmt: skip
    app, config = graph.compile(checkpointer=InMemorySaver()), thread()
    await app.ainvoke(USER, config) if mode == "ainvoke" else app.invoke(USER, config)
    command = resume_command(app.get_state(config).interrupts, [{"type": "approve"}])
    out = await app.ainvoke(command, config) if mode == "ainvoke" else app.invoke(command, config)
    assert ran == [(500, "eve")] and out["messages"][-2].status == "error" and out["messages"][-1].text == "done"


def test_memory_claims_forget_the_oldest_past_the_cap() -> None:
    claims = MemoryApprovalClaims(max_entries=2)
    for key in ("a", "b", "c"):
        claims.claim(key)
    claims.claim("a")  # forgotten: the oldest of three
    with pytest.raises(ApprovalAlreadyUsed):
        claims.claim("c")
    with pytest.raises(ValueError, match="positive"):
        MemoryApprovalClaims(ttl_s=0)


# Redis: several processes (here: separate middleware instances and clients) share the claims ---------------------


def _redis_claims(redis_url: str, prefix: str, **options: Any) -> RedisApprovalClaims:
    return RedisApprovalClaims.from_url(redis_url, store_key=KEY, prefix=prefix, **options)


@pytest.fixture
def claim_prefix(redis_url: str) -> Any:
    prefix = f"guard-test-claims-{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()


def test_redis_claims_across_instances(harness: Any, thread: Any, redis_url: str, claim_prefix: str) -> None:
    h = harness()
    checkpointer = InMemorySaver()
    first_claims, second_claims = _redis_claims(redis_url, claim_prefix), _redis_claims(redis_url, claim_prefix)
    first, second = agent_for(h, checkpointer, first_claims), agent_for(h, checkpointer, second_claims)
    config = thread()
    first.invoke(USER, config)
    saved = at_interrupt(first, config)
    first.invoke(APPROVE, saved)
    with pytest.raises(ApprovalAlreadyUsed, match="Unix time"):
        second.invoke(APPROVE, saved)  # another replica replays the same resume
    assert h.runs.count() == 1
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=claim_prefix + "*"))
    assert len(keys) == 1 and 0 < client.pttl(keys[0]) <= 30 * 24 * 3600 * 1000
    client.close()
    first_claims.close()
    second_claims.close()


@pytest.mark.anyio
async def test_redis_claims_async_gather(harness: Any, thread: Any, redis_url: str, claim_prefix: str) -> None:
    h = harness()
    claims = _redis_claims(redis_url, claim_prefix)
    agent, config = agent_for(h, InMemorySaver(), claims), thread()
    await agent.ainvoke(USER, config)
    results = await asyncio.gather(
        agent.ainvoke(APPROVE, config), agent.ainvoke(APPROVE, config), return_exceptions=True
    )
    assert h.runs.count() == 1
    assert [type(r) for r in results if isinstance(r, BaseException)] == [ApprovalAlreadyUsed]
    await claims.aclose()
    claims.close()


@pytest.mark.anyio
async def test_redis_claims_approve_and_edit_gathered_run_once(
    harness: Any, thread: Any, redis_url: str, claim_prefix: str
) -> None:
    h = harness()
    claims = _redis_claims(redis_url, claim_prefix)
    agent, config = agent_for(h, InMemorySaver(), claims), thread()
    await agent.ainvoke(USER, config)
    results = await asyncio.gather(agent.ainvoke(APPROVE, config), agent.ainvoke(edit_to(5), config),
                                   return_exceptions=True)  # fmt: skip
    assert h.runs.count() == 1
    assert [type(r) for r in results if isinstance(r, BaseException)] == [ApprovalAlreadyUsed]
    await claims.aclose()
    claims.close()


def test_redis_claim_held_by_a_forged_entry_is_refused(redis_url: str, claim_prefix: str) -> None:
    claims = _redis_claims(redis_url, claim_prefix)
    client = redis.Redis.from_url(redis_url)
    client.set(claim_prefix + "ga_forged", "1700000000.0:" + "0" * 64)
    with pytest.raises(ApprovalAlreadyUsed, match="seal does not check"):
        claims.claim("ga_forged")
    assert claims.forged == 1
    claims.claim("ga_fresh")
    with pytest.raises(ApprovalAlreadyUsed, match="Unix time"):
        claims.claim("ga_fresh")
    client.close()
    claims.close()


def test_redis_down_fails_closed(harness: Any, thread: Any) -> None:
    h = harness()
    claims = RedisApprovalClaims.from_url("redis://127.0.0.1:1/0", store_key=KEY, timeout_s=0.2)
    agent, config = agent_for(h, InMemorySaver(), claims), thread()
    agent.invoke(USER, config)
    with pytest.raises(ReviewStoreUnavailable, match="approval claim store failed"):
        agent.invoke(APPROVE, config)
    assert h.runs.count() == 0
    claims.close()


def test_redis_claims_need_a_store_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GUARD_STORE_KEY", raising=False)
    with pytest.raises(ValueError, match="RedisApprovalClaims needs a store key"):
        RedisApprovalClaims(redis.Redis())
    with pytest.raises(ValueError, match="client="):
        RedisApprovalClaims(store_key=KEY)


@pytest.mark.parametrize("url", ["redis://:top/secret@127.0.0.1:6379/0", "redis://:top?secret@127.0.0.1:6379/0",
                                 "redis://:top#secret@127.0.0.1:6379/0"])
def test_redis_claims_url_error_does_not_show_the_password(url: str) -> None:
    with pytest.raises(ValueError, match="approval claim store URL") as raised:
        RedisApprovalClaims.from_url(url, store_key=KEY)
    assert "top" not in str(raised.value) and "secret" not in str(raised.value)


def test_redis_claims_url_with_a_database_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ValueError, match="not a number"):
        RedisApprovalClaims.from_url("redis://127.0.0.1:6379/nine", store_key=KEY)
