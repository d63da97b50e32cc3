"""The command lines of ``examples/api`` (``traffic.py``, ``app.py``): a bare ``http://`` URL reaches a real worker,
and an unusable backend, policy or pair of them is one line on stderr, never a traceback. (The README's headline
commands run as doc tests in ``tests/test_docs.py``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from guard.backends.local import LocalBackend
from tests.worker._serve import serve_worker

ROOT = Path(__file__).resolve().parents[2]
TRAFFIC = ROOT / "examples" / "api" / "traffic.py"
APP = ROOT / "examples" / "api" / "app.py"


def _run(script: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script), *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip


def test_a_bare_url_reaches_a_clef_worker_for_the_policy_compact_cannot_answer(golden_checkpoint: Path) -> None:
    backend = LocalBackend.from_pretrained(golden_checkpoint, dtype=torch.float32)
    with serve_worker(backend) as worker:
        result = _run(TRAFFIC, "--backend", worker.url, "--policy", "policies/api_abuse.yaml", "--limit", "3")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("benign-", "Dan_", "STAN"))]
    assert len(rows) == 3 and not [row for row in rows if "(fail " in row]
    assert "3 requests" in result.stdout


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        (TRAFFIC, ["--backend", "https://"],
         "--backend 'https://': url must be an http:// or https:// URL with a host, got 'https://'"),
        (APP, ["--backend", "https://"],
         "--backend 'https://': url must be an http:// or https:// URL with a host, got 'https://'"),
        (TRAFFIC, ["--backend", "ftp://host"],
         ("--backend 'ftp://host': expected compact, compact:DIR, local:CHECKPOINT_DIR, http:URL, a bare http(s)://URL "
          "or unix:SOCKET")),
        (TRAFFIC, ["--backend", "local:/nowhere/clef"], "/nowhere/clef is not a Clef checkpoint: config.json is missing"),
        (TRAFFIC, ["--backend", "http://127.0.0.1:9", "--dtype", "float32"],
         "--dtype applies only to a local: backend, not --backend http://127.0.0.1:9"),
    ],
    ids=["traffic-bad-url", "app-bad-url", "traffic-unknown-spec", "traffic-no-checkpoint", "traffic-dtype-with-http"],
)  # fmt: skip
def test_an_unusable_backend_is_one_line(script: Path, argv: list[str], message: str) -> None:
    result = _run(script, "--policy", "guard/quickstart/policies.yaml", *argv)
    assert (result.returncode, result.stdout, result.stderr) == (1, "", f"{script.name}: {message}\n")


@pytest.mark.parametrize("script", [TRAFFIC, APP], ids=["traffic.py", "app.py"])
def test_a_policy_the_compact_model_cannot_answer_is_one_line_naming_the_question(script: Path) -> None:
    result = _run(script, "--policy", "policies/api_abuse.yaml", "--backend", "compact")
    assert result.returncode == 1 and "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"{script.name}: policies/api_abuse.yaml:")
    assert "cannot answer question 'spam'" in result.stderr and "Clef or System One backend" in result.stderr
