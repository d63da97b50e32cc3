"""The example API: a small FastAPI service with three JSON endpoints, guarded in-process or left bare for a proxy.

Run it bare (for ``guard proxy`` to front it)::

    python examples/api/app.py --port 9000

Run it with the guard inside the process::

    python examples/api/app.py --port 8080 --policy policies/api_abuse.yaml --backend compact

The guarded app also serves the reviewers' API at ``/admin/reviews`` (token from ``$GUARD_REVIEW_TOKEN``, if set).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from guard.asgi import GuardMiddleware, review_app
from guard.engine import Guard
from guard.review import MemoryReviewStore, ReviewStore


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
               review_token: str | None = None) -> FastAPI:
    """The example service; with ``guard`` it is wrapped in :class:`GuardMiddleware` and serves the review API."""
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
        store = review_store or MemoryReviewStore()
        app.mount("/admin/reviews", review_app(store, token=review_token))
        app.add_middleware(GuardMiddleware, guard=guard, review_store=store)
    return app


def main() -> None:
    import uvicorn

    from guard.backends import open_backend

    parser = argparse.ArgumentParser(description="The guard example API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--policy", help="guard the app in-process with this policy file")
    parser.add_argument("--backend", default="compact", help="compact, local:CHECKPOINT_DIR or http:URL")
    args = parser.parse_args()
    guard = Guard.from_files(args.policy, backends=open_backend(args.backend)) if args.policy else None
    app = create_app(guard, review_token=os.environ.get("GUARD_REVIEW_TOKEN"))
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
