"""Authenticated frames: after the shared secret's handshake, every write carries a tag.

The handshake (auth.py) proves who connected; the tags prove that every frame after it
came from them, unchanged, in order and once. Both sides derive two keys from the secret
and both nonces (HKDF-SHA256, one key per direction, so a frame cannot be reflected back
to its sender).

A sender's write is one record: its frames back to back, the last one marked by the
SEALED bit (0x80) in its opcode and ending in a 16-byte tag, which its header's length
counts. Frames without the bit wait at the receiver until the marked frame's tag is
checked, and only then are handled. Each direction keeps one running MAC over all its
records so far, and a record's tag is its value at the record's end:

    tag of record i = BLAKE2s-128(key of the direction, R_1 || R_2 || ... || R_i)
    R_j = record j as sent, less its tag, each payload of over BIG bytes replaced by
          its SHA-256

so a tag vouches for the record and for everything before it on the connection. A record
that was changed, cut, replayed, reordered, dropped before another, or spliced in from
another connection (other nonces, other keys) fails its tag, and the connection is
closed. The headers are hashed too, so where frames and records end is covered. Every
opcode gets this at the framing layer: the coordinator's Peer seals what it writes and
reads through its Channel, the worker likewise. A record's unmarked frames end within
RECORD_BYTES of its start, and it has at most RECORD_FRAMES frames (a larger write is
cut into several records), so what a receiver holds unchecked stays bounded; both
readers give a record frame_timeout_s from its first byte, as they would one frame.

What it costs decides the design: CPython's work around a tag, hashing included, is a
good part of what the coordinator spends on a RESULT. So there is one tag per write, not
per frame: a worker's RESULT and its next JOB_REQUEST go out as one record, checked with
one hash over the bytes where they lie in the receive buffer, and the running MAC needs
no copy or sequence number per record. Keyed BLAKE2s is a MAC by design (RFC 7693, as in
WireGuard) and costs a third of HMAC-SHA256 on records of tens of bytes. A step's update
goes to every worker as the same JOB_RESPONSE of up to hundreds of KB: its SHA-256 (1.3
GB/s with the CPU's SHA instructions, against 0.5 for BLAKE2s) is taken once for all of
them (DigestCache), and each connection's MAC covers only the digest. The load test's
figures are in docs/RELIABILITY.md (Measured).

Nothing is encrypted: anyone on the path can read the traffic, but not change it.
Without a secret nothing here runs and the bytes on the wire are the reference's.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from .protocol import HEADER_SIZE, MAGIC, OPCODE_NAMES, VERSION, FrameReader, ProtocolError
from .protocol import check_length as _check_length
from .protocol import parse_header as _parse_header

TAG_SIZE = 16
SEALED = 0x80  # opcode bit: this frame ends a record and carries its tag
BIG = 1024  # payloads over this many bytes are tagged through their SHA-256
RECORD_BYTES = 1 << 16  # a record's unmarked frames end within this many bytes of it
RECORD_FRAMES = 64  # and a record has at most this many frames
_HEADER = struct.Struct(">4sBBI")
_OPCODE_LENGTH = struct.Struct(">BI")  # a frame header's last two fields
_LENGTH = struct.Struct(">I")


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


class Channel(FrameReader):
    """One side of a proven connection: seal() what we send; feed() what arrives, as a
    FrameReader does, getting frames only once their record's tag is checked."""

    def __init__(
        self,
        send_key: bytes,
        receive_key: bytes,
        limits: dict[int, int],
        digests: DigestCache | None = None,
        unread: bytes = b"",
    ):
        super().__init__(limits)  # the payload limits without tags
        self._buf += unread  # what arrived after AUTH: the start of a frame at most
        # One running MAC a direction: a record's tag is the digest of everything so far.
        self._send = hashlib.blake2s(key=send_key, digest_size=TAG_SIZE)
        self._receive = hashlib.blake2s(key=receive_key, digest_size=TAG_SIZE)
        self._digests = digests if digests is not None else DigestCache()
        self._unchecked: list[tuple[int, bytes]] = []  # frames of a record still open
        self._parsed = 0  # bytes of the buffer cut into frames so far

    @classmethod
    def for_worker(
        cls, secret: bytes, worker_nonce: bytes, coordinator_nonce: bytes, limits: dict[int, int]
    ) -> Channel:
        up, down = channel_keys(secret, worker_nonce, coordinator_nonce)
        return cls(up, down, limits)

    @classmethod
    def for_coordinator(
        cls,
        secret: bytes,
        worker_nonce: bytes,
        coordinator_nonce: bytes,
        limits: dict[int, int],
        digests: DigestCache | None = None,
        unread: bytes = b"",
    ) -> Channel:
        up, down = channel_keys(secret, worker_nonce, coordinator_nonce)
        return cls(down, up, limits, digests, unread)

    # --- sending -----------------------------------------------------------------------

    def seal(self, data: bytes) -> bytes:
        """One write's encoded frames (one or several back to back, all ours) as records."""
        mac = self._send
        (length,) = _LENGTH.unpack_from(data, 6)
        if length <= BIG and HEADER_SIZE + length == len(data):  # most writes: one small frame
            sealed = data[:5] + _OPCODE_LENGTH.pack(data[5] | SEALED, length + TAG_SIZE)
            sealed += data[HEADER_SIZE:]
            mac.update(sealed)
            return sealed + mac.digest()
        out: list[bytes | memoryview] = []
        record = frames = pos = 0  # the record's bytes and frames so far; the next frame
        view = memoryview(data)
        while pos < len(data):
            opcode, length = _OPCODE_LENGTH.unpack_from(data, pos + 5)
            end = pos + HEADER_SIZE + length
            record += HEADER_SIZE + length
            frames += 1
            payload = view[pos + HEADER_SIZE : end]
            body: bytes | memoryview
            if length > BIG:  # a step's update, written alike to every worker: hashed once
                whole = pos == 0 and end == len(data)
                body = self._digests.digest(data, payload) if whole else _sha256(payload)
            else:
                body = payload
            # this frame ends a record
            last = end == len(data) or record > RECORD_BYTES or frames == RECORD_FRAMES
            header: bytes | memoryview
            if last:
                header = data[pos : pos + 5] + _OPCODE_LENGTH.pack(
                    opcode | SEALED, length + TAG_SIZE
                )
                record = frames = 0
            else:
                header = view[pos : pos + HEADER_SIZE]
            mac.update(header)
            mac.update(body)
            out += (header, payload, mac.digest()) if last else (header, payload)
            pos = end
        return b"".join(out)

    # --- receiving ---------------------------------------------------------------------

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The frames of every record completed by new bytes, tags checked and removed, in
        order; ProtocolError at the first record whose tag does not match (the connection
        must end). The coordinator's hot path: a record is hashed where it lies."""
        buf = self._buf
        buf += data
        frames = self._unchecked  # the open record's frames come first
        checked = start = 0  # frames[:checked] are checked; the open record starts at start
        pos = self._parsed
        limits = self.limits
        while len(buf) - pos >= HEADER_SIZE:
            magic, version, opcode, length = _HEADER.unpack_from(buf, pos)
            if magic != MAGIC or version != VERSION:
                _parse_header(bytes(buf[pos : pos + HEADER_SIZE]))  # raises, saying which
            end = pos + HEADER_SIZE + length
            if opcode < SEALED:
                limit = limits.get(opcode)
                if limit is None or length > limit:
                    _check_length(opcode, length, limits)  # raises, saying which
                if end - start > RECORD_BYTES or len(frames) - checked == RECORD_FRAMES - 1:
                    raise ProtocolError(
                        f"over {RECORD_BYTES} bytes or {RECORD_FRAMES - 1} frames without a tag"
                    )
                if len(buf) < end:
                    break
                frames.append((opcode, bytes(buf[pos + HEADER_SIZE : end])))
                pos = end
                continue
            opcode ^= SEALED
            limit = limits.get(opcode)
            if limit is None or not TAG_SIZE <= length <= limit + TAG_SIZE:
                if length < TAG_SIZE:
                    raise ProtocolError(f"a tagged frame of {length} bytes, shorter than a tag")
                _check_length(opcode, length - TAG_SIZE, limits)
            if len(buf) < end:
                break
            tag = end - TAG_SIZE
            mac = self._receive
            if tag - start <= BIG + HEADER_SIZE:  # no payload over BIG: hashed as it lies
                mac.update(buf[start:tag])
            else:
                _update_piecewise(mac, buf, start, tag)
            if not hmac.compare_digest(mac.digest(), buf[tag:end]):
                names = [OPCODE_NAMES.get(op, str(op)) for op, _ in frames[checked:]]
                names.append(OPCODE_NAMES.get(opcode, str(opcode)))
                raise ProtocolError(
                    f"a record ({', '.join(names)}) failed authentication: changed, cut, "
                    "replayed, reordered, dropped or from another connection"
                )
            frames.append((opcode, bytes(buf[pos + HEADER_SIZE : tag])))
            checked = len(frames)
            pos = start = end
        del buf[:start]
        self._parsed = pos - start
        if checked == len(frames):
            self._unchecked = []
            return frames
        self._unchecked = frames[checked:]
        del frames[checked:]
        return frames


def _update_piecewise(mac, buf: bytearray, start: int, tag: int):
    """Hash the record buf[start:tag] as sealed: each payload of over BIG bytes through
    its SHA-256."""
    with memoryview(buf) as view:
        pos = start
        while pos < tag:
            opcode, length = _OPCODE_LENGTH.unpack_from(buf, pos + 5)
            end = min(pos + HEADER_SIZE + length, tag)  # the last frame's payload ends at tag
            mac.update(view[pos : pos + HEADER_SIZE])
            payload = view[pos + HEADER_SIZE : end]
            mac.update(payload if len(payload) <= BIG else _sha256(payload))
            pos = end


def _sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def sealed_limits(limits: dict[int, int]) -> dict[int, int]:
    """Payload limits for a reader that takes one frame at a time before a Channel's
    feed() (the worker's blocking socket): each opcode both unmarked and SEALED."""
    return limits | {opcode | SEALED: size + TAG_SIZE for opcode, size in limits.items()}
