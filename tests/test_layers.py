"""Imports run down the layers ``guard/__init__.py`` names, with no cycle, imports inside functions included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import guard

ROOT = Path(guard.__file__).parent


def _layers() -> list[set[str]]:
    """The layer table of ``guard/__init__.py``'s docstring: one set of module or package names per line."""
    doc = guard.__doc__ or ""
    table = doc[doc.index("Layers, bottom up") :]
    rows = [line.strip().split("   ")[0] for line in table.splitlines() if line.startswith("    guard.")]
    return [set(re.findall(r"guard\.\w+", row)) for row in rows]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every guard module ``name`` imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".")
            if node.level:
                base = base[: len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module, *(f"{module}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("guard.") and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def _unit(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_every_module_has_a_layer_and_imports_only_from_its_own_or_lower_ones() -> None:
    layers = _layers()
    rank = {unit: i for i, row in enumerate(layers) for unit in row}
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if name in ("guard", "guard.__main__"):
            continue
        assert _unit(name) in rank, f"{name} belongs to no layer of guard/__init__.py"
        for target in _imports(name, path, modules):
            if rank[_unit(target)] > rank[_unit(name)]:
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_no_import_cycles_between_modules_or_packages() -> None:
    modules = _modules()
    edges = {name: _imports(name, path, modules) for name, path in modules.items() if name != "guard"}
    packages: dict[str, set[str]] = {}
    for name, targets in edges.items():
        for target in targets:
            if _unit(name) != _unit(target):
                packages.setdefault(_unit(name), set()).add(_unit(target))

    def cycle(graph: dict[str, set[str]]) -> list[str]:
        state: dict[str, int] = {}
        stack: list[str] = []

        def visit(node: str) -> list[str]:
            state[node] = 1
            stack.append(node)
            for nxt in sorted(graph.get(node, ())):
                if state.get(nxt) == 1:
                    return [*stack[stack.index(nxt) :], nxt]
                if nxt not in state and (found := visit(nxt)):
                    return found
            stack.pop()
            state[node] = 2
            return []

        for node in sorted(graph):
            if node not in state and (found := visit(node)):
                return found
        return []

    assert cycle(edges) == [] and cycle(packages) == []
