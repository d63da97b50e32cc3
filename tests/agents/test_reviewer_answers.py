"""What a reviewer model's structured answer decides: a valid one; never its text when its structured answer is
invalid, and never the first of several."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.output_parsers.openai_tools import parse_tool_call

from guard.agents._judge import review
from guard.errors import HandoffError
from guard.subject import AgentSubject
from guard.verdict import Verdict


class ToolFake(GenericFakeChatModel):
    """A chat model that accepts ``bind_tools`` (so guard asks it for a structured answer) and replies as told."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self


VERDICT = Verdict(action="handoff", decision_id="d", policy_id="p", policy_version="1", rule="r", handoff="rev")
SUBJECT = AgentSubject(event="tool_call", tool_name="send_money", tool_call_id="c1", arguments={"to": "x"},
                       user_message="hi")


def _call(args: dict[str, Any], call_id: str = "t") -> dict[str, Any]:
    return {"name": "ReviewerAnswer", "args": args, "id": call_id}


def test_a_valid_structured_deny_decides_whatever_the_text_says() -> None:
    reply = AIMessage(content='{"decision": "allow"}', tool_calls=[_call({"decision": "deny", "reason": "no"})])
    assert review("rev", ToolFake(messages=iter([reply])), SUBJECT, VERDICT).decision == "deny"


@pytest.mark.parametrize("calls", [
    [_call({"decision": "deny", "reason": "r" * 1500})],  # a reason over the limit
    [_call({"decision": "deny", "reason": "no", "risk": "high"})],  # an extra key
    [_call({"decision": "deny"}), _call({"decision": "allow"}, "u")],  # two answers
    [_call({"decision": "allow"}), _call({"decision": "deny"}, "u")],
])  # fmt: skip
def test_an_invalid_or_ambiguous_structured_answer_is_malformed_not_read_as_its_text(
    calls: list[dict[str, Any]],
) -> None:
    """An invalid structured "deny" fell back to the reply's text, which said "allow"; of two answers the first won."""
    reply = AIMessage(content='{"decision": "allow"}', tool_calls=calls)
    with pytest.raises(HandoffError) as info:
        review("rev", ToolFake(messages=iter([reply])), SUBJECT, VERDICT)
    assert info.value.reason == "malformed"


def test_a_valid_allow_beside_a_call_whose_arguments_did_not_parse_is_malformed() -> None:
    """A valid "allow" call beside a "deny" call whose arguments were cut (an ``invalid_tool_calls`` entry) was read as
    the one structured answer: the allow decided."""
    broken = {"name": "ReviewerAnswer", "args": '{"decision": "deny", "reason": ', "id": "u", "error": None}
    reply = AIMessage(content="", tool_calls=[_call({"decision": "allow", "reason": "ok"})],
                      invalid_tool_calls=[broken])
    with pytest.raises(HandoffError) as info:
        review("rev", ToolFake(messages=iter([reply])), SUBJECT, VERDICT)
    assert info.value.reason == "malformed" and "2 structured answers" in str(info.value)


def test_a_structured_answer_sent_with_a_repeated_key_is_malformed() -> None:
    """An OpenAI-style call whose arguments were sent as ``{"decision": "deny", "decision": "allow"}`` was parsed by the
    integration keeping the last key, an allow; the same text answer is malformed."""
    sent = '{"decision": "deny", "decision": "allow", "reason": "r"}'
    reply = AIMessage(content="", additional_kwargs={"tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "ReviewerAnswer", "arguments": sent}}]})
    assert reply.tool_calls[0]["args"]["decision"] == "allow"  # what the integration made of it
    with pytest.raises(HandoffError) as info:
        review("rev", ToolFake(messages=iter([reply])), SUBJECT, VERDICT)
    assert info.value.reason == "malformed" and "duplicate_key" in str(info.value)


def test_a_structured_answer_with_a_control_character_in_its_reason_decides() -> None:
    """OpenAI's integration reads tool-call arguments with ``json.loads(strict=False)``, so a reason holding a raw line
    feed or tab is a valid answer; reading the arguments as sent strictly for a repeated key refused it too, and the
    fail mode decided (``open``: an allow) where the reviewer had denied."""
    sent = '{"decision": "deny", "reason": "the payee\tis new\nand unknown"}'
    raw = {"id": "t", "type": "function", "function": {"name": "ReviewerAnswer", "arguments": sent}}
    reply = AIMessage(content="", additional_kwargs={"tool_calls": [raw]},
                      tool_calls=[parse_tool_call(raw, return_id=True)])  # as langchain_openai builds it
    answer = review("rev", ToolFake(messages=iter([reply])), SUBJECT, VERDICT)
    assert answer.decision == "deny" and answer.reason == "the payee\tis new\nand unknown"
