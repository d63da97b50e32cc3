"""The text a client shows of a streamed answer: the pieces an LLM API streams, joined.

An LLM's answer streams as many small events, each holding a few characters of it at the same place in its JSON:
``choices[0].delta.content`` (OpenAI's chat completions and the APIs that copy them), ``delta.text`` (Anthropic's
messages), ``delta`` (OpenAI's responses), ``candidates[0].content.parts[0].text`` (Gemini), ``message.content``
(Ollama's JSON Lines). A word, a credential or an instruction is cut across events, so each event's strings read
on their own hide it: ``sk`` + ``-abcd`` + ``efgh123`` never matches ``sk-[A-Za-z0-9]{8,}``.

:class:`DeltaJoiner` reads a stream's complete events as they arrive (server-sent events, or one JSON document per
line) as a client's JSON parser does (Python's ``json``: ``NaN`` and lone surrogates read), and keeps, per place
in the JSON, the strings the events held there, in order. A place is a JSON pointer in which an object with an
integer ``index`` member is named by it (``/choices/0#1/delta/content``): OpenAI streams each of ``n`` answers, and
each tool call, at array position 0 with its ``index``. A place whose string is the same in every event (an id, a
model name) is metadata and is not joined. :meth:`DeltaJoiner.joined` gives each joined place's pieces not yet sent,
after the end of what it held before (so a span cut where the sent text ends is seen whole);
:meth:`DeltaJoiner.hold_from` says where the events start that hold the last few characters of a joined text, which
wait for what follows before they are sent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from guard._json import surrogates_joined
from guard.policy.redact import escape_pointer

__all__ = ["MAX_PLACES", "DeltaJoiner"]

#: Most places one stream's joiner follows at once; when full, places seen in one earlier event only are forgotten
#: (an event's own strings are judged with it in any case).
MAX_PLACES = 4096
_LINE_END = re.compile(r"\r\n|\r|\n")


def _places(document: Any) -> Iterator[tuple[str, str]]:
    """Every non-empty string of ``document`` with its place (see the module doc), in document order."""
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if value:
                yield where, surrogates_joined(value)
        elif isinstance(value, dict):
            index = value.get("index")
            if isinstance(index, int) and not isinstance(index, bool):
                where = f"{where}#{index}"
            stack += [(f"{where}/{escape_pointer(k)}", v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{where}/{i}", v) for i, v in reversed(list(enumerate(value)))]


class DeltaJoiner:
    """The pieces of a stream's events, joined per place (see the module doc). Offsets are in characters of the
    decoded stream, from its first.

    Args:
        sse: the stream is server-sent events: an event's lines run up to an empty line (its ``data:`` lines are
            joined as the SSE standard joins them); else every line is an event (JSON Lines, ``json-seq``).
        context_chars: characters of each place's sent text kept before its new pieces.
        max_event_chars: the longest event read; a longer one is left out of the joined text (its windows are
            judged as text, as any stream's are).
    """

    def __init__(self, *, sse: bool, context_chars: int, max_event_chars: int) -> None:
        self.sse, self.context_chars, self.max_event_chars = sse, context_chars, max_event_chars
        self._buffer = ""  # text not yet ended by a line break
        self._buffer_at = 0  # offset of the buffer's first character
        self._scanned = 0  # characters of the buffer known to hold no line break
        self._skip = False  # the line (SSE: the event) being read is too long: left out
        self._lines: list[str] = []  # the lines of the SSE event being read
        self._event_chars = 0
        self._event_at = 0  # offset where the SSE event being read starts
        self._latest = -1  # offset of the last event read that held a string
        self._forgotten_at = -1  # offset of the last event that made the joiner forget places
        self._first: dict[str, tuple[int, int]] = {}  # place -> (hash, length) of the first string seen there
        self._seen: dict[str, int] = {}  # place -> the offset of the last event that held a string there
        self._varies: set[str] = set()  # places whose string changed from one event to another
        self._before: dict[str, str] = {}  # place -> the end of its sent text
        self._pieces: dict[str, list[tuple[int, str]]] = {}  # place -> (event offset, string) not yet sent

    def feed(self, text: str, *, final: bool = False) -> None:
        """Read ``text``, the stream's next decoded characters (``final``: the stream ends after them). Each
        character is searched for a line break once."""
        self._buffer += text
        # a CR at the end may be the first half of a CRLF: wait for the next character unless the stream ended
        cut = len(self._buffer) if final or not self._buffer.endswith("\r") else len(self._buffer) - 1
        at = 0
        for end in _LINE_END.finditer(self._buffer, self._scanned, cut):
            self._line(self._buffer[at:end.start()], self._buffer_at + at)
            at = end.end()
        if final:
            if at < len(self._buffer):
                self._line(self._buffer[at:], self._buffer_at + at)
            at = len(self._buffer)
            self._line("", self._buffer_at + at)
        self._buffer, self._buffer_at, self._scanned = self._buffer[at:], self._buffer_at + at, max(cut - at, 0)
        if len(self._buffer) > self.max_event_chars:  # a line no event of a token stream is: not read
            self._buffer_at += len(self._buffer)
            self._buffer, self._scanned, self._skip = "", 0, True

    def _line(self, line: str, at: int) -> None:
        if self._skip:  # the rest of a line too long to read (SSE: of such an event, up to its empty line)
            self._skip = bool(self.sse and line)
            self._lines, self._event_chars = [], 0
            return
        if not self.sse:
            if line:
                self._event(line.removeprefix("data:").lstrip("\x1e"), at)
        elif line:
            if not self._lines:
                self._event_at = at
            self._lines.append(line)
            self._event_chars += len(line)
            if self._event_chars > self.max_event_chars:
                self._skip, self._lines, self._event_chars = True, [], 0
        elif self._lines:
            data = [line[5:].removeprefix(" ") for line in self._lines if line.startswith("data:")]
            self._lines, self._event_chars = [], 0
            if data:
                self._event("\n".join(data), self._event_at)

    def _event(self, data: str, at: int) -> None:
        try:  # as a client reads it: Python's json takes NaN, Infinity and lone surrogates that strict JSON refuses
            document = json.loads(data)
        except (ValueError, RecursionError):
            return
        seen: set[str] = set()
        for place, value in _places(document):
            if place in seen:
                continue
            seen.add(place)
            self._latest = at
            first = self._first.get(place)
            if first is None:
                if len(self._first) >= MAX_PLACES and self._forgotten_at < at:
                    self._forget(at)
                if len(self._first) >= MAX_PLACES:
                    continue
                self._first[place] = (hash(value), len(value))
            elif first != (hash(value), len(value)):
                self._varies.add(place)
            self._seen[place] = at
            self._pieces.setdefault(place, []).append((at, value))

    def _forget(self, at: int) -> None:
        """Forget the places seen in one event before ``at`` only (once per event: an event with more new places
        than there is room for leaves the rest out). A forgotten place's string was judged with its event; seen
        again, it starts afresh."""
        self._forgotten_at = at
        for place in [p for p, last in self._seen.items()
                      if last < at and p not in self._varies and len(self._pieces.get(p, ())) <= 1]:
            for table in (self._first, self._seen, self._before, self._pieces):
                table.pop(place, None)

    def joined(self) -> tuple[tuple[str, ...], ...]:
        """Per joined place with pieces not yet sent, in the order first seen: the end of its sent text (when
        there is any), then each such piece."""
        return tuple(
            (*((self._before[p],) if self._before.get(p) else ()), *(value for _, value in pieces))
            for p, pieces in self._pieces.items() if p in self._varies and pieces
        )

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
