"""The text a client shows of a streamed answer: the pieces an LLM API streams, joined.

An LLM's answer streams as many small events, each holding a few characters of it at the same place in its JSON:
``choices[0].delta.content`` (OpenAI's chat completions and the APIs that copy them), ``delta.text`` (Anthropic's
messages), ``delta`` (OpenAI's responses), ``candidates[0].content.parts[0].text`` (Gemini), ``message.content``
(Ollama's JSON Lines). A word, a credential or an instruction is cut across events, so each event's strings read
on their own hide it: ``sk`` + ``-abcd`` + ``efgh123`` never matches ``sk-[A-Za-z0-9]{8,}``.

:class:`DeltaJoiner` reads a stream's complete events as they arrive (server-sent events, or one JSON document per
line) and keeps, per JSON pointer, the strings the events held there, in order. A pointer whose string is the same
in every event (an id, a model name) is metadata and is not joined. :meth:`DeltaJoiner.joined` gives each joined
pointer's pieces not yet sent, after the end of what it held before (so a span cut where the sent text ends is seen
whole); :meth:`DeltaJoiner.hold_from` says where the events start that hold the last few characters of a joined
text, which wait for what follows before they are sent.
"""

from __future__ import annotations

import re

from guard._json import json_readings
from guard.policy.redact import pointed_strings

__all__ = ["MAX_POINTERS", "DeltaJoiner"]

#: Most JSON pointers one stream's joiner follows; the strings at further ones are judged event by event only.
MAX_POINTERS = 1024
_LINE_END = re.compile(r"\r\n|\r|\n")


class DeltaJoiner:
    """The pieces of a stream's events, joined per JSON pointer (see the module doc). Offsets are in characters of
    the decoded stream, from its first.

    Args:
        sse: the stream is server-sent events: an event's lines run up to an empty line (its ``data:`` lines are
            joined as the SSE standard joins them); else every line is an event (JSON Lines, ``json-seq``).
        context_chars: characters of each pointer's sent text kept before its new pieces.
    """

    def __init__(self, *, sse: bool, context_chars: int) -> None:
        self.sse, self.context_chars = sse, context_chars
        self._buffer = ""  # text not yet ended by a line break
        self._buffer_at = 0  # offset of the buffer's first character
        self._lines: list[str] = []  # the lines of the SSE event being read
        self._event_at = 0  # offset where the SSE event being read starts
        self._first: dict[str, str] = {}  # pointer -> the first string seen there
        self._latest = -1  # offset of the last event read that held a string
        self._varies: set[str] = set()  # pointers whose string changed from one event to another
        self._before: dict[str, str] = {}  # pointer -> the end of its sent text
        self._pieces: dict[str, list[tuple[int, str]]] = {}  # pointer -> (event offset, string) not yet sent

    def feed(self, text: str, *, final: bool = False) -> None:
        """Read ``text``, the stream's next decoded characters (``final``: the stream ends after them)."""
        self._buffer += text
        # a CR at the end may be the first half of a CRLF: wait for the next character unless the stream ended
        cut = len(self._buffer) if final or not self._buffer.endswith("\r") else len(self._buffer) - 1
        at = 0
        for end in _LINE_END.finditer(self._buffer, 0, cut):
            self._line(self._buffer[at:end.start()], self._buffer_at + at)
            at = end.end()
        if final:
            if at < len(self._buffer):
                self._line(self._buffer[at:], self._buffer_at + at)
            at = len(self._buffer)
            self._line("", self._buffer_at + at)
        self._buffer, self._buffer_at = self._buffer[at:], self._buffer_at + at

    def _line(self, line: str, at: int) -> None:
        if not self.sse:
            if line:
                self._event(line, at)
        elif line:
            if not self._lines:
                self._event_at = at
            self._lines.append(line)
        elif self._lines:
            self._event("\n".join(self._lines), self._event_at)
            self._lines = []

    def _event(self, text: str, at: int) -> None:
        seen: set[str] = set()
        for document in json_readings(text):
            for pointer, value in pointed_strings(document):
                if pointer in seen or not value:  # a key one event repeats (collected duplicates) counts once
                    continue
                seen.add(pointer)
                self._latest = at
                first = self._first.get(pointer)
                if first is None:
                    if len(self._first) >= MAX_POINTERS:
                        continue
                    self._first[pointer] = value
                elif value != first:
                    self._varies.add(pointer)
                self._pieces.setdefault(pointer, []).append((at, value))

    def joined(self) -> tuple[tuple[str, ...], ...]:
        """Per joined pointer with pieces not yet sent, in the order first seen: the end of its sent text (when
        there is any), then each such piece."""
        return tuple(
            (*((self._before[p],) if self._before.get(p) else ()), *(value for _, value in pieces))
            for p, pieces in self._pieces.items() if p in self._varies and pieces
        )

    def hold_from(self, chars: int, *, after: int = 0) -> int | None:
        """The offset of the first event from ``after`` on to keep back until more follows (``None``: none, or
        ``chars`` is 0): one that holds one of the last ``chars`` characters of a joined pointer's unsent text, or
        the last event, when it holds the first string seen at a pointer (which the next event may continue). Sent
        no earlier than what follows them, a span that starts there is judged with at least ``chars`` characters of
        itself before any of it leaves."""
        if not chars:
            return None
        held: list[int] = []
        for pointer, pieces in self._pieces.items():
            if pointer not in self._varies:
                if len(pieces) == 1 and pieces[0][0] == self._latest and pointer not in self._before:
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
        """The stream was sent up to offset ``sent_to``: the pieces of events before it join each pointer's sent
        text, of which the last ``context_chars`` characters are kept."""
        for pointer, pieces in self._pieces.items():
            sent = [value for at, value in pieces if at < sent_to]
            if sent:
                text = self._before.get(pointer, "") + "".join(sent)
                self._before[pointer] = text[-self.context_chars:] if self.context_chars else ""
                del pieces[:len(sent)]
