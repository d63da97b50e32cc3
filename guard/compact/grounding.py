"""Argument grounding for ``guard.tool_call_serves_task``: does a tool call's content come from the user's task?

A call that serves the task mostly carries what the task names: the file, the channel, the customer's name and zip,
the order id, and a function named like the task's verbs. A call written by injected text, or one that belongs to
another task, carries values the task never mentions: the attacker's account, address or link. The model's
cross-encoder of (task, call) ranks calls of sources it never saw little better than chance (leave-one-source-out
AUROC 0.64, ``docs/catalog.md``); two lexical features of the (task, call) pair (:data:`FEATURES`,
:func:`call_features`) with it rank them far better. The answer is a logistic regression over the model's logit
and the features, stacked (Wolpert 1992): fitted on out-of-source model logits, so the features get the weight they
earn on sources the model did not see (:func:`fit`).

The features count what the arguments hold that the task does not, never what they share with it: an argument whose
words the task all holds changes neither feature, so copying the task into a call (``subject="<the task>"`` next to
the attacker's account) cannot raise its answer through them. Shares of the task's words in the arguments rank the
training sources a little better out of source (AUROC 0.81 against 0.77, mean over six suites) and are exactly what
such copying inflates: with them, a payment to a foreign account went from 0.18 to 0.85 once the task was pasted
into its subject. Foreign values are counted rather than foreign words, so how a value is written does not count
(an IBAN in groups of four is one value, not six words); the two rank alike out of source (0.772 and 0.766).
Reading one-character words and the keys of mappings inside arguments, so that a foreign value cannot hide as
``D_E_8_9...`` or as a key, cost 0.006.
Flagging calls without arguments added nothing and would let an added copy of the task move the answer.

The features read a state of the catalog shape ``{"task": ..., "tool_call": {"name": ..., "arguments": ...}}``; any
other state has none and is answered from the model's logit alone (:attr:`Grounding.plain_model`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from guard._json import loads
from guard.errors import InvalidJson

__all__ = ["FEATURES", "QUESTION", "Grounding", "GroundingFit", "call_features", "fit"]

#: The catalog question the grounding answers.
QUESTION = "guard.tool_call_serves_task"

#: The features :func:`call_features` returns, in order. A *word* is a run of letters or digits, one character or
#: more (``replicas: 0`` where the task says 6 is a foreign value, and so is ``D_E_8_9``), camelCase humps split,
#: case-folded; an argument *value* is a string or number anywhere in the arguments, and a key of a mapping inside
#: an argument (booleans and nulls are not values; the arguments' own names are not either).
FEATURES = (
    "argument_values_not_in_task",  # log(1 + count of argument values holding a word the task lacks)
    "name_words_in_task",  # share of the function name's words whose first five characters (all of a shorter word)
    # are those of a task word: "payment" matches "payments", "pay" matches "pay" but not "payment"
)

_HUMP_RE = re.compile(r"(?<=[a-z])(?=[A-Z])")
_WORD_RE = re.compile(r"[^\W_]+")
_STEM = 5


def _words(text: str) -> list[str]:
    return _WORD_RE.findall(_HUMP_RE.sub(" ", text).casefold())


def _values(value: Any, *, keys: bool = True) -> Iterator[str]:
    """The strings and numbers inside ``value`` (with ``keys``, the keys of its mappings too), depth first, as
    strings; a container met twice (a structure holding itself) is read once, and an integer too long to write
    (over 4,300 digits) is ``"<integer>"``."""
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, dict):
                stack.extend(reversed([*item.values(), *(item if keys else ())]))
            else:
                stack.extend(reversed(item))
        elif isinstance(item, str):
            yield item
        elif isinstance(item, int) and not isinstance(item, bool):
            yield str(item) if item.bit_length() < 14_000 else "<integer>"
        elif isinstance(item, float):
            yield str(item)


def _parsed(arguments: Any) -> Any:
    """Arguments given as JSON text (an OpenAI-style ``function.arguments`` string), parsed when they are an object
    or an array, so their values count one by one; anything else as it is. Parsed strictly, else as Python's own
    parser would (repeated keys, ``NaN``: what an agent framework would still run)."""
    if isinstance(arguments, str):
        try:
            parsed = loads(arguments)
        except InvalidJson:
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                return arguments
        if isinstance(parsed, (dict, list)):
            return parsed
    return arguments


def call_features(state: Any) -> tuple[float, ...] | None:
    """The :data:`FEATURES` of a ``{"task": ..., "tool_call": {"name": str, "arguments": ...}}`` state (the task's
    strings are read wherever they sit in ``task``), or ``None`` for a state of any other shape. Linear in the
    state's size; never raises."""
    if not isinstance(state, dict) or "task" not in state:
        return None
    call = state.get("tool_call")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    task_words = {w for text in _values(state["task"], keys=False) for w in _words(text)}
    stems = {w[:_STEM] for w in task_words}
    arguments = _parsed(call.get("arguments"))
    values = _values(list(arguments.values()) if isinstance(arguments, dict) else arguments)
    foreign = sum(any(w not in task_words for w in _words(value)) for value in values)
    name_words = _words(call["name"])
    return (
        math.log1p(foreign),
        sum(w[:_STEM] in stems for w in name_words) / len(name_words) if name_words else 0.0,
    )


@dataclass(frozen=True)
class Grounding:
    """The stacked answer: ``logit = model · z + Σ weights_i · f_i + bias`` for a state with :func:`call_features`
    ``f``, ``plain_model · z + plain_bias`` for one without, where ``z`` is the model's logit of ``true`` over
    ``false``; ``p(true) = sigmoid(logit)``. Fitted by :func:`fit`; stored in the checkpoint's question entry."""

    model: float
    weights: tuple[float, ...]
    bias: float
    plain_model: float
    plain_bias: float

    def logit(self, model_logit: float, features: Sequence[float] | None) -> float:
        """The stacked logit of ``true`` (see the class)."""
        if features is None:
            return self.plain_model * model_logit + self.plain_bias
        return self.model * model_logit + sum(w * f for w, f in zip(self.weights, features, strict=True)) + self.bias

    def to_json(self) -> dict[str, Any]:
        return {"features": list(FEATURES), "model": self.model, "weights": list(self.weights), "bias": self.bias,
                "plain_model": self.plain_model, "plain_bias": self.plain_bias}

    @classmethod
    def from_json(cls, body: Any) -> Grounding:
        """Read :meth:`to_json`'s mapping.

        Raises:
            ValueError: not a mapping, features other than :data:`FEATURES`, or a number missing or not finite.
        """
        if not isinstance(body, dict) or body.get("features") != list(FEATURES):
            shown = body.get("features") if isinstance(body, dict) else type(body).__name__
            raise ValueError(f"grounding must be a mapping with features {list(FEATURES)}, got {shown!r}")
        weights = body.get("weights")
        if not isinstance(weights, list) or len(weights) != len(FEATURES):
            raise ValueError(f"grounding weights must be a list of {len(FEATURES)} numbers")
        numbers = [body.get(k) for k in ("model", "bias", "plain_model", "plain_bias")] + weights
        if not all(isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) for n in numbers):
            raise ValueError("grounding numbers must be finite")
        return cls(float(body["model"]), tuple(float(w) for w in weights), float(body["bias"]),
                   float(body["plain_model"]), float(body["plain_bias"]))


@dataclass(frozen=True)
class GroundingFit:
    """What :func:`fit` returns: the model's new linear readout of the pooled vector (``logit = weight · pooled +
    bias``, fitted on every record), the stacked :class:`Grounding` and the leave-one-source-out report."""

    weight: np.ndarray
    bias: float
    grounding: Grounding
    report: dict[str, Any]


def _auroc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores)) if 0 < labels.sum() < len(labels) else None


def _ece(labels: np.ndarray, probabilities: np.ndarray) -> float:
    from guard.compact.evaluate import expected_calibration_error

    confidence = np.maximum(probabilities, 1.0 - probabilities)
    return expected_calibration_error(confidence.tolist(), ((probabilities >= 0.5) == labels).tolist())


def fit(pooled: np.ndarray, features: Sequence[Sequence[float] | None], labels: Sequence[bool],
        sources: Sequence[str], *, readout_c: float = 0.1, stack_c: float = 1.0) -> GroundingFit:
    """Fit the readout and the stacked grounding, leave one source out.

    1. Readout: a logistic regression (scikit-learn, L2, ``C=readout_c``) of the label on ``pooled`` ``(N, D)``
       float32 (the head's pooled vectors, :meth:`guard.compact.head.CatalogHead.pooled`), once per source on the
       other sources' records: each record's out-of-source logit. Then once on every record: the returned readout.
    2. Stack: a logistic regression (``C=stack_c``) of the label on [out-of-source logit, features] over the records
       with features (``plain_*``: on the logit alone, over every record).
    3. Report: per source, the AUROC of the out-of-source logit and of the stacked answer with the stack fitted
       without that source (the records' own source held out at both levels), their means over sources, and the
       pooled AUROC and ECE of the held-out stacked answers.

    Raises:
        ValueError: fewer than two sources, or a class missing once a source is held out.
    """
    from sklearn.linear_model import LogisticRegression

    x = np.asarray(pooled, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    group = np.asarray(sources)
    names = sorted(set(sources))
    if len(names) < 2:
        raise ValueError(f"grounding is fitted leave one source out and needs two sources or more, got {names}")
    has = np.array([f is not None for f in features])
    f = np.array([list(v) if v is not None else [0.0] * len(FEATURES) for v in features], dtype=np.float64)

    def logistic(inputs: np.ndarray, targets: np.ndarray, c: float) -> Any:
        if len(set(targets.tolist())) < 2:
            raise ValueError("grounding needs records of both labels in every training set")
        return LogisticRegression(C=c, max_iter=5000).fit(inputs, targets)

    outside = np.zeros(len(y))
    for name in names:
        held = group == name
        outside[held] = logistic(x[~held], y[~held], readout_c).decision_function(x[held])
    stacked_in = np.column_stack([outside, f])
    held_out = np.zeros(len(y))
    for name in names:
        held = group == name
        rows = ~held & has
        if has[held].any():
            held_out[held & has] = logistic(stacked_in[rows], y[rows], stack_c).decision_function(
                stacked_in[held & has])
        if (held & ~has).any():
            plain = logistic(outside[~held, None], y[~held], stack_c)
            held_out[held & ~has] = plain.decision_function(outside[held & ~has, None])
    readout = logistic(x, y, readout_c)
    stack = logistic(stacked_in[has], y[has], stack_c) if has.any() else None
    plain = logistic(outside[:, None], y, stack_c)
    grounding = Grounding(
        model=float(stack.coef_[0, 0]) if stack else float(plain.coef_[0, 0]),
        weights=tuple(float(w) for w in stack.coef_[0, 1:]) if stack else (0.0,) * len(FEATURES),
        bias=float(stack.intercept_[0]) if stack else float(plain.intercept_[0]),
        plain_model=float(plain.coef_[0, 0]), plain_bias=float(plain.intercept_[0]))
    by_source = {}
    for name in names:
        held = group == name
        by_source[name] = {"n": int(held.sum()), "model_auroc": _auroc(y[held], outside[held]),
                           "grounded_auroc": _auroc(y[held], held_out[held])}

    def mean(key: str) -> float | None:
        values = [s[key] for s in by_source.values() if s[key] is not None]
        return float(np.mean(values)) if values else None

    probabilities = 1.0 / (1.0 + np.exp(-held_out))
    report = {"question": QUESTION, "records": len(y), "with_features": int(has.sum()), "by_source": by_source,
              "source_mean": {"model_auroc": mean("model_auroc"), "grounded_auroc": mean("grounded_auroc")},
              "pooled": {"model_auroc": _auroc(y, outside), "grounded_auroc": _auroc(y, held_out),
                         "grounded_ece": _ece(y, probabilities)},
              "grounding": grounding.to_json()}
    return GroundingFit(readout.coef_[0].astype(np.float32), float(readout.intercept_[0]), grounding, report)
