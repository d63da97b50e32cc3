"""Decision log and telemetry against hostile input: redaction cost, request values in rule errors, deep nesting and
characters that end a line for Unicode-aware readers."""

from __future__ import annotations

import io
import json
import logging
import time
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from guard.engine import Guard, verdicts
from guard.engine.telemetry import (
    LOG_UNREAD_MARKER,
    MAX_DEPTH,
    MAX_DOCUMENT_STRINGS,
    MAX_SCRUBBED_CHARS,
    SCRUB_MAX_VALUES,
    TOO_DEEP,
    DecisionLog,
    Telemetry,
)
from guard.policy import load_text
from guard.policy.rules import trace_rules
from guard.subject import AgentSubject, HttpSubject, body_strings
from guard.verdict import Redaction, Verdict
from tests._backends import ScriptedBackend
from tests._linear import runs_in_time

# Redaction cost -----------------------------------------------------------------------------------------------------


def _token_body(n: int) -> HttpSubject:
    """A request whose body is ``n`` objects each holding one secret-named value, and whose text repeats them all."""
    body = [{"token": f"tk{i:07d}"} for i in range(n)]
    return HttpSubject(method="POST", path="/v1/x", body=body, body_text="\n".join(body_strings(body)))


def _redaction_seconds(n: int) -> float:
    subject = _token_body(n)
    verdict = Verdict("allow", "d1", policy_id="p", state={"text": subject.body_text})
    log = DecisionLog(io.StringIO())
    best = float("inf")
    for _ in range(3):  # the fastest of three: the least disturbed by other work on the machine
        start = time.process_time()
        log.event(verdict, subject)
        best = min(best, time.process_time() - start)
    return best


def test_redaction_time_grows_linearly_with_the_number_of_secret_values() -> None:
    """Each secret value was replaced one at a time in every string (time ~ values x text length: 40,000 values in a
    1 MB body took 15 s on the event loop); 4x the values must now cost about 4x the time, not 16x."""
    small, large = _redaction_seconds(4_000), _redaction_seconds(16_000)
    assert large / max(small, 1e-3) < 9, (small, large)


def test_past_the_cap_every_string_holding_a_secret_is_redacted_whole_and_nothing_leaks() -> None:
    n = 2 * SCRUB_MAX_VALUES
    subject = _token_body(n)
    subject.body.append({"note": "nothing secret here"})
    state = {"text": subject.body_text, "plain": "hello world", "one": "id tk0000200 end"}
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state=state), subject)
    line = json.dumps(event)
    assert not [i for i in range(n) if f"tk{i:07d}" in line]
    assert event["state"] == {"text": "[redacted]", "plain": "hello world", "one": "[redacted]"}
    assert event["input"]["body"][-1] == {"note": "nothing secret here"}


def test_strings_read_for_the_json_they_hold_are_capped_and_nothing_leaks_past_the_cap() -> None:
    """Each string holding a ``{`` is read for the secret-named fields of the JSON it may hold: a body of 200,000
    ``"{"`` strings took 13 s to read one by one; past :data:`MAX_DOCUMENT_STRINGS` such a string is redacted whole,
    so it costs about what a body of other strings does, and a secret past the cap is still not written."""
    def seconds(body: list[str]) -> float:
        subject = HttpSubject(method="POST", path="/", body=body, body_text="\n".join(body))
        log, best = DecisionLog(io.StringIO()), float("inf")
        for _ in range(3):
            start = time.process_time()
            log.event(Verdict("allow", "d1"), subject)
            best = min(best, time.process_time() - start)
        return best

    assert seconds(["{"] * 200_000) / seconds(["x"] * 200_000) < 5
    body = [json.dumps({"note": f"item {i}", "password": f"sekret-{i:05d}"}) for i in range(MAX_DOCUMENT_STRINGS + 10)]
    subject = HttpSubject(method="POST", path="/", content_type="text/plain", body=body, body_text="\n".join(body))
    line = json.dumps(DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": subject.body_text}),
                                                       subject))
    assert "sekret-" not in line and "[redacted]" in line


def test_under_the_cap_values_are_replaced_in_place() -> None:
    """Where two values overlap in the text, the second loses its overlap with the first (the documented limit of
    replacing one value after another, which stays linear in the text)."""
    body = {"token": "abcdWXYZ", "secret": "WXYZefgh", "note": "x abcdWXYZefgh y, code 321, order 43210", "cvv": 321}
    subject = HttpSubject(method="POST", path="/pay", body=body, body_text="\n".join(body_strings(body)))
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1"), subject)
    assert event["input"]["body"]["note"] == "x abcd[redacted] y, code [redacted], order 43210"


def test_long_values_whose_starts_the_text_repeats_cost_linear_time() -> None:
    """One regex alternation of the values tried every value at every position: 128 values of 1,000 characters and
    100,000 characters of their first letter took 30 s (review finding); the time must grow with the text, not
    with the text times the values' length."""
    def seconds(text_length: int) -> float:
        body = [{"token": ("A" if i % 2 else "B") * 1000 + f"{i:05d}"} for i in range(128)]
        body.append({"note": "A" * text_length})
        subject = HttpSubject(method="POST", path="/", body=body, body_text="\n".join(body_strings(body)))
        log, best = DecisionLog(io.StringIO()), float("inf")
        for _ in range(3):
            start = time.process_time()
            log.event(Verdict("allow", "d1", state={"text": subject.body_text}), subject)
            best = min(best, time.process_time() - start)
        return best

    assert seconds(400_000) / max(seconds(100_000), 1e-3) < 9


#: Bodies a pattern of the log's shape scrubbing read in quadratic time (review findings): a long run of hex,
#: base64url or letters with a URL anywhere (each start in the run read to its end as a URL's scheme: 131 KB took
#: 20 s), and ``BEGIN`` lines of a private key without their ``END`` (each read 16 KB ahead for one: 1 MB took 38 s),
#: close together or 16 KB apart.
#: Each as Python source, built in the child process (1 MiB does not fit a command line).
SLOW_SHAPE_BODIES = [
    "{'blob': 'ab' * 524_288, 'callback': 'https://example.com/hook'}",
    "{'note': 'a' * 1_048_576 + ' https://example.com'}",
    "{'note': 'ab' * 500_000 + '1' * 40 + '://app:Hunter2Secret@db/prod'}",
    "{'note': '1' * 1_048_576 + '://app:Hunter2Secret@db/prod'}",
    "{'note': '-----BEGIN PRIVATE KEY-----!' * 37_449}",
    "{'note': '-----BEGIN PRIVATE KEY-----' * 38_836}",
    "{'note': '-----BEGIN PRIVATE KEY-----\\n' * 37_449}",
    "{'note': 'a-----BEGIN PRIVATE KEY-----' * 37_449}",
    "{'note': ('-----BEGIN PRIVATE KEY-----' + 'x' * 16_357) * 64}",
    "{'note': ('-----BEGIN PRIVATE KEY-----' + '-----END ' + 'A' * 16_348) * 64}",
    "{'note': '-----BEGIN PRIVATE KEY-----:' * 37_449}",  # one line: each BEGIN reads at most 272 of it
    "{'note': '-----BEGIN PRIVATE KEY-----\\n' + ('x:' * 100 + 'A' * 15 + '\\n') * 4_500}",
    "{'note': 'authorization' * 80_000}",  # each Authorization header read to where it cannot go on
    "{'note': ('authorization: bearer' + '\\t' * 100) * 8_500}",
    "{'note': ('authorization: digest response=' + '\\t' * 100) * 7_500}",
    "{'note': 'authorization: digest ' + 'response ' * 116_000}",
    "{'note': ('x-api-key:' + '\\t' * 100) * 9_500}",
    "{'note': 'api-key' * 149_000}",
    "{'note': 'cookie:' * 149_000}",  # each cookie header read to its line's end, each pair to its ;
    "{'note': 'cookie: ' + 'a=b;' * 262_000}",
    "{'note': 'cookie:' + '=' * 1_048_000}",
    "{'note': 'cookie: ;a' + '\\t' * 1_048_000}",
]


def test_shape_scrubbing_takes_linear_time_on_long_runs() -> None:
    """Each body of :data:`SLOW_SHAPE_BODIES`, 1 MiB, logged redacted in well under a second; run in a child process
    killed after 60 s (a bound that a loaded machine cannot reach by accident, and that a regular expression, which
    holds the GIL and ignores signals, cannot overrun)."""
    code = (
        "import io\nfrom guard.engine.telemetry import DecisionLog\nfrom guard.subject import HttpSubject, body_strings\n"
        "from guard.verdict import Verdict\n"
        f"for source in {SLOW_SHAPE_BODIES!r}:\n"
        "    body = eval(source)\n"
        "    subject = HttpSubject(method='POST', path='/', body=body, body_text='\\n'.join(body_strings(body)))\n"
        "    DecisionLog(io.StringIO(), log_input='redacted').event(Verdict('allow', 'd1'), subject)\n"
    )
    runs_in_time(code, "the decision log scrubbing a 1 MiB body")


def test_a_string_past_the_scrubbed_length_is_cut_unread() -> None:
    """Past :data:`MAX_SCRUBBED_CHARS` a string is read for secrets in its first and last halves (the tail, where an
    attack hides, is kept and scrubbed); the middle is cut, never written unscrubbed."""
    half = MAX_SCRUBBED_CHARS // 2
    body = {"note": "x" * half + "AKIA" + "A" * 16 + "y" * half + " AKIA" + "B" * 16}
    subject = HttpSubject(method="POST", path="/", body=body, body_text=body["note"])
    event = DecisionLog(io.StringIO(), log_input="redacted", max_chars=2 * MAX_SCRUBBED_CHARS).event(
        Verdict("allow", "d1"), subject)
    marker = LOG_UNREAD_MARKER.format(cut=len(body["note"]) - 2 * half)
    assert event["input"]["body"]["note"] == "x" * half + f"\n{marker}\n" + "y" * (half - 21) + " [redacted]"


_PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA" + "Q" * 1_600 + "Zk3Jw==\n-----END RSA PRIVATE KEY-----"


@pytest.mark.parametrize(("secret", "start", "clear"), [
    ("AKIAIOSFODNN7EXAMPLE", MAX_SCRUBBED_CHARS // 2 - 12, "AKIAIOSF"),  # across the first half's end
    (_PEM, MAX_SCRUBBED_CHARS // 2 - 20, "QQQQ"),
    ("postgres://app:Hunter2Secret@db/prod", MAX_SCRUBBED_CHARS // 2 + 1_000 - 15, "Hunter2Secret"),  # the last's start
    (_PEM, MAX_SCRUBBED_CHARS // 2 + 1_000 - 20, "QQQQ"),
])
def test_a_secret_across_the_cut_of_a_string_past_the_scrubbed_length_is_masked(secret: str, start: int,
                                                                                clear: str) -> None:
    """Each half of a string past :data:`MAX_SCRUBBED_CHARS` was read alone, so a secret that crossed the cut between
    a half and the unread middle was no secret to either and was logged in part (a PEM key's body, a URL's password
    after the cut, 12 characters of an AWS key id): read with what is past the cut, it is masked whole."""
    length = MAX_SCRUBBED_CHARS + 1_000  # the last half starts 1,000 characters after the first ends
    note = "x" * (start - 1) + " " + secret + " "
    note += "y" * (length - len(note))
    subject = HttpSubject(method="POST", path="/", body={"note": note}, body_text=note)
    event = DecisionLog(io.StringIO(), log_input="redacted", max_chars=2 * MAX_SCRUBBED_CHARS).event(
        Verdict("allow", "d1"), subject)
    logged = event["input"]["body"]["note"]
    assert clear not in logged and "[redacted]" in logged
    assert logged.startswith("x" * (min(start, MAX_SCRUBBED_CHARS // 2) - 1)) and logged.endswith("y" * 1_000)


def test_a_secret_nested_past_the_depth_cap_is_still_scrubbed_from_the_text() -> None:
    """Cutting the body at 64 levels hid the password's key from the redaction, so the joined text kept its value
    (review finding)."""
    body: dict[str, Any] = {"password": "hunter2-S3CRET-pw"}
    for _ in range(70):
        body = {"a": body}
    subject = HttpSubject(method="POST", path="/", body=body, body_text="hunter2-S3CRET-pw")
    line = json.dumps(DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": "hunter2-S3CRET-pw"}),
                                                       subject))
    assert "hunter2" not in line and TOO_DEEP in line
    from guard.engine.telemetry import redact_secrets

    assert redact_secrets({"text": "hunter2-S3CRET-pw"}, subject) == {"text": "[redacted]"}



@pytest.mark.parametrize("levels", [60, 62, 63])
def test_a_secret_named_key_whose_value_is_cut_still_scrubs_that_value(levels: int) -> None:
    """``{"password": ["..."]}`` with the list just past the cap: its key was read, its value was the cut marker,
    so the password stayed in the text (review finding)."""
    body: dict[str, Any] = {"password": ["hunter2-S3CRET-pw"]}
    for _ in range(levels):
        body = {"a": body}
    subject = HttpSubject(method="POST", path="/", body=body, body_text="hunter2-S3CRET-pw")
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": "hunter2-S3CRET-pw"}), subject)
    assert "hunter2" not in json.dumps(event)


def test_a_secret_named_dataclass_field_past_the_cap_is_scrubbed() -> None:
    import dataclasses

    from guard.engine.telemetry import redact_secrets

    @dataclasses.dataclass
    class Login:
        password: str

    deep: Any = {"x": Login(password="hunter2-S3CRET-pw")}
    for _ in range(70):
        deep = {"a": deep}
    assert redact_secrets({"text": "hunter2-S3CRET-pw", "deep": deep}) ["text"] == "[redacted]"


# Request values in rule errors --------------------------------------------------------------------------------------

RULE_POLICY = """
data:
  plans: {"KEY-FREE-0001": "free"}
policies:
  - id: r
    version: 1
    match: {http: {paths: ["/**"]}}
    state: {text: body_text}
    questions:
      injection: {type: noul, instructions: Injection}
    rules:
      - {id: RULE, when: 'WHEN', action: block}
    on_error: {mode: closed}
"""


async def _rule_failure(when: str, subject: HttpSubject) -> tuple[Verdict, list[Any], dict[str, Any]]:
    """The verdict, the finished spans and the decision record of one request whose only rule is ``when``."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    lines: list[str] = []
    policies = load_text(RULE_POLICY.replace("WHEN", when).replace("RULE", "the_rule"))
    guard = Guard(policies, backends=ScriptedBackend(), decision_log=DecisionLog(lines.append),
                  telemetry=Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider))
    try:
        verdict = await guard.aevaluate(subject)
    finally:
        await guard.aclose()
        tracer_provider.shutdown()
        meter_provider.shutdown()
    return verdict, list(exporter.get_finished_spans()), json.loads(lines[-1])


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("when", "headers", "kind"),
    [
        ('data.plans[subject.headers["x-api-key"]] == "free"', {"x-api-key": "sk-live-STOLEN-KEY-123456"},
         "KeyError: no such key"),
        ('duration(subject.headers["x-api-key"]) > duration("1s")', {"x-api-key": "sk-live-STOLEN-KEY-123456"},
         "RuntimeError: function 'duration' failed on its arguments"),
        ('subject.headers["x-api-key"].matches(subject.headers["x-pattern"])',
         {"x-api-key": "a", "x-pattern": "(sk-live-STOLEN-KEY-123456"},
         "RuntimeError: function 'matches' failed on its arguments"),
        ('subject.headers["x-api-key"].size() < 2 ? true : subject.headers["x-api-key"]',
         {"x-api-key": "sk-live-STOLEN-KEY-123456"},
         "'when' returned str, not a boolean"),
    ],
)
async def test_a_failing_rule_names_the_failure_never_the_request_value(
    when: str, headers: dict[str, str], kind: str
) -> None:
    subject = HttpSubject(method="POST", path="/v1/x", headers=headers, body={"m": "hi"}, body_text="hi")
    verdict, spans, record = await _rule_failure(when, subject)
    expected = f"rule_error: rule 'the_rule' of policy 'r' failed: {kind}"
    assert (verdict.action, verdict.rule, verdict.error) == ("block", "on_error", expected)
    (span,) = spans
    assert span.attributes["guard.error"] == expected and span.status.description == expected
    assert record["error"] == expected
    assert "STOLEN" not in json.dumps(record)


@pytest.mark.anyio
async def test_a_missing_key_the_rule_itself_names_is_still_shown() -> None:
    subject = HttpSubject(method="POST", path="/v1/x", headers={}, body={"m": "hi"}, body_text="hi")
    verdict, _, _ = await _rule_failure('subject.headers["x-tenant"] == "blocked"', subject)
    assert verdict.error == "rule_error: rule 'the_rule' of policy 'r' failed: KeyError: 'x-tenant'"


@pytest.mark.anyio
async def test_an_unexpected_exception_gives_its_type_only() -> None:
    """Its text is unchecked (a ``KeyError`` quotes its key); the traceback goes to the ``guard.engine`` logger."""
    lines: list[str] = []
    backend = ScriptedBackend(fail=KeyError("sk-live-STOLEN-KEY-123456"))
    policies = load_text(RULE_POLICY.replace("WHEN", "injection.noul > 0.5").replace("RULE", "a"))
    guard = Guard(policies, backends=backend, decision_log=DecisionLog(lines.append))
    try:
        verdict = await guard.aevaluate(HttpSubject(method="POST", path="/v1/x", body={"m": "hi"}, body_text="hi"))
    finally:
        await guard.aclose()
    assert (verdict.action, verdict.error) == ("block", "internal_error: KeyError")
    assert "STOLEN" not in lines[-1]


def test_explain_still_shows_the_runtime_text_locally() -> None:
    (policy,) = load_text(RULE_POLICY.replace("WHEN", 'data.plans[subject.headers["k"]] == "x"').replace("RULE", "a"))
    subject = HttpSubject(method="POST", path="/", headers={"k": "KEY-UNKNOWN"})
    traced = trace_rules("r", policy.rules, {}, subject=subject, data={"plans": {}})
    assert traced == [("a", "KeyError: 'KEY-UNKNOWN'")]


def test_the_log_scrubs_secret_values_from_errors_too() -> None:
    """Defence in depth: an error text that repeats a credential header loses it, in ``error`` and ``policies``."""
    error = "backend: echoed sk-live-STOLEN-KEY-123456 and s3cr3t-body-value"
    subject = HttpSubject(method="POST", path="/", headers={"x-api-key": "sk-live-STOLEN-KEY-123456"},
                          body={"password": "s3cr3t-body-value"})
    part = Verdict("block", "d1", policy_id="a", error=error)
    verdict = Verdict("block", "d1", policy_id="a", error=error, contributions=(part, Verdict("allow", "d1")))
    for mode in ("redacted", "full"):
        event = DecisionLog(io.StringIO(), log_input=mode).event(verdict, subject)
        assert event["error"].startswith("backend: echoed [redacted]") and "sk-live" not in event["error"]
        assert "sk-live" not in event["policies"][0]["error"]
    event = DecisionLog(io.StringIO()).event(verdict, subject)
    assert event["error"] == "backend: echoed [redacted] and [redacted]"


def test_a_malformed_tool_calls_problem_is_left_out_under_none_and_scrubbed_under_redacted() -> None:
    """A malformed call's problem quotes its arguments (a duplicate key), in ``result.message`` and the ``malformed``
    flag: ``none`` writes neither, ``redacted`` scrubs both; a rule's own message is kept (attack finding)."""
    problem = "arguments are not acceptable JSON: duplicate key 'sk-proj-abcdefghijklmnopqrstuvwxyz123456' in an object"
    verdict = verdicts.refused(None, decision_id="d1", rule="malformed_arguments", status=400, message=problem,
                               flags={"malformed": problem})
    subject = AgentSubject(event="tool_call", tool_name="t")
    none = DecisionLog(io.StringIO(), log_input="none").event(verdict, subject)
    assert none["result"]["message"] is None and none["flags"]["malformed"] is None
    redacted = DecisionLog(io.StringIO()).event(verdict, subject)
    assert redacted["result"]["message"] == redacted["flags"]["malformed"] == problem.replace(
        "sk-proj-abcdefghijklmnopqrstuvwxyz123456", "[redacted]")
    rule = Verdict("block", "d2", policy_id="p", rule="r", message="Blocked: this asks for secrets.")
    assert DecisionLog(io.StringIO(), log_input="none").event(rule, subject)["result"]["message"] == rule.message


def test_pointers_hold_no_client_key_that_reads_as_text_nor_a_secret_one() -> None:
    """A redaction's pointer and an ``erased`` entry are made of the client's keys: ``none`` wrote the key
    ``"patient Jane Roe, SSN ..."`` whole, ``redacted`` a token and password held in a secret-named key it erased
    (review finding). A token that is not a plain identifier is written ``[key]``; a plain one is scrubbed as text."""
    private = "patient Jane Roe HIV positive, SSN 078-05-1120"
    secret = "backup token ghp_abcdefghijklmnopqrstuvwxyz0123456789 password hunter2"
    subject = HttpSubject(method="POST", path="/in", body={private: "x", secret: "y", "user_id": "u1"},
                          body_text=f"{private}\nx\n{secret}\ny\nu1")
    verdict = Verdict("redact", "d1", policy_id="p", redactions=(
        Redaction(f"/{private}", 0, 1, "api_key"), Redaction("/items/0/user_id", 0, 1, "api_key"),
        Redaction("/AKIAABCDEFGHIJKLMNOP", 0, 1, "api_key")))
    none = DecisionLog(io.StringIO(), log_input="none").event(verdict, subject)
    assert [r["pointer"] for r in none["result"]["redactions"]] == ["/[key]", "/items/0/user_id", "/[redacted]"]
    redacted = DecisionLog(io.StringIO()).event(verdict, subject)
    assert redacted["result"]["redactions"] == none["result"]["redactions"]
    assert "/input/body/[key]" in redacted["erased"]
    assert "Jane Roe" not in json.dumps(none)  # ``redacted`` keeps the input's body, keys and all
    logged = json.dumps([none, redacted])
    assert "ghp_" not in logged and "hunter2" not in logged
    full = DecisionLog(io.StringIO(), log_input="full").event(verdict, subject)  # keeps the input, keys and all
    assert full["result"]["redactions"][0]["pointer"] == f"/{private}"


def test_cookie_values_and_decoded_basic_credentials_are_scrubbed_where_the_body_repeats_them() -> None:
    """Only the whole Cookie header and the base64 Basic credential were scrubbed: a body repeating the session id
    or the password kept it (attack finding)."""
    subject = HttpSubject(
        method="POST", path="/",
        headers={"cookie": 'sid=SESSIONVALUE123456; theme=dark; quoted="QUOTEDSESSION99"',
                 "authorization": "Basic YWxpY2U6czNjcjN0UGFzc3dvcmQ="},
        body={"note": "my session SESSIONVALUE123456 QUOTEDSESSION99, login alice:s3cr3tPassword, pw s3cr3tPassword, "
                      "theme dark"},
        body_text="my session SESSIONVALUE123456 QUOTEDSESSION99, login alice:s3cr3tPassword, pw s3cr3tPassword, "
                  "theme dark",
    )
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", policy_id="p"), subject)
    logged = json.dumps(event)
    assert "SESSIONVALUE123456" not in logged and "s3cr3tPassword" not in logged and "QUOTEDSESSION99" not in logged
    assert "theme dark" in logged  # a short cookie value is a setting, not a secret: left in the text


# Deep nesting and unbuildable records -------------------------------------------------------------------------------

AGENT_POLICY = """
policies:
  - id: a
    version: 1
    match: {agent: {events: [tool_result]}}
    state:
      tool: tool_name
      result: {from: tool_result, max_chars: 2000}
    questions:
      injection: {type: noul, instructions: Injection}
    rules:
      - {id: inj, when: injection.noul >= 0.8, action: block}
"""


@pytest.mark.anyio
async def test_a_deeply_nested_tool_result_is_logged_cut_and_the_decision_stands() -> None:
    node: Any = "leaf"
    for _ in range(900):
        node = {"a": node}
    lines: list[str] = []
    guard = Guard(load_text(AGENT_POLICY), backends=ScriptedBackend(), decision_log=DecisionLog(lines.append))
    try:
        verdict = await guard.aevaluate(AgentSubject(event="tool_result", tool_name="fetch", tool_call_id="c1",
                                                     tool_result=node))
    finally:
        await guard.aclose()
    assert (verdict.action, verdict.rule) == ("allow", "default")
    value = json.loads(lines[-1])["input"]["tool_result"]
    for _ in range(MAX_DEPTH - 1):  # the subject is the first level
        value = value["a"]
    assert value == TOO_DEEP


def test_a_record_that_cannot_be_built_is_dropped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("sk-live-IN-THE-MESSAGE")

    lines: list[str] = []
    log = DecisionLog(lines.append)
    with caplog.at_level(logging.ERROR, logger="guard.telemetry"):
        assert log.record(Verdict("allow", "d1", policy_id="p", state={"x": Unprintable()}), None) == {}
    assert (lines, log.dropped) == ([], 1)
    assert "could not be built (1 dropped): RuntimeError" in caplog.text and "sk-live" not in caplog.text


# Line separators ----------------------------------------------------------------------------------------------------


def test_characters_that_end_a_line_for_unicode_readers_are_escaped() -> None:
    text = 'x\u2028{"forged":1}\u2029\x85\x9b31m\x80 caf\u00e9 \u65e5\u672c'
    lines: list[str] = []
    DecisionLog(lines.append).record(Verdict("allow", "d1", policy_id="p", state={"m": text}), None)
    (line,) = lines
    assert len(line.splitlines()) == 1
    assert not any(ch in line for ch in "\u2028\u2029\x85\x9b\x80")
    assert "\\u2028" in line and "\\u0085" in line and "caf\u00e9 \u65e5\u672c" in line  # other text stays UTF-8
    assert json.loads(line)["state"]["m"] == text


def test_values_that_are_not_json_are_written_as_their_repr() -> None:
    """``str`` of an httpx URL shows its password where its ``repr`` masks it (review finding)."""
    import httpx

    url = httpx.URL("https://svc:sk-live-PASSWORD123@llm.example/v1")
    subject = AgentSubject(event="tool_result", tool_name="fetch", tool_result={"final_url": url})
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"url": url}), subject)
    assert "sk-live-PASSWORD123" not in json.dumps(event)


@pytest.mark.parametrize("text", [
    "curl -H 'Authorization: Bearer opaqueBEARERtok12345' https://api.example/v1",
    '{"headers": {"Authorization": "Basic dXNlcjpodW50ZXIycGFzcw=="}}',
    "{'Proxy-Authorization': 'Token opaqueBEARERtok12345'}",
    "HTTP_AUTHORIZATION=Bearer opaqueBEARERtok12345",
    "[(b'authorization', b'Bearer opaqueBEARERtok12345')]",  # an ASGI scope's headers
    '[["Authorization", "Bearer opaqueBEARERtok12345"]]',
])
def test_an_authorization_header_written_in_text_has_its_credential_redacted(text: str) -> None:
    """A ``curl -H`` in a tool's arguments or a pasted request keeps an opaque bearer token or Basic pair that no key
    prefix gives away; the log kept it in clear under a field of no secret name (input and state)."""
    subject = HttpSubject(method="POST", path="/v1/x", body={"note": text}, body_text=text)
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": text}), subject)
    line = json.dumps(event)
    assert "opaqueBEARERtok12345" not in line and "dXNlcjpodW50ZXIycGFzcw" not in line
    assert event["state"]["text"].count("[redacted]") == 1


@pytest.mark.parametrize(("text", "logged"), [
    ("curl -H 'x-api-key: opaqueAPIkey12345' https://api.example/v1",
     "curl -H 'x-api-key: [redacted]' https://api.example/v1"),
    ('{"headers": {"Api-Key": "opaqueAPIkey12345", "X-Auth-Token": "opaqueAUTHtok12345"}}',
     '{"headers": {"Api-Key": "[redacted]", "X-Auth-Token": "[redacted]"}}'),
    ("HTTP_X_API_KEY=opaqueAPIkey12345", "HTTP_X_API_KEY=[redacted]"),
    ("[(b'x-api-key', b'opaqueAPIkey12345'), (b'x-auth-token', b'opaqueAUTHtok12345')]",  # an ASGI scope's headers
     "[(b'x-api-key', b'[redacted]'), (b'x-auth-token', b'[redacted]')]"),
    ('[["X-Api-Key", "opaqueAPIkey12345"]]', '[["X-Api-Key", "[redacted]"]]'),
    (('Authorization: Digest username="alice", realm="api", nonce="dcd98b7102dd2f0e", uri="/v1", '
     'response="6629fae49393a05397450978507c4ef1", opaque="5ccc069c403ebaf9"'),
     ('Authorization: Digest username="alice", realm="api", nonce="dcd98b7102dd2f0e", uri="/v1", '
     'response="[redacted]", opaque="5ccc069c403ebaf9"')),
    ("[(b'proxy-authorization', b'Digest username=\"alice\", response=\"6629fae49393a05397450978507c4ef1\"')]",
     "[(b'proxy-authorization', b'Digest username=\"alice\", response=\"[redacted]\"')]"),
    (("Authorization: AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
     "SignedHeaders=host;range;x-amz-date, "
     "Signature=fe5f80f77d5fa3beca038a248ff027d0445342fe2855ddc963176630326f1024"),
     ("Authorization: AWS4-HMAC-SHA256 Credential=[redacted]/20130524/us-east-1/s3/aws4_request, "
     "SignedHeaders=host;range;x-amz-date, Signature=[redacted]")),
    ('curl -H "Authorization: Hawk id=\\"dh37fgj492je\\", mac=\\"6R4rV5iE+NPoym+WwjeHzjAGXUtLNIxmo1vpMofpLAE=\\"" /v1',
     'curl -H "Authorization: Hawk id=\\"dh37fgj492je\\", mac=\\"[redacted]\\"" /v1'),
])
def test_a_credential_header_written_in_text_has_its_value_redacted(text: str, logged: str) -> None:
    """An API key header (``X-Api-Key``, ``Api-Key``, ``X-Auth-Token``) and the secret parameters of a Digest, AWS
    Signature Version 4 or Hawk ``Authorization`` were kept in clear in text (a ``curl -H``, a headers dict, a list
    of header pairs), where the bearer tokens and cookies beside them were masked; the header names stay."""
    subject = HttpSubject(method="POST", path="/v1/x", body={"note": text}, body_text=text)
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": text}), subject)
    assert event["state"]["text"] == logged
    assert event["input"]["body"]["note"] == logged


def test_a_credential_header_name_followed_by_a_word_is_kept() -> None:
    text = "send the X-Api-Key: required for writes; api_key=optional; the Digest response=ok"
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": text}), None)
    assert event["state"]["text"] == text


def test_an_authorization_scheme_followed_by_a_word_is_kept() -> None:
    text = "Authorization: Basic Reviewers may approve; the authorization: token expired"
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": text}), None)
    assert event["state"]["text"] == text


@pytest.mark.parametrize("text", [
    "curl -H 'Cookie: sessionid=abcSESSIONxyz987; csrftoken=CSRFtok5551' https://api.example/v1",
    '{"headers": {"Cookie": "sessionid=abcSESSIONxyz987; csrftoken=CSRFtok5551"}}',
    "HTTP/1.1 200 OK\nSet-Cookie: sessionid=abcSESSIONxyz987, csrftoken=CSRFtok5551; HttpOnly\n",
    "[(b'cookie', b'sessionid=abcSESSIONxyz987; csrftoken=CSRFtok5551')]",  # an ASGI scope's headers
])
def test_a_cookie_header_written_in_text_has_its_values_redacted(text: str) -> None:
    """A session cookie pasted with its header name kept its value in clear under a field of no secret name."""
    subject = HttpSubject(method="POST", path="/v1/x", body={"note": text}, body_text=text)
    line = json.dumps(DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": text}), subject))
    assert "abcSESSIONxyz987" not in line and "CSRFtok5551" not in line


def test_cookies_named_in_prose_are_kept() -> None:
    text = "I like cookies: chocolate and oat; the cookie=yes flag; cookie: none set"
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": text}), None)
    assert event["state"]["text"] == text


def test_a_cookie_value_holding_a_comma_is_masked_whole() -> None:
    """A pair's value was masked up to a comma, so the rest of a value that holds one was logged in clear."""
    text = "curl -H 'Cookie: sid=abc,def123SECRET; theme=dark' https://api.example/v1"
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": text}), None)
    assert event["state"]["text"] == "curl -H 'Cookie: sid=[redacted]; theme=[redacted]' https://api.example/v1"


def test_set_cookie_attributes_are_kept_and_its_cookies_masked() -> None:
    """Path, Domain, Expires, Max-Age and SameSite were masked as if they were cookies (Expires cut at its comma)."""
    text = ("Set-Cookie: sid=abcSESSIONxyz987; Path=/; Domain=example.com; Expires=Wed, 21 Oct 2015 07:28:00 GMT; "
            "Max-Age=3600; HttpOnly; SameSite=Lax")
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": text}), None)
    assert event["state"]["text"] == text.replace("abcSESSIONxyz987", "[redacted]")
    folded = "Set-Cookie: sid=abcSESSIONxyz987; Path=/, csrftoken=CSRFtok5551; HttpOnly"
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": folded}), None)
    assert event["state"]["text"] == "Set-Cookie: sid=[redacted]; Path=[redacted]; HttpOnly"
