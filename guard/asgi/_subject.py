"""The ASGI scope as guard sees it: the body-less subject used for matching, and what a review item keeps."""

from __future__ import annotations

import base64
import dataclasses
import functools
import ipaddress
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from starlette.types import Scope

from guard._headers import host_name
from guard._readable import INVISIBLE
from guard.asgi._body_view import shown_body
from guard.asgi._media import media_type
from guard.engine.telemetry import (
    CREDENTIAL_HEADERS,
    credential_header,
    credential_name,
    credential_value,
    redact_secrets,
)
from guard.errors import BodyError
from guard.subject import HttpSubject

__all__ = [
    "METHOD_OVERRIDE_HEADERS",
    "SENSITIVE_HEADERS",
    "SINGLE_VALUE_HEADERS",
    "UNBOUND_HEADERS",
    "ClientHeader",
    "client_address",
    "forwarded_hosts",
    "head_subject",
    "header_map",
    "held_request",
    "host_name",
    "is_credential",
    "query_map",
    "shown_query",
    "subject_summary",
    "with_body",
]

SENSITIVE_HEADERS = frozenset(name.encode("latin-1") for name in CREDENTIAL_HEADERS)
"""Credentials a review item never stores: a release takes them from the releasing request instead."""


def is_credential(name: bytes) -> bool:
    """Whether header ``name`` is one of :data:`SENSITIVE_HEADERS`, in any case and also spelled with ``_``
    (:func:`~guard.engine.telemetry.credential_header`)."""
    return credential_header(name.decode("latin-1"))


UNBOUND_HEADERS = SENSITIVE_HEADERS | {
    b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"te", b"upgrade", b"expect",
    b"x-guard-review-id", b"x-guard-release-token",
}
"""Headers a held request never stores and a release digest never takes from "every header": framing, and the
credentials and review headers that are bound on their own."""


METHOD_OVERRIDE_HEADERS = frozenset({"x-http-method-override", "x-http-method", "x-method-override"})
"""Headers some frameworks read as the request's real method."""
SINGLE_VALUE_HEADERS = frozenset({
    "content-type", "content-length", "host", "authorization", "proxy-authorization", "user-agent",
    "x-guard-review-id", "x-guard-release-token", *METHOD_OVERRIDE_HEADERS,
})
"""Headers that hold one value: sent twice they are refused, because readers differ on which copy wins (the first,
the last, or both joined), so a policy and the application would read different values."""


def header_map(scope: Scope) -> dict[str, str]:
    """Header name (lower-case) -> value; repeated headers joined with ``", "`` (latin-1, as ASGI defines).

    Raises:
        BodyError: 400 ``repeated_header`` (``field``: the header's name) for a repeated
            :data:`SINGLE_VALUE_HEADERS` header.
    """
    out: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        if name in out and name in SINGLE_VALUE_HEADERS:
            raise BodyError(400, "repeated_header", f"the {name} header is sent more than once; send it once",
                            field=name)
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
    return host_name(host)


#: Longest client identity kept from a trusted proxy's entry that is not an IP address.
MAX_CLIENT_CHARS = 100


@dataclass(frozen=True)
class ClientHeader:
    """Where the client's address is read when trusted proxies stand in front: ``name``, a header (lower-case) to
    which each proxy appends the address it got the request from (``x-forwarded-for``; or RFC 7239's ``forwarded``,
    whose elements' ``for=`` parameters are read), and ``hops``, how many of those proxies are trusted. The address
    used is the ``hops``-th from the right, the one the outermost trusted proxy appended; the entries left of it are
    whatever the client wrote."""

    name: str
    hops: int = 1


def client_address(scope: Scope, headers: dict[str, str], client_header: ClientHeader | None) -> str | None:
    """Who sent the request: the entry ``client_header`` names (see :class:`ClientHeader`), else the peer address
    (not configured, not sent, or fewer than ``hops`` entries). An IP address is given in one spelling (``0::1`` ->
    ``::1``, ``::ffff:10.0.0.1`` -> ``10.0.0.1``, a port dropped: ``203.0.113.7:51234``, ``[2001:db8::1]:443``);
    an entry that is not one (a trusted proxy wrote it: ``unknown``, an obfuscated name) is kept as written, at most
    :data:`MAX_CLIENT_CHARS` characters, so such clients are not all taken for the proxy itself."""
    if client_header is not None and client_header.name in headers:
        if client_header.name == "forwarded":  # RFC 7239: for=198.51.100.7:4000;proto=https, for="[2001:db8::1]"
            entries = _forwarded_for(headers[client_header.name])
        else:
            entries = headers[client_header.name].split(",")
        if len(entries) >= client_header.hops:
            entry = entries[-client_header.hops].strip()
            if entry:
                return _ip_address(entry) or entry[:MAX_CLIENT_CHARS]
    peer = scope.get("client")
    if not peer:
        return None
    return _ip_address(str(peer[0])) or str(peer[0])


#: One ``name=value`` pair of a ``Forwarded`` element and what ends it: a token or a quoted string (RFC 9110 5.6.4,
#: with ``\\`` escapes), so a ``;`` or ``,`` inside quotes (a ``host="..."`` the client chose) ends nothing.
#: Possessive, so blanks before something other than ``=`` are given back by neither ``\s*``: a run of blanks is
#: read once, in linear time.
_FORWARDED_PAIR = re.compile(r'\s*+([^=;,\s]*+)\s*+=\s*+("(?:[^"\\]|\\.)*+"|[^;,\s]*+)\s*+([;,]|$)')


#: The rest of a ``Forwarded`` element up to the ``,`` that ends it, a quoted string read whole (unclosed: to the end).
_ELEMENT_REST = re.compile(r'(?:"(?:[^"\\]|\\.)*"?|[^",])*')


def _forwarded_elements(value: str) -> list[list[tuple[str, str]]]:
    """The elements of a ``Forwarded`` header (RFC 7239 section 4), each its ``(name, value)`` pairs in order, names
    lower-case and values unquoted; an element without pairs is ``[]``. Quoted strings are read whole, so one cannot
    start another element."""
    out: list[list[tuple[str, str]]] = []
    element: list[tuple[str, str]] = []
    pos = 0
    while pos < len(value):
        match = _FORWARDED_PAIR.match(value, pos)
        if match is None or match.end() == pos:  # not a pair: the rest of this element is skipped, quotes whole
            end = _ELEMENT_REST.match(value, pos).end()  # type: ignore[union-attr]  # matches the empty string too
            out.append(element)
            element, pos = [], end + 1
            continue
        name, raw, sep = match.groups()
        quoted = len(raw) >= 2 and raw[0] == raw[-1] == '"'
        element.append((name.lower(), re.sub(r"\\(.)", r"\1", raw[1:-1]) if quoted else raw))
        pos = match.end()
        if sep != ";":  # "," or the end: the element is over
            out.append(element)
            element = []
    if element:
        out.append(element)
    elif value.rstrip().endswith(","):  # an empty last element, as "6.6.6.6," has in X-Forwarded-For
        out.append([])
    return out


def _forwarded_for(value: str) -> list[str]:
    """The ``for=`` value of each element of a ``Forwarded`` header, in order: ``198.51.100.7:4000``,
    ``[2001:db8::1]:443``, ``unknown``, ``_hidden``; ``""`` for an element without one (the first ``for=`` of an
    element counts)."""
    return [next((v for name, v in element if name == "for"), "") for element in _forwarded_elements(value)]


_RACK_FORWARDED_SPLIT = re.compile(r"[;,\n]")


def _rack_host(piece: str) -> str | None:
    """The value of a ``host=`` pair as Rack's ``forwarded_values`` reads one, after splitting the header at every
    ``;``, ``,`` and line break, quoted or not: spaces around the name and the value dropped, then an opening quote,
    and the value ends at the next quote (Rack's ``"?([^"]+)"?``); ``None`` for another pair or an empty value. Plain
    string operations: a regular expression with three runs that all match spaces backtracked in cubic time (a
    1.6 KB header took 4.5 s)."""
    name, equals, value = piece.partition("=")
    if not equals or name.strip().lower() != "host":
        return None
    value = value.strip()
    return value.removeprefix('"').partition('"')[0] or None


def forwarded_hosts(value: str) -> list[str]:
    """Every ``host=`` value of a ``Forwarded`` header (``api.example.com``, ``"[2001:db8::1]:8443"`` unquoted), in
    order: what an application behind a trusting proxy may take for the host the client asked for. Read as RFC 7239
    reads it (quoted strings whole), then as Rack reads it (split at every ``;`` and ``,``, quotes ignored), so
    ``for="x;host=evil.example"`` gives ``evil.example`` too; each value once."""
    hosts = [v for element in _forwarded_elements(value) for name, v in element if name == "host"]
    rack = (host for piece in _RACK_FORWARDED_SPLIT.split(value) if (host := _rack_host(piece)) is not None)
    return hosts + [host for host in dict.fromkeys(rack) if host not in hosts]


@functools.lru_cache(maxsize=4096)  # on every request: the same few addresses, parsed once each
def _ip_address(text: str) -> str | None:
    """``text`` as the one spelling :mod:`ipaddress` gives its IP address (an IPv4-mapped IPv6 address as IPv4; a
    port after an IPv4 address or a bracketed IPv6 one dropped, and an IPv6 zone: ``fe80::1%eth0``), or ``None`` when
    it is not one."""
    host = text
    if text.startswith("[") and "]" in text:
        host = text[1 : text.index("]")]
    elif text.count(":") == 1:
        host = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def head_subject(
    scope: Scope, headers: dict[str, str], client_header: ClientHeader | None, path: str | None = None
) -> HttpSubject:
    """The subject without its parsed query or body: everything a policy's ``match`` may look at; ``path`` replaces the
    scope's (the matching view of it, ``GuardMiddleware(path_case=..., trailing_slash=...)``), which is then kept as
    ``sent_path`` where it differs."""
    client = client_address(scope, headers, client_header)
    media = media_type(headers.get("content-type", ""))
    return HttpSubject(
        method=scope["method"].upper(),
        path=scope["path"] if path is None else path,
        query_string=scope.get("query_string", b"").decode("latin-1"),
        headers=headers,
        host=_host(headers, scope),
        client=client,
        content_type=media,
        repeated_headers=_repeated_names(scope, headers),
        sent_path=scope["path"] if path not in (None, scope["path"]) else "",
    )


def _repeated_names(scope: Scope, headers: dict[str, str]) -> tuple[str, ...]:
    """The names (lower-case, ``_`` read as ``-``, sorted) of the headers ``scope`` holds more than once, or spelled
    with ``_``: a WSGI server names ``x_user`` and ``x-user`` alike (``HTTP_X_USER``), so an application behind one
    reads ``x_user: mallory`` as the ``x-user`` a policy reads. ``headers`` is its :func:`header_map`, one entry per
    name, so equal counts and no ``_`` mean none."""
    raw = scope["headers"]
    if len(raw) == len(headers) and not any(b"_" in name for name, _ in raw):
        return ()
    seen: set[str] = set()
    repeated: set[str] = set()
    for raw_name, _ in raw:
        name = raw_name.decode("latin-1").lower()
        folded = name.replace("_", "-")
        if folded in seen or folded != name:
            repeated.add(folded)
        seen.add(folded)
    return tuple(sorted(repeated))


def with_body(head: HttpSubject, query: dict[str, list[str]], body: Any, body_text: str,
              received: bytes) -> HttpSubject:
    """A new subject: ``head`` with its query and body (``body`` and ``body_text`` parsed from ``received``, the body
    as the application reads it); a urlencoded body holding ``]=`` (or ``%5D=``, which qs reads so) is kept as its
    ``form_string`` too."""
    # ']' first (a byte search): a body a browser or urlencode() writes has none, and a two-byte search costs more
    form = head.content_type == "application/x-www-form-urlencoded" and (
        (b"]" in received and b"]=" in received) or b"%5D=" in received or b"%5d=" in received)
    return HttpSubject(
        method=head.method,
        path=head.path,
        query=query,
        query_string=head.query_string,
        headers=head.headers,
        host=head.host,
        client=head.client,
        content_type=head.content_type,
        body=body,
        body_text=body_text,
        form_string=received.decode("latin-1") if form else "",
        repeated_headers=head.repeated_headers,
        sent_path=head.sent_path,
    )


def subject_summary(subject: HttpSubject, body: bytes, tenant: str | None = None) -> dict[str, Any]:
    """What a reviewer sees of the held request besides the state: method, path and ``path_note``
    (:func:`shown_path`), query (:func:`shown_query`), host, client, tenant, media type, the headers a release replays
    (:func:`shown_headers`), ``headers_note`` (the host's, client's, tenant's and the headers' characters shown
    percent-encoded, as the path's are, from the bytes sent) and ``body``, the held body
    (:func:`~guard.asgi._body_view.shown_body`)."""
    path, note = shown_path(subject)
    texts = [subject.host, subject.client or "", tenant or "",
             *(text for pair in shown_headers(subject).items() for text in pair)]
    shown = [_percent_shown(_as_sent(text), _TEXT_SAFE) for text in texts]  # host, client, tenant, then the headers
    headers = {name[0]: value[0] for name, value in zip(shown[3::2], shown[4::2], strict=True)}
    count, invisible = sum(item[1] for item in shown), sum(item[2] for item in shown)
    return {
        "kind": "http",
        "method": subject.method,
        "path": path,
        "path_note": note,
        "query": shown_query(subject),
        "host": shown[0][0],
        "client": shown[1][0] if subject.client is not None else None,
        "tenant": shown[2][0] if tenant is not None else None,
        "content_type": subject.content_type,
        "headers": headers,
        "headers_note": _encoded_note("the host, client, tenant and headers", count, invisible),
        "body": shown_body(subject, body),
    }


#: What a path shows as itself besides letters, digits and ``_.-~`` (RFC 3986 ``pchar`` and ``/``).
_PATH_SAFE = "/!$&'()*+,;=:@"
#: What a host or header shows as itself: printable ASCII but ``%``.
_TEXT_SAFE = "".join(chr(code) for code in range(0x20, 0x7F) if chr(code) != "%")


def shown_path(subject: HttpSubject) -> tuple[str, str | None]:
    """The held request's path as sent (not the view policies matched) as a reviewer sees it, percent-encoded as the
    query is (``/v1/%E2%80%AEtxt.exe/echo``: a bidi control or a zero-width character cannot turn it around or hide
    in it), and a note saying how many characters are shown encoded and how many of them are invisible or format
    characters; ``None`` when every character is shown as itself (``%`` is always shown as ``%25``)."""
    path, count, invisible = _percent_shown(subject.sent_path or subject.path, _PATH_SAFE)
    return path, _encoded_note("the path", count, invisible)


def _as_sent(text: str) -> bytes:
    """The bytes of header text (the host, a header, a client or tenant read from one): ASGI gives them as latin-1
    characters, one per byte; text that is not (a tenant a function made up) as UTF-8."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


def _percent_shown(text: str | bytes, safe: str) -> tuple[str, int, int]:
    """``text`` (a ``str`` as UTF-8, ``bytes`` as they are) percent-encoded but for ASCII letters, digits, ``_.-~``
    and ``safe`` (``%`` always encoded), how many characters other than ``%`` it encodes, and how many of those are
    invisible or format characters (bytes are counted as the characters they are in UTF-8, or in latin-1, as ASGI
    applications read headers, when they are not UTF-8)."""
    chars = _characters(text) if isinstance(text, bytes) else text
    encoded = [char for char in chars if char != "%" and quote(char, safe=safe) != char]
    return quote(text, safe=safe), len(encoded), sum(1 for char in encoded if INVISIBLE.fullmatch(char))


def _characters(raw: bytes) -> str:
    """``raw`` read as UTF-8, or as latin-1 when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _encoded_note(what: str, count: int, invisible: int) -> str | None:
    """The note on ``count`` characters of ``what`` shown percent-encoded (``invisible`` of them invisible or format
    characters); ``None`` for none."""
    if not count:
        return None
    note = f"{count} {'character' if count == 1 else 'characters'} of {what} shown percent-encoded"
    if invisible:
        note += f" ({invisible} invisible or format: bidi, zero-width, tag)"
    return note


def shown_headers(subject: HttpSubject) -> dict[str, str]:
    """The headers a release replays, as a reviewer sees them (name -> value; an approval releases them too, so an
    ``x-role: admin`` is seen before it is approved): the credential headers are left out (the releasing request
    brings its own), a credential-named one's value is ``[redacted]`` (:func:`~guard.engine.telemetry.credential_name`:
    ``x-functions-key`` too), and the request's secret values are replaced by ``[redacted]`` wherever a header
    repeats them (:func:`redact_secrets`)."""
    held = [(name, value) for name, value in subject.headers.items()
            if name.encode("latin-1") not in UNBOUND_HEADERS and not is_credential(name.encode("latin-1"))]
    # secrets from the credential headers and credential-named ones only: the log's rule that any long header value
    # may be one would hide the very values (x-role: organization-admin) the reviewer approves
    credentials = {name: value for name, value in subject.headers.items() if is_credential(name.encode("latin-1"))}
    return dict(_shown_pairs(held, dataclasses.replace(subject, headers=credentials)))


def shown_query(subject: HttpSubject) -> str:
    """The subject's query string as a reviewer sees it (``role=admin&api_key=[redacted]``): every parameter, a
    credential-named one (:func:`~guard.engine.telemetry.credential_name`: ``subscription-key``, ``code`` too) with its
    value replaced by ``[redacted]``, and the request's secret values (those parameters', the credential headers') replaced by ``[redacted]`` wherever
    another parameter repeats them, as the item's state is redacted (:func:`redact_secrets`). Percent-encoded, so a
    value cannot pass for another parameter; ``""`` without a query."""
    pairs = [(name, value) for name, values in subject.query.items() for value in values]
    return urlencode(_shown_pairs(pairs, subject), quote_via=quote, safe="[]")


def _shown_pairs(pairs: list[tuple[str, str]], subject: HttpSubject) -> list[tuple[str, str]]:
    """``(name, value)`` pairs as a reviewer sees them: the value of one named like a credential
    (:func:`~guard.engine.telemetry.credential_name`) or shaped like one (``Bearer ...``:
    :func:`~guard.engine.telemetry.credential_value`) ``[redacted]``, and ``subject``'s secret values
    (:func:`redact_secrets`) and those of the credential-named pairs replaced by ``[redacted]`` wherever a value
    repeats them."""
    secret = [credential_name(name) or credential_value(value) for name, value in pairs]
    masked = [[name, "[redacted]" if hidden else value] for (name, value), hidden in zip(pairs, secret, strict=True)]
    secrets = [value for (_, value), hidden in zip(pairs, secret, strict=True) if hidden and value]
    return [(name, value) for name, value in redact_secrets(masked, subject, secrets)]


def held_request(scope: Scope, body: bytes, bound: dict[str, Any]) -> dict[str, Any]:
    """Everything needed to replay the request later, minus credentials and hop-by-hop headers (JSON-safe), and
    ``bound``: which headers and fields the release digest covers (``_reviews.binding``)."""
    return {
        "bound": bound,
        "method": scope["method"],
        "path": scope["path"],
        "raw_path": (scope.get("raw_path") or scope["path"].encode("utf-8")).decode("latin-1"),
        "query_string": scope.get("query_string", b"").decode("latin-1"),
        "headers": [
            [k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]
            if k.lower() not in UNBOUND_HEADERS and not is_credential(k)
        ],
        "body_b64": base64.b64encode(body).decode("ascii"),
    }
