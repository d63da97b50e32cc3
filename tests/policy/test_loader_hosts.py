"""``match.http.hosts``: a glob the middleware's host can never match (a port, a trailing dot) is a load error."""

from __future__ import annotations

import pytest

from guard.errors import PolicyError
from guard.policy import load_text

POLICY = """\
policies:
  - id: p
    version: 1
    match:
      http:
        hosts: [api.example.com, {glob}]
    rules:
      - {{id: r, when: 'true', action: block}}
"""


@pytest.mark.parametrize(
    ("glob", "reason"),
    [
        ('"admin.example.com:8443"', "host glob 'admin.example.com:8443' holds a port"),
        ('"*.example.com:*"', "holds a port"),
        ('"[::1]:8080"', "holds a port"),
        ("admin.example.com.", "ends in a dot; hosts are matched without the trailing dot of a fully qualified name"),
    ],
)
def test_a_host_glob_that_can_never_match_is_refused(glob: str, reason: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_text(POLICY.format(glob=glob), "p.yaml")
    assert (caught.value.file, caught.value.line, caught.value.key) == ("p.yaml", 6, "policies[0].match.http.hosts[1]")
    assert reason in caught.value.reason


@pytest.mark.parametrize("glob", ["'*.example.com'", "'[::1]'", "'::1'", "'10.0.0.1'", "'API.example.com'"])
def test_host_globs_without_port_load(glob: str) -> None:
    assert load_text(POLICY.format(glob=glob), "p.yaml")[0].http is not None
