"""Rendering the decision state from a subject with the declarative ``state`` mapping."""

from __future__ import annotations

from guard.policy import load_text
from guard.subject import AgentSubject, HttpSubject

TEXT = """
policies:
  - id: p
    version: 1
    match: {http: {}, agent: {}}
    state:
      last: body:/messages/-1/content
      first: {from: body, pointer: /messages/0/content, max_chars: 3}
      missing: {from: body, pointer: /nope/0, default: none}
      slash: body:/a~1b
      ua: header:User-Agent
      q: query:q
      tags: query:tag
      field: form:prompt
      method: method
      args: arguments:/cmd
      call:
        fields: {name: tool_name, args: arguments, fixed: {const: {k: [1, 2]}}}
    questions: {q: {type: noul, instructions: q}}
"""


def test_http_sources() -> None:
    (policy,) = load_text(TEXT)
    subject = HttpSubject(
        method="POST", path="/", query={"q": ["x"], "tag": ["a", "b"]}, headers={"user-agent": "curl"},
        body={"messages": [{"content": "hello"}, {"content": "bye"}], "a/b": 1},
    )
    state = policy.render_state(subject)
    assert state == {"last": "bye", "first": "hel", "missing": "none", "slash": 1, "ua": "curl", "q": "x",
                     "tags": ["a", "b"], "field": None, "method": "POST", "args": None,
                     "call": {"name": None, "args": None, "fixed": {"k": [1, 2]}}}
    assert list(state) == ["last", "first", "missing", "slash", "ua", "q", "tags", "field", "method", "args", "call"]
    form = policy.render_state(HttpSubject(method="POST", path="/", body={"prompt": ["hi"]}))
    assert form["field"] == "hi" and form["last"] is None


def test_agent_sources_and_defaults() -> None:
    (policy,) = load_text(TEXT)
    state = policy.render_state(AgentSubject(event="tool_call", tool_name="shell", arguments={"cmd": "rm -rf /"}))
    assert state["args"] == "rm -rf /" and state["call"]["name"] == "shell" and state["method"] is None
    bare = load_text(TEXT.split("    state:")[0] + "    questions: {q: {type: noul, instructions: q}}\n")[0]
    call = AgentSubject(event="tool_call", tool_name="t", arguments={"a": 1}, user_message="do it")
    assert bare.render_state(call) == {"task": "do it", "tool_call": {"name": "t", "arguments": {"a": 1}}}
    result = AgentSubject(event="tool_result", tool_name="t", tool_result="out", user_message="u")
    assert bare.render_state(result) == {"task": "u", "tool": "t", "result": "out"}
    assert bare.render_state(AgentSubject(event="model_input", text="x")) == {"text": "x"}
    assert bare.render_state(HttpSubject(method="GET", path="/p")) == {"method": "GET", "path": "/p", "body": None}
