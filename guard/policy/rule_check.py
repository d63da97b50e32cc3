"""Find rules that fail on every request because of the types of what they read (``state.text > 5``: a string
compared with a number; ``subject.path`` as a condition; ``sqli(state.status)``).

A rule's ``state.`` and ``subject.`` values come from a request, but their JSON types mostly do not: ``path`` and
``body_text`` are strings, ``status`` an integer or null, a header a string or null when absent, a query parameter
read with ``repeated: list`` a list of strings. For a rule whose every read has such a known type, the rule is run
once per combination of those types (a sample value of each: ``"x"``, ``1``, ``null``, ``["x"]``), on even answers,
zero flags and the file's ``data``. When every run fails with a type error (CEL's "No such overload", a method
the value's type does not have, a guard function given the wrong type) or returns a non-boolean, the rule cannot
work on any request and is refused at load. A rule reading a value whose type the request picks (``body``, a JSON
pointer into it, tool arguments and results, ``call``, ``result``) is not run, nor one with more than
:data:`MAX_RUNS` combinations; failures that depend on a value (a missing key, ``int("x")``) are not counted.
The same runs find an ``==``, ``!=`` or ``in`` between values of two types (``inj.noul == "0.9"``,
``subject.query.tier == "free"``), which the runtime answers with ``false`` (``true`` for ``!=``), not an error: the
rule never fires, or always does, and is refused too. So is an ordering of one answer's ``noul`` or ``score`` with
``data`` and constants that holds for no value of the field (``inj.noul * 1.0 >= data.t`` with ``t: 85``), run alone
over the field's range (:func:`_constant`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import logging
import math
import re
import types
import typing
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import cel

from guard.policy._compare import RECORD, Comparison, instrumented
from guard.policy._state import HTTP_SOURCES, NAMED_SOURCES, StateField
from guard.policy.rules import (
    FEATURE_NAMES,
    LITERAL_RE,
    CompiledRule,
    RuleError,
    _cel,
    data_value,
    field_reads,
    rule_context,
    run_rule,
    subject_fields,
)
from guard.subject import AgentSubject, HttpSubject
from guard.systemone import QuestionV1, answer_question

__all__ = ["MAX_RUNS", "SOURCE_TYPES", "certain_failures", "state_type", "subject_type"]

#: The most type combinations one rule is run with; a rule with more is not checked.
MAX_RUNS = 64
#: The longest rewritten ``when`` (:func:`~guard.policy._compare.instrumented`) :func:`_mismatched` compiles: the
#: rewriting repeats the left operand of each comparison, so a chain of them grows with its square
#: (``a == a == true ...``: 1,620 characters became 173,566), and the CEL runtime panics on a syntax error past
#: column 65,535 (its parser refuses ~96 nested brackets); a longer one is not checked.
_MAX_REWRITTEN = 60_000
_UNDEFINED = re.compile(r"Undefined variable or function: '(\w+)'")
_CHECKING = contextvars.ContextVar("guard_rule_check", default=False)


class _QuietWhileChecking(logging.Filter):
    """Drops the CEL runtime's warning that one of guard's functions failed (``sqli`` given an int) while
    :func:`certain_failures` runs rules on sample values, where such failures are what it looks for."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _CHECKING.get()


logging.getLogger("cel").addFilter(_QuietWhileChecking())


@dataclass(frozen=True)
class _Fields:
    """An object with known field names: name -> the field's type."""

    fields: Mapping[str, _Type]


@dataclass(frozen=True)
class _MapOf:
    """An object whose keys the request chooses, each value of one type (headers, query parameters)."""

    value: _Type


#: A type: its alternatives (a sample value, :class:`_Fields` or :class:`_MapOf`), or ``None`` when the request picks
#: it (any JSON value).
_Type = tuple[Any, ...] | None
_SAMPLES: dict[Any, Any] = {str: "x", int: 1, float: 1.5, bool: True, type(None): None}
_NAMES = {str: "string", int: "int", float: "double", bool: "bool", type(None): "null", list: "list", dict: "map"}

#: The type of a named source's value (a header or form field given by name; query parameters are typed by their
#: ``repeated``), before the field's ``default`` replaces a missing one; ``None``: the request picks it.
SOURCE_TYPES: dict[str, _Type] = {
    "header": ("x", None),  # a repeated header is joined into one string or refused
    "form": None,  # a form is the body's object: a JSON body's values are any JSON
}


def _hint_type(hint: Any) -> _Type:
    """A Python type annotation of a subject attribute as a :data:`_Type`; ``None`` for ``Any`` and other types
    rules cannot compare (the history of turns)."""
    origin = typing.get_origin(hint)
    if hint in _SAMPLES:
        return (_SAMPLES[hint],)
    if origin is Literal:
        return (hint.__args__[0],)  # a string (or int) like every other value of the literal
    if origin in (types.UnionType, typing.Union):
        parts = [_hint_type(arg) for arg in typing.get_args(hint)]
        return None if any(part is None for part in parts) else tuple(itertools.chain(*parts))  # type: ignore[arg-type]
    if origin is dict:
        value = _hint_type(typing.get_args(hint)[1])
        return None if value is None else (_MapOf(value),)
    if origin in (list, tuple):
        item = _hint_type(typing.get_args(hint)[0])
        return None if item is None or not all(_plain(alt) for alt in item) else ([item[0]],)
    return None


def _plain(sample: Any) -> bool:
    return not isinstance(sample, _Fields | _MapOf)


@functools.cache  # typing.get_type_hints resolves every annotation of the class again on each call
def _attribute_type(cls: type, name: str) -> _Type:
    """The type of attribute ``name`` of a subject class: a field's annotation or a property's return annotation
    (computed once per class and name; callers do not change it)."""
    hints = typing.get_type_hints(cls)
    if name in hints:
        return _hint_type(hints[name])
    member = getattr(cls, name, None)
    if isinstance(member, property) and member.fget is not None:
        return _hint_type(typing.get_type_hints(member.fget).get("return"))
    return None


@functools.cache
def subject_type(cls: type) -> _Type:
    """What rules read as ``subject`` for a subject class: its fields (:func:`guard.policy.rules.subject_fields`);
    computed once per class, callers do not change it."""
    return (_Fields({name: _attribute_type(cls, name) for name in subject_fields(cls)}),)


def state_type(fields: tuple[StateField, ...], kinds: Collection[type]) -> _Type:
    """The type of the raw state rendered from ``fields`` for the subject classes ``kinds``: a source of one kind of
    subject (``path`` of an HTTP request) reads as missing, so as its ``default``, for another; with no ``kinds``
    each source is read from its own kind (a default state, rendered only for the subjects it is the default of)."""
    return (_Fields({field.name: _field_type(field, kinds) for field in fields}),)


def _field_type(field: StateField, kinds: Collection[type]) -> _Type:
    if field.children is not None:
        return state_type(field.children, kinds)
    if field.source is None:
        return (field.const,)
    if field.pointer:
        return None
    cls = HttpSubject if field.source in HTTP_SOURCES else AgentSubject
    if field.source == "query":
        found = (_MapOf((["x"],)),) if field.key is None else (["x"], None) if field.repeated == "list" else ("x", None)
    elif field.source in NAMED_SOURCES:
        found = SOURCE_TYPES[field.source]
    else:
        found = _attribute_type(cls, field.source)
    if found is None:
        return None
    if any(kind is not cls for kind in kinds):
        found = (*found, None)  # the other kind of subject has no such source
    if None not in found:
        return found
    present = tuple(alt for alt in found if alt is not None)
    return (*present, field.default) if field.default is not None else found  # a missing value reads as the default


def _samples(kind: _Type, paths: list[tuple[str, ...]]) -> list[Any] | None:
    """Sample values of ``kind`` for a rule reading ``paths`` under it (``()``: the value whole): one per
    combination of the alternatives along the read paths. An object holds only the fields read (one the rule reads
    where :func:`~guard.policy.rules.field_reads` did not see it is then a missing key, not a wrong type). ``None``
    when a read path meets a type the request picks or there are more than :data:`MAX_RUNS` combinations."""
    if kind is None:
        return None
    out: list[Any] = []
    for alt in kind:
        if isinstance(alt, _Fields | _MapOf):
            fields = alt.fields if isinstance(alt, _Fields) else dict.fromkeys((p[0] for p in paths if p), alt.value)
            names = fields if () in paths else {p[0] for p in paths if p and p[0] in fields}
            parts = {}
            for name in names:
                found = _samples(fields[name], [p[1:] for p in paths if p[:1] == (name,)] or [()])
                if found is None:
                    return None
                parts[name] = found
            if len(out) + math.prod(map(len, parts.values())) > MAX_RUNS:
                return None
            out.extend(_combinations(parts))
        else:
            out.append(alt)
            if len(out) > MAX_RUNS:
                return None
    return out


def _combinations(parts: Mapping[str, list[Any]]) -> Iterator[dict[str, Any]]:
    for values in itertools.product(*parts.values()):
        yield dict(zip(parts, values, strict=True))


def _type_name(value: Any) -> str:
    return _NAMES.get(type(value), type(value).__name__)


def certain_failures(
    policy_id: str,
    rules: tuple[CompiledRule, ...],
    questions: Mapping[str, QuestionV1],
    data: Mapping[str, Any] | None,
    *,
    state: _Type,
    subject: _Type,
) -> dict[str, str]:
    """Rule id -> why its ``when`` fails on every request, or why one of its comparisons never holds, for the
    rules that can be run before a request.

    A rule that reads nothing of a request (only answers, ``answers``, ``flags`` and ``data``) is run once, on even
    answers (each option of each question equally likely) and zero flags: any failure (a quoted threshold
    ``"0.85"`` compared with a probability) is one on every request. A rule whose ``state.``/``subject.`` reads
    all have known types (``state``, ``subject``: :func:`state_type`, :func:`subject_type`; alternatives for a
    policy matching several kinds of subject) is run once per combination of those types and fails on every
    request when every run ends in a type error or a non-boolean (:func:`_type_error`). A rule that works is
    refused when one of its comparisons compares values of two types in some run and of one type in none
    (:func:`_mismatched`). Rules reading ``call`` or ``result`` are not run. Any rule is refused when an ordering
    of one answer's field with ``data`` and constants holds for no value of the field (:func:`_constant`).
    """
    answers = {key: answer_question(q, [1 / len(q.options())] * len(q.options())) for key, q in questions.items()}
    roots = {"state": state, "subject": subject}
    failures: dict[str, str] = {}
    points: dict[tuple[str, str, float], Any] = {}  # the contexts _constant runs orderings in, shared by the rules
    checking = _CHECKING.set(True)
    try:
        for rule in rules:
            rewritten = instrumented(rule.source)
            found = (_certain_failure(policy_id, rule, rewritten, roots, answers, data)
                     or _constant(rewritten[1] if rewritten is not None else (), questions, data, points))
            if found is not None:
                failures[rule.id] = found
    finally:
        _CHECKING.reset(checking)
    return failures


def _certain_failure(
    policy_id: str,
    rule: CompiledRule,
    rewritten: tuple[str, tuple[Comparison, ...]] | None,
    roots: Mapping[str, _Type],
    answers: Mapping[str, Any],
    data: Any,
) -> str | None:
    """Why ``rule`` fails on every request (:func:`certain_failures`), or why one of its comparisons never holds
    (:func:`_mismatched`, given ``rewritten``: :func:`~guard.policy._compare.instrumented` of its ``when``), or
    ``None``."""
    if rule.names & FEATURE_NAMES:
        return None
    reads = {root: [path for name, path in field_reads(rule.source) if name == root] for root in roots}
    if any(root in rule.names and not reads[root] for root in roots):
        return None  # a read the text scan did not see: what it reads is not known
    samples = {root: _samples(kind, reads[root]) if root in rule.names else [{}] for root, kind in roots.items()}
    if samples["state"] is None or samples["subject"] is None:
        return None
    runs = list(itertools.product(samples["state"], samples["subject"]))
    if len(runs) > MAX_RUNS:
        return None
    contexts = [rule_context((rule,), answers, subject, state, None, data) for state, subject in runs]
    errors: list[RuleError] = []
    for context in contexts:
        try:
            run_rule(policy_id, rule, context)
        except RuleError as exc:
            errors.append(exc)
    if errors and len(errors) == len(runs):
        if not rule.names & roots.keys():  # no request read: it fails the same way on every request
            return f"fails on every request: {errors[0].detail}"
        if all(_type_error(exc) for exc in errors):
            return f"fails on the types it reads ({_described(reads, runs)}): {_first_sentence(errors[0])}"
        if all(isinstance(exc.__cause__, ZeroDivisionError) for exc in errors):  # by a constant zero, whatever is read
            return f"divides by zero on every request ({_described(reads, runs)}): {_first_sentence(errors[0])}"
    return _mismatched(rewritten, contexts)


def _mismatched(rewritten: tuple[str, tuple[Comparison, ...]] | None, contexts: list[Any]) -> str | None:
    """Why a comparison of ``rule`` never holds, or ``None``: its ``==``, ``!=`` or ``in`` met values of two types
    (``inj.noul == "0.9"``, ``subject.query.tier == "free"``: a list of strings; ``state.tier in [1, 2]``) in some
    run and values of one type in none (null, a missing header, compares with anything). The CEL runtime answers
    ``false`` for ``==`` between two types (``true`` for ``!=``), so such a rule never fires, or always does.

    In each of ``contexts``, the rule is run as ``rewritten`` (its ``when`` rewritten by
    :func:`guard.policy._compare.instrumented`, ``None`` when it was not), which reports the values each comparison
    it reaches compares; the operands of one it does not reach (``&&`` stopped before it on the sample answers) are
    evaluated on their own, unless they read a macro's variable."""
    if rewritten is None:
        return None
    text, comparisons = rewritten
    program = _compiled(text) if len(text) <= _MAX_REWRITTEN else None
    if program is None:
        return None
    operands = [_compiled(f"[{c.left}, {c.right}]") if c.recorded else None for c in comparisons]
    seen: dict[int, set[bool | None]] = {}
    shown: dict[int, tuple[str, str]] = {}

    def record(index: int, left: Any, right: Any) -> bool:
        op = comparisons[index].op
        same = _same_types(left, right, op)
        seen.setdefault(index, set()).add(same)
        if same is False:
            shown.setdefault(index, (_type_name(left), _in_name(right) if op == "in" else _article(_type_name(right))))
        reached.add(index)
        return True

    for context in contexts:
        reached: set[int] = set()
        context.add_function(RECORD, record)
        with contextlib.suppress(Exception):  # the rule's own failures were judged before
            program.execute(context)
        for index, operand in enumerate(operands):
            if index not in reached and operand is not None:
                with contextlib.suppress(Exception):  # a key only some requests have, or a macro's variable
                    record(index, *operand.execute(context))
    for index, comparison in enumerate(comparisons):
        if comparison.recorded and False in seen.get(index, ()) and True not in seen[index]:
            left, right = shown[index]
            if comparison.op == "in":
                return (f"{str(comparison)!r} is always false: it looks for {_article(left)} in {right}; CEL finds no "
                        "value of one type equal to a value of another")
            return (f"{str(comparison)!r} is always {'true' if comparison.op == '!=' else 'false'}: it compares "
                    f"{_article(left)} with {right}, and CEL finds no value of one type equal to a value of another; "
                    "compare values of one type (convert with int(), double() or string())")
    return None


#: Where a bounded answer field is tried (:func:`_constant`), besides the numbers a comparison names: every
#: hundredth of its range.
_STEPS = 100
#: The answer fields :func:`_constant` tries, each named as its question's type: a probability (``noul``) and an
#: expected level (``score``).
_RANGED = frozenset({"noul", "score"})
_ORDERINGS = frozenset({"<", "<=", ">", ">="})
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")
#: The operands of an ordering :func:`~guard.policy.rules.answer_literal_errors` judges at load already: an answer
#: field and a number (``inj.noul > 1.5``).
_FIELD_OPERAND = re.compile(r"[A-Za-z_]\w*\.(?:noul|score)")
_NUMBER_OPERAND = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _constant(
    comparisons: tuple[Comparison, ...],
    questions: Mapping[str, QuestionV1],
    data: Mapping[str, Any] | None,
    points: dict[tuple[str, str, float], Any],
) -> str | None:
    """Why an ordering among a rule's ``comparisons`` (``<``, ``<=``, ``>``, ``>=``) never holds, or always does
    with a ``data`` value, or ``None``: one that reads one question's ``noul`` or ``score`` and otherwise only
    ``data`` and constants is run alone with the field at every hundredth of its range, at each number the
    comparison and its ``data`` values name and on either side of each: ``inj.noul * 1.0 >= data.t`` and
    ``inj.noul >= double(data.t)`` with ``t: 85`` never hold. A literal bound that always holds (``inj.noul <= 1.0``
    closing a band) is redundant, not wrong, and is not reported; a field compared with a number alone
    (``inj.noul > 1.5``) is judged by :func:`~guard.policy.rules.answer_literal_errors`, and not run. ``points``:
    ``(key, field, value)`` -> the context it is run in, filled here and shared between calls with one ``data``."""
    for comparison in comparisons:
        text = str(comparison)
        left, right = comparison.left, comparison.right
        bare = bool((_FIELD_OPERAND.fullmatch(left) and _NUMBER_OPERAND.fullmatch(right))
                    or (_NUMBER_OPERAND.fullmatch(left) and _FIELD_OPERAND.fullmatch(right)))
        program = _compiled(text) if comparison.op in _ORDERINGS and not bare else None
        keys = set(program.variables()) - {"data"} if program is not None else set()
        key = keys.pop() if len(keys) == 1 else None
        question = questions.get(key) if key is not None else None
        field = question.type if question is not None and question.type in _RANGED else None
        code = LITERAL_RE.sub('""', text)
        if field is None or set(re.findall(rf"(?<![\w.]){re.escape(key)}\s*\.\s*([A-Za-z_]\w*)", code)) != {field}:
            continue
        high = float(len(question.options()) - 1) if field == "score" else 1.0
        read = {path: data_value(data or {}, path) for root, path in field_reads(text) if root == "data"}
        numbers = [float(n) for n in _NUMBER.findall(code)]
        numbers += [float(v) for v in read.values() if isinstance(v, int | float) and not isinstance(v, bool)]
        tried = {high * i / _STEPS for i in range(_STEPS + 1)}
        tried |= {min(max(n + d, 0.0), high) for n in numbers if math.isfinite(n) for d in (-1e-9, 0.0, 1e-9)}
        seen = set()
        for point in tried:
            context = points.get((key, field, point))
            if context is None:
                variables = {key: {field: point}, "data": dict(data or {})}
                context = points[key, field, point] = cel.Context(variables=variables)
            with contextlib.suppress(Exception):  # a failure is the rule check's, not this one's
                seen.add(program.execute(context))
        if len(seen) != 1 or not isinstance(always := seen.pop(), bool) or (always and not read):
            continue
        shown = ", ".join(f"{_written('data', path)} is {value!r}" for path, value in read.items())
        what = "an expected level" if field == "score" else "a probability"
        return (f"{text!r} is always {str(always).lower()}{f' ({shown})' if shown else ''}: {key}.{field} is {what} "
                f"from 0 to {high:g}")
    return None


def _compiled(source: str) -> Any:
    """``source`` compiled, or ``None`` when the CEL runtime refuses it (or panics on it)."""
    try:
        return _cel(cel.compile, source)
    except ValueError:
        return None


def _kind(value: Any) -> str:
    """The CEL type a value is compared as: ``int`` and ``double`` are one (``1 == 1.0``)."""
    return "number" if type(value) in (int, float) else _type_name(value)


def _same_types(left: Any, right: Any, op: str) -> bool | None:
    """Whether a comparison meets values of one type; ``None`` when a null (or an empty list or map for ``in``)
    makes it say nothing."""
    if op == "in":
        if not isinstance(right, list | dict) or not right:
            return None
        kinds = {_kind(item) for item in right}
        return None if left is None or "null" in kinds else _kind(left) in kinds
    if left is None or right is None:
        return None
    return _kind(left) == _kind(right)


def _in_name(value: Any) -> str:
    """``a list of int values``: what an ``in`` looks in."""
    kinds = " and ".join(sorted({_type_name(item) for item in value}))
    return f"a {_type_name(value)} of {kinds} {'values' if isinstance(value, list) else 'keys'}"


def _first_sentence(exc: RuleError) -> str:
    """What failed, without the CEL runtime's advice or a sample value (a non-boolean is named by its type)."""
    if exc.__cause__ is None:
        return exc.reason
    undefined = _UNDEFINED.match(str(exc.__cause__))
    if undefined:  # every name was checked at load: a method called on a value of a type without it
        return f"{undefined.group(1)}() is not defined for the type of its value"
    return exc.detail.split(". ")[0]


def _type_error(exc: RuleError) -> bool:
    """Whether a rule's failure comes from the types of its values, not from the values themselves: a non-boolean
    result, CEL's ``TypeError`` (no such overload, unsupported operation), a method the value's type does not have
    (CEL says the function is undefined: rule names were checked at load) or one of guard's functions given a type
    it does not take; not a missing key, an index out of range or ``int("x")``."""
    cause = exc.__cause__
    if cause is None:
        return True
    text = str(cause)
    return isinstance(cause, TypeError) or (
        isinstance(cause, RuntimeError)
        and (_UNDEFINED.match(text) is not None or "Python function call failed: TypeError" in text)
    )


def _described(reads: Mapping[str, list[tuple[str, ...]]], runs: list[tuple[Any, Any]]) -> str:
    """``state.text is a string, subject.status is an int or null``: the types each read value took in ``runs``."""
    out = []
    for index, root in enumerate(("state", "subject")):
        for path in dict.fromkeys(reads[root]):
            names: dict[str, None] = {}
            for run in runs:
                node = run[index]
                for name in path:
                    node = node.get(name) if isinstance(node, dict) else None
                names[_type_name(node)] = None
            out.append(f"{_written(root, path)} is {_article(' or '.join(names))}")
    return ", ".join(out)


def _written(root: str, path: tuple[str, ...]) -> str:
    """``state.user["x-id"]``: a read path as a rule writes it."""
    return root + "".join(f".{name}" if name.isidentifier() else f'["{name}"]' for name in path)


def _article(name: str) -> str:
    return ("an " if name[0] in "aeiou" else "a ") + name
