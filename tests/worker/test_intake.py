"""Request-body intake of the worker (``guard/worker/_intake.py``): content codings, multipart assets, image checks."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import pytest
import zstandard
from PIL import Image

from guard.errors import BodyError, FieldError, RequestValidationError
from guard.worker import _intake

BODY = json.dumps({"model": "clef-flash", "state": "hello " * 2000, "questions": {}}).encode()


@pytest.mark.parametrize("cut", [1, 3, 30, 0])
def test_a_truncated_zstd_body_is_invalid_encoding(cut: int) -> None:
    packed = zstandard.compress(BODY)
    with pytest.raises(BodyError) as caught:
        _intake.decode_content(packed[:-cut] if cut else b"", "zstd", 1 << 20)
    assert (caught.value.status, caught.value.code, caught.value.field) == (
        400, "invalid_encoding", "headers.content-encoding")


def test_zstd_frames_in_sequence_are_one_body_and_a_cut_last_frame_is_refused() -> None:
    first, second = zstandard.compress(BODY[:100]), zstandard.compress(BODY[100:])
    assert _intake.decode_content(first + second, "zstd", 1 << 20) == BODY
    with pytest.raises(BodyError, match="zstd"):
        _intake.decode_content(first + second[:-2], "zstd", 1 << 20)


def image_bytes(size: tuple[int, int], fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    Image.new("1", size).save(out, fmt, **options)
    return out.getvalue()


def test_no_header_parser_but_the_decodable_formats_runs_on_client_bytes() -> None:
    """A TIFF (a format the backend never decodes) is not parsed for its size: the backend refuses it as undecodable,
    it is not a 413 read from a TIFF header."""
    tiff = image_bytes((5000, 5000), "TIFF", compression="group4")
    body = {"images": [{"content_type": "image/png", "base64": base64.b64encode(tiff).decode()}]}
    _intake.check_images(body, 1000 * 1000)  # no BodyError: the bytes are not read as an image at all
    png = image_bytes((5000, 5000), "PNG")
    body = {"images": [{"content_type": "image/png", "base64": base64.b64encode(png).decode()}]}
    with pytest.raises(BodyError, match="5000x5000"):
        _intake.check_images(body, 1000 * 1000)


def test_an_image_too_narrow_for_the_processor_is_refused_from_its_header_naming_it() -> None:
    """Sides 200 apart are what the image processor takes; more it refuses, so the header check does first."""
    _intake.check_images({"images": [{"content_type": "image/png", "base64": _png64((400, 2))}]}, 10**6)
    for names, field in (([], "images[0]"), (["scan"], "assets.scan")):
        body = {"images": [{"content_type": "image/png", "base64": _png64((2, 401))}]}
        with pytest.raises(BodyError, match="2x401 pixels") as caught:
            _intake.check_images(body, 10**6, names)
        assert (caught.value.status, caught.value.field) == (422, field)


def _png64(size: tuple[int, int]) -> str:
    return base64.b64encode(image_bytes(size, "PNG")).decode()


def test_the_declared_type_must_be_the_bytes_format() -> None:
    gif = base64.b64encode(image_bytes((8, 8), "GIF")).decode()
    _intake.check_images({"images": [{"content_type": "image/gif", "base64": gif}]}, 100)
    _intake.check_images({"images": [f"data:image/gif;base64,{gif}"]}, 100)
    for body, names, field in (
        ({"images": [{"content_type": "image/png", "base64": gif}]}, [], "images[0].content_type"),
        ({"images": [f"data:image/png;base64,{gif}"]}, [], "images[0]"),
        ({"images": [{"content_type": "image/png", "base64": gif}]}, ["scan"], "assets.scan"),
    ):
        with pytest.raises(BodyError, match="image/gif") as caught:
            _intake.check_images(body, 100, names)
        assert (caught.value.status, caught.value.field) == (422, field)


def test_images_in_base64_wrapped_into_lines_or_without_a_data_prefix_are_checked_from_their_headers() -> None:
    """The backend decodes them (as the reference does), so the worker's pixel limit and type check see them too."""
    png = image_bytes((2000, 2000), "PNG")
    for item in (
        "data:image/png;base64," + base64.encodebytes(png).decode(),
        {"content_type": "image/png", "base64": base64.encodebytes(png).decode()},
        base64.b64encode(png).decode(),
    ):
        with pytest.raises(BodyError, match="2000x2000") as caught:
            _intake.check_images({"images": [item]}, 1000 * 1000)
        assert caught.value.status == 413
    gif = base64.encodebytes(image_bytes((80, 80), "GIF")).decode()
    with pytest.raises(BodyError, match="is declared 'image/png' but its bytes are image/gif"):
        _intake.check_images({"images": [f"data:image/png;base64,{gif}"]}, 100 * 100)


def test_a_phone_jpeg_and_an_animated_png_are_the_types_they_declare() -> None:
    """PIL names a JPEG holding a second picture (MPO, as phone cameras write) ``image/mpo`` and an animated PNG
    ``image/apng``: they are a JPEG and a PNG."""
    frames = [Image.new("RGB", (8, 8), colour) for colour in ("red", "blue")]
    for fmt, declared in (("MPO", "image/jpeg"), ("PNG", "image/png")):
        out = io.BytesIO()
        frames[0].save(out, fmt, save_all=True, append_images=frames[1:])
        payload = base64.b64encode(out.getvalue()).decode()
        _intake.check_images({"images": [{"content_type": declared, "base64": payload}]}, 100)
        _intake.check_images({"images": [f"data:{declared};base64,{payload}"]}, 100)


def test_validation_errors_name_the_asset_the_client_sent() -> None:
    error = RequestValidationError([FieldError("images[1].content_type", "must be one of image/png"),
                                    FieldError("images", "has 5 entries"), FieldError("state", "is required")])
    named = _intake.name_assets(error, ["front", "back"])
    assert [e.field for e in named.errors] == ["assets.back", "assets", "state"]
    assert str(named).startswith("assets.back: must be one of image/png")
    assert _intake.name_assets(error, []) is error


def test_a_declared_image_jpg_is_a_jpeg() -> None:
    jpeg = base64.b64encode(image_bytes((8, 8), "JPEG")).decode()
    _intake.check_images({"images": [f"data:image/jpg;base64,{jpeg}"]}, 100)
    png = base64.b64encode(image_bytes((8, 8), "PNG")).decode()
    with pytest.raises(BodyError, match="declared 'image/jpg' but its bytes are image/png"):
        _intake.check_images({"images": [f"data:image/jpg;base64,{png}"]}, 100)


def test_more_codings_than_clients_send_are_refused_before_any_is_undone() -> None:
    plain = json.dumps({"a": 1}).encode()
    body = plain
    for _ in range(5):
        body = zstandard.compress(body)
    once = zstandard.compress(plain)
    assert _intake.decode_content(once, "identity, zstd, identity", 1 << 20) == plain  # identity is no coding
    with pytest.raises(BodyError, match="more than 4 content codings") as caught:
        _intake.decode_content(body, ", ".join(["zstd"] * 5), 1 << 20)
    assert (caught.value.status, caught.value.code) == (400, "invalid_encoding")


def test_a_part_named_in_utf8_matches_the_asset_that_names_it() -> None:
    """RFC 7578 lets a field name be UTF-8; the JSON naming the part is UTF-8 too, but part names were read as
    latin-1, so ``é`` could never match (attack finding)."""
    boundary = "b0undary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\nContent-Type: application/json\r\n\r\n'
            '{}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="é"\r\nContent-Type: image/png\r\n\r\n'
            'PNGDATA\r\n'
            f'--{boundary}--\r\n').encode()
    request, parts = _intake.split_multipart(body, f"multipart/form-data; boundary={boundary}")
    assert request == b"{}" and list(parts) == ["é"] and parts["é"][1] == b"PNGDATA"


@pytest.mark.parametrize("repeated", [
    'Content-Disposition: form-data; name="notes"\r\nContent-Disposition: form-data; name="scan"',
    'Content-Disposition: form-data; name="scan"\r\nContent-Type: image/png\r\ncontent-type: image/gif',
])
def test_a_part_sending_a_header_twice_is_refused_naming_the_part(repeated: str) -> None:
    """A part's repeated header was read as its last copy (review finding), so a front proxy reading the first saw
    another part name or type than the worker. The part is refused, named by its place in the body."""
    boundary = "b0undary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\n\r\n{{}}\r\n'
            f'--{boundary}\r\n{repeated}\r\n\r\nPNGDATA\r\n'
            f'--{boundary}--\r\n').encode()
    with pytest.raises(BodyError, match="part 1 sends its content-(disposition|type) header more than once") as caught:
        _intake.split_multipart(body, f"multipart/form-data; boundary={boundary}")
    assert (caught.value.status, caught.value.code, caught.value.field) == (400, "invalid_multipart", "body")


def _form(boundary: str, parts: list[tuple[str, str]]) -> bytes:
    return "".join(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n{data}\r\n"
                   for disposition, data in parts).encode() + f"--{boundary}--\r\n".encode()


@pytest.mark.parametrize("content_type", [
    "multipart/form-data; boundary=aaa; boundary=bbb",
    "multipart/form-data; Boundary=aaa; boundary=bbb",
    'multipart/form-data; boundary="aaa;x"; charset=utf-8; BOUNDARY=bbb',
    "multipart/form-data; boundary=bbb; boundary*=UTF-8''aaa",  # RFC 2231's form: Go's mime reads it instead
])
def test_a_content_type_repeating_its_boundary_is_refused(content_type: str) -> None:
    """A repeated boundary was read as its last copy, where Python's ``email`` (and any first-wins reader in front)
    reads the first: the two saw different bodies in the same bytes (review finding)."""
    body = (_form("bbb", [('form-data; name="request"', '{"state": "scored"}')])
            + _form("aaa", [('form-data; name="request"', '{"state": "inspected"}')]))
    with pytest.raises(BodyError, match="the Content-Type sends its 'boundary' parameter more than once") as caught:
        _intake.split_multipart(body, content_type)
    assert (caught.value.status, caught.value.code, caught.value.field) == (400, "invalid_multipart", "content-type")


@pytest.mark.parametrize("disposition", [
    'form-data; name="scan"; name="notes"',
    'form-data; name="scan"; NAME="notes"',
    'form-data; name="scan;x"; filename="a.png"; name=notes',
    "form-data; name=\"notes\"; name*=UTF-8''scan",
])
def test_a_part_repeating_its_name_parameter_is_refused_naming_the_part(disposition: str) -> None:
    """``name="scan"; name="notes"`` was read as the part ``notes`` (the last copy); a first-wins reader sees
    ``scan``. The part is refused, named by its place in the body."""
    body = _form("b0undary", [('form-data; name="request"', "{}"), (disposition, "PNGDATA")])
    with pytest.raises(BodyError, match="part 1 sends its 'name' parameter of Content-Disposition more than once"
                       ) as caught:
        _intake.split_multipart(body, "multipart/form-data; boundary=b0undary")
    assert (caught.value.status, caught.value.code, caught.value.field) == (400, "invalid_multipart", "body")


def test_parameters_sent_once_with_quoted_semicolons_and_escaped_quotes_are_read() -> None:
    disposition = r'form-data; name="scan"; filename="a \"b; name=c\".png"'
    body = _form("b0undary", [('form-data; name="request"', "{}"), (disposition, "PNGDATA")])
    request, parts = _intake.split_multipart(body, 'multipart/form-data; charset=utf-8; boundary="b0undary"')
    assert request == b"{}" and list(parts) == ["scan"]
    both = "form-data; name=\"scan\"; filename=\"na\u00efve.png\"; filename*=UTF-8''na%C3%AFve.png"  # RFC 6266
    body = _form("b0undary", [('form-data; name="request"', "{}"), (both, "PNGDATA")])
    assert list(_intake.split_multipart(body, "multipart/form-data; boundary=b0undary")[1]) == ["scan"]
