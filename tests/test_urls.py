"""URLs as logs show them: no credentials."""

from __future__ import annotations

import pytest

from guard._urls import shown_url
from guard.engine.cache import redis_options


@pytest.mark.parametrize(("url", "shown"), [
    ("http://svc:pw@127.0.0.1:9/v1?key=k#f", "http://127.0.0.1:9/v1"),
    ("https://token@[::1]:8443/v1", "https://[::1]:8443/v1"),
    ("http://a:b@c@llm.internal/v1/", "http://llm.internal/v1/"),
    ("http://llm.internal/v1", "http://llm.internal/v1"),
    ("http://[::1/v1", "[unparsable URL]"),
    # a password with '/', '#', '?' or '@' not percent-encoded: where it ends is unclear, so nothing is shown
    ("redis://:p@ss/w#rd@redis:6379/0", "redis://[hidden]"),
    ("redis://:ab/cd@redis:6379/0", "redis://[hidden]"),
    ("redis://default:389/x?y#z@redis/0", "redis://[hidden]"),
    ("https://user/pass@llm.internal/v1", "https://[hidden]"),
    ("redis://:ab[cd@redis:6379/0", "redis://redis:6379/0"),
    # a password whose '@' and host were left out is read as the port: a port that is not a number is not shown
    ("redis://default:hunter2", "redis://[hidden]"),
    ("https://svc:hunter2/v1", "https://[hidden]"),
    ("redis://default:123456", "redis://[hidden]"),  # a password of digits past the last port
    ("redis://default:00000000000000000000123456/0", "redis://[hidden]"),
    ("redis://redis:0006379/0", "redis://redis:0006379/0"),
    # an '@' that starts a path segment, or in a query's value, is the URL's own (the query is not shown)
    ("https://api.cloudflare.com/client/v4/accounts/a/ai/run/@cf/cloudflare/m",
     "https://api.cloudflare.com/client/v4/accounts/a/ai/run/@cf/cloudflare/m"),
    ("https://llm.internal:8443/v1?api_key=hunter2@x", "https://llm.internal:8443/v1"),
    # no scheme before '://' (left out or mistyped): no userinfo to drop, so nothing is shown when it has an '@'
    ("app:hunter2@redis:6379/0", "[hidden]"),
    ("//app:hunter2@redis:6379/0", "[hidden]"),
    ("redis:/app:hunter2@redis:6379/0", "[hidden]"),
    ("app:hunter2@redis://x/0", "[hidden]"),
    ("llm.internal:8443/v1", "llm.internal:8443/v1"),
])  # fmt: skip
def test_shown_url_has_no_credentials(url: str, shown: str) -> None:
    assert shown_url(url) == shown


@pytest.mark.parametrize(("url", "accepted", "shown"), [
    ("redis://[::1]:6379/2?password=p@ss", True, "redis://[::1]:6379/2"),
    ("unix:///tmp/redis.sock?password=p@ss&db=2", True, "unix:/tmp/redis.sock"),
    ("unix:///run/redis@6/redis.sock?db=2", True, "unix:/run/redis@6/redis.sock"),
    ("unix://:s3cr%40t@/run/redis.sock?db=2", True, "unix:/run/redis.sock"),
    ("redis://127.0.0.1:6379/2?client_name=guard@web1", True, "redis://127.0.0.1:6379/2"),
    ("redis://:p@ss@127.0.0.1:6379/2", True, "redis://127.0.0.1:6379/2"),
    ("redis://:pa:ss@[::1]:6379/2", True, "redis://[::1]:6379/2"),
    ("redis://user:hunter2@127.0.0.1:6379/2#frag@x", False, "redis://[hidden]"),
    ("redis://user/pass@127.0.0.1:6379/2", False, "redis://[hidden]"),
    ("redis://user:pa/ss@127.0.0.1:6379/2", False, "redis://[hidden]"),
    ("redis://user:pa#ss@[::1]:6379/2", False, "redis://[hidden]"),
    ("rediss://user:p?ss@[fe80::1%25eth0]:6380/0", False, "rediss://[hidden]"),
    ("redis://:pw/x@h1:6379,h2:6379/0", False, "redis://[hidden]"),
    ("unix://user:p/ss@/run/redis.sock?db=2", False, "unix://[hidden]"),
])  # fmt: skip
def test_a_redis_url_with_an_at_after_its_host_is_refused_only_when_a_password_may_hold_it(
    url: str, accepted: bool, shown: str
) -> None:
    """An '@' anywhere after the host refused the URL (a query value, a socket path, a fragment) and the error showed
    the URL from its last '@' on: the end of a password in the query (``redis://ss``), or a password verbatim. An '@'
    the URL holds as its own is accepted; one that may end a password whose '/', '?' or '#' is not percent-encoded is
    refused, and the URL shown without anything after its scheme."""
    assert shown_url(url) == shown
    if accepted:
        redis_options(url)
        return
    with pytest.raises(ValueError, match="percent-encode") as info:
        redis_options(url)
    assert str(info.value).startswith(f"cache URL {shown!r} cannot be used: where its host starts is unclear, ")


@pytest.mark.parametrize(
    "url", ["redis://default:hunter2", "rediss://:hunter2/0", "redis://u:hunter2@h:99999/0", "redis://u:123456/0"]
)
def test_a_redis_url_whose_port_is_not_a_number_is_refused_without_showing_it(url: str) -> None:
    """A password whose '@' and host were left out (``redis://user:password``) is read as the port, and the error
    quoted it twice: in the URL shown and in redis-py's "Port could not be cast to integer value as 'hunter2'"."""
    with pytest.raises(ValueError, match="its port is not a number") as info:
        redis_options(url)
    assert "hunter2" not in str(info.value) and "123456" not in str(info.value)
