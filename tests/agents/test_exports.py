"""guard.agents exports exactly its public names, sorted."""

from __future__ import annotations

import guard.agents


def test_all_is_sorted_and_complete() -> None:
    exported = guard.agents.__all__
    assert exported == sorted(exported)
    public = {name for name in vars(guard.agents) if not name.startswith("_") and name not in {"annotations"}}
    modules = {"claims", "decisions", "middleware", "tool_node"}
    assert public - modules == set(exported)
    for name in exported:
        assert getattr(guard.agents, name) is not None
