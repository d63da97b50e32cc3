"""Integrity seals for what guard keeps in a shared store (Redis): HMAC-SHA256 keyed by a secret the gateway holds;
and encryption (AES-256-GCM, :mod:`cryptography`) for what must not be readable there (a held request's headers and
body).

Anyone who can write to the store can change a value, but not make a seal for it without the key, so a forged or
edited entry is detected when read (a cache miss, a refused review item), never trusted; anyone who can read it
sees encrypted values as noise. The key comes from the ``GUARD_STORE_KEY`` environment variable (or is passed in);
every replica sharing a store needs the same key. The encryption key is derived from it (HMAC-SHA256 of a fixed
label), so one secret serves both.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["MIN_KEY_BYTES", "STORE_KEY_ENV", "Sealer"]

STORE_KEY_ENV = "GUARD_STORE_KEY"
MIN_KEY_BYTES = 16


class Sealer:
    """Makes and checks seals: ``HMAC-SHA256(key, len(context) || context || len(data) || data)``, hex.

    Args:
        key: the secret, at least :data:`MIN_KEY_BYTES` bytes (a ``str`` is UTF-8 encoded).
        source: what the error for a short key calls it (``$GUARD_STORE_KEY`` when it came from there).

    Raises:
        ValueError: a shorter key, or a ``str`` that is not text (bytes that are not UTF-8, as the environment hands
            them over).
    """

    def __init__(self, key: bytes | str, *, source: str = "the store key") -> None:
        try:
            raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
        except UnicodeEncodeError:
            raise ValueError(f"{source} is not UTF-8 text (raw random bytes?); use text, e.g. openssl rand -hex "
                             "32") from None
        if len(raw) < MIN_KEY_BYTES:
            raise ValueError(f"{source} has {len(raw)} bytes; at least {MIN_KEY_BYTES}")
        self._key = raw
        self._aead = AESGCM(hmac.new(raw, b"guard store encryption v1", hashlib.sha256).digest())

    def __repr__(self) -> str:
        return "Sealer(key=<hidden>)"

    @classmethod
    def resolve(cls, key: bytes | str | None, what: str, env: Mapping[str, str] | None = None) -> Sealer:
        """A sealer for ``key``, else for ``$GUARD_STORE_KEY``.

        Raises:
            ValueError: neither is set (naming ``what`` needs it), or the key is too short (naming ``$GUARD_STORE_KEY``
                when it came from there).
        """
        source = "the store key"
        if key is None:
            key, source = (os.environ if env is None else env).get(STORE_KEY_ENV), f"${STORE_KEY_ENV}"
        if not key:
            raise ValueError(f"{what} needs a store key to seal what it writes to Redis: set ${STORE_KEY_ENV} (the "
                             f"same secret on every replica, at least {MIN_KEY_BYTES} bytes, e.g. openssl rand -hex 32;"
                             " in Python, store_key=)")
        return cls(key, source=source)

    def seal(self, context: str, data: bytes) -> str:
        """The seal of ``data`` written under ``context`` (e.g. the Redis key), 64 hex digits."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (context.encode("utf-8", "surrogatepass"), data):
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.hexdigest()

    def check(self, context: str, data: bytes, seal: str | bytes) -> bool:
        """Whether ``seal`` is :meth:`seal` of ``data`` under ``context`` (constant-time comparison; a seal of any
        other form, non-ASCII included, is simply unequal)."""
        given = seal if isinstance(seal, bytes) else seal.encode("utf-8", "replace")
        return hmac.compare_digest(self.seal(context, data).encode("ascii"), given)

    def encrypt(self, context: str, data: bytes) -> str:
        """``data`` encrypted and authenticated for ``context`` (e.g. the Redis key): base64 of nonce + ciphertext."""
        nonce = secrets.token_bytes(12)
        return base64.b64encode(nonce + self._aead.encrypt(nonce, data, context.encode("utf-8", "surrogatepass"))).decode("ascii")

    def decrypt(self, context: str, text: str) -> bytes:
        """What :meth:`encrypt` encrypted for ``context``.

        Raises:
            ValueError: the text was not made by :meth:`encrypt` with this key for this context.
        """
        try:
            raw = base64.b64decode(text, validate=True)
            return self._aead.decrypt(raw[:12], raw[12:], context.encode("utf-8", "surrogatepass"))
        except (InvalidTag, ValueError) as exc:
            raise ValueError("the value does not decrypt with this store key") from exc
