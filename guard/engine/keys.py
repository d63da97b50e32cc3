"""Probability-cache keys: a SHA-256 of everything the model sees (:func:`cache_key`), the same key with the
constant part computed once per policy (:class:`KeyTemplate`), and a key kept apart for one tenant
(:func:`scoped_key`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from guard.systemone import QuestionV1, SystemOneRequestV1

__all__ = ["KEY_VERSION", "KeyTemplate", "cache_key", "scoped_key"]

#: Bump when the key material changes; old entries then simply miss.
KEY_VERSION = 3


def _media(value: Any) -> Any:
    """The key material of a value JSON cannot encode (Python API only): an array (a video's frames: numpy's, or a
    torch tensor, read through ``numpy(force=True)``) by its shape, dtype and bytes; a PIL image by its mode, size and
    pixels, a palette image's ("P", "PA") and one with a transparent colour (``info["transparency"]``, which the
    processor composites onto white) as RGBA (a palette image's pixels are indexes: the palette and transparency
    decide what the model sees); anything else by its repr."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        array = value if callable(getattr(value, "tobytes", None)) else value.numpy(force=True)
        return {"array": [list(array.shape), str(array.dtype), hashlib.sha256(array.tobytes()).hexdigest()]}
    tobytes = getattr(value, "tobytes", None)
    if callable(tobytes):
        mode = getattr(value, "mode", "")
        keyed = mode in ("P", "PA") or getattr(value, "info", {}).get("transparency") is not None
        pixels = value.convert("RGBA").tobytes() if keyed else tobytes()
        return {"image": [mode, list(getattr(value, "size", ())), hashlib.sha256(pixels).hexdigest()]}
    return repr(value)


#: One encoder for all key material (what ``json.dumps(..., ensure_ascii=False, separators=(",", ":"),
#: default=_media)`` builds on every call).
_KEY_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_media)


class KeyTemplate:
    """:func:`cache_key` with everything but the state rendered and hashed once (a policy's questions do not change
    between requests, so only the state is encoded per request).

    ``KeyTemplate(backend=b, revision=r, model=m, questions=qs).key(state)`` equals ``cache_key(SystemOneRequestV1(m,
    state, qs), backend=b, revision=r)``, byte for byte: the key material is the same JSON object, encoded in three
    pieces (before the state, the state, after it) that concatenate to the one-piece encoding.

    Args:
        backend: the backend's name.
        revision: the model revision.
        model: the model name in the request.
        questions: the questions in request order.
        images: the request's images (policies send none).
        videos: the request's videos (policies send none).
    """

    __slots__ = ("_head", "_tail")

    def __init__(
        self, *, backend: str, revision: str, model: str, questions: Sequence[QuestionV1], images: Sequence[Any] = (),
        videos: Sequence[Any] = (),
    ) -> None:
        head = _KEY_ENCODER.encode({"v": KEY_VERSION, "backend": backend, "revision": revision, "model": model})
        self._head = hashlib.sha256(f'{head[:-1]},"state":'.encode())
        canonical = [q.canonical() for q in questions]  # a choice's options sorted by id: listing order is no key
        questions_json = _KEY_ENCODER.encode([[q.id, q.type, q.instructions, q.criteria] for q in canonical])
        images_json = _KEY_ENCODER.encode(list(images))
        videos_json = _KEY_ENCODER.encode(list(videos))
        self._tail = f',"questions":{questions_json},"images":{images_json},"videos":{videos_json}}}'.encode()

    def key(self, state: Any) -> str:
        """SHA-256 (hex, 64 characters) of the key material with this ``state``."""
        digest = self._head.copy()
        digest.update(_KEY_ENCODER.encode(state).encode("utf-8"))
        digest.update(self._tail)
        return digest.hexdigest()


def cache_key(request: SystemOneRequestV1, *, backend: str, revision: str) -> str:
    """SHA-256 (hex) of everything the model sees.

    Material, in order: key version, backend name, model revision, model name, the state (key order kept: it is model
    input), every question in request order with its type, instructions and criteria (a choice's options sorted by
    id, as they go on the wire: two policies that list the same options in another order share entries), the
    images and the videos. Requests that differ in any of these never share an entry. The engine uses
    :class:`KeyTemplate` (same keys, the constant part computed once per policy).
    """
    template = KeyTemplate(
        backend=backend, revision=revision, model=request.model, questions=request.questions, images=request.images,
        videos=request.videos,
    )
    return template.key(request.state)


def scoped_key(key: str, scope: str | None) -> str:
    """``key`` for the entries of one ``scope`` (a tenant): SHA-256 (hex) of the key, a newline and the scope's UTF-8,
    so that scopes share no entry, and no in-flight call either (a caller cannot time whether another scope sent the
    same state); ``key`` itself when ``scope`` is ``None``."""
    if scope is None:
        return key
    return hashlib.sha256(f"{key}\n{scope}".encode("utf-8", "surrogatepass")).hexdigest()
