"""Matching: globs on method, path, host, headers and content type; events and tool names. Never the body."""

from __future__ import annotations

import pytest

from guard.policy import load_text
from guard.policy._match import compile_glob
from guard.subject import AgentSubject, HttpSubject

TEXT = """
policies:
  - id: api
    version: 1
    match:
      http:
        methods: [post, PUT]
        paths: ["/v1/*/chat", "/api/**"]
        hosts: ["*.example.com"]
        headers: {x-api-version: "2*", authorization: "*"}
        content_types: [application/json]
    questions: {q: {type: noul, instructions: q}}
  - id: agent
    version: 1
    match: {agent: {events: [tool_call], tools: ["fs_*", shell]}}
    questions: {q: {type: noul, instructions: q}}
  - id: any-model-output
    version: 1
    match: {agent: {events: [model_output]}}
    questions: {q: {type: noul, instructions: q}}
"""

OK_HEADERS = {"x-api-version": "2024-01", "authorization": "Bearer x"}


def http(**overrides: object) -> HttpSubject:
    fields: dict[str, object] = {"method": "POST", "path": "/v1/abc/chat", "host": "api.example.com",
                                 "headers": OK_HEADERS, "content_type": "application/json"}
    return HttpSubject(**{**fields, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def policies():  # type: ignore[no-untyped-def]
    from guard.policy import PolicySet

    return PolicySet(load_text(TEXT))


@pytest.mark.parametrize(
    ("overrides", "matched"),
    [
        ({}, True),
        ({"method": "GET"}, False),
        ({"path": "/v1/a/b/chat"}, False),  # * stays within one segment
        ({"path": "/api/a/b/c"}, True),  # ** crosses segments
        ({"host": "example.com"}, False),
        ({"host": "a.b.example.com"}, False),  # * stays within one label
        ({"headers": {"authorization": "x"}}, False),  # a required header is missing
        ({"headers": {**OK_HEADERS, "x-api-version": "1"}}, False),
        ({"content_type": "text/plain"}, False),
        ({"body": "anything at all"}, True),
    ],
)
def test_http_match(policies, overrides: dict[str, object], matched: bool) -> None:  # type: ignore[no-untyped-def]
    assert (policies.match(http(**overrides)) is not None) == matched


def test_agent_match(policies) -> None:  # type: ignore[no-untyped-def]
    assert policies.match(AgentSubject(event="tool_call", tool_name="fs_write")).id == "agent"
    assert policies.match(AgentSubject(event="tool_call", tool_name="shell")).id == "agent"
    assert policies.match(AgentSubject(event="tool_call", tool_name="browser")) is None
    assert policies.match(AgentSubject(event="tool_call")) is None
    assert policies.match(AgentSubject(event="tool_result", tool_name="shell")) is None
    assert policies.match(AgentSubject(event="model_output", text="hi")).id == "any-model-output"


def test_glob() -> None:
    assert compile_glob("/a/*.json", "/").fullmatch("/a/x.json")
    assert not compile_glob("/a/?", "/").fullmatch("/a/xy")
    assert compile_glob("a.b+c", None).fullmatch("a.b+c") and not compile_glob("a.b+c", None).fullmatch("aXb+c")
