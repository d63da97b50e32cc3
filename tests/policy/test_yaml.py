"""Safe YAML for policy files: duplicate keys (C21), anchors/aliases and bombs (C22), tags, depth, size, lines."""

from __future__ import annotations

import re
import time
import tracemalloc

import pytest

from guard.errors import PolicyError
from guard.policy import _yaml
from guard.policy._yaml import MAX_DEPTH, MAX_NODES, MAX_POLICY_BYTES, load_yaml

# The 9-level nested-anchor bomb (PyYAML #235 / js-yaml #738 shape): ~400 bytes, 9^9 leaves when expanded.
ALIAS_BOMB = """\
policies:
  - a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
    b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
    c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
    e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
    f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
    g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
    h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
    i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_plain_data_and_lines() -> None:
    data, lines = load_yaml("a: 1\nb:\n  - x\n  - {'y': 2.5, z: null, t: true}\nversion: '2024-05-01'\n", "f.yaml")
    assert data == {"a": 1, "b": ["x", {"y": 2.5, "z": None, "t": True}], "version": "2024-05-01"}
    assert lines.line(("b",)) == 2 and lines.line(("b", 1, "z")) == 4 and lines.line(("version",)) == 5
    assert lines.line(("b", 1, "missing")) == 4  # falls back to the nearest ancestor


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("threshold: 0.9\nthreshold: 0.1\n", 2, "threshold"),
        ("policies:\n  - questions:\n      urgency: {}\n      urgency: {}\n", 4, "policies[0].questions.urgency"),
        ("a: {x: 1, x: 2}\n", 1, "a.x"),
        ("'1': a\n\"1\": b\n", 2, "1"),  # single and double quotes write the same key
    ],
)
def test_duplicate_keys_name_key_and_line(text: str, line: int, key: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_yaml(text, "p.yaml")
    assert (caught.value.file, caught.value.line, caught.value.key) == ("p.yaml", line, key)
    assert "duplicate key" in caught.value.reason and "first defined on line" in caught.value.reason


def test_alias_bomb_is_rejected_fast_with_bounded_memory() -> None:
    assert len(ALIAS_BOMB) < 450
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(PolicyError) as caught:
        load_yaml(ALIAS_BOMB, "bomb.yaml")
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert caught.value.line == 2 and "anchor &a is not allowed" in caught.value.reason
    assert elapsed < 1.0 and peak < 50 * 2**20  # C22: < 1 s and < 50 MB (it stops at the first anchor)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("a: *x\n", "alias *x is not allowed"),
        ("a: &x 1\n", "anchor &x is not allowed"),
        ("base: {a: 1}\nother:\n  <<: {b: 2}\n", "merge keys"),
        ("a: !!python/object:os.system ls\n", "tag !!python/object:os.system is not allowed"),
        ("a: !custom 1\n", "tag !custom is not allowed"),
        ("a: !!binary aGVsbG8=\n", "is not allowed"),
        ("a: !!set {x, y}\n", "is not allowed"),
        ("? [a, b]\n: 1\n", "a key must be text, not a sequence or mapping"),
        ("a: [1, 2\n", "YAML syntax error"),
        ("a: 1\n---\nb: 2\n", "YAML syntax error"),
        ("a: " + "9" * 5000 + "\n", "a number of 5000 characters; at most 100"),  # was a bare ValueError
        ("a: 0." + "1" * 200 + "\n", "a number of 202 characters"),
        ("a: 0" + "9" * 5000 + "\n", "a number of 5001 characters"),  # text in YAML 1.1, a number in 1.2
        ("a: 1e" + "9" * 5000 + "\n", "a number of 5002 characters"),
        ("a: " + "59:" * 20 + "59\n", "would be read as a base-60 number; quote it"),  # quadratic in PyYAML
        ("at: 1:30\n", "'1:30' would be read as a base-60 number"),
    ],
)
def test_unsafe_or_broken_yaml_is_rejected(text: str, reason: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_yaml(text, "p.yaml")
    assert reason in caught.value.reason
    assert caught.value.line is not None


def test_depth_size_and_encoding_limits() -> None:
    with pytest.raises(PolicyError, match=f"nesting deeper than {MAX_DEPTH}"):
        load_yaml("a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(PolicyError, match="at most"):
        load_yaml("a: " + "x" * MAX_POLICY_BYTES)
    with pytest.raises(PolicyError) as info:
        load_yaml("a: 1\nb: [\"é\", \"x".encode() + b"\xff\xfe\"]\n", "p.yaml")
    assert info.value.line == 2
    assert info.value.reason == "file is not UTF-8: byte 0xFF at column 12 (offset 17); save the file as UTF-8"
    assert load_yaml("") == (None, load_yaml("")[1])


def test_node_count_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 MiB file of ``[1,1,...]`` is 500,000 nodes: PyYAML took minutes and over 400 MB to compose it (850 MB and
    nearly 5 minutes as a policy file, pydantic's errors included). The node past :data:`MAX_NODES` is refused as it
    is parsed, naming its line; the rest of the file is not composed."""
    assert len("a: [" + "1," * (MAX_NODES * 5) + "]") < MAX_POLICY_BYTES  # the size cap alone let such a file in
    monkeypatch.setattr(_yaml, "MAX_NODES", 20)
    assert len(load_yaml("a: [" + "1," * 17 + "]\n")[0]["a"]) == 17  # 20 nodes: the mapping, a, the list, 17 items
    with pytest.raises(PolicyError) as info:
        load_yaml("a: [" + "1," * 18 + "]\nb: [" + "1," * 10_000 + "]\n", "p.yaml")
    assert (info.value.file, info.value.line) == ("p.yaml", 1)
    assert info.value.reason == ("the file holds more than 20 values (keys included); at most 20 (split it into "
                                 "several files)")
    with pytest.raises(PolicyError, match="more than 20 values") as info:
        load_yaml("a: 1\nb:\n" + "".join(f"  k{i}: {i}\n" for i in range(30)), "p.yaml")
    assert info.value.line == 10  # the 21st node: k7's value (the mapping, a, 1, b, its mapping, k0, 0, ..., k7, 7)


@pytest.mark.parametrize(
    ("text", "line", "key", "reason"),
    [
        ("data:\n  countries: [se, no, dk]\n", 2, "data.countries[1]",
         "'no' is the boolean false in YAML 1.1 but text in YAML 1.2; quote it (\"no\") for the text, or write false"),
        ("a: 1\non: push\n", 2, "on", "key 'on' is the boolean true in YAML 1.1 but text in YAML 1.2; quote it (\"on\")"),
        ("criteria: {yes: a, no: b}\n", 1, "criteria.yes", "key 'yes' is the boolean true"),
        ("x: OFF\n", 1, "x", "'OFF' is the boolean false"),
        ("x: [Y, n]\n", 1, "x[0]", "'Y' is the boolean true"),  # YAML 1.1 booleans, though PyYAML reads them as text
        ("x: 010\n", 1, "x", "'010' is octal 8 in YAML 1.1 but 10 in YAML 1.2; write 10, or quote it (\"010\")"),
        ("version: 012\n", 1, "version", "'012' is octal 10"),
        ("x: 08\n", 1, "x", "'08' is text in YAML 1.1 but 8 in YAML 1.2; write 8"),
        ("x: 0b1010\n", 1, "x", "'0b1010' is binary 10 in YAML 1.1 but text"),
        ("x: 0o17\n", 1, "x", "'0o17' is text in YAML 1.1 but octal 15 in YAML 1.2; write 15"),
        ("x: -0x1F\n", 1, "x", "'-0x1F' is the number -31 in YAML 1.1 but text"),
        ("x: 1_000\n", 1, "x", "'1_000' is the number 1000 in YAML 1.1 but text"),
        ("x: 1e3\n", 1, "x", "'1e3' is text in YAML 1.1 but the number 1000.0 in YAML 1.2; write 1.0e+3, or quote it"),
        ("x: 2.5E3\n", 1, "x", "write 2.5e+3"),
        ("x: 1:30\n", 1, "x", "'1:30' would be read as a base-60 number"),
        ("data:\n  since: 2024-01-01\n", 2, "data.since",
         "'2024-01-01' is a timestamp in YAML 1.1 but text in YAML 1.2; quote it (\"2024-01-01\")"),
        ("x: [a, 2001-12-14 21:59:43.10 -5]\n", 1, "x[1]", "'2001-12-14 21:59:43.10 -5' is a timestamp"),
        ("x: {2024-1-2T3:04:05Z: a}\n", 1, "x.2024-1-2T3:04:05Z", "key '2024-1-2T3:04:05Z' is a timestamp"),
    ],
)
def test_plain_scalars_yaml_11_and_12_read_differently_are_refused(text: str, line: int, key: str, reason: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_yaml(text, "p.yaml")
    assert (caught.value.file, caught.value.line, caught.value.key) == ("p.yaml", line, key)
    assert reason in caught.value.reason


@pytest.mark.parametrize(
    ("text", "written", "value"),
    [("-.5", "-0.5", -0.5), ("+.5e+3", "+0.5e+3", 500.0), ("-.5e3", "-0.5e+3", -500.0), ("1e3", "1.0e+3", 1000.0),
     ("012", "12", 12)],
)
def test_the_spelling_an_error_suggests_loads_as_yaml_12_reads_the_value(text: str, written: str, value: float) -> None:
    """The hint wrote ``-.5e+`` for ``-.5`` (text again) and ``+.5e+3`` for itself (refused again)."""
    with pytest.raises(PolicyError, match=f"write {re.escape(written)}"):
        load_yaml(f"x: {text}\n", "p.yaml")
    assert load_yaml(f"x: {written}\n")[0] == {"x": value}


def test_plain_scalars_both_yaml_versions_agree_on_are_kept() -> None:
    text = ("a: [true, False, TRUE, null, ~, 0, -0, 12, +12, 0x1F, 1.5, .5, 1., 1.0e+3, -.inf, 2024-05-1, no way]\n"
            "quoted: ['no', \"on\", '010', '1e3', '2024-05-01', \"\\U0001F600\"]\n")
    data, _ = load_yaml(text, "p.yaml")
    assert data["a"][:15] == [True, False, True, None, None, 0, 0, 12, 12, 31, 1.5, 0.5, 1.0, 1000.0, float("-inf")]
    assert data["a"][15:] == ["2024-05-1", "no way"]  # a date without a time needs two-digit month and day
    assert data["quoted"] == ["no", "on", "010", "1e3", "2024-05-01", "\U0001F600"]


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ('x: !!bool "off"\n', "x", "tag !!bool is not allowed"),  # was false: a quoted value is always text
        ('x: !!int "012"\n', "x", "tag !!int is not allowed"),  # was 10
        ('x: !!null "x"\n', "x", "tag !!null is not allowed"),  # was null
        ("x: [a, !!float 1]\n", "x[1]", "tag !!float is not allowed"),
        ("x: !!str yes\n", "x", "tag !!str is not allowed"),  # even a tag naming what YAML 1.2 would read
        ("x: ! 012\n", "x", "tag ! is not allowed"),
        ("x: !!map {a: 1}\n", "x", "tag !!map is not allowed"),
        ("x: {!!str true: a}\n", "x.true", "tag !!str is not allowed"),
        ("%TAG !e! tag:example.com,2000:\n---\nx: !e!foo a\n", "x", "tag !e!foo is not allowed"),  # as written
        ("x: !<tag:yaml.org,2002:str> a\n", "x", "tag !<tag:yaml.org,2002:str> is not allowed"),
    ],
)
def test_explicit_tags_are_refused(text: str, key: str, reason: str) -> None:
    """``!!bool "off"`` read false, ``!!int "012"`` 10 and ``!!null "x"`` null: a tag got past the rule that a quoted
    value is text and past the YAML 1.1/1.2 checks."""
    with pytest.raises(PolicyError) as caught:
        load_yaml(text, "p.yaml")
    assert (caught.value.line, caught.value.key) == (text.count("\n"), key)
    assert reason in caught.value.reason


@pytest.mark.parametrize(
    ("text", "line", "key", "reason"),
    [
        ('data: {ops: [=, "<"]}\n', 1, "data.ops[0]", 'YAML 1.1\'s value marker, not text; quote it ("=")'),
        ("data:\n  ops: {=: eq}\n", 2, "data.ops.=", "'=' is YAML 1.1's value marker"),
        ("data: {ops: <<}\n", 1, "data.ops", "'<<' is YAML 1.1's merge key, not text; quote it"),
        ("data:\n  ? [a]\n  : 1\n", 2, "data", "a key must be text, not a sequence or mapping"),
    ],
)
def test_what_yaml_reads_as_no_data_names_its_key_and_how_to_write_it(
    text: str, line: int, key: str, reason: str
) -> None:
    """``=`` gave "tag tag:yaml.org,2002:value is not allowed" and a sequence key gave no key path."""
    with pytest.raises(PolicyError) as caught:
        load_yaml(text, "p.yaml")
    assert (caught.value.line, caught.value.key) == (line, key)
    assert reason in caught.value.reason
    assert load_yaml('data: {ops: ["=", "<"]}\n')[0] == {"data": {"ops": ["=", "<"]}}


@pytest.mark.parametrize(
    ("text", "line", "key", "reason"),
    [
        ("criteria: {true: a, b: c}\n", 1, "criteria.true", ('key \'true\' is the boolean true in YAML, not text; keys '
         'are text: quote it ("true")')),  # was the option "True"
        ("criteria:\n  a: b\n  null: c\n", 3, "criteria.null", "key 'null' is null in YAML"),  # was "None"
        ("criteria: {~: a}\n", 1, "criteria.~", "key '~' is null"),
        ("x: {0x1F: a}\n", 1, "x.0x1F", ('key \'0x1F\' is the number 31 in YAML, not text; keys are text: '
         'quote it ("0x1F")')),  # was "31"
        ("x: {1.5: a}\n", 1, "x.1.5", "is the number 1.5"),
        ("x: {+1: a}\n", 1, "x.+1", "is the number 1"),  # would be "1"
        ("x: {00: a}\n", 1, "x.00", "is the number 0"),
    ],
)
def test_keys_yaml_reads_as_anything_but_text_are_refused(text: str, line: int, key: str, reason: str) -> None:
    """``true:`` and ``null:`` as choice options became the options "True" and "None"."""
    with pytest.raises(PolicyError) as caught:
        load_yaml(text, "p.yaml")
    assert (caught.value.line, caught.value.key) == (line, key)
    assert reason in caught.value.reason


def test_a_decimal_integer_key_is_the_text_it_is_written_as() -> None:
    """Choice options ``{1: Low., 2: Medium., 3: High.}`` and ``status: {429: slow}`` loaded as "1", "2", "3" and
    "429" before keys YAML reads as no text were refused, and were refused since."""
    data, lines = load_yaml("criteria: {1: Low., 2: Medium., 3: High.}\nstatus:\n  429: slow\n  -1: x\n", "p.yaml")
    assert data == {"criteria": {"1": "Low.", "2": "Medium.", "3": "High."}, "status": {"429": "slow", "-1": "x"}}
    assert lines.line(("status", "-1")) == 4
    with pytest.raises(PolicyError, match="duplicate key '1'"):
        load_yaml('x: {"1": a, 1: b}\n')


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ('message: "refused \\ud800"\n', "message", "the value holds U+D800, a lone surrogate"),
        ("x: [a, \"\\udc80\"]\n", "x[1]", "U+DC80, a lone surrogate"),
        ('x: {"k\\ud800": 1}\n', "x.k\\ud800", "the key holds U+D800"),  # the key named as its escape
        ('x: "\\ude00\\ud83d"\n', "x", "the value holds U+DE00"),  # a pair the wrong way round is two lone halves
        ('x: "\\ud83d\\ude00\\ud83d"\n', "x", "the value holds U+D83D"),
    ],
)
def test_lone_surrogates_are_refused(text: str, key: str, reason: str) -> None:
    """A ``\\ud800`` escape made a string no encoder takes: a rule's message gave every block a 500, a const state
    field sent every request to the fail mode, ``data`` crashed ``guard policy check`` without file or line."""
    with pytest.raises(PolicyError) as caught:
        load_yaml(text, "p.yaml")
    assert (caught.value.file, caught.value.line, caught.value.key) == ("p.yaml", 1, key)
    assert reason in caught.value.reason
    str(caught.value).encode("utf-8")  # the error itself can be printed


def test_a_surrogate_pair_written_as_two_escapes_is_its_character() -> None:
    """``json.dumps`` writes an emoji as ``"\\ud83d\\ude00"``: such a JSON policy was refused as holding lone
    surrogates."""
    data, _ = load_yaml('{"data": {"k": "a \\ud83d\\ude00", "\\ud83d\\ude00": 1}}', "p.json")
    assert data == {"data": {"k": "a \U0001F600", "\U0001F600": 1}}


def test_a_lone_surrogate_in_the_text_itself_is_refused_with_its_line() -> None:
    """``load_text`` given a str holding one raised a bare UnicodeEncodeError (the size check encoded the text)."""
    with pytest.raises(PolicyError) as caught:
        load_yaml("policies: []\ndata: {k: a\ud800}\n", "x.yaml")
    assert (caught.value.line, caught.value.key) == (2, "")
    assert "holds U+D800, a lone surrogate" in caught.value.reason
    assert load_yaml("data: {k: a\ud83d\ude00}\n")[0] == {"data": {"k": "a\U0001F600"}}  # a pair is its character


def test_lone_surrogates_are_kept_only_where_the_caller_allows() -> None:
    """A policy test file keeps them in an agent's input (``guard/devtools/testing.py``), nowhere else."""
    def under_b(path: tuple[str | int, ...]) -> bool:
        return path[:1] == ("b",)

    text = 'b: {prompt: "a \\ud800 b", "k\\udc00": 1}\n'
    assert load_yaml(text, "p_test.yaml", surrogates=under_b)[0] == {"b": {"prompt": "a \ud800 b", "k\udc00": 1}}
    with pytest.raises(PolicyError) as caught:
        load_yaml(text.replace("b:", "a: 1\nc:"), "p_test.yaml", surrogates=under_b)
    assert (caught.value.line, caught.value.key) == (2, "c.prompt")


@pytest.mark.parametrize(("char", "escape"), [("\x85", "\\N"), ("\u2028", "\\L"), ("\u2029", "\\P")])
def test_line_breaks_only_yaml_11_reads_as_such_are_refused_with_line_and_column(char: str, escape: str) -> None:
    """PyYAML (YAML 1.1) ends a comment at U+0085, U+2028, U+2029; YAML 1.2 tools read on, so the key after one was
    a key for guard only (``mode: shadow`` hidden from the editor). Refused anywhere, naming its line and column."""
    text = f"policies:\n  - id: p\n    default: allow  # reviewed{char}    mode: shadow\n"
    with pytest.raises(PolicyError) as caught:
        load_yaml(text.encode("utf-8"), "p.yaml")
    assert (caught.value.file, caught.value.line) == ("p.yaml", 3)
    assert f"U+{ord(char):04X}" in caught.value.reason
    assert "at column 31" in caught.value.reason
    assert f"write {escape} inside a double-quoted string" in caught.value.reason
    assert load_yaml(f'k: "a {escape} b"\n')[0] == {"k": f"a {char} b"}  # the escape is the character


@pytest.mark.parametrize("end", ["\r", "\r\n"])
def test_the_position_of_a_yaml_11_line_break_is_counted_as_yaml_counts_lines(end: str) -> None:
    """Lines were counted by ``\\n`` only, so in a file with CR line ends a U+2028 on line 3 was at line 1, column
    46; a byte order mark counted as a column."""
    text = f"policies:{end}  - id: p{end}    default: allow  # reviewed\u2028    mode: shadow{end}"
    with pytest.raises(PolicyError) as caught:
        load_yaml(text.encode("utf-8"), "p.yaml")
    assert caught.value.line == 3 and "at column 31" in caught.value.reason
    with pytest.raises(PolicyError) as caught:
        load_yaml("\ufeff# a\u2029b\n".encode(), "p.yaml")
    assert caught.value.line == 1 and "at column 4" in caught.value.reason
    with pytest.raises(PolicyError) as caught:  # a control character is placed by the same count
        load_yaml(f"a: 1{end}b: 2{end}c: \x07{end}", "p.yaml")
    assert caught.value.line == 3
