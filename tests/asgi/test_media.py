"""Charsets and Content-Type parameters: a judged text body is read as UTF-8 or US-ASCII only (any other charset is a
415 recorded as a decision, never a 500 and never a reading the application does not share); parameters are parsed
strictly."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from guard.asgi._media import charset, check_xml_encoding, parse_params
from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.errors import BodyError
from tests._backends import ScriptedBackend
from tests.asgi._apps import ATTACK, BENIGN, client_for, guarded_app, scripted_answers

pytestmark = pytest.mark.anyio

GuardFactory = Callable[..., Guard]
BOUNDARY = "guard-media-7MA4YWxk"

# Real text encodings that read the same bytes differently, and codecs that are not text encodings at all (each of
# these raised LookupError or UnicodeError, a 500, before).
REFUSED_CHARSETS = [
    "utf-16-le",
    "utf-16-be",
    "utf-16",
    "utf-32",
    "cp037",
    "utf-7",
    "latin-1",
    "iso-8859-1",
    "windows-1252",
    "shift_jis",
    "rot13",
    "rot_13",
    "base64",
    "hex",
    "zlib",
    "bz2",
    "uu",
    "quopri",
    "punycode",
    "undefined",
    "idna",
    "unicode_escape",
    "raw_unicode_escape",
    "mbcs",
    "klingon",
    "",
]
ATTACK_JSON = json.dumps({"message": ATTACK}).encode()


def _multipart_part(part_charset: str) -> bytes:
    return (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="message"\r\nContent-Type: text/plain; '
            f"charset={part_charset}\r\n\r\n"
        ).encode()
        + ATTACK.encode()
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


def _bodies(label: str) -> list[tuple[bytes, str]]:
    """The attack as ASCII bytes under a declared ``label``, in every body kind that reads a charset."""
    quoted = f'"{label}"'
    return [
        (ATTACK_JSON, f"text/plain; charset={quoted}"),
        (ATTACK_JSON, f"application/xml; charset={quoted}"),
        (ATTACK_JSON, f"text/csv; charset={quoted}"),
        (ATTACK_JSON, f"application/json; charset={quoted}"),
        (b"message=" + ATTACK.replace(" ", "+").encode(), f"application/x-www-form-urlencoded; charset={quoted}"),
        (_multipart_part(quoted), f"multipart/form-data; boundary={BOUNDARY}"),
        (_multipart_part("utf-8"), f"multipart/form-data; boundary={BOUNDARY}; charset={quoted}"),
    ]


@pytest.mark.parametrize("label", REFUSED_CHARSETS)
async def test_other_charsets_are_415_recorded_never_500(make_guard: GuardFactory, label: str) -> None:
    backend = ScriptedBackend(scripted_answers)
    lines: list[str] = []
    async with client_for(guarded_app(make_guard(backend, decision_log=DecisionLog(lines.append)))) as client:
        for body, content_type in _bodies(label):
            response = await client.post("/v1/echo", content=body, headers={"content-type": content_type})
            assert response.status_code == 415, (content_type, response.text)
            assert response.json()["code"] == "unsupported_charset" and "x-app" not in response.headers
            record = json.loads(lines[-1])
            assert record["result"]["rule"] == "unsupported_charset"
            assert record["decision_id"] == response.json()["decision_id"]
    assert backend.calls == 0


@pytest.mark.parametrize(
    "label",
    ["utf-8", "UTF-8", "utf8", "csUTF8", "unicode-1-1-utf-8", "us-ascii", "US-ASCII", "ascii", "ANSI_X3.4-1968"],
)
async def test_utf8_and_ascii_labels_are_judged(make_guard: GuardFactory, label: str) -> None:
    async with client_for(guarded_app(make_guard())) as client:
        for body, content_type in _bodies(label):
            response = await client.post("/v1/echo", content=body, headers={"content-type": content_type})
            assert response.status_code == 403 and response.json()["rule"] == "prompt_injection", content_type
        benign = await client.post(
            "/v1/echo", content=BENIGN.encode(), headers={"content-type": f"text/plain; charset={label}"}
        )
    assert benign.status_code == 200


async def test_ascii_label_reads_strictly(make_guard: GuardFactory) -> None:
    async with client_for(guarded_app(make_guard())) as client:
        response = await client.post(
            "/v1/echo", content="caf\u00e9".encode(), headers={"content-type": "text/plain; charset=us-ascii"}
        )
    assert response.status_code == 400 and response.json()["code"] == "invalid_text"


@pytest.mark.parametrize(
    "declaration",
    [
        '<?xml version="1.0" encoding="UTF-7"?>',
        "<?xml version='1.0' encoding='utf-16'?>",
        '\ufeff<?xml version="1.0" encoding="ISO-8859-1" standalone="yes"?>',
        '<?xml version="1.0" encoding="EBCDIC-CP-US"?>',
    ],
)
async def test_xml_declaring_another_encoding_is_415(make_guard: GuardFactory, declaration: str) -> None:
    body = (declaration + f"<note>{ATTACK}</note>").encode()
    async with client_for(guarded_app(make_guard())) as client:
        for media in ("application/xml", "text/xml", "application/soap+xml"):
            response = await client.post("/v1/echo", content=body, headers={"content-type": media})
            assert response.status_code == 415 and response.json()["code"] == "unsupported_charset", media
    with pytest.raises(BodyError, match="XML declaration"):
        check_xml_encoding(body)


@pytest.mark.parametrize(("meta", "status"), [
    ('<meta charset="iso-2022-jp">', 415),  # a browser would decode SE\x1b(BCRET as SECRET
    ('<meta http-equiv="Content-Type" content="text/html; charset=Shift_JIS">', 415),
    ('<meta charset="utf-8">', 403),  # read as it is, and judged
    ("", 403),
    ("<!--" + "x" * 1100 + '--><meta charset="iso-2022-jp">\x1b(B', 415),  # past the first 1,024 bytes: the ESC
    ("\x1b(B", 415),  # no <meta>: a browser may detect ISO-2022-JP by its escapes
])  # fmt: skip
async def test_html_naming_another_charset_in_a_meta_tag_is_415(make_guard: GuardFactory, meta: str,
                                                                 status: int) -> None:
    body = f"<html><head>{meta}</head><body>{ATTACK}</body></html>".encode()
    async with client_for(guarded_app(make_guard())) as client:
        response = await client.post("/v1/echo", content=body, headers={"content-type": "text/html"})
        declared = await client.post("/v1/echo", content=body, headers={"content-type": "text/html; charset=utf-8"})
    assert response.status_code == status and "x-app" not in response.headers
    assert declared.status_code == 403  # a declared charset is what a browser uses, not the <meta> tag
    if status == 415:
        assert response.json()["code"] == "unsupported_charset"


@pytest.mark.parametrize("content_type", ["", "text/plain", "text/html"])
async def test_untyped_or_plain_text_without_a_charset_holding_an_esc_byte_is_415(make_guard: GuardFactory,
                                                                                  content_type: str) -> None:
    """A browser picks the charset of plain text or an untyped body (sniffed as HTML when it starts like HTML) when
    none is declared, and may pick ISO-2022-JP, which reads ``TOP\x1b(BSECRET`` as ``TOPSECRET``: refused (415), as
    HTML is; with ``charset=utf-8`` declared the ESC byte is read as it is."""
    body = b"<html>TOP\x1b(BSECRET</html>" if content_type != "text/plain" else b"TOP\x1b(BSECRET"
    headers = {"content-type": content_type} if content_type else {}
    async with client_for(guarded_app(make_guard())) as client:
        response = await client.post("/v1/echo", content=body, headers=headers)
        declared = await client.post("/v1/echo", content=body,
                                     headers={"content-type": f"{content_type or 'text/plain'}; charset=utf-8"})
    assert response.status_code == 415 and response.json()["code"] == "unsupported_charset"
    assert declared.status_code == 200


async def test_xml_in_utf8_is_judged(make_guard: GuardFactory) -> None:
    async with client_for(guarded_app(make_guard())) as client:
        for declaration in ('<?xml version="1.0" encoding="UTF-8"?>', '<?xml version="1.0"?>', ""):
            body = (declaration + f"<note>{ATTACK}</note>").encode()
            response = await client.post("/v1/echo", content=body, headers={"content-type": "application/xml"})
            assert response.status_code == 403, declaration


def test_charset_units() -> None:
    assert charset({}) == "utf-8" and charset({"charset": " UTF-8 "}) == "utf-8"
    assert charset({"charset": "us-ascii"}) == "ascii"
    with pytest.raises(BodyError, match="cannot be inspected") as info:
        charset({"charset": "rot13"}, "body.x")
    assert info.value.status == 415 and info.value.field == "body.x"


PARAMS_OK: list[tuple[str, tuple[str, dict[str, str]]]] = [
    ("application/json", ("application/json", {})),
    ("application/json;", ("application/json", {})),
    ("Text/Plain ; Charset=UTF-8", ("text/plain", {"charset": "UTF-8"})),
    ('multipart/form-data; boundary="a b;c"', ("multipart/form-data", {"boundary": "a b;c"})),
    ('form-data; name="a;b"; filename="c d"', ("form-data", {"name": "a;b", "filename": "c d"})),
    ("form-data; name=x; filename*=utf-8''y.txt", ("form-data", {"name": "x", "filename*": "utf-8''y.txt"})),
]


@pytest.mark.parametrize(("value", "expected"), PARAMS_OK)
def test_params_parse(value: str, expected: tuple[str, dict[str, str]]) -> None:
    assert parse_params(value) == expected


PARAMS_BAD = [
    ('multipart/form-data; boundary="ab\\cd"', "backslash"),
    ('form-data; name="pro\\mpt"', "backslash"),
    ('form-data; name="a\\"b"', "backslash"),
    ('form-data; filename="c\\\\d"', "backslash"),
    ('multipart/form-data; boundary=A; x="\\\\"; y="; boundary=B; z="', "backslash"),
    ("text/plain; charset=utf-8; charset=utf-16", "repeated"),
    ("text/plain; CHARSET=utf-8; charset=utf-16", "repeated"),
    ("multipart/form-data; boundary=a; boundary*=utf-8''b", "RFC 2231"),
    ("form-data; name=x; name*=utf-8''prompt", "RFC 2231"),
    ("form-data; name*0=pro; name*1=mpt", "RFC 2231"),
    ("text/plain; charset", "has no value"),
    ("text/plain; charset=utf-8; flag; x=1", "has no value"),
    ('form-data; name=a"b;c"', "neither a token"),
    ('form-data; name="a"b', "text after its value"),
    ('form-data; name="abc', "no closing quote"),
    ("text/plain; char set=utf-8", "not a token"),
]


@pytest.mark.parametrize(("value", "reason"), PARAMS_BAD)
def test_ambiguous_params_are_400(value: str, reason: str) -> None:
    with pytest.raises(BodyError, match=reason) as info:
        parse_params(value)
    assert info.value.status == 400 and info.value.code == "invalid_content_type"


async def test_ambiguous_content_type_is_400_through_the_middleware(make_guard: GuardFactory) -> None:
    backend = ScriptedBackend(scripted_answers)
    headers: list[dict[str, Any]] = [
        {"content-type": "text/plain; charset=utf-16; charset=utf-8"},
        {"content-type": "application/json; charset"},
    ]
    async with client_for(guarded_app(make_guard(backend))) as client:
        for header in headers:
            response = await client.post("/v1/echo", content=ATTACK_JSON, headers=header)
            assert response.status_code == 400 and response.json()["code"] == "invalid_content_type", header
    assert backend.calls == 0


@pytest.mark.parametrize("value", [
    'form-data; name="a"; \x0cfilename="a.png"', 'form-data; name="a"; filename\x0c="a.png"',
    'form-data; name="a"; \x1ffilename="a"', 'form-data; name="a"; \x85filename="a"', "text/plain; charset=utf-8\xa0",
])  # fmt: skip
def test_parameter_names_and_values_trim_only_http_whitespace(value: str) -> None:
    """``str.strip()`` also removed \\x0c, \\x1f, \\x85 and \\xa0, so ``\\x0cfilename`` was a file to guard (kept as
    metadata under opaque_media="metadata") and a text field to python-multipart (attack finding)."""
    with pytest.raises(BodyError) as caught:
        parse_params(value)
    assert caught.value.code == "invalid_content_type"
