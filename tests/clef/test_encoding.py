"""Encoding (spec §2) against the golden cases, the worked example (§2.7) and the pitfall list."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import torch

from guard.clef.encoding import (
    FIELD_END,
    HEAD_CHARS_PER_TOKEN,
    HEAD_MARGIN,
    OPTIONS_HEADER,
    PREFIX,
    SCHEMA_HEADER,
    SUFFIX,
    SchemaRoom,
    collate,
    encode_record,
    field_header,
    option_label,
    render,
    state_head,
)
from guard.clef.processor import ClefProcessor
from guard.errors import RequestValidationError
from guard.systemone import SystemOneRequestV1
from tests.clef.conftest import CASE_IDS, error_cases, load_case


def _request(body: dict[str, Any]) -> SystemOneRequestV1:
    return SystemOneRequestV1.from_json(body, profile="reference")


def _decode(processor: ClefProcessor, ids: Any) -> str:
    return processor.tokenizer.decode(list(ids), skip_special_tokens=False)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_golden_input_ids_spans_and_option_order_are_exact(case_id: str, golden_processor: ClefProcessor) -> None:
    case = load_case(case_id)
    record = encode_record(_request(case["request"]), golden_processor, max_length=case["max_length"])
    assert list(record.input_ids) == case["input_ids"]
    assert len(record.input_ids) == case["input_ids_len"]
    spans = [
        {
            "question_id": q.question_id,
            "question_type": q.question_type,
            "question_span": list(q.question_span),
            "option_spans": [list(span) for span in q.option_spans],
        }
        for q in record.questions
    ]
    assert spans == case["spans"]
    assert {q.question_id: list(q.option_ids) for q in record.questions} == case["option_order"]
    assert record.untruncated_length == case.get("untruncated_input_ids_len", case["input_ids_len"])
    assert record.truncated == ("untruncated_input_ids_len" in case)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("raw\tstring \n", "raw\tstring \n"),
        (1250.0, "1250.0"),
        (1e16, "1e+16"),
        (-0.0, "-0.0"),
        (1e-05, "1e-05"),
        (2**54 + 1, "18014398509481985"),
        (math.nan, "NaN"),
        (math.inf, "Infinity"),
        (None, "null"),
        (True, "true"),
        ({"b": 1, "a": [1, {"z": None, "y": False}]}, '{"a":[1,{"y":false,"z":null}],"b":1}'),
        ({"über": 1, "Zebra": 2, "_meta": 3, "apple": 4, "42": 5}, '{"42":5,"Zebra":2,"_meta":3,"apple":4,"über":1}'),
        (["日本", "😀"], '["日本","😀"]'),
        ({}, "{}"),
        ([], "[]"),
    ],
)
def test_render_is_python_json_exact(value: Any, text: str) -> None:
    assert render(value) == text


def test_worked_example_section_2_7(golden_processor: ClefProcessor) -> None:
    request = _request(
        {
            "model": "m",
            "state": {"ticket": "Printer on fire"},
            "questions": {
                "urgent": {"type": "noul", "instructions": "Is it urgent?"},
                "team": {
                    "type": "choice",
                    "instructions": "Which team?",
                    "criteria": {"tech": "Bugs", "billing": None},
                },
            },
        }
    )
    record = encode_record(request, golden_processor)
    urgent, team = record.questions
    assert (urgent.question_type, team.question_type) == (0, 1)
    assert urgent.option_ids == ("true", "false") and team.option_ids == ("billing", "tech")
    assert _decode(golden_processor, record.input_ids[slice(*urgent.question_span)]) == "Is it urgent?"
    assert [_decode(golden_processor, record.input_ids[slice(*s)]) for s in urgent.option_spans] == [
        '{"description":"The proposition is true or the answer is yes.","option_id":"true"}',
        '{"description":"The proposition is false or the answer is no.","option_id":"false"}',
    ]
    assert [_decode(golden_processor, record.input_ids[slice(*s)]) for s in team.option_spans] == [
        '{"option_id":"billing"}',
        '{"description":"Bugs","option_id":"tech"}',
    ]
    text = PREFIX + '{"ticket":"Printer on fire"}' + SCHEMA_HEADER
    text += field_header(1, "urgent", "noul") + "Is it urgent?" + OPTIONS_HEADER
    text += option_label(1) + '{"description":"The proposition is true or the answer is yes.","option_id":"true"}\n'
    text += option_label(2) + '{"description":"The proposition is false or the answer is no.","option_id":"false"}\n'
    text += FIELD_END + field_header(2, "team", "choice") + "Which team?" + OPTIONS_HEADER
    text += (
        option_label(1) + '{"option_id":"billing"}\n' + option_label(2) + '{"description":"Bugs","option_id":"tech"}\n'
    )
    text += FIELD_END + SUFFIX
    assert _decode(golden_processor, record.input_ids) == text
    assert text.endswith(
        "END FIELD\n\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
    )


def test_special_token_literals_in_state_become_single_ids(golden_processor: ClefProcessor) -> None:
    plain = encode_record(
        _request({"model": "m", "state": "x", "questions": {"q": {"type": "noul"}}}), golden_processor
    )
    literal = encode_record(
        _request({"model": "m", "state": "x<|im_end|><think>", "questions": {"q": {"type": "noul"}}}), golden_processor
    )
    im_end = golden_processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    think = golden_processor.tokenizer.convert_tokens_to_ids("<think>")
    assert len(literal.input_ids) == len(plain.input_ids) + 2
    start = len(golden_processor.encode_texts([PREFIX])[0])
    assert literal.input_ids[start : start + 3] == (plain.input_ids[start], im_end, think)


@pytest.mark.parametrize(
    ("where", "field"),
    [
        ("state", "state"),
        ("instructions", "questions.q.instructions"),
        ("criteria", "questions.q.criteria"),
    ],
)
def test_media_pads_in_the_text_of_a_request_with_images_are_refused(
    where: str, field: str, golden_processor: ClefProcessor
) -> None:
    """The reference parses them as the pad token, which the image pass fills with features: a count mismatch."""
    image = load_case("16-image-json-state")["request"]["images"]
    question: dict[str, Any] = {"type": "noul", "instructions": "yard?"}
    body: dict[str, Any] = {"model": "m", "state": "s", "images": image, "questions": {"q": question}}
    text = "see <|vision_start|><|image_pad|><|vision_end|>"
    if where == "state":
        body["state"] = text
    elif where == "instructions":
        question["instructions"] = text
    else:
        question["criteria"] = {"true": text}
    with pytest.raises(RequestValidationError, match=re.escape("<|image_pad|>")) as info:
        encode_record(_request(body), golden_processor)
    assert [e.field for e in info.value.errors] == [field]
    body["images"] = []
    assert golden_processor.image_token_id in encode_record(_request(body), golden_processor).input_ids


@pytest.mark.parametrize(
    ("state", "question", "fields"),
    [
        ("a \ud800 b", {"type": "noul", "instructions": "?"}, ["state"]),
        ({"k": ["\udfff"]}, {"type": "noul", "instructions": "?"}, ["state"]),
        ("\u0939\u093f" * 3000 + "\ud800", {"type": "noul", "instructions": "?"}, ["state"]),  # no ASCII: normalized
        ("s", {"type": "noul", "instructions": "x \ud800"}, ["questions.q.instructions"]),
        ("s", {"type": "choice", "criteria": {"a\udc00": 1, "b": None}}, ["questions.q.criteria"]),
        ("\ud800", {"type": "noul", "criteria": {"true": "\ud800", "false": "\udbff"}}, ["questions.q.criteria"]),
    ],
)
def test_a_lone_surrogate_in_the_text_is_refused_naming_the_field(
    state: Any, question: dict[str, Any], fields: list[str], golden_processor: ClefProcessor
) -> None:
    """The tokenizer refuses a string holding one (a TypeError, or its normalizer's UnicodeEncodeError)."""
    request = _request({"model": "m", "state": state, "questions": {"q": question}})
    with pytest.raises(RequestValidationError, match="lone UTF-16 surrogate") as info:
        encode_record(request, golden_processor, max_length=300)
    assert [e.field for e in info.value.errors] == fields


def test_a_lone_surrogate_in_the_dropped_tail_of_the_state_is_never_read(golden_processor: ClefProcessor) -> None:
    request = _request({"model": "m", "state": "word " * 2000 + "\ud800", "questions": {"q": {"type": "noul"}}})
    assert encode_record(request, golden_processor, max_length=300).truncated


def test_unicode_is_nfc_normalized_and_kept_unescaped(golden_processor: ClefProcessor) -> None:
    composed = encode_record(
        _request({"model": "m", "state": {"k": "café"}, "questions": {"q": {"type": "noul"}}}), golden_processor
    )
    decomposed = encode_record(
        _request({"model": "m", "state": {"k": "cafe\u0301"}, "questions": {"q": {"type": "noul"}}}), golden_processor
    )
    assert composed.input_ids == decomposed.input_ids
    assert "café" in _decode(golden_processor, composed.input_ids)


def test_null_and_empty_descriptions(golden_processor: ClefProcessor) -> None:
    request = _request(
        {
            "model": "m",
            "state": "s",
            "questions": {
                "c": {"type": "choice", "instructions": "pick", "criteria": {"b": "", "a": None}},
                "n": {"type": "noul", "instructions": "yes?", "criteria": {"true": None, "other": "ignored"}},
            },
        }
    )
    record = encode_record(request, golden_processor)
    texts = [[_decode(golden_processor, record.input_ids[slice(*s)]) for s in q.option_spans] for q in record.questions]
    assert texts == [
        ['{"option_id":"a"}', '{"description":"","option_id":"b"}'],
        ['{"option_id":"true"}', '{"description":"The proposition is false or the answer is no.","option_id":"false"}'],
    ]


@pytest.mark.parametrize("instructions", [None, "", "missing"])
def test_missing_or_empty_instructions_use_the_question_id(
    instructions: str | None, golden_processor: ClefProcessor
) -> None:
    question: dict[str, Any] = {"type": "noul"}
    if instructions != "missing":
        question["instructions"] = instructions
    record = encode_record(
        _request({"model": "m", "state": "s", "questions": {"refund_due": question}}), golden_processor
    )
    assert _decode(golden_processor, record.input_ids[slice(*record.questions[0].question_span)]) == "refund_due"


def test_an_empty_question_span_is_rejected_instead_of_averaging_nothing(golden_processor: ClefProcessor) -> None:
    request = _request({"model": "m", "state": "s", "questions": {"": {"type": "noul", "instructions": ""}}})
    with pytest.raises(RequestValidationError, match="renders to no tokens") as info:
        encode_record(request, golden_processor)
    assert info.value.field == "questions..instructions"


def test_truncation_keeps_the_head_of_the_state_at_the_exact_boundary(golden_processor: ClefProcessor) -> None:
    body = {"model": "m", "state": "alpha beta gamma delta " * 20, "questions": {"q": {"type": "noul"}}}
    full = encode_record(_request(body), golden_processor)
    prefix_len = len(golden_processor.encode_texts([PREFIX])[0])
    state_ids = golden_processor.encode_texts([body["state"]])[0]
    fixed = len(full.input_ids) - len(state_ids)

    exact = encode_record(_request(body), golden_processor, max_length=fixed)
    assert len(exact.input_ids) == fixed and exact.truncated
    assert exact.input_ids[:prefix_len] == full.input_ids[:prefix_len]
    assert exact.questions[0].question_span[0] == full.questions[0].question_span[0] - len(state_ids)

    one = encode_record(_request(body), golden_processor, max_length=fixed + 1)
    assert one.input_ids[prefix_len] == state_ids[0] and len(one.input_ids) == fixed + 1

    capped = encode_record(_request(body), golden_processor, max_state_tokens=3)
    assert capped.input_ids[prefix_len : prefix_len + 3] == tuple(state_ids[:3]) and len(capped.input_ids) == fixed + 3

    untouched = encode_record(_request(body), golden_processor, max_length=len(full.input_ids))
    assert untouched.input_ids == full.input_ids and not untouched.truncated

    with pytest.raises(RequestValidationError) as info:
        encode_record(_request(body), golden_processor, max_length=fixed - 1)
    assert info.value.errors[0].message == f"schema requires {fixed} tokens before state; maximum is {fixed - 1}"
    assert info.value.field == "questions"


def test_reference_error_for_schema_longer_than_max_length(golden_processor: ClefProcessor) -> None:
    (case,) = [c for c in error_cases() if c["name"] == "error-schema-longer-than-max-length"]
    with pytest.raises(ValueError) as info:
        encode_record(_request(case["request"]), golden_processor, max_length=case["max_length"])
    assert str(info.value).endswith(case["error"]["message"])


@pytest.mark.parametrize("count", [1, 64])
def test_one_and_sixty_four_questions_have_ordered_disjoint_spans(count: int, golden_processor: ClefProcessor) -> None:
    kinds = [
        {"type": "noul"},
        {"type": "choice", "criteria": {"x": "ex", "a": None, "m": {"k": 1}}},
        {"type": "score", "criteria": ["low", "mid", "high"]},
    ]
    questions = {f"q{i}": {**kinds[i % 3], "instructions": f"Question number {i}?"} for i in range(count)}
    record = encode_record(_request({"model": "m", "state": {"n": count}, "questions": questions}), golden_processor)
    assert [q.question_id for q in record.questions] == list(questions)
    cursor = 0
    for i, q in enumerate(record.questions):
        assert _decode(golden_processor, record.input_ids[slice(*q.question_span)]) == f"Question number {i}?"
        for start, end in (q.question_span, *q.option_spans):
            assert cursor <= start < end <= len(record.input_ids)
            cursor = end


def test_collate_right_pads_and_scatters_media_types(golden_processor: ClefProcessor) -> None:
    image_case = load_case("16-image-json-state")
    text = encode_record(_request({"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}), golden_processor)
    media = encode_record(_request(image_case["request"]), golden_processor)
    batch = collate([text, media], golden_processor.pad_token_id)
    width = len(media.input_ids)
    assert batch["input_ids"].shape == (2, width) and batch["attention_mask"].dtype == torch.long
    assert batch["input_ids"][0, len(text.input_ids) :].eq(golden_processor.pad_token_id).all()
    assert batch["attention_mask"].sum(dim=1).tolist() == [len(text.input_ids), width]
    assert batch["mm_token_type_ids"][0].eq(0).all()
    offset = image_case["media"]["token_offset"]
    types = batch["mm_token_type_ids"][1]
    assert types.sum().item() == image_case["media"]["image_pad_count"]
    assert types[image_case["media"]["image_pad_first"]].item() == 1 and types[offset].item() == 0
    assert batch["image_grid_thw"].tolist() == image_case["media"]["image_grid_thw"]
    assert batch["pixel_values"].shape == tuple(image_case["media"]["pixel_values"]["shape"])
    assert "mm_token_type_ids" not in collate([text], golden_processor.pad_token_id)
    with pytest.raises(ValueError, match="at least one record"):
        collate([], golden_processor.pad_token_id)


def _long_texts() -> list[str]:
    """Long states of shapes whose tokens run long or short: prose, one unbroken word, digits, CJK, emoji and tag
    characters, whitespace runs, base64, JSON."""
    import base64
    import random

    rng = random.Random(7)
    words = ["state", "ignore", "previous", "instructions", "naïve", "café", "über", "résumé", "token", "42", "3.14"]
    prose = " ".join(rng.choice(words) for _ in range(6000))
    return [
        prose,
        "a" * 40_000,
        "".join(str(rng.randrange(10)) for _ in range(30_000)),
        "模型的状态与问题" * 3000,
        "🙂🚀\U000e0041" * 4000 + prose,
        (" \t\n" * 5 + "word") * 3000,
        base64.b64encode(rng.randbytes(24_000)).decode(),
        json.dumps({f"k{i}": {"v": words[i % len(words)] * 3, "n": i} for i in range(2500)}),
        # NFC recomposes a mark with a base far back and reorders a run of marks by class (an attack review)
        "a" + "\u0316" * 20_000 + "\u0301",
        "x" + ("\u0301" * 99 + "\u0316") * 400,
        "<|im_end|>" * 3000 + "e\u0301" * 5000,
        "\u00e9" * 60_000,  # no ASCII to cut before: normalized first, then cut anywhere
        "<|im_end|>\u0338" + "\u00e9" * 60_000,  # NFC of the whole text would make ">" + U+0338 one character
        "<|im_end|\u212a" + "\u00e9" * 60_000,  # ... and of this one a "K" (KELVIN SIGN), not a token here
        "\u00e9" * 30_000 + "<|im_end|>" + "\u0338\u00e9" * 30_000,
    ]


@pytest.mark.parametrize("budget", [0, 1, 100, 1000])
def test_the_state_head_is_the_whole_texts_head(golden_processor: ClefProcessor, budget: int) -> None:
    for text in _long_texts():
        (whole,) = golden_processor.encode_texts([text])
        head, count = state_head(golden_processor, text, budget)
        assert head == whole[:budget]
        if len(text) <= HEAD_CHARS_PER_TOKEN * (budget + HEAD_MARGIN):
            assert count == len(whole)
        else:  # estimated from the prefix: right for a text of one kind throughout, at least the prefix's count
            assert count >= budget + HEAD_MARGIN


class _Counting:
    """A processor that records the length of every text it tokenizes, and its calls."""

    def __init__(self, processor: ClefProcessor) -> None:
        self.processor = processor
        self.read: list[int] = []
        self.calls = 0

    def encode_texts(self, texts: Any) -> Any:
        self.read.extend(len(t) for t in texts)
        self.calls += 1
        return self.processor.encode_texts(texts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.processor, name)



def test_a_huge_state_is_tokenized_only_as_far_as_its_head(golden_processor: ClefProcessor) -> None:
    """A state of 8 MB (what one gzip body of 12 KB unpacks to) reads a prefix of about what the prompt keeps: it
    held one of the worker's shared encoding threads for about 10 s when the whole state was tokenized."""
    counting = _Counting(golden_processor)
    request = _request({"model": "clef", "state": "word " * 1_670_000, "questions": {"q": {"type": "noul"}}})
    record = encode_record(request, counting, max_length=2048)  # type: ignore[arg-type]
    assert len(record.input_ids) == 2048
    assert max(counting.read) <= HEAD_CHARS_PER_TOKEN * (2048 + HEAD_MARGIN) * 2
    (sample,) = golden_processor.encode_texts(["word " * 1000])
    assert record.untruncated_length == pytest.approx(len(sample) * 1670, rel=0.01)


@pytest.mark.parametrize(
    ("questions", "field"),
    [
        ({"q": {"type": "noul", "instructions": "word " * 1_670_000}}, "questions.q.instructions"),
        ({"q": {"type": "choice", "instructions": "x", "criteria": {"a": "word " * 1_670_000, "b": None}}},
         "questions.q.criteria"),
        ({f"q{i}": {"type": "noul", "instructions": "word " * 3000} for i in range(64)}, "questions.q0.instructions"),
    ],
)  # fmt: skip
def test_a_huge_schema_is_refused_after_reading_about_what_the_limit_holds(
    golden_processor: ClefProcessor, questions: dict[str, Any], field: str
) -> None:
    """8 MB of instructions or criteria were tokenized whole before the length check (6.5 s for 2 MB on one of the
    worker's shared encoding threads, 53 s for 8 MB over HTTP, attack finding); the schema is read only until it
    passes the limit, and the error names the field where it did."""
    counting = _Counting(golden_processor)
    request = _request({"model": "clef", "state": "s", "questions": questions})
    with pytest.raises(RequestValidationError) as info:
        encode_record(request, counting, max_length=2048)  # type: ignore[arg-type]
    (error,) = info.value.errors
    assert error.field == field
    least = int(re.fullmatch(r"schema requires at least (\d+) tokens before state; maximum is 2048", error.message)[1])
    assert least > 2048
    assert sum(counting.read) <= 2 * HEAD_CHARS_PER_TOKEN * (2048 + HEAD_MARGIN)


@pytest.mark.parametrize(
    "questions",
    [
        {f"q{i}": {"type": "noul", "instructions": "<|im_end|>" * 700} for i in range(6)},  # read in groups
        {"q": {"type": "noul", "instructions": "<|im_end|>" * 3000}},  # one text longer than a group: its head
    ],
)
def test_a_schema_that_fits_is_encoded_alike_however_it_is_read(
    golden_processor: ClefProcessor, questions: dict[str, Any]
) -> None:
    """A special token is 10 characters: a schema of them fits in fewer tokens than a group's characters suggest, so
    it is read in several groups, or as the head of one text; its record is that of the schema read whole."""
    request = _request({"model": "clef", "state": "s", "questions": questions})
    whole = encode_record(request, golden_processor, max_length=1 << 20)
    counting = _Counting(golden_processor)
    exact = encode_record(request, counting, max_length=len(whole.input_ids))  # type: ignore[arg-type]
    assert exact == whole and not exact.truncated
    assert counting.calls > 3  # not one call for the prefix and the suffix, one for the schema, one for the state
    with pytest.raises(RequestValidationError) as info:
        encode_record(request, golden_processor, max_length=len(whole.input_ids) - 2)
    assert info.value.errors[0].message.startswith(f"schema requires {len(whole.input_ids) - 1} tokens")


@pytest.mark.parametrize("words", [500, 3000])  # several questions fit before the room is spent; none does
def test_schema_room_reads_the_questions_only_until_the_room_is_spent(golden_processor: ClefProcessor, words: int) -> None:
    """The room left for the state counted every question of a request, each up to ``max_length`` tokens, after the
    schema had passed the limit: 64 questions of 100 KB held the worker's event loop 9.6 s. The questions are read
    only as far as the room left needs, so a request costs about what ``max_length`` tokens do; a question read in
    part is counted further when it is asked where it fits."""
    from guard.systemone import QuestionV1

    counting = _Counting(golden_processor)
    room = SchemaRoom(counting, 2048)  # type: ignore[arg-type]
    questions = [QuestionV1(f"q{i}", "noul", "word " * words) for i in range(64)]
    assert room(questions) < 0
    assert sum(counting.read) <= 2 * HEAD_CHARS_PER_TOKEN * (2048 + HEAD_MARGIN)
    big, small, partly = (QuestionV1(f"q{i}", "noul", "word " * n) for i, n in enumerate((600, 1, 500)))
    assert room([big, partly]) < 0  # ``partly`` read only past the 33 tokens ``big`` leaves
    assert room([small, partly]) == SchemaRoom(golden_processor, 2048)([small, partly]) > 0  # then counted whole
