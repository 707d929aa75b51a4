"""The coordinator <-> worker wire protocol, byte-compatible with the d-eggs reference.

Every message is a frame: a 10-byte big-endian header (magic b"JOBS", version 1, opcode
u8, payload length u32) and then the payload. All integers are big-endian.

    JOB_REQUEST  0  worker -> coord  seed u64, last_step u64, data_position u64
    RESULT       1  worker -> coord  seed, last_step, data_position, updates_count u64,
                                     sum_loss i64, result_size u32, packed chunk fitness
    JOB_RESPONSE 2  coord -> worker  seed, last_step, data_position u64, model_size u32,
                                     packed population fitness (a catch-up step) or nothing
    LOG_MESSAGE  3  either way       UTF-8 text
    HELLO        4  worker -> coord  deggs_protocol u16, fingerprint 8 bytes,
                                     config_len u32, config JSON, nonce 16 bytes
    HELLO_REPLY  5  coord -> worker  fingerprint 8 bytes, config_len u32, config JSON
    CHALLENGE    6  coord -> worker  nonce 16 bytes, proof 32 bytes
    AUTH         7  worker -> coord  proof 32 bytes
    GOODBYE      8  coord -> worker  reason u8, UTF-8 text
    EVALUATION   9  worker -> coord  step u64, windows u32, tokens u64, sum_loss i64,
                                     nats f64, text_bytes u64
    HEALTH      10  worker -> coord  step u64, count u16, then per entry: name_len u8,
                                     ASCII name, mean, std, saturation, entropy (f64 each)
    DIGEST      11  worker -> coord  step u64, state digest 32 bytes
    SNAPSHOT_REQUEST 12 coord -> worker  step u64
    SNAPSHOT    13  either way       step u64, seed u64, size u64, state digest 32 bytes
    SNAPSHOT_PART 14 either way      offset u64, then up to 1 MiB of the snapshot file

A JOB_RESPONSE whose data_position is 2^64-1 means "no chunk free, ask again later".

Opcodes 4..14 are deggs' own: the handshake and farewell (see auth.py for the proofs),
then a worker's validation loss and model health, and the state digests and weight
snapshots (snapshot.py), exchanged only between a worker and a coordinator that have
both said HELLO. The reference worker never sends HELLO, so without a shared secret the
coordinator serves a worker that starts with JOB_REQUEST as well. The reference
coordinator ignores opcodes it does not know, so a deggs worker without a secret sends
HELLO and JOB_REQUEST back to back and accepts a HELLO_REPLY (deggs) or a JOB_RESPONSE
(reference) as the first answer. With a secret the coordinator answers HELLO with a
CHALLENGE, and nothing but AUTH is accepted until the worker has proven the secret.

GOODBYE tells a deggs worker why the coordinator is closing its connection, as a code it
need not parse from text: the run is finished, the coordinator is going away for now, or
a refusal that retrying cannot fix (Reason.permanent).

Snapshots. A worker reports DIGEST when its model reaches a digest step. After the step
the coordinator may send SNAPSHOT_REQUEST(S) to a worker whose digest agreed; the worker
answers SNAPSHOT (size 0: it no longer holds S) and the file in SNAPSHOT_PARTs, in order.
Where the coordinator would answer a JOB_REQUEST with a catch-up step, it may send a
SNAPSHOT and its parts instead (the newest snapshot, or a worker's resync after its digest
disagreed); SNAPSHOT of step 0 with size 0 means "start over from the initial weights".
"""

from __future__ import annotations

import math
import re
import socket
import struct
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Self, cast

MAGIC = b"JOBS"
VERSION = 1
HEADER_SIZE = 10
DEGGS_PROTOCOL = 5  # version of the HELLO handshake (2: nonces, CHALLENGE/AUTH, GOODBYE;
# 3: EVALUATION and HEALTH, which an older coordinator would drop a worker for; 4: with a
# secret, every frame after AUTH carries a tag (channel.py); DIGEST and the SNAPSHOT
# messages; GOODBYE STOPPED; 5: one tag per write, not per frame)
WAIT = 2**64 - 1  # JOB_RESPONSE.data_position: nothing to do yet
NO_FINGERPRINT = bytes(8)  # HELLO from a worker that has no config yet
NONCE_SIZE = 16
PROOF_SIZE = 32  # HMAC-SHA256
MAX_CONFIG_JSON = 64 * 1024  # a config is ~2 KB; anything near this is not one
MAX_LOG_TEXT = 64 * 1024  # a generation is a few hundred bytes


class Opcode(IntEnum):
    JOB_REQUEST = 0
    RESULT = 1
    JOB_RESPONSE = 2
    LOG_MESSAGE = 3
    HELLO = 4
    HELLO_REPLY = 5
    CHALLENGE = 6
    AUTH = 7
    GOODBYE = 8
    EVALUATION = 9  # deggs only: a worker's validation loss
    HEALTH = 10  # deggs only: a worker's weight and activation statistics
    DIGEST = 11  # deggs only: a worker's state digest at a step
    SNAPSHOT_REQUEST = 12  # deggs only: the coordinator asks for a worker's model at a step
    SNAPSHOT = 13  # deggs only: a model file follows in SNAPSHOT_PARTs
    SNAPSHOT_PART = 14


# The opcodes by the names the modules use, and by number for messages about them.
(
    JOB_REQUEST,
    RESULT,
    JOB_RESPONSE,
    LOG_MESSAGE,
    HELLO,
    HELLO_REPLY,
    CHALLENGE,
    AUTH,
    GOODBYE,
    EVALUATION,
    HEALTH,
    DIGEST,
    SNAPSHOT_REQUEST,
    SNAPSHOT,
    SNAPSHOT_PART,
) = Opcode
OPCODE_NAMES = {op.value: op.name for op in Opcode}
DIGEST_SIZE = 32  # SHA-256 (export.state_digest)
PART_SIZE = 1 << 20  # a SNAPSHOT_PART's bytes of the file, at most

_HEADER = struct.Struct(">4sBBI")


class ProtocolError(Exception):
    """A frame or payload that does not follow the protocol."""


class NotOurProtocol(ProtocolError):
    """A header with another magic or version: the peer speaks something else entirely
    (an SSH or web server answering on the port), so retrying cannot help."""


class NoFrame(TimeoutError):
    """Not one byte of a frame arrived within the wait (recv_frame's wait_s)."""


class Reason(IntEnum):
    """Why the coordinator says GOODBYE. Codes from 16 up are refusals for good."""

    FINISHED = 0  # the run reached --max-steps: a worker's work is done
    SHUTTING_DOWN = 1  # stopped by its operator; it may come back (--load-dir)
    DISK_FAILURE = 2  # it cannot make its history durable and exits; it may come back
    STOPPED = 3  # stopped by its operator (Ctrl-C, SIGTERM): the run ends, workers exit too
    CONFIG_MISMATCH = 16
    PROTOCOL_MISMATCH = 17
    HISTORY_GONE = 18  # the fitness a worker needs to catch up is no longer kept
    COORDINATOR_BEHIND = 19  # the worker is ahead: a coordinator restarted without history
    SEED_MISMATCH = 20

    @property
    def permanent(self) -> bool:
        return self >= 16


def frame(opcode: int, payload: bytes) -> bytes:
    """Header + payload, ready to send."""
    return _HEADER.pack(MAGIC, VERSION, opcode, len(payload)) + payload


def parse_header(header: bytes) -> tuple[int, int]:
    """(opcode, payload length) of a 10-byte header."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(header)}")
    magic, version, opcode, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise NotOurProtocol(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise NotOurProtocol(f"unsupported protocol version {version} (expected {VERSION})")
    return opcode, length


def _need(payload: bytes, size: int, what: str):
    if len(payload) < size:
        raise ProtocolError(f"{what} payload is {len(payload)} bytes, needs at least {size}")


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def printable(text: str) -> str:
    """A peer's text made safe for one log line: control characters escaped, so it can
    neither forge lines of its own nor drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def describe(message) -> str:
    """A message from an unproven peer, for a log line: a GOODBYE with its claimed reason."""
    if isinstance(message, Goodbye):
        return f"a GOODBYE ({message.reason.name}: {printable(message.text)[:200]})"
    return f"a {type(message).__name__}"


# --- messages ------------------------------------------------------------------------


class _Fixed:
    """A message that is its dataclass fields packed as `_FIELDS`, nothing more."""

    OPCODE: ClassVar[int]
    _FIELDS: ClassVar[struct.Struct]

    def encode(self) -> bytes:
        return frame(self.OPCODE, self._FIELDS.pack(*vars(self).values()))

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        _need(payload, cls._FIELDS.size, OPCODE_NAMES[cls.OPCODE])
        return cast(Any, cls)(*cls._FIELDS.unpack_from(payload))  # a dataclass's constructor


@dataclass(frozen=True)
class JobRequest(_Fixed):
    seed: int
    last_step: int
    data_position: int = 0

    OPCODE: ClassVar[int] = JOB_REQUEST
    _FIELDS: ClassVar[struct.Struct] = struct.Struct(">QQQ")


class _FieldsThenData:
    """A message of fixed fields, the size of `data` (u32), then `data` (its last field)."""

    OPCODE: ClassVar[int]
    _FIELDS: ClassVar[struct.Struct]

    def encode(self) -> bytes:
        *fixed, data = vars(self).values()  # the dataclass fields, in order
        return frame(self.OPCODE, self._FIELDS.pack(*fixed, len(data)) + data)

    @classmethod
    def decode(cls, payload: bytes):
        name = OPCODE_NAMES[cls.OPCODE]
        _need(payload, cls._FIELDS.size, name)
        *fixed, size = cls._FIELDS.unpack_from(payload)
        data = bytes(payload[cls._FIELDS.size : cls._FIELDS.size + size])
        if len(data) < size:
            raise ProtocolError(f"{name} announces {size} bytes of fitness but carries {len(data)}")
        return cast(Any, cls)(*fixed, data)  # a dataclass's constructor


@dataclass(frozen=True)
class Result(_FieldsThenData):
    seed: int
    last_step: int
    data_position: int
    updates_count: int
    sum_loss: int  # signed; two's complement on the wire
    data: bytes  # packed fitness of the chunk's pairs

    OPCODE: ClassVar[int] = RESULT
    _FIELDS: ClassVar[struct.Struct] = struct.Struct(">QQQQqI")


@dataclass(frozen=True)
class JobResponse(_FieldsThenData):
    seed: int
    last_step: int
    data_position: int
    data: bytes = b""  # packed population fitness of step last_step - 1, or empty

    OPCODE: ClassVar[int] = JOB_RESPONSE
    _FIELDS: ClassVar[struct.Struct] = struct.Struct(">QQQI")
    _FRAME: ClassVar[struct.Struct] = struct.Struct(">4sBBIQQQI")  # header, fields, no data

    def encode(self) -> bytes:
        if self.data:
            return super().encode()
        # A chunk or a WAIT, the coordinator's most frequent frame: in one pack.
        size = self._FIELDS.size
        return self._FRAME.pack(
            MAGIC, VERSION, JOB_RESPONSE, size, self.seed, self.last_step, self.data_position, 0
        )

    @property
    def is_wait(self) -> bool:
        return self.data_position == WAIT


@dataclass(frozen=True)
class LogMessage:
    text: str

    OPCODE: ClassVar[int] = LOG_MESSAGE

    def encode(self) -> bytes:
        return frame(self.OPCODE, self.text.encode("utf-8"))

    @classmethod
    def decode(cls, payload: bytes) -> LogMessage:
        return cls(_text(payload))


class _Reader:
    """Walks a payload field by field, raising ProtocolError when it runs short."""

    def __init__(self, payload: bytes, what: str):
        self.payload, self.what, self.pos = payload, what, 0

    def take(self, size: int, field: str) -> bytes:
        if self.pos + size > len(self.payload):
            raise ProtocolError(
                f"{self.what} payload ends inside {field} ({len(self.payload)} bytes)"
            )
        out = bytes(self.payload[self.pos : self.pos + size])
        self.pos += size
        return out

    def uint(self, size: int, field: str) -> int:
        return int.from_bytes(self.take(size, field), "big")

    def blob(self, field: str, limit: int) -> bytes:
        """A u32 length (at most `limit`) followed by that many bytes."""
        size = self.uint(4, f"{field} length")
        if size > limit:
            raise ProtocolError(f"{self.what} {field} of {size} bytes exceeds {limit}")
        return self.take(size, field)


@dataclass(frozen=True)
class Hello:
    fingerprint: bytes  # 8 bytes; NO_FINGERPRINT when the worker has no config
    config_json: str = ""
    nonce: bytes = bytes(NONCE_SIZE)  # fresh for every connection
    deggs_protocol: int = DEGGS_PROTOCOL

    OPCODE: ClassVar[int] = HELLO

    def encode(self) -> bytes:
        config = self.config_json.encode("utf-8")
        payload = (
            struct.pack(">H", self.deggs_protocol)
            + _sized(self.fingerprint, 8)
            + struct.pack(">I", len(config))
            + config
            + _sized(self.nonce, NONCE_SIZE)
        )
        return frame(self.OPCODE, payload)

    @classmethod
    def decode(cls, payload: bytes) -> Hello:
        r = _Reader(payload, "HELLO")
        version = r.uint(2, "deggs_protocol")
        if version != DEGGS_PROTOCOL:  # the rest may be laid out otherwise
            return cls(NO_FINGERPRINT, "", bytes(NONCE_SIZE), version)
        fingerprint = r.take(8, "fingerprint")
        config = _text(r.blob("config", MAX_CONFIG_JSON))
        return cls(fingerprint, config, r.take(NONCE_SIZE, "nonce"), version)


@dataclass(frozen=True)
class HelloReply:
    """The handshake's success: the coordinator's config, for a worker to check or adopt."""

    fingerprint: bytes
    config_json: str

    OPCODE: ClassVar[int] = HELLO_REPLY

    def encode(self) -> bytes:
        config = self.config_json.encode("utf-8")
        return frame(
            self.OPCODE, _sized(self.fingerprint, 8) + struct.pack(">I", len(config)) + config
        )

    @classmethod
    def decode(cls, payload: bytes) -> HelloReply:
        r = _Reader(payload, "HELLO_REPLY")
        fingerprint = r.take(8, "fingerprint")
        return cls(fingerprint, _text(r.blob("config", MAX_CONFIG_JSON)))


@dataclass(frozen=True)
class Challenge:
    """The coordinator's nonce and its proof that it knows the secret (auth.py)."""

    nonce: bytes
    proof: bytes

    OPCODE: ClassVar[int] = CHALLENGE

    def encode(self) -> bytes:
        return frame(self.OPCODE, _sized(self.nonce, NONCE_SIZE) + _sized(self.proof, PROOF_SIZE))

    @classmethod
    def decode(cls, payload: bytes) -> Challenge:
        r = _Reader(payload, "CHALLENGE")
        return cls(r.take(NONCE_SIZE, "nonce"), r.take(PROOF_SIZE, "proof"))


@dataclass(frozen=True)
class Auth:
    """The worker's proof that it knows the secret."""

    proof: bytes

    OPCODE: ClassVar[int] = AUTH

    def encode(self) -> bytes:
        return frame(self.OPCODE, _sized(self.proof, PROOF_SIZE))

    @classmethod
    def decode(cls, payload: bytes) -> Auth:
        return cls(_Reader(payload, "AUTH").take(PROOF_SIZE, "proof"))


@dataclass(frozen=True)
class Goodbye:
    reason: Reason
    text: str = ""

    OPCODE: ClassVar[int] = GOODBYE

    def encode(self) -> bytes:
        return frame(self.OPCODE, bytes([self.reason]) + self.text.encode("utf-8"))

    @classmethod
    def decode(cls, payload: bytes) -> Goodbye:
        r = _Reader(payload, "GOODBYE")
        code = r.uint(1, "reason")
        try:
            reason = Reason(code)
        except ValueError:
            raise ProtocolError(f"GOODBYE with unknown reason {code}") from None
        return cls(reason, _text(payload[1:]))


def _sized(value: bytes, size: int) -> bytes:
    if len(value) != size:
        raise ValueError(f"expected {size} bytes, got {len(value)}")
    return bytes(value)


@dataclass(frozen=True)
class Evaluation:
    """The unperturbed model of `step` on the validation windows (sent only to a deggs
    coordinator): integer loss in the reference's units, and the cross-entropy of its
    logits in nats, with the tokens and the bytes of text they stand for."""

    step: int
    windows: int
    tokens: int
    sum_loss: int
    nats: float
    text_bytes: int

    OPCODE: ClassVar[int] = EVALUATION
    _FIELDS: ClassVar[struct.Struct] = struct.Struct(">QIQqdQ")

    def encode(self) -> bytes:
        return frame(
            self.OPCODE,
            self._FIELDS.pack(
                self.step, self.windows, self.tokens, self.sum_loss, self.nats, self.text_bytes
            ),
        )

    @classmethod
    def decode(cls, payload: bytes) -> Evaluation:
        _need(payload, cls._FIELDS.size, "EVALUATION")
        message = cls(*cls._FIELDS.unpack_from(payload))
        if not (
            message.windows and message.tokens and math.isfinite(message.nats) and message.nats >= 0
        ):
            raise ProtocolError(f"EVALUATION with impossible figures: {message}")
        return message


# HEALTH: at model.n_layers <= 256, 12 parameters a layer and a few more stay below this.
MAX_HEALTH_ENTRIES = 4096
MAX_HEALTH_NAME = 48  # "layers.255.mlp_bias_down" is 24
_HEALTH_NAME = re.compile(rb"[A-Za-z0-9_.]+")
# What each figure of int8 values can be; anything else is not a measurement.
HEALTH_RANGES = {
    "mean": (-128.0, 127.0),
    "std": (0.0, 128.0),
    "saturation": (0.0, 1.0),
    "entropy": (0.0, 8.0),
}


@dataclass(frozen=True)
class HealthEntry:
    name: str  # a parameter ("embedding", "layers.3.w_up") or an activation ("act.NAME")
    mean: float
    std: float
    saturation: float  # share of entries at +-127
    entropy: float  # bits of the histogram of the 256 int8 values


@dataclass(frozen=True)
class Health:
    """Statistics of the unperturbed model of `step` (numerics/health.py), sent only to a
    deggs coordinator: one entry per weight matrix or vector and a few activations."""

    step: int
    entries: tuple[HealthEntry, ...]

    OPCODE: ClassVar[int] = HEALTH
    _HEAD: ClassVar[struct.Struct] = struct.Struct(">QH")
    _FIGURES: ClassVar[struct.Struct] = struct.Struct(">dddd")

    def encode(self) -> bytes:
        parts = [self._HEAD.pack(self.step, len(self.entries))]
        for e in self.entries:
            name = e.name.encode("ascii")
            if not (len(name) <= MAX_HEALTH_NAME and _HEALTH_NAME.fullmatch(name)):
                raise ValueError(f"health entry name {e.name!r} cannot be sent")
            figures = self._FIGURES.pack(e.mean, e.std, e.saturation, e.entropy)
            parts.append(bytes([len(name)]) + name + figures)
        return frame(self.OPCODE, b"".join(parts))

    @classmethod
    def decode(cls, payload: bytes) -> Health:
        r = _Reader(payload, "HEALTH")
        step = r.uint(8, "step")
        count = r.uint(2, "count")
        if not 1 <= count <= MAX_HEALTH_ENTRIES:
            raise ProtocolError(f"HEALTH with {count} entries (1..{MAX_HEALTH_ENTRIES})")
        entries: list[HealthEntry] = []
        names: set[str] = set()
        for i in range(count):
            size = r.uint(1, "name length")
            if not 1 <= size <= MAX_HEALTH_NAME:
                raise ProtocolError(f"HEALTH entry {i} has a name of {size} bytes")
            raw = r.take(size, "name")
            if not _HEALTH_NAME.fullmatch(raw):
                raise ProtocolError(f"HEALTH entry {i} has the name {raw!r} (A-Z a-z 0-9 _ . only)")
            name = raw.decode("ascii")
            if name in names:
                raise ProtocolError(f"HEALTH names {name} twice")
            names.add(name)
            figures = cls._FIGURES.unpack(r.take(cls._FIGURES.size, "figures"))
            for (field, (low, high)), value in zip(HEALTH_RANGES.items(), figures, strict=True):
                if not low <= value <= high:  # NaN fails too
                    raise ProtocolError(f"HEALTH {name} {field} {value!r} outside [{low}, {high}]")
            entries.append(HealthEntry(name, *figures))
        if r.pos != len(payload):
            raise ProtocolError(f"HEALTH has {len(payload) - r.pos} bytes after its last entry")
        return cls(step, tuple(entries))


@dataclass(frozen=True)
class Digest(_Fixed):
    """A worker's state digest (export.state_digest) when its model reached `step`."""

    step: int
    digest: bytes

    OPCODE: ClassVar[int] = DIGEST
    _FIELDS: ClassVar[struct.Struct] = struct.Struct(f">Q{DIGEST_SIZE}s")

    def __post_init__(self):
        _sized(self.digest, DIGEST_SIZE)


@dataclass(frozen=True)
class SnapshotRequest(_Fixed):
    step: int

    OPCODE: ClassVar[int] = SNAPSHOT_REQUEST
    _FIELDS: ClassVar[struct.Struct] = struct.Struct(">Q")


@dataclass(frozen=True)
class SnapshotHeader(_Fixed):
    """A model file of `size` bytes follows in SNAPSHOT_PARTs (none when size is 0)."""

    step: int
    seed: int
    size: int
    digest: bytes

    OPCODE: ClassVar[int] = SNAPSHOT
    _FIELDS: ClassVar[struct.Struct] = struct.Struct(f">QQQ{DIGEST_SIZE}s")

    def __post_init__(self):
        _sized(self.digest, DIGEST_SIZE)


@dataclass(frozen=True)
class SnapshotPart:
    offset: int
    data: bytes

    OPCODE: ClassVar[int] = SNAPSHOT_PART
    _FIELDS: ClassVar[struct.Struct] = struct.Struct(">Q")

    def encode(self) -> bytes:
        return frame(self.OPCODE, self._FIELDS.pack(self.offset) + self.data)

    @classmethod
    def decode(cls, payload: bytes) -> SnapshotPart:
        _need(payload, cls._FIELDS.size, "SNAPSHOT_PART")
        (offset,) = cls._FIELDS.unpack_from(payload)
        return cls(offset, bytes(payload[cls._FIELDS.size :]))


def health_size(entries: int) -> int:
    """The largest HEALTH payload of this many entries."""
    return Health._HEAD.size + entries * (1 + MAX_HEALTH_NAME + Health._FIGURES.size)


MESSAGES = {
    cls.OPCODE: cls
    for cls in (
        JobRequest,
        Result,
        JobResponse,
        LogMessage,
        Hello,
        HelloReply,
        Challenge,
        Auth,
        Goodbye,
        Evaluation,
        Health,
        Digest,
        SnapshotRequest,
        SnapshotHeader,
        SnapshotPart,
    )
}


def decode_message(opcode: int, payload: bytes):
    """The message object of a frame; ProtocolError for an opcode we do not know."""
    cls = MESSAGES.get(opcode)
    if cls is None:
        raise ProtocolError(f"unknown opcode {opcode}")
    return cls.decode(payload)


# --- reading and writing frames --------------------------------------------------------
#
# A peer announces a payload's length before sending it, so every reader takes a table of
# the largest payload it accepts per opcode and refuses a larger one from the header alone,
# before anything is allocated. An opcode missing from the table is refused too.


def limits_from_worker(
    chunk_bytes: int, health_entries: int = MAX_HEALTH_ENTRIES
) -> dict[int, int]:
    """The largest payload a coordinator accepts of each message a worker sends
    (health_entries: the most HEALTH entries its model can have)."""
    return {
        JOB_REQUEST: JobRequest._FIELDS.size,
        RESULT: Result._FIELDS.size + chunk_bytes,
        LOG_MESSAGE: MAX_LOG_TEXT,
        HELLO: 2 + 8 + 4 + MAX_CONFIG_JSON + NONCE_SIZE,
        AUTH: PROOF_SIZE,
        EVALUATION: Evaluation._FIELDS.size,
        HEALTH: health_size(min(health_entries, MAX_HEALTH_ENTRIES)),
        DIGEST: Digest._FIELDS.size,
        SNAPSHOT: SnapshotHeader._FIELDS.size,
        SNAPSHOT_PART: SnapshotPart._FIELDS.size + PART_SIZE,
    }


def limits_from_coordinator(population_bytes: int) -> dict[int, int]:
    """The largest payload a worker accepts of each message a coordinator sends."""
    return {
        JOB_RESPONSE: JobResponse._FIELDS.size + population_bytes,
        LOG_MESSAGE: MAX_LOG_TEXT,
        HELLO_REPLY: 8 + 4 + MAX_CONFIG_JSON,
        CHALLENGE: NONCE_SIZE + PROOF_SIZE,
        GOODBYE: 1 + MAX_LOG_TEXT,
        SNAPSHOT_REQUEST: SnapshotRequest._FIELDS.size,
        SNAPSHOT: SnapshotHeader._FIELDS.size,
        SNAPSHOT_PART: SnapshotPart._FIELDS.size + PART_SIZE,
    }


def check_length(opcode: int, length: int, limits: dict[int, int]):
    limit = limits.get(opcode)
    if limit is not None and length <= limit:
        return
    name = OPCODE_NAMES.get(opcode, f"opcode {opcode}")
    if limit is None:
        raise ProtocolError(
            f"unexpected {name}" if opcode in OPCODE_NAMES else f"unknown opcode {opcode}"
        )
    if length > limit:
        raise ProtocolError(f"{name} payload of {length} bytes exceeds the limit of {limit}")


class FrameReader:
    """Cuts a byte stream into frames as its bytes arrive (the coordinator's side).

    feed() returns the frames completed by new bytes; `partial` says whether the bytes of an
    unfinished frame are waiting, so the caller can hold that frame to a deadline. A bad
    header raises ProtocolError as soon as its 10 bytes are in.
    """

    def __init__(self, limits: dict[int, int]):
        self.limits = limits
        self._buf = bytearray()

    @property
    def partial(self) -> bool:
        return bool(self._buf)

    @property
    def unread(self) -> bytes:
        """The bytes of a frame not yet complete."""
        return bytes(self._buf)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        frames, pos = [], 0
        while len(buf) - pos >= HEADER_SIZE:
            magic, version, opcode, length = _HEADER.unpack_from(buf, pos)
            if magic != MAGIC or version != VERSION:
                parse_header(bytes(buf[pos : pos + HEADER_SIZE]))  # raises, saying which
            check_length(opcode, length, self.limits)
            end = pos + HEADER_SIZE + length
            if len(buf) < end:
                break
            frames.append((opcode, bytes(buf[pos + HEADER_SIZE : end])))
            pos = end
        del buf[:pos]
        return frames


def set_keepalive(sock: socket.socket | None) -> None:
    """Let the kernel find a peer that vanished without a word (a pulled cable, a crash)
    while we wait on a long chunk and read nothing: 60 s idle, then 6 probes 10 s apart."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def send_frame(sock: socket.socket, data: bytes) -> None:
    """Send one encoded frame on a blocking socket."""
    sock.sendall(data)


def recv_frame(
    sock: socket.socket,
    limits: dict[int, int],
    wait_s: float | None = None,
    frame_s: float | None = None,
) -> tuple[int, bytes] | None:
    """Next (opcode, payload) from a blocking socket; None when the peer closed cleanly.

    wait_s bounds the wait for a frame's first byte, frame_s the time from its first byte to
    its last (None: no bound); either running out raises TimeoutError. Deadlines are per
    frame, not per recv, so a peer dripping a byte at a time cannot hold the reader.
    """
    sock.settimeout(wait_s)
    try:
        first = sock.recv(HEADER_SIZE)
    except TimeoutError:
        raise NoFrame(f"nothing in {wait_s:g} s") from None
    if not first:
        return None
    if not MAGIC.startswith(first[: len(MAGIC)]):  # say so now, not after ten bytes
        raise NotOurProtocol(f"bad magic {bytes(first[: len(MAGIC)])!r} (expected {MAGIC!r})")
    deadline = None if frame_s is None else time.monotonic() + frame_s
    header = _recv_exact(sock, HEADER_SIZE, "header", deadline, first)
    opcode, length = parse_header(header)
    check_length(opcode, length, limits)
    return opcode, _recv_exact(sock, length, "payload", deadline)


def _recv_exact(
    sock: socket.socket, size: int, what: str, deadline: float | None, start: bytes = b""
) -> bytes:
    buf = bytearray(start)
    while len(buf) < size:
        try:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
            part = sock.recv(min(size - len(buf), 1 << 20))
        except TimeoutError:
            raise TimeoutError(
                f"a frame took too long ({len(buf)} of {size} {what} bytes)"
            ) from None
        if not part:
            raise ProtocolError(f"disconnected mid-frame ({len(buf)} of {size} {what} bytes)")
        buf += part
    return bytes(buf)
