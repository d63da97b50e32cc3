"""Tokenizer and media processor of a Clef checkpoint, loaded without a network and (for images) without torchvision.

Implements the loading half of the Clef runtime spec §1.6 and §2.3 step 2:

* The tokenizer is read **literally from ``tokenizer.json``** with the ``tokenizers`` library, the way transformers
  5.10.2 (the version the reference was tested with) reads it. transformers >= 5.24 loads a ``Qwen3_5Tokenizer`` for
  ``qwen3_5`` that swaps in a pre-tokenizer regex where combining marks join letter runs; text with marks that survive
  NFC (Devanagari, Thai) would tokenize differently from the reference, so we do not use it.
* Images go through the checkpoint's image processor (``AutoImageProcessor``; without torchvision this is
  ``Qwen2VLImageProcessorPil``) and the placeholder expansion of ``Qwen3VLProcessor`` is reproduced here: each
  ``<|image_pad|>`` becomes ``grid_t·grid_h·grid_w / merge_size²`` pads, the expanded text is tokenized in one call,
  and ``mm_token_type_ids`` marks image pads 1 and video pads 2.
* Videos need the full ``Qwen3VLProcessor`` with its video processor, which needs torchvision. When torchvision is
  installed every media request goes through that processor (with the faithful tokenizer above).
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from guard.errors import FieldError, RequestValidationError
from guard.systemone import IMAGE_FORMATS, MAX_IMAGE_PIXELS

__all__ = [
    "IMAGE_PLACEHOLDER",
    "MAX_ASPECT_RATIO",
    "VIDEO_PLACEHOLDER",
    "ClefProcessor",
    "EncodedMedia",
    "decode_base64",
    "decode_image",
    "load_tokenizer",
    "open_image",
]

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"

#: Longest over shortest side of an image the image processor takes (its ``smart_resize`` refuses more).
MAX_ASPECT_RATIO = 200

_DEFAULT_IMAGE_TOKEN = "<|image_pad|>"
_DEFAULT_VIDEO_TOKEN = "<|video_pad|>"
_TORCHVISION_FIX = (
    "video input needs torchvision for the checkpoint's video processor; install the torchvision build that matches "
    "your torch (e.g. `pip install torchvision==<version for torch {torch}>`)"
)


@dataclass(frozen=True)
class EncodedMedia:
    """The media block of one record (§2.3 step 2).

    Attributes:
        input_ids: the processor's ids for ``IMAGE_PLACEHOLDER × n + VIDEO_PLACEHOLDER × m + "\\n"`` with the pads
            expanded to the grid sizes.
        mm_token_type_ids: one entry per id in ``input_ids``: 0 text, 1 image pad, 2 video pad.
        tensors: ``pixel_values`` [patches, C·t·p·p] float32, ``image_grid_thw`` [n_images, 3] int64, and for videos
            ``pixel_values_videos`` / ``video_grid_thw``; concatenated along dim 0 when records are collated.
        token_offset: index of the first media id in the record's ``input_ids`` (= ``len(prefix_ids)``).
    """

    input_ids: tuple[int, ...]
    mm_token_type_ids: tuple[int, ...]
    tensors: dict[str, torch.Tensor] = field(compare=False)
    token_offset: int = 0


def load_tokenizer(path: str | Path) -> Any:
    """Load ``tokenizer.json`` literally as a transformers fast tokenizer (§1.6).

    Args:
        path: checkpoint directory holding ``tokenizer.json`` and ``tokenizer_config.json``.

    Returns:
        A ``PreTrainedTokenizerFast`` whose backend is exactly the file's pipeline, with the config's eos/pad tokens.

    Raises:
        FileNotFoundError: when ``tokenizer.json`` is missing.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    root = Path(path)
    config_path = root / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    special = {key: config[key] for key in ("eos_token", "pad_token", "bos_token", "unk_token") if config.get(key)}
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=Tokenizer.from_file(str(root / "tokenizer.json")),
        model_max_length=config.get("model_max_length", 262144),
        **special,
    )
    return tokenizer


def _check_aspect_ratio(width: int, height: int, where: str) -> None:
    """Refuse an image the image processor cannot resize: one without pixels (a PIL image given to the Python API can
    be 0 pixels wide; ``smart_resize`` divides by its sides) or with sides more than :data:`MAX_ASPECT_RATIO` apart.

    Raises:
        RequestValidationError: naming ``where``.
    """
    if min(width, height) < 1:
        raise RequestValidationError([FieldError(where, f"is {width}x{height} pixels; an image needs at least one")])
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        message = f"is {width}x{height} pixels; its sides may differ by a factor of {MAX_ASPECT_RATIO} at most"
        raise RequestValidationError([FieldError(where, message)])


#: Deletes ASCII whitespace (``bytes.translate``): the line breaks of base64 wrapped into lines.
_ASCII_WHITESPACE = b" \t\n\r\f\v"


def decode_base64(payload: str) -> bytes:
    """The bytes of standard, padded base64 ``payload``; ASCII whitespace in it is skipped (base64 wrapped into lines
    as MIME, the ``base64`` tool and Python's ``encodebytes`` write it; the reference's ``base64.decodebytes`` skips
    it too), any other character outside the alphabet is refused.

    Raises:
        ValueError: ``binascii.Error`` for a character outside the alphabet or wrong padding;
            ``UnicodeEncodeError`` for a character outside ASCII.
    """
    return base64.b64decode(payload.encode("ascii").translate(None, _ASCII_WHITESPACE), validate=True)


def decode_image(item: Any, *, where: str = "images[0]") -> Any:
    """Turn one ``images`` entry into an RGB PIL image, its transparency converted as the reference converts it
    (:func:`_decoded`).

    Accepts a PIL image, a ``data:image/...;base64,...`` URL (Workers AI form), ``{"content_type", "base64"}`` or
    bare base64 (as the reference's ``load_image`` takes a string that is not a URL or a file); the base64 may be
    wrapped into lines (:func:`decode_base64`).

    Raises:
        RequestValidationError: for a remote URL, bad base64, bytes PIL cannot decode, or an image over
            :data:`MAX_IMAGE_PIXELS` or with sides more than :data:`MAX_ASPECT_RATIO` apart (read from its header,
            before decoding); the field is ``where``.
    """
    return _decoded(item, open_image(item, where=where), where)


# PIL resampling filters (``PIL.Image.Resampling`` values) to torch's interpolation mode and antialias flag, as
# torchvision's ``resize`` maps them for a tensor (``pil_torch_interpolation_mapping``): NEAREST is NEAREST_EXACT
_INTERPOLATIONS = {0: ("nearest-exact", False), 2: ("bilinear", True), 3: ("bicubic", True)}


#: ``media_kwargs`` the checkpoint's vision tower fixes: a request may only repeat the image processor's value.
_FIXED_MEDIA_KWARGS = ("patch_size", "temporal_patch_size", "merge_size")


def _is_number(value: Any, kind: type | tuple[type, ...] = (int, float)) -> bool:
    """Whether ``value`` is a finite number of ``kind`` (never a bool)."""
    return isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)


def _interpolation(resample: Any) -> tuple[str, bool]:
    """Torch's interpolation mode and antialias flag for an image processor's ``resample`` (``None``: bilinear, as
    the torchvision backend resizes then).

    Raises:
        RequestValidationError: a filter torchvision cannot resize a tensor with here (BOX, HAMMING, LANCZOS), field
            ``media_kwargs.resample``.
    """
    if resample is None:
        return _INTERPOLATIONS[2]
    if isinstance(resample, int) and resample in _INTERPOLATIONS:
        return _INTERPOLATIONS[resample]
    raise RequestValidationError([FieldError(
        "media_kwargs.resample", f"{resample!r} is not supported; use PIL.Image.Resampling NEAREST, BILINEAR or BICUBIC"
    )])


def _decoded(item: Any, image: Any, where: str) -> Any:
    """``image`` (``item`` opened by :func:`open_image`) decoded, as RGB, as the reference converts it: an image from
    bytes first turned as its EXIF orientation says, then to RGB (its ``load_image``: ``ImageOps.exif_transpose``,
    then alpha dropped, a palette's transparent colour kept as an RGB colour key), then, as its image processor
    converts any image (``do_convert_rgb``: transformers' ``convert_to_rgb``), one with transparency (an alpha band
    or a colour key) composited onto white, so a PIL image given to the Python API keeps its alpha up to there. A
    quarter turn keeps the token count read from the header (``smart_resize`` is symmetric in height and width).

    Raises:
        RequestValidationError: pixels or EXIF data that do not decode (field ``where``).
    """
    from PIL import Image, ImageOps

    try:
        image.load()
        if not isinstance(item, Image.Image):
            ImageOps.exif_transpose(image, in_place=True)
            image = image.convert("RGB")
    except Exception as exc:  # a decoder of client bytes may raise any type (SyntaxError, EOFError, ...)
        raise RequestValidationError([FieldError(where, f"is not a decodable image ({exc})")]) from exc
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def open_image(item: Any, *, where: str = "images[0]") -> Any:
    """One ``images`` entry as a PIL image whose header alone is read (its ``size`` known, its pixels not decoded);
    accepts what :func:`decode_image` accepts.

    Raises:
        RequestValidationError: as :func:`decode_image`, for everything found before decoding.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        _check_aspect_ratio(*item.size, where)
        return item
    bare = isinstance(item, str) and item[:5].lower() != "data:"  # base64 alone, as the reference takes it
    if bare:
        if item[:8].lower().startswith(("http://", "https://")):
            message = "must be a data: URL or base64; remote URLs are never fetched"
            raise RequestValidationError([FieldError(where, message)])
        payload = item
    elif isinstance(item, str):
        header, _, payload = item.partition(",")
        if not header.lower().endswith(";base64"):
            raise RequestValidationError([FieldError(where, "data URL must be base64-encoded")])
    elif isinstance(item, Mapping) and isinstance(item.get("base64"), str):
        payload = item["base64"]
    else:
        raise RequestValidationError(
            [
                FieldError(
                    where, f"must be a PIL image, a data URL or {{content_type, base64}}, got {type(item).__name__}"
                )
            ]
        )
    try:
        raw = decode_base64(payload)
    except ValueError as exc:
        message = f"is neither a data: URL nor base64 ({exc}); file paths are never read" if bare else (
            f"is not base64 ({exc})")
        raise RequestValidationError([FieldError(where, message)]) from exc
    try:
        image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise RequestValidationError([FieldError(where, f"is too large to decode ({exc})")]) from exc
    except UnidentifiedImageError as exc:  # its message names a Python object by its memory address: not shown
        raise RequestValidationError(
            [FieldError(where, f"is not a decodable {', '.join(IMAGE_FORMATS)} image (not one of these formats)")]
        ) from exc
    except (ValueError, OSError) as exc:
        raise RequestValidationError(
            [FieldError(where, f"is not a decodable {', '.join(IMAGE_FORMATS)} image ({exc})")]
        ) from exc
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise RequestValidationError(
            [FieldError(where, f"is {width}x{height} pixels; the limit is {MAX_IMAGE_PIXELS} (checked before decoding)")]
        )
    _check_aspect_ratio(width, height, where)
    return image


class ClefProcessor:
    """Tokenizer plus media processing of one checkpoint: the ``processor`` argument of ``encode_record``.

    Args:
        tokenizer: a transformers tokenizer (see :func:`load_tokenizer`).
        image_processor: the checkpoint's image processor, or ``None`` for a text-only processor: its settings and
            token counts (the pixels are computed as its torchvision backend computes them, whichever it is).
        full_processor: a ``Qwen3VLProcessor`` (needs torchvision); when given, a request with videos goes through it.

    Example:
        >>> processor = ClefProcessor.from_pretrained("tests/fixtures/clef-golden/checkpoint")  # doctest: +SKIP
        >>> processor.encode_texts(["STATE:\\n"])  # doctest: +SKIP
    """

    def __init__(self, tokenizer: Any, image_processor: Any = None, full_processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.full_processor = full_processor
        self.pad_token_id: int = int(tokenizer.pad_token_id)
        self.image_token_id = self._special_id(_DEFAULT_IMAGE_TOKEN)
        self.video_token_id = self._special_id(_DEFAULT_VIDEO_TOKEN)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ClefProcessor:
        """Load tokenizer and (when ``processor_config.json`` exists) the media processors from a checkpoint dir."""
        root = Path(path)
        tokenizer = load_tokenizer(root)
        if not (root / "processor_config.json").exists():
            return cls(tokenizer)
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(str(root))  # type: ignore[no-untyped-call]
        full = None
        if importlib.util.find_spec("torchvision") is not None:  # pragma: no cover - torchvision is absent in CI
            from transformers import AutoVideoProcessor
            from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

            full = Qwen3VLProcessor(  # type: ignore[no-untyped-call]
                image_processor=image_processor,
                tokenizer=tokenizer,
                video_processor=AutoVideoProcessor.from_pretrained(str(root)),  # type: ignore[no-untyped-call]
            )
        return cls(tokenizer, image_processor, full)

    @property
    def media_pad_ids(self) -> frozenset[int]:
        """The ids the backbone fills with media features: ``<|image_pad|>`` and ``<|video_pad|>`` (those it has)."""
        return frozenset(i for i in (self.image_token_id, self.video_token_id) if i is not None)

    def _special_id(self, token: str) -> int | None:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        return int(token_id) if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id else None

    def normalized(self, text: str) -> str | None:
        """``text`` as the tokenizer's own normalizer leaves it, when that normalizer keeps a prefix of its output as
        it is (none, or NFC: the prefix of a normalized text is normalized), so a prefix of the result
        tokenizes as the same prefix of the whole text does up to the cut; ``None`` otherwise (a tokenizer without
        a fast backend, another normalizer, or added tokens matched with options this does not follow), where only
        the whole text tokenizes faithfully. As the tokenizer does, added tokens the normalizer must not touch
        (``<|im_end|>``) are found first, longest at the leftmost place, and only the text between them is
        normalized: NFC would make ``>`` and a following U+0338 one character and lose the token. Where normalizing
        the text between them makes a new one (U+212A KELVIN SIGN is ``K``), ``None``."""
        if self._backend is None:
            return None
        normalizer = self._backend.normalizer
        if normalizer is None:
            return text
        if type(normalizer).__name__ != "NFC":
            return None
        raw = [t for t in self._backend.get_added_tokens_decoder().values() if not t.normalized]
        if any(t.lstrip or t.rstrip or t.single_word for t in raw):
            return None
        literals = {t.content for t in raw if t.content}
        present = sorted((literal for literal in literals if literal in text), key=len, reverse=True)
        pieces, last = [], 0
        if present:
            for match in re.finditer("|".join(map(re.escape, present)), text):
                pieces += [str(normalizer.normalize_str(text[last : match.start()])), match.group()]
                last = match.end()
        pieces.append(str(normalizer.normalize_str(text[last:])))
        out = "".join(pieces)
        return out if all(out.count(literal) == text.count(literal) for literal in literals) else None

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Tokenize each text on its own, without special-token templates (§2.3).

        Equivalent to ``[tokenizer(t, add_special_tokens=False).input_ids for t in texts]``; uses the backend's batch
        encoder when there is one (same ids, one call).
        """
        if self._backend is not None:
            return [enc.ids for enc in self._backend.encode_batch(list(texts), add_special_tokens=False)]
        return [list(self.tokenizer(text, add_special_tokens=False).input_ids) for text in texts]

    def _media_settings(self, media_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The image processor's settings with ``media_kwargs`` over them, merged as the processor merges them
        (``size``, then ``min_pixels`` and ``max_pixels`` over its ``size``): what the images' token counts and pixels
        are computed with.

        Raises:
            RequestValidationError: naming ``media_kwargs.<key>``: a ``patch_size``, ``temporal_patch_size`` or
                ``merge_size`` other than the processor's (the checkpoint's vision tower is built for those),
                ``do_resize`` false (every image is resized to the patch grid its tokens are counted for), a ``size``
                (with ``min_pixels`` and ``max_pixels``) that gives no whole pixel counts ``shortest_edge`` >= 0 and
                ``longest_edge`` >= 1, an ``image_mean`` or ``image_std`` that is neither a number nor one per
                channel (3), a ``rescale_factor`` that is no finite number > 0, or a value the processor's merge
                refuses (``media_kwargs``).
        """
        processor = self.image_processor
        errors = [
            FieldError(f"media_kwargs.{key}", f"is fixed by the checkpoint's vision tower to {getattr(processor, key)}")
            for key in _FIXED_MEDIA_KWARGS
            if key in media_kwargs and media_kwargs[key] != getattr(processor, key)
        ]
        if errors:
            raise RequestValidationError(errors)
        try:
            settings = processor._merge_and_standardize_kwargs(**media_kwargs)
        except (TypeError, ValueError) as exc:
            error = FieldError("media_kwargs", f"is refused by the image processor ({exc})")
            raise RequestValidationError([error]) from exc
        if not settings["do_resize"]:
            errors.append(FieldError("media_kwargs.do_resize", "must be true: every image is resized to the patch grid "
                                     "its tokens are counted for"))  # fmt: skip
        bounds = (settings["size"].shortest_edge, settings["size"].longest_edge)
        if not all(_is_number(bound, int) and bound >= least for bound, least in zip(bounds, (0, 1), strict=True)):
            errors.append(FieldError("media_kwargs.size", "must give shortest_edge >= 0 and longest_edge >= 1 pixels "
                                     "(min_pixels and max_pixels set them)"))  # fmt: skip
        if not (_is_number(settings["rescale_factor"]) and settings["rescale_factor"] > 0):
            errors.append(FieldError("media_kwargs.rescale_factor", "must be a finite number > 0"))
        for key in ("image_mean", "image_std"):
            value = settings[key]
            channels = isinstance(value, list | tuple) and len(value) == 3 and all(map(_is_number, value))
            if not (_is_number(value) or channels):
                errors.append(FieldError(f"media_kwargs.{key}", "must be a number or 3 numbers, one per channel"))
        if errors:
            raise RequestValidationError(errors)
        return settings

    def _resized(self, height: int, width: int, settings: Mapping[str, Any]) -> tuple[int, int]:
        """The ``(height, width)`` the image processor resizes an image of ``height`` x ``width`` pixels to with
        ``settings`` (:meth:`_media_settings`): ``smart_resize`` to multiples of ``patch_size * merge_size`` within
        ``size``'s pixel counts, as its ``get_number_of_image_patches`` and its resize compute it."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(
            height, width, factor=settings["patch_size"] * settings["merge_size"],
            min_pixels=settings["size"].shortest_edge, max_pixels=settings["size"].longest_edge,
        )  # fmt: skip

    def _image_pads(self, opened: Sequence[Any], settings: Mapping[str, Any]) -> list[int]:
        """The ``<|image_pad|>`` tokens each opened image takes at the size the image processor resizes it to
        (``settings``: :meth:`_media_settings`)."""
        unit = (settings["patch_size"] * settings["merge_size"]) ** 2
        sizes = [self._resized(image.height, image.width, settings) for image in opened]
        return [height * width // unit for height, width in sizes]

    def _image_pixels(self, image: Any, settings: Mapping[str, Any]) -> tuple[torch.Tensor, list[int]]:
        """``pixel_values`` rows ``[grid_h x grid_w, patch width]`` and the ``[t, grid_h, grid_w]`` grid of one decoded
        RGB PIL image, as the reference's image processor (``Qwen2VLImageProcessor``, the torchvision backend)
        computes them on CPU, whether or not torchvision is installed: the uint8 image resized to ``smart_resize``'s
        size by torch's antialiased interpolation on uint8 (what torchvision's ``resize`` runs on CPU; PIL's bicubic,
        which the PIL backend uses, differs by up to 2/255), rescaled and normalised in float32 in one step
        (``(x - mean / rescale) / (std / rescale)``, as its fused ``rescale_and_normalize``), then cut into patches,
        each repeated ``temporal_patch_size`` times. ``settings``: the processor's with ``media_kwargs`` over them
        (:meth:`_media_settings`).

        Raises:
            RequestValidationError: a ``resample`` other than ``NEAREST``, ``BILINEAR`` and ``BICUBIC`` (field
                ``media_kwargs.resample``).
        """
        patch, merge, temporal = settings["patch_size"], settings["merge_size"], settings["temporal_patch_size"]
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]  # uint8 [1, 3, H, W]
        height, width = pixels.shape[-2:]
        size = self._resized(height, width, settings)
        if size != (height, width):
            mode, antialias = _interpolation(settings["resample"])
            pixels = torch.nn.functional.interpolate(pixels, size=size, mode=mode, antialias=antialias)
            height, width = size
        values = pixels[0].to(torch.float32)  # [3, H, W]
        if settings["do_normalize"]:
            scale = 1.0 / settings["rescale_factor"] if settings["do_rescale"] else 1.0
            mean = torch.tensor(settings["image_mean"]) * scale
            std = torch.tensor(settings["image_std"]) * scale
            values = (values - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        elif settings["do_rescale"]:
            values = values * settings["rescale_factor"]
        grid_h, grid_w = height // patch, width // patch
        rows = (
            values.reshape(3, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
            .permute(1, 4, 2, 5, 0, 3, 6)  # [grid_h / merge, grid_w / merge, merge, merge, 3, patch, patch]
            .unsqueeze(5)
            .expand(-1, -1, -1, -1, -1, temporal, -1, -1)
            .reshape(grid_h * grid_w, 3 * temporal * patch * patch)
        )
        return rows, [1, grid_h, grid_w]

    def _patch_width(self) -> int:
        """Floats in one row of ``pixel_values``: channels x temporal patch x patch x patch."""
        processor = self.image_processor
        return 3 * int(processor.temporal_patch_size) * int(processor.patch_size) ** 2

    def image_pads(self, images: Sequence[Any], media_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The ``<|image_pad|>`` tokens each of ``images`` takes, counted from its header (no image is decoded); ``[]``
        on a text-only checkpoint (which refuses images).

        Raises:
            RequestValidationError: as :func:`open_image`, naming ``images[i]``; ``media_kwargs`` the pixels cannot
                follow (:meth:`_media_settings`).
        """
        if not images or self.image_processor is None:
            return []
        opened = [open_image(item, where=f"images[{i}]") for i, item in enumerate(images)]
        return self._image_pads(opened, self._media_settings(media_kwargs or {}))

    def image_tensor_bytes(self, pads: Sequence[int]) -> int:
        """Bytes the tensors of images taking ``pads`` tokens each (:meth:`image_pads`) hold once encoded by
        :meth:`encode_media`: float32 ``pixel_values``, one row per patch, ``merge_size²`` patches per pad, and int64
        ``image_grid_thw``. 0 for no images."""
        if not pads:
            return 0
        rows = sum(pads) * int(self.image_processor.merge_size) ** 2
        return rows * self._patch_width() * 4 + len(pads) * 3 * 8

    def max_image_tensor_bytes(self) -> int:
        """Most bytes one image's tensors hold once encoded (:meth:`image_tensor_bytes` of an image resized to the most
        pixels the image processor keeps, ``size["longest_edge"]``: 24 MiB for 1,024 tokens); 0 on a text-only
        checkpoint."""
        processor = self.image_processor
        if processor is None:
            return 0
        factor = int(processor.patch_size) * int(processor.merge_size)
        return self.image_tensor_bytes([int(processor.size["longest_edge"]) // factor**2])

    def image_block_tokens(self, pads: Sequence[int]) -> int:
        """Tokens of the prompt's media block of images taking ``pads`` tokens each (:meth:`image_pads`): their pads,
        markers and the newline after them."""
        return len(self.encode_texts([IMAGE_PLACEHOLDER * len(pads) + "\n"])[0]) - len(pads) + sum(pads)

    def check_image_room(self, pads: Sequence[int], max_tokens: int) -> None:
        """Refuse images taking ``pads`` tokens each (:meth:`image_pads`) whose block, with its markers
        (:meth:`image_block_tokens`), takes more than ``max_tokens`` (the prompt's room beside its schema).

        Raises:
            RequestValidationError: field ``images``, naming each image's tokens and the room.
        """
        tokens = self.image_block_tokens(pads)
        if tokens > max_tokens:
            message = (f"{len(pads)} image(s) take {tokens} tokens at the sizes the image processor resizes them to "
                       f"({', '.join(map(str, pads))} each, plus their markers); the prompt has room for "
                       f"{max(max_tokens, 0)} beside its schema")
            raise RequestValidationError([FieldError("images", message)])

    def encode_media(
        self,
        images: Sequence[Any],
        videos: Sequence[Any],
        *,
        token_offset: int,
        media_kwargs: Mapping[str, Any] | None,
        max_tokens: int | None = None,
    ) -> EncodedMedia:
        """Run the media block through the image (and video) processor (§2.3 step 2).

        Every image's header is read first and its tokens counted from its size, as the image processor resizes it
        (``get_number_of_image_patches``); then the images are decoded and processed one at a time, so one request
        holds at most one decoded image.

        Args:
            images: PIL images, data URLs or ``{content_type, base64}`` entries.
            videos: frame arrays (needs torchvision).
            token_offset: where the block will start in ``input_ids``.
            media_kwargs: extra processor keyword arguments (reference ``media_kwargs``).
            max_tokens: most tokens the block may take (``None``: no limit); an image-only block is measured before
                any image is decoded.

        Raises:
            RequestValidationError: undecodable images, images whose block would take more than ``max_tokens``
                (field ``images``), media on a text-only checkpoint, videos without torchvision (the message names
                the fix), a ``resample`` in ``media_kwargs`` torch cannot resize with (``media_kwargs.resample``), or
                ``media_kwargs`` the pixels cannot follow (:meth:`_media_settings`).
        """
        if images and self.image_processor is None:
            raise RequestValidationError(
                [FieldError("images", "this checkpoint is text-only (no processor_config.json); send no images")]
            )
        opened = [open_image(item, where=f"images[{i}]") for i, item in enumerate(images)]
        text = IMAGE_PLACEHOLDER * len(opened) + VIDEO_PLACEHOLDER * len(videos) + "\n"
        kwargs = dict(media_kwargs or {})
        merge = int(self.image_processor.merge_size) ** 2 if opened else 1
        settings = self._media_settings(kwargs) if opened else {}
        pads = self._image_pads(opened, settings) if opened else []
        if max_tokens is not None and not videos:
            self.check_image_room(pads, max_tokens)
        if self.full_processor is not None and videos:  # pragma: no cover - torchvision is absent in CI
            decoded = [_decoded(images[i], image, f"images[{i}]") for i, image in enumerate(opened)]
            out = self.full_processor(
                text=[text], images=decoded or None, videos=list(videos), return_tensors="pt", **kwargs
            )
            ids = out.pop("input_ids")[0].tolist()
            types = out.pop("mm_token_type_ids")[0].tolist()
            out.pop("attention_mask", None)
            return EncodedMedia(tuple(ids), tuple(types), dict(out), token_offset)
        if videos:
            raise RequestValidationError([FieldError("videos", _TORCHVISION_FIX.format(torch=torch.__version__))])
        # filled in place, one decoded image at a time (dropped once processed): no second copy to concatenate
        pixel_values = torch.empty((sum(pads) * merge, self._patch_width()), dtype=torch.float32)
        grids, row = [], 0
        for i, image in enumerate(opened):
            rows, image_grid = self._image_pixels(_decoded(images[i], image, f"images[{i}]"), settings)
            pixel_values[row:row + pads[i] * merge] = rows
            row += pads[i] * merge
            grids.append(image_grid)
        grid = torch.tensor(grids, dtype=torch.long)  # [n_images, 3] (t, h, w) in patches
        parts = text.split(_DEFAULT_IMAGE_TOKEN)
        expanded = parts[0]
        for i, rest in enumerate(parts[1:]):
            expanded += _DEFAULT_IMAGE_TOKEN * (int(grid[i].prod()) // merge) + rest
        ids = self.encode_texts([expanded])[0]
        types = [1 if t == self.image_token_id else 2 if t == self.video_token_id else 0 for t in ids]
        tensors = {"pixel_values": pixel_values, "image_grid_thw": grid}
        return EncodedMedia(tuple(ids), tuple(types), tensors, token_offset)
