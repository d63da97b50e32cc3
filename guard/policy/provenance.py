"""Argument provenance: where each argument value of a tool call came from, in the turn the agent has seen so far.

A tool call's arguments are looked up in the conversation before it (the subject's ``history``, see
:class:`~guard.subject.TurnMessage`), newest message first. Each argument gets one **source**:

* ``user``: the value is in one of the user's messages;
* ``trusted``: it is in a message of role ``system``, or in the policy's ``trusted`` values (trusted configuration;
  the agent middleware gives role ``system`` only to the system messages that open the conversation, and ``agent`` to
  a later one or one a feature marked, such as a summary written in the system role);
* ``tool_result``: it is in a tool result, outside any span flagged as instructions to the agent, and not among the
  arguments of the call that result answers (:attr:`TurnMessage.arguments`): a result that repeats its call's
  arguments (``sent 90 EUR to X``, ``X is valid``) is no evidence a tool gave them, so such a value keeps the source
  the rest of the conversation gives it (what it had when that call was made, while those messages are kept), else
  ``none``; a number that is not an identifier is among them only under the argument of its own name (``amount=90``
  then ``amount`` 90; not ``n=100`` of a lookup then an ``amount`` of 100 it lists); nor is a tool result evidence
  for the arguments of an earlier call the policy's ``tools`` do not declare ``read_only`` (the payment a later
  ``get_most_recent_transactions`` lists, a file written then read), which keep the source they had before it; an
  identifier split among a call's strings and integers (``{"country": "GB", "rest": "33BUKB..."}``) is among them
  when they, joined in order, hold it forwards or reversed, or the pieces found in it cover it (:func:`_covers`). A
  tool whose results are no evidence (``evidence: false`` in the policy's ``tools``, and provider code execution and
  well-known code, shell and calculator tools unless declared ``evidence: true``: :func:`is_code_tool`) gives no
  value this source: its output is what the model's own code or command computed (``print('...'[::-1])``,
  ``echo ... | rev``); nor does a result whose tool is not known (:attr:`TurnMessage.tool_name` ``None``);
* ``flagged_tool_result``: it is inside such a span (:func:`guard.policy.instructions.find_instructions`) of a tool
  result or an ``agent`` message, in a tool result guard withheld or quoted, or in the instructions guard cut out of
  a *stripped* one (what is left of it is an ordinary tool result, but a value the cut instructions named stays
  theirs: :attr:`TurnMessage.cut`);
* ``agent``: it is in a message in the user's role that the user did not write (a ``TurnMessage`` of role
  ``agent``: a conversation summary, or the task a parent agent gave this sub-agent), outside any span flagged as
  instructions; in one that summarizes flagged tool results (``flagged == "summarized"``) it is
  ``flagged_tool_result``;
* ``none``: it is nowhere (the model wrote it: a computed amount, a composed e-mail body).

Precedence when a value is found in several places: ``user`` > ``trusted`` > ``flagged_tool_result`` >
``tool_result`` > ``agent``. A value the user typed is the user's even if a tool result repeats it; a value an
injected instruction names is tainted even if an ordinary tool result repeats it too. An argument that is a list or an
object takes the weakest source of its items (``flagged_tool_result`` < ``none`` < ``agent`` < ``tool_result`` <
``trusted`` < ``user``). A string found nowhere as a whole (text the model composed: a shell command, an e-mail
body) takes the weakest source of the identifiers inside it (URLs, e-mail addresses, file and host names, account-like codes), so
``wc notes.txt`` is the user's when the user named ``notes.txt`` and a link an injection named taints the body it is
pasted into; the identifiers are read as IDNA reads a host name (invisible characters removed, an ideographic full
stop as a dot: ``bob@example.com`` + soft hyphen + ``.evil.io`` is one address under ``evil.io``), and a string with
one a combining mark runs into is ``none``, as is one with no identifier inside. Arguments that carry no evidence (booleans, ``null``, strings under :data:`MIN_TEXT_CHARS`) count as
``user`` without a match. An object's keys that are identifiers (``{"DE89...": 900}``) are traced as its values are,
and a list of strings too short to carry evidence is also traced joined when together they make an identifier
(``["DE", "89", "37", ...]``: one value split into pieces).

Matching, after the same normalisation of value and text (a value is found *inside* longer text; one holding a
digit or ``@ . / :`` only as a whole token, so ``ert.jones@gmail.com`` is not found in ``robert.jones@gmail.com``
nor ``pal.com`` in ``paypal.com``: a letter next to a letter of the same script or a digit next to a digit
continues the token, and in a value holding letters (a host, an address, a code) a letter next to a digit too
(``password.com`` is not in ``1password.com``), while a number ends at a letter (``2.4.1`` is in ``v2.4.1``) and
nothing continues across scripts (``转账到DE89...``); nor is a value found next to the marks that would make it
part of a longer address, host name or number (:func:`_marks`)):

* text: Unicode NFKC (full-width letters and digits, ligatures), invisible (Default_Ignorable) characters removed,
  lower case as IDNA maps a host name (``ß`` is not ``ss``, nor final ``ς`` ``σ``: other domains), runs of white
  space as one space, YAML's doubled quote ``''`` as one, a host name label in ACE form in its Unicode form
  (``info@xn--bcher-kva.de`` is ``info@bücher.de``). A source vouches for a value only as written there:
  look-alike letters count, so ``bob@exаmple.com`` with a Cyrillic ``а`` (another domain) is not the user's, nor
  trusted, nor a tool result's, when those hold ``bob@example.com``; a tool result or an ``agent`` message also
  vouches for a value with no look-alike letters that it holds as guard's normaliser reads it (HTML entities or
  base64 it decodes). Instructions taint a value as guard's normaliser reads both (look-alike letters mapped:
  :mod:`guard.policy.normalize`), so a flagged span that names either is the look-alike's ``flagged_tool_result``;
* identifiers (a value of 6 or more letters and digits with at least one digit: IBANs, phone and card numbers, ids):
  also compared with every character but letters and digits removed, so ``GB29 NWBK 6016`` matches ``gb29nwbk6016``;
* e-mail addresses: lower case, a ``mailto:`` prefix dropped;
* URLs: scheme, ``www.`` and trailing ``/`` dropped, so ``https://www.example.com/a/`` matches ``example.com/a``;
* numbers: compared as numbers with the numbers written in the text (``98.7`` matches ``98.70``, ``1200`` matches
  ``1,200.00``), also with a decimal comma (``98,70``, ``1.234,56``, ``1 234,56``, ``1.234.567``). A single group of
  three digits after a dot is a decimal point (``1.250`` is ``1.25``, never ``1250``: three decimals are usual for
  KWD, BTC, exchange rates); after a comma it is read both as English thousands and as a decimal comma (``1,234`` is
  ``1234`` and ``1.234``, so ``$1,200`` matches ``1200``); a first group of ``0`` is never thousands (``0,500`` and
  ``0.500`` are ``0.5`` only).

Cost: each message's normalised forms are computed once per text (remembered for the last
:data:`CACHED_TEXTS` texts, at most :data:`CACHED_CHARS` characters in all, least recently used first out); a lookup
is a few substring searches per argument, and a trace checks at most :data:`MAX_REJECTED` places where a value is
found but not as a whole token (past them the argument is ``flagged_tool_result`` when a message in the history is
flagged, else ``none``).
``bench/provenance_latency.py`` measures a 10-message turn.
"""

from __future__ import annotations

import base64
import codecs
import math
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import cached_property, lru_cache, partial
from typing import Any, Literal
from urllib.parse import unquote

from guard.policy._memo import text_memo
from guard.policy.instructions import Detector, Span, find_instructions
from guard.policy.normalize import normalize_text, remove_ignorable
from guard.subject import AgentSubject, Subject, TurnMessage

__all__ = [
    "CACHED_CHARS",
    "CACHED_TEXTS",
    "CALL_KEYS",
    "CODE_TOOLS",
    "DETECTOR_MAX_CHARS",
    "RESULT_KEYS",
    "SOURCES",
    "ArgumentSource",
    "Source",
    "ToolSpec",
    "call_features",
    "flagged_results",
    "gives_evidence",
    "is_code_tool",
    "resolved_effect",
    "result_features",
    "rule_features",
    "tool_spec",
    "trace_arguments",
]

Source = Literal["user", "trusted", "tool_result", "agent", "flagged_tool_result", "none"]
#: Every source, strongest first (the order an argument made of several values takes the weakest of).
SOURCES: tuple[Source, ...] = ("user", "trusted", "tool_result", "agent", "none", "flagged_tool_result")
_RANK = {source: rank for rank, source in enumerate(SOURCES)}
#: The keys of the ``call`` object tool-call rules read (:func:`call_features`).
CALL_KEYS = frozenset({"tool", "effect", "provenance", "origin", "disallowed", "from_flagged", "flagged_results",
                       "user_arguments"})
#: The keys of the ``result`` object tool-result rules read (:func:`result_features`).
RESULT_KEYS = frozenset({"instructions", "cues", "chars", "unread"})
#: Characters of a tool result the detector reads (its head; about half a CPU second): the rest is reported unread
#: (``result.unread``), never looked at (10 MB would take the detector half a minute).
DETECTOR_MAX_CHARS = 200_000
#: Message texts whose normalised forms are remembered (entries of each memo table: :func:`_prepare`,
#: :func:`_normalised`, :func:`_split_tool_text`, :func:`_near_misses`).
CACHED_TEXTS = 2048
#: Characters each of those tables holds at most (its keys, and its results as :func:`_prepared_chars` counts them):
#: past it the least recently used entries go, so a table holds 16 to 64 MB of text (1 to 4 bytes a character) and a
#: long text that every call of a conversation reads stays remembered (:class:`guard.policy._memo.TextMemo`). Not
#: counted: the set of numbers a text holds (:attr:`_Prepared.numbers`, made when a number is looked for in it).
CACHED_CHARS = 16_000_000
#: Shortest value (normalised characters) matched as text; shorter strings are found anywhere and carry no evidence.
MIN_TEXT_CHARS = 3
#: Different identifiers inside one composed text (:func:`_embedded`) traced one by one; a text holding more (a
#: command pinging thousands of addresses, each traced through the whole history) is traced to no source.
MAX_EMBEDDED = 256
#: Places in a text where a value is found but not as a whole token (:func:`_contains`, :func:`_in_compact`) that one
#: :func:`trace_arguments` run checks one by one; past them the argument being traced, and each after it, is
#: ``flagged_tool_result`` where a message of the history is flagged, else ``none``
#: (a text that holds a value at many thousands of such places: ``ab.ab.ab`` against ``ab.ab.ab.ab...``). Those an
#: ASCII neighbour rules out are skipped by a regular expression (:func:`_near_misses`) and not counted.
MAX_REJECTED = 100_000
#: Tools that compute their output from the model's input, by name (:func:`is_code_tool` compares them): provider code
#: execution (Anthropic's ``code_execution`` and, from 2025-08-25, ``bash_code_execution`` and
#: ``text_editor_code_execution``, Google's ``code_execution``, OpenAI's ``code_interpreter`` and its shells,
#: ``local_shell`` and ``shell``) and the well-known client tools that run code, a shell or arithmetic: Anthropic's
#: ``bash`` tool; LangChain's ``terminal``, ``Python_REPL``, ``python_repl_ast``, ``Calculator``, ``e2b_data_analysis``,
#: ``bearly_interpreter``, ``riza_exec_python`` and ``wolfram_alpha``; smolagents' ``python_interpreter``; OpenHands'
#: ``execute_bash`` and ``execute_ipython_cell``; Cline's ``execute_command``; Gemini CLI's ``run_shell_command``; VS
#: Code's ``run_in_terminal``; Codex's ``container.exec``; Cursor's ``run_terminal_cmd``; mcp-run-python's
#: ``run_python_code``; Desktop Commander's ``start_process`` and ``interact_with_process``; and the common generic
#: names (``python``, ``python3``, ``node``, ``deno``, ``run_code``, ``run_script``, ``code_executor``, ``shell_exec``,
#: ``calc``, ``calculate``, ``evaluate`` ...), also as a kebab-case name's function (Semantic Kernel's
#: ``SessionsPythonTool-execute_code``: :func:`is_code_tool`). Their results print what the model's code computed, so they are no evidence unless the
#: policy's tools say ``evidence: true``. No list names every such tool: a policy declares the others
#: ``evidence: false``.
CODE_TOOLS = frozenset({
    "code_execution", "bash_code_execution", "text_editor_code_execution", "code_interpreter", "executable_code",
    "local_shell", "shell", "bash", "terminal", "python", "python_repl", "python_repl_ast", "calculator",
    "e2b_data_analysis", "bearly_interpreter", "riza_exec_python", "wolfram_alpha", "python_interpreter",
    "execute_bash", "execute_ipython_cell", "execute_command", "run_shell_command", "run_in_terminal", "exec",
    "run_code", "execute_code", "run_python", "execute_python", "run_javascript", "javascript", "shell_exec",
    "exec_command", "run_command", "bash_tool", "sh", "zsh", "powershell", "cmd", "ipython", "jupyter", "repl",
    "eval", "calc", "math", "llm_math", "python_repl_tool", "run_python_code", "run_terminal_cmd", "python3", "node",
    "nodejs", "deno", "code_executor", "start_process", "interact_with_process", "calculate", "execute_javascript",
    "run_script", "evaluate",
})  # fmt: skip


@dataclass(frozen=True)
class ToolSpec:
    """What a policy says about one tool (``tools:`` in the policy file).

    Attributes:
        effect: ``read_only``, ``side_effecting`` or ``unknown`` (not declared).
        arguments: sensitive argument name -> the sources it may have (e.g. ``("user", "trusted")``).
        evidence: whether a value in the tool's results is a ``tool_result`` (``False`` for a tool that computes its
            output from the model's input, such as a shell); ``None``: yes, but for :data:`CODE_TOOLS`.
    """

    effect: Literal["read_only", "side_effecting", "unknown"] = "unknown"
    arguments: Mapping[str, tuple[Source, ...]] | None = None
    evidence: bool | None = None


@dataclass(frozen=True)
class ArgumentSource:
    """Where one argument came from: ``source``, for a tool result the ``tool`` and ``tool_call_id``, and whether
    any value of it was found at all (``matched``; ``False`` for arguments that carry no evidence)."""

    source: Source
    tool: str | None = None
    tool_call_id: str | None = None
    matched: bool = True


class _Prepared:
    """The normalised forms of one text: the folded text, and (computed when a value first needs them) its
    letters-and-digits-only form, its URL form and the numbers in it."""

    __slots__ = ("__dict__", "text")

    def __init__(self, text: str) -> None:
        self.text = text

    @cached_property
    def compact(self) -> str:
        return _NOT_ALNUM.sub("", self.text)

    @cached_property
    def compact_bounds(self) -> bytes:
        """Where tokens start and end in :attr:`compact` (a token: a run of letters of one script and digits): for
        each place of it and its end, :data:`_STARTS` when a token starts there, :data:`_ENDS` when one ends there
        (a byte a character)."""
        bounds, at = bytearray(len(self.compact) + 1), 0
        for run in _ALNUM_RUN.findall(self.text):
            for token in _tokens(run):
                bounds[at] |= _STARTS
                at += len(token)
                bounds[at] |= _ENDS
        return bytes(bounds)

    @cached_property
    def url(self) -> str:
        return _url_form(self.text)

    @cached_property
    def numbers(self) -> frozenset[str]:
        return _numbers(self.text)


# The flags of :attr:`_Prepared.compact_bounds`.
_STARTS, _ENDS = 1, 2
_SPACE = re.compile(r"\s+")
_NOT_ALNUM = re.compile(r"[\W_]+")
_ALNUM_RUN = re.compile(r"[^\W_]+")
_URL_NOISE = re.compile(r"\b(?:https?://|ftp://|mailto:)|\bwww\.|(?<!/)/+(?=[\s'\"),;\]}]|$)")
# A number written with a decimal point: thousands parted by commas (1,234.56, 1,234) or none (98.70, 1.250); a first
# group of 0 is no thousands (0,500 is not 500), nor is a group of three digits after a comma a number of its own.
_NUMBER = re.compile(r"(?<![\w.])(?!(?<=\d,)\d{3}(?!\d))[-+]?(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)(?:\.\d+)?")
# A number written with a decimal comma: thousands parted by dots where that is unambiguous (1.234,56, 1.234.567),
# by spaces (1 234,56), or none (98,70); never part of a longer number (1,234.56, 192.168.1.1) nor a group of one
# parted by spaces (the 234,56 of 1 234,56). A single dot group with no decimal comma (1.250, 0.500) is read only as
# a decimal point, by _NUMBER.
_COMMA_NUMBER = re.compile(
    r"(?<![\w.,])(?<!\d )[-+]?(?:[1-9]\d{0,2}(?:(?:\.\d{3}){2,}(?:,\d+)?|\.\d{3},\d+|(?: \d{3})+,\d+)|\d+,\d+)"
    r"(?!\w|[.,]\d)"
)
_IDENTIFIER = re.compile(r"(?=.*\d)[A-Za-z0-9][A-Za-z0-9 .\-/]*")
# Identifiers inside a longer text the model wrote: URLs (any scheme's, ``ftp://``, ``s3://``, ``http:/``, and
# scheme-relative ``//evil.io/``; ``http:/`` also glued to the word or option before it, ``-xhttp://evil.io``, and
# ``//`` also after a colon, ``'https'://evil.io``, ``-xsftp://evil.io``), e-mail addresses, file and host names, IPv4
# and bracketed IPv6 addresses, account-like codes (IBANs, ids). A host name may start after a dot that follows no
# label (``x''.evil.io``, ``${H}.evil.io``, ``...evil.io``: :func:`_runs_on` then makes the leaf none), but not at a
# hidden file's leading dot (after white space, ``/``, ``~`` or at the text's start: ``~/.bashrc.bak``), and end with
# a dot that no label follows (``evil.io.``, a sentence's end); its last label has 2 to 5 characters (not ``e.g.``).
# Every branch that can start inside a run of its characters starts only at the run's first character (a look-behind;
# ``http:/`` cannot start inside a run of itself), and the IPv6 branch's runs are possessive, so a long run costs
# linear time, not a retry at every offset; _URL_NOISE's slash run likewise.
_EMBEDDED = re.compile(
    r"(?:https?:/|(?<![a-z0-9+.-])[a-z][a-z0-9+.-]{0,15}://)[^\s'\"<>)\]]+"
    r"|(?<![\w/])//(?=[\w-]+\.)[^\s'\"<>)\]]+|www\.[^\s'\"<>)\]]+"
    r"|(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+"
    r"|(?<![\w/-])(?<![\w-]\.)(?<![\s/~]\.)(?<!^\.)[\w-]+(?:\.[\w-]+)*\.[a-z][a-z0-9]{1,4}(?:/[^\s'\"<>)\]]*)?(?!\w|\.\w)"
    r"|(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?!\w|\.\d)|\[[0-9a-f.]*+:[0-9a-f:.]*+\]"
    r"|\b(?=[A-Z0-9]*\d)(?=[A-Z0-9]*[A-Z])[A-Z0-9]{12,34}\b",
    re.IGNORECASE,
)
# What a shell drops from a word and hides a host name with (:func:`_embedded` reads a text also without them): quotes
# (``evil.'io'``, ``https:/'/evil.io``) and a backslash (``https:\/\/evil.io``, ``evil\.io``), with the letter or digit
# after it, an escape such as ``\n`` in code (a backslash before a letter already makes the leaf none: ``e\vil.io``).
_SHELL_QUOTING = re.compile(r"['\"]|\\[^\W_]?")
# How an :data:`_EMBEDDED` URL starts: its scheme, ``//`` or ``www.``.
_URL_START = re.compile(r"https?:/|[a-z][a-z0-9+.-]{0,15}://|//|www\.", re.IGNORECASE)

# The ideographic full stops, which IDNA reads as a host name's dot (NFKC maps the full-width one to ".").
_HOST_DOTS = str.maketrans("\u3002\uff61", "..")
# Brackets and quotation marks past ASCII (categories Ps, Pe, Pi, Pf: 「」《》“”«»), the ideographic comma and the en
# and em dashes, which end an address in running text as the ASCII delimiters do (Markdown's * ` | ~ among them).
_MARKS = "".join(
    c for c in map(chr, range(0x80, 0x10000)) if unicodedata.category(c) in ("Ps", "Pe", "Pi", "Pf")
) + "\u3001\uff64"
_DELIMITERS = re.escape("<>()[]{}\"',;:!?*`|~/") + re.escape(_MARKS + "\u2013\u2014")
# What may stand next to an address, host name or URL without continuing it: white space, a delimiter, the text's end.
_EDGE = re.compile(rf"[\s{_DELIMITERS}]")
# A continuation after one: past sentence-ending dots a character that is no delimiter, or delimiters followed by a
# dot and a label (example.com」.evil.io, example.com;.evil.io: what IDNA2003 makes of a Greek question mark).
_RUNS_ON_AFTER = re.compile(rf"\.*[^\s.{_DELIMITERS}]|[.{_DELIMITERS}]*\.\w")


def _tokens(run: str) -> list[str]:
    """A run of letters and digits split where the script changes (``到de89`` is ``到``, ``de89``; digits go with
    Latin letters)."""
    out, start = [], 0
    for i in range(1, len(run)):
        if _joined_kind(run[i]) != _joined_kind(run[i - 1]):
            out.append(run[start:i])
            start = i
    out.append(run[start:])
    return out


def _fold(text: str) -> str:
    """``text`` NFKC-normalised (full-width letters and digits, ligatures, ``№``), invisible (Default_Ignorable)
    characters removed, lower-cased as IDNA maps a host name (``ß`` and final ``ς`` stay letters of their own, ``Σ`` is
    ``σ``), YAML ``''`` and escaped line breaks undone, white space collapsed, host name labels in ACE form in their
    Unicode form (:func:`_unicode_labels`); look-alike letters stay as they are."""
    text = remove_ignorable(unicodedata.normalize("NFKC", text)).replace("\u03a3", "\u03c3").lower()
    return _SPACE.sub(" ", _unicode_labels(text.replace("''", "'").replace("\\n", " "))).strip()


# A host name's ACE label, the ASCII form IDNA gives a label past ASCII (xn--bcher-kva: bücher), 63 characters at most.
_ACE_LABEL = re.compile(r"(?<![\w-])xn--([a-z0-9-]{1,59})(?![\w-])")


def _unicode_label(match: re.Match[str]) -> str:
    """The label of an :data:`_ACE_LABEL` match in its Unicode form, when that is one a host name may hold as
    :func:`_fold` leaves it (letters, digits, marks and hyphens, some past ASCII: no dot-like character that would
    join it to the next label); else the match as it is."""
    try:
        label = match.group(1).encode("ascii").decode("punycode")
    except UnicodeError:
        return match.group()
    allowed = all(c.isalnum() or c == "-" or unicodedata.category(c).startswith("M") for c in label)
    if allowed and not label.isascii() and unicodedata.normalize("NFKC", label).lower() == label:
        return label
    return match.group()


def _unicode_labels(text: str) -> str:
    """``text`` (lower case) with each host name label in ACE form (``info@xn--bcher-kva.de``) in its Unicode form
    (``info@bücher.de``), as IDNA's ToUnicode reads it, so the two forms of one host compare equal."""
    return _ACE_LABEL.sub(_unicode_label, text) if "xn--" in text else text


def _url_form(folded: str) -> str:
    return _URL_NOISE.sub("", folded)


def _canonical_number(written: str) -> str:
    """A number as written (``1,200.50``, ``-07``) in one canonical form (``1200.5``, ``-7``): thousands separators,
    leading zeros and trailing fractional zeros removed, so equal numbers compare equal as strings."""
    sign = "-" if written.startswith("-") else ""
    digits = written.lstrip("+-").replace(",", "")
    whole, _, fraction = digits.partition(".")
    whole, fraction = whole.lstrip("0") or "0", fraction.rstrip("0")
    if whole == "0" and not fraction:
        sign = ""
    return f"{sign}{whole}.{fraction}" if fraction else f"{sign}{whole}"


def _comma_number(written: str) -> str:
    """A number written with a decimal comma (``1.234,56``, ``1 234,56``) in :func:`_canonical_number`'s form."""
    return _canonical_number(written.replace(".", "").replace(" ", "").replace(",", "."))


def _numbers(folded: str) -> frozenset[str]:
    """The numbers written in ``folded``, canonical (:func:`_canonical_number`): each read with a decimal point, and
    those written with a decimal comma (:data:`_COMMA_NUMBER`) read that way too."""
    written = set(_NUMBER.findall(folded))
    points = {w if w.isdigit() and w[0] != "0" else _canonical_number(w) for w in written}
    return frozenset(points | {_comma_number(w) for w in _COMMA_NUMBER.findall(folded)})


def _prepared_chars(prepared: _Prepared) -> int:
    """The characters a memo counts for a :class:`_Prepared`: its folded text and, computed or not, its compact and
    URL forms and its token bounds (each at most as long as the text)."""
    return 4 * len(prepared.text)


@text_memo(max_entries=CACHED_TEXTS, max_chars=CACHED_CHARS, result_chars=_prepared_chars)
def _prepare(text: str) -> _Prepared:
    return _Prepared(_fold(text))


@text_memo(max_entries=CACHED_TEXTS, max_chars=CACHED_CHARS, result_chars=len)
def _normalised(text: str) -> str:
    """``text`` normalised (:func:`guard.policy.normalize.normalize_text`)."""
    return normalize_text(text).value


def _fold_read(text: str) -> str:
    """``text`` normalised (:func:`_normalised`) and folded (:func:`_fold`)."""
    return _fold(_normalised(text))


def _prepare_read(text: str) -> _Prepared:
    """The forms of ``text`` as guard's normaliser reads it (look-alike letters mapped, invisible characters
    removed)."""
    return _prepare(_normalised(text))


def _readings(text: str) -> tuple[str, ...]:
    """The texts the detector reads for one tool result: the normalised text, and the text as given when that
    differs (the normaliser appends what it decodes, ``[spaced: ...]``, ``[rot13: ...]``, so a JSON result
    normalised is no longer JSON and its strings would go unread one by one); of its first :data:`DETECTOR_MAX_CHARS`
    characters."""
    text = text[:DETECTOR_MAX_CHARS]
    normalised = _normalised(text)
    return (normalised,) if normalised == text else (normalised, text)


def _detected(text: str, detector: Detector) -> list[tuple[str, tuple[Span, ...]]]:
    """Each of :func:`_readings` of ``text`` with the spans ``detector`` finds in it."""
    return [(reading, detector(reading)) for reading in _readings(text)]


def _parts_chars(parts: tuple[_Prepared, _Prepared]) -> int:
    """The characters a memo counts for :func:`_split_tool_text`'s two parts (:func:`_prepared_chars`)."""
    return sum(map(_prepared_chars, parts))


@text_memo(max_entries=CACHED_TEXTS, max_chars=CACHED_CHARS, result_chars=_parts_chars)
def _split_tool_text(text: str, detector: Detector) -> tuple[_Prepared, _Prepared]:
    """A tool result's (ordinary part, flagged part): the normalised text less the spans the detector finds there,
    and the spans it finds in every reading (:func:`_readings`, as a tool-result rule finds them)."""
    readings = _detected(text, detector)
    plain, position = [], 0
    normalised, spans = readings[0]
    for span in spans:
        plain.append(normalised[position : span.start])
        position = span.end
    plain.append(normalised[position:])
    flagged = [reading[span.start : span.end] for reading, found in readings for span in found]
    return _prepare("\n".join(plain)), _prepare("\n".join(flagged))


@dataclass(frozen=True)
class _Needle:
    """One scalar value to look for, in the forms it can be matched by, and the top-level argument of the call it is
    in (``argument``; ``None`` for a value inside a composed text), which a number's echo is looked for under."""

    text: str
    compact: str | None
    url: str | None
    number: str | None
    marks: str | None = None
    joined: bool = False
    argument: str | None = None


@dataclass(frozen=True)
class _Value:
    """One scalar value to look for, folded two ways: ``written`` (:func:`_fold`), found where a source vouches for it
    (the user's messages, trusted ones, a tool result's ordinary text, an ``agent`` message), and ``read`` (as guard's
    normaliser reads it: look-alike letters mapped, invisible characters removed), found where instructions taint it.
    So ``bob@exаmple.com`` with a Cyrillic ``а``, another domain, is not the user's when the user typed
    ``bob@example.com``, and is the injection's when a flagged span names either."""

    written: _Needle
    read: _Needle


def _value(value: Any, argument: str | None = None) -> _Value | None:
    """``value`` (a scalar of the top-level argument named ``argument``) as :class:`_Value`; ``None`` when it carries
    no evidence (bool, null, very short text)."""
    written = _needle(value, _fold, argument)
    if written is None:
        return None
    return _Value(written, _needle(value, _fold_read, argument) or written)


def _needle(value: Any, fold: Callable[[str], str], argument: str | None = None) -> _Needle | None:
    """The forms ``value`` (a scalar of the top-level argument named ``argument``) is matched by, its text folded by
    ``fold``; ``None`` when it carries no evidence (bool, null, very short text)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        try:
            number = _canonical_number(format(Decimal(str(value)), "f"))
        except InvalidOperation:  # inf and nan
            return None
        return _Needle(fold(str(value)), None, None, number, marks=".,", argument=argument)
    if not isinstance(value, str):
        value = str(value)
    folded = fold(value)
    folded = folded.removeprefix("mailto:")
    if len(folded) < MIN_TEXT_CHARS:
        return None
    compact = _NOT_ALNUM.sub("", folded)
    identifier = len(compact) >= 6 and _IDENTIFIER.fullmatch(value.strip()) is not None
    url = _url_form(folded)
    number = None
    if _NUMBER.fullmatch(folded):
        number = _canonical_number(folded)
    elif _COMMA_NUMBER.fullmatch(folded):
        number = _comma_number(folded)
    hostlike = url != folded or (not number and ("." in folded or "/" in folded))  # also found in a text's URL form
    joined = any(char.isalpha() for char in folded)  # letters and digits continue each other (see _continues)
    return _Needle(
        folded, compact if identifier else None, url if hostlike else None, number, _marks(folded), joined, argument
    )


def _marks(folded: str) -> str | None:
    """How a text value is found inside longer text (:func:`_contains`): ``None`` (anywhere) for words; else only as
    whole tokens, and not next to the characters that would make it part of a longer address (an e-mail address:
    ``. _ % + -``, so ``jones@gmail.com`` is not ``robert.jones@gmail.com`` nor ``alice@bank.co`` ``alice@bank.co.uk``),
    host name (``. - _``: ``paypal.com`` is not ``my-paypal.com``) or number (``. ,``: ``4.1`` is not in ``2.4.1``,
    ``200`` not in ``1,200``, ``5`` not in ``0.5``; ``2.4.1`` is in ``release-2.4.1``)."""
    if "@" in folded:
        return "._%+-"
    if "." in folded and any(char.isalpha() for char in folded):
        return ".-_"
    if any(char.isdigit() for char in folded) and not any(char.isalpha() for char in folded):
        return ".,"
    return "" if any(char.isdigit() or char in "./:" for char in folded) else None


@lru_cache(maxsize=4096)
def _kind(char: str) -> str | None:
    """What a character is, as far as token boundaries go: ``digit``; a letter's or combining mark's script
    (``latin`` for ASCII and Latin letters; else the first word of its Unicode name: ``CJK``, ``ARABIC``,
    ``DEVANAGARI``); None for the rest."""
    if char.isdigit():
        return "digit"
    if unicodedata.category(char)[0] not in "LM":
        return None
    if char.isascii():
        return "latin"
    word = unicodedata.name(char, "?").split(" ", 1)[0]
    return "latin" if word == "LATIN" else word


def _joined_kind(char: str) -> str | None:
    """:func:`_kind` with digits counted as Latin letters (inside a code, a host or an address)."""
    kind = _kind(char)
    return "latin" if kind == "digit" else kind


def _continues(neighbour: str, edge: str, joined: bool) -> bool:
    """Whether ``neighbour`` (next to a match in the text) continues the token ``edge`` (the match's first or last
    character) is part of: two letters of one script or two digits; with ``joined`` (a value holding letters: a host,
    an address, a code), a letter and a digit too (``password.com`` is not in ``1password.com``), else not
    (``2.4.1`` is in ``v2.4.1``, ``1200`` in ``USD1200``)."""
    kind = _joined_kind if joined else _kind
    found = kind(edge)
    return found is not None and kind(neighbour) == found


def _contains(text: str, needle: str, marks: str | None, joined: bool = False) -> bool:
    """Whether ``needle`` is in ``text``: anywhere when ``marks`` is None, else as whole tokens (:func:`_continues`),
    not right after one of ``marks`` and not right before one followed by a letter or digit. Past a few places that
    are not whole tokens, the next are found by :func:`_near_misses`; each one checked counts against the trace's
    :data:`MAX_REJECTED`."""
    if marks is None:
        return needle in text
    at, checked = text.find(needle), 0
    while at != -1:
        end = at + len(needle)
        before = at > 0 and (text[at - 1] in marks or _continues(text[at - 1], needle[0], joined))
        after = end < len(text) and (
            _continues(text[end], needle[-1], joined)
            or (text[end] in marks and end + 1 < len(text) and text[end + 1].isalnum())
        )
        if not before and not after:
            return True
        _reject()
        checked += 1
        if checked < _FOUND_BEFORE_PATTERN:
            at = text.find(needle, at + 1)
        else:
            found = _near_misses(needle, marks, joined).search(text, at + 1)
            at = found.start() if found else -1
    return False


# Places :func:`_contains` finds with ``str.find`` before it searches with :func:`_near_misses`' pattern.
_FOUND_BEFORE_PATTERN = 8


#: What a memo counts for a compiled :func:`_near_misses` pattern per character of its source: the compiled
#: look-behind holds about 17 bytes a character.
PATTERN_CHAR_WEIGHT = 20


@text_memo(max_entries=CACHED_TEXTS, max_chars=CACHED_CHARS,
           result_chars=lambda pattern: PATTERN_CHAR_WEIGHT * len(pattern.pattern))
def _near_misses(needle: str, marks: str, joined: bool) -> re.Pattern[str]:
    """A pattern of ``needle`` that leaves out the places :func:`_contains` rules out for an ASCII neighbour: after
    one of ``marks`` or an ASCII letter or digit that continues its first character, before one that continues its
    last or before one of ``marks`` and a letter or digit; the places it finds are still checked (a neighbour past
    ASCII). The needle comes first and the look-behind spans it, so a search skips from place to place in linear
    time, however often the needle overlaps itself."""
    pattern = re.escape(needle)
    before = re.escape(marks) + _ascii_kin(needle[0], joined)
    if before:
        pattern += rf"(?<![{before}](?s:.){{{len(needle)}}})"
    after = [rf"[{kin}]" for kin in (_ascii_kin(needle[-1], joined),) if kin]
    after += [rf"[{re.escape(marks)}][^\W_]"] if marks else []
    if after:
        pattern += rf"(?!{'|'.join(after)})"
    return re.compile(pattern)


def _ascii_kin(edge: str, joined: bool) -> str:
    """The ASCII letters and digits that continue a token ending or starting with ``edge`` (:func:`_continues`), as
    a character class's ranges."""
    kind = (_joined_kind if joined else _kind)(edge)
    return {"digit": "0-9", "latin": "a-zA-Z0-9" if joined else "a-zA-Z"}.get(kind or "", "")


class _OverBudget(Exception):
    """More places than :data:`MAX_REJECTED` checked in one trace."""


# The places one trace may still check (:data:`MAX_REJECTED`), set by :func:`trace_arguments`; None: no limit.
_BUDGET: ContextVar[list[int] | None] = ContextVar("provenance_budget", default=None)


def _reject() -> None:
    """Count one place a value was found but not as a whole token; raise :class:`_OverBudget` past the trace's
    :data:`MAX_REJECTED`."""
    budget = _BUDGET.get()
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise _OverBudget


def _in_compact(needle: str, haystack: _Prepared) -> bool:
    """Whether ``needle`` (letters and digits only) is in the text's compact form as whole tokens: starting where
    one starts and ending where one ends (``gb29nwbk6016`` in ``GB29 NWBK 6016``, not in ``XGB29 NWBK 6016``); each
    place it is not counts against the trace's :data:`MAX_REJECTED`."""
    at = haystack.compact.find(needle)
    while at != -1:
        bounds = haystack.compact_bounds  # computed once per text, and only for a text holding the needle
        if bounds[at] & _STARTS and bounds[at + len(needle)] & _ENDS:
            return True
        _reject()
        at = haystack.compact.find(needle, at + 1)
    return False


def _found(needle: _Needle, haystack: _Prepared) -> bool:
    if _contains(haystack.text, needle.text, needle.marks, needle.joined):
        return True
    if needle.number is not None and needle.number in haystack.numbers:
        return True
    if needle.url is not None and needle.url and _contains(haystack.url, needle.url, _marks(needle.url) or "", True):
        return True
    return needle.compact is not None and _in_compact(needle.compact, haystack)


def _as_host(text: str) -> str:
    """``text`` as IDNA reads a host name in it: NFKC, invisible (Default_Ignorable) characters removed, an
    ideographic full stop as ``.``."""
    return remove_ignorable(unicodedata.normalize("NFKC", text)).translate(_HOST_DOTS)


def _runs_on(text: str, start: int, end: int) -> bool:
    """Whether the address, host name or URL at ``text[start:end]`` runs on into a character next to it that a host
    name may hold (``example.com`` and a Tibetan tsheg, a middle dot, a combining mark: another host to IDNA): one
    that is not white space, an ASCII delimiter (Markdown's ``*`` ``|`` among them), a dash or a bracket or quotation
    mark, before it (but for a URL, whose scheme ends the host) or after it (past sentence-ending dots; delimiters
    followed by a dot and a label continue the host)."""
    before = text[start - 1] if start else " "
    if not _URL_START.match(text, start) and not _EDGE.match(before):
        return True
    return bool(_RUNS_ON_AFTER.match(text, end))


def _embedded(value: Any) -> list[_Value] | None:
    """The identifiers inside a string leaf that are not the whole of it (a link or address in a composed body),
    found in the leaf as a host name reads (:func:`_as_host`: ``bob@example.com<soft hyphen>.evil.io`` is one address
    under ``evil.io``); ``None`` when an address, host name or URL runs on into a character next to it
    (:func:`_runs_on`: ``example.com`` and U+0F0B or U+0334 is another host), or when it holds more than
    :data:`MAX_EMBEDDED` different ones, so the leaf cannot be traced by them; each is given once. The leaf is read
    as given and, when it holds quotes or backslashes, also without them as a shell reads it
    (:data:`_SHELL_QUOTING`: ``https:\\/\\/evil.io`` is ``https://evil.io``)."""
    if not isinstance(value, str) or len(value) < 2 * MIN_TEXT_CHARS:
        return []
    text = _as_host(value)
    unquoted = _SHELL_QUOTING.sub("", text)
    tokens: set[str] = set()
    out = []
    for reading in (text, unquoted) if unquoted != text else (text,):
        for match in _EMBEDDED.finditer(reading):
            if not match.group().isalnum() and _runs_on(reading, match.start(), match.end()):
                return None
            token = match.group().rstrip(".,;:!?")
            if token.strip() != reading.strip() and token not in tokens:
                tokens.add(token)
                if len(tokens) > MAX_EMBEDDED:
                    return None
                found = _value(token)
                if found is not None:
                    out.append(found)
    return out


def _leaves(value: Any) -> Iterable[Any]:
    """The scalars of an argument to trace, in the order given: its values, the keys of its objects that are
    identifiers, and for a list of strings each too short to carry evidence, the strings joined when that makes an
    identifier (in place of the pieces)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            yield from (key for key in item if isinstance(key, str) and _EMBEDDED.fullmatch(key.strip()))
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list | tuple):
            joined = "".join(piece.strip() for piece in item if isinstance(piece, str))
            if (item and all(isinstance(piece, str) and len(piece.strip()) < MIN_TEXT_CHARS for piece in item)
                    and _IDENTIFIER.fullmatch(joined) and len(_NOT_ALNUM.sub("", joined)) >= 6):
                yield joined
            else:
                stack.extend(reversed(item))
        else:
            yield item


_CODE_NAMES = frozenset(_NOT_ALNUM.sub("", _fold(name)) for name in CODE_TOOLS)
# The code tool names of two words or more (run_code, execute_code, run_command), and the shells' names: the last word
# of a kebab-case name that is one of these names a code function (Semantic Kernel's Plugin-Function:
# ShellPlugin-run_command, SessionsPythonPlugin-ExecuteCode; e2b-run_code, mcp-shell-bash), a word such as node,
# calculate or evaluate only in a plugin named for code (MathPlugin-Calculate; not get-node, tax-calculate).
_FUNCTION_NAMES = frozenset(
    _NOT_ALNUM.sub("", _fold(name)) for name in CODE_TOOLS if "_" in name
) | {"bash", "sh", "zsh", "shell", "powershell"}
# What parts a namespaced tool name: functions.python, mcp__shell__bash, container.exec, tools/python, server:bash
# (not "-", which joins the words of kebab-case names: get-node, tax-calculate; :func:`_code_function` reads those).
_NAMESPACE = re.compile(r"__|[./:]")


def is_code_tool(tool: str) -> bool:
    """Whether ``tool`` is one of :data:`CODE_TOOLS`: its name or the last part of a namespaced one
    (``functions.python``, ``mcp__shell__bash``, ``container.exec``; not a server's or namespace's name,
    ``mcp__python__search_pypi``), compared in letters and digits only, NFKC-normalised and lower-cased (``Code
    Interpreter``, ``PythonREPL`` and ``python-repl`` are ``code_interpreter`` and ``python_repl``); or a code
    function of a kebab-case name (:func:`_code_function`: ``ShellPlugin-run_command``, not ``get-node``)."""
    return any(key in _CODE_NAMES for key in _tool_keys(tool)) or _code_function(tool)


def _code_function(tool: str) -> bool:
    """Whether the last word of a kebab-case name (of its last namespaced part) names a code function: a code tool
    name of two words or more or a shell's (``SessionsPythonPlugin-ExecuteCode``, ``e2b-run_code``,
    ``mcp-shell-bash``), or a code tool name after a plugin named for code, ``Plugin`` or ``Tool`` dropped
    (``MathPlugin-Calculate``, ``python-eval``; not ``tax-calculate``, ``model-evaluate``, ``get-node``)."""
    *words, function = _NAMESPACE.split(tool)[-1].split("-")
    if not words:
        return False
    name = _NOT_ALNUM.sub("", _fold(function))
    plugin = _NOT_ALNUM.sub("", _fold(words[-1])).removesuffix("plugin").removesuffix("tool")
    return name in _FUNCTION_NAMES or (name in _CODE_NAMES and plugin in _CODE_NAMES)


@lru_cache(maxsize=4096)
def _tool_keys(tool: str) -> tuple[str, str]:
    """A tool's name and the last part of it namespaced (:data:`_NAMESPACE`), each in letters and digits only,
    NFKC-normalised and lower-cased."""
    return _NOT_ALNUM.sub("", _fold(tool)), _NOT_ALNUM.sub("", _fold(_NAMESPACE.split(tool)[-1]))


def same_tool(tool: str, other: str) -> bool:
    """Whether two tool names name one tool as :func:`is_code_tool` compares them: whole or by the last part of a
    namespaced one, in letters and digits only, case ignored (``Get_IBAN``, `` get_iban `` and ``bank.get_iban``
    are ``get_iban``)."""
    return any(one == two for one, two in zip(_tool_keys(tool), _tool_keys(other), strict=True))


# Effects from the least to the most restrictive (what :func:`tool_spec` keeps of several declarations).
_EFFECTS = ("read_only", "unknown", "side_effecting")


def tool_spec(tools: Mapping[str, ToolSpec], tool: str | None) -> ToolSpec:
    """What a policy's ``tools`` declare for ``tool``: its entry by the exact name, else the entries that name it as
    :func:`same_tool` compares names (``Run_SQL``, ``db.run_sql`` and ``mcp__db__run_sql`` for ``run_sql``); of
    several such entries the most restrictive of each setting: the last effect of :data:`_EFFECTS`, ``evidence:
    false`` if any says so (else unset if any leaves it unset), every sensitive argument any names with only the
    sources all that name it allow. ``ToolSpec()`` (nothing declared) for none, or for ``tool`` ``None``."""
    if tool is None:
        return ToolSpec()
    if tool in tools:
        return tools[tool]
    specs = [spec for name, spec in tools.items() if same_tool(name, tool)]
    if len(specs) < 2:
        return specs[0] if specs else ToolSpec()
    arguments: dict[str, tuple[Source, ...]] = {}
    for spec in specs:
        for name, allowed in (spec.arguments or {}).items():
            arguments[name] = tuple(source for source in arguments.get(name, allowed) if source in allowed)
    return ToolSpec(
        max((spec.effect for spec in specs), key=_EFFECTS.index),
        arguments or None,
        min((spec.evidence for spec in specs), key=(False, None, True).index),
    )


def gives_evidence(tools: Mapping[str, ToolSpec], tool: str | None) -> bool:
    """Whether a value in ``tool``'s results is a ``tool_result`` for a policy with ``tools`` (its ``evidence``, as
    :func:`tool_spec` finds it; undeclared: yes, but for :func:`is_code_tool`; ``None``, a result whose tool is not
    known: no)."""
    if tool is None:
        return False
    evidence = tool_spec(tools, tool).evidence
    return evidence if evidence is not None else not is_code_tool(tool)


def _repeated(history: Sequence[TurnMessage], tools: Mapping[str, ToolSpec]) -> list[tuple[Any, ...] | None]:
    """For each message of ``history``, the arguments (:attr:`~guard.subject.TurnMessage.arguments`) of calls a tool
    result there may only repeat: those of the call it answers, and those of every call answered before it that
    ``tools`` does not declare ``read_only`` (what it did shows in later reads: a payment in the account's history,
    a file written then read); ``None`` for a result that gives no evidence (:func:`gives_evidence`): its tool's, or
    the name it carries itself where that differs (:attr:`~guard.subject.TurnMessage.result_name`)."""
    out: list[tuple[Any, ...] | None] = []
    sent: list[Any] = []
    # each name looked up once: tool_spec compares a name the policy does not declare with every name it does
    evidence_of = lru_cache(maxsize=None)(partial(gives_evidence, tools))
    effect_of = lru_cache(maxsize=None)(partial(resolved_effect, tools))
    for message in history:
        own = () if message.role != "tool" or message.arguments is None else (message.arguments,)
        names = (message.tool_name, message.result_name or message.tool_name)
        evidence = message.role != "tool" or all(evidence_of(name) for name in names)
        out.append((*sent, *own) if evidence else None)
        if own and effect_of(message.tool_name, "unknown") != "read_only":
            sent.append(message.arguments)
    return out


def _covers(pieces: Sequence[str], compact: str) -> bool:
    """Whether the ``pieces`` (letters and digits only) of :data:`MIN_TEXT_CHARS` or more that are in ``compact``, as
    given or reversed, cover every character of it, wherever they are and whatever other pieces there are: a tool may
    join them in any order and reverse some (``head="GB33BUKB"`` after ``rest="2020..."``, beside ``order="b,a"`` or a
    template ``{1}{0}``). Shorter pieces (``page=1, per_page=10``) cover nothing: they would make most numbers."""
    covered = [False] * len(compact)
    for form in {form for piece in pieces if len(piece) >= MIN_TEXT_CHARS for form in (piece, piece[::-1])}:
        at = compact.find(form)
        while at >= 0:
            covered[at : at + len(form)] = [True] * len(form)
            at = compact.find(form, at + 1)
    return bool(compact) and all(covered)


# A run of base64 (standard or URL-safe alphabet) or hex digits inside an argument, 8 characters or more: its decoded
# text is what the tool may print. It starts only where a run of its characters starts, so a long run costs linear time.
_ENCODED = re.compile(r"(?<![A-Za-z0-9+/_=-])[A-Za-z0-9+/_-]{8,}={0,2}")


def _base64(token: str) -> bytes:
    return base64.b64decode(token.rstrip("=") + "=" * (-len(token.rstrip("=")) % 4), altchars=b"-_", validate=True)


def _decoded(text: str) -> list[str]:
    """The texts a tool may print from the argument ``text`` by decoding it: its rot13 and percent-decoded forms, and
    each base64 or hex run in it (:data:`_ENCODED`) decoded as UTF-8, where that decodes."""
    out = [codecs.encode(text, "rot13")]
    if "%" in text:
        out.append(unquote(text))
    for token in _ENCODED.findall(text):
        for decode in (_base64, bytes.fromhex):
            try:
                out.append(decode(token).decode())
            except (ValueError, UnicodeDecodeError):
                pass
    return out


# The forms of one repeated call's arguments an echo is looked for in (:func:`_echo_forms`), by the arguments' ``id``
# and the top-level argument read (``None``: all); each entry keeps the arguments it was made from, so the ``id`` is
# not reused while the cache lives (one :func:`trace_arguments` run).
_EchoCache = dict[tuple[int, str | None], tuple[Any, tuple[list[str], str, _Prepared | None]]]


def _echo_forms(arguments: Any, argument: str | None, cache: _EchoCache) -> tuple[list[str], str, _Prepared | None]:
    """What :func:`_echoes` reads of one repeated call's ``arguments`` (only its top-level argument named
    ``argument`` when that is given): the letters-and-digits-only pieces of its strings and integers and of each string's decoded forms
    (:func:`_decoded`), those pieces joined in order, and all its values as one prepared text (``None``: no values);
    made once per call in ``cache``."""
    key = (id(arguments), argument)
    hit = cache.get(key)
    if hit is None:
        values = arguments
        if argument is not None:
            values = arguments[argument] if isinstance(arguments, Mapping) and argument in arguments else None
        leaves = [leaf for leaf in _leaves(values) if isinstance(leaf, str | int | float)]
        leaves += [form for leaf in leaves if isinstance(leaf, str) for form in _decoded(leaf)]
        pieces = [_NOT_ALNUM.sub("", _fold(str(leaf))) for leaf in leaves if isinstance(leaf, str | int)
                  and not isinstance(leaf, bool)]  # fmt: skip
        prepared = _Prepared(_fold("\n".join(map(str, leaves)))) if leaves else None
        hit = cache[key] = (arguments, (pieces, "".join(pieces), prepared))
    return hit[1]


def _echoes(needle: _Needle, repeated: Sequence[Any], cache: _EchoCache) -> bool:
    """Whether ``needle`` is among the arguments of a call in ``repeated`` (their values and the identifiers inside
    them: :func:`_repeated`), so a tool result may only repeat it; each call's forms come from ``cache``
    (:func:`_echo_forms`). A number (not an identifier) is looked for only in the argument of its own name (``amount``
    of a repeated payment; not ``n=100`` of a lookup whose result lists a payment of 100); an identifier also in a
    call's strings and integers, letters and digits only: joined in order, forwards or reversed (split into
    ``{"country": "GB", "rest": "33BUKB..."}`` or 4-character pieces for the tool to join, ``echo 55...BG | rev``),
    or pieces that cover it in another order (:func:`_covers`); each string also as it decodes (:func:`_decoded`:
    base64, hex, percent-encoding, rot13), after them all."""
    argument = None
    if needle.number is not None and needle.compact is None:
        if needle.argument is None:  # a number inside a composed text: no argument of its name
            return False
        argument = needle.argument
    for arguments in repeated:
        pieces, joined, prepared = _echo_forms(arguments, argument, cache)
        if needle.compact is not None and (needle.compact in joined or needle.compact[::-1] in joined
                                           or _covers(pieces, needle.compact)):  # fmt: skip
            return True
        if prepared is not None and _found(needle, prepared):
            return True
    return False


def _as_written(value: _Value, text: str) -> bool:
    """Whether ``text``, found to hold ``value`` as guard's normaliser reads both, vouches for it as written: always
    when the value reads as written (no look-alike letters: what the normaliser decodes in ``text``, HTML entities,
    base64, counts), else when ``text`` holds its written form."""
    return value.written == value.read or _found(value.written, _prepare(text))


def _source_of(
    value: _Value,
    history: Sequence[TurnMessage],
    trusted: Sequence[_Prepared],
    detector: Detector,
    repeated: Sequence[tuple[Any, ...] | None],
    echoes: _EchoCache,
) -> ArgumentSource:
    """Where ``value`` came from (the module docstring's precedence): a source that vouches for it holds it as
    written, a flagged one as guard's normaliser reads both; ``repeated`` is :func:`_repeated` of ``history``,
    ``echoes`` the run's cache of its calls' forms (:func:`_echo_forms`)."""
    written, read = value.written, value.read
    if any(_found(written, _prepare(m.text)) for m in history if m.role == "user"):
        return ArgumentSource("user")
    if any(_found(written, t) for t in trusted) or any(
        _found(written, _prepare(m.text)) for m in history if m.role == "system"
    ):
        return ArgumentSource("trusted")
    plain: ArgumentSource | None = None
    relayed: ArgumentSource | None = None
    for message, repeats in zip(reversed(history), reversed(repeated), strict=True):
        if message.role == "agent":  # a summary, a parent agent's task: not the user's words
            if _found(read, _prepare_read(message.text)):
                if message.flagged is not None:  # it summarizes flagged results: all of it counts as flagged
                    return ArgumentSource("flagged_tool_result")
                _, flagged = _split_tool_text(message.text, detector)  # instructions in it, as in a tool result
                if flagged.text and _found(read, flagged):
                    return ArgumentSource("flagged_tool_result")
                if _as_written(value, message.text):
                    relayed = relayed or ArgumentSource("agent")
            continue
        if message.role != "tool":
            continue
        if message.flagged in ("withheld", "quoted"):  # all of guard's notice or quote counts as flagged
            if _found(read, _prepare_read(message.text)):
                return ArgumentSource("flagged_tool_result", message.tool_name, message.tool_call_id)
            continue
        if message.cut and _found(read, _prepare_read(message.cut)):  # named by instructions guard cut
            return ArgumentSource("flagged_tool_result", message.tool_name, message.tool_call_id)
        ordinary, flagged = _split_tool_text(message.text, detector)
        if flagged.text and _found(read, flagged):
            return ArgumentSource("flagged_tool_result", message.tool_name, message.tool_call_id)
        if (plain is None and _found(read, ordinary) and _as_written(value, message.text)
                and repeats is not None and not _echoes(written, repeats, echoes)):
            plain = ArgumentSource("tool_result", message.tool_name, message.tool_call_id)
    return plain or relayed or ArgumentSource("none")


def trace_arguments(
    arguments: Mapping[str, Any] | None,
    history: Sequence[TurnMessage],
    *,
    trusted: Sequence[str] = (),
    detector: Detector = find_instructions,
    tools: Mapping[str, ToolSpec] | None = None,
) -> dict[str, ArgumentSource]:
    """The source of every top-level argument of a tool call.

    Args:
        arguments: the call's parsed arguments (an object; ``None`` = no arguments).
        history: the messages before the call, oldest first.
        trusted: values from trusted configuration (e.g. the policy's ``trusted`` list).
        detector: finds the spans of a tool result that give the agent instructions.
        tools: the policy's tools; the arguments of an earlier call it does not declare ``read_only`` are no
            evidence in tool results from that call on (``None``: no tool is declared).

    Returns:
        Argument name -> :class:`ArgumentSource`; an argument made of several values gets the weakest of theirs.
    """
    out: dict[str, ArgumentSource] = {}
    if not arguments:
        return out
    trusted_prepared = [_prepare(t) for t in trusted]
    repeated = _repeated(history, tools or {})
    echoes: _EchoCache = {}

    def source_of(value: _Value) -> ArgumentSource:
        return _source_of(value, history, trusted_prepared, detector, repeated, echoes)

    def leaf_sources(name: str, value: Any) -> Iterator[ArgumentSource]:
        for leaf in _leaves(value):
            traced = _value(leaf, name)
            if traced is None:
                continue
            found = source_of(traced)
            if found.source == "none":  # composed text: its links, addresses, names and codes are traced one by one
                inner = _embedded(leaf)
                if inner:
                    found = _weakest(map(source_of, inner)) or found
            yield found

    budget = _BUDGET.set([MAX_REJECTED])
    try:
        for name, value in arguments.items():
            try:
                out[name] = _weakest(leaf_sources(name, value)) or ArgumentSource("user", matched=False)
            except _OverBudget:  # a text built to hold it at too many places that are not whole tokens
                out[name] = _past_budget(history, detector)
    finally:
        _BUDGET.reset(budget)
    return out


def _past_budget(history: Sequence[TurnMessage], detector: Detector) -> ArgumentSource:
    """The source of an argument whose trace ran past :data:`MAX_REJECTED`: ``flagged_tool_result`` when a tool
    result or an agent's message in ``history`` is flagged (withheld, quoted or cut by guard, or holding instructions
    ``detector`` finds), so spending the budget on another argument cannot hide a value an injection named; else
    ``none``."""
    for message in history:
        if message.role in ("tool", "agent") and (
            message.flagged is not None or message.cut or _split_tool_text(message.text, detector)[1].text
        ):
            return ArgumentSource("flagged_tool_result")
    return ArgumentSource("none")


def _weakest(found: Iterable[ArgumentSource]) -> ArgumentSource | None:
    """The first of the weakest sources in ``found`` (:data:`SOURCES`' order; ``None`` when there is none), read only
    until a ``flagged_tool_result``, than which none is weaker."""
    worst: ArgumentSource | None = None
    for source in found:
        if worst is None or _RANK[source.source] > _RANK[worst.source]:
            worst = source
        if source.source == SOURCES[-1]:
            break
    return worst


def resolved_effect(
    tools: Mapping[str, ToolSpec], tool: str | None, declared: Literal["read_only", "side_effecting", "unknown"]
) -> Literal["read_only", "side_effecting", "unknown"]:
    """What ``tool`` does for a policy with ``tools``: its entry there (:func:`tool_spec`), else ``declared`` (the
    tool's own metadata, :attr:`guard.subject.AgentSubject.tool_effect`)."""
    effect = tool_spec(tools, tool).effect
    return effect if effect != "unknown" else declared


def call_features(
    tool: str | None,
    arguments: Mapping[str, Any] | None,
    history: Sequence[TurnMessage],
    *,
    tools: Mapping[str, ToolSpec],
    trusted: Sequence[str] = (),
    detector: Detector = find_instructions,
    declared_effect: Literal["read_only", "side_effecting", "unknown"] = "unknown",
) -> dict[str, Any]:
    """The ``call`` object tool-call rules read (plain JSON values).

    Keys:
        ``tool``: the tool's name; ``effect``: ``read_only``, ``side_effecting`` or ``unknown`` (from ``tools``, else
        ``declared_effect``: what the tool's own metadata says);
        ``provenance``: argument -> source (every top-level argument); ``origin``: argument -> the ``tool_call_id``
        of the tool result it came from (``""`` otherwise); ``disallowed``: the sensitive arguments (named in the
        tool's spec) whose source the spec does not allow, sorted; ``from_flagged``: the arguments whose source is
        ``flagged_tool_result``, sorted; ``flagged_results``: how many tool results since the user's last message
        were flagged (guard withheld, quoted or stripped them, or the detector finds instructions in them);
        ``user_arguments``: how many arguments come from the user.
    """
    sources = trace_arguments(arguments, history, trusted=trusted, detector=detector, tools=tools)
    spec = tool_spec(tools, tool)
    allowed = spec.arguments or {}
    disallowed = sorted(
        name for name, permitted in allowed.items() if name in sources and sources[name].source not in permitted
    )
    return {
        "tool": tool or "",
        "effect": resolved_effect(tools, tool, declared_effect),
        "provenance": {name: found.source for name, found in sources.items()},
        "origin": {name: found.tool_call_id or "" for name, found in sources.items()},
        "disallowed": disallowed,
        "from_flagged": sorted(name for name, found in sources.items() if found.source == "flagged_tool_result"),
        "flagged_results": flagged_results(history, detector),
        "user_arguments": sum(1 for found in sources.values() if found.source == "user" and found.matched),
    }


def flagged_results(history: Sequence[TurnMessage], detector: Detector = find_instructions) -> int:
    """How many tool results since the user's last message (``history``, oldest first) were flagged: guard withheld,
    quoted or stripped them, or ``detector`` finds instructions in them; an ``agent`` message that summarizes flagged
    results, or in which ``detector`` finds instructions, counts as one (it does not end the count: it is not the
    user's)."""
    count = 0
    for message in reversed(history):
        if message.role == "user":
            break
        if message.role in ("agent", "tool") and (
            message.flagged is not None or any(spans for _, spans in _detected(message.text, detector))
        ):
            count += 1
    return count


def result_features(text: Any, *, detector: Detector = find_instructions) -> dict[str, Any]:
    """The ``result`` object tool-result rules read: ``instructions`` (how many spans give the agent instructions),
    ``cues`` (their cue families, sorted) and ``chars`` (characters in them), found in the normalised text and in
    the text as given (:func:`_readings`): the counts of the reading with the most spans, the cues of both; and
    ``unread`` (characters past :data:`DETECTOR_MAX_CHARS`, which the detector did not read)."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    readings = [spans for _, spans in _detected(text, detector)]
    spans = max(readings, key=len)
    return {
        "instructions": len(spans),
        "cues": sorted({cue for found in readings for span in found for cue in span.cues}),
        "chars": sum(span.end - span.start for span in spans),
        "unread": max(0, len(text) - DETECTOR_MAX_CHARS),
    }


def rule_features(
    subject: Subject | None,
    names: frozenset[str],
    *,
    tools: Mapping[str, ToolSpec],
    trusted: Sequence[str] = (),
    detector: Detector = find_instructions,
) -> dict[str, Any]:
    """``call`` and ``result`` for the rules of a policy, only those in ``names`` (what its rules read) and only for
    the events they describe (a tool call, a tool result); ``{}`` otherwise."""
    out: dict[str, Any] = {}
    if not isinstance(subject, AgentSubject):
        return out
    if "call" in names and subject.event == "tool_call":
        arguments = subject.arguments if isinstance(subject.arguments, Mapping) else None
        out["call"] = call_features(
            subject.tool_name,
            arguments,
            subject.history,
            tools=tools,
            trusted=trusted,
            detector=detector,
            declared_effect=subject.tool_effect,
        )
    if "result" in names and subject.event == "tool_result":
        out["result"] = result_features(subject.tool_result, detector=detector)
    return out
