"""Safe YAML for policy files: plain data only, with the line of every node kept for error messages.

PyYAML's ``safe_load`` still accepts anchors and aliases (the "billion laughs" shape), silently keeps the
last of two equal mapping keys and turns ``2024-01-01`` into a date. This loader composes the node tree itself
and refuses, at the first offending event:

* an anchor (``&a``) or alias (``*a``), so an alias bomb fails before anything is expanded;
* a duplicate mapping key, a merge key (``<<``), a non-scalar key, a key YAML reads as anything but text (``true:``,
  ``null:``, ``1.5:``, ``0x1F:``: quote it; a decimal integer key such as ``429:`` is read as the text it is written
  as, ``"429"``), YAML 1.1's ``=`` value marker (quote it), and any explicit tag (``!!str``, ``!!bool "off"``,
  ``!custom``: a tag would let ``!!int "012"`` be 10 where a quoted value is always text);
* a lone surrogate (U+D800 to U+DFFF, written as a ``\\ud800`` escape), in a value or a key: it is half of a UTF-16
  pair, not a character, and cannot be encoded in a response, a header or a model request. A pair written as two
  escapes, JSON's way (``"\\ud83d\\ude00"``, as ``json.dumps`` writes an emoji), is joined into its character;
* nesting deeper than :data:`MAX_DEPTH`, documents larger than :data:`MAX_POLICY_BYTES` and documents of more than
  :data:`MAX_NODES` values (PyYAML keeps about 1 KB per node: ``[1,1,...]`` in 1 MiB is 500,000 nodes, about 500 MB
  and tens of seconds of parsing);
* U+0085, U+2028 or U+2029 anywhere in the text: YAML 1.1 (PyYAML) reads them as line breaks, YAML 1.2 (editors,
  linters) as ordinary characters, so one in a comment would hide a key from every other tool; a double-quoted
  string writes them as ``\\N``, ``\\L``, ``\\P``;
* a plain (unquoted) value or key that YAML 1.1 and YAML 1.2 read differently: ``no``/``yes``/``on``/``off``/``y``/``n``
  (any case), integers with a leading zero, ``0b``/``0o`` numbers, signed hex, ``_`` in numbers, floats without a
  dot such as ``1e3`` and timestamps such as ``2024-01-01`` (see :func:`_version_problem`). ``true``/``false``,
  decimals, ``0x1F`` and ``1.5`` stay as they are.

The result is plain Python data plus a :class:`LineMap` from key paths to 1-based line numbers, so schema errors
found later (pydantic, CEL, System One limits) can still name the line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any, ClassVar

import yaml  # type: ignore[import-untyped,unused-ignore]

from guard._json import surrogates_joined
from guard._readfile import FileRefused, read_capped
from guard.errors import PolicyError

__all__ = ["MAX_DEPTH", "MAX_NODES", "MAX_NUMBER_CHARS", "MAX_POLICY_BYTES", "LineMap", "Path", "format_path",
           "load_yaml", "read_policy_file"]

#: Largest policy (or policy test) file accepted, in bytes.
MAX_POLICY_BYTES = 1 << 20
#: Deepest nesting of mappings and sequences accepted.
MAX_DEPTH = 48
#: Most nodes (scalars, keys included, mappings and sequences) a document may hold; the next one is refused as it is
#: parsed, before the rest of the file is read.
MAX_NODES = 100_000
#: Longest number (in characters) a policy file may write; a longer one is refused, not parsed.
MAX_NUMBER_CHARS = 100

Path = tuple[str | int, ...]

_CORE_PREFIX = "tag:yaml.org,2002:"  # what the parser expands ``!!`` to
_NUMBER_TAGS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
#: The tags the loader resolves plain and quoted scalars to (explicit tags are refused): anything else (``=``, read as
#: YAML 1.1's value key) is refused too.
_SCALAR_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
}
#: Words YAML 1.1 reads as booleans (in these spellings; ``y``/``n`` too, though PyYAML keeps those as text) and YAML
#: 1.2 reads as text. Compared lower-cased, so ``yEs`` is refused as well.
_BOOL_WORDS_11 = {"yes": True, "y": True, "on": True, "no": False, "n": False, "off": False}
#: The YAML 1.2 core schema's integer and float forms.
_INT_12 = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_FLOAT_12 = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
#: Lone UTF-16 surrogates: YAML's ``\\ud800`` escapes make them, no UTF-8 text holds them.
_SURROGATE = re.compile(r"[\ud800-\udfff]")
#: An explicit tag as written in the document (``!!str``, ``!e!foo``, ``!<tag:...>``, ``!``): the parser gives it
#: expanded (``%TAG`` handles resolved), an error names it as written.
_WRITTEN_TAG = re.compile(r"!<[^>]*>|![^\s,\[\]{}]*")
#: The characters YAML 1.1 reads as line breaks and YAML 1.2 does not, with the escape a double-quoted string writes
#: each as.
_LINE_BREAKS_11 = {"\x85": ("next line", "\\N"), "\u2028": ("line separator", "\\L"),
                   "\u2029": ("paragraph separator", "\\P")}
_LINE_BREAK_11 = re.compile("[\x85\u2028\u2029]")
#: What ends a line for YAML besides those: CR LF, a CR alone, LF.
_LINE_END = re.compile(r"\r\n|\r|\n")
#: What YAML 1.1 resolves a few plain scalars to that are no data (``=``, ``<<`` as a value), by tag.
_MARKERS = {"tag:yaml.org,2002:value": "value marker", "tag:yaml.org,2002:merge": "merge key"}
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
#: YAML 1.1's timestamp form (``2024-01-01``, ``2024-01-01 10:00:00Z``), read as text by YAML 1.2.
_TIMESTAMP_11 = next(regexp for resolvers in yaml.SafeLoader.yaml_implicit_resolvers.values()
                     for tag, regexp in resolvers if tag == _TIMESTAMP)


def format_path(path: Path) -> str:
    """``("policies", 0, "questions", "urgency")`` -> ``policies[0].questions.urgency``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


@dataclass
class LineMap:
    """1-based line of each node, by key path. A missing path falls back to its nearest present ancestor."""

    file: str
    lines: dict[Path, int] = field(default_factory=dict)

    def line(self, path: Path) -> int | None:
        probe = tuple(path)
        while probe:
            if probe in self.lines:
                return self.lines[probe]
            probe = probe[:-1]
        return self.lines.get((), None)

    def error(self, path: Path, reason: str) -> PolicyError:
        """A :class:`PolicyError` naming this file, the line of ``path`` and the dotted key path."""
        return PolicyError(self.file, self.line(path), format_path(path), reason)


class _Reject(Exception):
    def __init__(self, mark: Any, reason: str, path: Path = ()) -> None:
        super().__init__(reason)
        self.line = mark.line + 1 if mark is not None else None
        self.reason = reason
        self.path = path


class _Loader(yaml.SafeLoader):  # type: ignore[misc,unused-ignore]
    """SafeLoader that composes nodes but refuses anchors, aliases, deep nesting and too many nodes as they are parsed,
    and notes the scalars written plain and the nodes with an explicit tag (refused by :func:`_to_data`, which knows
    their key)."""

    # The YAML 1.1 core resolver without timestamps: a plain ``2024-05-01`` is text, then refused (_readings).
    yaml_implicit_resolvers: ClassVar[dict[Any, Any]] = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != _TIMESTAMP]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str, *, surrogates: Callable[[Path], bool] | None) -> None:
        super().__init__(stream)
        self.surrogates = surrogates  # the key paths whose scalars keep lone surrogates (load_yaml)
        self._depth = 0
        self._nodes = 0
        self.plain_scalars: set[int] = set()  # id() of each scalar node written without quotes or a tag
        self.tagged: dict[int, str] = {}  # id() of each node written with an explicit tag -> the tag as parsed

    def compose_scalar_node(self, anchor: Any) -> Any:
        event = self.peek_event()
        node = super().compose_scalar_node(anchor)
        if event.style is None and event.tag is None:
            self.plain_scalars.add(id(node))
        return node

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Reject(event.start_mark, f"alias *{event.anchor} is not allowed in policy files; repeat the value")
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise _Reject(event.start_mark, f"anchor &{anchor} is not allowed in policy files; repeat the value")
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise _Reject(event.start_mark, f"the file holds more than {MAX_NODES} values (keys included); at most "
                          f"{MAX_NODES} (split it into several files)")
        nested = isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent))
        if nested:
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise _Reject(event.start_mark, f"nesting deeper than {MAX_DEPTH} levels is not allowed")
        try:
            node = super().compose_node(parent, index)
        finally:
            if nested:
                self._depth -= 1
        if event.tag is not None:  # "!!str", "!": an explicit tag, even one naming the type YAML would read anyway
            self.tagged[id(node)] = event.tag
        return node


def read_policy_file(path: str | FilePath) -> bytes:
    """The bytes of the policy or policy-test file at ``path``: a regular file of at most :data:`MAX_POLICY_BYTES`.
    Opened without blocking and checked before reading, so a path swapped for a FIFO, a device (``/dev/zero``) or a
    huge file costs no wait and no memory.

    Raises:
        PolicyError: naming the file: it cannot be opened, is not a regular file, or is too large.
    """
    name = str(path)
    try:
        return read_capped(path, MAX_POLICY_BYTES)
    except OSError as exc:
        raise PolicyError(name, None, "", f"cannot read file: {exc.strerror}") from None
    except FileRefused as exc:
        if exc.kind:
            raise PolicyError(name, None, "", f"cannot read file: it is {exc.kind}, not a regular file") from None
        raise PolicyError(name, None, "", f"{exc} (split it into several files)") from None


def load_yaml(
    text: str | bytes, file: str = "<string>", *, surrogates: Callable[[Path], bool] | None = None
) -> tuple[Any, LineMap]:
    """Parse one YAML document into plain data (dict, list, str, int, float, bool, None).

    Args:
        text: the document; bytes are decoded as UTF-8.
        file: name used in errors.
        surrogates: the key paths (a key's own path ends in ``"<key>"``) whose scalars may keep lone surrogates
            written as ``\\ud800`` escapes (a policy test file's agent input: an agent's strings can hold them);
            refused everywhere by default. A lone surrogate in ``text`` itself is refused wherever it stands.

    Returns:
        ``(data, lines)``: the data (``None`` for an empty document) and the line of every key path.

    Raises:
        PolicyError: on a YAML syntax error, a control character, U+0085, U+2028 or U+2029 (naming its line and
            column as YAML counts them: ``\\r\\n``, ``\\r`` or ``\\n`` ends a line), a lone surrogate (unless
            allowed), an anchor or alias, a duplicate or merge key, a key that is not text, an explicit tag, excessive
            nesting, more than :data:`MAX_NODES` nodes, a file over :data:`MAX_POLICY_BYTES`, or bytes that are not
            UTF-8.
    """
    lines = LineMap(file)
    if isinstance(text, str) and _SURROGATE.search(text):
        text = surrogates_joined(text, lone="keep")  # a pair becomes its character; a lone half is refused below
    size = len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else len(text)
    if size > MAX_POLICY_BYTES:
        raise PolicyError(file, None, "", f"file is {size} bytes; at most {MAX_POLICY_BYTES} (split it into "
                          "several files)")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            start = text.rfind(b"\n", 0, exc.start) + 1  # the line's first byte: what precedes the error is UTF-8
            line = text.count(b"\n", 0, exc.start) + 1
            column = len(text[start : exc.start].decode("utf-8")) + 1
            raise PolicyError(file, line, "", f"file is not UTF-8: byte 0x{text[exc.start]:02X} at column {column} "
                              f"(offset {exc.start}); save the file as UTF-8") from exc
    line_break = _LINE_BREAK_11.search(text)
    if line_break:
        line, column = _position(text, line_break.start())
        raise PolicyError(file, line, "", _line_break_problem(line_break.group(), column))
    try:
        loader = _Loader(text, surrogates=surrogates)  # the reader refuses control characters here, before parsing
    except yaml.reader.ReaderError as exc:
        line = _position(text, exc.position)[0]
        code = int(exc.character)
        if _SURROGATE.fullmatch(chr(code)):
            raise PolicyError(file, line, "", _surrogate_problem(code, "text")) from None
        raise PolicyError(file, line, "", f"control character U+{code:04X} is not allowed in a policy file") from None
    try:
        node = loader.get_single_node()
        data = None if node is None else _to_data(loader, node, (), lines)
    except _Reject as exc:
        raise PolicyError(file, exc.line, format_path(exc.path), exc.reason) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise PolicyError(file, line, "", f"YAML syntax error: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise PolicyError(file, None, "", f"YAML error: {exc}") from None
    finally:
        loader.dispose()
    return data, lines


def _to_data(loader: _Loader, node: yaml.Node, path: Path, lines: LineMap) -> Any:
    """The plain data of ``node`` (at key ``path``; a key's own path ends in ``"<key>"``), its lines noted in
    ``lines``.

    Raises:
        _Reject: what the module docstring lists, at the node's line and key.
    """
    lines.lines.setdefault(path, node.start_mark.line + 1)
    is_key = path[-1:] == ("<key>",)
    if id(node) in loader.tagged:
        raise _Reject(node.start_mark, f"tag {_written_tag(node, loader.tagged[id(node)])} is not allowed; policy "
                      "files hold plain data only: write the value without it (a quoted value is text)",
                      _where(node, path, is_key=is_key))
    if isinstance(node, yaml.ScalarNode):
        if node.tag not in _SCALAR_TAGS:  # untagged, so a plain scalar YAML 1.1 reads as a marker: "=", "<<"
            marker = _MARKERS.get(node.tag, node.tag)
            raise _Reject(node.start_mark, f"{node.value!r} is YAML 1.1's {marker}, not text; quote it "
                          f'("{node.value}")', _where(node, path, is_key=is_key))
        surrogate = _SURROGATE.search(node.value)
        if surrogate:  # a pair written as two \u escapes, JSON's way, is one character; a lone half stays
            node.value = surrogates_joined(node.value, lone="keep")
            keep = loader.surrogates is not None and loader.surrogates(path)
            surrogate = None if keep else _SURROGATE.search(node.value)
        if surrogate:
            raise _Reject(node.start_mark, _surrogate_problem(ord(surrogate.group()), "key" if is_key else "value"),
                          _where(node, path, is_key=is_key))
        plain = id(node) in loader.plain_scalars
        if node.tag in _NUMBER_TAGS or (plain and (_INT_12.fullmatch(node.value) or _FLOAT_12.fullmatch(node.value))):
            # a number in YAML 1.1 or 1.2: refuse a long one before any conversion
            if len(node.value) > MAX_NUMBER_CHARS:
                raise _Reject(node.start_mark, f"a number of {len(node.value)} characters; at most {MAX_NUMBER_CHARS}",
                              path)
            if ":" in node.value:  # YAML 1.1 reads 1:30 as 90 (base 60), in time quadratic in its length
                raise _Reject(node.start_mark, f"{node.value!r} would be read as a base-60 number; quote it", path)
        value = loader.construct_object(node, deep=True)
        if plain:
            problem = _version_problem(node.value, value, is_key=is_key)
            if problem:
                raise _Reject(node.start_mark, problem, _where(node, path, is_key=is_key))
        if is_key and type(value) is int and node.value == str(value):  # 429: is the key "429", as written
            return node.value
        if is_key and not isinstance(value, str):  # true: would be the option "True", null: "None", 0x1F: "31"
            raise _Reject(node.start_mark, f"key {node.value!r} is {_reading(value)} in YAML, not text; keys are "
                          f'text: quote it ("{node.value}")', _where(node, path, is_key=is_key))
        return value
    if isinstance(node, yaml.SequenceNode):  # untagged, so a plain sequence
        return [_to_data(loader, item, (*path, i), lines) for i, item in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):  # untagged, so a plain mapping
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):  # "? [a]": a sequence or mapping as a key
                raise _Reject(key_node.start_mark, "a key must be text, not a sequence or mapping", path)
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise _Reject(key_node.start_mark, "merge keys (<<) are not allowed in policy files; repeat the "
                              'keys (or quote it, "<<", for the text)', path)
            key = _to_data(loader, key_node, (*path, "<key>"), lines)  # text: anything else is refused
            if key in out:
                first = lines.lines.get((*path, key))
                raise _Reject(
                    key_node.start_mark,
                    f"duplicate key {key!r} (first defined on line {first}); keys must be unique",
                    (*path, key),
                )
            lines.lines[(*path, key)] = key_node.start_mark.line + 1
            out[key] = _to_data(loader, value_node, (*path, key), lines)
        lines.lines.pop((*path, "<key>"), None)
        return out
    raise _Reject(node.start_mark, f"unsupported YAML node {type(node).__name__}")  # pragma: no cover


def _where(node: yaml.ScalarNode, path: Path, *, is_key: bool) -> Path:
    """The key path an error about ``node`` names: ``path``, or for a key the key itself (a lone surrogate in it
    written as its escape, so the error can be printed)."""
    if not is_key:
        return path
    return (*path[:-1], node.value.encode("utf-8", "backslashreplace").decode("utf-8"))


def _written_tag(node: yaml.Node, parsed: str) -> str:
    """The explicit tag of ``node`` as the document writes it (``!e!foo``, not the ``tag:example.com,2000:foo`` a
    ``%TAG`` directive expands it to), read at the node's start; else ``parsed`` with the core prefix as ``!!``."""
    mark = node.start_mark
    written = _WRITTEN_TAG.match(mark.buffer, mark.pointer) if isinstance(mark.buffer, str) else None
    return written.group() if written else parsed.replace(_CORE_PREFIX, "!!", 1)


def _position(text: str, index: int) -> tuple[int, int]:
    """The line and column (both 1-based) of ``text[index]``, as PyYAML's marks count them when no U+0085, U+2028 or
    U+2029 precedes it: CR LF, a CR alone and LF end a line, and a leading U+FEFF (byte order mark) is no column."""
    ends = list(_LINE_END.finditer(text, 0, index))
    start = ends[-1].end() if ends else int(text.startswith("\ufeff"))
    return len(ends) + 1, index - start + 1


def _line_break_problem(char: str, column: int) -> str:
    """Why the U+0085, U+2028 or U+2029 ``char`` at ``column`` is refused, with the escape to write instead."""
    name, escape = _LINE_BREAKS_11[char]
    return (f"U+{ord(char):04X} ({name}) at column {column} is not allowed: YAML 1.1 (guard) reads it as a "
            "line break, YAML 1.2 tools (editors, linters) do not, so the file would mean something else to them "
            f"(in a comment it would end the comment for guard only); delete it, or write {escape} inside a "
            "double-quoted string for the character")


def _surrogate_problem(code: int, what: str) -> str:
    """Why the ``what`` (``"key"``, ``"value"``, ``"text"``) holding the lone surrogate ``code`` is refused, with what
    to write instead."""
    return (f"the {what} holds U+{code:04X}, a lone surrogate (half of a UTF-16 pair, not a character: it cannot be "
            "sent in a request, a response, a header or a model request); write the character itself, or "
            "\\UXXXXXXXX (8 hex digits) for one above U+FFFF")


def _reading(value: Any) -> str:
    """What YAML read a plain scalar as, in words: ``the boolean true``, ``null``, ``the number 1``."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if value is None:
        return "null"
    return f"the number {value!r}"


def _version_problem(text: str, value: Any, *, is_key: bool) -> str | None:
    """Why the plain scalar ``text`` (read by YAML 1.1 as ``value``) would mean something else in YAML 1.2 (core
    schema), with how to write it; ``None`` when both read it the same."""
    readings = _readings(text, value)
    if readings is None:
        return None
    old, new, write = readings
    quote = f'quote it ("{text}")'
    if is_key:  # a key is text: quoting is the only fix
        return f"key {text!r} is {old} in YAML 1.1 but {new} in YAML 1.2; {quote}"
    if new == "text" and not write:  # a timestamp: only text can be written
        return f"{text!r} is {old} in YAML 1.1 but text in YAML 1.2; {quote}"
    if new == "text":  # YAML 1.1 reads a boolean or a number here
        return f"{text!r} is {old} in YAML 1.1 but text in YAML 1.2; {quote} for the text, or write {write}"
    return f"{text!r} is {old} in YAML 1.1 but {new} in YAML 1.2; write {write}, or {quote}"


def _readings(text: str, value: Any) -> tuple[str, str, str] | None:
    """``(YAML 1.1 reading, YAML 1.2 reading, what to write for the number or boolean)`` of the plain scalar ``text``
    (``value`` as YAML 1.1 reads it; ``""`` to write for a timestamp), or ``None`` when both read it the same."""
    if _TIMESTAMP_11.match(text):
        return "a timestamp", "text", ""
    word = _BOOL_WORDS_11.get(text.lower())
    if word is not None:  # yes, No, ON, off, y, n...
        return f"the boolean {str(word).lower()}", "text", str(word).lower()
    if isinstance(value, bool) or not (isinstance(value, (int, float)) or _INT_12.fullmatch(text)
                                       or _FLOAT_12.fullmatch(text)):
        return None  # true/false, null, and text that YAML 1.2 reads as text too
    digits = text.lstrip("+-")
    if "_" in text:  # YAML 1.1 drops the underscores of 1_000; YAML 1.2 has none in numbers
        return f"the number {value}", "text", str(value)
    if digits.startswith("0b"):
        return f"binary {value}", "text", str(value)
    if digits.startswith("0o"):
        number = int(text, 0)
        return "text", f"octal {number}", str(number)
    if digits.startswith("0x"):  # 0x1F is 31 in both; -0x1F is text in YAML 1.2
        return None if digits == text else (f"the number {value}", "text", str(value))
    if len(digits) > 1 and digits[0] == "0" and digits.isdigit():  # 012: octal (08: text) in 1.1, decimal in 1.2
        number = int(text, 10)
        if value == number and isinstance(value, int):
            return None  # 00: zero in both
        return f"octal {value}" if isinstance(value, int) else "text", str(number), str(number)
    if isinstance(value, str):  # 1e3, -.5: a float in YAML 1.2, text in YAML 1.1 (which wants a digit before the dot,
        # a dot before an exponent and a sign in it)
        mantissa, _, exponent = text.lower().partition("e")
        sign, unsigned = (mantissa[0], mantissa[1:]) if mantissa[:1] in ("+", "-") else ("", mantissa)
        unsigned = ("0" if unsigned.startswith(".") else "") + unsigned + ("" if "." in unsigned else ".0")
        written = sign + unsigned
        if exponent:
            written += "e" + (exponent if exponent[:1] in ("+", "-") else "+" + exponent)
        return "text", f"the number {float(text)}", written
    return None
