"""``--backend`` / ``--device`` / ``--dtype``, defined once (``guard/backends/options.py``) for every command that opens a
backend, and ``open_backend``'s specs (a bare ``http(s)://`` URL is the HTTP backend)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard.backends import SystemOneClient, open_backend, start_backend
from guard.backends.local import LocalBackend
from guard.backends.options import backend_factory, describe_backend, open_cli_backend, torch_dtype
from guard.cli import build_parser, main
from guard.cli.cmd_proxy import build
from guard.quickstart import policy_path
from tests.asgi._servers import serve_in_thread

POLICY = policy_path()


def _commands(tmp_path: Path) -> dict[str, list[str]]:
    """Every command that opens a backend from a spec, with its required arguments."""
    data = tmp_path / "data.jsonl"
    subject = tmp_path / "subject.json"
    return {
        "proxy": ["proxy", "--policy", POLICY, "--upstream", "http://127.0.0.1:9"],
        "quickstart": ["quickstart"],
        "policy explain": ["policy", "explain", POLICY, "--input", str(subject)],
        "policy test": ["policy", "test", POLICY],
        "eval": ["eval", str(data)],
    }


@pytest.mark.parametrize("command", ["proxy", "quickstart", "policy explain", "policy test", "eval"])
@pytest.mark.parametrize(
    ("options", "device", "dtype"),
    [
        ([], "cpu", torch.float32),  # auto on CPU is float32, not the reference's bfloat16
        (["--dtype", "auto"], "cpu", torch.float32),
        (["--dtype", "bfloat16"], "cpu", torch.bfloat16),
        (["--device", "cpu", "--dtype", "float32"], "cpu", torch.float32),
    ],
)
def test_every_backend_command_takes_device_and_dtype(
    command: str, options: list[str], device: str, dtype: torch.dtype, tmp_path: Path, golden_checkpoint: Path
) -> None:
    argv = [*_commands(tmp_path)[command], "--backend", f"local:{golden_checkpoint}", *options]
    args = build_parser().parse_args(argv)
    assert (args.device or "cpu", torch_dtype(args)) == (device, dtype)


def test_a_local_backend_opens_on_the_device_in_the_dtype_asked(golden_checkpoint: Path, tmp_path: Path) -> None:
    argv = [*_commands(tmp_path)["policy explain"], "--backend", f"local:{golden_checkpoint}"]
    backend = open_cli_backend(build_parser().parse_args(argv))
    assert isinstance(backend, LocalBackend)
    assert (backend.model.dtype, backend.model.device.type) == (torch.float32, "cpu")
    assert describe_backend(backend).endswith(", float32 on cpu)")
    backend = open_cli_backend(build_parser().parse_args([*argv, "--dtype", "bfloat16"]))
    assert isinstance(backend, LocalBackend) and backend.model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("compact", ["--device", "cuda"], "--device applies only to a local: backend, not --backend compact"),
        ("compact", ["--dtype", "float32"], "--dtype applies only to a local: backend"),
        ("http://127.0.0.1:9", ["--device", "cpu", "--dtype", "bfloat16"], "--device and --dtype apply only to a "),
        ("local:/nowhere", ["--device", "gpu"], "--device 'gpu': expected cpu, cuda or cuda:N"),
        ("local:/nowhere", ["--device", "cuda:one"], "--device 'cuda:one': expected cpu, cuda or cuda:N"),
        # torch devices guard does not run on: refused before loading, as the message says
        *(("local:/nowhere", ["--device", kind], f"--device '{kind}': expected cpu, cuda or cuda:N")
          for kind in ("mps", "meta", "xpu", "mps:0")),
    ],
)
def test_device_options_are_checked_not_ignored(spec: str, options: list[str], message: str, tmp_path: Path) -> None:
    args = build_parser().parse_args([*_commands(tmp_path)["proxy"], "--backend", spec, *options])
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        open_cli_backend(args)


@pytest.mark.parametrize("command", ["policy explain", "policy test"])
def test_device_options_without_a_backend_are_refused(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """These commands have no default backend: --device and --dtype without --backend were silently ignored."""
    (tmp_path / "subject.json").write_text('{"http": {"method": "POST", "path": "/v1/chat", "body": {"m": "hi"}}}')
    assert main([*_commands(tmp_path)[command], "--device", "cuda"]) == 2
    message = "--device applies only to a local: backend, and no --backend is given\n"
    assert capsys.readouterr().err == f"guard {command}: {message}"


def test_cuda_without_a_cuda_build_is_refused_before_loading(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this torch build has CUDA")
    args = build_parser().parse_args([*_commands(tmp_path)["quickstart"], "--backend", "local:/x", "--device", "cuda"])
    with pytest.raises(ValueError, match="--device cuda: this torch build has no CUDA device"):
        open_cli_backend(args)
    assert main([*_commands(tmp_path)["quickstart"], "--backend", "local:/x", "--device", "cuda:0"]) == 2  # as proxy


@pytest.mark.parametrize("url", ["redis+sentinel://:hunter2@127.0.0.1:26379/mymaster", "127.0.0.1:6379",
                                 "redis://127.0.0.1:6379/9?socket_timeout=fast"])
def test_the_proxy_refuses_a_redis_url_the_cache_cannot_use_before_loading_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """Such a ``--redis-url`` started the proxy, and every decision then fell to the policy's fail mode; with
    ``?decode_responses=true`` startup died with a bare traceback (exit 3). Now exit 2 naming the option, before the
    model (here a checkpoint that does not exist) is loaded."""
    argv = [*_commands(tmp_path)["proxy"], "--backend", f"local:{tmp_path / 'missing'}", "--redis-url", url]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("guard proxy: --redis-url: cache URL ") and "cannot be used" in error
    assert "hunter2" not in error


@pytest.mark.parametrize("password", ["hunter2/x#y", "hunter2#y", "hun/ter2?q@z", "1234/hunter2"])
@pytest.mark.parametrize(("variable", "names"), [
    ("GUARD_REDIS_URL", "$GUARD_REDIS_URL (the default of --redis-url)"),
    ("GUARD_REVIEW_REDIS_URL", "$GUARD_REVIEW_REDIS_URL (the default of --review-redis-url)"),
])  # fmt: skip
def test_a_redis_password_not_percent_encoded_is_refused_without_showing_any_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, password: str,
    variable: str, names: str,
) -> None:
    """A password holding '/', '?' or '#' ends the host early: ``redis://:hunter2/x#y@redis:6379/0`` was named as
    ``'redis://:hunter2/x'`` (its netloc ``:hunter2`` has no '@' to strip) or redis-py's error quoted the password as a
    port. Now exit 2 naming the variable the URL came from, the URL as ``redis://[hidden]`` and percent-encoding."""
    monkeypatch.setenv(variable, f"redis://:{password}@redis:6379/0")
    argv = [*_commands(tmp_path)["proxy"], "--backend", f"local:{tmp_path / 'missing'}"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"guard proxy: {names}: ") and "'redis://[hidden]'" in error, error
    assert "percent-encode" in error and "hunter2" not in error and "1234" not in error, error


def test_the_proxy_refuses_a_review_redis_url_whose_database_is_not_a_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--review-redis-url`` went to redis-py unchecked: ``/nine`` put the review queue in database 0, beside
    whatever else lives there. It is checked as the cache's is: exit 2 naming the option, before the model loads."""
    argv = [*_commands(tmp_path)["proxy"], "--backend", f"local:{tmp_path / 'missing'}",
            "--review-redis-url", "redis://:hunter2@127.0.0.1:6379/nine"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("guard proxy: --review-redis-url: review store URL ") and "'nine'" in error, error
    assert "hunter2" not in error


@pytest.mark.parametrize(
    ("spec", "url"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1/systemone"),
        ("https://decide.example/", "https://decide.example/v1/systemone"),
        ("http://worker:8000/custom/path", "http://worker:8000/custom/path"),
        ("http:http://127.0.0.1:8000", "http://127.0.0.1:8000/v1/systemone"),
        ("http:https://decide.example", "https://decide.example/v1/systemone"),
    ],
)
def test_a_bare_url_is_the_http_backend(spec: str, url: str) -> None:
    backend = open_backend(spec)
    assert isinstance(backend, SystemOneClient) and backend.url == url


def test_a_unix_spec_is_a_worker_on_that_socket() -> None:
    backend = open_backend("unix:/run/guard/worker.sock")
    assert isinstance(backend, SystemOneClient) and backend.provider.name == "worker"
    assert backend.model_revision == "worker:http://127.0.0.1:8000/v1/systemone@/run/guard/worker.sock"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("http://", "^--backend 'http://': url must be an http:// or https:// URL with a host, got 'http://'$"),
        ("https:", r"--backend 'https:': expected compact"),
        ("ftp://host", r"--backend 'ftp://host': expected compact, compact:DIR, local:CHECKPOINT_DIR, http:URL"),
        ("http:ftp://host", ("^--backend 'http:ftp://host': url must be an http:// or https:// URL with a host, got "
                            "'ftp://host'$")),
        ("http://127.0.0.1:99999", "its port is not a number from 0 to 65535"),  # was an OverflowError per request
        ("http:http://127.0.0.1:-1", "^--backend 'http:http://\\[hidden\\]': url 'http://\\[hidden\\]': its port"),
        ("local:", "expected compact"),
        ("unix:", "expected compact.*or unix:SOCKET"),
        ("clef", "expected compact"),
    ],
)
def test_unusable_specs_are_one_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_backend(spec)


@pytest.mark.parametrize(
    "spec", ["https://svc:hunter2/v1", "http:https://svc:hunter2/v1", "https://u:x@h:hunter2/v1",
             "https://svc:[hunter2]/v1", "https://svc:hunter2\uff03@h/v1", "http:ftp://svc:hunter2@h/v1"],
)
def test_a_refused_backend_url_is_named_without_its_password(spec: str) -> None:
    """A password whose '@' and host were left out is read as the port (or an IP literal, in brackets): the URL was
    quoted whole, twice, and urlsplit's own error quoted the password again."""
    with pytest.raises(ValueError, match="^--backend ") as info:
        open_backend(spec)
    assert "hunter2" not in str(info.value)


def test_the_policy_test_factory_loads_a_checkpoint_once(golden_checkpoint: Path, tmp_path: Path) -> None:
    argv = [*_commands(tmp_path)["policy test"], "--backend", f"local:{golden_checkpoint}"]
    make = backend_factory(build_parser().parse_args(argv))
    first, second, third = make(), make(), make()
    assert all(isinstance(b, LocalBackend) for b in (first, second, third))
    assert first is not second is not third
    assert first.model is second.model is third.model  # type: ignore[attr-defined]
    http = backend_factory(build_parser().parse_args([*argv[:-1], "http://127.0.0.1:9"]))
    one, two = http(), http()
    assert isinstance(one, SystemOneClient) and isinstance(two, SystemOneClient) and one is not two


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


@pytest.mark.anyio
async def test_the_proxy_warms_a_local_backend_up_at_startup(golden_checkpoint: Path, tmp_path: Path) -> None:
    upstream = Starlette(routes=[Route("/v1/messages", _echo, methods=["POST"])])
    policy = tmp_path / "policies.yaml"  # the quickstart's, with room for a loaded machine (2 s -> 60 s)
    policy.write_text(Path(POLICY).read_text(encoding="utf-8").replace("timeout_ms: 2000", "timeout_ms: 60000"))
    with serve_in_thread(upstream) as url:
        argv = ["proxy", "--policy", str(policy), "--upstream", url, "--listen", f"127.0.0.1:{_free_port()}",
                "--backend", f"local:{golden_checkpoint}", "--dtype", "float32", "--decision-headers", "full"]  # fmt: skip
        runtime = build(build_parser().parse_args(argv))
        backend = runtime.app.guard.backends["default"]
        assert isinstance(backend, LocalBackend) and backend.batcher.stats.batches == 0
        with serve_in_thread(runtime.app, lifespan="on") as proxy:
            warmed = backend.batcher.stats.batches  # startup finished before the server accepted requests
            async with httpx.AsyncClient(base_url=proxy, timeout=60) as client:
                response = await client.post("/v1/messages", json={"message": "hello"})
    # the self-test's request, its canaries' two states each and its image canary, then the health monitor's first
    # canary run
    assert warmed == 1 + 2 * 2 * len(backend.canaries) + 1 and backend.model.dtype == torch.float32
    assert response.headers["x-guard-policy"].startswith("api-abuse-embedded@")
    assert "x-guard-fail-mode" not in response.headers


@pytest.mark.anyio
async def test_start_backend_starts_what_has_a_start_and_leaves_the_rest(golden_checkpoint: Path) -> None:
    local = LocalBackend.from_pretrained(golden_checkpoint, dtype=torch.float32)
    await start_backend(local)
    assert local.batcher.stats.batches == 1 + 2 * len(local.canaries) + 1  # the self-test request, the canaries, the image canary
    await local.aclose()
    client = open_backend("http://127.0.0.1:9")
    await start_backend(client)  # nothing to start: no request is sent
    await client.aclose()


def test_parse_args_keeps_none_for_unset_device_options(tmp_path: Path) -> None:
    args = build_parser().parse_args(_commands(tmp_path)["proxy"])
    assert isinstance(args, argparse.Namespace) and (args.backend, args.device, args.dtype) == ("compact", None, None)
