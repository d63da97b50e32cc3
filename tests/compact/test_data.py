from __future__ import annotations

from pathlib import Path

import pytest

from guard.compact.data import build_splits, jaccard_clusters, write_splits

DATA = Path(__file__).resolve().parents[2] / "data"


def test_jaccard_clusters_join_near_duplicates() -> None:
    a = "one two three four five six seven eight nine ten"
    texts = [a, a + " eleven", "completely different words that share nothing with the others at all"]
    ids = jaccard_clusters(texts)
    assert ids[0] == ids[1] != ids[2]


@pytest.fixture(scope="module")
def splits():  # type: ignore[no-untyped-def]
    return build_splits(DATA)


def _texts(rows):  # type: ignore[no-untyped-def]
    import json

    return {json.dumps(r["state"], sort_keys=True) for r in rows}


def test_no_state_is_on_both_sides(splits) -> None:  # type: ignore[no-untyped-def]
    train = _texts(splits.train)
    for name, rows in splits.test.items():
        assert not train & _texts(rows), name


def test_attack_near_duplicates_stay_on_one_side(splits) -> None:  # type: ignore[no-untyped-def]
    def attacks(rows):  # type: ignore[no-untyped-def]
        out = []
        for r in rows:
            if r["id"].startswith("attack:"):
                s = r["state"]
                out.append(s if isinstance(s, str) else str(s))
        return out

    train, test = attacks(splits.train), attacks(splits.test["prompt_injection"])
    ids = jaccard_clusters(train + test)
    assert not set(ids[: len(train)]) & set(ids[len(train):])


def test_splits_are_deterministic_and_written(splits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    again = build_splits(DATA)
    assert [r["id"] for r in again.train] == [r["id"] for r in splits.train]
    counts = write_splits(splits, tmp_path)
    assert counts["train.jsonl"] == len(splits.train)
    assert (tmp_path / "test" / "prompt_injection.jsonl").exists()
    assert {"prompt_injection", "harmful_request", "harm_severity", "tool_call_serves_task", "refusal",
            "prompt_injection_long"} <= set(splits.test)


def test_clusters_do_not_depend_on_the_hash_seed() -> None:
    import subprocess
    import sys

    code = ("import json; from pathlib import Path; from guard.compact.data import jaccard_clusters; "
            "rows = [json.loads(l) for l in open(Path('data/jailbreak/inthewild.jsonl'))][:150]; "
            "print(jaccard_clusters([r['text'] for r in rows]))")
    root = Path(__file__).resolve().parents[2]
    outputs = {
        subprocess.run([sys.executable, "-c", code], cwd=root, env={"PYTHONHASHSEED": seed, "PATH": ""},
                       capture_output=True, text=True, check=True).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
