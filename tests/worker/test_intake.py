"""Request-body intake of the worker (``guard/worker/_intake.py``): content codings, multipart assets, image checks."""

from __future__ import annotations

import json

import pytest
import zstandard

from guard.errors import BodyError
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
