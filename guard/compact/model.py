"""The compact decision model: frozen MiniLM encoder + a head from Clef's parts, answering System One requests.

A checkpoint directory holds (release layout, ``shared/design/clef-runtime.md`` §1.2):

* ``joint_head_config.json``: the head sizes (:class:`~guard.clef.head.JointHeadConfig`, ``hidden_size`` 384);
* ``joint_head.safetensors``: the head weights (bf16 on disk, run in float32);
* ``compact_config.json``: ``format``, ``kind`` (``catalog`` = :class:`~guard.compact.head.CompactHead` answering
  catalog questions, ``router`` = :class:`~guard.compact.router.RouterHead` answering one ``choice`` question over
  fixed labels), the reference to the encoder (name, package, windows), and per question its canonical wording,
  options and calibration temperature.

The encoder runs in bf16 where the CPU supports it (:func:`~guard.compact.encoder.default_dtype`), else float32.
Probabilities are ``softmax(logits / T)`` per question with the question's fitted temperature ``T``, read out by
:func:`guard.systemone.answer_question`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from guard.clef.encoding import render
from guard.clef.head import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE, JointHeadConfig
from guard.compact._batch import QuestionEncoding, collate, option_texts, question_text, type_id
from guard.compact.catalog import CATALOG
from guard.compact.encoder import ENCODER_NAME, ENCODER_PACKAGE, EncodedText, EncoderConfig, TextEncoder
from guard.compact.head import CompactHead, pool_rows
from guard.compact.router import RouterHead
from guard.systemone import (
    AnswerV1,
    ConfidenceProfile,
    QuestionType,
    QuestionV1,
    SystemOneRequestV1,
    SystemOneResponseV1,
    UsageV1,
    answer_question,
)

__all__ = [
    "COMPACT_CONFIG_FILE",
    "FORMAT",
    "MODEL_NAME",
    "CompactModel",
    "CompactResponseV1",
    "CompactUsageV1",
    "ModelQuestion",
]

COMPACT_CONFIG_FILE = "compact_config.json"
FORMAT = "guard-compact/1"
#: The ``model`` of every compact response: the model that answered, not the name the request asked for (a
#: policy's default ``clef-flash`` would otherwise be recorded for answers Clef never gave).
MODEL_NAME = "guard-compact"
_QUESTION_CACHE = 256
#: Default run length of state token states mean-pooled into one memory row (see ``guard/compact/head.py``).
DEFAULT_MEMORY_POOL = 8


@dataclass(frozen=True)
class ModelQuestion:
    """A question a checkpoint answers.

    Attributes:
        id: the question id.
        type: its type.
        instructions: canonical wording.
        criteria: canonical options (``None`` for noul; level list for score; label descriptions for a router).
        temperature: calibration temperature (logits are divided by it).
        labels: a router's labels in prompt (sorted) order.
        label_bias: logit offsets by option id, added before the temperature (a router's out-of-scope bias, fitted
            by :func:`guard.compact.train.fit_outside_bias`).
    """

    id: str
    type: QuestionType
    instructions: str
    criteria: Any = None
    temperature: float = 1.0
    labels: tuple[str, ...] = ()
    label_bias: dict[str, float] = field(default_factory=dict)

    def to_question(self) -> QuestionV1:
        return QuestionV1(self.id, self.type, self.instructions, self.criteria)

    def mismatch(self, question: QuestionV1, *, accept_paraphrases: bool) -> str | None:
        """``None`` when this checkpoint can answer ``question`` as calibrated, else why not."""
        if question.type != self.type:
            return f"its type is {question.type!r} but the model answers it as {self.type!r}"
        if self.labels:
            asked, trained = set(question.option_ids()), set(self.labels)
            if asked != trained:
                return _label_mismatch(sorted(asked - trained), sorted(trained - asked), len(trained))
            if not accept_paraphrases and question.instructions not in (None, "", self.id, self.instructions):
                return "its instructions differ from the trained wording"
            return None
        entry = CATALOG.get(self.id)
        if entry is not None:
            reason = entry.matches(question)
            if reason and accept_paraphrases and question.type == entry.type:
                return None if len(question.options()) == len(entry.to_question().options()) else reason
            return reason
        return None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type, "instructions": self.instructions, "criteria": self.criteria,
                                "temperature": self.temperature}
        if self.labels:
            body["labels"] = list(self.labels)
        if self.label_bias:
            body["label_bias"] = dict(self.label_bias)
        return body


@dataclass(frozen=True)
class CompactUsageV1(UsageV1):
    """Usage of one compact answer. ``input_tokens`` counts every encoded token (state windows incl. ``[CLS]``/
    ``[SEP]``, question and option texts); ``state_tokens`` the state's word pieces; ``state_tokens_dropped`` those
    cut from the middle of a state longer than the encoder's ``max_tokens`` (0 unless something was cut);
    ``windows`` the encoder windows the state took."""

    state_tokens: int = 0
    state_tokens_dropped: int = 0
    windows: int = 0


@dataclass(frozen=True)
class CompactResponseV1(SystemOneResponseV1):
    """A System One response whose wire ``usage`` also reports ``state_tokens``, ``windows`` and, when anything
    was cut, ``state_tokens_dropped``."""

    usage: CompactUsageV1 = field(default_factory=lambda: CompactUsageV1(0))

    def to_json(self, decimals: int = 4) -> dict[str, Any]:
        body = super().to_json(decimals)
        body["usage"]["state_tokens"] = self.usage.state_tokens
        body["usage"]["windows"] = self.usage.windows
        if self.usage.state_tokens_dropped:
            body["usage"]["state_tokens_dropped"] = self.usage.state_tokens_dropped
        return body


class CompactModel:
    """Encoder + head + the questions they answer.

    Args:
        encoder: the loaded text encoder.
        head: a :class:`CompactHead` (``kind="catalog"``) or :class:`RouterHead` (``kind="router"``), float32.
        questions: the answerable questions by id.
        kind: ``"catalog"`` or ``"router"``.
        meta: free-form training metadata kept in ``compact_config.json``.
        memory_pool: state token states mean-pooled per memory row.
    """

    def __init__(
        self,
        encoder: TextEncoder,
        head: CompactHead | RouterHead,
        questions: dict[str, ModelQuestion],
        *,
        kind: str,
        meta: dict[str, Any] | None = None,
        memory_pool: int = DEFAULT_MEMORY_POOL,
    ) -> None:
        if memory_pool < 1:
            raise ValueError(f"memory_pool must be at least 1, got {memory_pool}")
        self.memory_pool = memory_pool
        if kind not in ("catalog", "router"):
            raise ValueError(f"kind must be 'catalog' or 'router', got {kind!r}")
        self.encoder = encoder
        self.head = head.eval()
        self.questions = dict(questions)
        self.kind = kind
        self.meta = dict(meta or {})
        self._question_cache: OrderedDict[tuple[str, ...], QuestionEncoding] = OrderedDict()

    # ---------------------------------------------------------------------------------------------------- encoding
    def encode_states(self, states: Sequence[Any]) -> list[EncodedText]:
        """Encode request states (rendered as in Clef §2.1) in overlapping windows."""
        return self.encoder.encode([render(state) for state in states])

    def encode_question(self, question: QuestionV1) -> QuestionEncoding:
        """Encode a question's wording and options (LRU-cached by their texts)."""
        texts = [question_text(question), *option_texts(question)]
        key = (question.type, *texts)
        cached = self._question_cache.get(key)
        if cached is not None:
            self._question_cache.move_to_end(key)
            return cached
        encoded = self.encoder.encode(texts)
        embedding = self.encoder.word_embeddings
        with torch.inference_mode():
            lexical = torch.stack([embedding[e.token_ids].float().mean(0) for e in encoded[1:]])
        result = QuestionEncoding(
            type_id=type_id(question),
            tokens=encoded[0].states.float(),
            options=tuple(e.states.float() for e in encoded[1:]),
            lexical=lexical,
            option_ids=tuple(option_id for option_id, _ in question.options()),
        )
        self._question_cache[key] = result
        while len(self._question_cache) > _QUESTION_CACHE:
            self._question_cache.popitem(last=False)
        return result

    # ----------------------------------------------------------------------------------------------------- scoring
    def logits(self, states: Sequence[EncodedText], questions: Sequence[Sequence[QuestionV1]]) -> list[list[torch.Tensor]]:
        """Uncalibrated logits per record, per question, in prompt option order (float32 1-D tensors).

        A catalog head scores each question of a record in its own row of the batch (the record's state memory
        shared, one question per row): the head was trained and calibrated on one question at a time, so an answer
        never depends on which other questions a request asks with it.
        """
        rows = [pool_rows(s.states.float(), self.memory_pool) for s in states]
        with torch.inference_mode():
            if isinstance(self.head, RouterHead):
                width = max(r.shape[0] for r in rows)
                state = torch.zeros(len(rows), width, rows[0].shape[-1])
                mask = torch.zeros(len(rows), width, dtype=torch.bool)
                for b, r in enumerate(rows):
                    state[b, : r.shape[0]] = r
                    mask[b, : r.shape[0]] = True
                out = self.head(state, mask)
                return [[out[b] for _ in qs] for b, qs in enumerate(questions)]
            pairs = [(b, self.encode_question(self.canonical(q))) for b, qs in enumerate(questions) for q in qs]
            inputs = collate([rows[b] for b, _ in pairs], [[enc] for _, enc in pairs], torch.float32, self.memory_pool)
            out = self.head.forward_batch(inputs)  # (B*Q, 1, K): one question per row
        per_record: list[list[torch.Tensor]] = [[] for _ in questions]
        for row, (b, enc) in enumerate(pairs):
            per_record[b].append(out[row, 0, : len(enc.options)])
        return per_record

    def canonical(self, question: QuestionV1) -> QuestionV1:
        """``question`` with its trained wording when it gives none (instructions missing, empty or the bare id)."""
        known = self.questions.get(question.id)
        if known is None or question.instructions not in (None, "", question.id):
            return question
        return QuestionV1(question.id, question.type, known.instructions, question.criteria)

    def probabilities(self, question: QuestionV1, logits: torch.Tensor) -> list[float]:
        """Calibrated probabilities in prompt order: ``softmax(logits / T)`` with the question's temperature."""
        known = self.questions.get(question.id)
        if known is None:
            return torch.softmax(logits.double(), dim=-1).tolist()
        values = logits.double()
        if known.label_bias:
            ids = [option_id for option_id, _ in question.options()]
            values = values + torch.tensor([known.label_bias.get(i, 0.0) for i in ids], dtype=torch.float64)
        return torch.softmax(values / known.temperature, dim=-1).tolist()

    def answer(
        self, request: SystemOneRequestV1, *, confidence_profile: ConfidenceProfile = "reference"
    ) -> CompactResponseV1:
        """Answer every question of ``request`` (callers check support first, see the backend)."""
        (state,) = self.encode_states([request.state])
        (logits,) = self.logits([state], [list(request.questions)])
        answers: dict[str, AnswerV1] = {}
        question_tokens = 0
        for question, values in zip(request.questions, logits, strict=True):
            answers[question.id] = answer_question(
                question, self.probabilities(question, values), confidence_profile=confidence_profile
            )
            if self.kind == "catalog":
                encoding = self.encode_question(self.canonical(question))
                question_tokens += encoding.tokens.shape[0] + sum(o.shape[0] for o in encoding.options)
        usage = CompactUsageV1(
            input_tokens=state.tokens - state.dropped + 2 * state.windows + question_tokens,
            state_tokens=state.tokens,
            state_tokens_dropped=state.dropped,
            windows=state.windows,
        )
        return CompactResponseV1(model=MODEL_NAME, answers=answers, usage=usage)

    # ---------------------------------------------------------------------------------------------------- save/load
    def save(self, path: str | Path) -> Path:
        """Write the checkpoint directory (head weights in bf16)."""
        from safetensors.torch import save_file

        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        config: JointHeadConfig = self.head.config
        (root / HEAD_CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")
        tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.head.state_dict().items()}
        save_file(tensors, str(root / HEAD_WEIGHTS_FILE))
        body = {
            "format": FORMAT,
            "kind": self.kind,
            "encoder": {"name": ENCODER_NAME, "package": ENCODER_PACKAGE, **self.encoder.config.to_json()},
            "memory_pool": self.memory_pool,
            "questions": {qid: q.to_json() for qid, q in self.questions.items()},
            "meta": self.meta,
        }
        (root / COMPACT_CONFIG_FILE).write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        return root

    @classmethod
    def load(
        cls, path: str | Path, *, encoder: TextEncoder | None = None, dtype: torch.dtype | None = None
    ) -> CompactModel:
        """Load a checkpoint directory written by :meth:`save`.

        Args:
            path: the directory.
            encoder: reuse an already loaded encoder (its window settings must match); else one is loaded.
            dtype: encoder dtype; default :func:`~guard.compact.encoder.default_dtype`.

        Raises:
            ValueError: an unknown format or kind, or an encoder other than all-MiniLM-L6-v2.
            FileNotFoundError: a missing file.
        """
        from safetensors.torch import load_file

        root = Path(path)
        body = json.loads((root / COMPACT_CONFIG_FILE).read_text(encoding="utf-8"))
        if body.get("format") != FORMAT:
            raise ValueError(f"{root / COMPACT_CONFIG_FILE} has format {body.get('format')!r}; expected {FORMAT!r}")
        spec = body["encoder"]
        if spec.get("name") != ENCODER_NAME:
            raise ValueError(f"checkpoint encoder is {spec.get('name')!r}; only {ENCODER_NAME!r} is supported")
        config = EncoderConfig(window=spec["window"], overlap=spec["overlap"], max_tokens=spec["max_tokens"])
        if encoder is None or encoder.config != config:
            encoder = TextEncoder.load(config, dtype=dtype) if encoder is None else TextEncoder(
                encoder.model, encoder.tokenizer, config, encoder.dtype)
        questions = {
            qid: ModelQuestion(id=qid, type=q["type"], instructions=q["instructions"], criteria=q.get("criteria"),
                               temperature=float(q.get("temperature", 1.0)), labels=tuple(q.get("labels", ())),
                               label_bias={k: float(v) for k, v in (q.get("label_bias") or {}).items()})
            for qid, q in body["questions"].items()
        }
        head_config = JointHeadConfig.from_file(root / HEAD_CONFIG_FILE)
        kind = body.get("kind")
        head: CompactHead | RouterHead
        if kind == "catalog":
            head = CompactHead(head_config)
        elif kind == "router":
            (router,) = questions.values()
            head = RouterHead(head_config, len(router.labels))
        else:
            raise ValueError(f"{root / COMPACT_CONFIG_FILE} has kind {kind!r}; expected 'catalog' or 'router'")
        state = {k: v.float() for k, v in load_file(str(root / HEAD_WEIGHTS_FILE)).items()}
        head.load_state_dict(state, strict=True)
        return cls(encoder, head.float(), questions, kind=kind, meta=body.get("meta"),
                   memory_pool=int(body.get("memory_pool", DEFAULT_MEMORY_POOL)))


def _label_mismatch(untrained: list[str], missing: list[str], trained: int) -> str:
    """Why a router question's options are not its trained labels, naming the differences (at most 10 of each)."""

    def some(names: list[str]) -> str:
        shown = ", ".join(repr(n) for n in names[:10])
        return shown + (f" and {len(names) - 10} more" if len(names) > 10 else "")

    parts = []
    if untrained:
        parts.append(f"{len(untrained)} option(s) it was not trained on ({some(untrained)})")
    if missing:
        parts.append(f"{len(missing)} trained label(s) missing ({some(missing)})")
    return f"its options must be exactly the {trained} trained labels: {'; '.join(parts)}"
