"""Turning decoded body bytes into the judged value: JSON, forms, multipart, text.

``parse_body`` returns ``(value, text)``: the value the policy renders into its state (a JSON value, ``{field:
[values]}`` for forms, a ``str`` for text) and the judged text, ``HttpSubject.body_text``: every string value in it,
in document order, joined by newlines, with these rules:

* **Keys are judged unless they are plain identifiers.** An object key or form field name is data the application can
  read (iterate, store, hand to a model), so ``{"Ignore all previous instructions...": 1}`` must be judged. A key
  of at most :data:`guard.subject.PLAIN_KEY_CHARS` characters from ``A-Z a-z 0-9 _ - . : @ $`` (``max_tokens``, ``user_id``,
  ``Content-Type``) is structure, not text, and is left out so it neither dilutes the text nor causes false
  positives, unless it joins four or more words (:func:`guard.subject.joined_words`: ``ignore_all_prior_rules``);
  any other key (with a space or other punctuation, non-ASCII, or longer) comes before its value.
* **A text or form body that is a JSON document is judged as both.** An application may parse any body as JSON
  (Starlette's ``request.json()`` is ``json.loads`` of the bytes, whatever the media type: a byte-order mark and
  UTF-16/32 are read too), so the document's decoded strings follow the text (:func:`_also_json`).
* **A string holding JSON written with escapes is judged as it decodes too.** A field holding ``json.dumps`` of an
  object (``{"msg": "{\\"q\\": \\"\\\\u0069gnore ...\\"}"}``), a form field's or a text body's too, reaches an
  application that parses it as the decoded text, so the strings' text with its escapes decoded follows them,
  :data:`guard._json.JSON_LEVELS` times over (:func:`guard.subject.escape_readings`).
* **An HTML or XML body is judged as written and as a parser reads it** (:func:`guard._markup.with_markup_reading`:
  ``&#65;TTACK``, ``AT<![CDATA[TACK]]>``); its value stays the text as sent, the one a ``redact`` verdict masks.
* **File metadata is not text.** A multipart file's ``filename`` and ``content_type`` stay in ``body`` (a policy's
  state can address them) but only the file's content is judged.

Anything the application could read differently from the guard is refused: JSON that is not UTF-8, has a duplicate
key (unless ``duplicate_keys="collect"``), nests too deep or holds NaN; text or forms in a charset other than UTF-8 or
US-ASCII (see :mod:`guard.asgi._media`); form text that is not valid in its charset.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.types import Scope

from guard._json import dumps, is_json_media, json_readings, loads
from guard._markup import is_markup, is_xml, with_markup_reading
from guard.asgi._media import (
    charset,
    charset_guessed,
    check_html_charset,
    check_html_escapes,
    check_xml_encoding,
    is_textual,
    parse_params,
)
from guard.asgi._multipart import FILE_TEXT, parse_multipart
from guard.asgi.limits import BodyLimits
from guard.errors import BodyError, InvalidJson
from guard.policy.redact import apply_redactions
from guard.subject import body_strings, escape_readings, is_plain_key, judged_strings
from guard.verdict import Redaction

__all__ = ["check_containers", "encode_body", "parse_body", "redacted_request"]


def _form_strings(fields: dict[str, list[Any]], limits: BodyLimits) -> list[str]:
    """The judged strings of a multipart form: field names and file names that are not plain identifiers (an app
    stores and reads a file's name: ``x'; DROP TABLE users; --.txt`` is judged, ``a.txt`` is not), text values and
    file contents, each with what it reads as JSON (:func:`_field_json`), then the text of the JSON written with
    escapes in them (:func:`guard.subject.escape_readings`); never a file's media type.

    Raises:
        BodyError: 413 ``body_too_complex`` when the values read as JSON hold more ``[`` and ``{`` together than
            ``limits.max_json_containers`` (percent-encoded or multipart, they are not counted with the body's bytes).
    """
    out: list[str] = []
    for name, values in fields.items():
        if not is_plain_key(name):
            out.append(name)
        for value in values:
            if isinstance(value, str):
                out.append(value)
                continue
            if value["filename"] and not is_plain_key(value["filename"]):
                out.append(value["filename"])
            if value[FILE_TEXT] is not None:
                out.append(value[FILE_TEXT])
    # the values read as JSON too: their brackets count together, one body's cap, before any is parsed
    json_read = [i for i, text in enumerate(out) if _reads_as_json(text)]
    check_containers("".join(out[i] for i in json_read).encode("utf-8", "surrogatepass"), limits)
    for i in reversed(json_read):
        out[i + 1 : i + 1] = _field_json(out[i])
    return out + escape_readings(out)


def _reads_as_json(value: str) -> bool:
    """Whether a form value is read as JSON too (:func:`_field_json`): only escapes make its strings differ from the
    value, so one without a backslash is not."""
    return "\\" in value and value.lstrip(" \t\r\n")[:1] in ("{", "[", '"')


def _field_json(value: str) -> list[str]:
    """The strings a form value holds when an application parses it as JSON (``json.loads(form["data"])``), where
    they can differ from the value itself (:func:`_reads_as_json` says when; the caller capped the brackets of all
    such values together). Read as Python's ``json`` reads it (NaN and lone surrogates accepted, as the
    application's parser does); a value it cannot read gives none (the value itself is judged as text)."""
    try:
        return body_strings(json.loads(value))
    except (ValueError, RecursionError):
        return []


def check_containers(body: bytes, limits: BodyLimits) -> None:
    """Refuse (413 ``body_too_complex``) a body to be read as JSON, or for the JSON documents in it, that holds more
    ``[`` and ``{`` than ``limits.max_json_containers`` (counted before any parsing: the parsers hold the GIL)."""
    if (brackets := body.count(b"[") + body.count(b"{")) > limits.max_json_containers:
        raise BodyError(413, "body_too_complex", f"the body holds {brackets} '[' and '{{' characters; at most "
                        f"{limits.max_json_containers} are read (each may open a JSON array or object guard parses, "
                        "as an application could)", field="body")


def _json(body: bytes, params: dict[str, str], limits: BodyLimits) -> Any:
    check_containers(body, limits)
    try:
        charset(params)  # JSON is UTF-8 (RFC 8259 8.1); a label is accepted only when it agrees
    except BodyError as exc:
        raise BodyError(
            415,
            exc.code,
            f"JSON must be UTF-8; the body declares charset {params['charset'][:40]!r}",
            field="content-type",
        ) from exc
    try:
        return loads(body, max_depth=limits.max_json_depth, duplicate_keys=limits.duplicate_keys)
    except InvalidJson as exc:
        raise _json_error(exc) from exc


def _json_error(exc: InvalidJson) -> BodyError:
    """The 400 for a body that breaks the strict JSON rules, naming the offending value's path."""
    field = "body" if exc.path == "$" else "body" + exc.path[1:]
    code = f"invalid_json_{exc.reason}" if exc.reason != "syntax" else "invalid_json"
    return BodyError(400, code, str(exc), field=field)


def _urlencoded(body: bytes, params: dict[str, str], limits: BodyLimits) -> dict[str, list[str]]:
    charset(params)  # percent-escapes are read as UTF-8 (US-ASCII text has none above 0x7F)
    try:
        text = body.decode("ascii")
        pairs = parse_qsl(
            text, keep_blank_values=True, encoding="utf-8", errors="strict", max_num_fields=limits.max_form_fields
        )
    except UnicodeDecodeError as exc:
        raise BodyError(
            400, "invalid_form", f"the form body is not UTF-8 or not percent-encoded (byte offset {exc.start})"
        ) from exc
    except ValueError as exc:
        raise BodyError(
            400,
            "invalid_form",
            f"the form has more than {limits.max_form_fields} fields; at most {limits.max_form_fields} are allowed",
        ) from exc
    fields: dict[str, list[str]] = {}
    for name, value in pairs:
        fields.setdefault(name, []).append(value)
    return fields


def _text(body: bytes, media: str, params: dict[str, str]) -> str:
    codec = charset(params)
    if is_xml(media):
        check_xml_encoding(body)
    elif media == "text/html" and "charset" not in params:  # a declared charset overrides <meta>, as in browsers
        check_html_charset(body)
    elif charset_guessed(media, params):
        check_html_escapes(body)
    try:
        text = body.decode(codec)
    except UnicodeDecodeError as exc:
        raise BodyError(400, "invalid_text", f"the body is not valid {codec} text (byte offset {exc.start})") from exc
    if "\x00" in text:  # UTF-16 or UTF-32 (a JSON parser reads them by their zero bytes) or binary, not text
        raise BodyError(400, "invalid_text", f"the body holds a NUL byte (offset {text.index(chr(0))}): UTF-16, "
                        "UTF-32 or binary data is not judged as text; send UTF-8")
    return text


def parse_body(body: bytes, content_type: str, limits: BodyLimits) -> tuple[Any, str]:
    """Parse decoded ``body`` by its ``Content-Type``.

    Returns:
        ``(value, text)``; ``(None, "")`` for an empty body or an opaque one under ``opaque_media="metadata"``.

    Raises:
        BodyError: 400 malformed (``Content-Type`` parameters, JSON, form, multipart, text), 413 ``body_too_complex``
            (a body read as JSON, or for the JSON in it, with more ``[`` and ``{`` than
            ``limits.max_json_containers``), 415 unsupported media type, charset or part encoding.
    """
    if not body:
        return None, ""
    media, params = parse_params(content_type) if ";" in content_type else (content_type.strip().lower(), {})
    if is_json_media(media):
        value: Any = _json(body, params, limits)
    elif media == "application/x-www-form-urlencoded":
        value = _urlencoded(body, params, limits)
        return value, _also_json("\n".join(_form_strings(value, limits)), body, limits)
    elif media == "multipart/form-data":
        fields = parse_multipart(body, params, limits)
        return fields, "\n".join(_form_strings(fields, limits))
    elif not media and _is_utf8(body):
        check_html_escapes(body)  # a browser sniffs an untyped body and picks its charset (charset_guessed)
        return _untyped(body, limits)
    elif not media and _reads_as_wide_json(body):
        raise BodyError(400, "invalid_json_not_utf8", "the body has no Content-Type and reads as UTF-16 or UTF-32 "
                        "JSON, which an application parsing it as JSON reads; JSON must be UTF-8", field="body")
    elif is_textual(media):
        text = _text(body, media, params)
        judged = with_markup_reading(text) if is_markup(media) else text  # the value stays as sent
        return text, _also_json(judged, body, limits)
    elif limits.opaque_media == "metadata":
        return None, ""
    else:
        raise BodyError(
            415,
            "unsupported_media_type",
            f"a {media or 'untyped'} body cannot be inspected; send JSON, "
            "a form or text, or set opaque_media='metadata'",
            field="content-type",
        )
    return value, "\n".join(judged_strings(value))


def _was_json(sent: bytes) -> bool:
    """Whether ``sent``, an untyped body :func:`_untyped` read, was JSON (rather than text)."""
    try:
        loads(sent, duplicate_keys="collect")
    except InvalidJson:
        return False
    return True


def encode_body(value: Any, content_type: str, sent: bytes) -> bytes:
    """The body :func:`parse_body` read as ``value``, written again after a ``redact`` verdict changed it: compact
    JSON (UTF-8; a key the body repeated is repeated again, each value redacted on its own; a document that is one
    string stays a JSON string), a urlencoded form, or UTF-8 text. ``sent``: the body as parsed, which says whether an
    untyped one whose value is a string was a JSON string or text.

    Raises:
        BodyError: 422 ``redact_unsupported`` for a multipart body (guard does not rewrite its parts).
    """
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "multipart/form-data":
        raise BodyError(422, "redact_unsupported", "a multipart body cannot be redacted; send JSON, a form or text",
                        field="content-type")
    if isinstance(value, str) and not (is_json_media(media) or (not media and _was_json(sent))):
        return value.encode("utf-8")
    if media == "application/x-www-form-urlencoded":
        return urlencode([(k, v) for k, values in value.items() for v in values]).encode("ascii")
    return dumps(value).encode("utf-8")


def redacted_request(scope: Scope, value: Any, redactions: Sequence[Redaction], sent: bytes) -> tuple[bytes, Scope]:
    """The body the application gets once ``redactions`` are masked in ``value`` (the parsed body of ``sent``, the
    body as received with its ``Content-Encoding`` undone), and ``scope`` with its new ``Content-Length`` (the body is re-encoded from the parsed value,
    so ``Content-Encoding`` goes; :func:`encode_body`).

    Raises:
        BodyError: 422 ``redact_unsupported`` for a multipart body.
        ValueError: a redaction does not fit ``value`` (:func:`~guard.policy.redact.apply_redactions`).
    """
    content_type = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"content-type"), "")
    body = encode_body(apply_redactions(value, tuple(redactions)), content_type, sent)
    drop = (b"content-length", b"content-encoding")
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in drop]
    headers.append((b"content-length", str(len(body)).encode()))
    return body, {**scope, "headers": headers}


def _untyped(body: bytes, limits: BodyLimits) -> tuple[Any, str]:
    """A UTF-8 body without a ``Content-Type``: JSON when it parses as JSON, else text.

    FastAPI parses an untyped body as JSON, so one that is JSON is judged as JSON (its ``\\u`` escapes decoded,
    its duplicate keys refused, like a typed one); anything that is not even JSON syntax is judged as the text it is.
    """
    check_containers(body, limits)
    try:
        value = loads(body, max_depth=limits.max_json_depth, duplicate_keys=limits.duplicate_keys)
    except InvalidJson as exc:
        if exc.reason == "syntax":
            text = body.decode("utf-8")
            return text, text
        raise _json_error(exc) from exc
    return value, "\n".join(judged_strings(value))


def _also_json(text: str, body: bytes, limits: BodyLimits) -> str:
    """What a text or form body is judged as: ``text`` (what :func:`parse_body` read), and when ``body`` is also JSON,
    the strings of its documents after it.

    An application can parse any body as JSON whatever its media type (Starlette's ``request.json()``, Flask's
    ``get_json(force=True)``), so ``\\u`` escapes in a ``text/plain`` or form body must not hide what they decode to.
    The bytes are read as ``json.loads`` reads them (RFC 8259 section 8.1 and Python's ``json.detect_encoding``: a
    UTF-8 byte-order mark is skipped, UTF-16 and UTF-32 are recognised by their zero bytes). A body that is not one
    document is read line by line as well (JSON Lines, ``application/json-seq``, an event stream:
    :func:`guard._json.json_readings`). Every value of a repeated key is judged; a whole document too deep to parse
    is refused as a typed one is (400), and so is one with too many arrays and objects (413).
    """
    check_containers(body, limits)
    try:
        decoded = body.decode(json.detect_encoding(body))
    except UnicodeDecodeError:
        return text
    values: list[Any] = []
    if decoded.lstrip(" \t\r\n")[:1] in ("{", "[", '"'):
        try:
            values = [loads(decoded, max_depth=limits.max_json_depth, duplicate_keys="collect")]
        except InvalidJson as exc:
            if exc.reason != "syntax":
                raise _json_error(exc) from exc
    if not values and ("\n" in decoded or "\r" in decoded):
        values = json_readings(decoded)  # JSON Lines, application/json-seq, an event stream
    return "\n".join([text, *judged_strings(values)]) if values else text


def _reads_as_wide_json(body: bytes) -> bool:
    """Whether a body that is not UTF-8 is a JSON document as ``json.loads`` reads bytes (a byte-order mark or zero
    bytes pick UTF-16 or UTF-32; whitespace of any length may lead): FastAPI and ``request.json()`` parse an untyped
    body so, whatever ``opaque_media`` says. Binary data that only starts like JSON is not."""
    encoding = json.detect_encoding(body)
    if encoding in ("utf-8", "utf-8-sig"):
        return False
    try:  # as json.loads decodes bytes; binary (most of it) is told by its first 4 KiB, not decoded whole
        head = body[:4096].decode(encoding, "surrogatepass").lstrip("\ufeff \t\r\n")
        text = body.decode(encoding, "surrogatepass") if head[:1] in ("{", "[", '"') or not head else ""
    except UnicodeDecodeError:
        return False
    if text.lstrip("\ufeff \t\r\n")[:1] not in ("{", "[", '"'):
        return False
    try:
        json.loads(text)
    except RecursionError:
        return True  # too deep for json.loads, which the application's parse fails on too: refused all the same
    except ValueError:
        return False
    return True


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
