"""Parameter names as PHP, Rack 2, Rack 3 and qs read them (``guard/_params.py``)."""

from __future__ import annotations

import pytest

from guard._params import APPEND, FRAMEWORKS, fills, is_plain, labels, pairs, qs_names, readings, shown

#: Where qs from 6.15.4 reads a name otherwise than earlier qs (the ``qs`` column): an unclosed bracket is a child.
QS_BALANCED = {"q[x": ("q", "[x"), "q[": ("q", "[")}


@pytest.mark.parametrize(
    ("name", "php", "rack2", "rack3", "qs"),
    [
        ("q", ("q",), ("q",), ("q",), ("q",)),
        ("q[]", ("q", APPEND), ("q", APPEND), ("q", APPEND), ("q", APPEND)),
        ("q[a][b]", ("q", "a", "b"), ("q", "a", "b"), ("q", "a", "b"), ("q", "a", "b")),
        ("[q]", None, ("q",), ("[q]",), ("q",)),  # a leading [k]: Rack 2 and qs read k, PHP drops the name
        ("]q", ("]q",), ("q",), ("]q",), ("]q",)),  # Rack 2's key: \A[\[\]]*([^\[\]]+)\]*
        ("q]", ("q]",), ("q",), ("q]",), ("q]",)),
        ("q[x", ("q_x",), ("q", "x"), ("q", "[x"), ("q[x",)),  # an unclosed '[': PHP's '_', Rack nests
        ("q[", ("q_",), ("q[",), ("q[",), ("q[",)),
        ("q.x", ("q_x",), ("q.x",), ("q.x",), ("q.x",)),
        ("  q", ("q",), ("  q",), ("  q",), ("  q",)),  # PHP drops leading spaces
        ("q\x00x", ("q",), ("q\x00x",), ("q\x00x",), ("q\x00x",)),  # PHP ends a name at NUL
        ("q[a]b", ("q", "a"), ("q", "a", "b"), ("q", "a", "b"), ("q", "a")),
        ("q[ ]", ("q", APPEND), ("q", " "), ("q", " "), ("q", " ")),
        ("a[1][2][3][4][5][6][7]", ("a", *"1234567"), ("a", *"1234567"), ("a", *"1234567"),
         ("a", *[APPEND] * 5, "[6][7]")),  # qs: five levels, the rest one key; an index makes a list without holes
    ],
)
def test_readings_follow_each_parser(name: str, php: tuple, rack2: tuple, rack3: tuple, qs: tuple) -> None:
    expected = {"PHP": php, "Rack 2": rack2, "Rack 3": rack3, "qs": qs, "qs 6.15": QS_BALANCED.get(name, qs)}
    assert readings(name) == {framework: path for framework, path in expected.items() if path is not None}


def test_fills_is_the_place_or_below_it() -> None:
    assert fills(("q", APPEND), ("q",)) and fills(("q", "a", "b"), ("q",))
    assert fills(("filter", "search", "0"), ("filter", "search"))
    assert not fills(("filter", "status"), ("filter", "search")) and not fills(("filter",), ("filter", "search"))
    assert fills(("ids",), ("ids", APPEND))  # a list read whole: a plain 'ids' fills it
    assert fills(("f", APPEND), ("f", "0")) and not fills(("f", APPEND), ("f", "x"))  # [] appends at an index
    assert readings("f[5]")["qs"] == ("f", APPEND) and readings("f[21]")["qs"] == ("f", "21")  # qs's arrayLimit


def test_shown_labels_and_pairs() -> None:
    assert (shown(("filter", "search")), shown(("q", APPEND))) == ("filter[search]", "q[]")
    assert labels({"qs", "Rack 3", "PHP", "Rack 2"}) == ("PHP", "Rails", "Express")
    assert labels({"Rack 2"}) == ("Rails (Rack 2)",)
    assert list(pairs("a=1;%20q=x& b&&c=%ZZ+d&e=")) == [("a", "1"), (" q", "x"), ("b", None), ("c", "%ZZ d"), ("e", "")]


def test_each_parser_stops_at_its_depth_limit() -> None:
    """A name nested deeper than a framework reads (PHP 64 indices, Rack 2 100 keys, Rack 3 32) is dropped by that
    reading (PHP drops it, Rack refuses the request), found without recursion however deep it is sent."""
    assert readings("q" + "[a]" * 64) == {"PHP": ("q", *"a" * 64), "Rack 2": ("q", *"a" * 64),
                                          "qs": ("q", *"a" * 5, "[a]" * 59), "qs 6.15": ("q", *"a" * 5, "[a]" * 59)}
    assert readings("q" + "[a]" * 31)["Rack 3"] == ("q", *"a" * 31)
    assert readings("q" + "[a]" * 99)["Rack 2"] == ("q", *"a" * 99)
    assert set(readings("q" + "[a]" * 100)) == {"qs", "qs 6.15"}
    deep = readings("x" + "[a]" * 5000)
    assert deep == dict.fromkeys(("qs", "qs 6.15"), ("x", *"a" * 5, "[a]" * 4995))


def test_a_long_index_is_a_key() -> None:
    """qs reads an index only up to 20 as a list's; a 4400-digit one (past Python's int() digit limit) is a key."""
    index = "9" * 4400
    assert readings(f"x[{index}]")["qs"] == ("x", index)
    assert readings("x[05]")["qs"] == ("x", "05") and readings("x[20]")["qs"] == ("x", APPEND)


@pytest.mark.parametrize("name", ["q", "user_id", "X-Trace", "0", "_method", "a-b_C9"])
def test_a_plain_name_is_read_by_every_parser_as_itself(name: str) -> None:
    """What lets the alias check skip a plain name when the field's key is plain too (review: four parsers ran for
    every parameter and every field on every request)."""
    assert is_plain(name) and readings(name) == dict.fromkeys(FRAMEWORKS, (name,))


@pytest.mark.parametrize("name", ["a.b", " q", "q[]", "[q]", "q]", "", "é", "a b", "q\x00"])
def test_a_name_a_parser_reads_otherwise_is_not_plain(name: str) -> None:
    assert not is_plain(name)


def test_qs_ends_a_name_at_a_bracket_before_an_equals_sign() -> None:
    # qs reads %5D as ']' before it looks for ']=' (qs 6.12.2 on, which Express 4.21's body-parser uses)
    assert list(qs_names("q[=]=attack&a=b&c%5D=d]=e&&x&y[=%5d=z")) == ["q[=]", "a", "c]", "x", "y[=]"]
