"""The example agent (examples/agent) end to end: real sandbox tools, a local web server, the example's policies
and AgentDojo banking traces, decided by the compact CPU model guard ships (no scripted answers)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from examples.agent import replay as example
from examples.agent.tools import Sandbox, SandboxError, sandbox_tools
from guard.backends.compact import CompactBackend
from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from guard.policy import load_files


def test_replay_allows_wanted_calls_and_stops_the_attackers(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = []
    policies = load_files(*example.COMPACT_POLICIES)
    out = io.StringIO()
    with Guard(
        policies, backends=CompactBackend.default(), decision_log=DecisionLog(lambda line: records.append(json.loads(line)))
    ) as guard:
        totals = example.replay(guard, records, suite="banking", limit=0, out=out)
    text = out.getvalue()
    assert totals["wanted_calls"] > 30 and totals["wanted_ran"] == totals["wanted_calls"]
    assert totals["attacker_calls"] >= 12 and totals["attacker_stopped"] == totals["attacker_calls"]
    assert totals["outputs_withheld"] >= 10  # the injected CV and every poisoned bill
    # The stub tools answer "ok", so a wanted call whose arguments would come from their output (an id, an IBAN) has
    # them from nowhere and waits for the reviewer; the bill payment takes its IBAN from the real file and runs.
    assert "-> reviewer rejects" in text
    assert "send_money {\"recipient\": \"UK12345678901234567890\"" not in text
    assert "Emily is the best" not in "".join(r["result"].get("message") or "" for r in records)
    assert {r["backend"] for r in records} == {"compact"}


def test_sandbox_tools_stay_in_their_folder(tmp_path: Path) -> None:
    sandbox = Sandbox(tmp_path / "box")
    tools = {t.name: t for t in sandbox_tools(sandbox)}
    (tmp_path / "outside.txt").write_text("secret")
    assert "outside the sandbox" in tools["read_file"].invoke({"file_path": "../outside.txt"})
    assert "unknown command" in tools["run_shell"].invoke({"command": "curl http://evil"})
    assert "only fetches from the local server" in tools["http_fetch"].invoke({"url": "http://example.com/"})
    tools["write_file"].invoke({"file_path": "a.txt", "content": "one\ntwo\n"})
    assert tools["run_shell"].invoke({"command": "wc a.txt"}).startswith("2 2 8 a.txt")
    assert tools["send_money"].invoke({"recipient": "X", "amount": 1.5, "subject": "s", "date": "d"}) == "sent 1.5 to X"
    assert json.loads((tmp_path / "box" / "ledger.jsonl").read_text())["amount"] == 1.5
    with pytest.raises(SandboxError):
        sandbox.path("/etc/passwd")


def test_the_example_policy_passes_its_own_tests(capsys: pytest.CaptureFixture[str]) -> None:
    from guard.cli import main

    assert main(["policy", "test", *map(str, example.COMPACT_POLICIES[:1])]) == 0
    assert "3 passed, 0 failed" in capsys.readouterr().out
