"""The ``redact`` action: find the spans a rule masks in a body, and replace them.

A rule with ``action: redact`` names what to mask in its ``redact`` block: ``patterns`` (label -> regular
expression in RE2 syntax, searched in every string of the body; see :func:`compile_pattern`) and ``detector: true``
(the spans the policy's instruction detector returns, labelled ``instructions``). :meth:`Redactor.find` returns
:class:`~guard.verdict.Redaction` records, which say where a span is (a JSON pointer into the body, character
offsets) and never what it holds; :func:`apply_redactions` replaces them in a copy of the body. Both run on the
parsed body the guard judged: a JSON value, ``{field: [values]}`` for a form, or a ``str`` for text (pointer
``""``).

Styles (:data:`~guard.verdict.MaskStyle`): ``redact`` writes ``[REDACTED:<label>]``; ``mask`` writes one ``*`` per
character and keeps the last 4 characters of a span of 8 or more (what a card receipt shows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from guard._json import Repeated, json_readings
from guard._markup import markup_reading
from guard.policy._re2 import Pattern, compile_re2
from guard.policy.instructions import Detector
from guard.verdict import MaskStyle, Redaction

__all__ = [
    "DETECTOR_LABEL",
    "MASK_KEEP",
    "UNMASKABLE_FLAG",
    "Redactor",
    "apply_redactions",
    "compile_pattern",
    "escape_pointer",
    "masked_texts",
    "merge_redactions",
    "replacement",
]

#: Label of a span the policy's detector found.
DETECTOR_LABEL = "instructions"
#: The flag of a ``redact`` verdict turned into a block because what its rule masks is also where it cannot be
#: masked (:meth:`Redactor.leaves`): the request holds it in clear, so no log keeps the body or query.
UNMASKABLE_FLAG = "unmaskable"
#: Characters ``mask`` keeps at the end of a span of at least twice as many.
MASK_KEEP = 4


_EMPTY_PROBE = "a 1-_.\nZ"  # word and non-word characters, a line break: where a pattern of empty matches matches


def compile_pattern(source: str) -> Pattern:
    """A ``redact`` pattern compiled with RE2 (:mod:`guard.policy._re2`: linear time; Unicode ``\\d``, ``\\s``,
    ``\\w``, ASCII ``\\b``).

    Raises:
        ValueError: the pattern is not valid RE2 syntax, with RE2's reason; or it can match the empty string
            (``[0-9]*`` for ``[0-9]+``, ``\\b``): it would match inside every string, object keys included, which
            cannot be masked, so every request it fires on would be refused.
    """
    compiled = compile_re2(source)
    if compiled.fullmatch("") is not None or any(m.start() == m.end() for m in compiled.finditer(_EMPTY_PROBE)):
        raise ValueError(f"{source!r} matches the empty string, so it matches inside every string (and every object "
                         "key, which cannot be masked: each request it fires on would be refused); make it match at "
                         "least one character (+ instead of *, no optional-only pattern)")
    return compiled


@dataclass(frozen=True)
class Redactor:
    """A rule's compiled ``redact`` block.

    Attributes:
        patterns: ``(label, compiled regex)`` in file order.
        detector: also mask the spans the policy's detector finds.
        style: how spans are replaced.
    """

    patterns: tuple[tuple[str, Pattern], ...]
    detector: bool = False
    style: MaskStyle = "redact"

    def find(self, body: Any, detector: Detector | None = None) -> tuple[Redaction, ...]:
        """The spans to replace in ``body``, in document order; overlapping spans in one string are merged (the
        first one's label).

        Args:
            body: the parsed body (JSON value, form mapping or text).
            detector: the policy's detector (used when :attr:`detector` is set).
        """
        out: list[Redaction] = []
        for pointer, text in _strings(body, ""):
            spans: list[tuple[int, int, str]] = []
            for label, pattern in self.patterns:
                spans += [(m.start(), m.end(), label) for m in pattern.finditer(text) if m.end() > m.start()]
            if self.detector and detector is not None:
                spans += [(s.start, s.end, DETECTOR_LABEL) for s in detector(text)]
            out += [Redaction(pointer, start, end, label, self.style) for start, end, label in spans]
        return merge_redactions(out)


    def leaves(self, body: Any, query: Mapping[str, Any], redactions: tuple[Redaction, ...],
               detector: Detector | None = None, deltas: tuple[tuple[str, ...], ...] = (), *,
               markup: bool = False, clear: Iterable[str] = ()) -> bool:
        """Whether what this block masks would still reach the application (or the client) once ``redactions``
        are applied: found in an object key or form field name, in the query's names or values, in ``clear`` (the
        path, header values), for a text body or
        a stream's window in what a JSON parser decodes from it (:func:`guard._json.json_readings`: documents,
        events, JSON lines, the escapes of a cut document; ``\\u0034111`` is ``4111``), for HTML or XML in what a
        parser reads from it (``markup``), or across two of a stream's pieces that its client joins (``deltas``:
        ``sk`` + ``-abcdefgh123``; no span of the raw text is that key). The enforcement point refuses such a
        request, or stops such a response, instead of passing it on half masked.

        Markup is masked as written, so what a parser reads from the masked text
        (:func:`guard._markup.markup_reading`) must be what it reads from the text with this block's spans masked
        there: ``sk-&#97;bcdefgh1234`` holds no key as written, and ``sk-abcdefgh&#49;&#50;`` holds ``sk-abcdefgh``
        but reads as ``sk-abcdefgh12``, whose ``12`` masking the written key leaves.

        Args:
            body: the parsed body the spans were found in.
            query: the query parameters (``{}`` for a response).
            redactions: what :meth:`find` returned for ``body``.
            detector: the policy's detector.
            deltas: a streamed window's joined pieces (:attr:`guard.subject.HttpSubject.deltas`); a span inside
                one piece is the raw text's to mask (or an earlier window's, in the first piece), one that crosses
                two cannot be masked.
            markup: ``body`` is the text of an HTML or XML body, or of a stream's window of one.
            clear: the other texts that go on as they are, which nothing masks (the request's path, the values of
                the headers the policy reads).
        """
        masked = apply_redactions(body, redactions)
        fields = [] if isinstance(masked, str) else _keys_and_strings(masked)
        texts = [*fields, *_keys_and_strings(dict(query)), *clear]
        # a form field or name, a JSON string, a query or header value that is a JSON document with escapes, which
        # an application parses with json.loads (json.loads(form["data"])): the strings it decodes
        texts += [text for value in texts if "\\" in value and value.lstrip(" \t\r\n")[:1] in ("{", "[", '"')
                  for text in _keys_and_strings(json_readings(value, piece=True))]
        if isinstance(masked, str):
            texts += [masked, *_keys_and_strings(json_readings(masked, piece=True))]
            if markup:
                parsed, read = markup_reading(body), markup_reading(masked)
                if read != apply_redactions(parsed, self.find(parsed, detector)):
                    return True
                texts.append(read)
        for text in texts:
            if any(pattern.search(text) for _, pattern in self.patterns):
                return True
            if self.detector and detector is not None and detector(text):
                return True
        return any(self._crosses(pieces, detector) for pieces in deltas)

    def _crosses(self, pieces: tuple[str, ...], detector: Detector | None) -> bool:
        """Whether a span this block masks in ``"".join(pieces)`` starts in one piece and ends in another."""
        text, ends, at = "".join(pieces), [], 0
        for piece in pieces:
            at += len(piece)
            ends.append(at)
        spans = [(m.start(), m.end()) for _, pattern in self.patterns for m in pattern.finditer(text)]
        if self.detector and detector is not None:
            spans += [(s.start, s.end) for s in detector(text)]
        return any(start < end_of_piece < end for start, end in spans for end_of_piece in ends)


def merge_redactions(redactions: Iterable[Redaction]) -> tuple[Redaction, ...]:
    """``redactions`` sorted by pointer (in first-seen order) and start, overlapping spans in one string merged into
    one (the first one's label and style), so every span can be replaced on its own and a stream cut never falls
    inside two at once (several redacting policies' spans are combined this way)."""
    by_pointer: dict[str, list[Redaction]] = {}
    for r in redactions:
        by_pointer.setdefault(r.pointer, []).append(r)
    out: list[Redaction] = []
    for spans in by_pointer.values():
        merged: list[Redaction] = []
        for r in sorted(spans, key=lambda r: (r.start, r.end)):
            if merged and r.start < merged[-1].end:
                merged[-1] = dataclasses.replace(merged[-1], end=max(merged[-1].end, r.end))
            else:
                merged.append(r)
        out += merged
    return tuple(out)


def replacement(text: str, label: str, style: MaskStyle) -> str:
    """What one span's ``text`` becomes under ``style``."""
    if style == "mask":
        keep = MASK_KEEP if len(text) >= 2 * MASK_KEEP else 0
        return "*" * (len(text) - keep) + text[len(text) - keep:]
    return f"[REDACTED:{label}]"


def apply_redactions(body: Any, redactions: tuple[Redaction, ...]) -> Any:
    """A copy of ``body`` with every span replaced (``body`` itself is not changed).

    Raises:
        ValueError: a redaction's pointer does not lead to a string in ``body`` or its offsets fall outside it.
    """
    by_pointer: dict[str, list[Redaction]] = {}
    for r in redactions:
        by_pointer.setdefault(r.pointer, []).append(r)
    if not by_pointer:
        return body
    # every pointer that leads to a span (its own and its ancestors'), so each container is looked up once: the
    # whole rebuild is linear in the body and the spans
    above = {p[:i] for p in by_pointer for i, c in enumerate(p) if c == "/"}
    return _rebuild(body, "", by_pointer, above)


def _rebuild(node: Any, pointer: str, spans: dict[str, list[Redaction]], above: set[str]) -> Any:
    if isinstance(node, str):
        found = spans.get(pointer)
        return _replace(node, found) if found else node
    if isinstance(node, dict):
        if pointer not in above:
            return node
        return {k: _rebuild(v, f"{pointer}/{escape_pointer(k)}", spans, above) for k, v in node.items()}
    if isinstance(node, list):
        if pointer not in above:
            return node
        rebuilt = [_rebuild(v, f"{pointer}/{i}", spans, above) for i, v in enumerate(node)]
        return Repeated(rebuilt) if isinstance(node, Repeated) else rebuilt
    if pointer in spans:
        raise ValueError(f"redaction at {pointer or '/'} does not point to a string")
    return node


def _replace(text: str, found: list[Redaction]) -> str:
    parts: list[str] = []
    at = 0
    merged: list[list] = []  # [start, end, label, style]; overlapping spans (several rules or policies) become one
    for r in sorted(found, key=lambda r: (r.start, -r.end)):
        if not (0 <= r.start < r.end <= len(text)):
            raise ValueError(f"redaction {r.start}:{r.end} at {r.pointer or '/'} is outside its {len(text)} characters")
        if merged and r.start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], r.end)
        else:
            merged.append([r.start, r.end, r.label, r.style])
    for start, end, label, style in merged:
        parts += [text[at:start], replacement(text[start:end], label, style)]
        at = end
    parts.append(text[at:])
    return "".join(parts)


def _strings(node: Any, pointer: str) -> Iterator[tuple[str, str]]:
    """Every string value in ``node`` with its JSON pointer, in document order (object keys are not masked)."""
    stack: list[tuple[str, Any]] = [(pointer, node)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            yield where, value
        elif isinstance(value, dict):
            stack += [(f"{where}/{escape_pointer(k)}", v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{where}/{i}", v) for i, v in reversed(list(enumerate(value)))]


def masked_texts(body: Any, redactions: Iterable[Redaction]) -> set[str]:
    """What each of ``redactions`` masks in ``body``: the text of its span."""
    by_pointer: dict[str, list[Redaction]] = {}
    for r in redactions:
        by_pointer.setdefault(r.pointer, []).append(r)
    return {text[r.start : r.end] for pointer, text in _strings(body, "") for r in by_pointer.get(pointer, ())}


def _keys_and_strings(node: Any) -> list[str]:
    """Every object key and string value in ``node`` (a JSON value, a form mapping or text)."""
    out: list[str] = []
    stack = [node]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            out += [str(key) for key in value]
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return out


def escape_pointer(key: str) -> str:
    """``key`` as one reference token of a JSON pointer (RFC 6901 section 3: ``~`` -> ``~0``, ``/`` -> ``~1``)."""
    return key.replace("~", "~0").replace("/", "~1")
