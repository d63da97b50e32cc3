"""``guard train`` and ``guard eval`` end to end on a tiny dataset (real encoder, no embedding cache on disk)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guard.cli import main
from tests.compact.conftest import injection_records, tool_call_records, write_jsonl


def test_train_then_eval_a_router(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"utt": t, "intent": label} for label, texts in {
        "billing": ["refund my payment", "invoice is wrong", "charged twice", "update my card"],
        "tech": ["app crashes", "cannot log in", "error on upload", "page is blank"],
    }.items() for t in texts]
    data = write_jsonl(tmp_path / "intents.jsonl", rows)
    out = tmp_path / "router"
    code = main(["train", str(data), "--out", str(out), "--text-field", "utt", "--label-field", "intent",
                 "--question-id", "support.queue", "--epochs", "2", "--width", "32", "--no-cache", "--no-progress",
                 "--val-fraction", "0.25"])
    assert code == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["kind"] == "router" and trained["train_records"] == 6 and trained["val_records"] == 2
    assert (out / "joint_head.safetensors").exists()

    report_path = tmp_path / "report.json"
    code = main(["eval", str(data), "--backend", f"compact:{out}", "--text-field", "utt", "--label-field", "intent",
                 "--question-id", "support.queue", "--json", str(report_path), "--no-progress"])
    assert code == 0
    table = capsys.readouterr().out
    assert "support.queue" in table and "p50_ms" in table
    report = json.loads(report_path.read_text())
    metrics = report["questions"]["support.queue"]
    assert metrics["n"] == 8 and 0.0 <= metrics["accuracy"] <= 1.0 and "macro_f1" in metrics
    assert set(report["latency_ms"]) == {"p50_ms", "p95_ms", "p99_ms"}

    # An eval file holding some of the trained labels asks the router its own options: it was refused whole (its
    # choice question had only the file's labels).
    billing = write_jsonl(tmp_path / "billing.jsonl", [row for row in rows if row["intent"] == "billing"])
    code = main(["eval", str(billing), "--backend", f"compact:{out}", "--text-field", "utt", "--label-field",
                 "intent", "--question-id", "support.queue", "--json", str(report_path), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert json.loads(report_path.read_text())["questions"]["support.queue"]["n"] == 4
    capsys.readouterr()

    # A label the router was not trained on is a bad line of the file, named with its place.
    other = write_jsonl(tmp_path / "other.jsonl", [*rows, {"utt": "where is my parcel", "intent": "shipping"}])
    code = main(["eval", str(other), "--backend", f"compact:{out}", "--text-field", "utt", "--label-field", "intent",
                 "--question-id", "support.queue", "--json", str(report_path), "--no-progress"])
    assert code == 2
    assert capsys.readouterr().err == (f"guard eval: {other}:9: label 'shipping' is not one of the 2 options of "
                                       "'support.queue' ('billing', 'tech')\n")


def test_train_catalog_records_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{**row, "source": f"src{n % 2}", "fold": f"f{n % 2}"} for n, row in enumerate(injection_records())]
    data = write_jsonl(tmp_path / "t.jsonl", rows)
    out = tmp_path / "ck"
    assert main(["train", str(data), "--out", str(out), "--epochs", "1", "--fold-share", "1", "--window", "64",
                 "--overlap", "16", "--no-progress"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["kind"] == "catalog" and set(trained["heldout"]["by_fold"]["guard.prompt_injection"]) == {"f0", "f1"}
    assert (out / "catalog_head.safetensors").exists()
    report_path = tmp_path / "report.json"
    assert main(["eval", str(data), "--backend", f"compact:{out}", "--by", "source", "--json", str(report_path),
                 "--no-progress"]) == 0
    assert "src0" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert report["by"] == "source" and set(report["groups"]) == {"src0", "src1"}
    assert report["groups"]["src0"]["guard.prompt_injection"]["n"] == 8
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert main(["train", str(bad), "--out", str(out), "--no-progress"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert main(["eval", str(bad), "--no-progress"]) == 2
    assert main(["train", str(data), "--out", str(out), "--head-epochs", "2", "--head-questions",
                 "guard.refusal, guard.refusals", "--no-progress"]) == 2
    assert "head_questions ['guard.refusals'] are not catalog questions" in capsys.readouterr().err


def test_ground_refits_the_tool_call_grounding_of_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    from guard.compact.model import CompactModel

    one_source = write_jsonl(tmp_path / "one.jsonl", [{**row, "source": "suite0"} for row in tool_call_records()])
    two_sources = write_jsonl(tmp_path / "two.jsonl", tool_call_records())
    trained, grounded = tmp_path / "ck", tmp_path / "grounded"
    common = ["--no-progress", "--window", "64", "--overlap", "16"]
    assert main(["train", str(one_source), "--val", str(one_source), "--out", str(trained), "--epochs", "1",
                 "--no-folds", *common]) == 0
    assert json.loads(capsys.readouterr().out)["grounding"] == {}  # one source: nothing to hold out
    assert main(["train", str(two_sources), "--val", str(two_sources), "--ground", str(trained), "--out",
                 str(grounded), "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == 32 and set(report["grounding"]["by_source"]) == {"suite0", "suite1"}
    model = CompactModel.load(grounded, runtime="torch")
    assert model.questions["guard.tool_call_serves_task"].grounding is not None
    assert model.meta["report"]["grounding"] == report["grounding"]
    # the training report of the checkpoint describes the grounded answer: no temperature, val not held out
    assert "guard.tool_call_serves_task" not in model.meta["report"]["temperatures"]
    assert model.meta["report"]["val"]["guard.tool_call_serves_task"]["held_out"] is False
    for extra, error in ((["--clef", str(trained)], "--ground refits"), ([], "two sources")):
        data = one_source if not extra else two_sources
        assert main(["train", str(data), "--val", str(data), "--ground", str(trained), "--out",
                     str(tmp_path / "x"), "--no-progress", *extra]) == 2
        assert error in capsys.readouterr().err
    assert main(["train", str(two_sources), "--ground", str(tmp_path / "missing"), "--out", str(tmp_path / "x"),
                 "--no-progress"]) == 2
    assert "--ground" in capsys.readouterr().err
    assert main(["train", str(two_sources), "--ground", str(grounded), "--out", str(tmp_path / "x"),
                 "--no-progress"]) == 2
    assert "already grounded" in capsys.readouterr().err


def test_fold_models_are_refused_where_there_are_none_and_for_fold_names_that_are_not_folder_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{**row, "source": "src", "fold": "../escape" if n % 2 else "f0"}
            for n, row in enumerate(injection_records())]
    data = write_jsonl(tmp_path / "t.jsonl", rows)
    out, folds = tmp_path / "ck", tmp_path / "folds"
    base = ["train", str(data), "--out", str(out), "--fold-models", str(folds), "--no-progress"]
    assert main([*base, "--no-folds"]) == 2
    assert "cannot go with --no-folds" in capsys.readouterr().err
    assert main([*base, "--kind", "router"]) == 2
    assert "applies to catalog training" in capsys.readouterr().err
    assert main(base) == 2
    assert "fold names ['../escape'] cannot name a folder" in capsys.readouterr().err
    assert not folds.exists() and not (tmp_path / "escape").exists() and not out.exists()


def test_output_paths_are_checked_before_the_work_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An evaluation or a training run ended in a traceback at its very end (results lost) when --json named a
    folder or --out a file; such paths are refused at once, as are schema outputs that cannot be written."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello", "label": true, "question_id": "guard.prompt_injection"}\n')
    assert main(["eval", str(data), "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    afile = tmp_path / "a.txt"
    afile.write_text("keep")
    assert main(["train", str(data), "--out", str(afile)]) == 2
    assert "not a directory" in capsys.readouterr().err and afile.read_text() == "keep"
    assert main(["train", str(data), "--out", str(afile / "below")]) == 2
    assert "cannot be made below it" in capsys.readouterr().err
    assert main(["policy", "schema", "--output", str(tmp_path / "missing" / "s.json")]) == 2
    assert "No such file" in capsys.readouterr().err
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe")
    assert main(["policy", "schema", "--check", str(binary)]) == 1
    assert "not UTF-8" in capsys.readouterr().err
    assert main(["quickstart", "--limit", "-1"]) == 2
    assert "--limit must be a positive" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["eval", "d.jsonl", "--tpr", "2"], ["eval", "d.jsonl", "--tpr", "nan"], ["eval", "d.jsonl", "--threads", "0"],
    ["eval", "d.jsonl", "--timeout", "-1"], ["train", "d.jsonl", "--out", "o", "--val-fraction", "2"],
    ["proxy", "--policy", "p.yaml", "--upstream", "http://x:1", "--canary-interval", "nan"],
    ["proxy", "--policy", "p.yaml", "--upstream", "http://x:1", "--reload-interval", "-1"],
    ["train", "d.jsonl", "--out", "o", "--lr", "-0.001"], ["train", "d.jsonl", "--out", "o", "--lr", "0"],
    ["train", "d.jsonl", "--out", "o", "--lr", "nan"], ["train", "d.jsonl", "--out", "o", "--layer-lr", "-0.0001"],
    ["train", "d.jsonl", "--out", "o", "--layer-lr", "nan"], ["train", "d.jsonl", "--out", "o", "--layer-lr", "inf"],
    ["train", "d.jsonl", "--out", "o", "--epochs", "0"], ["train", "d.jsonl", "--out", "o", "--batch-size", "0"],
    ["train", "d.jsonl", "--out", "o", "--patience", "0"], ["train", "d.jsonl", "--out", "o", "--width", "0"],
    ["train", "d.jsonl", "--out", "o", "--head-epochs", "-1"], ["train", "d.jsonl", "--out", "o", "--overlap", "-1"],
    ["train", "d.jsonl", "--out", "o", "--label-smoothing", "1"],
    ["train", "d.jsonl", "--out", "o", "--brier-weight", "-1"],
    ["train", "d.jsonl", "--out", "o", "--ordinal-weight", "nan"],
    ["train", "d.jsonl", "--out", "o", "--outside-rate", "2"], ["train", "d.jsonl", "--out", "o", "--fold-share", "0"],
    ["train", "d.jsonl", "--out", "o", "--source-balance", "-0.5"],
])  # fmt: skip
def test_numbers_out_of_their_range_are_usage_errors_naming_the_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """They were accepted: --canary-interval nan and --reload-interval -1 turned the feature off, --tpr 2 and
    --threads 0 failed late or not at all; train's --epochs 0 and the like failed after the data was read, naming
    the config field (batch_size), or were taken (--label-smoothing 1, --brier-weight -1, --clef --epochs 0)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and f"argument {argv[-2]}" in capsys.readouterr().err


def test_records_of_one_fold_are_refused_before_training_and_unlabelled_ones_warn(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """All records in one fold failed after encoding with "Sample larger than population or is negative"."""
    rows = [{**row, "source": "src", "fold": "f0"} for row in injection_records()]
    unlabelled = {k: v for k, v in rows[0].items() if k != "labels"}
    data = write_jsonl(tmp_path / "one.jsonl", [*rows, unlabelled])
    out = tmp_path / "ck"
    assert main(["train", str(data), "--out", str(out), "--epochs", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'f0'" in err and "at least two" in err and "--no-folds" in err and "Sample larger" not in err
    assert f"{data}:{len(rows) + 1}" in err and "not trained on" in err
    assert not out.exists()


def test_a_question_outside_the_catalog_names_the_first_record_that_asks_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = injection_records()
    rows[3] = {**rows[3], "questions": {"guard.nosuch": {"type": "noul", "instructions": "x"}},
               "labels": {"guard.nosuch": "true"}}
    data = write_jsonl(tmp_path / "q.jsonl", rows)
    assert main(["train", str(data), "--out", str(tmp_path / "ck"), "--no-folds", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "['guard.nosuch']" in err and f"{data}:4" in err


def test_out_is_refused_when_it_holds_files_that_are_not_a_compact_checkpoint_of_the_same_kind(
        tmp_path: Path, golden_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--out over a Clef checkpoint overwrote its joint head (breaking it); --clef kept the files already in --out
    and wrote its head beside them (a mismatched checkpoint). Only a compact checkpoint of the same kind is replaced."""
    rows = [{"text": t, "label": label} for label, texts in {"a": ["one", "two"], "b": ["three", "four"]}.items()
            for t in texts]
    data = write_jsonl(tmp_path / "intents.jsonl", rows)
    clef = tmp_path / "clef"
    clef.mkdir()
    for item in golden_checkpoint.iterdir():
        (clef / item.name).write_bytes(item.read_bytes())
    before = {item.name: item.read_bytes() for item in clef.iterdir()}
    base = ["train", str(data), "--no-progress", "--no-cache", "--epochs", "1", "--val-fraction", "0.5"]
    assert main([*base, "--out", str(clef)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main([*base, "--clef", str(clef), "--out", str(clef)]) == 2
    assert "is the --clef checkpoint" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "joint_head_config.json").write_text("{}")
    assert main([*base, "--clef", str(clef), "--out", str(other)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert {item.name: item.read_bytes() for item in clef.iterdir()} == before
    assert [item.name for item in other.iterdir()] == ["joint_head_config.json"]
    catalog = tmp_path / "catalog"
    catalog.mkdir()
    (catalog / "compact_config.json").write_text('{"kind": "catalog"}')
    assert main([*base, "--out", str(catalog)]) == 2
    assert "holds a compact catalog checkpoint; a router is not written over it" in capsys.readouterr().err
    assert main([*base, "--ground", str(catalog), "--out", str(clef)]) == 2
    assert "is not empty" in capsys.readouterr().err
    router = tmp_path / "router"
    for _ in range(2):  # the second run replaces the first's checkpoint
        assert main([*base, "--width", "16", "--out", str(router)]) == 0
    assert json.loads((router / "compact_config.json").read_text())["kind"] == "router"


def test_clef_device_and_checkpoint_problems_are_usage_errors(
        tmp_path: Path, golden_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--clef with --device cdua, --device cuda on a torch without CUDA, or a checkpoint whose joint head config
    lacks hidden_size ended in a traceback."""
    import torch

    data = write_jsonl(tmp_path / "r.jsonl", [{"state": "alpha", "questions": {
        "flag": {"type": "noul", "instructions": "Is it alpha?"}}, "labels": {"flag": True}}])
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for item in golden_checkpoint.iterdir():
        (damaged / item.name).write_bytes(item.read_bytes())
    (damaged / "joint_head_config.json").write_text("{}")
    base = ["train", str(data), "--val", str(data), "--no-progress", "--epochs", "1", "--out", str(tmp_path / "o")]
    assert main([*base, "--clef", str(golden_checkpoint), "--device", "cdua"]) == 2
    assert capsys.readouterr().err == "guard train: --device 'cdua': expected cpu, cuda or cuda:N\n"
    if not torch.cuda.is_available():
        assert main([*base, "--clef", str(golden_checkpoint), "--device", "cuda"]) == 2
        assert "--device cuda: this torch build has no CUDA device" in capsys.readouterr().err
    assert main([*base, "--device", "cpu"]) == 2
    assert "--device applies only to --clef" in capsys.readouterr().err
    assert main([*base, "--clef", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert err == f"guard train: --clef: {damaged / 'joint_head_config.json'}: joint head config must set hidden_size\n"
    (damaged / "joint_head_config.json").write_text((golden_checkpoint / "joint_head_config.json").read_text())
    (damaged / "joint_head.safetensors").write_bytes(b"not safetensors")
    assert main([*base, "--clef", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert f"guard train: --clef {damaged}: " in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    # an error of the data is not the checkpoint's: it was prefixed "--clef DIR:"
    unlabelled = write_jsonl(tmp_path / "u.jsonl", [{"state": "alpha", "questions": {
        "flag": {"type": "noul", "instructions": "Is it alpha?"}}}])
    assert main(["train", str(unlabelled), "--val", str(unlabelled), "--no-progress", "--epochs", "1", "--out",
                 str(tmp_path / "o"), "--clef", str(golden_checkpoint)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "guard train: no labelled question in the training records"


def test_an_empty_validation_split_is_refused(
        tmp_path: Path, golden_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Four records at --val-fraction 0.1 held none out, and an empty --val file held none: the validation loss was
    NaN, written as NaN (not JSON) into the report and compact_config.json (also with --clef). A subnormal fraction
    ended in an OverflowError traceback."""
    data = write_jsonl(tmp_path / "few.jsonl", [{"text": t, "label": t[0]} for t in ("aa", "ab", "ba", "bb")])
    out = tmp_path / "o"
    base = ["train", str(data), "--out", str(out), "--no-cache", "--no-progress", "--epochs", "1"]
    assert main(base) == 2
    assert capsys.readouterr().err == ("guard train: the validation split is empty (4 records, --val-fraction 0.1): "
                                       "give --val or at least 10 records\n")
    assert main([*base, "--val-fraction", "1e-320"]) == 2
    assert capsys.readouterr().err == ("guard train: the validation split is empty (4 records, --val-fraction "
                                       "1e-320): give --val or a larger --val-fraction\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for extra in ([], ["--clef", str(golden_checkpoint)]):
        assert main([*base, "--val", str(empty), *extra]) == 2
        assert capsys.readouterr().err == f"guard train: --val {empty}: holds no records\n"
    assert not out.exists()


@pytest.mark.parametrize("command", [["eval", "d.jsonl"], ["train", "d.jsonl", "--out", "o"]])
@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_question_id_is_a_usage_error(command: list[str], value: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--question-id "" was taken: every record asked a question with an empty id."""
    with pytest.raises(SystemExit) as info:
        main([*command, "--question-id", value])
    assert info.value.code == 2
    assert f"argument --question-id: {value!r} is empty; give a name" in capsys.readouterr().err
