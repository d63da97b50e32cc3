"""System One wire types, their validation, and the readout from probabilities to answers.

Pure Python (no torch). Implements the Clef runtime spec:

* §5.2 request body and field rules, with two validation profiles:
  ``"workers-ai"`` (the hosted limits: 1-64 questions, 2-255 choice options, 2-10 score levels, ids
  ``[A-Za-z0-9_.-]{1,100}``, instructions required, unknown fields rejected) and ``"reference"`` (exactly what the
  reference ``systemone()`` accepts).
* §2.2 option lists per question type, in prompt order (noul ``true`` then ``false``; choice sorted by id; score
  ``"0".."n-1"``).
* §4 readout: per-question probabilities in prompt order become ``noul`` = P(true), ``choice`` = argmax (exact ties
  go to the option id that sorts first by code point, whatever order the policy lists the options in), ``score`` =
  expected 0-based level index, with ``confidence`` from a named profile
  (§4.1) and rounding to 4 decimals only on the wire.
* §5.4 response body, and parsing of a remote response with checks (every question answered, probabilities finite and
  summing to 1 within the provider's rounding).

Object key order is preserved: question order is model input. A choice's option order is not: the prompt lists
options sorted by id, remote backends are sent them sorted (:meth:`SystemOneRequestV1.canonical`), the cache key and
the stored answers use that order, and only the reported ``probabilities`` follow the caller's order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, get_args

from guard.errors import FieldError, MalformedAnswer, RequestValidationError

__all__ = [
    "COARSEST_DECIMALS",
    "CONFIDENCE_PROFILES",
    "IMAGE_FORMATS",
    "MAX_CHOICE_OPTIONS",
    "MAX_IMAGES",
    "MAX_IMAGE_PIXELS",
    "MAX_QUESTIONS",
    "MAX_SCORE_LEVELS",
    "MIN_CHOICE_OPTIONS",
    "MIN_SCORE_LEVELS",
    "NOUL_DEFAULT_FALSE",
    "NOUL_DEFAULT_TRUE",
    "AnswerV1",
    "ConfidenceProfile",
    "QuestionType",
    "QuestionV1",
    "ReadOnlyDict",
    "SystemOneRequestV1",
    "SystemOneResponseV1",
    "UsageV1",
    "ValidationProfile",
    "answer_question",
    "check_readout",
    "confidence",
    "max_answer_bytes",
    "max_answer_containers",
    "parse_usage",
    "require_request",
    "sum_tolerance",
]

QuestionType = Literal["noul", "choice", "score"]
ValidationProfile = Literal["workers-ai", "reference"]
ConfidenceProfile = Literal["reference", "workers-ai", "jev"]

QUESTION_TYPES: tuple[str, ...] = get_args(QuestionType)
CONFIDENCE_PROFILES: tuple[str, ...] = get_args(ConfidenceProfile)
VALIDATION_PROFILES: tuple[str, ...] = get_args(ValidationProfile)

#: Default noul option descriptions (§2.2), overlaid by the caller's ``criteria``.
NOUL_DEFAULT_TRUE = "The proposition is true or the answer is yes."
NOUL_DEFAULT_FALSE = "The proposition is false or the answer is no."

#: Workers AI limits (§5.2, §5.3).
MAX_QUESTIONS = 64
MIN_CHOICE_OPTIONS = 2
MAX_CHOICE_OPTIONS = 255
MIN_SCORE_LEVELS = 2
MAX_SCORE_LEVELS = 10
MAX_IMAGES = 4
#: Largest image (width x height) a guard backend decodes: 4096 x 4096, read from the header before decoding.
MAX_IMAGE_PIXELS = 4096 * 4096
#: The image formats a guard backend decodes (PIL's names); PIL's other decoders (TIFF, DDS, ICNS, AVIF, IM, ...) are
#: never tried on client bytes.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
#: A question id (fullmatch): the policy loader takes it for policy and rule ids and handoff target names too.
ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,100}")
IMAGE_CONTENT_TYPES = ("image/png", "image/jpeg", "image/webp")

#: What a choice option id may not hold under the workers-ai profile: control characters (Cc), the bidi controls
#: (embeddings, overrides, isolates, LRM, RLM, ALM), U+200B and U+FEFF. Joiners, soft hyphens, tag sequences, no-break
#: and other spaces inside, and code points newer than Python's Unicode tables are text.
_OPTION_ID_REFUSED = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
_REQUEST_KEYS = ("model", "state", "questions", "images")
_QUESTION_KEYS = ("type", "instructions", "criteria")
_WIRE_DECIMALS = 4
#: The coarsest rounding of any provider (Jev, OpenRouter): the tolerance stored answers are checked with.
COARSEST_DECIMALS = 2
#: Widest tolerance on a probability sum: at least half the mass is left after any rounding.
MAX_SUM_TOLERANCE = 0.5
#: Longest ``model`` name taken from an answer; a longer or unprintable one gives way to the request's.
MAX_MODEL_CHARS = 200
#: Largest ``usage.input_tokens``, ``output_tokens`` or ``state_tokens_dropped`` an answer may report: far over any
#: model's context (Clef's 262,144 positions), so a count past it is no count (it reaches spans, metrics, flags, the
#: cache and decision records).
MAX_USAGE_TOKENS = 10_000_000


def _describe(value: Any) -> str:
    text = shown_id(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shown_id(value: Any, *, quoted: bool = True) -> str:
    """``value`` (an id) as an error message shows it: a string not in Unicode NFKC form with :func:`ascii`, so ids
    that print alike read apart (``'\\u212b'`` beside ``'Å'``, ``'\\ufb01'`` beside ``'fi'``); anything else with
    :func:`repr`, or as it is when ``quoted`` is false and it is a string (an entry of a list of ids)."""
    if isinstance(value, str) and not unicodedata.is_normalized("NFKC", value):
        return ascii(value)
    return value if isinstance(value, str) and not quoted else repr(value)


def _shown(value: Any) -> str:
    """``value``, read from a remote answer, as an error message may show it: a number under 1000 in size, written in
    at most 12 characters, as it is; anything else by its JSON type only (a string or a larger number may repeat the
    request's state, and error messages reach verdicts, spans and decision logs)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and -1000 < value < 1000:
        text = repr(value)
        if len(text) <= 12:
            return text
    return f"a JSON {_json_type(value)}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


@dataclass(frozen=True)
class QuestionV1:
    """One typed question of a System One request (§5.2).

    Attributes:
        id: the question id; the reference renders it into the prompt (§2.3), so it is model input.
        type: ``"noul"`` (yes/no), ``"choice"`` (one of named options) or ``"score"`` (ordered levels).
        instructions: string, object or array; ``None`` or ``""`` means "use the id" (reference profile only).
        criteria: noul: ``{"true"?: D, "false"?: D}`` or ``None``; choice: ``{option_id: D}`` (caller order kept);
            score: ``[D, ...]`` lowest level first. ``D`` is any JSON value; ``None`` means "no description".
    """

    id: str
    type: QuestionType
    instructions: Any = None
    criteria: Any = None

    def instruction_value(self) -> Any:
        """The value rendered as the question span: ``instructions``, or the id when missing, null or ``""``."""
        if self.instructions is None or self.instructions == "":
            return self.id
        return self.instructions

    def options(self) -> list[tuple[str, Any]]:
        """``(option_id, description)`` pairs in **prompt** order (§2.2); ``None`` description = no description key."""
        if self.type == "noul":
            descriptions: dict[str, Any] = {"true": NOUL_DEFAULT_TRUE, "false": NOUL_DEFAULT_FALSE}
            if isinstance(self.criteria, Mapping):
                for key in ("true", "false"):
                    if key in self.criteria:
                        descriptions[key] = self.criteria[key]
            return [("true", descriptions["true"]), ("false", descriptions["false"])]
        if self.type == "choice":
            return sorted(self.criteria.items(), key=lambda item: item[0])
        return [(str(level), description) for level, description in enumerate(self.criteria)]

    def canonical(self) -> QuestionV1:
        """This question as it goes to a remote backend: a choice's options sorted by id (the prompt order of §2.2),
        so no backend sees the order a policy lists them in; noul and score questions as they are (a score's level
        order is its meaning). ``self`` when nothing changes."""
        if self.type != "choice" or list(self.criteria) == sorted(self.criteria):
            return self
        return dataclasses.replace(self, criteria=dict(self.options()))

    def option_ids(self) -> list[str]:
        """Option ids in **caller** order (the order answers report them in, §4)."""
        if self.type == "noul":
            return ["true", "false"]
        if self.type == "choice":
            return list(self.criteria)
        return [str(level) for level in range(len(self.criteria))]

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": self.type}
        if self.instructions is not None:
            body["instructions"] = self.instructions
        if self.criteria is not None:
            body["criteria"] = self.criteria
        return body


@dataclass(frozen=True)
class SystemOneRequestV1:
    """A validated System One request (§5.2). Frozen: change it with :meth:`override`.

    Attributes:
        model: model name, echoed in the response.
        state: the decision state: string, object or array (any JSON value in the reference profile).
        questions: questions in request order; the order is model input (§7 pitfall 4).
        images: Workers AI ``images`` extension (data URLs or ``{content_type, base64}``) or PIL images.
        videos: frame arrays for the reference's video path (Python API only).

    Example:
        >>> req = SystemOneRequestV1.from_json({"model": "clef-flash", "state": "hi",
        ...     "questions": {"spam": {"type": "noul", "instructions": "Is this spam?"}}})
        >>> [q.id for q in req.questions]
        ['spam']
    """

    model: str
    state: Any
    questions: tuple[QuestionV1, ...]
    images: tuple[Any, ...] = ()
    videos: tuple[Any, ...] = field(default=(), compare=True)

    @classmethod
    def from_json(cls, body: Any, *, profile: ValidationProfile = "workers-ai") -> SystemOneRequestV1:
        """Validate a parsed JSON body and build a request.

        Args:
            body: the parsed JSON object (a ``dict`` in wire key order).
            profile: ``"workers-ai"`` for the hosted limits, ``"reference"`` for what the reference accepts.

        Raises:
            RequestValidationError: listing every bad field with its path, value and limit.
        """
        if profile not in VALIDATION_PROFILES:
            raise ValueError(f"profile must be one of {VALIDATION_PROFILES}, got {profile!r}")
        errors: list[FieldError] = []
        if not isinstance(body, Mapping):
            raise RequestValidationError([FieldError("body", f"must be a JSON object, got {_json_type(body)}")])
        strict = profile == "workers-ai"
        if strict:
            for key in body:
                if key not in _REQUEST_KEYS:
                    errors.append(FieldError(str(key), f"unknown field; allowed fields are {', '.join(_REQUEST_KEYS)}"))
        model = body.get("model")
        if strict:
            if not isinstance(model, str) or not model.strip():
                errors.append(FieldError("model", "is required and must be a non-empty string"))
            if "state" not in body:
                errors.append(FieldError("state", "is required"))
            elif not isinstance(body["state"], (str, Mapping, list)):
                errors.append(
                    FieldError("state", f"must be a string, object or array, got {_json_type(body['state'])}")
                )
        elif not model or "state" not in body:
            errors.append(FieldError("state" if model else "model", "model and state are required"))
        elif not isinstance(model, str):
            errors.append(FieldError("model", f"must be a string, got {_json_type(model)}"))
        questions = _validate_questions(body.get("questions"), strict, errors)
        images = _validate_images(body.get("images"), strict, errors)
        videos = body.get("videos") if not strict else None
        if not isinstance(videos, (list, tuple, type(None))):
            errors.append(FieldError("videos", f"must be an array of videos (frame arrays), got {_json_type(videos)}"))
        if errors:
            raise RequestValidationError(errors)
        return cls(
            model=str(model),
            state=body.get("state"),
            questions=tuple(questions),
            images=tuple(images),
            videos=tuple(videos or ()),
        )

    def to_json(self) -> dict[str, Any]:
        """The wire body, in key order (``images`` only when present; PIL images are not JSON)."""
        body: dict[str, Any] = {
            "model": self.model,
            "state": self.state,
            "questions": {q.id: q.to_json() for q in self.questions},
        }
        if self.images:
            body["images"] = list(self.images)
        return body

    def canonical(self) -> SystemOneRequestV1:
        """This request with every question :meth:`QuestionV1.canonical` (choice options sorted by id): what goes on
        the wire to a remote backend. Answers to it are keyed by option id, so parsing them against the original
        request (:meth:`SystemOneResponseV1.from_json`) reports them in the caller's order. ``self`` when nothing
        changes."""
        questions = tuple(q.canonical() for q in self.questions)
        if all(a is b for a, b in zip(questions, self.questions, strict=True)):
            return self
        return dataclasses.replace(self, questions=questions)

    def override(self, **changes: Any) -> SystemOneRequestV1:
        """Return a copy with some fields replaced (``model``, ``state``, ``questions``, ``images``, ``videos``)."""
        if "questions" in changes:
            changes["questions"] = tuple(changes["questions"])
        return dataclasses.replace(self, **changes)

    def question(self, question_id: str) -> QuestionV1:
        """The question with this id.

        Raises:
            KeyError: when no question has this id.
        """
        for q in self.questions:
            if q.id == question_id:
                return q
        raise KeyError(question_id)


def require_request(request: Any, caller: str) -> SystemOneRequestV1:
    """``request`` itself when it is a :class:`SystemOneRequestV1`; ``caller`` names the method refusing anything else
    (``"compact: decide()"``, ``"ClefModel.encode()"``).

    Raises:
        TypeError: for anything else (a parsed JSON body included), naming ``caller`` and how to build a request.
    """
    if isinstance(request, SystemOneRequestV1):
        return request
    raise TypeError(f"{caller} takes a SystemOneRequestV1, not {type(request).__name__}; build one from a JSON body "
                    "with SystemOneRequestV1.from_json(body)")


def _validate_questions(raw: Any, strict: bool, errors: list[FieldError]) -> list[QuestionV1]:
    if raw is None:
        errors.append(FieldError("questions", "at least one question is required"))
        return []
    if not isinstance(raw, Mapping):
        errors.append(FieldError("questions", f"must be an object keyed by question id, got {_json_type(raw)}"))
        return []
    if not raw:
        errors.append(FieldError("questions", "at least one question is required"))
    if strict and len(raw) > MAX_QUESTIONS:
        errors.append(FieldError("questions", f"has {len(raw)} entries; at most {MAX_QUESTIONS}"))
    out: list[QuestionV1] = []
    for qid, spec in raw.items():
        path = f"questions.{qid}"
        before = len(errors)
        if strict and not (isinstance(qid, str) and ID_PATTERN.fullmatch(qid)):
            errors.append(FieldError(path, f"id {_describe(qid)} must match {ID_PATTERN.pattern}"))
        if not isinstance(spec, Mapping):
            errors.append(FieldError(path, f"must be an object, got {_json_type(spec)}"))
            continue
        if strict:
            for key in spec:
                if key not in _QUESTION_KEYS:
                    errors.append(FieldError(f"{path}.{key}", "unknown field; allowed: type, instructions, criteria"))
        qtype = spec.get("type")
        if qtype not in QUESTION_TYPES:
            errors.append(FieldError(f"{path}.type", f"{qid}: type must be noul, choice, or score"))
            continue
        instructions = spec.get("instructions")
        if strict:
            if instructions is None or instructions == "":
                errors.append(FieldError(f"{path}.instructions", "is required and must not be empty"))
            elif not isinstance(instructions, (str, Mapping, list)):
                errors.append(
                    FieldError(
                        f"{path}.instructions", f"must be a string, object or array, got {_json_type(instructions)}"
                    )
                )
        criteria = spec.get("criteria")
        _validate_criteria(qid, qtype, criteria, path, strict, errors)
        if len(errors) == before:
            out.append(QuestionV1(id=str(qid), type=qtype, instructions=instructions, criteria=criteria))
    return out


def _validate_criteria(
    qid: str, qtype: str, criteria: Any, path: str, strict: bool, errors: list[FieldError]
) -> None:
    where = f"{path}.criteria"
    if qtype == "noul":
        if criteria is None:
            return
        if not isinstance(criteria, Mapping):
            errors.append(FieldError(where, f"must be an object with keys true/false, got {_json_type(criteria)}"))
        elif strict:
            for key in criteria:
                if str(key) in ("True", "False"):  # YAML reads a bare true: or false: as a boolean
                    errors.append(FieldError(f"{where}.{key}", f"write the key as \"{str(key).lower()}\", in quotes: "
                                             "YAML reads a bare true or false as a boolean"))
                elif key not in ("true", "false"):
                    errors.append(FieldError(f"{where}.{key}", "unknown key; a noul question has only true and false"))
        return
    if qtype == "choice":
        if not isinstance(criteria, Mapping):
            errors.append(FieldError(where, f"must be an object of option_id: description, got {_json_type(criteria)}"))
            return
        if not criteria:
            errors.append(FieldError(where, f"{qid}: criteria must not be empty"))
        elif strict and not MIN_CHOICE_OPTIONS <= len(criteria) <= MAX_CHOICE_OPTIONS:
            errors.append(
                FieldError(
                    where,
                    f"has {len(criteria)} options; a choice needs {MIN_CHOICE_OPTIONS} to {MAX_CHOICE_OPTIONS}",
                )
            )
        if strict:  # ids are model input (spec pitfall 5): no control or bidi characters, no blank or padded id
            normalised: dict[str, str] = {}  # NFKC form -> the first id with it
            for option_id in criteria:
                if not isinstance(option_id, str) or not option_id:
                    errors.append(FieldError(where, f"option id {_describe(option_id)} must be a non-empty string"))
                elif _OPTION_ID_REFUSED.search(option_id) or option_id.strip() != option_id:
                    errors.append(FieldError(where, f"option id {_describe(option_id)} must be text without control "
                                             "or bidi characters, U+200B or U+FEFF, and without leading or trailing "
                                             "whitespace"))
                # the tokenizer reads NFC forms as one text (U+212B and U+00C5 are the same tokens), and a rule's
                # reader cannot tell NFKC forms apart either (U+FB01 and "fi")
                elif (first := normalised.setdefault(unicodedata.normalize("NFKC", option_id), option_id)) != option_id:
                    errors.append(FieldError(where, f"option ids {_describe(first)} and {_describe(option_id)} are "
                                             "the same text once Unicode-normalised (NFKC); the model and a rule "
                                             "cannot tell them apart"))
        return
    if not isinstance(criteria, list):
        errors.append(FieldError(where, f"must be an array of levels, lowest first, got {_json_type(criteria)}"))
        return
    if not criteria:
        errors.append(FieldError(where, f"{qid}: criteria must not be empty"))
    elif strict and not MIN_SCORE_LEVELS <= len(criteria) <= MAX_SCORE_LEVELS:
        errors.append(
            FieldError(
                where, f"has {len(criteria)} levels; a score needs {MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS}"
            )
        )


def _validate_images(raw: Any, strict: bool, errors: list[FieldError]) -> list[Any]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        errors.append(FieldError("images", f"must be an array, got {_json_type(raw)}"))
        return []
    if len(raw) > MAX_IMAGES:  # in every profile: each image is decoded and costs up to 1,024 tokens of compute
        errors.append(FieldError("images", f"has {len(raw)} entries; at most {MAX_IMAGES}"))
    if not strict:
        return list(raw)
    for i, image in enumerate(raw):
        where = f"images[{i}]"
        if isinstance(image, str):
            if image[:5].lower() != "data:":
                errors.append(FieldError(where, "must be a data: URL (bare base64 only in the reference profile); "
                                         "remote URLs are never fetched"))
        elif isinstance(image, Mapping):
            if image.get("content_type") not in IMAGE_CONTENT_TYPES:
                errors.append(
                    FieldError(f"{where}.content_type", f"must be one of {', '.join(IMAGE_CONTENT_TYPES)}")
                )
            if not isinstance(image.get("base64"), str) or not image.get("base64"):
                errors.append(FieldError(f"{where}.base64", "is required and must be a non-empty string"))
        else:
            errors.append(FieldError(where, f"must be a data URL or {{content_type, base64}}, got {_json_type(image)}"))
    return list(raw)


# --------------------------------------------------------------------------------------------------------------------
# Readout (§4)


def confidence(probabilities: Sequence[float], question_type: QuestionType, profile: ConfidenceProfile) -> float:
    """The ``confidence`` of one choice or score answer under a named profile (§4.1).

    Args:
        probabilities: the question's probabilities, one per option (any order for choice; level order for score).
        question_type: ``"choice"`` or ``"score"``.
        profile: ``"reference"`` = top probability (Clef reference); ``"workers-ai"`` = normalized purity
            ``(n·Σp² − 1)/(n − 1)``; ``"jev"`` = ``(n·p_max − 1)/(n − 1)`` for choice and
            ``max(0, 1 − E|level − mode| / MAD_uniform)`` for score.

    Returns:
        A float in [0, 1]; 1.0 for a single-option question.

    Raises:
        ValueError: for an unknown profile.
    """
    n = len(probabilities)
    p_max = max(probabilities)
    if profile == "reference":
        return p_max
    if n < 2:
        return 1.0
    if profile == "workers-ai":
        return (n * sum(p * p for p in probabilities) - 1.0) / (n - 1)
    if profile == "jev":
        if question_type != "score":
            return (n * p_max - 1.0) / (n - 1)
        return _jev_score_confidence(probabilities, max(range(n), key=lambda i: (probabilities[i], -i)))
    raise ValueError(f"confidence profile must be one of {CONFIDENCE_PROFILES}, got {profile!r}")


def _jev_score_confidence(probabilities: Sequence[float], mode: int) -> float:
    """Jev's confidence of a score answer (at least 2 levels) whose most probable level is ``mode``:
    ``max(0, 1 − E|level − mode| / MAD_uniform)``."""
    expected_distance = sum(p * abs(level - mode) for level, p in enumerate(probabilities))
    return max(0.0, 1.0 - expected_distance / _mad_uniform(len(probabilities)))


def _mad_uniform(levels: int) -> float:
    """The mean distance of ``levels`` score levels from their centre, Jev's scale for a score's confidence."""
    centre = (levels - 1) / 2
    return sum(abs(level - centre) for level in range(levels)) / levels


class ReadOnlyDict(dict[str, Any]):
    """A ``dict`` that cannot change once made. Reading, ``==``, ``json.dumps``, ``dict(x)``, ``copy`` and ``pickle``
    work as for any dict; every change raises ``TypeError``.

    :class:`AnswerV1` keeps its ``probabilities`` and ``legend`` in one, so an answer is immutable all the way down and
    can be shared by every decision a cache serves from it (no copy per decision; a caller cannot change what the next
    one reads).
    """

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("this mapping is read-only (it is shared); copy it with dict(...) to change it")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple[type[ReadOnlyDict], tuple[dict[str, Any]]]:
        return (type(self), (dict(self),))

    def __copy__(self) -> ReadOnlyDict:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ReadOnlyDict:
        return self  # keys are strings; values are numbers or (legend) the criteria's strings, as received


@dataclass(frozen=True)
class AnswerV1:
    """One question's answer. Numbers are unrounded; :meth:`to_json` rounds for the wire. Immutable: ``probabilities``
    and ``legend`` are made :class:`ReadOnlyDict` copies of what is given.

    Attributes:
        question_id: the question's id.
        type: the question type.
        probabilities: ``option_id -> probability`` in caller order (noul: ``true``, ``false``).
        noul: P(true), noul only.
        choice: the chosen option id, choice only.
        score: expected 0-based level index in [0, levels − 1], score only.
        confidence: choice and score only, per the confidence profile used.
        legend: score only: ``{"0": level 0 criterion, ...}`` echoed raw.
    """

    question_id: str
    type: QuestionType
    probabilities: dict[str, float]
    noul: float | None = None
    choice: str | None = None
    score: float | None = None
    confidence: float | None = None
    legend: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if type(self.probabilities) is not ReadOnlyDict:
            object.__setattr__(self, "probabilities", ReadOnlyDict(self.probabilities))
        if self.legend is not None and type(self.legend) is not ReadOnlyDict:
            object.__setattr__(self, "legend", ReadOnlyDict(self.legend))

    @property
    def value(self) -> float | str:
        """The headline value: ``noul`` probability, ``choice`` id or ``score``."""
        if self.type == "noul":
            assert self.noul is not None
            return self.noul
        if self.type == "choice":
            assert self.choice is not None
            return self.choice
        assert self.score is not None
        return self.score

    def in_order(self, option_ids: Sequence[str]) -> AnswerV1:
        """This answer with ``probabilities`` in the order of ``option_ids`` (the same ids, another order): an answer
        cached for one policy, reported in the order another lists the same options. ``self`` when already so."""
        if list(self.probabilities) == list(option_ids):
            return self
        return dataclasses.replace(self, probabilities={o: self.probabilities[o] for o in option_ids})

    def to_json(self, decimals: int = _WIRE_DECIMALS) -> dict[str, Any]:
        """The wire answer, with the reference's key order and ``round(x, decimals)``."""
        if self.type == "noul":
            return {"type": "noul", "noul": round(float(self.noul or 0.0), decimals)}
        probabilities = {k: round(v, decimals) for k, v in self.probabilities.items()}
        conf = round(float(self.confidence or 0.0), decimals)
        if self.type == "choice":
            return {"type": "choice", "choice": self.choice, "confidence": conf, "probabilities": probabilities}
        return {
            "type": "score",
            "score": round(float(self.score or 0.0), decimals),
            "confidence": conf,
            "legend": dict(self.legend) if self.legend is not None else None,
            "probabilities": probabilities,
        }


def answer_question(
    question: QuestionV1, probabilities: Sequence[float], *, confidence_profile: ConfidenceProfile = "reference"
) -> AnswerV1:
    """Turn one question's probabilities (in **prompt** order) into its answer (§4).

    Args:
        question: the question.
        probabilities: softmax of the question's logits, one per option in ``question.options()`` order.
        confidence_profile: which ``confidence`` definition to report (§4.1).

    Raises:
        MalformedAnswer: when the count does not match the options or a value is not finite.
    """
    prompt_ids = [option_id for option_id, _ in question.options()]
    if len(probabilities) != len(prompt_ids):
        raise MalformedAnswer(
            f"question {question.id!r} has {len(prompt_ids)} options but {len(probabilities)} probabilities"
        )
    values = [float(p) for p in probabilities]
    if not all(math.isfinite(p) for p in values):
        raise MalformedAnswer(f"question {question.id!r} has a non-finite probability: {values}")
    by_id = dict(zip(prompt_ids, values, strict=True))
    caller = {option_id: by_id[option_id] for option_id in question.option_ids()}
    return _answer_from_caller_order(question, caller, confidence_profile)


def _answer_from_caller_order(
    question: QuestionV1, caller: dict[str, float], profile: ConfidenceProfile, reported_confidence: float | None = None
) -> AnswerV1:
    if question.type == "noul":
        return AnswerV1(question.id, "noul", caller, noul=caller["true"])
    conf = reported_confidence
    if conf is None:
        conf = confidence(list(caller.values()), question.type, profile)
    if question.type == "choice":
        best = _argmax(caller)
        return AnswerV1(question.id, "choice", caller, choice=best, confidence=conf)
    expected = sum(level * p for level, p in enumerate(caller.values()))
    legend = {str(level): criterion for level, criterion in enumerate(question.criteria)}
    return AnswerV1(question.id, "score", caller, score=expected, confidence=conf, legend=legend)


def _argmax(probabilities: Mapping[str, float]) -> str:
    """The most probable option; exact ties go to the id that sorts first (code points), not the listing order."""
    top = max(probabilities.values())
    return min(option_id for option_id, p in probabilities.items() if p == top)


@dataclass(frozen=True)
class UsageV1:
    """Token usage: ``input_tokens`` = prompt length including media; ``output_tokens`` is 0 for Clef;
    ``state_tokens_dropped`` = state tokens the model did not read because the state was over its window (0 unless
    the backend cut it; read from a response's ``usage`` when a server sends it); ``out_of_competence`` = 1 when the
    model reports it could not read the state (an unsupported language or non-text; 0 otherwise)."""

    input_tokens: int
    output_tokens: int = 0
    state_tokens_dropped: int = 0
    out_of_competence: int = 0


@dataclass(frozen=True)
class SystemOneResponseV1:
    """A System One response (§5.4): answers keyed by question id, in request order."""

    model: str
    answers: dict[str, AnswerV1]
    usage: UsageV1

    def to_json(self, decimals: int = _WIRE_DECIMALS) -> dict[str, Any]:
        """The wire body (§5.4), exactly the reference's keys: ``usage`` has ``input_tokens`` and ``output_tokens``
        only (:meth:`served_json` adds ``state_tokens_dropped``)."""
        return {
            "model": self.model,
            "answers": {qid: answer.to_json(decimals) for qid, answer in self.answers.items()},
            "usage": {"input_tokens": self.usage.input_tokens, "output_tokens": self.usage.output_tokens},
        }

    def served_json(self, decimals: int = _WIRE_DECIMALS) -> dict[str, Any]:
        """What guard's worker and ``guard decide`` send: :meth:`to_json`, with ``usage.state_tokens_dropped`` when
        the state was cut (a cut is never silent; the reference's usage has no such key)."""
        body = self.to_json(decimals)
        if self.usage.state_tokens_dropped:
            body["usage"]["state_tokens_dropped"] = self.usage.state_tokens_dropped
        return body

    @classmethod
    def from_json(
        cls,
        body: Any,
        request: SystemOneRequestV1,
        *,
        decimals: int = _WIRE_DECIMALS,
        confidence_profile: ConfidenceProfile = "reference",
        backend: str = "",
    ) -> SystemOneResponseV1:
        """Parse and check a response from a remote System One server.

        Args:
            body: the parsed JSON body (already unwrapped from any envelope).
            request: the request it answers; every question must be answered with its own options.
            decimals: the provider's rounding (4 for Clef and Workers AI, 2 for Jev and OpenRouter); sets the
                tolerance on the probability sum to ``max(1e-3, n · ½·10^-decimals)``.
            confidence_profile: used only when the provider omitted ``confidence``.
            backend: the backend's name, for error messages.

        Raises:
            MalformedAnswer: a missing or extra answer, a wrong type, a non-finite or out-of-range number, unknown
                option ids, probabilities that do not sum to 1 within the tolerance, or a ``usage`` that is not an
                object of whole numbers >= 0.
        """

        def bad(message: str) -> MalformedAnswer:
            return MalformedAnswer(message, backend=backend)

        if not isinstance(body, Mapping):
            raise bad(f"response must be a JSON object, got {_json_type(body)}")
        answers_raw = body.get("answers")
        if not isinstance(answers_raw, Mapping):
            raise bad("response has no 'answers' object")
        answers: dict[str, AnswerV1] = {}
        for question in request.questions:
            raw = answers_raw.get(question.id)
            if not isinstance(raw, Mapping):
                raise bad(f"answer for question {question.id!r} is missing")
            if raw.get("type", question.type) != question.type:
                raise bad(f"answer for {question.id!r} has type {_shown(raw.get('type'))}, expected {question.type!r}")
            answers[question.id] = _parse_answer(question, raw, decimals, confidence_profile, bad)
        extra = [qid for qid in answers_raw if qid not in answers]
        if extra:
            raise bad(f"response answers {len(extra)} question(s) the request did not ask")
        model = body.get("model")
        if not (isinstance(model, str) and 0 < len(model) <= MAX_MODEL_CHARS and model.isprintable()):
            model = request.model  # what spans and decision logs carry: nothing a hostile endpoint can bloat
        return cls(model=model, answers=answers, usage=parse_usage(body.get("usage"), bad))


#: Arrays and objects an answer holds besides its questions' (the body, ``answers``, ``usage``, an envelope's
#: ``result``, ``errors`` and ``messages``, and room for a few more a provider adds).
_ANSWER_CONTAINERS_BASE = 64
#: Arrays and objects one answered question adds: its answer, ``probabilities`` and a score's ``legend``.
_ANSWER_CONTAINERS_PER_QUESTION = 3
#: Bytes an answer holds besides its questions' answers and what it echoes: the body, ``usage``, an envelope, and
#: fields a provider adds (timings, request ids, warnings), with room to spare.
_ANSWER_BYTES_BASE = 64 * 1024
#: Bytes one answered question adds besides what it echoes: its type, choice or score, confidence, and fields a
#: provider adds to it.
_ANSWER_BYTES_PER_QUESTION = 1024
#: Bytes each option of a question adds: its probability (a float written in full takes up to 24 characters), a
#: score's legend key, and the indentation of a pretty-printed answer.
_ANSWER_BYTES_PER_OPTION = 64


def _echoed(request: SystemOneRequestV1, model: str | None) -> str:
    """What an answer to ``request`` can write back of it, as JSON with non-ASCII escaped (its longest spelling):
    the model name (``model``, a client's, else the request's), the question ids and the questions."""
    return json.dumps({"model": model or request.model,
                       "questions": {question.id: question.to_json() for question in request.questions}})


def max_answer_containers(request: SystemOneRequestV1, model: str | None = None) -> int:
    """Most ``[`` and ``{`` (counted in strings too, as :func:`guard._json.loads` counts them) a System One answer to
    ``request`` holds: a few for the body and an envelope, three per question, and twice each bracket written in its
    model name (``model`` when a client sends its own), question ids and questions (an option id comes back as a key
    of ``probabilities`` and as a ``choice``, a score's levels as its ``legend``). 64 choices of 255 plain option ids
    allow 514; a body with more is no answer to ``request``, and json's parser, which holds the GIL, is not run on it
    (8 MiB of ``[]`` are 2.8 million lists)."""
    written = _echoed(request, model)
    brackets = written.count("[") + written.count("{")
    return _ANSWER_CONTAINERS_BASE + _ANSWER_CONTAINERS_PER_QUESTION * len(request.questions) + 2 * brackets


def max_answer_bytes(request: SystemOneRequestV1, model: str | None = None) -> int:
    """Most bytes a System One answer to ``request`` holds: 64 KiB for the body, an envelope and fields a provider
    adds, 1 KiB per question and 64 bytes per option, and twice the JSON of its model name (``model`` when a client
    sends its own), question ids and questions with non-ASCII escaped (option ids come back as keys and a choice, a
    score's levels as its legend). One yes/no question allows about 66 KB; a longer body is no answer to
    ``request``, and json's parser, which holds the GIL, is not run on it (8 MiB of ``0.5,`` are 2 million floats)."""
    options = sum(len(question.options()) for question in request.questions)
    return (_ANSWER_BYTES_BASE + _ANSWER_BYTES_PER_QUESTION * len(request.questions)
            + _ANSWER_BYTES_PER_OPTION * options + 2 * len(_echoed(request, model)))


def sum_tolerance(options: int, decimals: int = _WIRE_DECIMALS) -> float:
    """How far from 1 the probabilities of one answer may sum: ``max(1e-3, options · ½·10^-decimals)`` (spec §7
    pitfall 2: a provider that rounds to ``decimals`` places can be off by half a unit per option), at most
    :data:`MAX_SUM_TOLERANCE`, so an answer of 200 options rounded to 2 places cannot be all zeros.

    Args:
        options: the answer's number of options.
        decimals: the provider's rounding (4 for Clef and Workers AI, 2 for Jev and OpenRouter; stored answers,
            which may come from any provider, use :data:`COARSEST_DECIMALS`).
    """
    return min(MAX_SUM_TOLERANCE, max(1e-3, options * 0.5 * 10.0**-decimals)) + 1e-9


def parse_usage(raw: Any, bad: Any) -> UsageV1:
    """A response's ``usage`` (spec §5.4: ``input_tokens``, ``output_tokens``; guard's servers add
    ``state_tokens_dropped`` and ``out_of_competence``), from a server's JSON or from the :class:`UsageV1` an
    in-process backend built (its fields are checked the same way). A count that is absent or null reads 0, as does
    a ``usage`` that is; a whole-number float reads as the integer (``1200.0``), and ``out_of_competence`` may be a
    boolean (a flag: 0 or 1).

    Args:
        bad: builds the exception raised from its message (a :class:`~guard.errors.MalformedAnswer`).

    Raises:
        MalformedAnswer: ``usage`` is not an object, or a count is negative, fractional or not a number (read as 0,
            a cut state or an unread one would pass as read whole), or a token count is over
            :data:`MAX_USAGE_TOKENS`, or ``out_of_competence`` over 1.
    """
    if raw is None:
        return UsageV1(input_tokens=0)
    if isinstance(raw, UsageV1):
        raw = dataclasses.asdict(raw)
    if not isinstance(raw, Mapping):
        raise bad(f"response usage is a JSON {_json_type(raw)}; expected an object")
    counts: dict[str, int] = {}
    for name in ("input_tokens", "output_tokens", "state_tokens_dropped", "out_of_competence"):
        value = raw.get(name)
        if value is None or (name == "out_of_competence" and isinstance(value, bool)):
            counts[name] = int(value or 0)
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            counts[name] = value
        elif isinstance(value, float) and value.is_integer() and value >= 0:
            counts[name] = int(value)
        else:
            raise bad(f"response usage.{name} is {_shown(value)}; expected a whole number >= 0")
        limit = 1 if name == "out_of_competence" else MAX_USAGE_TOKENS
        if counts[name] > limit:
            raise bad(f"response usage.{name} is {_shown(value)}; expected at most {limit}")
    return UsageV1(**counts)


def _probability(value: Any) -> float | None:
    """``value`` as a probability in [0, 1], or None when it is not one: within 1e-9 of the range (a float artefact
    such as 1.0000000000000002) it is clamped, so every later check sees a value in range."""
    if (  # NaN and the infinities fail the range; an integer too large for a float is compared exactly
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and -1e-9 <= value <= 1 + 1e-9
    ):
        return min(max(float(value), 0.0), 1.0)
    return None


def _parse_answer(
    question: QuestionV1, raw: Mapping[str, Any], decimals: int, profile: ConfidenceProfile, bad: Any
) -> AnswerV1:
    if question.type == "noul":
        p = _probability(raw.get("noul"))
        if p is None:
            raise bad(f"answer for {question.id!r} has noul {_shown(raw.get('noul'))}; expected a probability in [0, 1]")
        return AnswerV1(question.id, "noul", {"true": p, "false": 1.0 - p}, noul=p)
    probabilities = raw.get("probabilities")
    expected_ids = question.option_ids()
    if not isinstance(probabilities, Mapping) or set(probabilities) != set(expected_ids):
        got = (f"{len(set(probabilities) & set(expected_ids))} of its {len(expected_ids)} options and "
               f"{len(set(probabilities) - set(expected_ids))} other id(s)" if isinstance(probabilities, Mapping)
               else _shown(probabilities))
        raise bad(f"answer for {question.id!r} has probabilities for {got}; expected {expected_ids}")
    caller: dict[str, float] = {}
    for option_id in expected_ids:
        p = _probability(probabilities[option_id])
        if p is None:
            raise bad(f"answer for {question.id!r} has probability {_shown(probabilities[option_id])} for option "
                      f"{option_id!r}")
        caller[option_id] = p
    tolerance = sum_tolerance(len(expected_ids), decimals)
    total = sum(caller.values())
    if abs(total - 1.0) > tolerance:
        raise bad(f"probabilities for {question.id!r} sum to {total:.6f}; expected 1 within {tolerance:.4f}")
    reported = raw.get("confidence")
    if reported is not None:
        reported = _probability(reported)
        if reported is None:
            raise bad(f"answer for {question.id!r} has confidence {_shown(raw.get('confidence'))}")
    if question.type == "choice":
        choice = raw.get("choice")
        if not isinstance(choice, str) or choice not in caller:  # a list or object is no option id (nor hashable)
            raise bad(f"answer for {question.id!r} chose {_shown(choice)}, not one of its options")
        check_readout(question, caller, choice, reported, decimals, bad)
        answer = _answer_from_caller_order(question, caller, profile, reported)
        return answer if caller[choice] == max(caller.values()) else dataclasses.replace(answer, choice=choice)
    score = raw.get("score")
    levels = len(expected_ids)
    if not isinstance(score, (int, float)) or isinstance(score, bool) or (isinstance(score, float)
                                                                         and not math.isfinite(score)):
        raise bad(f"answer for {question.id!r} has score {_shown(score)}; expected a number")
    if not -1e-6 <= score <= levels - 1 + 1e-6:
        raise bad(f"answer for {question.id!r} has score {_shown(score)}; expected 0 to {levels - 1}")
    check_readout(question, caller, score, reported, decimals, bad)
    # rules read the expected level of the checked probabilities, never a reported mode
    return _answer_from_caller_order(question, caller, profile, reported)


def check_readout(
    question: QuestionV1, probabilities: Mapping[str, float], value: float | str, reported_confidence: float | None,
    decimals: int, bad: Callable[[str], Exception],
) -> None:
    """Check that an answer's headline ``value`` and ``reported_confidence`` are what its ``probabilities`` give,
    within a provider's rounding to ``decimals`` places (two values each rounded by half a unit can differ by one unit
    from the true order): the one check of a remote answer (:meth:`SystemOneResponseV1.from_json`) and of a stored one
    (:func:`guard.systemone.answers.decode_answers`, with :data:`COARSEST_DECIMALS`), so rules never read a headline
    its probabilities contradict.

    Args:
        question: the question answered.
        probabilities: option id -> probability in caller order (a score's in level order), each in [0, 1], summing
            to 1 (checked before).
        value: noul: P(true), within one unit of ``probabilities["true"]``; choice: an option id (checked before),
            whose probability is within one unit of the top one; score: a number from 0 to levels - 1 (checked
            before), the expected level within the rounding of each probability, or a most probable level.
        reported_confidence: a probability, or ``None`` when not reported; it must be what one of
            :data:`CONFIDENCE_PROFILES` gives for the probabilities, within ``max(1e-3, 5·10^-decimals)``. Jev's
            score confidence is taken with any level within one unit of the top probability as the most probable
            (rounding can tie two levels, or swap them, that were apart), within what rounding each probability
            moves it too (half a unit times each level's distance from that one, over ``MAD_uniform``).
        decimals: the provider's rounding.
        bad: makes the error from its message.

    Raises:
        Exception: what ``bad`` makes, naming the question, when a headline or confidence does not follow.
    """
    unit = 10.0**-decimals
    top = max(probabilities.values())
    if reported_confidence is not None:  # a rule may read it: it must be what one of the known definitions gives
        values = list(probabilities.values())
        slack = max(1e-3, 5 * unit)
        known = [(confidence(values, question.type, profile), slack) for profile in CONFIDENCE_PROFILES]
        if question.type == "score" and len(values) > 1:  # Jev's, from each level that may be the true mode
            levels, scale = len(values), _mad_uniform(len(values))
            known += [
                (_jev_score_confidence(values, mode),
                 max(slack, 0.5 * unit * (1 + sum(abs(level - mode) for level in range(levels)) / scale) + 1e-9))
                for mode, p in enumerate(values) if p >= top - unit - 1e-9
            ]  # fmt: skip
        if not any(abs(reported_confidence - value) <= within for value, within in known):
            raise bad(f"answer for {question.id!r} has confidence {reported_confidence:.6f}, which no confidence "
                      f"definition ({', '.join(CONFIDENCE_PROFILES)}) gives for its probabilities")
    if question.type == "noul":
        assert isinstance(value, (int, float))
        if abs(value - probabilities["true"]) > unit + 1e-9:
            raise bad(f"answer for {question.id!r} has noul {_shown(value)} but P(true) = "
                      f"{probabilities['true']:.4f}; noul is P(true)")
        return
    if question.type == "choice":
        assert isinstance(value, str)
        if probabilities[value] < top - unit - 1e-9:
            raise bad(f"answer for {question.id!r} chose {value!r} (p={probabilities[value]:.4f}) but "
                      f"{_argmax(probabilities)!r} has p={top:.4f}; the choice must be the most probable option")
        return
    assert isinstance(value, (int, float))
    levels = len(probabilities)
    # each probability is off by up to half a unit (times its level), and the score itself by half a unit
    tolerance = 0.5 * unit * (1 + levels * (levels - 1) / 2) + 1e-9
    expected = sum(level * p for level, p in enumerate(probabilities.values()))
    modes = {level for level, p in enumerate(probabilities.values()) if p == top}
    if abs(value - expected) > tolerance and not (float(value).is_integer() and int(value) in modes):
        raise bad(f"answer for {question.id!r} has score {_shown(value)} but its probabilities give {expected:.4f} "
                  f"(expected level) within {tolerance:.4f}")
