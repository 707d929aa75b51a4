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
                                     config_len u32, config JSON
    HELLO_REPLY  5  coord -> worker  accepted u8, fingerprint 8 bytes, config_len u32,
                                     config JSON, message_len u32, message UTF-8

A JOB_RESPONSE whose data_position is 2^64-1 means "no chunk free, ask again later".

HELLO and HELLO_REPLY are deggs' own handshake. The reference worker never sends HELLO,
so the coordinator serves a worker that starts with JOB_REQUEST as well. The reference
coordinator ignores opcodes it does not know, so our worker sends HELLO and then
JOB_REQUEST straight away, without waiting, and accepts either a HELLO_REPLY (deggs
coordinator) or a JOB_RESPONSE (reference coordinator) as the first answer.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass, fields
from typing import ClassVar

MAGIC = b"JOBS"
VERSION = 1
HEADER_SIZE = 10
DEGGS_PROTOCOL = 1  # version of the HELLO handshake
WAIT = 2**64 - 1  # JOB_RESPONSE.data_position: nothing to do yet
NO_FINGERPRINT = bytes(8)  # HELLO from a worker that has no config yet

JOB_REQUEST = 0
RESULT = 1
JOB_RESPONSE = 2
LOG_MESSAGE = 3
HELLO = 4
HELLO_REPLY = 5
OPCODE_NAMES = {JOB_REQUEST: "JOB_REQUEST", RESULT: "RESULT", JOB_RESPONSE: "JOB_RESPONSE",
                LOG_MESSAGE: "LOG_MESSAGE", HELLO: "HELLO", HELLO_REPLY: "HELLO_REPLY"}

_HEADER = struct.Struct(">4sBBI")


class ProtocolError(Exception):
    """A frame or payload that does not follow the protocol."""


def frame(opcode: int, payload: bytes) -> bytes:
    """Header + payload, ready to send."""
    return _HEADER.pack(MAGIC, VERSION, opcode, len(payload)) + payload


def parse_header(header: bytes) -> tuple[int, int]:
    """(opcode, payload length) of a 10-byte header."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(header)}")
    magic, version, opcode, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (expected {VERSION})")
    return opcode, length


def _need(payload: bytes, size: int, what: str):
    if len(payload) < size:
        raise ProtocolError(f"{what} payload is {len(payload)} bytes, needs at least {size}")


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


# --- messages ------------------------------------------------------------------------

@dataclass(frozen=True)
class JobRequest:
    seed: int
    last_step: int
    data_position: int = 0

    OPCODE: ClassVar[int] = JOB_REQUEST
    _FIELDS: ClassVar[struct.Struct] = struct.Struct(">QQQ")

    def encode(self) -> bytes:
        return frame(self.OPCODE, self._FIELDS.pack(self.seed, self.last_step, self.data_position))

    @classmethod
    def decode(cls, payload: bytes) -> "JobRequest":
        _need(payload, cls._FIELDS.size, "JOB_REQUEST")
        return cls(*cls._FIELDS.unpack_from(payload))


class _FieldsThenData:
    """A message of fixed fields, the size of `data` (u32), then `data` (its last field)."""

    def encode(self) -> bytes:
        *fixed, data = (getattr(self, f.name) for f in fields(self))
        return frame(self.OPCODE, self._FIELDS.pack(*fixed, len(data)) + data)

    @classmethod
    def decode(cls, payload: bytes):
        name = OPCODE_NAMES[cls.OPCODE]
        _need(payload, cls._FIELDS.size, name)
        *fixed, size = cls._FIELDS.unpack_from(payload)
        data = bytes(payload[cls._FIELDS.size:cls._FIELDS.size + size])
        if len(data) < size:
            raise ProtocolError(f"{name} announces {size} bytes of fitness but carries "
                                f"{len(data)}")
        return cls(*fixed, data)


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
    def decode(cls, payload: bytes) -> "LogMessage":
        return cls(_text(payload))


class _Reader:
    """Walks a payload field by field, raising ProtocolError when it runs short."""

    def __init__(self, payload: bytes, what: str):
        self.payload, self.what, self.pos = payload, what, 0

    def take(self, size: int, field: str) -> bytes:
        if self.pos + size > len(self.payload):
            raise ProtocolError(f"{self.what} payload ends inside {field} "
                                f"({len(self.payload)} bytes)")
        out = bytes(self.payload[self.pos:self.pos + size])
        self.pos += size
        return out

    def uint(self, size: int, field: str) -> int:
        return int.from_bytes(self.take(size, field), "big")

    def blob(self, field: str) -> bytes:
        """A u32 length followed by that many bytes."""
        return self.take(self.uint(4, f"{field} length"), field)


@dataclass(frozen=True)
class Hello:
    fingerprint: bytes  # 8 bytes; NO_FINGERPRINT when the worker has no config
    config_json: str = ""
    deggs_protocol: int = DEGGS_PROTOCOL

    OPCODE: ClassVar[int] = HELLO

    def encode(self) -> bytes:
        config = self.config_json.encode("utf-8")
        payload = (struct.pack(">H", self.deggs_protocol) + _fingerprint(self.fingerprint)
                   + struct.pack(">I", len(config)) + config)
        return frame(self.OPCODE, payload)

    @classmethod
    def decode(cls, payload: bytes) -> "Hello":
        r = _Reader(payload, "HELLO")
        version = r.uint(2, "deggs_protocol")
        fingerprint = r.take(8, "fingerprint")
        return cls(fingerprint, _text(r.blob("config")), version)


@dataclass(frozen=True)
class HelloReply:
    accepted: bool
    fingerprint: bytes  # the coordinator's
    config_json: str  # the coordinator's full config, for a worker to adopt
    message: str = ""

    OPCODE: ClassVar[int] = HELLO_REPLY

    def encode(self) -> bytes:
        config, message = self.config_json.encode("utf-8"), self.message.encode("utf-8")
        payload = (bytes([1 if self.accepted else 0]) + _fingerprint(self.fingerprint)
                   + struct.pack(">I", len(config)) + config
                   + struct.pack(">I", len(message)) + message)
        return frame(self.OPCODE, payload)

    @classmethod
    def decode(cls, payload: bytes) -> "HelloReply":
        r = _Reader(payload, "HELLO_REPLY")
        accepted = r.uint(1, "accepted") != 0
        fingerprint = r.take(8, "fingerprint")
        config = _text(r.blob("config"))
        return cls(accepted, fingerprint, config, _text(r.blob("message")))


def _fingerprint(value: bytes) -> bytes:
    if len(value) != 8:
        raise ValueError(f"a fingerprint is 8 bytes, got {len(value)}")
    return bytes(value)


MESSAGES = {cls.OPCODE: cls for cls in (JobRequest, Result, JobResponse, LogMessage,
                                         Hello, HelloReply)}


def decode_message(opcode: int, payload: bytes):
    """The message object of a frame; ProtocolError for an opcode we do not know."""
    cls = MESSAGES.get(opcode)
    if cls is None:
        raise ProtocolError(f"unknown opcode {opcode}")
    return cls.decode(payload)


# --- reading and writing frames --------------------------------------------------------

def _check_length(opcode: int, length: int, max_payload: int):
    if length > max_payload:
        name = OPCODE_NAMES.get(opcode, f"opcode {opcode}")
        raise ProtocolError(f"{name} payload of {length} bytes exceeds the limit of "
                            f"{max_payload}")


async def read_frame(reader: asyncio.StreamReader, max_payload: int) -> tuple[int, bytes] | None:
    """Next (opcode, payload) from a stream; None on a clean end of stream between frames.

    The length is checked before anything is allocated. A stream that ends inside a
    frame raises ProtocolError('disconnected mid-frame ...').
    """
    try:
        header = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ProtocolError(f"disconnected mid-frame ({len(e.partial)} of {HEADER_SIZE} "
                            "header bytes)") from None
    opcode, length = parse_header(header)
    _check_length(opcode, length, max_payload)
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(f"disconnected mid-frame ({len(e.partial)} of {length} payload "
                            "bytes)") from None
    return opcode, payload


def send_frame(sock: socket.socket, data: bytes) -> None:
    """Send one encoded frame on a blocking socket."""
    sock.sendall(data)


def _recv_exact(sock: socket.socket, size: int, what: str, start: bytes = b"") -> bytes:
    buf = bytearray(start)
    while len(buf) < size:
        part = sock.recv(min(size - len(buf), 1 << 20))
        if not part:
            raise ProtocolError(f"disconnected mid-frame ({len(buf)} of {size} {what} bytes)")
        buf += part
    return bytes(buf)


def recv_frame(sock: socket.socket, max_payload: int) -> tuple[int, bytes] | None:
    """Blocking twin of read_frame: (opcode, payload), or None when the peer closed cleanly."""
    first = sock.recv(HEADER_SIZE)
    if not first:
        return None
    header = _recv_exact(sock, HEADER_SIZE, "header", first)
    opcode, length = parse_header(header)
    _check_length(opcode, length, max_payload)
    return opcode, _recv_exact(sock, length, "payload")
