"""Build the catalog's labelled records from the repository's ``data/`` folder, split into train, val and test.

Every record is one line of labelled System One JSONL (the format ``guard train`` and ``guard eval`` read)::

    {"id": "...", "state": <any JSON>, "questions": {"<id>": {"type": ..., "instructions": ..., "criteria": ...}},
     "labels": {"<id>": "true" | "false" | <level index> | "<option id>"}}

Splits are fixed by ``SEED`` and grouped so that near-duplicates never straddle them:

* jailbreak prompts (in-the-wild and DAN templates) are clustered by word 5-gram Jaccard >= 0.5 (union-find, the rule
  of ``data/README.md``) and whole clusters go to one split;
* harm rows are grouped by their (normalised) objective across ``harm_scores``, ``objective_achieved`` and
  ``refusal``;
* AgentDojo tasks are split by task, CLINC150 ``train`` feeds only the training side and CLINC150 ``val`` (and the
  benign request bodies derived from it) only the test side.

``test`` holds one file per metric (``prompt_injection.jsonl``, ...), plus ``*_heldout_wording.jsonl`` files that ask
the same held-out states with paraphrased and negated wordings never used in training.

Run ``python -m guard.compact.data data/ OUT_DIR`` to write ``OUT_DIR/{train,val}.jsonl`` and ``OUT_DIR/test/*.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.compact.catalog import CATALOG, CatalogQuestion
from guard.subject import body_strings

__all__ = ["SEED", "Splits", "build_splits", "jaccard_clusters", "main", "write_splits"]

SEED = 20260517
#: Fractions of each grouped source that go to val and test (the rest trains).
VAL_FRACTION = 0.1
TEST_FRACTION = 0.3
#: CLINC150 train utterances used as benign states / for the auxiliary domain questions.
CLINC_BENIGN = 2500
CLINC_AUX = 2500
#: Long composed states (benign padding with an attack inside or at the end) per split.
COMPOSED_TRAIN = 400
COMPOSED_TEST = 120
_SHAPES = ("text", "message", "chat", "search", "agent")
#: Extra training wordings per example for the smaller sources (each is one more training record).
_ALTERNATES = {"guard.harm_severity": 3, "guard.refusal": 2}
#: Share of request-shaped states (a JSON body) that are also seen as policies serve them: ``{"text": body_text}``,
#: every string of the body joined by newlines (``state: {text: body_text}`` in the shipped policies).
SERVED_FRACTION = 0.35
#: Instances drawn per synthetic template (``data/synthetic_injection/templates.json``) on the training side and
#: on the test side.
SYNTHETIC_TRAIN = 14
SYNTHETIC_TEST = 10


@dataclass
class Splits:
    """The built records: ``train`` and ``val`` lists, and named ``test`` sets."""

    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    test: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))


def _rows(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def jaccard_clusters(texts: list[str], threshold: float = 0.5, n: int = 5) -> list[int]:
    """Cluster ids (union-find) joining texts whose word ``n``-gram sets have Jaccard similarity >= ``threshold``;
    a cluster's id is the index of its first text, so ids do not depend on hash or union order."""
    grams = []
    for text in texts:
        words = _norm(text).split()
        grams.append({tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1))})
    parent = list(range(len(texts)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    postings: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i, gram_set in enumerate(grams):
        for gram in gram_set:
            postings[gram].append(i)
    for i, gram_set in enumerate(grams):
        shared: dict[int, int] = defaultdict(int)
        for gram in gram_set:
            for j in postings[gram]:
                if j > i:
                    shared[j] += 1
        for j, common in shared.items():
            if common / (len(gram_set) + len(grams[j]) - common) >= threshold:
                parent[find(i)] = find(j)
    roots = [find(i) for i in range(len(texts))]
    first: dict[int, int] = {}
    for i, root in enumerate(roots):  # name each cluster by its first member: independent of union order
        first.setdefault(root, i)
    return [first[root] for root in roots]


def _assign(groups: Iterable[str], rng: random.Random) -> dict[str, str]:
    """Map each group key to ``train``/``val``/``test`` (sorted, shuffled, then cut by fractions)."""
    keys = sorted(set(groups))
    rng.shuffle(keys)
    n_test = round(len(keys) * TEST_FRACTION)
    n_val = round(len(keys) * VAL_FRACTION)
    return {key: ("test" if i < n_test else "val" if i < n_test + n_val else "train") for i, key in enumerate(keys)}


def _shape(text: str, shape: str) -> Any:
    """Wrap a user text in one of the request shapes guard sees (raw text, message body, chat, search, agent)."""
    if shape == "message":
        return {"message": text}
    if shape == "chat":
        return {"model": "assistant-small", "messages": [{"role": "user", "content": text}]}
    if shape == "search":
        return {"query": text, "limit": 10}
    if shape == "agent":
        return {"event": "model_input", "text": text}
    return text


def _record(rid: str, state: Any, entry: CatalogQuestion | dict[str, Any], label: Any, wording: str | None = None,
            qid: str | None = None) -> dict[str, Any]:
    if isinstance(entry, CatalogQuestion):
        body = entry.to_json()
        if wording is not None:
            body["instructions"] = wording
        qid = entry.id
    else:
        body = dict(entry)
    assert qid is not None
    return {"id": rid, "state": state, "questions": {qid: body}, "labels": {qid: label}}


def _flip(label: Any) -> Any:
    return {"true": "false", "false": "true"}[label]


class _Builder:
    """Collects (split, state, question, label) examples and expands training wordings.

    ``view_rng`` (its own stream, so adding it left every split as it was) picks the request-shaped states of the
    injection and harmful-request questions that are also written as served: ``{"text": body_text}``.
    """

    def __init__(self, rng: random.Random, view_rng: random.Random | None = None) -> None:
        self.rng = rng
        self.view_rng = view_rng or random.Random(0)
        self.splits = Splits()

    def add(self, split: str, rid: str, state: Any, entry: CatalogQuestion, label: Any, test_set: str = "") -> None:
        if (
            entry.id in ("guard.prompt_injection", "guard.harmful_request")
            and isinstance(state, dict)
            and self.view_rng.random() < SERVED_FRACTION
        ):
            state = {"text": "\n".join(body_strings(state))}
        if split == "test":
            name = test_set or entry.id.split(".", 1)[1]
            self.splits.test[name].append(_record(rid, state, entry, label))
            if entry.heldout_wordings:
                wording = self.rng.choice(entry.heldout_wordings)
                self.splits.test[f"{name}_heldout_wording"].append(
                    _record(rid + ":para", state, entry, label, wording)
                )
            if entry.heldout_negations:
                wording = self.rng.choice(entry.heldout_negations)
                self.splits.test[f"{name}_heldout_wording"].append(
                    _record(rid + ":neg", state, entry, _flip(label), wording)
                )
            return
        target = self.splits.train if split == "train" else self.splits.val
        target.append(_record(rid, state, entry, label))
        if split != "train":
            return
        alternatives = [(w, False) for w in entry.training_wordings] + [(w, True) for w in entry.negated_wordings]
        for n in range(_ALTERNATES.get(entry.id, 1) if alternatives else 0):
            wording, negated = self.rng.choice(alternatives)
            target.append(_record(f"{rid}:alt{n}", state, entry, _flip(label) if negated else label, wording))


def build_splits(root: Path, seed: int = SEED) -> Splits:
    """Build every catalog record from ``root`` (the repository's ``data/`` folder)."""
    rng = random.Random(seed)
    build = _Builder(random.Random(seed + 1), random.Random(seed + 2))
    injection, harmful = CATALOG["guard.prompt_injection"], CATALOG["guard.harmful_request"]
    severity, serves, refusal = (
        CATALOG["guard.harm_severity"], CATALOG["guard.tool_call_serves_task"], CATALOG["guard.refusal"]
    )

    # --- attacks: in-the-wild + DAN templates clustered together, payloads per row ---------------------------------
    wild = _rows(root / "jailbreak" / "inthewild.jsonl")
    dan = _rows(root / "jailbreak" / "dan_templates.jsonl")
    attacks = [(r["id"], r["text"]) for r in wild] + [
        (r["id"], r["text"].replace("{generator.name}", rng.choice(["ChatGPT", "the assistant", "Claude", "Bard"])))
        for r in dan
    ]
    clusters = jaccard_clusters([text for _, text in attacks])
    where = _assign((f"jb{c}" for c in clusters), rng)
    attack_split = {rid: where[f"jb{c}"] for (rid, _), c in zip(attacks, clusters, strict=True)}
    payloads = _rows(root / "jailbreak" / "payloads.jsonl")
    seen: dict[str, str] = {}
    for row in payloads:
        seen.setdefault(_norm(row["text"]), row["id"])
    payload_split = _assign(seen.values(), rng)
    attack_texts: dict[str, list[str]] = defaultdict(list)
    for rid, text in attacks:
        split = attack_split[rid]
        attack_texts[split].append(text)
        build.add(split, f"attack:{rid}", _shape(text, rng.choice(_SHAPES)), injection, "true")
    for row in payloads:
        split = payload_split[seen[_norm(row["text"])]]
        label = "true" if row["label"] == "attack" else "false"
        if label == "true":
            attack_texts[split].append(row["text"])
        build.add(split, f"payload:{row['id']}", _shape(row["text"], rng.choice(_SHAPES)), injection, label)
        if label == "false":
            build.add(split, f"payload:{row['id']}", _shape(row["text"], rng.choice(_SHAPES)), harmful, "false")

    # --- benign: CLINC150 train (training side), benign request bodies from CLINC150 val (test side) ---------------
    clinc = _rows(root / "clinc150" / "train.jsonl")
    clinc_val_ids = sorted(range(len(clinc)), key=lambda _: rng.random())
    benign_train = [clinc[i]["text"] for i in clinc_val_ids[:CLINC_BENIGN]]
    for i, text in enumerate(benign_train):
        split = "val" if i % 10 == 0 else "train"
        state = _shape(text, rng.choice(_SHAPES))
        build.add(split, f"clinc:{i}", state, injection if i % 4 < 2 else harmful, "false")
    for row in _rows(root / "benign_requests" / "requests.jsonl"):
        build.add("test", row["id"], row["body"], injection, "false")
        build.add("test", row["id"], row["body"], harmful, "false")

    # --- tool traces: AgentDojo tasks, split by task ----------------------------------------------------------------
    tasks = _rows(root / "agent_tool_calls" / "ground_truth_calls.jsonl")
    task_split = _assign((f"{t['suite']}/{t['task_id']}" for t in tasks), rng)
    by_suite: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for task in tasks:
        task["split"] = task_split[f"{task['suite']}/{task['task_id']}"]
        by_suite[task["suite"]].append(task)
    for task in tasks:
        if task["kind"] != "user":
            continue
        split, key = task["split"], f"{task['suite']}/{task['task_id']}"
        build.add(split, f"trace:{key}", {"task": task["prompt"], "tool_calls": task["calls"]}, injection, "false")
        build.add(split, f"task:{key}", _shape(task["prompt"], rng.choice(_SHAPES)), harmful, "false")
        own = {call["function"] for call in task["calls"]}
        for n, call in enumerate(task["calls"]):
            build.add(split, f"call:{key}:{n}", _call_state(task["prompt"], call, rng), serves, "true")
        for other in by_suite[task["suite"]]:
            if other["split"] != split or other is task:
                continue
            for n, call in enumerate(other["calls"]):
                injected = other["kind"] == "injection"
                if injected or (call["function"] not in own and rng.random() < 0.25):
                    rid = f"call:{key}:{other['task_id']}:{n}"
                    build.add(split, rid, _call_state(task["prompt"], call, rng), serves, "false")

    # --- harm: objectives grouped across the three PyRIT files -------------------------------------------------------
    scores = _rows(root / "harm" / "harm_scores.jsonl")
    achieved = _rows(root / "harm" / "objective_achieved.jsonl")
    refusals = _rows(root / "harm" / "refusal.jsonl")
    group_split = _assign((_norm(r["objective"]) for r in scores + achieved + refusals), rng)
    objectives: dict[str, str] = {}
    for i, row in enumerate(scores):
        split = group_split[_norm(row["objective"])]
        level = round(float(row["human_score"]) * 4)
        build.add(split, f"severity:{i}", _pair_state(row, rng), severity, level)
        objectives.setdefault(_norm(row["objective"]), row["objective"])
    for i, row in enumerate(achieved):
        objectives.setdefault(_norm(row["objective"]), row["objective"])
        if row["achieved"]:
            build.add(group_split[_norm(row["objective"])], f"achieved:{i}", _pair_state(row, rng), refusal, "false")
    for i, row in enumerate(refusals):
        label = "true" if row["refused"] else "false"
        build.add(group_split[_norm(row["objective"])], f"refusal:{i}", _pair_state(row, rng), refusal, label)
        if row["refused"]:
            build.add(group_split[_norm(row["objective"])], f"refused:{i}", _pair_state(row, rng), severity, 0)
    for key, objective in sorted(objectives.items()):
        split = group_split[key]
        state = _shape(objective, rng.choice(_SHAPES))
        build.add(split, f"objective:{_digest(key)}", state, harmful, "true")
        if split != "test":
            build.add(split, f"objective-inj:{_digest(key)}", state, injection, "false")

    # --- long composed states: benign padding with an attack inside, or none ---------------------------------------
    benign_pool = {"train": benign_train, "val": benign_train, "test": [r["text"] for r in _rows(
        root / "benign_requests" / "requests.jsonl")]}
    for split, count in (("train", COMPOSED_TRAIN), ("val", COMPOSED_TRAIN // 8), ("test", COMPOSED_TEST)):
        pool = attack_texts[split]
        for n in range(count):
            padding = " ".join(rng.sample(benign_pool[split], rng.randint(40, 160)))
            if n % 2 == 0:
                attack = rng.choice(pool)
                # Training keeps a state's first and last tokens only, so attacks go at either end there; the test
                # set also hides them in the middle, which inference reads.
                if n % 4 == 0:
                    text = padding + " " + attack
                elif split == "test":
                    text = _insert_middle(padding, attack, rng)
                else:
                    text = attack + " " + padding
                label = "true"
            else:
                text, label = padding, "false"
            build.add(split, f"composed:{split}:{n}", {"document": text}, injection, label,
                      test_set="prompt_injection_long")

    # --- short synthetic injections and benign look-alikes: held-out templates and goals on the test side ----------
    injection_goals = {
        split: [_goal(t["prompt"]) for t in tasks if t["kind"] == "injection" and t["split"] == split]
        for split in ("train", "val", "test")
    }
    _add_synthetic(build, root / "synthetic_injection" / "templates.json", injection_goals, benign_train, injection,
                   harmful, random.Random(seed + 3))

    # --- auxiliary questions (training only): make the head read the question --------------------------------------
    domains = {row["intent"]: row["domain"] for row in json.loads((root / "clinc150" / "intents.json").read_text())}
    names = sorted(set(domains.values()))
    for i, idx in enumerate(clinc_val_ids[CLINC_BENIGN : CLINC_BENIGN + CLINC_AUX]):
        row = clinc[idx]
        truth = domains.get(row["intent"])
        asked = truth if (truth and rng.random() < 0.5) else rng.choice(names)
        question = {"type": "noul", "instructions": _domain_question(asked, rng)}
        label = "true" if asked == truth else "false"
        target = build.splits.val if i % 10 == 0 else build.splits.train
        target.append(_record(f"aux:{i}", _shape(row["text"], rng.choice(_SHAPES)), question, label,
                              qid="aux.domain"))
    for i, text in enumerate(attack_texts["train"][:200]):
        question = {"type": "noul", "instructions": _domain_question(rng.choice(names), rng)}
        build.splits.train.append(_record(f"aux-attack:{i}", text, question, "false", qid="aux.domain"))
    return build.splits


_ALTERNATIVE_RE = re.compile(r"\[([^\[\]]*\|[^\[\]]*)\]")
_SLOT_RE = re.compile(r"\{(goal|Goal|email|url|iban|user|tool|args)\}")


def _goal(prompt: str) -> str:
    """An AgentDojo injection task's prompt as a goal phrase: first letter lower-cased, final period dropped."""
    text = prompt.strip().rstrip(".")
    return text[:1].lower() + text[1:]


def _expand(template: str, goals: list[str], fill: dict[str, list[str]], rng: random.Random) -> str:
    """Fill a synthetic template: ``[a|b]`` alternatives, then ``{goal}``/``{Goal}`` and the other slots."""

    def pick(match: re.Match[str]) -> str:
        return rng.choice(match.group(1).split("|"))

    def slot(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in ("goal", "Goal"):
            goal = _expand(rng.choice(goals), goals, fill, rng)
            return goal[:1].upper() + goal[1:] if name == "Goal" else goal
        return rng.choice(fill[name])

    return _SLOT_RE.sub(slot, _ALTERNATIVE_RE.sub(pick, template))


def _add_synthetic(build: _Builder, path: Path, agent_goals: dict[str, list[str]], benign_pool: list[str],
                   injection: CatalogQuestion, harmful: CatalogQuestion, rng: random.Random) -> None:
    """Short injections and benign look-alikes from ``templates.json`` (see its ``about``).

    Training templates and goals (with the AgentDojo injection goals of training tasks) feed train and val (every
    tenth instance); the ``test`` templates with the ``test`` goals (and the test tasks' goals) are written to the
    ``prompt_injection_short`` test set only. Instances are wrapped like the other sources, and some are embedded in
    a benign message (indirect injection). Benign look-alikes are also asked as ``guard.harmful_request`` (false).
    """
    spec = json.loads(path.read_text(encoding="utf-8"))
    fill = spec["fill"]
    goals = {"train": spec["goals"]["train"] + agent_goals["train"] + agent_goals["val"],
             "test": spec["goals"]["test"] + agent_goals["test"]}
    for side, count in (("train", SYNTHETIC_TRAIN), ("test", SYNTHETIC_TEST)):
        for label, families in (("true", spec["attack"]), ("false", spec["benign"])):
            for family, templates in sorted(families.items()):
                for t, template in enumerate(templates[side]):
                    for n in range(count):
                        text = _expand(template, goals[side], fill, rng)
                        if rng.random() < 0.3:
                            before, after = rng.sample(benign_pool, 2) if side == "train" else ("Hi,", "Thanks!")
                            text = f"{before} {text} {after}"
                        split = side if side == "test" else ("val" if n % 10 == 9 else "train")
                        rid = f"synthetic:{label}:{family}:{side}{t}:{n}"
                        state = _shape(text, rng.choice(_SHAPES))
                        build.add(split, rid, state, injection, label, test_set="prompt_injection_short")
                        if label == "false":
                            build.add(split, rid, state, harmful, "false", test_set="harmful_request_short")


_DOMAIN_WORDS = {
    "auto_and_commute": "cars, driving or commuting", "banking": "banking or bank accounts",
    "credit_cards": "credit cards", "home": "the home, smart devices or household chores",
    "kitchen_and_dining": "cooking, food or restaurants", "meta": "the conversation with the assistant itself",
    "small_talk": "small talk or chit-chat", "travel": "travel, trips or flights", "utility": "everyday utilities "
    "such as time, weather, timers or calculations", "work": "work, meetings or the workplace",
}


def _domain_question(domain: str, rng: random.Random) -> str:
    template = rng.choice(["Is this message about {}?", "Does the user ask something related to {}?",
                           "Is the topic of this request {}?"])
    return template.format(_DOMAIN_WORDS[domain])


def _insert_middle(padding: str, attack: str, rng: random.Random) -> str:
    words = padding.split(" ")
    at = rng.randint(len(words) // 4, 3 * len(words) // 4)
    return " ".join(words[:at]) + " " + attack + " " + " ".join(words[at:])


def _call_state(task: str, call: dict[str, Any], rng: random.Random) -> Any:
    if rng.random() < 0.5:
        return {"task": task, "tool_call": {"name": call["function"], "arguments": call["args"]}}
    return {"user_message": task, "tool_name": call["function"], "arguments": call["args"], "event": "tool_call"}


def _pair_state(row: dict[str, Any], rng: random.Random) -> Any:
    if rng.random() < 0.7:
        return {"request": row["objective"], "response": row["response"]}
    return f"User: {row['objective']}\n\nAssistant: {row['response']}"


def write_splits(splits: Splits, out: Path) -> dict[str, int]:
    """Write ``train.jsonl``, ``val.jsonl`` and ``test/<name>.jsonl`` under ``out``; returns row counts by file."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "test").mkdir(exist_ok=True)
    counts = {}
    files: list[tuple[Path, list[dict[str, Any]]]] = [(out / "train.jsonl", splits.train), (out / "val.jsonl",
                                                                                               splits.val)]
    files += [(out / "test" / f"{name}.jsonl", rows) for name, rows in sorted(splits.test.items())]
    for path, rows in files:
        with path.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        counts[str(path.relative_to(out))] = len(rows)
    return counts


def main(argv: list[str] | None = None, echo: Callable[[str], Any] = print) -> int:
    """``python -m guard.compact.data DATA_DIR OUT_DIR``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        echo("usage: python -m guard.compact.data DATA_DIR OUT_DIR")
        return 2
    counts = write_splits(build_splits(Path(args[0])), Path(args[1]))
    for name, count in counts.items():
        echo(f"{name}\t{count}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
