"""Training the catalog model (``guard train``): the encoder's top layers fine-tuned jointly with per-question heads.

The lower layers of all-MiniLM-L6-v2 stay frozen, so each training text is run through them **once** (its windows'
hidden states are kept in memory as float16); every step then runs only the ``top_layers`` fine-tuned layers and
the heads (:class:`~guard.compact.head.CatalogHead`), forward and backward. A text is read as serving reads it
(:func:`~guard.compact.model.segments`): a long text of a text question as its sentence pieces, a pair's text as
overlapping windows. A record's label belongs to the whole state while the model scores pieces or windows: the loss
is taken on the one the model itself would answer with (the one most in favour of the question's ``risky`` option,
or the highest expected level; multiple-instance learning), so the training objective and the max-over-pieces
answer agree. Long training texts keep at most ``train_pieces`` evenly spaced pieces (text questions) or
``train_windows`` windows (pair questions).

Loss per record: label-smoothed cross-entropy + ``brier_weight`` × Brier (+ ``ordinal_weight`` × the expected-level
error for score questions), :func:`guard.compact.train.soft_loss`. AdamW (``layer_learning_rate`` for the encoder
layers, ``learning_rate`` for the heads), linear warm-up then cosine decay, seeded, a tqdm bar per epoch.

With ``head_epochs`` the heads then train alone for that many more epochs (a second warm-up and decay) on the
fine-tuned top layers' output, computed once: a joint epoch gives a question with a few hundred records a few dozen
steps, far from a fitted head. ``head_questions`` limits them to some questions' heads (the pair questions, whose
records are few), leaving the others and the shared ``LayerNorm`` as the joint epochs left them, as the shipped
weights do. Off by default (``docs/compact-model.md`` has the measurements).

With ``layer_epochs`` the top layers train that many more epochs after the joint ones with every head frozen (their
own warm-up and decay at ``layer_learning_rate``), before any head epochs: the layer keeps learning while the heads
stay as one joint pass left them. Off by default.

Honest numbers (``folds=True``): before the final fit, one model per fold is trained without that fold's records
(records carry a ``fold``: a group of sources by provenance, ``guard/compact/data.py``) on a seeded share of the rest
and scores the held-out fold; it leaves out every training text a held-out record shares, for any question (the same
text up to case and punctuation, one inside the other, or one template with other fillers: :func:`_shared_texts`),
so no fold model has read the records it scores. The out-of-fold answers give the leave-one-source-group-out
metrics (pooled, per fold and per source), calibrated as the procedure would be on new sources: for each fold a
temperature fitted on the other folds' out-of-fold logits (:func:`~guard.compact.train.fit_temperature`). The shipped model's temperatures are
fitted on ``val`` with the final weights (fold models train on a share of the data and are less sure of themselves,
so their temperatures would flatten the final model's answers).
"""

from __future__ import annotations

import math
import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from guard.compact import grounding
from guard.compact.catalog import CATALOG
from guard.compact.encoder import TextEncoder
from guard.compact.evaluate import question_metrics
from guard.compact.head import CatalogHead, masked_mean
from guard.compact.model import CompactModel, ModelQuestion, length_buckets, pick_window, segments, state_text
from guard.compact.records import LabelledRecord
from guard.compact.train import fit_temperature, soft_loss

__all__ = ["FinetuneConfig", "FinetuneReport", "ground", "grounded_val", "train_catalog"]

ProgressFactory = Callable[..., Any]
#: Most padded positions of one batch through the frozen layers.
_ENCODE_TOKENS = 4096
#: A fold name that can name a folder of ``fold_models`` (no separators, not ``.`` or ``..``).
_FOLD_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
#: Fewest words of a text that counts as read when it is found inside another (shorter ones must match whole).
_CONTAINED_WORDS = 8
#: Jaccard similarity of two texts' word 5-grams from which they are one text (a template with other fillers).
_NEAR = 0.8


@dataclass(frozen=True)
class FinetuneConfig:
    """Settings of :func:`train_catalog` (``docs/compact-model.md`` gives the shipped model's command).

    Attributes:
        epochs: passes over the training records of the final model.
        batch_size: records per step.
        learning_rate: AdamW rate of the heads.
        layer_learning_rate: AdamW rate of the fine-tuned encoder layers (0 freezes them: the frozen-encoder baseline).
        weight_decay, label_smoothing, brier_weight, ordinal_weight: loss and optimiser settings.
        seed: seeds torch and Python ``random``.
        train_windows: most windows kept per training text of a pair question (evenly spaced).
        train_pieces: most pieces kept per long training text of a text question (evenly spaced).
        top_layers: encoder layers fine-tuned (the top ones; the rest stay frozen).
        fold_share: share of the other folds' training records a fold model trains on.
        fold_epochs: epochs of a fold model.
        head_epochs: epochs of the heads alone after the joint epochs (final and fold models), on the fine-tuned
            top layers' states of the training texts, computed once with those layers frozen. 0 skips them (the
            shipped weights: 20, for the pair questions' heads).
        layer_epochs: epochs of the top layers alone after the joint epochs, every head and the ``LayerNorm``
            frozen (final and fold models; before the head epochs). 0 skips them (the shipped weights).
        head_questions: catalog question ids whose heads the head epochs train, on those questions' records only;
            the other questions' heads and the ``LayerNorm`` all questions share stay as the joint epochs left them.
            Empty: every head and the ``LayerNorm``.
        source_balance: exponent ``a`` of source-balanced sampling. Each epoch draws a question's records of a source
            in proportion to ``n ** a`` (``n``: that source's records of the question), the epoch keeping its
            length: 1 trains on the records as they are, 0.5 gives a source four times the size twice the share,
            0 gives every source of a question the same share. Small sources are repeated, large ones subsampled
            afresh each epoch (temperature sampling, as multilingual models balance languages).
    """

    epochs: int = 2
    batch_size: int = 16
    learning_rate: float = 2e-3
    layer_learning_rate: float = 1e-4
    weight_decay: float = 0.01
    label_smoothing: float = 0.05
    brier_weight: float = 0.5
    ordinal_weight: float = 1.0
    seed: int = 0
    train_windows: int = 2
    train_pieces: int = 32
    top_layers: int = 1
    fold_share: float = 0.3
    fold_epochs: int = 1
    head_epochs: int = 0
    layer_epochs: int = 0
    head_questions: tuple[str, ...] = ()
    source_balance: float = 1.0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "train_windows", "train_pieces", "top_layers", "fold_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("head_epochs", "layer_epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"learning_rate must be a number > 0, got {self.learning_rate}")
        if not (math.isfinite(self.layer_learning_rate) and self.layer_learning_rate >= 0):
            raise ValueError(f"layer_learning_rate must be a number >= 0 (0 freezes the layers), got "
                             f"{self.layer_learning_rate}")
        if self.layer_epochs and self.layer_learning_rate <= 0:
            raise ValueError("layer_epochs needs layer_learning_rate > 0 (they train the top layers alone)")
        if self.head_questions and not self.head_epochs:
            raise ValueError("head_questions needs head_epochs (they name the heads the head epochs train)")
        unknown = sorted(set(self.head_questions) - set(CATALOG))
        if unknown:
            raise ValueError(f"head_questions {unknown} are not catalog questions; known: {sorted(CATALOG)}")
        if not 0.0 < self.fold_share <= 1.0:
            raise ValueError(f"fold_share must be in (0, 1], got {self.fold_share}")
        if not 0.0 <= self.source_balance <= 1.0:
            raise ValueError(f"source_balance must be in [0, 1], got {self.source_balance}")


@dataclass
class FinetuneReport:
    """The final model's losses, the out-of-fold (leave-one-source-group-out) metrics and the fitted temperatures.

    ``train_loss`` has one entry per joint epoch, then one per layer epoch, then one per head epoch; ``val_loss``
    one per joint and per layer epoch, then one after the head epochs. ``val`` holds the metrics of the saved model's
    answers on the validation records: the head's answers calibrated by ``temperatures``, fitted on those records;
    for a grounded question (:func:`ground` ran) its grounded answer, whose grounding was fitted on the training
    *and* validation records, so its entry says ``"held_out": false`` and it has no temperature (the grounding
    answers in its place). ``grounding`` holds the report of :func:`ground` when it ran (out-of-source numbers).
    ``heldout`` holds the out-of-fold metrics and, as ``left_out_texts``, how many training texts each fold model
    left out because its held-out fold shares them."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    temperatures: dict[str, float] = field(default_factory=dict)
    heldout: dict[str, Any] = field(default_factory=dict)
    val: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    grounding: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Example:
    text: int
    question: int
    target: int
    fold: str
    source: str


class _Stack:
    """Per text (an int id) its windows' states ``(W, L, H)`` float16 and ``(W, L)`` bool masks, padded into one
    batch on demand."""

    def __init__(self, hidden: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
                 mask: Mapping[int, torch.Tensor] | Sequence[torch.Tensor]) -> None:
        self.hidden, self.mask = hidden, mask

    def batch(self, texts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Every window of ``texts`` padded into one float32 batch, its mask, and each text's window count."""
        counts = [self.hidden[t].shape[0] for t in texts]
        width = max(self.hidden[t].shape[1] for t in texts)
        hidden = torch.zeros(sum(counts), width, self.hidden[texts[0]].shape[-1])
        mask = torch.zeros(sum(counts), width, dtype=torch.bool)
        row = 0
        for t in texts:
            n, length = self.hidden[t].shape[:2]
            hidden[row : row + n, :length] = self.hidden[t].float()
            mask[row : row + n, :length] = self.mask[t]
            row += n
        return hidden, mask, counts


class _Windows(_Stack):
    """The training texts' windows below the fine-tuned top layers, float16, in memory.

    Each item is ``(text, sentences)``: a text question's text (``sentences`` true) is cut into pieces as serving
    cuts it (:func:`~guard.compact.model.segments`) and keeps at most ``pieces`` of them, evenly spaced; a pair's
    text keeps at most ``windows`` windows. All windows run through the frozen layers in batches of similar length.
    """

    def __init__(self, encoder: TextEncoder, items: Sequence[tuple[str, bool]], *, windows: int, pieces: int,
                 top: int, progress: ProgressFactory | None) -> None:
        kept: list[list[torch.Tensor]] = []
        for text, sentences in items:
            ids, mask, _, _ = encoder.window_batch(segments(encoder, text, sentences=sentences)[0])
            rows = _spaced(ids.shape[0], pieces if sentences else windows)
            kept.append([ids[r, : int(mask[r].sum())] for r in rows])
        order = sorted(((t, w) for t, rows in enumerate(kept) for w in range(len(rows))),
                       key=lambda tw: len(kept[tw[0]][tw[1]]))
        states: list[list[torch.Tensor]] = [[torch.empty(0)] * len(rows) for rows in kept]
        bar = progress(total=len(order), desc="encoding texts", unit="window") if progress else None
        batches: list[list[tuple[int, int]]] = [[]]
        for t, w in order:  # shortest first: a batch's last window is its widest
            if batches[-1] and (len(batches[-1]) + 1) * len(kept[t][w]) > _ENCODE_TOKENS:
                batches.append([])
            batches[-1].append((t, w))
        for batch in batches:
            width = len(kept[batch[-1][0]][batch[-1][1]])
            ids = torch.full((len(batch), width), encoder.pad_id, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.bool)
            for row, (t, w) in enumerate(batch):
                ids[row, : len(kept[t][w])] = kept[t][w]
                mask[row, : len(kept[t][w])] = True
            hidden = encoder.lower(ids, mask, top=top)
            for row, (t, w) in enumerate(batch):
                states[t][w] = hidden[row, : len(kept[t][w])].to(torch.float16).clone()
            if bar:
                bar.update(len(batch))
        if bar:
            bar.close()
        padded: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        for rows in states:
            width = max(r.shape[0] for r in rows)
            hidden = torch.zeros(len(rows), width, encoder.hidden_size, dtype=torch.float16)
            mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for w, r in enumerate(rows):
                hidden[w, : r.shape[0]], mask[w, : r.shape[0]] = r, True
            padded.append(hidden)
            masks.append(mask)
        super().__init__(padded, masks)


def _spaced(count: int, limit: int) -> list[int]:
    """At most ``limit`` of ``range(count)``, evenly spaced, the first and last kept."""
    if count <= limit:
        return list(range(count))
    if limit == 1:
        return [0]
    step = (count - 1) / (limit - 1)
    return [round(i * step) for i in range(limit)]


def train_catalog(
    train_records: Sequence[LabelledRecord],
    val_records: Sequence[LabelledRecord],
    config: FinetuneConfig,
    encoder: TextEncoder,
    *,
    folds: bool = True,
    fold_models: Path | None = None,
    progress: ProgressFactory | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[CompactModel, FinetuneReport]:
    """Fine-tune the catalog model and return it calibrated, with its report.

    Args:
        train_records: labelled records of catalog questions (their ``fold`` is used when ``folds``).
        val_records: validation records (loss per epoch; the calibration temperatures, fitted with the final weights).
        config: settings.
        encoder: the encoder (its lower layers stay frozen; its window settings are the model's).
        folds: run the leave-one-fold-out models first (records without a fold are never held out).
        fold_models: also save each fold model as a checkpoint in ``fold_models/<fold>`` (temperatures 1.0; its
            ``meta.held_out`` names the fold), so its held-out records can be scored again through any serving path
            (``bench/compact_int8_drift.py --folds``, ``guard eval --backend compact:DIR/<fold>``).
        progress: a ``tqdm``-like factory, or ``None``.
        log: receives one line per epoch and per fold.

    Raises:
        ValueError: no training records, a question that is not in the catalog (naming the first record that asks
            it), ``head_questions`` the records do not ask, ``folds`` with the training records of one fold, or
            ``fold_models`` without ``folds`` or with a fold name that cannot name a folder, or a fold whose other
            folds' training texts it all shares. ``folds`` with no record of a fold logs a warning (no held-out
            numbers).
    """
    if not train_records:
        raise ValueError("no training records")
    if folds:
        named = sorted({r.fold for r in train_records if r.fold})
        if len(named) == 1:
            first = next(r for r in train_records if r.fold)
            raise ValueError(f"every training record with a fold is in fold {named[0]!r} (first at "
                             f"{first.where or first.record_id}): leave-one-fold-out needs records of at least two "
                             f"folds to hold one out; give the records other folds, or train without the held-out "
                             f"models (folds=False, guard train --no-folds)")
    if fold_models is not None:
        if not folds:
            raise ValueError("fold_models needs folds (the fold models are those of the leave-one-fold-out runs)")
        unsafe = sorted({r.fold for r in train_records if r.fold and not _FOLD_NAME.fullmatch(r.fold)})
        if unsafe:
            raise ValueError(f"fold names {unsafe} cannot name a folder of fold_models: letters, digits, '_', '-' "
                             f"and '.' only, not starting with '.'")
    torch.manual_seed(config.seed)
    ids = [qid for qid in CATALOG if any(qid in r.labels for r in (*train_records, *val_records))]
    unknown = sorted({q for r in (*train_records, *val_records) for q in r.labels} - set(CATALOG))
    if unknown:
        first = next(r for r in (*train_records, *val_records) if set(r.labels) - set(CATALOG))
        raise ValueError(f"the catalog model answers catalog questions only; the records ask {unknown} (first at "
                         f"{first.where or first.record_id})")
    if folds and not any(r.fold for r in train_records):
        log("warning: no training record has a 'fold' field, so no model is trained without a fold and the report "
            "has no held-out (leave-one-source-group-out) numbers ('heldout' is empty); give each record a 'fold' "
            "(python -m guard.compact.data writes them), or train with --no-folds (folds=False) to skip them "
            "without this warning")
    unasked = sorted(set(config.head_questions) - set(ids))
    if unasked:
        raise ValueError(f"head_questions {unasked} are not asked by the training or validation records")
    entries = [CATALOG[qid] for qid in ids]
    options = [len(entry.to_question().options()) for entry in entries]
    texts: dict[tuple[str, bool], int] = {}
    train_examples, val_examples = _examples(train_records, ids, texts), _examples(val_records, ids, texts)
    report = FinetuneReport()
    started = time.perf_counter()
    windows = _Windows(encoder, list(texts), windows=config.train_windows, pieces=config.train_pieces,
                       top=config.top_layers, progress=progress)
    report.seconds["encode"] = time.perf_counter() - started
    layers = encoder.model.encoder.layer[-config.top_layers :]

    def run_epochs(head: CatalogHead, groups: list[dict[str, Any]], selected: Sequence[_Example], stack: _Stack,
                   epochs: int, desc: str, rng: random.Random, *, top: bool, val: Sequence[_Example] = ()
                   ) -> list[float]:
        """``epochs`` AdamW epochs (warm-up then cosine) of ``groups`` on ``selected``; ``stack`` holds the states
        below the top layers (``top``: run them) or their output. Returns the mean training loss per epoch; with
        ``val``, appends the validation loss after each epoch to the report and logs both."""
        optimizer = torch.optim.AdamW(groups, weight_decay=config.weight_decay)
        schedule = _warmup_cosine(optimizer, epochs * math.ceil(len(selected) / config.batch_size))
        losses = []
        for epoch in range(epochs):
            head.train()
            drawn = balanced(selected, config.source_balance, rng) if config.source_balance < 1.0 else selected
            batches = _batches(drawn, stack, config.batch_size, rng)
            bar = progress(total=len(batches), desc=f"{desc} epoch {epoch + 1}/{epochs}", unit="batch") \
                if progress else None
            total = 0.0
            for batch in batches:
                loss = _loss(head, batch, stack, entries, config, top=top)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for group in groups for p in group["params"]], 1.0)
                optimizer.step()
                schedule.step()
                total += float(loss.detach())
                if bar:
                    bar.update(1)
                    bar.set_postfix(loss=f"{float(loss.detach()):.4f}")
            if bar:
                bar.close()
            losses.append(total / max(1, len(batches)))
            if val:
                report.val_loss.append(_mean_loss(head, val, windows, entries, config))
                log(f"{desc} epoch {epoch + 1}: train loss {losses[-1]:.4f}, val loss {report.val_loss[-1]:.4f}")
        return losses

    def fit_heads(head: CatalogHead, refit: Sequence[_Example], desc: str) -> list[float]:
        """The head epochs on ``refit`` over the frozen top layers' output. With ``config.head_questions`` the
        ``LayerNorm`` all questions share stays frozen and the other questions' rows of the query, weight and bias
        (which get no gradient, only AdamW's weight decay) are put back afterwards."""
        head.top.requires_grad_(False)
        tops = _top_states(head.eval(), windows, sorted({e.text for e in refit}), progress)
        others = [q for q, qid in enumerate(ids) if config.head_questions and qid not in config.head_questions]
        if config.head_questions:
            head.norm.requires_grad_(False)
        rows = [head.query, head.weight, head.bias]
        kept = [p.detach()[others].clone() for p in rows]
        params = [p for p in head.parameters() if p.requires_grad]
        losses = run_epochs(head, [{"params": params, "lr": config.learning_rate}], refit, tops, config.head_epochs,
                            f"{desc} heads", random.Random(f"{config.seed}|heads|{desc}"), top=False)
        with torch.no_grad():
            for p, saved in zip(rows, kept, strict=True):
                p[others] = saved
        return losses

    def fit(selected: Sequence[_Example], epochs: int, desc: str, val: Sequence[_Example] = ()) -> CatalogHead:
        torch.manual_seed(config.seed)
        rng = random.Random(f"{config.seed}|{desc}")  # its own draws: the fold models leave the final model as it is
        head = CatalogHead(layers, options, encoder.hidden_size)
        heads = [p for n, p in head.named_parameters() if not n.startswith("top.")]
        groups = [{"params": heads, "lr": config.learning_rate}]
        if config.layer_learning_rate > 0:
            groups.append({"params": list(head.top.parameters()), "lr": config.layer_learning_rate})
        else:
            head.top.requires_grad_(False)
        losses = run_epochs(head, groups, selected, windows, epochs, desc, rng, top=True, val=val)
        if config.layer_epochs:
            for p in heads:
                p.requires_grad_(False)
            losses += run_epochs(head, [{"params": list(head.top.parameters()), "lr": config.layer_learning_rate}],
                                 selected, windows, config.layer_epochs, f"{desc} layer", rng, top=True, val=val)
            for p in heads:
                p.requires_grad_(True)
        refit = [e for e in selected if not config.head_questions or ids[e.question] in config.head_questions]
        if config.head_epochs and refit:
            losses += fit_heads(head, refit, desc)
            if val:
                report.val_loss.append(_mean_loss(head, val, windows, entries, config))
                log(f"{desc} heads: train loss {losses[-1]:.4f}, val loss {report.val_loss[-1]:.4f}")
        if desc == "final":
            report.train_loss = losses
        return _rounded(head.eval())

    heldout: list[tuple[_Example, torch.Tensor]] = []
    read: dict[str, set[int]] = {}
    if folds:
        names = sorted({e.fold for e in train_examples if e.fold})
        for name in names:
            scored = [e for e in (*train_examples, *val_examples) if e.fold == name]
            read[name] = _shared_texts([e for e in train_examples if e.fold != name], scored, list(texts))
            rest = [e for e in train_examples if e.fold != name and e.text not in read[name]]
            if not rest:
                raise ValueError(f"every training record of the folds other than {name!r} shares its text with a "
                                 f"record of {name!r}, so no model can be trained without having read it; give the "
                                 f"folds distinct texts, or train without the held-out models (folds=False, guard "
                                 f"train --no-folds)")
            rng_fold = random.Random(f"{config.seed}|{name}")
            share = rng_fold.sample(rest, max(1, round(len(rest) * config.fold_share)))
            t0 = time.perf_counter()
            head = fit(share, config.fold_epochs, f"fold {name}")
            heldout.extend(zip(scored, _logits(head, scored, windows, entries), strict=True))
            report.seconds[f"fold_{name}"] = time.perf_counter() - t0
            if fold_models is not None:
                head.top.to(encoder.dtype)
                CompactModel(encoder, head, _questions(entries, {}), kind="catalog",
                             meta={"config": asdict(config), "held_out": name}).save(fold_models / name)
            log(f"fold {name}: trained on {len(share)} records of the other folds (left out the texts of "
                f"{len(read[name])} that the held-out records share), scored {len(scored)} held out")
    t0 = time.perf_counter()
    head = fit(train_examples, config.epochs, "final", val_examples)
    report.seconds["final"] = time.perf_counter() - t0
    val_logits = _logits(head, val_examples, windows, entries)
    if heldout:
        report.heldout = _heldout_report(heldout, ids, entries)
        report.heldout["left_out_texts"] = {name: len(shared) for name, shared in read.items()}
        report.heldout["frozen_encoder"] = _frozen_baseline(layers, windows, train_examples, val_examples, ids,
                                                            entries, read, progress)
    pairs = list(zip(val_examples, val_logits, strict=True))
    report.temperatures = {ids[q]: fit_temperature(*_pairs(pairs, q)) for q in range(len(ids))
                           if _pairs(pairs, q)[0]}
    report.val = _metrics(list(zip(val_examples, val_logits, strict=True)), ids, entries, report.temperatures)
    head.top.to(encoder.dtype)  # as a loaded checkpoint runs it
    model = CompactModel(encoder, head, _questions(entries, report.temperatures), kind="catalog", meta={})
    calls = [r for r in (*train_records, *val_records) if grounding.QUESTION in r.labels]
    if len({r.source for r in calls}) >= 2:
        t0 = time.perf_counter()
        report.grounding = ground(model, calls, progress)
        report.seconds["grounding"] = time.perf_counter() - t0
        log(f"grounding: {grounding.QUESTION} fitted on {len(calls)} records, leave one source out")
        # the saved answer of the question is the grounded one, not the head's with a temperature
        report.temperatures.pop(grounding.QUESTION, None)
        if grounding.QUESTION in report.val:
            report.val[grounding.QUESTION] = grounded_val(model, val_records)
    elif calls:
        log(f"grounding: skipped; {grounding.QUESTION} records come from fewer than two sources")
    model.meta.update({"config": asdict(config), "folds": folds, "report": report.to_json()})
    return model, report


def ground(model: CompactModel, records: Sequence[LabelledRecord], progress: ProgressFactory | None = None
           ) -> dict[str, Any]:
    """Fit the argument grounding of ``guard.tool_call_serves_task`` (:mod:`guard.compact.grounding`) on the
    ``records`` that label it, leave one ``source`` out, and put it in ``model``: the head's readout of that question
    becomes the fitted readout (rounded to bf16, as it is saved) and the question's entry gets the stacked
    :class:`~guard.compact.grounding.Grounding` in place of its temperature. The encoder and the other questions do
    not change. Returns the fit's report (``GroundingFit.report``: per-source AUROCs of the model's logit and of
    the grounded answer, each out of source).

    A grounded question is refused: its readout was fitted on every record, and it picks the window each record is
    read by, so a second fit would pick windows with the labels of the sources it holds out.

    Raises:
        ValueError: the model does not answer the question or is already grounded, or the records hold fewer than
            two sources of it.
    """
    question = grounding.QUESTION
    if question not in model.questions or not isinstance(model.head, CatalogHead):
        raise ValueError(f"the model does not answer {question}; grounding needs a catalog model that does")
    if model.questions[question].grounding is not None:
        raise ValueError(f"{question} is already grounded; ground the checkpoint it was grounded from (its readout "
                         f"would pick each record's window with every source's labels)")
    chosen = [r for r in records if question in r.labels]
    view = CATALOG[question].view
    bar = progress(total=len(chosen), desc="grounding", unit="record") if progress else None
    pooled = []
    for record in chosen:
        pooled.append(model.pooled(state_text(record.request.state, view), question).numpy())
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    fitted = grounding.fit(np.stack(pooled) if pooled else np.zeros((0, 0)),
                           [grounding.call_features(r.request.state) for r in chosen],
                           [r.labels[question] == 0 for r in chosen], [r.source for r in chosen])
    weight = torch.from_numpy(fitted.weight).to(torch.bfloat16).float()
    model.head.set_noul_readout(list(model.questions).index(question), weight, fitted.bias)
    model.questions[question] = replace(model.questions[question], temperature=1.0, grounding=fitted.grounding)
    return fitted.report


def grounded_val(model: CompactModel, val_records: Sequence[LabelledRecord]) -> dict[str, Any]:
    """The metrics of the grounded question's saved answer on the validation records (as serving reads a record,
    without the language check), marked as not held out: its grounding was fitted on these records too."""
    question = grounding.QUESTION
    entry = CATALOG[question]
    asked = entry.to_question()
    chosen = [r for r in val_records if question in r.labels]
    answers = []
    for record in chosen:
        logits, _, _, _ = model.window_logits(state_text(record.request.state, entry.view), [question])
        answers.append(model.probabilities(asked, logits[0][pick_window(logits[0], entry)], record.request.state))
    option_ids = [o for o, _ in asked.options()]
    metrics = question_metrics(question, entry.type, option_ids, answers, [r.labels[question] for r in chosen])
    return {**metrics.to_json(), "held_out": False,
            "note": "the saved (grounded) answer; its grounding was fitted on the training and these validation "
                    "records, so these numbers are not held out (report.grounding has out-of-source ones)"}


def _questions(entries: Sequence[Any], temperatures: dict[str, float]) -> dict[str, ModelQuestion]:
    """The checkpoint's question table: each catalog entry with its fitted temperature (1.0 where none)."""
    return {
        entry.id: ModelQuestion(entry.id, entry.type, entry.instructions,
                                list(entry.criteria) if entry.criteria else None,
                                temperature=temperatures.get(entry.id, 1.0))
        for entry in entries
    }


def _loss(head: CatalogHead, batch: Sequence[_Example], stack: _Stack, entries: Sequence[Any],
          config: FinetuneConfig, *, top: bool = True) -> torch.Tensor:
    """The mean :func:`~guard.compact.train.soft_loss` of ``batch``, each record scored by its chosen window;
    ``stack`` holds the states below the top layers (``top``: run them) or their output."""
    hidden, mask, counts = stack.batch([e.text for e in batch])
    question = torch.tensor([e.question for e, n in zip(batch, counts, strict=True) for _ in range(n)])
    per_window = head.score(_encoded(head, hidden, mask) if top else hidden, mask, question)
    logits = torch.stack(_per_record(per_window, counts, batch, entries))
    target = torch.tensor([e.target for e in batch])
    ordinal = torch.tensor([entries[e.question].type == "score" for e in batch])
    return soft_loss(logits, target, torch.isfinite(logits), config.label_smoothing, config.brier_weight, ordinal,
                     config.ordinal_weight)


def _encoded(head: CatalogHead, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``head.encode`` of a padded batch run in length buckets (:func:`~guard.compact.model.length_buckets`), so
    short pieces next to a full window are not padded to its width; the same states as one padded call."""
    states = torch.zeros(hidden.shape)
    for rows, width in length_buckets(mask.sum(-1)):
        states[rows, :width] = head.encode(hidden[rows, :width], mask[rows, :width])
    return states


def _top_states(head: CatalogHead, windows: _Windows, texts: Sequence[int],
                progress: ProgressFactory | None) -> _Stack:
    """The top layers' output for the windows of ``texts`` (float16, no gradient), keyed by text."""
    hidden: dict[int, torch.Tensor] = {}
    order = sorted(texts, key=lambda t: windows.hidden[t].numel())  # similar sizes batch with little padding
    bar = progress(total=len(order), desc="top-layer states", unit="text") if progress else None
    with torch.no_grad():
        for start in range(0, len(order), 64):
            chunk = order[start : start + 64]
            batch, mask, counts = windows.batch(chunk)
            states = _encoded(head, batch, mask)
            row = 0
            for t, n in zip(chunk, counts, strict=True):
                hidden[t] = states[row : row + n, : windows.hidden[t].shape[1]].to(torch.float16)
                row += n
            if bar:
                bar.update(len(chunk))
    if bar:
        bar.close()
    return _Stack(hidden, {t: windows.mask[t] for t in order})


def _per_record(per_window: torch.Tensor, counts: Sequence[int], batch: Sequence[_Example],
                entries: Sequence[Any]) -> list[torch.Tensor]:
    out, row = [], 0
    for example, n in zip(batch, counts, strict=True):
        rows = per_window[row : row + n]
        out.append(rows[pick_window(rows.detach(), entries[example.question])])
        row += n
    return out


def _logits(head: CatalogHead, examples: Sequence[_Example], windows: _Windows,
            entries: Sequence[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(examples), 32):
            batch = examples[start : start + 32]
            hidden, mask, counts = windows.batch([e.text for e in batch])
            question = torch.tensor([e.question for e, n in zip(batch, counts, strict=True) for _ in range(n)])
            per_window = head.score(_encoded(head, hidden, mask), mask, question)
            out.extend(z.clone() for z in _per_record(per_window, counts, batch, entries))
    return out


def _mean_loss(head: CatalogHead, examples: Sequence[_Example], windows: _Windows, entries: Sequence[Any],
               config: FinetuneConfig) -> float:
    head.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(examples), 32):
            batch = examples[start : start + 32]
            total += float(_loss(head, batch, windows, entries, config)) * len(batch)
    head.train()
    return total / max(1, len(examples))


def _pairs(pairs: Sequence[tuple[_Example, torch.Tensor]], q: int) -> tuple[list[torch.Tensor], list[int]]:
    chosen = [(z, e.target) for e, z in pairs if e.question == q]
    return [z[torch.isfinite(z)] for z, _ in chosen], [y for _, y in chosen]


def _metrics(pairs: Sequence[tuple[_Example, torch.Tensor]], ids: Sequence[str], entries: Sequence[Any],
             temperatures: dict[str, float], by: Callable[[_Example], str] | None = None) -> dict[str, Any]:
    """Metrics per question (and per ``by`` group) with the temperatures applied."""
    buckets: dict[tuple[str, str], list[tuple[list[float], int]]] = defaultdict(list)
    for example, z in pairs:
        qid = ids[example.question]
        p = torch.softmax(z[torch.isfinite(z)].double() / temperatures.get(qid, 1.0), -1).tolist()
        buckets[(qid, by(example) if by else "")].append((p, example.target))
    out: dict[str, Any] = {}
    for (qid, group), rows in sorted(buckets.items()):
        entry = entries[ids.index(qid)]
        option_ids = [o for o, _ in entry.to_question().options()]
        metrics = question_metrics(qid, entry.type, option_ids, [p for p, _ in rows], [y for _, y in rows]).to_json()
        if by:
            out.setdefault(qid, {})[group] = metrics
        else:
            out[qid] = metrics
    return out


def _heldout_report(pairs: Sequence[tuple[_Example, torch.Tensor]], ids: Sequence[str],
                    entries: Sequence[Any]) -> dict[str, Any]:
    """Out-of-fold metrics: pooled per question (each fold's temperature fitted on the other folds), per fold and
    per source."""
    cross: dict[str, float] = {}
    crossed: list[tuple[_Example, torch.Tensor]] = []
    for fold in sorted({e.fold for e, _ in pairs}):
        others = [(e, z) for e, z in pairs if e.fold != fold]
        for q, qid in enumerate(ids):
            zs, ys = _pairs(others, q)
            cross[f"{fold}|{qid}"] = fit_temperature(zs, ys) if zs else 1.0
        for e, z in pairs:
            if e.fold == fold:
                crossed.append((e, z / cross[f"{fold}|{ids[e.question]}"]))
    by_fold = _metrics(crossed, ids, entries, {}, by=lambda e: e.fold)
    return {
        "pooled": _metrics(crossed, ids, entries, {}),
        "by_fold": by_fold,
        "fold_mean": _fold_mean(by_fold),
        "by_source": _metrics(crossed, ids, entries, {}, by=lambda e: e.source),
    }


def _fold_mean(by_fold: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per question, the mean over folds of each fold's AUROC and Spearman (folds where it is defined): unlike the
    pooled numbers, not moved by the fold models' different calibrations."""
    out: dict[str, dict[str, float]] = {}
    for qid, folds in by_fold.items():
        for metric in ("auroc", "spearman"):
            values = [m[metric] for m in folds.values() if isinstance(m.get(metric), float)
                      and not math.isnan(m[metric])]
            if values:
                out.setdefault(qid, {})[metric] = sum(values) / len(values)
    return out


def _frozen_baseline(layers: Sequence[torch.nn.Module], windows: _Windows, train_examples: Sequence[_Example],
                     val_examples: Sequence[_Example], ids: Sequence[str], entries: Sequence[Any],
                     read: Mapping[str, set[int]], progress: ProgressFactory | None) -> dict[str, Any]:
    """The frozen-encoder comparison on the same folds: all-MiniLM-L6-v2 as shipped (mean-pooled sentence
    embedding of each window), a logistic regression per question (scikit-learn, ``C=1``) trained on the other folds'
    first pieces or windows (less the texts ``read[fold]`` the fold shares, as the fold models), the record answered
    by its piece or window with the highest score. Out-of-fold metrics pooled, per fold and their mean over folds."""
    from sklearn.linear_model import LogisticRegression

    head = CatalogHead(layers, [2], windows.hidden[0].shape[-1]).eval()
    features: dict[int, torch.Tensor] = {}
    texts = sorted({e.text for e in (*train_examples, *val_examples)})
    bar = progress(total=len(texts), desc="frozen-encoder features", unit="text") if progress else None
    with torch.no_grad():
        for start in range(0, len(texts), 32):
            chunk = texts[start : start + 32]
            hidden, mask, counts = windows.batch(chunk)
            pooled = masked_mean(head.encode(hidden, mask), mask)
            row = 0
            for t, n in zip(chunk, counts, strict=True):
                features[t] = pooled[row : row + n].numpy()
                row += n
            if bar:
                bar.update(len(chunk))
    if bar:
        bar.close()
    pairs: list[tuple[_Example, torch.Tensor]] = []
    every = [*train_examples, *val_examples]
    for fold in sorted({e.fold for e in train_examples if e.fold}):
        for q, entry in enumerate(entries):
            rest = [e for e in train_examples if e.fold != fold and e.question == q and e.text not in read[fold]]
            held = [e for e in every if e.fold == fold and e.question == q]
            if not held or len({e.target for e in rest}) < 2:
                continue
            model = LogisticRegression(C=1.0, max_iter=2000).fit(
                [features[e.text][0] for e in rest], [e.target for e in rest])
            k = len(entry.to_question().options())
            for e in held:
                # an option no training record of these folds had gets log-probability -1e4 (probability 0), finite
                # because the metrics drop non-finite logits as options the question does not have
                scores = torch.full((features[e.text].shape[0], k), -1e4, dtype=torch.float64)
                scores[:, model.classes_] = torch.from_numpy(model.predict_log_proba(features[e.text]))
                pairs.append((e, scores[pick_window(scores, entry)]))
    by_fold = _metrics(pairs, ids, entries, {}, by=lambda e: e.fold)
    return {"pooled": _metrics(pairs, ids, entries, {}), "by_fold": by_fold, "fold_mean": _fold_mean(by_fold)}


def _examples(records: Sequence[LabelledRecord], ids: Sequence[str], texts: dict[tuple[str, bool], int]
              ) -> list[_Example]:
    """One example per record and question of ``ids`` it labels; ``texts`` numbers each ``(text, text view)``, adding
    those it has not seen."""
    out = []
    for record in records:
        for qid, target in record.labels.items():
            q, view = ids.index(qid), CATALOG[qid].view
            item = (state_text(record.request.state, view), view == "text")
            out.append(_Example(texts.setdefault(item, len(texts)), q, target, record.fold, record.source))
    return out


def fold_overlap(train_records: Sequence[LabelledRecord], val_records: Sequence[LabelledRecord]
                 ) -> dict[str, dict[str, Any]]:
    """How much each fold shares with the other folds' training records (:func:`_shared_texts`), by fold: the
    training texts its fold model leaves out (``left_out_texts``) and, by question, the held-out records (training
    and validation records of the fold) whose text a fold model trained on every other fold's training records would
    have read (``shared`` of ``n``)."""
    ids = [qid for qid in CATALOG if any(qid in r.labels for r in (*train_records, *val_records))]
    texts: dict[tuple[str, bool], int] = {}
    train, val = _examples(train_records, ids, texts), _examples(val_records, ids, texts)
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({e.fold for e in train if e.fold}):
        held = [e for e in (*train, *val) if e.fold == name]
        rest = [e for e in train if e.fold != name]
        read = _shared_texts(held, rest, list(texts))
        by_question = {ids[q]: {"shared": sum(e.text in read for e in held if e.question == q),
                                "n": sum(e.question == q for e in held)}
                       for q in sorted({e.question for e in held})}
        out[name] = {"left_out_texts": len(_shared_texts(rest, held, list(texts))), "questions": by_question}
    return out


def _normalised(text: str) -> str:
    """``text`` compared up to case, white space and punctuation: casefolded words joined by single spaces (a text
    without words, braille or emoji, up to white space only, so it is not every other such text)."""
    return " ".join(re.sub(r"[\W_]+", " ", text.casefold()).split()) or " ".join(text.split())


def _shared_texts(train: Sequence[_Example], held: Sequence[_Example], texts: Sequence[tuple[str, bool]]) -> set[int]:
    """The texts of ``train`` that a ``held`` record shares, for any question (the fold models share their encoder
    layer): the same text up to case, white space and punctuation (:func:`_normalised`), or one of at least
    :data:`_CONTAINED_WORDS` words inside the other (a composed document's attack sentence, a document cut into
    pieces). A fold model trained on them would have read its held-out records.

    Args:
        train, held: the fold model's candidate training examples and the held-out fold's.
        texts: ``(text, text view)`` by an example's ``text`` index.
    """
    norm = {t: _normalised(texts[t][0]) for t in {e.text for e in (*train, *held)}}
    held_texts = {norm[e.text] for e in held}
    train_texts = {e.text for e in train}
    shared = {t for t in train_texts if norm[t] in held_texts}

    def starts(members: Iterable[str]) -> dict[str, list[str]]:
        """Texts of at least ``_CONTAINED_WORDS`` words by their first ``_CONTAINED_WORDS`` words."""
        out: dict[str, list[str]] = defaultdict(list)
        for text in members:
            words = text.split(" ")
            if len(words) >= _CONTAINED_WORDS:
                out[" ".join(words[:_CONTAINED_WORDS])].append(text)
        return out

    def inside(text: str, candidates: dict[str, list[str]]) -> Iterator[str]:
        """The candidates found in ``text`` as whole words."""
        words, padded = text.split(" "), f" {text} "
        for i in range(len(words) - _CONTAINED_WORDS + 1):
            for candidate in candidates.get(" ".join(words[i : i + _CONTAINED_WORDS]), ()):
                if f" {candidate} " in padded:
                    yield candidate

    held_starts = starts(held_texts)
    shared |= {t for t in train_texts - shared if any(inside(norm[t], held_starts))}
    by_norm: dict[str, list[int]] = defaultdict(list)
    for t in train_texts - shared:
        by_norm[norm[t]].append(t)
    train_starts = starts(by_norm)
    for text in held_texts:
        for found in inside(text, train_starts):
            shared.update(by_norm[found])
    held_grams = {text: grams for text in held_texts if (grams := _grams(text))}
    postings: dict[str, list[str]] = defaultdict(list)
    for text, grams in held_grams.items():
        for gram in grams:
            postings[gram].append(text)
    for t in train_texts - shared:
        grams = _grams(norm[t])
        counts = Counter(text for gram in grams for text in postings.get(gram, ()))
        if any(n >= _NEAR * len(grams | held_grams[text]) for text, n in counts.items()):
            shared.add(t)
    return shared


def _grams(text: str) -> set[str]:
    """The word 5-grams of a normalised text of at least :data:`_CONTAINED_WORDS` words (none for a shorter one)."""
    words = text.split(" ")
    if len(words) < _CONTAINED_WORDS:
        return set()
    return {" ".join(words[i : i + 5]) for i in range(len(words) - 4)}


def _rounded(head: CatalogHead) -> CatalogHead:
    """The head with its weights rounded to bf16 (their on-disk dtype), so scores match the saved checkpoint."""
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return head


def balanced(examples: Sequence[Any], exponent: float, rng: random.Random) -> list[Any]:
    """One epoch of source-balanced sampling: as many records as ``examples``, a (question, source) group of ``n``
    drawn ``len(examples) * n ** exponent / sum(n_g ** exponent)`` times (rounded down; the remainders go to the
    groups with the largest fractions). A group drawn ``k`` times gives ``k // n`` copies of each record plus
    ``k % n`` records sampled without replacement, so no record of a group is drawn twice before all were drawn once.

    Args:
        examples: records with ``question`` and ``source`` attributes.
        exponent: in [0, 1]; 1 returns every record once, 0 gives every group of a question the same count.
        rng: the seeded random source.
    """
    groups: dict[tuple[Any, str], list[Any]] = defaultdict(list)
    for example in examples:
        groups[(example.question, example.source)].append(example)
    weights = {key: len(members) ** exponent for key, members in groups.items()}
    total = sum(weights.values())
    shares = {key: len(examples) * w / total for key, w in weights.items()}
    counts = {key: math.floor(share) for key, share in shares.items()}
    by_fraction = sorted(shares, key=lambda key: (counts[key] - shares[key], key))
    for key in by_fraction[: len(examples) - sum(counts.values())]:
        counts[key] += 1
    out: list[Any] = []
    for key in sorted(groups):
        members, k = groups[key], counts[key]
        out.extend(members * (k // len(members)))
        out.extend(rng.sample(members, k % len(members)))
    return out


def _batches(examples: Sequence[_Example], stack: _Stack, size: int, rng: random.Random) -> list[list[_Example]]:
    """Shuffled batches of records with similar window sizes (less padding)."""
    keyed = sorted(examples, key=lambda e: stack.hidden[e.text].numel() * (1.0 + 0.3 * rng.random()))
    batches = [list(keyed[i : i + size]) for i in range(0, len(keyed), size)]
    rng.shuffle(batches)
    return batches


def _warmup_cosine(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warm = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, steps - warm))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
