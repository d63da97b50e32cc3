"""A rule's ``state.`` and ``data.`` names are checked against what the policy defines when it loads (issue 19: a
misspelt name was a ``KeyError``, so a 503 on every request, and ``guard policy check`` said ok)."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard.cli import main
from guard.errors import PolicyError
from guard.policy import load_text
from guard.policy.rules import field_reads

POLICY = """
policies:
  - id: p
    version: 1
    match: {http: {methods: [POST]}}
    state:
      text: body_text
      meta:
        fields: {route: path, tier: {from: header, name: x-tier}}
      limits: {const: {max: 3}}
    questions: {spam: {type: noul, instructions: "Is it spam?"}}
    rules:
      - id: r
        when: WHEN
        action: block
data:
  block_threshold: 0.85
  lists: {admins: [alice]}
"""


@pytest.mark.parametrize(
    "when",
    [
        'state.text.matches("buy now")',
        "state.meta.route.startsWith('/admin') && state.limits.max > 2",
        "spam.noul >= data.block_threshold && 'alice' in data.lists.admins",
        'state["meta"]["tier"] == "free" && has(state.text)',
    ],
)
def test_names_the_policy_defines_load(when: str) -> None:
    (policy,) = load_text(POLICY.replace("WHEN", repr(when) if '"' in when else when))
    assert policy.rules[0].source == when


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ("state.txt.size() > 3", "reads state.txt, but the state has no field 'txt'; known names: limits, meta, text"),
        ("state.meta.rout == '/x'", ("reads state.meta.rout, but state.meta has no field 'rout'; known names: route, "
         "tier")),
        ("state.limits.min > 1", "reads state.limits.min, but state.limits has no field 'min'; known names: max"),
        ("spam.noul > data.block_treshold", ("reads data.block_treshold, but the file's data has no 'block_treshold'; "
         "known names: block_threshold, lists")),
        ("data.lists.admin.size() > 0", "reads data.lists.admin, but data.lists has no 'admin'; known names: admins"),
    ],
)  # fmt: skip
def test_a_misspelt_name_is_refused_with_file_line_key_and_the_known_names(when: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_text(POLICY.replace("WHEN", when), "p.yaml")
    assert (info.value.file, info.value.line, info.value.key) == ("p.yaml", 14, "policies[0].rules[0].when")
    assert info.value.reason == message


def test_the_default_state_is_what_a_policy_without_state_may_read() -> None:
    text = """
policies:
  - id: tools
    version: 1
    match: {agent: {events: [tool_call, tool_result]}}
    questions: {bad: {type: noul, instructions: "Bad?"}}
    rules:
      - {id: r, when: "state.tool_call.name == 'shell' || state.result != ''", action: block}
      - {id: s, when: "state.text == ''", action: block}
"""
    with pytest.raises(PolicyError, match=r"rules\[1\].when: reads state.text, but the state has no field 'text'; "
                       r"known names: result, task, tool, tool_call \(the default state"):  # fmt: skip
        load_text(text)


def test_reads_are_found_outside_strings_and_stop_at_calls() -> None:
    assert field_reads('"state.x" == state.y.lowerAscii() && data["k"].v') == [
        ("state", ("y",)), ("data", ("k", "v"))
    ]
    assert field_reads("[1].exists(state, state > 0)") == []


def test_policy_check_reports_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(POLICY.replace("WHEN", "state.txt.size() > 3"))
    assert main(["policy", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        f"{path}:14: policies[0].rules[0].when: reads state.txt, but the state has no field 'txt'; known names: "
        "limits, meta, text"
    )
