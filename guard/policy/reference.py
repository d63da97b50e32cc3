"""Render the policy file reference (``docs/policy-reference.md``) from the policy JSON Schema.

The JSON Schema is generated from the pydantic models in ``guard/policy/model.py`` (``guard policy schema``); this
module turns it into Markdown, so the reference can never drift from what the loader accepts: one section per object
type (``$defs`` entry, plus the file itself), each with the object's description, where it is used, and a table of
its fields (type, required, default, description, allowed values, limits), with ``$ref`` types linked to their
sections. ``guard policy reference --output docs/policy-reference.md`` writes it; a test keeps the committed file
current.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["SECTION_TITLES", "render_reference"]

#: Section title for each ``$defs`` name (and ``""`` for the file, the schema's root); others use the def name.
SECTION_TITLES: dict[str, str] = {
    "": "Policy file",
    "PolicySpec": "Policy",
    "MatchSpec": "Match",
    "HttpMatchSpec": "HTTP match",
    "ResponseMatchSpec": "Response match",
    "AgentMatchSpec": "Agent match",
    "SourceSpec": "State source",
    "QuestionSpec": "Question",
    "RuleSpec": "Rule",
    "OutcomeSpec": "Outcome",
    "RedactSpec": "Redact",
    "OnErrorSpec": "On error",
    "CacheSpec": "Cache",
    "HandoffTargetSpec": "Handoff target",
    "ToolSpec": "Tool",
    "ToolArgumentSpec": "Tool argument",
}

_REF_PREFIX = "#/$defs/"
#: JSON Schema keyword -> (template, unit noun singular, plural) for the "Limits" note.
_CONSTRAINTS: tuple[tuple[str, str, str, str], ...] = (
    ("minimum", "≥ {}", "", ""),
    ("exclusiveMinimum", "> {}", "", ""),
    ("maximum", "≤ {}", "", ""),
    ("exclusiveMaximum", "< {}", "", ""),
    ("minLength", "at least {}", "character", "characters"),
    ("maxLength", "at most {}", "character", "characters"),
    ("minItems", "at least {}", "item", "items"),
    ("maxItems", "at most {}", "item", "items"),
    ("minProperties", "at least {}", "entry", "entries"),
    ("maxProperties", "at most {}", "entry", "entries"),
)
_CODE_SPAN = re.compile(r"(`[^`]*`)")
_ESCAPE = re.compile(r"([\\*_\[\]<>|])")

HEADER = """\
<!-- Generated from policies/guard-policy.schema.json by `guard policy reference`; do not edit by hand.
     Regenerate: guard policy reference --output docs/policy-reference.md -->

# Policy file reference

Every key a policy file may contain, generated from the JSON Schema
([`policies/guard-policy.schema.json`](../policies/guard-policy.schema.json)) that `guard policy schema` builds from the
loader's own models, so this page and the loader cannot disagree. For what the keys mean together, with examples, read
[Writing policies](policies.md); for the ideas behind them, [Concepts](concepts.md).

Unknown keys, wrong types, duplicate keys, YAML anchors/aliases and tags are errors that name the file, line and key.
The schema checks shapes; the loader also checks meaning (CEL syntax and names, System One limits, handoff targets,
state sources that fit the matched subjects), so `guard policy check` can report errors the schema alone does not.
"""


def render_reference(schema: Mapping[str, Any]) -> str:
    """Render the Markdown reference for a policy file JSON Schema.

    Args:
        schema: the JSON Schema object (draft 2020-12) as produced by ``guard policy schema``: a root object with
            ``properties`` and ``$defs`` whose references are ``#/$defs/<Name>``.

    Returns:
        Markdown text ending with one newline: a header, a contents list, then one section per object type in the
        order they are first reached from the root (depth first, in property order); defs never reached come last.

    Raises:
        ValueError: when a ``$ref`` does not point into ``#/$defs``, or names a def that does not exist.
    """
    defs: Mapping[str, Any] = schema.get("$defs", {})
    order = _section_order(schema, defs)
    used_by = _used_by(schema, defs, order)
    out = [HEADER, "## Contents\n"]
    out.extend(f"* [{_title(name)}](#{_anchor(name)})" for name in order)
    out.append("")
    for name in order:
        node = schema if name == "" else defs[name]
        out.append(_section(name, node, used_by.get(name, [])))
    return "\n".join(out).rstrip("\n") + "\n"


# Walking the schema -------------------------------------------------------------------------------------------------


def _ref_name(ref: str, defs: Mapping[str, Any]) -> str:
    if not ref.startswith(_REF_PREFIX):
        raise ValueError(f"$ref {ref!r} does not point into #/$defs; only local definitions are supported")
    name = ref[len(_REF_PREFIX) :]
    if name not in defs:
        raise ValueError(f"$ref {ref!r} names a definition that is not in $defs ({sorted(defs)})")
    return name


def _map_values(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The schema of a map's values: ``additionalProperties``, or the one ``patternProperties`` schema (a map whose
    keys must match a pattern); ``None`` when ``node`` gives neither."""
    values = node.get("additionalProperties")
    if isinstance(values, Mapping):
        return values
    patterns = list(node.get("patternProperties", {}).values())
    return patterns[0] if len(patterns) == 1 else None


def _subschemas(node: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The schemas nested directly in ``node`` that describe the same value (union members, items, map values)."""
    for key in ("anyOf", "oneOf", "allOf"):
        yield from node.get(key, ())
    for child in (node.get("items"), _map_values(node)):
        if isinstance(child, Mapping):
            yield child


def _refs(node: Mapping[str, Any], defs: Mapping[str, Any]) -> Iterator[str]:
    """Def names referenced by one property schema, in order (not following the references)."""
    if "$ref" in node:
        yield _ref_name(node["$ref"], defs)
    for child in _subschemas(node):
        yield from _refs(child, defs)


def _section_order(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        order.append(name)
        node = schema if name == "" else defs[name]
        for prop in node.get("properties", {}).values():
            for ref in _refs(prop, defs):
                visit(ref)

    visit("")
    order.extend(name for name in defs if name not in order)
    return order


def _used_by(schema: Mapping[str, Any], defs: Mapping[str, Any], order: list[str]) -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for parent in order:
        node = schema if parent == "" else defs[parent]
        for field, prop in node.get("properties", {}).items():
            for ref in dict.fromkeys(_refs(prop, defs)):
                used.setdefault(ref, []).append(f"[{_title(parent)}](#{_anchor(parent)}) `{field}`")
    return used


# Rendering ----------------------------------------------------------------------------------------------------------


def _title(name: str) -> str:
    return SECTION_TITLES.get(name, name)


def _anchor(name: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give the section heading."""
    return re.sub(r"[^a-z0-9 _-]", "", _title(name).lower()).replace(" ", "-")


def _section(name: str, node: Mapping[str, Any], used_by: list[str]) -> str:
    lines = [f"## {_title(name)}", ""]
    where = "the document root" if name == "" else f"`#/$defs/{name}`"
    lines.append(f"Schema: {where}." + (f" Used by: {', '.join(used_by)}." if used_by else ""))
    lines.append("")
    if node.get("description"):
        lines.extend([_prose(node["description"]), ""])
    properties: Mapping[str, Any] = node.get("properties", {})
    if not properties:
        lines.extend(["(no fields)", ""])
        return "\n".join(lines)
    required = set(node.get("required", ()))
    lines.append("| field | type | required | default | description |")
    lines.append("|---|---|---|---|---|")
    for field, prop in properties.items():
        lines.append(
            f"| `{field}` | {_type(prop)} | {'yes' if field in required else 'no'} | {_default(prop, field in required)} "
            f"| {_describe(prop)} |"
        )
    if node.get("additionalProperties") is False:
        lines.extend(["", "No other keys are allowed."])
    lines.append("")
    return "\n".join(lines)


def _link(ref: str) -> str:
    name = ref[len(_REF_PREFIX) :]
    return f"[{_title(name)}](#{_anchor(name)})"


def _type(node: Mapping[str, Any]) -> str:
    """A short, linked type: ``string``, ``list of string``, ``map of [Question](#question)``, ``a or b or null``."""
    if "$ref" in node:
        return _link(node["$ref"])
    for key in ("anyOf", "oneOf"):
        if key in node:
            members = [m for m in node[key] if m.get("type") != "null"]
            nullable = len(members) != len(node[key])
            parts = list(dict.fromkeys(_type(m) for m in members))
            return " or ".join(parts + (["null"] if nullable else []))
    kind = node.get("type")
    if kind == "array":
        items = node.get("items")
        return f"list of {_group(_type(items))}" if isinstance(items, Mapping) else "list"
    if kind == "object":
        values = _map_values(node)
        if values is not None:
            return f"map of {_group(_type(values))}"
        return "map of any" if node.get("additionalProperties") is True or "properties" not in node else "object"
    if isinstance(kind, list):
        return " or ".join(kind)
    return kind if isinstance(kind, str) else "any"


def _group(text: str) -> str:
    return f"({text})" if " or " in text else text


def _collect(node: Mapping[str, Any], key: str) -> Iterator[tuple[Mapping[str, Any], Any]]:
    """``(schema, value)`` for every nested schema of the same value (not through ``$ref``) that has ``key``."""
    if key in node:
        yield node, node[key]
    for child in _subschemas(node):
        yield from _collect(child, key)


def _describe(prop: Mapping[str, Any]) -> str:
    parts = [_cell(prop["description"])] if prop.get("description") else []
    allowed = [value for _, values in _collect(prop, "enum") for value in values]
    allowed += [value for _, value in _collect(prop, "const")]
    if allowed:
        parts.append("Allowed: " + ", ".join(_code(v) for v in dict.fromkeys(allowed)) + ".")
    limits = [
        _limit(template, value, one, many)
        for key, template, one, many in _CONSTRAINTS
        for _, value in _collect(prop, key)
    ]
    limits += [f"matches {_code(value)}" for _, value in _collect(prop, "pattern")]
    limits += [f"keys match {_code(key)}" for _, keys in _collect(prop, "patternProperties") for key in keys]
    if limits:
        parts.append("Limits: " + ", ".join(limits) + ".")
    return " ".join(parts) if parts else "—"


def _default(prop: Mapping[str, Any], required: bool) -> str:
    if required or "default" not in prop:
        return "—"
    return _code(prop["default"])


def _limit(template: str, value: Any, one: str, many: str) -> str:
    text = template.format(_number(value))
    unit = one if value == 1 else many
    return f"{text} {unit}" if unit else text


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _code(value: Any) -> str:
    plain = isinstance(value, str) and value.strip() == value and value != ""
    text = value if plain else json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    text = text.replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}" if fence == "`" else f"{fence} {text} {fence}"


def _escape(text: str) -> str:
    """Escape Markdown outside code spans; ``|`` everywhere (table cells)."""
    pieces = _CODE_SPAN.split(text)
    return "".join(p.replace("|", "\\|") if i % 2 else _ESCAPE.sub(r"\\\1", p) for i, p in enumerate(pieces))


def _cell(text: str) -> str:
    """A plain-text field description as one table cell."""
    return _escape(" ".join(text.split()))


def _prose(text: str) -> str:
    """A model docstring (reStructuredText ````code```` markup) as Markdown paragraphs."""
    markdown = text.replace("``", "`")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", markdown.strip())]
    return "\n\n".join(_escape(p) for p in paragraphs)
