"""URLs as logs, errors and spans name them; what a request path may not hold (``guard/asgi/_target.py`` refuses it,
and the policy loader refuses a path glob that could only match it)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["REFUSED_PATH_ESCAPES", "is_path_control", "shown_url"]

#: Bytes a request path may not send percent-encoded, with what they are: servers read an encoded slash or backslash
#: differently (some decode it before routing, some after), so such a request is refused (400 ``invalid_target``).
REFUSED_PATH_ESCAPES: dict[int, str] = {0x2F: "an encoded slash", 0x5C: "an encoded backslash"}


def is_path_control(code: int) -> bool:
    """Whether the code point (or byte) ``code`` is a control character a request path may not hold, raw or
    percent-encoded: U+0000-U+001F and DEL (U+007F)."""
    return code < 0x20 or code == 0x7F


def shown_url(url: str) -> str:
    """``url`` without userinfo (``user:password@``), query and fragment, which can hold credentials;
    ``[unparsable URL]`` when :func:`urllib.parse.urlsplit` refuses what is left.

    A password typed without percent-encoding may hold ``/``, ``?``, ``#`` or ``@``, which end the authority as a URL
    parser reads it, so the rest of the password would be read as host, path or fragment. Where the authority (the
    text after ``://`` up to the first of those) holds a ``:`` or an ``@``, and so may hold a password, everything up
    to the URL's last ``@`` is cut before it is parsed. An authority with neither holds no password, and an ``@``
    after it is the path's (Workers AI's ``/@cf/``)."""
    scheme, sep, rest = url.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if sep and (":" in authority or "@" in authority):
        url = scheme + sep + rest.rpartition("@")[2]
    try:
        parts = urlsplit(url)
    except ValueError:
        return "[unparsable URL]"
    return parts._replace(query="", fragment="").geturl()
