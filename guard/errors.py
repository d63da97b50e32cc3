"""Every exception guard raises, in one tree.

    GuardError
    ├── RequestValidationError      a System One request (or response) breaks the wire rules; carries FieldError list
    ├── PolicyError                 a policy file is invalid; names file, line and key path
    ├── BackendError                the decision backend could not produce a valid answer
    │   ├── BackendTimeout          no answer within the deadline
    │   ├── BackendUnavailable      connection refused / reset, 5xx, 429 after retries, worker closed
    │   ├── BackendRejected         the backend refused the request (4xx); retrying will not help
    │   └── MalformedAnswer         an answer is missing, not finite, or its probabilities do not sum to 1
    ├── Overloaded                  a bounded queue is full; carries ``retry_after`` seconds
    ├── UnsupportedQuestion         a backend was asked a question it cannot answer (compact model catalog)
    ├── StateTooLong                a state field is longer than its max_chars and the policy says truncate: error
    ├── StateAmbiguous              a value a policy reads as one (parameter, field, header) sent twice or as q[] for q
    ├── InvalidJson                 strict JSON parsing failed: not UTF-8, duplicate key, too deep, NaN, bad syntax
    ├── BodyError                   an HTTP request body cannot be inspected (too large, undecodable, malformed)
    ├── ReviewError                 a review item cannot be read or changed as asked
    │   ├── ReviewNotFound          no review item has that id (never existed or expired)
    │   ├── ReviewConflict          the item's status or content digest forbids the change (e.g. a second release)
    │   │   └── ApprovalAlreadyUsed an approved agent tool call was already released once (single use)
    │   ├── ReviewStoreUnavailable  the review store (Redis) cannot be reached, or is full
    │   │   └── ReviewOutcomeUnknown a change was sent to Redis, its reply was lost and a re-read could not tell
    │   └── ReviewQuotaExceeded     one client already has as many pending items or bytes as it may (HTTP 429)
    ├── HandoffError                the LLM handoff target is unknown, unreachable or answered badly
    └── ResumeError                 an agent resume does not answer exactly the pending review items

Exceptions from httpx, redis and torch are translated at the boundary with ``raise ... from exc``. Messages are one
sentence built from the attributes, naming the object, the value, the limit and, where one exists, the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "ApprovalAlreadyUsed",
    "BackendError",
    "BackendRejected",
    "BackendTimeout",
    "BackendUnavailable",
    "BodyError",
    "FieldError",
    "GuardError",
    "HandoffError",
    "InvalidJson",
    "MalformedAnswer",
    "Overloaded",
    "PolicyError",
    "RequestValidationError",
    "ResumeError",
    "ReviewConflict",
    "ReviewError",
    "ReviewNotFound",
    "ReviewOutcomeUnknown",
    "ReviewQuotaExceeded",
    "ReviewStoreUnavailable",
    "StateAmbiguous",
    "StateTooLong",
    "UnsupportedQuestion",
]


class GuardError(Exception):
    """Root of every error guard raises on purpose."""


@dataclass(frozen=True)
class FieldError:
    """One problem with one field of a request.

    Attributes:
        field: dotted path of the field, e.g. ``questions.urgency.criteria``.
        message: one sentence saying what is wrong and what is allowed.
    """

    field: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"field": self.field, "message": self.message}


class RequestValidationError(GuardError, ValueError):
    """A System One request or response breaks the wire rules.

    Attributes:
        errors: every problem found, each naming its field.
    """

    def __init__(self, errors: list[FieldError]) -> None:
        if not errors:
            raise ValueError("RequestValidationError needs at least one FieldError")
        self.errors = list(errors)
        first = self.errors[0]
        more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
        super().__init__(f"{first.field}: {first.message}{more}")

    @property
    def field(self) -> str:
        return self.errors[0].field


class PolicyError(GuardError, ValueError):
    """A policy file cannot be loaded.

    Attributes:
        file: path of the policy file (or ``<string>``).
        line: 1-based line of the offending node, or ``None`` when unknown.
        key: dotted key path, e.g. ``policies[0].questions.urgency.criteria``.
        reason: what is wrong and what is allowed.
    """

    def __init__(self, file: str, line: int | None, key: str, reason: str) -> None:
        self.file = file
        self.line = line
        self.key = key
        self.reason = reason
        where = f"{file}:{line}" if line is not None else file
        at = f" at {key}" if key else ""
        super().__init__(f"{where}{at}: {reason}")


class BackendError(GuardError):
    """The decision backend could not produce a valid answer.

    Attributes:
        backend: name of the backend that failed.
        reason: short machine-friendly reason, e.g. ``timeout``, ``http_503``, ``malformed``.
    """

    reason_code = "backend_error"

    def __init__(self, message: str, *, backend: str = "", reason: str | None = None) -> None:
        self.backend = backend
        self.reason = reason or self.reason_code
        super().__init__(message)


class BackendTimeout(BackendError):
    """No answer arrived within the deadline."""

    reason_code = "timeout"


class BackendUnavailable(BackendError):
    """The backend could not be reached or answered with a server error (also 429 after the last retry)."""

    reason_code = "unavailable"

    def __init__(
        self, message: str, *, backend: str = "", reason: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, backend=backend, reason=reason)
        self.retry_after = retry_after


class BackendRejected(BackendError):
    """The backend refused the request as invalid (HTTP 4xx other than 408/429); retrying will not help.

    Attributes:
        status_code: the HTTP status, when one exists.
        detail: what the backend told of the refusal: the local backend's field errors (``[{"field", "message"}]``),
            or :func:`guard.backends.http`'s summary of a remote's error answer (its status, media type, length and
            code tokens, never its text, which may repeat the request).
    """

    reason_code = "rejected"

    def __init__(self, message: str, *, backend: str = "", status_code: int | None = None, detail: Any = None) -> None:
        super().__init__(message, backend=backend)
        self.status_code = status_code
        self.detail = detail


class MalformedAnswer(BackendError):
    """An answer is missing, not finite, of the wrong type, or its probabilities do not sum to 1."""

    reason_code = "malformed"


class Overloaded(GuardError):
    """A bounded queue (or memory) is full; the caller should retry after ``retry_after`` seconds. ``counted`` names
    what ``limit`` counts."""

    def __init__(self, what: str, limit: int, retry_after: float, *, counted: str = "waiting") -> None:
        self.what = what
        self.limit = limit
        self.retry_after = retry_after
        super().__init__(f"{what} is full ({limit} {counted}); retry after {retry_after:g} s")


class UnsupportedQuestion(GuardError, ValueError):
    """A backend was asked a question it was not built to answer.

    Attributes:
        question_id: the question's id.
        backend: the backend that refused it.
        reason: why it was refused, and which backend can answer it.
    """

    def __init__(self, question_id: str, backend: str, reason: str) -> None:
        self.question_id = question_id
        self.backend = backend
        self.reason = reason
        super().__init__(f"question {question_id!r} cannot be answered by backend {backend!r}: {reason}")


class StateTooLong(GuardError):
    """A state field is longer than its ``max_chars`` and its policy refuses to judge a cut text (``truncate:
    error``); the engine answers with a block (413), never with a decision on part of the text.

    Attributes:
        field: the state field's path, e.g. ``text`` or ``call.arguments``.
        length: the field's length in characters (after normalisation; the raw length when far over the cap).
        max_chars: the field's cap.
    """

    def __init__(self, field: str, length: int, max_chars: int) -> None:
        self.field = field
        self.length = length
        self.max_chars = max_chars
        super().__init__(
            f"state field {field!r} has {length} characters; this policy judges at most {max_chars} and refuses to "
            "judge a cut text (truncate: error)"
        )


class StateAmbiguous(GuardError):
    """A request sends a value more than once (a query parameter, form field, header, or a JSON key its object
    repeats) that its policy reads as one value: parsers differ on which copy counts (the first, the last, all joined), so the guard could judge one
    copy while the application reads another. The engine answers with a block (400) and asks no model.

    Also raised for a query parameter or form field sent under another spelling that a framework reads as the one
    the policy reads (``q[]`` for ``q``, ``guard/_params.py``): ``alias``.

    Attributes:
        source: ``query``, ``form``, ``header``, or ``body`` (a JSON key an object repeats, its values collected).
        name: the parameter, field or header name; for ``body`` the JSON pointer to the repeated key.
        alias: the other spelling sent (``q[]``; ``;q`` for one only Rack 2 reads, after a ``;``), or ``None`` for a
            value sent twice.
        at_semicolon: a query parameter whose values Rails on Rack 2 reads otherwise, as it splits a query at ``;``
            too (``role=admin;`` is ``admin`` there).
        readers: with an alias, which frameworks read it into which parameter: ``((frameworks, parameter), ...)``,
            e.g. ``((("PHP", "Rails", "Express"), "q"),)``; ``parameter`` is the framework's own reading of
            ``name`` (PHP reads ``a.b`` as ``a_b``).
        what: ``query parameter 'q'``, ``form field 'q'`` or ``header 'x-user'``; with an alias
            ``query parameter 'q' (as 'q[]', which PHP, Rails and Express read into 'q')``.
    """

    def __init__(self, source: str, name: str, *, alias: str | None = None,
                 readers: tuple[tuple[tuple[str, ...], str], ...] = (), at_semicolon: bool = False) -> None:
        self.source = source
        self.name = name
        self.alias = alias
        self.readers = readers
        self.at_semicolon = at_semicolon
        kind = {"query": "query parameter", "form": "form field", "body": "JSON member"}.get(source, source)
        self.what = f"{kind} {name!r}"
        if at_semicolon:
            super().__init__(f"the {self.what} is read otherwise by Rails on Rack 2, which also splits a query at "
                             "';'; this policy reads it as one value (send a ';' in a value as %3B)")
            return
        if alias is not None:
            self.what += f" (as {alias[:60]!r}, which {_read_into(name, readers)})"
            super().__init__(f"the {self.what} is sent under another name; this policy reads it as one value, by "
                             "its own name")
            return
        twice = "is sent more than once" + (" (or spelled with '_', which WSGI servers read alike)"
                                            if source == "header" else "")
        super().__init__(f"the {self.what} {twice}; this policy reads it as one value")


def _read_into(name: str, readers: tuple[tuple[tuple[str, ...], str], ...]) -> str:
    """``PHP, Rails and Express read into 'q'``; ``PHP reads into 'a_b' as it does 'a.b', and Rails into 'a.b'``:
    each group of frameworks and the parameter it reads the spelling into."""
    parts = []
    for frameworks, reading in readers:
        one = len(frameworks) == 1
        who = frameworks[0] if one else f"{', '.join(frameworks[:-1])} and {frameworks[-1]}"
        verb = "" if parts else "reads " if one else "read "
        own = f" as {'it does' if one else 'they do'} {name!r}" if reading != name else ""
        parts.append(f"{who} {verb}into {reading[:60]!r}{own}")
    return ", and ".join(parts) or f"a framework reads into {name!r}"


class InvalidJson(GuardError, ValueError):
    """A JSON document breaks the strict rules (``guard/_json.py``).

    Attributes:
        reason: ``not_utf8``, ``syntax``, ``duplicate_key``, ``too_deep``, ``non_finite``, ``lone_surrogate``,
            ``number_too_long`` or ``too_many_values``.
        path: JSON path of the offending value (``$.messages[0].content``), ``$`` when it is the whole document.
        detail: one sentence naming the value and the limit.
    """

    def __init__(self, reason: str, detail: str, *, path: str = "$") -> None:
        self.reason = reason
        self.path = path
        self.detail = detail
        super().__init__(f"{detail} (at {path})" if path != "$" else detail)


class BodyError(GuardError, ValueError):
    """An HTTP request body cannot be inspected, so it must not be forwarded.

    Attributes:
        status: the HTTP status to answer with (400 malformed, 413 too large, 415 unsupported media or encoding).
        code: snake_case error code for the ``{code, message, field}`` body, e.g. ``body_too_large``.
        field: what is at fault, e.g. ``body``, ``content-encoding``, ``body.prompt``.
        reason: one sentence naming the value and the limit.
    """

    def __init__(self, status: int, code: str, reason: str, *, field: str = "body") -> None:
        self.status = status
        self.code = code
        self.field = field
        self.reason = reason
        super().__init__(reason)


class ReviewError(GuardError):
    """A review item cannot be read or changed as asked.

    Attributes:
        review_id: the item's id.
        reason: what is wrong.
    """

    def __init__(self, review_id: str, reason: str) -> None:
        self.review_id = review_id
        self.reason = reason
        super().__init__(f"review {review_id!r}: {reason}")


class ReviewNotFound(ReviewError):
    """No review item has that id: it never existed or its TTL expired."""

    def __init__(self, review_id: str) -> None:
        super().__init__(review_id, "no such review item (unknown id or expired)")


class ReviewConflict(ReviewError):
    """The item's status or content digest forbids the change (approve twice, release unapproved, second release).

    Attributes:
        status: the item's current status.
    """

    def __init__(self, review_id: str, status: str, reason: str) -> None:
        self.status = status
        super().__init__(review_id, reason)


class ApprovalAlreadyUsed(ReviewConflict):
    """An approved agent tool call was already released once: a second resume of the same interrupt (concurrent, or
    replayed from the checkpoint saved at the interrupt) claimed it after the first. The tool did not run again.

    Attributes:
        review_id: the approval's claim id (``ga_`` + 24 hex digits, bound to thread, turn, call and arguments).
        status: ``"claimed"``, or ``"failed"`` when the tool raised in the run that used the approval.
    """

    def __init__(self, claim_id: str, reason: str, status: str = "claimed") -> None:
        super().__init__(claim_id, status, reason)


class ReviewStoreUnavailable(ReviewError):
    """The review store could not be reached (Redis down or slow), or is full (its items or bytes at its cap);
    nothing was stored or changed (except for :class:`ReviewOutcomeUnknown`, which says it cannot tell)."""


class ReviewOutcomeUnknown(ReviewStoreUnavailable):
    """A change of a review item (approve, reject, release) was sent to Redis, its reply was lost (a timeout, a
    connection cut) and reading the item again could not tell whether it was made: it may have been, or be made
    still. Read the item's status before deciding again; a release that was made is not replayed (at most once)."""


class ReviewQuotaExceeded(ReviewError):
    """One client already holds as many pending review items, or bytes of items, as the store allows it; others are
    unaffected.

    Attributes:
        retry_after: seconds after which the oldest of them expires (an upper bound on the wait).
    """

    def __init__(self, review_id: str, reason: str, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(review_id, reason)


class HandoffError(GuardError):
    """The LLM handoff target is unknown, unreachable, timed out, or answered with an error or a malformed body.

    Attributes:
        target: the handoff target's name.
        reason: short machine-friendly reason: ``unknown_target``, ``timeout``, ``unavailable``, ``http_<status>``,
            ``malformed``, ``misconfigured`` (its URL or key cannot make a request).
    """

    def __init__(self, message: str, *, target: str, reason: str) -> None:
        self.target = target
        self.reason = reason
        super().__init__(message)


class ResumeError(GuardError, ValueError):
    """An agent resume value does not answer exactly the review items that are pending.

    Raised inside an interrupt's ``response_schema`` (LangGraph then saves nothing, so the thread can be answered
    again) and by ``guard.agents.resume_command`` before a ``Command`` is built.

    Attributes:
        expected: ids of the pending review items.
        given: ids the resume value answered.
        reason: what is wrong, in one sentence.
    """

    def __init__(self, reason: str, *, expected: tuple[str, ...] = (), given: tuple[str, ...] = ()) -> None:
        self.expected = expected
        self.given = given
        self.reason = reason
        super().__init__(reason)
