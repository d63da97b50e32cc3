"""Malformed tool-call arguments are found before anything runs, and never coerced to {} (case C17)."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.tools import StructuredTool, tool

from guard.agents._arguments import (
    arguments_digest,
    classify_arguments,
    empty_arguments_problem,
    parse_calls,
    required_parameters,
    tool_effect,
)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ('{"{"a":1}', "arguments are not valid JSON"),
        ("null", "arguments are null"),
        ("[]", "arguments are a JSON array, not an object"),
        ('"x"', "arguments are a JSON string, not an object"),
        ("3", "arguments are a JSON number, not an object"),
        ('{"path": "/etc/pas', "arguments are truncated"),
        ('{"a": [1, 2', "arguments are truncated"),
        ('{"a":1} trailing', "arguments are not valid JSON"),
    ],
)
def test_malformed_text_is_classified_and_never_becomes_an_object(raw: str, problem: str) -> None:
    assert classify_arguments(raw) == (None, problem)


@pytest.mark.parametrize("value", [None, [], "x", 1.5, True, ["a"]])
def test_parsed_values_that_are_not_objects_are_malformed(value: object) -> None:
    arguments, problem = classify_arguments(value)
    assert arguments is None and problem is not None and "arguments are" in problem


def test_strict_json_rules_apply_to_argument_text() -> None:
    for raw, fragment in [('{"a":1,"a":2}', "duplicate key"), ('{"a": NaN}', "NaN"), ("[" * 80 + "]" * 80, "deep")]:
        arguments, problem = classify_arguments(raw)
        assert arguments is None and problem is not None and fragment in problem


def test_well_formed_arguments_pass() -> None:
    assert classify_arguments('{"a": 1}') == ({"a": 1}, None)
    assert classify_arguments({"a": 1}) == ({"a": 1}, None)
    assert classify_arguments("") == ({}, None)  # "no arguments", as LangChain's own parser reads it (a normal turn)


def _merged(*chunks: AIMessageChunk) -> AIMessageChunk:
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    return total


def _openai_style(raw_by_id: dict[str, str]) -> AIMessageChunk:
    chunks = [
        AIMessageChunk(
            content="",
            tool_call_chunks=[tool_call_chunk(name="pay", args=raw, id=call_id, index=i)],
            additional_kwargs={
                "tool_calls": [
                    {"index": i, "id": call_id, "type": "function", "function": {"name": "pay", "arguments": raw}}
                ]
            },
        )
        for i, (call_id, raw) in enumerate(raw_by_id.items())
    ]
    return _merged(*chunks)


def test_langchain_repairs_are_undone_by_the_raw_text() -> None:
    message = _openai_style({"good": '{"amount": 5}', "bad": '{"{"a":1}', "cut": '{"amount": 5, "to": "bo'})
    # LangChain's streaming merge "repairs" both bad calls into objects ...
    assert {c["id"]: c["args"] for c in message.tool_calls} == {
        "good": {"amount": 5},
        "bad": {},
        "cut": {"amount": 5, "to": "bo"},
    }
    # ... guard reads the raw text and refuses both, judging the good sibling on its own.
    calls = {c.id: c for c in parse_calls(message)}
    assert calls["good"].arguments == {"amount": 5} and not calls["good"].malformed
    assert calls["bad"].problem == "arguments are not valid JSON" and calls["bad"].arguments is None
    assert calls["cut"].problem == "arguments are truncated" and calls["cut"].raw == '{"amount": 5, "to": "bo'


def test_invalid_tool_calls_are_reported_with_their_problem() -> None:
    message = AIMessage(
        content="",
        tool_calls=[{"name": "pay", "args": {"amount": 1}, "id": "ok", "type": "tool_call"}],
        invalid_tool_calls=[
            {"name": "pay", "args": "null", "id": "n", "error": None, "type": "invalid_tool_call"},
            {"name": "pay", "args": "[]", "id": "l", "error": None, "type": "invalid_tool_call"},
            {"name": "pay", "args": None, "id": "m", "error": "boom", "type": "invalid_tool_call"},
        ],
    )
    problems = {c.id: c.problem for c in parse_calls(message)}
    assert problems == {
        "ok": None,
        "n": "arguments are null",
        "l": "arguments are a JSON array, not an object",
        "m": "arguments are null",
    }


def test_cut_off_output_marks_the_last_call_when_no_raw_text_proves_it_whole() -> None:
    calls = [{"name": "pay", "args": {"amount": i}, "id": f"c{i}", "type": "tool_call"} for i in range(2)]
    message = AIMessage(content="", tool_calls=calls, response_metadata={"finish_reason": "length"})
    parsed = parse_calls(message)
    assert parsed[0].problem is None
    assert parsed[1].problem == "arguments may be truncated: the output was cut off (finish_reason=length)"


def _empty_last_call(meta: dict[str, object], raw_last: str = "") -> AIMessageChunk:
    message = _openai_style({"first": "", "last": raw_last})
    return message.model_copy(update={"response_metadata": meta})


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        ({"finish_reason": "length"}, "finish_reason=length"),
        ({"finish_reason": "MAX_TOKENS"}, "finish_reason=max_tokens"),  # Gemini
        ({"stop_reason": "max_tokens"}, "stop_reason=max_tokens"),  # Anthropic
        ({"stopReason": "max_tokens"}, "stopReason=max_tokens"),  # Bedrock Converse
        ({"stop_reason": "model_context_window_exceeded"}, "stop_reason=model_context_window_exceeded"),
        ({"done_reason": "length"}, "done_reason=length"),  # Ollama
        ({"finish_reason": "content_filter"}, "finish_reason=content_filter"),
        ({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}, "incomplete_details.reason"),
        ({"status": "incomplete"}, "status=incomplete"),  # OpenAI Responses
    ],
)
def test_empty_raw_arguments_of_a_cut_off_turn_are_truncated_not_no_arguments(
    meta: dict[str, object], reason: str
) -> None:
    """Raw argument text "" on a cut-off turn: the output ended before any argument was written."""
    message = _empty_last_call(meta)
    assert message.tool_calls[-1]["args"] == {}  # LangChain reads "" as {} ...
    first, last = parse_calls(message)
    assert last.arguments is None and last.raw == ""  # ... guard refuses it
    assert last.problem is not None and last.problem.startswith("arguments may be truncated: the output was cut off (")
    assert reason in last.problem
    assert first.problem is None and first.arguments == {}  # an earlier call was complete before the next began


@pytest.mark.parametrize("raw", ["  ", "\n"])
def test_blank_raw_arguments_on_a_cut_off_turn_are_refused(raw: str) -> None:
    # LangChain cannot parse whitespace, so the call is an invalid one: refused either way, never run as {}
    (_, last) = parse_calls(_empty_last_call({"finish_reason": "length"}, raw))
    assert last.arguments is None and last.problem is not None


@pytest.mark.parametrize("meta", [{}, {"finish_reason": "stop"}, {"stop_reason": "end_turn"}, {"status": "completed"}])
def test_empty_raw_arguments_of_a_finished_turn_mean_no_arguments(meta: dict[str, object]) -> None:
    assert [(c.arguments, c.problem) for c in parse_calls(_empty_last_call(meta))] == [({}, None), ({}, None)]


def test_a_cut_off_turn_whose_last_raw_text_is_a_whole_object_is_not_refused() -> None:
    (_, last) = parse_calls(_empty_last_call({"finish_reason": "length"}, '{"amount": 5}'))
    assert last.problem is None and last.arguments == {"amount": 5}


@tool
def _no_parameters() -> str:
    """Takes nothing."""
    return "ok"


@tool
def _pay(amount: int, to: str, memo: str = "") -> str:
    """Pay someone."""
    return "paid"


_MCP_STYLE = StructuredTool(
    name="wire",
    description="A tool with a JSON-schema args_schema (as MCP adapters build them): LangChain does not validate it.",
    args_schema={"type": "object", "properties": {"iban": {"type": "string"}}, "required": ["iban"]},
    func=lambda **kwargs: "sent",
)


def test_required_parameters_come_from_the_schema_the_model_sees() -> None:
    assert required_parameters(_pay) == {"amount", "to"}
    assert required_parameters(_no_parameters) == frozenset()
    assert required_parameters(_MCP_STYLE) == {"iban"}


@pytest.mark.parametrize("args", ["", "{}", {}])
def test_empty_arguments_for_a_tool_with_required_parameters_are_malformed(args: object) -> None:
    calls = [("_pay", "p"), ("wire", "w"), ("_no_parameters", "n"), ("unknown", "u")]
    if isinstance(args, str):  # raw text, as a provider streams it
        message: AIMessage = _merged(
            *[
                AIMessageChunk(content="", tool_call_chunks=[tool_call_chunk(name=name, args=args, id=i, index=n)])
                for n, (name, i) in enumerate(calls)
            ]
        )
    else:  # parsed arguments only (no raw text kept)
        message = AIMessage(
            content="", tool_calls=[{"name": n, "args": {}, "id": i, "type": "tool_call"} for n, i in calls]
        )
    problems = {c.id: c.problem for c in parse_calls(message, [_pay, _MCP_STYLE, _no_parameters, {"type": "x"}])}
    assert problems == {
        "p": "arguments are empty, but tool `_pay` requires amount, to",
        "w": "arguments are empty, but tool `wire` requires iban",
        "n": None,  # no parameters: "" is "no arguments"
        "u": None,  # a tool the agent does not have: the tool node answers it
    }
    assert empty_arguments_problem(_pay, {"amount": 1}) is None  # only empty arguments are checked here


def test_duplicate_and_missing_ids_are_malformed() -> None:
    message = AIMessage(
        content="",
        tool_calls=[
            {"name": "pay", "args": {"amount": 1}, "id": "same", "type": "tool_call"},
            {"name": "pay", "args": {"amount": 2}, "id": "same", "type": "tool_call"},
            {"name": "pay", "args": {"amount": 3}, "id": None, "type": "tool_call"},
        ],
    )
    parsed = parse_calls(message)
    assert [bool(c.problem) for c in parsed] == [True, True, True]
    assert "same" in (parsed[0].problem or "") and parsed[2].problem == "the tool call has no id"


def test_digest_binds_tool_and_exact_arguments() -> None:
    base = arguments_digest("pay", {"amount": 5, "to": "bob"})
    assert base == arguments_digest("pay", {"to": "bob", "amount": 5})  # key order does not matter
    assert base != arguments_digest("refund", {"amount": 5, "to": "bob"})
    assert base != arguments_digest("pay", {"amount": 5.0001, "to": "bob"})
    assert base != arguments_digest("pay", {"amount": "5", "to": "bob"})


def _tool_with(metadata: dict | None) -> StructuredTool:
    return StructuredTool.from_function(lambda x: x, name="t", description="t", metadata=metadata)


@pytest.mark.parametrize(
    ("metadata", "effect"),
    [
        (None, "unknown"),
        ({}, "unknown"),
        ({"readOnlyHint": True}, "read_only"),  # MCP annotations as langchain-mcp-adapters copies them
        ({"readOnlyHint": False}, "side_effecting"),
        ({"readOnlyHint": True, "destructiveHint": True}, "side_effecting"),
        ({"guard_effect": "side_effecting", "readOnlyHint": True}, "side_effecting"),  # guard's own key wins
        ({"guard_effect": "read_only"}, "read_only"),
        ({"guard_effect": "maybe"}, "unknown"),
    ],
)
def test_tool_effect_comes_from_the_tools_metadata(metadata: dict | None, effect: str) -> None:
    assert tool_effect(_tool_with(metadata)) == effect


def test_tool_effect_without_a_tool_is_unknown() -> None:
    assert tool_effect(None) == "unknown"

