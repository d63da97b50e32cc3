"""Request header fields that hold one value, read as one: a credential header (``Authorization``) sent twice is
refused rather than read as its first or last copy.

A field that is not a list (RFC 9110 section 5.3; ``Authorization`` carries one credential, section 11.6.2) sent more
than once is ambiguous: a front proxy or WAF that checks or strips one copy while guard reads another would let one
client's credential stand for another's. The answer is 400 ``repeated_header``, the code guard's other single-value
headers use, never 401: the request is malformed rather than unauthenticated, no credential in it was compared (so
the answer tells nothing of any key), and a 401 with ``WWW-Authenticate`` would ask the client to send a credential
it already sent twice.
"""

from __future__ import annotations

from collections.abc import Iterable

from guard.errors import BodyError

__all__ = ["REPEATED_HEADER", "sole_header"]

REPEATED_HEADER = "repeated_header"


def sole_header(headers: Iterable[tuple[bytes, bytes]], name: str) -> bytes | None:
    """The one value of header ``name`` in an ASGI scope's ``headers`` (names compared case-insensitively), or
    ``None`` when the request does not send it.

    Raises:
        BodyError: 400 :data:`REPEATED_HEADER` (``field``: ``name`` lower-cased) when the request sends it more than
            once.
    """
    key = name.lower().encode("latin-1")
    values = [value for k, value in headers if k.lower() == key]
    if len(values) > 1:
        raise BodyError(400, REPEATED_HEADER, f"the {name.lower()} header is sent more than once; send it once",
                        field=name.lower())
    return values[0] if values else None
