"""The body-less subject policies match: the host a ``hosts:`` glob sees, the client's address."""

from __future__ import annotations

import pytest

from guard.asgi._subject import ClientHeader, client_address, forwarded_hosts, head_subject, header_map
from tests._linear import runs_in_time


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("api.example.com", "api.example.com"),
        ("API.Example.com:8443", "api.example.com"),
        ("api.example.com.", "api.example.com"),  # the fully qualified form names the same host
        ("api.example.com.:443", "api.example.com"),
        ("[::1]:8080", "[::1]"),
        (None, "testserver"),
    ],
)
def test_host_is_the_header_without_port_or_trailing_dot(host: str | None, expected: str) -> None:
    headers = [(b"host", host.encode())] if host is not None else []
    scope = {"type": "http", "method": "post", "path": "/v1", "headers": headers, "server": ("TestServer", 80)}
    subject = head_subject(scope, header_map(scope), None)
    assert subject.host == expected and subject.method == "POST"


def test_header_map_lower_cases_names_and_joins_repeats() -> None:
    scope = {"headers": [(b"Host", b"api"), (b"X-Tag", b"a"), (b"x-tag", b"b"), (bytearray(b"X-Raw"), b"\xe9")]}
    expected = {"host": "api", "x-tag": "a, b", "x-raw": "\xe9"}  # latin-1, as ASGI defines
    assert header_map(scope) == expected and header_map(scope) == expected
    assert header_map({"headers": [(b"Host", b"api"), (b"X-Tag", b"a")]}) == {"host": "api", "x-tag": "a"}


def test_with_body_makes_a_new_subject_and_leaves_the_head_as_it_was() -> None:
    from guard.asgi._subject import with_body

    scope = {"type": "http", "method": "POST", "path": "/v1", "headers": [(b"host", b"api")], "server": ("api", 80)}
    head = head_subject(scope, header_map(scope), None)
    full = with_body(head, {"q": ["1"]}, {"prompt": "hi"}, "hi", b'{"prompt": "hi"}')
    assert (full.query, full.body, full.body_text) == ({"q": ["1"]}, {"prompt": "hi"}, "hi")
    assert (head.query, head.body, head.body_text) == ({}, None, "") and full is not head


@pytest.mark.parametrize(
    ("content_type", "received", "form_string"),
    [
        ("application/x-www-form-urlencoded", b"q[=]=attack", "q[=]=attack"),  # qs names it q[=], guard q[
        ("application/x-www-form-urlencoded; charset=UTF-8", b"filter[a]=1&b=2", "filter[a]=1&b=2"),
        ("application/x-www-form-urlencoded", b"q=1&filter%5Ba=2", ""),  # qs splits it as guard does
        ("application/x-www-form-urlencoded", b"q=1&filter%5Ba%5D=2", "q=1&filter%5Ba%5D=2"),  # qs reads %5D= as ]=
        ("multipart/form-data; boundary=b", b'--b\r\nContent-Disposition: form-data; name="q"\r\n\r\n]=x\r\n--b--',
         ""),  # multipart names are not qs's
        ("application/json", b'{"q]=": 1}', ""),
    ],
)
def test_with_body_keeps_a_urlencoded_body_as_sent_only_where_qs_may_name_a_field_otherwise(
        content_type: str, received: bytes, form_string: str) -> None:
    from guard.asgi._subject import with_body

    scope = {"type": "http", "method": "POST", "path": "/v1", "headers": [(b"content-type", content_type.encode())]}
    full = with_body(head_subject(scope, header_map(scope), None), {}, {}, "", received)
    assert full.form_string == form_string


@pytest.mark.parametrize(
    ("forwarded", "hops", "expected"),
    [
        ("198.51.100.7", 1, "198.51.100.7"),
        ("6.6.6.6, 198.51.100.7", 1, "198.51.100.7"),  # the client wrote 6.6.6.6; the proxy appended the rest
        ("6.6.6.6, 198.51.100.7, 10.0.0.2", 2, "198.51.100.7"),  # two trusted proxies
        ("198.51.100.7", 2, "10.0.0.9"),  # fewer entries than trusted proxies: the peer
        ("6.6.6.6, unknown", 1, "unknown"),  # written by the trusted proxy: an identity, not the proxy's address
        ("6.6.6.6,", 1, "10.0.0.9"),  # nothing written: the peer
        ("203.0.113.7:51234", 1, "203.0.113.7"),  # a port after the address (some load balancers append one)
        ("[2001:db8::1]:443", 1, "2001:db8::1"),
        ("2001:db8::1", 1, "2001:db8::1"),
        ("0000::1", 1, "::1"),
        ("0:0::0:1", 1, "::1"),
        ("::FFFF:10.0.0.1", 1, "10.0.0.1"),
        (None, 1, "10.0.0.9"),
    ],
)
def test_the_client_is_the_entry_the_outermost_trusted_proxy_appended(
    forwarded: str | None, hops: int, expected: str
) -> None:
    headers = {"x-forwarded-for": forwarded} if forwarded is not None else {}
    scope = {"client": ("10.0.0.9", 5000)}
    assert client_address(scope, headers, ClientHeader("x-forwarded-for", hops)) == expected


@pytest.mark.parametrize(
    ("forwarded", "expected"),
    [
        ('for="198.51.100.7:40001"', "198.51.100.7"),  # HAProxy's option forwarded with the port: one identity
        ("for=198.51.100.7;proto=https;by=10.0.0.2", "198.51.100.7"),
        ('for=6.6.6.6, For="[2001:db8::1]:443"', "2001:db8::1"),
        ("for=unknown", "unknown"),  # written by the trusted proxy: an identity
        ("proto=https", "10.0.0.9"),  # no for=: the peer
        # a quoted value (host= echoes the client's Host) holding ; or , ends nothing (review finding)
        ('proto=https;host="x;for=6.6.6.6;y=z";for=198.51.100.7', "198.51.100.7"),
        ('for=198.51.100.7;proto=https;host="x,for=6.6.6.6;y=z"', "198.51.100.7"),
        ('for=198.51.100.7;host="x,for=anything-I-like-123"', "198.51.100.7"),
        ('garbage;host="a,for=6.6.6.6", for=1.2.3.4', "1.2.3.4"),  # a skipped element's quotes read whole too
        ('for=1.2.3.4, garbage;host="a,for=6.6.6.6"', "10.0.0.9"),  # the last element has no for=: the peer
        ("for=1.2.3.4,", "10.0.0.9"),  # an empty last element: the peer, as in X-Forwarded-For
    ],
)
def test_the_forwarded_header_is_read_by_its_for_parameters(forwarded: str, expected: str) -> None:
    """``--client-header forwarded`` kept each element as written: ``for="198.51.100.7:40001"`` was a new client
    per source port, escaping the per-client review cap, and rules on ``subject.client`` never matched (attack
    finding). RFC 7239's ``for=`` is read, unquoted, and its address given in one spelling."""
    scope = {"client": ("10.0.0.9", 5000)}
    assert client_address(scope, {"forwarded": forwarded}, ClientHeader("forwarded", 1)) == expected
    assert client_address(scope, {"x-forwarded-for": "fe80::1%eth0"}, ClientHeader("x-forwarded-for")) == "fe80::1"


def test_the_peer_is_the_client_without_a_client_header() -> None:
    headers = {"x-forwarded-for": "6.6.6.6"}
    assert client_address({"client": ("::ffff:10.0.0.9", 1)}, headers, None) == "10.0.0.9"
    assert client_address({"client": ("testclient", 1)}, headers, None) == "testclient"  # not an IP: as it is
    assert client_address({}, headers, None) is None


@pytest.mark.parametrize(
    ("value", "hosts"),
    [
        ('for="x;host=evil.example"', ["evil.example"]),  # Rack splits inside quotes
        ('for=1.2.3.4;host="[2001:db8::1]:8443"', ["[2001:db8::1]:8443"]),
        ("for=x, Host = a.example ", ["a.example"]),
        ("host=" + " " * 4000 + '""x', ['""x']),  # Rack reads an empty value: none
        ("host" + " " * 4000 + "=x", ["x"]),
        ("for=a;" + " " * 4000 + 'host =  "b"  ', ["b"]),
    ],
)
def test_forwarded_hosts_as_rfc_7239_and_rack_read_them(value: str, hosts: list[str]) -> None:
    """Spaces around a Rack-read pair are stripped with string operations: a regular expression whose three runs all
    matched spaces took 4.5 s on 1.6 KB and 130 s on 4 KB (a hang bound: each case here is microseconds)."""
    assert forwarded_hosts(value) == hosts


def test_a_forwarded_header_of_blanks_is_read_in_linear_time() -> None:
    """``for=1;`` then a run of blanks and no ``=``: each blank was given back by one ``\\s*`` and taken again by the
    next, quadratic in the run (16 KB: 0.5 s; 400 KB: minutes). Run in a child process killed after 60 s."""
    code = "from guard.asgi._subject import forwarded_hosts\nforwarded_hosts('for=1;' + ' ' * 400_000 + 'x')\n"
    runs_in_time(code, "forwarded_hosts on 400 KB of blanks")
