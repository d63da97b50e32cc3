"""The tool-result instruction detector (``guard/policy/instructions.py``) on labelled data: attacks found and
benign texts flagged, per source file.

Every record of ``data/prompt_injection/*.jsonl`` and ``data/agent_tool_safety/agentdojo_v1_tool_outputs.jsonl``
(``label`` ``attack`` or ``benign``) is read as one tool result; a record counts as flagged when
:func:`~guard.policy.instructions.find_instructions` returns at least one span. Direct prompts (jailbreak templates,
role-play prompts) are not tool results, so their rates say little; the injected documents (BIPIA, inspect, the
authored indirect set, AgentDojo tool outputs) are the detector's target.

    python bench/instruction_cues.py
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from guard.policy.instructions import find_instructions

DATA = Path(__file__).resolve().parent.parent / "data"
FILES = (*sorted((DATA / "prompt_injection").glob("*.jsonl")), DATA / "agent_tool_safety" / "agentdojo_v1_tool_outputs.jsonl")


def main() -> None:
    argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0]).parse_args()
    total: Counter[str] = Counter()
    print(f"{'source':42s} {'attacks found':>16s} {'benign flagged':>16s}")
    for path in FILES:
        counts: Counter[str] = Counter()
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            label = row.get("label")
            if label not in ("attack", "benign"):
                continue
            counts[label] += 1
            counts[f"{label}_flagged"] += bool(find_instructions(row["text"]))
        total.update(counts)
        print(f"{path.parent.name + '/' + path.stem:42s} {_rate(counts, 'attack'):>16s} {_rate(counts, 'benign'):>16s}")
    print(f"{'all':42s} {_rate(total, 'attack'):>16s} {_rate(total, 'benign'):>16s}")


def _rate(counts: Counter[str], label: str) -> str:
    return f"{counts[label + '_flagged']}/{counts[label]}" if counts[label] else "-"


if __name__ == "__main__":
    main()
