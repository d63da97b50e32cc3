"""A policy's digest: which policy text decided, the same in the decision log, the reload log line and ``guard policy``
output."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from guard.cli import main
from guard.policy import load_files, load_text

POLICY = """\
policies:
  - id: api
    version: "1.0"
    match: {http: {paths: ["/v1/**"]}}
    state: {text: body_text, route: path}
    questions:
      inj: {type: noul, instructions: "Is it an injection?"}
      spam: {type: noul, instructions: "Is it spam?"}
    rules: [{id: inj, when: inj.noul >= data.block, action: block}]
    default: allow
data: {block: 0.8}
"""

SAME = """\
# the same policy: comments, layout, quoting and defaults written out do not change what decides
data:
  block: 0.8
policies:
  - id: api
    version: '1.0'
    mode: enforce       # the default
    priority: 0         # the default
    match:
      http:
        paths: ['/v1/**']
    state:
      text: {from: body_text}
      route: path
    questions:
      inj:
        type: noul
        instructions: Is it an injection?
      spam: {type: noul, instructions: 'Is it spam?'}
    rules:
      - id: inj
        when: inj.noul >= data.block
        action: block
    default: allow
"""


def digest(text: str) -> str:
    (policy,) = load_text(text)
    return policy.digest


def test_the_digest_is_of_what_decides_not_of_how_it_is_written() -> None:
    first = digest(POLICY)
    assert re.fullmatch(r"[0-9a-f]{16}", first)
    assert digest(SAME) == first
    changed = [
        POLICY.replace("block: 0.8", "block: 0.3"),  # the data a rule reads, the version kept
        POLICY.replace(">= data.block", ">= 0.8"),
        POLICY.replace("default: allow", "default: escalate"),
        POLICY.replace('paths: ["/v1/**"]', 'paths: ["/v1/**", "/v2/**"]'),
        POLICY.replace("Is it spam?", "Is it bulk mail?"),
        POLICY.replace("state: {text: body_text, route: path}", "state: {route: path, text: body_text}"),  # model input
    ]
    digests = {digest(text) for text in changed}
    assert first not in digests and len(digests) == len(changed)


def test_reload_computes_the_digest_again_and_logs_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY, encoding="utf-8")
    policies = load_files(path)
    before = policies["api"].digest
    path.write_text(POLICY.replace("block: 0.8", "block: 0.3"), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="guard.policy"):
        policies.reload()
    after = policies["api"].digest
    assert after != before and policies["api"].version == "1.0"
    assert f"policies reloaded: api@1.0 digest {after}" in caplog.text


def test_guard_policy_check_and_explain_show_the_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY, encoding="utf-8")
    expected = digest(POLICY)
    assert main(["policy", "check", str(path)]) == 0
    assert f"ok {path}: 1 policy (api@1.0 digest {expected})" in capsys.readouterr().out
    subject = tmp_path / "subject.json"
    subject.write_text(json.dumps({"http": {"method": "POST", "path": "/v1/x", "body": {"m": "hi"}}}))
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"inj": 0.1, "spam": 0.1}))
    args = ["policy", "explain", str(path), "--input", str(subject), "--answers", str(answers)]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith(f"policy     api@1.0 digest {expected} ({path}:2, mode enforce)")
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"]["digest"] == expected
