"""Secrets stay out of the decision log: through uvicorn on loopback, a request carrying ``?api_key=``,
``X-Auth-Token``, ``X-CSRF-Token`` and a body password is logged without them (also where the body's joined text and the
state repeat them) by default, with ordinary fields kept; ``none`` logs no input or state; ``full`` keeps all but the
credential headers; ``guard proxy --log-input`` reaches the log."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard.cli import build_parser
from guard.cli.cmd_proxy import build
from guard.engine import Guard
from guard.engine.telemetry import DecisionLog
from tests.asgi._apps import POLICY, client_for, guarded_app
from tests.asgi._servers import serve_in_thread

pytestmark = pytest.mark.anyio

GuardFactory = Callable[..., Guard]
SECRETS = ("sk-live-query-123", "tok-header-456", "csrf-789", "hunter2-password", "Bearer client-secret",
           "fn-key-0123456789abcdef", "eyJhbGciOiJIUzI1NiJ9.e30.c2ln", "AIzaQueryKey0123", "apim-query-0123",
           "fn-code-query-0123")


async def _logged(make_guard: GuardFactory, mode: str, **options: Any) -> dict[str, Any]:
    lines: list[str] = []
    guard = make_guard(decision_log=DecisionLog(lines.append, log_input=mode, **options))
    with serve_in_thread(guarded_app(guard)) as base:
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            response = await client.post(
                "/v1/echo?api_key=sk-live-query-123&lang=en&key=AIzaQueryKey0123&subscription-key=apim-query-0123"
                "&code=fn-code-query-0123",
                json={"user": {"name": "ada", "password": "hunter2-password"}, "message": "What is my balance?"},
                headers={"x-auth-token": "tok-header-456", "x-csrf-token": "csrf-789",
                         "authorization": "Bearer client-secret", "x-customer-tier": "premium",
                         "x-functions-key": "fn-key-0123456789abcdef",
                         "cf-access-jwt-assertion": "eyJhbGciOiJIUzI1NiJ9.e30.c2ln"},
            )
    assert response.status_code == 200
    (record,) = [json.loads(line) for line in lines]
    return record


async def test_redacted_by_default(make_guard: GuardFactory) -> None:
    record = await _logged(make_guard, "redacted")
    text = json.dumps(record)
    assert not [s for s in SECRETS if s in text]
    entry = record["input"]
    # a header is kept only when known to carry no credential: they travel under names of every kind
    assert entry["query"] == {"lang": ["en"]} and "x-customer-tier" not in entry["headers"]
    assert entry["headers"]["content-type"] == "application/json"
    assert entry["body"] == {"user": {"name": "ada"}, "message": "What is my balance?"}
    # Azure APIM's subscription-key and Azure Functions' code travel in the query as well as in headers
    assert {"/input/query/subscription-key", "/input/query/code"} <= set(record["erased"])
    assert {"/input/query/api_key", "/input/query/key", "/input/headers/x-auth-token", "/input/headers/x-csrf-token",
            "/input/headers/x-functions-key", "/input/headers/x-customer-tier",
            "/input/body/user/password"} <= set(record["erased"])
    # a name joining four words (cf-access-jwt-assertion) is not a plain identifier: written as a client's key is
    assert "/input/headers/[key]" in record["erased"]
    assert "[redacted]" in entry["body_text"] and "What is my balance?" in record["state"]["text"]


async def test_headers_an_audit_reads_can_be_kept(make_guard: GuardFactory) -> None:
    record = await _logged(make_guard, "redacted", logged_headers={"X-Customer-Tier", "content-type"})
    assert record["input"]["headers"] == {"x-customer-tier": "premium", "content-type": "application/json"}
    assert not [s for s in SECRETS if s in json.dumps(record)]


@pytest.mark.parametrize("mode", ["none", "redacted"])
async def test_refusal_messages_quoting_the_body_are_left_out_or_scrubbed(make_guard: GuardFactory,
                                                                          mode: str) -> None:
    """A refusal's message quotes what the client sent (a duplicate key, a JSON path, a charset): the client is
    answered with it, the log under ``none`` names the refusal by its rule only, under ``redacted`` scrubs it."""
    key = "sk-proj-abcdefghijklmnopqrstuvwxyz123456"
    lines: list[str] = []
    guard = make_guard(decision_log=DecisionLog(lines.append, log_input=mode))
    async with client_for(guarded_app(guard)) as client:
        for body, content_type, rule in [
            (f'{{"{key}": 1, "{key}": 2}}', "application/json", "invalid_json_duplicate_key"),
            (f'{{"{key}": "\\ud800"}}', "application/json", "invalid_json_lone_surrogate"),
            ('{"text": "hi"}', f"application/json; charset={key}", "unsupported_charset"),
        ]:
            response = await client.post("/v1/chat", content=body, headers={"content-type": content_type})
            assert response.json()["code"] == rule and key in response.json()["message"]
            record = json.loads(lines.pop())
            assert record["result"]["rule"] == rule and key not in json.dumps(record)
            assert (record["result"]["message"] is None) == (mode == "none")


async def test_none_and_full(make_guard: GuardFactory) -> None:
    none = await _logged(make_guard, "none")
    assert none["input"] is None and none["state"] is None and none["result"]["action"] == "allow"
    full = json.dumps(await _logged(make_guard, "full"))
    assert "hunter2-password" in full and "sk-live-query-123" in full and "Bearer client-secret" not in full
    with pytest.raises(ValueError, match="log_input"):
        DecisionLog(lambda line: None, log_input="some")


def test_guard_proxy_log_input_option(tmp_path: Path) -> None:
    argv = ["proxy", "--policy", str(POLICY), "--upstream", "http://127.0.0.1:9", "--backend", "http://127.0.0.1:9",
            "--decision-log", str(tmp_path / "d.jsonl")]
    for extra, mode in (([], "redacted"), (["--log-input", "none"], "none"), (["--log-input", "full"], "full")):
        runtime = build(build_parser().parse_args([*argv, *extra]))
        assert runtime.app.guard.decision_log.log_input == mode
        asyncio.run(runtime.aclose())
    runtime = build(build_parser().parse_args([*argv, "--log-header", "X-Customer-Tier"]))
    assert {"x-customer-tier", "user-agent"} <= runtime.app.guard.decision_log.logged_headers
    asyncio.run(runtime.aclose())


async def test_controls_in_a_path_cannot_start_a_log_line(make_guard: GuardFactory,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A path is logged quoted: NEL, U+2028 and an 8-bit escape decoded from it are written escaped."""
    from tests.asgi._apps import client_for

    with caplog.at_level("INFO", logger="guard.asgi"):
        async with client_for(guarded_app(make_guard())) as client:
            refused = await client.post("/v1/x%C2%85FORGED%E2%80%A8LINE%C2%9B31m", content=b"{bad json",
                                        headers={"content-type": "application/json"})
    assert refused.status_code == 400
    (line,) = [r.getMessage() for r in caplog.records if "before a decision" in r.getMessage()]
    assert line.isprintable() and "\\x85" in line and "\\u2028" in line


@pytest.mark.parametrize(
    ("target", "shown"),
    [
        ("/v1/x?api_key=S1&q=hi", "/v1/x?api_key=[redacted]&q=hi"),
        ("/v1/x?a=1;api_key=S2&b=2", "/v1/x?a=1;api_key=[redacted]&b=2"),  # ; separates parameters in some apps
        ("/v1/x?Api%5FKey=S3&key%5B%5D=S4&code=S5", "/v1/x?Api%5FKey=[redacted]&key%5B%5D=[redacted]&code=[redacted]"),
        ("/v1/x?q=a%3Bb&sort=asc", "/v1/x?q=a%3Bb&sort=asc"),  # values and names that are not secrets are kept
        # values shaped like a secret under any name: a key prefix, a URL's password, a bearer token, a JWT
        ("/cb?q=sk-proj-Abc123def456ghi789jkl&page=2", "/cb?q=[redacted]&page=2"),
        ("/cb?redirect=https%3A%2F%2Fbob%3Apa55w0rd%40x.example%2F&id=7", "/cb?redirect=[redacted]&id=7"),
        ("/cb?h=Bearer%20Zm9vYmFyYmF6cXV4MTIz&x=AKIAIOSFODNN7EXAMPLE", "/cb?h=[redacted]&x=[redacted]"),
        ("/cb?t=eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl&fields=id,created_at,total",
         "/cb?t=[redacted]&fields=id,created_at,total"),
        # ordinary values beside a credential-named one stay as sent, and so do the names
        ("/v1/orders?sort_key=created_at&fields=id,created_at,total&name=bob",
         "/v1/orders?sort_key=[redacted]&fields=id,created_at,total&name=bob"),
    ],
)
def test_the_access_log_shows_a_target_with_credential_values_masked(target: str, shown: str) -> None:
    """Values were masked by their parameter's name only: a token under ``q`` or ``redirect`` was logged as sent."""
    from guard.asgi.server import masked_target

    assert masked_target(target) == shown


def test_the_servers_show_guards_info_logs_unless_logging_is_configured(tmp_path: Path) -> None:
    """``guard proxy --log-level info`` never showed ``policies reloaded: ...`` (the ``guard`` loggers had no handler,
    and Python's last resort shows warnings only): the servers give them uvicorn's handler and format, at the
    level asked, unless the process configured logging itself."""
    import os
    import subprocess
    import sys

    policy = tmp_path / "p.yaml"
    policy.write_text(Path(POLICY).read_text())
    script = f"""
import logging, sys
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.ERROR)
from guard.asgi.server import show_guard_logs
from guard.policy import load_files
show_guard_logs(sys.argv[2])
load_files({str(policy)!r}).reload()
logging.getLogger("guard.engine.health").debug("a debug line")
"""
    root = Path(__file__).resolve().parents[2]

    def stderr_of(*args: str) -> str:
        done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(root)}, check=False)
        assert done.returncode == 0, done.stderr
        return done.stderr

    shown = stderr_of("plain", "info")
    assert "INFO:     guard.policy: policies reloaded: api_guard@3" in shown and "a debug line" not in shown
    assert "a debug line" in stderr_of("plain", "debug") and "a debug line" in stderr_of("plain", "trace")
    assert "policies reloaded" not in stderr_of("configured", "info")  # the process's own configuration stands


async def test_a_secret_named_field_in_the_json_a_streams_deltas_spell_is_redacted() -> None:
    """A streamed answer whose deltas join into ``{"api_key": "..."}`` kept the key's value in the record's
    ``body_text`` and state (review finding): the same document in a ``text/plain`` answer was redacted. Both are now."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from guard.asgi import GuardMiddleware
    from guard.policy import load_text
    from tests._backends import ScriptedBackend
    from tests.asgi._apps import client_for

    secret = "SEKRETSTREAM-9f8e7d6c"
    document = json.dumps({"api_key": secret, "note": "kept"})

    async def streamed(request: Any) -> StreamingResponse:
        async def events() -> Any:
            for at in range(0, len(document), 5):
                yield f"data: {json.dumps({'choices': [{'delta': {'content': document[at:at + 5]}}]})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def plain(request: Any) -> Response:
        return Response(document, media_type="text/plain")

    policy = load_text("""
policies:
  - id: answers
    version: 1
    match: {http: {paths: ["/v1/**"], response: {status: [200]}}}
    state: {text: body_text}
    questions:
      leak: {type: noul, instructions: "Does the text leak?"}
    rules:
      - {id: leak, when: leak.noul >= 0.99, action: block}
""")
    lines: list[str] = []
    guard = Guard(policy, backends=ScriptedBackend(), decision_log=DecisionLog(lines.append))
    app = Starlette(routes=[Route("/v1/stream", streamed, methods=["POST"]), Route("/v1/plain", plain, methods=["POST"])],
                    middleware=[Middleware(GuardMiddleware, guard=guard)])
    async with client_for(app) as client:
        for path in ("/v1/stream", "/v1/plain"):
            assert (await client.post(path, json={"q": "json please"})).status_code == 200
    await guard.aclose()
    records = [json.loads(line) for line in lines]
    assert [r["input"]["phase"] for r in records] == ["response", "response"]
    for record in records:
        assert secret not in json.dumps(record), record["input"]["body_text"]
        assert '{"api_key": "[redacted]", "note": "kept"}' in record["state"]["text"]
