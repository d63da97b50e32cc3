"""The example API: a small FastAPI service with three JSON endpoints, guarded in-process or left bare for a proxy.

Run it bare (for ``guard proxy`` to front it)::

    python examples/api/app.py --port 9000

Run it with the guard inside the process (the quickstart's policy asks only catalog questions, which the embedded
compact model answers; ``policies/api_abuse.yaml`` needs Clef: ``--backend local:DIR`` or ``http://WORKER``)::

    python examples/api/app.py --port 8080 --policy guard/quickstart/policies.yaml

Guarded, it also serves an admin listener on ``--admin-host``/``--admin-port`` (default ``127.0.0.1:9901``, never the
API's own port): health, metrics and, only with credentials, the reviewers' API at ``/_guard/admin/reviews``:
``$GUARD_REVIEW_TOKENS`` holds ``name:token,name:token`` (one token per reviewer, at least 16 characters each).
Without it, ``--insecure-review`` serves the review API to loopback clients only (and only with a loopback
``--admin-host``); with neither, it is not served.
The app starts (warms up) the guard's backends at startup. A backend that cannot answer the policy, or a bad option,
stops it with one line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from guard import Guard, MemoryReviewStore, ReviewStore
from guard.asgi import GuardMiddleware, HttpMetrics
from guard.asgi.admin import AdminApp, admin_app
from guard.asgi.review_api import Reviewer, is_loopback, parse_reviewer_tokens


class Message(BaseModel):
    message: str


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    model: str
    messages: list[ChatMessage]


class SearchRequest(BaseModel):
    query: str
    limit: int = 10


def create_app(guard: Guard | None = None, *, review_store: ReviewStore | None = None,
               metrics: HttpMetrics | None = None) -> FastAPI:
    """The example service; with ``guard`` it is wrapped in :class:`GuardMiddleware` (holding escalated requests in
    ``review_store``, default a new :class:`MemoryReviewStore`, and counting into ``metrics``, default a new set),
    which starts the guard's backends at the app's startup (a ``LocalBackend`` warms up before the first request).
    The guard, store and metrics are kept in ``app.state`` for :func:`create_admin`, which serves the reviewers' API
    and the metrics on another port."""
    app = FastAPI(title="guard example API")

    @app.post("/v1/messages")
    async def messages(body: Message) -> dict[str, Any]:
        return {"reply": f"Thanks, we received your message ({len(body.message)} characters)."}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> dict[str, Any]:
        last = body.messages[-1].content if body.messages else ""
        return {"object": "chat.completion", "model": body.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"Echo: {last[:80]}"},
                             "finish_reason": "stop"}]}

    @app.post("/v1/search")
    async def search(body: SearchRequest) -> dict[str, Any]:
        return {"query": body.query, "results": [], "limit": body.limit}

    @app.get("/healthz")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    if guard is not None:
        app.state.guard = guard
        app.state.review_store = review_store if review_store is not None else MemoryReviewStore()
        app.state.metrics = metrics if metrics is not None else HttpMetrics()
        app.add_middleware(GuardMiddleware, guard=guard, review_store=app.state.review_store,
                           metrics=app.state.metrics)
    return app


def create_admin(app: FastAPI, *, reviewers: Mapping[str, str | Reviewer] | None = None,
                 insecure_review: bool = False) -> AdminApp:
    """The admin listener's app for a guarded :func:`create_app` app: health, its middleware's metrics and the
    reviewers' API over its review store (with ``reviewers``, or for loopback clients only with ``insecure_review``).

    Raises:
        ValueError: ``app`` was made without a guard.
    """
    guard = getattr(app.state, "guard", None)
    if guard is None:
        raise ValueError("create_admin needs an app made by create_app(guard): this one has no guard")
    return admin_app(guard, review_store=app.state.review_store, reviewers=reviewers,
                     insecure_loopback=insecure_review, metrics=app.state.metrics)


def main() -> None:
    import uvicorn

    from guard.asgi.server import bind_socket, serve_together
    from guard.backends.options import add_backend_options, open_cli_backend
    from guard.errors import GuardError

    parser = argparse.ArgumentParser(description="The guard example API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--admin-host", default="127.0.0.1", help="the admin listener (health, review API)")
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--policy", help="guard the app in-process with this policy file")
    parser.add_argument("--insecure-review", action="store_true",
                        help="without $GUARD_REVIEW_TOKENS, serve the review API to loopback clients (loopback "
                        "--admin-host)")
    add_backend_options(parser, default="compact")
    args = parser.parse_args()
    try:
        tokens = os.environ.get("GUARD_REVIEW_TOKENS")
        reviewers = parse_reviewer_tokens(tokens) if tokens else None
        if args.insecure_review and (reviewers is not None or not is_loopback(args.admin_host)):
            raise ValueError("--insecure-review needs a loopback --admin-host and no $GUARD_REVIEW_TOKENS")
        guard = Guard.from_files(args.policy, backends=open_cli_backend(args)) if args.policy else None
        sockets = [bind_socket(args.host, args.port), bind_socket(args.admin_host, args.admin_port)] if guard else []
    except (GuardError, OSError, ValueError) as exc:  # PolicyError is a GuardError
        raise SystemExit(f"app.py: {exc}") from None
    if guard is None:
        uvicorn.run(create_app(), host=args.host, port=args.port)
        return
    if reviewers is None and not args.insecure_review:
        print("app.py: the review API is not served (set GUARD_REVIEW_TOKENS, or --insecure-review on loopback)")
    app = create_app(guard)
    serve_together(app, create_admin(app, reviewers=reviewers, insecure_review=args.insecure_review), sockets)


if __name__ == "__main__":
    main()
