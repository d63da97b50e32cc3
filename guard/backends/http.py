"""System One over HTTP(S) or a Unix socket: our worker, Cloudflare Workers AI, TypeSafe Jev, OpenRouter, any server.

:class:`SystemOneClient` implements :class:`~guard.backends.base.DecisionBackend` with a pooled ``httpx.AsyncClient``
and ``tenacity`` retries:

* one overall deadline per ``decide`` (``timeout``): every attempt gets only what is left of it, and our worker is
  told the rest in ``x-request-timeout-ms`` so it drops the request if we give up first;
* retries with exponential backoff and jitter on 408, 429, 5xx and connection errors, honouring ``Retry-After``
  (seconds or an HTTP date; also ``retry-after-ms``) when the wait fits in the deadline; never on other 4xx;
* a choice's options are sent sorted by option id (:meth:`SystemOneRequestV1.canonical`), whatever order the policy
  lists them in, so a backend that reads options by position answers the same for either order; answers are keyed
  by option id and reported back in the policy's order;
* an answer is a 200 with a JSON ``Content-Type`` (another 2xx or type is a ``MalformedAnswer``), and its body is
  checked with :meth:`SystemOneResponseV1.from_json` (each question answered, finite,
  probabilities summing to 1 within the provider's rounding); Cloudflare's ``{result, success, errors, messages}``
  envelope is unwrapped and ``success`` must be ``true`` (spec §5.5), also when ``answers`` sit beside it;
* the current trace context goes in ``traceparent`` (OpenTelemetry's propagator), so guard's worker continues the
  gateway's trace; the app's baggage is not sent, in whatever headers the propagators would write it;
* httpx errors are translated at the boundary (``raise ... from exc``) into ``BackendTimeout``,
  ``BackendUnavailable``, ``BackendRejected`` or ``MalformedAnswer``;
* an error answer's text (a 422 that echoes the request's state, in whatever shape) is read nowhere: the error
  raised names the status and the answer's code token (:func:`error_code`; a worker's ``model_not_found`` adds how
  to serve the name), and the log (at WARNING the first time each status is seen, at DEBUG after) and
  ``BackendRejected.detail`` get :func:`error_summary` (the status, media type and length, and the short code, type
  and field tokens and ``loc`` paths of a JSON error; no message). A connection error is named by its httpx type
  only (its text can quote the bytes of a bad answer head), and a Content-Type is quoted and cut at 40 characters.

Example:
    >>> client = SystemOneClient.workers_ai(account_id, api_token, model="clef-flash")  # doctest: +SKIP
    >>> response = await client.decide(request, timeout=2.0)  # doctest: +SKIP
    >>> worker = SystemOneClient.worker(uds="/run/guard/worker.sock")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Collection, Mapping
from typing import Any, Self

import httpx
from opentelemetry import baggage, propagate
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from guard._json import loads
from guard._urls import shown_url, split_url
from guard.backends._providers import (
    DEFAULT_HTTP_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_KEEPALIVE,
    ERROR_BODY_BYTES,
    JEV_URL,
    MODEL_NOT_FOUND,
    MODEL_REVISION_HEADER,
    OPENROUTER_URL,
    PROVIDERS,
    RETRY_STATUSES,
    SYSTEMONE_PATH,
    TIMEOUT_HEADER,
    WORKERS_AI_URL,
    Provider,
    ProviderName,
    RetryConfig,
    error_body,
    error_code,
    error_summary,
    parse_retry_after,
)
from guard.errors import (
    BackendError,
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    InvalidJson,
    MalformedAnswer,
)
from guard.systemone import SystemOneRequestV1, SystemOneResponseV1, require_request
from guard.systemone.wire import max_answer_bytes, max_answer_containers

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_HTTP_TIMEOUT_S",
    "JEV_URL",
    "MAX_RESPONSE_BYTES",
    "OPENROUTER_URL",
    "PROVIDERS",
    "WORKERS_AI_URL",
    "Provider",
    "ProviderName",
    "RetryConfig",
    "SystemOneClient",
    "parse_retry_after",
]

#: Longest ``x-guard-model-revision`` value taken into cache keys (longer or unprintable values are ignored, with a
#: warning). A worker's is ``<checkpoint directory name>@<16 hex>`` and its suffixes (``+max_length=``, ``+guard=``,
#: ``+confidence=``): a name of 255 bytes, the most a file system allows, fits with room to spare.
MAX_REVISION_CHARS = 512
#: Most bytes of a response body read (answers are asked for uncompressed), whatever the request: 64 questions of 255
#: options each fit many times over; a longer body is a malformed answer, read no further. An answer is also held to
#: what its request allows (:func:`~guard.systemone.wire.max_answer_bytes`).
MAX_RESPONSE_BYTES = 8 * 1024 * 1024


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, BackendUnavailable) and exc.reason != "closed"


class SystemOneClient:
    """A System One :class:`~guard.backends.base.DecisionBackend` over HTTP(S) or a Unix socket.

    Args:
        url: the endpoint; a bare origin (``http://worker:8000``) gets ``/v1/systemone`` appended.
        provider: a preset name of :data:`PROVIDERS` (rounding, confidence formula, envelope handling).
        api_key: sent as ``Authorization: Bearer <api_key>``.
        model: overrides the request's ``model`` on the wire (Workers AI requires it to match the URL).
        timeout: default overall deadline of one ``decide`` in seconds.
        retry: retry policy (:class:`RetryConfig` defaults when ``None``).
        uds: path of a Unix socket to connect through (the URL's host is then only a label).
        headers: extra request headers, names taken without regard to case. One of these replaces the client's
            own Content-Type, Accept or Accept-Encoding; ``api_key``'s Authorization, the trace context and the
            worker's ``x-request-timeout-ms`` (set from the deadline on each attempt) replace one of these. No name
            is sent twice.
        name: backend name for errors and verdicts (``http:<provider>`` by default).
        model_revision: identity of the remote weights for cache keys, used as given. By default it is
            ``<provider>:<model or url>`` (plus ``@<uds>`` on a Unix socket) and, once the server has named the
            checkpoint that answered in ``x-guard-model-revision`` (guard's worker does on every answer),
            ``...#<that revision>``: see :attr:`model_revision`.
        verify: TLS verification (``False`` or a CA bundle path for private endpoints).
        max_connections: pool size.
        model_aliases: other model names an answer may carry. An answer names the model it came from, which the
            System One spec has echo the request's ``model``; one naming another model is refused
            (:class:`~guard.errors.MalformedAnswer`, so the policy's fail mode decides) and never cached under this
            model's key. Give the names a provider answers under when it echoes its own.

    Raises:
        ValueError: for an unknown provider, a URL that is not http(s), or a bad timeout.
    """

    def __init__(
        self,
        url: str,
        *,
        provider: ProviderName = "systemone",
        api_key: str | None = None,
        model: str | None = None,
        timeout: float = DEFAULT_HTTP_TIMEOUT_S,
        retry: RetryConfig | None = None,
        uds: str | None = None,
        headers: Mapping[str, str] | None = None,
        name: str | None = None,
        model_revision: str | None = None,
        verify: bool | str = True,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        model_aliases: Collection[str] = (),
    ) -> None:
        if provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {sorted(PROVIDERS)}, got {provider!r}")
        try:
            parts = split_url(url)
        except ValueError as exc:
            raise ValueError(f"url {shown_url(url)!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url must be an http:// or https:// URL with a host, got {shown_url(url)!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if parts.path in ("", "/"):
            url = url.rstrip("/") + SYSTEMONE_PATH
        self.url = url
        self._shown_url = shown_url(url)  # what errors, repr and the revision (on every span and log record) name
        self.provider = PROVIDERS[provider]
        self.model = model
        self.model_aliases = frozenset(model_aliases)
        self.timeout = float(timeout)
        self.retry = retry if retry is not None else RetryConfig()
        self.name = name or f"http:{provider}"
        self._fixed_revision = model_revision
        self._base_revision = f"{provider}:{model or self._shown_url}" + (f"@{uds}" if uds else "")
        self._reached = f"unix socket {uds}" if uds else self._shown_url  # what a connection error names
        self._reported_revision: str | None = None
        self._revision_refused_logged = False  # a reported revision was ignored, and the warning written
        self._statuses_logged: set[int] = set()  # the statuses whose error text was logged at WARNING
        # identity: a compressed answer would be inflated in one call before any size check could stop it
        # held without regard to case: a name set again (the caller's Content-Type, each attempt's deadline header)
        # replaces the line already there instead of sending a second one, which the worker refuses
        self._headers = httpx.Headers({"content-type": "application/json", "accept": "application/json",
                                       "accept-encoding": "identity"})
        self._headers.update(headers or {})
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=DEFAULT_MAX_KEEPALIVE)
        transport = httpx.AsyncHTTPTransport(uds=uds, limits=limits, verify=verify)
        self._client = httpx.AsyncClient(transport=transport, follow_redirects=False)
        self._closed = False

    # ------------------------------------------------------------------------------------------------------ presets

    @classmethod
    def worker(cls, url: str = "http://127.0.0.1:8000", *, uds: str | None = None, **kwargs: Any) -> Self:
        """Our decision worker (``guard worker serve``), on TCP or a Unix socket (``uds``)."""
        return cls(url, provider="worker", uds=uds, **kwargs)

    @classmethod
    def workers_ai(cls, account_id: str, api_token: str, *, model: str = "clef-flash", **kwargs: Any) -> Self:
        """Cloudflare Workers AI (spec §5.1, §5.5): ``@cf/cloudflare/<model>`` with an API token.

        Raises:
            ValueError: for an empty account id, token or model.
        """
        for label, value in (("account_id", account_id), ("api_token", api_token), ("model", model)):
            if not value or not isinstance(value, str):
                raise ValueError(f"Workers AI needs a non-empty {label}")
        url = WORKERS_AI_URL.format(account_id=account_id, model=model)
        return cls(url, provider="workers-ai", api_key=api_token, model=model, **kwargs)

    @classmethod
    def jev(cls, api_key: str, *, url: str = JEV_URL, **kwargs: Any) -> Self:
        """TypeSafe Jev (2-decimal probabilities, Jev confidence formulas)."""
        return cls(url, provider="jev", api_key=api_key, **kwargs)

    @classmethod
    def openrouter(
        cls, api_key: str, *, model: str = "cloudflare/clef-flash", url: str = OPENROUTER_URL, **kwargs: Any
    ) -> Self:
        """OpenRouter's decisions endpoint (2-decimal probabilities)."""
        return cls(url, provider="openrouter", api_key=api_key, model=model, **kwargs)

    def __repr__(self) -> str:
        return f"SystemOneClient(url={self._shown_url!r}, provider={self.provider.name!r}, name={self.name!r})"

    @property
    def model_revision(self) -> str:
        """Identity of the remote weights, part of every cache key (the engine rebuilds its plan when it changes).

        The ``model_revision`` argument when one was given. Otherwise ``<provider>:<model or url>[@<uds>]``, followed
        by ``#<revision>`` once a successful answer carried ``x-guard-model-revision`` (printable, at most
        :data:`MAX_REVISION_CHARS` characters; another value is ignored, with one warning): from then on a shared Redis
        keeps the answers of different checkpoints behind the same address apart. A checkpoint swapped behind the
        address is seen on the next answer the server sends (a cache miss); answers cached before stay until their
        TTL, as with any cache.
        """
        if self._fixed_revision is not None:
            return self._fixed_revision
        if self._reported_revision is None:
            return self._base_revision
        return f"{self._base_revision}#{self._reported_revision}"

    async def aclose(self) -> None:
        """Close the connection pool. Idempotent."""
        self._closed = True
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -------------------------------------------------------------------------------------------------------- decide

    async def decide(self, request: SystemOneRequestV1, *, timeout: float | None = None) -> SystemOneResponseV1:
        """Send ``request`` and return the checked answer, retrying transient failures within ``timeout``.

        Args:
            request: a validated request (PIL images cannot be sent; use data URLs).
            timeout: overall deadline in seconds, retries and backoff included (the client's default when ``None``).

        Raises:
            BackendTimeout: no answer within the deadline.
            BackendUnavailable: connection failures, 408/429/5xx after the last attempt (``retry_after`` set when the
                server sent one), or a wait the deadline cannot cover.
            BackendRejected: any other non-2xx (not retried), or a Cloudflare envelope with ``success`` not ``true``.
            MalformedAnswer: a 2xx other than 200, a Content-Type other than JSON, or a body that is not JSON, is
                truncated, misses an answer, has a non-finite number or a wrong type, or probabilities not summing to 1
                within the provider's rounding.
            RuntimeError: the client was closed.
            TypeError: ``request`` is not a :class:`~guard.systemone.SystemOneRequestV1`.
        """
        request = require_request(request, f"{self.name}: decide()")
        if self._closed:
            raise RuntimeError(f"Cannot send a request with {self!r}: it has been closed.")
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        content = self._encode(request)
        max_bytes = min(MAX_RESPONSE_BYTES, max_answer_bytes(request, self.model))
        max_containers = max_answer_containers(request, self.model)
        retrying = AsyncRetrying(
            stop=lambda state: self._stop(state, deadline),
            wait=self._wait,
            retry=retry_if_exception(_retryable),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BackendTimeout(f"{self.name}: no answer within {budget * 1000:g} ms", backend=self.name)
                response = await self._post(content, remaining, budget, max_bytes)
                return self._parse(response, request, max_containers)
        raise AssertionError("unreachable: tenacity re-raises the last error")  # pragma: no cover

    def _encode(self, request: SystemOneRequestV1) -> bytes:
        if self.provider.name == "openrouter" and request.images:
            raise BackendRejected(
                f"{self.name}: OpenRouter takes images inside the state array, not a top-level images field",
                backend=self.name,
            )
        body = request.canonical().to_json()  # choice options sorted by id: no route depends on listing order
        if self.model:
            body["model"] = self.model
        try:
            return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise BackendRejected(f"{self.name}: request is not JSON-serialisable: {exc}", backend=self.name) from exc

    def _stop(self, state: RetryCallState, deadline: float) -> bool:
        """Stop after ``max_attempts``, or when the next wait would end past the deadline."""
        if state.attempt_number >= self.retry.max_attempts:
            return True
        return time.monotonic() + state.upcoming_sleep >= deadline

    def _wait(self, state: RetryCallState) -> float:
        """The server's ``Retry-After`` when it sent one, else exponential backoff with jitter."""
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, BackendUnavailable) and exc.retry_after is not None:
            return exc.retry_after
        backoff = wait_random_exponential(multiplier=self.retry.initial_backoff_s, max=self.retry.max_backoff_s)
        return float(backoff(state))

    async def _post(self, content: bytes, remaining: float, budget: float, max_bytes: int) -> httpx.Response:
        headers = self._headers.copy()
        if self.provider.continues_trace:  # the decision span's trace context: the worker continues it
            carrier: dict[str, str] = {}
            # without the app's baggage (user, session, tenant ids), whatever headers a propagator writes it in
            # (W3C ``baggage``, Jaeger's ``uberctx-*``, OT's ``ot-baggage-*``)
            propagate.inject(carrier, context=baggage.clear())
            headers.update(carrier)
        if self.provider.sends_deadline:
            headers[TIMEOUT_HEADER] = str(max(1, math.floor(remaining * 1000)))
        try:
            async with asyncio.timeout(remaining):  # httpx's timeout is per phase; this bounds the whole exchange
                return await self._read(content, headers, remaining, max_bytes)
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise BackendTimeout(
                f"{self.name}: no answer within {budget * 1000:g} ms ({type(exc).__name__})", backend=self.name
            ) from exc
        except httpx.TransportError as exc:  # its text can quote what the server sent (a bad head): the type only
            raise BackendUnavailable(
                f"{self.name}: cannot reach {self._reached}: {type(exc).__name__}",
                backend=self.name,
                reason="connection",
            ) from exc

    async def _read(self, content: bytes, headers: httpx.Headers, remaining: float, max_bytes: int) -> httpx.Response:
        """POST and read the answer's body up to ``max_bytes`` (:data:`MAX_RESPONSE_BYTES` or less, what an answer to
        the request can hold: :func:`~guard.systemone.wire.max_answer_bytes`), as sent (never decompressed); an answer
        whose status is not 2xx is read up to :data:`~guard.backends._providers.ERROR_BODY_BYTES` and cut there, not
        refused (its status says what failed: a 503 with a long page is an unavailable backend, not a malformed
        answer).

        Raises:
            MalformedAnswer: a 2xx body is longer (``too_large``), or the body has a ``Content-Encoding`` (the request asks for
                identity).
        """
        async with self._client.stream("POST", self.url, content=content, headers=headers,
                                       timeout=remaining) as response:  # fmt: skip
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise MalformedAnswer(f"{self.name}: the answer has Content-Encoding {encoding[:40]!r}; this client "
                                      "asks for identity and does not decompress", backend=self.name)
            body = bytearray()
            error = not 200 <= response.status_code < 300
            async for chunk in response.aiter_raw():
                body += chunk
                if error and len(body) > ERROR_BODY_BYTES:
                    del body[ERROR_BODY_BYTES:]
                    break
                if len(body) > max_bytes:
                    raise MalformedAnswer(f"{self.name}: the answer is longer than {max_bytes} bytes, the most an "
                                          "answer to this request holds (too_large); it was not read further",
                                          backend=self.name)
            # the raw bytes: a header value that is not ASCII (rev-é) is kept as sent, not re-encoded (which raised)
            kept = [(k, v) for k, v in response.headers.raw if k.lower() != b"content-encoding"]
            return httpx.Response(response.status_code, headers=kept, content=bytes(body), request=response.request)

    def _parse(self, response: httpx.Response, request: SystemOneRequestV1, max_containers: int) -> SystemOneResponseV1:
        """The checked answer in a 2xx ``response``, whose body holds at most ``max_containers`` arrays and objects
        (:func:`~guard.systemone.wire.max_answer_containers`; counted before parsing, which holds the event loop)."""
        status = response.status_code
        if not 200 <= status < 300:
            raise self._status_error(response)
        self._check_answer_head(response)
        try:
            body = loads(response.content, max_containers=max_containers)
        except InvalidJson as exc:
            if exc.reason == "too_many_values":  # valid or not, more than an answer holds: not parsed
                raise MalformedAnswer(f"{self.name}: the answer holds more than {max_containers} arrays and objects, "
                                      "the most an answer to this request holds (too_many_values); it was not parsed",
                                      backend=self.name) from exc
            media = response.headers.get("content-type")
            kind = "no Content-Type" if media is None else f"Content-Type {media[:40]!r}"  # quoted: no control
            self._log_error(error_summary(response, None))
            raise MalformedAnswer(
                f"{self.name}: HTTP {status} body is not valid JSON ({kind}; {exc.reason})", backend=self.name
            ) from exc
        if isinstance(body, Mapping) and "success" in body:  # an envelope, even one that also carries answers
            body = self._unwrap(body, response)
        named, asked = body.get("model") if isinstance(body, Mapping) else None, self.model or request.model
        if named is not None and (not isinstance(named, str) or (named != asked and named not in self.model_aliases)):
            raise MalformedAnswer(
                f"{self.name}: the answer names model {str(named)[:80]!r}, but {asked!r} was asked (the System One "
                f"answer echoes the request's model; give model_aliases= for names this provider answers under)",
                backend=self.name,
            )
        answer = SystemOneResponseV1.from_json(
            body,
            request,
            decimals=self.provider.decimals,
            confidence_profile=self.provider.confidence_profile,
            backend=self.name,
        )
        reported = response.headers.get(MODEL_REVISION_HEADER)  # taken from a valid answer only
        if reported and len(reported) <= MAX_REVISION_CHARS and reported.isprintable():
            self._reported_revision = reported
        elif reported and self._fixed_revision is None and not self._revision_refused_logged:
            self._revision_refused_logged = True
            why = f"longer than {MAX_REVISION_CHARS} characters" if len(reported) > MAX_REVISION_CHARS else "unprintable"
            logger.warning("%s: its %s header is %s and ignored: the cache keys cannot tell apart the checkpoints "
                           "served behind this address (shorten the checkpoint directory's name, or give "
                           "model_revision=)", self.name, MODEL_REVISION_HEADER, why)
        return answer

    def _check_answer_head(self, response: httpx.Response) -> None:
        """A System One answer is ``200`` with a JSON ``Content-Type`` (``application/json`` or a ``+json`` type, any
        parameters): another 2xx (``203`` from a transforming proxy, ``206``) or type (an HTML page that happens to
        parse) is not one.

        Raises:
            MalformedAnswer: naming the status, or the Content-Type (quoted, cut at 40 characters).
        """
        if response.status_code != 200:
            raise MalformedAnswer(f"{self.name}: HTTP {response.status_code} is not a System One answer (200 expected)",
                                  backend=self.name)
        media = response.headers.get("content-type")
        kind = media.partition(";")[0].strip().lower() if media is not None else ""
        if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
            shown = "no Content-Type" if media is None else f"Content-Type {media[:40]!r}"  # quoted: no control
            raise MalformedAnswer(f"{self.name}: the answer has {shown}; a System One answer is application/json",
                                  backend=self.name)

    def _unwrap(self, envelope: Mapping[str, Any], response: httpx.Response) -> Any:
        """Cloudflare's ``{result, success, errors, messages}`` (spec §5.5): ``result`` when ``success`` is true."""
        if envelope.get("success") is not True:
            summary = error_summary(response, envelope)
            self._log_error(summary)
            code = error_code(summary)
            raise BackendRejected(
                f"{self.name}: the request failed (HTTP {response.status_code}{'' if code is None else f', {code}'}): "
                "the envelope's success is not true",
                backend=self.name,
                status_code=response.status_code,
                detail=summary,
            )
        if "result" in envelope:
            return envelope["result"]
        if "answers" in envelope:  # a successful envelope with the answers beside its flags
            return envelope
        raise MalformedAnswer(f"{self.name}: success envelope without a 'result'", backend=self.name)

    def _status_error(self, response: httpx.Response) -> BackendError:
        status = response.status_code
        summary = error_summary(response, error_body(response))
        self._log_error(summary)
        if status in RETRY_STATUSES or status >= 500:
            retry_after = parse_retry_after(response.headers)
            return BackendUnavailable(
                f"{self.name} answered HTTP {status}",
                backend=self.name,
                reason=f"http_{status}",
                retry_after=retry_after,
            )
        code = error_code(summary)
        hint = ""
        if status == 401 and "authorization" not in self._headers:
            hint = "; this client sends no API key (api_key=; guard's command line reads $GUARD_BACKEND_API_KEY)"
        elif code == MODEL_NOT_FOUND:
            hint = ("; it serves other model names (GET /v1/models lists them): ask one of those, or serve this name "
                    "too (guard worker serve --model-alias NAME)")
        return BackendRejected(
            f"{self.name} refused the request with HTTP {status}{'' if code is None else f' ({code})'}{hint}",
            backend=self.name,
            status_code=status,
            detail=summary,
        )

    def _log_error(self, summary: dict[str, Any]) -> None:
        """Log an error answer's :func:`error_summary` (no free text of the provider's: it may quote the request), as
        one line of JSON: at WARNING the first time this client sees the status, at DEBUG after."""
        status = summary["status"]
        level = logging.DEBUG if status in self._statuses_logged else logging.WARNING
        self._statuses_logged.add(status)
        logger.log(level, "%s answered HTTP %d: %s", self.name, status, json.dumps(summary))
