from __future__ import annotations

import torch

from guard.clef.head import JointHeadConfig, JointSchemaHead
from guard.compact._batch import QuestionEncoding, collate
from guard.compact.head import CompactHead, masked_mean
from guard.compact.router import RouterHead

H = 16


def _config() -> JointHeadConfig:
    return JointHeadConfig(hidden_size=H, width=32, routing_layers=2, layers=2, heads=4, feedforward=64)


def _question(type_id: int, options: int, generator: torch.Generator) -> QuestionEncoding:
    return QuestionEncoding(
        type_id=type_id,
        tokens=torch.randn(3 + options, H, generator=generator),
        options=tuple(torch.randn(2 + k, H, generator=generator) for k in range(options)),
        lexical=torch.randn(options, H, generator=generator),
        option_ids=tuple(str(k) for k in range(options)),
    )


def test_parameters_are_the_clef_head_plus_a_segment_embedding() -> None:
    compact = set(CompactHead(_config()).state_dict())
    clef = set(JointSchemaHead(_config()).state_dict())
    assert compact - clef == {"memory_segment_embedding.weight"}
    assert clef <= compact


def test_batched_forward_equals_one_record_at_a_time() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    head = CompactHead(_config()).eval()
    states = [torch.randn(n, H, generator=generator) for n in (5, 11, 2)]
    questions = [[_question(0, 2, generator)], [_question(2, 5, generator), _question(0, 2, generator)],
                 [_question(1, 3, generator)]]
    with torch.no_grad():
        batched = head.forward_batch(collate(states, questions, torch.float32))
        for b in range(3):
            alone = head.forward_batch(collate([states[b]], [questions[b]], torch.float32))[0]
            for j, enc in enumerate(questions[b]):
                k = len(enc.options)
                torch.testing.assert_close(batched[b, j, :k], alone[j, :k], atol=1e-5, rtol=1e-5)
                assert torch.isinf(batched[b, j, k:]).all()


def test_answers_depend_on_the_question_and_the_state() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    head = CompactHead(_config()).eval()
    state = torch.randn(7, H, generator=generator)
    q1, q2 = _question(0, 2, generator), _question(0, 2, generator)
    with torch.no_grad():
        a = head.forward_batch(collate([state], [[q1]], torch.float32))
        b = head.forward_batch(collate([state], [[q2]], torch.float32))
        c = head.forward_batch(collate([state * 2 + 1], [[q1]], torch.float32))
    assert not torch.allclose(a, b) and not torch.allclose(a, c)


def test_router_is_padding_invariant() -> None:
    torch.manual_seed(0)
    head = RouterHead(_config(), 4).eval()
    short, long = torch.randn(3, H), torch.randn(9, H)
    state = torch.zeros(2, 9, H)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    state[0, :3], mask[0, :3] = short, True
    state[1], mask[1] = long, True
    with torch.no_grad():
        both = head(state, mask)
        alone = head(short.unsqueeze(0), torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(both[0], alone[0], atol=1e-5, rtol=1e-5)
    assert both.shape == (2, 4)


def test_masked_mean() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]])
    assert masked_mean(x, torch.tensor([True, True, False])).tolist() == [2.0, 3.0]
