"""Telemetry for decisions: one OpenTelemetry span per decision, outcome counters, and a JSON-lines decision log.

Span ``guard.decision`` (one per evaluation, allow and block alike) carries the stable attributes in
:data:`SPAN_ATTRIBUTES`. Counters (OpenTelemetry metrics): ``guard.decisions`` by policy, action, rule and fail
mode; ``guard.fail_open`` (every decision a fail-open policy allowed because of an error); ``guard.state_cut``
(every decision made on part of its state: a field cut to its ``max_chars``, or state tokens the backend did not
read); both count each matching policy under its own id, a shadow one's too (an enforced policy's fail-open only when
the decision let the subject through); ``guard.handoffs`` (agent decisions an LLM reviewer settled, by ``outcome``:
:data:`HandoffOutcome`); a duration histogram ``guard.decision.duration`` in seconds (buckets from
25 us to 10 s, :data:`guard._buckets.DURATION_BUCKETS_S`). Every metric's attributes use one vocabulary:
``guard.policy.id``, ``guard.action``, ``guard.rule``, ``guard.fail_mode``, ``guard.shadow`` (Prometheus:
``guard_policy_id``, ...).

Decisions whose answers came through the cache are counted in ``guard.cache.lookups`` by policy and ``result``
(``hit``, ``miss``, ``shared``: the deciding policy's lookup). Where a model was asked, the span also carries
``gen_ai.operation.name`` = ``text_completion`` (the GenAI conventions' closest operation: one
prompt, the rendered state and questions, is read and one structured answer comes back, with no chat history, no
tool and no generated tokens; ``chat`` and ``generate_content`` imply a conversation or generated output) and one
``gen_ai.evaluation.result`` event for the verdict: ``gen_ai.evaluation.name`` = the policy id,
``gen_ai.evaluation.score.label`` = the action, ``gen_ai.evaluation.explanation`` = the rule, plus ``error.type``
when the verdict has an error (a fail mode decided, or the input was refused: its code). The span's status is ERROR
only when a fail mode decided.

The decision log (:class:`DecisionLog`) writes one JSON object per line, modelled on OPA's ``EventV1``:
``decision_id``, ``timestamp``, ``labels``, ``policy`` (id, version, digest: which text of it decided, file),
``input`` (the subject, original text), ``state`` (what the model saw), ``result``, ``answers`` (probabilities),
``cache``, ``backend``, ``model``, ``revision``, ``metrics.latency_ms``, ``fail_mode``, ``error``, ``flags``,
``trace_id``/``span_id`` and ``erased``:
the JSON pointers removed before the record left the process (``*`` matches any key or index). When several
policies matched, ``policy`` and ``result`` are the deciding one's and ``policies`` lists each one's own verdict
(id, version, digest, file, action, rule, answers, cache hit, backend, model, revision, latency, fail mode, error,
flags) in match order, as the span's :data:`POLICY_VERDICT_EVENT` events do. What a person then does with an
escalated decision (approves, rejects or edits it; an approved HTTP request released) is written to the same log as a
record of ``kind`` :data:`REVIEW_RECORD_KIND` (:meth:`DecisionLog.review`, :func:`record_review`), with an INFO line
on logger ``guard.review``.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import datetime
import errno
import functools
import hashlib
import json
import logging
import math
import os
import queue
import re
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import IO, Any, Literal
from urllib.parse import quote, quote_plus, unquote_plus

from opentelemetry import metrics, trace
from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Span, Status, StatusCode

from guard import __version__
from guard._buckets import DURATION_BUCKETS_S
from guard._close import CLOSE_TIMEOUT_S
from guard._json import JSON_LEVELS, json_readings, surrogates_joined
from guard._logevery import LogEvery
from guard._resource import resource_from_env
from guard._urls import password_unclear, shown_url
from guard.policy._state import split_pointer
from guard.policy.redact import UNMASKABLE_FLAG, apply_redactions, escape_pointer
from guard.subject import AgentSubject, HttpSubject, Subject, body_strings, is_plain_key
from guard.verdict import Verdict

__all__ = [
    "CREDENTIAL_HEADERS",
    "DEFAULT_REDACT",
    "EVALUATION_EVENT",
    "GEN_AI_OPERATION",
    "LOG_INPUT_MODES",
    "METRICS_EXPORTERS",
    "REVIEW_EVENTS",
    "REVIEW_RECORD_KIND",
    "SECRET_NAME",
    "SPAN_ATTRIBUTES",
    "SPAN_NAME",
    "TRACES_EXPORTERS",
    "TRACING_RECHECK_S",
    "DecisionLog",
    "HandoffOutcome",
    "ReviewEvent",
    "Scrubber",
    "Telemetry",
    "body_secrets",
    "credential_header",
    "credential_name",
    "credential_value",
    "metric_readers_from_env",
    "record_review",
    "redact_secrets",
    "secret_values",
    "tracer_provider_from_env",
]

HandoffOutcome = Literal["allowed", "denied", "failed"]
"""How an agent's LLM reviewer handoff was settled: the ``outcome`` of ``guard.handoffs`` and of the decision log's
``handoff_outcome`` record (the reviewer allowed or denied the call, or the handoff failed and the fail mode
decided)."""
#: ``OTEL_TRACES_EXPORTER`` values understood by :func:`tracer_provider_from_env`.
TRACES_EXPORTERS = ("otlp", "console", "none")
#: ``OTEL_METRICS_EXPORTER`` values understood by :func:`metric_readers_from_env` (a comma-separated list).
METRICS_EXPORTERS = ("otlp", "console", "prometheus", "none")

logger = logging.getLogger("guard.telemetry")

SPAN_NAME = "guard.decision"
#: ``gen_ai.operation.name`` of decision spans (see the module docstring for why).
GEN_AI_OPERATION = "text_completion"
#: Name of the span event carrying the verdict.
EVALUATION_EVENT = "gen_ai.evaluation.result"
#: Name of the span events carrying each matching policy's own verdict when several matched (one each, in match
#: order), with the :data:`POLICY_VERDICT_ATTRIBUTES` of that verdict.
POLICY_VERDICT_EVENT = "guard.policy.verdict"
#: Seconds between two reads of the global tracer provider while none that records is configured.
TRACING_RECHECK_S = 1.0
#: Attribute names set on every decision span (absent values are omitted, not set to empty).
SPAN_ATTRIBUTES = (
    "guard.decision_id",
    "guard.subject.kind",
    "guard.policy.id",
    "guard.policy.version",
    "guard.policy.digest",
    "guard.policy.file",
    "guard.rule",
    "guard.action",
    "guard.shadow_action",
    "guard.status",
    "guard.cache_hit",
    "guard.cache",
    "guard.backend",
    "guard.model",
    "guard.model_revision",
    "guard.latency_ms",
    "guard.fail_mode",
    "guard.error",
    "guard.flags",
    "guard.policies",
    "gen_ai.request.model",
    "gen_ai.operation.name",
    "error.type",
)
#: The :data:`SPAN_ATTRIBUTES` each :data:`POLICY_VERDICT_EVENT` gives of its policy's own verdict.
POLICY_VERDICT_ATTRIBUTES = (
    "guard.policy.id",
    "guard.policy.version",
    "guard.policy.digest",
    "guard.policy.file",
    "guard.rule",
    "guard.action",
    "guard.shadow_action",
    "guard.status",
    "guard.cache_hit",
    "guard.backend",
    "guard.model",
    "guard.model_revision",
    "guard.latency_ms",
    "guard.fail_mode",
    "guard.error",
    "guard.flags",
)
#: Request headers that carry credentials: never logged, never sent on (a handoff), their values scrubbed from text.
CREDENTIAL_HEADERS = ("authorization", "cookie", "proxy-authorization", "x-api-key")
#: Pointers the decision log removes unless told otherwise (in every log_input mode): the credential headers, also
#: spelled with ``_`` (:func:`credential_header`).
DEFAULT_REDACT = tuple(f"/input/headers/{spelling}" for name in CREDENTIAL_HEADERS
                       for spelling in dict.fromkeys((name, name.replace("-", "_"))))


def credential_header(name: str) -> bool:
    """Whether request header ``name`` is one of :data:`CREDENTIAL_HEADERS`, in any case and also spelled with ``_``:
    a WSGI server reads ``x_api_key`` as ``X-Api-Key`` (``HTTP_X_API_KEY``)."""
    return name.lower().replace("_", "-") in CREDENTIAL_HEADERS


#: Names of headers, query parameters and body or argument fields whose values ``log_input="redacted"`` removes
#: wherever they appear under ``input`` or ``state`` (case-insensitive search). ``pw``, ``otp``, ``totp``, ``ssn``,
#: ``pan`` and ``ccn`` count as words of a name, split at ``-``, ``_``, ``.`` and camelCase (``new_pw``, ``otpCode``,
#: ``card_pan``, not ``power``, ``span`` or ``company``), and so do a card, account or pin number's (``cardNo``,
#: ``acct_number``, ``account_no``, not ``account_notes``); of the names ending in ``key
#: only those of secret keys (``ssh_key``, ``client_key``, ``signing_key``, ``license_key``; not ``object_key``,
#: ``sort_key``, ``public_key`` or ``idempotency_key``, which a reviewer must read).
_WORD_START = r"(?:^|(?<=[-_.\s])|(?-i:(?<=[a-z])(?=[A-Z])))"  # a name's word starts: snake, kebab or camelCase
_WORD_END = r"(?:$|(?=[-_.\s])|(?-i:(?<=[a-z])(?=[A-Z])))"
SECRET_NAME = re.compile(
    r"passw(or)?d|pass[-_]?phrase|secret|token(?!s)|api[-_]?key|access[-_]?key|private[-_]?key|credential|session"
    r"|cookie|csrf|xsrf|signature|^auth$|authorization|^x-auth|[-_]auth$|^pin$|card[-_]?num|(?:^|[-_])cc[-_]?num"
    r"|credit[-_]?card|cvv|cvc|hmac|social[-_]?security|^card$"
    rf"|{_WORD_START}(?:pwd?|t?otp|ssn|pan|ccn){_WORD_END}"
    r"|(?:verification|auth|mfa|2fa|otp|backup|recovery)[-_]?code|sess[-_]?id"
    r"|(?:^|[-_])(?:ssh|client|auth|signing|encryption|decryption|master|license|licence|app|account|shared"
    r"|subscription|webhook|storage)[-_]?key|seed[-_]?phrase|mnemonic|security[-_]?answer"
    rf"|{_WORD_START}(?:pin|account|acct|routing|card)[-_]?(?:num(?:ber)?|no|nr){_WORD_END}"
    r"|^key$|^sig$|jwt|^dpop$|assertion|^pass$|passcode|security[-_]?code|^pin[-_]?code$|^iban$|^bearer$"
    rf"|connection[-_]?string|conn[-_]?str(?:ing)?{_WORD_END}|database[-_]?url|{_WORD_START}dsn{_WORD_END}",
    re.IGNORECASE,
)
_CREDENTIAL_PARAM = re.compile(r"[-_](?:key|sig)$|^(?:code|authentication|sid|ticket)$", re.IGNORECASE)


def credential_name(name: str) -> bool:
    """Whether a query parameter or header is named like a credential: like a secret (:data:`SECRET_NAME`), a key or
    signature by its last word (``subscription-key``, ``x-functions-key``, ``app_key``, ``x-webhook-sig``), ``code``
    (an OAuth authorization code, an Azure Functions key), ``authentication`` (a misspelt Authorization), ``sid`` (a
    session id) or ``ticket`` (a CAS service ticket); a ``[]`` suffix (``key[]``) is read without it. Broader than
    :data:`SECRET_NAME`, which also names the body and state fields a reviewer must read (a support ``ticket``, an
    ``object_key``)."""
    name = name.removesuffix("[]")
    return SECRET_NAME.search(name) is not None or _CREDENTIAL_PARAM.search(name) is not None


#: An ``Authorization`` value of a scheme that carries one opaque credential (RFC 9110 token68: ``Bearer abc.def``,
#: ``Basic dXNlcjpwYXNz``), the credential running to the end of the value.
#: The credential may be quoted, and what follows a ``,`` or ``;`` (a second credential, a parameter) is not read.
_TOKEN68_VALUE = re.compile(r"\s*(?:bearer|basic|token|negotiate|apikey|api-key|sharedkey|dpop)\s+\"?"
                            r"([A-Za-z0-9._~+/-]+=*)\"?\s*(?:[,;].*)?", re.IGNORECASE | re.DOTALL)
#: The auth schemes that carry parameters (``Digest username="a", response="..."``, ``AWS4-HMAC-SHA256
#: Credential=..., Signature=...``, Rails' ``Token token="...", email="..."``).
_PARAM_SCHEMES = r"digest|hawk|aws4-hmac-sha256|sharedkey|token"
#: An ``Authorization`` value of a scheme that carries parameters (:data:`_PARAM_SCHEMES`) and its first ``name=``.
_PARAMS_VALUE = re.compile(rf"\s*(?:{_PARAM_SCHEMES})\s+[A-Za-z_-]+=", re.IGNORECASE)
#: What tells a credential from a word after ``Basic`` or ``Token`` (``Basic Reviewer``, ``Token refreshed``): a digit
#: or a symbol, a capital after a small letter (base64), or a length no word has.
_NOT_A_WORD = re.compile(r"[0-9._~+/=-]|[a-z][A-Z]|^.{24,}$")


def credential_value(value: str) -> bool:
    """Whether ``value`` reads as a credential by its shape, as an ``Authorization`` header's value: an auth scheme
    (``Bearer``, ``Basic``, ``Token``, ...) and one credential of at least 8 characters that is not a plain word,
    running to the end of the value; or a parameter scheme (``Digest``, ``Hawk``, ...) and its first ``name=``."""
    token = _TOKEN68_VALUE.fullmatch(value)
    if token is not None:
        credential = token.group(1)
        return len(credential) >= 8 and _NOT_A_WORD.search(credential) is not None
    return _PARAMS_VALUE.match(value) is not None


#: Request headers whose values ``log_input="redacted"`` keeps in ``input``; every other header's value is removed
#: (its name stays listed in ``erased``): credentials travel in headers of every name (``x-functions-key``,
#: ``ocp-apim-subscription-key``, ``cf-access-jwt-assertion``), so the log keeps only headers known to carry none.
LOGGED_HEADERS = frozenset({
    "accept", "accept-encoding", "accept-language", "cache-control", "connection", "content-encoding",
    "content-language", "content-length", "content-type", "forwarded", "host", "origin", "pragma", "te",
    "traceparent", "transfer-encoding", "user-agent", "via", "x-forwarded-for", "x-forwarded-host",
    "x-forwarded-proto", "x-real-ip", "x-request-id",
})
LOG_INPUT_MODES = ("none", "redacted", "full")
"""``none``: no ``input`` and no ``state``; ``redacted`` (default): fields named like secrets (:data:`SECRET_NAME`)
and request headers not in :data:`LOGGED_HEADERS` removed, and their values wherever they are repeated in
``input`` or ``state`` text; ``full``: only the ``redact`` pointers, and their values wherever ``input`` or ``state``
text repeats them (a state read from the ``authorization`` header)."""

_NO_SPAN: AbstractContextManager[None] = nullcontext()


#: Most characters of a span attribute taken from the request (``url.path``, a tool's name); longer ones are cut
#: and end with ``...``: a client sends 60 KB paths, and a batch of such spans is refused by a collector whole.
MAX_REQUEST_ATTRIBUTE_CHARS = 1024
#: Most characters of any span attribute value, unless ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`` or
#: ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`` says otherwise (OpenTelemetry's own default is no limit).
DEFAULT_ATTRIBUTE_VALUE_LIMIT = 4096


def _capped(text: str) -> str:
    """``text``, cut to :data:`MAX_REQUEST_ATTRIBUTE_CHARS` characters (``...`` at the end when cut)."""
    if len(text) <= MAX_REQUEST_ATTRIBUTE_CHARS:
        return text
    return text[: MAX_REQUEST_ATTRIBUTE_CHARS - 3] + "..."


def tracer_provider_from_env(environ: Mapping[str, str]) -> Any:
    """An SDK ``TracerProvider`` configured by the standard ``OTEL_*`` variables, or ``None`` for no tracing.

    ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn tracing off. ``OTEL_TRACES_EXPORTER=console``
    prints spans on stdout; ``otlp`` (also chosen when only ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set) sends them in batches over OTLP/HTTP protobuf to the traces
    endpoint (default ``http://localhost:4318/v1/traces``). With none of these set there is no tracing. The resource
    comes from ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (service name ``guard`` by default). Attribute
    values are cut at ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`` / ``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`` characters,
    :data:`DEFAULT_ATTRIBUTE_VALUE_LIMIT` when neither is set.

    Raises:
        ValueError: an ``OTEL_TRACES_EXPORTER`` other than :data:`TRACES_EXPORTERS` (one exporter at a time), an
            attribute length limit that is not a whole number, or for ``otlp`` an ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or
            ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``) other than ``http/protobuf``.
    """
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    traces_endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base_endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not exporter:
        exporter = "otlp" if traces_endpoint or base_endpoint else "none"
    if exporter not in TRACES_EXPORTERS:
        raise ValueError(f"OTEL_TRACES_EXPORTER must be one of {', '.join(TRACES_EXPORTERS)}, got {exporter!r}")
    if exporter == "none":
        return None
    limit = DEFAULT_ATTRIBUTE_VALUE_LIMIT
    for name in ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"):  # the span's first
        if value := environ.get(name, "").strip():
            if not (value.isascii() and value.isdigit()):
                raise ValueError(f"{name} must be a whole number of characters, got {value!r}")
            limit = int(value)
            break
    provider = TracerProvider(resource=resource_from_env(environ, "guard"),
                              span_limits=SpanLimits(max_attribute_length=limit))
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        return provider
    _check_otlp_protocol(environ, "TRACES")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint = traces_endpoint or (base_endpoint or "http://localhost:4318").rstrip("/") + "/v1/traces"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def metric_readers_from_env(environ: Mapping[str, str]) -> tuple[list[Any], bool]:
    """The metric readers the standard ``OTEL_*`` variables ask for, and whether Prometheus is among them.

    ``OTEL_METRICS_EXPORTER`` is a comma-separated list of ``otlp`` (OTLP/HTTP protobuf to
    ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/metrics``, every
    ``OTEL_METRIC_EXPORT_INTERVAL`` ms, default 60000), ``console`` (stdout, same interval), ``prometheus`` (the
    process's ``/metrics`` or ``/_guard/metrics`` endpoint; not a reader made here) or ``none``. Unset: ``prometheus``,
    plus ``otlp`` when an OTLP endpoint is set. ``OTEL_SDK_DISABLED=true`` adds no reader, and (OpenTelemetry's
    specification) makes every SDK ``MeterProvider`` a no-op: no guard metric is kept, on the Prometheus endpoints
    either; ``OTEL_METRICS_EXPORTER=prometheus`` is the way to keep scraping without pushing.

    Returns:
        ``(readers to add to a MeterProvider, whether the Prometheus endpoint should serve)``.

    Raises:
        ValueError: an unknown exporter name, an ``OTEL_METRIC_EXPORT_INTERVAL`` that is not a number of
            milliseconds a reader can wait, or for ``otlp`` an ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or
            ``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL``) other than ``http/protobuf`` (naming the variable).
    """
    endpoint = environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip()
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    raw = environ.get("OTEL_METRICS_EXPORTER", "").strip().lower()
    names = [n.strip() for n in raw.split(",") if n.strip()] or ["prometheus", *(["otlp"] if endpoint or base else [])]
    unknown = [n for n in names if n not in METRICS_EXPORTERS]
    if unknown:
        raise ValueError(f"OTEL_METRICS_EXPORTER must list {', '.join(METRICS_EXPORTERS)}, got {unknown[0]!r}")
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return [], "prometheus" in names
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    interval = _export_interval_ms(environ)
    readers: list[Any] = []
    if "console" in names:
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=interval))
    if "otlp" in names:
        _check_otlp_protocol(environ, "METRICS")
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        url = endpoint or (base or "http://localhost:4318").rstrip("/") + "/v1/metrics"
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=url), export_interval_millis=interval))
    return readers, "prometheus" in names


#: The one OTLP protocol guard exports with (``OTEL_EXPORTER_OTLP_PROTOCOL``).
OTLP_PROTOCOL = "http/protobuf"


def _check_otlp_protocol(environ: Mapping[str, str], signal: str) -> None:
    """Refuse an OTLP protocol other than :data:`OTLP_PROTOCOL` (``grpc``, ``http/json``) named by
    ``OTEL_EXPORTER_OTLP_<signal>_PROTOCOL`` or else ``OTEL_EXPORTER_OTLP_PROTOCOL``: the exporter would send
    HTTP/protobuf anyway, which a gRPC collector port refuses, and nothing would be exported.

    Raises:
        ValueError: naming the variable and its value.
    """
    for name in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):  # the signal's first
        if value := environ.get(name, "").strip():
            if value.lower() != OTLP_PROTOCOL:
                raise ValueError(f"{name} must be {OTLP_PROTOCOL} (guard exports OTLP over HTTP/protobuf only), "
                                 f"got {value!r}")
            return


def _export_interval_ms(environ: Mapping[str, str]) -> float:
    """``OTEL_METRIC_EXPORT_INTERVAL``: milliseconds between a periodic reader's exports, 60000 when unset or empty.

    Raises:
        ValueError: naming the variable, when it is not a finite number of milliseconds above 0 and at most what a
            thread can wait (``threading.TIMEOUT_MAX``; past it the reader's thread dies and nothing is exported).
    """
    text = environ.get("OTEL_METRIC_EXPORT_INTERVAL", "").strip()
    if not text:
        return 60000.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= threading.TIMEOUT_MAX * 1000:
        raise ValueError(
            f"OTEL_METRIC_EXPORT_INTERVAL must be a number of milliseconds above 0 and at most "
            f"{threading.TIMEOUT_MAX * 1000:.0f}, got {text!r}"
        )
    return value


class Telemetry:
    """Spans and counters for decisions.

    Args:
        tracer_provider: an OpenTelemetry ``TracerProvider``; ``None`` = the global one (a no-op until configured).
        meter_provider: a ``MeterProvider``; ``None`` = the global one.
    """

    def __init__(self, *, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        self.tracer_provider = tracer_provider
        self.tracer = trace.get_tracer("guard", __version__, tracer_provider=tracer_provider)
        self._tracing = False
        self._tracing_checked = -math.inf
        meter = metrics.get_meter("guard", __version__, meter_provider=meter_provider)
        self.decisions = meter.create_counter(
            "guard.decisions", unit="{decision}", description="Decisions by policy, action, rule and fail mode."
        )
        self.fail_open = meter.create_counter(
            "guard.fail_open", unit="{decision}", description="Decisions allowed because a fail-open policy erred."
        )
        self.state_cut = meter.create_counter(
            "guard.state_cut",
            unit="{decision}",
            description="Decisions made on part of the state (a field over max_chars, or tokens the backend dropped).",
        )
        self.shadow_skipped = meter.create_counter(
            "guard.shadow_skipped",
            unit="{decision}",
            description="Shadow policies not asked because as many late shadow decisions as the cap were running.",
        )
        self.cache_lookups = meter.create_counter(
            "guard.cache.lookups",
            unit="{decision}",
            description="Decisions by how the deciding policy's answers were found: hit, miss or shared (result).",
        )
        self.handoffs = meter.create_counter(
            "guard.handoffs",
            unit="{decision}",
            description="Agent decisions handed to an LLM reviewer, by policy and how they were settled (outcome).",
        )
        self.duration = meter.create_histogram(
            "guard.decision.duration",
            unit="s",
            description="Wall time of one evaluation.",
            explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS_S),
        )

    @property
    def tracing(self) -> bool:
        """Whether spans can record: the tracer provider (this one's, else the global one) is not OpenTelemetry's
        no-op or not-yet-configured proxy provider.

        A global provider set after this object was made is seen within :data:`TRACING_RECHECK_S` seconds (reading
        the global provider costs about a third of a cached decision, so it is not read on every call); once a
        recording provider is seen the answer stays ``True`` (OpenTelemetry sets the global provider only once).
        """
        if self._tracing:
            return True
        now = time.monotonic()
        if now >= self._tracing_checked + TRACING_RECHECK_S:
            provider = self.tracer_provider if self.tracer_provider is not None else trace.get_tracer_provider()
            self._tracing = not isinstance(provider, (ProxyTracerProvider, NoOpTracerProvider))
            self._tracing_checked = now
        return self._tracing

    def span(self, subject: Subject) -> AbstractContextManager[Span | None]:
        """The decision span, current for the duration (backend client spans nest under it); ``None`` when no span
        is started.

        Attributes are built only when the span records. With no tracer provider configured no span is started at
        all (starting OpenTelemetry's no-op span and making it current costs about as much as the rest of a cache
        hit): the context manager yields ``None`` and leaves the context as it is, so a recording span of someone
        else's provider stays current and untouched (the decision log still takes its trace id).
        """
        if not self.tracing:
            return _NO_SPAN
        return self._recording_span(subject)

    @contextmanager
    def _recording_span(self, subject: Subject) -> Iterator[Span]:
        with self.tracer.start_as_current_span(SPAN_NAME, record_exception=False) as span:
            if span.is_recording():
                attributes: dict[str, Any] = {"guard.subject.kind": subject.kind}
                if isinstance(subject, HttpSubject):
                    attributes["http.request.method"] = _capped(subject.method)
                    attributes["url.path"] = _capped(subject.path)
                elif isinstance(subject, AgentSubject):
                    attributes["guard.agent.event"] = _capped(subject.event)
                    if subject.tool_name:
                        attributes["guard.agent.tool"] = attributes["gen_ai.tool.name"] = _capped(subject.tool_name)
                span.set_attributes(attributes)
            yield span

    def finish(self, span: Span | None, verdict: Verdict, *, cache: str | None = None, path: str | None = None) -> None:
        """Set the verdict's attributes on ``span`` (when there is one and it records) and count the outcome. The
        span's status is ERROR only when a fail mode decided (the backend failed, or the guard itself raised); a
        refusal of the client's input (a body that is not JSON: ``guard.error`` names it) leaves it unset, as an
        HTTP server span leaves a 4xx. ``path``, when given, replaces the ``url.path`` the span started with (the
        path with what a refused ``redact`` rule could not mask masked)."""
        if span is not None and span.is_recording():
            span.set_attributes(span_attributes(verdict, cache=cache))
            if path is not None:
                span.set_attribute("url.path", _capped(path))
            if verdict.fail_mode is not None:
                span.set_status(Status(StatusCode.ERROR, verdict.error))
            span.add_event(EVALUATION_EVENT, evaluation_attributes(verdict))
            for own in verdict.contributions:
                attributes = span_attributes(own)
                span.add_event(POLICY_VERDICT_EVENT, {k: attributes[k] for k in POLICY_VERDICT_ATTRIBUTES
                                                      if k in attributes})
        policy_id = verdict.policy_id or ""
        labels, by_policy = _labels(policy_id, verdict.action, verdict.rule, verdict.fail_mode, verdict.shadow_action)
        self.decisions.add(1, labels)
        if cache is not None:
            self.cache_lookups.add(1, {"guard.policy.id": policy_id, "result": cache})
        self.duration.record(verdict.latency_ms / 1000.0, by_policy)
        for own in verdict.contributions or (verdict,):  # each policy's fail-open and cut state under its own id
            flags = own.flags
            if flags:  # usually empty
                policy = {"guard.policy.id": own.policy_id or ""}
                # an enforced policy's fail-open counts when the decision let the subject through (the verdict keeps
                # it), a shadow one's always, as when it finishes late and is recorded alone
                if flags.get("fail_open") and (own.shadow_action is not None or verdict.flags.get("fail_open")):
                    self.fail_open.add(1, policy)
                if flags.get("truncated") or flags.get("state_tokens_dropped"):
                    self.state_cut.add(1, policy)


@functools.lru_cache(maxsize=1024)
def _labels(
    policy_id: str, action: str, rule: str | None, fail_mode: str | None, shadow_action: str | None
) -> tuple[dict[str, str | bool], dict[str, str]]:
    """The counters' attributes for one outcome, and the policy's alone: made once per outcome (OpenTelemetry reads
    attributes and never changes them; nor does anything here)."""
    labels: dict[str, str | bool] = {
        "guard.policy.id": policy_id,
        "guard.action": action,
        "guard.rule": rule or "",
        "guard.fail_mode": fail_mode or "",
        "guard.shadow": shadow_action is not None,
    }
    return labels, {"guard.policy.id": policy_id}


def evaluation_attributes(verdict: Verdict) -> dict[str, Any]:
    """The ``gen_ai.evaluation.result`` event's attributes for a verdict (GenAI semantic conventions)."""
    values: dict[str, Any] = {
        "gen_ai.evaluation.name": verdict.policy_id or "no_policy",
        "gen_ai.evaluation.score.label": verdict.action,
        "gen_ai.evaluation.explanation": verdict.rule,
        "error.type": verdict.error.split(":", 1)[0] if verdict.error else None,
    }
    return {k: v for k, v in values.items() if v is not None}


def span_attributes(verdict: Verdict, *, cache: str | None = None) -> dict[str, Any]:
    """The :data:`SPAN_ATTRIBUTES` of a verdict (``None`` values left out), each string valid UTF-8, as OTLP needs
    (:func:`~guard._json.surrogates_joined`: a policy file's or checkpoint directory's name that is not UTF-8 holds
    lone surrogates from ``os.fsdecode``, shown as U+FFFD). The ``gen_ai.*`` attributes are left out where no model
    was asked for the decision (a cache hit, answers shared with a caller that asked, no backend)."""
    asked = verdict.model is not None and not verdict.cache_hit
    values: dict[str, Any] = {
        "guard.decision_id": verdict.decision_id,
        "guard.policy.id": verdict.policy_id,
        "guard.policy.version": verdict.policy_version,
        "guard.policy.digest": verdict.policy_digest,
        "guard.policy.file": verdict.policy_file,
        "guard.rule": verdict.rule,
        "guard.action": verdict.action,
        "guard.shadow_action": verdict.shadow_action,
        "guard.status": verdict.status,
        "guard.cache_hit": verdict.cache_hit,
        "guard.cache": cache,
        "guard.backend": verdict.backend,
        "guard.model": verdict.model,
        "guard.model_revision": verdict.model_revision,
        "guard.latency_ms": round(verdict.latency_ms, 3),
        "guard.fail_mode": verdict.fail_mode,
        "guard.error": verdict.error,
        "guard.flags": sorted(verdict.flags) if verdict.flags else None,
        # several matching policies: each one's "id@version=action/rule", in match order
        "guard.policies": [
            f"{c.policy_id}@{c.policy_version}={c.shadow_action or c.action}/{c.rule}" for c in verdict.contributions
        ] or None,
        # only where a model answered this decision: not a cache hit, not a caller sharing another's call
        "gen_ai.request.model": verdict.model if asked else None,
        "gen_ai.operation.name": GEN_AI_OPERATION if asked else None,
        # OpenTelemetry's error.type: the kind before the colon of guard.error ("timeout", "connection", ...)
        "error.type": verdict.error.split(":", 1)[0] if verdict.error else None,
    }
    return {k: surrogates_joined(v) if isinstance(v, str) else v for k, v in values.items() if v is not None}


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


#: Deepest nesting of objects and arrays a decision record keeps; deeper values become :data:`TOO_DEEP`.
MAX_DEPTH = 64
#: What the log writes in place of a value nested deeper than :data:`MAX_DEPTH`.
TOO_DEEP = "[too deep: left out]"


def _json_safe(value: Any, depth: int = 0, hidden: list[str] | None = None, secret: bool = False) -> Any:
    """``value`` as JSON types (dataclasses as objects, tuples as arrays, anything else as its ``repr``); an object
    or array nested more than :data:`MAX_DEPTH` levels down is replaced by :data:`TOO_DEEP`, so nothing that walks
    the record later (redaction, ``json.dumps``) can run out of stack. The secret values such a cut leaves out go to
    ``hidden`` (:func:`_secret_strings`; every string of it when ``secret``: the part sits under a secret-named
    key), so the text that repeats them is still scrubbed."""
    if isinstance(value, (dict, list, tuple)) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        if depth >= MAX_DEPTH:
            if hidden is not None:
                hidden.extend(_secret_strings(value, secret))
            return TOO_DEEP
        if isinstance(value, dict):
            return {str(k): _json_safe(v, depth + 1, hidden, secret or _secret_name(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_json_safe(v, depth + 1, hidden, secret) for v in value]
        return {f.name: _json_safe(getattr(value, f.name), depth + 1, hidden, secret or _secret_name(f.name))
                for f in dataclasses.fields(value)}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)  # not str: some types mask what their repr would show (httpx.URL's password)


def _secret_name(key: Any) -> bool:
    return SECRET_NAME.search(str(key)) is not None


def _secret_strings(value: Any, secret: bool = False) -> list[str]:
    """The strings (and integers, as digits) under secret-named keys or dataclass fields (:data:`SECRET_NAME`)
    anywhere in ``value`` (all of them when ``secret``: ``value`` sits under one), walked with a stack, so any depth
    is read."""
    out: list[str] = []
    stack: list[tuple[Any, bool]] = [(value, secret)]
    while stack:
        node, under = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, under or _secret_name(k)) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, under) for v in node)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            stack.extend((getattr(node, f.name), under or _secret_name(f.name)) for f in dataclasses.fields(node))
        elif under and isinstance(node, str):
            out.append(node)
        elif under and isinstance(node, int) and not isinstance(node, bool):
            out.append(str(node))
    return out


#: Most strings read for the JSON documents they hold (:func:`_document_secrets`) per record; each one past them that
#: may hold an object is itself taken as a secret value (redacted whole): the log redacts more than it must rather
#: than parse a body of 200,000 ``"{"`` strings (13 s).
MAX_DOCUMENT_STRINGS = 256


def _document_secrets(node: Any) -> list[str]:
    """The values under secret-named keys (:func:`_secret_strings`) in the JSON documents ``node``'s strings hold,
    read as a client's JSON parser reads them (:func:`guard._json.json_readings`: a ``text/plain`` or NDJSON body, an
    event stream, a field or parameter holding ``json.dumps`` of an object), and in the documents their strings hold,
    :data:`~guard._json.JSON_LEVELS` deep; each value also as serialisers spell it inside such a string
    (:func:`_json_spellings`). Reads at most :data:`MAX_DOCUMENT_STRINGS` strings."""
    out: list[str] = []
    pending = collections.deque((text, JSON_LEVELS) for text in body_strings(node))
    read = 0
    while pending:
        text, levels = pending.popleft()
        if "{" not in text:  # only an object has keys
            continue
        if read == MAX_DOCUMENT_STRINGS:
            out.append(text)
            continue
        read += 1
        documents = json_readings(text)
        out += [spelling for value in _secret_strings(documents) for spelling in _json_spellings(value)]
        if levels > 1:
            pending += [(inner, levels - 1) for inner in body_strings(documents)]
    return out


def body_secrets(body: Any) -> list[str]:
    """The values (strings, integers as digits) under secret-named keys (:data:`SECRET_NAME`) of a parsed request
    ``body``, and those in the JSON documents its strings hold, as those documents may spell them
    (:func:`_document_secrets`): what the state and the decision log mask wherever text repeats them."""
    return [*_secret_strings(body), *_document_secrets(body)]


def _json_spellings(value: str) -> set[str]:
    """``value`` and how JSON serialisers write it inside a string, where a text that holds a document keeps it: with
    what JSON must escape escaped (a quote, a backslash, a control character: JavaScript's ``JSON.stringify``), with
    non-ASCII as ``\\u`` escapes too (Python's ``json.dumps``), and with ``/`` as ``\\/`` on top (PHP's
    ``json_encode``)."""
    escaped = json.dumps(value, ensure_ascii=False)[1:-1]
    ascii_only = json.dumps(value)[1:-1]
    return {value, escaped, ascii_only, ascii_only.replace("/", "\\/")}


# Characters that JSON leaves raw with ensure_ascii=False but that end a line for Unicode-aware readers
# (str.splitlines, editors, some log shippers): C1 controls (NEL is U+0085) and the line and paragraph separators;
# and surrogate code points (a lone one from a JSON ``"\\ud83d"`` or from ``os.fsdecode``), which UTF-8 cannot encode.
_ESCAPED = re.compile("[\x80-\x9f\u2028\u2029\ud800-\udfff]")


def _json_line(event: dict[str, Any]) -> str:
    """``event`` as one JSON line: UTF-8 text kept as it is, except the characters in :data:`_ESCAPED`, written as
    ``\\uXXXX`` escapes (they only occur inside JSON strings, where the escape means the same), so the line can be
    written to any UTF-8 sink."""
    line = json.dumps(event, ensure_ascii=False, separators=(",", ":"), default=repr)
    return _ESCAPED.sub(lambda m: f"\\u{ord(m.group()):04x}", line)


#: What the log writes in place of a body, text or query value it must not keep.
WITHHELD = "[withheld: holds what a redact rule could not mask]"

#: Most characters of each string (and object key) of a record's ``input`` and ``state``, unless
#: ``DecisionLog(max_chars=...)`` says otherwise: a 5 MB tool result made a 10 MB line.
MAX_LOGGED_CHARS = 64 * 1024
#: Put between the two halves a longer string keeps: ``{cut}`` characters left out of ``{length}``.
LOG_CUT_MARKER = "[... cut from the log: {cut} of {length} characters ...]"
#: Most characters of each string the decision log reads for secrets (:func:`_scrub_record`), 1 MiB (the gateway's
#: default largest body): a longer string keeps its first and last halves, as :data:`LOG_CUT_MARKER` cuts do (the end
#: an attack hides in is kept), and the middle is cut, never written unread, :data:`LOG_UNREAD_MARKER` in its place.
MAX_SCRUBBED_CHARS = 1024 * 1024
#: Put between the halves of a string past :data:`MAX_SCRUBBED_CHARS`: ``{cut}`` characters.
LOG_UNREAD_MARKER = "[... cut from the log unread: {cut} more characters ...]"


def _bounded(node: Any, limit: int) -> Any:
    """``node`` (JSON types) with each string and object key over ``limit`` characters cut to its first and last
    halves of ``limit``, :data:`LOG_CUT_MARKER` (with its length) between them on lines of its own; keys of one object
    cut to the same text are kept apart by a suffix, `` #2``, `` #3``, ... on the second and later (in the object's
    order), so no value is lost. A suffixed key equals no other: an uncut key is shorter than any cut one, and each cut
    one ends with the marker and a tail of the same length, which the suffix lengthens."""
    if isinstance(node, str):
        if len(node) <= limit:
            return node
        head = limit - limit // 2
        marker = LOG_CUT_MARKER.format(cut=len(node) - limit, length=len(node))
        return f"{node[:head]}\n{marker}\n{node[len(node) - (limit - head):]}"
    if isinstance(node, dict):
        out: dict[Any, Any] = {}
        seen: collections.Counter[Any] = collections.Counter()  # keys by the text they were cut to
        for key, value in node.items():
            name = _bounded(key, limit)
            seen[name] += 1
            out[name if seen[name] == 1 else f"{name} #{seen[name]}"] = _bounded(value, limit)
        return out
    if isinstance(node, list):
        return [_bounded(v, limit) for v in node]
    return node


def _input_json(subject: Subject, verdict: Verdict, hidden: list[str]) -> Any:
    """The subject as the log keeps it: every field but an agent subject's ``history`` (the conversation before the
    event, which would make every record as long as the thread) and an HTTP subject's ``query_string``,
    ``form_string`` and ``sent_path`` (the raw query, form and path: the decoded ``query`` and ``body`` and the
    matched ``path`` are kept, where secret-named fields are redacted and values withheld as below),
    the method cut by :func:`_capped`; a ``redact``
    verdict's spans masked in the body and its text; the body, its text and the query values left out (:data:`WITHHELD`)
    of a request refused because what its rule masks could not be masked there. Secret values cut off with a part nested
    too deep go to ``hidden``, and so do those of the secret-named fields of the JSON a streamed window's ``deltas`` spell
    once joined (:func:`_document_secrets`), which the record leaves out: the joined text in ``body_text`` and the
    state built from it are scrubbed of them, as a ``text/plain`` body's are."""
    record = _json_safe(subject, hidden=hidden)
    if isinstance(subject, HttpSubject):  # a method is one token: cut as on the span (any length reaches us)
        record["method"] = _capped(subject.method)
    record.pop("history", None)
    record.pop("query_string", None)
    record.pop("form_string", None)
    record.pop("sent_path", None)  # the path as sent where a policy matched its lower-cased view: as query_string
    record.pop("deltas", None)  # a streamed window's pieces: its body_text holds them joined
    if isinstance(subject, HttpSubject) and subject.deltas:  # the JSON they spell joined: its secrets, as a text body's
        hidden.extend(_document_secrets(["".join(pieces) for pieces in subject.deltas]))
    unmaskable = any(own.flags.get(UNMASKABLE_FLAG) for own in (verdict, *verdict.contributions))  # a shadow's too
    if unmaskable and isinstance(subject, HttpSubject):  # it holds what could not be masked
        record.update(body=WITHHELD, body_text=WITHHELD, query={name: [WITHHELD] for name in subject.query})
    elif verdict.redactions and isinstance(subject, HttpSubject):
        body = apply_redactions(subject.body, verdict.redactions)
        record["body"] = _json_safe(body, hidden=hidden)
        record["body_text"] = "\n".join(body_strings(body))
    return record


def _split(pointer: str) -> list[str]:
    if not pointer.startswith("/"):
        raise ValueError(f"redaction pointer {pointer!r} must be a JSON pointer starting with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _erase(node: Any, tokens: list[str], at: str, erased: list[str], values: list[str]) -> None:
    """Remove what the pointer ``tokens`` names under ``node``; each removed pointer goes to ``erased`` and the
    strings it held to ``values`` (so text that repeats them can be scrubbed too)."""
    if not tokens:
        return
    head, rest = tokens[0], tokens[1:]
    if isinstance(node, dict):
        keys = list(node) if head == "*" else ([head] if head in node else [])
        for key in keys:
            where = f"{at}/{escape_pointer(str(key))}"
            if rest:
                _erase(node[key], rest, where, erased, values)
            else:
                values.extend(_strings(node.pop(key)))
                erased.append(where)
    elif isinstance(node, list):
        if head == "*":
            indices = range(len(node))
        else:
            try:
                indices = range(int(head), int(head) + 1) if 0 <= int(head) < len(node) else range(0)
            except ValueError:
                return
        for i in reversed(indices) if not rest else indices:
            if rest:
                _erase(node[i], rest, f"{at}/{i}", erased, values)
            else:
                values.extend(_strings(node[i]))
                node[i] = None  # keep indices stable; the value is gone
                erased.append(f"{at}/{i}")


def _strings(node: Any) -> list[str]:
    """Every string value in ``node`` (an integer as its digits: ``"cvv": 123``), and the keys of its mappings that
    the judged body text repeats (those that are not plain identifiers: a secret can be a key,
    ``{"sk-live-...": "active"}``)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, int) and not isinstance(node, bool):
        return [str(node)]
    if isinstance(node, dict):
        return [t for k, v in node.items() for t in ((*(() if is_plain_key(str(k)) else (str(k),)), *_strings(v)))]
    if isinstance(node, list):
        return [t for v in node for t in _strings(v)]
    return []


def _erase_secret_names(node: Any, at: str, erased: list[str], values: list[str]) -> None:
    """Remove every mapping entry whose key looks like a secret (:data:`SECRET_NAME`), at any depth; the strings
    they held, and the key where it is not a plain identifier (the body's text repeats it:
    ``"backup token ... password hunter2"``), go to ``values``."""
    if isinstance(node, dict):
        for key in list(node):
            where = f"{at}/{escape_pointer(str(key))}"
            if SECRET_NAME.search(str(key)):
                values.extend(_strings({key: node.pop(key)}))
                erased.append(where)
            else:
                _erase_secret_names(node[key], where, erased, values)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            _erase_secret_names(item, f"{at}/{i}", erased, values)


#: Most distinct secret values scrubbed one by one from a record's text. A string that may hold one of the others
#: (it holds the first :data:`_WINDOW` characters of one) is replaced whole by ``[redacted]``: past this many the
#: log redacts more than it must rather than spend time quadratic in the request's size, and never leaks.
SCRUB_MAX_VALUES = 128
_WINDOW = 8


class Scrubber:
    """Replaces secret values in strings by ``[redacted]``, in time linear in each string's length.

    The first :data:`SCRUB_MAX_VALUES` values are replaced one after another, longest first (``str.replace``: a
    linear search in C per value, whatever the text repeats); a value of 3 digits only where no digit is next to it
    (a security code, not the middle of ``41234``). Where two values overlap in the text, the second loses its
    overlap with the first and keeps its other end. A string holding the start (:data:`_WINDOW` characters) of any
    value past the cap is replaced whole.
    """

    def __init__(self, values: list[str]) -> None:
        ordered = sorted(set(values), key=lambda v: (-len(v), v))
        exact, rest = ordered[:SCRUB_MAX_VALUES], ordered[SCRUB_MAX_VALUES:]
        self._values = [v for v in exact if len(v) >= 4]
        codes = [v for v in exact if len(v) < 4]
        self._codes = re.compile(rf"(?<!\d)(?:{'|'.join(codes)})(?!\d)") if codes else None  # 3 digits each
        self._width = min([_WINDOW, *(len(v) for v in rest)])
        self._starts = {v[:self._width] for v in rest}

    def __call__(self, text: str) -> str:
        if self._starts and any(text[i:i + self._width] in self._starts for i in range(len(text) - self._width + 1)):
            return "[redacted]"
        for value in self._values:
            if value in text:
                text = text.replace(value, "[redacted]")
        return self._codes.sub("[redacted]", text) if self._codes is not None else text


def _scrub(node: Any, scrub: Callable[[str], str]) -> Any:
    """``node`` with ``scrub`` applied to each of its strings (not to mapping keys)."""
    if isinstance(node, str):
        return scrub(node)
    if isinstance(node, dict):
        return {k: _scrub(v, scrub) for k, v in node.items()}
    if isinstance(node, list):
        return [_scrub(v, scrub) for v in node]
    return node


RAW_ARGUMENTS_FLAG = "raw_arguments"
"""The verdict flag that holds a malformed tool call's raw argument text (input, redacted like ``input``)."""
MALFORMED_FLAG = "malformed"
"""The verdict flag that says what is wrong with a malformed tool call; it may quote the arguments (a duplicate key),
so the decision log treats it as the verdict's ``message_from_input`` message."""
# A key in JSON-like text that may be malformed or cut off, up to its ``:`` (or a keyword argument's ``=``):
# double-quoted (escapes kept), single-quoted, or a bare identifier (the shapes a model writes).
_RAW_KEY = re.compile(
    r'"((?:[^"\\]|\\.)*)"\s*[:=]\s*|\'((?:[^\'\\]|\\.)*)\'\s*[:=]\s*|(?<![\w"\'$])([A-Za-z_$][\w$-]*)\s*[:=]\s*'
)
_RAW_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"|\'((?:[^\'\\]|\\.)*)\'')
_RAW_BARE = re.compile(r"[^,}\])\n]*")


def _raw_key(written: str) -> str:
    """A JSON key as its escapes spell it (``"pass\\u0077ord"`` is ``password``); as written when it is no JSON."""
    try:
        return str(json.loads(f'"{written}"'))
    except ValueError:
        return written


def _value_end(raw: str, start: int) -> int:
    """Where the value that starts at ``raw[start]`` ends: a quoted string to its closing quote, an object or array to
    its matching bracket (quotes inside skipped), a bare value to the next ``,``, ``}``, ``]``, ``)`` or line break;
    the end of ``raw`` when the text is cut off first."""
    if start >= len(raw):
        return start
    first = raw[start]
    if raw.startswith(('"""', "'''"), start):  # a triple-quoted string
        close = raw.find(raw[start:start + 3], start + 3)
        return len(raw) if close < 0 else close + 3
    if first in "\"'":
        i = start + 1
        while i < len(raw) and raw[i] != first:
            i += 2 if raw[i] == "\\" else 1
        return min(i + 1, len(raw))
    if first in "{[":
        depth, i, quote = 0, start, ""
        while i < len(raw):
            char = raw[i]
            if quote:
                if char == "\\":
                    i += 1
                elif char == quote:
                    quote = ""
            elif char in "\"'":
                quote = char
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return len(raw)
    return _RAW_BARE.match(raw, start).end()  # type: ignore[union-attr]  # it matches the empty string


def _erase_raw_secrets(raw: str, values: list[str]) -> str:
    """``raw`` (argument text that did not parse) with the value of every secret-named key replaced by
    ``"[redacted]"``, whatever the value (a string, a number, an object or array, one cut off); the string values go
    to ``values``."""
    out, at = [], 0
    for match in _RAW_KEY.finditer(raw):
        if match.start() < at:  # inside a value already erased
            continue
        written = next(group for group in match.groups() if group is not None)
        if not SECRET_NAME.search(_raw_key(written)):
            continue
        end = _value_end(raw, match.end())
        value = raw[match.end():end]
        strings = [double or single for double, single in _RAW_STRING.findall(value)]
        values.extend(strings or [value.strip("\"'")])  # a value cut off inside its string has no closing quote
        out.append(raw[at:match.end()] + '"[redacted]"')
        at = end
    out.append(raw[at:])
    return "".join(out)


def _credentials(values: list[str]) -> list[str]:
    """The credentials inside ``Authorization``-style values (``Bearer sk-...`` -> ``sk-...``; ``Basic`` ones decoded
    as well: ``user:password`` and the password) and each value of 8 characters or more of a ``Cookie``-style one
    (``sid=abcdef123456; theme=dark`` -> ``abcdef123456``), so text that repeats the bare key, password or session id is scrubbed too."""
    out = []
    for value in values:
        scheme, _, credential = value.partition(" ")
        if credential and scheme.lower() in ("bearer", "basic", "token", "digest", "apikey"):
            out.append(credential.strip())
            if scheme.lower() == "basic":
                try:
                    decoded = base64.b64decode(credential.strip(), validate=True).decode("utf-8")
                except (ValueError, UnicodeDecodeError):
                    continue
                out += [decoded, decoded.partition(":")[2]]
        elif "=" in value:
            for part in value.split(";"):
                cookie = part.partition("=")[2].strip().strip('"')  # RFC 6265 allows a quoted value
                if len(cookie) >= 8:  # a session id, not a theme or a language
                    out.append(cookie)
    return out


def _redact_input(record: dict[str, Any], erased: list[str], logged_headers: Collection[str] = LOGGED_HEADERS,
                  values: list[str] | None = None, *, cards: bool = True, keep_input: bool = True) -> None:
    """Request headers not in ``logged_headers`` and secret-named fields out of ``input`` and ``state``, and their
    values, those of the secret-named fields in the JSON documents the input's strings hold (a ``text/plain`` body's:
    :func:`_document_secrets`) and ``values`` (what the ``redact`` pointers removed: the credential headers), out of
    any text that repeats them (the body's joined text, state built from it; of a header not named like a secret,
    only values of 12 characters or more: shorter ones are tiers and versions, words elsewhere; of the rest, values of
    4 characters or more, and 3 digits: a card's security code), and values shaped like secrets (:func:`_scrub_shapes`;
    card numbers only with ``cards``). Without ``keep_input``, ``input`` is read for its secrets and then dropped
    (``None``), not scrubbed: a caller that wants only the state does not scrub the whole body."""
    values = list(values or ())
    headers = record["input"].get("headers") if isinstance(record.get("input"), dict) else None
    if isinstance(headers, dict):
        for name in [n for n in headers if str(n).lower() not in logged_headers]:
            value = headers.pop(name)
            values.extend(v for v in _strings(value) if SECRET_NAME.search(str(name)) or len(v) >= 12)
            erased.append(f"/input/headers/{escape_pointer(str(name))}")
    query = record["input"].get("query") if isinstance(record.get("input"), dict) else None
    if isinstance(query, dict):
        for name in [n for n in query if credential_name(str(n))]:
            values.extend(v for v in _strings(query.pop(name)) if v != WITHHELD)  # a withheld value is guard's own
            erased.append(f"/input/query/{escape_pointer(str(name))}")
    _erase_secret_names(record.get("input"), "/input", erased, values)
    _erase_secret_names(record.get("state"), "/state", erased, values)
    if isinstance(record.get("input"), dict):  # JSON a text body, a form or query value holds (body_text repeats it)
        values.extend(_document_secrets([v for k, v in record["input"].items() if k != "body_text"]))
    flags = record.get("flags")
    raw = flags.get(RAW_ARGUMENTS_FLAG) if isinstance(flags, dict) else None
    if isinstance(raw, str):
        found = len(values)
        flags[RAW_ARGUMENTS_FLAG] = _erase_raw_secrets(raw, values)
        if len(values) > found:
            erased.append(f"/flags/{RAW_ARGUMENTS_FLAG}")
    if not keep_input:
        record["input"] = None
    _scrub_record(record, values, shapes=True, cards=cards, keys=True)


def secret_values(values: Iterable[str]) -> list[str]:
    """``values`` and the credentials inside ``Authorization``- and ``Cookie``-style ones (``Bearer sk-...`` ->
    ``sk-...``: :func:`_credentials`), less those too short to mask: under 4 characters, but for 3 digits (a card's
    security code); shorter ones would hit words."""
    values = list(values)
    return [v for v in [*values, *_credentials(values)] if len(v) >= 4 or (len(v) == 3 and v.isdigit())]


def _spellings(values: list[str]) -> list[str]:
    """How a request's raw text (a body as sent: a review item shows it) may spell each of ``values`` besides as
    itself: as a JSON string (:func:`_json_spellings`) and percent-encoded (a form's, ``+`` for a space, as Python
    and as browsers encode it, and a URL's)."""
    out = []
    for value in values:
        spelled = _json_spellings(value) | {quote_plus(value), quote_plus(value, safe="*").replace("~", "%7E"),
                                            quote(value, safe="")}
        out += sorted(spelled - {value})
    return out


#: Credentials known by their shape: AWS access key ids, GitHub tokens, Slack tokens (``xox?-``, ``xoxe.``,
#: ``xapp-``) and an incoming webhook URL's path, Google API keys and OAuth access tokens (``ya29.``), OpenAI-style ``sk-`` keys
#: (``sk-proj-``, ``sk-ant-``, ``sk-svcacct-``, ``sk-admin-``, or ``sk-`` and 20 letters and digits or more without a
#: dash: not ``sk-learn-pipeline-configuration``), Stripe secret and restricted keys and webhook secrets, GitLab
#: personal access tokens (``glpat-``), npm tokens, Hugging Face tokens (``hf_``), SendGrid keys (``SG.x.y``), Twilio
#: API key and account SIDs (``SK``, ``AC`` and 32 small hex digits: identifiers, redacted as AWS key ids are; a Twilio
#: secret has no shape to find), Mailgun keys (``key-`` and 32), Shopify access tokens and shared secrets (``shpat_``,
#: ``shpca_``, ``shpss_`` and 32; these four not followed by another letter or digit, so a longer hex value, a SHA-1
#: after ``key-``, is no key), JSON Web Tokens (``eyJ...`` header and payload, and the signature), PEM private keys
#: (``-----BEGIN ... PRIVATE KEY-----`` to its ``END`` line, 16 KB at most and whatever is between: quotes and ``\\n``
#: of string literals, ``> `` of a quoted email, ``<br>``; the search for an ``END`` stops at the next
#: ``-----BEGIN``, so each character is read for one ``BEGIN`` at most; where no ``END`` follows within 16 KB, the
#: base64 after it and each line after that ending in 16 base64 characters after at most 256 others, such as a log
#: line's prefix)
#: and an Azure shared access signature's ``sig=`` after ``?``, ``&`` or ``;`` (a SAS token without its URL). Each
#: not after a letter, digit, ``_`` or ``-``, but a PEM key, found after them too (a ``\\n`` written out before it in
#: JSON text ends in ``n``).
_KEY_SHAPE = re.compile(
    r"(?<![A-Za-z0-9_-])(?:(?:AKIA|ASIA)[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,}"
    r"|xox[abposr]-[A-Za-z0-9-]{10,}|xoxe[.-][A-Za-z0-9.-]{10,}|xapp-[A-Za-z0-9-]{10,}"
    r"|(?<=hooks\.slack\.com/services/)T[A-Z0-9]+/B[A-Z0-9]+/[A-Za-z0-9]+"
    r"|AIza[0-9A-Za-z_-]{35}|ya29\.[A-Za-z0-9_-]{20,}|sk-(?:proj|ant|svcacct|admin)-[A-Za-z0-9_-]{20,}"
    r"|sk-[A-Za-z0-9]{20,}|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}|whsec_[A-Za-z0-9]{24,}|glpat-[A-Za-z0-9_-]{20,}"
    r"|npm_[A-Za-z0-9]{36}|hf_[A-Za-z0-9]{30,}|SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}"
    r"|(?:SK|AC|key-|shp(?:at|ca|ss)_)[0-9a-f]{32}(?![0-9A-Za-z])"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
    r"|(?<=[?&;]sig=)[A-Za-z0-9%+/=]{20,})"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"(?:(?:(?!-----BEGIN )[\s\S]){0,16384}?-----END [A-Z ]*PRIVATE KEY-----"
    r"|[A-Za-z0-9+/=\s\\]*(?:[^\n]{0,256}[A-Za-z0-9+/=]{16}[ \t\r]*(?:\n|$))*)"
)
#: A Twilio account SID: an identifier that every webhook of the account carries (its auth token is the secret), kept
#: where a reviewer reads a body (:func:`_scrub_shapes` without ``account_ids``).
_ACCOUNT_SID = re.compile(r"AC[0-9a-f]{32}")
#: The known prefix a key of :data:`_KEY_SHAPE` starts with (not a JWT's, nor a webhook path's), before its random
#: part.
_KEY_PREFIX = re.compile(
    r"AKIA|ASIA|gh[pousr]_|github_pat_|xox[abposr]-|xoxe[.-]|xapp-|AIza|ya29\.|sk-(?:(?:proj|ant|svcacct|admin)-)?"
    r"|[sr]k_(?:live|test)_|whsec_|glpat-|npm_|hf_|SG\.|SK|AC|key-|shp(?:at|ca|ss)_"
)
#: A card number as written: 13 to 19 digits in one run, or in groups of 4 (the last of 3 on 19 digits; Amex's 4, 6
#: and 5) split by one space or one dash; not inside a longer run of letters, digits or ``_`` (a hex id, a git SHA),
#: nor after ``+`` (a phone number), nor in a path or a dotted number. Which numbers a card has: :data:`_CARD_NUMBER`.
_CARD_SHAPE = re.compile(
    r"(?<![\w+/.-])(?:\d{13,19}|\d{4}([ -])\d{4}\1\d{4}\1\d{4}(?:\1\d{3})?|\d{4}([ -])\d{6}\2\d{5})"
    r"(?![\w/-]|\.\d)"
)
#: Card numbers by issuer prefix and length: Visa (4; 13, 16 or 19 digits), Mastercard (51-55 or 2221-2720; 16),
#: American Express (34, 37; 15) and Discover (6011, 644-649, 65; 16 or 19).
_CARD_NUMBER = re.compile(
    r"4\d{12}(?:\d{3}){0,2}|(?:5[1-5]\d\d|222[1-9]|22[3-9]\d|2[3-6]\d\d|27[01]\d|2720)\d{12}|3[47]\d{13}"
    r"|(?:6011|64[4-9]\d|65\d\d)\d{12}(?:\d{3})?"
)
#: A URL: a scheme of 32 characters at most, or none where no letter starts one within 32 characters before ``://``
#: (a longer run before it, a hex digest's or digits', is read as no scheme: an unbounded one made each start in a
#: long run read to its end, seconds on 64 KB; the user and password after ``://`` are masked all the same), ``://``
#: and up to the next blank, quote, ``<``, ``>`` or backslash.
_URL_SHAPE = re.compile(r"(?:[A-Za-z][A-Za-z0-9+.-]{0,31})?://[^\s\"'<>\\]+")
#: A plain user name in a URL (``git``, ``app``, ``deploy``, ``john.doe``): letters, then letters, dots, ``_`` or
#: ``-``, 32 at most. Any other (digits, percent-encoding, a long run: ``ghtoken123``) may be a token, and is masked.
_PLAIN_USER = re.compile(r"[A-Za-z][A-Za-z._-]{0,31}")
#: One ``name=value`` parameter of a URL's query or fragment (``&``-separated, as a parser splits them), its value not
#: empty.
_URL_PARAM = re.compile(r"(?:^|(?<=&))([^&=]*)=([^&]+)")
#: Most parameters of a URL's query or fragment read for a credential's name (each name is matched against
#: :data:`SECRET_NAME`: 100,000 of them took seconds); the rest are masked unread.
_MAX_URL_PARAMS = 1_000
#: A secret in a connection string (``;``-separated ``name=value`` pairs: Azure Storage's and Service Bus's, ADO.NET's,
#: ODBC's; libpq's blank-separated ones): the value of ``AccountKey``, ``SharedAccessKey``, ``SharedAccessSignature``,
#: ``Password`` or ``Passwd`` (``Pwd`` after a ``;`` or at the start: ``PWD=/home/alice`` is a shell's directory),
#: blanks around the ``=`` or not (group 1, kept), and the value (group 2, masked): quoted (``"..."``, ``'...'``,
#: ODBC's ``{...}``) or not empty and up to the next ``;``, ``&``, quote, line end, or blank before another ``name=``
#: (a password may hold a blank: ``Password=S3cr3 tPass;``).
_CONNECTION_SECRET = re.compile(
    r"((?:(?<![A-Za-z0-9])(?:AccountKey|SharedAccessKey|SharedAccessSignature|Pass(?:word|wd))|(?:^|(?<=;))[ \t]*Pwd)"
    r"[ \t]*=[ \t]*)"
    r"(\"[^\"]*\"|'[^']*'|\{[^}]*\}|[^\s;\"'<>&]+(?:[ \t]+(?![\w.-]+[ \t]*=)[^\s;\"'<>&]+)*)",
    re.IGNORECASE,
)
#: An ``Authorization`` header written in text (a ``curl -H`` in a tool's arguments, an HTTP exchange pasted in a
#: message, a headers dict's JSON or repr, a list of header pairs' ``'authorization', b'Bearer ...'``;
#: ``Proxy-Authorization``, ``X-Authorization``, ``HTTP_AUTHORIZATION=``): the name, ``:`` or ``=`` (``,`` after a
#: quoted name), a scheme that carries one opaque credential, quotes (group 1, kept), and the credential (group 2,
#: masked where :data:`_NOT_A_WORD` tells it from a word).
_AUTHORIZATION_LINE = re.compile(
    r"(authorization(?:[\"']?[ \t]*[:=]|[\"'][ \t]*,)[ \t]*b?[\"']?"
    r"(?:bearer|basic|token|negotiate|apikey|api-key|sharedkey|dpop)[ \t]+[\"']?)([A-Za-z0-9._~+/-]{8,}=*)",
    re.IGNORECASE,
)
#: An ``Authorization`` header of a scheme that carries parameters (:data:`_PARAM_SCHEMES`) written in text, as
#: :data:`_AUTHORIZATION_LINE` finds one: the name to the scheme (group 1, kept) and the rest of its line (group 2),
#: where each secret parameter's value is masked (:data:`_AUTHORIZATION_PARAM`).
_AUTHORIZATION_PARAMS_LINE = re.compile(
    rf"(authorization(?:[\"']?[ \t]*[:=]|[\"'][ \t]*,)[ \t]*b?[\"']?(?:{_PARAM_SCHEMES})[ \t]+)([^\r\n]*)",
    re.IGNORECASE,
)
#: A secret parameter of such a header: Digest's ``response`` (a hash of the password), AWS Signature Version 4's
#: ``Signature``, Hawk's ``mac``, Rails' ``token``; the name, ``=`` and an opening quote (escaped or not: a headers
#: dict's JSON in a string; group 1, kept) and the value (group 2, masked). The rest (a user name, a realm, the
#: signed headers) stays; an AWS access key id in ``Credential`` is masked by its shape (:data:`_KEY_SHAPE`).
_AUTHORIZATION_PARAM = re.compile(
    r"((?<![\w-])(?:response|signature|mac|token)[ \t]*=[ \t]*\\?[\"']?)([^\s,;\"'\\]+)", re.IGNORECASE)
#: A header that carries a bare key written in text (``X-Api-Key``, ``Api-Key``, ``X-Goog-Api-Key``,
#: ``HTTP_X_API_KEY=``, ``X-Auth-Token``, ``X-Access-Token``; a list of header pairs' ``'x-api-key', b'...'``): the
#: name, ``:`` or ``=`` (``,`` after a quoted name) and quotes (group 1, kept), and the key (group 2, masked where
#: :data:`_NOT_A_WORD` tells it from a word).
_KEY_HEADER_LINE = re.compile(
    r"((?:api[-_]?key|auth[-_]?token|access[-_]?token)(?:[\"']?[ \t]*[:=]|[\"'][ \t]*,)[ \t]*b?[\"']?)"
    r"([A-Za-z0-9._~+/-]{8,}=*)",
    re.IGNORECASE,
)
#: What text holds, lower-cased, where :data:`_KEY_HEADER_LINE` may match.
_KEY_HEADER_WORDS = ("key", "token")
#: A ``Cookie`` or ``Set-Cookie`` header written in text (a ``curl -H``, a pasted exchange, a headers dict's JSON, a
#: list of header pairs' ``'cookie', b'sid=...'``): the name, ``:`` (``,`` after a quoted name) and quotes (group 1,
#: kept), and the value to the line's end or a quote (group 2), whose ``name=value`` pairs' values are masked
#: (:data:`_COOKIE_PAIR`).
_COOKIE_LINE = re.compile(
    r"((?:set-)?cookie(?:[\"']?[ \t]*:|[\"'][ \t]*,)[ \t]*b?[\"']?)([^\r\n\"']*)", re.IGNORECASE)
#: One ``name=value`` pair of a cookie header: the name and ``=`` (group 1, kept) and the value up to ``;`` (a value
#: may hold a comma; ``Set-Cookie`` lines folded with ``,`` are masked from the first value to the next ``;``).
_COOKIE_PAIR = re.compile(r"((?:^|;)[ \t]*([^=;,\s]+)[ \t]*=)([^;]*)")
#: ``Set-Cookie`` attributes whose values are kept (where they hold no ``=``, which a folded next cookie would).
_COOKIE_ATTRIBUTES = frozenset({"expires", "max-age", "domain", "path", "samesite", "priority"})
#: What text holds, lower-cased, where :data:`_CONNECTION_SECRET` may match.
_CONNECTION_SECRET_NAMES = ("accountkey", "sharedaccess", "passw", "pwd")


def _luhn(digits: str) -> bool:
    """Whether ``digits`` pass the Luhn check (every card number does)."""
    total = 0
    for i, char in enumerate(reversed(digits)):
        n = int(char) * (2 if i % 2 else 1)
        total += n - 9 if n > 9 else n
    return total % 10 == 0


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"[ -]", "", match.group())
    return "[redacted]" if _CARD_NUMBER.fullmatch(digits) and _luhn(digits) else match.group()


def _url(match: re.Match[str]) -> str:
    """The URL with its credentials replaced by ``[redacted]``: a password (``postgres://app:[redacted]@db``), a user
    name that is not a plain one (:data:`_PLAIN_USER`: ``https://[redacted]@github.com``, a token as the user), and
    the value of each credential-named query or fragment parameter (:func:`credential_name`, less ``code``: a
    promotion's as often as an OAuth code; ``?api_key=[redacted]&page=2``), the rest as it is;
    ``scheme://[hidden]`` where a password may hold a ``/``, ``?`` or ``#`` (:func:`~guard._urls.password_unclear`:
    where the host starts cannot be told)."""
    url = match.group()
    if password_unclear(url):
        return shown_url(url)
    scheme, _, rest = url.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    rest, hash_, fragment = rest[len(authority):].partition("#")
    path, mark, query = rest.partition("?")
    userinfo, at, host = authority.rpartition("@")
    user, _, password = userinfo.partition(":")
    if at and (password or not _PLAIN_USER.fullmatch(user)):
        userinfo = f"{user}:[redacted]" if _PLAIN_USER.fullmatch(user) else "[redacted]"
    return f"{scheme}://{userinfo}{at}{host}{path}{mark}{_masked_params(query)}{hash_}{_masked_params(fragment)}"


def _masked_params(text: str) -> str:
    """A URL's query or fragment with the value of each credential-named ``name=value`` parameter replaced by
    ``[redacted]`` (see :func:`_url`); after :data:`_MAX_URL_PARAMS` parameters, the rest is ``[redacted]`` unread."""

    def masked(pair: re.Match[str]) -> str:
        name = unquote_plus(pair.group(1))
        return f"{pair.group(1)}=[redacted]" if credential_name(name) and name.lower() != "code" else pair.group()

    if "=" not in text:
        return text
    params = text.split("&", _MAX_URL_PARAMS)  # the last one holds what is past the cap, if any
    rest = ""
    if len(params) > _MAX_URL_PARAMS:
        params.pop()
        rest = "&[redacted]"
    return _URL_PARAM.sub(masked, "&".join(params)) + rest


def _authorization(match: re.Match[str]) -> str:
    """An ``Authorization`` or API key header in text with its credential replaced by ``[redacted]`` (not a word:
    ``Authorization: Basic Reviewers``, ``X-Api-Key: required``)."""
    return f"{match.group(1)}[redacted]" if _NOT_A_WORD.search(match.group(2)) else match.group()


def _authorization_params(match: re.Match[str]) -> str:
    """An ``Authorization`` header of a parameter scheme in text with its secret parameters' values replaced by
    ``[redacted]`` (``Digest username="alice", response="[redacted]"``)."""
    return match.group(1) + _AUTHORIZATION_PARAM.sub(r"\1[redacted]", match.group(2))


def _cookie_pair(match: re.Match[str]) -> str:
    """A cookie's ``name=[redacted]``, or a ``Set-Cookie`` attribute as it is (``Path=/``)."""
    if match.group(2).lower() in _COOKIE_ATTRIBUTES and "=" not in match.group(3):
        return match.group()
    return f"{match.group(1)}[redacted]"


def _cookies(match: re.Match[str]) -> str:
    """A cookie header in text with each cookie's value replaced by ``[redacted]`` (``Cookie: sid=[redacted]``); a
    ``Set-Cookie`` attribute's value is kept (``Path=/``)."""
    return match.group(1) + _COOKIE_PAIR.sub(_cookie_pair, match.group(2))


def _scrub_shapes(text: str, *, cards: bool = True, account_ids: bool = True) -> str:
    """``text`` with the values a secret's shape gives away replaced by ``[redacted]``: keys by their known prefixes
    (:data:`_KEY_SHAPE`: ``AKIA``, ``ghp_``, ``xoxb-``, ``AIza``, ``sk-``, ``sk_live_``, ``glpat-``, a JWT, ...; a
    Slack webhook URL's path), a connection string's key or password (:data:`_CONNECTION_SECRET`:
    ``AccountKey=[redacted]``), an ``Authorization`` header's credential written in text
    (:data:`_AUTHORIZATION_LINE`: ``Authorization: Bearer [redacted]``; a Digest, AWS Signature Version 4 or Hawk
    header's secret parameters: :data:`_AUTHORIZATION_PARAMS_LINE`), an API key header's key
    (:data:`_KEY_HEADER_LINE`: ``X-Api-Key: [redacted]``) and a cookie header's cookies' values
    (:data:`_COOKIE_LINE`), a URL's password, token-shaped user name or credential-named parameter's value
    (:func:`_url`: ``https://app:[redacted]@host/?api_key=[redacted]&page=2``), and with ``cards``, card numbers
    (:data:`_CARD_SHAPE` of an issuer's prefix and length that pass the Luhn check). Without ``account_ids``, a
    Twilio account SID (:data:`_ACCOUNT_SID`) is kept."""
    text = _KEY_SHAPE.sub("[redacted]" if account_ids else _key_but_account_id, text)
    lowered = text.lower()
    if any(name in lowered for name in _CONNECTION_SECRET_NAMES):  # the pattern is slow to fail on long text
        text = _CONNECTION_SECRET.sub(r"\1[redacted]", text)
    if "authorization" in lowered:
        text = _AUTHORIZATION_LINE.sub(_authorization, text)
        text = _AUTHORIZATION_PARAMS_LINE.sub(_authorization_params, text)
    if any(word in lowered for word in _KEY_HEADER_WORDS):
        text = _KEY_HEADER_LINE.sub(_authorization, text)
    if "cookie" in lowered:
        text = _COOKIE_LINE.sub(_cookies, text)
    if cards:
        text = _CARD_SHAPE.sub(_card, text)
    return _URL_SHAPE.sub(_url, text) if "://" in text else text


def secret_shaped(text: str) -> bool:
    """Whether ``text`` holds a value a secret's shape gives away (:func:`_scrub_shapes` masks something in it) or
    reads as an ``Authorization`` value (:func:`credential_value`: ``Bearer <token>``)."""
    return credential_value(text) or _scrub_shapes(text) != text


def _key_but_account_id(key: re.Match[str]) -> str:
    """``[redacted]`` for a key :data:`_KEY_SHAPE` found, but a Twilio account SID (:data:`_ACCOUNT_SID`) as it is."""
    return key.group() if _ACCOUNT_SID.fullmatch(key.group()) else "[redacted]"


KEY_PLACEHOLDER = "[key]"
"""How the decision log writes a JSON pointer's reference token that is not a plain identifier (a client's key)."""


def _plain_tokens(scrub: Callable[[str], str]) -> Callable[[str], str]:
    """A pointer token rewriter: a plain identifier (:func:`~guard.subject.is_plain_key`: ``body``, ``0``,
    ``user_id``) through ``scrub``, any other token (a client's key that reads as text, ``"patient Jane Roe, SSN
    ..."``) as :data:`KEY_PLACEHOLDER`."""
    return lambda token: scrub(token) if is_plain_key(token) else KEY_PLACEHOLDER


def _rewrite_pointers(record: dict[str, Any], token: Callable[[str], str]) -> None:
    """Each reference token of the record's JSON pointers (``result.redactions[].pointer`` and ``erased``: they are
    made of the client's keys) replaced by ``token(it)``."""

    def rewrite(pointer: str) -> str:
        return "".join(f"/{escape_pointer(token(t))}" for t in split_pointer(pointer))

    result = record.get("result")
    for redaction in (result.get("redactions") or ()) if isinstance(result, dict) else ():
        redaction["pointer"] = rewrite(redaction["pointer"])
    if isinstance(record.get("erased"), list):
        record["erased"] = [rewrite(pointer) for pointer in record["erased"]]


#: Characters past the cut read with each half of a string longer than :data:`MAX_SCRUBBED_CHARS`, so that a secret
#: crossing the cut (a PEM private key: 16 KB at most) is read whole.
_CUT_OVERLAP = 32 * 1024


def _read_to_cut(text: str, cut: int, read: Callable[[str], str], *, head: bool) -> str:
    """``read(text[:cut])`` (``head``) or ``read(text[cut:])`` with a secret that crosses ``cut`` masked, never
    shown in part: the part is read with the :data:`_CUT_OVERLAP` characters past the cut, which are then dropped
    from what ``read`` returns. Where ``read`` changed them (a secret masked past or across the cut), the part is read
    alone too and kept as far as the two readings agree, the rest of it to the cut as one ``[redacted]``."""
    part = text[:cut] if head else text[cut:]
    overlap = text[cut:cut + _CUT_OVERLAP] if head else text[cut - _CUT_OVERLAP:cut]
    if head:
        read_with = read(part + overlap)
        if read_with.endswith(overlap):
            return read_with[:len(read_with) - len(overlap)]
        alone = read(part)
        same = len(os.path.commonprefix([read_with, alone]))
        return alone if same == len(alone) else f"{read_with[:same]}[redacted]"
    read_with = read(overlap + part)
    if read_with.startswith(overlap):
        return read_with[len(overlap):]
    alone = read(part)
    same = len(os.path.commonprefix([read_with[::-1], alone[::-1]]))  # the two readings' common end
    return alone if same == len(alone) else f"[redacted]{read_with[len(read_with) - same:]}"


def _scrub_record(record: dict[str, Any], values: list[str], *, shapes: bool = False, cards: bool = True,
                  keys: bool = False) -> None:
    """``values`` (and the bare keys inside ``Authorization``-style ones, and each as raw request text may spell it:
    :func:`_spellings`) replaced by ``[redacted]`` in the record's ``input``, ``state``, raw argument text and
    malformed call's problem, ``result.message``, ``error``, each ``policies[].error`` and each token of the
    pointers in ``result.redactions`` and ``erased``; values under 4 characters only when they are 3 digits (shorter
    ones would hit words); with ``shapes``, what :func:`_scrub_shapes` replaces too (card numbers only with
    ``cards``); with ``keys``, a pointer token that is not a plain identifier written as :data:`KEY_PLACEHOLDER`. Each
    string is read to :data:`MAX_SCRUBBED_CHARS`, its first and last halves (each with what is past its cut:
    :func:`_read_to_cut`), the middle cut (:data:`LOG_UNREAD_MARKER`). See :class:`Scrubber` for the cost."""
    values = secret_values(values)
    values += _spellings(values)
    if not values and not shapes:
        return
    by_value = Scrubber(values)

    def read(text: str) -> str:
        return _scrub_shapes(by_value(text), cards=cards) if shapes else by_value(text)

    def scrub(text: str) -> str:
        if len(text) <= MAX_SCRUBBED_CHARS:
            return read(text)
        half = MAX_SCRUBBED_CHARS // 2
        marker = LOG_UNREAD_MARKER.format(cut=len(text) - 2 * half)
        head = _read_to_cut(text, half, read, head=True)
        return f"{head}\n{marker}\n{_read_to_cut(text, len(text) - half, read, head=False)}"

    record["input"] = _scrub(record.get("input"), scrub)
    record["state"] = _scrub(record.get("state"), scrub)
    flags = record.get("flags")
    if isinstance(flags, dict):
        for name in (RAW_ARGUMENTS_FLAG, MALFORMED_FLAG):
            if isinstance(flags.get(name), str):
                flags[name] = scrub(flags[name])
    result = record.get("result")
    if isinstance(result, dict) and isinstance(result.get("message"), str):
        result["message"] = scrub(result["message"])
    if isinstance(record.get("error"), str):
        record["error"] = scrub(record["error"])
    for contribution in record.get("policies") or ():
        if isinstance(contribution.get("error"), str):
            contribution["error"] = scrub(contribution["error"])
    _rewrite_pointers(record, _plain_tokens(scrub) if keys else scrub)


def _contribution(verdict: Verdict) -> dict[str, Any]:
    """One matching policy's own verdict in a decision record (``policies``), with what a record of that policy alone
    says of where it came from (a shadow policy answering late is recorded alone): its text's digest and file, and
    the backend, model and revision that answered it."""
    return {
        "id": verdict.policy_id,
        "version": verdict.policy_version,
        "digest": verdict.policy_digest,
        "file": verdict.policy_file,
        "action": verdict.action,
        "rule": verdict.rule,
        "shadow_action": verdict.shadow_action,
        "status": verdict.status,
        "answers": {qid: dict(answer.probabilities) for qid, answer in verdict.answers.items()},
        "cache_hit": verdict.cache_hit,
        "backend": verdict.backend,
        "model": verdict.model,
        "revision": verdict.model_revision,
        "latency_ms": round(verdict.latency_ms, 3),
        "fail_mode": verdict.fail_mode,
        "error": verdict.error,
        "flags": _json_safe(verdict.flags),
    }


def redact_secrets(state: Any, subject: Subject | None = None, secrets: Iterable[str] = ()) -> Any:
    """A copy of ``state`` as ``log_input="redacted"`` writes it: secret-named fields (:data:`SECRET_NAME`) removed
    at any depth, and their values, those of the ``subject``'s secret-named fields (a query's ``api_key``, a body's
    ``password``, also inside JSON a text body or a value holds: what a ``request_text`` or ``body_text`` state
    repeats), ``secrets`` and values shaped like credentials (:func:`_scrub_shapes`: known key prefixes, URLs with
    credentials), replaced by ``[redacted]``. Numbers shaped like cards are kept: this is what a reviewer reads (a
    review item's state, a handoff's body), where order and tracking numbers share their shape; the decision log's
    ``redacted`` mode removes them."""
    hidden: list[str] = list(secrets)
    record = {"input": None if subject is None else _json_safe(subject, hidden=hidden),
              "state": _json_safe(state, hidden=hidden)}
    _redact_input(record, [], values=hidden, cards=False, keep_input=False)
    return record["state"]


REVIEW_RECORD_KIND = "review"
"""The ``kind`` of a decision log record written for a reviewer event (:meth:`DecisionLog.review`); a decision's
record has no ``kind``."""
HANDOFF_OUTCOME_RECORD_KIND = "handoff_outcome"
"""The ``kind`` of a decision log record saying how an agent's handoff to an LLM reviewer was settled
(:meth:`DecisionLog.handoff_outcome`)."""
REVIEW_EVENTS = ("approved", "rejected", "edited", "released")
"""What a :class:`ReviewEvent` says happened to an escalated decision."""
_review_logger = logging.getLogger("guard.review")


@dataclasses.dataclass(frozen=True)
class ReviewEvent:
    """What a person did with an escalated decision, as :func:`record_review` logs and records it.

    Attributes:
        event: one of :data:`REVIEW_EVENTS`: ``approved`` or ``rejected`` (the reviewers' API; an agent's resume),
            ``edited`` (an agent's resume; the edited call is judged again under a decision of its own), ``released``
            (an approved HTTP request replayed to the application).
        decision_id: the escalating verdict's decision id (its ``escalate`` record has the same).
        review_id: the review item's id (HTTP: ``rv_...``) or the pending item's (agents: ``gp_...``).
        reviewer: who decided: the reviewer token's name; for ``released``, who approved it; ``None`` where guard
            is not told (an agent's resume carries no identity).
        tenant: the held request's tenant, or ``None``.
        policy_id: the policy that escalated; ``policy_version`` its version.
        note: the reviewer's note (an agent's reject message); only its SHA-256 is recorded.
        accept_unseen_body: for an HTTP approval, whether the reviewer accepted a held body not shown in full
            (``None`` for the other events).

    Raises:
        ValueError: ``event`` is not one of :data:`REVIEW_EVENTS`.
    """

    event: str
    decision_id: str
    review_id: str
    reviewer: str | None
    tenant: str | None = None
    policy_id: str | None = None
    policy_version: str | None = None
    note: str | None = None
    accept_unseen_body: bool | None = None

    def __post_init__(self) -> None:
        if self.event not in REVIEW_EVENTS:
            raise ValueError(f"review event {self.event!r} is not one of {REVIEW_EVENTS}")


def record_review(decision_log: DecisionLog | None, event: ReviewEvent) -> None:
    """Log ``event`` at INFO (logger ``guard.review``, without the note) and write its record to ``decision_log``
    (:meth:`DecisionLog.review`; none written when it is ``None``)."""
    _review_logger.info("review item %s %s (reviewer %s, decision %s, policy %s)", event.review_id, event.event,
                        event.reviewer, event.decision_id, event.policy_id)
    if decision_log is not None:
        decision_log.review(event)


#: Most characters of lines a :class:`DecisionLog` holds for its writer thread (``queue_chars``), the line being
#: written included; a line past them is dropped (one line longer than that alone is taken).
QUEUE_CHARS = 16 * 1024 * 1024
#: Seconds between two error log lines of one kind about a decision log's sink (``does not keep up``, ``write
#: failed``); each says how many were not logged since the one before.
ERROR_LOG_INTERVAL_S = 10.0


#: What the writer thread's queue holds to ask it to open the log's path again (no record's line is empty).
_REOPEN = ""


#: The mode a decision log file is created with (less the umask): its records hold requests' input and state, so
#: other users may not read it; a file that exists keeps its mode.
LOG_FILE_MODE = 0o640


def open_log_path(path: str | Path) -> IO[str]:
    """``path`` opened to append UTF-8 lines (created if missing, as :data:`LOG_FILE_MODE`), line-buffered. A FIFO
    is opened without waiting for a reader (``O_NONBLOCK``, cleared once it is open), where a plain open blocks until
    one comes. A symbolic link at ``path`` is not followed to a file (``O_NOFOLLOW``): one placed there would have
    the records written into whatever file it names; it is followed only to a stream (:func:`_opened_through_link`:
    ``/dev/stdout`` in a container).

    Raises:
        OSError: as ``open`` does; ``ENXIO`` for a FIFO no process has open for reading; ``ELOOP`` ("is a symbolic
            link", naming ``path``) for a link to a file or to nothing.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, LOG_FILE_MODE)
    except OSError as exc:
        if exc.errno != errno.ELOOP or not os.path.islink(path):
            raise
        fd = _opened_through_link(path, flags)
    try:
        os.set_blocking(fd, True)  # a full pipe blocks the writer thread, as its queue expects
        return open(fd, "a", encoding="utf-8", buffering=1)  # the log closes it
    except BaseException:
        os.close(fd)
        raise


def _opened_through_link(path: str | Path, flags: int) -> int:
    """The descriptor of what the symbolic link ``path`` leads to, opened with ``flags`` (never created) where it is
    a stream, which keeps no file: a pipe, a FIFO or a character device (a terminal, ``/dev/null``); or where it is
    the file this process's stdout or stderr writes already (``--decision-log /dev/stdout``, whose link is
    ``/proc/self/fd/1``, with the output sent to a file). What the opened descriptor is gets checked, not the path, so
    a link changed between a check and the open cannot have another file written.

    Raises:
        OSError: ``ELOOP`` ("is a symbolic link") for a link to another file (a regular file, a block device) or to
            nothing; as ``open`` does otherwise.
    """
    refused = OSError(errno.ELOOP, "is a symbolic link (the decision log follows one only to a pipe, a terminal or the "
                      "process's stdout or stderr)", str(path))
    try:
        fd = os.open(path, flags | os.O_NOCTTY)
    except FileNotFoundError:
        raise refused from None
    opened = os.fstat(fd)
    if stat.S_ISFIFO(opened.st_mode) or stat.S_ISCHR(opened.st_mode):
        return fd
    for standard in (1, 2):
        with contextlib.suppress(OSError):  # closed
            if os.path.samestat(opened, os.fstat(standard)):
                return fd
    os.close(fd)
    raise refused


class DecisionLog:
    """JSON-lines decision records (OPA ``EventV1``-like), with fields removed before they are written.

    Args:
        sink: a path (appended to), a text stream, or a callable taking one line (without the newline).
        redact: JSON pointers into the record to remove, e.g. ``/input/body/password``, ``/state/*/email``;
            :data:`DEFAULT_REDACT` by default. Removed pointers are listed in the record's ``erased``.
        include_input: write the subject (original, un-normalised text) as ``input``; without it the subject's
            secret values are still scrubbed from ``state`` as ``log_input`` says.
        log_input: ``"redacted"`` (default), ``"none"`` or ``"full"`` (:data:`LOG_INPUT_MODES`).
        labels: static labels (e.g. service, region) copied into every record.
        logged_headers: with ``log_input="redacted"``, the request headers whose values ``input`` keeps
            (lower-case names; default :data:`LOGGED_HEADERS`); add the ones your audits read.
        max_chars: most characters of each string and object key of ``input`` and ``state``
            (:data:`MAX_LOGGED_CHARS` by default); a longer one keeps its first and last halves around
            :data:`LOG_CUT_MARKER`, which gives its length. Raise it above a policy's largest ``max_chars`` to log
            all of what that policy's model read.
        background: write lines from a thread of the log's own, which takes them through a queue of at most
            ``queue_chars`` characters, so a sink that blocks (a FIFO nobody reads, a stalled disk or producer) never
            holds a decision; a line the queue has no room for is dropped. ``None`` (default): for a path, not for a
            stream or callable (written to where the decision is recorded: under ``Guard.aevaluate`` on the event loop,
            a large request's record too, which is built on a worker thread; pass ``True`` when it may block).
        queue_chars: most characters the queue holds (:data:`QUEUE_CHARS` by default).
        meter_provider: where ``guard.decision_log.dropped`` (records dropped, by ``reason``:
            ``queue_full``, ``sink_error``, ``unbuildable``, ``shutdown``) is counted; ``None`` = the global one.

    Raises:
        ValueError: for a pointer that does not start with ``/``, an unknown ``log_input``, or a ``max_chars``
            under 1.
        TypeError: for a ``max_chars`` that is not an ``int`` (a ``bool`` or a ``float`` included).
    """

    #: The pointers removed by default; extend with ``redact=(*DecisionLog.DEFAULT_REDACT, ...)``.
    DEFAULT_REDACT = DEFAULT_REDACT

    def __init__(
        self,
        sink: str | Path | IO[str] | Callable[[str], None],
        *,
        redact: Sequence[str] = DEFAULT_REDACT,
        include_input: bool = True,
        labels: dict[str, str] | None = None,
        log_input: str = "redacted",
        logged_headers: Collection[str] = LOGGED_HEADERS,
        max_chars: int = MAX_LOGGED_CHARS,
        background: bool | None = None,
        queue_chars: int = QUEUE_CHARS,
        meter_provider: Any = None,
    ) -> None:
        if log_input not in LOG_INPUT_MODES:
            raise ValueError(f"log_input is {log_input!r}; it must be one of {LOG_INPUT_MODES}")
        if isinstance(max_chars, bool) or not isinstance(max_chars, int):
            raise TypeError(f"max_chars is {max_chars!r}; it must be an int (a number of characters), at least 1")
        if max_chars < 1:
            raise ValueError(f"max_chars is {max_chars!r}; it must be an int (a number of characters), at least 1")
        self.max_chars = max_chars
        self.log_input = log_input
        self.logged_headers = frozenset(name.lower() for name in logged_headers)
        self._redact = [(p, _split(p)) for p in redact]
        self.include_input = include_input
        self.labels = {"app": "guard", "version": __version__, **(labels or {})}
        self.dropped = 0
        self._dropped = metrics.get_meter("guard", __version__, meter_provider=meter_provider).create_counter(
            "guard.decision_log.dropped", unit="{record}", description="Decision log records dropped, by reason."
        )
        self._lock = threading.Lock()  # one write at a time to the sink
        self._count_lock = threading.Lock()
        self._queue_full_log = LogEvery(ERROR_LOG_INTERVAL_S)
        self._sink_error_log = LogEvery(ERROR_LOG_INTERVAL_S)
        self._gave_up = threading.Event()  # close() stopped waiting: lines the writer gets from then on are dropped
        self._file: IO[str] | None = None
        self._stream: IO[str] | None = None
        self._callback: Callable[[str], None] | None = None
        self._path = sink if isinstance(sink, (str, Path)) else None
        if self._path is not None:
            self._file = self._stream = open_log_path(self._path)
        elif callable(sink):
            self._callback = sink
        else:
            self._stream = sink
        self._queue: queue.SimpleQueue[str | None] | None = None
        self._writer: threading.Thread | None = None
        self._queue_chars = queue_chars
        self._queued_chars = 0  # of the lines queued and the one being written
        self._background = background if background is not None else self._file is not None
        if self._background:
            self._queue = queue.SimpleQueue()  # its put is reentrant: reopen() may run in a signal handler
            self._writer = threading.Thread(target=self._write_queued, args=(self._queue, self._stream, self._file),
                                            daemon=True, name="guard-decision-log")
            self._writer.start()

    def _write(self, line: str, stream: IO[str] | None) -> None:
        """Write ``line`` to the callable sink, else to ``stream``."""
        if self._callback is not None:
            self._callback(line)
        elif stream is not None:
            stream.write(line + "\n")
        else:
            raise ValueError("the decision log is closed")

    def event(self, verdict: Verdict, subject: Subject | None, *, cache: str | None = None,
              span: Span | None = None) -> dict[str, Any]:
        """Build the redacted record for one decision (not written); ``span`` gives the trace and span ids (``None``
        = the current span: a caller's recording span when guard started none)."""
        hidden: list[str] = []  # secret values in parts nested too deep to keep
        record: dict[str, Any] = {
            "decision_id": verdict.decision_id,
            "timestamp": _utc_now(),
            "labels": dict(self.labels),
            "policy": {"id": verdict.policy_id, "version": verdict.policy_version, "digest": verdict.policy_digest,
                       "file": verdict.policy_file},
            # built even when it is not written: its secret values are scrubbed from the state
            "input": _input_json(subject, verdict, hidden) if subject is not None and self.log_input != "none" else None,
            "state": _json_safe(verdict.state, hidden=hidden),
            "result": {
                "action": verdict.action,
                "rule": verdict.rule,
                "status": verdict.status,
                "message": verdict.message,
                "handoff": verdict.handoff,
                "retry_after": verdict.retry_after,
                "shadow_action": verdict.shadow_action,
                "redactions": [r.to_json() for r in verdict.redactions],
            },
            "phase": verdict.phase,
            "answers": {qid: dict(answer.probabilities) for qid, answer in verdict.answers.items()},
            "cache_hit": verdict.cache_hit,
            "cache": cache,
            "backend": verdict.backend,
            "model": verdict.model,
            "revision": verdict.model_revision,
            "metrics": {"latency_ms": round(verdict.latency_ms, 3)},
            "fail_mode": verdict.fail_mode,
            "error": verdict.error,
            "flags": _json_safe(verdict.flags),
            "trace_id": None,
            "span_id": None,
        }
        if verdict.contributions:  # several policies matched: each one's part, in match order
            record["policies"] = [_contribution(c) for c in verdict.contributions]
        context = (span if span is not None else trace.get_current_span()).get_span_context()
        if context.is_valid:
            record["trace_id"] = format(context.trace_id, "032x")
            record["span_id"] = format(context.span_id, "016x")
        erased: list[str] = []
        record["erased"] = erased  # rewritten where the pointers' tokens are
        removed: list[str] = []
        for _, tokens in self._redact:
            _erase(record, tokens, "", erased, removed)
        if self.log_input == "redacted":
            _redact_input(record, erased, self.logged_headers, removed + hidden)
        elif self.log_input == "full":
            _scrub_record(record, removed)  # what the pointers removed (the credential headers) repeated elsewhere
        else:
            record["input"] = record["state"] = None
            if verdict.message_from_input:  # ``rule`` names the refusal
                record["result"]["message"] = None
            for name in (RAW_ARGUMENTS_FLAG, MALFORMED_FLAG):
                if isinstance(record["flags"], dict) and name in record["flags"]:
                    record["flags"][name] = None
            _rewrite_pointers(record, _plain_tokens(_scrub_shapes))
            # an error can quote a key (a reviewer's answer, an endpoint's URL): masked by its shape, as redacted does
            for part in (record, *(record.get("policies") or ())):
                if isinstance(part.get("error"), str):
                    part["error"] = _scrub_shapes(part["error"])
        if not self.include_input:
            record["input"] = None
            record["erased"] = [pointer for pointer in record["erased"] if not pointer.startswith("/input/")]
        # cut once redacted: a secret value cut in two would no longer be found and replaced
        record["input"] = _bounded(record["input"], self.max_chars)
        record["state"] = _bounded(record["state"], self.max_chars)
        return record

    def record(self, verdict: Verdict, subject: Subject | None, **kwargs: Any) -> dict[str, Any]:
        """Build and write the record for one decision (:meth:`build`, then :meth:`append`); a record that cannot
        be built (returned as ``{}``) or a failing sink drops it (counted in ``dropped``, logged), never the
        decision."""
        event, line = self.build(verdict, subject, **kwargs)
        if line is not None:
            self.append(line)
        return event

    def build(self, verdict: Verdict, subject: Subject | None, **kwargs: Any) -> tuple[dict[str, Any], str | None]:
        """The record for one decision and its JSON line, not written (:meth:`append` writes it): safe on a worker
        thread, as it touches no sink. A record that cannot be built is dropped (counted in ``dropped``, logged)
        and returned as ``({}, None)``."""
        try:
            event = self.event(verdict, subject, **kwargs)
            return event, _json_line(event)
        except Exception as exc:  # noqa: BLE001 - whatever the subject held, the decision stands
            # the type only: an exception's text may quote the input the record was being redacted from
            logger.error("decision log record could not be built (%d dropped): %s", self._drop("unbuildable"),
                         type(exc).__name__)
            return {}, None

    def append(self, line: str) -> None:
        """Write one line :meth:`build` made, as :meth:`record` does (to the writer thread's queue, or to the sink
        from the calling thread)."""
        self._append(line)

    def review(self, event: ReviewEvent) -> dict[str, Any]:
        """Build and write the record of one reviewer event (:data:`REVIEW_RECORD_KIND`: ``kind``, ``event``,
        ``decision_id``, ``review_id``, ``reviewer``, ``tenant``, ``policy``, ``accept_unseen_body``,
        ``note_sha256``, ``timestamp``, ``labels``, ``trace_id``/``span_id``); returned as written. A failing sink
        drops it (counted in ``dropped``, logged), never the review."""
        record: dict[str, Any] = {
            "kind": REVIEW_RECORD_KIND,
            "event": event.event,
            "decision_id": event.decision_id,
            "review_id": event.review_id,
            "timestamp": _utc_now(),
            "labels": dict(self.labels),
            "reviewer": event.reviewer,
            "tenant": event.tenant,
            "policy": {"id": event.policy_id, "version": event.policy_version},
            "accept_unseen_body": event.accept_unseen_body,
            # the note is the reviewer's free text (it may quote the held request): its digest only
            "note_sha256": hashlib.sha256(event.note.encode("utf-8", "surrogatepass")).hexdigest()
            if event.note is not None else None,
            "trace_id": None,
            "span_id": None,
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record["trace_id"] = format(context.trace_id, "032x")
            record["span_id"] = format(context.span_id, "016x")
        self._append(_json_line(record))
        return record

    def handoff_outcome(self, verdict: Verdict, outcome: HandoffOutcome) -> dict[str, Any]:
        """Build and write the record of how a handoff was settled (:data:`HANDOFF_OUTCOME_RECORD_KIND`: ``kind``,
        ``decision_id`` (the handoff's), ``outcome`` (:data:`HandoffOutcome`), ``action`` (what was done),
        ``fail_mode`` and ``error`` (``failed``: why, and which fail mode decided), ``policy``, ``timestamp``,
        ``labels``); returned as written. The handoff's input and state are in its own record, not repeated. Under
        ``log_input`` ``"redacted"`` and ``"none"`` values shaped like secrets are scrubbed from ``error`` as from a
        decision record's (a reviewer's URL with ``?api-key=``, a key its error quotes). A failing sink drops it
        (counted in ``dropped``, logged)."""
        record: dict[str, Any] = {
            "kind": HANDOFF_OUTCOME_RECORD_KIND,
            "decision_id": verdict.decision_id,
            "timestamp": _utc_now(),
            "labels": dict(self.labels),
            "policy": {"id": verdict.policy_id, "version": verdict.policy_version},
            "outcome": outcome,
            "action": verdict.action,
            "fail_mode": verdict.fail_mode,
            "error": verdict.error,
        }
        if self.log_input != "full" and verdict.error is not None:
            record["error"] = _scrub_shapes(verdict.error)
        self._append(_json_line(record))
        return record

    def _append(self, line: str) -> None:
        """Hand one record's line to the writer thread, or write it here without one; a full queue or a failing sink
        drops it (counted in ``dropped`` and ``guard.decision_log.dropped``, logged)."""
        if self._queue is None:
            if self._background:  # closed: its sink is the writer thread's
                self._drop("shutdown")
            else:
                self._write_or_drop(line, None)  # the stream read under the lock: reopen() swaps it there
            return
        with self._count_lock:
            room = not self._queued_chars or self._queued_chars + len(line) <= self._queue_chars
            if room:
                self._queued_chars += len(line)
        if room:
            self._queue.put_nowait(line)
            return
        count = self._drop("queue_full")
        held = self._queue_full_log.due()
        if held is not None:  # one line per ERROR_LOG_INTERVAL_S: the log must not flood the process's own
            logger.error("decision log sink does not keep up (%d characters queued): records are dropped (%d "
                         "dropped; %d such errors not logged since the last)", self._queued_chars, count, held)

    def _write_or_drop(self, line: str, stream: IO[str] | None) -> None:
        """Write ``line`` to ``stream`` (``None``: the log's own, read under the lock) or the callable sink; a
        failing sink drops it."""
        try:
            with self._lock:
                self._write(line, stream if stream is not None else self._stream)
        except Exception as exc:  # noqa: BLE001 - whatever the sink raises, the decision stands
            count = self._drop("sink_error")
            held = self._sink_error_log.due()
            if held is not None:  # the type only: a sink's exception text may quote the line
                logger.error("decision log write failed (%d dropped; %d such errors not logged since the last): %s",
                             count, held, type(exc).__name__)

    def _drop(self, reason: str, count: int = 1) -> int:
        """Count ``count`` records dropped for ``reason``; returns ``dropped``."""
        with self._count_lock:
            self.dropped += count
            dropped = self.dropped
        self._dropped.add(count, {"reason": reason})
        return dropped

    def _write_queued(self, lines: queue.SimpleQueue[str | None], stream: IO[str] | None, file: IO[str] | None) -> None:
        """The writer thread: write ``lines`` to ``stream`` (or the callable sink) until ``None``, then close
        ``file``, the one this log opened (a sink that broke already counted the line it failed on); at
        :data:`_REOPEN`, open the path again (:meth:`reopen`). Once :meth:`close` stopped waiting, a line taken is
        dropped as ``shutdown``."""
        while (line := lines.get()) is not None:
            if line == _REOPEN:
                if file is not None and self._path is not None:
                    file = stream = self._reopened(self._path, file)
                continue
            if self._gave_up.is_set():
                self._drop("shutdown")
            else:
                self._write_or_drop(line, stream)
            with self._count_lock:
                self._queued_chars -= len(line)
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()

    def reopen(self) -> None:
        """Open the log's path again and close the file it wrote to (``kill -HUP`` on ``guard proxy`` after
        logrotate moved the file). With a writer thread it is done there, after the lines queued before, so no line is
        written to the old file after it; without one, here. A path that cannot be opened (a FIFO with no reader
        now) is logged and the old file kept. A log given a stream or a callable has nothing to reopen."""
        if self._path is None:
            return
        if self._queue is not None:
            self._queue.put_nowait(_REOPEN)
        elif not self._background and self._file is not None:
            with self._lock:
                self._file = self._stream = self._reopened(self._path, self._file)

    @staticmethod
    def _reopened(path: str | Path, file: IO[str]) -> IO[str]:
        """``path`` opened again, ``file`` closed; ``file`` itself when ``path`` cannot be opened (logged)."""
        try:
            opened = open_log_path(path)
        except OSError as exc:
            logger.error("decision log %s could not be opened again (%s); still writing to the file open before",
                         path, exc.strerror or type(exc).__name__)
            return file
        with contextlib.suppress(OSError):
            file.close()
        return opened

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write the lines still queued, waiting at most ``timeout`` seconds, and close the file this log opened
        (streams and callables given to it are left alone). Lines the writer thread has not written by then are
        dropped (counted as ``shutdown``, logged); it finishes the line it is writing, if its sink ever takes it,
        then closes the file, else ends with the process. A log that had a writer thread drops the records made
        once it is closed."""
        writer, lines = self._writer, self._queue
        self._writer = self._queue = None
        if writer is None or lines is None:
            if self._file is not None:
                self._file.close()
            self._file = self._stream = None
            return
        lines.put_nowait(None)
        writer.join(timeout)
        self._file = self._stream = None  # the writer thread still holds its own
        if not writer.is_alive():
            return
        self._gave_up.set()
        left = 0
        with contextlib.suppress(queue.Empty):
            while (line := lines.get_nowait()) is not None:
                left += line != _REOPEN
        lines.put_nowait(None)  # the writer's end, once its sink takes the line it is writing
        logger.warning("decision log sink had not taken every record %g s after close; %d records not written (%d "
                       "dropped)", timeout, left, self._drop("shutdown", left) if left else self.dropped)
