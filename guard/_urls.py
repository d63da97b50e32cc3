"""URLs as logs, errors and spans name them; what a request path may not hold (``guard/asgi/_target.py`` refuses it,
and the policy loader refuses a path glob that could only match it); ``%uXXXX`` escapes as IIS and ASP.NET read
them."""

from __future__ import annotations

import re
from urllib.parse import SplitResult, urlsplit

from guard._json import surrogates_joined

__all__ = [
    "PERCENT_U_RE",
    "REFUSED_PATH_ESCAPES",
    "is_path_control",
    "named_url",
    "password_unclear",
    "percent_u_decoded",
    "shown_url",
    "split_url",
]

#: A ``%uXXXX`` escape: one UTF-16 code unit, which IIS and classic ASP.NET (``HttpUtility.UrlDecode``, behind
#: ``Request.QueryString`` and ``Request.Form``) decode beside ``%XX`` (``%u003Cscript%u003E`` is ``<script>``).
PERCENT_U_RE = re.compile(r"%[uU]([0-9A-Fa-f]{4})")

#: Bytes a request path may not send percent-encoded, with what they are: servers read an encoded slash or backslash
#: differently (some decode it before routing, some after), so such a request is refused (400 ``invalid_target``).
REFUSED_PATH_ESCAPES: dict[int, str] = {0x2F: "an encoded slash", 0x5C: "an encoded backslash"}


def is_path_control(code: int) -> bool:
    """Whether the code point (or byte) ``code`` is a control character a request path may not hold, raw or
    percent-encoded: U+0000-U+001F and DEL (U+007F)."""
    return code < 0x20 or code == 0x7F


#: A URL's host and port as a URL parser reads them (after the userinfo's last ``@``): a name or an IP literal in
#: brackets, then a port of digits, if any.
_HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:\[\]]*)(:[0-9]*)?")
#: A URL's scheme (RFC 3986): a letter, then letters, digits, ``+``, ``-`` and ``.``.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
#: An ``@`` a path holds as its own: one that starts a path segment (Workers AI's ``/@cf/``, an npm scope's ``/@org/``).
_PATH_AT = re.compile(r"/@")


def _split(url: str) -> tuple[str, str, str, str, str] | None:
    """``url`` as a URL parser splits it: scheme, authority (after ``://`` up to the first ``/``, ``?`` or ``#``), path,
    query and fragment; ``None`` when it has no ``://``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    path, _, fragment = rest[len(authority) :].partition("#")
    path, _, query = path.partition("?")
    return scheme, authority, path, query, fragment


def password_unclear(url: str) -> bool:
    """Whether a password in ``url`` may hold a ``/``, ``?`` or ``#`` not percent-encoded, so that where its
    authority ends (and its host starts) cannot be told: an ``@`` follows the authority a URL parser reads, and that
    authority is not a well-formed ``[userinfo@]host[:port]`` (a ``unix://`` URL's holds no host), or the ``@`` is not
    one the rest holds as its own. Its own: any ``@`` of a ``unix://`` URL's socket path or query; elsewhere an ``@``
    that starts a path segment (``/@cf/``) or is in the value of a query's ``name=value`` pair
    (``?client_name=web@1``). An ``@`` in a fragment, or inside a path segment, may end a password
    (``redis://user:pa/ss@host/0``, ``redis://user/pass@host/0``)."""
    parts = _split(url)
    if parts is None or "@" not in "".join(parts[2:]):
        return False
    scheme, authority, path, query, fragment = parts
    host = authority.rpartition("@")[2]
    if scheme.lower() == "unix":
        return host != ""
    pairs = re.split(r"[&;]", query)
    return (not _HOST_PORT.fullmatch(host) or "@" in fragment or "@" in _PATH_AT.sub("/", path)
            or any("@" in pair.partition("=")[0] or "=" not in pair for pair in pairs if "@" in pair))  # fmt: skip


def _port_unclear(authority: str) -> bool:
    """Whether what follows the host in ``authority`` (after its userinfo's last ``@``) is not a port from 0 to
    65535, as when a password is given without its ``@`` and host (``redis://user:password``, or
    ``redis://user:123456``: a URL parser reads the password as the port); a host in brackets (an IP literal) is left
    to the URL parser."""
    host = authority.rpartition("@")[2]
    if "[" in host:
        return False
    match = _HOST_PORT.fullmatch(host)
    if match is None:
        return True
    digits = (match.group(2) or ":")[1:].lstrip("0")
    return len(digits) > 5 or int(digits or 0) > 65535


def split_url(url: str) -> SplitResult:
    """:func:`urllib.parse.urlsplit` of ``url``, its port checked (urlsplit checks it only when it is read).

    Raises:
        ValueError: with a message that quotes no part of ``url``, as urlsplit's own quote what they refuse: a
            password, when its ``@`` and host were left out, is read as the port (``https://user:password``), or as
            an IP literal (``https://user:[password]``); a netloc whose NFKC form holds ``/``, ``?``, ``#``, ``@`` or
            ``:`` is quoted whole, password included.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError("it does not parse as a URL (a '[' or ']' not around an IP address, or a character whose "
                         "NFKC form is '/', '?', '#', '@' or ':' before the path)") from None
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when it is read
    except ValueError:
        raise ValueError("its port is not a number from 0 to 65535 (a password goes before an '@' and the host: "
                         "scheme://user:password@host:port/)") from None
    return parts


def percent_u_decoded(text: str) -> str:
    """``text`` with its ``%uXXXX`` escapes (:data:`PERCENT_U_RE`) decoded, a surrogate pair joined into its
    character and a lone surrogate read as U+FFFD; ``%XX`` escapes are left as they are."""
    if "%" not in text:
        return text
    return surrogates_joined(PERCENT_U_RE.sub(lambda escape: chr(int(escape.group(1), 16)), text))


def shown_url(url: str) -> str:
    """``url`` without userinfo (``user:password@``), query and fragment, which can hold credentials;
    ``scheme://[hidden]`` when a password in it may hold a ``/``, ``?`` or ``#`` not percent-encoded
    (:func:`password_unclear`: a URL parser would read part of it as host, path, query or fragment, so no part of the
    URL is shown), or when its port is not a number from 0 to 65535 (``redis://user:password``, the ``@`` and host
    left out: the password is read as the port); ``[hidden]`` when it has an ``@`` but no ``scheme://``
    (``user:password@host``: no userinfo to drop); ``[unparsable URL]`` when :func:`urllib.parse.urlsplit` refuses
    what is left."""
    parts = _split(url)
    if (parts is None or not _SCHEME.fullmatch(parts[0])) and "@" in url:
        return "[hidden]"
    if parts is not None:
        scheme, authority, path, _, _ = parts
        if password_unclear(url) or _port_unclear(authority):
            return f"{scheme}://[hidden]"
        url = f"{scheme}://{authority.rpartition('@')[2]}{path}"
    try:
        split = urlsplit(url)
    except ValueError:
        return "[unparsable URL]"
    return split._replace(query="", fragment="").geturl()


def named_url(text: str) -> str:
    """``text``, a URL or an option's value that may hold one, as a message names it: as given, or as
    :func:`shown_url` shows it when it may hold a password (an ``@``, or a port that is not one:
    ``redis://user:password``)."""
    parts = _split(text)
    return shown_url(text) if "@" in text or (parts is not None and _port_unclear(parts[1])) else text
