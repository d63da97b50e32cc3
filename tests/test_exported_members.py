"""The public API: ``guard.__all__`` lists exactly the public names, each resolves, and every package's ``__all__``
is sorted and importable (as httpx's test_exported_members does)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

import guard

PACKAGES = [
    "guard",
    "guard.agents",
    "guard.asgi",
    "guard.backends",
    "guard.clef",
    "guard.compact",
    "guard.errors",
    "guard.policy",
    "guard.systemone",
    "guard.worker",
]


def test_guard_all_is_exactly_the_public_names() -> None:
    exported = sorted(guard._EXPORTS)
    assert guard.__all__ == exported
    for name in exported:
        assert getattr(guard, name) is not None
    public = {
        name for name in dir(guard)
        if not name.startswith("_") and not isinstance(getattr(guard, name), types.ModuleType)
    }
    assert public - set(guard.__all__) <= {"annotations", "TYPE_CHECKING", "Any"}


def _isort_style(name: str) -> tuple[int, str]:
    """ruff's RUF022 order: SCREAMING_CASE constants, then CamelCase classes, then the rest, each alphabetical."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


@pytest.mark.parametrize("name", PACKAGES)
def test_package_all_is_sorted_and_resolves(name: str) -> None:
    module = importlib.import_module(name)
    names = list(module.__all__)
    assert names == sorted(names, key=_isort_style), f"{name}.__all__ is not sorted"
    for attribute in names:
        assert hasattr(module, attribute), f"{name}.{attribute} does not resolve"


def test_a_tenant_scoped_reviewer_is_made_from_guard_asgi_as_docs_http_md_shows() -> None:
    from guard.asgi import Reviewer
    from guard.asgi.review_api import Reviewer as Defined

    assert Reviewer is Defined and "Reviewer" in importlib.import_module("guard.asgi").__all__


def test_import_guard_does_not_load_torch() -> None:
    code = "import sys, guard, guard.systemone, guard.errors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        guard.Nope  # noqa: B018
