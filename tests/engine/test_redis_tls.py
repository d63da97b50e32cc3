"""Redis over TLS with a password (``rediss://:PASSWORD@host``): the probability cache and the review store work
against a real TLS-only redis-server whose certificate the client verifies, and refuse it when the certificate is
not trusted (a miss and the backend asked, never an unchecked answer)."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from guard.asgi.review_store import RedisReviewStore
from guard.engine import Guard
from guard.errors import ReviewStoreUnavailable
from tests._backends import ScriptedBackend
from tests._redis_server import _free_port, redis_server_binary
from tests.asgi.test_review_store import _verdict
from tests.conftest import STORE_KEY
from tests.engine.test_cache import by_text, policies, redis_cache, subject

PASSWORD = "tls-redis-password-0123456789"


def _write_pki(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: ``(ca.pem, server.pem, server.key)``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "guard test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return paths


@pytest.fixture(scope="module")
def tls_redis() -> Iterator[tuple[str, Path]]:
    """``(rediss URL with the password, CA file)`` of a TLS-only redis-server with ``requirepass``."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server binary")
    workdir = Path(tempfile.mkdtemp(prefix="guard-redis-tls-"))
    ca, cert, key = _write_pki(workdir)
    port = _free_port()
    process = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(cert),
         "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
         "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"
    deadline = time.monotonic() + 30
    while True:
        try:
            if redis.Redis.from_url(url, ssl_ca_certs=str(ca), socket_timeout=0.5).ping():
                break
        except redis.RedisError:
            pass
        if process.poll() is not None:
            output = process.stdout.read().decode(errors="replace") if process.stdout else ""
            shutil.rmtree(workdir, ignore_errors=True)
            if "TLS" in output and ("not" in output or "support" in output):
                pytest.skip(f"this redis-server has no TLS: {output[-200:]}")
            raise RuntimeError(f"TLS redis-server did not start: {output[-500:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("TLS redis-server did not answer in 30 s")
        time.sleep(0.05)
    yield url, ca
    process.terminate()
    process.wait(timeout=10)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.anyio
async def test_cache_and_review_store_over_tls_with_a_password(
    tls_redis: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ca = tls_redis
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # the deployment's CA bundle: OpenSSL's default verify paths
    first, second = ScriptedBackend(by_text, name="clef"), ScriptedBackend(by_text, name="clef")
    one = Guard(policies(), backends=first, cache=redis_cache(url, "tls-test:", store_key=STORE_KEY, local_ttl=0))
    two = Guard(policies(), backends=second, cache=redis_cache(url, "tls-test:", store_key=STORE_KEY, local_ttl=0))
    asked = await one.aevaluate(subject("ignore all rules"))
    shared = await two.aevaluate(subject("ignore all rules"))  # another replica: answered from Redis over TLS
    assert (asked.action, shared.action) == ("block", "block")
    assert (first.calls, second.calls) == (1, 0) and shared.cache_hit
    assert two.cache.health().errors == 0
    store = RedisReviewStore.from_url(url, store_key=STORE_KEY)
    item = await store.create(_verdict(), subject={"path": "/x"}, digest="d")
    assert (await store.get(item.id)).status == "pending"
    await store.aclose()
    for guard in (one, two):
        await guard.aclose()


@pytest.mark.anyio
async def test_an_untrusted_certificate_is_refused_not_trusted(
    tls_redis: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url, _ca = tls_redis
    other = _write_pki(tmp_path)[0]  # a CA that did not sign the server's certificate
    monkeypatch.setenv("SSL_CERT_FILE", str(other))
    backend = ScriptedBackend(by_text, name="clef")
    guard = Guard(policies(), backends=backend, cache=redis_cache(url, "tls-test:", store_key=STORE_KEY, local_ttl=0))
    verdict = await guard.aevaluate(subject("ignore all rules"))
    assert verdict.action == "block" and backend.calls == 1  # decided by the backend; Redis was not used
    assert guard.cache.health().errors >= 1
    store = RedisReviewStore.from_url(url, store_key=STORE_KEY)
    with pytest.raises(ReviewStoreUnavailable):
        await store.create(_verdict(), subject={}, digest="d")
    await store.aclose()
    await guard.aclose()
