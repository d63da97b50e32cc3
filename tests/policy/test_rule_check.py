"""A rule that fails on every request because of the types of what it reads (``state.text > 5``, ``subject.path``
as a condition) is refused at load, naming the types; a rule that fails only on some values, or reads values whose
type the request picks, loads (``guard/policy/rule_check.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import cel
import pytest

from guard.cli import main
from guard.errors import PolicyError
from guard.policy import load_text
from guard.policy._compare import RECORD, instrumented

HTTP = """
policies:
  - id: p
    version: 1
    match: {http: {methods: [POST]}}
    state:
      text: body_text
      tier: {from: header, name: x-tier}
      plan: {from: header, name: x-plan, default: 0}
      tags: {from: query, name: tag, repeated: list}
      payload: {from: body, pointer: /amount}
      meta:
        fields: {route: path, size: {const: 3}}
    questions: {spam: {type: noul, instructions: "Is it spam?"}}
    rules:
      - id: r
        when: WHEN
        action: block
"""

ZERO = "divides by zero on every request (state.text is a string): ZeroDivisionError: {} by zero in CEL expression"
OVERLOAD = "TypeError: No such overload: the operation is not defined for the given operand types"


def typed(types: str, failure: str = OVERLOAD) -> str:
    return f"fails on the types it reads ({types}): {failure}"


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("state.text > 5", typed("state.text is a string")),
        ("subject.path", typed("subject.path is a string", "'when' returned str, not a boolean")),
        ("state.text || spam.noul > 0.9", typed("state.text is a string")),
        ("state.tier > 3", typed("state.tier is a string or null")),
        ('subject.headers["content-length"] > 1000', typed('subject.headers["content-length"] is a string')),
        ("state.tags > 3", typed("state.tags is a list or null")),
        ("sqli(state.meta.size)", typed("state.meta.size is an int", "RuntimeError: Function 'sqli' error: Python "
                                        "function call failed: TypeError: sqli() takes a string, got int")),
        ("state.meta.route.size() > '3'", typed("state.meta.route is a string")),
        ("state.text.size() >= 0 && state.text > 3", typed("state.text is a string")),
        ("size(state.text) / 0 > 1", ZERO.format("division")),
        ("size(state.text) % 0 == 1", ZERO.format("modulo")),
    ],
)  # fmt: skip
def test_a_rule_whose_types_fail_on_every_request_is_refused(when: str, message: str) -> None:
    """Each of these was a 503 (or the fail mode's verdict) on every request while ``guard policy check`` said ok."""
    with pytest.raises(PolicyError) as info:
        load_text(HTTP.replace("WHEN", repr(when) if "'" not in when else f'"{when}"'), "p.yaml")
    assert (info.value.file, info.value.line, info.value.key) == ("p.yaml", 17, "policies[0].rules[0].when")
    assert info.value.reason == message


@pytest.mark.parametrize(
    "when",
    [
        "state.tier.size() > 3",  # a string or null: works whenever the header is sent
        "state.plan > 3",  # a string or its default 0: works when the header is missing
        "int(state.tier) > 5",  # fails on some values only
        "state.payload > 5",  # the body's JSON type is the client's
        'subject.headers["x-a"] == "b" && subject.method == "POST"',
        "state.tags.exists(t, t == 'x') || spam.noul > 0.5",
        "subject.status >= 500 || state.text.contains('x')",  # status is null for requests: false || ... absorbs
        "state.text.size() > 3 && state.meta.size > 2",
        "type(state.payload) == string && state.payload > 'a'",
        "100 / size(state.text) > 1",  # by zero for the empty text only
    ],
)
def test_a_rule_that_can_work_on_some_request_loads(when: str) -> None:
    (policy,) = load_text(HTTP.replace("WHEN", repr(when) if "'" not in when else f'"{when}"'))
    assert policy.rules[0].source == when


NEVER = "is always {}: it compares {} with {}, and CEL finds no value of one type equal to a value of another"
TYPED = HTTP.replace("questions: {spam: {type: noul, instructions: \"Is it spam?\"}}", """questions:
      queue: {type: choice, instructions: "Which?", criteria: {billing: a, tech: b}}
      sev: {type: score, instructions: "How bad?", criteria: [lo, mid, hi]}
      spam: {type: noul, instructions: "Is it spam?"}""").replace("policies:", 'data: {t: "0.9", levels: [1, 2]}\npolicies:')


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("spam.noul == true", "'spam.noul == true' " + NEVER.format("false", "a double", "a bool")),
        ('spam.noul == "0.9" || spam == 0.9', "'spam.noul == \"0.9\"' " + NEVER.format("false", "a double", "a string")),
        ("spam == 0.9", "'spam == 0.9' " + NEVER.format("false", "a map", "a double")),
        ("spam.noul != data.t", "'spam.noul != data.t' " + NEVER.format("true", "a double", "a string")),
        ("queue.choice == 0", "'queue.choice == 0' " + NEVER.format("false", "a string", "an int")),
        ('queue == "billing"', "'queue == \"billing\"' " + NEVER.format("false", "a map", "a string")),
        ('sev.score == "hi"', "'sev.score == \"hi\"' " + NEVER.format("false", "a double", "a string")),
        ('queue.probabilities["tech"] == true', "is always false: it compares a double with a bool"),
        ("state.tier == 1", "'state.tier == 1' " + NEVER.format("false", "a string", "an int")),
        ("state.tier != 1", "'state.tier != 1' " + NEVER.format("true", "a string", "an int")),
        ('subject.query.tier == "free"', "'subject.query.tier == \"free\"' " + NEVER.format("false", "a list",
                                                                                               "a string")),
        ('state.tags == "a"', "it compares a list with a string"),
        ("state.tier in [1, 2]", "'state.tier in [1, 2]' is always false: it looks for a string in a list of int"),
        ("state.tier in data.levels", "it looks for a string in a list of int values"),
        ("subject.method == 1 || state.text.contains('x')", "'subject.method == 1' is always false"),
        ("spam.noul > 0.5 && state.tier != 1", "'state.tier != 1' is always true"),  # not reached on even answers
        ("[1, 2].exists(v, v == state.tier)", "'v == state.tier' is always false: it compares an int with a string"),
    ],
)  # fmt: skip
def test_a_comparison_of_two_types_is_refused(when: str, message: str) -> None:
    """CEL answers ``false`` for ``==`` between values of two types (``true`` for ``!=``) instead of an error: each
    of these never fired (or always did) while ``guard policy check`` said ok."""
    with pytest.raises(PolicyError) as info:
        load_text(TYPED.replace("WHEN", repr(when) if "'" not in when else f'"{when}"'), "p.yaml")
    assert (info.value.file, info.value.key) == ("p.yaml", "policies[0].rules[0].when")
    assert message in info.value.reason


@pytest.mark.parametrize(
    "when",
    [
        "state.tier == null || state.tier == 'free'",
        "state.plan == 0 || state.plan == 'x'",  # a header or its default 0: both can hold
        '"free" in subject.query.tier && subject.status == 200',
        "state.payload == 1 || state.payload == 'x'",  # the body's JSON type is the client's: not run
        "type(state.tier) == string && spam.noul == 0.5 && queue.choice != 'tech'",
        "[1, 'a'].exists(v, v == state.tier)",
        "int(state.tier) in [1, 2] && sev.score == 2.0",
        "spam.noul == 1",  # an int and a double compare
    ],
)
def test_a_comparison_of_one_type_loads(when: str) -> None:
    (policy,) = load_text(TYPED.replace("WHEN", repr(when) if "'" not in when else f'"{when}"'))
    assert policy.rules[0].source == when


def test_a_source_of_another_kind_of_subject_reads_as_its_default() -> None:
    """A policy matching HTTP and agent events renders ``path`` as missing (null or the default) for agent events."""
    both = """
policies:
  - id: p
    version: 1
    match: {http: {}, agent: {events: [model_input]}}
    state: {route: path, said: text}
    rules: [{id: r, when: WHEN, action: block}]
    default: allow
"""
    assert load_text(both.replace("WHEN", "state.route.startsWith('/a') || state.said.contains('x')"))
    with pytest.raises(PolicyError, match=re.escape(typed("state.route is a string or null"))):
        load_text(both.replace("WHEN", "state.route > 1"))


def test_default_states_are_typed_per_subject() -> None:
    """Without a ``state`` block, each kind of event renders its own default state; a response policy's holds the
    status (it could not be read: the name check used the request's default state)."""
    response = """
policies:
  - id: r
    version: 1
    match: {http: {response: {}}}
    rules: [{id: s, when: WHEN, action: block}]
    default: allow
"""
    assert load_text(response.replace("WHEN", "state.status >= 500"))
    with pytest.raises(PolicyError, match=re.escape(typed("state.status is an int or null",
                                                         "startsWith() is not defined for the type of its value"))):
        load_text(response.replace("WHEN", "state.status.startsWith('5')"))
    with pytest.raises(PolicyError, match="reads state.method, but the state has no field 'method'"):
        load_text(response.replace("WHEN", "state.method == 'GET'"))
    agent = """
policies:
  - id: a
    version: 1
    match: {agent: {events: [model_input, model_output]}}
    rules: [{id: s, when: WHEN, action: block}]
    default: allow
"""
    assert load_text(agent.replace("WHEN", "state.text.contains('x') || state.task == 'x'"))
    with pytest.raises(PolicyError, match=re.escape(typed("state.text is a string or null"))):
        load_text(agent.replace("WHEN", "state.text > 3"))


def test_policy_check_says_it_without_the_runtime_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(HTTP.replace("WHEN", "sqli(state.meta.size)"))
    assert main(["policy", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:17: policies[0].rules[0].when: fails on the types it reads (state.meta.size is ")
    assert "Python function 'sqli' failed" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "when",
    [
        "// don't let big refunds through\nstate.payload > 1000 || state.meta.route.endsWith('.php')",
        'state.tier.contains(r"..\\") || state.payload > 1000 || state.tier.endsWith(".exe")',
        "state.text == '''it's''' || state.payload > 1000",
    ],
)
def test_a_quote_in_a_comment_or_a_raw_string_hides_no_read(when: str) -> None:
    """A ``'`` in a ``//`` comment or a raw string ending in ``\\`` made the text scan miss the reads after it, and
    the rule was run with the body's value as null: refused, though it works on requests."""
    policy = HTTP.replace("        when: WHEN", "        when: |\n" + "".join(f"          {line}\n" for line in
                                                                        when.splitlines())).rstrip()
    (loaded,) = load_text(policy)
    assert loaded.rules[0].source.strip() == when


def test_a_rule_reading_many_fields_loads_at_once() -> None:
    """Each header read is a string or null: a rule reading 26 of them has 2**26 combinations, which were all
    built (tens of GB) before the cap on runs was applied."""
    names = [f"h{i}" for i in range(26)]
    fields = "".join(f"      {n}: {{from: header, name: x-{n}}}\n" for n in names)
    when = " || ".join(f'state.{n} == "a"' for n in names)
    text = ("policies:\n  - id: p\n    version: 1\n    match: {http: {}}\n    state:\n" + fields +
            f"    rules:\n      - {{id: r, when: '{when}', action: block}}\n    default: allow\n")
    (loaded,) = load_text(text)
    assert loaded.rules[0].id == "r"


@pytest.mark.parametrize(
    "when",
    [
        'a == 1 ? b != "x" : [1, 2,].exists(v, v == a) // c == d',
        "!(a == 1) && {'k': a in [1]}['k'] == true",
        "a < 2 == true || -a == -1 && b.size() == 1 && r'\\d' != b'x'",
        'b.matches("^y$") == false && .a in [1] && m.x.y == "z"',
    ],
)
def test_a_rewritten_when_has_the_value_of_the_when(when: str) -> None:
    """The rule check runs each ``when`` rewritten to report what its comparisons compare: the rewriting keeps the
    value (operator precedence, macros, maps, comments, raw strings)."""
    found = instrumented(when)
    assert found is not None
    text, comparisons = found
    seen: list[tuple[int, object, object]] = []
    for variables in ({"a": 1, "b": "y", "m": {"x": {"y": "z"}}}, {"a": 2, "b": "x", "m": {"x": {"y": "w"}}}):
        context = cel.Context(variables=variables)
        context.add_function(RECORD, lambda index, left, right: seen.append((index, left, right)) or True)
        assert cel.compile(text).execute(context) == cel.compile(when).execute(cel.Context(variables=variables))
    assert seen and {index for index, _, _ in seen} <= set(range(len(comparisons)))


@pytest.mark.parametrize(
    "when",
    [
        "(" * 90 + "spam.noul > 0.5" + ")" * 90,
        "!(" * 90 + "spam.noul > 0.5" + ")" * 90,
        "[" * 90 + "spam.noul" + "]" * 90 + " == " + "[" * 90 + "0.5" + "]" * 90,
        "double(" * 90 + "spam.noul" + ")" * 90 + " > 0.5",
        '{"k": ' * 90 + "spam.noul" + "}" * 90 + " == " + '{"k": ' * 90 + "0.5" + "}" * 90,
    ],
)
def test_a_when_nested_as_deep_as_allowed_loads(when: str) -> None:
    """90 nested brackets (as deep as the CEL parser reads) of any shape load: the rewriting parser of the rule
    check recursed past Python's limit and the loader raised RecursionError, naming no file, line or key."""
    (loaded,) = load_text(HTTP.replace("WHEN", f"'{when}'"))
    assert loaded.rules[0].source == when


def test_a_when_whose_rewriting_is_too_long_for_the_runtime_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewriting repeats each comparison's left operand: a chain of 200 ``== true`` (1,620 characters) became
    173,566, on which the CEL runtime panics (a PanicException, not a ValueError) and the loader died. Such a
    rewriting is not compiled; one the runtime panics on anyway is not checked either."""
    from guard.policy import rule_check

    when = "spam.noul == spam.noul" + " == true" * 200
    (loaded,) = load_text(HTTP.replace("WHEN", f"'{when}'"))
    assert loaded.rules[0].source == when
    monkeypatch.setattr(rule_check, "_MAX_REWRITTEN", 10**9)
    (loaded,) = load_text(HTTP.replace("WHEN", f"'{when}'"))
    assert loaded.rules[0].source == when
    assert rule_check._compiled("1 + " + " " * 70_000 + ")") is None


def test_the_subject_types_rules_are_checked_against_are_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``typing.get_type_hints`` ran for every field of the subject class for every policy: loading 500 policies
    spent most of its 6 s there."""
    import typing

    calls = []
    real = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    one = "  - {id: p%d, version: '1', match: {http: {}}, rules: [{id: r, when: 'subject.path == \"/x\"', action: block}]}\n"
    load_text("policies:\n" + "".join(one % i for i in range(40)))
    assert len(calls) < 40
