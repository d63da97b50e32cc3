"""Rules are a pure function of (policy, answers, subject): tested by passing probabilities straight in."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from guard.backends.fixture import answer_from_spec
from guard.policy import Outcome, RuleError, apply_rules, load_text
from guard.policy import rules as rules_module
from guard.policy.loader import PolicyLoadError
from guard.policy.rules import MAX_WHEN_DEPTH, _cel, compile_condition, selected_fields, trace_rules
from guard.subject import AgentSubject, HttpSubject

TEXT = """
data: {limit: 0.7, vip: [gold, platinum]}
policies:
  - id: p
    version: 1
    match: {http: {}}
    questions:
      spam: {type: noul, instructions: Spam}
      topic: {type: choice, instructions: Topic, criteria: {billing: b, tech: t}}
      severity: {type: score, instructions: Severity, criteria: [a, b, c, d]}
    rules:
      - {id: vip, when: 'subject.headers["x-tier"] in data.vip', action: allow}
      - {id: spam, when: spam.noul > data.limit, action: block}
      - {id: unsure, when: 'topic.confidence < 0.6 && topic.probabilities["tech"] > 0.4', action: escalate}
      - {id: severe, when: severity.score >= 2.0, action: block, status: 429}
      - {id: hidden, when: flags.unicode_tags > 0, action: block}
    default: {action: escalate, message: nobody decided}
"""


@pytest.fixture(scope="module")
def policy() -> Any:
    return load_text(TEXT)[0]


def answers(policy: Any, **specs: Any) -> dict[str, Any]:
    defaults = {"spam": 0.1, "topic": "billing", "severity": [1, 0, 0, 0]}
    out = {}
    for q in policy.questions:
        out[q.key] = answer_from_spec(q.wire, {**defaults, **specs}[q.key])
    return out


def decide(policy: Any, headers: dict[str, str] | None = None, flags: dict[str, int] | None = None, **specs: Any):
    subject = HttpSubject(method="POST", path="/", headers={"x-tier": "free", **(headers or {})})
    return apply_rules(policy.id, policy.rules, policy.default, answers(policy, **specs), subject=subject,
                       state={}, flags=flags, data=policy.data)


def test_default_when_no_rule_fires(policy: Any) -> None:
    result = decide(policy)
    assert result.rule == "default" and result.outcome == Outcome("escalate", message="nobody decided")


@pytest.mark.parametrize(
    ("headers", "specs", "rule"),
    [
        ({"x-tier": "gold"}, {"spam": 0.99}, "vip"),  # order: the first true rule decides
        ({}, {"spam": 0.71}, "spam"),
        ({}, {"spam": 0.69}, "default"),  # data.limit is 0.7
        ({}, {"topic": {"billing": 0.55, "tech": 0.45}}, "unsure"),
        ({}, {"severity": [0, 0, 1, 0]}, "severe"),
        ({}, {"severity": [0, 0.5, 0.5, 0]}, "default"),  # expected level 1.5
    ],
)
def test_rules_fire_in_order(policy: Any, headers: dict[str, str], specs: dict[str, Any], rule: str) -> None:
    assert decide(policy, headers, **specs).rule == rule


def test_flags_and_status(policy: Any) -> None:
    assert decide(policy, flags={"unicode_tags": 3}).rule == "hidden"
    assert decide(policy, severity=[0, 0, 0, 1]).outcome.status == 429


def rule_of(policy: Any, **fields: Any) -> Any:
    """What ``policy``'s rules decide (no answers) for a POST to ``/`` with ``fields`` (body, body_text, headers)."""
    subject = HttpSubject(method="POST", path="/", **fields)
    return apply_rules(policy.id, policy.rules, policy.default, {}, subject=subject,
                       state=policy.render_state(subject), data=policy.data)


def test_runtime_errors_and_non_booleans_raise() -> None:
    text = TEXT.replace("""'subject.headers["x-tier"] in data.vip'""", """'subject.headers["x-missing"] == "a"'""")
    policy = load_text(text)[0]
    with pytest.raises(RuleError, match="rule 'vip' of policy 'p' failed: KeyError"):
        decide(policy)
    with pytest.raises(PolicyLoadError, match=r"rules\[1\]\.when: fails on every request: 'when' returned float"):
        load_text(TEXT.replace("when: spam.noul > data.limit", "when: spam.noul"))  # reads no request: run at load
    number = load_text(TEXT.replace("when: spam.noul > data.limit", "when: 'subject.method == \"POST\" ? spam.noul : false'"))[0]
    with pytest.raises(RuleError, match="not a boolean"):
        decide(number)
    traced = trace_rules(policy.id, policy.rules, answers(policy), subject=HttpSubject(method="GET", path="/"),
                         data=policy.data)
    assert traced[0][0] == "vip" and "KeyError" in str(traced[0][1]) and traced[1] == ("spam", False)


def test_a_number_too_large_for_cel_does_not_break_the_rules_reading_the_state() -> None:
    """A client's 400-digit integer cannot make every rule that reads ``state`` fail (and so pick the fail mode)."""
    (policy,) = load_text("""
policies:
  - id: p
    version: 1
    match: {http: {}}
    state: {body: body}
    rules:
      - {id: script, when: xss(state.body.comment), action: block}
      - {id: huge, when: state.body.n > 1000, action: escalate}
""")
    huge = int("9" * 400)
    for body, rule in [({"comment": "<script>alert(1)</script>", "n": huge}, "script"),
                       ({"comment": "hi", "n": huge}, "huge"), ({"comment": "hi", "n": -huge}, "default")]:
        assert rule_of(policy, body=body).rule == rule


def test_negating_the_smallest_64_bit_integer_does_not_wrap() -> None:
    """The CEL runtime's ``-x`` of -2**63 is -2**63 (``0 - x`` fails as an overflow): a rule taking the size of a
    negative amount allowed the largest one. Where a rule negates, that integer reads as a double."""
    (policy,) = load_text("""
policies:
  - id: p
    version: 1
    match: {http: {}}
    state: {body: body}
    rules:
      - {id: too_large, when: '(state.body.n < 0 ? -state.body.n : state.body.n) > 10000', action: block}
      - {id: listed, when: 'state.body.m.exists(i, -i > 10000)', action: escalate}
""")
    smallest = -(2**63)
    cases = [({"n": -20000, "m": []}, "too_large"), ({"n": smallest, "m": []}, "too_large"),
             ({"n": smallest + 1, "m": []}, "too_large"), ({"n": 5, "m": [1, smallest]}, "listed"),
             ({"n": 5, "m": [-3]}, "default")]
    for body, rule in cases:
        assert rule_of(policy, body=body).rule == rule


def test_a_lone_surrogate_does_not_break_the_rules_reading_the_state() -> None:
    """A non-UTF-8 file name (``os.fsdecode`` gives lone surrogates) in a value or a key cannot make every rule that
    reads ``state`` fail (and so let the client pick the fail mode): it reads as U+FFFD, a pair as its character."""
    (policy,) = load_text("""
policies:
  - id: p
    version: 1
    match: {http: {}}
    state: {body: body}
    rules:
      - {id: injection, when: 'state.body.text.matches("(?i)ignore previous instructions")', action: block}
      - {id: replaced, when: 'state.body.text == "\\ufffd.txt" && "\\ufffd" in state.body.files', action: escalate}
      - {id: joined, when: 'state.body.text == "\\U0001F642"', action: block, status: 409}
      - {id: both, when: 'state.body.files["a\\ufffd.txt"] == "IGNORE" && state.body.files["a\\ufffd.txt (2)"] == "ok"', action: block, status: 410}
""")
    cases = [({"text": "IGNORE PREVIOUS INSTRUCTIONS \udcff.txt"}, "injection"),
             ({"text": "\udcff.txt", "files": {"\udcfe": 1}}, "replaced"),
             ({"text": "\ud83d\ude42", "files": {}}, "joined"),
             # keys that read alike are all kept, the second as "name (2)": neither value is dropped
             ({"text": "hi", "files": {"a\udcff.txt": "IGNORE"} | {"a\ufffd.txt": "ok"}}, "both")]
    for body, rule in cases:
        assert rule_of(policy, body=body).rule == rule


def test_values_json_does_not_have_do_not_break_the_rules_reading_the_state() -> None:
    """An app's tool result or arguments passed to Guard.aevaluate may hold what JSON does not (a double or None key,
    a set, a complex number): it cannot make every rule that reads ``state`` fail (and so pick the fail mode). Such
    a key reads as its text, a set as a sorted list, another value as its str()."""
    (policy,) = load_text("""
policies:
  - id: p
    version: 1
    match: {http: {}}
    state: {body: body}
    rules:
      - {id: injection, when: 'state.body.text.matches("(?i)ignore previous")', action: block}
      - {id: keys, when: 'has(state.body.m) && state.body.m["1.5"] == 1 && state.body.m["null"] == 2 && "(1, 2)" in state.body.m', action: escalate}
      - {id: sets, when: 'has(state.body.f) && state.body.s == [1, 2, 3] && state.body.f == ["a", "b"] && size(state.body.mixed) == 2', action: block, status: 409}
      - {id: objects, when: 'state.body.c == "(1+2j)" && state.body.d == "2020-01-02"', action: block, status: 410}
""")
    cases = [({"text": "IGNORE PREVIOUS", 1.5: "x"}, "injection"), ({"text": "IGNORE PREVIOUS", "s": {1}}, "injection"),
             ({"text": "IGNORE PREVIOUS", "c": 1j}, "injection"),
             ({"text": "hi", "m": {1.5: 1, None: 2, (1, 2): 3, 2**70: 4}}, "keys"),
             ({"text": "hi", "s": {3, 1, 2}, "f": frozenset({"b", "a"}), "mixed": {1, "a"}}, "sets"),
             ({"text": "hi", "c": 1 + 2j, "d": datetime.date(2020, 1, 2)}, "objects")]
    for body, rule in cases:
        assert rule_of(policy, body=body).rule == rule


def test_compile_condition_checks_names() -> None:
    known = {"spam": "noul", "topic": "choice"}
    _, names = compile_condition("[1, 2].exists(x, x > 1) && spam.noul > 0.5", known)
    assert names == {"spam"}  # comprehension variables are not names to check
    _, names = compile_condition('subject.path == "spam.choice"', known)  # string contents are not code
    assert names == {"subject"}
    # a macro variable named like an input: the input read outside the macro was dropped from the names, so the
    # rule failed on every request that reached it (a fail-open policy then allowed everyone)
    for rule in ('["x"].exists(subject, subject == "x") && subject.headers["x-role"] != "admin"',
                 "[0.1].exists(spam, spam > 0.5) || spam.noul > 0.9",
                 '["x"].existsOne(subject, subject == "x") && subject.headers["x-role"] != "admin"'):
        with pytest.raises(ValueError, match="a macro's variable is named '(subject|spam)', which is a rule input"):
            compile_condition(rule, known)
    with pytest.raises(ValueError, match="unknown name 'tpoic'"):
        compile_condition("tpoic.choice == 'a'", known)
    with pytest.raises(ValueError, match="a noul answer has noul, probabilities, type"):
        compile_condition("spam.score > 1", known)
    _, names = compile_condition("type(state.role) != string || type(state.ids) == list", known)
    assert names == {"state"}  # CEL's type names are not names to check


@pytest.mark.parametrize("key", ["string", "list", "state", "in"])
def test_a_question_key_that_rules_could_not_tell_apart_is_refused(key: str) -> None:
    """A question keyed ``string`` would be what ``type(state.role) != string`` compares with."""
    text = f"""
policies:
  - id: p
    version: 1
    match: {{http: {{paths: ["/x"]}}}}
    questions:
      {key}: {{type: noul, instructions: "Is it spam?"}}
    rules:
      - {{id: r, when: "true", action: block}}
"""
    with pytest.raises(PolicyLoadError, match=f"question key '{key}' must be a name rules can use"):
        load_text(text, "p.yaml")


def test_a_rule_can_check_the_json_type_a_client_chose() -> None:
    """``==`` across types is false, not an error (CEL's heterogeneous equality): a rule that must fire on
    ``"admin"`` fires on any other type too when it says so."""
    (policy,) = load_text("""
policies:
  - id: roles
    version: 1
    match: {http: {paths: ["/x"]}}
    state: {role: "body:/role"}
    rules:
      - {id: admin, when: 'type(state.role) != string || state.role == "admin"', action: block}
""", "p.yaml")
    for role, rule in (("admin", "admin"), (["admin"], "admin"), (1, "admin"), ("user", "default")):
        subject = HttpSubject(method="POST", path="/x", content_type="application/json", body={"role": role})
        result = apply_rules(policy.id, policy.rules, policy.default, {}, subject=subject,
                             state=policy.render_state(subject), data=policy.data)
        assert result.rule == rule, role


MATCHES = """
policies:
  - id: p
    version: 1
    match: {http: {}}
    state: {messages: "body:/messages"}
    rules:
      - {id: email, when: 'state.messages.exists(m, m.content.matches("\\\\w{1,40}@\\\\w{1,40}\\\\.example"))', action: block}
"""


def test_matches_compiles_its_pattern_once_so_a_long_list_cannot_hold_the_event_loop() -> None:
    """The CEL runtime's own matches() built its pattern on every call (19 ms for this one): 300 empty strings in a
    4.5 KB body held the event loop 5.5 s, a 1 MiB body some 20 minutes."""
    import time

    (policy,) = load_text(MATCHES)
    messages = [{"content": ""}] * 400 + [{"content": "write to bob@corp.example"}]
    started = time.monotonic()
    for body, rule in [({"messages": messages[:-1]}, "default"), ({"messages": messages}, "email")]:
        assert rule_of(policy, body=body).rule == rule
    assert time.monotonic() - started < 2.0  # a hang bound: about 5 ms now, 15 s before


def test_the_patterns_a_request_supplies_are_compiled_once_within_a_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pattern a request supplies is compiled once, and past ``REQUEST_PROGRAM`` RE2 instructions matches()
    fails (the policy's fail mode decides): ``\\w{40}0``, 7 characters, takes 30 ms to compile, so a 7 KB body list
    of such patterns in an ``exists`` held the event loop 10 s; a thousand small patterns still run."""
    from guard.policy import _re2

    (policy,) = load_text("""
policies:
  - id: p
    version: 1
    match: {http: {}}
    state: {patterns: "body:/patterns"}
    rules: [{id: admin, when: 'state.patterns.exists(p, "admin".matches(p))', action: block}]
""")
    compiled, compile = [], _re2._compile
    monkeypatch.setattr(_re2, "_compile", lambda source, options: compiled.append(source) or compile(source, options))
    assert rule_of(policy, body={"patterns": ["^user$"] * 1000}).rule == "default"
    assert compiled == ["^user$"]
    compiled.clear()
    assert rule_of(policy, body={"patterns": [f"^user{i}$" for i in range(1000)]}).rule == "default"
    assert len(compiled) == 1000
    compiled.clear()
    with pytest.raises(RuleError, match="function .matches. failed"):
        rule_of(policy, body={"patterns": [f"\\w{{40}}{i}" for i in range(1000)]})
    assert len(compiled) < 5


@pytest.mark.parametrize(("pattern", "text", "found"), [
    ("\\\\d{3}", "123", True), ("\\\\d{3}", "١٢٣", True), ("\\\\d{3}", "１２３", True),  # \\d \\s \\w are Unicode
    ("(?i)ignore\\\\s+previous", "ignore\u00a0previous", True), ("(?i)ignore\\\\s+previous", "ignore\u3000previous", True),
    ("^\\\\w+$", "résumé", True), ("[\\\\w.]+@x", "jösé.b@x", True), ("\\\\D+", "١٢٣", False), ("[^\\\\s]", " \u00a0", False),
    ("\\\\Q\\\\d\\\\E", "\\\\d", True), ("[\\\\d-]+x", "-١x", True),
    ("[\\\\w-.]+@x", "a-b.c@x", True), ("[\\\\w-\\\\x{3000}]", "-", True), ("^[\\\\s\\\\S]+$", "a b", True),
    ("[\\\\d[:]+\\\\s*pm", "10:30\u00a0pm", True),  # a '-' after \\w is a literal; '[:' without ':]' is not POSIX
    ("(?i)ignore (all )?previous", "IGNORE ALL PREVIOUS", True), ("^abc$", "xabc", False),
])  # fmt: skip
def test_matches_is_an_re2_search(pattern: str, text: str, found: bool) -> None:
    (policy,) = load_text(f"""
policies:
  - id: p
    version: 1
    match: {{http: {{}}}}
    state: {{text: body_text}}
    rules: [{{id: hit, when: 'state.text.matches("{pattern}")', action: block}}]
""")
    assert (rule_of(policy, body_text=text).rule == "hit") is found


def test_a_matches_pattern_rust_regex_has_and_re2_lacks_is_a_load_error() -> None:
    with pytest.raises(PolicyLoadError, match=r"rules\[0\]\.when: the pattern .* of matches\(\) is not a valid "
                                              r"regular expression \(RE2 syntax"):
        load_text(MATCHES.replace("\\\\w{1,40}@", "\\\\p{Alphabetic}+@"))  # Rust regex has the property


def test_a_comment_inside_a_matches_call_does_not_hand_it_back_to_the_runtime() -> None:
    """``.matches // why`` then ``("...")`` on the next line was left to the CEL runtime (a pattern built on every
    call, its Rust syntax unchecked at load)."""

    def policy(pattern: str) -> str:
        return f"""
policies:
  - id: p
    version: 1
    match: {{http: {{}}}}
    state: {{text: body_text}}
    rules:
      - id: hit
        action: block
        when: |
          state.text.matches // why
            ("{pattern}")
"""

    with pytest.raises(PolicyLoadError, match="is not a valid regular expression"):
        load_text(policy("\\\\p{Alphabetic}+"))  # Rust regex has the property, RE2 does not
    (loaded,) = load_text(policy("\\\\d{3}"))
    assert "matches_re2" in loaded.rules[0].program.source and list(loaded.rules[0].patterns) == ["\\d{3}"]


def test_a_pattern_a_request_supplies_is_compiled_per_call_and_never_quoted() -> None:
    (policy,) = load_text("""
policies:
  - id: p
    version: 1
    match: {http: {}}
    state: {text: body_text, pattern: "header:x-pattern"}
    rules: [{id: hit, when: 'state.text.matches(state.pattern)', action: block}]
""")
    for pattern, text, rule in [("a\\d", "xa1", "hit"), ("a\\d", "xa", "default"), ("(", "x", None)]:
        if rule is None:
            with pytest.raises(RuleError, match="function 'matches' failed on its arguments") as info:
                rule_of(policy, body_text=text, headers={"x-pattern": pattern})
            assert "(" not in info.value.detail.split("matches()")[-1]
            continue
        assert rule_of(policy, body_text=text, headers={"x-pattern": pattern}).rule == rule


@pytest.mark.parametrize("when", [
    'state.text.matches(r"\\w{1,40}@\\w{1,40}\\.example")',  # a raw string
    '["\\\\w{1,40}@\\\\w{1,40}\\\\.example", "(?i)ignore\\\\s+previous"].exists(p, state.text.matches(p))',
    'data.patterns.exists(p, state.text.matches(p))',
])  # fmt: skip
def test_patterns_a_rule_computes_or_writes_raw_are_compiled_at_load(when: str) -> None:
    """A raw-string pattern was neither checked nor compiled at load, and patterns from a list or ``data`` were
    compiled on every call within 1 MiB, too little for ``\\w{1,40}`` once Unicode: every request failed."""
    (policy,) = load_text(f"""
data: {{patterns: ['\\w{{1,40}}@\\w{{1,40}}\\.example']}}
policies:
  - id: p
    version: 1
    match: {{http: {{}}}}
    state: {{text: body_text}}
    rules: [{{id: hit, when: '{when}', action: block}}]
""")
    assert "\\w{1,40}@\\w{1,40}\\.example" in policy.rules[0].patterns
    for text, rule in [("mail bob@corp.example", "hit"), ("hello", "default")]:
        assert rule_of(policy, body_text=text).rule == rule


def test_a_raw_string_pattern_re2_cannot_run_is_a_load_error() -> None:
    with pytest.raises(PolicyLoadError, match="is not a valid regular expression"):
        load_text(MATCHES.replace('m.content.matches("\\\\w{1,40}@', 'm.content.matches(r"\\p{Alphabetic}+@'))


def test_heavy_patterns_a_request_supplies_are_refused_quickly() -> None:
    """30 patterns of ``[\\w.]{1,200}@...`` in a 1.3 KB body took 2.8 s to compile within 16 MiB each."""
    import time

    (policy,) = load_text("""
policies:
  - id: p
    version: 1
    match: {http: {}}
    state: {filters: "body:/filters"}
    rules: [{id: hit, when: 'state.filters.exists(p, "hello".matches(p))', action: block}]
""")
    filters = [rf"[\w.]{{1,200}}@\w{{1,200}}\.x{i}" for i in range(30)]
    started = time.monotonic()
    with pytest.raises(RuleError, match="function 'matches' failed on its arguments"):
        rule_of(policy, body={"filters": filters})
    assert time.monotonic() - started < 1.0  # a hang bound: about 0.01 s (refused within 1 MiB), 2.8 s before


def one_rule(when: str) -> str:
    """A file whose one policy reads ``body:/qty`` as ``state.qty`` and blocks when ``when`` holds."""
    return f"""
policies:
  - id: p
    version: 1
    match: {{http: {{}}}}
    state: {{qty: "body:/qty"}}
    rules: [{{id: r, when: '{when}', action: block}}]
"""


def test_a_when_too_long_or_too_deep_for_the_cel_runtime_is_a_load_error() -> None:
    """The CEL runtime recurses once per level of a ``when`` with no limit: ``state.qty + state.qty + ...`` (16,000
    terms) loaded, then killed the process (SIGSEGV) on the first request it judged; at ~20,000 loading it did."""
    with pytest.raises(PolicyLoadError, match=r"p\.yaml:7 at policies\[0\]\.rules\[0\]\.when: is 191997 characters "
                                              r"long; a 'when' may have at most 4096"):
        load_text(one_rule(" + ".join(["state.qty"] * 16_000)), "p.yaml")
    deep = " + ".join(["state.qty"] * 300)  # 3,597 characters: 299 '+' and 300 '.'
    with pytest.raises(PolicyLoadError, match=rf"rules\[0\]\.when: nests 599 deep .* at most {MAX_WHEN_DEPTH} deep"):
        load_text(one_rule(deep))


@pytest.mark.parametrize(("shape", "at_limit"), [
    ("chain", "state.qty" + " + 1" * (MAX_WHEN_DEPTH - 1)),  # a '.' and 499 '+'
    ("members", "has(state" + ".qty" * (MAX_WHEN_DEPTH - 2) + ")"),
    ("indexes", "state" + '["qty"]' * (MAX_WHEN_DEPTH - 1)),  # each index 1, the innermost bracket's item 1
    ("brackets", "(" * 90 + "state.qty" + " + 1" * (MAX_WHEN_DEPTH - 181) + ")" * 90),  # a bracket: 2 levels
])  # fmt: skip
def test_a_when_at_the_depth_limit_runs_on_a_small_thread_stack(shape: str, at_limit: str) -> None:
    """What the limit lets through compiles and runs on a 1 MiB thread stack (an overflow would kill the test
    process: the CEL runtime has no depth limit of its own); one level more is refused."""
    import threading

    import cel

    program, _ = compile_condition(at_limit, {})
    with pytest.raises(ValueError, match=f"nests {MAX_WHEN_DEPTH + 1} deep"):
        compile_condition(f"!{at_limit}", {})
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(program.execute(cel.Context(variables={"state": {"qty": 1}})))
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:  # an outcome too: what matters is the stack
            outcome.append(type(exc))

    previous = threading.stack_size(1 << 20)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    finally:
        threading.stack_size(previous)
    assert len(outcome) == 1


LONG_BAD_LIST = 'state.qty in [' + ", ".join(f'"v{i}"' for i in range(9000)) + ",]]"


def test_a_when_the_cel_runtime_panics_on_is_a_load_error_and_a_failed_reload(tmp_path: Any) -> None:
    """A syntax error past column 65,535 made the runtime panic: ``pyo3_runtime.PanicException`` derives from
    BaseException only, so it went through ``guard policy check`` as a Rust traceback and ended the policy watcher's
    task for good on a reload."""
    from guard.policy import load_files

    with pytest.raises(PolicyLoadError, match=r"rules\[0\]\.when: is 79905 characters long"):
        load_text(one_rule(LONG_BAD_LIST))
    path = tmp_path / "p.yaml"
    path.write_text(one_rule("state.qty > 1"))
    policies = load_files(path)
    path.write_text(one_rule(LONG_BAD_LIST))
    with pytest.raises(PolicyLoadError):
        policies.reload()
    assert policies.reload_failures == 1 and [p.id for p in policies] == ["p"]


def test_a_panic_of_the_cel_runtime_while_compiling_is_a_value_error() -> None:
    """The runtime panics on this text; the limits keep it from any ``when``, and the compile wrapper turns the
    panic into a ValueError wherever else it could come from."""
    import cel

    for call in (cel.compile, cel.evaluate):
        with pytest.raises(ValueError, match="the CEL runtime panicked on it"):
            _cel(call, LONG_BAD_LIST)


@pytest.mark.parametrize(("when", "error"), [
    ("state.qty.exists(a, state.qty.filter(b, b == a).size() > 1)", r"runs filter\(\) over state\.qty, request data"),
    ("size(state.qty.filter(i, i.price > 100)) > 3",
     r"runs filter\(\) over state\.qty, request data: .* at least two \(x\.exists\(i, p\) && !x\.exists_one\(i, p\)\); a larger count"),
    ("state.qty.exists(i, i.tags.filter(t, t == \"x\").size() > 1)", r"runs filter\(\) over i\.tags, request data"),
    ("state.qty.exists(x, state.other.exists(y, x == y))",
     r"reads state inside the body of exists\(\) over state\.qty: .* \(two request lists intersected, .* in the app"),
    ("state.qty.exists(a, data.l.exists(b, subject.headers.all(h, h != a)))",
     r"reads subject inside the body of exists\(\) over state\.qty: the CEL runtime copies a list or map each time it "
     + "is read, so the cost grows with the square of the request"),
    ("state.qty.items.all(i, i.currency == state.qty.currency)",
     r"reads state inside the body of all\(\) over state\.qty\.items: .* request only through its variable 'i'"),
    ("state.qty.all(i, i.currency == state.qty[0].currency)", r"reads state inside the body of all\(\) over state\.qty"),
    ("state.qty.exists(a, a in state.other)", r"reads state inside the body of exists\(\) over state\.qty"),
    ("state.qty.exists(i, i.p == size(state.qty))", r"reads state inside the body of exists\(\) over state\.qty"),
    ("state.qty.exists(k, state.qty[k].matches(\"x\"))", r"reads state .* a map.s values read by key\) cannot be written"),
    ("state.qty.exists(o, o.lines.exists(a, o.lines.exists(b, a != b && a.sku == b.sku)))",
     r"reads o, the variable of an enclosing macro, inside the body of exists\(\) over o\.lines"),
    ("state.qty.exists(o, o.lines.exists(l, l.qty > o.min))", r"reads o, the variable of an enclosing macro"),
    ("[state.qty].exists(l, l.exists(a, l.exists(b, a != b && a == b)))",
     r"reads l, the variable of an enclosing macro, inside the body of exists\(\) over l:"),
    ("{''x'': state.qty}.x.exists(a, {''x'': state.qty}.x.exists(b, a != b && a == b))",
     r"reads state inside the body of exists\(\) over \{'x': state\.qty\}\.x"),
    ("{''x'': state.qty}.x.filter(a, a > 1).size() > 1", r"runs filter\(\) over \{'x': state\.qty\}\.x, request data"),
    ("size(state.qty[0].tags.map(t, t)) > 2", r"runs map\(\) over state\.qty\[0\]\.tags, request data"),
    ("state.qty.exists(g, g.items.filter(i, i > 3).size() > 1)", r"runs filter\(\) over g\.items, request data"),
    ("state.qty.existsOne(x, state.qty.exists(y, y == x))",  # the runtime's other spelling of exists_one
     r"reads state inside the body of existsOne\(\) over state\.qty"),
    ("state.qty.existsOne(data, state.qty.exists(y, y == data))",
     r"reads state inside the body of existsOne\(\) over state\.qty"),
])  # fmt: skip
def test_a_when_whose_cost_grows_with_the_square_of_the_request_is_a_load_error(when: str, error: str) -> None:
    """Rules run on the event loop and the CEL runtime has no cost limit: a duplicate check nesting a macro over
    the request in another held the loop 3.3 s on 2,500 items, and map() or filter() alone 9 s on 10,000."""
    with pytest.raises(PolicyLoadError, match=r"p\.yaml:7 at policies\[0\]\.rules\[0\]\.when: " + error):
        load_text("data: {l: [1]}" + one_rule(when), "p.yaml")


@pytest.mark.parametrize("when", [
    "state.qty.exists(g, g.items.exists(i, i > 3))",  # each item's own list: linear in the request
    "state.qty.exists(g, g.exists(i, i > data.l[0]))",
    "state.qty.exists(i, data.l.exists(d, d == i.sku))",  # the request's items times the policy's list
    "state.qty.exists(x, x.b.exists(x, x > 1))",  # the inner x is the inner macro's
    "size(state.qty) > 3 && state.qty.exists(i, i. state > 1)",  # a field named state
    "data.l.exists(x, state.qty.exists(y, x == y))",  # the policy's list times the request's
    "state.qty.all(x, x > 0) && data.l.filter(x, x > 1).size() > 0",
    '["a", "b"].exists(p, state.qty.exists(x, x == p))',
    'state.qty.exists(x, x == ".exists(a, state.qty.map(b, b))")',
    "state.qty.existsOne(v, v > 1) && state.qty.exists_one(x, x > 2)",
])  # fmt: skip
def test_macros_whose_cost_grows_with_the_request_load(when: str) -> None:
    load_text("data: {l: [1]}" + one_rule(when))


def test_size_counts_a_string_s_characters() -> None:
    """The runtime's own size() counts a string's UTF-8 bytes: a minimum length of 8 let two emoji through, and
    ``max_chars`` counts characters. A list's, a map's and bytes' size are unchanged."""
    (policy,) = load_text("""
policies:
  - id: p
    version: 1
    match: {http: {}}
    state: {body: body}
    rules:
      - {id: short, when: 'size(state.body.password) < 8 // size("")', action: block}
      - {id: name, when: 'state.body.name.size() != size(state.body.tags[0]) + size(b"\\xc3\\xa9")', action: escalate}
      - {id: list, when: 'size(state.body.tags) + size(state.body) + size("size(ö)") == 12', action: block, status: 409}
""")
    cases = [({"password": "🙂🙂🙂🙂🙂🙂🙂", "name": "Łukasz", "tags": ["Żółć"]}, "short"),
             ({"password": "éééééééé", "name": "Łukasz!", "tags": ["Żółć"]}, "name"),
             ({"password": "éééééééé", "name": "Żółć🙂é", "tags": ["Żółć", [1]]}, "list")]
    for body, rule in cases:
        assert rule_of(policy, body=body).rule == rule
    # a macro's variable may be named like a CEL type; a string literal's size counts its characters too
    for when in ("state.qty.exists(string, size(string) == 3)", "state.qty.exists(string, string.size() == 3)",
                 "'ééé'.size() == 3 && size('ééé') == 3 && r\"é\".size() == 1"):
        (policy,) = load_text(one_rule(when.replace("'", "''")))
        assert rule_of(policy, body={"qty": ["ééé", "ab"]}).rule == "r", when
    with pytest.raises(ValueError, match=f"nests 506 deep as run .* at most {MAX_WHEN_DEPTH} deep"):
        compile_condition("size(state.qty)" + " + 1" * 494, {})  # 497 deep as written


BOTH = """
policies:
  - id: p
    version: 1
    match: {http: {}, agent: {}}
    rules:
      - {id: r, when: 'WHEN', action: block}
"""


@pytest.mark.parametrize(
    ("name", "when", "reads"),
    [
        ("subject", 'subject.path == "/x" && has(subject.body)', {"path", "body"}),
        ("subject", "subject . path.matches('^/a') // subject[0]", {"path"}),  # a method on a field; a comment
        ("subject", 'state.x == "subject" && spam.noul > 0.5', set()),
        ("subject", 'subject["body"] == 1', None),
        ("subject", '"body" in subject', None),
        ("subject", "size(subject) > 1", None),
        ("subject", "state.subject.x == 1 && subject.path == '/'", None),  # after a dot: the whole subject, to be safe
        ("subject", "subject.body(1)", None),
        ("state", "state.subject.x == 1 && subject.path == '/'", {"subject"}),
        ("state", "state.x.exists(k, k == 'a') && states.x == 1", {"x"}),
        ("state", "state.exists(k, k == 'a')", None),
    ],
)
def test_selected_fields(name: str, when: str, reads: set[str] | None) -> None:
    assert selected_fields(when, name) == (None if reads is None else frozenset(reads))


def test_rules_get_only_the_subject_fields_they_read(monkeypatch: Any) -> None:
    """A large body no rule reads is not converted into CEL values: the conversion holds the GIL, so a 150,000-key
    body stalled the event loop for seconds although rules run on a worker thread."""
    given: list[Any] = []
    context = rules_module.cel.Context

    def recording(variables: Any, functions: Any) -> Any:
        given.append(variables.get("subject", variables.get("state")))
        return context(variables=variables, functions=functions)

    monkeypatch.setattr(rules_module.cel, "Context", recording)
    subject = HttpSubject(method="POST", path="/x", body={f"k{i}": "v" for i in range(1000)}, body_text="v")
    (path_only,) = load_text(one_rule('subject.path == "/x" && subject.method == "POST"'))
    assert rule_of(path_only, body=subject.body, body_text="v").rule == "default"  # rule_of's path is "/"
    assert given[-1] == {"method": "POST", "path": "/"}
    (body,) = load_text(one_rule('has(subject.body) && subject.body.k7 == "v"'))
    assert rule_of(body, body=subject.body, body_text="v").rule == "r"
    assert given[-1] == {"body": subject.body}
    (whole,) = load_text(one_rule('subject.path == "/" && size(subject) > 3'))  # the subject read whole
    assert rule_of(whole, body=subject.body, body_text="v").rule == "r"
    assert given[-1]["body"] is subject.body and given[-1]["body_text"] == "v"
    # the state: a policy without a state block has the body in its default state
    (state_path,) = load_text(one_rule('state.path == "/"').replace('    state: {qty: "body:/qty"}\n', ""))
    assert rule_of(state_path, body=subject.body, body_text="v").rule == "r"
    assert given[-1] == {"path": "/"}
    (state_whole,) = load_text(one_rule('state.path == "/" && "path" in state').replace('    state: {qty: "body:/qty"}\n', ""))
    assert rule_of(state_whole, body=subject.body, body_text="v").rule == "r"
    assert given[-1] == {"method": "POST", "path": "/", "body": subject.body}


@pytest.mark.parametrize(
    "when",
    [
        "has(subject.body)",
        "has(subject.path) && subject.path == '/x'",
        "subject.path == '/x'",  # a KeyError for an agent subject
        "has(subject.body) && subject.body.k == 'v'",  # null's field, a missing key or a list's: an error
        "has(subject.body.k)",
        "has(subject.tool_name) || subject.body.size() > 0",
        "subject.body == null || has(subject.arguments)",
    ],
)
def test_a_subject_read_by_field_decides_as_the_whole_subject_does(when: str) -> None:
    """Rules given only the fields they read decide, and fail, exactly as with the whole subject: ``has()`` of a
    field some subject lacks (an agent subject has no path) and a missing field included."""
    (policy,) = load_text(BOTH.replace("WHEN", when.replace("'", "''")))
    (whole,) = load_text(BOTH.replace("WHEN", when.replace("'", "''")).replace(
        "action: block}", "action: block}\n      - {id: w, when: 'size(subject) < 0', action: block}"))
    assert policy.rules[0].selected["subject"] is not None and whole.rules[1].selected["subject"] is None
    subjects = [HttpSubject(method="POST", path=path, body=body) for path in ("/x", "/y")
                for body in ({"k": "v"}, {"k": "w"}, {"j": 1}, None, ["k"], "k")]
    subjects += [AgentSubject(event="tool_call", tool_name="t", arguments={"k": "v"}), AgentSubject(event="model_output", user_message="x", text="y")]
    for subject in subjects:
        alone = trace_rules(policy.id, policy.rules, {}, subject=subject, state={})
        beside = trace_rules(whole.id, whole.rules, {}, subject=subject, state={})
        assert alone == beside[:1], (subject, alone, beside)


@pytest.mark.parametrize(
    "when",
    [
        "has(state.body) && state.body.k == 'v'",
        "has(state.body.k) || state.path == '/x'",
        "state.method == 'POST' || has(state.task)",
        "state.task == 'x'",  # a KeyError for an HTTP request's state
    ],
)
def test_a_state_read_by_field_decides_as_the_whole_state_does(when: str) -> None:
    """As for the subject: the state's fields a rule reads decide as the whole state does (the default states here:
    an HTTP request's method, path and body, a model output's task and text)."""
    (policy,) = load_text(BOTH.replace("WHEN", when.replace("'", "''")))
    (whole,) = load_text(BOTH.replace("WHEN", when.replace("'", "''")).replace(
        "action: block}", "action: block}\n      - {id: w, when: 'size(state) < 0', action: block}"))
    assert policy.rules[0].selected["state"] is not None and whole.rules[1].selected["state"] is None
    subjects = [HttpSubject(method="POST", path="/x", body=body) for body in ({"k": "v"}, {"j": 1}, None, ["k"])]
    subjects.append(AgentSubject(event="model_output", user_message="x", text="y"))
    for subject in subjects:
        state = policy.render_state(subject)
        alone = trace_rules(policy.id, policy.rules, {}, subject=subject, state=state)
        assert alone == trace_rules(whole.id, whole.rules, {}, subject=subject, state=state)[:1], (subject, alone)
