"""Request header fields that hold one value, read as one: a credential header (``Authorization``) sent twice is
refused rather than read as its first or last copy.

A field that is not a list (RFC 9110 section 5.3; ``Authorization`` carries one credential, section 11.6.2) sent more
than once is ambiguous: a front proxy or WAF that checks or strips one copy while guard reads another would let one
client's credential stand for another's. The answer is 400 ``repeated_header``, the code guard's other single-value
headers use, never 401: the request is malformed rather than unauthenticated, no credential in it was compared (so
the answer tells nothing of any key), and a 401 with ``WWW-Authenticate`` would ask the client to send a credential
it already sent twice.

Also the ``Host`` and ``Content-Type`` values as guard matches them (:func:`host_name`, :func:`media_type`), which the
middleware judges requests with and the policy loader checks a rule's literals against.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from guard.errors import BodyError

__all__ = ["REPEATED_HEADER", "host_name", "media_type", "sole_header"]

REPEATED_HEADER = "repeated_header"


def sole_header(headers: Iterable[tuple[bytes, bytes]], name: str, *, wsgi_alike: bool = False) -> bytes | None:
    """The one value of header ``name`` in an ASGI scope's ``headers`` (names compared case-insensitively, and with
    ``wsgi_alike`` ``_`` read as ``-``: a WSGI server names ``x_tenant`` and ``x-tenant`` alike, ``HTTP_X_TENANT``),
    or ``None`` when the request does not send it.

    Raises:
        BodyError: 400 :data:`REPEATED_HEADER` (``field``: ``name`` lower-cased) when the request sends it more than
            once.
    """
    key = name.lower().encode("latin-1")
    if wsgi_alike:
        key = key.replace(b"_", b"-")
        values = [value for k, value in headers if k.lower().replace(b"_", b"-") == key]
    else:
        values = [value for k, value in headers if k.lower() == key]
    if len(values) > 1:
        raise BodyError(400, REPEATED_HEADER, f"the {name.lower()} header is sent more than once; send it once",
                        field=name.lower())
    return values[0] if values else None


@functools.lru_cache(maxsize=64)
def host_name(host: str) -> str:
    """A ``Host`` value as the middleware matches it (lower-case, without port and trailing dot: ``API.example.com.:443``
    -> ``api.example.com``), which ``guard policy test`` reads a case's host with too; remembered (a service answers
    to a handful of names, and this runs for every request)."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        return host[: host.find("]") + 1]
    host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return host.removesuffix(".")


@functools.lru_cache(maxsize=64)
def media_type(value: str) -> str:
    """The media type of a ``Content-Type`` value without its parameters, lower-case (``"application/json"``).
    Remembered: a service sees a handful of values, and this runs for every request."""
    return value.partition(";")[0].strip().lower()
