"""Authenticated frames: after the shared secret's handshake, every frame carries a tag.

The handshake (auth.py) proves who connected; the tags prove that every frame after it
came from them, unchanged, in order and once. Both sides derive two keys from the secret
and both nonces (HKDF-SHA256, one key per direction, so a frame cannot be reflected back
to its sender) and append a 16-byte tag to every frame's payload:

    tag = BLAKE2s-128(key of the direction, sequence u64 || opcode u8 || body)
    body = the payload, or SHA-256(payload) when the payload is over BIG bytes

The sequence counts the frames sent that way on the connection from 0 and is never sent;
the header's length covers the tag. A frame that was changed, replayed, reordered,
dropped before another, or spliced in from another connection (other nonces, other keys)
fails its tag, and the connection is closed. Every opcode gets this at the framing layer:
the coordinator's Peer seals what it writes and opens what it reads, the worker likewise.

What it costs decides the two hashes. Keyed BLAKE2s is a MAC by design (RFC 7693, as in
WireGuard) and costs CPython a third of HMAC-SHA256 on the frames of every chunk, which
are tens of bytes (0.3 against 1.4 us a tag). A step's update goes to every worker as
the same JOB_RESPONSE of up to hundreds of KB: its SHA-256 (1.3 GB/s with the CPU's SHA
instructions, against 0.5 for BLAKE2s) is taken once for all of them (DigestCache), and
each connection's tag covers only the digest. Together they cost the coordinator 10-21%
of its RESULTs a second in the load test (docs/RELIABILITY.md, Measured): CPython's
work around each tag, about 0.5 us a frame.

Nothing is encrypted: anyone on the path can read the traffic, but not change it.
Without a secret nothing here runs and the bytes on the wire are the reference's.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from .protocol import HEADER_SIZE, OPCODE_NAMES, ProtocolError

TAG_SIZE = 16
BIG = 1024  # payloads over this many bytes are tagged through their SHA-256
_SEQ_OPCODE = struct.Struct(">QB")
_LENGTH = struct.Struct(">I")  # a frame header's last field


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


class DigestCache:
    """SHA-256 of the payloads of the last few large frames sealed, by the frame object
    itself: the coordinator sends a step's update as one bytes object to every worker,
    and it is hashed once. Holding the frames keeps their ids from being reused."""

    SIZE = 4

    def __init__(self) -> None:
        self._recent: dict[int, tuple[bytes, bytes]] = {}

    def digest(self, frame: bytes, payload: memoryview) -> bytes:
        entry = self._recent.get(id(frame))
        if entry is not None and entry[0] is frame:
            return entry[1]
        digest = hashlib.sha256(payload).digest()
        if len(self._recent) >= self.SIZE:
            del self._recent[next(iter(self._recent))]  # the oldest
        self._recent[id(frame)] = (frame, digest)
        return digest


class Channel:
    """One side's sealing and opening of a connection's frames, with both sequences."""

    def __init__(self, send_key: bytes, receive_key: bytes, digests: DigestCache | None = None):
        # Keyed once; a frame's MAC starts from a copy (half the cost of keying anew).
        self._send = hashlib.blake2s(key=send_key, digest_size=TAG_SIZE)
        self._receive = hashlib.blake2s(key=receive_key, digest_size=TAG_SIZE)
        self._digests = digests if digests is not None else DigestCache()
        self.sent = 0  # frames sealed so far: the next one's sequence
        self.received = 0

    @classmethod
    def for_worker(cls, secret: bytes, worker_nonce: bytes, coordinator_nonce: bytes) -> Channel:
        up, down = channel_keys(secret, worker_nonce, coordinator_nonce)
        return cls(up, down)

    @classmethod
    def for_coordinator(
        cls,
        secret: bytes,
        worker_nonce: bytes,
        coordinator_nonce: bytes,
        digests: DigestCache | None = None,
    ) -> Channel:
        up, down = channel_keys(secret, worker_nonce, coordinator_nonce)
        return cls(down, up, digests)

    def seal(self, data: bytes) -> bytes:
        """Encoded frames (one or several back to back, all ours), each with its tag."""
        (length,) = _LENGTH.unpack_from(data, 6)
        if length <= BIG and HEADER_SIZE + length == len(data):  # most frames: one, small
            payload = data[HEADER_SIZE:]
            mac = self._send.copy()
            mac.update(_SEQ_OPCODE.pack(self.sent, data[5]) + payload)
            self.sent += 1
            return data[:6] + _LENGTH.pack(length + TAG_SIZE) + payload + mac.digest()
        out: list[bytes] = []
        pos = 0
        while pos < len(data):
            (length,) = _LENGTH.unpack_from(data, pos + 6)
            end = pos + HEADER_SIZE + length
            view = memoryview(data)[pos + HEADER_SIZE : end]  # copied once, by join
            whole = pos == 0 and end == len(data)
            if length > BIG:
                body = self._digests.digest(data, view) if whole else _sha256(view)
            else:
                body = bytes(view)
            mac = self._send.copy()
            mac.update(_SEQ_OPCODE.pack(self.sent, data[pos + 5]) + body)
            self.sent += 1
            # magic, version and opcode as they were; the length now counts the tag
            sealed = b"".join(
                (data[pos : pos + 6], _LENGTH.pack(length + TAG_SIZE), view, mac.digest())
            )
            if whole:
                return sealed
            out.append(sealed)
            pos = end
        return b"".join(out)

    def open_all(self, frames: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Received (opcode, payload) frames, their tags checked and removed in place, in
        order; ProtocolError at the first that does not match (the connection must end).
        One call for a batch, names bound once: the coordinator's hot path."""
        start, pack, equal = self._receive.copy, _SEQ_OPCODE.pack, hmac.compare_digest
        sequence = self.received
        for i, (opcode, payload) in enumerate(frames):
            body = payload[:-TAG_SIZE]
            mac = start()
            mac.update(pack(sequence, opcode) + (body if len(body) <= BIG else _sha256(body)))
            # A payload shorter than a tag compares unequal too.
            if not equal(mac.digest(), payload[-TAG_SIZE:]):
                self.received = sequence
                name = OPCODE_NAMES.get(opcode, f"opcode {opcode}")
                raise ProtocolError(
                    f"frame {sequence} ({name}) failed authentication: changed, replayed, "
                    "reordered, dropped or from another connection"
                )
            sequence += 1
            frames[i] = opcode, body
        self.received = sequence
        return frames

    def open(self, opcode: int, payload: bytes) -> bytes:
        """One received frame's payload without its tag (see open_all)."""
        return self.open_all([(opcode, payload)])[0][1]


def _sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def sealed_limits(limits: dict[int, int]) -> dict[int, int]:
    """A reader's payload limits once every frame carries a tag."""
    return {opcode: size + TAG_SIZE for opcode, size in limits.items()}
