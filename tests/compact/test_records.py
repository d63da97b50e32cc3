from __future__ import annotations

from pathlib import Path

import pytest

from guard.compact.records import label_index, load_records
from guard.systemone import QuestionV1
from tests.compact.conftest import write_jsonl


def test_label_forms() -> None:
    noul = QuestionV1("q", "noul")
    assert [label_index(noul, v) for v in ("true", "false", True, False, 1, 0)] == [0, 1, 0, 1, 0, 1]
    score = QuestionV1("s", "score", criteria=["a", "b", "c"])
    assert label_index(score, 2) == 2 and label_index(score, "1") == 1
    choice = QuestionV1("c", "choice", criteria={"z": None, "a": None})
    assert label_index(choice, "z") == 1  # prompt order is sorted
    with pytest.raises(ValueError, match="not one of its options"):
        label_index(choice, "b")
    with pytest.raises(ValueError, match="level index"):
        label_index(score, 1.5)


def test_text_label_lines_become_one_choice_question(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [{"utt": "hi", "intent": "greet"}, {"utt": "bye", "intent": "leave"}])
    records = load_records(path, text_field="utt", label_field="intent", question_id="r")
    assert records[0].request.questions[0].option_ids() == ["greet", "leave"]
    assert records[1].labels == {"r": 1}


def test_text_label_lines_take_the_options_given(tmp_path: Path) -> None:
    """A trained router's labels: a file holding one of them still asks all three."""
    path = write_jsonl(tmp_path / "x.jsonl", [{"text": "hi", "label": "greet"}])
    (record,) = load_records(path, question_id="r", labels=("greet", "leave", "oos"))
    assert record.request.questions[0].option_ids() == ["greet", "leave", "oos"] and record.labels == {"r": 0}
    with pytest.raises(ValueError, match=r"x.jsonl:1: label 'greet' is not one of the 2 options of 'r' \('a', 'b'\)"):
        load_records(path, question_id="r", labels=("b", "a"))


def test_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"state": "x", "questions": {"q": {"type": "noul"}}, "labels": {"q": "maybe"}}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: label 'maybe'"):
        load_records(bad)
    bad.write_text('{"state": "x", "questions": {"q": {"type": "noul"}}, "labels": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_records(bad)
    bad.write_text('{"text": "x", "label": "a"}\n')
    with pytest.raises(ValueError, match="at least 2 labels"):
        load_records(bad)


@pytest.mark.parametrize(("key", "near"), [("lables", "labels"), ("label", "labels"), ("folds", "fold"),
                                           ("sources", "source")])
def test_a_misspelled_record_key_is_refused_with_the_key_it_is_near(key: str, near: str, tmp_path: Path) -> None:
    """A misspelled ``labels`` made the record an unlabelled one: silently dropped by guard train and not scored by
    guard eval."""
    row = {"state": "x", "questions": {"q": {"type": "noul"}}, "labels": {"q": "true"}}
    path = write_jsonl(tmp_path / "k.jsonl", [row, {**row, key: row["labels"]}])
    with pytest.raises(ValueError, match=rf"k.jsonl:2: unknown key '{key}'; did you mean '{near}'\?"):
        load_records(path)


def test_other_record_fields_are_kept_out_of_the_way(tmp_path: Path) -> None:
    row = {"state": "x", "questions": {"q": {"type": "noul"}}, "labels": {"q": "true"}, "lang": "en", "notes": "n"}
    (record,) = load_records(write_jsonl(tmp_path / "k.jsonl", [row]))
    assert record.labels == {"q": 0}
