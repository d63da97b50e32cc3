"""Code payloads in text, for rules: SQL statements (``sqli(x)``), script-bearing markup or URLs (``xss(x)``),
shell or interpreter code that would run commands (``code_exec(x)``), and paths that climb out of a folder
(``path_traversal(x)``).

The model reads meaning; these read syntax, so a rule can stop a request that carries SQL or script whatever the
model thinks of its words. Each reads the text as written and, when it holds URL escapes, URL-decoded too
(``DROP%20TABLE``, ``%3Cscript%3E``; twice for ``%253C``; the ``%uXXXX`` escapes IIS and classic ASP.NET decode,
``%u003Cscript%u003E``), and, when it holds JSON's ``\\u00`` escapes, with its ``\\uXXXX`` escapes decoded (a JSON
document carried in a string field, where Go's ``encoding/json`` writes ``<`` as ``\\u003c``: the application that
parses the inner document reads ``<script>``): an application that decodes a field reads what the escapes hide. Text with letters an
application folds to ASCII is also read folded, in NFKC with dotless ``ı`` as ``i`` (``ſelect``, ``unıon``,
full-width ``ｓｙｓｔｅｍ``, mathematical ``__𝘪𝘮𝘱𝘰𝘳𝘵__``): ``str.upper()`` gives ``SELECT`` and ``UNION``, a
case-insensitive comparison matches them, and Python reads identifiers in NFKC, so ``eval`` runs
``__𝘪𝘮𝘱𝘰𝘳𝘵__('os').𝘴𝘺𝘴𝘵𝘦𝘮('id')``. Each takes a string;
``sqli`` and ``code_exec`` test each line of it on its own (``body_text`` joins a body's string values with newlines,
so each line is one value or a line of one), ``xss`` the whole text, as a browser would read it. All answer rarely
on ordinary text (measured on every benign record in ``data/``: docs/policies.md, ``bench/payload_detectors.py``).

``sqli(x)``: some line holds a complete SQL statement that modifies or reads data, parsed by ``sqlglot`` from an SQL
keyword to the first ``;`` outside quotes (at most :data:`MAX_SQL_STATEMENT` characters): ``DROP``, ``INSERT``,
``UPDATE``, ``DELETE``, ``CREATE``, ``ALTER``, ``TRUNCATE``, or a ``SELECT`` that reads a table (``FROM``) or computes
(``CASE``, a function, ``@@version``). Text before the keyword is not parsed, so a fragment that closes a quote first
(``' UNION SELECT ...``, ``10; DROP TABLE users --``) counts, and neither is text after the statement's ``;`` (``'; DROP
TABLE orders; nice shoes``) or after a ``)`` that closes a bracket opened before its keyword (a subquery: ``1 AND
(SELECT COUNT(*) FROM users) > 0``). A quote left open at the end of the line for the host query to close (``... WHERE
'1'='1``) is closed first, unless it follows a letter or digit (an apostrophe: "Bob's"); after ``UNION`` a SELECT counts
whatever it selects (``UNION SELECT 1,2,3``, ``UNION ALL SELECT NULL,NULL``) unless bare words. Lines are split at
``\n`` and ``\r`` only: a form feed, vertical tab or Unicode line separator is whitespace to SQL, so ``DROP<FF>TABLE``
is one statement; and as SQL reads a line break as a space, a statement left open at the end of its line (the parser
wanted more: ``'; DROP``, ``DELETE``; or after text that reads as SQL, it parsed without being code: ``' UNION SELECT
password``, ``'; UPDATE users``) is read on with the next line joined by a line break (a ``--`` comment ends there),
then the next two while still open, as far as :data:`MAX_SQL_STATEMENT` characters (``'; DROP\nTABLE users; --``,
``'; DROP -- c\nTABLE users``); comments may stand between ``UNION`` and what follows it (``/**/UNION/**/SELECT``, ``/***/``, a ``--`` comment
ending ``UNION``'s line), and so may a ``(`` (``UNION(SELECT 1,2,3)``; not "Join the union (select a plan from
the list)", bare words). MySQL syntax is read as MySQL reads it: a
versioned comment's content is code (``/*!50000UNION*/``), a hex literal is a string (``0x61646d696e``), and a ``#``
right after a word, quote or bracket starts a comment (``users#``; a hashtag after a space does not). English that
starts like SQL ("select the best option from the list", "delete my account") does not parse, and a SELECT or INSERT of
bare words (no punctuation, literal, comment or clause English rarely holds, :data:`_SQL_CLAUSES`) is English ("Select a
date from the calendar", "Insert image from URL") unless what comes right before its keyword reads as SQL (a quote,
``;``, ``)``, ``=``, ``|``, ``*/``, a digit, ``(`` after an operator or SQL keyword, or ``UNION``; not a ``(`` after
a word: "Shipping country (select from list)"). At most :data:`MAX_SQL_STARTS` places where a statement could start
are parsed (all readings together); past the first :data:`MAX_SQL_STARTS` keywords, only those shaped like a
statement (``DROP TABLE``, ``DELETE FROM``, ``INSERT INTO``, ``UPDATE x SET``, ``SELECT ... FROM``) are, so a long
document saying "update your password" a hundred times is read as prose, while a statement after many decoy keywords is
still parsed; a candidate parsed already (repeated boilerplate, or a line another reading left as it was: the same
characters from the keyword on) is not parsed again; a text that would need more parses than that counts as SQL
(checking each would cost too much), a parse that reads as prose (English of bare words, or words the grammar
refuses: a changelog of "Select a date range from the calendar" bullets) charged but not counted. What sqlglot tokenises and parses is charged to a budget,
:data:`SQL_WORK_BASE` plus :data:`SQL_WORK_PER_CHAR` per character of the text and at most
:data:`MAX_SQL_PARSE_CHARS` (a call costs at most about 15 us per character of budget); once it is spent, a keyword
shaped like a statement counts as SQL and any other is skipped, so a long line of prose is read as prose.

``xss(x)``: the text holds a ``<script`` (or ``<iframe``, ``<object``, ``<embed``) tag, a tag with an ``on...=``
event handler or a CSS ``expression(`` (its attributes may be spread over lines), or a script URL:
``javascript:``/``vbscript:`` followed at once by code, or ``data:text/html``, anywhere (a bare link, a Markdown
``](...)`` target, an ``href``); where the scheme opens the quoted value of an attribute that holds a URL (``href``,
``src``, ``action``, ``formaction``, ``data``, ...), a Markdown link target or a link reference definition's ``<...>``
destination, blanks after its colon count too (``href="javascript: alert(1)"``, ``[1]: <javascript: alert(1)>``), as browsers skip them (not ``title="JavaScript: basics"``). The
text is read as a browser reads it: character references decoded in a URL (``&#106;avascript&colon;``; escaped
markup such as ``&lt;script&gt;`` is text, not a tag), tabs and line breaks inside a scheme ignored
(``java<TAB>script:``). "JavaScript: a guide" is not one (in prose, a space follows the colon).

``code_exec(x)``: some line holds code that runs a command or reaches the interpreter's internals, by its syntax:
shell command substitution with a command and an argument (``$(touch /tmp/x)``, ``$(whoami)``), a backticked command
where a shell would run it (at the start of a line or after ``=``, ``;``, ``|`` or ``&``; a backticked command
inside prose is Markdown and not counted), a pipe into a shell (``| sh``, ``| sudo bash``, ``| /usr/bin/env bash``),
a download piped into an interpreter that reads its program from the pipe (``curl ... | python3``, not ``| python
-m json.tool``) or run by process substitution (``bash <(curl ...)``), ``sh -i`` (``bash -i``, ``/bin/sh -i``), a
redirection to ``/dev/tcp/``, ``mkfifo``, ``nc``/``ncat``/``netcat ... -e``, ``rm -rf /`` or ``~``; a command
chained onto a value (``; cat /etc/passwd``, ``&& id``, ``| whoami``, ``%0a whoami``: ``;``, ``|``, ``||``, ``&&``,
``&`` after a blank, after a value, at most one word from the start of its line or a closing quote, or ``%0a``, then
``cat``, ``id``, ``whoami``, ``uname``, ``ls``, ``ping``, netcat, a shell, ``powershell``, ``cmd``, ``curl`` or
``wget`` (also by its path, ``/bin/cat``), then the line's end, ``;``, ``<``, ``%0a``, a comment, an option, a path
or a URL (after blanks or ``${IFS}``); or after ``;``, ``&&``, ``||`` or ``&`` and a value that does not end in a word
of letters, ``id``, ``whoami`` or ``uname`` with options (``8.8.8.8 -c 1; uname -a``; not "Steps: log in; id"; by
its path, ``/usr/bin/id``, after anything), or after anything, a command line that reads ``/etc/passwd`` or
downloads to ``/tmp`` and ends the line (not "...; cat /etc/passwd lists the deploy user"); or on the line after a
value (``8.8.8.8 -c 1\\nwhoami``); not "cats & dogs; cat food", a Markdown row ``| id | name |``
nor a command line or sentence before it: ``cd build && ls -la``); Perl's ``@{[ ... ]}`` interpolation; a call that
runs a command or code with a string, a PHP variable or code argument (``system("...")``, ``system($_GET['c'])``, ``exec(...)``,
``eval("...")``, ``popen``, ``passthru``, ``shell_exec``, Node's ``execSync("...")``, ``Kernel.exec``, Perl's
``system "..."``), Node's ``require("child_process")``, Python's ``__import__(``, ``os.system(``/``os.popen(`` (no
space before the dot), ``subprocess.<call>(``, ``__subclasses__()``, ``__mro__``, ``__builtins__``, ``__globals__``,
and ``open()`` of a path under ``/tmp``, ``/etc``, ``/dev`` or ``/proc`` for writing; and a Log4j JNDI lookup
(``${jndi:ldap://...}``, also spelt with lookups inside it that Log4j resolves first, ``${${lower:j}ndi:``,
``${${::-j}${::-n}di:``), which makes a Java application that logs the text load and run a remote class. A question
about code ("how do I use subprocess in Python?", "what does eval do") has no such call and is not counted.

``path_traversal(x)``: the text climbs two or more folders (``../../etc/passwd``, ``..\\..\\windows\\win.ini``,
``....//....//``, which a filter that removes ``../`` once turns into ``../../``; ``.././../``, ``..;/..;/``), as written, URL-decoded
(``..%2f..%2f``) or folded, where that reads as a file name or path parameter that escapes the folder the
application serves from: the path starts its line (after blanks) or follows an unquoted ``=``, a tag's ``>`` or a
quoted value's ``="`` (blanks around them too; not a URL attribute's, ``href="../../main.css"``) and is absolute or
climbs above where it starts, its folders and steps up counted (``images/./../../app``,
``a/b/c/d/e/../../../../../../app``; not ``a/b/../../x``; two folders above in a quoted value, three in markup, a
tag's content or a quoted value inside a start tag: not Maven's ``<relativePath>../../pom.xml</relativePath>``), the
climb is written evasively (three or more dots, ``..//``, ``..\\/``, or shown only by another
reading), or it reaches a system file or folder (``etc``, ``windows``, ``WEB-INF``, ``.ssh``, ...). A relative
import or link inside a line (``from '../../components/Button'``, ``](../../docs/setup.md)``) and one ``../`` are
not counted.
"""

from __future__ import annotations

import html
import itertools
import re
import unicodedata
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote_plus

from sqlglot import exp
from sqlglot.errors import ParseError, SqlglotError
from sqlglot.parser import Parser
from sqlglot.tokens import Token, Tokenizer, TokenType

from guard._urls import percent_u_decoded

__all__ = ["FUNCTIONS", "code_exec", "path_traversal", "sqli", "xss"]

#: Keywords that start a statement sqlglot parses in full (others fall back to an unchecked "command").
_SQL_WORDS = ("select", "insert", "update", "delete", "drop", "create", "alter", "truncate")
_SQL_START_RE = re.compile(rf"\b(?:{'|'.join(_SQL_WORDS)})\b", re.IGNORECASE)
#: Statements that change data or schema (UPDATE and DELETE are checked further in ``_statement_is_code``).
_WRITES = (exp.Drop, exp.Insert, exp.Create, exp.Alter, exp.TruncateTable)
#: Projections that make a FROM-less SELECT code rather than words.
_COMPUTED = (exp.Case, exp.Func, exp.SessionParameter, exp.Parameter)
#: Keywords that make a SELECT or INSERT of bare words SQL: clauses English rarely holds (:func:`_is_words`).
_SQL_CLAUSES = frozenset((
    TokenType.WHERE, TokenType.GROUP_BY, TokenType.ORDER_BY, TokenType.HAVING, TokenType.LIMIT, TokenType.OFFSET,
    TokenType.FETCH, TokenType.JOIN, TokenType.UNION, TokenType.INTERSECT, TokenType.EXCEPT, TokenType.INTO,
    TokenType.VALUES, TokenType.TABLE, TokenType.CASE, TokenType.EXISTS, TokenType.QUALIFY, TokenType.WINDOW,
))
#: A comment, ``/* ... */`` (``*`` inside it too: ``/***/``).
_SQL_COMMENT = r"/\*[^*]*\*+(?:[^/*][^*]*\*+)*/"
#: What, right before a keyword, makes its statement SQL whatever its words: a quote, ``;``, ``)``, ``=``, ``|``, the
#: end of a comment (``*/``), a digit, a ``(`` after an operator or an SQL keyword (``1 AND (SELECT``, ``'||(SELECT``,
#: ``IN (``; not after a word of prose: "Tickets (select a seat from the map)"), or ``UNION`` (``ALL``, ``DISTINCT``;
#: then a SELECT is code whatever it selects, unless bare words: ``UNION SELECT 1,2,3``, a probe for the host query's
#: number of columns), also with a ``(`` after it (``UNION(SELECT 1,2,3)``, ``bracket``: a SELECT of bare words after
#: it is English, "Join the union (select a plan from the list)", unless ``sqlish``: a quote, digit, ``)``, ``-`` or
#: ``/`` comes before UNION, ``1' UNION(SELECT password FROM users)``) or a ``--`` comment ending its line (``UNION --
#: x\nSELECT``); comments may stand between them.
_SQL_CONTEXT_RE = re.compile(
    r"(?:['\"`;)=|/\d]|(?:[=,|'\"(<>+*-]|\b(?:and|or|not|in|exists|from|where|select|values|when|then|having|on))\s*\("
    rf"|(?P<sqlish>[-'\"`\d)/]\s*)?\b(?P<union>union)(?:(?:\s|{_SQL_COMMENT})+(?:all|distinct))?(?:(?:\s|{_SQL_COMMENT})*(?P<bracket>\())?"
    rf"(?:(?:\s|{_SQL_COMMENT})*--.*)?)(?:\s|{_SQL_COMMENT})*$",
    re.IGNORECASE,
)
#: Most characters parsed from one SQL keyword on (a statement longer than this is not looked for; parsing 2,000
#: characters costs about a millisecond).
MAX_SQL_STATEMENT = 2000
#: Most SQL keywords parsed from in one text; a text with more counts as SQL (module docstring).
MAX_SQL_STARTS = 64
#: Characters sqlglot may tokenise and parse for one ``sqli`` call, all readings together: :data:`SQL_WORK_BASE`
#: plus :data:`SQL_WORK_PER_CHAR` per character of the text, at most :data:`MAX_SQL_PARSE_CHARS`; past it, a keyword
#: shaped like a statement (:data:`_SQL_SHAPE_RE`) counts as SQL and any other is skipped; each keyword past the
#: budget or the first :data:`MAX_SQL_STARTS` costs a shape test of at most 300 characters (what a character of
#: budget costs, measured with ``bench/payload_detectors.py``: ``docs/policies.md``). Each line is
#: tokenised from its first keyword in windows of two statements, a window charged only for what the one before it
#: had not tokenised, the keywords read their statements from those tokens, and a parse that fails within a
#: statement's first tokens is charged only as far as it read (prose fails within a few words), so ordinary text
#: uses a small part of its budget (every benign record in ``data/`` less than :data:`SQL_WORK_BASE`).
SQL_WORK_BASE = 2 * MAX_SQL_STATEMENT
SQL_WORK_PER_CHAR = 3
MAX_SQL_PARSE_CHARS = 20_000
#: A keyword followed by what its statement needs next (parsed past the first MAX_SQL_STARTS keywords).
_SQL_SHAPE_RE = re.compile(
    r"(?:drop|create|alter|truncate)\s+(?:\w+\s+){0,2}?(?:table|database|schema|view|index|user|procedure|function"
    r"|trigger)\b|delete\s+(?:\S+\s+)?from\b|insert\s+(?:\S+\s+)?into\b|update\s+\S+\s+set\b"
    r"|select\s[^;]{0,300}?\bfrom\b",
    re.IGNORECASE,
)
_LINE_BREAK_RE = re.compile(r"\r\n?|\n")
#: MySQL syntax the default dialect does not read, as it reads it: a versioned comment's content is code
#: (``/*!50000UNION*/``), a hex literal is a string (``0x61646d696e``), and ``#`` right after a word, quote or bracket
#: starts a comment (``users#``; not a hashtag after a space).
_MYSQL_SYNTAX = ((re.compile(r"/\*!\d*([^*]*)\*/"), r" \1 "), (re.compile(r"\b0x[0-9a-f]+\b", re.IGNORECASE), "''"),
                 (re.compile(r"(?<=[\w'\")])#"), " --"))

#: A URL scheme as browsers read it: tabs and line breaks inside it are removed before it is parsed.
_SCHEME = "[\t\r\n]*".join
_URL_BLANKS = str.maketrans("", "", "\t\r\n")
_SCRIPT_SCHEME = rf"(?:{_SCHEME('javascript')}|{_SCHEME('vbscript')})\s*:"
#: A script URL: ``javascript:``/``vbscript:`` with code right after the colon anywhere, or after blanks where the
#: scheme opens the quoted value of an attribute that holds a URL (``href= " javascript: alert(1)"``, ``src``,
#: ``action``, ``formaction``, ...; not ``title="JavaScript: The Good Parts"``) or a Markdown link target
#: (``](javascript: alert(1))``, CommonMark's ``](<javascript: alert(1)>)``) or a CommonMark link reference definition
#: in angle brackets (``[1]: <javascript: alert(1)>`` at the start of a line, also after block quote and list item
#: markers, ``> [1]: <...>``, ``- [1]: <...>``, the markers read once, never given back; not a footnote, "[1]:
#: JavaScript: The Good Parts"), which browsers run as well (an unquoted
#: value ends at the blank; a browser strips control characters before the scheme too); or an HTML
#: document as a URL.
_URL_ATTRIBUTES = "href|src|action|formaction|data|poster|background|codebase|cite|ping|to"
_SCRIPT_URL = (rf"(?<![\w-]){_SCRIPT_SCHEME}[^\s]"
               rf"|(?:\b(?:{_URL_ATTRIBUTES})\s*=\s*[\"'][\x00-\x20]*|\]\(\s*<?"
               r"|(?<![^\n])(?:[ ]{0,3}(?:>|[-*+]|\d{1,9}[.)])[ ]?)*+[ ]{0,3}\[[^\]\n]+\]:\s*<)"
               rf"{_SCRIPT_SCHEME}\s*\S"
               r"|(?<![\w-])data\s*:\s*text/html")
_SCRIPT_URL_RE = re.compile(_SCRIPT_URL, re.IGNORECASE)
_XSS_RE = re.compile(r"<\s*(?:script|iframe|object|embed)\b|" + _SCRIPT_URL, re.IGNORECASE)  # + code-loading tags
#: A start tag as a browser reads it: ``<``, a letter, then everything up to the first ``>`` outside quotes (its
#: attributes may sit on lines of their own). Written as runs of unquoted characters between quoted values (Friedl's
#: unrolled loop), not one alternation per character, so it matches with no backtracking.
_TAG_RE = re.compile(r"<[a-z][^\"'>]*(?:(?:\"[^\"]*\"|'[^']*')[^\"'>]*)*", re.IGNORECASE)
_EVENT_RE = re.compile(r"[\s/\"']on[a-z]+\s*=", re.IGNORECASE)  # an event handler attribute
_STYLE_RE = re.compile(r"style\s*=", re.IGNORECASE)
_EXPRESSION_RE = re.compile(r"expression\s*\(", re.IGNORECASE)  # a CSS expression, after a style attribute

#: Shell command substitution, each pattern matched at a ``$(`` (:func:`_substitutes_a_command`).
_SUBSTITUTIONS = tuple(re.compile(pattern, re.IGNORECASE) for pattern in (
    r"\$\(\s*[a-z_./][\w./-]*\s+[^)\n]*\)",  # $(command argument ...)
    r"\$\(\s*(?:whoami|id|pwd|env|uname|hostname|reboot|ls)\s*\)",  # $(command) of one that needs none
))
#: What may run a piped script: ``sudo`` (with options and their values: ``sudo -u root``), then ``env`` (bare or by
#: its path).
_RUNNER = r"(?:sudo\s+(?:-\w+\s+(?:\w+\s+)?)*)?(?:(?:/usr)?/bin/env\s+|env\s+)?"
#: A command an attacker chains onto a value, bare or by its path (``id``, ``/bin/cat``); the lookahead, a character
#: each of them starts with, spares trying each name where none can follow (a run of separators, ``|| || ||``).
_CHAINED = (r"(?=[/bcilnpsuwz])(?:/usr)?(?:/s?bin/)?(?:cat|id|whoami|uname|ls|ping|nc|ncat|netcat|bash|sh|zsh|powershell|pwsh|cmd"
            r"|curl|wget)")
#: A chained command's arguments to the end of its command line: options, paths, URLs and numbers only, after blanks,
#: ``<`` or the shell's ``$IFS`` (``-la /var/www``, ``-I https://e.example/``, ``</etc/passwd``; a line that goes on in
#: words, "ls -la /var/www shows ...", is prose). An argument runs to the next blank, ``;`` or ``<`` and is never
#: given back (atomic, the loop possessive): an ``$IFS`` inside it stays part of it, so a line that fails is tried
#: once, not in every way of splitting it (2^n ways for n ``${IFS}``).
_ARGUMENTS = (r"(?:(?:[ \t]+|[ \t]*<[ \t]*|\$\{IFS\}|\$IFS\b)(?>-[^\s;<]+|/[^\s;<]*|~[^\s;<]*|[a-z]+://[^\s;<]*"
              r"|\d[^\s;<]*))++"
              r"[ \t\r]*(?:$|;|<)")
#: id, whoami or uname with options, then the line's end, a separator, a redirection or a comment.
_IDENTITY = r"(?:id|whoami|uname)(?:[ \t]+-\w+)*[ \t\r]*(?:$|[;#<>|&]|\d[<>])"
#: A command chained by ;, &&, || or & after a blank onto anything (:func:`_chained_onto_anything`): ``identity``,
#: id, whoami or uname (``path``: named by its path, ``/usr/bin/id``), or a command line that reads /etc/passwd or
#: /etc/shadow (``cat</etc/passwd``, ``cat${IFS}/etc/passwd``) or downloads into a temporary folder (``wget
#: http://e/x -O /tmp/x``) and ends there (not "...; cat /etc/passwd lists the deploy user").
_CHAINED_RE = re.compile(
    rf"(?:;|&&|\|\||&(?<!\S&))[ \t]*(?=[/bcilnpsuwz])(?:(?P<identity>(?P<path>(?:/usr)?/s?bin/)?{_IDENTITY})"
    rf"|{_CHAINED}(?=[^\n;|&]*?/etc/(?:passwd|shadow)\b){_ARGUMENTS}"
    rf"|(?:/usr)?(?:/s?bin/)?(?:curl|wget)(?=[^\n;|&]*?-[oO][ \t]*/(?:tmp|var/tmp|dev/shm)/){_ARGUMENTS})",
    re.IGNORECASE | re.MULTILINE,
)
#: (marks, pattern): each pattern matches only text that holds one of its marks (lower case), so a text is searched
#: only with the patterns whose mark it holds (a Python regex without a literal prefix costs about 30 us per KiB).
_CODE_EXEC = tuple((marks, re.compile(pattern, re.IGNORECASE | re.MULTILINE)) for marks, pattern in (
    (("`",), r"(?:^|[=;|&])\s*`\s*[a-z_./][\w./-]*(?:\s[^`\n]*)?`"),  # a backticked command where a shell runs it
    # a pipe into a shell (the lookahead, a letter each of its forms starts with, spares the optional parts at a
    # pipe followed by anything else)
    (("|",), rf"\|\s*(?=[/sbzdke]){_RUNNER}(?:/bin/|/usr/bin/)?(?:ba|z|da|k)?sh\b(?!\s*[a-z])"),
    # a download piped into an interpreter that reads its program from the pipe (not "| python -m json.tool")
    (("curl", "wget"), (rf"\b(?:curl|wget)\s[^|\n]{{0,300}}\|\s*{_RUNNER}(?:/usr/bin/|/usr/local/bin/)?"
                        r"(?:python[23]?|perl|ruby|php|node)\b\s*(?:-\s*)?(?:$|[;&|)\"'`])")),
    (("-i",), r"(?:\b|/)(?:ba|z|da)?sh\s+-i\b"),  # an interactive shell, for a reverse shell
    (("<(",), r"\b(?:ba|z|da|k)?sh\s*<\(\s*(?:curl|wget)\b"),  # a download run by process substitution
    (("/dev/",), r"[<>]&?\s*/dev/(?:tcp|udp)/"),  # a redirection to a network socket (bash's /dev/tcp/host/port)
    (("mkfifo",), r"\bmkfifo\s+/"),
    # netcat running a program (also by a variant's name: nc.traditional, nc.openbsd)
    (("nc ", "ncat ", "netcat ", "nc."), r"\b(?:nc|ncat|netcat)(?:\.\w+)? +(?:[^\s|;&]+ +){0,6}-[ec]\s"),
    (("rm ",), r"\brm +-[rf]{1,2}\s+[/~]"),
    (("@{[",), r"@\{\[\s*\w"),  # Perl: code interpolated into a string
    (("(",), (r"\b(?:system|execv?p?|eval|popen|passthru|shell_exec|proc_open|pcntl_exec|spawn"
              r"|(?:exec|execFile|spawn)Sync)\s*\(\s*(?:r?[\"'`]|\$\w|compile\s*\(|__import__)")),  # a call that runs
    # a string, a PHP variable ($_GET['c']) or compiled code
    (("child_process",), r"\brequire\s*\(\s*[\"'`](?:node:)?child_process[\"'`]\s*\)"),  # Node's command runner
    (("kernel",), r"\bkernel\s*\.\s*(?:exec|system|spawn)\b"),
    (("system",), r"\bsystem\s+[\"'][^\"'\n]*[\"']"),
    (("__",), r"__import__\s*\(|__subclasses__\s*\(|__mro__|__builtins__|__globals__"),
    (("os.",), r"\bos\.(?:system|popen|exec\w*|spawn\w*)\s*\("),
    (("subprocess",), r"\bsubprocess\s*\.\s*\w+\s*\("),
    (("open",), r"\bopen\s*\(\s*r?[\"']/(?:tmp|etc|dev|proc)/[^\"'\n]*[\"']\s*,\s*[\"'][wa]"),  # writing a system path
    # a command chained onto a value (; cat /etc/passwd, && id, | whoami, || id, %0a whoami): a separator after a
    # value (at most one word from the start of its line, or a closing quote; a lone & after a blank or before a word
    # and &: x&id&) or %0a, one of these commands, then the line's end, | or & ending the line (x|id|), an option, a
    # path or a URL, after blanks or the shell's $IFS (not "cats & dogs", "| id | name |", "|id|name|", nor a
    # command line or sentence before the separator: "cd build && ls -la", "ssh into the box; cat /var/log/...")
    ((";", "|", "&", "%0a"), (r"(?:^[ \t]*\S*?[ \t]*(?:\|\||[;|]|&&|(?<!\S)&|&(?=\w+&))|[\"'][ \t]*(?:[;|]|&&|&)|%0a)"
                              rf"\s*{_CHAINED}(?:\s*(?:$|;|<|%0a)|[|&]+[ \t\r]*$"
                              r"|(?:\s+|\$\{IFS\}|\$IFS\b)(?:#|[-/~$]|[a-z]+://))")),
    # a command on the line after a value (x\nwhoami, 127.0.0.1\ncat /etc/passwd: a URL-decoded %0a): a line of one
    # word (not a code fence or a label: "```bash", "Steps:") or of a word and options with at most one argument
    # each (8.8.8.8 -c 1), blank lines after it, then whoami or uname alone, or one of the commands
    # with options, paths or URLs and nothing else to its line's end (not a bare id, cat or ls: a query's or JSON
    # body's values are joined with line breaks, so "shoes\nid" is ?q=shoes&sort=id; nor a command line a sentence
    # goes on from: "high\ncurl -I https://e.example/ returns 502" is a ticket's priority and description)
    (("\n",), (r"^[ \t]*(?!```)(?:\S*[^\s:]|\S+(?:[ \t]+-\w+(?:[ \t]+\w[\w.]*)?)+)[ \t]*\r?\n(?:[ \t]*\r?\n)*[ \t]*"
               rf"(?=[/bcilnpsuwz])(?:(?:/usr)?(?:/s?bin/)?(?:whoami|uname)[ \t\r]*(?:$|;|<)|{_CHAINED}{_ARGUMENTS})")),
))

#: A Log4j lookup with no lookup inside it (``${lower:j}``, ``${::-j}``): its text after ``:-`` (the default when
#: its key is undefined) or after its first ``:``, quotes removed, is what Log4j puts in its place.
_LOOKUP_RE = re.compile(r"\$\{([^${}]*)\}")
_JNDI_RE = re.compile(r"\$\{\s*jndi\s*:", re.IGNORECASE)
#: Lookups nested deeper than this are not resolved (Log4j payloads nest one or two levels).
MAX_LOOKUP_DEPTH = 8
#: Two or more steps up a folder tree (``../../``, ``..\\..\\``, ``....//``; with ``./`` between them,
#: ``.././../``, or Tomcat's path parameter after the dots, ``..;/..;/``); a run of dots is tried from its first
#: dot only (``\.(?<!\.\.)``: a dot not after a dot; written so the pattern starts with a literal, which ``re`` scans
#: for fast), so a long run is scanned once; a match is the first two steps.
_CLIMB = r"\.(?<!\.\.)\.+;?[\\/]+(?:\.[\\/]+)*\.\.+;?[\\/]+"
_TRAVERSAL_RE = re.compile(_CLIMB)
#: Where a value starts, a path that climbs out of its folder there reads as an attack (:func:`_climbs_as_a_value`):
#: the start of a line, an ``=``, a tag's ``>``; only where a ``..`` follows in the next run of path characters.
_VALUE_START_RE = re.compile(r"(?:^|[=>\r\n])(?=[ \t\"']*[^\s\"'`<>=|,()\[\]{}&?#*]*\.\.)")
#: The value after such a start: blanks, a quote (``file = "../../../app/secret.key"``), blanks, and the path, a run of
#: characters other than blanks, quotes, markup, brackets and the characters around a query's or an assignment's
#: values.
_VALUE_RE = re.compile(r"[ \t]*(?P<quote>[\"'])?[ \t]*(?P<path>[^\s\"'`<>=|,()\[\]{}&?#*]+)")
#: A URL attribute's name before a quoted value's ``=``: ``href="../../assets/main.css"`` is a link the browser
#: resolves among the site's URLs.
_URL_NAME_RE = re.compile(rf"\b(?:{_URL_ATTRIBUTES})[ \t]*$", re.IGNORECASE)
#: Folders above its start a path in a quoted value right after its ``=`` climbs to count (``path="./a/b/../../../c"``
#: climbs one above).
QUOTED_CLIMB = 2
#: Folders above its start a path in markup climbs to count, in a tag's content or an attribute's value: build files
#: reach two folders up (Maven's ``<relativePath>../../pom.xml</relativePath>``, ``<module>``, MSBuild's
#: ``<Import Project="../../build/common.props" />``), and so do a configuration file's quoted values with a blank before
#: their ``=`` (Terraform's ``source = "../../modules/vpc"``, Cargo's ``path = "../../crates/shared"``).
MARKUP_CLIMB = 3
#: Characters a start tag may span before a quoted value inside it (a quoted value farther from its tag's ``<`` is
#: read as outside markup).
_TAG_REACH = 1024
_ABSOLUTE_RE = re.compile(r"(?:[a-z]:)?[\\/]", re.IGNORECASE)
#: The other climbs that read as an attack (:func:`_path_traversal`), each pattern starting with a literal: written
#: evasively (three or more dots before a separator: ``....//``, which a filter that removes ``../`` once turns into
#: ``../../``, not an ellipsis, "Loading... see"; two separators: ``..//``, ``..\/``; a run of dots tried from its
#: first dot only, as in :data:`_CLIMB`), or reaching a system file or folder at most four folders on (``etc``,
#: ``windows``, ``WEB-INF``, ...).
_TRAVERSAL_ATTACKS = tuple(re.compile(pattern, re.IGNORECASE) for pattern in (
    r"\.(?<!\.\.)\.(?:\.+;?[\\/]|[\\/]{2})",
    (rf"{_CLIMB}(?:[\w.-]+[\\/]+){{0,4}}?(?:etc|windows|winnt|proc|boot\.ini|win\.ini|web-inf|\.ssh|\.env|\.git"
     r"|\.aws|root|var[\\/]log|inetpub|system32)\b"),
))


class _Parser(Parser):
    """sqlglot's parser without its warning for text it keeps as an unparsed command (most English after CREATE or
    ALTER): such a command is not code here, and the warning would log user text."""

    def reset(self) -> None:
        super().reset()
        self.furthest = 0  # one past the furthest token read (the parser peeks one token ahead)

    def _advance(self, times: int = 1) -> None:
        super()._advance(times)
        self.furthest = max(self.furthest, self._index + 2)

    def _warn_unsupported(self) -> None:
        pass


def _is_words(tokens: list[Token], statements: list[exp.Expression | None]) -> bool:
    """Whether ``statements`` are SELECTs or INSERTs of bare words only, as English reads: "Select a date from the
    calendar" (``SELECT a AS date FROM the AS calendar``), "Insert image from URL"; no punctuation, literal, comment
    or clause English rarely holds (:data:`_SQL_CLAUSES`)."""
    return all(isinstance(statement, (exp.Select, exp.Insert)) for statement in statements) and all(
        token.text.isalpha() and not token.comments and token.token_type not in _SQL_CLAUSES for token in tokens
    )


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


class _Scan:
    """The tokens of ``line`` from offset ``start`` on, at most two statements' length (``2 * MAX_SQL_STATEMENT``
    characters): a keyword after ``start`` that starts one of them reads its statement from them, so a line is
    tokenised about once however many keywords it holds. A comment left open (``/*``, to cut off the rest of the
    host query) is closed first, and so is a quote left open at the end of the line for the host query to close
    (``... WHERE '1'='1``) unless it follows a letter or digit (an apostrophe: "it's", "Bob's"); where the text does
    not tokenise otherwise (an unclosed quote) the tokens stop before it and ``failed_at`` is the line offset where
    they stop (else ``None``). ``cost``: the characters tokenised past line offset ``tokenised``, where the line's
    scan before it stopped short of the statement at ``start`` (0 when there was none or it held the statement's
    reach but no token at ``start``): windows that go on along the line charge it about once for its length, and
    tokenise it at most about twice."""

    def __init__(self, line: str, start: int, tokenised: int = 0) -> None:
        self.start = start
        self.line_length = len(line)
        self.end = min(len(line), start + 2 * MAX_SQL_STATEMENT)  # line offset after the text scanned
        self.text = line[start : self.end]
        if self.text.rfind("/*") > self.text.rfind("*/"):
            self.text += "*/"
        self.cost = len(self.text) - max(0, min(tokenised, self.end) - start)
        tokenizer = Tokenizer()
        self.failed_at: int | None = None
        try:
            self.tokens = tokenizer.tokenize(self.text)
        except SqlglotError:  # TokenError: an unclosed quote or comment; the tokens before it are kept
            self.tokens = tokenizer.tokens
            stopped = self.tokens[-1].end + 1 if self.tokens else 0  # in self.text
            self.failed_at = start + stopped
            quote = len(self.text) - len(self.text[stopped:].lstrip())
            if self.end == len(line) and self.text.startswith("'", quote) and not self.text[quote - 1 : quote].isalnum():
                self.cost += len(self.text) + 1
                try:
                    self.tokens = Tokenizer().tokenize(self.text + "'")
                    self.failed_at = None
                except SqlglotError:
                    pass
        self.starts = [start + token.start for token in self.tokens]
        self.ends = [token.end for token in self.tokens]  # in self.text
        self.semicolons = [i for i, token in enumerate(self.tokens) if token.token_type == TokenType.SEMICOLON]
        # closes[i]: the first token after token i that closes a bracket opened before it (a subquery's ")" in
        # "1 AND (SELECT COUNT(*) FROM users) > 0"), else len(tokens)
        depth = [0]  # depth[k]: brackets open before token k
        for token in self.tokens:
            depth.append(depth[-1] + (token.token_type == TokenType.L_PAREN) - (token.token_type == TokenType.R_PAREN))
        self.closes = [len(self.tokens)] * len(self.tokens)
        waiting = [0] if self.tokens else []  # tokens whose closing ")" is not found yet, depths rising
        for k in range(1, len(self.tokens) + 1):
            while waiting and depth[k] < depth[waiting[-1]]:
                self.closes[waiting.pop()] = k - 1
            if k < len(self.tokens):
                waiting.append(k)

    def reaches(self, offset: int) -> bool:
        """Whether the scan holds the whole reach of a statement from line offset ``offset``."""
        return self.end >= min(self.line_length, offset + MAX_SQL_STATEMENT)

    def covers(self, offset: int) -> bool:
        """Whether a token starts at line offset ``offset`` and the scan holds its statement's whole reach."""
        if not self.reaches(offset):
            return False
        i = bisect_left(self.starts, offset)
        return i < len(self.starts) and self.starts[i] == offset

    def statement(self, offset: int) -> list[Token] | None:
        """The tokens from the one at line offset ``offset`` (:meth:`covers`) up to the first ``;`` outside quotes or
        ``)`` that closes a bracket opened before it, at most ``MAX_SQL_STATEMENT`` characters on; ``None`` when the
        text there does not tokenise before its end (an unclosed quote: text after the statement's ``;``, an
        apostrophe in prose, does not count)."""
        first = bisect_left(self.starts, offset)
        stop = min(bisect_left(self.ends, offset + MAX_SQL_STATEMENT - self.start), self.closes[first])
        semicolon = bisect_left(self.semicolons, first)
        if semicolon < len(self.semicolons):
            stop = min(stop, self.semicolons[semicolon])
        if stop == len(self.tokens) and self.failed_at is not None and self.failed_at < offset + MAX_SQL_STATEMENT:
            return None
        return self.tokens[first:stop]


#: Tokens of a statement parsed first: where the parser fails without reading to their end (prose fails within a
#: few words), the rest of a long statement is not handed to it.
_SQL_HEAD_TOKENS = 48


def _parses_as_code(scan: _Scan, offset: int, context: re.Match[str] | None) -> tuple[bool, int, bool, bool]:
    """Whether the statement at line offset ``offset`` of ``scan`` is code; how many of its characters the parser was
    handed (of a statement's first :data:`_SQL_HEAD_TOKENS` tokens, only as far as it read); and whether it is left
    open at the end of its line for the next line to finish: the parser read all of it and wanted more (``DROP
    TABLE``, ``DELETE``), it is its keyword alone (``DROP``), or, after text that reads as SQL, it parsed without
    being code (``' UNION SELECT password``, ``'; UPDATE users``). ``context``: what comes right before it,
    where that reads as SQL (:data:`_SQL_CONTEXT_RE`); without it or after ``UNION (`` a SELECT or INSERT of bare
    words is English (:func:`_is_words`), after ``UNION`` any other SELECT is code, and after a ``UNION`` with SQL
    before it (``1' UNION(SELECT password FROM users)``) any SELECT; and whether it read as prose, that English or
    words the grammar refuses (such a parse, charged as far as it read, does not count toward
    :data:`MAX_SQL_STARTS`)."""
    tokens = scan.statement(offset)
    if not tokens:
        return False, 0, False, False
    skipped = offset - scan.start  # characters of scan.text before the statement; token offsets count them
    open_end = scan.end == scan.line_length and tokens[-1] is scan.tokens[-1]
    for part in (tokens[:_SQL_HEAD_TOKENS], tokens):
        parser = _Parser()
        try:
            statements = parser.parse(part, scan.text)
        except ParseError:  # words, not SQL, unless the parser read to the end of a statement's first tokens
            if len(part) == len(tokens) or parser.furthest + 2 < len(part):
                last = part[-1] if len(part) > _SQL_HEAD_TOKENS else part[min(parser.furthest, len(part)) - 1]
                left_open = open_end and parser.furthest + 2 >= len(part)
                return False, last.end + 1 - skipped, left_open, not left_open
            continue
        except SqlglotError:
            return False, part[-1].end + 1 - skipped, False, False
        except RecursionError:  # a statement nested past the parser's depth ("select ((((..."): code, not prose
            return True, part[-1].end + 1 - skipped, False, False
        commands = all(isinstance(statement, exp.Command) for statement in statements)
        if commands or len(part) == len(tokens):
            break
    read = part[-1].end + 1 - skipped
    if commands:  # kept as an unparsed command ("create a branch and ...", decided by its first words): not code,
        return False, 0 if len(part) <= _SQL_HEAD_TOKENS else read, open_end and len(tokens) == 1, False  # no expression
    words = _is_words(tokens, statements)
    sql_union = context is not None and context["sqlish"] is not None  # "1' UNION(SELECT password FROM users)"
    if words and not sql_union and (context is None or context["bracket"]):
        return False, read, False, True
    # "UNION SELECT 1,2,3", not "union select in mysql"
    if context is not None and context["union"] and (not words or sql_union):
        code = all(isinstance(statement, exp.Select) for statement in statements)
    else:
        code = any(_statement_is_code(statement) for statement in statements)
    return code, read, open_end and not code and context is not None, False


def _lowered(text: str, function: str) -> str:
    """``text.lower()``; a ``TypeError`` naming ``function`` when ``text`` is not a string."""
    if not isinstance(text, str):
        raise TypeError(f"{function}() takes a string, got {type(text).__name__}")
    return text.lower()


_PERCENT_RE = re.compile(r"%(?:[0-9A-Fa-f]{2}|[uU][0-9A-Fa-f]{4})")
#: Dotless ``ı`` (U+0131), which ``str.upper()`` and case-insensitive comparisons read as ``I`` and NFKC leaves.
_DOTLESS_I = str.maketrans({"\u0131": "i"})
#: A character of the blocks whose letters and digits fold to ASCII ones (Latin-1 Supplement to Spacing Modifier
#: Letters: ``ª ² ı ĳ ſ``; Phonetic Extensions; super- and subscripts, letterlike symbols and number forms: ``ℌ K Ⅸ``;
#: enclosed alphanumerics; Latin ligatures: ``ﬁ``; full-width digits and letters; mathematical alphanumerics). Not
#: the no-break space, ``…`` or full-width punctuation (``，``), which English and CJK text hold and which neither
#: ``str.upper()`` nor Python's identifiers fold.
_FOLDABLE_RE = re.compile("[\u00aa-\u02ff\u1d00-\u1dbf\u2070-\u218f\u2460-\u24ff\ufb00-\ufb06\uff10-\uff19"
                          "\uff21-\uff3a\uff41-\uff5a\U0001d400-\U0001d7ff]")
#: Full-width ``＜ ＞ ＂ ＇`` next to an ASCII letter: markup (``＜script＞``) an application that applies NFKC reads as
#: ``<script>``; CJK text sets them beside its own characters, not beside ASCII letters.
_WIDE_MARKUP_RE = re.compile("[\uff1c\uff1e\uff02\uff07][A-Za-z]|[A-Za-z][\uff1c\uff1e\uff02\uff07]")


def _url_decoded(text: str) -> str:
    """``text`` with its ``%XX`` escapes (``+`` as a space) and ``%uXXXX`` escapes decoded."""
    return percent_u_decoded(unquote_plus(text, errors="replace"))


def _percent_decoded(text: str) -> str | None:
    """``text`` with its URL escapes decoded (``%3Cscript%3E``, ``DROP%20TABLE``, ``+`` as a space, IIS and ASP.NET's
    ``%u003Cscript%u003E``), twice when the first pass leaves escapes (``%253C``), or None when it holds none: an
    application that decodes a field reads the payload the escapes hide."""
    if "%" not in text or _PERCENT_RE.search(text) is None:
        return None
    decoded = _url_decoded(text)
    return _url_decoded(decoded) if _PERCENT_RE.search(decoded) else decoded


#: A JSON ``\\uXXXX`` escape of a character other than a surrogate (a pair's halves are left as written).
_JSON_ESCAPE_RE = re.compile(r"\\u(?![Dd][89A-Fa-f])([0-9A-Fa-f]{4})")


def _json_unescaped(text: str) -> str | None:
    """``text`` with its JSON ``\\uXXXX`` escapes decoded, or None when it holds no ``\\u00``: a JSON document
    carried in a string field (a webhook's payload, GraphQL variables) whose encoder escaped markup, as Go's
    ``encoding/json`` writes ``<`` and ``>`` as ``\\u003c`` and ``\\u003e``, is read as the application that parses
    it reads it. One scan of the text."""
    if "\\u00" not in text:
        return None
    return _JSON_ESCAPE_RE.sub(lambda match: chr(int(match.group(1), 16)), text)


def _folded(text: str, markup: bool = False) -> str | None:
    """``text`` in NFKC with dotless ``ı`` read as ``i`` where it holds a character of :data:`_FOLDABLE_RE` (or, with
    ``markup``, full-width markup punctuation next to ASCII letters, :data:`_WIDE_MARKUP_RE`), or None when it holds
    none or that changes nothing (French or Russian text): the letters an application folds to ASCII when it compares
    case-insensitively, upper-cases (``ſelect`` and ``unıon`` upper-case to ``SELECT`` and ``UNION``) or normalises
    (Python reads identifiers in NFKC: ``__𝘪𝘮𝘱𝘰𝘳𝘵__`` is ``__import__``; ``K``, the Kelvin sign, is ``K``; an
    application that applies NFKC reads ``＜script＞`` as ``<script>``)."""
    if text.isascii() or (_FOLDABLE_RE.search(text) is None
                           and not (markup and _WIDE_MARKUP_RE.search(text) is not None)):
        return None
    folded = unicodedata.normalize("NFKC", text).translate(_DOTLESS_I)
    return folded if folded != text else None


def _readings(text: str, markup: bool = False) -> Iterator[str]:
    """``text``, then, where they differ from it, its URL-decoded reading (:func:`_percent_decoded`), the
    JSON-unescaped reading (:func:`_json_unescaped`) of the last of those and the folded reading (:func:`_folded`,
    ``markup`` passed on) of the last of those, each made only when the one before did not answer."""
    yield text
    last = text
    decoded = _percent_decoded(last)
    if decoded is not None:
        yield decoded
        last = decoded
    unescaped = _json_unescaped(last)
    if unescaped is not None:
        yield unescaped
        last = unescaped
    folded = _folded(last, markup)
    if folded is not None:
        yield folded


def _or_decoded(check: Callable[[str], bool], text: str, function: str, markup: bool = False) -> bool:
    """``check`` of ``text`` or of one of its other readings (:func:`_readings`, ``markup`` passed on)."""
    _lowered(text, function)
    return any(check(reading) for reading in _readings(text, markup))


class _SqlBudget:
    """What one ``sqli`` call may still spend, all readings together: characters sqlglot tokenises and parses
    (:data:`SQL_WORK_PER_CHAR`) and statements parsed (:data:`MAX_SQL_STARTS`), and the candidates parsed already
    (hashes of the characters from a keyword on: repeated boilerplate, or a line a reading left unchanged, is
    parsed once)."""

    def __init__(self, length: int) -> None:
        self.chars = min(MAX_SQL_PARSE_CHARS, SQL_WORK_BASE + SQL_WORK_PER_CHAR * length)
        self.starts = 0  # distinct candidates met
        self.parses = 0
        self.seen: set[int] = set()


def sqli(text: str) -> bool:
    """Whether some line of ``text``, as written, URL-decoded or folded, holds a complete SQL statement that reads or
    changes data (module docstring). Costs at most about 12 us per character of budget (:data:`SQL_WORK_PER_CHAR`).

    Raises:
        TypeError: ``text`` is not a string (a rule error: the policy's fail mode decides).
    """
    _lowered(text, "sqli")
    budget = _SqlBudget(len(text))
    return any(_sqli(reading, budget) for reading in _readings(text))


def _sqli(text: str, budget: _SqlBudget) -> bool:
    lowered = text.lower()
    if not any(word in lowered for word in _SQL_WORDS):  # the common case, in a few us per KiB
        return False
    if "/*!" in text or "0x" in lowered or "#" in text:
        for pattern, replacement in _MYSQL_SYNTAX:
            text = pattern.sub(replacement, text)
    lines = _LINE_BREAK_RE.split(text)
    for number, line in enumerate(lines):
        scan: _Scan | None = None
        for match in _SQL_START_RE.finditer(line):
            offset = match.start()
            if (budget.starts >= MAX_SQL_STARTS or budget.chars < 0) and not _SQL_SHAPE_RE.match(line, offset):
                continue  # tested before the candidate is sliced and hashed, which is not charged
            key = hash(line[offset : offset + MAX_SQL_STATEMENT])
            if key in budget.seen:
                continue
            budget.seen.add(key)
            budget.starts += 1
            if budget.parses >= MAX_SQL_STARTS or budget.chars < 0:
                return True
            if scan is None or not scan.covers(offset):
                # a window that stops short of the statement goes on along the line, charged for what it adds; one
                # from a keyword the window before read inside a quote or comment is charged in full
                scan = _Scan(line, offset, scan.end if scan is not None and not scan.reaches(offset) else 0)
                budget.chars -= scan.cost
            context = _SQL_CONTEXT_RE.search(line, max(0, offset - 32), offset)
            if number and offset <= 32 and not line[:offset].strip():  # a keyword that starts its line, after UNION
                union = _SQL_CONTEXT_RE.search(lines[number - 1][-32:])  # on the line before ('%0AUNION%0ASELECT)
                context = union if union is not None and union["union"] else None
            code, read, open_end, prose = _parses_as_code(scan, offset, context)
            if code:
                return True
            budget.chars -= read
            budget.parses += not prose  # prose ("Select a date range from the calendar") is charged, not counted
            if open_end and number + 1 < len(lines) and _continues_as_code(lines, number, offset, context, budget):
                return True
    return False


def _continues_as_code(
    lines: list[str], number: int, offset: int, context: re.Match[str] | None, budget: _SqlBudget
) -> bool:
    """Whether the statement left open at ``offset`` of line ``number`` (:func:`_parses_as_code`) is code with the
    next line joined to it by a line break, then the next two while it is still left open, as far as
    ``MAX_SQL_STATEMENT`` characters (SQL reads a line break as a space: a value holding ``'; DROP\\nTABLE users``
    holds one statement); also True when ``budget`` is spent and the joined text is shaped like a statement
    (:data:`_SQL_SHAPE_RE`: it counts as SQL)."""
    joined = lines[number][offset:]
    for line in itertools.islice(lines, number + 1, None):
        if len(joined) >= MAX_SQL_STATEMENT:
            return False
        joined = f"{joined}\n{line}"[:MAX_SQL_STATEMENT]
        key = hash(joined)
        if key in budget.seen:
            return False
        budget.seen.add(key)
        if budget.chars < 0:
            return _SQL_SHAPE_RE.match(joined) is not None
        scan = _Scan(joined, 0)
        budget.chars -= scan.cost
        code, read, open_end, _ = _parses_as_code(scan, 0, context)
        budget.chars -= read
        if code or not open_end:
            return code
    return False


def xss(text: str) -> bool:
    """Whether ``text``, as written, URL-decoded or folded (full-width ``＜ ＞ ＂ ＇`` next to ASCII letters too:
    ``＜script＞``), holds script-bearing markup or a script URL (module docstring).

    Raises:
        TypeError: ``text`` is not a string.
    """
    return _or_decoded(_xss, text, "xss", markup=True)


def _xss(text: str) -> bool:
    lowered = text.lower()
    if "&" in text:  # a browser decodes character references in an attribute: &#106;avascript: is javascript:
        decoded = html.unescape(text)  # (in markup, &lt;script&gt; is text that shows, not a tag)
        if decoded != text and _SCRIPT_URL_RE.search(decoded) is not None:
            return True
    if "<" not in text and "text/html" not in lowered and "script" not in lowered.translate(_URL_BLANKS):
        return False  # the common case, fast
    if _XSS_RE.search(text) is not None:
        return True
    return "<" in text and any(_tag_runs_code(tag.group()) for tag in _TAG_RE.finditer(text))


def _tag_runs_code(tag: str) -> bool:
    """Whether a start tag (``<`` up to its ``>``) has an ``on...=`` event handler or a CSS ``expression(`` in a
    ``style`` attribute."""
    if _EVENT_RE.search(tag) is not None:
        return True
    style = _STYLE_RE.search(tag)
    return style is not None and _EXPRESSION_RE.search(tag, style.end()) is not None


def _substitutes_a_command(text: str) -> bool:
    """Whether some ``$(`` of ``text`` starts a command substitution (:data:`_SUBSTITUTIONS`), each tried only up to
    the first ``)`` after it (where a substitution ends, on its line or a later one): searched as one pattern, every
    ``$(`` of a long run of ``$(cmd arg`` without a ``)`` scanned to the end of its line (quadratic: 100 KB took
    10 s); here the next ``)`` is found once for all the ``$(`` before it."""
    end = -1
    start = text.find("$(")
    while start != -1:
        if end < start:
            end = text.find(")", start)
            if end == -1:
                return False  # no ")" after here: no substitution can end
        if any(pattern.match(text, start, end + 1) for pattern in _SUBSTITUTIONS):
            return True
        start = text.find("$(", start + 2)
    return False


def code_exec(text: str) -> bool:
    """Whether ``text``, as written, URL-decoded or folded, holds shell or interpreter code that runs a command
    (module docstring).

    Raises:
        TypeError: ``text`` is not a string.
    """
    return _or_decoded(_code_exec, text, "code_exec")


def _jndi_lookup(text: str) -> bool:
    """Whether ``text`` holds a Log4j ``${jndi:`` lookup once the lookups inside it are resolved (innermost first,
    at most :data:`MAX_LOOKUP_DEPTH` levels: ``${${lower:j}ndi:`` is ``${jndi:``)."""
    for _ in range(MAX_LOOKUP_DEPTH):
        if _JNDI_RE.search(text) is not None:
            return True
        resolved = _LOOKUP_RE.sub(_lookup_value, text)
        if resolved == text:
            return False
        text = resolved
    return False


def _lookup_value(match: re.Match[str]) -> str:
    body = match.group(1)
    value = body.rsplit(":-", 1)[1] if ":-" in body else body.split(":", 1)[-1]
    return value.strip("'\"")


def _chained_onto_anything(text: str) -> bool:
    """Whether a command is chained by ;, &&, || or & after a blank onto whatever precedes it (:data:`_CHAINED_RE`,
    ``8.8.8.8 -c 1; id``, ``Bob Smith; cat /etc/passwd``): id, whoami or uname (with options: ``uname -a``) onto a
    value that does not end in a word of letters (``1&&whoami``; not "Steps: log in; id", "It prints the name
    & id"), with a redirection after it (``localhost&&whoami>/tmp/x``, ``localhost || whoami 2>&1``) or by its path
    (``Bob Smith && /usr/bin/id``), or a read of /etc/passwd or a download into /tmp that ends
    its line. Not a transcript's "uname -a; cat /etc/os-release", nor after a lone | (a table row's "first name |
    id"). One search of the text; what precedes a separator is read only where a command follows it."""
    for match in _CHAINED_RE.finditer(text):
        before = text[max(0, match.start() - 64) : match.start()].rstrip(" \t")
        if not match["identity"] or match["path"] or not before[-1:].isalpha() or match.group()[-1] in "<>":
            return True
    return False


def _code_exec(text: str) -> bool:
    lowered = text.lower()
    if "$(" in text and _substitutes_a_command(text):
        return True
    if "${" in text and _jndi_lookup(text):
        return True
    if (";" in text or "&" in text or "||" in text) and _chained_onto_anything(text):
        return True
    for marks, pattern in _CODE_EXEC:
        for mark in marks:
            if mark in lowered:
                if pattern.search(text) is not None:
                    return True
                break  # searched once, whichever of its marks the text holds
    return False


def path_traversal(text: str) -> bool:
    """Whether ``text``, as written, URL-decoded or folded, climbs two or more folders where that reads as an attack
    (``../../etc/passwd``, ``..%2f..%2f``, ``file=../../x``; not ``import Button from '../../components/Button'``;
    module docstring, :func:`_path_traversal`). A climb that only another reading shows (URL-encoded, folded)
    is written evasively and counts.

    Raises:
        TypeError: ``text`` is not a string.
    """
    _lowered(text, "path_traversal")
    readings = _readings(text)
    if _path_traversal(next(readings)):
        return True
    shown = _climbs(text)
    return any(_path_traversal(reading) or (not shown and _climbs(reading)) for reading in readings)


def _climbs(text: str) -> bool:
    return ".." in text and _TRAVERSAL_RE.search(text) is not None


def _path_traversal(text: str) -> bool:
    """Whether ``text`` climbs two or more folders where that reads as an attack (:func:`_climbs_as_a_value`,
    :data:`_TRAVERSAL_ATTACKS`); not a relative link or import inside a line of code or prose (``from
    '../../components/Button'``, ``](../../docs/setup.md)``)."""
    if not _climbs(text):
        return False
    return _climbs_as_a_value(text) or any(pattern.search(text) for pattern in _TRAVERSAL_ATTACKS)


def _climbs_as_a_value(text: str) -> bool:
    """Whether some path of ``text`` where a value starts (:data:`_VALUE_START_RE`, :data:`_VALUE_RE`) climbs two or
    more folders and out of where it starts: it is absolute (``/var/www/../../etc``, ``C:\\app\\..\\..``) or climbs
    above its start (:func:`_climbs_above_start`). The value starts a line (after blanks), right after an unquoted
    ``=`` (``file=../../config``; not a ``.gitmodules`` line's ``url = ../../org/lib.git``), after a tag's ``>``
    (``<file> ../../../config/db.yml</file>``) or in a quoted value (``file = "../../../app/secret.key"``; not a URL
    attribute's, :data:`_URL_NAME_RE`), as many folders above as :func:`_climb_to_count` says, with ``/`` after ``>`` or in a quoted
    value (``..\\..\\`` in XML is an MSBuild hint path or project reference)."""
    for start in _VALUE_START_RE.finditer(text):
        value = _VALUE_RE.match(text, start.end())
        if value is None:
            continue
        path, mark, quoted = value["path"], start.group(), value["quote"] is not None
        if mark in ("", "\r", "\n") and quoted or mark == "=" and not quoted and value.start("path") > start.end():
            continue  # a quoted line, or blanks after an unquoted =
        if (mark == ">" or quoted) and "\\" in path:
            continue
        if mark == "=" and quoted and _URL_NAME_RE.search(text[max(0, start.start() - 32) : start.start()]):
            continue
        if _TRAVERSAL_RE.search(path) is None:
            continue
        if _ABSOLUTE_RE.match(path) or _climbs_above_start(path, _climb_to_count(text, start.start(), mark, quoted)):
            return True
    return False


def _climb_to_count(text: str, start: int, mark: str, quoted: bool) -> int:
    """Folders above its start the path after ``mark`` (at ``start``: ``""`` or a line break, ``=``, ``>``) climbs to
    count: :data:`MARKUP_CLIMB` in a tag's content, in a quoted value inside a start tag (a ``<`` within
    :data:`_TAG_REACH` characters before it and no ``>`` after that ``<``) or after a blank and ``=`` (``source =
    "../../modules/vpc"``), :data:`QUOTED_CLIMB` in another quoted value (``file="../../app/secret.key"``), else 1."""
    if mark == ">":
        return MARKUP_CLIMB
    if not (mark == "=" and quoted):
        return 1
    if text[start - 1 : start] in (" ", "\t"):
        return MARKUP_CLIMB
    reach = max(0, start - _TAG_REACH)
    return MARKUP_CLIMB if text.rfind("<", reach, start) > text.rfind(">", reach, start) else QUOTED_CLIMB


def _climbs_above_start(path: str, folders: int) -> bool:
    """Whether relative ``path`` climbs ``folders`` or more folders above where it starts, counting one down for each
    folder name and one up for each step up (``..``, ``..;x=1``; ``.`` skipped): ``images/./../../app`` and
    ``a/b/c/d/e/../../../../../../app`` climb 1, ``../../../x`` 3, ``a/b/../../x`` none. Reads the names only as far
    as that shows."""
    depth = 0
    for name in path.replace("\\", "/").split("/"):
        if name.startswith("..") and name.lstrip(".")[:1] in ("", ";"):
            depth -= 1
            if depth <= -folders:
                return True
        elif name not in ("", "."):
            depth += 1
    return False


#: The rule functions, by CEL name (registered in every rule context by :mod:`guard.policy.rules`).
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "code_exec": code_exec, "path_traversal": path_traversal, "sqli": sqli, "xss": xss,
}
