"""The text a client shows of a streamed answer: the pieces an LLM API streams, joined.

An LLM's answer streams as many small events, each holding a few characters of it at the same place in its JSON:
``choices[0].delta.content`` (OpenAI's chat completions and the APIs that copy them), ``delta.text`` (Anthropic's
messages), ``delta`` (OpenAI's responses), ``candidates[0].content.parts[0].text`` (Gemini), ``message.content``
(Ollama's JSON Lines), ``token.text`` (Hugging Face TGI), or the event's data itself (a plain-text SSE stream). A
word, a credential or an instruction is cut across events, so each event's strings read on their own hide it:
``sk`` + ``-abcd`` + ``efgh123`` never matches ``sk-[A-Za-z0-9]{8,}``.

:class:`DeltaJoiner` reads a stream's complete events as they arrive (server-sent events; one JSON document per
line; or the elements of one JSON array, as Gemini streams without ``alt=sse``) as a client's JSON parser does
(Python's ``json``: ``NaN`` and lone surrogates read), and keeps, per place in the JSON, the strings the events held
there, in order. A place is a JSON pointer without array positions (a client concatenates the texts of an array,
Gemini's ``parts``), in which an array element with an integer ``index`` member is named by it
(``/choices/#1/delta/content``): OpenAI streams each of ``n`` answers, and each tool call, at array position 0 with
its ``index``. A string under an array is also at a second place, named by array positions (``@/choices/0/delta/
content``): a client that reads ``choices[0]`` (OpenAI's SDK loop) joins by position whatever ``index`` says, so an
upstream that gives each event its own ``index``, or leaves it out of one, still has its pieces joined. An SSE
event's data that is not a JSON object or array is text at ``data:<type>`` (the type of its last ``event:`` line,
``message`` when there is none or it is empty, as the SSE standard reads it) and also at ``@data``, all the stream's
text data whatever its type (a client that ignores the type joins them). The Vercel AI SDK's data stream (v4,
:data:`AI_DATA_STREAM_HEADER`) is read line by line, each line a part ``TYPE:JSON`` (``0:"sk-ab"``: text; ``g``:
reasoning; ``c``: a tool call's argument delta) whose strings are at ``/TYPE``, and a tool call's (an object with a
``toolCallId``) at ``/TYPE/<toolCallId>``: the SDK's client joins each call's deltas apart. The text an event that
opens a block holds (Anthropic's ``content_block.text`` and ``.thinking``, OpenAI's responses' ``part.text``) is at
the place of the deltas that continue it, its first piece. A place whose string is
the same in every event (an id, a model name) is metadata and is not joined; nor is OpenAI's random
``obfuscation`` padding.
:meth:`DeltaJoiner.joined` gives each joined place's pieces not yet sent, after the end of what it held before (so a
span cut where the sent text ends is seen whole), :meth:`DeltaJoiner.readings` those of the second places too;
:meth:`DeltaJoiner.hold_from` says where the events start that hold the last few characters of a joined text, which
wait for what follows before they are sent.

The places of the latest event are always followed. When more than :data:`MAX_PLACES` are, those of older events are
forgotten, least recently seen first, but remembered (:data:`MAX_FORGOTTEN`): one that comes back goes on from what
it held, so a flood of places between two pieces of an answer cuts no join. Past :data:`MAX_FORGOTTEN` forgotten
places the joiner gives up (:attr:`DeltaJoiner.overflow`) and the stream cannot be judged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from guard._json import is_json_media, surrogates_joined
from guard.policy.redact import escape_pointer

__all__ = ["AI_DATA_STREAM_HEADER", "JSON_LINES", "MAX_FORGOTTEN", "MAX_FORGOTTEN_PENDING", "MAX_PLACES", "DeltaJoiner",
           "joiner_for"]

#: Media types of one JSON document per line (JSON Lines, NDJSON, RFC 7464 JSON text sequences).
JSON_LINES = frozenset({"application/x-ndjson", "application/ndjson", "application/jsonl", "application/x-jsonl",
                        "application/jsonlines", "application/x-jsonlines", "application/json-seq"})
#: The response header (lower-case) of the Vercel AI SDK's data stream protocol (v4's ``toDataStreamResponse``, sent
#: as ``text/plain``): its lines are parts ``TYPE:JSON``, the text ``0:"..."``.
AI_DATA_STREAM_HEADER = "x-vercel-ai-data-stream"

#: Most places one stream's joiner follows at once, besides those of the latest event; when more are, the places
#: seen least recently are forgotten (and remembered: :data:`MAX_FORGOTTEN`).
MAX_PLACES = 4096
#: Most places one stream's joiner remembers having forgotten (by a hash of the place: its first string, whether it
#: varied, the end of its sent text and its pieces not yet sent); past that the stream cannot be followed and
#: :attr:`DeltaJoiner.overflow` says so.
MAX_FORGOTTEN = 16_384
#: Most characters of a forgotten place's unsent pieces kept (after the ``context_chars`` of its sent text); a place
#: forgotten with more (a stream merging events into large chunks) makes the stream uninspectable rather than lose
#: text never judged joined (16,384 forgotten places: about 25 MB at most).
MAX_FORGOTTEN_PENDING = 1024
_LINE_END = re.compile(r"\r\n|\r|\n")


#: Keys whose strings are padding, not text: OpenAI adds a random ``obfuscation`` string to every streamed delta.
_PADDING = frozenset({"obfuscation"})
#: Places where the event that opens a block of an answer may hold its first text, each read at the place of the
#: deltas that continue it, as a client appends them: Anthropic's ``content_block_start`` (a text or thinking
#: block's ``text`` or ``thinking``) and OpenAI's responses' ``response.content_part.added`` (its ``part.text``).
_OPENINGS = {"/content_block/text": "/delta/text", "/content_block/thinking": "/delta/thinking",
             "/part/text": "/delta"}


def _index(element: Any) -> int | None:
    """The ``index`` an array element names itself by (an integer, or one written as a float or digits), else
    ``None``."""
    index = element.get("index") if isinstance(element, dict) else None
    if isinstance(index, bool):
        return None
    if isinstance(index, float) and index.is_integer():
        return int(index)
    if isinstance(index, str) and index.isascii() and index.isdigit():
        return int(index)
    return index if isinstance(index, int) else None


def _places(document: Any) -> Iterator[tuple[str, str]]:
    """Every non-empty string of ``document`` with its place, and then, under an array, its place by array positions
    (see the module doc), in document order."""
    stack: list[tuple[str, str | None, Any]] = [("", None, document)]  # (place, place by position: None = the same)
    while stack:
        where, position, value = stack.pop()
        if isinstance(value, str):
            if value:
                value = surrogates_joined(value)
                yield where, value
                if position is not None:
                    yield position, value
        elif isinstance(value, dict):
            keys = [(escape_pointer(k), v) for k, v in value.items() if k not in _PADDING]
            stack += [(f"{where}/{k}", None if position is None else f"{position}/{k}", v) for k, v in reversed(keys)]
        elif isinstance(value, list):
            at = f"@{where}" if position is None else position
            named = [_index(v) for v in value]
            stack += [(f"{where}/{'*' if n is None else f'#{n}'}", f"{at}/{i}", v)
                      for i, n, v in reversed(list(zip(range(len(value)), named, value, strict=True)))]


#: What the array reader looks at in a JSON array stream: an escape (with the character it escapes, when it came),
#: a quote, a bracket or a brace.
_STRUCTURE = re.compile(r'\\(.)?|["\[\]{}]', re.DOTALL)


class DeltaJoiner:
    """The pieces of a stream's events, joined per place (see the module doc). Offsets are in characters of the
    decoded stream, from its first.

    Args:
        sse: the stream is server-sent events: an event's lines run up to an empty line (its ``data:`` lines are
            joined as the SSE standard joins them); else, when it is not ``lines`` and starts with ``[``, each
            element of that array is an event, and otherwise every line is (JSON Lines, ``json-seq``).
        context_chars: characters of each place's sent text kept before its new pieces.
        max_event_chars: the longest event read; a longer one is left out of the joined text (its windows are
            judged as text, as any stream's are).
        lines: the stream is declared JSON Lines: every line is an event, whatever it starts with.
        parts: the stream is the Vercel AI SDK's data stream: every line is a part ``TYPE:JSON``, its strings placed
            under ``/TYPE`` (see the module doc).

    Attributes:
        complete_to: the offset where the last complete event read ends (a line, an SSE event, an array element).
        overflow: why the joiner cannot follow the stream's places (``None``: it can): more than
            :data:`MAX_FORGOTTEN` were forgotten, or one was forgotten with more than :data:`MAX_FORGOTTEN_PENDING`
            characters not yet judged. The stream cannot be judged joined.
    """

    def __init__(self, *, sse: bool, context_chars: int, max_event_chars: int, lines: bool = False,
                 parts: bool = False) -> None:
        self.sse, self.context_chars, self.max_event_chars, self.parts = sse, context_chars, max_event_chars, parts
        self._fed = 0  # characters read so far
        self._parts: list[str] = []  # the line (array stream: the element) being read, in the pieces it came in
        self._part_chars = 0
        self._part_at = 0  # offset where it starts
        self._skip = False  # the line, SSE event or array element being read is too long: left out
        self._after_cr = False  # the text so far ends with a CR, whose LF (if it comes) ends no other line
        self._lines: list[str] = []  # the lines of the SSE event being read
        self._event_chars = 0
        self._event_at = 0  # offset where the SSE event being read starts
        self._array: bool | None = False if sse or lines or parts else None  # one JSON array (None: not known yet)
        self._depth = 0  # array stream: brackets and braces open
        self._in_string = False  # array stream: inside a string
        self._escaped = False  # array stream: the next character is escaped (a backslash ended the last text)
        self.complete_to = 0
        self._latest = -1  # offset of the last event read that held a string
        self.overflow: str | None = None
        # hash(place) -> (its first string's key, whether it varied, the end of its text) of a forgotten place
        self._forgotten: dict[int, tuple[tuple[int, int], bool, str]] = {}
        self._first: dict[str, tuple[int, int]] = {}  # place -> (hash, length) of the first string seen there
        self._seen: dict[str, int] = {}  # place -> the offset of the last event that held a string there
        self._varies: set[str] = set()  # places whose string changed from one event to another
        self._before: dict[str, str] = {}  # place -> the end of its sent text
        self._pieces: dict[str, list[tuple[int, str]]] = {}  # place -> (event offset, string) not yet sent

    def feed(self, text: str, *, final: bool = False) -> None:
        """Read ``text``, the stream's next decoded characters (``final``: the stream ends after them). Each
        character is read once; the line or element being read is kept in pieces until it ends."""
        at = self._fed
        self._fed += len(text)
        if at == 0 and text.startswith("\ufeff"):  # a BOM, which clients drop
            text, at = text[1:], 1
        if self._array is None and (first := text.lstrip()[:1]):
            self._array = first == "["
        if self._array:
            self._feed_array(text, at)
        else:
            self._feed_lines(text, at, final)

    @property
    def open_from(self) -> int | None:
        """The offset where the array element being read starts (``None``: no element is open, or the stream is
        not one JSON array): nothing from there may be sent before the element was read whole."""
        if self._array and (self._depth >= 2 or (self._depth == 1 and self._in_string)):
            return self._part_at
        return None

    def _take(self, piece: str, at: int) -> None:
        """Keep ``piece`` (at offset ``at``) of the line or element being read, unless it grew too long to read."""
        if not self._parts and not self._skip:
            self._part_at = at
        self._part_chars += len(piece)
        if self._part_chars > self.max_event_chars:  # no event of a token stream is this long: not read
            self._parts, self._skip = [], True
        elif not self._skip and piece:
            self._parts.append(piece)

    def _taken(self) -> tuple[str, int, bool]:
        """The line or element read (its text, its offset, whether it was too long), and a fresh start."""
        out = ("".join(self._parts), self._part_at, self._skip)
        self._parts, self._part_chars, self._skip = [], 0, False
        return out

    def _feed_lines(self, text: str, at: int, final: bool) -> None:
        begin = 1 if self._after_cr and text.startswith("\n") else 0  # the LF of a CRLF cut between two texts
        if text:
            self._after_cr = text.endswith("\r")
        for end in _LINE_END.finditer(text, begin):
            self._take(text[begin:end.start()], at + begin)
            line, line_at, skipped = self._taken()
            self._line(None if skipped else line, line_at)
            self.complete_to = at + end.end()
            begin = end.end()
        self._take(text[begin:], at + begin)
        if final:
            line, line_at, skipped = self._taken()
            if line or skipped:
                self._line(None if skipped else line, line_at)
            self._line("", at + len(text))
            self.complete_to = at + len(text)

    def _feed_array(self, text: str, at: int) -> None:
        """Read the elements of a streamed JSON array: each object, array or string at depth 1, once it closed."""
        begin = 0  # where the part of ``text`` that belongs to an open element starts
        position = 0
        if self._escaped and text:  # the character a backslash at the end of the last text escapes
            self._escaped, position = False, 1
        for match in _STRUCTURE.finditer(text, position):
            char = match.group()
            if char[0] == "\\":
                self._escaped = match.group(1) is None  # the escaped character is still to come
                continue
            opens = char in "[{" or (char == '"' and not self._in_string)
            if self._in_string:
                self._in_string = char != '"'
                if self._in_string or self._depth > 1:
                    continue
            elif char == '"':
                self._in_string = True
            elif opens:
                self._depth += 1
            else:
                self._depth -= 1
            if opens and self._depth == (1 if char == '"' else 2):  # an element starts
                begin = match.start()
                self._parts, self._part_chars, self._skip, self._part_at = [], 0, False, at + begin
            elif not opens and self._depth == 1:  # an element ends
                self._take(text[begin:match.end()], at + begin)
                element, element_at, skipped = self._taken()
                if not skipped:
                    self._event(element, element_at)
                self.complete_to = at + match.end()
        if self._depth >= 2 or (self._depth == 1 and self._in_string):
            self._take(text[begin:], at + begin)

    def _line(self, line: str | None, at: int) -> None:
        """One line (``None``: one too long to read, which leaves its SSE event out)."""
        if not self.sse:
            if line and self.parts:
                kind, colon, data = line.partition(":")  # as the SDK's client splits a part: at its first colon
                if colon:
                    self._event(data, at, part=kind)
            elif line:
                self._event(line.removeprefix("data:").lstrip("\x1e"), at)
            return
        if line == "":  # an SSE event ends
            if self._lines and self._event_chars <= self.max_event_chars:
                data, kind = [], ""
                for field in self._lines:  # as the SSE standard parses a field: name, colon, one optional space
                    name, _, value = field.partition(":")
                    value = value.removeprefix(" ")
                    if name == "data":
                        data.append(value)
                    elif name == "event":
                        kind = value  # the last one counts
                if data:
                    self._event("\n".join(data), self._event_at, text_place=f"data:{kind or 'message'}")
            self._lines, self._event_chars = [], 0
        elif line is None or self._event_chars + len(line) > self.max_event_chars:
            self._lines, self._event_chars = [], self.max_event_chars + 1
        else:
            if not self._lines and not self._event_chars:
                self._event_at = at
            if line.startswith(("data", "event")):  # the fields read (others, and comments, need not be kept)
                self._lines.append(line)
            self._event_chars += len(line) + 1

    def _event(self, data: str, at: int, text_place: str | None = None, part: str | None = None) -> None:
        """Take one event's strings; ``data`` that is not JSON is a string at ``text_place`` (an SSE event's data,
        per event type), or nothing. ``part``: the type of the data stream part whose JSON ``data`` is."""
        try:  # as a client reads it: Python's json takes NaN, Infinity and lone surrogates that strict JSON refuses
            document = json.loads(data)
        except (ValueError, RecursionError):
            document = None
        if part is not None and document is not None:
            call = document.get("toolCallId") if isinstance(document, dict) else None
            document = {part: {call: document} if isinstance(call, str) else document}
        if isinstance(document, dict | list):
            strings = [(_OPENINGS.get(place, place), value) for place, value in _places(document)]
        elif isinstance(document, str):  # a token sent as a JSON string (LangServe, sse-starlette): its value
            strings = [(text_place or "", surrogates_joined(document))] if document else []
        else:  # SSE data that is a JSON number or literal (``8812``, ``true``: a plain-text stream's token) is text
            strings = [] if text_place is None else [(text_place, surrogates_joined(data))]
        if text_place is not None and strings and strings[0][0] == text_place:  # all text data, whatever its type
            strings.append(("@data", strings[0][1]))
        new = False
        for place, value in strings:  # a place an event holds several times (an array's texts): each a piece
            self._latest = at
            key = (hash(value), len(value))
            first = self._first.get(place)
            if first is None:
                remembered = self._forgotten.pop(hash(place), None) if self._forgotten else None
                if remembered is not None:  # a forgotten place comes back: it goes on from what it held
                    first, varied, tail = remembered
                    if varied:
                        self._varies.add(place)
                    if tail:
                        self._before[place] = tail
                else:
                    first = key
                self._first[place] = first
                new = True
            if first != key:
                self._varies.add(place)
            self._seen[place] = at
            self._pieces.setdefault(place, []).append((at, value))
        if new and len(self._first) > MAX_PLACES:
            self._forget(at)

    def _forget(self, at: int) -> None:
        """Make room in a full table: forget the places seen least recently (the deepest first among those seen
        together), none in the event at ``at``, down to three quarters of the table (an answer's place is seen in
        every event of it, so it stays). A forgotten place is remembered (by a hash of it: its first string, whether
        it varied, the end of its sent text and its pieces not yet sent), so back with new text it is joined after
        what it held (a flood of places between two pieces of an answer cuts no join); past :data:`MAX_FORGOTTEN`
        forgotten places :attr:`overflow` says the stream cannot be followed."""
        older = sorted((last, -place.count("/"), place) for place, last in self._seen.items() if last < at)
        if not older:
            return
        for _, _, place in older[: len(self._first) - 3 * MAX_PLACES // 4]:
            # the end of its sent text (already cut to context_chars) and its pieces not yet sent
            pending = "".join(value for _, value in self._pieces.get(place, ()))
            if len(pending) > MAX_FORGOTTEN_PENDING:  # not kept, and never judged joined: the stream cannot be
                self.overflow = (f"a place guard had to forget held more than {MAX_FORGOTTEN_PENDING} characters "
                                 "not yet judged")
            tail = self._before.get(place, "") + pending[-MAX_FORGOTTEN_PENDING:]
            self._forgotten[hash(place)] = (self._first[place], place in self._varies, tail)
            for table in (self._first, self._seen, self._before, self._pieces):
                table.pop(place, None)
            self._varies.discard(place)
        if len(self._forgotten) > MAX_FORGOTTEN:
            self.overflow = (f"the stream's events hold more places than guard follows (over {MAX_FORGOTTEN} "
                             "forgotten)")

    def joined(self) -> tuple[tuple[str, ...], ...]:
        """Per joined place with pieces not yet sent, in the order first seen: the end of its sent text (when
        there is any), then each such piece. Places by array position and ``@data`` are left out
        (:meth:`readings` has them)."""
        return tuple(self._reading(p, pieces) for p, pieces in self._pieces.items()
                     if p in self._varies and pieces and not p.startswith("@"))

    def readings(self) -> tuple[tuple[str, ...], ...]:
        """As :meth:`joined`, for every joined place, those by array position and ``@data`` too, each distinct
        reading once (a stream whose ``index`` is its position reads the same both ways)."""
        return tuple(dict.fromkeys(self._reading(p, pieces) for p, pieces in self._pieces.items()
                                   if p in self._varies and pieces))

    def _reading(self, place: str, pieces: list[tuple[int, str]]) -> tuple[str, ...]:
        """The end of ``place``'s sent text (when there is any), then each of its ``pieces`` not yet sent."""
        before = self._before.get(place)
        return (*((before,) if before else ()), *(value for _, value in pieces))

    def hold_from(self, chars: int, *, after: int = 0) -> int | None:
        """The offset of the first event from ``after`` on to keep back until more follows (``None``: none, or
        ``chars`` is 0): one that holds one of the last ``chars`` characters of a joined place's unsent text, or
        the last event, when it holds the first string seen at a place (which the next event may continue). Sent
        no earlier than what follows them, a span that starts there is judged with at least ``chars`` characters of
        itself before any of it leaves."""
        if not chars:
            return None
        held: list[int] = []
        for place, pieces in self._pieces.items():
            if place not in self._varies:
                if len(pieces) == 1 and pieces[0][0] == self._latest and place not in self._before:
                    held.append(self._latest)  # the first string seen there: the next event may continue it
                continue
            count = 0
            for at, value in reversed(pieces):
                if count >= chars or at < after:
                    break
                held.append(at)
                count += len(value)
        return min((at for at in held if at >= after), default=None)

    def mark(self, sent_to: int) -> None:
        """The stream was sent up to offset ``sent_to``: the pieces of events before it join each place's sent
        text, of which the last ``context_chars`` characters are kept."""
        for place, pieces in self._pieces.items():
            sent = [value for at, value in pieces if at < sent_to]
            if sent:
                text = self._before.get(place, "") + "".join(sent)
                self._before[place] = text[-self.context_chars:] if self.context_chars else ""
                del pieces[:len(sent)]


def joiner_for(media: str, *, context_chars: int, max_event_chars: int,
               data_stream: bool = False) -> DeltaJoiner | None:
    """A joiner for a stream of ``media`` (lower-case, without parameters) whose events a client may join: SSE, JSON
    Lines, JSON, or, with ``data_stream`` (the response has :data:`AI_DATA_STREAM_HEADER`) and not SSE, the Vercel AI
    SDK's data stream; ``None`` for another (text, HTML, XML)."""
    sse = media == "text/event-stream"
    if data_stream and not sse:
        return DeltaJoiner(sse=False, context_chars=context_chars, max_event_chars=max_event_chars, parts=True)
    if not (sse or media in JSON_LINES or is_json_media(media)):
        return None
    return DeltaJoiner(sse=sse, context_chars=context_chars, max_event_chars=max_event_chars,
                       lines=media in JSON_LINES)
