"""The review console: one self-contained HTML page (no build step, no external assets) over the review API.

It lists escalated items with their held body (what an approval releases, its decoded view, and what of it is not
shown), state and answers, and approves or rejects them by calling the review API routes it is mounted beside
(``guard.asgi.review_api``), relative to its own URL; an item whose body is not shown in full (or not at all: an HTTP
item held before items showed their body) is approved only once the reviewer ticks that they approve it unseen
(``accept_unseen_body``), and one whose listing carries a preview of its body only once the reviewer has loaded the
whole body (``GET /{id}``). The list is refreshed every 5 s, drawing only the items that are new or changed, so the
reviewer's tick, note and scroll position stay. Body and state text are untrusted: the page writes them with
``textContent`` only, never as HTML, and state text with its invisible and format characters (bidi controls,
zero-width characters) as ``\\u202e`` escapes, as the held body shows them.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

__all__ = ["CONSOLE_PATH", "console_route"]

CONSOLE_PATH = "/console"
_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def _page() -> str:
    return resources.files("guard.asgi").joinpath("console.html").read_text(encoding="utf-8")


def _security_headers(html: str) -> dict[str, str]:
    """The page's headers: a CSP that runs its one inline script by hash only (no other script, no frame around it,
    no form target, connections to its own origin), ``DENY`` framing for browsers without ``frame-ancestors``,
    ``nosniff``, ``no-referrer`` and ``no-store``."""
    (script,) = _SCRIPT.findall(html)
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    return {
        "content-security-policy": f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        "x-frame-options": "DENY",
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
        "cache-control": "no-store",
    }


def console_route() -> Route:
    """The ``GET /console`` route serving the page; include it before the ``/{review_id}`` routes."""
    html = _page()
    headers = _security_headers(html)

    async def console(request: Request) -> HTMLResponse:
        return HTMLResponse(html, headers=headers)

    return Route(CONSOLE_PATH, console, methods=["GET"])
