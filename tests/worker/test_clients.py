"""The worker as System One clients use it: TypeSafe's SDK (zstd bodies, multipart images) and the openai SDK with only
``base_url`` changed, and the encodings, request ids and model errors on the wire."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import brotli
import httpx
import openai
import pytest
import torch
import zstandard
from PIL import Image as PILImage
from typesafe_sdk import AsyncTypeSafeClient, Image, TypeSafeClient
from typesafe_sdk._core.compression import MIN_COMPRESSED_BODY_LENGTH, resolve_compression

from guard.backends.batcher import BatcherConfig
from guard.backends.local import LocalBackend
from guard.clef.model import ClefModel
from guard.clef.tiny import write_tiny_checkpoint
from guard.worker.app import WorkerConfig
from tests.worker._serve import RunningWorker, serve_worker

pytestmark = pytest.mark.anyio

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "clef-golden"
PNG = (GOLDEN / "media" / "yard-320x256.png").read_bytes()
CAP = 256 * 1024
QUESTIONS = {"risky": {"type": "noul", "instructions": "Is this message risky?"}}
LONG_STATE = "Please refund my last order, it arrived broken. " * 60  # > 1 KiB: the SDK compresses it


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> ClefModel:
    root = write_tiny_checkpoint(tmp_path_factory.mktemp("vision") / "jev-tiny", seed=5, vision=True)
    return ClefModel.from_pretrained(root, dtype=torch.float32)


@pytest.fixture(scope="module")
def worker(vision_model: ClefModel) -> Iterator[RunningWorker]:
    backend = LocalBackend(vision_model, batcher_config=BatcherConfig(max_wait_ms=2))
    config = WorkerConfig(model_name="jev-latest", max_body_bytes=CAP, release_date="2026-09-15")
    with serve_worker(backend, config=config) as running:
        yield running


def direct(model: ClefModel, state: Any, images: list[dict[str, str]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "jev-latest", "state": state, "questions": QUESTIONS}
    if images:
        body["images"] = images
    return model.systemone(body).to_json()


def test_the_sdk_compresses_long_bodies_with_zstd() -> None:
    assert resolve_compression(None) == "zstd" and len(LONG_STATE.encode()) > MIN_COMPRESSED_BODY_LENGTH


def test_typesafe_sync_client_text_image_and_models(worker: RunningWorker, vision_model: ClefModel) -> None:
    image = Image(PNG)
    with TypeSafeClient(api_key="k", base_url=worker.url) as client:
        text = client.system_one(LONG_STATE, QUESTIONS)
        pictured = client.system_one(f"What is in {image}?", QUESTIONS, assets={"yard": image})
        models = client.models.list()
    want = direct(vision_model, LONG_STATE)["answers"]["risky"]["noul"]
    assert text.model == "jev-latest" and text.answers["risky"].noul == pytest.approx(want, abs=1e-4)
    png = {"content_type": "image/png", "base64": base64.b64encode(PNG).decode()}
    # The SDK sends the image once per name: as "yard" and as the reference the state text contains.
    with_image = direct(vision_model, f"What is in {image}?", [png, png])
    assert pictured.answers["risky"].noul == pytest.approx(with_image["answers"]["risky"]["noul"], abs=1e-4)
    assert pictured.usage.input_tokens == with_image["usage"]["input_tokens"]
    assert pictured.usage.input_tokens > direct(vision_model, f"What is in {image}?")["usage"]["input_tokens"]
    (entry,) = [m for m in models.models if m.name == "jev-latest"]
    assert entry.release_date == "2026-09-15" and entry.description


async def test_typesafe_async_client_text_image_and_models(worker: RunningWorker, vision_model: ClefModel) -> None:
    image = Image(PNG)
    async with AsyncTypeSafeClient(api_key="k", base_url=worker.url) as client:
        text = await client.system_one(LONG_STATE, QUESTIONS)
        pictured = await client.system_one({"photo": image, "note": LONG_STATE}, QUESTIONS)
        models = await client.models.list()
    assert text.answers["risky"].noul == pytest.approx(direct(vision_model, LONG_STATE)["answers"]["risky"]["noul"],
                                                       abs=1e-4)  # fmt: skip
    assert pictured.model == "jev-latest" and 0.0 <= pictured.answers["risky"].noul <= 1.0
    assert "jev-latest" in [m.name for m in models.models]


def test_openai_sdk_lists_and_retrieves_the_model(worker: RunningWorker) -> None:
    with openai.OpenAI(api_key="k", base_url=worker.url + "/v1") as client:
        ids = [model.id for model in client.models.list()]
        one = client.models.retrieve("jev-latest")
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")
    assert ids == ["jev-latest", "jev-tiny"]
    assert one.id == "jev-latest" and one.object == "model" and one.created == 1789430400  # 2026-09-15 UTC


ENCODERS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "zstd": zstandard.ZstdCompressor().compress,
}


@pytest.mark.parametrize("encoding", list(ENCODERS))
async def test_every_content_encoding_gives_the_plain_answer(worker: RunningWorker, encoding: str) -> None:
    raw = json.dumps({"model": "jev-latest", "state": LONG_STATE, "questions": QUESTIONS}).encode()
    headers = {"content-type": "application/json", "content-encoding": encoding}
    async with worker.client() as client:
        plain = await client.post("/v1/systemone", content=raw, headers={"content-type": "application/json"})
        packed = await client.post("/v1/systemone", content=ENCODERS[encoding](raw), headers=headers)
    assert packed.status_code == 200, packed.text
    assert packed.json()["answers"]["risky"]["noul"] == pytest.approx(plain.json()["answers"]["risky"]["noul"],
                                                                       abs=1e-4)  # fmt: skip


@pytest.mark.parametrize("encoding", list(ENCODERS))
async def test_a_compression_bomb_is_413_whatever_the_encoding(worker: RunningWorker, encoding: str) -> None:
    bomb = ENCODERS[encoding](b" " * (64 * CAP))  # 16 MiB of whitespace, a few KiB on the wire
    assert len(bomb) < CAP
    async with worker.client() as client:
        response = await client.post("/v1/systemone", content=bomb,
                                     headers={"content-encoding": encoding, "content-type": "application/json"})
    assert response.status_code == 413 and response.json()["code"] == "body_too_large"


async def test_content_encoding_on_two_lines_is_one_list(worker: RunningWorker) -> None:
    """RFC 9110 §5.3: repeated field lines are one comma-joined list, so both codings are undone, last first."""
    raw = json.dumps({"model": "jev-latest", "state": "hi", "questions": QUESTIONS}).encode()
    headers = [("content-type", "application/json"), ("content-encoding", "gzip"), ("content-encoding", "br")]
    async with worker.client() as client:
        both = await client.post("/v1/systemone", content=brotli.compress(gzip.compress(raw)), headers=headers)
        unknown = await client.post("/v1/systemone", content=gzip.compress(raw),
                                    headers=[*headers[:2], ("content-encoding", "compress")])
    assert both.status_code == 200, both.text
    assert unknown.status_code == 415 and unknown.json()["code"] == "unsupported_encoding"


async def test_unknown_encodings_corrupt_streams_and_bad_multipart_are_4xx(worker: RunningWorker) -> None:
    raw = json.dumps({"model": "jev-latest", "state": "hi", "questions": QUESTIONS}).encode()
    async with worker.client() as client:
        json_type = {"content-type": "application/json"}
        lzw = await client.post("/v1/systemone", content=raw, headers={"content-encoding": "compress", **json_type})
        corrupt = await client.post("/v1/systemone", content=b"not gzip",
                                    headers={"content-encoding": "gzip", **json_type})
        trailing = [await client.post("/v1/systemone", content=encode(raw) + extra,
                                      headers={"content-encoding": name, **json_type})
                    for name, encode in (("gzip", gzip.compress), ("deflate", zlib.compress))
                    for extra in (b"junk", gzip.compress(b"more"))]  # gzip.decompress reads a second member
        no_request = await client.post("/v1/systemone", files={"asset-0": ("a.png", PNG, "image/png")})
        unclaimed = await client.post(
            "/v1/systemone",
            files={"request": (None, raw, "application/json"), "asset-0": ("a.png", PNG, "image/png")},
        )
    assert lzw.status_code == 415 and lzw.json()["field"] == "headers.content-encoding"
    assert corrupt.status_code == 400 and corrupt.json()["code"] == "invalid_encoding"
    assert [(r.status_code, r.json()["code"]) for r in trailing] == [(400, "invalid_encoding")] * 4
    assert no_request.status_code == 400 and no_request.json()["code"] == "invalid_multipart"
    assert unclaimed.status_code == 422 and unclaimed.json()["field"] == "parts.asset-0"


async def test_a_body_that_stalls_past_the_deadline_is_408(worker: RunningWorker) -> None:
    """A stalled upload cannot hold its buffer (up to --max-body-bytes) with no time limit."""

    async def stalled() -> Any:
        yield b'{"model": "jev-latest", "state": "'
        await asyncio.sleep(5)
        yield b'hi"}'

    async with worker.client() as client:  # httpx reads the answer once it has sent the whole body
        response = await client.post("/v1/systemone", content=stalled(), headers={
            "content-type": "application/json", "x-request-timeout-ms": "300"})  # fmt: skip
    assert response.status_code == 408 and response.json()["code"] == "body_timeout"


async def test_a_long_boundary_and_an_asset_naming_a_non_string_part_are_4xx(worker: RunningWorker) -> None:
    raw = json.dumps({"model": "jev-latest", "state": "hi", "questions": QUESTIONS,
                      "assets": {"a": {"type": "image", "part": ["asset-0"]}}}).encode()  # fmt: skip
    async with worker.client() as client:
        boundary = await client.post("/v1/systemone", content=b"--" + b"b" * 300,
                                     headers={"content-type": "multipart/form-data; boundary=" + "b" * 300})
        listed = await client.post(
            "/v1/systemone",
            files={"request": (None, raw, "application/json"), "asset-0": ("a.png", PNG, "image/png")},
        )
    assert boundary.status_code == 400 and boundary.json()["code"] == "invalid_multipart"
    assert listed.status_code == 422 and listed.json()["field"] == "assets.a.part"


def gif() -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (8, 8)).save(out, "GIF")
    return out.getvalue()


async def test_image_errors_name_the_asset_and_the_declared_type_must_be_the_bytes(worker: RunningWorker) -> None:
    """Every image refusal names ``assets.<name>``; a GIF is refused (Workers AI takes PNG, JPEG and WebP) whether it
    is declared ``image/gif`` or disguised as ``image/png``."""
    raw = json.dumps({"model": "jev-latest", "state": "hi", "questions": QUESTIONS,
                      "assets": {"scan": {"type": "image", "part": "asset-0"}}}).encode()  # fmt: skip

    async def send(data: bytes, content_type: str) -> httpx.Response:
        files = {"request": (None, raw, "application/json"), "asset-0": ("a", data, content_type)}
        return await client.post("/v1/systemone", files=files)

    async with worker.client() as client:
        declared_gif = await send(gif(), "image/gif")
        disguised_gif = await send(gif(), "image/png")
        not_an_image = await send(b"not an image at all", "image/png")
        png_as_jpeg = await send(PNG, "image/jpeg")
        png = await send(PNG, "image/png")
    for refused in (declared_gif, disguised_gif, not_an_image, png_as_jpeg):
        assert refused.status_code == 422, refused.text
        assert refused.json()["field"] == "assets.scan" and "images[" not in refused.text, refused.text
    assert "image/png, image/jpeg, image/webp" in declared_gif.json()["message"]
    assert "image/gif" in disguised_gif.json()["message"] and "image/png" in png_as_jpeg.json()["message"]
    assert png.status_code == 200, png.text


def body_of(state: Any, images: list[dict[str, str]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "jev-latest", "state": state, "questions": QUESTIONS}
    if images:
        body["images"] = images
    return body


async def test_image_pads_in_client_text_never_fail_a_forward_pass(worker: RunningWorker, vision_model: ClefModel) -> None:
    """With images, ``<|image_pad|>`` in the state is a 422 naming ``state`` (it would take an image slot and fail the
    pass); without, it is a plain token as in the reference, and it does not fail the image request batched beside
    it."""
    image = {"content_type": "image/png", "base64": base64.b64encode(PNG).decode()}
    pads = "see <|vision_start|><|image_pad|><|vision_end|>"
    failed = worker.batcher.stats.failed
    async with worker.client() as client:
        refused = await client.post("/v1/systemone", json=body_of(pads, [image]))
        victim, text = await asyncio.gather(
            client.post("/v1/systemone", json=body_of("hi", [image])), client.post("/v1/systemone", json=body_of(pads))
        )
    assert refused.status_code == 422 and refused.json()["field"] == "state", refused.text
    assert "<|image_pad|>" in refused.json()["message"]
    assert victim.status_code == 200 and victim.json() == direct(vision_model, "hi", [image])
    assert text.status_code == 200 and text.json() == direct(vision_model, pads)
    assert worker.batcher.stats.failed == failed


async def test_an_image_too_narrow_for_the_processor_names_the_image(worker: RunningWorker) -> None:
    out = io.BytesIO()
    PILImage.new("RGB", (402, 2)).save(out, "PNG")
    image = {"content_type": "image/png", "base64": base64.b64encode(out.getvalue()).decode()}
    request = json.dumps({**body_of("hi"), "assets": {"scan": {"type": "image", "part": "asset-0"}}}).encode()
    async with worker.client() as client:
        inline = await client.post("/v1/systemone", json=body_of("hi", [image]))
        files = {"request": (None, request, "application/json"), "asset-0": ("a", out.getvalue(), "image/png")}
        asset = await client.post("/v1/systemone", files=files)
    assert inline.status_code == 422 and inline.json()["field"] == "images[0]", inline.text
    assert asset.status_code == 422 and asset.json()["field"] == "assets.scan", asset.text
    assert "402x2 pixels" in asset.json()["message"]


async def test_an_unknown_model_is_404_and_request_ids_are_echoed_or_made(worker: RunningWorker) -> None:
    async with worker.client() as client:
        wrong = await client.post("/v1/systemone", json={"model": "gpt-4o", "state": "hi", "questions": QUESTIONS},
                                  headers={"x-request-id": "req-42"})  # fmt: skip
        made = await client.get("/v1/models")
        missing = await client.get("/v1/models/gpt-4o")
        bad_id = await client.get("/readyz", headers={"x-request-id": "has space"})
    assert wrong.status_code == 404 and wrong.json()["code"] == "model_not_found"
    assert wrong.json()["field"] == "model" and "jev-latest" in wrong.json()["message"]
    assert wrong.headers["x-request-id"] == "req-42"
    assert len(made.headers["x-request-id"]) == 32 and made.headers["x-request-id"] != bad_id.headers["x-request-id"]
    assert bad_id.headers["x-request-id"] != "has space"
    assert missing.status_code == 404 and missing.json()["field"] == "path.model_id"
    assert made.json()["object"] == "list" and made.json()["data"] == made.json()["models"]


async def test_a_client_asking_an_unserved_model_is_told_the_code_and_the_alias_option(worker: RunningWorker) -> None:
    """The rejection said only "HTTP 404"; the worker's code (a token, not its message) and the fix were in a log."""
    from guard.backends import SystemOneClient
    from guard.errors import BackendRejected
    from guard.systemone import SystemOneRequestV1

    async with SystemOneClient.worker(worker.url, timeout=60) as client:
        with pytest.raises(BackendRejected) as caught:
            await client.decide(SystemOneRequestV1.from_json({"model": "gpt-4o", "state": "hi", "questions": QUESTIONS}))
    assert str(caught.value) == (
        "http:worker refused the request with HTTP 404 (model_not_found); it serves other model names (GET /v1/models "
        "lists them): ask one of those, or serve this name too (guard worker serve --model-alias NAME)")


async def test_release_date_defaults_to_the_weights_date(vision_model: ClefModel) -> None:
    backend = LocalBackend(vision_model)
    with serve_worker(backend, config=WorkerConfig(model_name="jev-latest")) as running:
        async with running.client() as client:
            entry = (await client.get("/v1/models/jev-latest")).json()
    assert vision_model.released is not None and entry["release_date"] == vision_model.released.isoformat()


def test_bad_release_dates_and_aliases_are_refused() -> None:
    with pytest.raises(ValueError, match="release_date must be a YYYY-MM-DD date"):
        WorkerConfig(release_date="15/09/2026")
    with pytest.raises(ValueError, match="model_aliases"):
        WorkerConfig(model_aliases="jev")  # type: ignore[arg-type]




async def test_a_repeated_boundary_or_part_name_parameter_is_refused(worker: RunningWorker) -> None:
    """Repeated parameters were read as their last copy (review finding): ``boundary=aaa; boundary=bbb`` split the
    body at ``bbb`` where Python's ``email`` splits it at ``aaa``, and ``name="scan"; name="notes"`` named the part
    ``notes``. Both are 400 ``invalid_multipart`` now."""
    raw = json.dumps({"model": "jev-latest", "state": "hi", "questions": QUESTIONS,
                      "assets": {"a": {"type": "image", "part": "notes"}}})  # fmt: skip

    def part(boundary: str, disposition: str, data: str) -> str:
        return f"--{boundary}\r\nContent-Disposition: form-data; {disposition}\r\n\r\n{data}\r\n"

    two_bodies = (part("bbb", 'name="request"', raw) + "--bbb--\r\n" + part("aaa", 'name="request"', raw)
                  + "--aaa--\r\n")
    two_names = part("xx", 'name="request"', raw) + part("xx", 'name="scan"; name="notes"', "PNG") + "--xx--\r\n"
    async with worker.client() as client:
        boundary = await client.post("/v1/systemone", content=two_bodies.encode(),
                                     headers={"content-type": "multipart/form-data; boundary=aaa; boundary=bbb"})
        named = await client.post("/v1/systemone", content=two_names.encode(),
                                  headers={"content-type": "multipart/form-data; boundary=xx"})
    assert boundary.status_code == 400, boundary.text
    assert (boundary.json()["code"], boundary.json()["field"]) == ("invalid_multipart", "content-type")
    assert named.status_code == 400, named.text
    assert named.json()["code"] == "invalid_multipart" and named.json()["message"].startswith("part 1 sends its 'name'")
