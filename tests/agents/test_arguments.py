"""Malformed tool-call arguments are found before anything runs, and never coerced to {} (case C17)."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.tool import tool_call_chunk

from guard.agents._arguments import arguments_digest, classify_arguments, parse_calls


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
    assert classify_arguments("") == ({}, None)  # "no arguments", as LangChain's own parser reads it


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
    assert parsed[1].problem is not None and "length limit" in parsed[1].problem


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
