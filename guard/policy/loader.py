"""Load policy files: safe YAML -> pydantic schema -> compiled :class:`~guard.policy.policy.Policy` objects.

Every problem is a :class:`PolicyLoadError` (a :class:`~guard.errors.PolicyError`) naming the file, the line and the
key path, e.g. ``policies/api.yaml:31 at policies[0].questions.urgency.criteria: has 11 levels; a score needs 2 to
10``. The problems found are kept in ``.problems`` (the first :data:`MAX_PROBLEMS`, then one saying how many more);
the message names the first.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pydantic

from guard.errors import FieldError, PolicyError, RequestValidationError
from guard.policy import rule_check
from guard.policy._match import TOOL_EVENTS, AgentMatcher, HttpMatcher
from guard.policy._state import (
    AGENT_SOURCES,
    HTTP_SOURCES,
    NAMED_SOURCES,
    POINTER_SOURCES,
    REQUEST_SOURCES,
    RESPONSE_SOURCES,
    StateField,
    default_fields,
    split_pointer,
)
from guard.policy._yaml import LineMap, format_path, load_yaml, read_policy_file
from guard.policy._yaml import Path as KeyPath
from guard.policy.model import MAX_QUESTION_TEXT_CHARS, PATTERN_HINTS, PolicyFileSpec, PolicySpec, SourceSpec, keys_at
from guard.policy.policy import DEFAULT_MODEL, FailPolicy, HandoffTarget, Policy, PolicyQuestion, rule_header_reads
from guard.policy.provenance import CALL_KEYS, RESULT_KEYS, ToolSpec
from guard.policy.redact import Redactor, compile_pattern
from guard.policy.rules import (
    CEL_KEYWORDS,
    CEL_TYPE_NAMES,
    FLAG_NAMES,
    RESERVED_NAMES,
    RESERVED_RULE_IDS,
    CompiledRule,
    Outcome,
    answer_literal_errors,
    compile_condition,
    field_reads,
    fixed_value_errors,
    header_name_errors,
    rule_patterns,
    subject_fields,
)
from guard.subject import AgentSubject, HttpSubject, Subject
from guard.systemone import ID_PATTERN, MAX_QUESTIONS, QuestionType, SystemOneRequestV1

__all__ = [
    "MAX_PROBLEMS", "FileStamp", "PolicyLoadError", "PolicySet", "PolicyView", "ViewMatch", "check_unique", "file_stamp",
    "load_files", "load_text", "policy_digest", "policy_subjects", "validation_problem",
]

logger = logging.getLogger("guard.policy")

_CEL_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_HEADER_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an RFC 9110 field name (token)
_COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # non-string question text, measured

#: Most problems one load collects; past it a last problem says how many more there were (a file of 60,000 unknown
#: keys costs the first ones' messages, not 60,000 "did you mean" searches).
MAX_PROBLEMS = 50
#: How many times a set of files that changed while it was read is read again before the load fails.
READ_TRIES = 5
_RETRY_WAIT_S = 0.05  # first pause between tries (doubled each time): lets a writer finish

#: A file's identity as read: ``(resolved path, device, inode, size, mtime_ns)``; ``(path, -1, -1, -1, -1)`` when it
#: cannot be stat'ed. A ConfigMap update changes the resolved path, a rename the inode, an edit the size or mtime.
FileStamp = tuple[str, int, int, int, int]


def file_stamp(path: str | Path) -> FileStamp:
    """The identity of the file at ``path`` now (its symlinks followed, as a ConfigMap volume's ``..data`` is)."""
    try:
        resolved = os.path.realpath(path)
        info = os.stat(resolved)
    except (OSError, ValueError):
        return (str(path), -1, -1, -1, -1)
    return (resolved, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class PolicyLoadError(PolicyError):
    """One or more problems in a policy file; the message names the first, ``problems`` lists them all."""

    def __init__(self, problems: Sequence[PolicyError], *, omitted: int = 0) -> None:
        first = problems[0]
        super().__init__(first.file, first.line, first.key, first.reason)
        self.problems = list(problems[:MAX_PROBLEMS])
        total = len(problems) + omitted  # omitted: problems the caller found but did not build
        if total > len(self.problems):
            self.problems.append(PolicyError(first.file, None, "", f"... and {total - len(self.problems)} more errors"))
        if total > 1:
            self.args = (f"{self.args[0]} (and {total - 1} more)",)


def load_text(text: str | bytes, file: str = "<string>") -> list[Policy]:
    """Load the policies in one document.

    Args:
        text: YAML text (``bytes`` are decoded as UTF-8).
        file: name used in errors and recorded on each policy.

    Raises:
        PolicyLoadError: listing every problem found, each with file, line and key path.
    """
    data, lines = load_yaml(text, file)
    if data is None:
        raise PolicyLoadError([PolicyError(file, 1, "", "file is empty; expected a mapping with 'policies'")])
    try:
        spec = PolicyFileSpec.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=True, include_input=True)
        found = [validation_problem(error, lines) for error in errors[:MAX_PROBLEMS]]  # each may search for a near key
        raise PolicyLoadError(found, omitted=len(errors) - len(found)) from None
    problems: list[PolicyError] = []
    policies = [_compile(i, policy, spec, lines, problems) for i, policy in enumerate(spec.policies)]
    if problems:
        raise PolicyLoadError(problems)
    check_unique(policies)
    for policy in policies:
        if policy.on_error is not None and policy.on_error.mode == "open":
            logger.warning("policy %s@%s (%s) FAILS OPEN: backend errors will allow", policy.id, policy.version, file)
    return policies


def load_files(*paths: str | Path) -> PolicySet:
    """Load every file, in order, into one :class:`PolicySet` that can :meth:`~PolicySet.reload` them.

    Raises:
        PolicyLoadError: for the first file with problems (a missing file names the file and line ``None``).
    """
    if not paths:
        raise PolicyError("<none>", None, "", "no policy files given")
    texts, stamps = _read_all(paths)
    policies: list[Policy] = []
    for path, raw in zip(paths, texts, strict=True):
        policies.extend(load_text(raw, str(path)))
    return PolicySet(policies, sources=paths, stamps=stamps)


def _read_all(paths: Sequence[str | Path]) -> tuple[list[bytes], tuple[FileStamp, ...]]:
    """The bytes of every file, all of one version, and each file's identity when it was read.

    Each file is stat'ed before and after it is read, and all of them again once all are read; if any changed (a
    ConfigMap's ``..data`` swapped between two files of a set, a file renamed over), the whole set is read again, up
    to :data:`READ_TRIES` times. Parsing comes after, so a slow parse cannot straddle a change.

    Raises:
        PolicyLoadError: a file cannot be read, or the files kept changing.
    """
    changed: str | Path = paths[0]
    for attempt in range(READ_TRIES):
        if attempt:
            time.sleep(_RETRY_WAIT_S * 2 ** (attempt - 1))
        texts: list[bytes] = []
        stamps: list[FileStamp] = []
        for path in paths:
            before = file_stamp(path)
            try:
                texts.append(read_policy_file(path))
            except PolicyError as exc:
                raise PolicyLoadError([exc]) from None
            stamps.append(before)
            if file_stamp(path) != before:
                changed = path
                break
        else:
            moved = [path for path, stamp in zip(paths, stamps, strict=True) if file_stamp(path) != stamp]
            if not moved:
                return texts, tuple(stamps)
            changed = moved[0]
        logger.debug("policy file %s changed while the set was read; reading the set again", changed)
    raise PolicyLoadError([PolicyError(str(changed), None, "", f"changed while the policy files were being read "
                                       f"({READ_TRIES} tries); replace policy files atomically (write the new file "
                                       "elsewhere, then rename it or swap a symlink)")])


def validation_problem(error: Any, lines: LineMap, model: type[pydantic.BaseModel] = PolicyFileSpec) -> PolicyError:
    """One pydantic error of a file ``model`` validated, as a :class:`PolicyError` naming the file's line and key path
    (pydantic's union tags dropped); an unknown key gets the nearest key allowed there, or the list of them."""
    loc = tuple(error["loc"])
    path: list[str | int] = []
    for i, part in enumerate(loc):
        if part == "[key]":  # pydantic's mark of a mapping key that failed: the key, already in the path, is named
            continue
        candidate = (*path, part)
        # Drop union/validator tags pydantic inserts into ``loc`` (they are not keys in the file).
        if i == len(loc) - 1 or candidate in lines.lines:
            path.append(part)
    message = error["msg"]
    if error["type"] == "extra_forbidden":
        message = _unknown_key(path, model)
    elif error["type"] == "missing":
        message = "is required"
    elif error["type"] == "value_error":  # a validator's own message, without pydantic's "Value error, "
        message = str(error["ctx"]["error"])
    elif error["type"] == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") in PATTERN_HINTS:
        message = f"{PATTERN_HINTS[error['ctx']['pattern']]}, got {error['input']!r}"
    elif "input" in error and error["type"] not in ("missing",):
        shown = repr(error["input"])
        message = f"{message}, got {shown if len(shown) <= 60 else shown[:57] + '...'}"
    return lines.error(tuple(path), message)


def _unknown_key(path: Sequence[str | int], model: type[pydantic.BaseModel]) -> str:
    allowed = keys_at(model, path[:-1])
    if not allowed:
        return "unknown key; check the spelling against docs/policies.md"
    near = difflib.get_close_matches(str(path[-1]), allowed, n=1, cutoff=0.7)
    if near:
        return f"unknown key; did you mean {near[0]!r}?"
    return f"unknown key; the keys here are {', '.join(allowed)}"


def policy_digest(spec: PolicySpec, file_spec: PolicyFileSpec) -> str:
    """Which policy text ``spec`` is: the first 16 hex digits of the SHA-256 of its canonical form, the policy as
    validated (defaults filled in) with its file's ``data`` and ``handoff_targets``, as compact ASCII JSON in the
    file's order. Comments, layout, quoting and defaults written out do not change it; a change to anything that
    decides does (a threshold in a rule or in ``data``, a question, the order of the state's fields), whatever the
    ``version`` says."""
    canonical = {
        "policy": spec.model_dump(mode="json", by_alias=True),
        **file_spec.model_dump(mode="json", by_alias=True, include={"data", "handoff_targets"}),
    }
    text = json.dumps(canonical, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


def _compile(
    index: int, spec: PolicySpec, file_spec: PolicyFileSpec, lines: LineMap, problems: list[PolicyError]
) -> Policy:
    base: KeyPath = ("policies", index)

    def problem(path: KeyPath, reason: str) -> None:
        problems.append(lines.error((*base, *path), reason))

    if spec.match.http is None and spec.match.agent is None:
        problem(("match",), "needs 'http' or 'agent' (or both); a policy must say what it applies to")
    questions, known = _questions(spec, problem, base, lines)
    state_fields = _state(spec, problem)
    state_shapes = _state_shapes(spec, state_fields)
    state_names = _state_names(state_shapes)
    state_sources = _state_sources(state_shapes)
    fixed = _fixed_names(spec)
    rules = []
    seen_rules: set[str] = set()
    wires = {q.key: q.wire for q in questions}
    literal_errors: set[str] = set()
    for i, rule in enumerate(spec.rules):
        if rule.id in seen_rules:
            problem(("rules", i, "id"), f"rule id {rule.id!r} is used twice; rule ids must be unique in a policy")
        if rule.id in RESERVED_RULE_IDS:
            problem(("rules", i, "id"), f"rule id {rule.id!r} is the verdict's rule when {RESERVED_RULE_IDS[rule.id]}; "
                    "give this rule another id")
        seen_rules.add(rule.id)
        try:
            program, names = compile_condition(rule.when, known)
        except ValueError as exc:
            problem(("rules", i, "when"), str(exc))
            continue
        unknown = _unknown_read(rule.when, state_names, file_spec.data, fixed, declared=spec.state is not None)
        if unknown is not None:
            problem(("rules", i, "when"), unknown)
        patterns, pattern_problems = rule_patterns(rule.when, file_spec.data)
        for reason in pattern_problems:
            problem(("rules", i, "when"), reason)
        for reason in [*answer_literal_errors(rule.when, wires, file_spec.data), *header_name_errors(rule.when),
                       *fixed_value_errors(rule.when, state_sources),
                       *(_header_token_error(f"the header {name!r} this rule reads")  # '_': header_name_errors
                         for name in sorted(rule_header_reads(rule.when) or ()) if not _HEADER_TOKEN.fullmatch(name))]:
            problem(("rules", i, "when"), reason)
            literal_errors.add(rule.id)
        outcome = _outcome(rule, ("rules", i), file_spec, problem)
        rules.append(CompiledRule(rule.id, rule.when, program, outcome, names, patterns))
    failures = {}
    if len(wires) == len(known):  # every question compiled: the rules can be run on even answers
        kinds = _subject_classes(spec)
        # a default state is rendered only from the subjects it is the default of: each source from its own kind
        shapes = [(state_fields, kinds)] if state_fields is not None else [(shape, ()) for shape in state_shapes]
        state = tuple(alt for shape, of in shapes for alt in rule_check.state_type(shape, of) or ())
        subject = tuple(alt for cls in kinds for alt in rule_check.subject_type(cls) or ())
        failures = rule_check.certain_failures(spec.id, tuple(rules), wires, file_spec.data, state=state, subject=subject)
    for i, rule in enumerate(spec.rules):
        if rule.id in failures and rule.id not in literal_errors:  # already said, more plainly
            problem(("rules", i, "when"), failures[rule.id])
    if spec.match.http is not None:
        for name in spec.match.http.headers:
            if (error := _header_name_error(name, f"the header name {name!r}")) is not None:
                problem(("match", "http", "headers", name), error)
    agent_match = spec.match.agent
    for name in ("tools", "trusted"):
        if agent_match is None and getattr(spec, name):
            problem((name,), f"'{name}' is read for agent tool calls (call.*); this policy matches HTTP requests "
                    "only, so it would be ignored: drop it, or add match.agent")
    if agent_match is not None and agent_match.tools and agent_match.events \
            and not TOOL_EVENTS & set(agent_match.events):
        problem(("match", "agent", "tools"), f"a tool list never matches {' or '.join(agent_match.events)} events, "
                "which have no tool: the policy would judge nothing; add tool_call or tool_result to events, or "
                "drop tools")
    default = _outcome(spec.default, ("default",), file_spec, problem)
    _check_actions(spec, problem)
    on_error = None
    if spec.on_error is not None:
        e = spec.on_error
        on_error = FailPolicy(e.mode, status=e.status, retry_after=e.retry_after, message=e.message)
    try:
        http = HttpMatcher.from_spec(spec.match.http) if spec.match.http is not None else None
        agent = AgentMatcher.from_spec(spec.match.agent) if spec.match.agent is not None else None
    except ValueError as exc:  # globs past RE2's memory budget (hundreds of thousands of characters)
        problem(("match",), f"its globs could not be compiled: {exc}")
        http = agent = None
    return Policy(
        id=spec.id,
        version=spec.version,
        description=spec.description,
        mode=spec.mode,
        file=lines.file,
        line=lines.line(base),
        http=http,
        agent=agent,
        state_fields=state_fields,
        questions=tuple(questions),
        rules=tuple(rules),
        default=default,
        on_error=on_error,
        timeout=spec.timeout_ms / 1000.0,
        cache_ttl=spec.cache.ttl,
        backend=spec.backend,
        model=spec.model or DEFAULT_MODEL,
        digest=policy_digest(spec, file_spec),
        handoff_targets={
            name: HandoffTarget(name, t.base_url, t.model, t.api_key_env, t.timeout, t.system_prompt, t.stream_timeout)
            for name, t in file_spec.handoff_targets.items()
        },
        data=file_spec.data,
        tools={
            name: ToolSpec(t.effect, {arg: tuple(a.from_) for arg, a in t.arguments.items()} or None, t.evidence)
            for name, t in spec.tools.items()
        },
        trusted=tuple(spec.trusted),
        priority=spec.priority,
        index=index,
    )


def _field_names(fields: tuple[StateField, ...]) -> dict[str, Any]:
    """State field name -> the names under it: a dict for a nested object (``fields``) or a constant object, else
    ``None`` (a subject value: what is under it is not known before a request)."""
    out: dict[str, Any] = {}
    for f in fields:
        if f.children is not None:
            out[f.name] = _field_names(f.children)
        elif f.source is None and isinstance(f.const, Mapping):
            out[f.name] = dict(f.const)
        else:
            out[f.name] = None
    return out


def _state_shapes(spec: PolicySpec, fields: tuple[StateField, ...] | None) -> list[tuple[StateField, ...]]:
    """Every state the policy may render: the declared fields, else the default state of each subject it matches
    (:func:`guard.policy._state.default_fields`)."""
    if fields is not None:
        return [fields]
    agent = spec.match.agent
    events = (agent.events or ("tool_call", "tool_result", "model_input", "model_output")) if agent else ()
    http = spec.match.http
    phase = None if http is None else "request" if http.response is None else "response"
    return default_fields(phase, events)


def _state_names(shapes: list[tuple[StateField, ...]]) -> dict[str, Any]:
    """The names a rule may read under ``state``: those of every state the policy may render (:func:`_state_shapes`)."""
    merged: dict[str, Any] = {}
    for shape in shapes:
        for name, under in _field_names(shape).items():
            merged[name] = {**(merged.get(name) or {}), **under} if isinstance(under, dict) else under
    return merged


def _state_sources(shapes: list[tuple[StateField, ...]]) -> dict[tuple[str, ...], str]:
    """Each state field's path (``("m",)`` for ``state.m``, ``("a", "b")`` for a nested one) to the source it reads,
    where every state the policy may render (:func:`_state_shapes`) reads that source there and gives no default
    (which it may hold instead): what :func:`~guard.policy.rules.fixed_value_errors` checks literals against."""
    found: dict[tuple[str, ...], str | None] = {}

    def walk(fields: tuple[StateField, ...], at: tuple[str, ...]) -> None:
        for one in fields:
            path = (*at, one.name)
            if one.children:
                walk(one.children, path)
            source = one.source if one.default is None else None
            found[path] = source if found.get(path, source) == source else None

    for shape in shapes:
        walk(shape, ())
    return {path: source for path, source in found.items() if source is not None}


def _subject_classes(spec: PolicySpec) -> list[type]:
    """The subject classes of what ``spec`` matches: :class:`HttpSubject`, :class:`AgentSubject` or both."""
    return [cls for cls, matched in ((HttpSubject, spec.match.http), (AgentSubject, spec.match.agent)) if matched]


def _fixed_names(spec: PolicySpec) -> dict[str, frozenset[str]]:
    """The names a rule may read under ``flags``, ``subject``, ``call`` and ``result`` for what ``spec`` matches:
    every flag; the fields of the subjects it matches (:func:`~guard.policy.rules.subject_fields`); the keys of the
    ``call`` and ``result`` objects."""
    fields = {name for cls in _subject_classes(spec) for name in subject_fields(cls)}
    return {"flags": frozenset(FLAG_NAMES), "subject": frozenset(fields), "call": CALL_KEYS, "result": RESULT_KEYS}


def _unknown_read(
    source: str, state: Mapping[str, Any], data: Mapping[str, Any], fixed: Mapping[str, frozenset[str]], *,
    declared: bool,
) -> str | None:
    """Why a ``when`` reads a name that cannot exist (a ``KeyError`` on every request at run time): a ``state.`` or
    ``data.`` path the policy does not define, or a ``flags.``, ``subject.``, ``call.`` or ``result.`` name outside
    ``fixed`` (:func:`_fixed_names`), naming the known names; ``None`` when every fixed path it reads is there."""
    for root, path in field_reads(source):
        if root in fixed:
            if path and path[0] not in fixed[root]:
                known = ", ".join(sorted(fixed[root]))
                return f"reads {root}.{path[0]}, but {root} has no {path[0]!r}; known names: {known}"
            continue
        node: Any = state if root == "state" else data
        for depth, name in enumerate(path):
            if not isinstance(node, Mapping):
                break  # a subject value or a data list: what is under it is not known here
            if name not in node:
                read = ".".join((root, *path[: depth + 1]))
                known = ", ".join(sorted(map(str, node))) or "(none)"
                if root == "data":
                    where = "the file's data" if depth == 0 else f"data.{'.'.join(path[:depth])}"
                    return f"reads {read}, but {where} has no {name!r}; known names: {known}"
                where = "the state" if depth == 0 else f"state.{'.'.join(path[:depth])}"
                hint = "" if declared else " (the default state of the subjects it matches; declare 'state:' to set it)"
                return f"reads {read}, but {where} has no field {name!r}; known names: {known}{hint}"
            node = node[name]
    return None


def _check_actions(spec: PolicySpec, problem: Any) -> None:
    """``redact`` needs HTTP bodies (no agent events); a response policy can allow, block or redact (there is no
    client request left to hold for review or hand off)."""
    response = spec.match.http is not None and spec.match.http.response is not None
    outcomes: list[tuple[KeyPath, Any]] = [(("rules", i, "action"), r) for i, r in enumerate(spec.rules)]
    outcomes.append((("default",), spec.default))
    for where, outcome in outcomes:
        if outcome.action == "redact" and spec.match.agent is not None:
            problem(where, "redact masks HTTP bodies; a policy with match.agent cannot redact (use the agent "
                    "middleware's tool_result action for agent events)")
        if response and outcome.action in ("escalate", "handoff"):
            problem(where, f"a response policy (match.http.response) can allow, block or redact, not "
                    f"{outcome.action}: the request was already answered by the upstream")
    if response and spec.on_error is not None and spec.on_error.mode == "escalate":
        problem(("on_error", "mode"), "a response policy (match.http.response) fails closed or open, not escalate: "
                "the request was already answered by the upstream, there is nothing left to hold for review")
    if spec.on_error is not None and spec.on_error.mode != "closed":
        for name in sorted({"status", "retry_after"} & spec.on_error.model_fields_set):
            problem(("on_error", name), f"'{name}' is only for mode closed (the block it sends), not "
                    f"{spec.on_error.mode}")
    if response and spec.match.agent is not None:
        problem(("match", "agent"), "a response policy (match.http.response) judges HTTP responses only; put the "
                "agent match in a policy of its own")


def _questions(
    spec: PolicySpec, problem: Any, base: KeyPath, lines: LineMap
) -> tuple[list[PolicyQuestion], dict[str, QuestionType | None]]:
    """Validate each question against the Workers AI limits; returns the questions and every key's type (also for
    questions with problems, so rules that use them do not report a second, misleading error)."""
    if not spec.questions and not spec.rules:
        problem(("questions",), "needs at least one question, or rules that decide without one (a rules-only policy)")
    if len(spec.questions) > MAX_QUESTIONS:
        problem(("questions",), f"has {len(spec.questions)} entries; at most {MAX_QUESTIONS}")
    out: list[PolicyQuestion] = []
    known: dict[str, QuestionType | None] = {}
    wire_ids: dict[str, str] = {}
    for key, q in spec.questions.items():
        where = ("questions", key)
        known[key] = q.type
        if (not re.fullmatch(_CEL_IDENTIFIER, key) or key in RESERVED_NAMES or key in CEL_KEYWORDS
                or key in CEL_TYPE_NAMES):
            problem(where, f"question key {key!r} must be a name rules can use ([A-Za-z_][A-Za-z0-9_]*, not "
                    f"{', '.join(sorted(RESERVED_NAMES))}, a CEL keyword or a CEL type name); set 'id' for a different "
                    "wire id")
            continue
        body_question = q.model_dump(exclude={"id", "catalog"}, exclude_none=True)
        if q.catalog is not None:
            catalog = _catalog_question(q, where, problem)
            if catalog is None:
                continue
            known[key] = catalog.type
            body_question = catalog.to_json()
        elif q.type is None:
            problem((*where, "type"), "is required (noul, choice or score) unless the question names a 'catalog' id")
            continue
        wire_id = q.id if q.id is not None else (q.catalog or key)
        if not ID_PATTERN.fullmatch(wire_id):
            problem((*where, "id"), f"id {wire_id!r} must match {ID_PATTERN.pattern}")
            continue
        if wire_id in wire_ids:
            problem((*where, "id"), f"wire id {wire_id!r} is also used by question {wire_ids[wire_id]!r}")
            continue
        wire_ids[wire_id] = key
        body = {"model": "m", "state": "", "questions": {wire_id: body_question}}
        try:
            request = SystemOneRequestV1.from_json(body, profile="workers-ai")
        except RequestValidationError as exc:
            for field_error in exc.errors:
                problem(_field_path(field_error, wire_id, key), field_error.message)
            continue
        wire = request.questions[0]
        for name, value in (("instructions", wire.instructions), ("criteria", wire.criteria)):
            size = len(value) if isinstance(value, str) else len(_COMPACT_JSON.encode(value))
            if size > MAX_QUESTION_TEXT_CHARS:
                problem((*where, name), f"holds {size} characters as the model reads them; at most "
                        f"{MAX_QUESTION_TEXT_CHARS}, about the whole 16,384-token prompt (state included)")
        out.append(PolicyQuestion(key, wire, format_path((*base, *where)), lines.line((*base, *where))))
    return out, known


def _catalog_question(q: Any, where: KeyPath, problem: Any) -> Any:
    """The catalog entry ``q.catalog`` names, after checking the question does not contradict it."""
    try:
        from guard.compact.catalog import CATALOG
    except ImportError:  # pragma: no cover - the catalog ships with guard
        problem((*where, "catalog"), "the built-in question catalog is not installed")
        return None
    entry = CATALOG.get(q.catalog)
    if entry is None:
        problem((*where, "catalog"), f"{q.catalog!r} is not a catalog question; catalog ids are {sorted(CATALOG)}")
        return None
    if q.type is not None and q.type != entry.type:
        problem((*where, "type"), f"catalog question {entry.id} is a {entry.type} question, not {q.type}")
        return None
    for name in ("instructions", "criteria"):
        if getattr(q, name) is not None:
            problem((*where, name), f"a catalog question uses the catalog's {name}; remove '{name}' or drop 'catalog'")
            return None
    return entry


def _field_path(error: FieldError, wire_id: str, key: str) -> KeyPath:
    prefix = f"questions.{wire_id}"
    rest = error.field[len(prefix) :].lstrip(".") if error.field.startswith(prefix) else ""
    return ("questions", key, *(p for p in rest.split(".") if p))


def _outcome(spec: Any, where: KeyPath, file_spec: PolicyFileSpec, problem: Any) -> Outcome:
    if spec.action == "handoff":
        if spec.handoff is None:
            problem((*where, "handoff"), "a handoff needs 'handoff: <target>' naming one of handoff_targets")
        elif spec.handoff not in file_spec.handoff_targets:
            known = ", ".join(sorted(file_spec.handoff_targets)) or "(none declared)"
            problem((*where, "handoff"), f"handoff target {spec.handoff!r} is not in handoff_targets ({known})")
    elif spec.handoff is not None:
        problem((*where, "handoff"), f"'handoff' is only for action handoff, not {spec.action}")
    if spec.status is not None and spec.action != "block":
        problem((*where, "status"), f"'status' is only for action block, not {spec.action}")
    if spec.retry_after is not None and spec.action == "allow":
        problem((*where, "retry_after"), "'retry_after' is never sent with action allow: an allowed request gets "
                "the application's own response")
    status = spec.status if spec.status is not None else (403 if spec.action == "block" else None)
    redactor = _redactor(spec, where, problem)
    return Outcome(spec.action, status=status, message=spec.message, retry_after=spec.retry_after,
                   handoff=spec.handoff, redact=redactor)


def _redactor(spec: Any, where: KeyPath, problem: Any) -> Redactor | None:
    """The compiled ``redact`` block of a ``redact`` outcome (patterns compiled now, so a bad regex names its key)."""
    if spec.action != "redact":
        if spec.redact is not None:
            problem((*where, "redact"), f"'redact' is only for action redact, not {spec.action}")
        return None
    block = spec.redact
    if block is None or not (block.patterns or block.detector):
        problem((*where, "redact"), "a redact outcome needs 'redact: {patterns: {label: regex}}' and/or "
                "'detector: true' saying what to mask")
        return None
    patterns = []
    for label, source in block.patterns.items():
        try:
            patterns.append((label, compile_pattern(source)))
        except ValueError as exc:
            problem((*where, "redact", "patterns", label), str(exc))
    return Redactor(tuple(patterns), detector=block.detector, style=block.style)


def _state(spec: PolicySpec, problem: Any) -> tuple[StateField, ...] | None:
    if spec.state is None:
        return None
    kinds = set()
    if spec.match.http is not None:
        kinds.add("http")
        if spec.match.http.response is not None:
            kinds.add("response")
    if spec.match.agent is not None:
        kinds.add("agent")
    fields = []
    for name, source in spec.state.items():
        where = ("state", name)
        compiled = _state_field(name, source, kinds, lambda path, reason, w=where: problem((*w, *path), reason))
        if compiled is not None:
            fields.append(compiled)
    return tuple(fields)


def _header_token_error(what: str) -> str:
    return (f"{what} is not an HTTP field name (RFC 9110: letters, digits and !#$%&'*+-.^_`|~): no request has "
            "such a header")


def _header_name_error(name: str, what: str) -> str | None:
    """Why a policy cannot read the header ``name`` (``what`` names it in the message), or ``None``: it is not an
    HTTP field name, or it is spelled with ``_``, which guard reads as a copy of the ``-`` name and the proxy drops."""
    if not _HEADER_TOKEN.fullmatch(name):
        return _header_token_error(what)
    if "_" in name:
        return (f"{what} is spelled with '_', which guard reads as a copy of {name.replace('_', '-')!r} (a WSGI "
                f"server reads both alike) and guard proxy never forwards; write {name.replace('_', '-')!r}")
    return None


def _state_field(name: str, source: SourceSpec, kinds: set[str], problem: Any) -> StateField | None:
    fields_set = source.model_fields_set
    given = [key for key in ("from_", "const", "fields") if key in fields_set]
    if len(given) != 1:
        problem((), "needs exactly one of 'from: <source>', 'const: <value>' or 'fields: {...}'")
        return None
    if "truncate" in fields_set and source.max_chars is None:
        problem(("truncate",), "'truncate' says what to keep of a value over 'max_chars'; give max_chars too")
    limit, truncate = source.max_chars, source.truncate
    if source.fields is not None:
        children = []
        for child_name, child in source.fields.items():
            compiled = _state_field(
                child_name, child, kinds, lambda path, reason, c=child_name: problem(("fields", c, *path), reason)
            )
            if compiled is not None:
                children.append(compiled)
        return StateField(name, None, children=tuple(children), max_chars=limit, truncate=truncate)
    if source.from_ is None:
        return StateField(name, None, const=source.const, max_chars=limit, truncate=truncate)
    src = source.from_
    if src in HTTP_SOURCES and "http" not in kinds:
        problem(("from",), f"source {src!r} reads HTTP requests but the policy matches only agent events")
    if src in RESPONSE_SOURCES and "response" not in kinds:
        problem(("from",), f"source {src!r} reads upstream responses; only a response policy (match.http.response) "
                "has one")
    if src in REQUEST_SOURCES and "response" in kinds:
        problem(("from",), f"source {src!r} reads a request's query and body; a response policy judges the "
                "response's text (body_text)")
    if src in AGENT_SOURCES and "agent" not in kinds:
        problem(("from",), f"source {src!r} reads agent events but the policy matches only HTTP requests")
    pointer: tuple[str, ...] = ()
    if source.pointer is not None:
        if src not in POINTER_SOURCES:
            problem(("pointer",), f"a JSON pointer applies to {', '.join(sorted(POINTER_SOURCES))}, not {src}")
        try:
            pointer = split_pointer(source.pointer)
        except ValueError as exc:
            problem(("pointer",), str(exc))
    if source.name is not None and src not in NAMED_SOURCES:
        problem(("name",), f"'name' applies to {', '.join(sorted(NAMED_SOURCES))}, not {src}")
    if src == "header" and source.name is None:
        problem(("name",), "a header source needs 'name' (e.g. header:user-agent); headers are never sent whole")
    elif src == "header" and source.name is not None and (
            error := _header_name_error(source.name, f"the header name {source.name!r}")) is not None:
        problem(("name",), error)
    if "repeated" in fields_set:
        if src not in NAMED_SOURCES or source.name is None:
            problem(("repeated",), "'repeated' says how to read a query parameter, form field or header sent more "
                    "than once; it needs from: query, form or header and a 'name'")
        else:
            allowed = ("refuse", "join") if src == "header" else ("refuse", "list")
            if source.repeated not in allowed:
                problem(("repeated",), f"repeated: {source.repeated} does not apply to {src}; use "
                        f"{' or '.join(allowed)}")
    return StateField(
        name, src, pointer=pointer, key=source.name, default=source.default, max_chars=limit, truncate=truncate,
        repeated=source.repeated,
    )


@dataclass(frozen=True)
class PolicyView:
    """One version of a :class:`PolicySet`'s policies (a reload makes a new one). An enforcement point takes one per
    request (:meth:`PolicySet.view`) and matches the request and its response on it, so a reload in between cannot
    have a request judged by the old set and its response by the new one (or by neither).

    Attributes:
        policies: the policies in match order.
        response: the response policies among them (``match.http.response``), in match order.
        read_headers: the request headers (lower-case names) some HTTP policy's ``match`` names or its state or rules
            read (:attr:`~guard.policy.Policy.http_reads`); ``None`` when a rule may read any header.
        read_header_names: :attr:`read_headers` as the header names of an ASGI scope (bytes), made once per view.
    """

    policies: tuple[Policy, ...]
    response: tuple[Policy, ...] = field(init=False)
    read_headers: frozenset[str] | None = field(init=False)
    read_header_names: frozenset[bytes] | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "response", _response_policies(self.policies))  # once, while being built
        read = _read_headers(self.policies)
        object.__setattr__(self, "read_headers", read)
        object.__setattr__(self, "read_header_names", None if read is None else frozenset(n.encode() for n in read))

    def matching(self, subject: Subject) -> tuple[Policy, ...]:
        """Every policy that matches ``subject``, in match order (all of them decide, ``docs/policies.md``)."""
        return tuple([policy for policy in self.policies if policy.matches(subject)])

    def watching(self, request: HttpSubject) -> tuple[Policy, ...]:
        """The response policies whose request conditions match ``request``, in match order: the ones that judge its
        response. Empty, at once, when none is loaded."""
        if not self.response:
            return ()
        return tuple(p for p in self.response if p.watches(request))

    def matching_views(self, views: Sequence[HttpSubject], *, watching: bool = False) -> ViewMatch:
        """One request seen in several views (the same request but for its path: the views of
        :func:`~guard.asgi._target.path_views`, lower-cased and without a trailing slash, then as sent): every policy
        that matches (``watching``: watches) any view, each once, in match order, each judged on the first view that
        it matches, whatever other policies match (a policy whose globs match only the path as sent, an upper-case
        glob, decides on that path, beside those that match the canonical view); and the request's subject: the first
        view that some policy matches, else the first.

        Raises:
            ValueError: ``views`` is empty.
        """
        if not views:
            raise ValueError("matching_views needs at least one view")
        find = self.watching if watching else self.matching
        found = [find(view) for view in views]
        judged = next((view for view, policies in zip(views, found, strict=True) if policies), views[0])
        if len(found) == 1:
            return ViewMatch(judged, found[0], {})
        first: dict[int, HttpSubject] = {}  # id(policy) -> the first view it matches
        for view, policies in zip(views, found, strict=True):
            for policy in policies:
                first.setdefault(id(policy), view)
        matched = tuple(p for p in (self.response if watching else self.policies) if id(p) in first)
        return ViewMatch(judged, matched, {p.id: first[id(p)] for p in matched if first[id(p)] is not judged})


def _read_headers(policies: Sequence[Policy]) -> frozenset[str] | None:
    """The request headers ``policies`` match on or read (:attr:`PolicyView.read_headers`)."""
    names: set[str] = set()
    for policy in policies:
        if policy.http is None:
            continue
        reads = policy.http_reads.headers
        if reads is None:
            return None
        names |= reads
        names.update(name for name, _ in policy.http.headers)
    return frozenset(names)


class ViewMatch(NamedTuple):
    """What :meth:`PolicyView.matching_views` found.

    Attributes:
        subject: the request's subject: the first view some policy matches, else the first view.
        policies: every policy that matches a view, in match order.
        views: policy id to the view that policy is judged on, for each policy judged on another view than
            ``subject`` (it matches only a later one); :func:`policy_subjects` applies it to a subject built later
            from ``subject`` (with its body, or a response's).
    """

    subject: HttpSubject
    policies: tuple[Policy, ...]
    views: Mapping[str, HttpSubject]


def policy_subjects(subject: HttpSubject, views: Mapping[str, HttpSubject]) -> dict[str, HttpSubject]:
    """``subject`` (built from :attr:`ViewMatch.subject`) as each policy of ``views`` is judged on it: its path the
    view's (``Guard.aevaluate(views=...)``). Policies judged on the same view share one copy: the engine asks the
    model once for the policies that judge the same subject (the same object) and can share a request."""
    copies: dict[tuple[str, str], HttpSubject] = {}
    for view in views.values():
        key = (view.path, view.sent_path)
        if key not in copies:
            copies[key] = dataclasses.replace(subject, path=view.path, sent_path=view.sent_path)
    return {policy_id: copies[(view.path, view.sent_path)] for policy_id, view in views.items()}


class PolicySet:
    """The live set of policies, in match order (files in the order given, policies in file order).

    Every policy whose ``match`` accepts a subject decides it (:meth:`matching`; the engine combines their verdicts).
    :meth:`reload` re-reads the source files; if any fails, the last good set stays active and the error is logged
    and raised.

    Attributes:
        sources: the files this set was loaded from (empty for sets built from text).
        stamps: each source's identity (:func:`file_stamp`) when the active set was read from it (empty when not
            known); :class:`~guard.policy.watch.PolicyWatcher` reloads when the files differ from it.
        reload_failures: how many reloads failed.
        policies_removed: how many policies successful reloads dropped (ids active before and absent after).
        last_removed: the latest such reload's dropped policies, as ``id (file)``; empty when none has dropped one.
    """

    def __init__(
        self,
        policies: Sequence[Policy],
        *,
        sources: Sequence[str | Path] = (),
        validator: Callable[[Sequence[Policy]], None] | None = None,
        stamps: Sequence[FileStamp] = (),
    ) -> None:
        self._view = PolicyView(tuple(policies))  # replaced whole by a reload: one attribute, read at once
        self.sources: tuple[Path, ...] = tuple(Path(s) for s in sources)
        self.stamps: tuple[FileStamp, ...] = tuple(stamps)
        self.validator = validator
        self.reload_failures = 0
        self.last_error: PolicyError | None = None
        self.policies_removed = 0
        self.last_removed: tuple[str, ...] = ()
        self._lock = threading.Lock()  # the swap of the active set
        self._reload_lock = threading.Lock()  # one reload at a time
        check_unique(self._view.policies)

    @property
    def policies(self) -> tuple[Policy, ...]:
        """The policies in load order (a reload replaces the whole set)."""
        return self._view.policies

    def view(self) -> PolicyView:
        """The active version of the set: what one request is matched on, from its head to its response."""
        return self._view

    def __iter__(self) -> Iterator[Policy]:
        return iter(self._view.policies)

    def __len__(self) -> int:
        return len(self._view.policies)

    def __getitem__(self, policy_id: str) -> Policy:
        for policy in self._view.policies:
            if policy.id == policy_id:
                return policy
        raise KeyError(policy_id)

    def match(self, subject: Subject) -> Policy | None:
        """The first policy that matches ``subject``, or ``None``."""
        for policy in self._view.policies:
            if policy.matches(subject):
                return policy
        return None

    def matching(self, subject: Subject) -> tuple[Policy, ...]:
        """:meth:`PolicyView.matching` of the active version."""
        return self._view.matching(subject)

    def watching(self, request: HttpSubject) -> tuple[Policy, ...]:
        """:meth:`PolicyView.watching` of the active version."""
        return self._view.watching(request)

    def replace(self, policies: Sequence[Policy]) -> None:
        """Swap in a new set after validating it; on error the current set stays.

        Raises:
            PolicyError: when two policies share an id or the validator (e.g. ``Guard``'s backend check) rejects one.
        """
        new = tuple(policies)
        check_unique(new)
        if self.validator is not None:
            self.validator(new)
        with self._lock:
            self._view = PolicyView(new)

    def forget_error(self, error: PolicyError) -> None:
        """Clear :attr:`last_error` when it is still ``error``: the change that failed to load was undone (the
        files are again those the active set was read from, :attr:`stamps`); a later reload's error stays."""
        with self._reload_lock:
            if self.last_error is error:
                self.last_error = None

    def reload(self) -> None:
        """Re-read :attr:`sources`. On any error the last good policies stay active. A reload that drops policies
        is applied, logged at WARNING naming them, and counted in :attr:`policies_removed`: a file cut short by a
        writer that stopped mid-write can parse as fewer policies.

        Raises:
            PolicyError: naming the file, line and key of the first problem, or the sources and any other error
                raised while loading (also logged, and counted in :attr:`reload_failures`).
        """
        with self._reload_lock:  # one reload at a time (the watcher's thread, a caller's Guard.reload()), its outcome too
            before = self._view.policies
            try:
                fresh = load_files(*self.sources)
                self.replace(fresh.policies)
                self.stamps = fresh.stamps
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # any other error (a validator's, MemoryError, a BaseException such as the
                # CEL runtime's PanicException) is a failed reload, counted and reported: the watcher's task lives on
                error = exc if isinstance(exc, PolicyError) else PolicyError(
                    ", ".join(str(source) for source in self.sources), None, "",
                    f"could not be loaded: {type(exc).__name__}: {exc}"[:300])
                self.reload_failures += 1
                self.last_error = error
                logger.error("policy reload failed; keeping the last good policies (%d active): %s", len(self), error,
                             exc_info=None if error is exc else exc)  # an unexpected error's traceback for the operator
                if error is exc:
                    raise
                raise error from exc
            self.last_error = None
            kept = {p.id for p in self._view.policies}
            removed = tuple(f"{p.id} ({p.file})" for p in before if p.id not in kept)
            if removed:
                self.policies_removed += len(removed)
                self.last_removed = removed
        if removed:
            logger.warning("policy reload removed %d active policies: %s; if that was not meant, a policy file may "
                           "have been cut short (a writer that stopped mid-write): restore it", len(removed),
                           ", ".join(removed))
        logger.info("policies reloaded: %s", ", ".join(p.label for p in self._view.policies))


def _response_policies(policies: Sequence[Policy]) -> tuple[Policy, ...]:
    return tuple(p for p in policies if p.http is not None and p.http.response is not None)


def check_unique(policies: Sequence[Policy]) -> None:
    """Refuse two policies with one id (the verdict, the decision log and reviews name a policy by its id).

    Raises:
        PolicyError: naming the second definition's file, line and key (``policies[1].id``), and where the first is.
    """
    seen: dict[str, Policy] = {}
    for policy in policies:
        if policy.id in seen:
            first = seen[policy.id]
            raise PolicyError(
                policy.file,
                policy.line,
                "id" if policy.index is None else f"policies[{policy.index}].id",
                f"policy id {policy.id!r} is already defined in {first.file}:{first.line}; ids must be unique",
            )
        seen[policy.id] = policy
