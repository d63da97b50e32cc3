"""What differs between System One servers (rounding, confidence formula, endpoints), the retry policy, and the
small parsers of their HTTP answers (``Retry-After``, error messages). Used by :mod:`guard.backends.http`."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Literal

import httpx

from guard.systemone import ConfidenceProfile

__all__ = [
    "DEFAULT_HTTP_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_KEEPALIVE",
    "JEV_URL",
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
    "error_message",
    "parse_retry_after",
    "snippet",
    "without_echo",
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
#: Statuses worth retrying: request timeout, too many requests, and every 5xx.
RETRY_STATUSES = frozenset({408, 429})
DEFAULT_MAX_CONNECTIONS = 100
DEFAULT_MAX_KEEPALIVE = 20
_SNIPPET = 200


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


def snippet(response: httpx.Response) -> str:
    """The start of an error response's body on one line, for error messages (at most ``_SNIPPET`` characters)."""
    text = response.text.strip().replace("\n", " ")
    return text[:_SNIPPET] + ("..." if len(text) > _SNIPPET else "")


#: Members of a pydantic-style error (one with ``loc`` and ``msg``) that repeat what was refused: ``input`` is the
#: value itself (the request's state), ``ctx`` may quote it (``{"error": "ValueError('... <value>')"}``).
_ECHOED = frozenset({"input", "ctx"})


def without_echo(detail: Any) -> Any:
    """A provider's parsed error body without the request it repeats: the ``input`` and ``ctx`` members of each
    FastAPI/pydantic-style error (at any depth) and FastAPI's documented ``body`` (the whole request) left out, every
    other string cut to :data:`_SNIPPET` characters (a message that quotes the value keeps at most that much of it).

    The request's state is never cut down instead: secret-named fields stay in it, since the model must read them (an
    injection can sit in a field named ``password``); only what a backend repeats of it is kept out of logs and errors.
    """
    if isinstance(detail, Mapping):
        echoed = _ECHOED if "loc" in detail and "msg" in detail else frozenset()
        if "detail" in detail:  # FastAPI's errors, beside which its documented handler puts the request as "body"
            echoed |= {"body"}
        return {key: without_echo(value) for key, value in detail.items() if key not in echoed}
    if isinstance(detail, list):
        return [without_echo(value) for value in detail]
    if isinstance(detail, str) and len(detail) > _SNIPPET:
        return f"{detail[:_SNIPPET]}... ({len(detail)} characters)"
    return detail


def error_message(detail: Any) -> str | None:
    """The human message inside a provider's JSON error (ours, Cloudflare's, FastAPI's or OpenRouter's); give it
    :func:`without_echo` of the error, so no member that repeats the request is read."""
    if not isinstance(detail, Mapping):
        return None
    errors = detail.get("errors")
    if isinstance(errors, list) and errors and isinstance(errors[0], Mapping) and errors[0].get("message"):
        code = errors[0].get("code")
        return str(errors[0]["message"]) + (f" (code {code})" if code is not None else "")
    if isinstance(detail.get("message"), str):
        return str(detail["message"])
    error = detail.get("error")
    if isinstance(error, Mapping) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(detail.get("detail"), (str, list)):
        return json.dumps(detail["detail"])[:_SNIPPET]
    return None
