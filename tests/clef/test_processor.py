"""Tokenizer loading (tokenizer.json read literally, §1.6) and the image path (§2.3 step 2) against case 16."""

from __future__ import annotations

import base64
import importlib.util
import io
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer

from guard.clef.encoding import encode_record
from guard.clef.processor import ClefProcessor, decode_image, load_tokenizer
from guard.errors import RequestValidationError
from guard.systemone import QuestionV1, SystemOneRequestV1
from tests.clef.conftest import load_case
from tests.conftest import GOLDEN

PNG = (GOLDEN / "media" / "yard-320x256.png").read_bytes()


def test_tokenizer_is_tokenizer_json_literally(golden_checkpoint) -> None:
    ours = load_tokenizer(golden_checkpoint)
    literal = Tokenizer.from_file(str(golden_checkpoint / "tokenizer.json"))
    # Devanagari and Thai keep combining marks after NFC: the Qwen2 regex (tokenizer.json) splits them off letter
    # runs, the \p{M} regex that newer transformers swaps in would not.
    for text in ["नमस्ते दुनिया", "สวัสดีครับ", "plain ascii <|im_end|> text", "Ärger über ångström"]:
        assert ours(text, add_special_tokens=False).input_ids == literal.encode(text, add_special_tokens=False).ids
        pieces = ours.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert pieces == literal.pre_tokenizer.pre_tokenize_str(text)
    # "x" + combining acute has no precomposed form: the Qwen2 regex ends the letter run at the mark (a \p{M} regex
    # would keep "x\u0301y" whole).
    assert [p for p, _ in ours.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x\u0301y")] == ["x", "Ìģy"]
    assert ours.pad_token == "<|endoftext|>" and ours.eos_token == "<|im_end|>"


def test_encode_texts_matches_one_call_per_piece(golden_processor: ClefProcessor) -> None:
    pieces = ["STATE:\n", "", "  two  spaces ", "<|im_start|>x<think>"]
    expected = [golden_processor.tokenizer(p, add_special_tokens=False).input_ids for p in pieces]
    assert golden_processor.encode_texts(pieces) == expected


def test_image_media_block_matches_the_reference(golden_processor: ClefProcessor) -> None:
    case = load_case("16-image-json-state")
    reference = case["media"]
    media = golden_processor.encode_media(
        case["request"]["images"], [], token_offset=reference["token_offset"], media_kwargs=None
    )
    assert list(media.input_ids) == reference["media_ids"]
    assert media.tensors["image_grid_thw"].tolist() == reference["image_grid_thw"]
    assert media.mm_token_type_ids.count(1) == reference["image_pad_count"]
    pixels = media.tensors["pixel_values"].double()
    stats = reference["pixel_values"]
    assert list(pixels.shape) == stats["shape"]
    tolerance = 1e-6 * stats["abs_sum"]
    assert abs(pixels.sum().item() - stats["sum"]) <= tolerance
    assert abs(pixels.abs().sum().item() - stats["abs_sum"]) <= tolerance
    assert abs(pixels.square().sum().item() - stats["sum_sq"]) <= tolerance
    assert torch.allclose(pixels[0, :8].float(), torch.tensor(stats["first_row_head"]), atol=1e-6)


def test_patch_rows_follow_the_documented_layout(golden_processor: ClefProcessor) -> None:
    media = golden_processor.encode_media([Image.open(io.BytesIO(PNG))], [], token_offset=0, media_kwargs=None)
    frames = (np.asarray(Image.open(io.BytesIO(PNG)).convert("RGB"), dtype=np.float64) / 255 - 0.5) / 0.5
    frames = np.stack([frames.transpose(2, 0, 1)] * 2)  # (T=2, C, H, W)
    h, w = 16, 20
    rows = frames.reshape(2, 3, h // 2, 2, 16, w // 2, 2, 16).transpose(2, 5, 3, 6, 1, 0, 4, 7).reshape(h * w, -1)
    assert np.abs(media.tensors["pixel_values"].double().numpy() - rows).max() < 1e-6


def _photo(width: int, height: int) -> Image.Image:
    """Gradients with noise: resampling filters differ on it as on a photograph."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 64 * 4], -1)
    noisy = base + np.random.default_rng(width * height).normal(0, 40, (height, width, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


@pytest.mark.parametrize("size", [(33, 47), (333, 211), (1500, 900)])
def test_an_image_to_resize_gets_the_pixels_of_the_reference_torchvision_processor(
    golden_processor: ClefProcessor, size: tuple[int, int]
) -> None:
    """The reference's image processor (torchvision backend) resizes the uint8 image with torch's antialiased bicubic
    interpolation on CPU; PIL's bicubic (the PIL backend, without torchvision) was up to 2/255 off (a 6e-4
    probability at 1500x900)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    image = _photo(*size)
    media = golden_processor.encode_media([image], [], token_offset=0, media_kwargs=None)
    height, width = smart_resize(size[1], size[0], factor=32, min_pixels=65536, max_pixels=1048576)  # the checkpoint's
    resized = torch.nn.functional.interpolate(
        torch.from_numpy(np.array(image)).permute(2, 0, 1)[None], size=(height, width), mode="bicubic", antialias=True
    )[0]
    assert resized.dtype == torch.uint8 and (height, width) != size[::-1]
    values = (resized.float() - 127.5) / 127.5  # rescale by 1/255 and normalise by mean 0.5, std 0.5, as one step
    rows = []
    for block_y in range(height // 32):  # merge blocks of 2 x 2 patches of 16 x 16 pixels, row by row
        for block_x in range(width // 32):
            for y in range(2 * block_y, 2 * block_y + 2):
                for x in range(2 * block_x, 2 * block_x + 2):
                    patch = values[:, 16 * y:16 * y + 16, 16 * x:16 * x + 16]
                    rows.append(torch.stack([patch, patch], 1).flatten())  # (channel, time, row, column)
    assert media.tensors["image_grid_thw"].tolist() == [[1, height // 16, width // 16]]
    assert torch.equal(media.tensors["pixel_values"], torch.stack(rows))


def test_media_kwargs_size_and_resample_resize_as_the_reference_processor(golden_processor: ClefProcessor) -> None:
    """``media_kwargs`` ``size`` (the form transformers asks for) counted the image's tokens at that size but resized
    it to the processor's, so the pixels and the tokens disagreed (a RuntimeError), and ``resample`` was always
    bicubic. ``size`` resizes as ``min_pixels``/``max_pixels`` do; ``resample`` NEAREST gives the reference's nearest
    pixels (the PIL backend's, which torchvision's NEAREST_EXACT matches); a filter torch cannot run is refused."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = _photo(1500, 900)
    size = {"size": {"shortest_edge": 4096, "longest_edge": 200_000}}
    media = golden_processor.encode_media([image], [], token_offset=0, media_kwargs=size)
    with pytest.warns(FutureWarning):  # transformers deprecates min_pixels and max_pixels for size
        pixels = golden_processor.encode_media(
            [image], [], token_offset=0, media_kwargs={"min_pixels": 4096, "max_pixels": 200_000}
        )
    assert media.tensors["image_grid_thw"].tolist() == [[1, 20, 36]]
    assert torch.equal(media.tensors["pixel_values"], pixels.tensors["pixel_values"])
    assert media.input_ids == pixels.input_ids
    nearest = {"resample": Image.Resampling.NEAREST}
    media = golden_processor.encode_media([image], [], token_offset=0, media_kwargs=nearest)
    reference = Qwen2VLImageProcessorPil.from_pretrained(GOLDEN / "checkpoint")(images=[image], return_tensors="pt", **nearest)
    assert torch.allclose(media.tensors["pixel_values"], reference["pixel_values"], rtol=0, atol=1e-6)
    with pytest.raises(RequestValidationError, match="media_kwargs.resample") as info:
        golden_processor.encode_media([image], [], token_offset=0, media_kwargs={"resample": Image.Resampling.LANCZOS})
    assert "NEAREST, BILINEAR or BICUBIC" in str(info.value)


@pytest.mark.parametrize(("media_kwargs", "field"), [
    ({"patch_size": 14}, "media_kwargs.patch_size"),
    ({"temporal_patch_size": 1}, "media_kwargs.temporal_patch_size"),
    ({"merge_size": 1}, "media_kwargs.merge_size"),
    ({"do_resize": False}, "media_kwargs.do_resize"),
    ({"size": {"height": 64, "width": 64}}, "media_kwargs.size"),
    ({"size": {"shortest_edge": 1024}}, "media_kwargs.size"),
    ({"image_mean": [0.5, 0.5]}, "media_kwargs.image_mean"),
    ({"image_std": "wide"}, "media_kwargs.image_std"),
    ({"size": "large"}, "media_kwargs"),
    # a factor the normalisation divides by (review finding: ZeroDivisionError)
    ({"rescale_factor": 0.0}, "media_kwargs.rescale_factor"),
    ({"rescale_factor": -1 / 255}, "media_kwargs.rescale_factor"),
    ({"rescale_factor": float("inf")}, "media_kwargs.rescale_factor"),
])  # fmt: skip
def test_media_kwargs_the_pixels_cannot_follow_are_refused_naming_the_key(
    golden_processor: ClefProcessor, media_kwargs: dict, field: str
) -> None:
    """The pixel tensor was laid out with the processor's patch size while the pixels were cut with the request's,
    and a mean of two channels or an unresized image of sides that are no multiple of the patch grid met the
    three-channel image: each was a RuntimeError or TypeError out of ``encode_record`` (review finding). The vision
    tower fixes the patch sizes, and each such value is refused naming its key, before any image is decoded; the
    processor's own values and a single mean are taken."""
    image = "data:image/png;base64," + base64.b64encode(_png((64, 48))).decode()
    for count in (golden_processor.image_pads, partial(golden_processor.encode_media, videos=[], token_offset=0)):
        with pytest.raises(RequestValidationError) as info:
            count([image], media_kwargs=media_kwargs)
        assert [error.field for error in info.value.errors] == [field]
    same = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": 0.5}
    media = golden_processor.encode_media([image], [], token_offset=0, media_kwargs=same)
    plain = golden_processor.encode_media([image], [], token_offset=0, media_kwargs=None)
    assert torch.equal(media.tensors["pixel_values"], plain.tensors["pixel_values"])


def _transparent(mode: str) -> Image.Image:
    """A 320x256 photo (no resize) in ``mode`` whose left half is transparent over black, its middle half-opaque."""
    pixels = np.array(_photo(320, 256).convert("RGBA"))
    pixels[:, :160] = 0
    pixels[:, 160:240, 3] = 128
    image = Image.fromarray(pixels, "RGBA")
    if mode == "P":  # a palette with one transparent entry (the black of the left half), as a GIF or PNG has
        return image.convert("RGB").quantize(64).convert("P")
    return image.convert(mode)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_a_transparent_pil_image_is_composited_onto_white_as_the_reference_processor_does(
    golden_processor: ClefProcessor, mode: str
) -> None:
    """A PIL image given to the Python API had its alpha dropped (``convert("RGB")``: black under a transparent
    area); the reference's image processor composites it onto white (``convert_to_rgb``). An image sent as bytes
    drops its alpha, as the reference's ``load_image`` converts it to RGB before the processor, but a palette's
    transparent colour stays a colour key there, which the processor makes white (it was left black)."""
    image = _transparent(mode)
    if mode == "P":
        black = image.getpixel((0, 0))
        image.info["transparency"] = black
    media = golden_processor.encode_media([image], [], token_offset=0, media_kwargs=None)
    reference = golden_processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    assert media.tensors["image_grid_thw"].tolist() == [[1, 16, 20]]  # not resized
    assert torch.allclose(media.tensors["pixel_values"], reference, rtol=0, atol=1e-6)
    dropped = Image.fromarray(np.array(image.convert("RGB")))  # alpha dropped: black under the transparent half
    assert not torch.allclose(media.tensors["pixel_values"], golden_processor.image_processor(
        images=[dropped], return_tensors="pt")["pixel_values"], rtol=0, atol=1e-6)
    out = io.BytesIO()
    image.save(out, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    sent = golden_processor.encode_media([url], [], token_offset=0, media_kwargs=None)
    loaded = Image.open(io.BytesIO(out.getvalue())).convert("RGB")  # the reference's load_image
    want = golden_processor.image_processor(images=[loaded], return_tensors="pt")["pixel_values"]
    assert torch.allclose(sent.tensors["pixel_values"], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("save_as", ["JPEG", "PNG", "WEBP"])
def test_an_image_sent_as_bytes_is_turned_as_its_exif_orientation_says(
    golden_processor: ClefProcessor, save_as: str
) -> None:
    """A phone photo stored landscape with EXIF orientation 6 (turn a quarter clockwise) was read as stored, on its
    side: the reference's ``load_image`` turns it first (``ImageOps.exif_transpose``; review finding). Its pixels and
    grid are the reference's, and its token count, read from the header before the turn, is unchanged. EXIF that
    does not decode is refused, as ``load_image`` fails on it."""
    from transformers.image_utils import load_image

    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    _photo(320, 256).save(out, format=save_as, exif=exif.tobytes(), **({"lossless": True} if save_as == "WEBP" else {}))
    sent = base64.b64encode(out.getvalue()).decode()
    loaded = load_image(sent)
    assert loaded.size == (256, 320)
    assert decode_image(sent).tobytes() == loaded.tobytes()
    media = golden_processor.encode_media([sent], [], token_offset=0, media_kwargs=None)
    reference = golden_processor.image_processor(images=[loaded], return_tensors="pt")
    assert media.tensors["image_grid_thw"].tolist() == reference["image_grid_thw"].tolist() == [[1, 20, 16]]
    assert torch.allclose(media.tensors["pixel_values"], reference["pixel_values"], rtol=0, atol=1e-6)  # no resize
    assert golden_processor.image_pads([sent]) == [80]
    out = io.BytesIO()
    _photo(40, 30).save(out, format="PNG", exif=b"not EXIF data")
    with pytest.raises(RequestValidationError, match="is not a decodable image"):
        decode_image(base64.b64encode(out.getvalue()).decode())


def _png(size: tuple[int, int], colour: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def test_images_over_the_prompt_are_refused_from_their_headers_before_any_is_decoded(
    golden_processor: ClefProcessor,
) -> None:
    """Every image was decoded to RGB and resized before the prompt's length was checked (4 images of 4096 x 4096:
    a second of CPU and hundreds of MB each, then a 422 naming ``questions``). Their tokens are counted from their
    headers as the processor resizes them: these images' pixel data is cut off, so decoding them would fail; the
    refusal names ``images`` instead."""
    whole = _png((2048, 2048))
    cut = "data:image/png;base64," + base64.b64encode(whole[:200]).decode()  # the header and a sliver of the pixels
    request = SystemOneRequestV1.from_json({"model": "m", "state": "s", "images": [cut, cut],
                                            "questions": {"q": {"type": "noul", "instructions": "Is it red?"}}})
    with pytest.raises(RequestValidationError) as info:
        encode_record(request, golden_processor, max_length=1500)
    ((field, message),) = [(e.field, e.message) for e in info.value.errors]
    assert field == "images" and message.startswith("2 image(s) take 2053 tokens") and "1024, 1024 each" in message
    with pytest.raises(RequestValidationError, match="is not a decodable image"):  # room for them: then decoded
        encode_record(request, golden_processor, max_length=4096)


def test_images_processed_one_at_a_time_give_what_the_processor_gives_for_all(golden_processor: ClefProcessor) -> None:
    """Each image is decoded and processed alone (one decoded image held at a time), with the same tensors as one
    call for all of them; the record counts the bytes they hold."""
    images = [Image.open(io.BytesIO(_png(size, colour))) for size, colour in (((300, 200), "red"), ((64, 700), "blue"))]
    media = golden_processor.encode_media(images, [], token_offset=0, media_kwargs=None)
    together = golden_processor.image_processor(images=[image.convert("RGB") for image in images], return_tensors="pt")
    assert torch.equal(media.tensors["pixel_values"], together["pixel_values"])
    assert torch.equal(media.tensors["image_grid_thw"], together["image_grid_thw"])
    # the tokens counted from the headers are the block's: it fits in exactly its length
    golden_processor.encode_media(images, [], token_offset=0, media_kwargs=None, max_tokens=len(media.input_ids))
    with pytest.raises(RequestValidationError, match=f"take {len(media.input_ids)} tokens"):
        golden_processor.encode_media(images, [], token_offset=0, media_kwargs=None,
                                      max_tokens=len(media.input_ids) - 1)
    request = SystemOneRequestV1(model="m", state="s", questions=(QuestionV1("q", "noul", "?"),), images=tuple(images))
    record = encode_record(request, golden_processor)
    pixels = together["pixel_values"]
    assert record.media_bytes == pixels.nelement() * 4 + 2 * 3 * 8 and record.media_bytes > 1_000_000


@pytest.mark.parametrize(
    "item",
    [
        "data:image/png;base64," + base64.b64encode(PNG).decode(),
        "DATA:image/png;base64," + base64.b64encode(PNG).decode(),
        {"content_type": "image/png", "base64": base64.b64encode(PNG).decode()},
        Image.open(io.BytesIO(PNG)).convert("L"),
    ],
)
def test_decode_image_accepts_wire_and_pil_forms(item: object) -> None:
    image = decode_image(item)
    assert image.mode == "RGB" and image.size == (320, 256)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("https://example.com/a.png", "remote URLs are never fetched"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64,@@@", r"is not base64 \(Only base64 data is allowed\)"),
        ("data:image/png;base64," + base64.b64encode(PNG).decode().rstrip("="), r"is not base64 \(Incorrect padding\)"),
        ("/etc/hosts", "is neither a data: URL nor base64 .*; file paths are never read"),
        ({"content_type": "image/png", "base64": base64.b64encode(b"not an image").decode()}, "not a decodable"),
        (42, "got int"),
    ],
)
def test_decode_image_rejects_bad_input_naming_the_field(item: object, message: str) -> None:
    with pytest.raises(RequestValidationError, match=message) as info:
        decode_image(item, where="images[2]")
    assert info.value.field == "images[2]"


@pytest.mark.parametrize(
    "item",
    [
        "data:image/png;base64," + base64.encodebytes(PNG).decode(),  # 76-character lines, as MIME writes them
        "data:image/png;base64," + base64.encodebytes(PNG).decode().replace("\n", "\r\n"),
        base64.b64encode(PNG).decode(),  # no data: prefix
        base64.encodebytes(PNG).decode(),
    ],
)
def test_decode_image_takes_the_base64_the_reference_load_image_takes(item: str) -> None:
    from transformers.image_utils import load_image

    image = decode_image(item)
    assert image.size == (320, 256)
    assert image.tobytes() == load_image(item).tobytes() == Image.open(io.BytesIO(PNG)).convert("RGB").tobytes()


def test_an_unidentified_image_error_names_no_memory_address() -> None:
    """PIL's message named the ``BytesIO`` object by its address, which reached the client's 422 body (attack
    finding): a heap address weakens ASLR."""
    item = {"content_type": "image/png", "base64": base64.b64encode(b"AAAA").decode()}
    with pytest.raises(RequestValidationError) as info:
        decode_image(item, where="images[0]")
    assert " at 0x" not in str(info.value) and "not one of these formats" in str(info.value)


def test_decode_image_refuses_sides_further_apart_than_the_processor_takes() -> None:
    from PIL import Image

    assert decode_image(Image.new("RGB", (200, 1))).size == (200, 1)
    with pytest.raises(RequestValidationError, match="1x201 pixels"):
        decode_image(Image.new("RGB", (1, 201)))
    buffer = io.BytesIO()
    Image.new("RGB", (201, 1)).save(buffer, "PNG")
    item = {"content_type": "image/png", "base64": base64.b64encode(buffer.getvalue()).decode()}
    with pytest.raises(RequestValidationError, match="201x1 pixels") as info:
        decode_image(item, where="images[1]")
    assert info.value.field == "images[1]"


@pytest.mark.parametrize("size", [(0, 0), (0, 5), (5, 0)])
def test_decode_image_refuses_a_pil_image_without_pixels(size: tuple[int, int]) -> None:
    with pytest.raises(RequestValidationError, match=f"is {size[0]}x{size[1]} pixels; an image needs at least one"):
        decode_image(Image.new("RGB", size), where="images[3]")


def test_a_request_with_a_pil_image_without_pixels_is_refused_naming_it(golden_processor: ClefProcessor) -> None:
    question = QuestionV1(id="q", type="noul", instructions="?")
    request = SystemOneRequestV1(model="m", state="s", questions=(question,), images=(Image.new("RGB", (0, 0)),))
    with pytest.raises(RequestValidationError) as info:  # was a ZeroDivisionError in smart_resize
        encode_record(request, golden_processor)
    assert info.value.field == "images[0]"


def _dds_with_unknown_pixel_format() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, "DDS")
    data = bytearray(buffer.getvalue())
    data[80:84] = b"\0\0\0\0"  # DDS_PIXELFORMAT.dwFlags = 0: PIL's DDS plugin raises NotImplementedError
    return bytes(data)


@pytest.mark.parametrize("save_as", ["DDS-broken", "ICNS", "TGA", "PPM"])
def test_only_the_common_web_formats_are_decoded(save_as: str) -> None:
    """PIL's other decoders never see client bytes: a broken DDS raised NotImplementedError (a 500) before."""
    from PIL import Image

    if save_as == "DDS-broken":
        data = _dds_with_unknown_pixel_format()
    else:
        buffer = io.BytesIO()
        Image.new("RGB", (16, 16)).save(buffer, save_as)
        data = buffer.getvalue()
    item = {"content_type": "image/png", "base64": base64.b64encode(data).decode()}
    with pytest.raises(RequestValidationError, match="is not a decodable PNG, JPEG, GIF, WEBP, BMP image") as info:
        decode_image(item, where="images[0]")
    assert info.value.field == "images[0]"


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="only without torchvision")
def test_video_without_torchvision_names_the_fix(golden_processor: ClefProcessor) -> None:
    frames = np.zeros((4, 64, 64, 3), dtype=np.uint8)
    with pytest.raises(RequestValidationError, match="install the torchvision build") as info:
        golden_processor.encode_media([], [frames], token_offset=0, media_kwargs=None)
    assert info.value.field == "videos"
