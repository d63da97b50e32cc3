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
])  # fmt: skip
def test_shown_url_has_no_credentials(url: str, shown: str) -> None:
    assert shown_url(url) == shown
