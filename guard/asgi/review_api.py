"""The reviewers' API: list, read, approve and reject review items (JSON over HTTP, mountable Starlette routes).

Mount it where only reviewers can reach it (behind your own authentication, or with ``token=``)::

    app = Starlette(routes=[Mount("/admin/reviews", app=review_app(store, token=os.environ["GUARD_REVIEW_TOKEN"]))])

=======  ===========================  =============================================================================
GET      ``/``                        items with ``?status=pending`` (default; ``approved``, ``rejected``,
                                      ``released``, ``all``) and ``?limit=`` (1-1000, default 100), oldest first
GET      ``/{id}``                    one item with its state and answers (never the held body)
POST     ``/{id}/approve``            pending -> approved; JSON body ``{"by": ..., "note": ...}`` (optional)
POST     ``/{id}/reject``             pending -> rejected; same body
GET      ``/console``                 the review console page (``guard.asgi.console``)
=======  ===========================  =============================================================================

Errors are ``{code, message, field}``: 404 ``review_not_found``, 409 ``review_conflict`` (with the item's
``status``), 503 ``review_unavailable``, 400 ``invalid_parameter``, 401 ``unauthorized``. Releasing an approved
item is the client's step (``guard/asgi/_reviews.py``) or the agent's (``guard.asgi.review_store.ReviewStore.release``).
"""

from __future__ import annotations

import secrets
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard._json import loads
from guard.asgi.console import console_route
from guard.asgi.review_store import STATUSES, ReviewStore
from guard.errors import InvalidJson, ReviewConflict, ReviewError, ReviewNotFound

__all__ = ["MAX_LIST_LIMIT", "review_app", "review_routes"]

MAX_LIST_LIMIT = 1000
_MAX_DECISION_BODY = 16 * 1024
_MAX_TEXT = 1000


def _error(http_status: int, code: str, message: str, field: str | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"code": code, "message": message, "field": field, **extra}, status_code=http_status)


def _review_error(exc: ReviewError) -> JSONResponse:
    if isinstance(exc, ReviewNotFound):
        return _error(404, "review_not_found", str(exc), "id")
    if isinstance(exc, ReviewConflict):
        return _error(409, "review_conflict", str(exc), "status", status=exc.status)
    return _error(503, "review_unavailable", str(exc))


class _Api:
    def __init__(self, store: ReviewStore, token: str | None) -> None:
        self.store = store
        self.token = token

    def _denied(self, request: Request) -> JSONResponse | None:
        if self.token is None:
            return None
        given = request.headers.get("authorization", "")
        if given.startswith("Bearer ") and secrets.compare_digest(given[7:].encode(), self.token.encode()):
            return None
        return _error(401, "unauthorized", "send 'Authorization: Bearer <review token>'", "authorization")

    async def list(self, request: Request) -> JSONResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        status = request.query_params.get("status", "pending")
        if status not in (*STATUSES, "all"):
            return _error(400, "invalid_parameter", f"status {status[:40]!r} is not one of {[*STATUSES, 'all']}",
                          "status")
        raw_limit = request.query_params.get("limit", "100")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIST_LIMIT:
            return _error(400, "invalid_parameter", f"limit {raw_limit[:40]!r} must be an integer from 1 to "
                          f"{MAX_LIST_LIMIT}", "limit")
        try:
            items = await self.store.list_items(None if status == "all" else status,  # type: ignore[arg-type]
                                                limit=int(raw_limit))
        except ReviewError as exc:
            return _review_error(exc)
        return JSONResponse({"items": [item.to_json() for item in items], "count": len(items)})

    async def get(self, request: Request) -> JSONResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            item = await self.store.get(request.path_params["review_id"])
        except ReviewError as exc:
            return _review_error(exc)
        return JSONResponse(item.to_json())

    async def _decision(self, request: Request) -> dict[str, str | None] | JSONResponse:
        body = await request.body()
        if len(body) > _MAX_DECISION_BODY:
            return _error(413, "body_too_large", f"the decision body is {len(body)} bytes; at most "
                          f"{_MAX_DECISION_BODY}", "body")
        if not body.strip():
            return {"by": None, "note": None}
        try:
            data = loads(body)
        except InvalidJson as exc:
            return _error(400, "invalid_json", str(exc), "body")
        if not isinstance(data, dict) or set(data) - {"by", "note"}:
            return _error(400, "invalid_parameter", "the body must be an object with optional 'by' and 'note'",
                          "body")
        out: dict[str, str | None] = {}
        for key in ("by", "note"):
            value = data.get(key)
            if value is not None and (not isinstance(value, str) or len(value) > _MAX_TEXT):
                return _error(400, "invalid_parameter", f"{key} must be a string of at most {_MAX_TEXT} characters",
                              key)
            out[key] = value
        return out

    async def approve(self, request: Request) -> JSONResponse:
        return await self._decide(request, approve=True)

    async def reject(self, request: Request) -> JSONResponse:
        return await self._decide(request, approve=False)

    async def _decide(self, request: Request, *, approve: bool) -> JSONResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        decision = await self._decision(request)
        if isinstance(decision, JSONResponse):
            return decision
        review_id = request.path_params["review_id"]
        change = self.store.approve if approve else self.store.reject
        try:
            item = await change(review_id, by=decision["by"], note=decision["note"])
        except ReviewError as exc:
            return _review_error(exc)
        return JSONResponse(item.to_json())


def review_routes(store: ReviewStore, *, token: str | None = None) -> list[Route]:
    """The reviewers' routes (see the module docstring), to include in your own app or ``Mount``.

    Args:
        store: the review store the middleware writes to.
        token: when given, every call must send ``Authorization: Bearer <token>`` (401 otherwise).
    """
    api = _Api(store, token)
    return [
        console_route(),  # GET /console: the page; before /{review_id}
        Route("/", api.list, methods=["GET"]),
        Route("/{review_id}", api.get, methods=["GET"]),
        Route("/{review_id}/approve", api.approve, methods=["POST"]),
        Route("/{review_id}/reject", api.reject, methods=["POST"]),
    ]


def review_app(store: ReviewStore, *, token: str | None = None) -> Starlette:
    """A small Starlette app serving :func:`review_routes`, ready to ``Mount``."""
    return Starlette(routes=review_routes(store, token=token))
