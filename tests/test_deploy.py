"""Deployment files: Kubernetes manifests validate against the bundled API schemas (strict), the compose file and
Dockerfiles refer to files that exist, and every guard command line they run parses with guard's own CLI parser.

No Docker engine or cluster runs here; docs/operations.md says what was and was not run.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from guard.cli import build_parser

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
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    assert entry, f"{path.name} has no exec-form ENTRYPOINT"
    args = yaml.safe_load(entry.group(1))
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    return list(args) + (list(yaml.safe_load(cmd.group(1))) if cmd else [])


@pytest.mark.parametrize("path", sorted((DEPLOY / "docker").glob("*.Dockerfile")), ids=lambda p: p.name)
def test_dockerfiles_copy_existing_paths_and_run_valid_commands(path: Path) -> None:
    for line in path.read_text().splitlines():
        if line.startswith("COPY "):
            for source in shlex.split(line)[1:-1]:
                assert (ROOT / source).exists(), f"{path.name}: COPY source {source} does not exist"
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
