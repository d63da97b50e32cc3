"""``guard worker serve``: the decision worker (System One over HTTP, micro-batched Clef) under uvicorn.

Usage::

    guard worker serve --model DIR [--host H --port P | --uds PATH] [--device cpu|cuda|cuda:N]
                       [--dtype auto|float32|bfloat16] [--max-batch N] [--max-batch-tokens T] [--max-wait-ms M]
                       [--max-queue Q] [--max-length-ratio R] [--max-length L] [--confidence reference|workers-ai|jev]
                       [--profile workers-ai|reference] [--max-body-bytes B] [--max-pending-body-bytes P]
                       [--body-idle-timeout S] [--default-timeout-ms D]
                       [--overload-status 429|503] [--model-name NAME]
                       [--model-alias NAME]... [--release-date YYYY-MM-DD] [--torch-threads N] [--log-level LEVEL]
                       [--access-log] [--api-keys-env VAR | --insecure-no-auth] [--max-image-pixels N]
                       [--canary-margin M] [--canary-directional] [--canary-interval S] [--canary-timeout S]
                       [--header-timeout S]

The socket opens at once (``/healthz`` answers while the weights load); ``/readyz`` turns 200 after the model loaded
and the startup self-test passed (well-formed answers, and the canaries' benign and attack states answered apart by
``--canary-margin``; re-run every ``--canary-interval`` seconds, each run within ``--canary-timeout`` seconds,
unready while they fail).

Authentication: ``--api-keys-env VAR`` names an environment variable holding comma-separated bearer keys (16+
characters each) that ``/v1/*`` requires. Without keys the worker refuses to listen on a non-loopback TCP address
unless ``--insecure-no-auth`` is given (loopback and ``--uds`` need no keys). SIGTERM/SIGINT stop accepting connections, finish the requests already queued,
then exit. A connection that has not sent a whole request head within ``--header-timeout`` seconds (10) of opening, or
of its previous response plus the keep-alive time, is answered 408 and closed (:mod:`guard.asgi.server`). Invalid
options exit 2 with one line naming the option.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Any

from guard.asgi.server import DEFAULT_HEADER_TIMEOUT_S
from guard.backends.options import add_device_options, device, torch_dtype
from guard.cli._args import (
    flag_names,
    milliseconds,
    name,
    positive_int,
    positive_milliseconds,
    positive_seconds,
    ratio,
    seconds,
)

__all__ = ["register", "run"]

EXIT_INVALID = 2
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DEFAULT_PORT = 8000
#: Bytes of an AF_UNIX socket path (sun_path, its terminating NUL included): 108 on Linux, 104 on macOS and the BSDs.
UDS_PATH_MAX = 108 if sys.platform.startswith("linux") else 104


def register(subparsers: Any) -> None:
    """Add ``worker serve``."""
    from guard.backends.batcher import (
        DEFAULT_MAX_BATCH,
        DEFAULT_MAX_BATCH_TOKENS,
        DEFAULT_MAX_LENGTH_RATIO,
        DEFAULT_MAX_QUEUE,
        DEFAULT_MAX_WAIT_MS,
    )

    worker = subparsers.add_parser("worker", help="the decision worker (System One over HTTP, batched)")
    commands = worker.add_subparsers(dest="worker_command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a Clef checkpoint on POST /v1/systemone",
        description="Serve a Clef checkpoint: POST /v1/systemone, GET /v1/models, /healthz, /readyz, /metrics.",
    )
    serve.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (release layout)")
    where = serve.add_argument_group("listening (TCP or a Unix socket)")
    where.add_argument("--host", default=None, help="TCP host (default 127.0.0.1)")
    where.add_argument("--port", type=int, default=None, help=f"TCP port (default {DEFAULT_PORT})")
    where.add_argument("--uds", default=None, metavar="PATH", help="listen on this Unix socket instead of TCP")
    model = serve.add_argument_group("model")
    add_device_options(model)
    model.add_argument(
        "--max-length", type=positive_int, default=None, metavar="L", help="prompt limit (default 16384)"
    )
    model.add_argument(
        "--confidence", choices=("reference", "workers-ai", "jev"), default="reference", help="confidence formula"
    )
    model.add_argument(
        "--model-name", type=name, default=None, help="name listed by GET /v1/models (default: directory name)"
    )
    model.add_argument(
        "--model-alias", type=name, action="append", default=[], metavar="NAME",
        help="another accepted model name (repeatable)",
    )
    model.add_argument(
        "--release-date", default=None, metavar="YYYY-MM-DD", help="release date listed (default: the weights' date)"
    )
    model.add_argument(
        "--torch-threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch intra-op threads (default: torch's choice)",
    )
    batching = serve.add_argument_group("batching")
    batching.add_argument(
        "--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH, metavar="N", help="requests per pass"
    )
    batching.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        metavar="T",
        help="padded tokens per pass",
    )
    batching.add_argument(
        "--max-wait-ms",
        type=milliseconds,
        default=DEFAULT_MAX_WAIT_MS,
        metavar="M",
        help="longest wait to fill a batch",
    )
    batching.add_argument(
        "--max-queue", type=positive_int, default=DEFAULT_MAX_QUEUE, metavar="Q", help="waiting requests before 429"
    )
    batching.add_argument(
        "--max-length-ratio",
        type=ratio,
        default=DEFAULT_MAX_LENGTH_RATIO,
        metavar="R",
        help="longest/shortest record in one batch (1 or more; inf: no limit)",
    )
    http = serve.add_argument_group("http")
    http.add_argument("--profile", choices=("workers-ai", "reference"), default="workers-ai", help="validation rules")
    http.add_argument(
        "--max-body-bytes", type=positive_int, default=None, metavar="B", help="largest request body (8 MiB)"
    )
    http.add_argument(
        "--max-pending-body-bytes",
        type=positive_int,
        default=None,
        metavar="P",
        help="bytes of request bodies held in memory at once, counted as they arrive, with their images' pixel "
        "tensors (136 MiB: a body at the default cap and four images of 1,024 tokens, with room); at it, new "
        "requests get 429",
    )
    http.add_argument(
        "--body-idle-timeout",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="seconds a request body may send nothing before a 408 (10)",
    )
    http.add_argument(
        "--default-timeout-ms",
        type=positive_milliseconds,
        default=None,
        metavar="D",
        help="deadline without x-request-timeout-ms, in milliseconds (30000; at most 300000)",
    )
    http.add_argument("--overload-status", type=int, choices=(429, 503), default=429, help="status of a full queue")
    http.add_argument("--log-level", choices=_LOG_LEVELS, default="info", help="uvicorn log level")
    http.add_argument("--access-log", action="store_true", help="log every request (off by default)")
    http.add_argument("--header-timeout", type=positive_seconds, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                      help="seconds a client has to send a request head (line and headers) before the connection is "
                      f"closed (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    http.add_argument(
        "--max-image-pixels",
        type=positive_int,
        default=None,
        metavar="N",
        help="largest image, width x height (4096x4096)",
    )
    auth = serve.add_argument_group("authentication")
    auth.add_argument(
        "--api-keys-env", default=None, metavar="VAR", help="environment variable with comma-separated bearer keys"
    )
    auth.add_argument(
        "--insecure-no-auth", action="store_true", help="allow a non-loopback address without API keys"
    )
    canary = serve.add_argument_group("canary self-test")
    canary.add_argument(
        "--canary-margin",
        type=float,
        default=None,
        metavar="M",
        help="spread the benign and attack canaries must show (default 0.0001: the answers depend on the state)",
    )
    canary.add_argument(
        "--canary-directional", action="store_true", help="the attack must score higher (use with a release model)"
    )
    canary.add_argument(
        "--canary-interval",
        type=seconds,
        default=None,
        metavar="S",
        help="seconds between canary runs (60; 0: start only)",
    )
    canary.add_argument(
        "--canary-timeout",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="seconds one periodic canary run may take (10); a hung model is seen within 2-3 x (interval + timeout)",
    )
    serve.set_defaults(handler=run)


def _fail(message: str) -> int:
    print(f"guard worker serve: {message}", file=sys.stderr)
    return EXIT_INVALID


#: The config fields the options set, as the flags that set them: a config's ``ValueError`` names its field
#: (``WorkerConfig.max_pending_body_bytes``), the user typed the flag. Each option's own range is checked by its
#: argparse type; what is left are the checks across options and those only the config knows (a release date).
_FLAGS = {
    "BatcherConfig.max_batch": "--max-batch",
    "BatcherConfig.max_batch_tokens": "--max-batch-tokens",
    "BatcherConfig.max_wait_ms": "--max-wait-ms",
    "BatcherConfig.max_queue": "--max-queue",
    "BatcherConfig.max_length_ratio": "--max-length-ratio",
    "WorkerConfig.validation_profile": "--profile",
    "WorkerConfig.overload_status": "--overload-status",
    "WorkerConfig.model_aliases": "--model-alias",
    "WorkerConfig.release_date": "--release-date",
    "WorkerConfig.max_body_bytes": "--max-body-bytes",
    "WorkerConfig.max_pending_body_bytes": "--max-pending-body-bytes",
    "WorkerConfig.body_idle_timeout_s": "--body-idle-timeout",
    "WorkerConfig.max_image_pixels": "--max-image-pixels",
    "WorkerConfig.canary_interval_s": "--canary-interval",
    "WorkerConfig.canary_timeout_s": "--canary-timeout",
}


def _configs(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(BatcherConfig, WorkerConfig)`` from the options.

    Raises:
        ValueError: naming the bad option (as its flag), its value and what is allowed.
    """
    from guard.backends.batcher import BatcherConfig
    from guard.worker.app import MAX_TIMEOUT_S, WorkerConfig

    options: dict[str, Any] = {
        "validation_profile": args.profile,
        "overload_status": args.overload_status,
        "model_name": args.model_name,
        "model_aliases": tuple(args.model_alias),
        "release_date": args.release_date,
    }
    if args.max_body_bytes is not None:
        options["max_body_bytes"] = args.max_body_bytes
    if args.max_pending_body_bytes is not None:
        options["max_pending_body_bytes"] = args.max_pending_body_bytes
    if args.body_idle_timeout is not None:
        options["body_idle_timeout_s"] = args.body_idle_timeout
    if args.max_image_pixels is not None:
        options["max_image_pixels"] = args.max_image_pixels
    if args.canary_interval is not None:
        options["canary_interval_s"] = args.canary_interval
    if args.canary_timeout is not None:
        options["canary_timeout_s"] = args.canary_timeout
    options["api_keys"] = _api_keys(args)
    if args.default_timeout_ms is not None:
        if args.default_timeout_ms > MAX_TIMEOUT_S * 1000:
            raise ValueError(
                f"--default-timeout-ms must be at most {MAX_TIMEOUT_S * 1000:g} (the longest deadline a request may "
                f"ask for), got {args.default_timeout_ms:g}"
            )
        options["default_timeout_s"] = args.default_timeout_ms / 1000.0
    try:
        batcher = BatcherConfig(
            max_batch=args.max_batch,
            max_batch_tokens=args.max_batch_tokens,
            max_wait_ms=args.max_wait_ms,
            max_queue=args.max_queue,
            max_length_ratio=args.max_length_ratio,
        )
        return batcher, WorkerConfig(**options)
    except ValueError as exc:  # the config names its field; the user typed the flag
        raise ValueError(flag_names(str(exc), _FLAGS)) from None


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys in ``$VAR`` of ``--api-keys-env`` (none without it); raises ``ValueError`` naming the variable."""
    if args.api_keys_env is None:
        return ()
    raw = os.environ.get(args.api_keys_env, "")
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if not keys:
        raise ValueError(f"--api-keys-env {args.api_keys_env}: the variable is unset or holds no keys")
    short = [i for i, k in enumerate(keys) if len(k) < 16]
    if short:
        raise ValueError(f"--api-keys-env {args.api_keys_env}: key {short[0] + 1} is shorter than 16 characters")
    return keys


def _uds_problem(path: str) -> str | None:
    """Why ``path`` cannot become this worker's socket (``None`` when it can): the server replaces whatever is at the
    path and removes it on exit, so anything but a socket nobody listens on is refused, never deleted; a path of
    :data:`UDS_PATH_MAX` bytes or more cannot be bound."""
    if (size := len(os.fsencode(path))) >= UDS_PATH_MAX:
        return f"is {size} bytes long; a socket path must be shorter than {UDS_PATH_MAX} bytes (choose a shorter one)"
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be checked: {exc.strerror or exc}"
    if not stat.S_ISSOCK(info.st_mode):
        return "exists and is not a socket; the worker would replace it (choose another path)"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return None  # a socket left by a server that is gone: replaced
        except OSError as exc:  # a busy server (its backlog full) or one that does not answer: not taken over
            return f"another server may be listening on it ({exc.strerror or type(exc).__name__})"
    return "another server is listening on it"


def _owner_and_group_only(path: str) -> None:
    """Leave a socket file of mode 0660 at ``path``: uvicorn gives the socket it creates there the mode of the file it
    replaces, else 0666 (any local user could ask a worker without keys). ``path`` holds nothing, or a socket nobody
    listens on (:func:`_uds_problem`)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as placeholder:
        placeholder.bind(path)
    os.chmod(path, 0o660)


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    """Handler: serves until SIGTERM/SIGINT (exit 0); 2 for invalid options."""
    if args.uds and (args.host or args.port):
        return _fail("--uds cannot be combined with --host/--port")
    if args.port is not None and not 0 <= args.port <= 65535:
        return _fail(f"--port must be 0-65535, got {args.port}")
    from guard.clef.model import check_checkpoint

    try:  # before listening: a damaged checkpoint exits 2, not a worker that never becomes ready
        check_checkpoint(args.model)
    except (OSError, ValueError) as exc:
        return _fail(f"--model: {exc}")
    if args.uds:
        folder = Path(args.uds).parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            return _fail(f"--uds {args.uds}: folder {folder} does not exist or is not writable; create it first")
        if (problem := _uds_problem(args.uds)) is not None:
            return _fail(f"--uds {args.uds}: {problem}")
    try:
        torch_dtype(args)  # before listening: a --device this machine has not exits 2, not an unready worker
    except ValueError as exc:
        return _fail(str(exc))
    if args.canary_margin is not None and not 0 < args.canary_margin <= 1:
        return _fail(f"--canary-margin must be in (0, 1], got {args.canary_margin}")
    try:
        batcher_config, worker_config = _configs(args)
    except ValueError as exc:
        return _fail(str(exc))
    host = args.host or "127.0.0.1"
    if not args.uds and not worker_config.api_keys and not _loopback(host) and not args.insecure_no_auth:
        return _fail(
            f"--host {host} is not a loopback address and no API keys are set; pass --api-keys-env VAR "
            "(or --insecure-no-auth to serve without authentication)"
        )

    import uvicorn

    from guard.asgi.server import bind_socket, filter_server_logs, server_options, show_guard_logs
    from guard.worker.app import create_app

    def load() -> Any:
        import torch

        from guard.backends.local import LocalBackend
        from guard.backends.selftest import CLEF_CANARY_MARGIN, clef_canaries

        margin = CLEF_CANARY_MARGIN if args.canary_margin is None else args.canary_margin
        if args.torch_threads is not None:
            torch.set_num_threads(args.torch_threads)
        return LocalBackend.from_pretrained(
            args.model,
            dtype=torch_dtype(args),
            device=device(args),
            batcher_config=batcher_config,
            confidence_profile=args.confidence,
            max_length=args.max_length,
            canaries=clef_canaries(margin=margin, directional=args.canary_directional),
        )

    from guard.cli._otel import install_tracing_from_env, shutdown_providers
    from guard.engine.telemetry import metric_readers_from_env
    from guard.worker.metrics import WorkerMetrics

    try:
        install_tracing_from_env()
        readers, _ = metric_readers_from_env(os.environ)  # /metrics always serves the Prometheus text
    except ValueError as exc:
        shutdown_providers()
        return _fail(str(exc))
    port = DEFAULT_PORT if args.port is None else args.port
    try:  # before the weights load (at startup): a port in use is one line and exit 2, not a load then uvicorn's exit 3
        sockets = None if args.uds else [bind_socket(host, port)]
    except OSError as exc:
        shutdown_providers()
        return _fail(str(exc))
    try:  # after the bind: a meter provider, once made, sends its last OTLP export when it is shut down
        metrics = WorkerMetrics(extra_readers=readers)  # the SDK reads OTEL_METRICS_EXEMPLAR_FILTER here
    except ValueError as exc:
        for sock in sockets or ():
            sock.close()
        shutdown_providers()
        return _fail(str(exc))
    if args.uds:  # after every check: a usage error leaves no socket file behind
        _owner_and_group_only(args.uds)
    app = create_app(load, config=worker_config, metrics=metrics)
    where: dict[str, Any] = {"uds": args.uds} if args.uds else {}  # a Unix socket uvicorn binds itself
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level=args.log_level, access_log=args.access_log,
                                           **server_options(args.header_timeout), **where))
    filter_server_logs()  # after the config, which sets up uvicorn's loggers
    show_guard_logs(args.log_level)
    if sockets:  # uvicorn names only the sockets it binds
        shown = f"[{host}]" if ":" in host else host
        logging.getLogger("uvicorn.error").info("listening on http://%s:%d", shown, sockets[0].getsockname()[1])
    try:
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises a SIGINT again once its shutdown is done
            server.run(sockets=sockets)
    finally:
        if args.uds:  # as uvicorn.run does
            with contextlib.suppress(FileNotFoundError):
                os.remove(args.uds)
    shutdown_providers()  # after Ctrl-C the SDK's exit hooks would wait for a collector that never answers
    return 0
