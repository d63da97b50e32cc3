"""SystemOneClient against a real worker (TCP and Unix socket) and a local stand-in of the Workers AI envelope."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard._json import loads
from guard.backends import http as http_module
from guard.backends import open_backend
from guard.backends.base import DecisionBackend
from guard.backends.batcher import BatcherConfig
from guard.backends.http import PROVIDERS, RetryConfig, SystemOneClient, parse_retry_after
from guard.backends.local import LocalBackend
from guard.clef.model import ClefModel
from guard.errors import BackendRejected, BackendTimeout, BackendUnavailable, MalformedAnswer
from guard.systemone import SystemOneRequestV1
from guard.systemone.wire import max_answer_bytes
from tests.backends._standin import PATH, WorkersAIStandIn, socket_that_resets
from tests.worker._requests import long_body, ticket_body
from tests.worker._serve import RunningWorker, serve_app_in_thread, serve_worker

pytestmark = pytest.mark.anyio

ERROR_BYTES = 64 * 1024  # what a client reads of an error answer
FAST_RETRY = RetryConfig(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05)
REQUEST = SystemOneRequestV1.from_json(
    {
        "model": "clef-flash",
        "state": {"ticket": "Card charged twice"},
        "questions": {
            "churn": {"type": "noul", "instructions": "Will they leave?"},
            "queue": {"type": "choice", "instructions": "Which queue?", "criteria": {"billing": None, "tech": "Bugs"}},
            "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high", "now"]},
        },
    }
)


@pytest.fixture(scope="module")
def standin() -> Iterator[tuple[str, WorkersAIStandIn]]:
    server = WorkersAIStandIn()
    with serve_app_in_thread(server.app, ready_path=None) as url:
        yield url, server


def workers_ai(standin: tuple[str, WorkersAIStandIn], scenario: str, **kwargs: object) -> SystemOneClient:
    url, _ = standin
    kwargs.setdefault("retry", FAST_RETRY)
    return SystemOneClient(
        url + PATH.format(scenario=scenario, model="clef-flash"),
        provider="workers-ai",
        api_key="token-123",
        model="clef-flash",
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def worker(clef_fp32: ClefModel) -> Iterator[RunningWorker]:
    backend = LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_wait_ms=5))
    with serve_worker(backend) as running:
        yield running


# ------------------------------------------------------------------------------------------------- the stand-in


async def test_success_envelope_is_unwrapped_and_checked(standin: tuple[str, WorkersAIStandIn]) -> None:
    _, server = standin
    async with workers_ai(standin, "ok") as client:
        response = await client.decide(REQUEST.override(model="anything"))
    assert isinstance(client, DecisionBackend)
    assert list(response.answers) == ["churn", "queue", "urgency"]
    assert response.answers["queue"].choice == "billing" and response.usage.input_tokens == 42
    scenario, headers, body = server.requests[-1]
    assert scenario == "ok" and headers["authorization"] == "Bearer token-123"
    assert body["model"] == "clef-flash"  # Workers AI requires the body's model to match the URL
    assert "x-request-timeout-ms" not in headers


async def test_unwrapped_body_is_accepted(standin: tuple[str, WorkersAIStandIn]) -> None:
    async with workers_ai(standin, "unwrapped") as client:
        response = await client.decide(REQUEST)
    assert response.answers["churn"].noul == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("scenario", "status", "text", "code"),
    [
        ("rejected", 400, "required properties at '/' are 'model,state,questions'", 5006),
        ("success-false", 200, "Clef inference failed", 5012),
        ("success-false-with-answers", 200, "Clef inference failed", 5012),
        ("unprocessable", 422, "Unknown field 'extra'", 5012),
    ],
)
async def test_refusals_are_rejected_without_retry(
    standin: tuple[str, WorkersAIStandIn],
    scenario: str,
    status: int,
    text: str,
    code: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The provider's error text (it may repeat the request's state) is neither in the error (which goes into
    verdicts, spans and decision records) nor in the log: that gets the status and the error's code."""
    _, server = standin
    before = server.calls[scenario]
    with caplog.at_level("DEBUG", logger="guard.backends.http"):
        async with workers_ai(standin, scenario) as client:
            with pytest.raises(BackendRejected) as info:
                await client.decide(REQUEST)
    assert info.value.status_code == status and text not in str(info.value)
    assert (f"HTTP {status} ({code})" if status != 200 else f"(HTTP 200, {code})") in str(info.value)  # the code token
    assert f'"errors": [{{"code": {code}}}]' in caplog.text and text not in caplog.text
    assert info.value.detail["errors"] == [{"code": code}]
    assert server.calls[scenario] == before + 1


async def test_an_error_that_repeats_the_state_reaches_no_verdict_span_or_decision_record(
    standin: tuple[str, WorkersAIStandIn], caplog: pytest.LogCaptureFixture
) -> None:
    """A 422 whose body repeats the request's state (FastAPI's validation error) gives the verdict, the span and the
    decision log (``log_input="none"``) the error's kind, backend and status only; the log gets the error's type and
    ``loc`` path, without the state."""
    import io
    import json

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from guard.engine import Guard
    from guard.engine.telemetry import DecisionLog, Telemetry
    from guard.policy import load_text
    from guard.subject import HttpSubject

    policy = load_text("""
policies:
  - id: api
    version: 1
    match: {http: {paths: ["/v1/**"]}}
    state: {text: body_text}
    questions:
      injection: {type: noul, instructions: Injection}
    rules:
      - {id: injection, when: injection.noul >= 0.8, action: block}
    on_error: {mode: closed}
""")
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    stream = io.StringIO()
    secret = "card 4111111111111111"
    async with workers_ai(standin, "echo-422") as client:
        guard = Guard(policy, backends=client, telemetry=Telemetry(tracer_provider=tracer_provider),
                      decision_log=DecisionLog(stream, log_input="none"))
        verdict = await guard.aevaluate(HttpSubject(method="POST", path="/v1/chat", body={"m": secret},
                                                    body_text=secret))
    (span,) = exporter.get_finished_spans()
    assert verdict.error == "rejected: http:workers-ai refused the request with HTTP 422"
    assert json.loads(stream.getvalue())["error"] == verdict.error
    assert span.attributes["guard.error"] == verdict.error and span.status.description == verdict.error
    assert '"loc": ["body", "state"]' in caplog.text and secret not in caplog.text


async def test_a_backend_that_echoes_its_input_puts_no_request_secret_in_the_log(
    standin: tuple[str, WorkersAIStandIn], caplog: pytest.LogCaptureFixture
) -> None:
    """A System One server answering FastAPI's 422, which repeats the state it refused (``input``, a ``ctx`` quoting
    it, the whole request as ``body``), put the request's ``?api_key=`` and body ``password`` (which the state keeps:
    the model must read them) into guard's WARNING log (attack finding). Through the middleware: the log line names
    the status, the error's type and ``loc`` path, and neither secret; the error kept on the exception drops the echo
    too."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from guard.asgi import GuardMiddleware
    from guard.engine import Guard
    from guard.policy import load_text
    from tests.asgi._apps import client_for, echo

    url, _ = standin
    policy = load_text("""
policies:
  - id: echo
    version: 1
    match: {http: {paths: ["/v1/**"]}}
    state: {text: request_text}
    questions:
      injection: {type: noul, instructions: Injection}
    rules:
      - {id: injection, when: injection.noul >= 0.8, action: block}
    on_error: {mode: closed}
""")
    secrets = ("qs-apikey-secret-55", "body-password-hunter2")
    backend = SystemOneClient(url + PATH.format(scenario="echo-422", model="clef-flash"), model="clef-flash",
                              retry=FAST_RETRY)
    raised: list[BaseException] = []
    decide = backend.decide

    async def recording(*args: Any, **kwargs: Any) -> Any:
        try:
            return await decide(*args, **kwargs)
        except BackendRejected as exc:
            raised.append(exc)
            raise

    backend.decide = recording  # type: ignore[method-assign]
    guard = Guard(policy, backends=backend)
    app = Starlette(routes=[Route("/{path:path}", echo, methods=["POST"])],
                    middleware=[Middleware(GuardMiddleware, guard=guard)])
    with caplog.at_level(logging.DEBUG, logger="guard"):
        async with client_for(app) as client:
            for _ in range(2):  # WARNING the first time, DEBUG after
                response = await client.post(f"/v1/chat?api_key={secrets[0]}",
                                             json={"prompt": "hello", "password": secrets[1]})
                assert response.status_code == 503
    await guard.aclose()
    lines = [r.getMessage() for r in caplog.records if "answered HTTP 422" in r.getMessage()]
    assert [r.levelname for r in caplog.records if "answered HTTP 422" in r.getMessage()] == ["WARNING", "DEBUG"]
    assert '"loc": ["body", "state"]' in lines[0] and '"type": "value_error"' in lines[0]
    assert not [s for s in secrets if s in caplog.text]
    assert not [s for s in secrets if s in json.dumps(raised[0].detail)]  # type: ignore[attr-defined]


_ECHOED_SECRET = "qs-apikey-secret-55 body-password-hunter2"


def _echoing(shape: str, text: str) -> Any:
    """An error answer of ``shape`` that repeats ``text`` (the request's state), as System One servers answer."""
    from starlette.responses import JSONResponse, Response

    if shape == "plain":
        return Response(f"422 Unprocessable Entity: invalid state={text!r}", status_code=422)
    if shape == "html":
        return Response(f"<html><body><pre>{text}</pre></body></html>", status_code=400, media_type="text/html")
    if shape == "openai":
        return JSONResponse({"error": {"message": f"Invalid value: {text!r}", "type": "invalid_request_error",
                                       "code": "string_above_max_length"}}, status_code=400)
    if shape == "fastapi-string":
        return JSONResponse({"detail": f"Invalid request: {text}"}, status_code=400)
    if shape == "cloudflare":
        return JSONResponse({"success": False, "errors": [{"code": 5006, "message": f"Input failed: {text}"}],
                             "messages": [], "result": None})
    if shape == "message":
        return JSONResponse({"message": f"Rejected input {text!r}"}, status_code=413)
    if shape == "pydantic-v1":
        return JSONResponse({"detail": [{"loc": ["body", "state"], "msg": "bad", "type": "value_error",
                                         "value": text}]}, status_code=422)
    if shape == "code-is-text":  # a code or type that is free text is no token: left out
        return JSONResponse({"code": f"bad {text}", "error": {"type": text}}, status_code=400)
    assert shape == "ok-not-json"
    return Response('{"echo": ' + json.dumps(text) + ', "x": NaN}', media_type="application/json")


@pytest.mark.parametrize(
    ("shape", "kept"),
    [
        ("plain", {"status": 422, "media_type": None}),
        ("html", {"status": 400, "media_type": "text/html"}),
        ("openai", {"status": 400, "media_type": "application/json",
                    "error": {"code": "string_above_max_length", "type": "invalid_request_error"}}),
        ("fastapi-string", {"status": 400, "media_type": "application/json"}),
        ("cloudflare", {"status": 200, "media_type": "application/json", "errors": [{"code": 5006}]}),
        ("message", {"status": 413, "media_type": "application/json"}),
        ("pydantic-v1", {"status": 422, "media_type": "application/json",
                         "detail": [{"loc": ["body", "state"], "type": "value_error"}]}),
        ("code-is-text", {"status": 400, "media_type": "application/json"}),
        ("ok-not-json", {"status": 200, "media_type": "application/json"}),
    ],
)
async def test_an_error_answer_is_logged_as_its_status_codes_and_length_never_its_text(
    shape: str, kept: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A backend's error answer can repeat the request (its ``?api_key=``, a body ``password``) in any shape: plain
    text, HTML, OpenAI's ``error.message``, FastAPI's ``detail`` string, Cloudflare's ``errors[].message``, pydantic
    v1's ``value``; each reached guard's WARNING log (review finding). The log line and ``BackendRejected.detail``
    carry the status, the media type, the length and the short code/type tokens and ``loc`` paths only."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    sent: list[int] = []

    async def answer(request: Any) -> Any:
        response = _echoing(shape, json.dumps((await request.json())["state"]))
        sent.append(len(response.body))
        return response

    app = Starlette(routes=[Route("/v1/systemone", answer, methods=["POST"])])
    request = REQUEST.override(state={"ticket": _ECHOED_SECRET})
    with serve_app_in_thread(app, ready_path=None) as url, caplog.at_level(logging.DEBUG, "guard.backends.http"):
        async with SystemOneClient(url, retry=FAST_RETRY) as client:
            with pytest.raises((BackendRejected, MalformedAnswer)) as info:
                await client.decide(request)
    assert "hunter2" not in caplog.text and "secret-55" not in caplog.text and "hunter2" not in str(info.value)
    (line,) = [r.getMessage() for r in caplog.records if "answered HTTP" in r.getMessage()]
    said, _, summary = line.partition(": ")
    assert said == f"http:systemone answered HTTP {kept['status']}" and json.loads(summary) == kept | {"length": sent[0]}
    if isinstance(info.value, BackendRejected):
        assert info.value.detail == json.loads(summary)
    assert ("(string_above_max_length)" in str(info.value)) == (shape == "openai")  # a code token, not the text's


async def test_a_header_value_that_is_not_ascii_does_not_break_the_answer(
    standin: tuple[str, WorkersAIStandIn]
) -> None:
    """A valid answer under ``x-served-by: cdn-é`` raised UnicodeEncodeError when the client rebuilt the response:
    every decision was an internal error with a traceback."""
    async with workers_ai(standin, "latin1-header") as client:
        response = await client.decide(REQUEST)
    assert set(response.answers) == {"churn", "queue", "urgency"}


async def test_a_huge_error_message_is_logged_as_its_length(
    standin: tuple[str, WorkersAIStandIn], caplog: pytest.LogCaptureFixture
) -> None:
    """A 400 whose message is 2 MB was one 2 MB log line (a server cycling statuses could fill a disk)."""
    async with workers_ai(standin, "huge-error") as client:
        with pytest.raises(BackendRejected):
            await client.decide(REQUEST)
    (line,) = [r.getMessage() for r in caplog.records if "answered HTTP 400" in r.getMessage()]
    assert len(line) < 200 and json.loads(line.partition(": ")[2])["length"] == ERROR_BYTES


async def test_an_answer_of_millions_of_arrays_is_refused_before_json_builds_them(
    standin: tuple[str, WorkersAIStandIn], caplog: pytest.LogCaptureFixture
) -> None:
    """8 MiB of ``[]`` (2.8 million lists) was parsed on the event loop: 1.4 s as a 200, and 2.1 s as a 500 (three
    attempts, each body parsed for its error summary). An answer holds the arrays and objects its request allows,
    counted before parsing; of an error answer the first 64 KiB are read."""
    caplog.set_level(logging.DEBUG, logger="guard.backends.http")
    async with workers_ai(standin, "lists-200") as client:
        with pytest.raises(MalformedAnswer, match=r"\(too_large\)"):
            await client.decide(REQUEST)
    async with workers_ai(standin, "short-lists-200") as client:
        with pytest.raises(MalformedAnswer, match=r"holds more than \d+ arrays and objects, the most an answer to this "
                           r"request holds \(too_many_values\); it was not parsed"):
            await client.decide(REQUEST)
    assert not [r for r in caplog.records if "answered HTTP 200" in r.getMessage()]  # not logged as an error answer
    async with workers_ai(standin, "lists-500") as client:
        with pytest.raises(BackendUnavailable, match="answered HTTP 500$"):
            await client.decide(REQUEST)
    summaries = [json.loads(r.getMessage().partition(": ")[2]) for r in caplog.records
                 if "answered HTTP 500" in r.getMessage()]
    assert [s["length"] for s in summaries] == [ERROR_BYTES] * FAST_RETRY.max_attempts


@pytest.mark.parametrize("scenario", ["floats-200", "ints-200", "keys-200"])
async def test_an_answer_of_millions_of_scalars_is_refused_before_json_reads_them(
    standin: tuple[str, WorkersAIStandIn], monkeypatch: pytest.MonkeyPatch, scenario: str
) -> None:
    """8 MiB of ``0.5,`` (or ``0,``, or ``"0":0,``) under two containers passed the count of arrays and objects and
    held the event loop 1.3 s (0.66 s, 2.2 s) in json's parser. An answer is read only as far as an answer to its
    request can reach (:func:`max_answer_bytes`: about 66 KB for three questions) and never parsed past it."""
    parsed: list[int] = []

    def counting_loads(data: bytes, **kwargs: Any) -> Any:
        parsed.append(len(data))
        return loads(data, **kwargs)

    monkeypatch.setattr(http_module, "loads", counting_loads)
    limit = max_answer_bytes(REQUEST, "clef-flash")
    assert limit < 80_000
    async with workers_ai(standin, scenario) as client:
        with pytest.raises(MalformedAnswer, match=f"longer than {limit} bytes, the most an answer to this request "
                           r"holds \(too_large\); it was not read further"):
            await client.decide(REQUEST)
    assert parsed == []


def _scores(count: int, criterion: str) -> SystemOneRequestV1:
    return SystemOneRequestV1.from_json({"model": "clef-flash", "state": "s", "questions": {
        f"q{i}": {"type": "score", "instructions": "How bad?", "criteria": [f"{criterion} {j}" for j in range(10)]}
        for i in range(count)
    }})


@pytest.mark.parametrize("scenario", ["ok", "unwrapped", "extras"])
@pytest.mark.parametrize("request_", [REQUEST, _scores(64, "level"), _scores(64, "niveau élevé " * 8)],
                         ids=["three", "64-scores", "64-scores-non-ascii"])
async def test_answers_with_legends_envelopes_and_provider_fields_are_within_their_size(
    standin: tuple[str, WorkersAIStandIn], scenario: str, request_: SystemOneRequestV1
) -> None:
    """An answer bounded by its request's size still passes with a Workers AI envelope, legends echoing its levels
    (escaped as \\u00e9, six bytes for two), indentation and fields a provider adds to the body and to each answer."""
    async with workers_ai(standin, scenario) as client:
        response = await client.decide(request_)
    assert set(response.answers) == {question.id for question in request_.questions}


@pytest.mark.parametrize("bracketed", ["request", "client", "ids"])
async def test_brackets_in_the_model_name_and_question_ids_count_towards_an_answers_containers(
    standin: tuple[str, WorkersAIStandIn], bracketed: str
) -> None:
    """The answer echoes the model name and the question ids, so their brackets count too: a reference-profile model
    named ``m[x][x]...`` had its valid answer refused as too_many_values."""
    model = "m" + "[x]" * 70
    ids = ["[" * 40 + str(i) for i in range(3)] if bracketed == "ids" else ["q"]
    request = SystemOneRequestV1.from_json(
        {"model": model if bracketed == "request" else "clef-flash", "state": "s",
         "questions": {qid: {"type": "noul", "instructions": "Bad?"} for qid in ids}},
        profile="reference",
    )
    url, _ = standin
    async with SystemOneClient(url + PATH.format(scenario="ok", model="clef-flash"), provider="workers-ai",
                               api_key="token-123", model=model if bracketed == "client" else None,
                               retry=FAST_RETRY) as client:
        response = await client.decide(request)
    assert set(response.answers) == set(ids)


async def test_option_ids_and_levels_full_of_brackets_are_still_answered(
    standin: tuple[str, WorkersAIStandIn],
) -> None:
    """The arrays and objects an answer may hold count each bracket its questions write (an option id comes back as
    a key and a choice, a score's levels as its legend), so an answer to such a request is not refused."""
    ids = {"[" * 90 + str(i): None for i in range(255)}
    levels = [{"level": [[[i]]]} for i in range(10)]
    request = SystemOneRequestV1.from_json({"model": "clef-flash", "state": "s", "questions": {
        "which": {"type": "choice", "instructions": "Which?", "criteria": ids},
        "how": {"type": "score", "instructions": "How?", "criteria": levels},
    }})
    async with workers_ai(standin, "ok") as client:
        response = await client.decide(request)
    assert set(response.answers["which"].probabilities) == set(ids)


async def test_429_honours_retry_after(standin: tuple[str, WorkersAIStandIn]) -> None:
    _, server = standin
    started = time.monotonic()
    async with workers_ai(standin, "busy-then-ok", timeout=10) as client:
        response = await client.decide(REQUEST)
    assert time.monotonic() - started >= 0.9  # waited the server's Retry-After: 1, not the 10 ms backoff
    assert server.calls["busy-then-ok"] == 2 and response.answers["churn"].noul == pytest.approx(0.7)


async def test_429_without_retry_after_backs_off_and_retries(standin: tuple[str, WorkersAIStandIn],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    _, server = standin
    async with workers_ai(standin, "busy-no-header") as client:
        response = await client.decide(REQUEST)
    assert server.calls["busy-no-header"] == 3 and response.answers
    caplog.clear()  # the busy answers above were logged too
    with caplog.at_level("DEBUG", logger="guard.backends.http"):
        async with workers_ai(standin, "always-busy") as client:
            with pytest.raises(BackendUnavailable) as info:
                await client.decide(REQUEST)
    assert info.value.reason == "http_429" and str(info.value) == "http:workers-ai answered HTTP 429"
    # the answer's summary: at WARNING the first time, at DEBUG for the retries that got the same status
    said = [r.levelname for r in caplog.records if '"code": 3040' in r.getMessage()]
    assert said == ["WARNING"] + ["DEBUG"] * (FAST_RETRY.max_attempts - 1)
    assert server.calls["always-busy"] == FAST_RETRY.max_attempts


async def test_a_retry_after_past_the_deadline_fails_at_once(standin: tuple[str, WorkersAIStandIn]) -> None:
    _, server = standin
    started = time.monotonic()
    async with workers_ai(standin, "busy-long", timeout=2) as client:
        with pytest.raises(BackendUnavailable) as info:
            await client.decide(REQUEST)
    assert time.monotonic() - started < 1.5
    assert info.value.retry_after == 30 and server.calls["busy-long"] == 1


async def test_5xx_is_retried(standin: tuple[str, WorkersAIStandIn]) -> None:
    _, server = standin
    async with workers_ai(standin, "flaky-5xx") as client:
        assert (await client.decide(REQUEST)).answers
    assert server.calls["flaky-5xx"] == 2
    async with workers_ai(standin, "always-500") as client:
        with pytest.raises(BackendUnavailable, match="answered HTTP 500$"):
            await client.decide(REQUEST)
    assert server.calls["always-500"] == 3


async def test_html_error_pages_are_typed_errors(standin: tuple[str, WorkersAIStandIn]) -> None:
    async with workers_ai(standin, "html-502") as client:
        with pytest.raises(BackendUnavailable, match="answered HTTP 502$") as info:
            await client.decide(REQUEST)
    assert info.value.reason == "http_502"
    async with workers_ai(standin, "html-200") as client:
        with pytest.raises(MalformedAnswer, match="the answer has Content-Type 'text/html"):
            await client.decide(REQUEST)
    async with workers_ai(standin, "huge-503") as client:  # was malformed: its length read before its status
        with pytest.raises(BackendUnavailable) as info:
            await client.decide(REQUEST)
    assert info.value.reason == "http_503"


@pytest.mark.parametrize(
    ("scenario", "text"),
    [
        ("truncated", "not valid JSON"),
        ("oversized", r"longer than \d+ bytes, the most an answer to this request holds \(too_large\)"),  # a client reads no further (1.2 GB peak for 400 MB before)
        ("gzip", "Content-Encoding 'gzip'"),  # asked for identity: never inflated (a bomb stalled the loop before)
        ("missing-answer", "answer for question 'urgency' is missing"),
        ("nan", "non_finite"),
        ("bad-sum", "sum to"),
        ("wrong-choice", "the choice must be the most probable option"),
        ("wrong-score", "has score 3 but its probabilities give 0.7998"),
        # a choice that is a JSON array or object is no option id (a TypeError, unhashable, before)
        ("choice-list", "chose a JSON array, not one of its options"),
        ("choice-object", "chose a JSON object, not one of its options"),
        # only a 200 with a JSON type is an answer, however valid the body (taken before)
        ("html-type-answer", "the answer has Content-Type 'text/html; charset=utf-8'; a System One answer is"),
        ("no-type-answer", "the answer has no Content-Type"),
        ("status-203", "HTTP 203 is not a System One answer"),
        ("status-299", "HTTP 299 is not a System One answer"),
    ],
)
async def test_bad_answers_are_malformed(standin: tuple[str, WorkersAIStandIn], scenario: str, text: str) -> None:
    _, server = standin
    before = server.calls[scenario]
    async with workers_ai(standin, scenario) as client:
        with pytest.raises(MalformedAnswer, match=text) as info:
            await client.decide(REQUEST)
    assert info.value.backend == "http:workers-ai"
    assert server.calls[scenario] == before + 1  # a malformed answer is not retried


async def test_an_answer_naming_another_model_is_refused_unless_an_alias(standin: tuple[str, WorkersAIStandIn]) -> None:
    """The System One answer echoes the request's model; one naming another was taken (and cached under this
    model's key, its name in the verdict) before."""
    async with workers_ai(standin, "other-model") as client:
        with pytest.raises(MalformedAnswer, match="names model 'some-other-model', but 'clef-flash' was asked"):
            await client.decide(REQUEST)
    async with workers_ai(standin, "list-model") as client:  # not a TypeError from the alias lookup
        with pytest.raises(MalformedAnswer, match="names model"):
            await client.decide(REQUEST)
    async with workers_ai(standin, "other-model", model_aliases=["some-other-model"]) as client:
        assert (await client.decide(REQUEST)).model == "some-other-model"
    async with workers_ai(standin, "ok") as client:
        assert (await client.decide(REQUEST)).model == "clef-flash"


async def test_what_the_client_sends_and_keeps_of_a_broken_answer(standin: tuple[str, WorkersAIStandIn]) -> None:
    """Answers are asked for uncompressed; a third-party API gets none of the app's trace context or baggage; a
    revision named by an answer that fails its checks is not taken into cache keys."""
    from opentelemetry import baggage, context, trace
    from opentelemetry.sdk.trace import TracerProvider

    _, server = standin
    span = TracerProvider().get_tracer("t").start_span("decision")
    token = context.attach(baggage.set_baggage("user.email", "alice@example.com",
                                               trace.set_span_in_context(span)))
    try:
        async with workers_ai(standin, "ok") as client:
            await client.decide(REQUEST)
        async with workers_ai(standin, "truncated") as broken:
            before = broken.model_revision
            with pytest.raises(MalformedAnswer):
                await broken.decide(REQUEST)
            assert broken.model_revision == before
    finally:
        context.detach(token)
    _, headers, _ = next(r for r in reversed(server.requests) if r[0] == "ok")
    assert headers["accept-encoding"] == "identity"
    assert not {"traceparent", "tracestate", "baggage"} & set(headers)


async def test_rounding_tolerance_follows_the_provider(standin: tuple[str, WorkersAIStandIn]) -> None:
    url, _ = standin
    target = url + PATH.format(scenario="two-decimals", model="clef-flash")
    async with SystemOneClient.jev("key", url=target, retry=FAST_RETRY) as jev:
        response = await jev.decide(REQUEST)  # 0.6 + 3 x 0.13 = 0.99 is fine at 2 decimals
    assert response.answers["urgency"].probabilities["1"] == pytest.approx(0.13)
    async with SystemOneClient(target, provider="worker", retry=FAST_RETRY) as strict:
        with pytest.raises(MalformedAnswer, match="sum to 0.99"):
            await strict.decide(REQUEST)


async def test_slow_server_times_out_within_the_deadline(standin: tuple[str, WorkersAIStandIn]) -> None:
    started = time.monotonic()
    async with workers_ai(standin, "slow") as client:
        with pytest.raises(BackendTimeout, match="no answer within 500 ms"):
            await client.decide(REQUEST, timeout=0.5)
    assert time.monotonic() - started < 1.5


async def test_connection_refused_and_reset_are_unavailable() -> None:
    with socket_that_resets() as url:
        async with SystemOneClient(url, retry=FAST_RETRY) as client:
            with pytest.raises(BackendUnavailable) as info:
                await client.decide(REQUEST, timeout=5)
        assert info.value.reason == "connection" and isinstance(info.value.__cause__, httpx.TransportError)
    async with SystemOneClient(url, retry=FAST_RETRY) as client:  # the listener is closed now: refused
        with pytest.raises(BackendUnavailable, match="cannot reach"):
            await client.decide(REQUEST, timeout=5)
    async with SystemOneClient.worker(uds="/nonexistent/worker.sock", retry=FAST_RETRY) as client:
        with pytest.raises(BackendUnavailable, match="cannot reach unix socket /nonexistent/worker.sock"):
            await client.decide(REQUEST, timeout=5)  # named as the socket, not the URL label it is reached under


async def test_what_the_server_wrote_in_a_bad_head_stays_out_of_the_error() -> None:
    """httpx words a bad head with the bytes the server sent (``illegal header line: bytearray(b'...')``), which may
    repeat the request's state: the error, and so the verdict, span and decision log, names its type only; a
    Content-Type is quoted and cut (no terminal escape, no 8 KB line)."""
    with socket_that_resets(b"HTTP/1.1 200 OK\r\necho Card charged twice 4111111111111111\r\n\r\n") as url:
        async with SystemOneClient(url, retry=FAST_RETRY) as client:
            with pytest.raises(BackendUnavailable) as info:
                await client.decide(REQUEST, timeout=5)
    assert str(info.value) == f"http:systemone: cannot reach {url}/v1/systemone: RemoteProtocolError"
    assert "4111" in str(info.value.__cause__)  # what the server wrote stays on the cause, for a traceback
    media = b"\x1b[2Ktext/html" + b"A" * 8000
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: " + media + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n<p"
    with socket_that_resets(answer) as url:
        async with SystemOneClient(url, retry=FAST_RETRY) as client:
            with pytest.raises(MalformedAnswer) as malformed:
                await client.decide(REQUEST, timeout=5)
    assert f"Content-Type {media[:40].decode()!r}; " in str(malformed.value) and "\x1b" not in str(malformed.value)


def test_retry_after_accepts_seconds_dates_and_milliseconds() -> None:
    assert parse_retry_after(httpx.Headers({"retry-after": "7"})) == 7
    assert parse_retry_after(httpx.Headers({"retry-after-ms": "250"})) == 0.25
    when = datetime.now(UTC) + timedelta(seconds=20)
    seconds = parse_retry_after(httpx.Headers({"retry-after": format_datetime(when, usegmt=True)}))
    assert seconds is not None and 18 <= seconds <= 20
    past = format_datetime(datetime.now(UTC) - timedelta(seconds=20), usegmt=True)
    assert parse_retry_after(httpx.Headers({"retry-after": past})) == 0
    assert parse_retry_after(httpx.Headers({"retry-after": "soon"})) is None
    assert parse_retry_after(httpx.Headers()) is None


async def test_credentials_in_the_url_stay_out_of_revisions_repr_and_errors() -> None:
    client = SystemOneClient("http://svc:hunter2@127.0.0.1:9/v1/systemone?key=AIzaSECRET", retry=FAST_RETRY)
    with pytest.raises(BackendUnavailable) as info:
        await client.decide(REQUEST, timeout=2)
    shown = f"{client.model_revision} {client!r} {info.value}"
    assert "hunter2" not in shown and "AIzaSECRET" not in shown and "127.0.0.1:9/v1/systemone" in shown
    await client.aclose()


def test_presets_and_configuration() -> None:
    cf = SystemOneClient.workers_ai("acc", "tok", model="clef")
    assert cf.url == "https://api.cloudflare.com/client/v4/accounts/acc/ai/run/@cf/cloudflare/clef"
    assert cf.provider.decimals == 4 and cf.name == "http:workers-ai" and "tok" not in repr(cf)
    assert SystemOneClient.openrouter("k").url == "https://openrouter.ai/api/alpha/decisions"
    assert SystemOneClient.openrouter("k").provider.decimals == 2 and PROVIDERS["jev"].decimals == 2
    assert SystemOneClient("http://worker:8000").url == "http://worker:8000/v1/systemone"
    assert SystemOneClient.worker(uds="/tmp/w.sock").provider.sends_deadline
    with pytest.raises(ValueError, match="provider must be one of"):
        SystemOneClient("http://x", provider="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="http:// or https://"):
        SystemOneClient("ftp://x")
    with pytest.raises(ValueError, match="non-empty account_id"):
        SystemOneClient.workers_ai("", "tok")
    with pytest.raises(ValueError, match="max_attempts"):
        RetryConfig(max_attempts=0)


async def test_openrouter_refuses_top_level_images() -> None:
    request = REQUEST.override(images=("data:image/png;base64,AAAA",))
    async with SystemOneClient.openrouter("k", url="http://127.0.0.1:9") as client:
        with pytest.raises(BackendRejected, match="inside the state array"):
            await client.decide(request)


async def test_closed_client_refuses_in_a_sentence() -> None:
    client = SystemOneClient("http://127.0.0.1:9")
    await client.aclose()
    await client.aclose()
    with pytest.raises(RuntimeError, match="it has been closed"):
        await client.decide(REQUEST)


# --------------------------------------------------------------------------------------------------- our worker


async def test_worker_answers_match_the_in_process_backend(worker: RunningWorker, clef_fp32: ClefModel) -> None:
    requests = [SystemOneRequestV1.from_json(ticket_body(i)) for i in range(6)]
    async with SystemOneClient.worker(worker.url, timeout=60) as client:
        remote = await asyncio.gather(*(client.decide(r) for r in requests))
    async with LocalBackend(clef_fp32) as local:
        direct = [await local.decide(r) for r in requests]
    for got, want in zip(remote, direct, strict=True):
        assert list(got.answers) == list(want.answers) and got.usage == want.usage
        for qid, answer in want.answers.items():
            for option, p in answer.probabilities.items():
                assert got.answers[qid].probabilities[option] == pytest.approx(p, abs=1e-4)


async def test_worker_over_a_unix_socket(clef_fp32: ClefModel, tmp_path: Path) -> None:
    sock = str(tmp_path / "w.sock")
    with serve_worker(LocalBackend(clef_fp32), uds=sock) as running:
        async with open_backend(f"unix:{sock}") as client:  # what --backend unix:SOCKET opens
            before = client.model_revision
            response = await client.decide(SystemOneRequestV1.from_json(ticket_body(3)))
            after = client.model_revision
    assert set(response.answers) == {"churn_risk", "urgency"}
    # Two sockets are two workers: the socket is part of the revision, then the checkpoint the worker reports.
    assert before == f"worker:http://127.0.0.1:8000/v1/systemone@{sock}"
    assert after == f"{before}#{running.backend.model_revision}"


async def test_the_revision_in_cache_keys_follows_the_checkpoint_the_worker_reports(worker: RunningWorker) -> None:
    request = SystemOneRequestV1.from_json(ticket_body(1))
    async with SystemOneClient.worker(worker.url, timeout=60) as client:
        assert client.model_revision == f"worker:{worker.url}/v1/systemone"
        await client.decide(request)
        assert client.model_revision == f"worker:{worker.url}/v1/systemone#{worker.backend.model_revision}"
    async with SystemOneClient.worker(worker.url, timeout=60, model_revision="pinned-7") as pinned:
        await pinned.decide(request)
        assert pinned.model_revision == "pinned-7"  # an explicit revision is used as given


async def test_a_worker_on_a_checkpoint_with_the_longest_directory_name_still_names_it(
    golden_checkpoint: Path, tmp_path: Path, standin: tuple[str, WorkersAIStandIn], caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's revision is the checkpoint directory's name, its hash and suffixes (``+max_length=``,
    ``+guard=``, ``+confidence=``); the client ignored a value over 200 characters without a word, so workers
    running different checkpoints behind one address shared cache keys. A 255-character name (the most a file system
    allows) is taken now; a value past the limit is ignored with one warning."""
    import torch

    checkpoint = shutil.copytree(golden_checkpoint, tmp_path / ("clef-" + "x" * 250))
    backend = LocalBackend(ClefModel.from_pretrained(checkpoint, dtype=torch.float32), max_length=600,
                           confidence_profile="workers-ai")
    assert len(backend.model_revision) > 300
    with serve_worker(backend) as running:
        async with SystemOneClient.worker(running.url, timeout=60) as client:
            await client.decide(SystemOneRequestV1.from_json(ticket_body(1)))
            assert client.model_revision == f"worker:{running.url}/v1/systemone#{backend.model_revision}"
    async with workers_ai(standin, "long-revision") as client:
        before = client.model_revision
        with caplog.at_level(logging.WARNING, logger="guard.backends.http"):
            for _ in range(2):
                await client.decide(REQUEST)
        assert client.model_revision == before
    warnings = [r.getMessage() for r in caplog.records if "x-guard-model-revision" in r.getMessage()]
    assert len(warnings) == 1 and "longer than 512 characters and ignored" in warnings[0], warnings


async def test_a_parsed_json_body_is_refused_with_a_type_error_naming_the_fix(worker: RunningWorker) -> None:
    async with SystemOneClient.worker(worker.url, timeout=60) as client:
        with pytest.raises(TypeError, match=r"takes a SystemOneRequestV1, not dict.*from_json"):
            await client.decide(ticket_body(1))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "extra",
    [{"X-Request-Timeout-Ms": "1"}, {"Content-Type": "application/json"}, {"ACCEPT": "application/json"}],
)
async def test_a_header_the_client_sets_itself_is_sent_once_whatever_its_case(
    worker: RunningWorker, extra: dict[str, str]
) -> None:
    # The worker refuses a repeated x-request-timeout-ms or Content-Type (400 repeated_header): a caller's header
    # named in another case replaces the client's own line instead of being sent beside it.
    sent: list[list[tuple[bytes, bytes]]] = []

    async def record(request: httpx.Request) -> None:
        sent.append(list(request.headers.raw))

    async with SystemOneClient.worker(worker.url, timeout=60, headers=extra) as client:
        client._client.event_hooks["request"] = [record]
        response = await client.decide(REQUEST)
    assert list(response.answers) == ["churn", "queue", "urgency"]
    names = [name.lower() for name, _ in sent[-1]]
    assert len(names) == len(set(names)), names
    deadline = {name.lower(): value for name, value in sent[-1]}[b"x-request-timeout-ms"]
    assert int(deadline) > 1000  # the deadline of this call, not the value the caller fixed


async def test_worker_refusal_carries_the_field_errors(worker: RunningWorker) -> None:
    # Valid for the reference profile (no instructions) but not for the worker's workers-ai profile.
    request = SystemOneRequestV1.from_json(
        {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}, profile="reference"
    )
    async with SystemOneClient.worker(worker.url, timeout=60) as client:
        with pytest.raises(BackendRejected) as info:
            await client.decide(request)
    assert info.value.status_code == 422
    assert info.value.detail["errors"][0]["field"] == "questions.q.instructions"


class _GatedModel:
    """The real ClefModel, except that ``forward_records`` waits for ``gate``: a test can hold the inference
    thread busy for exactly as long as it needs, whatever the machine's speed."""

    def __init__(self, model: ClefModel) -> None:
        self.model = model
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward_records(self, records: Any) -> Any:
        self.gate.wait(timeout=30)
        return self.model.forward_records(records)


async def test_giving_up_on_a_busy_worker_drops_the_request_there(clef_fp32: ClefModel) -> None:
    gated = _GatedModel(clef_fp32)
    backend = LocalBackend(gated, batcher_config=BatcherConfig(max_wait_ms=5))  # type: ignore[arg-type]
    with serve_worker(backend) as worker:
        stats = worker.batcher.stats
        async with worker.client() as raw:
            gated.gate.clear()  # the next forward pass blocks until the client below has given up
            busy = asyncio.ensure_future(raw.post("/v1/systemone", json=long_body()))
            while worker.batcher.in_flight == 0:
                await asyncio.sleep(0.002)
            computed, dropped = stats.batched_requests, stats.expired + stats.cancelled
            try:
                async with SystemOneClient.worker(worker.url) as client:
                    with pytest.raises(BackendTimeout):
                        await client.decide(SystemOneRequestV1.from_json(ticket_body(7)), timeout=0.3)
            finally:
                gated.gate.set()
            assert (await busy).status_code == 200
        deadline = time.monotonic() + 60
        while stats.expired + stats.cancelled == dropped and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert stats.expired + stats.cancelled == dropped + 1
        assert stats.batched_requests == computed


async def test_overloaded_worker_is_unavailable_with_retry_after(clef_fp32: ClefModel) -> None:
    backend = LocalBackend(clef_fp32, batcher_config=BatcherConfig(max_batch=1, max_queue=1, max_wait_ms=0))
    with serve_worker(backend) as running:
        async with running.client() as raw:
            busy = asyncio.ensure_future(raw.post("/v1/systemone", json=long_body()))
            while backend.batcher.in_flight == 0:
                await asyncio.sleep(0.002)
            queued = asyncio.ensure_future(raw.post("/v1/systemone", json=ticket_body(1)))
            while backend.batcher.queue_depth == 0:
                await asyncio.sleep(0.002)
            no_retry = RetryConfig(max_attempts=1)
            async with SystemOneClient.worker(running.url, retry=no_retry, timeout=30) as client:
                with pytest.raises(BackendUnavailable) as info:
                    await client.decide(SystemOneRequestV1.from_json(ticket_body(2)))
            await asyncio.gather(busy, queued)
    assert info.value.reason == "http_429" and info.value.retry_after is not None and info.value.retry_after >= 1


async def test_a_401_to_a_client_without_a_key_says_where_the_key_goes() -> None:
    """A worker with --api-keys-env answered 401 and nothing named $GUARD_BACKEND_API_KEY (new-user trial)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def refuse(request: Any) -> JSONResponse:
        return JSONResponse({"code": "unauthorized", "message": "this worker needs a key"}, status_code=401)

    app = Starlette(routes=[Route("/v1/systemone", refuse, methods=["POST"])])
    with serve_app_in_thread(app, ready_path=None) as url:
        for key, hint in ((None, True), ("sk-0123456789abcdef", False)):
            async with SystemOneClient.worker(url, api_key=key) as client:
                with pytest.raises(BackendRejected) as info:
                    await client.decide(REQUEST)
            assert ("GUARD_BACKEND_API_KEY" in str(info.value)) is hint


async def test_the_worker_gets_the_decision_span_but_no_baggage_whatever_the_propagator(
    standin: tuple[str, WorkersAIStandIn],
) -> None:
    """A propagator that writes baggage in headers of its own (Jaeger's ``uberctx-<key>``, OT's ``ot-baggage-<key>``)
    sends none of the app's baggage to guard's worker either; the trace context still goes."""
    from opentelemetry import baggage, context, propagate, trace
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.propagators.textmap import CarrierT, Setter, TextMapPropagator, default_setter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    class PrefixedBaggage(TextMapPropagator):  # as Jaeger's propagator writes baggage
        def extract(self, carrier: CarrierT, context: Any = None, getter: Any = None) -> Any:
            return context

        def inject(self, carrier: CarrierT, context: Any = None, setter: Setter[CarrierT] = default_setter) -> None:
            for key, value in baggage.get_all(context).items():
                setter.set(carrier, f"uberctx-{key}", str(value))

        @property
        def fields(self) -> set[str]:
            return set()

    url, server = standin
    before = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator(), PrefixedBaggage()]))
    span = TracerProvider().get_tracer("t").start_span("decision")
    token = context.attach(baggage.set_baggage("user.email", "alice@example.com", trace.set_span_in_context(span)))
    try:
        target = url + PATH.format(scenario="ok", model="clef-flash")
        async with SystemOneClient(target, provider="worker", retry=FAST_RETRY) as client:
            await client.decide(REQUEST)
    finally:
        context.detach(token)
        propagate.set_global_textmap(before)
    _, headers, _ = next(r for r in reversed(server.requests) if r[0] == "ok")
    assert headers["traceparent"].split("-")[1] == f"{span.get_span_context().trace_id:032x}"
    assert not [name for name in headers if name.startswith("uberctx-") or name == "baggage"], dict(headers)
