"""Labelled JSONL records: what ``guard train`` learns from and ``guard eval`` scores.

Two line formats are read:

* **System One records** (any question type)::

      {"state": <JSON>, "questions": {"<id>": {"type": ..., "instructions": ..., "criteria": ...}},
       "labels": {"<id>": <label>}}

  A noul label is ``"true"``/``"false"`` (or a JSON boolean, or 1/0), a choice label an option id, a score label the
  0-based level index (an integer or its string). Questions without a label are asked but not scored; a record
  without any (``labels`` missing, ``null`` or ``{}``) is read, and ``guard train`` and ``guard eval`` warn about it
  naming its ``file:line``. Optional ``id``, ``source`` and ``fold``; other keys are not read, but one near a read
  key (``lables``) is refused (:data:`RECORD_KEYS`).
* **Text/label lines** for routing over the user's own labels: ``{"text": "...", "label": "..."}`` (field names are
  options of :func:`load_records`); they become one ``choice`` question whose options are all labels seen, or the
  labels given (a trained router's, when ``guard eval`` scores one).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard import _json
from guard._readfile import FileRefused, read_capped
from guard.errors import InvalidJson, RequestValidationError
from guard.systemone import QuestionV1, SystemOneRequestV1

__all__ = ["MAX_RECORDS_BYTES", "LabelledRecord", "label_index", "load_records", "read_records_file",
           "router_records"]

MAX_RECORDS_BYTES = 1 << 30
"""Largest labelled JSONL file read (1 GiB; the compact model's whole training set is 16 MB)."""

RECORD_KEYS = ("id", "state", "questions", "labels", "source", "fold")
"""The keys of a System One record line that are read. Other keys are kept out of the way (a record may carry its
own metadata), except one that looks like a misspelling of these (``lables``, ``label``, ``folds``): it is refused
with the key it is near, as a policy's unknown key is, because the record would silently lose what it meant to say
(an unlabelled record is not trained on or scored)."""


@dataclass(frozen=True)
class LabelledRecord:
    """One labelled request.

    Attributes:
        request: the validated System One request (``reference`` profile).
        labels: question id -> label index in the question's **prompt** option order (§2.2).
        record_id: the line's ``id`` or ``<file>:<line>``.
        source: the line's ``source`` (where the record came from; ``""`` when absent), for per-source reports.
        fold: the line's ``fold`` (its leave-one-source-group-out fold; ``""`` when absent).
        where: ``<file>:<line>`` of the record (``""`` when it was not read from a file).
    """

    request: SystemOneRequestV1
    labels: dict[str, int]
    record_id: str
    source: str = ""
    fold: str = ""
    where: str = ""


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
                 question_id: str = "route", instructions: str | None = None,
                 labels: Sequence[str] = ()) -> list[LabelledRecord]:
    """Read labelled JSONL in either format (decided per file by the first line).

    Args:
        path: the JSONL file.
        text_field, label_field: field names of text/label lines.
        question_id, instructions: the choice question built for text/label lines.
        labels: that question's options (a trained router's labels, so a file holding only some of them asks the
            router what it was trained on); empty: every label the file holds.

    Each line is read as strict JSON (:func:`guard._json.loads`: UTF-8, no duplicate keys, at most 64 levels deep, no
    lone surrogates, finite numbers of bounded length), as ``guard decide`` reads a request.

    Raises:
        ValueError: naming the file and line of a malformed line, an invalid request, a record without a state or an
            unknown label (one not in ``labels``); naming the file when it cannot be read, is not a regular file or is
            larger than :data:`MAX_RECORDS_BYTES`.
    """
    source = Path(path)
    rows: list[tuple[int, Any]] = []
    for number, line in enumerate(read_records_file(source).split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append((number, _json.loads(line)))
        except InvalidJson as exc:
            detail = str(exc).removeprefix("invalid JSON: ")
            raise ValueError(f"{source}:{number}: not valid JSON ({detail})") from None
    if rows and isinstance(rows[0][1], Mapping) and "questions" not in rows[0][1]:
        return router_records(source, rows, text_field, label_field, question_id, instructions, labels)
    out = []
    for number, row in rows:
        where = f"{source}:{number}"
        if not isinstance(row, Mapping) or "questions" not in row:
            raise ValueError(f"{where}: a System One record needs 'state', 'questions' and 'labels'")
        for key in row:
            if key not in RECORD_KEYS and (near := _near_key(str(key))):
                raise ValueError(f"{where}: unknown key {key!r}; did you mean {near!r}? (the keys read are "
                                 f"{', '.join(RECORD_KEYS)})")
        if row.get("state") is None:
            raise ValueError(f"{where}: the record has no 'state' (missing or null): nothing to judge")
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
                                  str(row.get("fold") or ""), where))
    return out


def _near_key(key: str) -> str | None:
    """The read record key that ``key`` (not one of them) looks like a misspelling of, if any: the same but for
    case, or close to one of the longer keys (``id`` is too short to tell ``idx`` from a typo)."""
    folded = key.casefold()
    if folded in RECORD_KEYS:
        return folded
    near = difflib.get_close_matches(folded, [k for k in RECORD_KEYS if len(k) > 2], n=1, cutoff=0.8)
    return near[0] if near else None


def read_records_file(path: str | Path) -> bytes:
    """The bytes of the labelled JSONL file at ``path``: a regular file of at most :data:`MAX_RECORDS_BYTES`, checked
    before it is read (:func:`guard._readfile.read_capped`), so a FIFO, a device (``/dev/zero``) or a huge file
    costs no wait and no memory.

    Raises:
        ValueError: naming the file: it cannot be opened, is not a regular file, or is too large.
    """
    try:
        return read_capped(path, MAX_RECORDS_BYTES)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read file: {exc.strerror}") from None
    except FileRefused as exc:
        if exc.kind:
            raise ValueError(f"{path}: cannot read file: {exc}") from None
        raise ValueError(f"{path}: {exc} (split it into several files)") from None


def router_records(source: Path, rows: Sequence[tuple[int, Any]], text_field: str, label_field: str,
                   question_id: str, instructions: str | None, options: Sequence[str] = ()) -> list[LabelledRecord]:
    """Text/label lines -> one ``choice`` question over ``options``, or every label seen when empty (sorted, no
    descriptions).

    A label is a non-empty string (an option id): ``1`` and ``"1"`` or ``true`` and ``"True"`` would otherwise be one
    option, and an object or array no option id at all. With ``options``, a label outside them is refused naming its
    line.
    """
    pairs = []
    for number, row in rows:
        where = f"{source}:{number}"
        label = row.get(label_field) if isinstance(row, Mapping) else None
        if not isinstance(row, Mapping) or not isinstance(row.get(text_field), str) or not isinstance(label, str) \
                or not label:
            got = "" if not isinstance(row, Mapping) or label_field not in row else \
                f"; its {label_field!r} is {_json.dumps(row[label_field])[:80]}"
            raise ValueError(f"{where}: needs a string {text_field!r} and a non-empty string {label_field!r}{got}")
        pairs.append((row[text_field], label, str(row.get("id", where)), where))
    labels = sorted(options or {label for _, label, _, _ in pairs})
    if len(labels) < 2:
        raise ValueError(f"{source}: a router needs at least 2 labels, found {labels}")
    known = set(labels)
    for _, label, _, where in pairs:
        if label not in known:  # only with options: every label seen is one of them
            shown = ", ".join(map(repr, labels[:10])) + (", ..." if len(labels) > 10 else "")
            raise ValueError(f"{where}: label {label!r} is not one of the {len(labels)} options of {question_id!r} "
                             f"({shown})")
    question = {"type": "choice", "instructions": instructions or question_id, "criteria": dict.fromkeys(labels)}
    out = []
    for text, label, rid, where in pairs:
        request = SystemOneRequestV1.from_json(
            {"model": "guard-train", "state": text, "questions": {question_id: question}}, profile="reference"
        )
        out.append(LabelledRecord(request, {question_id: labels.index(label)}, rid, where=where))
    return out
