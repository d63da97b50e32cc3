"""Record encoding: System One request -> token ids, question and option spans, and collated batches.

Implements the Clef runtime spec §2 (reference behaviour):

* §2.1 :func:`render`: strings raw, everything else as Python's compact, key-sorted, non-ASCII ``json.dumps``.
* §2.2 option lists come from :meth:`guard.systemone.QuestionV1.options` (prompt order).
* §2.3 the prompt constants below, byte for byte, each piece tokenized on its own.
* §2.4 spans are half-open token ranges into the final ``input_ids``.
* §2.5 head-of-state truncation to ``max_length``; only the state is ever cut.
* §2.6 :func:`collate`: right padding, media tensors concatenated, ``mm_token_type_ids`` scattered.

Token sequence: ``prefix ‖ media ‖ state ‖ schema ‖ suffix``.
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from guard.clef.processor import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, ClefProcessor, EncodedMedia
from guard.errors import FieldError, RequestValidationError
from guard.systemone import QuestionV1, SystemOneRequestV1

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "FIELD_END",
    "IMAGE_PLACEHOLDER",
    "OPTIONS_HEADER",
    "OPTION_END",
    "PREFIX",
    "QUESTION_TYPE_IDS",
    "SCHEMA_HEADER",
    "SCHEMA_ROOM_ENTRIES",
    "SUFFIX",
    "SYSTEM_PROMPT",
    "VIDEO_PLACEHOLDER",
    "EncodedMedia",
    "EncodedQuestion",
    "EncodedRecord",
    "SchemaRoom",
    "collate",
    "encode_record",
    "field_header",
    "option_label",
    "question_texts",
    "render",
]

#: Longest prompt the reference builds by default; the head was trained at 16k (§2.5).
DEFAULT_MAX_LENGTH = 16384

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. "
    "Each answer must be exactly one of that field's allowed options."
)
PREFIX = "<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
OPTIONS_HEADER = "\nALLOWED OPTIONS:\n"
OPTION_END = "\n"
FIELD_END = "END FIELD\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"

#: Head type ids (row of ``type_embedding``): 0 noul, 1 choice, 2 score (§1.5).
QUESTION_TYPE_IDS = {"noul": 0, "choice": 1, "score": 2}


def field_header(index: int, question_id: str, question_type: str) -> str:
    """``FIELD_HEADER(i, id, type)`` of §2.3; ``index`` is 1-based."""
    return "\nFIELD " + str(index) + "\nID: " + question_id + "\nTYPE: " + question_type + "\nINSTRUCTION: "


def option_label(index: int) -> str:
    """``OPTION_LABEL(k)`` of §2.3; ``index`` is 1-based."""
    return "OPTION " + str(index) + ": "


def render(value: Any) -> str:
    """Render a JSON value for the prompt (§2.1).

    A ``str`` is returned unchanged; anything else is ``json.dumps(value, ensure_ascii=False, separators=(",", ":"),
    sort_keys=True)`` (Python float repr such as ``1e-05``/``-0.0``, ``NaN`` accepted).
    """
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


@dataclass(frozen=True)
class EncodedQuestion:
    """Where one question sits in ``input_ids`` (§2.4).

    Attributes:
        question_id: the question id (raw request key).
        question_type: 0 noul, 1 choice, 2 score.
        question_span: half-open ``[start, end)`` of the rendered instructions piece.
        option_spans: half-open spans of each rendered option object, in prompt order.
        option_ids: option ids in prompt order (noul ``true, false``; choice sorted; score ``"0".."n-1"``).
    """

    question_id: str
    question_type: int
    question_span: tuple[int, int]
    option_spans: tuple[tuple[int, int], ...]
    option_ids: tuple[str, ...]


@dataclass(frozen=True)
class EncodedRecord:
    """One encoded request (§2.4).

    Attributes:
        input_ids: the full prompt, length L <= ``max_length``.
        questions: one entry per question, in request order.
        record_id: caller-chosen label (the reference reads ``record["id"]``; default ``"unknown"``).
        media: the media block, or ``None`` for a text-only record.
        untruncated_length: the prompt length before the state was cut (== ``len(input_ids)`` when nothing was cut).
    """

    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    record_id: str = "unknown"
    media: EncodedMedia | None = None
    untruncated_length: int = 0

    @property
    def truncated(self) -> bool:
        """Whether the tail of the state was dropped to fit ``max_length``."""
        return self.untruncated_length > len(self.input_ids)

    @property
    def media_bytes(self) -> int:
        """Bytes its media tensors hold (``pixel_values`` and the grids; 0 for a text-only record)."""
        if self.media is None:
            return 0
        return sum(t.element_size() * t.nelement() for t in self.media.tensors.values())


def _schema_texts(
    questions: tuple[QuestionV1, ...],
) -> tuple[list[str], list[tuple[int, int, int]], dict[int, str]]:
    """The schema's pieces in order, which piece is which span, and which request field each caller text comes from.

    Returns:
        ``(texts, marks, fields)``; ``marks[p] = (piece_index, question_index, option_index)`` for every span piece,
        with ``option_index = -1`` for the question span; ``fields[piece_index]`` is ``questions.<id>`` (the field
        header, which holds the id), ``questions.<id>.instructions`` or ``questions.<id>.criteria``.
    """
    texts = [SCHEMA_HEADER]
    marks: list[tuple[int, int, int]] = []
    fields: dict[int, str] = {}
    for qi, question in enumerate(questions):
        start, own = len(texts), question_texts(qi, question)
        path = f"questions.{question.id}"
        fields[start] = path
        marks.append((start + 1, qi, -1))
        fields[start + 1] = f"{path}.instructions"
        for k in range((len(own) - 4) // 3):  # header, instructions, options header, 3 per option, field end
            marks.append((start + 4 + 3 * k, qi, k))  # the option's object, after its label
            fields[start + 4 + 3 * k] = f"{path}.criteria"
        texts.extend(own)
    return texts, marks, fields


def question_texts(index: int, question: QuestionV1) -> list[str]:
    """The schema pieces of ``question`` asked at ``index`` (0-based) in a request (§2.3), each tokenized on its own:
    its field header, instructions, the options header, each option's label, object and end, and the field's end."""
    texts = [field_header(index + 1, question.id, question.type), render(question.instruction_value()), OPTIONS_HEADER]
    for k, (option_id, description) in enumerate(question.options()):
        option: dict[str, Any] = {"option_id": option_id}
        if description is not None:
            option["description"] = description
        texts.extend((option_label(k + 1), render(option), OPTION_END))
    texts.append(FIELD_END)
    return texts


def _refuse_media_pads(processor: ClefProcessor, pieces: list[tuple[str, list[int]]]) -> None:
    """Refuse caller text that holds an image or video pad id in a request with media.

    The tokenizer reads ``<|image_pad|>`` in the text as the pad token itself (§2.3, as the reference does), and the
    backbone fills every pad with one row of media features: extra pads make the counts differ and the pass fails
    (in the reference too). ``pieces`` are ``(field, ids)``; the error names each field once.

    Raises:
        RequestValidationError: naming every field whose ids hold a pad.
    """
    pads = processor.media_pad_ids
    found: dict[str, set[int]] = {}
    for where, ids in pieces:
        found.setdefault(where, set()).update(pads.intersection(ids))
    errors = [
        FieldError(
            where,
            f"holds {', '.join(processor.tokenizer.convert_ids_to_tokens(sorted(ids)))}: the model fills that token "
            "with image or video features, so a request with images cannot carry it in its text",
        )
        for where, ids in found.items()
        if ids
    ]
    if errors:
        raise RequestValidationError(errors)


#: A UTF-16 surrogate code point (U+D800-U+DFFF), which is not text: the tokenizer refuses a string holding one.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_surrogates(texts: Sequence[tuple[str, str]]) -> None:
    """Refuse caller text holding a lone surrogate (a request built in Python; JSON bodies are refused before), once
    the tokenizer refused a text (``TypeError``, or ``UnicodeEncodeError`` from its normalizer): searched only then,
    so text that tokenizes costs nothing more. ``texts`` are ``(field, text)``; the error names each field once.

    Raises:
        RequestValidationError: naming every field whose text holds a surrogate; nothing when none does.
    """
    fields = dict.fromkeys(where for where, text in texts if _SURROGATE.search(text))
    if fields:
        message = "holds a lone UTF-16 surrogate (U+D800-U+DFFF), which is not text and cannot be tokenized"
        raise RequestValidationError([FieldError(where, message) for where in fields])


#: A state is tokenized whole only up to this many characters per token it can keep (plus :data:`HEAD_MARGIN`);
#: past that, only a prefix of it, long enough for the kept head (:func:`state_head`).
HEAD_CHARS_PER_TOKEN = 8
#: Tokens a prefix must hold past the kept head before its cut is trusted not to reach the head.
HEAD_MARGIN = 256


def _ascii_cut(text: str, size: int) -> int | None:
    """The largest cut at most ``size`` that falls before an ASCII character, looking back at most 4,096 characters
    (``None`` when none is there). No character composes with, or reorders past, an ASCII character that follows
    it, so Unicode normalization never reaches across such a cut: the text before it normalizes as it does inside
    the whole text."""
    for cut in range(min(size, len(text) - 1), max(size - 4096, 0), -1):
        if text[cut].isascii():
            return cut
    return None


def state_head(processor: ClefProcessor, text: str, budget: int) -> tuple[list[int], int]:
    """The first ``budget`` token ids of ``text`` and its token count, tokenizing no more of it than the head needs.

    A text of at most ``HEAD_CHARS_PER_TOKEN * (budget + HEAD_MARGIN)`` characters is tokenized whole (the count is
    exact). A longer one is tokenized from a prefix of about that many characters, doubled until the prefix holds
    ``budget + HEAD_MARGIN`` tokens or reaches the end: the cut changes only the tokens at its end (pre-tokens split
    the text, and the margin is far longer than one), so the head's ids are those of the whole text, while an 8 MB
    state costs what its head does rather than seconds of a shared encoding thread. The cut falls before an ASCII
    character (:func:`_ascii_cut`), because the tokenizer normalizes first and NFC can change a character before a
    cut from combining marks far past it; where no ASCII character is near, the text is normalized as the tokenizer
    would (``processor.normalized``, about 0.3 s for 8 MB) and cut anywhere, or, for a normalizer a cut could
    change, tokenized whole. The count is then an estimate, the prefix's tokens scaled by the text's length in
    characters (never below the prefix's own).
    """
    size = HEAD_CHARS_PER_TOKEN * (budget + HEAD_MARGIN)
    source: str | None = text
    anywhere = False  # True once ``source`` is the normalized text, which may be cut anywhere
    while source is not None and size < len(source):
        cut = size if anywhere else _ascii_cut(source, size)
        if cut is None:
            source, anywhere = processor.normalized(text), True
            continue
        (ids,) = processor.encode_texts([source[:cut]])
        if len(ids) >= budget + HEAD_MARGIN:
            return ids[:budget], max(len(ids), round(len(ids) * len(source) / cut))
        size *= 2
    (ids,) = processor.encode_texts([text])
    return ids[:budget], len(ids)


def schema_ids(processor: ClefProcessor, texts: list[str], budget: int) -> tuple[list[list[int]], bool]:
    """The token ids of each schema text (each tokenized on its own, §2.3), tokenizing no more of them than it takes
    to see whether they fit in ``budget`` tokens.

    The texts are tokenized in order, in groups of at most ``HEAD_CHARS_PER_TOKEN * (budget + HEAD_MARGIN)``
    characters (a usual schema is one group, one call), until every text is done or they hold more than ``budget``
    tokens; a text longer than a group on its own is tokenized only as far as the tokens left need
    (:func:`state_head`). So megabytes of instructions or criteria cost what one group does, not the time of
    tokenizing them whole on a shared encoding thread (``docs/worker.md``).

    Returns:
        ``(pieces, complete)``: ``complete`` when every text was tokenized whole, one id list per text (their total may
        still pass ``budget`` when the last group passed it); otherwise the texts stopped past ``budget``: ``pieces``
        holds the lists so far, the last possibly a text's head only, each a prefix of that text's ids, so their total
        is a lower bound of the schema's tokens.
    """
    window = HEAD_CHARS_PER_TOKEN * (max(budget, 0) + HEAD_MARGIN)
    pieces: list[list[int]] = []
    count = 0
    while len(pieces) < len(texts):
        if pieces and count > budget:
            return pieces, False
        first = len(pieces)
        if len(texts[first]) > window:  # one long text: its head, as far as the tokens left need (and one past them)
            ids, total = state_head(processor, texts[first], max(budget - count, 0) + 1)
            pieces.append(ids)
            count += total
            if total > len(ids):
                return pieces, False
            continue
        end, size = first, 0
        while end < len(texts) and size + len(texts[end]) <= window:
            size += len(texts[end])
            end += 1
        group = processor.encode_texts(texts[first:end])
        pieces.extend(group)
        count += sum(map(len, group))
    return pieces, True


#: Questions (and, apart, question texts) a :class:`SchemaRoom` remembers the tokens of before it starts over.
SCHEMA_ROOM_ENTRIES = 4096


class SchemaRoom:
    """The tokens a text-only request leaves its state within ``max_length``, from its questions alone: the most of a
    state :func:`encode_record` keeps, ``max_length`` less the prompt's fixed text (prefix, schema header, suffix) and
    each question's schema pieces. Each piece is tokenized on its own (§2.3), so a question's tokens depend only on it
    and its place in the request: they are counted once and remembered per question object and place, and per
    digest of its pieces (a reloaded policy's equal question is not tokenized again), at most
    :data:`SCHEMA_ROOM_ENTRIES` of each, so asking again about questions seen before tokenizes nothing. A question is
    tokenized only as far as the room left needs, and none after the room is spent, so a request's questions cost at
    most what ``max_length`` tokens do, however many and long they are; a question read only in part is remembered
    as more than that room (a lower bound), and counted further when asked where more room is left.

    Threading: any thread may call it; each dict operation is atomic, and a count lost to a concurrent clear is made
    again.
    """

    def __init__(self, processor: ClefProcessor, max_length: int) -> None:
        self.processor = processor
        self.max_length = max_length
        self._fixed: int | None = None
        # id(question) -> (a weak reference to it, its place -> (its tokens there, whether counted whole)): a new
        # object under a reused id is not the one referenced, so it is counted anew
        self._questions: dict[int, tuple[weakref.ref[QuestionV1], dict[int, tuple[int, bool]]]] = {}
        self._texts: dict[bytes, tuple[int, bool]] = {}  # digest of a question's pieces -> their tokens, whole

    def __call__(self, questions: Sequence[QuestionV1]) -> int:
        """Tokens left for the state of a request asking ``questions`` in this order; below 0 when the schema alone
        does not fit (then a bound only: the questions are tokenized only as far as the room left needs)."""
        if self._fixed is None:
            self._fixed = sum(map(len, self.processor.encode_texts([PREFIX, SCHEMA_HEADER, SUFFIX])))
        room = self.max_length - self._fixed
        for index, question in enumerate(questions):
            if room < 0:
                break
            held = self._questions.get(id(question))
            if held is None or held[0]() is not question:
                if len(self._questions) >= SCHEMA_ROOM_ENTRIES:
                    self._questions.clear()
                held = self._questions[id(question)] = (weakref.ref(question), {})
            count = held[1].get(index)
            if not _enough(count, room):
                count = held[1][index] = self._count(question_texts(index, question), room)
            room -= count[0]
        return room

    def _count(self, texts: list[str], budget: int) -> tuple[int, bool]:
        """The tokens of a question's pieces ``texts`` and whether they were counted whole: tokenized only until they
        pass ``budget`` (then more than ``budget``, a lower bound)."""
        digest = hashlib.sha256()
        for text in texts:  # each piece's length first: pieces split differently are another question
            data = text.encode("utf-8", "surrogatepass")
            digest.update(len(data).to_bytes(8, "big") + data)
        key = digest.digest()
        count = self._texts.get(key)
        if not _enough(count, budget):
            pieces, complete = schema_ids(self.processor, texts, budget)
            count = (sum(map(len, pieces)), complete)
            if len(self._texts) >= SCHEMA_ROOM_ENTRIES:
                self._texts.clear()
            self._texts[key] = count
        return count


def _enough(count: tuple[int, bool] | None, budget: int) -> bool:
    """Whether a remembered ``(tokens, whole)`` count answers for ``budget``: it is exact, or a lower bound past it."""
    return count is not None and (count[1] or count[0] > budget)


def _field_past(pieces: list[list[int]], fields: dict[int, str], budget: int) -> str:
    """The request field of the schema piece that takes the running token count past ``budget`` (``questions`` for
    the fixed text between fields)."""
    total = 0
    for index, ids in enumerate(pieces):
        total += len(ids)
        if total > budget:
            return fields.get(index, "questions")
    return "questions"


def encode_record(
    request: SystemOneRequestV1,
    processor: ClefProcessor,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    max_state_tokens: int | None = None,
    record_id: str = "unknown",
    media_kwargs: dict[str, Any] | None = None,
) -> EncodedRecord:
    """Encode one request into token ids and spans (§2.3-§2.5). CPU only; no model forward.

    Args:
        request: a validated request (any validation profile).
        processor: the checkpoint's tokenizer/media processor.
        max_length: longest prompt allowed; the head of the state is kept, the tail dropped (the state is tokenized
            only as far as the head needs, :func:`state_head`, so the record's ``untruncated_length`` is an estimate
            for a state far longer than the prompt).
        max_state_tokens: optional cap on state tokens, applied first.
        record_id: label kept on the record.
        media_kwargs: extra keyword arguments for the media processor.

    Returns:
        The encoded record; ``len(input_ids) <= max_length``.

    Raises:
        RequestValidationError: (a ``ValueError``) with field ``questions`` and the reference message
            ``schema requires N tokens before state; maximum is M`` when everything but the state exceeds
            ``max_length``; when the schema alone is so long that it was tokenized only in part (:func:`schema_ids`),
            ``schema requires at least N tokens before state; maximum is M`` with the field where it passed the limit
            (``questions.<id>.instructions``, ``questions.<id>.criteria``); with field ``questions`` when there are no
            questions; with field
            ``questions.<id>.instructions`` when a question span would be empty (id ``""`` and no instructions: the
            reference would return NaN); for a request with media, naming ``state`` or the question field whose
            text holds an image or video pad token (:func:`_refuse_media_pads`), or ``images`` when the images'
            tokens, counted from their headers before any is decoded, leave the schema no room; naming ``state``
            or the question field whose text holds a lone surrogate (:func:`_refuse_surrogates`); media errors from
            the processor.
    """
    if not request.questions:
        raise RequestValidationError([FieldError("questions", "at least one question is required")])
    schema_texts, marks, fields = _schema_texts(request.questions)
    prefix_ids, suffix_ids = processor.encode_texts([PREFIX, SUFFIX])
    schema_budget = max_length - len(prefix_ids) - len(suffix_ids)
    try:
        schema_pieces, complete = schema_ids(processor, schema_texts, schema_budget)
    except (TypeError, UnicodeEncodeError):
        _refuse_surrogates([(where, schema_texts[piece]) for piece, where in fields.items()])
        raise
    if not complete:
        least = len(prefix_ids) + sum(map(len, schema_pieces)) + len(suffix_ids)
        message = f"schema requires at least {least} tokens before state; maximum is {max_length}"
        raise RequestValidationError([FieldError(_field_past(schema_pieces, fields, schema_budget), message)])
    for piece, qi, k in marks:
        if k < 0 and not schema_pieces[piece]:  # the head would average zero rows (NaN), §2.4 degenerate case
            qid = request.questions[qi].id
            message = "renders to no tokens; give non-empty instructions or a non-empty question id"
            raise RequestValidationError([FieldError(f"questions.{qid}.instructions", message)])
    media = None
    media_ids: tuple[int, ...] = ()
    if request.images or request.videos:
        _refuse_media_pads(processor, [(where, schema_pieces[p]) for p, where in fields.items()])
        media = processor.encode_media(
            request.images, request.videos, token_offset=len(prefix_ids), media_kwargs=media_kwargs,
            max_tokens=schema_budget - sum(map(len, schema_pieces)),
        )
        media_ids = media.input_ids
    fixed = len(prefix_ids) + len(media_ids) + sum(map(len, schema_pieces)) + len(suffix_ids)
    if fixed > max_length:
        message = f"schema requires {fixed} tokens before state; maximum is {max_length}"
        raise RequestValidationError([FieldError("questions", message)])
    budget = max_length - fixed if max_state_tokens is None else min(max_state_tokens, max_length - fixed)
    state = render(request.state)
    try:
        state_ids, state_count = state_head(processor, state, budget)
    except (TypeError, UnicodeEncodeError):
        _refuse_surrogates([("state", state)])
        raise
    if media is not None:
        _refuse_media_pads(processor, [("state", state_ids)])
    untruncated = fixed + state_count

    # Piece start offsets inside the schema, then shifted past prefix, media and (truncated) state (§2.4).
    shift = len(prefix_ids) + len(media_ids) + len(state_ids)
    starts = [shift]
    for piece in schema_pieces:
        starts.append(starts[-1] + len(piece))
    spans: dict[tuple[int, int], tuple[int, int]] = {(qi, k): (starts[p], starts[p + 1]) for p, qi, k in marks}
    questions = tuple(
        EncodedQuestion(
            question_id=q.id,
            question_type=QUESTION_TYPE_IDS[q.type],
            question_span=spans[(qi, -1)],
            option_spans=tuple(spans[(qi, k)] for k in range(len(q.options()))),
            option_ids=tuple(option_id for option_id, _ in q.options()),
        )
        for qi, q in enumerate(request.questions)
    )
    input_ids = (*prefix_ids, *media_ids, *state_ids, *(t for piece in schema_pieces for t in piece), *suffix_ids)
    if not input_ids:  # pragma: no cover - the constant prefix always tokenizes to something
        raise ValueError("record encodes to no tokens")
    return EncodedRecord(
        input_ids=input_ids, questions=questions, record_id=record_id, media=media, untruncated_length=untruncated
    )


def collate(records: list[EncodedRecord], pad_token_id: int, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Right-pad records into one batch (§2.6).

    Args:
        records: encoded records (B >= 1).
        pad_token_id: the tokenizer's pad id (``<|endoftext|>``).
        device: where the tensors go.

    Returns:
        ``input_ids`` [B, T] int64 and ``attention_mask`` [B, T] int64 (1 real, 0 pad); when any record has media,
        also ``mm_token_type_ids`` [B, T] int64 (zeros with each record's types at its ``token_offset``) and the media
        tensors concatenated along dim 0 in record order (``pixel_values``, ``image_grid_thw``, ...).

    Raises:
        ValueError: for an empty list.
    """
    if not records:
        raise ValueError("collate needs at least one record")
    width = max(len(r.input_ids) for r in records)
    input_ids = torch.full((len(records), width), pad_token_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(records), width), dtype=torch.long)  # [B, T]
    for b, record in enumerate(records):
        input_ids[b, : len(record.input_ids)] = torch.tensor(record.input_ids, dtype=torch.long)
        attention_mask[b, : len(record.input_ids)] = 1
    batch: dict[str, Any] = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    media_records = [r for r in records if r.media is not None]
    if media_records:
        types = torch.zeros((len(records), width), dtype=torch.long)  # [B, T]
        tensors: dict[str, list[torch.Tensor]] = {}
        for b, record in enumerate(records):
            if record.media is None:
                continue
            offset = record.media.token_offset
            types[b, offset : offset + len(record.media.mm_token_type_ids)] = torch.tensor(
                record.media.mm_token_type_ids, dtype=torch.long
            )
            for name, tensor in record.media.tensors.items():
                tensors.setdefault(name, []).append(tensor)
        batch["mm_token_type_ids"] = types.to(device)
        for name, parts in tensors.items():
            batch[name] = torch.cat(parts, dim=0).to(device)
    return batch
