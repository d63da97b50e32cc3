from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from guard.compact.catalog import CATALOG
from guard.compact.data import FOLDS, build_splits, write_splits
from guard.compact.model import state_text

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def splits():  # type: ignore[no-untyped-def]
    return build_splits(DATA)


def _question(row: dict[str, Any]) -> str:
    (qid,) = row["questions"]
    return qid


def test_twins_and_tasks_never_straddle_the_split(splits) -> None:  # type: ignore[no-untyped-def]
    def groups(rows: list[dict[str, Any]]) -> set[str]:
        pairs = [r["id"].rsplit("-", 1) for r in rows if "authored" in r["source"]]
        return {pair for pair, label in pairs if label in ("attack", "benign", "harmful")}  # a pair's two records

    train = groups(splits.train)
    for rows in splits.test.values():
        assert not train & groups(rows)
    tasks = {r["id"] for r in splits.train if r["source"].startswith("agentdojo")}
    assert tasks  # the tool-call pairs are split by task; their ids name the pair, not the task
    assert "guard.tool_call_serves_task" in {_question(r) for r in splits.test["tool_call_serves_task"]}


def test_every_source_of_a_question_is_in_one_named_fold(splits) -> None:  # type: ignore[no-untyped-def]
    rows = [*splits.train, *splits.val, *(r for rs in splits.test.values() for r in rs)]
    folds: dict[tuple[str, str], set[str]] = {}
    for row in rows:
        folds.setdefault((_question(row), row["source"]), set()).add(row["fold"])
    for (qid, source), names in folds.items():
        assert len(names) == 1 or qid in ("guard.refusal", "guard.harm_severity"), (qid, source, names)
        if FOLDS[qid] and qid != "guard.harm_severity":
            assert any(source == s or s.startswith(source + ":") or source.startswith(s)
                       for sources in FOLDS[qid].values() for s in sources), (qid, source)
    per_question = Counter((_question(r), r["fold"]) for r in rows)
    for qid in CATALOG:
        assert {f for q, f in per_question if q == qid} == {"f0", "f1", "f2", "f3", "f4"}, qid


def test_metadata_fields_are_on_both_classes(splits) -> None:  # type: ignore[no-untyped-def]
    with_route = Counter(
        r["labels"][_question(r)] for r in splits.train
        if _question(r) == "guard.prompt_injection" and isinstance(r["state"], dict) and "route" in r["state"]
    )
    assert with_route["true"] > 50 and with_route["false"] > 50


def test_the_text_view_of_every_record_is_nonempty(splits) -> None:  # type: ignore[no-untyped-def]
    for row in splits.train[:2000]:
        assert state_text(row["state"], CATALOG[_question(row)].view).strip()


def test_splits_are_deterministic_and_written(splits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    again = build_splits(DATA)
    assert [r["id"] for r in again.train] == [r["id"] for r in splits.train]
    counts = write_splits(splits, tmp_path)
    assert counts["train.jsonl"] == len(splits.train)
    first = json.loads((tmp_path / "train.jsonl").read_text().split("\n", 1)[0])
    assert {"id", "state", "questions", "labels", "source", "fold"} <= set(first)
    assert {"prompt_injection", "harmful_request", "harm_severity", "tool_call_serves_task", "refusal",
            "prompt_injection_long"} <= set(splits.test)


def test_the_contrast_sets_leave_every_other_record_as_it_was(splits, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from guard.compact import data

    contrast = {relative.removesuffix(".jsonl") for relative, _, _ in data.CONTRAST_SETS}
    monkeypatch.setattr(data, "CONTRAST_SETS", ())
    without = build_splits(DATA)

    def others(s: Any) -> list[str]:
        rows = [*s.train, *s.val, *(r for name in sorted(s.test) for r in s.test[name])]
        return [json.dumps(r, sort_keys=True) for r in rows if r["source"] not in contrast]

    assert others(splits) == others(without)
    added = Counter((r["source"], _question(r)) for r in splits.train if r["source"] in contrast)
    assert added[("harmful_requests/authored_twins", "guard.harmful_request")] > 1000
    assert added[("benign_requests/authored_hard_benign", "guard.prompt_injection")] > 400
    assert added[("benign_requests/authored_hard_benign", "guard.harmful_request")] > 400
