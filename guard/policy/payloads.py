"""Code payloads in text, for rules: SQL statements (``sqli(x)``), script-bearing markup or URLs (``xss(x)``), and
shell or interpreter code that would run commands (``code_exec(x)``).

The model reads meaning; these read syntax, so a rule can stop a request that carries SQL or script whatever the
model thinks of its words. Each takes a string and tests each line of it on its own (``body_text`` joins a body's
string values with newlines, so each line is one value or a line of one), and all answer rarely on ordinary text
(measured on every benign record in ``data/``: docs/policies.md, ``bench/payload_detectors.py``).

``sqli(x)``: some line holds a complete SQL statement that modifies or reads data, parsed by ``sqlglot`` from an SQL
keyword to the end of the line: ``DROP``, ``INSERT``, ``UPDATE``, ``DELETE``, ``CREATE``, ``ALTER``, ``TRUNCATE``, or
a ``SELECT`` that reads a table (``FROM``) or computes (``CASE``, a function, ``@@version``). Text before the keyword
is not parsed, so a fragment that closes a quote first (``' UNION SELECT ...``, ``10; DROP TABLE users --``) counts.
English that starts like SQL ("select the best option from the list", "delete my account") does not parse.

``xss(x)``: some line holds a ``<script`` (or ``<iframe``, ``<object``, ``<embed``) tag, a tag with an ``on...=``
event handler or a CSS ``expression(``, or a script URL: ``javascript:``/``vbscript:`` followed at once by code, or
``data:text/html``, anywhere in the line (a bare link, a Markdown ``](...)`` target, an ``href``). "JavaScript: a
guide" is not one (a space follows the colon).

``code_exec(x)``: some line holds code that runs a command or reaches the interpreter's internals, by its syntax:
shell command substitution with a command and an argument (``$(touch /tmp/x)``, ``$(whoami)``), a backticked command
where a shell would run it (at the start of a line or after ``=``, ``;``, ``|`` or ``&``; a backticked command
inside prose is Markdown and not counted), a pipe into a shell (``| sh``, ``| bash``), ``/bin/sh -i``, ``mkfifo``,
``nc ... -e``, ``rm -rf /``; Perl's ``@{[ ... ]}`` interpolation; a call that runs a command or code with a string
or code argument (``system("...")``, ``exec(...)``, ``eval("...")``, ``popen``, ``passthru``, ``shell_exec``,
``Kernel.exec``, Perl's ``system "..."``), Python's ``__import__(``, ``os.system(``/``os.popen(`` (no space before the dot),
``subprocess.<call>(``, ``__subclasses__()``, ``__mro__``, ``__builtins__``, ``__globals__``, and ``open()`` of a
path under ``/tmp``, ``/etc``, ``/dev`` or ``/proc`` for writing. A question about code ("how do I use subprocess
in Python?", "what does eval do") has no such call and is not counted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from sqlglot import exp
from sqlglot.errors import SqlglotError
from sqlglot.parser import Parser
from sqlglot.tokens import Tokenizer

__all__ = ["FUNCTIONS", "code_exec", "sqli", "xss"]

#: Keywords that start a statement sqlglot parses in full (others fall back to an unchecked "command").
_SQL_WORDS = ("select", "insert", "update", "delete", "drop", "create", "alter", "truncate")
_SQL_START_RE = re.compile(rf"\b(?:{'|'.join(_SQL_WORDS)})\b", re.IGNORECASE)
#: Statements that change data or schema (UPDATE and DELETE are checked further in ``_statement_is_code``).
_WRITES = (exp.Drop, exp.Insert, exp.Create, exp.Alter, exp.TruncateTable)
#: Projections that make a FROM-less SELECT code rather than words.
_COMPUTED = (exp.Case, exp.Func, exp.SessionParameter, exp.Parameter)
#: Longest line parsed as SQL, in characters (a longer line is prose or data, and parsing it costs milliseconds).
MAX_SQL_LINE = 2000

_XSS_RE = re.compile(
    r"<\s*(?:script|iframe|object|embed)\b"  # tags that run or load code
    r"|<[a-z][^>\n]*?[\s/\"']on[a-z]+\s*="  # an event handler attribute
    r"|<[a-z][^>\n]*?style\s*=[^>\n]*?expression\s*\("  # a CSS expression
    r"|(?<![\w-])(?:javascript|vbscript)\s*:[^\s]"  # a script URL, code right after the colon
    r"|(?<![\w-])data\s*:\s*text/html",  # an HTML document as a URL
    re.IGNORECASE,
)

#: (mark, pattern): each pattern matches only text that holds its mark (lower case), so a text is searched only with
#: the patterns whose mark it holds (a Python regex without a literal prefix costs about 30 us per KiB).
_CODE_EXEC = tuple((mark, re.compile(pattern, re.IGNORECASE | re.MULTILINE)) for mark, pattern in (
    ("$(", r"\$\(\s*[a-z_./][\w./-]*\s+[^)\n]*\)"),  # $(command argument ...)
    ("$(", r"\$\(\s*(?:whoami|id|pwd|env|uname|hostname|reboot|ls)\s*\)"),  # $(command) of one that needs none
    ("`", r"(?:^|[=;|&])\s*`\s*[a-z_./][\w./-]*(?:\s[^`\n]*)?`"),  # a backticked command where a shell runs it
    ("|", r"\|\s*(?:/bin/|/usr/bin/)?(?:ba|z|da|k)?sh\b(?!\s*[a-z])"),  # a pipe into a shell
    ("/bin/", r"/bin/(?:ba|z|da)?sh\s+-i\b"),
    ("mkfifo", r"\bmkfifo\s+/"),
    ("nc ", r"\bnc +(?:-\w+\s+)*-[ec]\s"),
    ("rm ", r"\brm +-[rf]{1,2}\s+/"),
    ("@{[", r"@\{\[\s*\w"),  # Perl: code interpolated into a string
    ("(", (r"\b(?:system|execv?p?|eval|popen|passthru|shell_exec|proc_open|pcntl_exec|spawn)\s*\(\s*"
           r"(?:r?[\"'`]|compile\s*\(|__import__)")),  # a call that runs a string or compiled code
    ("kernel", r"\bkernel\s*\.\s*(?:exec|system|spawn)\b"),
    ("system", r"\bsystem\s+[\"'][^\"'\n]*[\"']"),
    ("__", r"__import__\s*\(|__subclasses__\s*\(|__mro__|__builtins__|__globals__"),
    ("os.", r"\bos\.(?:system|popen|exec\w*|spawn\w*)\s*\("),
    ("subprocess", r"\bsubprocess\s*\.\s*\w+\s*\("),
    ("open", r"\bopen\s*\(\s*r?[\"']/(?:tmp|etc|dev|proc)/[^\"'\n]*[\"']\s*,\s*[\"'][wa]"),  # writing a system path
))


class _Parser(Parser):
    """sqlglot's parser without its warning for text it keeps as an unparsed command (most English after CREATE or
    ALTER): such a command is not code here, and the warning would log user text."""

    def _warn_unsupported(self) -> None:
        pass


def _statement_is_code(statement: exp.Expression | None) -> bool:
    if isinstance(statement, exp.Update):
        return bool(statement.expressions)  # UPDATE t SET ...; "update my insurance" parses without SET
    if isinstance(statement, exp.Delete):
        return not statement.args.get("tables")  # DELETE FROM t; "delete fries from the list" is the multi-table form
    if isinstance(statement, (*_WRITES, exp.Union)):
        return True
    if isinstance(statement, exp.Select):
        reads_table = any(isinstance(value, exp.From) for value in statement.args.values())
        return reads_table or any(node.find(*_COMPUTED) is not None for node in statement.expressions)
    return False


def _parses_as_code(candidate: str) -> bool:
    if "/*" in candidate and "*/" not in candidate:
        candidate += "*/"  # a comment left open to cut off the rest of the host query
    try:
        statements = _Parser().parse(Tokenizer().tokenize(candidate), candidate)
    except SqlglotError:  # ParseError, TokenError: words, not SQL
        return False
    return any(_statement_is_code(statement) for statement in statements)


def _lowered(text: str, function: str) -> str:
    """``text.lower()``; a ``TypeError`` naming ``function`` when ``text`` is not a string."""
    if not isinstance(text, str):
        raise TypeError(f"{function}() takes a string, got {type(text).__name__}")
    return text.lower()


def sqli(text: str) -> bool:
    """Whether some line of ``text`` holds a complete SQL statement that reads or changes data (module docstring).

    Raises:
        TypeError: ``text`` is not a string (a rule error: the policy's fail mode decides).
    """
    lowered = _lowered(text, "sqli")
    if not any(word in lowered for word in _SQL_WORDS):  # the common case, in a few us per KiB
        return False
    for line in text.splitlines():
        if len(line) > MAX_SQL_LINE:
            continue
        for match in _SQL_START_RE.finditer(line):
            if _parses_as_code(line[match.start() :]):
                return True
    return False


def xss(text: str) -> bool:
    """Whether ``text`` holds script-bearing markup or a script URL (module docstring).

    Raises:
        TypeError: ``text`` is not a string.
    """
    lowered = _lowered(text, "xss")
    if "<" not in text and "script" not in lowered and "text/html" not in lowered:  # the common case, fast
        return False
    return _XSS_RE.search(text) is not None


def code_exec(text: str) -> bool:
    """Whether ``text`` holds shell or interpreter code that runs a command (module docstring).

    Raises:
        TypeError: ``text`` is not a string.
    """
    lowered = _lowered(text, "code_exec")
    return any(mark in lowered and pattern.search(text) is not None for mark, pattern in _CODE_EXEC)


#: The rule functions, by CEL name (registered in every rule context by :mod:`guard.policy.rules`).
FUNCTIONS: dict[str, Callable[..., Any]] = {"code_exec": code_exec, "sqli": sqli, "xss": xss}
