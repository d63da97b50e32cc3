"""URLs as logs show them: no credentials."""

from __future__ import annotations

import pytest

from guard._urls import shown_url


@pytest.mark.parametrize(("url", "shown"), [
    ("http://svc:pw@127.0.0.1:9/v1?key=k#f", "http://127.0.0.1:9/v1"),
    ("https://token@[::1]:8443/v1", "https://[::1]:8443/v1"),
    ("http://a:b@c@llm.internal/v1/", "http://llm.internal/v1/"),
    ("http://llm.internal/v1", "http://llm.internal/v1"),
    ("http://[::1/v1", "[unparsable URL]"),
    # a password with '/', '#', '?' or '@' not percent-encoded: none of it is shown
    ("redis://:p@ss/w#rd@redis:6379/0", "redis://redis:6379/0"),
    ("redis://:ab/cd@redis:6379/0", "redis://redis:6379/0"),
    ("redis://default:389/x?y#z@redis/0", "redis://redis/0"),
    ("redis://:ab[cd@redis:6379/0", "redis://redis:6379/0"),
    # an '@' in the path of a URL whose authority holds no password is the path's
    ("https://api.cloudflare.com/client/v4/accounts/a/ai/run/@cf/cloudflare/m",
     "https://api.cloudflare.com/client/v4/accounts/a/ai/run/@cf/cloudflare/m"),
])  # fmt: skip
def test_shown_url_has_no_credentials(url: str, shown: str) -> None:
    assert shown_url(url) == shown
