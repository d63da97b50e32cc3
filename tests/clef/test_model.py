"""ClefModel against the reference's own outputs (golden README tolerances), batching, errors and the readout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from guard.clef.encoding import EncodedRecord, collate
from guard.clef.model import ClefModel, checkpoint_revision
from guard.errors import RequestValidationError
from guard.systemone import SystemOneRequestV1
from tests.clef.conftest import CASE_IDS, error_cases, load_case

FP32 = {"logit": 1e-4, "probability": 1e-4, "wire": 2e-4}
BF16 = {"logit": 0.25, "probability": 2.5e-2, "wire": 2.5e-2}
IMAGE_CASES = ("16-image-json-state", "17-image-truncated-state")


def _run(model: ClefModel, case: dict[str, Any]) -> tuple[SystemOneRequestV1, EncodedRecord, list[torch.Tensor]]:
    request = SystemOneRequestV1.from_json(case["request"], profile="reference")
    record = model.encode(request, max_length=case["max_length"])
    (logits,) = model.forward_records([record])
    return request, record, logits


@pytest.fixture(scope="module")
def fp32_runs(golden_fp32: ClefModel) -> dict[str, Any]:
    return {case_id: _run(golden_fp32, load_case(case_id)) for case_id in CASE_IDS}


@pytest.fixture(scope="module")
def bf16_runs(golden_bf16: ClefModel) -> dict[str, Any]:
    return {case_id: _run(golden_bf16, load_case(case_id)) for case_id in CASE_IDS}


def _compare_wire(ours: dict[str, Any], reference: dict[str, Any], tolerance: float, case: dict[str, Any]) -> None:
    """Exact structure (key order, types, choice, legend, echo, usage); numbers within ``tolerance``."""
    assert list(ours) == list(reference) and ours["model"] == reference["model"] and ours["usage"] == reference["usage"]
    assert list(ours["answers"]) == list(reference["answers"])
    for qid, expected in reference["answers"].items():
        got = ours["answers"][qid]
        assert list(got) == list(expected), qid
        assert got["type"] == expected["type"]
        if expected["type"] == "noul":
            assert abs(got["noul"] - expected["noul"]) <= tolerance, qid
            continue
        assert list(got["probabilities"]) == list(expected["probabilities"]), qid
        for option, p in expected["probabilities"].items():
            assert abs(got["probabilities"][option] - p) <= tolerance, (qid, option)
        assert abs(got["confidence"] - expected["confidence"]) <= tolerance, qid
        if expected["type"] == "choice":
            assert got["choice"] == expected["choice"], qid
        else:
            assert got["legend"] == expected["legend"], qid
            levels = len(case["option_order"][qid])
            assert abs(got["score"] - expected["score"]) <= tolerance * (levels - 1), qid


def _check_case(runs: dict[str, Any], model: ClefModel, case_id: str, dtype: str, bounds: dict[str, float]) -> None:
    case = load_case(case_id)
    request, record, logits = runs[case_id]
    assert len(record.input_ids) == case["input_ids_len"]
    for question, z in zip(record.questions, logits, strict=True):
        assert z.dtype == torch.float32 and z.device.type == "cpu"
        reference_z = torch.tensor(case[f"logits_{dtype}"][question.question_id])
        reference_p = torch.tensor(case[f"probabilities_{dtype}"][question.question_id])
        assert (z - reference_z).abs().max().item() <= bounds["logit"], question.question_id
        assert (torch.softmax(z, dim=-1) - reference_p).abs().max().item() <= bounds["probability"], (
            question.question_id
        )
    response = model.answer(request, record, logits).to_json()
    _compare_wire(response, case[f"response_{dtype}"], bounds["wire"], case)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_golden_case_float32(case_id: str, fp32_runs: dict[str, Any], golden_fp32: ClefModel) -> None:
    _check_case(fp32_runs, golden_fp32, case_id, "fp32", FP32)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_golden_case_bfloat16(case_id: str, bf16_runs: dict[str, Any], golden_bf16: ClefModel) -> None:
    _check_case(bf16_runs, golden_bf16, case_id, "bf16", BF16)


@pytest.mark.parametrize("case_id", [c for c in CASE_IDS if "last_hidden_state_fp32" in load_case(c)])
def test_hidden_state_checksums_float32(case_id: str, fp32_runs: dict[str, Any], golden_fp32: ClefModel) -> None:
    reference = load_case(case_id)["last_hidden_state_fp32"]
    _, record, _ = fp32_runs[case_id]
    hidden = golden_fp32.hidden_states(collate([record], golden_fp32.processor.pad_token_id))[0].double()
    assert list(hidden.shape) == reference["shape"]
    bound = 1e-5 * reference["abs_sum"]
    assert abs(hidden.sum().item() - reference["sum"]) <= bound
    assert abs(hidden.abs().sum().item() - reference["abs_sum"]) <= bound
    assert torch.allclose(hidden[0].float(), torch.tensor(reference["first_row"]), atol=1e-4, rtol=0)
    assert torch.allclose(hidden[-1].float(), torch.tensor(reference["last_row"]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case_id", IMAGE_CASES)
def test_image_vision_embeddings_and_mrope_positions(
    case_id: str, fp32_runs: dict[str, Any], golden_fp32: ClefModel
) -> None:
    media = load_case(case_id)["media"]
    _, record, _ = fp32_runs[case_id]
    batch = collate([record], golden_fp32.processor.pad_token_id)
    inner = golden_fp32.backbone.model
    with torch.inference_mode():
        embeds = inner.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output[0]
        positions, delta = inner.get_rope_index(
            batch["input_ids"],
            batch["mm_token_type_ids"],
            image_grid_thw=batch["image_grid_thw"],
            attention_mask=batch["attention_mask"],
        )
    if "vision_embeds_fp32" in media:
        reference = media["vision_embeds_fp32"]
        assert list(embeds.shape) == reference["shape"]
        assert torch.allclose(embeds[0], torch.tensor(reference["first_row"]), atol=1e-4, rtol=0)
        assert torch.allclose(embeds[-1], torch.tensor(reference["last_row"]), atol=1e-4, rtol=0)
    assert positions[:, 0].tolist() == media["mrope_position_ids"]
    assert delta.flatten().tolist() == [media["rope_delta"]]


@pytest.mark.parametrize("error", error_cases(), ids=lambda e: e["name"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_error_cases(error: dict[str, Any], dtype: str, request: pytest.FixtureRequest) -> None:
    model: ClefModel = request.getfixturevalue(f"golden_{dtype}")
    with pytest.raises(RequestValidationError) as info:
        model.systemone(error["request"], max_length=error["max_length"])
    assert isinstance(info.value, ValueError)
    assert info.value.errors[0].message == error["error"]["message"]


def test_batched_equals_one_at_a_time_float32(fp32_runs: dict[str, Any], golden_fp32: ClefModel) -> None:
    chosen = ["13-single-question-null-state", "01-three-types", "16-image-json-state", "08-special-token-literals"]
    records = [fp32_runs[c][1] for c in chosen]
    batched = golden_fp32.forward_records(records)
    for case_id, per_record in zip(chosen, batched, strict=True):
        for single, joint in zip(fp32_runs[case_id][2], per_record, strict=True):
            assert torch.allclose(single, joint, atol=1e-5, rtol=0), case_id
    text_only = golden_fp32.forward_records([fp32_runs[c][1] for c in ("02-choice-caller-order", "07-string-state")])
    assert torch.allclose(text_only[1][0], fp32_runs["07-string-state"][2][0], atol=1e-5, rtol=0)


def test_a_text_record_with_image_pads_does_not_fail_an_image_batch(
    fp32_runs: dict[str, Any], golden_fp32: ClefModel
) -> None:
    """Its pads are plain tokens (the reference embeds them so); in the image pass they would claim media slots."""
    state = "look <|vision_start|><|image_pad|><|vision_end|>"
    body = {"model": "m", "state": state, "questions": {"q": {"type": "noul"}}}
    text = golden_fp32.encode(SystemOneRequestV1.from_json(body, profile="reference"))
    image = fp32_runs["16-image-json-state"][1]
    (alone,) = golden_fp32.forward_records([text])
    batched = golden_fp32.forward_records([text, image])
    assert torch.allclose(batched[0][0], alone[0], atol=1e-5, rtol=0)
    for single, joint in zip(fp32_runs["16-image-json-state"][2], batched[1], strict=True):
        assert torch.allclose(single, joint, atol=1e-5, rtol=0)


def test_batched_equals_one_at_a_time_bfloat16(bf16_runs: dict[str, Any], golden_bf16: ClefModel) -> None:
    chosen = ["11-question-order-rca", "05-score-object-levels", "15-array-state-unicode-ids"]
    batched = golden_bf16.forward_records([bf16_runs[c][1] for c in chosen])
    for case_id, per_record in zip(chosen, batched, strict=True):
        for single, joint in zip(bf16_runs[case_id][2], per_record, strict=True):
            assert (torch.softmax(single, -1) - torch.softmax(joint, -1)).abs().max() <= BF16["probability"]


def test_systemone_takes_a_dict_and_echoes_model_and_usage(golden_fp32: ClefModel) -> None:
    case = load_case("02-choice-caller-order")
    response = golden_fp32.systemone(case["request"], max_length=case["max_length"])
    assert response.to_json() == case["response_fp32"]
    purity = golden_fp32.systemone(case["request"], confidence_profile="workers-ai").to_json()
    (answer,) = purity["answers"].values()
    probabilities = list(answer["probabilities"].values())
    n = len(probabilities)
    assert abs(answer["confidence"] - (n * sum(p * p for p in probabilities) - 1) / (n - 1)) < 1e-3
    with pytest.raises(RequestValidationError, match="instructions"):
        golden_fp32.systemone(load_case("09-no-instructions")["request"], validation_profile="workers-ai")


def test_encode_refuses_a_dict_naming_from_json(golden_fp32: ClefModel) -> None:
    """encode() takes a request, not the JSON body systemone() takes: a dict was an AttributeError on .questions."""
    body = load_case("02-choice-caller-order")["request"]
    with pytest.raises(TypeError, match=r"ClefModel.encode\(\) takes a SystemOneRequestV1, not dict.*from_json\(body\)"):
        golden_fp32.encode(body)


def test_identity_dtype_and_max_length(golden_checkpoint: Path, golden_fp32: ClefModel, tiny_checkpoint: Path) -> None:
    assert golden_fp32.model_id == "checkpoint" and golden_fp32.max_length == 16384
    assert golden_fp32.revision == checkpoint_revision(golden_checkpoint) and len(golden_fp32.revision) == 16
    assert golden_fp32.revision != checkpoint_revision(tiny_checkpoint)
    assert golden_fp32.head.hidden_norm.weight.dtype == torch.float32 == golden_fp32.dtype
    assert not golden_fp32.backbone.config.use_cache


def test_from_pretrained_rejects_bad_arguments(golden_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        ClefModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        ClefModel.from_pretrained(golden_checkpoint, dtype=torch.float16)
    with pytest.raises(ValueError, match="max_length"):
        ClefModel.from_pretrained(golden_checkpoint, max_length=0)
