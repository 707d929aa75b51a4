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
After AUTH every frame both ways is tagged under keys derived from the secret and both
nonces (channel.py).

One HELLO gets anyone the coordinator's proof, against which guesses of the secret can be
tested offline at millions a second: a password a person chose falls to a word list in
moments. So a secret must have at least MIN_SECRET characters; `deggs secret` makes one
of 256 random bits.
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
MIN_SECRET = 32  # characters; `deggs secret` prints 64 hex digits


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
    where = f"the secret in {SECRET_FILE_ENV}={path}" if path is not None else f"{SECRET_ENV}"
    return check_secret(value.encode("utf-8"), where)


def new_secret() -> str:
    """A fresh secret of 256 random bits, as 64 hex digits."""
    return secrets.token_hex(32)


def check_secret(secret: bytes, where: str = "the shared secret") -> bytes:
    """The secret itself, or SecretError when it is too short to resist offline guessing."""
    if len(secret) < MIN_SECRET:
        raise SecretError(
            f"{where} has {len(secret)} characters; at least {MIN_SECRET} are needed, as one "
            "HELLO lets anyone test guesses of it offline: make one with "
            f"`deggs secret > ~/.deggs-secret` and set {SECRET_FILE_ENV}=~/.deggs-secret"
        )
    return secret


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
