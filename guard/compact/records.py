"""Labelled JSONL records: what ``guard train`` learns from and ``guard eval`` scores.

Two line formats are read:

* **System One records** (any question type)::

      {"state": <JSON>, "questions": {"<id>": {"type": ..., "instructions": ..., "criteria": ...}},
       "labels": {"<id>": <label>}}

  A noul label is ``"true"``/``"false"`` (or a JSON boolean, or 1/0), a choice label an option id, a score label the
  0-based level index (an integer or its string). Questions without a label are asked but not scored.
* **Text/label lines** for routing over the user's own labels: ``{"text": "...", "label": "..."}`` (field names are
  options of :func:`load_records`); they become one ``choice`` question whose options are all labels seen.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.errors import RequestValidationError
from guard.systemone import QuestionV1, SystemOneRequestV1

__all__ = ["LabelledRecord", "label_index", "load_records", "router_records"]


@dataclass(frozen=True)
class LabelledRecord:
    """One labelled request.

    Attributes:
        request: the validated System One request (``reference`` profile).
        labels: question id -> label index in the question's **prompt** option order (§2.2).
        record_id: the line's ``id`` or ``<file>:<line>``.
        source: the line's ``source`` (where the record came from; ``""`` when absent), for per-source reports.
        fold: the line's ``fold`` (its leave-one-source-group-out fold; ``""`` when absent).
    """

    request: SystemOneRequestV1
    labels: dict[str, int]
    record_id: str
    source: str = ""
    fold: str = ""


def label_index(question: QuestionV1, label: Any) -> int:
    """The prompt-order option index of ``label`` for ``question``.

    Raises:
        ValueError: when the label is not one of the question's options.
    """
    ids = [option_id for option_id, _ in question.options()]
    if question.type == "noul":
        if isinstance(label, bool):
            label = "true" if label else "false"
        elif label in (0, 1) and not isinstance(label, str):
            label = "true" if label == 1 else "false"
    elif question.type == "score" and isinstance(label, (int, float)) and not isinstance(label, bool):
        if float(label) != int(label):
            raise ValueError(f"score label {label!r} of question {question.id!r} must be a level index")
        label = str(int(label))
    if not isinstance(label, str) or label not in ids:
        raise ValueError(f"label {label!r} of question {question.id!r} is not one of its options {ids}")
    return ids.index(label)


def load_records(path: str | Path, *, text_field: str = "text", label_field: str = "label",
                 question_id: str = "route", instructions: str | None = None) -> list[LabelledRecord]:
    """Read labelled JSONL in either format (decided per file by the first line).

    Args:
        path: the JSONL file.
        text_field, label_field: field names of text/label lines.
        question_id, instructions: the choice question built for text/label lines.

    Raises:
        ValueError: naming the file and line of a malformed line, an invalid request or an unknown label.
    """
    source = Path(path)
    lines = [(n, line) for n, line in enumerate(source.read_text(encoding="utf-8").split("\n"), 1) if line.strip()]
    rows: list[tuple[int, Any]] = []
    for number, line in lines:
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{number}: not valid JSON ({exc.msg})") from exc
    if rows and isinstance(rows[0][1], Mapping) and "questions" not in rows[0][1]:
        return router_records(source, rows, text_field, label_field, question_id, instructions)
    out = []
    for number, row in rows:
        where = f"{source}:{number}"
        if not isinstance(row, Mapping) or "questions" not in row:
            raise ValueError(f"{where}: a System One record needs 'state', 'questions' and 'labels'")
        try:
            request = SystemOneRequestV1.from_json(
                {"model": "guard-train", "state": row.get("state"), "questions": row["questions"]}, profile="reference"
            )
        except RequestValidationError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        labels_raw = row.get("labels") or {}
        if not isinstance(labels_raw, Mapping):
            raise ValueError(f"{where}: 'labels' must be an object keyed by question id")  # noqa: TRY004 - a bad line of the file, not a bad argument
        labels = {}
        for qid, label in labels_raw.items():
            try:
                labels[qid] = label_index(request.question(qid), label)
            except KeyError:
                raise ValueError(f"{where}: label for unknown question {qid!r}") from None
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
        out.append(LabelledRecord(request, labels, str(row.get("id", where)), str(row.get("source") or ""),
                                  str(row.get("fold") or "")))
    return out


def router_records(source: Path, rows: Sequence[tuple[int, Any]], text_field: str, label_field: str,
                   question_id: str, instructions: str | None) -> list[LabelledRecord]:
    """Text/label lines -> one ``choice`` question over every label seen (options sorted, no descriptions)."""
    pairs = []
    for number, row in rows:
        if not isinstance(row, Mapping) or not isinstance(row.get(text_field), str) or row.get(label_field) is None:
            raise ValueError(f"{source}:{number}: needs a string {text_field!r} and a {label_field!r}")
        pairs.append((row[text_field], str(row[label_field]), str(row.get("id", f"{source}:{number}"))))
    labels = sorted({label for _, label, _ in pairs})
    if len(labels) < 2:
        raise ValueError(f"{source}: a router needs at least 2 labels, found {labels}")
    question = {"type": "choice", "instructions": instructions or question_id, "criteria": dict.fromkeys(labels)}
    out = []
    for text, label, rid in pairs:
        request = SystemOneRequestV1.from_json(
            {"model": "guard-train", "state": text, "questions": {question_id: question}}, profile="reference"
        )
        out.append(LabelledRecord(request, {question_id: labels.index(label)}, rid))
    return out
