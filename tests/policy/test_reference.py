"""``guard policy reference``: the Markdown policy reference rendered from the JSON Schema, kept current in docs/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from guard.cli import main
from guard.cli.cmd_policy import reference_markdown, schema_json
from guard.policy.reference import SECTION_TITLES, render_reference

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "policy-reference.md"


def _sections(markdown: str) -> dict[str, str]:
    """``## Title`` -> the text up to the next ``## `` heading."""
    parts = re.split(r"^## (.+)$", markdown, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _rows(section: str) -> dict[str, list[str]]:
    """Field name -> the table row's cells (field, type, required, default, description)."""
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| `([^`]+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in re.split(r"(?<!\\)\|", match.group(2))]
    return rows


def test_committed_reference_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    # Regenerate with: guard policy reference --output docs/policy-reference.md
    assert main(["policy", "reference", "--check", str(REFERENCE)]) == 0
    assert REFERENCE.read_text(encoding="utf-8") == reference_markdown()
    assert capsys.readouterr().out.strip() == f"ok {REFERENCE}"


def test_every_schema_field_is_in_its_section() -> None:
    schema = json.loads(schema_json())
    sections = _sections(REFERENCE.read_text(encoding="utf-8"))
    objects = {"": schema, **schema["$defs"]}
    assert set(sections) - {"Contents"} == {SECTION_TITLES[name] for name in objects}
    for name, node in objects.items():
        rows = _rows(sections[SECTION_TITLES[name]])
        assert list(rows) == list(node["properties"]), name
        required = set(node.get("required", ()))
        for field, cells in rows.items():
            assert cells[1] == ("yes" if field in required else "no"), (name, field)
            description = node["properties"][field].get("description")
            assert description, f"{name}.{field} has no description in the schema"
            assert cells[3] != "—", (name, field)


def test_descriptions_defaults_enums_and_limits_reach_the_page() -> None:
    rows = _rows(_sections(REFERENCE.read_text(encoding="utf-8"))["Policy"])
    assert rows["timeout_ms"][:3] == ["integer", "no", "`2000`"]
    assert "Limits: ≥ 1, ≤ 60000." in rows["timeout_ms"][3]
    assert rows["mode"][2] == "`enforce`" and "Allowed: `enforce`, `shadow`." in rows["mode"][3]
    assert rows["questions"][0] == "map of [Question](#question)"
    assert rows["default"][:3] == ["string or [Outcome](#outcome)", "no", "`allow`"]
    assert rows["id"][1:3] == ["yes", "—"] and "matches `^[A-Za-z0-9_.-]{1,100}$`" in rows["id"][3]


def test_renderer_on_a_small_schema() -> None:
    schema = {
        "description": "A ``root`` object.",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "description": "All | some."},
            "mode": {"enum": ["a", "b"], "type": "string", "default": "a", "description": "Mode *star*."},
            "extra": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "null"}], "default": None},
        },
        "required": ["items"],
        "additionalProperties": False,
        "$defs": {
            "Item": {"properties": {"size": {"type": "number", "maximum": 10, "description": "Size."}}},
            "Unused": {"description": "Never referenced."},
        },
    }
    text = render_reference(schema)
    sections = _sections(text)
    assert list(sections) == ["Contents", "Policy file", "Item", "Unused"]
    root = _rows(sections["Policy file"])
    assert root["items"] == ["list of [Item](#item)", "yes", "—", "All \\| some. Limits: at least 1 item."]
    assert root["mode"] == ["string", "no", "`a`", "Mode \\*star\\*. Allowed: `a`, `b`."]
    assert root["extra"] == ["integer or null", "no", "`null`", "Limits: > 0."]
    assert "A `root` object." in sections["Policy file"] and "No other keys are allowed." in sections["Policy file"]
    assert "Used by: [Policy file](#policy-file) `items`." in sections["Item"]
    assert _rows(sections["Item"])["size"] == ["number", "no", "—", "Size. Limits: ≤ 10."]
    assert "(no fields)" in sections["Unused"]
    with pytest.raises(ValueError, match="not in \\$defs"):
        render_reference({"properties": {"x": {"$ref": "#/$defs/Missing"}}, "$defs": {}})
    with pytest.raises(ValueError, match="only local definitions"):
        render_reference({"properties": {"x": {"$ref": "other.json#/x"}}})


def test_cli_writes_prints_and_flags_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "reference.md"
    assert main(["policy", "reference", "--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == reference_markdown()
    assert main(["policy", "reference"]) == 0
    assert capsys.readouterr().out == reference_markdown()
    out.write_text(reference_markdown().replace("Milliseconds", "Seconds"), encoding="utf-8")
    assert main(["policy", "reference", "--check", str(out)]) == 1
    assert f"run: guard policy reference --output {out}" in capsys.readouterr().err
    assert main(["policy", "reference", "--check", str(tmp_path / "missing.md")]) == 1
    assert "cannot read" in capsys.readouterr().err
