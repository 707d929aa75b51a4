"""Authenticated frames: after the shared secret's handshake, every frame carries a tag.

The handshake (auth.py) proves who connected; the tags prove that every frame after it
came from them, unchanged, in order and once. Both sides derive two keys from the secret
and both nonces (HKDF-SHA256, one key per direction, so a frame cannot be reflected back
to its sender) and append a 16-byte tag to every frame's payload:

    tag = BLAKE2s-128(key of the direction, sequence u64 || opcode u8 || payload)

The sequence counts the frames sent that way on the connection from 0 and is never sent;
the header's length covers the tag. A frame that was changed, replayed, reordered,
dropped before another, or spliced in from another connection (other nonces, other keys)
fails its tag, and the connection is closed. Every opcode gets this at the framing layer:
the coordinator's Peer seals what it writes and opens what it reads, the worker likewise.

Keyed BLAKE2s is a MAC by design (RFC 7693, as in WireGuard) and costs CPython a third of
HMAC-SHA256 on frames this small (0.3 against 1.4 us a tag), which keeps the coordinator within
10% of its throughput without a secret. Nothing is encrypted: anyone on the path can read
the traffic, but not change it.

Without a secret nothing here runs and the bytes on the wire are the reference's.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from .protocol import HEADER_SIZE, OPCODE_NAMES, ProtocolError

TAG_SIZE = 16
_SEQ_OPCODE = struct.Struct(">QB")


def channel_keys(
    secret: bytes, worker_nonce: bytes, coordinator_nonce: bytes
) -> tuple[bytes, bytes]:
    """(worker -> coordinator key, coordinator -> worker key): HKDF-SHA256 with the
    nonces as salt, so every connection has keys of its own."""
    prk = hmac.digest(b"deggs frames 1\0" + worker_nonce + coordinator_nonce, secret, "sha256")
    return (
        hmac.digest(prk, b"worker to coordinator\x01", "sha256"),
        hmac.digest(prk, b"coordinator to worker\x01", "sha256"),
    )


class Channel:
    """One side's sealing and opening of a connection's frames, with both sequences."""

    def __init__(self, send_key: bytes, receive_key: bytes):
        # Keyed once; a frame's MAC starts from a copy (half the cost of keying anew).
        self._send = hashlib.blake2s(key=send_key, digest_size=TAG_SIZE)
        self._receive = hashlib.blake2s(key=receive_key, digest_size=TAG_SIZE)
        self.sent = 0  # frames sealed so far: the next one's sequence
        self.received = 0

    @classmethod
    def for_worker(cls, secret: bytes, worker_nonce: bytes, coordinator_nonce: bytes) -> Channel:
        up, down = channel_keys(secret, worker_nonce, coordinator_nonce)
        return cls(up, down)

    @classmethod
    def for_coordinator(
        cls, secret: bytes, worker_nonce: bytes, coordinator_nonce: bytes
    ) -> Channel:
        up, down = channel_keys(secret, worker_nonce, coordinator_nonce)
        return cls(down, up)

    def seal(self, data: bytes) -> bytes:
        """Encoded frames (one or several back to back, all ours), each with its tag."""
        out: list[bytes] = []
        pos = 0
        while pos < len(data):
            opcode = data[pos + 5]
            length = int.from_bytes(data[pos + 6 : pos + HEADER_SIZE], "big")
            start = pos + HEADER_SIZE
            payload = data[start : start + length]
            mac = self._send.copy()
            mac.update(_SEQ_OPCODE.pack(self.sent, opcode))
            mac.update(payload)
            out += (
                data[pos : pos + 6],  # magic, version, opcode
                (length + TAG_SIZE).to_bytes(4, "big"),
                payload,
                mac.digest(),
            )
            self.sent += 1
            pos = start + length
        return b"".join(out)

    def open(self, opcode: int, payload: bytes) -> bytes:
        """The payload of a received frame without its tag; ProtocolError when the tag
        does not match (the sequence then stays, and the connection must end)."""
        body = payload[:-TAG_SIZE]
        mac = self._receive.copy()
        mac.update(_SEQ_OPCODE.pack(self.received, opcode))
        mac.update(body)
        if len(payload) < TAG_SIZE or not hmac.compare_digest(mac.digest(), payload[-TAG_SIZE:]):
            name = OPCODE_NAMES.get(opcode, f"opcode {opcode}")
            raise ProtocolError(
                f"frame {self.received} ({name}) failed authentication: changed, replayed, "
                "reordered, dropped or from another connection"
            )
        self.received += 1
        return body


def sealed_limits(limits: dict[int, int]) -> dict[int, int]:
    """A reader's payload limits once every frame carries a tag."""
    return {opcode: size + TAG_SIZE for opcode, size in limits.items()}
