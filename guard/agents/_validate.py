"""Constructor checks shared by :class:`~guard.agents.GuardAgentMiddleware` and :class:`~guard.agents.GuardToolWrapper`:
everything is validated once, at construction, with errors that name the argument, the value and what is allowed."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Literal, get_args

from langchain_core.language_models import BaseChatModel

from guard.verdict import FailMode

if TYPE_CHECKING:
    from guard.engine import Guard

__all__ = ["check_options"]

TOOL_RESULT_ACTIONS = ("block", "quote", "strip")


def _names(value: Any, argument: str) -> frozenset[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        raise TypeError(f"{argument} must be a collection of names, not {type(value).__name__}")
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        raise TypeError(f"{argument} must hold non-empty strings; got {bad[0]!r}")
    return frozenset(value)


def check_options(
    *,
    guard: Guard,
    reviewers: Mapping[str, BaseChatModel] | None,
    handoff_nodes: Collection[str],
    side_effecting_tools: Collection[str] | Literal["all"],
    tool_result_action: str,
    fail_mode: str,
    reviewer_timeout_s: float,
) -> tuple[dict[str, BaseChatModel], frozenset[str], frozenset[str] | Literal["all"]]:
    """Validate the options; returns normalised ``(reviewers, handoff_nodes, side_effecting_tools)``.

    Raises:
        TypeError: ``guard`` lacks ``match``/``evaluate``/``aevaluate``; a reviewer is not a LangChain chat model;
            a name collection is a string or holds non-strings.
        ValueError: ``tool_result_action``, ``fail_mode`` or ``reviewer_timeout_s`` is outside its allowed values; a
            name is both a reviewer and a handoff node.
    """
    for method in ("match", "evaluate", "aevaluate"):
        if not callable(getattr(guard, method, None)):
            raise TypeError(f"guard must be a guard.Guard (it has no {method}()); got {type(guard).__name__}")
    if reviewers is None:
        reviewers = {}
    if not isinstance(reviewers, Mapping):
        raise TypeError(f"reviewers must map handoff target names to chat models, not {type(reviewers).__name__}")
    for name, model in reviewers.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"reviewers keys must be non-empty handoff target names; got {name!r}")
        if not isinstance(model, BaseChatModel):
            raise TypeError(f"reviewers[{name!r}] must be a LangChain BaseChatModel, not {type(model).__name__}")
    nodes = _names(handoff_nodes, "handoff_nodes")
    both = sorted(nodes & set(reviewers))
    if both:
        raise ValueError(f"handoff target {both[0]!r} is both a reviewer and a handoff node; give it one meaning")
    side: frozenset[str] | Literal["all"]
    side = "all" if side_effecting_tools == "all" else _names(side_effecting_tools, "side_effecting_tools")
    if tool_result_action not in TOOL_RESULT_ACTIONS:
        raise ValueError(
            f"tool_result_action must be one of {', '.join(TOOL_RESULT_ACTIONS)}; got {tool_result_action!r}"
        )
    if fail_mode not in get_args(FailMode):
        raise ValueError(f"fail_mode must be one of {', '.join(get_args(FailMode))}; got {fail_mode!r}")
    if (
        isinstance(reviewer_timeout_s, bool)
        or not isinstance(reviewer_timeout_s, (int, float))
        or not (0 < reviewer_timeout_s <= 600)
    ):
        raise ValueError(f"reviewer_timeout_s must be a number of seconds in (0, 600]; got {reviewer_timeout_s!r}")
    return dict(reviewers), nodes, side
