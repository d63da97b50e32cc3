"""guard: decision-model middleware for agents and APIs.

The public names below are imported lazily, so ``import guard`` stays cheap and does not load torch until a model
is used::

    from guard import Guard, GuardMiddleware, GuardAgentMiddleware

Layers, bottom up; each imports only from the ones before it (``tests/test_layers.py`` checks it, lazy imports
included)::

    guard.errors, guard._json, guard._seal, guard.subject, guard._readfile   errors; strict JSON; store seals; what is
                                               judged; capped file reads
    guard._buckets, guard._resource, guard._close, guard._urls, guard._english, guard._params, guard._rootpath,
    guard._markup, guard._logevery,            duration histogram bounds; the OTel resource; bounded OTel close; URLs
    guard._readable, guard._headers            as logs show them and what a request path may not hold; English words;
                                               parameter names as frameworks read them; the part of an ASGI path a
                                               root path takes; what a parser reads of HTML and XML; one log line
                                               per interval; whether decoded bytes read as text, base64 as its
                                               readers decode it, and which characters a reader cannot see; the one
                                               value of a single-value request header; Host and Content-Type as
                                               guard matches them
    guard._tracecontext                        a caller's trace headers read without logging their text
    guard.systemone                            wire types; the one answer check
    guard.verdict                              the Verdict type
    guard._body                                ASGI body reading and replay (worker and middleware)
    guard.clef, guard.compact                  the Clef runtime; the compact CPU model
    guard.backends                             decide(request) -> response: clients, local + batcher, compact, fixture
    guard.worker                               the System One server
    guard.policy                               format, loader, rules, normalisation
    guard.engine                               Guard; verdicts; probability cache and its keys; telemetry; ids
    guard.asgi, guard.agents                   the enforcement points
    guard.devtools                             policy explain and policy tests
    guard.quickstart, guard.cli                the demo; the command line
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "AgentSubject": "guard.subject",
    "AnswerV1": "guard.systemone",
    "BackendError": "guard.errors",
    "BackendRejected": "guard.errors",
    "BackendTimeout": "guard.errors",
    "BackendUnavailable": "guard.errors",
    "CacheConfig": "guard.engine.cache",
    "ClefModel": "guard.clef",
    "CompactBackend": "guard.backends",
    "DecisionBackend": "guard.backends",
    "DecisionLog": "guard.engine.telemetry",
    "FixtureBackend": "guard.backends",
    "Guard": "guard.engine",
    "GuardAgentMiddleware": "guard.agents",
    "GuardError": "guard.errors",
    "GuardMiddleware": "guard.asgi",
    "HandoffClient": "guard.asgi.handoff",
    "HttpSubject": "guard.subject",
    "LocalBackend": "guard.backends",
    "MalformedAnswer": "guard.errors",
    "MemoryCache": "guard.engine.cache",
    "MemoryReviewStore": "guard.asgi.review_store",
    "Overloaded": "guard.errors",
    "Policy": "guard.policy",
    "PolicyError": "guard.errors",
    "PolicySet": "guard.policy",
    "QuestionV1": "guard.systemone",
    "RedisCache": "guard.engine.cache",
    "RedisReviewStore": "guard.asgi.review_store",
    "RequestValidationError": "guard.errors",
    "ReviewStore": "guard.asgi.review_store",
    "SystemOneClient": "guard.backends",
    "SystemOneRequestV1": "guard.systemone",
    "SystemOneResponseV1": "guard.systemone",
    "Telemetry": "guard.engine.telemetry",
    "UnsupportedQuestion": "guard.errors",
    "UsageV1": "guard.systemone",
    "Verdict": "guard.verdict",
    "load_files": "guard.policy",
}

__all__ = [
    "AgentSubject",
    "AnswerV1",
    "BackendError",
    "BackendRejected",
    "BackendTimeout",
    "BackendUnavailable",
    "CacheConfig",
    "ClefModel",
    "CompactBackend",
    "DecisionBackend",
    "DecisionLog",
    "FixtureBackend",
    "Guard",
    "GuardAgentMiddleware",
    "GuardError",
    "GuardMiddleware",
    "HandoffClient",
    "HttpSubject",
    "LocalBackend",
    "MalformedAnswer",
    "MemoryCache",
    "MemoryReviewStore",
    "Overloaded",
    "Policy",
    "PolicyError",
    "PolicySet",
    "QuestionV1",
    "RedisCache",
    "RedisReviewStore",
    "RequestValidationError",
    "ReviewStore",
    "SystemOneClient",
    "SystemOneRequestV1",
    "SystemOneResponseV1",
    "Telemetry",
    "UnsupportedQuestion",
    "UsageV1",
    "Verdict",
    "load_files",
]

if TYPE_CHECKING:  # pragma: no cover
    from guard.agents import GuardAgentMiddleware
    from guard.asgi import GuardMiddleware
    from guard.asgi.handoff import HandoffClient
    from guard.asgi.review_store import MemoryReviewStore, RedisReviewStore, ReviewStore
    from guard.backends import CompactBackend, DecisionBackend, FixtureBackend, LocalBackend, SystemOneClient
    from guard.clef import ClefModel
    from guard.engine import Guard
    from guard.engine.cache import CacheConfig, MemoryCache, RedisCache
    from guard.engine.telemetry import DecisionLog, Telemetry
    from guard.errors import (
        BackendError,
        BackendRejected,
        BackendTimeout,
        BackendUnavailable,
        GuardError,
        MalformedAnswer,
        Overloaded,
        PolicyError,
        RequestValidationError,
        UnsupportedQuestion,
    )
    from guard.policy import Policy, PolicySet, load_files
    from guard.subject import AgentSubject, HttpSubject
    from guard.systemone import AnswerV1, QuestionV1, SystemOneRequestV1, SystemOneResponseV1, UsageV1
    from guard.verdict import Verdict

def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'guard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
