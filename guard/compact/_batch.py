"""Padding separately encoded states, questions and options into :class:`~guard.compact.head.HeadInputs`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from guard.clef.encoding import QUESTION_TYPE_IDS, render
from guard.compact.head import HeadInputs, pool_rows
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
    states: Sequence[torch.Tensor], questions: Sequence[Sequence[QuestionEncoding]], dtype: torch.dtype,
    pool: int = 1,
) -> HeadInputs:
    """Pad a batch; each distinct question (by identity) is stored once.

    Args:
        states: per record ``(Ls_b, H)`` state rows (already pooled).
        questions: per record its questions (at least one each).
        dtype: the head's dtype.
        pool: run length for the question's memory rows (:func:`~guard.compact.head.pool_rows`).

    Returns:
        The padded :class:`HeadInputs` (masks are ``bool``).
    """
    batch = len(states)
    hidden = states[0].shape[-1]
    distinct: dict[int, int] = {}
    unique: list[QuestionEncoding] = []
    for encs in questions:
        for enc in encs:
            if id(enc) not in distinct:
                distinct[id(enc)] = len(unique)
                unique.append(enc)
    ls = max(s.shape[0] for s in states)
    nq = max(len(q) for q in questions)
    lq = max(e.tokens.shape[0] for e in unique)
    nk = max(len(e.options) for e in unique)
    lo = max(o.shape[0] for e in unique for o in e.options)
    state = torch.zeros(batch, ls, hidden, dtype=dtype)
    state_mask = torch.zeros(batch, ls, dtype=torch.bool)
    index = torch.zeros(batch, nq, dtype=torch.long)
    asked = torch.zeros(batch, nq, dtype=torch.bool)
    for b, (rows, encs) in enumerate(zip(states, questions, strict=True)):
        state[b, : rows.shape[0]] = rows
        state_mask[b, : rows.shape[0]] = True
        for j, enc in enumerate(encs):
            index[b, j] = distinct[id(enc)]
            asked[b, j] = True
    u = len(unique)
    pooled = [pool_rows(e.tokens, pool) for e in unique]
    lr = max(p.shape[0] for p in pooled)
    qrows = torch.zeros(u, lr, hidden, dtype=dtype)
    qrows_mask = torch.zeros(u, lr, dtype=torch.bool)
    qtok = torch.zeros(u, lq, hidden, dtype=dtype)
    qtok_mask = torch.zeros(u, lq, dtype=torch.bool)
    qtype = torch.zeros(u, dtype=torch.long)
    otok = torch.zeros(u, nk, lo, hidden, dtype=dtype)
    otok_mask = torch.zeros(u, nk, lo, dtype=torch.bool)
    lexical = torch.zeros(u, nk, hidden, dtype=dtype)
    omask = torch.zeros(u, nk, dtype=torch.bool)
    for i, enc in enumerate(unique):
        qtype[i] = enc.type_id
        qtok[i, : enc.tokens.shape[0]] = enc.tokens
        qtok_mask[i, : enc.tokens.shape[0]] = True
        qrows[i, : pooled[i].shape[0]] = pooled[i]
        qrows_mask[i, : pooled[i].shape[0]] = True
        lexical[i, : len(enc.options)] = enc.lexical
        omask[i, : len(enc.options)] = True
        for k, option in enumerate(enc.options):
            otok[i, k, : option.shape[0]] = option
            otok_mask[i, k, : option.shape[0]] = True
    return HeadInputs(state, state_mask, index, asked, qtok, qtok_mask, qrows, qrows_mask, qtype, otok, otok_mask, lexical,
                      omask)


def type_id(question: QuestionV1) -> int:
    """The head's type id of a question (0 noul, 1 choice, 2 score)."""
    return QUESTION_TYPE_IDS[question.type]
