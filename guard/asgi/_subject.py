"""The ASGI scope as guard sees it: the body-less subject used for matching, and what a review item keeps."""

from __future__ import annotations

import base64
import functools
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import Scope

from guard._frozen import frozen_builder
from guard.asgi._media import media_type
from guard.errors import BodyError
from guard.subject import HttpSubject

__all__ = [
    "SENSITIVE_HEADERS",
    "fill_body",
    "head_subject",
    "header_map",
    "held_request",
    "query_map",
    "subject_summary",
]

SENSITIVE_HEADERS = frozenset({b"authorization", b"cookie", b"proxy-authorization", b"x-api-key"})
"""Credentials a review item never stores: a release takes them from the releasing request instead."""
_NOT_HELD = SENSITIVE_HEADERS | {
    b"content-length",
    b"transfer-encoding",
    b"connection",
    b"keep-alive",
    b"te",
    b"upgrade",
    b"expect",
    b"x-guard-review-id",
}


#: Header names remembered by :func:`header_map` (raw bytes -> lower-case text); names past this many are decoded
#: every time, so a client sending made-up names cannot grow the table.
HEADER_NAMES_KEPT = 256
_header_names: dict[bytes, str] = {}


def _header_name(raw: bytes) -> str:
    """``raw`` decoded (latin-1) and lower-cased, remembered while the table has room: the same few names come with
    every request, and a dict lookup costs about half of decoding and lower-casing one."""
    name = raw.decode("latin-1").lower()
    if len(_header_names) < HEADER_NAMES_KEPT:
        _header_names[raw] = name
    return name


def header_map(scope: Scope) -> dict[str, str]:
    """Header name (lower-case) -> value; repeated headers joined with ``", "`` (latin-1, as ASGI defines)."""
    raw = scope["headers"]
    known = _header_names.get
    try:
        out = {known(name) or _header_name(name): value.decode("latin-1") for name, value in raw}
    except TypeError:  # a bytearray name (not ASGI, but seen) is no key of the table: the loop below decodes it
        out = {}
    if len(out) == len(raw):  # no repeated name: the usual case, built in one comprehension
        return out
    out = {}
    for raw_name, raw_value in raw:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def query_map(scope: Scope, max_fields: int) -> dict[str, list[str]]:
    """Query parameters, each name to its values in order; percent-escapes decoded as UTF-8 (bad bytes -> U+FFFD).

    Raises:
        BodyError: 400 ``invalid_query`` past ``max_fields`` parameters.
    """
    raw = scope.get("query_string", b"")
    if not raw:
        return {}
    try:
        pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True, errors="replace", max_num_fields=max_fields)
    except ValueError as exc:
        raise BodyError(
            400,
            "invalid_query",
            f"the query string has more than {max_fields} parameters; at most {max_fields} are allowed",
            field="query",
        ) from exc
    out: dict[str, list[str]] = {}
    for name, value in pairs:
        out.setdefault(name, []).append(value)
    return out


def _host(headers: dict[str, str], scope: Scope) -> str:
    """The ``Host`` header, lower-case, without port and without the trailing dot of a fully qualified name
    (``API.example.com.:443`` -> ``api.example.com``); the server address when there is no header. This is what the
    client says, not what chose the upstream: see docs/http.md on ``hosts:``."""
    host = headers.get("host")
    if host is None:
        server = scope.get("server")
        return str(server[0]).lower() if server else ""
    return _host_name(host)


@functools.lru_cache(maxsize=64)
def _host_name(host: str) -> str:
    """A ``Host`` value as :func:`_host` gives it; remembered (a service answers to a handful of names, and this runs
    for every request)."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        return host[: host.find("]") + 1]
    host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return host.removesuffix(".")


_subject = frozen_builder(HttpSubject)  # built twice per guarded request: see guard/_frozen.py


def head_subject(scope: Scope, headers: dict[str, str], client_header: str | None) -> HttpSubject:
    """The subject without query or body: everything a policy's ``match`` may look at."""
    client: str | None = None
    if client_header is not None and client_header in headers:
        client = headers[client_header].split(",")[0].strip() or None
    else:
        peer = scope.get("client")
        if peer:
            client = str(peer[0])
    media = media_type(headers.get("content-type", ""))
    return _subject(
        {
            "method": scope["method"].upper(),
            "path": scope["path"],
            "query": {},
            "headers": headers,
            "host": _host(headers, scope),
            "client": client,
            "content_type": media,
            "body": None,
            "body_text": "",
            "kind": "http",
        }
    )


def fill_body(head: HttpSubject, query: dict[str, list[str]], body: Any, body_text: str) -> HttpSubject:
    """``head`` itself, with its query and body filled in.

    Only for a subject :func:`head_subject` made for this request and nothing has kept: matching reads it and keeps
    nothing, and it is filled before it goes anywhere else (the engine, a review item, the decision log). Filling it
    in place saves copying a frozen object's fields on every guarded request.
    """
    head.__dict__.update(query=query, body=body, body_text=body_text)
    return head


def subject_summary(subject: HttpSubject) -> dict[str, Any]:
    """What a reviewer sees of the held request besides the state: method, path, host, client, media type."""
    return {
        "kind": "http",
        "method": subject.method,
        "path": subject.path,
        "host": subject.host,
        "client": subject.client,
        "content_type": subject.content_type,
    }


def held_request(scope: Scope, body: bytes) -> dict[str, Any]:
    """Everything needed to replay the request later, minus credentials and hop-by-hop headers (JSON-safe)."""
    return {
        "method": scope["method"],
        "path": scope["path"],
        "raw_path": (scope.get("raw_path") or scope["path"].encode("utf-8")).decode("latin-1"),
        "query_string": scope.get("query_string", b"").decode("latin-1"),
        "headers": [
            [k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"] if k.lower() not in _NOT_HELD
        ],
        "body_b64": base64.b64encode(body).decode("ascii"),
    }
