"""Request bodies as System One clients send them: ``Content-Encoding`` (gzip, deflate, br, zstd) and
``multipart/form-data`` with image parts (TypeSafe's SDK: a JSON part named ``request``, then one part per asset that
``assets.<name>.part`` names). Only JSON and multipart bodies are taken (:func:`body_kind`), and every image's size is
read from its header before anything decodes it (:func:`check_images`).

Decompression stops as soon as the output passes the body cap (413), so a small compressed bomb costs at most the cap
(zstd: the cap plus one step's output). A stream cut short is a 400 ``invalid_encoding`` whatever the coding.
"""

from __future__ import annotations

import base64
import io
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import brotli
import zstandard
from python_multipart.multipart import MultipartParser, parse_options_header

from guard.clef.processor import MAX_ASPECT_RATIO, decode_base64
from guard.errors import BodyError, FieldError, RequestValidationError
from guard.systemone import IMAGE_FORMATS, MAX_IMAGE_PIXELS

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ENCODINGS",
    "assets_to_images",
    "body_kind",
    "check_images",
    "decode_content",
    "name_assets",
    "split_multipart",
]

UNSUPPORTED_ENCODING = "unsupported_encoding"
INVALID_ENCODING = "invalid_encoding"
INVALID_MULTIPART = "invalid_multipart"
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
IMAGE_TOO_LARGE = "image_too_large"
#: Largest image accepted by default, width x height (4096 x 4096); Clef's processor resizes far below it anyway.
DEFAULT_MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
_FIELD = "headers.content-encoding"
#: Most parts a multipart request may have (the request part and its images).
MAX_PARTS = 16
_SNIFF = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"))
_FORMAT_TYPES = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg", "webp": "image/webp"}
_IMAGE_FIELD = re.compile(r"images\[(\d+)\]")


def _too_large(limit: int) -> BodyError:
    return BodyError(413, "body_too_large", f"the decompressed request body exceeds the limit of {limit} bytes")


def _zlib(wbits: int) -> Callable[[bytes, int], bytes]:
    def decode(data: bytes, limit: int) -> bytes:
        stream = zlib.decompressobj(wbits)
        out = stream.decompress(data, limit + 1)
        if len(out) > limit or stream.unconsumed_tail:
            raise _too_large(limit)
        if not stream.eof:
            raise zlib.error("truncated stream")
        if stream.unused_data:  # a second gzip member or junk: other decoders read it, so it is refused, not dropped
            raise zlib.error("data after the end of the compressed stream")
        return out

    return decode


def _deflate(data: bytes, limit: int) -> bytes:
    # HTTP "deflate" is the zlib format (RFC 9110 §8.4.1.2); some clients send a raw deflate stream instead.
    try:
        return _zlib(zlib.MAX_WBITS)(data, limit)
    except zlib.error:
        return _zlib(-zlib.MAX_WBITS)(data, limit)


def _brotli(data: bytes, limit: int) -> bytes:
    stream = brotli.Decompressor()
    out = stream.process(data, output_buffer_limit=limit + 1)
    if len(out) > limit or not stream.is_finished():
        if len(out) > limit or not stream.can_accept_more_data():
            raise _too_large(limit)
        raise brotli.error("truncated stream")
    return out


#: Compressed bytes fed to the zstd decoder per step. A zstd block of 4 bytes may expand to 128 KiB, so one step
#: yields at most 8 MiB: the decoder never runs far past the cap.
_ZSTD_STEP = 256
#: Most content codings one body may carry (each is undone in turn; clients send one).
MAX_CODINGS = 4


def _zstd(data: bytes, limit: int) -> bytes:
    # One or more frames, each of which must end (an empty body has none): a frame cut short is refused, not read
    # as the shorter body it decodes to.
    decompressor = zstandard.ZstdDecompressor()
    out = bytearray()
    frame = decompressor.decompressobj()
    fed = False  # whether the current frame has been given any bytes
    for start in range(0, len(data), _ZSTD_STEP):
        piece = data[start:start + _ZSTD_STEP]
        while piece:
            out += frame.decompress(piece)
            fed = True
            if len(out) > limit:
                raise _too_large(limit)
            if not frame.eof:
                break
            piece = frame.unused_data  # the next frame starts inside this piece
            frame, fed = decompressor.decompressobj(), False
    if fed or not data:
        raise zstandard.ZstdError("truncated stream: the last frame does not end")
    return bytes(out)


#: ``Content-Encoding`` tokens accepted, each ``(body, limit) -> decoded body``.
ENCODINGS: dict[str, Callable[[bytes, int], bytes]] = {
    "gzip": _zlib(16 + zlib.MAX_WBITS),
    "x-gzip": _zlib(16 + zlib.MAX_WBITS),
    "deflate": _deflate,
    "br": _brotli,
    "zstd": _zstd,
}


def decode_content(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding`` (codings applied in header order, so undone last first).

    Raises:
        BodyError: 415 ``unsupported_encoding`` for a coding not in :data:`ENCODINGS` (nor ``identity``); 413
            ``body_too_large`` when a decoded body passes ``limit`` bytes; 400 ``invalid_encoding`` for a corrupt
            stream or more than :data:`MAX_CODINGS` codings.
    """
    if not content_encoding:
        return body
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    if len([c for c in codings if c != "identity"]) > MAX_CODINGS:
        raise BodyError(400, INVALID_ENCODING, f"more than {MAX_CODINGS} content codings", field=_FIELD)
    for coding in codings:
        if coding != "identity" and coding not in ENCODINGS:
            raise BodyError(
                415,
                UNSUPPORTED_ENCODING,
                f"Content-Encoding {coding[:40]!r} is not supported; use one of {', '.join(ENCODINGS)}",
                field=_FIELD,
            )
    for coding in reversed(codings):
        if coding == "identity":
            continue
        try:
            body = ENCODINGS[coding](body, limit)
        except (zlib.error, brotli.error, zstandard.ZstdError) as exc:
            raise BodyError(400, INVALID_ENCODING, f"the body is not valid {coding}: {exc}", field=_FIELD) from exc
    return body


#: The parameters a request is read by (the boundary, a part's name): their RFC 2231 forms count as copies of them.
_READ_PARAMETERS = frozenset({"boundary", "name"})


def _repeated_parameter(value: str) -> str | None:
    """The first parameter of a header value (``type; a=1; b="x;y"``) whose name, taken without regard to case, comes
    again later in it, or ``None``. The value is split at each ``;`` outside double quotes (a ``\\"`` is no quote), as
    python-multipart's :func:`parse_options_header` splits it; that function keeps the last copy of a repeated
    parameter where other readers (Python's ``email``) keep the first. ``boundary*=...`` and ``name*=...`` are
    copies of ``boundary`` and ``name`` (python-multipart skips them; Go's ``mime`` reads them instead).
    """
    segments: list[str] = []
    start, quoted = 0, False
    for i, char in enumerate(value):
        if char == '"' and (i == 0 or value[i - 1] != "\\"):
            quoted = not quoted
        elif char == ";" and not quoted:
            segments.append(value[start:i])
            start = i + 1
    segments.append(value[start:])
    seen: set[str] = set()
    for segment in segments[1:]:
        name = segment.partition("=")[0].strip(" \t").lower()
        if name.partition("*")[0] in _READ_PARAMETERS:  # name*=UTF-8''x: RFC 2231's form of name, which python-
            name = name.partition("*")[0]  # multipart skips and Go's mime reads in its place
        if not name:
            continue
        if name in seen:
            return name
        seen.add(name)
    return None


def split_multipart(body: bytes, content_type: str) -> tuple[bytes, dict[str, tuple[str, bytes]]]:
    """Split a ``multipart/form-data`` body into its ``request`` JSON part and the other parts.

    Returns:
        ``(request JSON bytes, {part name: (content type, bytes)})``.

    Raises:
        BodyError: 400 ``invalid_multipart`` naming what is wrong (no boundary, no ``request`` part, a repeated or
            unnamed part, a part sending a header more than once, a parameter repeated in the Content-Type or in a
            part's Content-Disposition, more than :data:`MAX_PARTS` parts, a truncated body).
    """
    repeated = _repeated_parameter(content_type)
    if repeated is not None:
        raise BodyError(400, INVALID_MULTIPART, f"the Content-Type sends its {repeated[:40]!r} parameter more than once",
                        field="content-type")
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise BodyError(400, INVALID_MULTIPART, "multipart/form-data needs a boundary parameter", field="content-type")
    parts: list[tuple[dict[str, str], bytearray]] = []
    header: dict[str, list[bytearray]] = {"field": [bytearray()], "value": [bytearray()]}

    def on_part_begin() -> None:
        parts.append(({}, bytearray()))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        parts[-1][1].extend(data[start:end])

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header["field"][0].extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header["value"][0].extend(data[start:end])

    def on_header_end() -> None:
        name = header["field"][0].decode("latin-1").lower()
        if name in parts[-1][0]:  # readers differ on which copy wins: a front proxy may have read the other
            raise BodyError(400, INVALID_MULTIPART, f"part {len(parts) - 1} sends its {name} header more than once",
                            field="body")
        parts[-1][0][name] = header["value"][0].decode("latin-1")
        header["field"][0] = bytearray()
        header["value"][0] = bytearray()

    def on_part_end() -> None:
        if len(parts) > MAX_PARTS:
            raise BodyError(400, INVALID_MULTIPART, f"more than {MAX_PARTS} parts", field="body")

    ended: list[bool] = []
    try:
        parser = MultipartParser(
            boundary,
            {
                "on_part_begin": on_part_begin,
                "on_part_data": on_part_data,
                "on_header_field": on_header_field,
                "on_header_value": on_header_value,
                "on_header_end": on_header_end,
                "on_part_end": on_part_end,
                "on_end": lambda: ended.append(True),
            },
        )
        parser.write(body)
        parser.finalize()
    except BodyError:
        raise
    except Exception as exc:  # python-multipart raises its own error types for malformed input
        raise BodyError(400, INVALID_MULTIPART, f"malformed multipart body: {exc}", field="body") from exc
    if not ended:
        raise BodyError(400, INVALID_MULTIPART, "the multipart body ends before its closing boundary", field="body")
    named: dict[str, tuple[str, bytes]] = {}
    for i, (headers, data) in enumerate(parts):
        repeated = _repeated_parameter(headers.get("content-disposition", ""))
        if repeated is not None:
            raise BodyError(400, INVALID_MULTIPART,
                            f"part {i} sends its {repeated[:40]!r} parameter of Content-Disposition more than once",
                            field="body")
        _, disposition = parse_options_header(headers.get("content-disposition", ""))
        raw_name = disposition.get(b"name", b"")
        try:  # RFC 7578 4.2: a field name may be UTF-8 (the JSON naming it is); an older client's is latin-1
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            name = raw_name.decode("latin-1")
        if not name:
            raise BodyError(400, INVALID_MULTIPART, f"part {i} has no Content-Disposition name", field="body")
        if name in named:
            raise BodyError(400, INVALID_MULTIPART, f"part {name!r} appears twice", field=f"parts.{name}")
        named[name] = (headers.get("content-type", "application/octet-stream"), bytes(data))
    if "request" not in named:
        raise BodyError(400, INVALID_MULTIPART, "a multipart request needs a JSON part named 'request'", field="body")
    _, request = named.pop("request")
    return request, named


def _image_type(declared: str, data: bytes) -> str:
    media = declared.split(";", 1)[0].strip().lower()
    if media.startswith("image/"):
        return media
    for magic, sniffed in _SNIFF:
        if data.startswith(magic):
            return sniffed
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return media


def assets_to_images(
    body: dict[str, Any], parts: dict[str, tuple[str, bytes]]
) -> tuple[dict[str, Any], list[str]]:
    """Turn TypeSafe's ``assets`` (``{name: {type: "image", part | format + data_base64}}``) into ``images`` entries
    (``{content_type, base64}``, in ``assets`` order).

    Returns:
        ``(the body without assets, the asset names in images order)``; a body without ``assets`` comes back as it
        is, with no names.

    Raises:
        BodyError: 422 ``invalid_request`` naming the asset or part: an asset that is not an image, names a missing
            part, or has no data; a part no asset claims; ``assets`` together with ``images``.
    """
    assets = body.get("assets")
    if assets is None:
        if parts:
            raise BodyError(422, "invalid_request", "multipart parts need an 'assets' entry naming them",
                            field=f"parts.{next(iter(parts))}")
        return body, []
    if not isinstance(assets, dict) or not assets:
        raise BodyError(422, "invalid_request", "must be a non-empty object of assets", field="assets")
    if "images" in body:
        raise BodyError(422, "invalid_request", "send images or assets, not both", field="assets")
    images: list[dict[str, str]] = []
    claimed: set[str] = set()
    for name, asset in assets.items():
        where = f"assets.{name}"
        if not isinstance(asset, dict) or asset.get("type", "image") != "image":
            raise BodyError(422, "invalid_request", "must be an object with type 'image'", field=where)
        part = asset.get("part")
        if part is not None:
            if not isinstance(part, str):
                raise BodyError(422, "invalid_request", "must be the name of a multipart part (a string)",
                                field=f"{where}.part")
            if part not in parts:
                raise BodyError(422, "invalid_request", f"names part {str(part)[:40]!r}, which was not sent",
                                field=f"{where}.part")
            if part in claimed:
                message = f"part {part!r} is claimed by two assets"
                raise BodyError(422, "invalid_request", message, field=f"{where}.part")
            claimed.add(part)
            declared, data = parts[part]
            images.append({"content_type": _image_type(declared, data), "base64": base64.b64encode(data).decode()})
        elif isinstance(asset.get("data_base64"), str) and asset["data_base64"]:
            media = _FORMAT_TYPES.get(str(asset.get("format", "")).lower())
            if media is None:
                raise BodyError(422, "invalid_request", f"must be one of {', '.join(_FORMAT_TYPES)}",
                                field=f"{where}.format")
            images.append({"content_type": media, "base64": asset["data_base64"]})
        else:
            raise BodyError(422, "invalid_request", "needs a part or data_base64", field=where)
    unclaimed = sorted(set(parts) - claimed)
    if unclaimed:
        raise BodyError(422, "invalid_request", "no asset names this part", field=f"parts.{unclaimed[0]}")
    rest = {key: value for key, value in body.items() if key != "assets"}
    rest["images"] = images
    return rest, list(assets)


def body_kind(content_type: str) -> str:
    """``"json"`` for ``application/json`` or any ``application/*+json`` type, ``"multipart"`` for
    ``multipart/form-data``.

    Raises:
        BodyError: 415 ``unsupported_media_type`` for anything else, a missing type included (``text/plain``,
            ``application/x-www-form-urlencoded`` and no type are what a browser sends without a CORS preflight).
    """
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return "json"
    if media == "multipart/form-data":
        return "multipart"
    shown = repr(media[:60]) if media else "missing"
    raise BodyError(
        415,
        UNSUPPORTED_MEDIA_TYPE,
        f"Content-Type {shown} is not accepted; send application/json or multipart/form-data",
        field="headers.content-type",
    )


#: The media type of each PIL format read: a JPEG holding more pictures (MPO, as phone cameras write) is a JPEG, an
#: animated PNG (PIL's ``image/apng``) is a PNG.
_MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "MPO": "image/jpeg", "WEBP": "image/webp",
                "GIF": "image/gif", "BMP": "image/bmp"}


#: Declared media types that name another's format (``image/jpg`` is a common misspelling of ``image/jpeg``).
_ALIASES = {"image/jpg": "image/jpeg", "image/x-png": "image/png", "image/x-ms-bmp": "image/bmp"}


def _image_header(payload: str) -> tuple[str, int, int] | None:
    """``(media type, width, height)`` from an image's header (nothing is decoded), or ``None`` when the bytes are
    not an image in one of :data:`~guard.systemone.IMAGE_FORMATS` (the backend then refuses them with a 422 of its
    own): only those formats' header parsers run on client bytes.

    Raises:
        _TooManyPixels: PIL itself refused the header as a decompression bomb (over twice its pixel limit, or
            over its limit where warnings raise); guard's own limit is lower.
    """
    from PIL import Image

    try:
        raw = decode_base64(payload)
    except ValueError:
        return None
    try:
        with Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS) as image:
            return _MEDIA_TYPES.get(image.format or "", ""), *image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:  # the warning where it raises
        raise _TooManyPixels(str(exc)) from exc
    except Exception:  # noqa: BLE001 - PIL raises many types for bytes that are not an image
        return None


class _TooManyPixels(Exception):
    """PIL's own decompression-bomb refusal, carrying its message."""


def check_images(body: dict[str, Any], max_pixels: int, names: Sequence[str] = ()) -> None:
    """Check every image in ``body["images"]`` from its header alone: no larger than ``max_pixels`` (width x height),
    and of the type it declares (a ``content_type``, or a data URL's type). ``names`` are the asset names of the
    images, in order (from :func:`assets_to_images`).

    Raises:
        BodyError: naming the image (``assets.<name>`` when it came as an asset, else ``images[i]``): 413
            ``image_too_large`` with its size; 422 ``invalid_request`` when its sides are more than
            :data:`~guard.clef.processor.MAX_ASPECT_RATIO` apart (the image processor refuses it), or its bytes are
            another format than declared (a GIF sent as ``image/png``).
    """
    images = body.get("images")
    if not isinstance(images, list):
        return
    for i, item in enumerate(images):
        if isinstance(item, dict):
            declared, payload = item.get("content_type"), item.get("base64")
        elif isinstance(item, str) and item[:5].lower() == "data:":
            header, _, payload = item.partition(",")
            declared = header[5:].split(";", 1)[0]  # data:<type>;base64
        elif isinstance(item, str):  # bare base64 (the reference profile takes it)
            declared, payload = None, item
        else:
            continue
        where = f"assets.{names[i]}" if i < len(names) else f"images[{i}]"
        try:
            found = _image_header(payload) if isinstance(payload, str) else None
        except _TooManyPixels as exc:
            raise BodyError(413, IMAGE_TOO_LARGE, f"the image is too large: {exc}", field=where) from exc
        if found is None:
            continue
        media, width, height = found
        if width * height > max_pixels:
            raise BodyError(
                413,
                IMAGE_TOO_LARGE,
                f"the image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}",
                field=where,
            )
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            message = f"is {width}x{height} pixels; its sides may differ by a factor of {MAX_ASPECT_RATIO} at most"
            raise BodyError(422, "invalid_request", message, field=where)
        if isinstance(declared, str) and _ALIASES.get(declared.strip().lower(), declared.strip().lower()) != media:
            field = f"{where}.content_type" if isinstance(item, dict) and i >= len(names) else where
            raise BodyError(422, "invalid_request", f"is declared {declared[:40]!r} but its bytes are {media}",
                            field=field)


def name_assets(error: RequestValidationError, names: Sequence[str]) -> RequestValidationError:
    """``error`` with its fields named as the client sent them: ``images[i]`` (and any field below it) of an image
    that came as asset ``names[i]`` is ``assets.<name>``, and ``images`` is ``assets``; other fields are unchanged.
    """
    if not names:
        return error

    def client_field(field: str) -> str:
        if field == "images":
            return "assets"
        match = _IMAGE_FIELD.match(field)
        if match is not None and int(match[1]) < len(names):
            return f"assets.{names[int(match[1])]}"
        return field

    return RequestValidationError([FieldError(client_field(e.field), e.message) for e in error.errors])
