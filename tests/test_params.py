"""Parameter names as PHP, Rack 2, Rack 3 and qs read them (``guard/_params.py``)."""

from __future__ import annotations

import pytest

from guard._params import APPEND, fills, labels, pairs, readings, shown


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
    expected = {"PHP": php, "Rack 2": rack2, "Rack 3": rack3, "qs": qs}
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
    assert list(pairs("a=1;%20q=x& b&&c=%ZZ+d")) == [("a", "1"), (" q", "x"), ("b", ""), ("c", "%ZZ d")]
