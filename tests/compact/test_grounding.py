"""Argument grounding of ``guard.tool_call_serves_task``: the features, the stacked fit leave one source out, the
checkpoint round trip and the training stage that fits it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from guard.compact import grounding
from guard.compact.catalog import CATALOG
from guard.compact.finetune import FinetuneConfig, ground, train_catalog
from guard.compact.grounding import FEATURES, QUESTION, Grounding, call_features
from guard.compact.head import CatalogHead
from guard.compact.model import CompactModel, state_text
from guard.compact.records import load_records
from guard.systemone import SystemOneRequestV1
from tests.compact.conftest import injection_records, tool_call_records, write_jsonl


def _call(task: Any, name: str, arguments: Any) -> dict[str, Any]:
    return {"task": task, "tool_call": {"name": name, "arguments": arguments}}


def test_features_count_the_values_that_hold_what_the_task_does_not() -> None:
    task = "Send 50 dollars to Alice Martin for dinner"
    named = call_features(_call(task, "sendMoney", {"recipient": "Alice Martin", "amount": 50, "urgent": True}))
    assert named == (0.0, 0.5)  # every argument value is named in the task; "send" is, "money" is not
    foreign = call_features(_call(task, "delete_file", {"path": "/etc/passwd", "force": True, "note": None}))
    assert foreign == (pytest.approx(math.log1p(1)), 0.0)  # one foreign value; booleans and nulls hold no word
    # a value is one value however it is written
    assert call_features(_call(task, "pay", {"iban": "UK12 3456 7890 1234 5678 90"})) == call_features(
        _call(task, "pay", {"iban": "UK12345678901234567890"}))
    # the task's strings are read wherever they sit in it
    assert call_features(_call({"messages": [{"content": "Alice Martin"}]}, "x", ["Martin Alice"]))[0] == 0.0
    assert call_features(_call("List my files", "list_files", {})) == (0.0, 1.0)


def test_copying_the_task_into_a_call_moves_no_feature() -> None:
    task = "Send 50 dollars to Alice Martin for last night's dinner."
    call = {"recipient": "DE89370400440532013000", "amount": 4999}
    plain = call_features(_call(task, "send_money", call))
    for extra in ({"subject": task}, {"note": [task] * 5, "memo": ["Alice Martin dinner"]}):
        assert call_features(_call(task, "send_money", {**call, **extra})) == plain
    # replacing a foreign value by one the task names lowers the count
    assert call_features(_call(task, "send_money", {**call, "amount": 50}))[0] < plain[0]


def test_a_foreign_value_cannot_hide_in_a_key_in_single_characters_or_in_a_number() -> None:
    task = "Scale checkout-service in prod to 6 replicas"
    named = call_features(_call(task, "scale", {"replicas": 6, "cluster": "prod"}))
    assert named[0] == 0.0  # argument names are not values
    for hidden in ({"replicas": 0, "cluster": "prod"}, {"cluster": {"DE89370400440532013000": True}},
                   {"cluster": "D_E_8_9_3_7"}, {"cluster": "D.E.8.9"}, {"cluster": [10**5000]}):
        assert call_features(_call(task, "scale", hidden))[0] == pytest.approx(math.log1p(1)), list(hidden)


def test_arguments_sent_as_json_text_count_value_by_value() -> None:
    task = "Send 50 dollars to Alice"
    as_object = {"recipient": "DE89370400440532013000", "amount": 4999, "note": "urgent fee"}
    assert call_features(_call(task, "send_money", json.dumps(as_object))) == call_features(
        _call(task, "send_money", as_object)) == (pytest.approx(math.log1p(3)), 0.5)
    assert call_features(_call(task, "send_money", "{not json")) == (pytest.approx(math.log1p(1)), 0.5)
    repeated = '{"recipient": "DE89370400440532013000", "amount": 4999, "note": "x", "note": "urgent fee"}'
    assert call_features(_call(task, "send_money", repeated))[0] == pytest.approx(math.log1p(3))


def test_a_structure_holding_itself_is_read_once() -> None:
    looped: dict[str, Any] = {}
    looped["x"] = [looped, "prod"]
    assert call_features(_call("in prod", "scale", {"cluster": looped})) == (pytest.approx(math.log1p(1)), 0.0)


@pytest.mark.parametrize("state", [
    "a plain string", {"task": "t"}, {"tool_call": {"name": "f"}}, {"task": "t", "tool_call": "f"},
    {"task": "t", "tool_call": {"name": 3, "arguments": {}}}, ["task", "tool_call"],
])
def test_a_state_of_another_shape_has_no_features(state: Any) -> None:
    assert call_features(state) is None


def test_deeply_nested_arguments_are_read_without_recursion() -> None:
    deep: Any = "needle"
    for _ in range(50_000):
        deep = [deep]
    assert call_features(_call("find the needle", "search", {"q": deep})) == (0.0, 0.0)
    assert call_features(_call("find the needle", "search", {"q": [deep, "haystack"]}))[0] == pytest.approx(
        math.log1p(1))


def test_the_grounding_round_trips_and_malformed_bodies_are_refused() -> None:
    fitted = Grounding(0.3, tuple(float(n) for n in range(len(FEATURES))), -1.0, 0.4, -0.2)
    assert Grounding.from_json(json.loads(json.dumps(fitted.to_json()))) == fitted
    assert fitted.logit(2.0, None) == pytest.approx(0.4 * 2.0 - 0.2)
    body = fitted.to_json()
    for broken in ({**body, "weights": [1.0]}, {**body, "bias": float("nan")}, {**body, "model": "1"},
                   {**body, "features": list(reversed(FEATURES))}, {**body, "plain_model": True}, [1, 2], None):
        with pytest.raises(ValueError, match="grounding"):
            Grounding.from_json(broken)


def _synthetic(rng: np.random.Generator, sources: int, size: int) -> tuple[Any, ...]:
    labels = rng.random(sources * size) < 0.5
    pooled = rng.normal(size=(len(labels), 8)).astype(np.float32)  # the model's vectors carry nothing
    features = [tuple(float(v) for v in rng.normal(loc=1.5 * y, size=len(FEATURES))) for y in labels]
    names = [f"src{n // size}" for n in range(len(labels))]
    return pooled, features, labels.tolist(), names


def test_the_fit_weighs_what_ranks_sources_it_did_not_see() -> None:
    pooled, features, labels, names = _synthetic(np.random.default_rng(0), 3, 80)
    fitted = grounding.fit(pooled, features, labels, names)
    report = fitted.report
    assert set(report["by_source"]) == {"src0", "src1", "src2"} and report["records"] == 240
    assert report["source_mean"]["grounded_auroc"] > 0.9
    assert report["source_mean"]["model_auroc"] < 0.7
    assert abs(fitted.grounding.model) < min(abs(w) for w in fitted.grounding.weights)
    assert fitted.weight.shape == (8,) and fitted.weight.dtype == np.float32
    with pytest.raises(ValueError, match="two sources"):
        grounding.fit(pooled, features, labels, ["one"] * len(labels))


def test_a_record_without_features_is_answered_from_the_logit_alone() -> None:
    pooled, features, labels, names = _synthetic(np.random.default_rng(1), 2, 60)
    features = [None if n % 3 == 0 else f for n, f in enumerate(features)]
    fitted = grounding.fit(pooled, features, labels, names)
    assert fitted.report["with_features"] == sum(f is not None for f in features)
    assert fitted.grounding.logit(1.0, None) == pytest.approx(fitted.grounding.plain_model + fitted.grounding.plain_bias)


def test_training_fits_the_grounding_and_the_checkpoint_answers_with_it(encoder: Any, tmp_path: Path) -> None:
    records = load_records(write_jsonl(tmp_path / "train.jsonl", injection_records() + tool_call_records()))
    model, report = train_catalog(records, [], FinetuneConfig(epochs=1, batch_size=4), encoder, folds=False)
    assert set(report.grounding["by_source"]) == {"suite0", "suite1"}
    assert model.meta["report"]["grounding"] == report.grounding
    trained = model.questions[QUESTION]
    assert trained.grounding is not None and trained.temperature == 1.0
    assert model.questions["guard.prompt_injection"].grounding is None

    state = _call("Send 50 dollars to Alice", "send_money", {"recipient": "Alice", "amount": 50})
    questions = {QUESTION: CATALOG[QUESTION].to_json()}
    request = SystemOneRequestV1.from_json({"model": "compact", "state": state, "questions": questions})
    logits, _, _, _ = model.window_logits(state_text(state, "json"), [QUESTION])
    head = float(logits[0][0, 0] - logits[0][0, 1])
    expected = 1.0 / (1.0 + math.exp(-trained.grounding.logit(head, call_features(state))))
    assert model.answer(request).answers[QUESTION].noul == pytest.approx(expected, abs=1e-6)

    again = CompactModel.load(model.save(tmp_path / "ckpt"), encoder=encoder, runtime="torch")
    assert again.questions[QUESTION].grounding == trained.grounding
    assert again.answer(request).answers[QUESTION].noul == pytest.approx(expected, abs=1e-3)  # bf16 on disk
    with pytest.raises(ValueError, match="already grounded"):  # its readout would pick the windows with every label
        ground(again, records)


def test_training_skips_the_grounding_of_tool_calls_from_one_source(encoder: Any, tmp_path: Path) -> None:
    rows = [{**row, "source": "suite0"} for row in tool_call_records()]
    records = load_records(write_jsonl(tmp_path / "train.jsonl", rows))
    lines: list[str] = []
    model, report = train_catalog(records, [], FinetuneConfig(epochs=1, batch_size=4), encoder, folds=False,
                                  log=lines.append)
    assert report.grounding == {} and model.questions[QUESTION].grounding is None
    assert any("grounding: skipped" in line for line in lines)


def test_a_checkpoint_with_a_malformed_grounding_does_not_load(encoder: Any, tmp_path: Path) -> None:
    records = load_records(write_jsonl(tmp_path / "train.jsonl", injection_records() + tool_call_records()))
    model, _ = train_catalog(records, [], FinetuneConfig(epochs=1, batch_size=4), encoder, folds=False)
    root = model.save(tmp_path / "ckpt")
    config = json.loads((root / "compact_config.json").read_text())
    config["questions"][QUESTION]["grounding"]["weights"][0] = "NaN"
    (root / "compact_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="grounding"):
        CompactModel.load(root, encoder=encoder, runtime="torch")


def test_the_readout_is_what_the_head_answers() -> None:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    layer = BertLayer(BertConfig(hidden_size=16, num_attention_heads=2, intermediate_size=32))
    head = CatalogHead([layer], [2, 5], hidden=16).eval()
    weight = torch.randn(32)
    head.set_noul_readout(0, weight, 0.5)
    states, mask = torch.randn(3, 4, 16), torch.ones(3, 4, dtype=torch.bool)
    index = torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        logits = head.score(states, mask, index)
        expected = head.pooled(states, mask, index) @ weight + 0.5
    assert torch.allclose(logits[:, 0] - logits[:, 1], expected, atol=1e-5)
    with pytest.raises(ValueError, match="5 options"):
        head.set_noul_readout(1, weight, 0.0)
    with pytest.raises(ValueError, match="shape"):
        head.set_noul_readout(0, torch.randn(8), 0.0)



def test_the_validation_report_of_the_grounded_question_is_the_saved_answer_and_not_held_out(
        encoder: Any, tmp_path: Path) -> None:
    """report.val was the head's answer before its grounding, with a temperature the saved model does not use (the
    grounding replaces it), and the grounding is fitted on the validation records too: the numbers must be those of
    the saved answer and say they are not held out."""
    from guard.compact.evaluate import question_metrics
    from guard.compact.model import pick_window

    train = load_records(write_jsonl(tmp_path / "train.jsonl", injection_records() + tool_call_records()))
    val = load_records(write_jsonl(tmp_path / "val.jsonl", tool_call_records()))
    model, report = train_catalog(train, val, FinetuneConfig(epochs=1, batch_size=4), encoder, folds=False)
    assert model.questions[QUESTION].grounding is not None
    assert QUESTION not in report.temperatures  # the grounding answers in its place
    entry = CATALOG[QUESTION]
    answers = []
    for record in val:
        logits, _, _, _ = model.window_logits(state_text(record.request.state, entry.view), [QUESTION])
        answers.append(model.probabilities(entry.to_question(), logits[0][pick_window(logits[0], entry)],
                                           record.request.state))
    saved = question_metrics(QUESTION, "noul", ["true", "false"], answers, [r.labels[QUESTION] for r in val])
    reported = report.val[QUESTION]
    for metric in ("n", "accuracy", "auroc", "brier", "ece"):
        assert reported[metric] == pytest.approx(getattr(saved, metric), abs=1e-9)
    assert reported["held_out"] is False and "grounding" in reported["note"]
    assert model.meta["report"]["val"][QUESTION] == reported
    assert QUESTION not in model.meta["report"]["temperatures"]
