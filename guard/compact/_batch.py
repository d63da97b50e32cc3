"""Padding separately encoded states, questions and options into :class:`~guard.compact.head.HeadInputs`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from guard.clef.encoding import QUESTION_TYPE_IDS, render
from guard.compact.head import HeadInputs
from guard.systemone import QuestionV1

__all__ = ["QuestionEncoding", "collate", "option_texts", "question_text"]


@dataclass(frozen=True)
class QuestionEncoding:
    """One question, encoded (encoder dtype or float32).

    Attributes:
        type_id: 0 noul, 1 choice, 2 score.
        tokens: ``(Lq, H)`` token states of the rendered instructions.
        options: per option in prompt order, ``(Lo, H)`` token states of the rendered option object.
        lexical: ``(K, H)`` mean input word-piece embedding of each option.
        option_ids: option ids in prompt order.
    """

    type_id: int
    tokens: torch.Tensor
    options: tuple[torch.Tensor, ...]
    lexical: torch.Tensor
    option_ids: tuple[str, ...]


def question_text(question: QuestionV1) -> str:
    """The text encoded for a question: its rendered instructions (or id), as Clef's question span (§2.3)."""
    return render(question.instruction_value())


def option_texts(question: QuestionV1) -> list[str]:
    """The rendered option objects ``{"description":…,"option_id":…}`` in prompt order (§2.3)."""
    out = []
    for option_id, description in question.options():
        body = {"option_id": option_id}
        if description is not None:
            body["description"] = description
        out.append(render(body))
    return out


def collate(
    states: Sequence[torch.Tensor], questions: Sequence[Sequence[QuestionEncoding]], dtype: torch.dtype
) -> HeadInputs:
    """Pad a batch.

    Args:
        states: per record ``(Ls_b, H)`` state token states.
        questions: per record its questions (at least one each).
        dtype: the head's dtype.

    Returns:
        The padded :class:`HeadInputs` (masks are ``bool``).
    """
    batch = len(states)
    hidden = states[0].shape[-1]
    ls = max(s.shape[0] for s in states)
    nq = max(len(q) for q in questions)
    lq = max(e.tokens.shape[0] for q in questions for e in q)
    nk = max(len(e.options) for q in questions for e in q)
    lo = max(o.shape[0] for q in questions for e in q for o in e.options)
    state = torch.zeros(batch, ls, hidden, dtype=dtype)
    state_mask = torch.zeros(batch, ls, dtype=torch.bool)
    qtok = torch.zeros(batch, nq, lq, hidden, dtype=dtype)
    qtok_mask = torch.zeros(batch, nq, lq, dtype=torch.bool)
    qmask = torch.zeros(batch, nq, dtype=torch.bool)
    qtype = torch.zeros(batch, nq, dtype=torch.long)
    otok = torch.zeros(batch, nq, nk, lo, hidden, dtype=dtype)
    otok_mask = torch.zeros(batch, nq, nk, lo, dtype=torch.bool)
    lexical = torch.zeros(batch, nq, nk, hidden, dtype=dtype)
    omask = torch.zeros(batch, nq, nk, dtype=torch.bool)
    for b, (rows, encs) in enumerate(zip(states, questions, strict=True)):
        state[b, : rows.shape[0]] = rows
        state_mask[b, : rows.shape[0]] = True
        for j, enc in enumerate(encs):
            qmask[b, j] = True
            qtype[b, j] = enc.type_id
            qtok[b, j, : enc.tokens.shape[0]] = enc.tokens
            qtok_mask[b, j, : enc.tokens.shape[0]] = True
            lexical[b, j, : len(enc.options)] = enc.lexical
            omask[b, j, : len(enc.options)] = True
            for k, option in enumerate(enc.options):
                otok[b, j, k, : option.shape[0]] = option
                otok_mask[b, j, k, : option.shape[0]] = True
    return HeadInputs(state, state_mask, qtok, qtok_mask, qmask, qtype, otok, otok_mask, lexical, omask)


def type_id(question: QuestionV1) -> int:
    """The head's type id of a question (0 noul, 1 choice, 2 score)."""
    return QUESTION_TYPE_IDS[question.type]
