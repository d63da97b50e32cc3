"""``guard policy``: lint, explain and test policy files, and publish their JSON Schema.

Usage::

    guard policy check PATH...                         # files, directories, globs; line-numbered errors, exit 1 on any;
                                                       # lists overlapping policies (information, exit 0); loads the
                                                       # test file beside each policy file too
    guard policy explain FILE --input SUBJECT.json [--answers ANSWERS.json | --backend SPEC] [--timeout-ms MS] [--json]
    guard policy test PATH... [--set] [--backend SPEC] [--timeout-ms MS] [--run PATTERN] [--format text|json|junit] [-v]
    guard policy schema [--tests] [--output PATH | --check PATH]  # JSON Schema of policy (or test) files
    guard policy reference [--output PATH | --check PATH]  # that schema as a Markdown reference

``SUBJECT.json`` is ``{"http": {...}}`` or ``{"agent": {...}}`` (see ``guard/devtools/testing.py``). ``ANSWERS.json``
maps question keys to answer specs (``{"injection": 0.93}``). ``--backend`` is ``local:CHECKPOINT_DIR`` (in-process
Clef, on ``--device`` in ``--dtype``), ``http:URL`` or a bare ``http(s)://`` URL (a System One server) or ``compact``
(the built-in CPU model); it is started (warmed up) before anything is timed. ``--timeout-ms`` replaces the policies'
``timeout_ms``, e.g. for a checkpoint on a slow CPU. A PATH is a file, a directory (every ``*.yaml`` below) or a glob;
``*_test.yaml`` files stand for the policy beside them. ``test`` runs ``<name>_test.yaml`` beside each policy
(against that policy file alone; with ``--set`` against every file given, as one deployment), names each failure by
its test file and line, lists the rules no case fired (coverage), warns about a policy without a test file or a test
file without cases, and exits 1 on a failing case (and, with ``--fail-on-empty``, when no case ran).
``explain`` exits 1 when the decision failed (the fail mode decided).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import unicodedata
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any, TextIO

from guard._readable import INVISIBLE
from guard.backends.options import add_backend_options, backend_factory, check_device_options, open_cli_backend
from guard.cli._args import positive_milliseconds
from guard.cli._output import write_utf8
from guard.errors import GuardError, PolicyError

__all__ = ["reference_markdown", "register", "schema_json"]

EXIT_FAILED = 1
EXIT_USAGE = 2
#: Largest ``--check`` file read by ``guard policy schema|reference`` (the generated files are tens of KiB).
MAX_CHECK_BYTES = 4 << 20
#: Largest ``--input`` / ``--answers`` file read by ``guard policy explain``: the worker's largest request body
#: (``guard.worker.app.DEFAULT_MAX_BODY_BYTES``), as for ``guard decide``.
MAX_INPUT_BYTES = 8 << 20
SCHEMA_ID = "https://github.com/guard/guard/policies/guard-policy.schema.json"


def register(subparsers: Any) -> None:
    """Add ``guard policy check|explain|test|schema|reference``."""
    parser = subparsers.add_parser("policy", help="check, explain and test policy files")
    sub = parser.add_subparsers(dest="policy_command", required=True, metavar="ACTION")

    check = sub.add_parser("check", help="validate policy files; errors name file, line and key")
    check.add_argument("files", nargs="+", metavar="PATH")
    check.set_defaults(handler=run_check)

    explain = sub.add_parser("explain", help="show state, answers, rules and verdicts for one subject")
    explain.add_argument("file", metavar="FILE")
    explain.add_argument("--input", required=True, metavar="SUBJECT.json", help='{"http": {...}} or {"agent": {...}}')
    source = explain.add_mutually_exclusive_group()
    source.add_argument(
        "--answers",
        metavar="ANSWERS.json",
        help="question key -> answer spec, instead of a model (with neither --answers nor --backend every question "
        "gets uniform probabilities, which shows the rules but decides nothing)",
    )
    add_backend_options(explain, default=None, group=source)
    _add_timeout_option(explain)
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    explain.set_defaults(handler=run_explain)

    test = sub.add_parser("test", help="run <name>_test.yaml cases; fails on a failing case")
    test.add_argument("files", nargs="+", metavar="PATH")
    test.add_argument("--run", metavar="PATTERN", default=None, help="only cases whose name matches this regex")
    test.add_argument("--format", choices=("text", "json", "junit"), default="text", help="report format on stdout")
    add_backend_options(test, default=None, note="for cases without 'answers'")
    _add_timeout_option(test)
    test.add_argument("-v", "--verbose", action="store_true", help="list passing cases too")
    test.add_argument("--set", action="store_true",
                      help="judge every test file's cases against all the policy files given, loaded as one set (one "
                      "deployment, as Guard.from_files and the proxy load them); without it each test file is judged "
                      "against its own policy file")
    test.add_argument("--fail-on-empty", action="store_true",
                      help="exit 1 when no test case ran (no test file, or only empty ones), as opa test does")
    test.set_defaults(handler=run_test)

    schema = sub.add_parser("schema", help="print (or write, or check) the policy file JSON Schema")
    schema.add_argument("--tests", action="store_true", help="the schema of <name>_test.yaml files instead")
    target = schema.add_mutually_exclusive_group()
    target.add_argument("--output", metavar="PATH", help="write the schema here (new, or a schema written before)")
    target.add_argument("--check", metavar="PATH", help="exit 1 when PATH differs from the generated schema")
    schema.set_defaults(handler=run_schema)

    reference = sub.add_parser("reference", help="print (or write, or check) the Markdown policy file reference")
    target = reference.add_mutually_exclusive_group()
    target.add_argument("--output", metavar="PATH", help="write the reference here (new, or a reference written before)")
    target.add_argument("--check", metavar="PATH", help="exit 1 when PATH differs from the generated reference")
    reference.set_defaults(handler=run_reference)


def _add_timeout_option(parser: Any) -> None:
    parser.add_argument(
        "--timeout-ms", type=positive_milliseconds, default=None, metavar="MS",
        help="replace the policies' timeout_ms (e.g. for a checkpoint on a slow CPU)",
    )  # fmt: skip


def _timeout_s(args: argparse.Namespace) -> float | None:
    """``--timeout-ms`` (a finite number > 0, checked by its argparse type) in seconds, ``None`` without it."""
    return None if args.timeout_ms is None else args.timeout_ms / 1000.0


def _problems(exc: PolicyError) -> list[PolicyError]:
    return list(getattr(exc, "problems", None) or [exc])


def _load_error(file: str, line: int | None, key: str | None, message: str) -> dict[str, Any]:
    """A file that does not load, as ``policy test --format json`` reports it: ``{file, line, key, message}``."""
    return {"file": file, "line": line, "key": key, "message": message}


def _error_text(error: dict[str, Any]) -> str:
    """``file:line: key: message`` (line and key when known)."""
    where = f"{error['file']}:{error['line']}" if error["line"] is not None else error["file"]
    key = f" {error['key']}:" if error["key"] else ""
    return f"{where}:{key} {error['message']}"


def _printed(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``errors``, after printing each to stderr."""
    for error in errors:
        key = error["key"] and _shown(error["key"], words=False)  # a key shows every invisible character escaped
        _say(_error_text({**error, "key": key}), file=sys.stderr)
    return errors


def _print_problem(problem: PolicyError) -> None:
    _printed([_load_error(problem.file, problem.line, problem.key, problem.reason)])


def run_check(args: argparse.Namespace) -> int:
    from guard.devtools.testing import expand_policy_paths, load_policy_file
    from guard.policy import check_unique

    try:
        files = expand_policy_paths(args.files)
    except (OSError, ValueError) as exc:  # no file matches; a glob that is not a pattern
        _say(f"guard policy check: {exc}", file=sys.stderr)
        return EXIT_FAILED
    failed = False
    loaded = []
    for policy_file, test_files in files.items():
        name = str(policy_file)
        try:
            policies = load_policy_file(name)
            check_unique([*loaded, *policies])  # the files checked together are loaded together: ids must be unique
        except PolicyError as exc:  # a file that cannot be read too
            for problem in _problems(exc):
                _print_problem(problem)
            failed = True
        else:
            ids = ", ".join(p.label for p in policies)
            _say(f"ok {name}: {len(policies)} {'policy' if len(policies) == 1 else 'policies'} ({ids})")
            _warn_upper_case_paths(policies)
            _warn_unknown_methods(policies)
            loaded.extend(policies)
        for test_file in test_files:
            failed |= not _check_test_file(test_file)
    _print_overlaps(loaded)
    return EXIT_FAILED if failed else 0


def _check_test_file(test_file: Path) -> bool:
    """Load the test file ``test_file`` as ``guard policy test`` reads it (its shape, each ``expect`` checks
    something; no case is run) and print ``ok`` or its errors. False when it has errors."""
    from guard.devtools.testing import load_test_file

    try:
        cases, _ = load_test_file(test_file)
    except PolicyError as exc:
        for problem in _problems(exc):
            _print_problem(problem)
        return False
    _say(f"ok {test_file}: {len(cases)} {'case' if len(cases) == 1 else 'cases'}")
    return True


def _warn_upper_case_paths(policies: list[Any]) -> None:
    """Warn about path globs with upper-case letters: the middleware matches a request's lower-cased path first
    (``path_case="fold"``, the default), so such a glob judges only requests spelt in its exact case."""
    for policy in policies:
        for glob in policy.http.globs[0] if policy.http is not None else ():
            if glob != glob.lower():
                _say(f"warning: {policy.file}:{policy.line}: policy {policy.id}: path {glob!r} has upper-case "
                     f"letters; requests are matched on their lower-cased path first (path_case='fold', the "
                     f"default), so a request for {glob.lower()!r} is not judged by it: write paths in lower case "
                     "(docs/http.md)", file=sys.stderr)


def _warn_unknown_methods(policies: list[Any]) -> None:
    """Warn about a method outside the IANA registry (``KNOWN_METHODS``): probably misspelt (``POTS``), and then the
    policy judges no request."""
    import difflib

    from guard.policy.model import KNOWN_METHODS

    for policy in policies:
        for method in sorted(policy.http.methods) if policy.http is not None else ():
            if method.upper() not in KNOWN_METHODS:
                near = difflib.get_close_matches(method.upper(), KNOWN_METHODS, n=1, cutoff=0.6)
                hint = f"did you mean {near[0]!r}? " if near else ""
                _say(f"warning: {policy.file}:{policy.line}: policy {policy.id}: method {method!r} is not a "
                     f"registered HTTP method; {hint}requests with another method are not judged by this policy",
                     file=sys.stderr)


def _print_overlaps(policies: list[Any]) -> None:
    """List the pairs of policies that can match one subject (information: enforced ones all decide, the most severe
    verdict wins; a shadow one's verdict is only recorded)."""
    from guard.policy.overlap import overlapping_pairs

    for a, b, kinds in overlapping_pairs(policies):
        _say(
            f"overlap {a.id} ({a.file}:{a.line}) and {b.id} ({b.file}:{b.line}): both match some "
            f"{' and '.join('HTTP requests' if k == 'http' else 'agent events' for k in kinds)}; {_combined(a, b)}"
        )


def _combined(a: Any, b: Any) -> str:
    """What decides a subject both policies match, by their modes."""
    from guard.verdict import ACTIONS

    shadow = [p for p in (a, b) if p.mode == "shadow"]
    if not shadow:
        return f"both decide, the most severe verdict wins ({' > '.join(ACTIONS)})"
    if len(shadow) == 2:
        return "both are shadow: both verdicts are recorded and the subject is allowed"
    enforced = b if shadow[0] is a else a
    return f"{shadow[0].id} is shadow: {enforced.id} decides, {shadow[0].id}'s verdict is only recorded"


def _read_json(option: str, path: str) -> Any:
    """The JSON document in ``path``.

    Raises:
        ValueError: the file cannot be read or holds no valid JSON, naming ``option`` and ``path``.
    """
    from guard._json import loads
    from guard._readfile import FileRefused, read_capped

    try:  # a FIFO (a shell's <(...)) is read too, but never more than MAX_INPUT_BYTES: /dev/zero is refused
        data = read_capped(path, MAX_INPUT_BYTES, streams=True)
    except FileRefused as exc:
        raise ValueError(f"{option} {path}: {'is a directory, not a file' if exc.kind == 'a folder' else exc}") from None
    except OSError as exc:
        reason = {FileNotFoundError: "no such file", IsADirectoryError: "is a directory, not a file"}.get(
            type(exc), exc.strerror or str(exc)
        )
        raise ValueError(f"{option} {path}: {reason}") from None
    try:
        return loads(data)
    except ValueError as exc:  # InvalidJson: "invalid JSON: ... at line L column C"
        raise ValueError(f"{option} {path}: {exc}") from None


UNIFORM_NOTE = (
    "guard policy explain: no --answers or --backend given: every question is answered with uniform probabilities "
    "(noul 0.5, each of n options 1/n), so the verdict below only shows how the rules read; pass --answers FILE or "
    "--backend SPEC for real answers"
)


def run_explain(args: argparse.Namespace) -> int:
    from guard.devtools.explain import explain

    try:
        timeout_s = _timeout_s(args)
        check_device_options(args)
        subject_data = _read_json("--input", args.input)
        answers = _read_json("--answers", args.answers) if args.answers else None
        if args.answers and not isinstance(answers, dict):  # [] or null would answer nothing, silently
            raise ValueError(f"--answers {args.answers}: must be a JSON object of question key -> answer spec "
                             '({"injection": 0.93})')
        factory: Callable[[], Any] | None = (lambda: open_cli_backend(args)) if args.backend else None
        report = asyncio.run(
            explain(args.file, subject_data, answers=answers, backend_factory=factory, timeout_s=timeout_s)
        )
    except PolicyError as exc:
        for problem in _problems(exc):
            _print_problem(problem)
        return EXIT_FAILED
    except (OSError, ValueError, GuardError, ImportError) as exc:
        print(f"guard policy explain: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if answers is None and factory is None and any(part["questions"] and not part.get("refused_state")
                                                   for part in report["matched"]):
        print(UNIFORM_NOTE, file=sys.stderr)  # the answers were made up: only the rules' reading is shown
    if args.json:
        write_utf8(_json_text(report, default=repr) + "\n")
    else:
        _print_report(report)
    return EXIT_FAILED if report["error"] else 0


def _print_report(report: dict[str, Any]) -> None:
    from guard.policy.policy import policy_label

    if report["policy"] is None:
        _say("no policy matches this subject: allow, without a model call")
        return
    p = report["policy"]
    v = report["verdict"]
    _say(f"policy     {policy_label(p['id'], p['version'], p['digest'])} ({p['file']}:{p['line']}, mode {p['mode']})")
    if report.get("refused_state"):  # the policy does not judge this subject: no model call, no rules
        _say(f"state      refused: {report['refused_state']}")
    else:
        _say(f"state      {json.dumps(report['state'], ensure_ascii=False)}")
    if report["rule_state"] != report["state"]:
        _say(f"rules read {json.dumps(report['rule_state'], ensure_ascii=False)}  (the state as received)")
    if report["flags"]:
        _say(f"flags      {json.dumps(report['flags'])}  (original text kept in the subject)")
    if report["cache_key"] is not None:  # a rules-only policy asks no model
        _say(f"cache key  {report['cache_key']}  (backend {report['backend']}, revision {report['revision']})")
    for name, features in report["features"].items():  # call: argument provenance; result: instructions found
        _say(f"{name:<10} {json.dumps(features, ensure_ascii=False)}")
    if report["error"]:
        _say(f"FAILED     {report['error']}")
        _say(f"           fail mode {v['fail_mode']} decided: {v['action']} (status {v.get('status')})")
    if report.get("refused_state"):
        _say("answers    none: the state was refused before the model was asked")
        _say("rules      not evaluated: the policy does not judge this subject")
    elif report["error"] and not report["rules"]:
        _say("answers    none: the decision failed before the backend answered")
        _say("rules      not evaluated: there are no answers to run them on")
    else:
        _say("answers")
        for key, answer in report["answers"].items():
            _say(f"  {key:<20} {json.dumps(answer, ensure_ascii=False)}")
        _say("rules (in order; the first true one decides)")
        for rule_id, value in report["rules"]:
            _say(f"  {rule_id:<20} {value}")
    _say(f"verdict    {v['action']} (rule {v['rule']}, status {v.get('status')}) {v.get('message') or ''}".rstrip())
    for redaction in v.get("redactions") or ():  # what a redact verdict masks, where
        _say(f"  masks    {redaction['pointer'] or '(body)'} [{redaction['start']}:{redaction['end']}] "
              f"{redaction['label']} ({redaction['style']})")
    if len(report["matched"]) > 1:
        _say("matched    (every policy decides; the most severe verdict wins)")
        for part in report["matched"]:
            own, mark = part["own_verdict"], "  <- decided" if part["policy"]["id"] == p["id"] else ""
            _say(f"  {part['policy']['id']:<20} {own['action']} (rule {own['rule']}){mark}")
    if not report["questions"]:
        _say("on backend failure  (none: this policy asks no question, so it calls no backend)")
        return
    _say("on backend failure")
    for mode, failed in report["fail_modes"].items():
        marker = "  <- this policy" if mode == report["fail_mode"] else ""
        _say(f"  {mode:<9} -> {failed['action']} (status {failed.get('status')}){marker}")


def run_test(args: argparse.Namespace) -> int:
    import re

    from guard.devtools.testing import (
        CaseResult,
        expand_policy_paths,
        find_test_file,
        load_policy_file,
        run_test_file,
    )
    from guard.policy import check_unique

    try:
        timeout_s = _timeout_s(args)
        check_device_options(args)
        factory: Callable[[], Any] | None = backend_factory(args) if args.backend else None
        pattern = re.compile(args.run) if args.run else None
        files = expand_policy_paths(args.files)
    except re.error as exc:
        print(f"guard policy test: --run {args.run!r} is not a regular expression: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, ValueError) as exc:
        _say(f"guard policy test: {exc}", file=sys.stderr)
        return EXIT_USAGE
    text = args.format == "text"
    suites: list[tuple[str, list[CaseResult]]] = []
    errors: list[dict[str, Any]] = []  # what did not load
    broken = 0
    loaded: dict[Path, list[Any]] = {}  # each policy file that loaded -> its policies
    for policy_file in files:
        try:
            policies = load_policy_file(policy_file)  # a policy without tests must load too
            check_unique([*chain.from_iterable(loaded.values()), *policies])  # as check: one set, unique ids
        except PolicyError as exc:
            errors += _printed([_load_error(p.file, p.line, p.key, p.reason) for p in _problems(exc)])
            broken += 1
            continue
        loaded[policy_file] = policies
    if args.set and broken:  # the deployment would not load: no case is judged against part of it
        _say(f"guard policy test: --set: {broken} file(s) did not load, so the set would not; no case ran",
             file=sys.stderr)
        loaded = {}
    deployment = list(chain.from_iterable(loaded.values()))
    fired: set[tuple[str | None, str | None]] = set()  # (policy id, rule id) of each rule a case fired
    tested: dict[Path, list[Any]] = {}  # each policy file a test file of which ran -> its policies
    for policy_file, policies in loaded.items():
        if not files[policy_file]:
            _say(f"warning: {policy_file}: no test file ({find_test_file(policy_file)[1].name})", file=sys.stderr)
        for test_file in files[policy_file]:
            try:
                results = run_test_file(test_file, backend_factory=factory, timeout_s=timeout_s, run=pattern,
                                        policies=deployment if args.set else policies)
            except PolicyError as exc:
                errors += _printed([_load_error(p.file, p.line, p.key, p.reason) for p in _problems(exc)])
                broken += 1
                continue
            except OSError as exc:
                unread = _load_error(str(exc.filename or test_file), None, None, f"cannot read: {exc.strerror}")
                errors += _printed([unread])
                broken += 1
                continue
            if not results:
                _say(f"warning: {test_file}: no test cases" + (" match --run" if pattern else ""), file=sys.stderr)
            suites.append((str(test_file), results))
            tested[policy_file] = policies
            # a rule of a policy that matched but did not decide fired too
            fired |= {(v.policy_id, v.rule) for r in results if r.verdict is not None
                      for v in (r.verdict, *r.verdict.contributions, *r.late)}  # fmt: skip
            for result in results:
                where = f"{test_file}:{result.line}" if result.line is not None else str(test_file)
                if result.passed:
                    if args.verbose and text:
                        _say(f"PASS {where}: {result.name}")
                    continue
                _say(f"FAIL {where}: {result.name}", file=sys.stderr)
                for difference in result.problems:
                    _say(f"     {difference}", file=sys.stderr)
    uncovered = [] if pattern is not None else [
        f"{policy_file}: {p.id}/{rule.id}" for policy_file, policies in tested.items() for p in policies
        for rule in p.rules if (p.id, rule.id) not in fired]  # fmt: skip
    total = sum(len(results) for _, results in suites)
    failed = sum(not r.passed for _, results in suites for r in results)
    unmatched = pattern is not None and not total and not broken  # a filter that selects nothing tests nothing
    if unmatched:
        print(f"guard policy test: no case matches --run {args.run!r}", file=sys.stderr)
    empty = not total and not broken and not unmatched  # no test file, or only empty ones: nothing was tested
    if empty:
        print(f"{'guard policy test' if args.fail_on_empty else 'warning'}: no test case ran: looked for "
              f"<name>_test.yaml (or .yml) beside each of the {len(files)} policy file(s) in {' '.join(args.files)}",
              file=sys.stderr)
    if args.format == "json":
        write_utf8(_json_text(_json_report(suites, uncovered, errors)) + "\n")
    elif args.format == "junit":
        write_utf8(_junit_report(suites, errors) + "\n")
    else:
        for line in uncovered:
            _say(f"not covered {line}")
        print(f"{total - failed} passed, {failed} failed" + (f", {broken} files broken" if broken else ""))
    return EXIT_FAILED if failed or broken or unmatched or (empty and args.fail_on_empty) else 0


#: An emoji tag sequence (a subdivision flag: U+1F3F4, tag letters, U+E007F cancel tag), or one character of text
#: output that is not printable ASCII (whose category is looked up).
_NOT_PLAIN = re.compile("\U0001f3f4[\U000e0020-\U000e007e]+\U000e007f|[^\x20-\x7e]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_JOINERS = "\u200c\u200d"  # zero-width non-joiner and joiner
_PRESENTATION = "\ufe0e\ufe0f"  # text and emoji presentation selectors


def _say(text: str, file: TextIO | None = None) -> None:
    """Print a line of text output with each character a terminal would act on or not show written as Python writes
    it in a string (:func:`_shown`): names, keys and values from policy and test files never act on the terminal,
    hide in it (``default\\u200b: unknown key``) nor stop the output."""
    print(_shown(text), file=file)


def _shown(text: str, *, words: bool = True) -> str:
    """``text`` with each control character (C0, DEL, C1), lone surrogate (which UTF-8 cannot carry) and character
    a reader cannot see (:data:`~guard._readable.INVISIBLE`: format characters, line and paragraph separators,
    variation selectors, Hangul fillers and the other default-ignorable code points) written as Python writes it in
    a string (``\\x1b``, ``\\n``, ``\\u200b``, ``\\ud800``). With ``words`` (free text) what writing in words and
    emoji needs stays: a zero-width non-joiner or joiner between two letters or emoji outside ASCII (Persian, Indic
    scripts, an emoji ZWJ sequence), U+FE0E or U+FE0F after a character outside ASCII (an emoji's presentation), a
    soft hyphen between two letters and an emoji tag sequence (a subdivision flag); a key is shown with
    ``words=False``."""
    return _NOT_PLAIN.sub(lambda found: _escaped(found, words=words), text)


def _escaped(found: re.Match[str], *, words: bool) -> str:
    """The text ``found`` by :data:`_NOT_PLAIN` as :func:`_shown` writes it."""
    char, head, after = found.group(), found.string[: found.start()], found.string[found.end() : found.end() + 1]
    if words and len(char) > 1:  # an emoji tag sequence
        return char
    if unicodedata.category(char) not in ("Cc", "Cs") and not INVISIBLE.fullmatch(char):
        return char
    if words and _needed_in_words(char, head, after):
        return char
    escaped = repr(char)[1:-1]  # repr leaves the printable ones as they are (U+034F, U+3164: marks, letters)
    return escaped if escaped != char else f"\\u{ord(char):04x}" if char <= "\uffff" else f"\\U{ord(char):08x}"


def _needed_in_words(char: str, head: str, after: str) -> bool:
    """Whether the invisible ``char`` between ``head`` and the character ``after`` is one that writing in words and
    emoji needs (:func:`_shown`)."""
    if char in _PRESENTATION:
        return _word_part(head[-1:], "LMS")
    if char in _JOINERS:
        return _word_part(head.rstrip(_PRESENTATION)[-1:], "LMS") and _word_part(after, "LS")
    return char == "\xad" and head[-1:].isalpha() and after.isalpha()  # a soft hyphen inside a word


def _word_part(char: str, categories: str) -> bool:
    """Whether ``char`` is one visible character outside ASCII whose Unicode category starts with one of
    ``categories`` (``L`` letters, ``M`` marks, ``S`` symbols such as emoji)."""
    return (len(char) == 1 and char > "\x7f" and not INVISIBLE.fullmatch(char)
            and unicodedata.category(char)[0] in categories)


def _json_text(value: Any, **options: Any) -> str:
    """``value`` as indented JSON with non-ASCII text as it is, a lone surrogate (a YAML ``"\\ud800"`` in a case
    name) written as its ``\\uXXXX`` escape, which JSON allows and UTF-8 cannot carry."""
    text = json.dumps(value, indent=2, ensure_ascii=False, **options)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _json_report(
    suites: list[tuple[str, list[Any]]], uncovered: list[str], errors: list[dict[str, Any]]
) -> dict[str, Any]:
    """``{"results": [{file, line, name, passed, problems, action, rule}], "not_covered": [...],
    "errors": [{file, line, key, message}]}`` (``errors``: the files that did not load)."""
    results = [
        {
            "file": file, "line": r.line, "name": r.name, "passed": r.passed, "problems": r.problems,
            "action": r.verdict.action if r.verdict is not None else None,
            "rule": r.verdict.rule if r.verdict is not None else None,
        }
        for file, rs in suites for r in rs
    ]  # fmt: skip
    return {"results": results, "not_covered": uncovered, "errors": errors}


#: Characters XML 1.0 does not allow anywhere in a document (ElementTree writes them as they are).
_XML_INVALID = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _junit_report(suites: list[tuple[str, list[Any]]], errors: list[dict[str, Any]]) -> str:
    """JUnit XML: one ``<testsuite>`` per test file, a ``<failure>`` per failing case listing its differences, and
    per file that did not load a ``<testsuite>`` with one ``<testcase>`` per load error, holding an ``<error>``."""
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites", name="guard policy test")
    for file in dict.fromkeys(error["file"] for error in errors):
        own = [error for error in errors if error["file"] == file]
        suite = ET.SubElement(root, "testsuite", name=file, tests=str(len(own)), failures="0", errors=str(len(own)))
        for error in own:
            case = ET.SubElement(suite, "testcase", classname=file, name=error["key"] or "load",
                                 file=file, line=str(error["line"] or 0))  # fmt: skip
            ET.SubElement(case, "error", message=_error_text(error))
    for file, results in suites:
        failures = sum(not r.passed for r in results)
        suite = ET.SubElement(root, "testsuite", name=file, tests=str(len(results)), failures=str(failures))
        for r in results:
            case = ET.SubElement(suite, "testcase", classname=file, name=r.name, file=file, line=str(r.line or 0))
            if not r.passed:
                ET.SubElement(case, "failure", message=r.problems[0] if r.problems else "failed").text = "\n".join(
                    r.problems
                )
    root.set("tests", str(sum(len(rs) for _, rs in suites) + len(errors)))
    root.set("failures", str(sum(not r.passed for _, rs in suites for r in rs)))
    root.set("errors", str(len(errors)))
    # a name or message holding a control character (a test file's key) would make the file unreadable as XML
    return _XML_INVALID.sub("\ufffd", ET.tostring(root, encoding="unicode", xml_declaration=True))


def schema_json() -> str:
    """The policy file JSON Schema (draft 2020-12), as text with a trailing newline."""
    from guard.policy.model import PolicyFileSpec

    schema = PolicyFileSpec.model_json_schema(by_alias=True)
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        **schema,
        "title": "guard policy file",  # after the spread: pydantic's own title is the class name
    }
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def reference_markdown() -> str:
    """The policy file reference (``docs/policy-reference.md``): :func:`schema_json` rendered as Markdown."""
    from guard.policy.reference import render_reference

    return render_reference(json.loads(schema_json()))


def run_schema(args: argparse.Namespace) -> int:
    if args.tests:
        from guard.devtools.testing import test_file_schema

        return _emit(json.dumps(test_file_schema(), indent=2, ensure_ascii=False) + "\n", args, "schema --tests")
    return _emit(schema_json(), args, "schema")


def run_reference(args: argparse.Namespace) -> int:
    return _emit(reference_markdown(), args, "reference")


def _read_text(path: str) -> str:
    """The text of the file at ``path``, newlines read as ``read_text`` reads them: a regular file of at most
    :data:`MAX_CHECK_BYTES` (a device or FIFO such as /dev/zero is refused before any read).

    Raises:
        OSError, FileRefused, UnicodeDecodeError: it cannot be read, is not such a file, or is not UTF-8.
    """
    from guard._readfile import read_capped

    current = read_capped(path, MAX_CHECK_BYTES).decode("utf-8")
    return current.replace("\r\n", "\n").replace("\r", "\n")


def _is_generated(current: str, text: str) -> bool:
    """Whether ``current`` is a file this command wrote, in this or another version: it starts with the generated
    ``text``'s first three lines (the schema's ``$schema`` and ``$id``, the reference's "Generated ..." comment)."""
    return current.split("\n")[:3] == text.split("\n")[:3]


def _emit(text: str, args: argparse.Namespace, command: str) -> int:
    """Print ``text``, write it to ``--output`` (a new file or one this command wrote), or with ``--check`` exit 1
    when that file differs from it (suggesting ``--output`` only for a file this command wrote)."""
    from guard._readfile import FileRefused

    if args.check:
        try:
            current = _read_text(args.check)
        except OSError as exc:
            print(f"{args.check}: cannot read: {exc.strerror}", file=sys.stderr)
            return EXIT_FAILED
        except FileRefused as exc:
            print(f"{args.check}: cannot read: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except UnicodeDecodeError:
            print(f"{args.check}: not UTF-8 text, so not the output of guard policy {command}", file=sys.stderr)
            return EXIT_FAILED
        if current == text:
            print(f"ok {args.check}")
            return 0
        if _is_generated(current, text):
            print(f"{args.check} is out of date; run: guard policy {command} --output {args.check}", file=sys.stderr)
        else:
            print(f"{args.check} differs and is not the output of guard policy {command} (its first lines differ); "
                  "check the file that command wrote", file=sys.stderr)
        return EXIT_FAILED
    if args.output:
        if os.path.lexists(args.output):
            try:
                written = _is_generated(_read_text(args.output), text)
            except (OSError, FileRefused, UnicodeDecodeError):
                written = False
            if not written:
                print(f"guard policy {command}: --output {args.output} exists and is not the output of guard policy "
                      f"{command}; it is not overwritten (give a new path, or remove the file first)", file=sys.stderr)
                return EXIT_USAGE
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            print(f"guard policy {command}: --output {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE
        return 0
    write_utf8(text)
    return 0
