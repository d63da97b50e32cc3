"""The ASGI root path: which part of a scope's ``path`` is the prefix an application is served under, and which part
it routes on (the worker's key check and the middleware's review endpoints read the path as routing does).

``scope["root_path"]`` is the prefix (uvicorn ``--root-path``, a Starlette ``Mount``). Starlette routes on what
follows it in ``scope["path"]`` when the path is the root path or continues below it at a ``/``, and on the whole path
otherwise (``get_route_path``): ``/apix/v1`` is not below ``/api``.
"""

from __future__ import annotations

from starlette.types import Scope

__all__ = ["root_prefix", "route_path"]


def _below(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or continues below it at a ``/`` (``False`` for an empty ``root``)."""
    return bool(root) and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/")


def root_prefix(scope: Scope) -> str:
    """The part of ``scope["path"]`` that is its ``root_path``, without a trailing slash: ``"/api"`` for
    ``/api/v1/chat`` under uvicorn ``--root-path /api`` (or ``/api/``) or inside ``Mount("/api", ...)``; ``""`` when
    there is no root path or the path is neither it nor below it."""
    root: str = scope.get("root_path", "").rstrip("/")
    return root if _below(scope["path"], root) else ""


def route_path(scope: Scope) -> str:
    """The path the application routes on, as Starlette's ``get_route_path`` reads it: ``scope["path"]`` without its
    ``root_path`` when it is that or below it (``"/v1/chat"`` for ``/api/v1/chat`` under ``/api``; ``""`` for ``/api``
    itself), else the whole path (``"/v1"`` under ``/api``)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if _below(path, root) else path
