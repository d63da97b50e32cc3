"""What differs between System One servers (rounding, confidence formula, endpoints), the retry policy, and the
small parsers of their HTTP answers (``Retry-After``, the summary of an error answer). Used by :mod:`guard.backends.http`."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Literal

import httpx

from guard._json import loads
from guard.errors import InvalidJson
from guard.systemone import ConfidenceProfile

__all__ = [
    "DEFAULT_HTTP_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_KEEPALIVE",
    "ERROR_BODY_BYTES",
    "JEV_URL",
    "MODEL_NOT_FOUND",
    "MODEL_REVISION_HEADER",
    "OPENROUTER_URL",
    "PROVIDERS",
    "RETRY_STATUSES",
    "SYSTEMONE_PATH",
    "TIMEOUT_HEADER",
    "WORKERS_AI_URL",
    "Provider",
    "ProviderName",
    "RetryConfig",
    "error_body",
    "error_code",
    "error_summary",
    "parse_retry_after",
]

ProviderName = Literal["systemone", "worker", "workers-ai", "jev", "openrouter"]

#: Overall deadline of one ``decide`` when neither the call nor the client sets one.
DEFAULT_HTTP_TIMEOUT_S = 10.0
#: Endpoints (spec §5.1).
WORKERS_AI_URL = "https://api.cloudflare.com/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/{model}"
JEV_URL = "https://api.typesafe.ai/v1/systemone"
OPENROUTER_URL = "https://openrouter.ai/api/alpha/decisions"
SYSTEMONE_PATH = "/v1/systemone"
#: Header telling our worker how long we will wait (milliseconds).
TIMEOUT_HEADER = "x-request-timeout-ms"
#: Response header in which our worker names the checkpoint revision that answered.
MODEL_REVISION_HEADER = "x-guard-model-revision"
#: The error code our worker answers (404) for a model name it does not serve.
MODEL_NOT_FOUND = "model_not_found"
#: Statuses worth retrying: request timeout, too many requests, and every 5xx.
RETRY_STATUSES = frozenset({408, 429})
DEFAULT_MAX_CONNECTIONS = 100
DEFAULT_MAX_KEEPALIVE = 20
#: Most bytes of an error answer (a status other than 2xx) read: its code and field tokens sit at its head, and
#: parsing it holds the event loop, so the read is capped where a body still parses in milliseconds
#: (``docs/benchmarks.md``).
ERROR_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class RetryConfig:
    """Retries of one ``decide``, all inside its deadline.

    Attributes:
        max_attempts: attempts in all (1 disables retries).
        initial_backoff_s: first backoff; each retry doubles it (random jitter up to that bound).
        max_backoff_s: longest backoff when the server sent no ``Retry-After``.

    Raises:
        ValueError: naming the field and the allowed range.
    """

    max_attempts: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"RetryConfig.max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        for name in ("initial_backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"RetryConfig.{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True)
class Provider:
    """What differs between System One servers.

    Attributes:
        name: preset name.
        decimals: the provider's rounding of probabilities (sets the sum tolerance, spec §7 pitfall 2).
        confidence_profile: the provider's ``confidence`` formula (used only when an answer omits it, §4.1).
        sends_deadline: send ``x-request-timeout-ms`` (our worker drops work we gave up on).
        continues_trace: send the decision span's trace context (W3C ``traceparent``, no baggage), which guard's
            worker continues; a third-party API gets none of the app's tracing headers.
    """

    name: ProviderName
    decimals: int
    confidence_profile: ConfidenceProfile
    sends_deadline: bool = False
    continues_trace: bool = False


#: The presets (spec §4.1, §5.1, §5.5).
PROVIDERS: dict[str, Provider] = {
    "systemone": Provider("systemone", 4, "reference", sends_deadline=True, continues_trace=True),
    "worker": Provider("worker", 4, "reference", sends_deadline=True, continues_trace=True),
    "workers-ai": Provider("workers-ai", 4, "workers-ai"),
    "jev": Provider("jev", 2, "jev"),
    "openrouter": Provider("openrouter", 2, "workers-ai"),
}


def parse_retry_after(headers: httpx.Headers, *, now: float | None = None) -> float | None:
    """Seconds to wait from ``Retry-After`` (delta-seconds or an HTTP date, RFC 9110 §10.2.3) or ``retry-after-ms``.

    Returns:
        Seconds >= 0, or ``None`` when absent or unreadable.
    """
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            value = float(raw_ms) / 1000.0
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return value
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        seconds = float(raw)
    except ValueError:
        try:
            when = parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


#: What an error answer's summary keeps of a JSON member: a short token (a code, a type, a field path) or an integer;
#: free text (a message, a value) can repeat the request and is never kept.
_TOKEN = re.compile(r"[A-Za-z0-9_.:\[\]-]{1,64}")
#: Most entries of an ``errors`` or ``detail`` list, and steps of a ``loc`` path, kept.
_MAX_KEPT_ITEMS = 10
#: A media type (``type/subtype``, RFC 9110 token characters), without its parameters.
_MEDIA_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]{1,64}/[A-Za-z0-9!#$&^_.+-]{1,64}")


def _is_token(value: Any) -> bool:
    """Whether ``value`` is an integer or a :data:`_TOKEN` string."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, str) and _TOKEN.fullmatch(value) is not None)


def _tokens(error: Mapping[str, Any]) -> dict[str, Any]:
    """The members of one error object that name a kind or a place: ``code`` and ``type`` (ours, OpenAI's,
    Cloudflare's, pydantic's) and ``field`` (guard's worker) when they are tokens, and pydantic's ``loc`` path (its
    first :data:`_MAX_KEPT_ITEMS` steps, a step that is no token as ``"?"``)."""
    kept = {name: error[name] for name in ("code", "type", "field") if _is_token(error.get(name))}
    loc = error.get("loc")
    if isinstance(loc, list) and loc:
        kept["loc"] = [step if _is_token(step) else "?" for step in loc[:_MAX_KEPT_ITEMS]]
    return kept


def error_body(response: httpx.Response) -> Any:
    """An error answer's body parsed as JSON (a client reads at most :data:`ERROR_BODY_BYTES` of it), or ``None``
    when it is not JSON (a body cut there is not)."""
    try:
        return loads(response.content)
    except InvalidJson:
        return None


def error_summary(response: httpx.Response, body: Any) -> dict[str, Any]:
    """What can be told of an error answer without repeating the request, which a backend's error text may quote in
    any shape (plain text, HTML, a message, a pydantic ``input`` or ``value``): nothing the remote wrote as free text.

    Args:
        response: the answer (its status, ``Content-Type`` and length are read).
        body: its body as parsed once (:func:`error_body`, or an envelope), ``None`` when it is not JSON.

    Returns:
        ``{"status", "media_type", "length"}`` (the HTTP status, the ``Content-Type`` without parameters or ``None``
        when absent or not a media type, the length in bytes of the body as read), and from a JSON object body the
        tokens of its ``code``/``type``/``field``/``loc`` members (:data:`_TOKEN`: at most 64 characters of letters,
        digits and ``_.:[]-``; integers), of its ``error`` object's (OpenAI, OpenRouter) as ``"error"``, and of each
        of the first 10 objects of its ``errors`` (Cloudflare, guard's worker) and ``detail`` (FastAPI) lists under
        those names.
    """
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    summary: dict[str, Any] = {
        "status": response.status_code,
        "media_type": media if _MEDIA_TYPE.fullmatch(media) else None,
        "length": len(response.content),
    }
    if not isinstance(body, Mapping):
        return summary
    summary.update(_tokens(body))
    if isinstance(body.get("error"), Mapping) and (error := _tokens(body["error"])):
        summary["error"] = error
    for name in ("errors", "detail"):
        if isinstance(body.get(name), list):
            errors = [_tokens(item) for item in body[name][:_MAX_KEPT_ITEMS] if isinstance(item, Mapping)]
            if any(errors):
                summary[name] = errors
    return summary


def error_code(summary: Mapping[str, Any]) -> str | int | None:
    """The error code an :func:`error_summary` holds (a token, safe to show): the answer's own ``code`` (guard's
    worker), else its ``error`` object's (OpenAI, OpenRouter), else the first of its ``errors`` entries' (Cloudflare);
    ``None`` when it has none."""
    for found in (summary, summary.get("error") or {}, *summary.get("errors", ())):
        if "code" in found:
            code: str | int = found["code"]
            return code
    return None
