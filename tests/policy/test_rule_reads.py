"""A rule's ``state.`` and ``data.`` names are checked against what the policy defines when it loads (a
misspelt name would be a ``KeyError`` at run time, so a 503 on every request, while ``guard policy check`` said ok)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from guard.cli import main
from guard.errors import PolicyError
from guard.policy import load_text
from guard.policy.provenance import CALL_KEYS, RESULT_KEYS, call_features, result_features
from guard.policy.rules import field_reads

POLICY = """
policies:
  - id: p
    version: 1
    match: {http: {methods: [POST]}}
    state:
      text: body_text
      meta:
        fields: {route: path, tier: {from: header, name: x-tier}}
      limits: {const: {max: 3}}
    questions: {spam: {type: noul, instructions: "Is it spam?"}}
    rules:
      - id: r
        when: WHEN
        action: block
data:
  block_threshold: 0.85
  lists: {admins: [alice]}
"""


@pytest.mark.parametrize(
    "when",
    [
        'state.text.matches("buy now")',
        "state.meta.route.startsWith('/admin') && state.limits.max > 2",
        "spam.noul >= data.block_threshold && 'alice' in data.lists.admins",
        'state["meta"]["tier"] == "free" && has(state.text)',
    ],
)
def test_names_the_policy_defines_load(when: str) -> None:
    (policy,) = load_text(POLICY.replace("WHEN", repr(when) if '"' in when else when))
    assert policy.rules[0].source == when


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("state.txt.size() > 3", "reads state.txt, but the state has no field 'txt'; known names: limits, meta, text"),
        ("state.meta.rout == '/x'", ("reads state.meta.rout, but state.meta has no field 'rout'; known names: route, "
         "tier")),
        ("state.limits.min > 1", "reads state.limits.min, but state.limits has no field 'min'; known names: max"),
        ("spam.noul > data.block_treshold", ("reads data.block_treshold, but the file's data has no 'block_treshold'; "
         "known names: block_threshold, lists")),
        ("data.lists.admin.size() > 0", "reads data.lists.admin, but data.lists has no 'admin'; known names: admins"),
    ],
)  # fmt: skip
def test_a_misspelt_name_is_refused_with_file_line_key_and_the_known_names(when: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_text(POLICY.replace("WHEN", when), "p.yaml")
    assert (info.value.file, info.value.line, info.value.key) == ("p.yaml", 14, "policies[0].rules[0].when")
    assert info.value.reason == message


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("state.text.lowerAscii().contains('x')", "unknown function 'lowerAscii'; a rule may call code_exec, "),
        ("sqli(state.text, 'x')", "sqli() takes 1 argument, given 2"),
        ("confusable(state.text)", "confusable() takes 2 arguments, given 1"),
        ("spam.noul >= data.quoted", "fails on every request: TypeError: No such overload"),
        ("spam.noul", "fails on every request: 'when' returned float 0.5, not a boolean"),
        ("size(data.lists.admins) > data.quoted", "fails on every request: TypeError"),
    ],
)  # fmt: skip
def test_a_rule_that_would_fail_on_every_request_is_refused_at_load(when: str, message: str) -> None:
    """A function the runtime does not have, a wrong argument count, or a rule reading nothing of a request that
    fails on even answers (a quoted threshold) was a 503 on every request, and ``guard policy check`` said ok."""
    with pytest.raises(PolicyError) as info:
        load_text(POLICY.replace("WHEN", repr(when) if "'" not in when else f'"{when}"').replace(
            "  block_threshold: 0.85\n", '  block_threshold: 0.85\n  quoted: "0.85"\n'), "p.yaml")
    assert (info.value.file, info.value.line, info.value.key) == ("p.yaml", 14, "policies[0].rules[0].when")
    assert info.value.reason.startswith(message)


def test_a_rule_reading_the_request_is_not_run_at_load() -> None:
    """Only a rule that reads nothing of a request is run at load: one reading the state may fail on some requests
    only (a field some bodies lack) and loads."""
    (policy,) = load_text(POLICY.replace("WHEN", "state.meta.tier.startsWith('x') && spam.noul > data.block_threshold"))
    assert policy.rules[0].id == "r"


def test_the_default_state_is_what_a_policy_without_state_may_read() -> None:
    text = """
policies:
  - id: tools
    version: 1
    match: {agent: {events: [tool_call, tool_result]}}
    questions: {bad: {type: noul, instructions: "Bad?"}}
    rules:
      - {id: r, when: "state.tool_call.name == 'shell' || state.result != ''", action: block}
      - {id: s, when: "state.text == ''", action: block}
"""
    with pytest.raises(PolicyError, match=r"rules\[1\].when: reads state.text, but the state has no field 'text'; "
                       r"known names: result, task, tool, tool_call \(the default state"):  # fmt: skip
        load_text(text)


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ('spam.noul > 0.5 && subject.metod == "POST"', ("reads subject.metod, but subject has no 'metod'; known "
         "names: body, body_text, client, content_type, headers, host, kind, method, path, phase, query, query_string, repeated_headers, status")),
        ("flags.zero_widht > 0 && state.text != ''", "reads flags.zero_widht, but flags has no 'zero_widht'"),
        ('subject["tool_name"] == "x"', "reads subject.tool_name, but subject has no 'tool_name'"),
        # kept for the state's form check, only where qs may name a field otherwise: rules read the form in body
        ('subject.form_string != ""', "reads subject.form_string, but subject has no 'form_string'"),
        ("state.text.matches('(')", "the pattern '(' of matches() is not a valid regular expression"),
        ('matches(state.text, "[")', "matches() is a method in this runtime: write x.matches(...)"),
        ("startsWith(state.text, 'a')", "startsWith() is a method in this runtime"),
    ],
)
def test_flag_subject_names_and_patterns_are_checked_at_load(when: str, message: str) -> None:
    """A misspelt flag or subject field, or a pattern the engine cannot run, fails every request it reaches (a 503,
    or an allow under on_error: open); also when the rule reads the state, so it cannot be run once at load."""
    with pytest.raises(PolicyError, match=re.escape(message)):
        load_text(POLICY.replace("WHEN", repr(when) if '"' in when else when))
    (ok,) = load_text(POLICY.replace("WHEN", "flags.zero_width > 0 && subject.method == 'POST' && "
                                              "state.text.matches('^(?i)buy') && state.text. contains('a')"))
    assert ok.rules[0].id == "r"


@pytest.mark.parametrize(
    ("when", "name", "where"),
    [
        ('subject.headers["X-Tier"] == "free"', "X-Tier", "headers"),
        ("has(subject.headers.X_Tier)", "X_Tier", "headers"),
        ("'X-Api-Key' in subject.headers", "X-Api-Key", "headers"),
        ('spam.noul > 0.5 && "Cookie" in subject.repeated_headers', "Cookie", "repeated_headers"),
    ],
)
def test_a_header_name_in_upper_case_is_refused(when: str, name: str, where: str) -> None:
    """Header names are lower-cased: ``subject.headers["X-Tier"]`` was a missing key, so a 503, on every request
    (and ``"X-Tier" in subject.headers`` never held) while ``guard policy check`` said ok."""
    with pytest.raises(PolicyError) as info:
        load_text(POLICY.replace("WHEN", repr(when) if '"' in when else f'"{when}"'), "p.yaml")
    assert (info.value.line, info.value.key) == (14, "policies[0].rules[0].when")
    written = name.lower().replace("_", "-")  # a header spelled with _ is read as a copy of the - name
    assert info.value.reason == (f"reads the header {name!r} of subject.{where}, whose names are lower-case: no "
                                 f"request has it; write {written!r}")
    fixed = f"{written!r} in subject.headers" if when.startswith("has(") else when.replace(name, written)
    assert load_text(POLICY.replace("WHEN", repr(fixed) if '"' in fixed else f'"{fixed}"'))


AGENT = """
policies:
  - id: a
    version: 1
    match: {agent: {events: [tool_call, tool_result]}}
    rules: [{id: r, when: WHEN, action: block}]
    default: allow
"""


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("call.flaged_results > 0", "reads call.flaged_results, but call has no 'flaged_results'"),
        ("result.instructons > 0", "reads result.instructons, but result has no 'instructons'"),
        ("subject.path == '/'", "reads subject.path, but subject has no 'path'"),
    ],
)
def test_call_and_result_names_are_checked_at_load(when: str, message: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(message)):
        load_text(AGENT.replace("WHEN", when))
    assert load_text(AGENT.replace("WHEN", "call.flagged_results > 0 || result.instructions > 0 || "
                                           "subject.tool_name == 'x'"))


def test_the_checked_call_and_result_keys_are_those_rules_get() -> None:
    call = call_features("pay", {"to": "bob"}, (), tools={})
    assert set(call) == CALL_KEYS
    assert set(result_features("text")) == RESULT_KEYS


def test_reads_are_found_outside_strings_and_stop_at_calls() -> None:
    assert field_reads('"state.x" == state.y.lowerAscii() && data["k"].v') == [
        ("state", ("y",)), ("data", ("k", "v"))
    ]
    assert field_reads("[1].exists(state, state > 0)") == []
    assert field_reads("[1].existsOne(state, state > 0)") == []


def test_policy_check_reports_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY.replace("WHEN", "state.txt.size() > 3"))
    assert main(["policy", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"{path}:14: policies[0].rules[0].when: reads state.txt, but the state has no field 'txt'; known names: "
        "limits, meta, text"
    )


FIXED = """
policies:
  - id: h
    version: 1
    match: {http: {}}
    state: {m: method, ct: content_type, nested: {fields: {h: host}}, named: {from: host, default: Unknown}}
    rules: [{id: r, when: WHEN, action: block}]
    default: allow
  - id: a
    version: 1
    match: {agent: {}}
    state: {ev: event}
    rules: [{id: r, when: AGENT, action: block}]
    default: allow
"""


_EVENTS = "one of tool_call, tool_result, model_input, model_output; check the spelling"
_EFFECTS = "one of read_only, side_effecting, unknown; check the spelling"


@pytest.mark.parametrize(
    ("when", "agent", "reason"),
    [
        ('subject.method == "post"', "", ("subject.method with \"post\", which it never is: subject.method is "
         "upper-case; write 'POST'")),
        ('"Get" != subject.method', "", ("subject.method with \"Get\", which it never is: subject.method is "
         "upper-case; write 'GET'")),
        ('state.m in ["POST", "put"]', "", ("state.m with \"put\", which it never is: state.m is upper-case; "
         "write 'PUT'")),
        ('state.ct == "Application/JSON"', "", ("state.ct with \"Application/JSON\", which it never is: "
         "state.ct is lower-case; write 'application/json'")),
        ('subject.content_type.startsWith("Text/")', "", ("subject.content_type with \"Text/\", which it "
         "never starts with: subject.content_type is lower-case; write 'text/'")),
        ('subject.host == "API.example.com"', "", ("subject.host with \"API.example.com\", which it never "
         "is: subject.host is lower-case; write 'api.example.com'")),
        ('subject.host == "API.example.com:8443"', "", ("subject.host with \"API.example.com:8443\", which it "
         "never is: subject.host is lower-case, has no port; write 'api.example.com'")),
        ('subject.host in ["a.example.com", "localhost:8080"]', "", ("subject.host with \"localhost:8080\", which "
         "it never is: subject.host has no port; write 'localhost'")),
        ('state.nested.h != "api.example.com."', "", ("state.nested.h with \"api.example.com.\", which it never is: "
         "state.nested.h has no trailing dot; write 'api.example.com'")),
        ('subject.host == "[FE80::1]:443"', "", ("subject.host with \"[FE80::1]:443\", which it never is: "
         "subject.host is lower-case, has no port; write '[fe80::1]'")),
        ('subject.content_type == "application/json; charset=UTF-8"', "", ("subject.content_type with "
         "\"application/json; charset=UTF-8\", which it never is: subject.content_type has no parameters; "
         "write 'application/json'")),
        ('state.ct in ["Text/Plain; charset=utf-8"]', "", ("state.ct with \"Text/Plain; charset=utf-8\", which it "
         "never is: state.ct is lower-case, has no parameters; write 'text/plain'")),
        ('state.nested.h.endsWith(".Example.com")', "", ("state.nested.h with \".Example.com\", which it "
         "never ends with: state.nested.h is lower-case; write '.example.com'")),
        ("", 'subject.event == "toolcall"', f'subject.event with "toolcall", which it never is: subject.event is {_EVENTS}'),
        ("", 'state.ev in ["tool_call", "tool-result"]', f'state.ev with "tool-result", which it never is: state.ev is {_EVENTS}'),
        ("", 'call.effect == "sideeffecting"', f'call.effect with "sideeffecting", which it never is: call.effect is {_EFFECTS}'),
        ("", 'subject.tool_effect.startsWith("side-")', ("subject.tool_effect with \"side-\", which it never starts "
         f"with: subject.tool_effect is {_EFFECTS}")),
    ],
)
def test_a_literal_that_a_normalised_or_fixed_value_never_is_is_refused(when: str, agent: str, reason: str) -> None:
    """Methods are upper-case, media types lower-case without parameters, hosts lower-case without port or trailing
    dot, events and tool effects a few fixed names: a rule comparing one (or a state field read from one) with
    another spelling never held, yet loaded, and the error names the spelling that does."""
    text = FIXED.replace("WHEN", repr(when or "false")).replace("AGENT", repr(agent or "false"))
    with pytest.raises(PolicyError) as info:
        load_text(text, "p.yaml")
    assert (info.value.line, info.value.key) == ((7, "policies[0].rules[0].when") if when
                                                 else (13, "policies[1].rules[0].when"))
    assert info.value.reason == f"compares {reason}"


@pytest.mark.parametrize("when", [
    'subject.method == "POST" || state.m in ["PUT", "M-SEARCH"] || subject.method.startsWith("P")',
    'state.ct == "application/json" || subject.host.endsWith(".example.com") || state.nested.h != "a.b"',
    'state.named == "Unknown"',  # a field with a default may hold it
    'subject.host in ["api.example.com", "[fe80::1]", "fe80::1", "localhost"] || state.nested.h != "10.0.0.1"',
    'subject.content_type == "application/json" || subject.content_type.startsWith("application/")',
    'state.ct.contains("json") || subject.host.startsWith("api.") || subject.host.endsWith(".example.com")',
    'subject.path == "/Admin" || subject.headers["x-mode"] == "POST" || state.ct == "a\\u0041"',
    'subject.method + "x" == "postx"',  # not the whole operand: not read
])
def test_a_literal_a_normalised_value_may_be_loads(when: str) -> None:
    assert load_text(FIXED.replace("WHEN", repr(when)).replace("AGENT", repr(
        'subject.event == "tool_call" && call.effect in ["read_only", "side_effecting"] && state.ev != "model_input"')))


def test_check_names_the_file_line_and_key_of_a_literal_a_method_never_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "m.yaml"
    policy.write_text(FIXED.replace("WHEN", repr('subject.method == "post"')).replace("AGENT", "'false'"))
    assert main(["policy", "check", str(policy)]) == 1
    assert (f"{policy}:7: policies[0].rules[0].when: compares subject.method with \"post\", which it never is: "
            "subject.method is upper-case; write 'POST'") in capsys.readouterr().err
