"""Policy loading: schema errors with file, line and key path; System One limits at load time (C22); CEL names;
handoff targets; state sources; catalog questions; duplicate ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard.errors import PolicyError
from guard.policy import HandoffTarget, PolicyLoadError, load_files, load_text
from guard.policy.loader import PolicyView

BASE = """\
policies:
  - id: p
    version: 1
    match:
      http: {methods: [POST]}
    questions:
      urgency:
        type: score
        instructions: How urgent?
        criteria: [low, medium, high]
      topic:
        type: choice
        instructions: Which topic?
        criteria: {billing: Billing, tech: Tech}
    rules:
      - id: urgent
        when: urgency.score >= 1.5
        action: escalate
"""


def load_error(text: str) -> PolicyLoadError:
    with pytest.raises(PolicyError) as caught:
        load_text(text, "p.yaml")
    assert caught.value.file == "p.yaml"
    return caught.value  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("old", "new", "key", "reason"),
    [
        ("        when: urgency.score", "        whne: urgency.score", "policies[0].rules[0].whne",
         "unknown key; did you mean 'when'?"),
        ("        type: score", "        kind: score", "policies[0].questions.urgency.kind",
         "unknown key; the keys here are catalog, criteria, id, instructions, type"),
        ("    version: 1\n", "    versoin: 1\n", "policies[0].versoin", "unknown key; did you mean 'version'?"),
    ],
)
def test_an_unknown_key_names_the_nearest_allowed_key(old: str, new: str, key: str, reason: str) -> None:
    assert old in BASE
    error = load_error(BASE.replace(old, new, 1))
    assert any(p.key == key and p.reason == reason for p in error.problems), error.problems


def test_choice_option_ids_in_any_script_load_and_padded_or_bidi_ones_do_not() -> None:
    """Policies are checked with the workers-ai profile: str.isprintable() refused a Persian id with a ZWNJ and a
    ZWJ emoji (review finding)."""
    old = "{billing: Billing, tech: Tech}"
    (policy,) = load_text(BASE.replace(old, '{"می\u200cخواهم": I want, "👩\u200d💻 developer": Dev, "10\u00a0km": Far}'))
    assert policy.questions[1].wire.option_ids() == ["می\u200cخواهم", "👩\u200d💻 developer", "10\u00a0km"]
    error = load_error(BASE.replace(old, '{"billing\u202e": Billing, " tech": Tech}'))
    assert [p.key for p in error.problems] == ["policies[0].questions.topic.criteria"] * 2


def test_choice_option_ids_that_are_one_text_once_normalised_do_not_load() -> None:
    """Å written as A + U+030A and as U+00C5 loaded as two options (attack finding); a rule's literal that differs
    from an option only in its normal form is reported with the ids escaped, so the difference shows."""
    old = "{billing: Billing, tech: Tech}"
    error = load_error(BASE.replace(old, '{"A\u030a": Krone, "\u00c5": Krona}'))
    reason = ("option ids 'A\\u030a' and '\u00c5' are the same text once Unicode-normalised (NFKC); the model and a "
              "rule cannot tell them apart")
    assert [(p.line, p.key, p.reason) for p in error.problems] == [(14, "policies[0].questions.topic.criteria", reason)]
    error = load_error(BASE.replace(old, '{"A\u030a": Krone, NOK: Norwegian}').replace(
        "urgency.score >= 1.5", 'topic.choice == "\u00c5"'))
    assert [p.reason for p in error.problems] == [
        "topic has no option '\u00c5' (its options: 'A\\u030a', NOK); check the spelling"
    ]


def test_base_policy_loads() -> None:
    (policy,) = load_text(BASE, "p.yaml")
    assert (policy.id, policy.version, policy.line, policy.mode) == ("p", "1", 2, "enforce")
    assert [q.key for q in policy.questions] == ["urgency", "topic"]
    assert policy.timeout == 2.0 and policy.cache_ttl == 300.0 and policy.model == "clef-flash"


@pytest.mark.parametrize(
    ("old", "new", "line", "key", "reason"),
    [
        # C22: a score with 1 or 11 levels, criteria as a string, a choice with 256 options
        ("[low, medium, high]", "[only]", 10, "policies[0].questions.urgency.criteria",
         "has 1 levels; a score needs 2 to 10"),
        ("[low, medium, high]", str([f"l{i}" for i in range(11)]), 10, "policies[0].questions.urgency.criteria",
         "has 11 levels"),
        ("[low, medium, high]", "low to high", 10, "policies[0].questions.urgency.criteria", "must be an array"),
        ("{billing: Billing, tech: Tech}", "{" + ", ".join(f"o{i}: d" for i in range(256)) + "}", 14,
         "policies[0].questions.topic.criteria", "has 256 options; a choice needs 2 to 255"),
        ("{billing: Billing, tech: Tech}", "{only: One}", 14, "policies[0].questions.topic.criteria", "has 1 options"),
        ("        instructions: How urgent?\n", "", 7, "policies[0].questions.urgency.instructions", "is required"),
        # wrong types and unknown keys
        ("    version: 1\n", "    version: 1\n    timeout_ms: high\n", 4, "policies[0].timeout_ms", "valid integer"),
        ("    version: 1\n", "    version: 1\n    cache: {ttl: soon}\n", 4, "policies[0].cache.ttl", "valid number"),
        # a TTL no store can keep: Redis got PX inf (OverflowError) on every decision
        ("    version: 1\n", "    version: 1\n    cache: {ttl: .inf}\n", 4, "policies[0].cache.ttl", "finite number"),
        ("    version: 1\n", "    version: 1\n    cache: {ttl: .nan}\n", 4, "policies[0].cache.ttl", "finite number"),
        ("    version: 1\n", "    version: 1\n    cache: {ttl: 2592001}\n", 4, "policies[0].cache.ttl",
         "less than or equal to 2592000"),
        ("    version: 1\n", "    version: 1\n    threshold: 0.9\n", 4, "policies[0].threshold", "unknown key"),
        ("        type: score\n", "        type: scale\n", 8, "policies[0].questions.urgency.type", "'noul', 'choice'"),
        ("        action: escalate\n", "        action: deny\n", 18, "policies[0].rules[0].action", "'allow', 'block'"),
        ("    version: 1\n", "    version: 1\n    mode: dry-run\n", 4, "policies[0].mode", "'enforce' or 'shadow'"),
        ("      http: {methods: [POST]}\n", "      http: {methods: POST}\n", 5, "policies[0].match.http.methods",
         "valid list"),
        # tool effects and trusted values only agent tool calls read: on an HTTP policy they loaded and did nothing
        ("    version: 1\n", "    version: 1\n    tools: {shell: {effect: side_effecting}}\n", 4, "policies[0].tools",
         "matches HTTP requests only"),
        ("    version: 1\n", "    version: 1\n    trusted: [corp.example]\n", 4, "policies[0].trusted",
         "matches HTTP requests only"),
        # a tool list with only events that have no tool: the policy loaded and never judged anything
        ("      http: {methods: [POST]}\n", "      agent: {events: [model_input], tools: [shell]}\n", 5,
         "policies[0].match.agent.tools", "never matches model_input events"),
        # a status no response has: the response policy loaded and never judged anything
        ("      http: {methods: [POST]}\n", "      http: {methods: [POST], response: {status: [200, 2000]}}\n", 5,
         "policies[0].match.http.response.status[1]", "less than or equal to 599"),
        ("  - id: p\n", "  - id: 'bad id!'\n", 2, "policies[0].id", "an id or name is 1 to 100 characters"),
        # rules
        ("urgency.score >= 1.5", "severity.score >= 1.5", 17, "policies[0].rules[0].when", "unknown name 'severity'"),
        ("urgency.score >= 1.5", "urgency.choice == 'x'", 17, "policies[0].rules[0].when", "a score answer has"),
        ("urgency.score >= 1.5", "urgency.score >=", 17, "policies[0].rules[0].when", "CEL syntax error"),
        ("        action: escalate\n", "        action: escalate\n        status: 403\n", 19,
         "policies[0].rules[0].status", "only for action block"),
        # a fail mode that sends no block has no status or Retry-After: written there, they loaded and did nothing
        ("    version: 1\n", "    version: 1\n    on_error: {mode: open, status: 500}\n", 4,
         "policies[0].on_error.status", "only for mode closed"),
        ("    version: 1\n", "    version: 1\n    on_error: {mode: escalate, retry_after: 30}\n", 4,
         "policies[0].on_error.retry_after", "only for mode closed"),
        # a Retry-After an allow never sends (verdict_headers leaves it out): a rule or default saying one loaded
        ("        action: escalate\n", "        action: allow\n        retry_after: 60\n", 19,
         "policies[0].rules[0].retry_after", "never sent with action allow"),
        ("    version: 1\n", "    version: 1\n    default: {action: allow, retry_after: 60}\n", 4,
         "policies[0].default.retry_after", "never sent with action allow"),
        ("        action: escalate\n", "        action: handoff\n        handoff: nobody\n", 19,
         "policies[0].rules[0].handoff", "not in handoff_targets"),
        ("        action: escalate\n", "        action: block\n        status: 200\n", 19,
         "policies[0].rules[0].status", "greater than or equal to 400"),
        ("        action: escalate\n", "        action: block\n      - {id: urgent, when: 'true', action: allow}\n",
         19, "policies[0].rules[1].id", "used twice"),
        # match, state, questions
        ("    match:\n      http: {methods: [POST]}\n", "    match: {}\n", 4, "policies[0].match", "needs 'http' or"),
        ("    questions:\n", "    state: {tool: tool_name}\n    questions:\n", 6, "policies[0].state.tool.from",
         "reads agent events"),
        ("    questions:\n", "    state: {ua: header}\n    questions:\n", 6, "policies[0].state.ua.name",
         "needs 'name'"),
        ("    questions:\n", "    state: {b: 'body:x/y'}\n    questions:\n", 6, "policies[0].state.b.name",
         "'name' applies to"),
        ("    questions:\n", "    state: {b: {from: body, const: 1}}\n    questions:\n", 6, "policies[0].state.b",
         "exactly one of"),
        ("    questions:\n", "    state: {b: {from: body, pointer: 'a/b'}}\n    questions:\n", 6,
         "policies[0].state.b.pointer", "must start with '/'"),
        ("    questions:\n", "    state: {b: {from: cookies}}\n    questions:\n", 6, "policies[0].state.b.from",
         "Input should be"),
        ("      topic:\n", "      subject:\n", 11, "policies[0].questions.subject", "must be a name rules can use"),
        ("      topic:\n", "      topic:\n        id: urgency\n", 12, "policies[0].questions.topic.id", "also used by"),
        ("      topic:\n", "      topic:\n        id: 'no spaces'\n", 12, "policies[0].questions.topic.id",
         "must match"),
        ("    version: 1\n", "    version: 1.10\n", 3, "policies[0].version", "quote the version"),
        # a Retry-After no header can hold: math.ceil(inf) raised on every matching request (a 500, not the 429/503)
        ("        action: escalate\n", "        action: block\n        retry_after: .inf\n", 19,
         "policies[0].rules[0].retry_after", "finite number"),
        ("        action: escalate\n", "        action: block\n        retry_after: .nan\n", 19,
         "policies[0].rules[0].retry_after", "finite number"),
        ("        action: escalate\n", "        action: block\n        retry_after: 86401\n", 19,
         "policies[0].rules[0].retry_after", "less than or equal to 86400"),
        ("    version: 1\n", "    version: 1\n    on_error: {mode: closed, retry_after: .inf}\n", 4,
         "policies[0].on_error.retry_after", "finite number"),
        ("    version: 1\n", "    version: 1\n    default: {action: block, retry_after: 1.0e+6}\n", 4,
         "policies[0].default.retry_after", "less than or equal to 86400"),
        # a version is sent in x-guard-policy: a CR LF in it broke every response carrying the decision headers
        ("    version: 1\n", '    version: "2.1\\r\\nx-injected: yes"\n', 3, "policies[0].version",
         "a version is 1 to 64 printable ASCII characters without spaces"),
        ("    version: 1\n", '    version: "1 beta"\n', 3, "policies[0].version", "without spaces"),
        ("    version: 1\n", '    version: "1.0-\u00e9"\n', 3, "policies[0].version", "printable ASCII"),
        ("    version: 1\n", '    version: ""\n', 3, "policies[0].version", "1 to 64"),
        ("    version: 1\n", f'    version: "{"9" * 65}"\n', 3, "policies[0].version", "1 to 64"),
        ("      topic:\n        type: choice\n", "      topic:\n", 11, "policies[0].questions.topic.type",
         "is required"),
    ],
)
def test_errors_name_line_and_key(old: str, new: str, line: int, key: str, reason: str) -> None:
    assert old in BASE
    error = load_error(BASE.replace(old, new, 1))
    assert (error.line, error.key) == (line, key), str(error)
    assert reason in error.reason, error.reason


@pytest.mark.parametrize(
    ("old", "new", "line", "key"),
    [
        ("      http: {methods: [POST]}\n", '      http: {methods: [POST], headers: {"x-\u20ac": "a"}}\n', 5,
         "policies[0].match.http.headers.x-\u20ac"),
        ("    questions:\n", '    state: {euro: "header:x-\u20ac"}\n    questions:\n', 6, "policies[0].state.euro.name"),
        ("    questions:\n", "    state: {euro: {from: header, name: 'x y'}}\n    questions:\n", 6,
         "policies[0].state.euro.name"),
        ("        when: urgency.score >= 1.5", "        when: subject.headers['x-\u20ac'] == 'a'", 17,
         "policies[0].rules[0].when"),
        ("        when: urgency.score >= 1.5", "        when: \"'x:y' in subject.headers\"", 17,
         "policies[0].rules[0].when"),
    ],
)
def test_a_header_name_no_request_can_have_is_a_load_error(old: str, new: str, line: int, key: str) -> None:
    """A header name outside RFC 9110's token characters (``x-\u20ac``, a space) loaded, and the proxy failed every
    request that had a ``Connection`` header on encoding it (500): such a name is refused where it is written."""
    assert old in BASE
    error = load_error(BASE.replace(old, new, 1))
    assert (error.line, error.key) == (line, key), str(error)
    assert "is not an HTTP field name" in error.reason, error.reason


@pytest.mark.parametrize(
    ("old", "new", "line", "key"),
    [
        ("    questions:\n", '    state: {dry: "header:x_dry_run"}\n    questions:\n', 6, "policies[0].state.dry.name"),
        ("      http: {methods: [POST]}\n", "      http: {methods: [POST], headers: {x_tier: gold}}\n", 5,
         "policies[0].match.http.headers.x_tier"),
        ("        when: urgency.score >= 1.5", "        when: subject.headers['x_dry_run'] == 'true'", 17,
         "policies[0].rules[0].when"),
        ("        when: urgency.score >= 1.5", "        when: subject.headers.x_dry_run == 'true'", 17,
         "policies[0].rules[0].when"),
        ("        when: urgency.score >= 1.5", "        when: \"'x_dry_run' in subject.headers\"", 17,
         "policies[0].rules[0].when"),
    ],
)
def test_a_header_name_spelled_with_an_underscore_is_a_load_error(old: str, new: str, line: int, key: str) -> None:
    """``header:x_dry_run`` loaded: guard judged a header the proxy never forwards (the upstream ran without it) and
    that a WSGI server reads as ``x-dry-run``; the name is refused with the spelling to write."""
    error = load_error(BASE.replace(old, new, 1))
    assert (error.line, error.key) == (line, key), str(error)
    assert "spelled with '_'" in error.reason and "write 'x-" in error.reason, error.reason
    assert error.reason.count("spelled with") == 1, error.reason


def test_a_views_read_header_names_are_made_once_as_bytes() -> None:
    text = BASE.replace("      http: {methods: [POST]}\n", "      http: {methods: [POST], headers: {x-tier: gold}}\n")
    text = text.replace("urgency.score >= 1.5", "urgency.score >= 1.5 && subject.headers['x-dry-run'] == 'a'")
    view = PolicyView(tuple(load_text(text)))
    assert view.read_headers == {"x-tier", "x-dry-run"}
    assert view.read_header_names == {b"x-tier", b"x-dry-run"}


def test_all_problems_are_reported_and_a_bad_question_does_not_cascade() -> None:
    text = BASE.replace("[low, medium, high]", "[x]").replace("{billing: Billing, tech: Tech}", "{a: A}")
    error = load_error(text)
    assert [p.key for p in error.problems] == ["policies[0].questions.urgency.criteria",
                                               "policies[0].questions.topic.criteria"]
    assert "(and 1 more)" in str(error)


def test_question_and_rule_limits() -> None:
    many = "".join(f"      q{i}: {{type: noul, instructions: q}}\n" for i in range(65))
    text = "policies:\n  - id: p\n    version: 1\n    match: {http: {}}\n    questions:\n" + many
    error = load_error(text)
    assert (error.line, error.key) == (5, "policies[0].questions") and "65 entries; at most 64" in error.reason


def test_question_text_past_the_prompt_is_a_load_error() -> None:
    """198,000 characters of instructions loaded, and every decision then failed closed: no model reads them whole."""
    def question(instructions: str, criteria: str = "{a: A, b: B}") -> str:
        return (f"policies:\n  - id: p\n    version: 1\n    match: {{http: {{}}}}\n    questions:\n      q:\n"
                f"        type: choice\n        instructions: '{instructions}'\n        criteria: {criteria}\n")

    (policy,) = load_text(question("x" * 65_536))
    assert len(policy.questions[0].wire.instructions) == 65_536
    error = load_error(question("Ignore it? " * 18_000))
    assert (error.line, error.key) == (8, "policies[0].questions.q.instructions")
    assert "holds 198000 characters as the model reads them; at most 65536" in error.reason
    error = load_error(question("Which?", "{a: A, b: '" + "B" * 65_536 + "'}"))
    assert (error.line, error.key) == (9, "policies[0].questions.q.criteria")


def test_catalog_questions() -> None:
    text = BASE.replace("    rules:", "      injection: {catalog: guard.prompt_injection}\n    rules:")
    (policy,) = load_text(text)
    wire = policy.questions[-1].wire
    assert (wire.id, wire.type) == ("guard.prompt_injection", "noul") and "prompt injection" in wire.instructions
    assert load_error(BASE.replace("    rules:", "      x: {catalog: guard.nope}\n    rules:")).key == \
        "policies[0].questions.x.catalog"
    bad = load_error(BASE.replace("    rules:", "      x: {catalog: guard.harm_severity, type: noul}\n    rules:"))
    assert bad.key == "policies[0].questions.x.type" and "is a score question" in bad.reason
    reworded = "      x: {catalog: guard.refusal, instructions: 'Did it refuse?'}\n    rules:"
    assert "uses the catalog's instructions" in load_error(BASE.replace("    rules:", reworded)).reason


def test_file_level_shape() -> None:
    assert load_error("").reason.startswith("file is empty")
    assert load_error("policies: []\n").key == "policies"
    assert load_error("- a\n").reason.startswith("Input should be a valid dictionary")
    assert load_error(BASE + "extra: 1\n").key == "extra"
    handoff = BASE.replace("        action: escalate\n", "        action: handoff\n        handoff: t\n")
    targets = "handoff_targets:\n  t: {base_url: 'http://x/v1', model: m, timeout: -1}\n"
    assert load_error(targets + handoff).key == "handoff_targets.t.timeout"
    ok = load_text(targets.replace("timeout: -1", "api_key_env: K") + handoff)
    assert ok[0].handoff_targets["t"].api_key_env == "K"
    for url in ("http://[::1/v1", "ftp://x/v1", "/v1", "http://:80/v1", "htps://svc:sk-live-KEY@llm/v1?key=QKEY",
                "http://svc:sk-live-KEY@llm:99999/v1", "svc:sk-live-KEY@llm:8080/v1",  # each a 500 per request first
                # a key whose '@' and host were left out: urlsplit's errors quoted it as the port or an IP literal
                "http://svc:sk-live-KEY/v1", "http://svc:[sk-live-KEY]/v1", "http://svc:sk-live-KEY\uff03@llm/v1"):
        error = load_error(targets.replace("http://x/v1", url).replace("timeout: -1", "timeout: 1") + handoff)
        assert error.key == "handoff_targets.t.base_url" and "base_url" in error.reason
        assert "sk-live" not in error.reason and "QKEY" not in error.reason  # the URL as logs show it


def test_handoff_target_names_and_timeouts_must_fit_a_header_and_a_clock() -> None:
    """A target's name is sent in x-guard-handoff: a CR LF in it broke the handoff's response. An infinite timeout
    would wait for ever."""
    handoff = BASE.replace("        action: escalate\n", "        action: handoff\n        handoff: t\n")
    targets = "handoff_targets:\n  {name}: {{base_url: 'http://x/v1', model: m{extra}}}\n"
    error = load_error(targets.format(name='"t\\r\\nx-injected: yes"', extra="") + handoff)
    assert (error.line, error.key) == (2, "handoff_targets.t\r\nx-injected: yes")
    assert "an id or name is 1 to 100 characters from A-Z, a-z, 0-9, '_', '.' and '-'" in error.reason
    assert load_error(targets.format(name="'two words'", extra="") + handoff).key == "handoff_targets.two words"
    for extra, key in ((", timeout: .inf", "timeout"), (", stream_timeout: .inf", "stream_timeout"),
                       (", timeout: .nan", "timeout")):
        error = load_error(targets.format(name="t", extra=extra) + handoff)
        assert (error.key, error.reason[:32]) == (f"handoff_targets.t.{key}", "Input should be a finite number,")
    name = "triage_llm.v2-eu"
    (policy,) = load_text(targets.format(name=name, extra="") + handoff.replace("handoff: t\n", f"handoff: {name}\n"))
    assert list(policy.handoff_targets) == ["triage_llm.v2-eu"]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"name": "t\r\nx-injected: yes"}, "handoff target name 't\\r\\nx-injected: yes' must match [A-Za-z0-9_.-]{1,100}"),
        ({"name": ""}, "must match"),
        ({"timeout": float("inf")}, "handoff target 't': timeout is inf; it must be a finite number of seconds above 0"),
        ({"stream_timeout": float("nan")}, "stream_timeout is nan"),
        ({"timeout": 0}, "timeout is 0;"),
    ],
)
def test_a_handoff_target_built_in_code_is_checked_as_the_loader_checks_one(fields: dict[str, object], reason: str
                                                                           ) -> None:
    """``HandoffClient(targets=...)`` overrides are built in code, past the loader's checks of a policy file's."""
    with pytest.raises(ValueError) as caught:
        HandoffTarget(**{"name": "t", "base_url": "http://x/v1", "model": "m", **fields})  # type: ignore[arg-type]
    assert reason in str(caught.value)
    assert HandoffTarget("triage_llm.v2-eu", "http://x/v1", "m", timeout=1).timeout == 1


def test_duplicate_policy_ids_across_files(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(BASE)
    (tmp_path / "b.yaml").write_text(BASE)
    with pytest.raises(PolicyError) as caught:
        load_files(tmp_path / "a.yaml", tmp_path / "b.yaml")
    assert caught.value.file.endswith("b.yaml") and "already defined in" in caught.value.reason
    assert caught.value.key == "policies[0].id"  # was "id": the error names the key path
    with pytest.raises(PolicyError) as caught:
        load_text("policies:\n" + "".join(f"  - {{id: {pid}, version: 1, match: {{http: {{}}}}, rules: [{{id: r, "
                                             "when: 'true', action: block}]}\n" for pid in ("a", "b", "a")), "p.yaml")
    assert (caught.value.line, caught.value.key) == (4, "policies[2].id")
    with pytest.raises(PolicyError, match="cannot read file"):
        load_files(tmp_path / "missing.yaml")


def test_versions_and_shorthands() -> None:
    text = BASE.replace("version: 1", "version: '1.10'").replace(
        "    questions:",
        "    state: {p: 'body:/messages/-1/content', q: 'query:q', c: {const: [1, 2]}}\n    questions:",
    )
    (policy,) = load_text(text)
    assert policy.version == "1.10"
    for version in ("1.2.0-rc.1+build.7", "2024-05-01", "v3@eu/west", "x" * 64):
        assert load_text(BASE.replace("version: 1", f"version: '{version}'"))[0].version == version
    assert [(f.name, f.source, f.pointer, f.key) for f in policy.state_fields or ()] == [
        ("p", "body", ("messages", "-1", "content"), None), ("q", "query", (), "q"), ("c", None, (), None)]


def test_a_comparison_that_can_never_decide_is_a_load_error() -> None:
    """``check`` said ok for an option id the question does not have, written out or in ``data`` (the rule never
    fired), and for a threshold no probability reaches (``data: {block_threshold: 85}``), while arithmetic and
    concatenation around an operand stay allowed."""
    head = """
data: {block_threshold: 85, review: 0.6, review_pct: 60, thresholds: {block: 85, review: 0.5}, route: biling,
       routes: [tecch, biling], known: [tech, billing], shared: [tech, security]}
policies:
  - id: p
    version: 1
    match: {http: {}}
    questions:
      queue: {type: choice, instructions: "which queue?", criteria: {billing: "money", tech: "tech"}}
      injection: {catalog: guard.prompt_injection}
      sev: {type: score, instructions: "how bad", criteria: ["none", "low", "mid", "high", "max"]}
    rules:
      - id: r
        when: '%s'
        action: block
"""
    bad = {
        'queue.choice == "biling"': "queue has no option 'biling' (its options: billing, tech)",
        '"tecch" != queue.choice': "no option 'tecch'",
        'queue.choice in ["tech", "biling"]': "no option 'biling'",
        'queue.probabilities["tecch"] > 0.5': "no option 'tecch'",
        'injection.probabilities["yes"] > 0.5': "no option 'yes' (its options: true, false)",
        "injection.noul > 1.0": "'injection.noul > 1.0' is always false",
        "injection.noul < data.review_pct": "'injection.noul < data.review_pct' is always true (data.review_pct is 60)",
        "injection.noul >= data.block_threshold": "always false (data.block_threshold is 85)",
        "injection.noul >= data . thresholds.block": "always false (data.thresholds.block is 85)",
        "1.5 <= queue.confidence": "always false",
        "sev.score >= 7": "'sev.score >= 7' is always false: sev.score is an expected level from 0 to 4",
        # through ``answers`` and quoted names: the text scan read only ``queue.`` and ``data.x``
        'answers.queue.choice == "biling"': "queue has no option 'biling'",
        'answers["queue"].probabilities["tecch"] > 0.5': "no option 'tecch'",
        'injection.noul >= data["block_threshold"]': "'injection.noul >= data[\"block_threshold\"]' is always false "
                                                     '(data["block_threshold"] is 85)',
        "data['thresholds'].block <= answers.injection.noul": "always false (data['thresholds'].block is 85)",
        # an option named in data: the rule loaded and never fired
        "queue.choice == data.route": "queue has no option 'biling' (its options: billing, tech), which data.route "
                                      "holds",
        "data['route'] != answers.queue.choice": "no option 'biling'",
        "queue.choice in data.routes": "queue has none of the options data.routes holds (its options: billing, "
                                       "tech)",
        "queue.probabilities[data.route] > 0.5": "no option 'biling'",
        # a data value of the wrong type: its type is the mistake, not an option in it
        "queue.choice == data.routes": "it compares a string with a list",
        "queue.choice in data.route": "fails on every request",
        "queue.probabilities[data.routes] > 0.5": "cannot be used as a map key",
        # a bound the text scan did not read, as a comparison run alone over the field's range finds it
        "injection.noul * 1.0 >= data.block_threshold": "'injection.noul * 1.0 >= data.block_threshold' is always "
                                                        "false (data.block_threshold is 85): injection.noul is a "
                                                        "probability from 0 to 1",
        'injection.noul >= double(data["block_threshold"])': "is always false (data.block_threshold is 85)",
        "queue.choice == 'tech' || 1.0 - injection.noul < data.review - 1.0": "'1.0 - injection.noul < data.review - "
                                                                              "1.0' is always false (data.review is 0.6)",
        "sev.score * 1.0 >= 4.5": "'sev.score * 1.0 >= 4.5' is always false: sev.score is an expected level from 0 "
                                  "to 4",
    }
    for when, reason in bad.items():
        with pytest.raises(PolicyLoadError) as err:
            load_text(head % when.replace("'", "''"), "p.yaml")
        assert reason in str(err.value) and "rules[0].when" in str(err.value), (when, str(err.value))
    for when in ('injection.noul >= data.review || queue.choice == "bil" + "ling"', "2.0 * injection.noul > 1.5",
                 'queue.choice in ["tech", "billing"] && 0.5 < injection.noul && sev.score >= 4',
                 "queue.choice in data.shared",  # a list the file's policies share: other questions' options too
                 'injection.probabilities["true"] > 0.2 && queue.confidence < 1.0', "injection.noul == 0.5",
                 "sev.score == 1.5 || sev.score != 0.5",  # a score is the expected level: 1.5 can be
                 "injection.noul >= 0.85 && injection.noul <= 1.0",
                 "injection.noul >= data.thresholds.review && data.thresholds.review < 1",  # a band's redundant upper end
                 'answers["queue"].choice == "tech" && answers.injection.noul >= data["thresholds"]["review"]',
                 "injection.noul * 100.0 >= double(data.review_pct) && injection.noul * 100.0 < 60.5",  # a narrow band
                 "queue.choice in data.known && queue.probabilities[data.known[0]] > 0.5",
                 "data.review_pct == 0 && injection.noul > 0.5",  # a switch in data: not an answer's comparison
                 "injection.noul * 1.0 <= 1.0 && sev.score + 0.0 >= 0.0"):  # literal bounds that always hold
        load_text(head % when.replace("'", "''"), "p.yaml")


@pytest.mark.parametrize(
    ("question", "key"),
    [
        ('{type: noul, instructions: "x?", criteria: {true: "yes", "false": "no"}}', "true"),
        ('{type: choice, instructions: "x?", criteria: {a: A, null: B}}', "null"),  # was the option "None"
        ('{type: choice, instructions: "x?", criteria: {a: A, false: B}}', "false"),  # was the option "False"
    ],
)
def test_a_bare_criteria_key_yaml_reads_as_no_text_says_to_quote_it(question: str, key: str) -> None:
    text = f"""
policies:
  - id: a
    version: 1
    match: {{http: {{}}}}
    questions:
      q: {question}
    rules: [{{id: r, when: "true", action: block}}]
"""
    with pytest.raises(PolicyError) as err:
        load_text(text, "p.yaml")
    assert (err.value.line, err.value.key) == (7, f"policies[0].questions.q.criteria.{key}")
    assert f'quote it ("{key}")' in err.value.reason


def test_numbered_choice_options_load_as_the_text_written() -> None:
    """``criteria: {1: Low., 2: Medium., 3: High.}`` loaded as the options "1", "2", "3", then was refused."""
    (policy,) = load_text("""
policies:
  - id: a
    version: 1
    match: {http: {}}
    state: {text: body}
    questions:
      tier: {type: choice, instructions: "Which tier?", criteria: {1: Low., 2: Medium., 3: High.}}
    rules: [{id: r, when: 'tier.choice == "3"', action: block}]
""", "p.yaml")
    assert sorted(policy.questions[0].wire.criteria) == ["1", "2", "3"]


def test_rule_ids_the_verdict_gives_itself_are_refused() -> None:
    """A rule named ``default`` made ``expect: {rule: default}`` ambiguous (that rule, or no rule fired)."""
    from guard.engine.verdicts import GUARD_ERROR_RULE, STATE_TOO_LONG_RULE
    from guard.policy.rules import RESERVED_RULE_IDS

    assert {"default", GUARD_ERROR_RULE, STATE_TOO_LONG_RULE} <= set(RESERVED_RULE_IDS)
    template = """
policies:
  - id: a
    version: 1
    match: {http: {}}
    rules: [{id: "%s", when: "true", action: block}]
"""
    for rule_id, reason in (("default", "the verdict's rule when no rule fired"), ("on_error", "a fail mode decided"),
                            ("my rule!", "it is sent in a response header")):
        with pytest.raises(PolicyLoadError) as err:
            load_text(template % rule_id, "p.yaml")
        assert "rules[0].id" in str(err.value) and reason in str(err.value), str(err.value)
