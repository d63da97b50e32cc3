"""``guard.clef`` re-exports a sorted ``__all__`` of names that exist."""

from __future__ import annotations

import guard.clef


def test_public_names_are_sorted_and_importable() -> None:
    assert guard.clef.__all__ == sorted(guard.clef.__all__)
    assert all(getattr(guard.clef, name) is not None for name in guard.clef.__all__)
    assert {"ClefModel", "JointSchemaHead", "EvidenceRoutingLayer", "write_tiny_checkpoint"} <= set(guard.clef.__all__)
