"""``guard proxy``'s options: a bad one exits 2 with a message naming the flag the user typed, never a config field
(``BodyLimits.max_body_bytes``) or a variable's bare parse error."""

from __future__ import annotations

import pytest

from guard.cli import main
from guard.quickstart import policy_path

PROXY = ["proxy", "--policy", str(policy_path()), "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0",
         "--admin-listen", "127.0.0.1:0"]  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-body-bytes", "0", "'0' is not a whole number of 1 or more"),
        ("--body-timeout", "0", "'0' is not a number of seconds above 0"),
        ("--body-timeout", "inf", "'inf' is not a number of seconds above 0"),
        ("--header-timeout", "0", "'0' is not a number of seconds above 0"),
        ("--connect-timeout", "-1", "'-1' is not a number of seconds above 0"),
        ("--read-timeout", "nan", "'nan' is not a number of seconds above 0"),
        ("--cache-local-ttl", "-1", "'-1' is not a number of seconds (0 or more)"),
        ("--stream-flush", "-1", "'-1' is not a number of seconds (0 or more)"),
        ("--stream-hold", "-1", "'-1' is not a whole number of 0 or more"),
        ("--connect-timeout", "soon", "invalid positive_seconds value: 'soon'"),
    ],
)
def test_a_number_out_of_its_range_is_a_usage_error_naming_the_flag(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """New-user trial: --max-body-bytes 0 and --body-timeout 0 named BodyLimits.max_body_bytes and
    BodyLimits.body_timeout_s, --cache-local-ttl -1 CacheConfig.local_ttl, and --connect-timeout -1 listed four
    fields, none a flag."""
    with pytest.raises(SystemExit) as info:
        main([*PROXY, flag, value])
    last = capsys.readouterr().err.splitlines()[-1]
    assert info.value.code == 2
    assert last == f"guard proxy: error: argument {flag}: {message}", last


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--max-head-bytes", "100"], "--max-head-bytes is 100; it must be at least 1024"),
        (["--allowed-hosts", "api.example.com:443"], "--allowed-hosts: host glob 'api.example.com:443' holds a port"),
        (["--upstream", "ftp://x"], "--upstream 'ftp://x' must be an http(s) URL without query or fragment"),
        # was accepted, the credentials never sent, and the start-up line printed the password
        (["--upstream", "http://app:s3cret@127.0.0.1:9000"], "--upstream holds a user name or password"),
        # the checks before it quoted these, password and all
        (["--upstream", "http://app:s3cret@127.0.0.1:9000/?x=1"], "--upstream holds a user name or password"),
        (["--upstream", "http://app:s3cret/x@127.0.0.1:9000"], "--upstream holds a user name or password"),
        (["--upstream", "app:s3cret@127.0.0.1:9000"], "--upstream '[hidden]' must be an http(s) URL"),
        (["--backend", "http://"], ("--backend 'http://': url must be an http:// or https:// URL with a host, got "
                                   "'http://'")),
        (["--backend", "http:ftp://host"], "--backend 'http:ftp://host': url must be an http:// or https:// URL"),
    ],
)  # fmt: skip
def test_what_only_the_config_checks_is_named_by_the_flag(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--backend http:// said "url must be ..." without naming --backend; the config's own checks named its fields."""
    assert main([*PROXY, *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"guard proxy: {message}") and err.count("\n") == 1, err
    assert "s3cret" not in err


def test_the_start_up_line_names_the_backend_without_its_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attack finding: ``--backend http://user:password@worker`` (httpx sends it as Basic auth) was printed whole on
    the start-up line, into every log that keeps the proxy's stderr; so was a malformed one in its error."""
    from guard.asgi import server

    monkeypatch.setattr(server, "serve_together", lambda *args, **kwargs: None)
    assert main([*PROXY, "--backend", "http://worker:s3cret@127.0.0.1:9"]) == 0
    err = capsys.readouterr().err
    assert "backend: http://127.0.0.1:9)" in err and "s3cret" not in err, err
    assert main([*PROXY, "--backend", "http://worker:s3cret@127.0.0.1:99999"]) == 2
    err = capsys.readouterr().err
    assert "its port is not a number" in err and "s3cret" not in err, err


def test_an_unknown_otel_propagator_is_one_line_and_exit_2() -> None:
    """OpenTelemetry reads ``OTEL_PROPAGATORS`` when ``opentelemetry.propagate`` is first imported and raises for a
    name it cannot load: every command (``guard policy check`` too) died with a traceback while its parser was
    built."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    environ = {**os.environ, "OTEL_PROPAGATORS": "tracecontext,b3multi-typo",
               "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "guard", "policy", "--help"], env=environ, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("guard: OTEL_PROPAGATORS: ") and "b3multi-typo" in done.stderr
