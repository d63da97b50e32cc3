"""The example API: a small FastAPI service with three JSON endpoints, guarded in-process or left bare for a proxy.

Run it bare (for ``guard proxy`` to front it)::

    python examples/api/app.py --port 9000

Run it with the guard inside the process (the quickstart's policy asks only catalog questions, which the embedded
compact model answers; ``policies/api_abuse.yaml`` needs Clef: ``--backend local:DIR`` or ``http://WORKER``)::

    python examples/api/app.py --port 8080 --policy guard/quickstart/policies.yaml

The guarded app serves the reviewers' API at ``/admin/reviews`` only with credentials: ``$GUARD_REVIEW_TOKENS`` holds
``name:token,name:token`` (one token per reviewer, at least 16 characters each). Without it, ``--insecure-review``
serves the API to loopback clients only (and only with a loopback ``--host``); with neither, the API is not mounted.
The app starts (warms up) the guard's backends at startup. A backend that cannot answer the policy, or a bad option,
stops it with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from guard import Guard, MemoryReviewStore, ReviewStore
from guard.asgi import GuardMiddleware, review_app
from guard.asgi.review_api import is_loopback, parse_reviewer_tokens
from guard.backends import start_backend


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
               reviewers: Mapping[str, str] | None = None, insecure_review: bool = False) -> FastAPI:
    """The example service; with ``guard`` it is wrapped in :class:`GuardMiddleware` and its lifespan starts the
    guard's backends (a ``LocalBackend`` warms up before the first request). The review API is mounted with
    ``reviewers`` (name -> token), or for loopback clients only with ``insecure_review``; otherwise not at all."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if guard is not None:
            for backend in guard.backends.values():
                await start_backend(backend)
        yield

    app = FastAPI(title="guard example API", lifespan=lifespan)

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
        store = review_store or MemoryReviewStore()
        if reviewers is not None or insecure_review:
            app.mount("/admin/reviews", review_app(store, reviewers=reviewers, insecure_loopback=insecure_review))
        app.add_middleware(GuardMiddleware, guard=guard, review_store=store)
    return app


def main() -> None:
    import uvicorn

    from guard.backends.options import add_backend_options, open_cli_backend
    from guard.errors import GuardError

    parser = argparse.ArgumentParser(description="The guard example API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--policy", help="guard the app in-process with this policy file")
    parser.add_argument("--insecure-review", action="store_true",
                        help="without $GUARD_REVIEW_TOKENS, serve the review API to loopback clients (loopback --host)")
    add_backend_options(parser, default="compact")
    args = parser.parse_args()
    try:
        tokens = os.environ.get("GUARD_REVIEW_TOKENS")
        reviewers = parse_reviewer_tokens(tokens) if tokens else None
        if args.insecure_review and (reviewers is not None or not is_loopback(args.host)):
            raise ValueError("--insecure-review needs a loopback --host and no $GUARD_REVIEW_TOKENS")
        guard = Guard.from_files(args.policy, backends=open_cli_backend(args)) if args.policy else None
    except (GuardError, OSError, ValueError) as exc:  # PolicyError is a GuardError
        raise SystemExit(f"app.py: {exc}") from None
    if guard is not None and reviewers is None and not args.insecure_review:
        print("app.py: the review API is not served (set GUARD_REVIEW_TOKENS, or --insecure-review on loopback)")
    app = create_app(guard, reviewers=reviewers, insecure_review=args.insecure_review)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
