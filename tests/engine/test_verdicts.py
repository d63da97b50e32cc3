"""Where verdicts are made (guard/engine/verdicts.py): the one constructor call, shadow mode, verdicts without a
model answer, and the one recording path."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import guard
from guard.backends.fixture import FixtureBackend
from guard.engine import verdicts
from guard.engine.telemetry import DecisionLog, Telemetry
from guard.errors import BackendTimeout
from guard.policy import load_text
from guard.subject import AgentSubject, HttpSubject

POLICY = """
policies:
  - id: tools
    version: 3
    MODE
    match: {agent: {events: [tool_call]}}
    questions:
      risky: {type: noul, instructions: Is the call risky}
    rules:
      - {id: risky, when: risky.noul >= 0.5, action: block}
    on_error: {mode: closed}
"""


def _policy(mode: str = "") -> guard.Policy:
    return load_text(POLICY.replace("MODE", mode))[0]


def test_only_verdicts_py_calls_the_verdict_constructor() -> None:
    root = Path(guard.__file__).parent
    callers = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Verdict":
                callers.append(str(path.relative_to(root)))
    assert callers == ["engine/verdicts.py"]


def test_shadow_mode_allows_and_keeps_the_action_it_computed() -> None:
    made = verdicts.make("block", "d-1", policy_id="p", rule="r", shadow=True)
    assert (made.action, made.shadow_action, made.rule) == ("allow", "block", "r")
    plain = verdicts.make("block", "d-2", policy_id="p", rule="r")
    assert (plain.action, plain.shadow_action, plain.answers, plain.flags) == ("block", None, {}, {})


def test_a_refused_input_blocks_even_under_a_shadow_policy() -> None:
    refused = verdicts.refused(_policy("mode: shadow"), decision_id="d", rule="invalid_json", status=400, message="no")
    assert (refused.action, refused.shadow_action, refused.status, refused.policy_id) == ("block", None, 400, "tools")


def test_the_fail_mode_verdict_names_the_error_and_is_shadowed_in_shadow_mode() -> None:
    subject = AgentSubject(event="tool_call", tool_name="shell", arguments={})
    for mode, action in (("", "block"), ("mode: shadow", "allow")):
        verdict = verdicts.fail_mode(
            _policy(mode), subject, BackendTimeout("slow", backend="b"), decision_id="d", backend="b", model=None,
            model_revision=None, latency_ms=1.0, state=None, flags={},
        )  # fmt: skip
        assert (verdict.action, verdict.rule, verdict.fail_mode, verdict.status) == (action, "on_error", "closed", 503)
        assert verdict.error is not None and verdict.error.startswith("timeout")


def test_record_counts_every_verdict_and_logs_those_of_a_matched_policy() -> None:
    lines: list[str] = []
    log = DecisionLog(lines.append)
    subject = AgentSubject(event="tool_call", tool_name="shell", arguments={})
    matched = verdicts.refused(_policy(), decision_id="d-1", rule="malformed_arguments", status=400, message="bad")
    assert verdicts.record(Telemetry(), log, matched, subject, policy=_policy()) is matched
    verdicts.record(Telemetry(), log, verdicts.no_match("d-2", 0.1), subject, policy=None)
    assert [json.loads(line)["decision_id"] for line in lines] == ["d-1"]


def test_the_logged_tool_effect_is_the_one_the_deciding_policy_resolved() -> None:
    """Every agent record said ``tool_effect: unknown`` (the tool's own metadata, which says nothing) even for a tool
    the policy declares ``side_effecting``, the effect its rules read as ``call.effect``."""
    policy = load_text(POLICY.replace("MODE", "tools: {shell: {effect: side_effecting}}"))[0]
    lines: list[str] = []
    log = DecisionLog(lines.append)
    for tool, declared in (("shell", "unknown"), ("shell", "read_only"), ("ls", "read_only"), ("ls", "unknown")):
        subject = AgentSubject(event="tool_call", tool_name=tool, arguments={}, tool_effect=declared)
        verdicts.record(Telemetry(), log, verdicts.refused(policy, decision_id="d", rule="r", status=400,
                                                           message="m"), subject, policy=policy)  # fmt: skip
    assert [json.loads(line)["input"]["tool_effect"] for line in lines] == [
        "side_effecting", "side_effecting", "read_only", "unknown"]  # fmt: skip


def test_combined_flags_keep_the_largest_count_whatever_the_match_order() -> None:
    """Each policy counts in its own state; the combined counts came from the last policy in match order (A, B, C gave
    truncated 1 and A, C, B gave 2)."""
    rules_only = (
        "\n  - id: {0}\n    version: 1\n    match: {{http: {{}}}}\n    rules: [{{id: r, when: 'true', action: allow}}]\n"
    )
    policies = {p.id: p for p in load_text("policies:" + "".join(rules_only.format(i) for i in "abc"))}
    own = {
        "a": verdicts.make("block", "d", policy_id="a", rule="r", flags={"truncated": 1}),
        "b": verdicts.make("allow", "d", policy_id="b", rule="r", flags={"truncated": 3, "zero_width": 1}),
        "c": verdicts.make("allow", "d", policy_id="c", rule="r", flags={"truncated": 2, "fail_open": True}),
    }
    for order in ("abc", "acb", "bca", "cba"):
        verdict = verdicts.combined(
            [policies[i] for i in order], [own[i] for i in order], decision_id="d", latency_ms=1.0
        )
        assert (verdict.policy_id, verdict.flags) == ("a", {"truncated": 3, "zero_width": 1}), order
        assert [c.flags for c in verdict.contributions] == [own[i].flags for i in order]  # each keeps its own


KEYS = """
policies:
  - id: keys
    version: 1
    match: {http: {RESPONSE}}
    state: {text: body_text, path: path, note: 'header:x-note'}
    rules:
      - id: api-key
        when: '[state.text, state.path, state.note].exists(t, t != null && t.matches("sk-[a-z0-9]{16}"))'
        action: redact
        redact: {patterns: {key: 'sk-[a-z0-9]{16}'}}
"""
SECRET = "sk-abcdefgh12345678"


@pytest.mark.parametrize(("phase", "path", "headers", "action", "status"), [
    ("request", f"/v1/notes/{SECRET}", {}, "block", 422),  # the path the app gets
    ("request", "/v1/notes", {"x-note": SECRET}, "block", 422),  # a header the state reads
    ("request", "/v1/notes", {"authorization": f"Bearer {SECRET}"}, "redact", None),  # one no rule reads
    ("response", "/v1/notes", {"x-note": SECRET}, "block", None),  # the response's header: the response block's
    ("response", f"/v1/notes/{SECRET}", {}, "redact", None),  # the request's path is not sent to the client
])  # fmt: skip
def test_a_redact_rule_whose_match_is_in_the_path_or_a_header_it_reads_refuses(
    phase: str, path: str, headers: dict[str, str], action: str, status: int | None
) -> None:
    """A redact rule that fired on a key in the path or in a header the state reads gave ``redact`` with no span,
    and the request went on as it was (attack finding); neither can be masked, so it is refused as a query is."""
    policies = load_text(KEYS.replace("RESPONSE", "response: {}" if phase == "response" else ""))
    subject = HttpSubject(method="POST", path=path, headers=headers, content_type="application/json",
                          body={"note": f"and {SECRET}"}, phase=phase, status=200 if phase == "response" else None)  # type: ignore[arg-type]
    with guard.Guard(policies, backends=FixtureBackend({})) as judge:
        verdict = judge.evaluate(subject)
    assert (verdict.action, verdict.status, verdict.rule) == (action, status, "api-key")
    assert (verdict.message == verdicts.UNMASKABLE) is (action == "block")
    assert [(r.pointer, r.start, r.end) for r in verdict.redactions] == ([("/note", 4, 23)] if action == "redact" else [])


CARDS = """
policies:
  - id: cards
    version: 1
    match: {http: {methods: [POST]}}
    state: {text: body_text, auth: 'header:authorization'}
    rules:
      - id: anonymous
        when: '!has(subject.headers.authorization)'
        action: block
        status: 401
      - id: card
        when: 'state.text.matches("\\\\b[0-9]{13,19}\\\\b")'
        action: redact
        redact: {patterns: {card: '\\b[0-9]{13,19}\\b'}}
"""


@pytest.mark.parametrize(("path", "headers", "state", "action"), [
    ("/channels/1098765432109876543/messages", {"authorization": "Bearer t"}, "", "redact"),  # a snowflake id
    ("/v1/notes", {"authorization": "Bearer 4111111111111111"}, "", "redact"),  # the caller's own credential
    ("/v1/notes", {"authorization": "Bearer t", "x_api_key": "4111111111111111"}, "", "redact"),  # read as X-Api-Key
    ("/channels/1098765432109876543/messages", {"authorization": "Bearer t"}, "path: path,", "block"),
    ("/channels/1098765432109876543/messages", {"authorization": "Bearer t"}, "words: request_text,", "block"),
])  # fmt: skip
def test_a_redact_rule_is_refused_only_for_the_path_and_headers_it_reads_but_credentials(
    path: str, headers: dict[str, str], state: str, action: str
) -> None:
    """The path was checked whatever the policy read, and the credential headers too: a card masked in the body was
    refused (422) because the path held a 19-digit id the card pattern matches, or because the caller's own key in
    ``authorization`` (read by ``has(subject.headers.authorization)``, which reads every header) matched. The path is
    checked where the state or rules read it; the credential headers, which the app is sent anyway, never are."""
    policies = load_text(CARDS.replace("state: {", "state: {" + state))
    subject = HttpSubject(method="POST", path=path, headers=headers, content_type="application/json",
                          body={"content": "charge my card 4111111111111111 please"})
    with guard.Guard(policies, backends=FixtureBackend({})) as judge:
        verdict = judge.evaluate(subject)
    assert (verdict.action, verdict.rule) == (action, "card")
    assert [(r.pointer, r.start, r.end) for r in verdict.redactions] == (
        [("/content", 15, 31)] if action == "redact" else [])  # fmt: skip


def test_a_refused_redact_rule_leaves_the_path_and_header_secret_out_of_the_log_and_span() -> None:
    """A request refused because its path held the key the rule masks kept that key in the decision log's
    ``input.path`` and the span's ``url.path`` (its body and query were withheld), and in a logged header it read;
    they are kept with what the rule's patterns match masked."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    lines: list[str] = []
    policies = load_text(KEYS.replace("RESPONSE", "").replace("'header:x-note'", "'header:user-agent'"))
    subject = HttpSubject(method="GET", path=f"/v1/notes/{SECRET}", headers={"user-agent": f"cli/{SECRET}"})
    with guard.Guard(policies, backends=FixtureBackend({}), decision_log=DecisionLog(lines.append),
                     telemetry=Telemetry(tracer_provider=provider)) as judge:
        verdict = judge.evaluate(subject)
    provider.shutdown()
    assert (verdict.action, verdict.status, verdict.message) == ("block", 422, verdicts.UNMASKABLE)
    (line,) = lines
    assert SECRET not in line
    assert json.loads(line)["input"]["path"] == "/v1/notes/[REDACTED:key]"
    assert json.loads(line)["input"]["headers"] == {"user-agent": "cli/[REDACTED:key]"}
    (span,) = exporter.get_finished_spans()
    assert span.attributes["url.path"] == "/v1/notes/[REDACTED:key]"


GENERIC = """
policies:
  - id: tokens
    version: 1
    match: {http: {RESPONSE}}
    rules:
      - id: internal
        when: 'subject.headers.exists(h, h.startsWith("x-internal-"))'
        action: allow
      - id: token
        when: 'subject.body_text.matches("[0-9a-f]{32}")'
        action: redact
        redact: {patterns: {token: '[0-9a-f]{32}'}}
"""
TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(("phase", "header", "action"), [
    ("request", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "redact"),  # a traceparent's trace id
    ("response", '"9e107d9d372bb6826bd81d3542a419d6"', "redact"),  # an md5 ETag
    ("request", f"note {TOKEN}", "block"),  # what the rule masks, in clear
    ("response", TOKEN, "block"),
])  # fmt: skip
def test_a_rule_that_may_read_any_header_is_refused_only_for_a_header_holding_what_it_masks(
    phase: str, header: str, action: str
) -> None:
    """A rule that reads header names (``subject.headers.exists(...)``) made every header's value count: a token
    masked in the body was refused (422), or a response blocked, because a traceparent or an ETag matched the token
    pattern. There a header counts where it holds what the rule masks in the body."""
    policies = load_text(GENERIC.replace("RESPONSE", "response: {}" if phase == "response" else ""))
    subject = HttpSubject(method="POST", path="/v1/notes", headers={"etag": header}, content_type="application/json",
                          body={"note": f"my token is {TOKEN}"}, phase=phase,  # type: ignore[arg-type]
                          status=200 if phase == "response" else None)
    with guard.Guard(policies, backends=FixtureBackend({})) as judge:
        verdict = judge.evaluate(subject)
    assert (verdict.action, verdict.rule) == (action, "token")
    assert [(r.pointer, r.start, r.end) for r in verdict.redactions] == ([("/note", 12, 44)] if action == "redact" else [])


def test_a_guard_that_raised_is_named_by_the_exceptions_type_only() -> None:
    """An agent's guard that raised put ``repr(exc)`` in the verdict's ``error`` (the span's ``guard.error`` and
    status description, the decision log's ``error``): an exception's text may quote the call it judged."""
    exc = KeyError("sk-live-0123456789 from the tool's arguments")
    verdict = verdicts.guard_failed(None, "closed", exc, decision_id="d", latency_ms=1.0)
    assert verdict.error == "guard_error: KeyError" and verdict.fail_mode == "closed"
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(tracer_provider=provider)
    with telemetry.span(AgentSubject(event="tool_call", tool_name="pay")) as span:
        telemetry.finish(span, verdict)
    assert "sk-live" not in exporter.get_finished_spans()[0].to_json()
