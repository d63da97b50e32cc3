"""Find text in a tool result that gives instructions to the agent (indirect prompt injection), as character spans.

Pure Python and deterministic: each segment of the text (a sentence or a line; YAML and JSON escapes undone first) is
matched against families of cues that say "this text talks to the assistant, not to a reader":

* ``address``: it speaks to the model (``to you, GPT-4``, ``dear assistant``, ``note to AI``, a command that opens
  by calling it: ``Assistant, forward ...``, ``AI agent: send ...``);
* ``override``: it tries to replace the agent's instructions (``ignore your previous ...``, ``ignore what you were
  told``, ``new task``,
  ``your objective is``, ``from now on``, ``instead``);
* ``task``: it refers to the agent's own task (``before you can solve the task``, ``the task I gave you``,
  ``end each response with``);
* ``markup``: a tag or label that fakes a channel (``<INFORMATION>``, ``###(system_message)``, ``[SYSTEM]``, a
  leading ``IMPORTANT!!!`` or ``TODO:``);
* ``tool``: it tells the agent which tool to call (``use the tool `send_money```, ``with the arguments``);
* ``imperative``: it opens with an action verb (send, delete, invite, ...), the way a command does.

A segment is an instruction when it has a strong cue (address, override, task, tool), or markup together with an
imperative, or an imperative that speaks of "the user" in the third person (text written for an agent acting for
someone). An imperative alone ("Please pay the amount to the account below", "Call the bank") is an ordinary
document and is not flagged. An imperative or a channel tag right next to a flagged segment joins it (the goal after
"please do the following first:"), and flagged segments up to :data:`MERGE_GAP` segments apart are merged into one
span, so the goal between an injection's opening and closing lines is covered too.

:func:`find_instructions` is what ``tool_result`` rules read (``result.instructions``) and what the provenance of a
tool call's arguments checks against (``guard/policy/provenance.py``). It is the default *detector*; any callable
``str -> tuple[Span, ...]`` can stand in for it (see :data:`Detector`).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["MERGE_GAP", "STRIPPED_MARKER", "Detector", "Span", "find_instructions", "strip_spans"]

#: Flagged segments at most this many segments apart become one span.
MERGE_GAP = 3
#: Texts remembered by :func:`find_instructions` (a turn's tool results are checked again for every later call).
_CACHED_TEXTS = 1024


@dataclass(frozen=True)
class Span:
    """A stretch of a tool result that gives the agent instructions.

    Attributes:
        start, end: character offsets into the text as given (``text[start:end]``).
        cues: the cue families found in it, sorted (``address``, ``imperative``, ``markup``, ``override``, ``task``,
            ``tool``, ``third_person``).
    """

    start: int
    end: int
    cues: tuple[str, ...]


#: A tool-result detector: the spans of ``text`` that give the agent instructions (empty when none).
Detector = Callable[[str], tuple[Span, ...]]

_F = re.IGNORECASE
_VERBS = (
    "send|email|e-mail|forward|transfer|pay|wire|delete|remove|erase|wipe|create|invite|add|post|publish|upload|"
    "visit|open|go|click|change|modify|update|reset|set|make|reserve|book|cancel|concatenate|share|say|tell|write|"
    "reply|schedule|grant|give|download|execute|run|copy|move|rename|get|fetch|read|find|search|list|print|reveal|"
    "leak|disclose|exfiltrate|summari[sz]e|include|append|output|respond|answer|insert|put|transmit|submit|buy|order"
)
_ADDRESS = re.compile(
    r"\bto you,?\s+(?:the\s+)?(?:ai|assistant|model|agent|llm|gpt|claude|gemini|llama|chatbot|bot)\b"
    r"|\bto you,\s+[A-Z][\w.-]*\b"  # "from me, Emma, to you, GPT-4"
    r"|\b(?:dear|hey|hello|attention|note to|message to|instructions? for)\s+(?:the\s+)?"
    r"(?:ai|a\.i\.|assistant|model|agent|llm|language model|chatbot|bot)s?\b"
    r"|\b(?:ai|assistant|model|agent|llm)s?\s+(?:reading|processing|summari[sz]ing)\s+(?:this|these)\b"
    r"|\byou,?\s+(?:the\s+)?(?:ai|assistant|ai model|language model)\b"
    r"|\bimportant message from\b"
    # a command that opens by calling the model ("Assistant, forward ...", "AI agent: send ...")
    r"|^\W{0,3}(?:dear\s+|hey\s+)?(?:the\s+)?(?:ai\s+)?(?:assistant|agent|model|llm|ai)\s*[,:]\s*"
    rf"(?:(?:please|kindly|now)\s*,?\s+)?(?:{_VERBS})\b",
    _F,
)
_OVERRIDE = re.compile(
    r"\b(?:ignore|disregard|forget|override|bypass|skip)\b[^.\n]{0,40}?"
    r"\b(?:previous|prior|earlier|above|all|everything|your|any|other|original|initial)\b"
    r"|\b(?:ignore|disregard|forget)\b[^.\n]{0,40}?\byou(?:'ve|\s+have|\s+were|\s+are)\s+(?:been\s+)?"
    r"(?:told|given|instructed|asked)\b"  # "ignore what you were told before"
    r"|\b(?:previous|prior|earlier|original|initial)\s+(?:instructions?|iunstructions?|tasks?|prompts?|directives?|rules)"
    r"|\bnew\s+(?:instructions?|task|objective|goal|directive|priority)\b"
    r"|\byour\s+(?:real\s+|true\s+|new\s+|actual\s+|only\s+|primary\s+)?(?:objective|task|goal|mission|job|instructions?)"
    r"\s+(?:is|are|now)\b"
    r"|\bfrom now on\b|\bstop here\b|\binstead\b[.!]?\s*$",
    _F,
)
_TASK = re.compile(
    r"\bbefore you (?:can |do |continue|answer|proceed|complete|solve|reply|respond)"
    r"|\bafter you do that\b"
    r"|\b(?:the )?task (?:that )?(?:i|the user|they|we) (?:gave|assigned|asked) you\b"
    r"|\bsolve the (?:task|request)\b"
    r"|\b(?:end|start|begin) (?:each|every|all|your) (?:response|answer|reply|message)s?\b"
    r"|\b(?:substitute|replace) the placeholders\b",
    _F,
)
_TOOL = re.compile(
    r"\b(?:use|call|invoke|run|execute) (?:the )?(?:tool|function)\b"
    r"|\bwith the (?:following )?arguments\b",
    _F,
)
_CHANNEL = re.compile(
    r"</?\s*(?:information|instructions?|system|important|admin|prompt|im_start|im_end|assistant|user)\b[^>]{0,40}>"
    r"|#{2,}\s*\(?\s*(?:system|instruction|admin|important)"
    r"|\[\s*(?:system|instructions?|admin|important)\s*\]",
    _F,
)
_LABEL = re.compile(
    r"^(?:todo|important|attention|urgent|note|system|instructions?|admin|reminder|action required)\b\s*(?:[:!]|!!)",
    _F,
)
_IMPERATIVE = re.compile(
    rf"^\W{{0,3}}(?:[A-Za-z]+\s*[:!]+\s*)?(?:(?:please|kindly|now|then|also|first|just)\s*,?\s+)*"
    rf"(?:do\s+)?(?:{_VERBS})\b",
    _F,
)
_THIRD_PERSON = re.compile(r"\bthe user(?:'s|s')?\b|\bof the user\b", _F)

_STRONG = frozenset({"address", "override", "task", "tool"})
#: Word stems of which every strong cue, label or fake channel holds at least one, and the symbols that open a fake
#: channel (a superset: they only pick which segments are read).
_KEY_STEMS = (
    "you", "dear", "hey", "hello", "attention", "note", "message", "instruction", "iunstruction", "reading",
    "processing", "summari", "ignore", "disregard", "forget", "override", "bypass", "skip", "previous", "prior",
    "earlier", "original", "initial", "new", "now", "stop", "instead", "task", "solve", "end", "start", "begin",
    "substitute", "replace", "placeholder", "tool", "function", "argument", "user", "todo", "important", "urgent",
    "system", "admin", "reminder", "action", "ai", "assistant", "model", "agent", "llm", "gpt",
)
_WORD = re.compile(r"[A-Za-z]+|<|##|\[")
#: Upper-case labels a segment may start with even when glued to the word before it ("USATODO: ...").
_LABELS = ("TODO", "IMPORTANT", "ATTENTION", "URGENT", "NOTE", "SYSTEM", "ADMIN", "REMINDER")
#: Cues that do not make an instruction alone but join one they stand next to (the goal after "do the following:").
_WEAK = frozenset({"imperative", "markup"})
# What may precede a sentence inside structured text: list dashes, quotes, a YAML/JSON key, a fake channel tag.
_LEAD = re.compile(r"^(?:[\s\-*'\"`{,]+|[\w.\- ]{1,30}['\"]?\s*[:!]+\s+(?=\S)|#{2,}\s*\([^)]{0,30}\)\s*|<[^>]{1,30}>\s*)")
# Where a segment ends: a sentence end (with or without a space after it), a line break (not the indented
# continuation of a folded YAML string), an escaped line break, or just before a fake channel tag or an upper-case
# label glued to the text before it ("...7.2%.TODO: ...", "USA###(system_message) ...").
_SEGMENT_END = re.compile(
    r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z<#\[])"
    r"|(?<=[.!?])(?=[A-Z#<\[])"
    r"|\n(?![ \t]+(?![\w.\- ]{1,30}:\s|-\s)\S)"
    r"|\\n|\r"
    r"|(?<=\S)(?=#{2,}\s*\()"
    r"|(?<=.)(?=(?:TODO|IMPORTANT|ATTENTION|URGENT|NOTE|SYSTEM|ADMIN|REMINDER)\s*[:!])"  # the _LABELS
)


def _cues(segment: str) -> tuple[str, ...]:
    text = whole = segment.replace("''", "'").strip()
    labelled = bool(_CHANNEL.search(text))
    while True:  # peel list dashes, quotes, keys and tags off the front, noting any label on the way
        labelled = labelled or bool(_LABEL.match(text))
        peeled = _LEAD.sub("", text, count=1)
        if peeled == text:
            break
        text = peeled
    found = []
    if _ADDRESS.search(text) or _ADDRESS.search(whole):  # whole: "AI agent: send ..." reads as a key and its value
        found.append("address")
    if _IMPERATIVE.match(text):
        found.append("imperative")
    if labelled:
        found.append("markup")
    if _OVERRIDE.search(text):
        found.append("override")
    if _TASK.search(text):
        found.append("task")
    if _THIRD_PERSON.search(text):
        found.append("third_person")
    if _TOOL.search(text):
        found.append("tool")
    return tuple(found)


def _is_instruction(cues: tuple[str, ...]) -> bool:
    if _STRONG.intersection(cues):
        return True
    return "imperative" in cues and ("markup" in cues or "third_person" in cues)


def _segments(text: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start = 0
    for match in _SEGMENT_END.finditer(text):
        if match.start() > start:
            out.append((start, match.start()))
        start = match.end()
    if start < len(text):
        out.append((start, len(text)))
    return out


@lru_cache(maxsize=_CACHED_TEXTS)
def find_instructions(text: str) -> tuple[Span, ...]:
    """The spans of ``text`` that give the agent instructions, in order; ``()`` when there are none.

    Args:
        text: a tool result as the agent would read it (any format: prose, YAML, JSON, a Python repr).

    Returns:
        Non-overlapping :class:`Span` objects, ``text[span.start:span.end]`` being the instruction (segments merged
        when at most :data:`MERGE_GAP` apart). Cost: linear in the text (a few regular expressions per segment);
        results for the last :data:`_CACHED_TEXTS` texts are remembered.
    """
    segments = _segments(text)
    starts = [start for start, _ in segments]
    # One scan of the whole text finds the segments that can hold a cue; only those (and their neighbours) are read.
    picked = {index for index, start in enumerate(starts) if text.startswith(_LABELS, start)}  # "...%.TODO: ..."
    for match in _WORD.finditer(text):
        word = match.group().lower()
        if word[0] in "<#[" or word.startswith(_KEY_STEMS):
            picked.add(bisect_right(starts, match.start()) - 1)
    candidates = sorted(picked)
    found: dict[int, tuple[str, ...]] = {}

    def cues_of(index: int) -> tuple[str, ...]:
        if index not in found:
            start, end = segments[index]
            found[index] = _cues(text[start:end])
        return found[index]

    strong = [i for i in candidates if i >= 0 and _is_instruction(cues_of(i))]
    if not strong:
        return ()
    marked = set(strong)
    for index in strong:  # an imperative or a channel tag right next to an instruction belongs to it
        for step in (-1, 1):
            neighbour = index + step
            while (
                0 <= neighbour < len(segments) and neighbour not in marked and _WEAK.intersection(cues_of(neighbour))
            ):
                marked.add(neighbour)
                neighbour += step
    spans: list[Span] = []
    group: list[int] = []
    for index in sorted(marked):
        if group and index - group[-1] > MERGE_GAP:
            spans.append(_span(segments, found, group))
            group = []
        group.append(index)
    spans.append(_span(segments, found, group))
    return tuple(spans)


def _span(segments: list[tuple[int, int]], found: dict[int, tuple[str, ...]], group: list[int]) -> Span:
    cues = sorted({cue for index in group for cue in found[index]})
    return Span(segments[group[0]][0], segments[group[-1]][1], tuple(cues))


STRIPPED_MARKER = "[guard: {n} characters of instructions to the assistant removed]"
"""Put where :func:`strip_spans` removed a span."""


def strip_spans(text: str, spans: tuple[Span, ...]) -> str:
    """``text`` with every span replaced by :data:`STRIPPED_MARKER` (the rest kept as it was)."""
    out: list[str] = []
    position = 0
    for span in spans:
        out.append(text[position : span.start])
        out.append(STRIPPED_MARKER.format(n=span.end - span.start))
        position = span.end
    out.append(text[position:])
    return "".join(out)
