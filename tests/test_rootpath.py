"""The root path of an ASGI scope: what the application routes on is read one way, Starlette's, by the middleware's
review endpoints and the worker's key check alike."""

from __future__ import annotations

import pytest
from starlette._utils import get_route_path

from guard._rootpath import root_prefix, route_path

SCOPES = [  # (root_path, path)
    ("", "/v1/chat"), ("/api", "/api/v1/chat"), ("/api", "/api"), ("/api", "/api/"), ("/api", "/apix/v1"),
    ("/api", "/v1"), ("/api/", "/api//v1/chat"), ("/api/", "/api/v1/chat"), ("/api/", "/api/"), ("/", "/v1"),
    ("/a/b", "/a/b/c"), ("/a/b", "/a/bc"),
]


@pytest.mark.parametrize(("root", "path"), SCOPES)
def test_route_path_is_what_starlette_routes_on(root: str, path: str) -> None:
    scope = {"type": "http", "path": path, "root_path": root}
    assert route_path(scope) == get_route_path(scope)


def test_root_prefix_is_the_root_path_that_starts_the_path_without_a_trailing_slash() -> None:
    assert [root_prefix({"path": path, "root_path": root}) for root, path in SCOPES] == [
        "", "/api", "/api", "/api", "", "", "/api", "/api", "/api", "", "/a/b", ""]
    assert root_prefix({"path": "/v1"}) == ""
