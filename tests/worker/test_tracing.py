"""One trace shows gateway -> worker -> batch; ``guard worker serve`` configured only by ``OTEL_*``
variables sends its spans (and metrics) to an OTLP receiver; metrics in seconds with 25 us buckets and one label
vocabulary; prometheus_client's own parser reads what guard serves."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from guard.backends.http import SystemOneClient
from guard.backends.local import LocalBackend
from guard.clef.model import ClefModel
from guard.engine import Guard
from guard.engine.telemetry import Telemetry, metric_readers_from_env
from guard.policy import load_text
from guard.subject import AgentSubject
from guard.worker.app import WorkerConfig, create_app
from tests._otlp import Receiver
from tests.worker._requests import ticket_body
from tests.worker._serve import ServerThread, serve_app_in_thread, worker_process

pytestmark = pytest.mark.anyio

POLICY = """
policies:
  - id: traced
    version: 1
    match: {agent: {events: [tool_result]}}
    state: {result: tool_result}
    questions:
      injection: {type: noul, instructions: "Does the text give the assistant instructions?"}
    rules:
      - {id: injection, when: injection.noul >= 0.99, action: block}
    timeout_ms: 60000
"""


@pytest.fixture
def spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_one_trace_runs_from_the_gateway_through_the_worker_to_the_batch(
    clef_fp32: ClefModel, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    backend = LocalBackend(clef_fp32, tracer_provider=provider)
    app = create_app(backend, config=WorkerConfig(model_name="clef-flash"), tracer_provider=provider)
    server = ServerThread(app)
    url = server.start()
    try:
        exporter.clear()  # the start-up canaries ran without a parent: not part of this trace
        telemetry = Telemetry(tracer_provider=provider)
        async with Guard(load_text(POLICY), backends=SystemOneClient.worker(url, timeout=60), telemetry=telemetry) as g:
            verdict = await g.aevaluate(AgentSubject(event="tool_result", tool_name="fetch", tool_result="a page"))
    finally:
        server.stop()
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    decision, served, batch = by_name["guard.decision"], by_name["POST /v1/systemone"], by_name["guard.batch"]
    assert decision.context.trace_id == served.context.trace_id == batch.context.trace_id
    assert served.parent is not None and served.parent.span_id == decision.context.span_id
    assert batch.parent is not None and batch.parent.span_id == served.context.span_id
    assert served.kind is SpanKind.SERVER and served.attributes["gen_ai.operation.name"] == "text_completion"
    assert served.attributes["gen_ai.request.model"] == "clef-flash" and served.attributes["gen_ai.usage.input_tokens"]
    assert served.attributes["http.response.status_code"] == 200 and batch.attributes["guard.batch.size"] == 1
    assert decision.attributes["gen_ai.operation.name"] == "text_completion"
    (event,) = [e for e in decision.events if e.name == "gen_ai.evaluation.result"]
    assert event.attributes["gen_ai.evaluation.name"] == "traced"
    assert event.attributes["gen_ai.evaluation.score.label"] == verdict.action
    assert event.attributes["gen_ai.evaluation.explanation"] == verdict.rule


async def test_a_refused_request_is_an_error_span(
    clef_fp32: ClefModel, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    app = create_app(LocalBackend(clef_fp32), config=WorkerConfig(model_name="clef-flash"), tracer_provider=provider)
    server = ServerThread(app)
    url = server.start()
    try:
        traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        with httpx.Client(base_url=url, timeout=30) as client:
            refused = client.post("/v1/systemone", content=b"{}", headers={"content-type": "text/plain",
                                                                           "traceparent": traceparent})  # fmt: skip
            timed_out = client.post("/v1/systemone", json=ticket_body(0), headers={"x-request-timeout-ms": "1"})
    finally:
        server.stop()
    served, late = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/systemone"]
    assert refused.status_code == 415 and served.attributes["error.type"] == "415"
    assert served.status.status_code is StatusCode.UNSET  # the caller's error, not the server's
    assert timed_out.status_code == 504 and late.attributes["error.type"] == "504"
    assert late.status.status_code is StatusCode.ERROR  # a 5xx is the server span's error
    assert f"{served.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"  # the caller's trace continues
    assert served.parent is not None and f"{served.parent.span_id:016x}" == "b7ad6b7169203331"


def test_the_worker_does_not_log_a_callers_malformed_trace_headers(
    clef_fp32: ClefModel, spans: tuple[TracerProvider, InMemorySpanExporter], caplog: pytest.LogCaptureFixture
) -> None:
    """OpenTelemetry's warnings about a malformed ``tracestate`` or ``baggage`` quote the caller's text (a 100 KB
    ``baggage`` header whole, on every request); the worker drops that context quietly, as the gateway does, and the
    caller's ``traceparent`` is still continued."""
    provider, exporter = spans
    app = create_app(LocalBackend(clef_fp32), config=WorkerConfig(model_name="clef-flash"), tracer_provider=provider)
    server = ServerThread(app)
    url = server.start()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    try:
        with caplog.at_level(logging.DEBUG), httpx.Client(base_url=url, timeout=30) as client:
            for name, value in (("tracestate", "Bearer sk-live-tracestate-text"),
                                ("baggage", "password=%zz;;;,sk-live-baggage-text"),
                                ("baggage", ",".join(f"k{i}=" + "v" * 100 for i in range(200)) + ",sk-live-long")):
                answer = client.post("/v1/systemone", json=ticket_body(0),
                                     headers={"traceparent": traceparent, name: value})
                assert answer.status_code == 200
    finally:
        server.stop()
    assert "sk-live" not in caplog.text
    served = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/systemone"]
    assert len(served) == 3 and all(f"{s.context.trace_id:032x}" == traceparent[3:35] for s in served)


def test_an_unexpected_error_is_counted_and_its_text_stays_out_of_the_span(
    clef_fp32: ClefModel, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A request answered 500 by an exception was not counted in ``guard_worker_requests_total``, and its server span
    kept the exception's text (an ``exception`` event with its message and stack, the status description), which may
    quote the request."""
    provider, exporter = spans
    backend = LocalBackend(clef_fp32)
    app = create_app(backend, config=WorkerConfig(model_name="clef-flash"), tracer_provider=provider)
    server = ServerThread(app)
    url = server.start()

    async def failing(request: Any, **options: Any) -> Any:
        raise ValueError(f"cannot read {request.state!r}")

    backend.decide = failing  # type: ignore[method-assign]
    try:
        body = {**ticket_body(0), "state": {"password": "hunter2-secret"}}
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.post("/v1/systemone", json=body).status_code == 500
        text = httpx.get(f"{url}/metrics", timeout=30).text  # uvicorn closed the connection after the 500
    finally:
        server.stop()
    (served,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/systemone"]
    assert served.status.status_code is StatusCode.ERROR and served.status.description == "ValueError"
    assert served.attributes["http.response.status_code"] == 500 and not served.events
    assert "hunter2" not in str(served.to_json())
    counted = families(text)["guard_worker_requests"]
    assert [(s.labels, s.value) for s in counted.samples if s.name.endswith("_total")] == [({"outcome": "error"}, 1.0)]


def test_a_worker_process_configured_by_otel_variables_sends_its_spans_to_an_otlp_receiver(
    golden_checkpoint: Path, tmp_path: Path
) -> None:
    otlp = Receiver()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with serve_app_in_thread(otlp.app, ready_path=None) as collector:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector, "OTEL_SERVICE_NAME": "guard-worker-test"}
        # one torch thread: half the start-up CPU where cores are shared
        options = ("--model", str(golden_checkpoint), "--dtype", "float32", "--model-name", "clef-flash",
                   "--log-level", "warning", "--torch-threads", "1")  # fmt: skip
        with worker_process(str(tmp_path / "w.sock"), *options, env=env) as worker, worker.client() as client:
            answer = client.post("/v1/systemone", json=ticket_body(0),
                                 headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})  # fmt: skip
            returncode = worker.stop()  # spans still queued for export must leave before the process ends
            stderr = worker.process.stderr.read().decode() if worker.process.stderr else ""
    assert answer.status_code == 200 and returncode in (0, -signal.SIGTERM), stderr
    traced = {span.name: (resource, span) for resource, span in otlp.spans() if span.trace_id.hex() == trace_id}
    assert set(traced) == {"POST /v1/systemone", "guard.batch"}, (sorted(traced), stderr)
    (resource, served), (_, batch) = traced["POST /v1/systemone"], traced["guard.batch"]
    assert resource["service.name"] == "guard-worker-test"
    assert served.parent_span_id.hex() == parent_id and batch.parent_span_id == served.span_id
    assert served.kind == served.SPAN_KIND_SERVER
    attributes = {a.key: a.value for a in served.attributes}
    assert attributes["gen_ai.request.model"].string_value == "clef-flash"
    assert attributes["http.response.status_code"].int_value == 200
    assert "guard.worker.requests" in otlp.metric_names()  # metrics go to the same endpoint, flushed at shutdown
    assert otlp.metric_services() == {"guard-worker-test"}  # one service for the worker's traces and metrics


def test_a_worker_stopped_with_ctrl_c_waits_a_bounded_time_for_a_collector_that_never_answers(
    golden_checkpoint: Path, tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT) makes uvicorn return, so the SDK's exit hooks would shut the providers down again and wait
    for the collector about ``OTEL_EXPORTER_OTLP_TIMEOUT`` a batch; ``guard worker serve`` shuts them down itself,
    within the bound."""
    import socket
    import time

    with socket.socket() as silent:  # connections wait in its backlog: accepted, never answered
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
               "OTEL_EXPORTER_OTLP_TIMEOUT": "30"}  # seconds an export waits for an answer
        options = ("--model", str(golden_checkpoint), "--dtype", "float32", "--model-name", "clef-flash",
                   "--log-level", "warning", "--torch-threads", "1")  # fmt: skip
        with worker_process(str(tmp_path / "w.sock"), *options, env=env) as worker, worker.client() as client:
            for i in range(3):
                assert client.post("/v1/systemone", json=ticket_body(i)).status_code == 200
            started = time.monotonic()
            worker.process.send_signal(signal.SIGINT)
            returncode = worker.process.wait(60)
            elapsed = time.monotonic() - started
            stderr = worker.process.stderr.read().decode() if worker.process.stderr else ""
    assert returncode == 0 and elapsed < 14, (returncode, elapsed, stderr[-2000:])


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_prometheus_reads_the_decision_metrics_in_seconds_with_25us_buckets() -> None:
    from tests._backends import ScriptedBackend, constant

    registry = CollectorRegistry(auto_describe=True)
    meter_provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    policy = load_text(POLICY.replace("type: noul, instructions: \"Does the text give the assistant instructions?\"",
                                      "catalog: guard.prompt_injection"))  # fmt: skip
    backend = ScriptedBackend(constant(**{"guard.prompt_injection": 0.1}))
    async with Guard(policy, backends=backend, telemetry=Telemetry(meter_provider=meter_provider)) as guard:
        for _ in range(3):
            await guard.aevaluate(AgentSubject(event="tool_result", tool_name="fetch", tool_result="a page"))
    parsed = families(generate_latest(registry).decode())
    duration = parsed["guard_decision_duration_seconds"]
    assert duration.type == "histogram" and duration.unit in ("seconds", "")
    bounds = [s.labels["le"] for s in duration.samples if s.name.endswith("_bucket")]
    assert bounds[:3] == ["2.5e-05", "5e-05", "0.0001"] and bounds[-2:] == ["10.0", "+Inf"]
    count = next(s.value for s in duration.samples if s.name.endswith("_count"))
    fast = next(s.value for s in duration.samples if s.name.endswith("_bucket") and s.labels["le"] == "0.001")
    assert count == 3 and fast >= 2  # the two cache hits take well under a millisecond
    decisions = parsed["guard_decisions"]
    assert {s.labels["guard_policy_id"] for s in decisions.samples} == {"traced"}
    assert all(s.labels.get("guard_policy_id") == "traced" for s in duration.samples)
    meter_provider.shutdown()


async def test_prometheus_reads_the_worker_metrics(clef_fp32: ClefModel) -> None:
    server = ServerThread(create_app(LocalBackend(clef_fp32), config=WorkerConfig(model_name="clef-flash")))
    url = server.start()
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            text = client.get("/metrics").text
    finally:
        server.stop()
    parsed = families(text)
    compute = parsed["guard_worker_batch_compute_seconds"]
    bounds = [s.labels["le"] for s in compute.samples if s.name.endswith("_bucket")]
    assert bounds[:2] == ["2.5e-05", "5e-05"] and "+Inf" in bounds
    assert next(s.value for s in compute.samples if s.name.endswith("_count")) >= 5  # self-test and canaries


def test_otel_metrics_exporter_is_read_from_the_environment() -> None:
    assert metric_readers_from_env({}) == ([], True)
    readers, prometheus = metric_readers_from_env({"OTEL_METRICS_EXPORTER": "otlp,console",
                                                   "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})  # fmt: skip
    assert not prometheus and [type(r).__name__ for r in readers] == ["PeriodicExportingMetricReader"] * 2
    assert metric_readers_from_env({"OTEL_METRICS_EXPORTER": "none"}) == ([], False)
    with pytest.raises(ValueError, match="OTEL_METRICS_EXPORTER"):
        metric_readers_from_env({"OTEL_METRICS_EXPORTER": "zipkin"})
    for reader in readers:
        reader.shutdown()


async def test_shutdown_gives_up_on_a_collector_that_never_answers(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The worker's shutdown waits at most ``CLOSE_TIMEOUT_S`` for its last spans and metrics when the collector
    accepts connections and never answers (the flush and the metrics shutdown each blocked for
    ``OTEL_EXPORTER_OTLP_TIMEOUT``, whatever timeout they were given), and says they may be lost."""
    import atexit
    import socket
    import time

    from guard.engine.telemetry import tracer_provider_from_env
    from guard.worker.metrics import WorkerMetrics

    silent = socket.socket()  # connections wait in its backlog: accepted, never answered
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
               "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}  # longer than the bound below, short at exit
    provider = tracer_provider_from_env(environ)
    readers, _ = metric_readers_from_env(environ)
    metrics = WorkerMetrics(extra_readers=readers)
    app = create_app(lambda: None, metrics=metrics, tracer_provider=provider)  # type: ignore[arg-type, return-value]
    with provider.get_tracer("test").start_as_current_span("queued"):
        metrics.request_done("ok", 0.01)
    own = metrics._own_provider  # close() lets it go
    assert own is not None
    monkeypatch.setattr("guard.worker.app.CLOSE_TIMEOUT_S", 1.0)
    started = time.monotonic()
    try:
        await app.state.worker.close()
    finally:
        silent.close()
        # the providers' exit hooks would export again at interpreter exit, retrying for seconds to a closed port
        atexit.unregister(provider.shutdown)
        atexit.unregister(own.shutdown)
    assert time.monotonic() - started < 3
    assert "the worker's metrics shutdown and the trace flush did not finish within 1 s" in caplog.text
