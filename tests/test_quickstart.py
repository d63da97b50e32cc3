"""The quickstart on the embedded CPU model: every replayed item gets a verdict carried out as the policy says, and
the shipped model separates the quickstart's benign requests from its attacks."""

from __future__ import annotations

import pytest

from guard.backends.compact import CompactBackend
from guard.cli import main
from guard.policy import load_files
from guard.quickstart import load_traffic, policy_path, run_quickstart

STATUS = {"allow": 200, "block": 403, "escalate": 202}


def test_quickstart_policies_pass_their_fixture_cases() -> None:
    assert main(["policy", "test", policy_path()]) == 0
    assert [p.id for p in load_files(policy_path()).policies] == ["api-abuse-embedded", "tool-calls-embedded"]


def test_traffic_is_labelled() -> None:
    http, tools = load_traffic("http_traffic"), load_traffic("tool_calls")
    assert {row["label"] for row in http} == {"benign", "attack"} == {row["label"] for row in tools}


@pytest.mark.anyio
async def test_quickstart_replays_traffic_through_the_guard() -> None:
    seen = []
    result = await run_quickstart(CompactBackend.default(), on_row=seen.append)
    assert seen == result.rows
    assert len(result.rows) == len(load_traffic("http_traffic")) + len(load_traffic("tool_calls"))
    for row in result.rows:
        assert row.action in STATUS, row
        if row.kind == "http":
            assert row.status == STATUS[row.action], row
        assert row.probabilities, row
        assert all(0.0 <= p <= 1.0 for p in row.probabilities.values())
    http = [row for row in result.rows if row.kind == "http"]
    benign_allowed = sum(r.action == "allow" for r in http if r.label == "benign")
    attacks_stopped = sum(r.action != "allow" for r in http if r.label == "attack")
    assert benign_allowed / sum(r.label == "benign" for r in http) >= 0.9
    assert attacks_stopped / sum(r.label == "attack" for r in http) >= 0.6
    counts = result.summary()["counts"]
    assert sum(counts["http/benign"].values()) == sum(r.label == "benign" for r in http)


def test_quickstart_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quickstart", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "Summary" in out and "Next steps" in out and "local:/path/to/clef-flash" in out
    assert out.count("\nhttp ") == 2 and out.count("\ntool ") == 2
