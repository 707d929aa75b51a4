"""The shared secret that admits workers, and the HMAC proofs of the HELLO handshake.

The secret comes from the environment, never from the command line (where `ps` shows it
to every user of the machine): DEGGS_SECRET holds it, or DEGGS_SECRET_FILE names a file
holding it. With a secret the handshake is

    worker -> HELLO(..., nonce_w)
    coord  -> CHALLENGE(nonce_c, proof("coordinator", nonce_w, nonce_c))
    worker -> AUTH(proof("worker", nonce_w, nonce_c))
    coord  -> HELLO_REPLY(fingerprint, config)

Each side proves the secret over both fresh nonces, so a recorded handshake replays to
nothing, and the role in the MAC keeps a coordinator's proof from passing as a worker's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from .protocol import NONCE_SIZE

SECRET_ENV = "DEGGS_SECRET"
SECRET_FILE_ENV = "DEGGS_SECRET_FILE"


class SecretError(ValueError):
    """The secret's environment variables cannot be used; the message says why."""


def load_secret(environ=os.environ) -> bytes | None:
    """The shared secret from DEGGS_SECRET or the file DEGGS_SECRET_FILE, or None."""
    value, path = environ.get(SECRET_ENV), environ.get(SECRET_FILE_ENV)
    if value is not None and path is not None:
        raise SecretError(f"set {SECRET_ENV} or {SECRET_FILE_ENV}, not both")
    if path is not None:
        try:
            value = Path(path).read_text(encoding="utf-8").strip("\r\n")
        except (OSError, UnicodeDecodeError) as e:
            raise SecretError(f"{SECRET_FILE_ENV}={path}: cannot read the secret: {e}") from None
    if value is None:
        return None
    if not value:
        raise SecretError(f"the secret in {SECRET_FILE_ENV if path else SECRET_ENV} is empty")
    return value.encode("utf-8")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def proof(secret: bytes, role: str, worker_nonce: bytes, coordinator_nonce: bytes) -> bytes:
    """HMAC-SHA256 of the role ('worker' or 'coordinator') and both nonces."""
    message = b"deggs handshake 2\0" + role.encode() + b"\0" + worker_nonce + coordinator_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def verify(
    secret: bytes, role: str, worker_nonce: bytes, coordinator_nonce: bytes, claimed: bytes
) -> bool:
    return hmac.compare_digest(proof(secret, role, worker_nonce, coordinator_nonce), claimed)
