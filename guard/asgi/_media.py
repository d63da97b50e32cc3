"""Media types, their parameters and the charsets guard reads (``Content-Type``, multipart part headers).

The guard must read a body exactly as the application does, or refuse it. Two places where readers disagree are
handled here:

* **Parameters** (RFC 9110 5.6.6) are parsed strictly: ``name=token`` or ``name="quoted string"``. Refused with 400
  ``invalid_content_type``: a parameter without ``=``, a value that is neither a token nor one quoted string, a
  repeated parameter (parsers differ on which one wins), any backslash inside a quoted value (RFC 9110 reads
  ``\\c`` as ``c`` and python-multipart, which Starlette uses, keeps the backslash; python-multipart also takes
  every ``\\"`` as an escaped quote, so RFC 9110 reads ``x="\\\\"; y="; boundary=B; z="`` as parameters x, y and z,
  python-multipart as x, boundary=B and z), and the RFC 2231 form (``boundary*=``, ``charset*=``, ``name*=``) of a
  parameter guard reads (python-multipart ignores it, others use it).
* **Charsets**: a judged text body is read as UTF-8 or US-ASCII only (:data:`UTF8_LABELS`, :data:`ASCII_LABELS`).
  Any other declared charset is a 415 ``unsupported_charset``: a body declared ``utf-16-le`` but holding ASCII JSON
  reads as garbage in UTF-16 and as an attack to an application that ignores the label, and the converse; codecs
  such as ``rot13``, ``base64`` or ``punycode`` are not text encodings at all. An XML body whose declaration names
  another encoding (``<?xml version="1.0" encoding="UTF-7"?>``) is refused the same way.
"""

from __future__ import annotations

import re

from guard._headers import media_type
from guard.errors import BodyError

__all__ = [
    "ASCII_LABELS",
    "READ_PARAMS",
    "UNSUPPORTED_CHARSET",
    "UTF8_LABELS",
    "charset",
    "charset_guessed",
    "check_html_charset",
    "check_html_escapes",
    "check_xml_encoding",
    "is_textual",
    "media_type",
    "parse_params",
]

UNSUPPORTED_CHARSET = "unsupported_charset"
UTF8_LABELS = frozenset(
    {"utf-8", "utf8", "unicode-1-1-utf-8", "unicode11utf8", "unicode20utf8", "x-unicode20utf8", "csutf8"}
)
"""Labels read as UTF-8 (the WHATWG Encoding labels for UTF-8, plus IANA's ``csUTF8``), compared lower-case."""
ASCII_LABELS = frozenset(
    {
        "us-ascii",
        "ascii",
        "iso646-us",
        "ansi_x3.4-1968",
        "ansi_x3.4-1986",
        "iso_646.irv:1991",
        "iso-ir-6",
        "us",
        "ibm367",
        "cp367",
        "csascii",
        "646",
    }
)
"""Labels read as US-ASCII (IANA's aliases), strictly: a byte above 0x7F is a 400."""
READ_PARAMS = frozenset({"boundary", "charset", "name"})
"""Parameters guard reads; their RFC 2231 ``name*`` forms are refused rather than ignored."""

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TEXTUAL_PREFIXES = (
    "text/",
    "application/json",  # also application/jsonl and application/json-seq
    "application/x-ndjson",
    "application/ndjson",
    "application/x-jsonlines",
    "application/jsonlines",
    "application/xml",
    "application/x-yaml",
    "application/yaml",
    "application/graphql",
)
_HTML_META_CHARSET = re.compile(rb"<meta\b[^>]*?\bcharset\s*=\s*[\"']?\s*([A-Za-z0-9_.:-]+)", re.IGNORECASE)
_XML_DECL = re.compile(rb"<\?xml[^>]{0,200}?encoding\s*=\s*[\"']([^\"']{0,40})[\"']")


def _bad(reason: str, field: str) -> BodyError:
    return BodyError(400, "invalid_content_type", reason, field=field)


def _quoted(value: str, start: int, field: str) -> tuple[str, int]:
    """The quoted string starting at ``value[start] == '"'`` and the index after its closing quote.

    Raises:
        BodyError: 400 ``invalid_content_type`` for a backslash in it (parsers disagree on what it escapes and so on
            where the value ends) or a missing closing quote.
    """
    end = value.find('"', start + 1)
    if end < 0:
        raise _bad("a quoted parameter value has no closing quote", field)
    text = value[start + 1 : end]
    if "\\" in text:
        raise _bad(
            f"a quoted parameter value has a backslash ({value[start : end + 1][:40]}); parsers disagree on what it "
            "escapes and where the value ends",
            field,
        )
    return text, end + 1


def parse_params(value: str, field: str = "content-type") -> tuple[str, dict[str, str]]:
    """Split a header value like ``form-data; name="a;b"; filename=x`` into (``"form-data"``, params), strictly.

    Parameter names are lower-cased. See the module docstring for what is refused.

    Args:
        value: the header value.
        field: the field named in errors (``content-type``, ``body.<part>``).

    Raises:
        BodyError: 400 ``invalid_content_type``.
    """
    head, sep, rest = value.partition(";")
    params: dict[str, str] = {}
    i, n = 0, len(rest)
    while sep and i < n:
        while i < n and rest[i] in " \t;":
            i += 1
        if i >= n:
            break
        eq = rest.find("=", i)
        semi = rest.find(";", i)
        if eq < 0 or (0 <= semi < eq):
            raise _bad(f"the parameter {rest[i : semi if semi >= 0 else n].strip()[:40]!r} has no value", field)
        name = rest[i:eq].strip(" \t").lower()  # only what HTTP calls whitespace: str.strip() also drops \x0c, \x85
        if not _TOKEN.fullmatch(name):
            raise _bad(f"the parameter name {name[:40]!r} is not a token", field)
        i = eq + 1
        while i < n and rest[i] in " \t":
            i += 1
        if i < n and rest[i] == '"':
            text, i = _quoted(rest, i, field)
        else:
            end = rest.find(";", i)
            end = n if end < 0 else end
            text = rest[i:end].strip(" \t")
            if not _TOKEN.fullmatch(text):
                raise _bad(
                    f"the parameter {name[:40]!r} has the value {text[:40]!r}, which is neither a token nor a "
                    "quoted string",
                    field,
                )
            i = end
        while i < n and rest[i] in " \t":
            i += 1
        if i < n and rest[i] != ";":
            raise _bad(f"the parameter {name[:40]!r} has text after its value", field)
        if name in params:
            raise _bad(f"the parameter {name[:40]!r} is repeated; parsers differ on which one counts", field)
        base, star, _ = name.partition("*")
        if star and base in READ_PARAMS:
            raise _bad(
                f"the parameter {name[:40]!r} uses the RFC 2231 form, which parsers read differently; send {base}=...",
                field,
            )
        params[name] = text
    return head.strip().lower(), params


def charset(params: dict[str, str], field: str = "content-type") -> str:
    """The charset a judged text body is read with: ``"utf-8"`` (also when none is declared) or ``"ascii"``.

    Raises:
        BodyError: 415 ``unsupported_charset`` for any other label.
    """
    label = params.get("charset")
    if label is None:
        return "utf-8"
    name = label.strip().lower()
    if name in UTF8_LABELS:
        return "utf-8"
    if name in ASCII_LABELS:
        return "ascii"
    raise BodyError(
        415,
        UNSUPPORTED_CHARSET,
        f"charset {name[:40]!r} cannot be inspected; send the text as UTF-8 (or US-ASCII)",
        field=field,
    )


def is_textual(media: str) -> bool:
    """Media types read and judged as text: ``text/*``, JSON (JSON Lines too), XML, YAML, GraphQL, and ``+json`` /
    ``+xml`` types."""
    return media.startswith(_TEXTUAL_PREFIXES) or media.endswith(("+json", "+xml"))


def check_html_charset(body: bytes, field: str = "body", *, partial: bool = False) -> None:
    """Refuse an HTML body (sent without a ``charset`` parameter) whose ``<meta charset>`` or ``<meta
    http-equiv="content-type">`` in its first 1,024 bytes names a charset other than UTF-8 or US-ASCII: a browser
    decodes it with that charset (the HTML encoding prescan), so ``SE\x1b(BCRET`` reads as ``SECRET`` in
    ISO-2022-JP. One holding an ESC byte anywhere is refused too (:func:`check_html_escapes`). ``partial``: ``body``
    is the start of a stream whose next bytes may continue a label that runs to its end (``charset="utf``), so such
    a label is read once more bytes come, not now.

    Raises:
        BodyError: 415 ``unsupported_charset``.
    """
    check_html_escapes(body, field)
    head = body[:1024]
    match = _HTML_META_CHARSET.search(head)
    if match is not None and not (partial and match.end() == len(head)):
        _refuse_unread_label(match.group(1), "the HTML names charset {!r} in a <meta> tag", "send it as UTF-8", field)


def charset_guessed(media: str, params: dict[str, str]) -> bool:
    """Whether a browser picks the charset of a body itself: HTML, plain text or an untyped body (``media`` ``""``,
    which a browser sniffs as HTML when it starts like HTML), sent without a ``charset`` parameter. Such bytes holding
    an ESC byte are refused (:func:`check_html_escapes`)."""
    return media in ("", "text/html", "text/plain") and "charset" not in params


def check_html_escapes(body: bytes, field: str = "body") -> None:
    """Refuse bytes whose charset a browser picks itself (:func:`charset_guessed`) that hold an ESC byte (0x1B):
    ISO-2022-JP reads ``ESC ( B`` as a switch that shows nothing, and a browser may pick it past the 1,024 bytes a
    ``<meta>`` is looked for in (a later ``<meta>``, or its own detection), so ``SE\x1b(BCRET`` would show
    ``SECRET``. UTF-8 text has no use for the byte; the charsets that read ASCII bytes as they are (Shift_JIS, GBK,
    ...) cannot show a letter the UTF-8 reading lacks.

    Raises:
        BodyError: 415 ``unsupported_charset``.
    """
    if b"\x1b" in body:
        raise BodyError(415, UNSUPPORTED_CHARSET, "the text holds an ESC byte (0x1B), which ISO-2022-JP reads as a "
                        "hidden switch, and names no charset, so a browser may pick one; send it as UTF-8 with "
                        "charset=utf-8 in the Content-Type", field=field)


def check_xml_encoding(body: bytes, field: str = "body") -> None:
    """Refuse an XML body whose declaration names an encoding other than UTF-8 or US-ASCII (an XML parser would
    decode it with that encoding, whatever the ``Content-Type`` says).

    Raises:
        BodyError: 415 ``unsupported_charset``.
    """
    start = body.lstrip(b"\xef\xbb\xbf \t\r\n")[:256]
    if not start.startswith(b"<?xml"):
        return
    match = _XML_DECL.match(start)
    if match is not None:
        _refuse_unread_label(match.group(1), "the XML declaration names encoding {!r}", "send the document as UTF-8",
                             field)  # fmt: skip


def _refuse_unread_label(raw: bytes, where: str, fix: str, field: str) -> None:
    """Raise 415 ``unsupported_charset`` when the charset label ``raw`` a document names for itself is not UTF-8 or
    US-ASCII (``where``: how the message names it, with ``{!r}`` for the label; ``fix``: what to do)."""
    name = raw.decode("latin-1").strip().lower()
    if name not in UTF8_LABELS and name not in ASCII_LABELS:
        raise BodyError(415, UNSUPPORTED_CHARSET, f"{where.format(name[:40])}, which cannot be inspected; {fix}",
                        field=field)  # fmt: skip
