"""One span per decision with stable attributes, outcome counters, and the JSON-lines decision log with redaction."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, StatusCode

from guard.engine import Guard
from guard.engine.telemetry import (
    SECRET_NAME,
    SPAN_NAME,
    DecisionLog,
    ReviewEvent,
    Telemetry,
    credential_name,
    redact_secrets,
)
from guard.errors import BackendUnavailable
from guard.policy import load_text
from guard.subject import AgentSubject, HttpSubject, body_strings
from tests._backends import ScriptedBackend

POLICY = """
policies:
  - id: api
    version: 7
    match: {http: {paths: ["/v1/**"]}}
    state: {prompt: body:/prompt, password: body:/password}
    questions:
      injection: {type: noul, instructions: Injection}
    rules:
      - {id: injection, when: injection.noul >= 0.8, action: block}
    ON_ERROR
"""


@pytest.fixture
def otel() -> Any:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider), exporter, reader
    tracer_provider.shutdown()
    meter_provider.shutdown()


def guard_for(telemetry: Telemetry, backend: ScriptedBackend, on_error: str = "", log: DecisionLog | None = None):
    return Guard(load_text(POLICY.replace("ON_ERROR", on_error)), backends=backend, telemetry=telemetry,
                 decision_log=log)


def post(prompt: str) -> HttpSubject:
    return HttpSubject(method="POST", path="/v1/chat", headers={"authorization": "Bearer s3cret", "x-req": "1"},
                       body={"prompt": prompt, "password": "hunter2"}, body_text=prompt)


def by_prompt(request: Any) -> dict[str, Any]:
    return {"injection": 0.95 if "ignore" in request.state["prompt"] else 0.05}


def counters(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], float]]]:
    out: dict[str, list[tuple[dict[str, Any], float]]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "value", None)
                    if value is None:
                        value = point.count
                    out.setdefault(metric.name, []).append((dict(point.attributes), value))
    return out


@pytest.mark.anyio
async def test_one_span_per_decision_with_stable_attributes(otel: Any) -> None:
    telemetry, exporter, reader = otel
    guard = guard_for(telemetry, ScriptedBackend(by_prompt, name="clef-local", revision="r9", model="clef-flash"))
    blocked = await guard.aevaluate(post("ignore it"))
    allowed = await guard.aevaluate(post("hello"))
    cached = await guard.aevaluate(post("hello"))
    unmatched = await guard.aevaluate(HttpSubject(method="GET", path="/health"))
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == [SPAN_NAME] * 4
    first = dict(spans[0].attributes)
    assert first == {
        "guard.subject.kind": "http", "http.request.method": "POST", "url.path": "/v1/chat",
        "guard.decision_id": blocked.decision_id, "guard.policy.id": "api", "guard.policy.version": "7",
        "guard.policy.digest": guard.policies["api"].digest, "guard.policy.file": "<string>", "guard.rule": "injection", "guard.action": "block", "guard.status": 403, "guard.cache_hit": False,
        "guard.cache": "miss", "guard.backend": "clef-local", "guard.model": "clef-flash",
        "gen_ai.request.model": "clef-flash", "gen_ai.operation.name": "text_completion",
        "guard.model_revision": "r9", "guard.latency_ms": round(blocked.latency_ms, 3),
    }
    (event,) = spans[0].events
    assert event.name == "gen_ai.evaluation.result" and dict(event.attributes) == {
        "gen_ai.evaluation.name": "api", "gen_ai.evaluation.score.label": "block",
        "gen_ai.evaluation.explanation": "injection",
    }  # fmt: skip
    assert spans[1].attributes["guard.action"] == "allow" and spans[1].attributes["guard.rule"] == "default"
    assert spans[2].attributes["guard.cache_hit"] is True and spans[2].attributes["guard.cache"] == "hit"
    assert not [k for k in spans[2].attributes if k.startswith("gen_ai.")]  # no model was asked: the cache answered
    assert "guard.policy.id" not in spans[3].attributes and spans[3].attributes["guard.action"] == "allow"
    assert allowed.decision_id != cached.decision_id and unmatched.policy_id is None
    decisions = counters(reader)["guard.decisions"]
    by_action = {(a["guard.policy.id"], a["guard.action"], a["guard.rule"]): v for a, v in decisions}
    assert by_action == {("api", "block", "injection"): 1, ("api", "allow", "default"): 2, ("", "allow", ""): 1}
    lookups = {(a["guard.policy.id"], a["result"]): v for a, v in counters(reader)["guard.cache.lookups"]}
    assert lookups == {("api", "miss"): 2, ("api", "hit"): 1}


def test_the_method_and_the_agent_event_are_cut_like_the_path(otel: Any) -> None:
    """A 12,000-character method (uvicorn passes any token) was written whole on the span and twice in a 25 KB
    decision log line; the span and the log's input cut it at 1,024 characters, as they cut ``url.path``."""
    from guard.verdict import Verdict

    telemetry, exporter, _ = otel
    method, event = "X" * 12_000, "e" * 12_000
    with telemetry.span(HttpSubject(method=method, path="/v1/chat")):
        pass
    with telemetry.span(AgentSubject(event=event, tool_name="search")):  # type: ignore[arg-type]
        pass
    http, agent = (dict(span.attributes) for span in exporter.get_finished_spans())
    assert http["http.request.method"] == "X" * 1021 + "..." and agent["guard.agent.event"] == "e" * 1021 + "..."
    logged = DecisionLog(io.StringIO()).event(Verdict("allow", "d1"), HttpSubject(method=method, path="/v1/chat"))
    assert logged["input"]["method"] == "X" * 1021 + "..."


@pytest.mark.anyio
async def test_without_a_tracer_provider_no_span_is_started_and_a_foreign_span_is_left_alone() -> None:
    # No provider configured (the global proxy, as in this test process) or an explicit no-op one: nothing records.
    assert Telemetry().tracing is False and Telemetry(tracer_provider=NoOpTracerProvider()).tracing is False
    assert Telemetry(tracer_provider=TracerProvider()).tracing is True
    # A recording span of another provider is current: guard's decision writes nothing on it, the context is left
    # as it was, and the decision log still names that trace (as OpenTelemetry's no-op tracer would make it).
    exporter = InMemorySpanExporter()
    foreign = TracerProvider()
    foreign.add_span_processor(SimpleSpanProcessor(exporter))
    lines: list[str] = []
    guard = guard_for(Telemetry(), ScriptedBackend(by_prompt), log=DecisionLog(lines.append))
    with foreign.get_tracer("app").start_as_current_span("request") as outer:
        verdict = await guard.aevaluate(post("ignore it"))
        assert trace.get_current_span() is outer
    assert verdict.action == "block"
    (finished,) = exporter.get_finished_spans()
    assert finished.name == "request" and not any(k.startswith("guard.") for k in finished.attributes)
    record = json.loads(lines[0])
    assert record["trace_id"] == format(outer.get_span_context().trace_id, "032x")
    assert record["span_id"] == format(outer.get_span_context().span_id, "016x")
    foreign.shutdown()


def test_global_providers_set_after_the_guard_was_built_record_within_the_recheck_interval() -> None:
    # A global provider can be set once per process, so this runs in a fresh interpreter.
    code = textwrap.dedent(
        """
        import asyncio
        import time
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from tests._backends import ScriptedBackend
        from guard.engine.telemetry import TRACING_RECHECK_S
        from tests.engine.test_telemetry import Telemetry, by_prompt, counters, guard_for, post

        guard = guard_for(Telemetry(), ScriptedBackend(by_prompt))
        subject = post("hello")
        before = asyncio.run(guard.aevaluate(subject))
        assert not guard.telemetry.tracing
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        asyncio.run(guard.aevaluate(subject))  # counted at once; traced only after the recheck interval
        time.sleep(TRACING_RECHECK_S + 0.1)
        after = asyncio.run(guard.aevaluate(subject))
        spans = exporter.get_finished_spans()
        assert [s.attributes["guard.decision_id"] for s in spans] == [after.decision_id], spans
        assert [value for _, value in counters(reader)["guard.decisions"]] == [2]  # both decisions after the provider
        print("ok", before.action, after.action)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok allow allow"


@pytest.mark.anyio
async def test_fail_mode_spans_and_the_fail_open_counter(otel: Any) -> None:
    telemetry, exporter, reader = otel
    down = ScriptedBackend(fail=BackendUnavailable("HTTP 503", reason="http_503"))
    await guard_for(telemetry, down).aevaluate(post("x"))
    await guard_for(telemetry, down, on_error="on_error: {mode: open}").aevaluate(post("x"))
    closed, opened = exporter.get_finished_spans()
    assert closed.attributes["guard.fail_mode"] == "closed" and closed.attributes["guard.action"] == "block"
    assert closed.attributes["guard.error"] == "http_503: HTTP 503" and closed.status.status_code == StatusCode.ERROR
    assert opened.attributes["guard.fail_mode"] == "open" and list(opened.attributes["guard.flags"]) == ["fail_open"]
    assert [v for _, v in counters(reader)["guard.fail_open"]] == [1]


@pytest.mark.anyio
async def test_decision_log_records_and_redacts(otel: Any) -> None:
    telemetry, exporter, _ = otel
    stream = io.StringIO()
    log = DecisionLog(stream, redact=("/input/headers/authorization", "/input/body/password", "/state/password",
                                      "/input/headers/absent"), labels={"region": "eu"})
    guard = guard_for(telemetry, ScriptedBackend(by_prompt, revision="r9"), log=log)
    verdict = await guard.aevaluate(post("ignore it"))
    await guard.aevaluate(HttpSubject(method="GET", path="/health"))  # unmatched: no record
    (line,) = stream.getvalue().splitlines()
    event = json.loads(line)
    span = exporter.get_finished_spans()[0]
    assert event["decision_id"] == verdict.decision_id
    assert event["policy"] == {"id": "api", "version": "7", "digest": guard.policies["api"].digest, "file": "<string>"}
    assert event["result"]["action"] == "block" and event["result"]["rule"] == "injection"
    assert event["answers"]["injection"]["true"] == pytest.approx(0.95)
    assert (event["cache_hit"], event["cache"], event["revision"], event["fail_mode"]) == (False, "miss", "r9", None)
    assert event["trace_id"] == format(span.context.trace_id, "032x")
    assert event["span_id"] == format(span.context.span_id, "016x")
    assert event["labels"]["region"] == "eu" and event["metrics"]["latency_ms"] > 0
    # the explicit pointers, then what log_input="redacted" removes: x-req is not a header known to carry none
    assert event["erased"] == ["/input/headers/authorization", "/input/body/password", "/state/password",
                               "/input/headers/x-req"]
    assert event["input"]["headers"] == {}
    assert "password" not in event["input"]["body"] and "password" not in event["state"]
    assert "hunter2" not in line and "s3cret" not in line


def test_decision_log_wildcards_sinks_and_errors(tmp_path: Any) -> None:
    from guard.verdict import Verdict

    subject = HttpSubject(method="POST", path="/", body={"messages": [{"content": "a", "role": "u"},
                                                                      {"content": "b", "role": "u"}]})
    lines: list[str] = []
    log = DecisionLog(lines.append, redact=("/input/body/messages/*/content",), include_input=True)
    event = log.record(Verdict("allow", "d1"), subject)
    assert event["erased"] == ["/input/body/messages/0/content", "/input/body/messages/1/content"]
    assert event["input"]["body"]["messages"] == [{"role": "u"}, {"role": "u"}] and len(lines) == 1
    path = tmp_path / "decisions.jsonl"
    file_log = DecisionLog(path)
    file_log.record(Verdict("block", "d2"), None)
    file_log.close()
    assert json.loads(path.read_text())["decision_id"] == "d2"

    def broken(line: str) -> None:
        raise OSError("disk full")

    failing = DecisionLog(broken)
    failing.record(Verdict("allow", "d3"), None)  # the decision is not lost because the log is
    assert failing.dropped == 1
    with pytest.raises(ValueError, match="must be a JSON pointer"):
        DecisionLog(lines.append, redact=("input/x",))


def test_a_review_record_names_who_decided_and_keeps_only_the_notes_digest() -> None:
    import hashlib

    lines: list[str] = []
    log = DecisionLog(lines.append, labels={"service": "payments"})
    event = ReviewEvent("approved", "d1", "rv_0123456789abcdef01234567", "alice", tenant="acme", policy_id="hold",
                        policy_version="3", note="pin is 4321", accept_unseen_body=True)
    with TracerProvider().get_tracer("test").start_as_current_span("review call") as span:
        record = log.review(event)
    assert json.loads(lines[0]) == record
    assert {k: v for k, v in record.items() if k not in ("timestamp", "trace_id", "span_id")} == {
        "kind": "review", "event": "approved", "decision_id": "d1", "review_id": "rv_0123456789abcdef01234567",
        "labels": {"app": "guard", "version": record["labels"]["version"], "service": "payments"},
        "reviewer": "alice", "tenant": "acme", "policy": {"id": "hold", "version": "3"}, "accept_unseen_body": True,
        "note_sha256": hashlib.sha256(b"pin is 4321").hexdigest()}
    assert record["span_id"] == format(span.get_span_context().span_id, "016x") and "4321" not in lines[0]

    def broken(line: str) -> None:
        raise OSError("disk full")

    failing = DecisionLog(broken)
    failing.review(event)  # the review stands whatever the sink does
    assert failing.dropped == 1
    with pytest.raises(ValueError, match="review event 'maybe' is not one of"):
        ReviewEvent("maybe", "d1", "rv_x", None)


def test_redacted_scrubs_every_copy_of_a_credential_header_and_short_or_keyed_secrets() -> None:
    """The default pointers remove the credential headers; under ``redacted`` their values are also scrubbed from the
    state and the body's text that repeat them (they were left in clear while lesser headers were scrubbed), as are
    a 3-digit security code, a secret written as an object key, and ``pwd``/``pass``/``security_code`` fields."""
    from guard.verdict import Verdict

    body = {"note": "my token is Bearer SECRET-BEARER-abc and sid=SECRET-COOKIE-987", "cvv": "123",
            "api_keys": {"sk-live-0123456789abcdefghij": "active"}, "pwd": "hunter2", "pass": "opensesame",
            "security_code": "4321"}
    subject = HttpSubject(method="POST", path="/pay", body=body, body_text="\n".join(body_strings(body)),
                          headers={"authorization": "Bearer SECRET-BEARER-abc", "cookie": "sid=SECRET-COOKIE-987"})
    state = {"caller": "Bearer SECRET-BEARER-abc", "jar": "sid=SECRET-COOKIE-987", "text": subject.body_text}
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state=state), subject)
    line = json.dumps(event)
    for secret in ("SECRET-BEARER", "SECRET-COOKIE", "sk-live-0123456789", "hunter2", "opensesame"):
        assert secret not in line, secret
    logged = json.dumps([event["input"], event["state"]])  # not the ids and times, which may hold any digits
    assert "4321" not in logged and "123" not in logged
    assert event["state"]["caller"] == "[redacted]" and "my token is" in event["state"]["text"]
    # a 3-digit code is scrubbed where it stands alone, not inside other numbers; a number field counts too
    body = {"cvv": 321, "note": "code 321, order 43210"}
    subject = HttpSubject(method="POST", path="/pay", body=body, body_text="\n".join(body_strings(body)))
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d2"), subject)
    assert event["input"]["body_text"] == "code [redacted], order 43210"


SECRET_FIELDS = ("card_cvv", "cvv2", "cardCvc", "cc_number", "ccnum", "card_num", "pw", "new_pw", "pwd", "otp_code",
                 "verification_code", "mfa_code", "auth_code", "ssn_number", "auth_key", "client_key", "ssh_key",
                 "hmac", "PHPSESSID", "sess_id", "password", "api_key", "pin", "iban", "card_number", "secret_key",
                 "signing_key", "encryption_key", "private_key", "license_key", "x-ssh-key", "pass_phrase",
                 "passphrase", "totp", "totp_code", "backup_code", "backup_codes", "recovery_codes", "seed_phrase",
                 "mnemonic", "credit_card", "pin_number", "account_number", "routing_number", "security_answer",
                 "connection_string", "connectionString", "conn_str", "DATABASE_URL", "databaseUrl", "dsn",
                 "sentry_dsn")
ORDINARY_FIELDS = ("keyboard", "monkey", "turkey", "keys", "passage", "compass", "pinned", "spinach", "sidebar",
                   "ticket", "tickets_sold", "topic", "code", "zip_code", "country_code", "sword", "power", "lesson",
                   "success", "accent", "messages", "description", "assessment_id", "object_key", "sort_key",
                   "primary_key", "idempotency_key", "public_key", "cache_key", "partition_key", "foreign_key",
                   "key_id", "acc_num", "spin_number", "bottom", "connection_id", "database", "windsnow")


@pytest.mark.parametrize("name", SECRET_FIELDS)
def test_common_secret_and_card_field_names_are_secret_names(name: str) -> None:
    """``card_cvv``, ``cvv2``, ``cc_number``, ``pw``, ``otp_code``, ``ssn_number``, ``client_key``... were kept by the
    ``redacted`` log (only whole-name ``cvv``, ``otp``, ``ssn``, ``pwd`` counted)."""
    assert SECRET_NAME.search(name) and credential_name(name)


@pytest.mark.parametrize("name", ORDINARY_FIELDS)
def test_ordinary_field_names_are_not_secret_names(name: str) -> None:
    assert not SECRET_NAME.search(name)


@pytest.mark.parametrize(("name", "credential"), [
    ("PHPSESSID", True), ("sid", True), ("ticket", True), ("hmac", True), ("code", True), ("x-functions-key", True),
    ("app_key", True), ("x-idempotency-key", True), ("sort_key", True), ("x-webhook-sig", True),
    ("tickets", False), ("sidebar", False), ("q", False), ("state", False), ("page_key_count", False),
])  # fmt: skip
def test_query_credentials_include_session_ids_and_cas_tickets(name: str, credential: bool) -> None:
    assert credential_name(name) is credential


def test_redacted_removes_card_codes_short_passwords_and_session_ids_from_body_and_query() -> None:
    from guard.verdict import Verdict

    body = {"message": "hi", "card_cvv": "9876", "cvv2": "5432", "cc_number": "4111111111111111", "pw": "PWVAL123",
            "otp_code": "123456", "ssh_key": "SSHKEYVAL", "ssn_number": "123-45-6789", "ticket": "Card charged twice"}
    query = {"PHPSESSID": ["PHPSESSVAL123"], "sid": ["SIDVALUE12345"], "ticket": ["ST-CASTICKET1"], "q": ["1"]}
    subject = HttpSubject(method="POST", path="/pay", body=body, query=query, body_text="\n".join(body_strings(body)))
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={"text": subject.body_text}), subject)
    logged = json.dumps([event["input"], event["state"]])
    for secret in ("9876", "5432", "4111111111111111", "PWVAL123", "123456", "SSHKEYVAL", "123-45-6789",
                   "PHPSESSVAL123", "SIDVALUE12345", "ST-CASTICKET1"):
        assert secret not in logged, secret
    assert event["input"]["body"] == {"message": "hi", "ticket": "Card charged twice"}
    assert event["input"]["query"] == {"q": ["1"]}


def test_the_raw_query_string_is_not_logged_beside_the_redacted_query() -> None:
    """``input.query_string`` (the query as sent) was written as it is: ``api_key`` and ``password`` values the
    redacted ``query`` drops, and a card number a ``redact`` rule could not mask (``query`` withheld), were kept."""
    from guard.policy.redact import UNMASKABLE_FLAG
    from guard.verdict import Verdict

    raw = "q=x&api_key=s3cr%2Ft%2Bvalue%2F123&password=hunter2%21%21&note=4111+1111+1111+1111"
    subject = HttpSubject(method="GET", path="/s", query_string=raw,
                          query={"q": ["x"], "api_key": ["s3cr/t+value/123"], "password": ["hunter2!!"],
                                 "note": ["4111 1111 1111 1111"]})
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={}), subject)
    assert "query_string" not in event["input"]
    assert event["input"]["query"] == {"q": ["x"], "note": ["[redacted]"]}  # a card number, by its shape
    assert "s3cr" not in json.dumps(event) and "hunter2" not in json.dumps(event)
    unmaskable = DecisionLog(io.StringIO()).event(Verdict("block", "d2", state={}, flags={UNMASKABLE_FLAG: 1}), subject)
    assert "query_string" not in unmaskable["input"] and "4111" not in json.dumps(unmaskable)


def test_the_raw_form_is_not_logged_beside_the_redacted_body() -> None:
    """``input.form_string`` (a urlencoded body as sent, kept where qs may name a field otherwise) holds what the
    logged ``body`` redacts: it is left out as ``query_string`` is."""
    from guard.verdict import Verdict

    raw = "q[=]=x&password=hunter2%21%21"
    subject = HttpSubject(method="POST", path="/s", content_type="application/x-www-form-urlencoded",
                          body={"q[": ["]=x"], "password": ["hunter2!!"]}, form_string=raw)
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state={}), subject)
    assert "form_string" not in event["input"] and event["input"]["body"] == {"q[": ["]=x"]}
    assert "hunter2" not in json.dumps(event)


def test_a_body_field_named_for_a_key_that_is_no_secret_is_kept_and_its_value_not_scrubbed_from_text() -> None:
    """Every body field whose last word was ``key`` counted as a secret: an ``object_key``'s value was removed and
    scrubbed from every free text (a reviewer approving "delete reports/2024/q3-payroll.pdf" read "delete
    [redacted]"; review finding). As a query parameter such a name still counts as a credential."""
    from guard.verdict import Verdict

    body = {"object_key": "reports/2024/q3-payroll.pdf", "sort_key": "price", "signing_key": "SIGNKEY-778899",
            "note": "delete reports/2024/q3-payroll.pdf by price, signed SIGNKEY-778899"}
    subject = HttpSubject(method="POST", path="/v1/delete", body=body, query={"object_key": ["QUERYKEY-123456"]},
                          body_text=body["note"])
    state = {"text": subject.body_text}
    assert redact_secrets(state, subject) == {"text": "delete reports/2024/q3-payroll.pdf by price, signed [redacted]"}
    event = DecisionLog(io.StringIO()).event(Verdict("allow", "d1", state=state), subject)
    assert event["input"]["body"] == {"object_key": "reports/2024/q3-payroll.pdf", "sort_key": "price",
                                      "note": "delete reports/2024/q3-payroll.pdf by price, signed [redacted]"}
    assert event["input"]["query"] == {}


def test_leaving_the_input_out_scrubs_the_state_as_much_and_full_mode_scrubs_credential_headers() -> None:
    """``include_input=False`` writes a state no less redacted than ``include_input=True`` (its secret values were
    only collected from the written input), and ``full`` keeps no credential header's value that the state read."""
    from guard.verdict import Verdict

    subject = HttpSubject(method="POST", path="/v1/chat", query={"api_key": ["QUERYSECRET-123456"]},
                          headers={"authorization": "Bearer sk-live-ABCDEF123456", "x-functions-key": "FUNCKEY-0987654321"},
                          body={"prompt": "hello", "password": "hunter2hunter2"},
                          body_text="QUERYSECRET-123456\nhello\nhunter2hunter2")
    state = {"text": subject.body_text, "h1": "Bearer sk-live-ABCDEF123456", "h2": "FUNCKEY-0987654321"}
    verdict = Verdict("allow", "d1", state=state)
    with_input = DecisionLog(io.StringIO()).event(verdict, subject)
    without = DecisionLog(io.StringIO(), include_input=False).event(verdict, subject)
    assert without["input"] is None and without["state"] == with_input["state"]
    assert without["state"] == {"text": "[redacted]\nhello\n[redacted]", "h1": "[redacted]", "h2": "[redacted]"}
    assert not [p for p in without["erased"] if p.startswith("/input/")]  # it names only what the record had
    full = DecisionLog(io.StringIO(), log_input="full", include_input=False).event(verdict, subject)
    assert full["state"] == {**state, "h1": "[redacted]"} and "sk-live" not in json.dumps(full)


def test_full_mode_removes_a_credential_header_spelled_with_underscores() -> None:
    """A WSGI application reads ``x_api_key`` as ``X-Api-Key``; ``full`` removed ``x-api-key`` and wrote
    ``x_api_key`` (and every state value repeating it) as sent."""
    from guard.verdict import Verdict

    for name in ("x-api-key", "x_api_key", "proxy_authorization"):
        subject = HttpSubject(method="POST", path="/v1/chat", headers={name: "client-key-0123456789", "x-tier": "gold"})
        verdict = Verdict("allow", "d1", state={"key": "client-key-0123456789"})
        event = DecisionLog(io.StringIO(), log_input="full").event(verdict, subject)
        assert event["input"]["headers"] == {"x-tier": "gold"} and "client-key" not in json.dumps(event), name
        assert f"/input/headers/{name}" in event["erased"]
