"""guard in front of HTTP APIs: the ASGI middleware, the reviewers' API and the reverse proxy.

Key components:

* :class:`GuardMiddleware`: pure ASGI; judges matched requests, replays allowed bodies byte for byte.
* :class:`BodyLimits`: caps on received and decoded bytes, JSON depth, forms and multipart.
* :func:`review_routes` / :func:`review_app`: list, read, approve and reject escalated requests; :class:`Reviewer`: a
  reviewer's token, optionally scoped to tenants.
* :func:`proxy_app`: a reverse proxy (Starlette + httpx streaming) with the middleware in front.

Typical use::

    from guard.asgi import GuardMiddleware
    app = Starlette(routes=routes, middleware=[Middleware(GuardMiddleware, guard=guard)])
"""

from __future__ import annotations

from guard.asgi._metrics import HttpMetrics
from guard.asgi.limits import BodyLimits
from guard.asgi.middleware import DEFAULT_REVIEW_PATH, GuardMiddleware
from guard.asgi.review_api import Reviewer, review_app, review_routes

__all__ = [
    "DEFAULT_REVIEW_PATH",
    "BodyLimits",
    "GuardMiddleware",
    "HttpMetrics",
    "Reviewer",
    "review_app",
    "review_routes",
]
