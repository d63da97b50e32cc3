"""Training a router head on labelled records (``guard train --kind router``), and the loss and calibration
helpers the catalog training (:mod:`guard.compact.finetune`) shares.

The encoder stays frozen, so every state is encoded once (through the on-disk
:class:`~guard.compact._cache.EmbeddingCache`) and each epoch only runs the head. The loss per question is
label-smoothed cross-entropy plus a Brier term over its options (the Clef recipe: §1.7 of the Clef runtime
specification, whose sections ``docs/clef.md`` lists). Training is seeded (``torch``, Python ``random``), validates
after every epoch, keeps the best epoch by validation loss and stops after ``patience`` epochs without improvement.
Afterwards the head is rounded to bf16 (its on-disk dtype) and a temperature per question id is fitted on the
validation records (:func:`fit_temperature`).

The head is a :class:`~guard.compact.router.RouterHead`: one choice question over fixed labels.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

from guard.clef.encoding import render
from guard.clef.head import JointHeadConfig
from guard.compact._cache import EmbeddingCache
from guard.compact.encoder import TextEncoder
from guard.compact.head import pool_rows
from guard.compact.model import DEFAULT_MEMORY_POOL, CompactModel, ModelQuestion
from guard.compact.records import LabelledRecord
from guard.compact.router import RouterHead

__all__ = ["TrainConfig", "TrainReport", "fit_outside_bias", "fit_temperature", "soft_loss", "train"]

ProgressFactory = Callable[..., Any]


@dataclass(frozen=True)
class TrainConfig:
    """Router training settings.

    Attributes:
        kind: ``"router"`` (the catalog model is trained by :mod:`guard.compact.finetune`).
        epochs: most epochs; ``patience`` epochs without a better validation loss stop early.
        batch_size, learning_rate, weight_decay: AdamW settings.
        label_smoothing: ε of the smoothed cross-entropy target ``(1-ε)·onehot + ε/K``.
        brier_weight: weight of ``Σ_k (p_k − onehot_k)²`` added to the loss.
        ordinal_weight: weight of the expected-level error of ``score`` questions (see :func:`soft_loss`).
        seed: seeds torch and Python ``random``.
        max_state_tokens: state tokens a training example keeps (first and last halves); inference reads all.
        memory_pool: state token states mean-pooled per memory row (kept in the checkpoint).
        width, routing_layers, layers, heads, feedforward, dropout: head sizes (:class:`JointHeadConfig`).
        outside_label: a router's out-of-scope label (e.g. ``oos``); its logit gets the bias of
            :func:`fit_outside_bias` so that ``outside_rate`` of the in-scope validation records would go to it.
        outside_rate: see ``outside_label``.
    """

    kind: str = "router"
    epochs: int = 12
    patience: int = 3
    batch_size: int = 32
    learning_rate: float = 5e-4
    weight_decay: float = 0.01
    label_smoothing: float = 0.05
    brier_weight: float = 0.5
    ordinal_weight: float = 1.0
    seed: int = 0
    max_state_tokens: int = 512
    memory_pool: int = DEFAULT_MEMORY_POOL
    width: int = 128
    routing_layers: int = 2
    layers: int = 2
    heads: int = 2
    feedforward: int = 256
    dropout: float = 0.1
    outside_label: str | None = None
    outside_rate: float = 0.03

    def __post_init__(self) -> None:
        if self.kind != "router":
            raise ValueError(f"kind must be 'router' (catalog models: guard.compact.finetune), got {self.kind!r}")
        for name in ("epochs", "patience", "batch_size", "max_state_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")

    def head_config(self, hidden_size: int) -> JointHeadConfig:
        return JointHeadConfig(hidden_size=hidden_size, width=self.width, routing_layers=self.routing_layers,
                               layers=self.layers, heads=self.heads, feedforward=self.feedforward, dropout=self.dropout)


@dataclass
class TrainReport:
    """What happened: per-epoch train/val loss, the best epoch, fitted temperatures."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_accuracy: list[float] = field(default_factory=list)
    best_epoch: int = 0
    temperatures: dict[str, float] = field(default_factory=dict)
    outside_bias: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def soft_loss(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, smoothing: float,
              brier_weight: float, ordinal: torch.Tensor | None = None, ordinal_weight: float = 0.0) -> torch.Tensor:
    """Label-smoothed cross-entropy plus ``brier_weight`` × Brier score (plus, for ``score`` questions,
    ``ordinal_weight`` × the squared error of the expected level), averaged over questions.

    Args:
        logits: ``(N, K)`` with ``-inf`` at invalid options.
        target: ``(N,)`` label index.
        valid: ``(N, K)`` bool, the real options.
        smoothing: ε.
        brier_weight: weight of the Brier term.
        ordinal: ``(N,)`` bool, the rows whose options are ordered levels (``score`` questions, levels in index
            order); their term is ``((Σ_k p_k·k − target) / (K_valid − 1))²``, the error of the expected level that
            a score answer reports (spec §4), scaled to [0, 1].
        ordinal_weight: weight of that term (0 = off).
    """
    count = valid.sum(-1, keepdim=True).clamp(min=1).float()
    onehot = F.one_hot(target, logits.shape[-1]).float()
    smooth = (1.0 - smoothing) * onehot + smoothing * valid.float() / count
    log_p = torch.log_softmax(logits, dim=-1).masked_fill(~valid, 0.0)
    cross_entropy = -(smooth * log_p).sum(-1)
    p = log_p.exp() * valid
    loss = cross_entropy + brier_weight * ((p - onehot) ** 2).sum(-1)
    if ordinal is not None and ordinal_weight:
        levels = torch.arange(logits.shape[-1], dtype=p.dtype, device=p.device)
        expected = (p * levels).sum(-1)  # (N,)
        span = (count.squeeze(-1) - 1.0).clamp(min=1.0)
        loss = loss + ordinal_weight * ordinal.float() * ((expected - target.float()) / span) ** 2
    return loss.mean()


def fit_temperature(logits: Sequence[torch.Tensor], targets: Sequence[int]) -> float:
    """The temperature ``T`` in [0.05, 20] minimising the NLL of ``softmax(z / T)`` (grid search in log space)."""
    if not logits:
        return 1.0
    best, best_nll = 1.0, math.inf
    for step in range(241):
        t = math.exp(math.log(0.05) + step * (math.log(20.0) - math.log(0.05)) / 240)
        nll = sum(float(-torch.log_softmax(z.double() / t, -1)[y]) for z, y in zip(logits, targets, strict=True))
        if nll < best_nll:
            best, best_nll = t, nll
    return best


def fit_outside_bias(logits: Sequence[torch.Tensor], targets: Sequence[int], outside: int, rate: float) -> float:
    """The bias ``b`` added to the out-of-scope logit so that a fraction ``rate`` of the **in-scope** records would be
    answered out-of-scope: ``b`` = the ``rate`` quantile of ``max_in_scope_logit − outside_logit`` over records whose
    target is not ``outside``. Needs only in-scope validation data (out-of-scope examples are usually scarce)."""
    margins = []
    for z, y in zip(logits, targets, strict=True):
        if y == outside:
            continue
        inside = torch.cat([z[:outside], z[outside + 1 :]])
        margins.append(float(inside.max() - z[outside]))
    if not margins:
        return 0.0
    return float(torch.quantile(torch.tensor(margins, dtype=torch.float64), rate))


def _cap(rows: torch.Tensor, limit: int) -> torch.Tensor:
    if rows.shape[0] <= limit:
        return rows
    half = limit // 2
    return torch.cat([rows[:half], rows[-(limit - half):]], 0)


@dataclass(frozen=True)
class _Example:
    state: int
    questions: tuple[str, ...]
    targets: tuple[int, ...]


def train(
    train_records: Sequence[LabelledRecord],
    val_records: Sequence[LabelledRecord],
    config: TrainConfig,
    encoder: TextEncoder,
    *,
    cache: EmbeddingCache | None = None,
    progress: ProgressFactory | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[CompactModel, TrainReport]:
    """Train a head and return the calibrated model.

    Args:
        train_records, val_records: labelled records (val may be empty: then the last epoch wins and ``T = 1``).
        config: settings.
        encoder: the frozen encoder.
        cache: embedding cache; default in memory only.
        progress: a ``tqdm``-like factory (``progress(total=..., desc=...)`` with ``update``/``close``), or ``None``.
        log: receives one line per epoch.

    Raises:
        ValueError: no training records, or a router trained on records with more than one question.
    """
    if not train_records:
        raise ValueError("no training records")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    cache = cache or EmbeddingCache(encoder, None)
    questions: dict[str, ModelQuestion] = {}
    labels = _router_labels(train_records)
    texts = sorted({render(r.request.state) for r in (*train_records, *val_records)})
    bar = progress(total=len(texts), desc="encoding states", unit="text") if progress else None
    states = cache.get(texts, progress=bar.update if bar else None)
    if bar:
        bar.close()
    index = {text: i for i, text in enumerate(texts)}
    rows = [pool_rows(_cap(s.float(), config.max_state_tokens), config.memory_pool) for s in states]

    head_config = config.head_config(encoder.hidden_size)
    head = RouterHead(head_config, len(labels))

    def examples(records: Sequence[LabelledRecord]) -> list[_Example]:
        out = []
        for record in records:
            keys, targets = [], []
            for question in record.request.questions:
                key = json_key(question)
                if question.id in record.labels:
                    keys.append(key)
                    targets.append(labels.index(question.options()[record.labels[question.id]][0]))
                _remember(questions, question, labels)
            if keys:
                out.append(_Example(index[render(record.request.state)], tuple(keys), tuple(targets)))
        return out

    train_examples, val_examples = examples(train_records), examples(val_records)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    steps = config.epochs * math.ceil(len(train_examples) / config.batch_size)
    schedule = _one_cycle(optimizer, config.learning_rate, steps)
    report = TrainReport()
    best_state: dict[str, torch.Tensor] | None = None
    best_loss, stale = math.inf, 0

    def run(batch: Sequence[_Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        state_rows = [rows[e.state] for e in batch]
        width = max(r.shape[0] for r in state_rows)
        state = torch.zeros(len(batch), width, state_rows[0].shape[-1])
        mask = torch.zeros(len(batch), width, dtype=torch.bool)
        for b, r in enumerate(state_rows):
            state[b, : r.shape[0]], mask[b, : r.shape[0]] = r, True
        logits = head(state, mask)  # (B, K)
        valid = torch.ones_like(logits, dtype=torch.bool)
        target = torch.tensor([e.targets[0] for e in batch])
        return logits, target, valid, torch.zeros(len(batch), dtype=torch.bool)

    for epoch in range(config.epochs):
        head.train()
        order = _batches(train_examples, rows, config.batch_size, rng)
        bar = progress(total=len(order), desc=f"epoch {epoch + 1}/{config.epochs}", unit="batch") if progress else None
        total = 0.0
        for batch in order:
            logits, target, valid, ordinal = run(batch)
            loss = soft_loss(logits, target, valid, config.label_smoothing, config.brier_weight, ordinal,
                             config.ordinal_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            value = float(loss.detach())
            total += value
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4f}")
        if bar:
            bar.close()
        report.train_loss.append(total / max(1, len(order)))
        val_loss, val_acc = _evaluate(head, val_examples, rows, config, run)
        report.val_loss.append(val_loss)
        report.val_accuracy.append(val_acc)
        log(f"epoch {epoch + 1}: train loss {report.train_loss[-1]:.4f}, val loss {val_loss:.4f}, val acc {val_acc:.4f}")
        if not val_examples or val_loss < best_loss - 1e-4:
            best_loss, stale, report.best_epoch = val_loss, 0, epoch + 1
            best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
        else:
            stale += 1
            if stale >= config.patience:
                break
    assert best_state is not None
    # Round to the on-disk dtype before calibrating, so the temperatures fit the weights that ship.
    head.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in best_state.items()})
    head.eval()
    bias: dict[str, dict[str, float]] = {}
    if config.outside_label in labels and val_examples:
        outside = labels.index(config.outside_label)
        zs, ys = _collect(head, val_examples, run)
        value = fit_outside_bias(zs, ys, outside, config.outside_rate)
        bias = {qid: {config.outside_label: value} for qid in questions}
        report.outside_bias = value
    report.temperatures = _calibrate(head, val_examples, config, run, train_records, questions, bias)
    final = {qid: ModelQuestion(q.id, q.type, q.instructions, q.criteria, report.temperatures.get(qid, 1.0), q.labels,
                                bias.get(qid, {}))
             for qid, q in questions.items()}
    model = CompactModel(encoder, head, final, kind=config.kind, memory_pool=config.memory_pool,
                         meta={"train_config": asdict(config), "report": report.to_json()})
    return model, report


def _one_cycle(optimizer: torch.optim.Optimizer, max_lr: float, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """One-cycle learning rate over ``steps`` optimizer steps: 10 % warm-up, then cosine annealing.

    ``OneCycleLR`` divides by the length of each phase minus one, so the warm-up gets at least 2 steps and the
    annealing at least 2; a run too short for that (under 4 steps) keeps the learning rate constant.
    """
    if steps < 4:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    warmup = max(0.1, 2.0 / steps)
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=steps, pct_start=warmup)


def json_key(question: Any) -> str:
    """A key identifying a question's type, wording and options."""
    return render([question.id, question.type, question.instruction_value(), question.options()])


def _remember(questions: dict[str, ModelQuestion], question: Any, labels: tuple[str, ...]) -> None:
    if question.id in questions:
        return
    criteria = {label: (question.criteria or {}).get(label) for label in labels}
    questions[question.id] = ModelQuestion(question.id, question.type, str(question.instruction_value()), criteria,
                                           labels=labels)


def _router_labels(records: Sequence[LabelledRecord]) -> tuple[str, ...]:
    ids = {q.id for r in records for q in r.request.questions}
    if len(ids) != 1:
        raise ValueError(f"a router is trained on one choice question; the records ask {sorted(ids)}")
    found: set[str] = set()
    for record in records:
        (question,) = record.request.questions
        if question.type != "choice":
            raise ValueError(f"a router question must be 'choice', {question.id!r} is {question.type!r}")
        found.update(question.option_ids())
    return tuple(sorted(found))


def _batches(examples: Sequence[_Example], rows: Sequence[torch.Tensor], size: int,
             rng: random.Random) -> list[list[_Example]]:
    """Shuffled batches of examples with similar state lengths (less padding)."""
    keyed = sorted(examples, key=lambda e: rows[e.state].shape[0] * (1.0 + 0.3 * rng.random()))
    batches = [list(keyed[i : i + size]) for i in range(0, len(keyed), size)]
    rng.shuffle(batches)
    return batches


def _evaluate(head: torch.nn.Module, examples: Sequence[_Example], rows: Sequence[torch.Tensor],
              config: TrainConfig, run: Callable[..., Any]) -> tuple[float, float]:
    if not examples:
        return math.nan, math.nan
    head.eval()
    total, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(examples), 64):
            logits, target, valid, ordinal = run(examples[start : start + 64])
            loss = soft_loss(logits, target, valid, config.label_smoothing, config.brier_weight, ordinal,
                             config.ordinal_weight)
            total += float(loss) * len(target)
            correct += int((logits.argmax(-1) == target).sum())
            count += len(target)
    return total / count, correct / count


def _collect(head: torch.nn.Module, examples: Sequence[_Example], run: Callable[..., Any]) -> tuple[
        list[torch.Tensor], list[int]]:
    zs: list[torch.Tensor] = []
    ys: list[int] = []
    with torch.no_grad():
        for start in range(0, len(examples), 64):
            logits, target, _, _ = run(examples[start : start + 64])
            zs.extend(logits)
            ys.extend(int(y) for y in target)
    return zs, ys


def _calibrate(head: torch.nn.Module, examples: Sequence[_Example], config: TrainConfig, run: Callable[..., Any],
               records: Sequence[LabelledRecord], questions: dict[str, ModelQuestion],
               bias: dict[str, dict[str, float]]) -> dict[str, float]:
    """One temperature per question id, fitted on the validation examples (after any label bias)."""
    per_id: dict[str, tuple[list[torch.Tensor], list[int]]] = {}
    with torch.no_grad():
        for start in range(0, len(examples), 64):
            batch = examples[start : start + 64]
            logits, target, valid, _ = run(batch)
            qids = [_id_of(k, config) for e in batch for k in e.questions]
            for qid, z, m, y in zip(qids, logits, valid, target, strict=True):
                bucket = per_id.setdefault(qid, ([], []))
                if qid in bias:
                    z = z + torch.tensor([bias[qid].get(label, 0.0) for label in questions[qid].labels])
                bucket[0].append(z[m])
                bucket[1].append(int(y))
    return {qid: fit_temperature(zs, ys) for qid, (zs, ys) in per_id.items()}


def _id_of(key: str, config: TrainConfig) -> str:
    """The question id stored in a :func:`json_key`."""
    import json

    qid: str = json.loads(key)[0]
    return qid
