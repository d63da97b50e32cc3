"""The quickstart on the embedded CPU model: every replayed item gets a verdict carried out as the policy says, and
the shipped model separates the quickstart's benign requests from its attacks."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import torch

from guard.backends.compact import CompactBackend
from guard.backends.local import LocalBackend
from guard.backends.selftest import SELF_TEST_REQUEST
from guard.cli import main
from guard.policy import load_files
from guard.quickstart import NEXT_STEPS, load_traffic, policy_path, run_quickstart

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
    payloads = [r for r in http if r.id.startswith(("sql_injection-", "web_html_js-", "markdown_js-",
                                                    "access_shell_commands-", "python_code_execution-"))]
    syntax_rules = {"sql-statement", "script-markup", "code-execution"}  # sqli() / xss() / code_exec(), any model
    assert len(payloads) == 15 and all(r.action == "block" for r in payloads), payloads
    assert {r.rule for r in payloads} == syntax_rules
    assert all(r.rule not in syntax_rules for r in http if r.label == "benign")
    assert attacks_stopped / sum(r.label == "attack" for r in http) >= 0.6
    tools = [row for row in result.rows if row.kind == "tool"]
    assert all(r.action == "allow" for r in tools if r.label == "benign")  # provenance: the user's own calls
    assert all(r.action != "allow" for r in tools if r.label == "attack")  # values from the injected tool results
    counts = result.summary()["counts"]
    assert sum(counts["http/benign"].values()) == sum(r.label == "benign" for r in http)


def test_quickstart_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quickstart", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "Summary" in out and "Next steps" in out and "local:/path/to/clef-flash" in out
    assert out.count("\nhttp ") == 2 and out.count("\ntool ") == 2



def test_quickstart_exits_2_when_it_cannot_start_and_1_when_the_replay_breaks(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import guard.quickstart

    monkeypatch.delenv("GUARD_STORE_KEY", raising=False)
    assert main(["quickstart", "--limit", "1", "--redis-url", "redis://127.0.0.1:1/0"]) == 2  # as guard proxy
    out, err = capsys.readouterr()
    assert "$GUARD_STORE_KEY" in err and out == ""  # before the table: it stopped after the header before
    printed = []

    def closed_pipe(row: object, out: object) -> None:  # `guard quickstart | head -n 8`: the reader went away
        if printed:
            raise BrokenPipeError(32, "Broken pipe")
        printed.append(row)

    monkeypatch.setattr(guard.quickstart, "print_row", closed_pipe)
    assert main(["quickstart", "--limit", "2"]) == 1 and len(printed) == 1
    assert "Broken pipe" in capsys.readouterr().err

TOOL_NOTE = "ranks guard.tool_call_serves_task at AUROC 0.77"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_the_tool_call_note_is_for_the_embedded_model_only(
    golden_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["quickstart", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count(TOOL_NOTE) == 1 and "backend: compact (" in out
    assert main(["quickstart", "--limit", "1", "--backend", f"local:{golden_checkpoint}"]) == 0
    out = capsys.readouterr().out
    assert TOOL_NOTE not in out and "Next steps" in out and "\n\nNext steps" in out
    # a backend that answers nothing: the rows show the fail mode, and the run says so and exits 1 (it was 0)
    assert main(["quickstart", "--limit", "1", "--backend", f"http://127.0.0.1:{_closed_port()}"]) == 1
    captured = capsys.readouterr()
    assert "2 of 2 decisions failed" in captured.err and "Next steps" not in captured.out
    assert main(["quickstart", "--limit", "1", "--backend", f"local:{golden_checkpoint}", "--dtype", "bfloat16"]) == 0
    assert "backend: clef-local (checkpoint@" in (out := capsys.readouterr().out) and "bfloat16 on cpu)" in out


def test_a_local_checkpoint_is_warmed_up_before_the_first_row(golden_checkpoint: Path, capsys) -> None:
    assert main(["quickstart", "--limit", "2", "--backend", f"local:{golden_checkpoint}"]) == 0
    out = capsys.readouterr().out
    assert "float32 on cpu)" in out  # --dtype auto on CPU
    rows = [line for line in out.splitlines() if line.startswith(("http ", "tool "))]
    assert len(rows) == 4 and not [row for row in rows if "on_error" in row]


@pytest.mark.anyio
async def test_run_quickstart_starts_the_backend_before_any_row(golden_checkpoint: Path) -> None:
    events: list[str] = []
    backend = LocalBackend.from_pretrained(golden_checkpoint, dtype=torch.float32,
                                           on_batch=lambda info: events.append(f"batch {info.tokens}"))  # fmt: skip
    self_test = len(backend.model.encode(SELF_TEST_REQUEST).input_ids)
    result = await run_quickstart(backend, limit=1, on_row=lambda row: events.append(f"row {row.id}"))
    assert events[0] == f"batch {self_test}" and events.index(f"row {result.rows[0].id}") >= 2
    assert all(row.rule != "on_error" for row in result.rows)


def test_next_steps_keep_the_api_and_the_worker_on_different_ports() -> None:
    upstreams = set(re.findall(r"--upstream http://127\.0\.0\.1:(\d+)", NEXT_STEPS))
    apps = set(re.findall(r"app\.py --port (\d+)", NEXT_STEPS))
    workers = set(re.findall(r"worker serve .*--port (\d+)", NEXT_STEPS))
    backends = set(re.findall(r"--backend http://127\.0\.0\.1:(\d+)", NEXT_STEPS))
    assert upstreams == apps == {"9000"} and workers == backends == {"8000"}
    assert "--backend local:/path/to/clef-flash --device cuda" in NEXT_STEPS
