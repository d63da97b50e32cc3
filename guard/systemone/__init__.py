"""System One: the wire types (request, questions, answers, usage), their limits, and the readout from probabilities
to answers (:mod:`guard.systemone.wire`); the one check a backend's answers pass before they are used
(:mod:`guard.systemone.answers`). Pure Python, no torch."""

from __future__ import annotations

from guard.systemone.wire import (
    COARSEST_DECIMALS,
    CONFIDENCE_PROFILES,
    ID_PATTERN,
    MAX_CHOICE_OPTIONS,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    MAX_QUESTIONS,
    MAX_SCORE_LEVELS,
    MIN_CHOICE_OPTIONS,
    MIN_SCORE_LEVELS,
    NOUL_DEFAULT_FALSE,
    NOUL_DEFAULT_TRUE,
    AnswerV1,
    ConfidenceProfile,
    QuestionType,
    QuestionV1,
    ReadOnlyDict,
    SystemOneRequestV1,
    SystemOneResponseV1,
    UsageV1,
    ValidationProfile,
    answer_question,
    confidence,
    sum_tolerance,
)

__all__ = [
    "COARSEST_DECIMALS",
    "CONFIDENCE_PROFILES",
    "ID_PATTERN",
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
    "confidence",
    "sum_tolerance",
]
