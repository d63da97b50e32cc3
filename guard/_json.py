"""Strict JSON for judged content: UTF-8 only, no duplicate keys, bounded depth, finite numbers, no lone surrogates.

Python's ``json`` keeps the last of duplicate keys, accepts ``NaN``/``Infinity``, decodes ``"\\ud800"`` into a lone
surrogate, and ``json.loads(bytes)`` silently accepts UTF-16 and UTF-32. A guard that parses leniently can score one
value while the application uses another, so judged JSON goes through :func:`loads` instead.

Example:
    >>> loads(b'{"prompt": "hi"}')
    {'prompt': 'hi'}
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from guard.errors import InvalidJson

__all__ = ["DEFAULT_MAX_DEPTH", "JSON_LEVELS", "DuplicateKeys", "Repeated", "dumps", "is_json_media", "json_offsets",
           "json_readings", "json_strings", "json_unescaped", "loads", "pairs_rejecting", "unique_key"]

def is_json_media(media: str) -> bool:
    """Whether a media type (lower-case, without parameters) is JSON: ``application/json`` or any structured
    syntax suffix ``+json`` (RFC 6839: ``application/vnd.api+json``, ``application/problem+json``, ...)."""
    return media == "application/json" or (media.endswith("+json") and "/" in media)


DEFAULT_MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted (``{}`` is depth 1, a bare scalar depth 0)."""

JSON_LEVELS = 3
"""How many times a string holding JSON is read into its document (:func:`json_readings`, :func:`json_strings`), by the
compact model, the redaction of secrets and the tool-result instruction detector: a document inside a string inside a
string (``json.dumps`` applied twice) is read too."""

DuplicateKeys = Literal["reject", "collect"]
"""``reject``: a repeated key is an error. ``collect``: the key maps to the list of all its values, in order (a
:class:`Repeated`), so every value is judged (the application will use one of them, usually the last)."""


class Repeated(list):  # type: ignore[type-arg]
    """The values of a key an object repeats, in order (``duplicate_keys="collect"``): a list, so every value is
    judged, which :func:`dumps` writes back as the key repeated, one member per value, as the document had it."""


def dumps(value: Any) -> str:
    """Compact JSON text of ``value`` (non-ASCII kept as is); an object member whose value is :class:`Repeated`
    is written once per value under the same key (in order, where the key first stood), so a document :func:`loads`
    collected keeps its repeated keys and the value each parser picks (first or last)."""
    if isinstance(value, dict):
        members = [f"{json.dumps(key, ensure_ascii=False)}:{dumps(item)}"
                   for key, v in value.items() for item in (v if isinstance(v, Repeated) else (v,))]
        return "{" + ",".join(members) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False)


_UTF8_BOM = b"\xef\xbb\xbf"
_BINARY = (bytes, bytearray, memoryview)  # a tuple: isinstance on it is cheaper than on a union


def _reject_constant(name: str) -> Any:
    raise InvalidJson("non_finite", f"the constant {name} is not JSON; numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidJson("non_finite", f"the number {text[:40]} overflows a 64-bit float; numbers must be finite")
    return value


def pairs_rejecting(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict (``json.loads``' ``object_pairs_hook``).

    Raises:
        InvalidJson: ``duplicate_key``: a key appears twice.
    """
    out: dict[str, Any] = dict(pairs)  # built in C; a key seen twice leaves the dict shorter than the pairs
    if len(out) == len(pairs):
        return out
    out = {}
    for key, value in pairs:
        if key in out:
            raise InvalidJson("duplicate_key", f"duplicate key {key[:100]!r} in an object; each key may appear once")
        out[key] = value
    return out


def _pairs_collecting(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    repeated: set[str] = set()
    for key, value in pairs:
        if key not in out:
            out[key] = value
        elif key in repeated:
            out[key].append(value)
        else:
            out[key] = Repeated([out[key], value])
            repeated.add(key)
    return out


def _decode_text(data: bytes) -> str:
    data = data.removeprefix(_UTF8_BOM)
    if b"\x00" in data:  # never valid in JSON text; the usual sign of UTF-16 or UTF-32 (RFC 8259 section 8.1)
        raise InvalidJson("not_utf8", f"byte 0x00 at offset {data.index(0)}: UTF-16/UTF-32 JSON is refused; JSON "
                          "must be UTF-8")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data[exc.start]
        raise InvalidJson(
            "not_utf8", f"byte 0x{bad:02x} at offset {exc.start} is not valid UTF-8; JSON must be UTF-8"
        ) from exc


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal, escapes included
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")  # bytes.translate deletes these


def _nests_deeper(text: str, limit: int) -> bool:
    """Whether valid JSON ``text`` nests arrays and objects more than ``limit`` levels deep, read from its brackets:
    strings and every other character are dropped, then each pass removes the innermost pairs, one level per pass.
    Runs in C string operations (no Python step per value), at most ``limit`` passes."""
    skeleton = _STRING.sub("", text).encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKETS)
    brackets = skeleton.replace(b"{", b"[").replace(b"}", b"]")
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def _check_surrogates(value: Any) -> None:
    """Raise ``InvalidJson`` naming the first string (or key) holding a lone surrogate. The whole value is written
    out once in C; the Python walk that names the path runs only when that finds one."""
    try:
        json.dumps(value, ensure_ascii=False, check_circular=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):  # a value nested past the interpreter's limit: walk it
        pass
    else:
        return
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidJson(
                    "lone_surrogate", "a \\u escape encodes a lone UTF-16 surrogate, which is not text", path=path
                ) from exc
        elif isinstance(node, dict):
            for key, child in node.items():
                stack.append((key, path))
                stack.append((child, f"{path}.{key}"))
        elif isinstance(node, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node))


# Built once: json.loads(**kwargs) would build a new decoder (and scanner) on every call.  Their C scanners are called
# directly by _scan (what JSONDecoder.decode and raw_decode do, without their two Python frames).
_REJECTING = json.JSONDecoder(
    object_pairs_hook=pairs_rejecting, parse_constant=_reject_constant, parse_float=_finite_float
)
_COLLECTING = json.JSONDecoder(
    object_pairs_hook=_pairs_collecting, parse_constant=_reject_constant, parse_float=_finite_float
)


_WHITESPACE = re.compile(r"[ \t\n\r]*")  # json.decoder.WHITESPACE (its stubs do not declare it); always matches
_Scanner = Callable[[str, int], tuple[Any, int]]
_SCAN_REJECTING: _Scanner = _REJECTING.scan_once  # type: ignore[attr-defined]  # the decoders' own C scanners
_SCAN_COLLECTING: _Scanner = _COLLECTING.scan_once  # type: ignore[attr-defined]


def _skip_space(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    return match.end() if match is not None else pos


def _scan(scan: _Scanner, text: str) -> Any:
    """``JSONDecoder.decode(text)`` for the decoder owning ``scan``: same value, same :class:`json.JSONDecodeError`."""
    try:
        value, end = scan(text, _skip_space(text, 0))
    except StopIteration as exc:
        raise json.JSONDecodeError("Expecting value", text, exc.value) from None
    end = _skip_space(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def loads(data: bytes | str, *, max_depth: int = DEFAULT_MAX_DEPTH, duplicate_keys: DuplicateKeys = "reject",
          max_containers: int | None = None) -> Any:
    """Parse one JSON document strictly.

    Args:
        data: the document; bytes must be UTF-8 (a UTF-8 byte-order mark is ignored; UTF-16/32 are refused).
        max_depth: deepest nesting of arrays/objects allowed.
        duplicate_keys: ``reject`` (default) or ``collect`` (see :data:`DuplicateKeys`).
        max_containers: most ``[`` and ``{`` characters the text may hold (brackets inside strings count too), checked
            before parsing; ``None``: no limit. json's C parser holds the GIL for the whole document, and 8 MiB of
            ``[]`` are 2.8 million lists and half a second in which no other thread or event loop runs.

    Returns:
        The parsed value (dicts, lists, str, int, float, bool, None).

    Raises:
        InvalidJson: with ``reason`` ``not_utf8``, ``syntax``, ``duplicate_key``, ``too_deep``, ``non_finite``,
            ``lone_surrogate``, ``number_too_long`` or ``too_many_values``.
    """
    text = _decode_text(data) if isinstance(data, _BINARY) else data
    if max_containers is not None and (found := text.count("{") + text.count("[")) > max_containers:
        raise InvalidJson("too_many_values", f"the document holds {found} arrays and objects (counting brackets); "
                          f"at most {max_containers} are read")
    scan = _SCAN_REJECTING if duplicate_keys == "reject" else _SCAN_COLLECTING
    try:
        value = _scan(scan, text)
    except InvalidJson:
        raise
    except json.JSONDecodeError as exc:
        raise InvalidJson("syntax", f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from exc
    except RecursionError as exc:
        raise InvalidJson("too_deep", f"JSON nesting exceeds the limit of {max_depth} levels") from exc
    except ValueError as exc:  # int() past sys.get_int_max_str_digits()
        raise InvalidJson("number_too_long", f"a number has too many digits: {exc}") from exc
    # Fast path: fewer brackets than the limit cannot nest deeper than it.
    if text.count("{") + text.count("[") > max_depth and _nests_deeper(text, max_depth):
        raise InvalidJson("too_deep", f"JSON nests more than {max_depth} levels deep; the limit is {max_depth}")
    if "\\u" in text and ("\\ud" in text or "\\uD" in text):
        _check_surrogates(value)
    return value


_OPENERS = ("{", "[", '"')
_ESCAPE = re.compile(r'\\(?:u([0-9a-fA-F]{4})|(["\\/bfnrt]))')
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NOT_A_DOCUMENT = object()
_LINE_END = re.compile(r"\r\n|\r|\n")
# Where JSON that loads refuses starts for json_strings: an object's first key, or an array of objects, strings or arrays.
_JSON_OPENING = re.compile(r'\{\s*"|\[\s*[{"\[]')
_LINE_STRING = re.compile(r'"[^"\\\r\n]*(?:\\[^\r\n][^"\\\r\n]*)*"')  # a string literal within one line
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_unescaped(text: str) -> str:
    """``text`` with every JSON string escape (RFC 8259 section 7: ``\\uXXXX``, ``\\n``, ``\\"``...) decoded where
    it stands, a surrogate pair joined into its character and a lone surrogate read as U+FFFD: what a client's JSON
    parser makes of the escapes of a document this text is only a piece of."""
    def one(match: re.Match[str]) -> str:
        code, simple = match.groups()
        return chr(int(code, 16)) if code is not None else _SIMPLE_ESCAPES[simple]

    return surrogates_joined(_ESCAPE.sub(one, text))


def surrogates_joined(text: str, *, lone: Literal["replace", "keep"] = "replace") -> str:
    """``text`` with each surrogate pair joined into its character and each lone surrogate (U+D800-U+DFFF, which no
    UTF-8 encoder takes: a non-UTF-8 file name from ``os.fsdecode``, a ``\\ud800`` escape) as U+FFFD, or kept as it
    is with ``lone="keep"`` (for a caller that refuses it); ``text`` itself when it holds none."""
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace" if lone == "replace" else
                                                            "surrogatepass")


def json_strings(text: str) -> list[tuple[str, int, int]]:
    """The strings of the JSON in ``text``, object keys included, in the order they stand: those of the whole text
    when it is one document (:func:`loads`, duplicate keys collected); else every string literal from the first
    ``{"``, ``[{``, ``["`` or ``[[`` on, read leniently, as a client's lenient parser would read a document
    :func:`loads` refuses (``NaN``, a lone surrogate, too deep, JSON Lines, a prefix or suffix around it, two
    documents, a document cut short, even inside a string): a literal does not cross a line end (JSON writes none
    inside a string) but one unclosed at the text's end runs to it, its escapes are decoded where they are valid and
    a lone surrogate reads as U+FFFD (:func:`json_unescaped`); ``[]`` when there is no such opening.

    Each is ``(value, start, end)``: the string as a parser reads it, and where it is written in ``text`` (between
    its quotes: ``text[start:end]``, escapes undecoded); :func:`json_offsets` maps a piece of ``value`` back there.
    Cost: linear in ``text`` (a line's unclosed quote ends the scan of that line)."""
    out: list[tuple[str, int, int]] = []
    if _document(text) is not _NOT_A_DOCUMENT:
        for literal in _STRING.finditer(text):  # in a valid document, the quotes outside strings are none
            written = literal.group()
            value = loads(written) if "\\" in written else written[1:-1]
            out.append((value, literal.start() + 1, literal.end() - 1))
        return out
    opening = _JSON_OPENING.search(text)
    if opening is None:
        return out
    raw_surrogates = not text.isascii() and _SURROGATE.search(text) is not None
    position = text.find('"', opening.start())
    while position != -1:
        literal = _LINE_STRING.match(text, position)
        if literal is not None:
            start, end, position = literal.start() + 1, literal.end() - 1, text.find('"', literal.end())
        elif (line_end := _LINE_END.search(text, position)) is not None:  # unclosed on its line: the next literal
            position = text.find('"', line_end.end())  # starts on the next line
            continue
        else:  # unclosed at the text's end: a document cut short inside a string, read to the end
            start, end, position = position + 1, len(text), -1
        body = text[start:end]
        # a surrogate written raw (not escaped) would be joined or replaced in the value, off its offsets: left out
        if not (raw_surrogates and _SURROGATE.search(body)):
            out.append((json_unescaped(body) if "\\" in body else body, start, end))
    return out


def json_offsets(text: str, start: int, end: int) -> Sequence[int]:
    """For the string written as ``text[start:end]`` (a :func:`json_strings` entry), the offset in ``text`` of the
    character or escape that gives each of its characters (a surrogate pair's two escapes give one), then ``end``:
    ``text[at[i]:at[j]]`` writes ``value[i:j]``."""
    if "\\" not in text[start:end]:
        return range(start, end + 1)
    at: list[int] = []
    position, high = start, False
    for match in _ESCAPE.finditer(text, start, end):
        code = int(match.group(1), 16) if match.group(1) is not None else None
        at += range(position, match.start())
        if high and match.start() == position and code is not None and 0xDC00 <= code <= 0xDFFF:
            high = False  # the low half of a pair: its character is the high half's
        else:
            at.append(match.start())
            high = code is not None and 0xD800 <= code <= 0xDBFF
        position = match.end()
    at += range(position, end + 1)
    return at


def _document(text: str) -> Any:
    """``text`` parsed as one JSON document (duplicate keys collected), else :data:`_NOT_A_DOCUMENT`."""
    if text.lstrip()[:1] not in _OPENERS:
        return _NOT_A_DOCUMENT
    try:
        return loads(text, duplicate_keys="collect")
    except InvalidJson:
        return _NOT_A_DOCUMENT


def _events(text: str) -> list[list[str]]:
    """The lines of ``text`` grouped as server-sent events are: runs of non-empty lines between empty ones. Lines
    end at CRLF, LF or CR, as SSE and JSON Lines readers split them: not at U+2028 or NEL, which JSON allows inside
    a string (a raw CR or LF it does not)."""
    events: list[list[str]] = [[]]
    for line in _LINE_END.split(text):
        if line:
            events[-1].append(line)
        elif events[-1]:
            events.append([])
    return [lines for lines in events if lines]


def json_readings(text: str, *, piece: bool = False) -> list[Any]:
    """What a client's JSON parser can read out of ``text`` (a body, or with ``piece`` a stream's window): the whole
    text when it is one document; else each server-sent event's data (its ``data:`` lines joined by newlines, as the
    SSE standard joins them) and each line that is a document (JSON Lines, ``application/json-seq`` after its record
    separator, a lone ``data:`` line). Lines that look like a document but :func:`loads` refuses (too deep, ``NaN``,
    a lone surrogate, all of which Python's ``json`` reads) and, with ``piece``, every other line no document
    accounts for, follow when they hold escapes, as one string with the escapes decoded (:func:`json_unescaped`):
    a client still decodes a document a stream window cuts in two.
    """
    whole = _document(text)
    if whole is not _NOT_A_DOCUMENT:
        return [whole]
    out: list[Any] = []
    unread: list[str] = []
    for lines in _events(text):
        data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
        if len(data) > 1 and (event := _document("\n".join(data))) is not _NOT_A_DOCUMENT:
            out.append(event)
            continue
        for line in lines:
            body = line.removeprefix("data:").lstrip("\x1e")
            found = _document(body)
            if found is not _NOT_A_DOCUMENT:
                out.append(found)
            elif "\\" in line and (piece or body.lstrip()[:1] in _OPENERS):
                unread.append(line)  # a document :func:`loads` refuses (NaN, a lone surrogate) is still parsed by
                # a client's lenient parser: its escapes are read
    if unread:
        out.append(json_unescaped("\n".join(unread)))
    return out


def unique_key(name: Any, out: Mapping[Any, Any], seen: dict[Any, int]) -> Any:
    """The key to keep a value under in ``out``, a map being rebuilt with its keys changed: ``name``, or where
    ``out`` holds it already, ``"name (n)"`` for the n-th key to become ``name`` (the first such text ``out`` does not
    hold). ``seen`` maps each name to how many keys became it so far; this updates it."""
    if name not in out:
        return name
    n = seen.get(name, 1)
    while f"{name} ({n + 1})" in out:
        n += 1
    seen[name] = n + 1
    return f"{name} ({n + 1})"
