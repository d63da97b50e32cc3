"""Guard for agents: LangChain v1 ``create_agent`` middleware, a guarded ``ToolNode`` for hand-built LangGraph graphs,
and the types a reviewer reads and answers. See ``docs/agents.md``."""

from __future__ import annotations

from guard.agents._records import GuardAgentState
from guard.agents.claims import ApprovalClaims, MemoryApprovalClaims, RedisApprovalClaims
from guard.agents.decisions import (
    ApproveDecision,
    Decision,
    EditDecision,
    EditedActionDecision,
    GuardReviewRequest,
    GuardReviewResponse,
    PendingItem,
    RejectDecision,
    guard_interrupts,
    resume_command,
)
from guard.agents.middleware import GuardAgentMiddleware
from guard.agents.tool_node import GuardToolWrapper, guarded_tool_node, send_tool_calls

__all__ = [
    "ApprovalClaims",
    "ApproveDecision",
    "Decision",
    "EditDecision",
    "EditedActionDecision",
    "GuardAgentMiddleware",
    "GuardAgentState",
    "GuardReviewRequest",
    "GuardReviewResponse",
    "GuardToolWrapper",
    "MemoryApprovalClaims",
    "PendingItem",
    "RedisApprovalClaims",
    "RejectDecision",
    "guard_interrupts",
    "guarded_tool_node",
    "resume_command",
    "send_tool_calls",
]
