"""Policies: the YAML format, the safe loader, compiled policies and rules.

See ``docs/policies.md`` for the format and ``policies/`` for examples.
"""

from __future__ import annotations

from guard.policy.loader import PolicyLoadError, PolicySet, PolicyView, check_unique, load_files, load_text
from guard.policy.policy import DEFAULT_MODEL, FailPolicy, HandoffTarget, HttpReads, Policy, PolicyQuestion
from guard.policy.rules import Outcome, RuleError, RuleResult, apply_rules

__all__ = [
    "DEFAULT_MODEL",
    "FailPolicy",
    "HandoffTarget",
    "HttpReads",
    "Outcome",
    "Policy",
    "PolicyLoadError",
    "PolicyQuestion",
    "PolicySet",
    "PolicyView",
    "RuleError",
    "RuleResult",
    "apply_rules",
    "check_unique",
    "load_files",
    "load_text",
]
