from __future__ import annotations

import pytest
import torch

from guard.compact.encoder import EncoderConfig, TextEncoder, default_dtype, text_key


def test_windows_cover_every_token_once(encoder: TextEncoder) -> None:
    text = " ".join(f"word{i}" for i in range(120))
    (encoded,) = encoder.encode([text])
    ids = encoder.token_ids(text)
    assert encoded.tokens == len(ids) > encoder.config.chunk * 2
    assert encoded.token_ids.tolist() == ids  # one row per token, in order, overlaps not doubled
    assert encoded.states.shape == (len(ids), 384)
    assert encoded.windows > 2 and encoded.dropped == 0


def test_overlap_gives_context_from_both_windows(encoder: TextEncoder) -> None:
    text = " ".join(f"token{i}" for i in range(200))
    (windowed,) = encoder.encode([text])
    no_overlap = TextEncoder(encoder.model, encoder.tokenizer, EncoderConfig(window=64, overlap=0), encoder.dtype)
    (plain,) = no_overlap.encode([text])
    assert windowed.token_ids.tolist() == plain.token_ids.tolist()
    assert windowed.windows > plain.windows
    assert not torch.equal(windowed.states, plain.states)


def test_long_text_keeps_head_and_tail_and_reports_the_cut(encoder: TextEncoder) -> None:
    small = TextEncoder(encoder.model, encoder.tokenizer, EncoderConfig(window=64, overlap=16, max_tokens=40),
                        encoder.dtype)
    text = " ".join(f"w{i}" for i in range(100))
    ids = small.token_ids(text)
    (encoded,) = small.encode([text])
    assert encoded.tokens == len(ids)
    assert encoded.dropped == len(ids) - 40
    assert encoded.token_ids.tolist() == ids[:20] + ids[-20:]


def test_empty_text_reads_the_cls_state(encoder: TextEncoder) -> None:
    (encoded,) = encoder.encode([""])
    assert encoded.states.shape == (1, 384) and encoded.tokens == 0 and encoded.windows == 1


def test_batch_equals_single(encoder: TextEncoder) -> None:
    texts = ["short one", " ".join(["longer text"] * 60)]
    together = encoder.encode(texts)
    alone = [encoder.encode([t])[0] for t in texts]
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a.states.float(), b.states.float(), atol=0.05, rtol=0.05)


def test_default_dtype_is_bf16_or_fp32() -> None:
    assert default_dtype() in (torch.bfloat16, torch.float32)


@pytest.mark.parametrize(("kwargs", "message"), [({"window": 4}, "window is 4"), ({"overlap": 200}, "overlap is 200"),
                                                 ({"max_tokens": 1}, "max_tokens is 1")])
def test_config_rejects_bad_values(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EncoderConfig(**kwargs)


def test_text_key_depends_on_windows() -> None:
    assert text_key("a", EncoderConfig()) != text_key("a", EncoderConfig(window=128))
    assert text_key("a", EncoderConfig()) == text_key("a", EncoderConfig())
