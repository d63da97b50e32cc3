"""Rules: CEL conditions over the answers, compiled once at load and applied as a pure function.

Evaluation order (documented in ``docs/policies.md``): rules are tried top to bottom; the first whose ``when`` is
``true`` decides; when none is, ``default`` decides. A ``when`` that fails at run time (a missing key, a type error)
or yields a non-boolean is an error, handled by the policy's fail mode, never skipped and never an allow.

Names a ``when`` can use:

* each question by its key in ``questions``: ``{type, noul | choice | score, confidence, probabilities}``
  (``injection.noul >= 0.8``, ``queue.choice == "billing" && queue.confidence > 0.6``, ``severity.score >= 3``,
  ``queue.probabilities["other"] > 0.5``);
* ``answers``: the same objects in one map; ``subject``: the subject's fields (``subject.method``,
  ``subject.tool_name``, ``subject.headers["x-tier"]``); ``state``: the rendered state as received (not normalised
  and not cut: normalisation feeds the model only, so ``state.user == "admin"`` does not match a Cyrillic or
  full-width look-alike); ``flags``: the normalisation findings and the cuts (``flags.unicode_tags > 0``,
  ``flags.truncated > 0``; every name in :data:`FLAG_NAMES` reads 0 when absent); ``data``: the file's ``data`` block;
* ``call`` (tool calls): argument provenance and the tool's effect (``call.provenance.recipient == "user"``,
  ``size(call.disallowed) > 0``); ``result`` (tool results): instructions to the agent found in the text
  (``result.instructions > 0``); both from ``guard/policy/provenance.py``, empty objects for other events.

Functions besides CEL's own (:data:`FUNCTIONS`): ``skeleton(x)`` (the UTS #39 skeleton of a string) and
``confusable(x, y)`` (their skeletons are equal), for rules that want homoglyph-insensitive comparison
(``confusable(state.user, "admin")``), from :mod:`guard.policy.skeleton`; ``sqli(x)`` (a line of ``x`` is an SQL
statement), ``xss(x)`` (script-bearing markup or a script URL), ``code_exec(x)`` (code that runs a command) and
``path_traversal(x)`` (a path that climbs two or more folders), from :mod:`guard.policy.payloads`. The method
``x.matches(pattern)`` is guard's, not the runtime's: RE2 syntax with Unicode ``\\d \\s \\w``, the patterns a
rule is given compiled once at load (:func:`rule_patterns`, :func:`guard.policy._re2.matcher`), as a ``redact``
pattern is. ``size(x)`` and ``x.size()`` of a string count its characters (code points), as CEL's specification
says, not the UTF-8 bytes the runtime's own ``size`` counts (:func:`_with_character_size`).
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import inspect
import math
import operator
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import cel

from guard._headers import host_name, media_type
from guard._json import surrogates_joined, unique_key
from guard.errors import GuardError
from guard.policy import payloads, skeleton
from guard.policy._re2 import CANDIDATE_MAX_MEM, Pattern, compile_re2, matcher
from guard.policy.normalize import FLAG_NAMES as NORMALIZE_FLAG_NAMES
from guard.policy.redact import Redactor
from guard.subject import AgentEvent, ToolEffect
from guard.systemone import AnswerV1, QuestionType, QuestionV1, shown_id
from guard.verdict import Action

__all__ = [
    "ANSWER_FIELDS",
    "FEATURE_NAMES",
    "FLAG_NAMES",
    "FUNCTIONS",
    "LITERAL_RE",
    "RESERVED_NAMES",
    "RESERVED_RULE_IDS",
    "CompiledRule",
    "Outcome",
    "RuleError",
    "RuleResult",
    "answer_literal_errors",
    "answer_variables",
    "apply_rules",
    "compile_condition",
    "data_value",
    "field_reads",
    "fixed_value_errors",
    "header_name_errors",
    "rule_context",
    "rule_inputs",
    "rule_patterns",
    "run_rule",
    "selected_fields",
    "subject_fields",
    "trace_rules",
]

#: Flags rules read as ``flags.<name>`` (``0`` when absent): the normalisation findings (:mod:`guard.policy.normalize`),
#: ``truncated`` (state fields cut to their ``max_chars``) and ``state_tokens_dropped`` (state tokens the backend
#: reported it did not read, ``usage.state_tokens_dropped``) and ``out_of_competence`` (the backend could not read the
#: state: an unsupported language or non-text, ``usage.out_of_competence``). A verdict also carries ``fail_open``
#: (rules never see it: they did not run).
FLAG_NAMES = (*NORMALIZE_FLAG_NAMES, "truncated", "state_tokens_dropped", "out_of_competence")

#: The functions every ``when`` may call besides CEL's own, by name.
FUNCTIONS = skeleton.FUNCTIONS | payloads.FUNCTIONS
#: The name a ``when``'s ``.matches(`` calls are compiled to: guard's RE2 ``matches``, which the runtime's own
#: (compiling its pattern on every call) cannot be replaced by under its name.
_MATCHES = "matches_re2"
_MATCHES_CALL = re.compile(r"\.\s*matches\s*\(")
#: The name of guard's character count, which a ``when``'s ``size(x)`` and ``x.size()`` call for a string (the
#: runtime's own counts UTF-8 bytes).
_SIZE = "size_chars"
_SIZE_CALL = re.compile(r"(?<![\w.])size\s*\(|\.\s*size\s*\(")
_CLOSING = re.compile(r"\s*\)")
_LARGEST_DOUBLE = int(sys.float_info.max)
#: The smallest 64-bit integer, which the CEL runtime's unary minus returns unchanged (``-x`` of it is itself, where
#: ``0 - x`` and ``x * -1`` fail as an overflow).
_SMALLEST_INT = -(2**63)
#: A ``-`` that negates what follows (not a number written after it): one with no operand before it.
_NEGATION = re.compile(r"(?:^|[-([{,?:!&|=<>+*/%]|(?<![\w.])in)\s*-(?!\s*[\d-])")

#: Top-level names every ``when`` may use besides question keys.
RESERVED_NAMES = frozenset({"answers", "subject", "state", "flags", "data", "call", "result"})
#: CEL's type names, which ``type(x) == string`` compares with (a rule checks a client-chosen JSON type this way).
CEL_TYPE_NAMES = frozenset({"bool", "int", "uint", "double", "string", "bytes", "list", "map", "null_type", "type"})
#: Rule ids a verdict carries when no rule of the policy decided it, and when that is; no rule may take one.
RESERVED_RULE_IDS = {
    "default": "no rule fired",
    "on_error": "a fail mode decided",
    "state_too_long": "the state was too long to judge",
    "state_ambiguous": "the request sent a value the policy reads as one more than once",
}
#: Reserved names whose values the caller computes per subject (``features=`` of :func:`apply_rules`).
FEATURE_NAMES = frozenset({"call", "result"})
#: CEL words a question key may not take.
CEL_KEYWORDS = frozenset(
    {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if", "import",
     "let", "loop", "package", "namespace", "return", "var", "void", "while"}
)  # fmt: skip
#: Fields of an answer object by question type.
ANSWER_FIELDS: dict[str, frozenset[str]] = {
    "noul": frozenset({"type", "noul", "probabilities"}),
    "choice": frozenset({"type", "choice", "confidence", "probabilities"}),
    "score": frozenset({"type", "score", "confidence", "probabilities"}),
}
#: The functions of the CEL runtime (``common-expression-language``) a rule may call, besides :data:`FUNCTIONS` and
#: the macros (``has``, ``all``, ``exists``, ``exists_one`` or ``existsOne``, ``map``, ``filter``). It has no strings
#: extension (``lowerAscii``, ``split``, ``replace``) and no ``max``/``min``.
STANDARD_FUNCTIONS = frozenset({
    "contains", "startsWith", "endsWith", "matches", "size", "int", "uint", "double", "string", "bytes", "duration",
    "timestamp", "type", "dyn", "getDate", "getDayOfMonth", "getDayOfWeek", "getDayOfYear", "getFullYear",
    "getHours", "getMilliseconds", "getMinutes", "getMonth", "getSeconds",
})
#: Standard functions this runtime has only as methods (``state.text.matches("...")``): written as functions
#: (``matches(state.text, "...")``) they are undefined on every request.
METHOD_ONLY = frozenset({
    "contains", "startsWith", "endsWith", "matches", "getDate", "getDayOfMonth", "getDayOfWeek", "getDayOfYear",
    "getFullYear", "getHours", "getMilliseconds", "getMinutes", "getMonth", "getSeconds",
})
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_CALL_RE = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\s*\(")
#: A CEL string literal (prefix ``r`` raw: no escapes, ``b`` bytes; single, double or triple quotes) or a comment
#: (``//`` to the end of the line), found left to right so a quote in a comment or a ``//`` in a string is neither.
LITERAL_RE = re.compile(
    r"//[^\n]*"
    r"""|(?<![\w.])(?:[rR][bB]?|[bB][rR])(?:"{3}[\s\S]*?"{3}|'{3}[\s\S]*?'{3}|"[^"\n]*"|'[^'\n]*')"""
    r"""|(?:(?<![\w.])[bB])?(?:"{3}(?:[^\\]|\\[\s\S])*?"{3}|'{3}(?:[^\\]|\\[\s\S])*?'{3}"""
    r"""|"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')"""
)


def _literal_spans(source: str) -> list[tuple[int, int]]:
    """Where ``source``'s string literals and comments are (:data:`LITERAL_RE`)."""
    return [m.span() for m in LITERAL_RE.finditer(source)]


def _code_only(source: str) -> str:
    """``source`` with each string literal written ``""`` and each comment a space: the code, for name searches."""
    return LITERAL_RE.sub(lambda m: " " if m.group(0).startswith("//") else '""', source)
_BOUND_RE = re.compile(r"\.\s*(?:all|exists|exists_one|existsOne|map|filter)\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*,")


class RuleError(GuardError):
    """A rule's ``when`` failed at run time or did not yield a boolean.

    ``reason`` (and the message) name the kind of failure without any value the request supplied (it reaches the
    verdict's ``error``, spans and the decision log); ``detail`` is the runtime's own text, values included, for the
    local tools of policy authors (``guard policy explain``, load-time checks). ``detail`` defaults to ``reason``.
    """

    def __init__(self, policy_id: str, rule_id: str, reason: str, detail: str | None = None) -> None:
        self.policy_id = policy_id
        self.rule_id = rule_id
        self.reason = reason
        self.detail = reason if detail is None else detail
        super().__init__(f"rule {rule_id!r} of policy {policy_id!r} failed: {reason}")


@dataclass(frozen=True)
class Outcome:
    """What a rule (or the default) does.

    Attributes:
        action: ``allow``, ``block``, ``escalate``, ``handoff`` or ``redact``.
        status: HTTP status for block (default 403).
        message: text for the caller or the model.
        retry_after: seconds, e.g. for a 429.
        handoff: handoff target name, for ``handoff``.
        redact: what to mask, for ``redact``.
    """

    action: Action
    status: int | None = None
    message: str | None = None
    retry_after: float | None = None
    handoff: str | None = None
    redact: Redactor | None = None


@dataclass(frozen=True)
class CompiledRule:
    """A rule with its CEL program compiled, the names it reads, and the patterns its ``matches()`` calls are given,
    compiled (:func:`rule_patterns`). ``selected`` is set from ``source``: for ``subject`` and ``state``, the fields
    it reads (:func:`selected_fields`), ``None`` where it reads that name some other way."""

    id: str
    source: str
    program: Any
    outcome: Outcome
    names: frozenset[str]
    patterns: Mapping[str, Pattern] = field(default_factory=dict)
    selected: Mapping[str, frozenset[str] | None] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "selected", {name: selected_fields(self.source, name) for name in _SELECTED_NAMES})


@dataclass(frozen=True)
class RuleResult:
    """The rule that fired (``"default"`` when none did) and its outcome."""

    rule: str
    outcome: Outcome


#: Most characters a ``when`` may have. The CEL runtime panics on a syntax error past column 65,535 of a line
#: (:func:`_cel` turns that into an error); the longest ``when`` shipped has 80 characters.
MAX_WHEN_CHARS = 4096
#: Deepest a ``when`` may nest, as :func:`_nesting_depth` counts it. The CEL runtime (Rust) recurses once per level
#: of the expression tree with no limit of its own, so a ``when`` nested deeper than the thread's stack allows kills
#: the process: ``x + x + ... + x`` evaluated took ~670 bytes of stack per ``+`` (12,500 of them overflowed the main
#: thread's 8 MiB, 1,560 a 1 MiB thread's; compiling, ~20,000 and 8 MiB). Its parser refuses more than ~96 nested
#: brackets by itself, but not a long chain of operators. Every shape of ``when`` tried at this depth (chains of
#: operators, members, indexes and calls, 90 nested brackets, nested macros) compiled and ran on a 1 MiB thread
#: stack; the shipped rules nest 7 deep at most.
MAX_WHEN_DEPTH = 500
#: Operators :func:`_nesting_depth` counts: two-character ones first, then one-character ones (``.`` of a member or
#: a method; a decimal point is not one), and ``in``.
_OPERATOR_RE = re.compile(r"&&|\|\||[=!<>]=|(?<!\d)\.|\.(?!\d)|[-+*/%<>!?]|\bin\b")


def _nesting_depth(code: str) -> int:
    """An upper bound of the depth of ``code``'s expression tree (``code``: a ``when`` with its string literals and
    comments blanked, :func:`_masked`): for each bracket (parentheses, a call's, a list's, a map's, an index), one
    plus, over the items its commas separate, the most operators an item holds plus the deepest bracket in it; the
    whole ``when`` is one such item. Every operator counts, ``&&`` and ``||`` too, each of a run of ``!`` or ``-``,
    and each bracket as one more operator of the item it opens in. Unbalanced brackets are left for the CEL parser
    to report."""
    stack = [[0, 0, 0]]  # per open bracket: operators in the current item, its deepest bracket, the deepest item so far
    at = 0
    for found in re.finditer(r"[([{]|[)\]}]|,", code):
        stack[-1][0] += len(_OPERATOR_RE.findall(code, at, found.start()))
        at = found.end()
        char = found.group()
        if char in "([{":
            stack[-1][0] += 1  # a call, an index, a list or a map is a node of its own: ``m["a"]["b"]`` is 2 deep
            stack.append([0, 0, 0])
            continue
        item = stack[-1]
        item[2] = max(item[2], item[0] + item[1])
        item[0] = item[1] = 0
        if char != "," and len(stack) > 1:
            stack.pop()
            stack[-1][1] = max(stack[-1][1], 1 + item[2])
    stack[-1][0] += len(_OPERATOR_RE.findall(code, at))
    depth = 0
    while stack:  # brackets never closed, then the whole ``when``
        ops, inner, deepest = stack.pop()
        depth = max(deepest, ops + inner, depth + ops) + (1 if stack else 0)
    return depth


def _cel(call: Callable[[str], Any], source: str) -> Any:
    """``call(source)``, ``call`` being ``cel.compile`` or ``cel.evaluate``, with a panic of the runtime
    (``pyo3_runtime.PanicException``, which derives from ``BaseException`` only, and whose class pyo3 makes at run
    time: a syntax error past column 65,535 of a line makes it panic) turned into a ValueError. Running a compiled
    program needs no such guard: the runtime turns a panic there into a ValueError itself.

    Raises:
        ValueError: ``source`` is not a CEL expression the runtime can compile (or ``call``'s own errors).
    """
    try:
        return call(source)
    except BaseException as exc:
        if type(exc).__module__ != "pyo3_runtime" or type(exc).__name__ != "PanicException":
            raise
        raise ValueError(f"Failed to parse expression: the CEL runtime panicked on it ({exc})") from None


def compile_condition(source: str, known: Mapping[str, QuestionType | None]) -> tuple[Any, frozenset[str]]:
    """Compile one ``when`` and check every name it reads.

    Args:
        source: the CEL expression.
        known: question key -> question type (``None`` when unknown: fields are then not checked).

    Returns:
        ``(program, names)``: the compiled program and the top-level names it reads.

    Raises:
        ValueError: a ``when`` longer than :data:`MAX_WHEN_CHARS` or nested deeper than :data:`MAX_WHEN_DEPTH`
            (checked before the runtime sees it), a CEL syntax error, an unknown name (e.g. a question that does not
            exist), or an answer field the question's type does not have (``injection.choice`` on a noul question).
    """
    if len(source) > MAX_WHEN_CHARS:
        raise ValueError(f"is {len(source)} characters long; a 'when' may have at most {MAX_WHEN_CHARS} (put a long "
                         "list or map in the file's 'data' block and read it as data.<name>)")
    depth = _nesting_depth(_masked(source))
    if depth > MAX_WHEN_DEPTH:
        raise ValueError(f"nests {depth} deep (operators in a row, plus one per bracket around them); a 'when' may "
                         f"nest at most {MAX_WHEN_DEPTH} deep: split it into several rules, or put values in 'data'")
    try:
        program = _cel(cel.compile, source)
    except ValueError as exc:
        detail = str(exc).splitlines()
        raise ValueError(f"CEL syntax error: {' '.join(line.strip() for line in detail[:2])}") from None
    runnable = _with_character_size(_with_guard_matches(source))
    depth = _nesting_depth(_masked(runnable))
    if depth > MAX_WHEN_DEPTH:
        raise ValueError(f"nests {depth} deep as run (each size() runs as [x].map(v, ...)[0], 9 levels more); a "
                         f"'when' may nest at most {MAX_WHEN_DEPTH} deep: split it into several rules")
    without_strings = _code_only(source)
    _check_calls(program, without_strings)
    _check_macro_cost(source)
    bound = set(_BOUND_RE.findall(without_strings))
    shadowing = sorted(bound & (RESERVED_NAMES | set(known)))
    if shadowing:  # the name would be the loop variable inside the macro and an unread input outside it
        raise ValueError(f"a macro's variable is named {shadowing[0]!r}, which is a rule input; rename the variable")
    names = set(program.variables()) - bound - CEL_TYPE_NAMES  # no question takes a type's name (the loader)
    unknown = sorted(names - RESERVED_NAMES - set(known))
    if unknown:
        allowed = ", ".join(sorted(known)) or "(none)"
        others = ", ".join(sorted(RESERVED_NAMES))
        raise ValueError(f"unknown name {unknown[0]!r}; a rule may use the questions ({allowed}) or {others}")
    for key, qtype in known.items():
        if qtype is None:
            continue
        for match in re.finditer(rf"(?<![\w.]){re.escape(key)}\s*\.\s*([A-Za-z_]\w*)", without_strings):
            field = match.group(1)
            if field not in ANSWER_FIELDS[qtype]:
                raise ValueError(f"{key}.{field}: a {qtype} answer has {', '.join(sorted(ANSWER_FIELDS[qtype]))}")
    return (_cel(cel.compile, runnable) if runnable != source else program), frozenset(names)


def _with_guard_matches(source: str) -> str:
    """``source`` with each ``.matches(`` call (:func:`_matches_calls`) calling guard's RE2 ``matches``
    (:data:`_MATCHES`); a comment between ``matches`` and ``(`` is dropped."""
    out, at = [], 0
    for start, end, _ in _matches_calls(source):
        out.append(source[at:start] + f".{_MATCHES}(")
        at = end
    return "".join(out) + source[at:]


def _with_character_size(source: str) -> str:
    """``source`` with each ``size(x)`` and ``x.size()`` counting a string's characters (code points, as CEL's
    specification says and ``max_chars`` counts) where the runtime's own ``size`` counts its UTF-8 bytes: the call
    becomes ``[x].map(v, type(v) == type("") ? size_chars(v) : size(v))[0]`` (``x`` read once, a string literal
    too; a list's, a map's or bytes' size unchanged; ``type("")``, as a macro's variable may be named ``string``). A
    call given other than one argument is left for the runtime to report."""
    code = _masked(source)
    calls = []  # (start, end, start of x, end of x) of each call, x being its argument or what it is called on
    for found in _SIZE_CALL.finditer(code):
        close = _closing(code, found.end())
        if found.group().startswith("."):
            start = _receiver_start(code, found.start())
            while start > 0 and code[start - 1] == " " and source[start - 1] in "rRbB":  # a literal's prefix
                start -= 1
            if start < found.start() and not code[found.end() : close].strip():
                calls.append((start, close + 1, start, found.start()))
        elif _argument_count(code, found.end()) == 1:
            calls.append((found.start(), close + 1, found.end(), close))
    calls.sort(key=lambda call: (call[0], -call[1]))  # calls nest: the outer one first

    def rewritten(start: int, end: int) -> str:
        out, at = [], start
        for call_start, call_end, value_start, value_end in calls:
            if call_start >= at and call_end <= end:
                value = rewritten(value_start, value_end)
                out.append(source[at:call_start] + f"[{value}].map(v, type(v) == type(\"\") ? {_SIZE}(v) : size(v))[0]")
                at = call_end
        return "".join(out) + source[at:end]

    return rewritten(0, len(source))


def _matches_calls(source: str) -> list[tuple[int, int, str | None]]:
    """Each ``.matches(`` call of ``source`` outside string literals and comments (comments may sit anywhere in it):
    its span up to the ``(``, and the string literal it is given when that literal is its whole argument (as
    written: ``r"\\d+"``), else None."""
    masked = _masked(source)
    literals = {}  # where each literal's first quote is (what its masked form keeps) -> its span, prefix included
    for a, b in _literal_spans(source):
        if not source.startswith("//", a):
            literals[a + len(source[a:b]) - len(source[a:b].lstrip("rRbB"))] = (a, b)
    out = []
    for call in _MATCHES_CALL.finditer(masked):
        span = literals.get(len(masked) - len(masked[call.end() :].lstrip()))
        literal = source[span[0] : span[1]] if span is not None and _CLOSING.match(masked, span[1]) else None
        out.append((call.start(), call.end(), literal))
    return out


def _check_calls(program: Any, source: str) -> None:
    """Refuse a call the runtime would fail on every time: a function it does not have, or one of guard's
    :data:`FUNCTIONS` called with the wrong number of arguments (``source``: the ``when`` with its string literals
    emptied).

    Raises:
        ValueError: naming the function and what a rule may call.
    """
    unknown = sorted(
        name for name in program.functions()
        if _IDENTIFIER.fullmatch(name) and name not in STANDARD_FUNCTIONS and name not in FUNCTIONS
    )
    if unknown:
        raise ValueError(
            f"unknown function {unknown[0]!r}; a rule may call {', '.join(sorted(FUNCTIONS))} and CEL's "
            f"{', '.join(sorted(STANDARD_FUNCTIONS))}"
        )
    for match in _CALL_RE.finditer(source):
        name = match.group(1)
        if name in METHOD_ONLY and not source[: match.start()].rstrip().endswith("."):  # "x. contains(" is a method
            raise ValueError(f"{name}() is a method in this runtime: write x.{name}(...), not {name}(x, ...)")
        if name not in FUNCTIONS:
            continue
        given = _argument_count(source, match.end())
        expected = len(inspect.signature(FUNCTIONS[name]).parameters)
        if given != expected:
            plural = "s" if expected != 1 else ""
            raise ValueError(f"{name}() takes {expected} argument{plural}, given {given}")


#: Macros that iterate a list (or a map's keys); ``map`` and ``filter`` collect what they keep. ``existsOne`` is the
#: runtime's other spelling of ``exists_one``.
_MACRO_RE = re.compile(r"\.\s*(all|exists_one|existsOne|exists|map|filter)\s*\(")
#: Names whose values the request supplies, so their sizes too.
_REQUEST_NAMES = frozenset({"state", "subject", "call", "result"})
_MACRO_VARIABLE = re.compile(r"\s*([A-Za-z_]\w*)\s*,")
_NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*")


@dataclass
class _Macro:
    """A macro call of a ``when``: its name, variable, receiver as written, the span of its body (its arguments
    after the variable) in the text, and whether it iterates request data."""

    name: str
    variable: str
    receiver: str
    body: tuple[int, int]
    over_request: bool = False


def _check_macro_cost(source: str) -> None:
    """Refuse a ``when`` whose run time grows with the square of the request, which no timeout can stop (rules run
    on the event loop, and the CEL runtime neither yields nor has a cost limit). The runtime copies a list or map
    each time an expression reads it, so inside the body of a macro over request data (:data:`_REQUEST_NAMES`, or
    the variable of such a macro, list and map literals holding them included) the request may be read only through
    that macro's own variable: a request name or an enclosing macro's variable read there is refused, and so is a
    macro over either. ``map`` and ``filter`` over request data are refused too: this runtime copies what they
    collected at each item. ``data``, question keys and literals may be read anywhere.

    Raises:
        ValueError: naming what is read where, and what to write instead.
    """
    code = _masked(source)
    macros: list[_Macro] = []

    def binding(name: str, at: int) -> _Macro | None:
        """The macro whose variable ``name`` at ``at`` is (the innermost binding it), None for a top-level name."""
        inner = [m for m in macros if m.variable == name and m.body[0] <= at < m.body[1]]
        return max(inner, key=lambda m: m.body[0]) if inner else None

    def over_request(name: str, at: int) -> bool:
        bound = binding(name, at)
        return bound.over_request if bound is not None else name in _REQUEST_NAMES

    for found in _MACRO_RE.finditer(code):
        variable = _MACRO_VARIABLE.match(code, found.end())
        if variable is None:
            continue
        start = _receiver_start(code, found.start())
        macro = _Macro(found.group(1), variable.group(1), " ".join(source[start : found.start()].split()),
                       (variable.end(), _closing(code, variable.end())))
        names = _names(code, start, found.start())
        macro.over_request = start == found.start() or any(over_request(name, at) for name, at in names)
        macros.append(macro)
        if macro.over_request and macro.name in ("map", "filter"):
            raise ValueError(
                f"runs {macro.name}() over {macro.receiver}, request data: this CEL runtime's map() and filter() "
                "take time growing with the square of the list (10,000 items: 9 s on the event loop, which no "
                "timeout stops); exists(), all() and exists_one() cost what the list does: some item holds "
                "(exists), every item (all), exactly one (exists_one), at least two (x.exists(i, p) && "
                "!x.exists_one(i, p)); a larger count, or a list built from the request, cannot be written: "
                "compute it in the app and pass it in the state"
            )
    for name, at in _names(code, 0, len(code)):
        enclosing = [m for m in macros if m.over_request and m.body[0] <= at < m.body[1]]
        if not enclosing or not over_request(name, at):
            continue
        inner = max(enclosing, key=lambda m: m.body[0])
        if binding(name, at) is inner:
            continue
        what = f"{name}, the variable of an enclosing macro," if name not in _REQUEST_NAMES or binding(name, at) \
            else name
        raise ValueError(
            f"reads {what} inside the body of {inner.name}() over {inner.receiver}: the CEL runtime copies a list "
            "or map each time it is read, so the cost grows with the square of the request (8,000 items: 74 s on "
            "the event loop, which no timeout stops); inside a macro over request data read the request only "
            f"through its variable {inner.variable!r} (a macro over a field of it loads), and compare it with "
            "data or literals; what needs two request values in one body (two request lists intersected, a list's "
            "duplicates, a map's values read by key) cannot be written: compute it in the app and pass it in the "
            "state (the intersection, a flag, a map's values as a list)"
        )


def _names(code: str, start: int, end: int) -> list[tuple[str, int]]:
    """The names ``code`` (a :func:`_masked` ``when``) reads between ``start`` and ``end``, with their offsets:
    variables and top-level names, not fields or methods (after a ``.``) nor functions called."""
    out = []
    for found in _NAME.finditer(code, start, end):
        if code[: found.start()].rstrip().endswith(".") or code[found.end() :].lstrip().startswith("("):
            continue
        out.append((found.group(), found.start()))
    return out


def _receiver_start(code: str, dot: int) -> int:
    """Where the expression a method is called on starts, the method's ``.`` being at ``dot`` in ``code`` (a
    :func:`_masked` ``when``): a chain of names, members, calls and indexes (``state.items[0].tags``), one that
    starts with a bracketed expression (``[state.a, state.b]``, ``{"x": state.items}.x``), or a string literal."""
    at = dot
    while True:
        start = len(code[:at].rstrip())
        if start > 0 and code[start - 1] in "\"'":  # a literal's text is blanked: its opening quote is the one before
            return code.rfind(code[start - 1], 0, start - 1)
        bracket = start > 0 and code[start - 1] in ")]}"
        if bracket:
            start = _opening(code, start - 1)
        else:
            while start > 0 and (code[start - 1].isalnum() or code[start - 1] == "_"):
                start -= 1
            if start == at:
                return at
        before = len(code[:start].rstrip())
        if before > 0 and (code[before - 1] == "." or (bracket and (code[before - 1].isalnum() or code[before - 1]
                                                                    in "_)]}"))):
            at = before - 1 if code[before - 1] == "." else before
            continue
        return start


def _opening(code: str, close: int) -> int:
    """Where the bracket that the one at ``close`` closes opens (0 when none does)."""
    depth = 0
    for at in range(close, -1, -1):
        if code[at] in ")]}":
            depth += 1
        elif code[at] in "([{":
            depth -= 1
            if depth == 0:
                return at
    return 0


def _closing(code: str, start: int) -> int:
    """Where the bracket open just before ``start`` closes (the end of ``code`` when it does not)."""
    depth = 0
    for at in range(start, len(code)):
        if code[at] in "([{":
            depth += 1
        elif code[at] in ")]}":
            if depth == 0:
                return at
            depth -= 1
    return len(code)


def _argument_count(source: str, start: int) -> int:
    """How many arguments the call whose ``(`` ends at ``start`` is given (commas at its own bracket depth)."""
    depth, count, empty = 0, 1, True
    for char in source[start:]:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return 0 if empty else count
            depth -= 1
        elif char == "," and depth == 0:
            count += 1
        if not char.isspace():
            empty = False
    return count


#: The names whose top-level fields rules are given only where they read them (:func:`rule_context`): the request
#: supplies them, a large body too.
_SELECTED_NAMES = ("subject", "state")
#: A field selected by name (``.path``), not a method called (``.path(``).
_SELECTED_FIELD = re.compile(r"\s*\.\s*([A-Za-z_]\w*)(?!\w|\s*\()")


def selected_fields(source: str, name: str) -> frozenset[str] | None:
    """The fields of ``name`` (``subject``, ``state``) a ``when`` reads when it reads ``name`` only as
    ``name.<field>`` (``has()`` of one too): ``subject.path == "/" && has(subject.body)`` gives
    ``{"path", "body"}``, a ``when`` that does not read ``name`` an empty set. ``None`` where it reads ``name`` any
    other way (``subject["path"]``, ``"path" in subject``, ``size(subject)``, a method called on it), or where the
    name follows a ``.``: then it reads the whole value. Text inside string literals and comments is not read."""
    code = _masked(source)
    fields = set()
    for found in re.finditer(rf"\b{name}\b", code):
        selected = _SELECTED_FIELD.match(code, found.end())
        if selected is None or code[: found.start()].rstrip().endswith("."):
            return None
        fields.add(selected.group(1))
    return frozenset(fields)


_READ_ROOT = re.compile(r"(?<![\w.])(state|data|flags|subject|call|result)(?![\w])")
_READ_STEP = re.compile(r"\s*(?:\.\s*([A-Za-z_]\w*)|\[\s*(\"[^\"\\]*\"|'[^'\\]*')\s*\])")


def field_reads(source: str) -> list[tuple[str, tuple[str, ...]]]:
    """The fixed paths a ``when`` reads under ``state``, ``data``, ``flags``, ``subject``, ``call`` and ``result``:
    ``state.user.name`` and ``data["limits"]`` give ``("state", ("user", "name"))`` and ``("data", ("limits",))``
    (a root read whole gives an empty path). A path ends before a method call
    (``state.text.matches(...)`` reads ``("text",)``) and at the first step that is not a name or a string literal;
    text inside string literals is not read, nor a name a macro binds (``x.exists(state, ...)``)."""
    strings = _literal_spans(source)
    bound = set(_BOUND_RE.findall(_code_only(source)))
    out = []
    for root in _READ_ROOT.finditer(source):
        if root.group(1) in bound or any(a <= root.start() < b for a, b in strings):
            continue
        path: list[str] = []
        at = root.end()
        while (step := _READ_STEP.match(source, at)) is not None:
            name = step.group(1) if step.group(1) is not None else step.group(2)[1:-1]
            if step.group(1) is not None and source[step.end() :].lstrip().startswith("("):
                break  # a method call on the value, not a field
            path.append(name)
            at = step.end()
        out.append((root.group(1), tuple(path)))
    return out


#: Most strings compiled at load as the patterns a rule may compute (:func:`rule_patterns`), each within
#: :data:`~guard.policy._re2.CANDIDATE_MAX_MEM`: 128 MiB of RE2 memory at most per rule.
MAX_CANDIDATE_PATTERNS = 32


def rule_patterns(source: str, data: Mapping[str, Any] | None = None) -> tuple[dict[str, Pattern], list[str]]:
    """The patterns a ``when`` gives ``.matches(...)``, compiled as the rule runs them
    (:func:`guard.policy._re2.compile_re2`): ``(pattern -> compiled, why each one that failed is not a pattern)``.

    A string literal that is a call's whole argument must compile (else the rule would fail on every request it
    reaches: an error). When some call's pattern is computed (``["a", "b"].exists(p, x.matches(p))``,
    ``data.patterns.exists(...)``), every other string literal of the rule and every string under the ``data``
    names it reads (at most :data:`MAX_CANDIDATE_PATTERNS` in all, each within a smaller memory budget) is
    compiled too where it compiles, so those are not compiled again on each request."""
    patterns: dict[str, Pattern] = {}
    errors = []
    calls = _matches_calls(source)
    for _, _, literal in calls:
        if literal is None:
            continue
        try:
            value = _cel(cel.evaluate, literal)
            patterns[value] = compile_re2(value)
        except (RuntimeError, ValueError) as exc:
            reason = " ".join(str(exc).split())
            errors.append(f"the pattern {literal} of matches() is {reason[:300]}")
    if all(literal is not None for _, _, literal in calls):
        return patterns, errors
    candidates = 0
    for candidate in _candidate_patterns(source, data or {}):
        if candidates == MAX_CANDIDATE_PATTERNS:
            break
        if candidate not in patterns:
            candidates += 1
            try:
                patterns[candidate] = compile_re2(candidate, max_mem=CANDIDATE_MAX_MEM)
            except ValueError:
                continue
    return patterns, errors


def _candidate_patterns(source: str, data: Mapping[str, Any]) -> Iterator[str]:
    """The strings a computed ``matches`` pattern may be: the rule's string literals, then every string under the
    ``data`` names it reads."""
    for a, b in _literal_spans(source):
        if not source.startswith("//", a):
            try:
                value = _cel(cel.evaluate, source[a:b])
            except (RuntimeError, ValueError):
                continue
            if isinstance(value, str):
                yield value
    stack = [data[path[0]] for root, path in field_reads(source) if root == "data" and path and path[0] in data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


_CMP = r"(==|!=|<=|>=|<|>)"
_NUMBER = r"(-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|data(?:\s*\.\s*[A-Za-z_]\w*)+)"
_MASKED_STRING = r"(\"\s*\"|'\s*')"  # a string literal once its text is blanked out (offsets kept)
# A comparison's operand is the whole of it only between these (no arithmetic or concatenation around it).
_START = r"(?:^|(?<=[(&|!?:,]))\s*"
_END = r"(?=\s*(?:$|[)&|?:,]))"
#: Answer fields that hold a probability, by question type (a score's level is checked against its levels).
_BOUNDED = {"noul": "noul|confidence", "choice": "confidence", "score": "confidence|score"}
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}


def _masked(source: str) -> str:
    """``source`` with every string literal's text and every comment replaced by spaces (same length, so offsets
    still match): a literal becomes its quote, spaces and its quote (``r"ab"`` -> ``␣"␣␣"``)."""

    def blank(found: re.Match[str]) -> str:
        text = found.group(0)
        if text.startswith("//"):
            return " " * len(text)
        start = min(i for i in (text.find('"'), text.find("'")) if i >= 0)
        return " " * start + text[start] + " " * (len(text) - start - 2) + text[start]

    return LITERAL_RE.sub(blank, source)


_CHAIN = re.compile(r"""(?<![\w.])(?:answers\s*\[\s*(?:"\s*"|'\s*')\s*\]"""
                    r"""|data(?:\s*\.\s*[A-Za-z_]\w*|\s*\[\s*(?:"\s*"|'\s*')\s*\])+)""")
_QUOTED_INDEX = re.compile(r"""\[\s*(?:"([A-Za-z_]\w*)"|'([A-Za-z_]\w*)')\s*\]""")


def _dotted(source: str, masked: str) -> tuple[str, str]:
    """``source`` and its :func:`_masked` form with a quoted name indexing ``answers``, or ``data`` or a step under
    it, written as a field and padded to the same length (``answers["queue"].choice`` ->
    ``answers.queue   .choice``, ``data['block']`` -> ``data.block   ``), so one pattern reads both spellings."""
    source_chars, masked_chars = list(source), list(masked)
    for chain in _CHAIN.finditer(masked):
        for index in _QUOTED_INDEX.finditer(source, chain.start(), chain.end()):
            name = index.group(1) or index.group(2)
            written = ("." + name).ljust(index.end() - index.start())
            source_chars[index.start() : index.end()] = masked_chars[index.start() : index.end()] = written
    return "".join(source_chars), "".join(masked_chars)


def _option_literals(masked: str, name: str) -> list[tuple[int, int]]:
    """Spans of the string literals a ``when`` compares ``name``'s choice with or indexes its probabilities by."""
    spans = [span for _, span in _compared_literals(masked, name + "choice")]
    spans += [m.span(1) for m in re.finditer(name + rf"probabilities\s*\[\s*{_MASKED_STRING}\s*\]", masked)]
    return spans


def _option_data(masked: str, name: str) -> list[tuple[int, int, bool]]:
    """Spans of the ``data`` names a ``when`` compares ``name``'s choice with (``==``, ``!=``: ``data.route``) or
    indexes its probabilities by, each with ``False``, and those it looks the choice up in (``in``: ``data.routes``),
    with ``True``."""
    data, choice = r"(data(?:\s*\.\s*[A-Za-z_]\w*)+)", name + "choice"
    patterns = ((_START + choice + rf"\s*(?:==|!=)\s*{data}" + _END, False),
                (_START + data + rf"\s*(?:==|!=)\s*{choice}" + _END, False),
                (name + rf"probabilities\s*\[\s*{data}\s*\]", False),
                (_START + choice + rf"\s+in\s+{data}" + _END, True))
    return [(*m.span(1), many) for pattern, many in patterns for m in re.finditer(pattern, masked)]


_AFFIX_CALLS = ("startsWith", "endsWith", "contains")


def _compared_literals(masked: str, operand: str, *, calls: bool = False) -> list[tuple[str, tuple[int, int]]]:
    """The string literals a ``when`` (:func:`_masked`) compares ``operand`` (a pattern of the whole operand) with,
    each with how: ``"=="`` (``==`` or ``!=`` on either side, or one of an ``in [...]`` list) and, with ``calls``,
    the method of :data:`_AFFIX_CALLS` whose whole argument it is (``operand.startsWith("x")``)."""
    found = []
    for pattern in (_START + operand + rf"\s*(?:==|!=)\s*{_MASKED_STRING}" + _END,
                    _START + rf"{_MASKED_STRING}\s*(?:==|!=)\s*" + operand + _END):
        found += [("==", m.span(1)) for m in re.finditer(pattern, masked)]
    for listed in re.finditer(_START + operand + r"\s+in\s*\[([^\]]*)\]" + _END, masked):
        offset = listed.start(1)
        found += [("==", (offset + m.start(), offset + m.end())) for m in re.finditer(_MASKED_STRING, listed.group(1))]
    if calls:
        call = rf"(?<![\w.]){operand}\s*\.\s*({'|'.join(_AFFIX_CALLS)})\s*\(\s*{_MASKED_STRING}\s*\)"
        found += [(m.group(1), m.span(2)) for m in re.finditer(call, masked)]
    return found


#: What guard's subjects always hold in these fields (and a state field read from the source of the same name):
#: ``upper``-case text, a value as the middleware normalises it (``host``: :func:`~guard._headers.host_name`,
#: ``media type``: :func:`~guard._headers.media_type`), or one of a few values.
FIXED_VALUES: dict[str, str | tuple[str, ...]] = {
    "method": "upper",
    "content_type": "media type",
    "host": "host",
    "event": get_args(AgentEvent),
    "tool_effect": get_args(ToolEffect),
}
_HOW_SAID = {"==": "is", "startsWith": "starts with", "endsWith": "ends with", "contains": "contains"}


def _normalised(values: str, value: str) -> tuple[str, str]:
    """What a field of kind ``values`` (:data:`FIXED_VALUES`: ``"host"`` or ``"media type"``) holds for a request
    that sends ``value``, and how that differs from ``value`` (``"has no port"``, ``"is lower-case"``)."""
    written = value.strip()
    if values == "host":
        normal = host_name(value)
        lowered = written.lower()
        bracketed = lowered.startswith("[")
        port = lowered != normal if bracketed else lowered.count(":") == 1
        unported = lowered.rsplit(":", 1)[0] if port else lowered
        differs = [(written != value, "has no surrounding spaces"), (lowered != written, "is lower-case"),
                   (port, "has no port"), (not bracketed and unported.endswith("."), "has no trailing dot")]
    else:
        normal = media_type(value)
        typed = value.partition(";")[0]
        differs = [(typed.strip() != typed, "has no surrounding spaces"), (typed.lower() != typed, "is lower-case"),
                   (";" in value, "has no parameters")]
    return normal, ", ".join(why for holds, why in differs if holds)


def fixed_value_errors(source: str, state_sources: Mapping[tuple[str, ...], str] | None = None) -> list[str]:
    """String literals a ``when`` compares (``==``, ``!=``, ``in [...]``, ``startsWith``, ``endsWith``,
    ``contains``) with a value guard normalises or takes from a fixed set (:data:`FIXED_VALUES`), which no request
    or agent event ever matches: ``subject.method == "post"`` (methods are upper-case), ``subject.host ==
    "API.example.com"``, ``"api.example.com:8443"`` or ``"api.example.com."`` (lower-case, without port or trailing
    dot), ``subject.content_type == "application/json; charset=utf-8"`` (the media type alone, lower-case),
    ``subject.event == "toolcall"``, ``call.effect`` and ``subject.tool_effect == "sideeffecting"`` (fixed names),
    and the same for a state field read from one of those sources (``state_sources``: a state field's path,
    ``("m",)`` for ``state.m``, to its source). A literal compared whole (``==``, ``!=``, ``in``) with a host or
    content type is refused when it is not what the normaliser makes of it; one given to ``startsWith``,
    ``endsWith`` or ``contains`` only when it is not lower-case (``startsWith("application/")`` loads). Each error
    says what to write. A literal with an escape is not checked."""
    masked = _masked(source)
    operands = [(f"subject.{name}", ("subject", name), name) for name in FIXED_VALUES]
    operands.append(("call.effect", ("call", "effect"), "tool_effect"))
    operands += [("state." + ".".join(path), ("state", *path), source_name)
                 for path, source_name in (state_sources or {}).items() if source_name in FIXED_VALUES]
    out = []
    for shown, steps, kind in operands:
        operand = r"(?<![\w.])" + r"\s*\.\s*".join(re.escape(step) for step in steps) + r"(?![\w])"
        for how, (start, end) in _compared_literals(masked, operand, calls=True):
            value = source[start + 1 : end - 1]
            if "\\" in value:
                continue
            values = FIXED_VALUES[kind]
            said = f"compares {shown} with {source[start:end]}, which it never {_HOW_SAID[how]}"
            if values == "upper" and value != value.upper():
                out.append(f"{said}: {shown} is upper-case; write {value.upper()!r}")
            elif values in ("host", "media type") and how == "==" and value != _normalised(values, value)[0]:
                normal, why = _normalised(values, value)
                out.append(f"{said}: {shown} {why}; write {normal!r}")
            elif values in ("host", "media type") and how != "==" and value != value.lower():
                out.append(f"{said}: {shown} is lower-case; write {value.lower()!r}")
            elif isinstance(values, tuple) and not any(_holds(how, one, value) for one in values):
                out.append(f"{said}: {shown} is one of {', '.join(values)}; check the spelling")
    return out


def _holds(how: str, value: str, literal: str) -> bool:
    """Whether ``value`` ``how`` (:func:`_compared_literals`) ``literal``."""
    if how == "==":
        return value == literal
    if how == "contains":
        return literal in value
    return value.startswith(literal) if how == "startsWith" else value.endswith(literal)


def _padded(dotted: str, end: int) -> int:
    """Where a span of a :func:`_dotted` text ending at ``end`` ends in the text as written (past the padding)."""
    return len(dotted) - len(dotted[end:].lstrip(" "))


def answer_literal_errors(source: str, questions: Mapping[str, QuestionV1], data: Mapping[str, Any]) -> list[str]:
    """Comparisons in a ``when`` that never hold, or always do, because a literal names what the question's answer
    never is: an option id it does not have (``queue.choice == "biling"``, ``queue.choice in ["tech", "biling"]``,
    ``queue.probabilities["biling"]``, or one a ``data`` name holds: ``queue.choice in data.routes``), or a bound
    outside what a probability, confidence or score level can be (``injection.noul > 1.0``, ``injection.noul >=
    data.block_threshold`` with ``block_threshold: 85`` or ``>= data.thresholds.block`` with ``thresholds: {block:
    85}``, ``severity.score >= 7`` with five levels). A question read through ``answers`` (``answers.queue.choice``,
    ``answers["queue"]``) and a ``data`` name indexed by a quoted name (``data["block_threshold"]``) are read too. A
    literal bound that always holds (``x.noul <= 1.0`` closing a band) is redundant, not reported; one from
    ``data`` is. Only a comparison that stands alone is read (``2 * x.noul > 1.5`` is not). ``data``: the file's
    ``data``."""
    written = source
    source, masked = _dotted(source, _masked(source))
    out: list[str] = []
    for key, question in questions.items():
        options = question.option_ids()
        name = rf"(?:(?<![\w.])answers\s*\.\s*|(?<![\w.])){re.escape(key)}\s*\.\s*"
        listed = ", ".join(shown_id(option, quoted=False) for option in options)
        for start, end in _option_literals(masked, name):
            value = source[start + 1 : end - 1]
            if "\\" not in value and value not in options:  # a literal with an escape is not checked
                out.append(f"{key} has no option {shown_id(value)} (its options: {listed}); check the spelling")
        for start, end, many in _option_data(masked, name):
            value = data_value(data, [part.strip() for part in masked[start:end].split(".")[1:]])
            # a value of the wrong type (a list after ==, a string after in) fails anyway: rule_check says why;
            # a list a file's policies share may hold other questions' options, so it is refused only when it holds
            # none of this one's (the rule never fires)
            shown = written[start : _padded(source, end)].replace(" ", "")
            if many and isinstance(value, list):
                strings = [option for option in value if isinstance(option, str)]
                if strings and not any(option in options for option in strings):
                    out.append(f"{key} has none of the options {shown} holds (its options: {listed}); check the "
                               "spelling")
            elif not many and isinstance(value, str) and value not in options:
                out.append(f"{key} has no option {shown_id(value)} (its options: {listed}), which {shown} holds; "
                           "check the spelling")
        fields = rf"({_BOUNDED[question.type]}|probabilities\s*\[\s*(?:\"\s*\"|'\s*')\s*\])"
        for forward, pattern in ((True, _START + name + fields + rf"\s*{_CMP}\s*{_NUMBER}" + _END),
                                 (False, _START + _NUMBER + rf"\s*{_CMP}\s*" + name + fields + _END)):
            for m in re.finditer(pattern, masked):
                field, number = (m.group(1), m.group(3)) if forward else (m.group(3), m.group(1))
                field = field.split("[")[0].strip()
                if number.startswith("data"):
                    value = data_value(data, [part.strip() for part in number.split(".")[1:]])
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        continue
                    at = m.span(3) if forward else m.span(1)
                    shown = f" ({written[at[0] : _padded(source, at[1])].replace(' ', '')} is {value})"
                else:
                    value, shown = float(number), ""
                high = len(options) - 1 if field == "score" else 1
                compare = _COMPARE[m.group(2)]
                # a score is the expected level, a number from 0 to the last level like a probability's [0, 1]: the
                # ends, the middle and either side of the bound cover every way a bound can cut the range
                answers = {0.0, high / 2, float(high), *(min(max(value + d, 0.0), high) for d in (-1e-9, 0.0, 1e-9))}
                seen = {compare(answer, value) if forward else compare(value, answer) for answer in answers}
                if seen == {True} and not shown:  # a literal bound that always holds (x.noul <= 1.0 in a band)
                    continue  # is redundant, not wrong; from data (a threshold in the wrong unit) it is a mistake
                if len(seen) == 1:
                    what = "an expected level" if field == "score" else "a confidence" if field == "confidence" \
                        else "a probability"
                    out.append(f"{written[m.start() : _padded(source, m.end())].strip()!r} is always {'true' if seen.pop() else 'false'}"
                               f"{shown}: {key}.{field} is {what} from 0 to {high}")
    return out


_HEADER_MAPS = ("headers", "repeated_headers")
_IN_HEADERS = re.compile(rf"{_MASKED_STRING}\s*in\s*subject\s*\.\s*({'|'.join(_HEADER_MAPS)})(?![\w.\[])")


def header_name_errors(source: str) -> list[str]:
    """Header names a ``when`` reads with upper-case letters, which no request has: ``subject.headers`` and
    ``subject.repeated_headers`` hold names lower-cased, so ``subject.headers["X-Tier"]`` fails on every request (a
    missing key) and ``"X-Tier" in subject.headers`` never holds; or spelled with ``_`` (``subject.headers.x_tier``),
    which guard reads as a copy of the ``-`` name (a WSGI server reads both alike) and ``guard proxy`` never
    forwards. Each error says the name to write."""
    out = []
    reads = [(path[0], path[1]) for root, path in field_reads(source) if root == "subject" and len(path) > 1]
    masked = _masked(source)
    for found in _IN_HEADERS.finditer(masked):
        start, end = found.span(1)
        if "\\" not in source[start:end]:  # a literal with an escape is not checked
            reads.append((found.group(2), source[start + 1 : end - 1]))
    for where, name in reads:
        written = name.lower().replace("_", "-")
        if where in _HEADER_MAPS and name != name.lower():
            out.append(f"reads the header {name!r} of subject.{where}, whose names are lower-case: no request has "
                       f"it; write {written!r}")
        elif where in _HEADER_MAPS and "_" in name:
            out.append(f"reads the header {name!r} of subject.{where}, spelled with '_', which guard reads as a copy "
                       f"of {written!r} and guard proxy never forwards; write {written!r}")
    return out


def data_value(data: Mapping[str, Any], path: Sequence[str]) -> Any:
    """The value at ``path`` (``["thresholds", "block"]`` for ``data.thresholds.block``) in a file's ``data``;
    ``None`` where a step is missing or not a mapping."""
    value: Any = data
    for name in path:
        value = value.get(name) if isinstance(value, Mapping) else None
    return value


def answer_variables(answer: AnswerV1) -> dict[str, Any]:
    """The CEL object for one answer: ``{type, noul | choice | score, confidence, probabilities}``."""
    out: dict[str, Any] = {"type": answer.type, "probabilities": dict(answer.probabilities)}
    if answer.type == "noul":
        out["noul"] = answer.noul
    elif answer.type == "choice":
        out["choice"] = answer.choice
        out["confidence"] = answer.confidence
    else:
        out["score"] = answer.score
        out["confidence"] = answer.confidence
    return out


def subject_fields(subject_type: Any) -> list[str]:
    """The fields of a subject (an instance or its class) that rules read as ``subject.<name>``: every field but an
    agent subject's ``history``, which rules read through ``call``, a streamed response's ``deltas``, whose
    joined text rules read in ``body_text``, an HTTP subject's ``form_string``, kept only for some forms (rules
    read the form in ``body``), and its ``sent_path``, kept only where ``path`` is a view of it (rules read
    ``path``)."""
    return [f.name for f in dataclasses.fields(subject_type)
            if f.name not in ("history", "deltas", "form_string", "sent_path")]


def subject_variables(subject: Any, only: frozenset[str] | None = None) -> dict[str, Any]:
    """The subject's fields (:func:`subject_fields`; of those, the ones in ``only`` where given) as a plain mapping
    for CEL (``None`` fields kept as ``null``)."""
    return {name: getattr(subject, name) for name in subject_fields(subject) if only is None or name in only}


def rule_inputs(rules: tuple[CompiledRule, ...]) -> frozenset[str]:
    """Every top-level name some rule's ``when`` reads (question keys and :data:`RESERVED_NAMES`)."""
    return frozenset().union(*(rule.names for rule in rules))


def apply_rules(
    policy_id: str,
    rules: tuple[CompiledRule, ...],
    default: Outcome,
    answers: Mapping[str, AnswerV1],
    *,
    subject: Any = None,
    state: Any = None,
    flags: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    features: Mapping[str, Any] | None = None,
) -> RuleResult:
    """Apply ordered rules to a policy's answers: a pure function of its arguments.

    Args:
        policy_id: for error messages.
        rules: the compiled rules, in order.
        default: the outcome when no rule fires.
        answers: question key -> answer.
        subject: the subject (a dataclass) or ``None``.
        state: the rendered state as received (``Policy.render_state``: not normalised, not cut).
        flags: the state's flags; missing names in :data:`FLAG_NAMES` read as 0.
        data: the file's ``data`` block.
        features: values of :data:`FEATURE_NAMES` (``call``, ``result``); a name missing here reads as ``{}``.

    Returns:
        The first rule whose ``when`` is true, or ``RuleResult("default", default)``.

    Raises:
        RuleError: when a ``when`` fails or does not return a boolean.
    """
    if not rules:
        return RuleResult("default", default)
    context = rule_context(rules, answers, subject, state, flags, data, features)
    for rule in rules:
        if run_rule(policy_id, rule, context):
            return RuleResult(rule.id, rule.outcome)
    return RuleResult("default", default)


def trace_rules(
    policy_id: str,
    rules: tuple[CompiledRule, ...],
    answers: Mapping[str, AnswerV1],
    *,
    subject: Any = None,
    state: Any = None,
    flags: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    features: Mapping[str, Any] | None = None,
) -> list[tuple[str, bool | str]]:
    """Every rule's ``when`` value (or its error text, values included: a local tool), in order, for
    ``guard policy explain``."""
    context = rule_context(rules, answers, subject, state, flags, data, features)
    out: list[tuple[str, bool | str]] = []
    for rule in rules:
        try:
            out.append((rule.id, run_rule(policy_id, rule, context)))
        except RuleError as exc:
            out.append((rule.id, exc.detail))
    return out


def rule_context(
    rules: tuple[CompiledRule, ...],
    answers: Mapping[str, AnswerV1],
    subject: Any,
    state: Any,
    flags: Mapping[str, Any] | None,
    data: Mapping[str, Any] | None,
    features: Mapping[str, Any] | None = None,
) -> Any:
    # Converting values into CEL costs ~10-30 us per object, so only the names some rule reads are passed.
    needed = rule_inputs(rules)
    answer_objects = {
        key: answer_variables(answer) for key, answer in answers.items() if key in needed or "answers" in needed
    }
    variables: dict[str, Any] = {key: value for key, value in answer_objects.items() if key in needed}
    if "answers" in needed:
        variables["answers"] = answer_objects
    if "flags" in needed:
        variables["flags"] = dict.fromkeys(FLAG_NAMES, 0) | dict(flags or {})
    if "data" in needed:
        variables["data"] = dict(data or {})
    # of the state and the subject, only the fields the rules select by name (a large body no rule reads is not
    # converted), unless some rule reads it another way
    if "state" in needed:
        reads = _selected(rules, "state")
        variables["state"] = state if reads is None or not isinstance(state, Mapping) else \
            {key: value for key, value in state.items() if key in reads}
    if "subject" in needed:
        reads = _selected(rules, "subject")
        if subject is None:
            variables["subject"] = {}
        elif isinstance(subject, Mapping):  # the sample subjects of a load-time check (guard/policy/rule_check.py)
            variables["subject"] = subject if reads is None else {k: v for k, v in subject.items() if k in reads}
        else:
            variables["subject"] = subject_variables(subject, reads)
    for name in FEATURE_NAMES & needed:
        variables[name] = dict((features or {}).get(name) or {})
    functions = FUNCTIONS | {_MATCHES: matcher({p: c for rule in rules for p, c in rule.patterns.items()}), _SIZE: len}
    negates = any("-" in rule.source and _NEGATION.search(_masked(rule.source)) for rule in rules)
    if not (negates and _holds_smallest_int(variables)):
        try:
            return cel.Context(variables=variables, functions=functions)
        except ValueError:  # a value CEL cannot hold (an integer past a double's range, a lone surrogate): rules
            pass  # still read the rest
    return cel.Context(variables=_representable(variables), functions=functions)


def _selected(rules: tuple[CompiledRule, ...], name: str) -> frozenset[str] | None:
    """The fields of ``name`` the rules read (:attr:`CompiledRule.selected`); ``None`` where one reads it whole."""
    reads = [rule.selected[name] for rule in rules]
    return None if None in reads else frozenset().union(*reads)


def _holds_smallest_int(value: Any) -> bool:
    """Whether ``value`` (a mapping's values, a list's items, all the way down) holds the integer
    :data:`_SMALLEST_INT`."""
    if isinstance(value, dict):
        return any(_holds_smallest_int(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_smallest_int(item) for item in value)
    return type(value) is int and value == _SMALLEST_INT


#: Values the CEL runtime holds as they are, besides the strings, integers, maps and lists :func:`_representable`
#: walks.
_CEL_SCALARS = (bool, float, bytes, bytearray, memoryview, decimal.Decimal, datetime.datetime, datetime.timedelta,
                type(None))
#: The integers a CEL map key may be (``int`` or ``uint``).
_CEL_INT_KEYS = range(-(2**63), 2**64)


def _representable(value: Any) -> Any:
    """``value`` with what CEL cannot hold replaced, so a client's value cannot make every rule that reads ``state``
    (or ``subject``, ``call``) fail and so choose the policy's fail mode: every integer too large for a double (CEL
    turns integers past 64 bits into doubles) becomes an infinity of its sign, and comparisons with it still hold
    (``state.n > 5``); :data:`_SMALLEST_INT` becomes the double of its value (a rule's ``-x`` of it is then
    positive); in every string, map keys included, a UTF-16 surrogate pair is joined into its character and a lone
    surrogate (a non-UTF-8 file name from ``os.fsdecode``) becomes U+FFFD, as the normaliser makes it (flag
    ``lone_surrogates``). A map key CEL cannot hold (:func:`_map_key`) becomes a string; keys that become one are
    all kept, the second as ``"name (2)"`` and so on, as the normaliser keeps them (:func:`unique_key`); a set or frozenset becomes
    a list in sorted order (by ``repr`` where its items do not compare), a tuple a list, and any other value CEL
    cannot hold (a complex number, a date, an application's object) its ``str()``."""
    if isinstance(value, str):
        return surrogates_joined(value)
    if isinstance(value, _CEL_SCALARS):
        return value
    if isinstance(value, int):
        if value == _SMALLEST_INT:
            return float(value)
        return value if abs(value) <= _LARGEST_DOUBLE else (math.inf if value > 0 else -math.inf)
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        seen: dict[Any, int] = {}
        for key, item in value.items():
            out[unique_key(_map_key(key), out, seen)] = _representable(item)
        return out
    if isinstance(value, set | frozenset):
        try:
            items = sorted(value)
        except TypeError:
            items = sorted(value, key=repr)
        return [_representable(item) for item in items]
    if isinstance(value, list | tuple):
        return [_representable(item) for item in value]
    return str(value)


def _map_key(key: Any) -> Any:
    """A map key as CEL holds it: a string (surrogates joined as in :func:`_representable`), a bool or a 64-bit
    integer as it is; any other key (a double, ``None``, a tuple, bytes, a larger integer) becomes its text, ``None``
    written ``"null"`` as JSON writes it."""
    if isinstance(key, str):
        return surrogates_joined(key)
    if isinstance(key, bool) or (isinstance(key, int) and key in _CEL_INT_KEYS):
        return key
    return "null" if key is None else str(key)


def run_rule(policy_id: str, rule: CompiledRule, context: Any) -> bool:
    try:
        result = rule.program.execute(context)
    except Exception as exc:  # the CEL runtime raises KeyError, TypeError, ValueError, RuntimeError
        detail = f"{type(exc).__name__}: {exc}".replace(_MATCHES, "matches")
        raise RuleError(policy_id, rule.id, _failure_kind(exc, rule.source), detail) from exc
    if not isinstance(result, bool):
        raise RuleError(policy_id, rule.id, f"'when' returned {type(result).__name__}, not a boolean",
                        f"'when' returned {type(result).__name__} {result!r}, not a boolean")
    return result


_CEL_FUNCTION_ERROR = re.compile(r"Function '(\w+)' error")
# CEL messages that hold no value: kept as they are, up to the first period.
_CEL_FIXED_MESSAGES = ("No such overload", "division by zero", "modulus by zero")


def _failure_kind(exc: Exception, source: str) -> str:
    """What failed in a rule, without the values the runtime quotes (a map key, a function's argument): the
    exception's type, and the key when the rule's own text names it (``state.meta.tier``: ``KeyError: 'tier'``),
    the function that failed (``duration``), or a CEL message that quotes nothing (``No such overload``)."""
    kind = type(exc).__name__
    if isinstance(exc, KeyError):
        key = exc.args[0] if exc.args else None
        if isinstance(key, str) and _names_key(source, key):
            return f"{kind}: {key!r}"  # a key written in the policy, not one the request supplied
        return f"{kind}: no such key"
    text = str(exc)
    function = _CEL_FUNCTION_ERROR.match(text)
    if function:
        name = "matches" if function.group(1) == _MATCHES else function.group(1)
        return f"{kind}: function {name!r} failed on its arguments"
    if text.startswith(_CEL_FIXED_MESSAGES):
        return f"{kind}: {text.split('.', 1)[0]}"
    if isinstance(exc, IndexError):
        return f"{kind}: index out of bounds"
    return kind


def _names_key(source: str, key: str) -> bool:
    """Whether a rule's text names ``key``: as a field (``.tier``) or a quoted string (``["x-tenant"]``)."""
    if f'"{key}"' in source or f"'{key}'" in source:
        return True
    return _IDENTIFIER.fullmatch(key) is not None and re.search(rf"\.\s*{key}\b", source) is not None
