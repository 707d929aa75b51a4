"""Fuzzing: every decoder, and a live coordinator, fed random, truncated and mutated input.

The decoders (hypothesis, derandomized) must answer bytes from anywhere with a value or
their own error class, never another exception; valid messages must round-trip. The live
coordinator (seeded random.Random) takes thousands of hostile frames over a few hundred
loopback connections, with and without a shared secret, and must come out of it serving,
with nothing counted that an honest worker did not send, and still train a whole step.
"""

import asyncio
import contextlib
import json
import logging
import random
import re
import socket
import struct
import time
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sync import async_wait_until
from test_coordinator import (
    CHUNK,
    N_CHUNKS,
    SECRET,
    SMALL,
    Client,
    chunk_fitness,
    coordinator,
    seed_of,
    step_fitness,
)

from deggs.config import Config, ConfigError
from deggs.runtime import auth, protocol
from deggs.runtime.channel import SEALED, Channel
from deggs.runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    decode_checkpoint,
    encode_checkpoint,
)
from deggs.runtime.protocol import (
    AUTH,
    CHALLENGE,
    DIGEST_SIZE,
    GOODBYE,
    HEADER_SIZE,
    HELLO,
    HELLO_REPLY,
    JOB_RESPONSE,
    LOG_MESSAGE,
    MAGIC,
    MAX_CONFIG_JSON,
    MESSAGES,
    NO_FINGERPRINT,
    NONCE_SIZE,
    OPCODE_NAMES,
    PROOF_SIZE,
    SNAPSHOT_PART,
    Auth,
    Challenge,
    Digest,
    Evaluation,
    FrameReader,
    Goodbye,
    Health,
    HealthEntry,
    Hello,
    HelloReply,
    JobRequest,
    JobResponse,
    LogMessage,
    ProtocolError,
    Reason,
    Result,
    SnapshotHeader,
    SnapshotPart,
    SnapshotRequest,
    decode_message,
    frame,
    parse_header,
    recv_frame,
)
from deggs.ternary import pack_trits, packed_size, unpack_trits

FUZZ = settings(
    database=None,
    derandomize=True,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ANY = dict.fromkeys(OPCODE_NAMES, 1 << 24)  # a reader that accepts every known opcode


@pytest.fixture(autouse=True)
def no_logged_errors(caplog):
    """An error that reached asyncio's default handler, or that deggs logged, fails the test."""
    yield
    errors = [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.get_records("call")
        if (r.name == "asyncio" or r.name.startswith("deggs")) and r.levelno >= logging.ERROR
    ]
    assert not errors, errors


# --- strategies --------------------------------------------------------------------------

u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
text = st.text(max_size=200)  # no lone surrogates: those cannot be sent as UTF-8


def _bytes(n):
    return st.binary(min_size=n, max_size=n)


MESSAGE_STRATEGIES = {
    JobRequest: st.builds(JobRequest, u64, u64, u64),
    Result: st.builds(Result, u64, u64, u64, u64, i64, st.binary(max_size=64)),
    JobResponse: st.builds(JobResponse, u64, u64, u64, st.binary(max_size=64)),
    LogMessage: st.builds(LogMessage, text),
    Hello: st.builds(Hello, _bytes(8), text, _bytes(NONCE_SIZE)),
    HelloReply: st.builds(HelloReply, _bytes(8), text),
    Challenge: st.builds(Challenge, _bytes(NONCE_SIZE), _bytes(PROOF_SIZE)),
    Auth: st.builds(Auth, _bytes(PROOF_SIZE)),
    Goodbye: st.builds(Goodbye, st.sampled_from(Reason), text),
    Evaluation: st.builds(
        Evaluation,
        u64,
        st.integers(1, 2**32 - 1),
        st.integers(1, 2**64 - 1),
        i64,
        st.floats(0, 1e12),
        u64,
    ),
    Health: st.builds(
        Health,
        u64,
        st.lists(
            st.builds(
                HealthEntry,
                st.from_regex(r"[A-Za-z0-9_.]{1,48}", fullmatch=True),
                st.floats(-128, 127),
                st.floats(0, 128),
                st.floats(0, 1),
                st.floats(0, 8),
            ),
            min_size=1,
            max_size=4,
            unique_by=lambda e: e.name,
        ).map(tuple),
    ),
    Digest: st.builds(Digest, u64, _bytes(DIGEST_SIZE)),
    SnapshotRequest: st.builds(SnapshotRequest, u64),
    SnapshotHeader: st.builds(SnapshotHeader, u64, u64, u64, _bytes(DIGEST_SIZE)),
    SnapshotPart: st.builds(SnapshotPart, u64, st.binary(max_size=64)),
}
assert set(MESSAGE_STRATEGIES) == set(MESSAGES.values())
any_message = st.one_of(*MESSAGE_STRATEGIES.values())


@st.composite
def mutated(draw, base):
    """Bytes of `base` with a few bit flips, cuts, insertions and overwrites."""
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "overwrite", "u32"]))
        at = draw(st.integers(0, len(data)))
        if kind == "flip" and data:
            at = min(at, len(data) - 1)
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at : at + draw(st.integers(1, 16))]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[at : at + len(chunk)] = chunk
        else:  # a length field, as likely as not, made absurd
            data[at : at + 4] = draw(
                st.sampled_from(
                    [
                        b"\xff\xff\xff\xff",
                        b"\x7f\xff\xff\xff",
                        b"\x00\x01\x00\x01",
                        b"\x00\x00\x00\x00",
                    ]
                )
            )
    return bytes(data)


def payloads():
    """Payloads for any decoder: random bytes, other messages' payloads, and those mutated."""
    valid = any_message.map(lambda m: m.encode()[HEADER_SIZE:])
    hello_like = st.builds(
        lambda fp, n, rest: b"\x00\x02" + fp + n.to_bytes(4, "big") + rest,
        _bytes(8),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=64),
    )
    return st.one_of(
        st.binary(max_size=300), valid, hello_like, mutated(st.one_of(valid, hello_like))
    )


def streams():
    """A byte stream as a peer might send it: frames, garbage, and frames mutated."""
    frames = st.lists(any_message.map(lambda m: m.encode()), max_size=6).map(b"".join)
    return st.one_of(
        st.binary(max_size=400),
        frames,
        mutated(frames),
        st.tuples(frames, st.binary(max_size=40)).map(b"".join),
    )


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0] + points, points + [len(data)], strict=True)]


def reference_frames(stream: bytes, limits: dict) -> tuple[list, bool]:
    """(the frames a reader must find, whether it must then fail), walked one frame at a time."""
    out, pos = [], 0
    while len(stream) - pos >= HEADER_SIZE:
        try:
            opcode, length = parse_header(stream[pos : pos + HEADER_SIZE])
        except ProtocolError:
            return out, True
        if opcode not in limits or length > limits[opcode]:
            return out, True
        if len(stream) - pos - HEADER_SIZE < length:
            break
        out.append((opcode, stream[pos + HEADER_SIZE : pos + HEADER_SIZE + length]))
        pos += HEADER_SIZE + length
    return out, False


# --- decoders ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MESSAGE_STRATEGIES, ids=lambda c: c.__name__)
@FUZZ
@given(payload=payloads())
def test_decode_of_any_bytes_is_a_message_or_a_protocol_error(cls, payload):
    try:
        message = cls.decode(payload)
    except ProtocolError:
        return
    assert type(message) is cls
    assert cls.decode(message.encode()[HEADER_SIZE:]) == message  # what it read, it can say
    try:
        via_opcode = decode_message(cls.OPCODE, payload)
    except ProtocolError:
        pytest.fail("decode_message disagrees with decode")
    assert via_opcode == message


@FUZZ
@given(opcode=st.integers(0, 255), payload=st.binary(max_size=100))
def test_decode_message_of_any_opcode(opcode, payload):
    try:
        message = decode_message(opcode, payload)
    except ProtocolError:
        return
    assert opcode in MESSAGES and type(message) is MESSAGES[opcode]


@pytest.mark.parametrize("cls", MESSAGE_STRATEGIES, ids=lambda c: c.__name__)
@FUZZ
@given(data=st.data())
def test_every_message_round_trips(cls, data):
    message = data.draw(MESSAGE_STRATEGIES[cls])
    raw = message.encode()
    assert parse_header(raw[:HEADER_SIZE]) == (cls.OPCODE, len(raw) - HEADER_SIZE)
    assert cls.decode(raw[HEADER_SIZE:]) == message
    assert decode_message(cls.OPCODE, raw[HEADER_SIZE:]) == message


@FUZZ
@given(
    version=st.integers(0, 2**16 - 1).filter(lambda v: v != protocol.DEGGS_PROTOCOL),
    rest=st.binary(max_size=64),
)
def test_a_hello_of_another_version_decodes_to_its_version_alone(version, rest):
    message = Hello.decode(version.to_bytes(2, "big") + rest)
    assert message == Hello(NO_FINGERPRINT, "", bytes(NONCE_SIZE), version)
    assert Hello.decode(message.encode()[HEADER_SIZE:]) == message


@FUZZ
@given(
    stream=streams(), cuts=st.lists(st.integers(0, 500), max_size=12), small_limits=st.booleans()
)
def test_frame_reader_finds_the_same_frames_however_the_bytes_arrive(stream, cuts, small_limits):
    # The coordinator's table (only what a worker sends, RESULT of one chunk) or every opcode.
    limits = (
        {
            protocol.JOB_REQUEST: 24,
            protocol.RESULT: 45,
            LOG_MESSAGE: 1 << 16,
            HELLO: 2 + 8 + 4 + MAX_CONFIG_JSON + NONCE_SIZE,
            AUTH: PROOF_SIZE,
        }
        if small_limits
        else ANY
    )
    expected, fails = reference_frames(stream, limits)
    reader, got, failed = FrameReader(limits), [], False
    try:
        for piece in split(stream, cuts):
            got += reader.feed(piece)
    except ProtocolError:
        failed = True
    assert failed == fails
    assert got == expected[: len(got)]  # frames completed with the bad header's bytes are lost
    if not failed:
        assert got == expected
        consumed = sum(HEADER_SIZE + len(p) for _, p in got)
        assert reader.partial == (consumed < len(stream))
    for opcode, payload in got:
        assert len(payload) <= limits[opcode]


@FUZZ
@given(messages=st.lists(any_message, max_size=8), cuts=st.lists(st.integers(0, 2000), max_size=20))
def test_frame_reader_reassembles_valid_frames_split_anywhere(messages, cuts):
    stream = b"".join(m.encode() for m in messages)
    reader, got = FrameReader(ANY), []
    for piece in split(stream, cuts):
        got += reader.feed(piece)
    assert [decode_message(*f) for f in got] == messages
    assert not reader.partial


def channel_pair() -> tuple[Channel, Channel]:
    nonces = auth.new_nonce(), auth.new_nonce()
    return (
        Channel.for_worker(SECRET, *nonces, ANY),
        Channel.for_coordinator(SECRET, *nonces, ANY),
    )


writes = st.lists(st.lists(any_message, min_size=1, max_size=3), min_size=1, max_size=5)


def sealed_writes(sender: Channel, messages: list[list]) -> list[bytes]:
    """Each write's messages sealed as one write (a record)."""
    return [sender.seal(b"".join(m.encode() for m in write)) for write in messages]


@FUZZ
@given(messages=writes, cuts=st.lists(st.integers(0, 2000)))
def test_sealed_writes_open_in_order_however_the_bytes_arrive(messages, cuts):
    worker, coordinator_side = channel_pair()
    stream = b"".join(sealed_writes(worker, messages))
    got = []
    for piece in split(stream, cuts):
        got += coordinator_side.feed(piece)
    assert [decode_message(*f) for f in got] == [m for write in messages for m in write]
    assert not coordinator_side.partial


@FUZZ
@given(messages=writes, data=st.data())
def test_any_change_to_sealed_writes_fails_their_authentication(messages, data):
    """A byte changed, a record dropped, repeated or swapped: the first record that
    differs from what was sealed fails, and only what came before it is handed on."""
    worker, coordinator_side = channel_pair()
    records = sealed_writes(worker, messages)
    change = data.draw(st.sampled_from(["flip", "drop", "repeat", "swap"]))
    i = data.draw(st.integers(0, len(records) - 1))
    tampered = list(records)
    if change == "flip":
        record = bytearray(records[i])
        record[data.draw(st.integers(0, len(record) - 1))] ^= data.draw(st.integers(1, 255))
        tampered[i] = bytes(record)
    elif change == "drop":
        del tampered[i]
    elif change == "repeat":
        tampered.insert(i, records[i])
    else:
        j = data.draw(st.integers(0, len(records) - 1))
        tampered[i], tampered[j] = tampered[j], tampered[i]
    opened, refused = [], False
    try:
        opened += coordinator_side.feed(b"".join(tampered))
    except ProtocolError:
        refused = True
    sent = [(m.OPCODE, m.encode()[HEADER_SIZE:]) for write in messages for m in write]
    assert opened == sent[: len(opened)]  # a prefix of what was sent, in order
    # Unchanged (a record swapped with itself), or cut short: that the peer ends the
    # stream early is no forgery (its connection just closes). Anything else is refused,
    # or waits unopened for bytes that cannot come (a length made longer).
    if change == "drop" and i == len(records) - 1:
        assert len(opened) == len(sent) - len(messages[-1]) and not refused
    elif tampered != records:
        assert refused or coordinator_side.partial


@FUZZ
@given(opcode=st.sampled_from(sorted(OPCODE_NAMES)), payload=st.binary(max_size=100))
def test_bytes_not_sealed_by_the_peer_never_come_out(opcode, payload):
    """An unmarked frame waits for its record's tag; a marked one (the tag being its
    last 16 bytes) fails it."""
    _, coordinator_side = channel_pair()
    assert coordinator_side.feed(frame(opcode, payload)) == []
    assert coordinator_side.partial
    _, coordinator_side = channel_pair()
    with pytest.raises(ProtocolError, match="failed authentication|shorter than a tag"):
        coordinator_side.feed(frame(opcode | SEALED, payload))


@settings(FUZZ, max_examples=100)
@given(stream=streams())
def test_recv_frame_on_any_bytes(stream):
    expected, fails = reference_frames(stream, ANY)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(stream)  # small enough for the socket buffer
        a.shutdown(socket.SHUT_WR)
        got, failed = [], False
        try:
            while (item := recv_frame(b, ANY, wait_s=5, frame_s=5)) is not None:
                got.append(item)
        except ProtocolError:
            failed = True
    consumed = sum(HEADER_SIZE + len(p) for _, p in expected)
    assert got == expected
    assert failed == (fails or consumed < len(stream))  # a half frame then EOF is an error


@FUZZ
@given(text=st.text())
def test_printable_leaves_no_control_characters(text):
    out = protocol.printable(text)
    assert out.isprintable() and "\n" not in out and "\r" not in out and "\x1b" not in out


# --- config, ternary, checkpoint -----------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**50), 10**50),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
DEFAULTS = Config().to_dict()


@st.composite
def config_like(draw):
    """A dict shaped like a config: known tables and keys, values near and far from sane."""
    out = {}
    for table in draw(st.lists(st.sampled_from(sorted(DEFAULTS)), unique=True, max_size=4)):
        keys = draw(st.lists(st.sampled_from(sorted(DEFAULTS[table])), unique=True, max_size=4))
        values = {}
        for key in keys:
            default = DEFAULTS[table][key]
            values[key] = draw(
                st.one_of(
                    st.just(default),
                    json_values,
                    st.integers(-(2**40), 2**40),
                    st.floats(-1e9, 1e9),
                    st.lists(st.tuples(st.integers(-5, 500), st.floats(-2, 2)), max_size=4),
                    st.lists(st.lists(json_scalars, max_size=3), max_size=3),
                )
            )
        out[table] = values
    if draw(st.integers(0, 9)) == 0:
        out[draw(st.text(max_size=8))] = draw(json_values)
    return out


def check_from_json(text: str):
    """Config.from_json gives a Config, which round-trips, or raises ConfigError; nothing else."""
    try:
        config = Config.from_json(text)
    except ConfigError:
        return None
    assert isinstance(config, Config) and len(config.fingerprint()) == 8
    assert Config.from_json(config.to_json()) == config
    return config


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=300),
        st.text(alphabet='[]{}":,.-+eE0123456789 \\ntrufalsNIy', max_size=300),
    )
)
def test_config_from_random_text(text):
    check_from_json(text)


@FUZZ
@given(value=st.one_of(json_values, config_like()))
def test_config_from_random_json(value):
    check_from_json(json.dumps(value))  # NaN and Infinity come out as such


@settings(FUZZ, max_examples=100)
@given(value=config_like())
def test_config_from_a_config_with_some_values_changed(value):
    merged = {
        t: {**DEFAULTS.get(t, {}), **v} if isinstance(v, dict) else v for t, v in value.items()
    }
    check_from_json(json.dumps({**DEFAULTS, **merged}))


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"a":' * 50_000 + "1" + "}" * 50_000,
        '{"model":' * 5 + "{}" + "}" * 5,
        '{"optimizer":{"lr_schedule":[[[[[0]]]]]}}',
        "9" * 100_000,
        '{"model":{"hidden_dim":' + "9" * 5000 + "}}",
        '{"model":{"hidden_dim":1' + "0" * 40 + "}}",
        '{"softmax":{"exp_scale":NaN}}',
        '{"softmax":{"exp_scale":-Infinity}}',
        '{"training":{"seed":-1}}',
        '{"training":{"population_size":1e3}}',
        '{"optimizer":{"lr_schedule":[]}}',
        '{"optimizer":{"lr_schedule":[[0,0.5],[0,0.5]]}}',
        '{"optimizer":{"lr_schedule":[[true,0.5]]}}',
        '{"noise":{"init_distribution":"\\ud800"}}',
        "\ufffd" * 1000,
        b'{"model":{\xff\xfe}}'.decode("utf-8", "replace"),
        '"' + "\\\\" * 1000,
        "",
        "null",
        "[]",
        '{"model":[]}',
        "x" * (64 * 1024 + 1),
    ],
    ids=lambda t: repr(t[:30]),
)
def test_config_from_adversarial_text(text):
    assert check_from_json(text) is None


@pytest.mark.parametrize(
    "text", ['{"softmax":{"exp_scale":1e999}}', '{"optimizer":{"lr_schedule":[[0,1e400]]}}']
)
def test_config_from_json_refuses_an_overflowing_number(text):
    with pytest.raises(ConfigError):
        Config.from_json(text)


def test_config_from_json_scans_escaped_quotes_in_one_pass():
    # An unterminated string of escaped quotes once took a backtracking regex 15 s at
    # 64 KiB, blocking the coordinator's event loop; the one-pass scan reads it at once.
    text = '"' + '\\"' * 32767
    with pytest.raises(ConfigError, match="malformed"):
        Config.from_json(text)


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=64),
        st.lists(st.sampled_from([-1, 0, 1]), max_size=200).map(pack_trits),
        mutated(st.lists(st.sampled_from([-1, 0, 1]), max_size=200).map(pack_trits)),
    ),
    count=st.integers(0, 400),
)
def test_unpack_trits_raises_only_value_error(data, count):
    try:
        values = unpack_trits(data, count)
    except ValueError:
        return
    assert values.shape == (count,) and values.dtype == np.int32
    assert set(values.tolist()) <= {-1, 0, 1}
    assert pack_trits(values) == data and len(data) == packed_size(count)


@FUZZ
@given(values=st.lists(st.sampled_from([-1, 0, 1]), max_size=300))
def test_trits_round_trip(values):
    assert unpack_trits(pack_trits(values), len(values)).tolist() == values


checkpoints = st.builds(
    lambda step, seed, values: encode_checkpoint(Checkpoint(step, seed, pack_trits(values))),
    u64,
    u64,
    st.lists(st.sampled_from([-1, 0, 1]), max_size=50),
)


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=100), checkpoints, mutated(checkpoints)),
    n_pairs=st.one_of(st.none(), st.integers(0, 60)),
)
def test_decode_checkpoint_raises_only_checkpoint_error(data, n_pairs):
    try:
        checkpoint = decode_checkpoint(data, "fuzz.bin", n_pairs)
    except CheckpointError as e:
        assert str(e).startswith("fuzz.bin: ")
        return
    assert encode_checkpoint(checkpoint) == data
    if n_pairs is not None:
        assert len(unpack_trits(checkpoint.fitness, n_pairs)) == n_pairs


# --- a live coordinator under fire -------------------------------------------------------
#
# Connections are scripted up front from a seeded random.Random and played against one
# coordinator, a few at a time. An honest worker holds chunks 0 and 1 through the barrage.
#
# Only an honest worker may ever have a RESULT counted, so the fuzz keeps to one rule:
# a "deep" connection may be handed chunks (it asks with the right seed and step, and
# with a secret it proves the secret first) but sends RESULTs only for other steps, intact,
# which are ignored; every other connection never asks with the right seed, so no chunk
# is ever handed to it and none of its RESULTs, however well formed, may count. Either
# way the coordinator's transmissions stay 0, with or without a secret.

FUZZ_CONFIG = SMALL.replace(coordinator={"handshake_timeout_s": 0.5, "frame_timeout_s": 0.5})
CLOSE_WITHIN_S = 5.0  # a connection the coordinator must close, closed by then
DRIP_S = 0.05  # between the bytes of a frame sent one at a time
CONTROL = "\x00\x07\x08\x1b[2J\x1b]0;owned\x07\r\n\t\x7f\u2028\u202e"


@dataclass
class Script:
    kind: str
    pieces: list  # bytes to send, one write each
    n_frames: int  # frames, whole or not, the pieces hold
    ending: str  # close | rst | half_close | await_close
    authenticate: bool = False  # prove the secret first (deep connections only)
    must_close: bool = False  # the coordinator must close it on its own
    drip: bool = False


@dataclass
class Outcome:
    script: Script
    received: bytes
    closed_by_peer: bool


class Fuzzer:
    def __init__(self, seed: int, coord, step: int):
        self.r = random.Random(seed)
        self.coord, self.step = coord, step
        self.config = coord.config
        self.secret = coord.secret
        self.fingerprint = self.config.fingerprint()

    # --- single frames (each returns the bytes of one frame, well formed or not) -------

    def text(self, n: int | None = None) -> str:
        r = self.r
        n = r.randrange(0, 300) if n is None else n
        alphabet = "abc xyz|0123456789.:-" + CONTROL + "é中\U0001f600\ufffd"
        return "".join(r.choice(alphabet) for _ in range(n))

    def job_request(self, right=False) -> bytes:
        r = self.r
        if right:
            return JobRequest(seed_of(self.step), self.step, r.getrandbits(64)).encode()
        # Never the right seed: nothing may be handed to this connection.
        last_step = r.choice([self.step, self.step + 1, max(self.step - 1, 0), r.getrandbits(64)])
        return JobRequest(r.getrandbits(64) | 1 << 63, last_step, r.getrandbits(64)).encode()

    def result(self) -> bytes:
        """A RESULT from a connection that holds no chunk: most are well formed, for the
        current step, with the right seed; none may count."""
        r = self.r
        if r.random() < 0.6:  # plausible: only holding the chunk is missing
            chunk = r.randrange(N_CHUNKS)
            return Result(
                seed_of(self.step),
                self.step,
                chunk * CHUNK,
                r.randrange(100),
                r.randrange(-(2**40), 2**40),
                pack_trits(chunk_fitness(self.step, chunk)),
            ).encode()
        step = r.choice(
            [self.step, self.step, self.step + 1, max(self.step - 1, 0), r.getrandbits(64)]
        )
        seed = r.choice([seed_of(self.step), seed_of(step) if step < 8 else 0, r.getrandbits(64)])
        position = r.choice(
            [c * CHUNK for c in range(N_CHUNKS)] + [r.randrange(1, 40), 40, r.getrandbits(64)]
        )
        fitness = r.choice(
            [
                pack_trits(chunk_fitness(step % 8, position // CHUNK % N_CHUNKS)),
                bytes([r.randrange(243, 256)]),
                r.randbytes(r.randrange(0, 5)),
            ]
        )
        return Result(
            seed, step, position, r.getrandbits(64), r.randrange(-(2**63), 2**63), fitness
        ).encode()

    def log_message(self) -> bytes:
        r = self.r
        choice = r.randrange(6)
        if choice == 0:
            return frame(LOG_MESSAGE, r.randbytes(r.randrange(0, 200)))  # not UTF-8
        if choice == 1:
            return LogMessage("Step 99 | Loss: 0.0001" + CONTROL).encode()
        if choice == 2:
            return frame(LOG_MESSAGE, b"x" * r.choice([64 * 1024, 64 * 1024 + 1]))  # at, over
        return LogMessage(self.text()).encode()

    def config_json(self) -> bytes:
        r, ours = self.r, self.config.to_json()
        choice = r.randrange(14)
        if choice == 0:
            return ours.encode()
        if choice == 1:  # another valid config: the refusal lists the differences
            return (
                self.config.replace(
                    model={"seq_len": r.choice([16, 32, 128])},
                    training={"seed": r.randrange(2**32)},
                )
                .to_json()
                .encode()
            )
        if choice == 2:
            return b""
        if choice == 3:
            n = r.choice([5, 50, 1000, 30000])
            return b"[" * n + b"]" * n
        if choice == 4:
            n = r.choice([5, 50, 5000])
            return b'{"a":' * n + b"1" + b"}" * n
        if choice == 5:
            return b"9" * r.choice([41, 1000, 4301, 60000])
        if choice == 6:
            return b'{"model":{"hidden_dim":' + b"9" * r.choice([39, 41, 5000]) + b"}}"
        if choice == 7:
            return r.choice(
                [
                    b'{"softmax":{"exp_scale":NaN}}',
                    b'{"softmax":{"exp_scale":Infinity}}',
                    b'{"optimizer":{"eps":-Infinity}}',
                    b'{"softmax":{"exp_scale":1e999}}',
                    b"NaN",
                    b'{"model":{"seq_len":1.5e308}}',
                ]
            )
        if choice == 8:  # invalid UTF-8
            raw = bytearray(ours.encode())
            for _ in range(r.randrange(1, 10)):
                raw[r.randrange(len(raw))] = r.choice([0xFF, 0xFE, 0xC3, 0x80, 0xED])
            return bytes(raw)
        if choice == 9:  # JSON with characters swapped
            raw = list(ours)
            for _ in range(r.randrange(1, 10)):
                raw[r.randrange(len(raw))] = r.choice('{}[]":,0123456789eE.-\\ ')
            return "".join(raw).encode()
        if choice == 10:
            return json.dumps(self.json_value(4)).encode()
        if choice == 11:
            return r.randbytes(r.randrange(0, 500))
        if choice == 12:  # a config with some values made absurd
            data = json.loads(ours)
            for _ in range(r.randrange(1, 5)):
                table = r.choice(sorted(data))
                key = r.choice(sorted(data[table]))
                data[table][key] = self.json_value(2)
            return json.dumps(data).encode()
        return b"x" * (MAX_CONFIG_JSON + r.choice([0, 1]))  # at the limit, over it

    def json_value(self, depth: int):
        r = self.r
        choice = r.randrange(8 if depth > 0 else 6)
        if choice == 0:
            return None
        if choice == 1:
            return r.choice([True, False])
        if choice == 2:
            return r.choice([0, -1, 1, 2**31, 2**63, -(2**64), 10**39, r.getrandbits(64)])
        if choice == 3:
            return r.choice([0.0, -0.0, 1e-320, 1e308, float("nan"), float("inf"), r.random()])
        if choice in (4, 5):
            return self.text(r.randrange(0, 12))
        if choice == 6:
            return [self.json_value(depth - 1) for _ in range(r.randrange(0, 4))]
        return {
            self.text(r.randrange(0, 6)): self.json_value(depth - 1)
            for _ in range(r.randrange(0, 4))
        }

    def hello(self, valid=False) -> bytes:
        r = self.r
        if valid:
            fingerprint = r.choice([self.fingerprint, NO_FINGERPRINT])
            return Hello(
                fingerprint, r.choice(["", self.config.to_json()]), r.randbytes(NONCE_SIZE)
            ).encode()
        fingerprint = r.choice([self.fingerprint, NO_FINGERPRINT, r.randbytes(8), r.randbytes(8)])
        config = self.config_json()
        announced, version, nonce = len(config), protocol.DEGGS_PROTOCOL, r.randbytes(NONCE_SIZE)
        if r.random() < 0.3:  # the layout broken too
            announced = r.choice(
                [
                    announced + 1,
                    max(announced - 1, 0),
                    r.getrandbits(32),
                    MAX_CONFIG_JSON + 1,
                    announced,
                ]
            )
            version = r.choice([protocol.DEGGS_PROTOCOL, 1, 2, r.getrandbits(16)])
            nonce = r.randbytes(r.choice([NONCE_SIZE, 0, 15, 17]))
        payload = (
            struct.pack(">H", version) + fingerprint + struct.pack(">I", announced) + config + nonce
        )
        return frame(HELLO, payload)

    def auth(self) -> bytes:
        r = self.r
        return frame(AUTH, r.randbytes(r.choice([PROOF_SIZE] * 4 + [0, 31, 33])))

    def snapshot_traffic(self) -> bytes:
        """A digest, an upload nobody asked for or a piece of one: none may count."""
        r = self.r
        choice = r.randrange(4)
        if choice == 0:
            step = r.choice([self.step, max(self.step - 1, 0), self.step + 1, r.getrandbits(64)])
            return Digest(step, r.randbytes(DIGEST_SIZE)).encode()
        if choice == 1:
            size = r.choice([0, 1, 1 << 20, 1 << 40, r.getrandbits(64)])
            return SnapshotHeader(self.step, r.getrandbits(64), size, r.randbytes(32)).encode()
        if choice == 2:
            return SnapshotPart(r.choice([0, 1, r.getrandbits(64)]), r.randbytes(50)).encode()
        return frame(SNAPSHOT_PART, r.randbytes(r.randrange(0, 8)))

    def coordinators_own(self) -> bytes:  # frames only a coordinator sends
        r = self.r
        return r.choice(
            [
                JobResponse(seed_of(self.step), self.step, 0).encode(),
                HelloReply(self.fingerprint, self.config.to_json()).encode(),
                Challenge(r.randbytes(NONCE_SIZE), r.randbytes(PROOF_SIZE)).encode(),
                Goodbye(r.choice(list(Reason)), self.text(20)).encode(),
            ]
        )

    def raw_header(self) -> bytes:
        r = self.r
        magic = r.choice([MAGIC] * 6 + [b"JOBX", b"SSH-", b"GET ", r.randbytes(4)])
        version = r.choice([1] * 6 + [0, 2, 255])
        length = r.choice(
            [0, 1, 24, 44, 45, 46, 1 << 16, (1 << 16) + 31, 2**31, 2**32 - 1, r.getrandbits(32)]
        )
        header = struct.pack(">4sBBI", magic, version, r.randrange(256), length)
        return header + r.randbytes(min(length, r.randrange(0, 60)))

    def garbage(self) -> bytes:
        r = self.r
        return r.choice(
            [
                b"",
                b"\x00" * 10,
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                r.randbytes(r.randrange(1, 200)),
            ]
        )

    def mutate(self, data: bytes) -> bytes:
        r = self.r
        data = bytearray(data)
        for _ in range(r.randrange(1, 4)):
            kind = r.randrange(6)
            if kind == 0 and data:  # bit flips
                for _ in range(r.randrange(1, 9)):
                    data[r.randrange(len(data))] ^= 1 << r.randrange(8)
            elif kind == 1:  # cut
                data = data[: r.randrange(len(data) + 1)]
            elif kind == 2 and len(data) >= HEADER_SIZE:  # announced length
                data[6:10] = struct.pack(
                    ">I",
                    r.choice(
                        [0, len(data), len(data) - HEADER_SIZE + 1, 2**32 - 1, r.getrandbits(32)]
                    ),
                )
            elif kind == 3 and len(data) > 5:  # opcode
                data[5] = r.randrange(256)
            elif kind == 4:  # junk appended or inserted
                at = r.randrange(len(data) + 1)
                data[at:at] = r.randbytes(r.randrange(1, 20))
            elif kind == 5 and len(data) > HEADER_SIZE:  # payload bytes overwritten
                at = r.randrange(HEADER_SIZE, len(data))
                data[at] = r.randrange(256)
        return bytes(data)

    def mutate_payload(self, data: bytes) -> bytes:
        """Payload bytes flipped, cut or added, the header's length kept true: the frame
        reaches the decoders instead of failing as a frame."""
        r = self.r
        payload = bytearray(data[HEADER_SIZE:])
        for _ in range(r.randrange(1, 4)):
            kind = r.randrange(3)
            if kind == 0 and payload:
                for _ in range(r.randrange(1, 9)):
                    payload[r.randrange(len(payload))] ^= 1 << r.randrange(8)
            elif kind == 1:
                del payload[r.randrange(len(payload) + 1) :]
            else:
                at = r.randrange(len(payload) + 1)
                payload[at:at] = r.randbytes(r.randrange(1, 20))
        return frame(data[5], bytes(payload[: self.coord.limits.get(data[5], len(payload))]))

    def any_frame(self, clean=False) -> bytes:
        """One hostile frame for a connection that must never be handed a chunk. A clean
        one is framed right (the header fits the coordinator's limits), so that the frames
        before it are handled before it ends the connection."""
        r = self.r
        if clean:
            maker = r.choices(
                [
                    self.job_request,
                    self.result,
                    self.stale_result,
                    lambda: LogMessage(self.text()).encode(),
                    self.hello,
                    self.auth,
                    self.snapshot_traffic,
                ],
                weights=[3, 6, 2, 2, 3, 2, 2],
            )[0]
        else:
            maker = r.choices(
                [
                    self.job_request,
                    self.result,
                    self.log_message,
                    self.hello,
                    self.auth,
                    self.coordinators_own,
                    self.raw_header,
                    self.garbage,
                    self.snapshot_traffic,
                ],
                weights=[3, 5, 3, 3, 2, 1, 2, 1, 2],
            )[0]
        data = maker()
        # A RESULT with the right seed goes out intact: a mutation could make it a
        # JOB_REQUEST with the right seed, which would hand this connection a chunk.
        if maker not in (self.result, self.stale_result) and r.random() < 0.4:
            data = self.mutate_payload(data) if clean else self.mutate(data)
        return data

    def stale_result(self) -> bytes:
        """A well-formed RESULT for another step: read, checked and ignored, never counted."""
        r = self.r
        steps = [self.step + 1, self.step + 2, r.getrandbits(64)] + [self.step - 1] * (
            self.step > 0
        )
        step = r.choice(steps)
        fitness = r.choice(
            [pack_trits(chunk_fitness(0, r.randrange(N_CHUNKS))), bytes([r.randrange(243, 256)])]
        )
        return Result(
            r.choice([seed_of(self.step), r.getrandbits(64)]),
            step,
            r.randrange(N_CHUNKS) * CHUNK,
            r.getrandbits(64),
            r.randrange(-(2**63), 2**63),
            fitness,
        ).encode()

    def catch_up(self) -> bytes:
        """A JOB_REQUEST from a step behind (served from the history; no seed is checked)."""
        r = self.r
        return JobRequest(
            r.getrandbits(64) | 1 << 63, r.randrange(self.step), r.getrandbits(64)
        ).encode()

    def deep_frame(self, maker=None) -> bytes:
        """A frame the coordinator reads, handles and answers without closing: for a
        connection that may hold chunks, so never a RESULT of the current step."""
        r = self.r
        if maker is None:
            makers = [
                lambda: self.job_request(right=True),
                self.stale_result,
                lambda: LogMessage(self.text()).encode(),
                lambda: frame(LOG_MESSAGE, r.randbytes(r.randrange(0, 200))),
            ]
            makers += [self.catch_up] * 2 * (self.step > 0)
            maker = r.choice(makers)
        return maker()

    def hostile_tail(self) -> bytes:
        """A last frame for a connection that may hold chunks: it gets it dropped (or not),
        and cannot be a RESULT of the current step however it was mutated."""
        r = self.r
        data = r.choice(
            [
                self.mutate(self.deep_frame()),
                self.job_request(),
                self.hello(),
                self.auth(),
                self.coordinators_own(),
                self.raw_header(),
                self.garbage(),
                self.truncated(),
                frame(LOG_MESSAGE, b"x" * (64 * 1024 + 1)),
            ]
        )
        if len(data) > 5 and data[5] == protocol.RESULT:
            data = data[:5] + bytes([LOG_MESSAGE]) + data[6:]
        return data

    def truncated(self) -> bytes:
        data = self.r.choice(
            [
                self.job_request(),
                self.result(),
                self.hello(valid=True),
                self.log_message(),
                self.auth(),
            ]
        )
        return data[: self.r.randrange(1, len(data))]

    # --- whole connections ---------------------------------------------------------------

    def script(self) -> Script:
        r = self.r
        kind = r.choices(
            ["instant", "silent", "garbage", "handshake", "auth_first", "forger", "deep", "stall"],
            weights=[8, 2, 18, 12, 3, 10, 40, 7],
        )[0]
        frames, authenticate, clean = [], False, r.random() < 0.6
        if kind == "garbage":
            frames = [self.any_frame(clean) for _ in range(r.randrange(1, 40))]
        elif kind == "handshake":
            frames = [self.hello(valid=r.random() < 0.3)]
            if r.random() < 0.5:
                frames.append(self.auth())
            frames += [self.any_frame(clean) for _ in range(r.randrange(0, 20))]
        elif kind == "forger":  # a RESULT for a chunk it was never handed
            if r.random() < 0.5:
                frames.append(self.hello(valid=True))
            frames.append(self.result())
            frames += [self.any_frame(clean) for _ in range(r.randrange(0, 10))]
        elif kind == "auth_first":
            frames = [self.auth()] + [self.any_frame(clean) for _ in range(r.randrange(0, 10))]
        elif kind == "deep":
            # Past the handshake (with the secret proven, when there is one), many frames
            # the coordinator must handle one by one, perhaps all of one kind.
            authenticate = self.secret is not None
            if self.secret is None and r.random() < 0.6:
                frames.append(self.hello(valid=True))
            maker = None
            if r.random() < 0.3:
                maker = r.choice(
                    [lambda: self.job_request(right=True), self.stale_result, self.log_message]
                    + [self.catch_up] * (self.step > 0)
                )
            n = r.choice([r.randrange(1, 60), r.randrange(100, 400)])
            frames += [self.deep_frame(maker) for _ in range(n)]
            if r.random() < 0.1:
                frames.insert(r.randrange(len(frames) + 1), self.hello(valid=True))  # again
            if r.random() < 0.5:
                frames.append(self.hostile_tail())
        elif kind == "stall":
            frames = [self.any_frame() for _ in range(r.randrange(0, 6))] + [self.truncated()]
        stream = b"".join(frames)
        script = Script(
            kind, self.fragments(stream, frames), len(frames), "close", authenticate=authenticate
        )
        script.must_close = self.must_close(stream, authenticated=authenticate)
        endings = ["close", "rst"] + ["half_close"] * 2 + ["await_close"] * 4 * script.must_close
        script.ending = r.choice(endings)
        return script

    def drip_script(self) -> Script:
        """A frame sent a byte at a time, slower than frame_timeout_s allows."""
        data = (
            self.hello(valid=True)
            if self.secret is not None
            else self.r.choice([self.job_request(), self.hello(valid=True)])
        )
        n = int(1.5 * self.config.coordinator.frame_timeout_s / DRIP_S) + 1
        assert n < len(data)
        return Script(
            "drip",
            [data[i : i + 1] for i in range(n)],
            1,
            "await_close",
            must_close=True,
            drip=True,
        )

    def fragments(self, stream: bytes, frames: list) -> list:
        r = self.r
        how = r.randrange(3)
        if how == 0 or not stream:
            return [stream] if stream else []
        if how == 1:
            return [f for f in frames if f]
        return [
            p
            for p in split(stream, [r.randrange(len(stream)) for _ in range(r.randrange(1, 20))])
            if p
        ]

    def must_close(self, stream: bytes, authenticated: bool) -> bool:
        """Whether the coordinator must end this connection on its own: an unproven peer
        with a secret, a bad header, an unfinished frame, or no frame at all."""
        if self.secret is not None and not authenticated:
            return True
        reader = FrameReader(self.coord.limits)
        try:
            frames = reader.feed(stream)
        except ProtocolError:
            return True
        return reader.partial or (not frames and not authenticated)


async def _drain(reader: asyncio.StreamReader, into: bytearray) -> None:
    """Read everything the coordinator sends until it closes (or resets) the connection."""
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(1 << 16):
            into += data


async def play(port: int, script: Script, coord) -> Outcome:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()
    drained = None
    try:
        if script.authenticate:
            client = Client(reader, writer)
            await client.hello(coord.config, secret=coord.secret)
            assert not client.received
        drained = asyncio.ensure_future(_drain(reader, received))
        for piece in script.pieces:
            if drained.done():
                break  # the coordinator has closed: nothing more gets through
            try:
                writer.write(piece)
                await writer.drain()
            except ConnectionError:
                break
            if script.drip:
                await asyncio.sleep(DRIP_S)  # the slow peer under test, not a wait for anything
        if script.ending in ("half_close", "await_close"):
            if script.ending == "half_close" and not drained.done():
                with contextlib.suppress(OSError):
                    writer.write_eof()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(drained), CLOSE_WITHIN_S)
        elif script.ending == "rst":
            sock = writer.get_extra_info("socket")
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        closed_by_peer = drained.done()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        if drained is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(drained, CLOSE_WITHIN_S)
    return Outcome(script, bytes(received), closed_by_peer)


def check_outcome(outcome: Outcome, secret) -> None:
    """What a fuzz connection was told: whole, valid frames only, and nothing at all
    beyond a CHALLENGE for a peer that has not proven the secret."""
    script = outcome.script
    where = f"{script.kind} connection ending {script.ending}: {script.pieces[:3]!r}"
    if script.ending in ("half_close", "await_close"):
        assert outcome.closed_by_peer, f"still open after {CLOSE_WITHIN_S} s: {where}"
    reader = FrameReader(ANY)
    messages = [decode_message(*f) for f in reader.feed(outcome.received)]
    allowed = {JOB_RESPONSE, HELLO_REPLY, GOODBYE} | ({CHALLENGE} if secret else set())
    assert {m.OPCODE for m in messages} <= allowed, (messages, where)
    if secret is not None and not script.authenticate:
        # A CHALLENGE, or the refusal of a HELLO laid out by another deggs version (which
        # could not have carried a proof); never a step, a seed or the config.
        assert all(
            isinstance(m, Challenge)
            or (isinstance(m, Goodbye) and m.reason == Reason.PROTOCOL_MISMATCH)
            for m in messages
        ), (messages, where)
        assert len(messages) <= 1, where
    assert sum(isinstance(m, HelloReply) for m in messages) <= 1, where


async def barrage(coord, seed: int, step: int, n_connections: int, parallel: int = 12) -> int:
    """Play n_connections scripted connections (and two drips); return the frames thrown."""
    fuzzer = Fuzzer(seed, coord, step)
    scripts = [fuzzer.script() for _ in range(n_connections)] + [
        fuzzer.drip_script() for _ in range(2)
    ]
    gate = asyncio.Semaphore(parallel)

    async def one(script):
        async with gate:
            outcome = await play(coord.port, script, coord)
        check_outcome(outcome, coord.secret)

    await asyncio.gather(*(one(s) for s in scripts))
    return sum(s.n_frames for s in scripts)


async def until(condition, what: str, timeout: float = 10.0):
    await async_wait_until(condition, timeout, what)


async def finish_step(client: Client, coord, step: int, held: list) -> None:
    """Return `held` jobs' results, take and return the rest of the step's chunks in
    whatever order they come, and wait for the step's update (a deggs worker's request
    is held until the update is ready; WAIT only if that takes more than HOLD_S)."""
    for job in held:
        await client.result(job)
    deadline = time.monotonic() + 10
    while not (job := await client.request(step)).data:
        assert time.monotonic() < deadline, f"step {step} still not sealed after 10 s"
        if job.data_position != protocol.WAIT:
            assert (job.last_step, job.seed) == (step, seed_of(step))
            await client.result(job)
    assert job.last_step == step + 1 and job.data == pack_trits(step_fitness(step))
    await until(lambda: coord.state.step == step + 1, f"step {step + 1}")
    assert coord.history[step] == pack_trits(step_fitness(step))


def check_untouched(coord, step: int, held: set) -> None:
    """After a barrage: the same step, nothing counted, only the honest worker's chunks out."""
    s = coord.state
    assert (s.step, s.seed) == (step, seed_of(step))
    assert s.transmissions == 0 and s.n_done == 0 and s.packed == [None] * s.n_chunks
    assert s.sum_loss == 0 and s.updates_total == 0 and not s.sealing
    assert set(s.in_progress) == held and set(s.holders) == held
    assert all(len(h) == 1 for h in s.holders.values())
    assert sorted(s.pending) == sorted(set(range(N_CHUNKS)) - held)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "secret"])
def test_coordinator_survives_a_barrage_and_still_trains(secret, caplog):
    caplog.set_level(logging.WARNING)
    thrown = []

    async def go():
        async with coordinator(FUZZ_CONFIG, secret=secret) as coord:
            honest = await Client.connect(coord)
            await honest.hello(secret=secret)
            held = [await honest.request(0) for _ in range(2)]
            assert [j.data_position for j in held] == [0, CHUNK]

            thrown.append(await barrage(coord, seed=1, step=0, n_connections=180))
            await until(lambda: len(coord.peers) == 1, "the fuzz connections to close")
            check_untouched(coord, 0, held={0, 1})
            await finish_step(honest, coord, 0, held)

            # Again a step later: now stale RESULTs and catch-up requests have a history.
            thrown.append(await barrage(coord, seed=2, step=1, n_connections=60))
            await until(lambda: len(coord.peers) == 1, "the fuzz connections to close")
            check_untouched(coord, 1, held=set())
            # A worker that joins now is served: it catches up, then trains step 1.
            late = await Client.connect(coord)
            await late.hello(secret=secret)
            catch_up = await late.request(0)
            assert (catch_up.last_step, catch_up.seed) == (1, seed_of(1))
            assert catch_up.data == pack_trits(step_fitness(0))
            await finish_step(late, coord, 1, [])
            assert coord.state.step == 2 and not coord.ended.is_set()
            # Both stay connected: see test_stop_survives_a_worker_that_just_left.

    asyncio.run(asyncio.wait_for(go(), 55))
    assert sum(thrown) >= 1500, thrown
    dropped = [
        r.getMessage()
        for r in caplog.records
        if r.name == "deggs.runtime.coordinator"
        and r.levelno == logging.WARNING
        and ("dropping" in r.getMessage() or "closing" in r.getMessage())
    ]
    # Unproven peers' failures come summarised, a line a second of each kind with a count
    # (the last second's said at the stop): the barrage did reach the coordinator's checks.
    counted = [re.search(r"\((\d+) such from unproven peers", line) for line in dropped]
    assert sum(int(m.group(1)) if m else 1 for m in counted) >= 100, dropped


# --- found by fuzzing ----------------------------------------------------------------------
#
# Peer.close_with() sends a GOODBYE and then half-closes with transport.write_eof(). When
# the peer has already closed its socket, the GOODBYE's send draws a RST (at once, over
# loopback) and write_eof()'s shutdown(SHUT_WR) raises OSError ENOTCONN, which nothing
# catches. Inside data_received asyncio swallows an OSError silently; elsewhere it escapes.


def test_stop_survives_a_worker_that_just_left(caplog):
    """stop() says GOODBYE to a welcomed worker that has just closed: it must finish,
    forget the peer and log no error (the autouse fixture fails on one)."""
    caplog.set_level(logging.INFO, logger="deggs")

    async def go():
        async with coordinator() as coord:
            worker = await Client.connect(coord)
            await worker.hello()  # welcomed: stop() says GOODBYE to it
            await worker.close()  # gone before the coordinator has read the EOF
        return coord

    coord = asyncio.run(asyncio.wait_for(go(), 10))
    assert not coord.peers and coord._server is None
    assert "stopped at step 0" in caplog.text


def test_a_refusal_to_a_peer_that_left_during_an_async_reply():
    config = SMALL.replace(coordinator={"max_history": 1})
    unhandled = []

    async def go():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx))
        async with coordinator(config) as coord:  # no save_dir: step 0 is then gone
            trainer = await Client.connect(coord)
            await finish_step(trainer, coord, 0, [])
            await finish_step(trainer, coord, 1, [])
            loop = asyncio.get_running_loop()
            with socket.create_connection(("127.0.0.1", coord.port)) as s:
                s.sendall(Hello(SMALL.fingerprint()).encode())
                s.setblocking(False)
                assert isinstance(
                    decode_message(*FrameReader(ANY).feed(await loop.sock_recv(s, 1 << 16))[0]),
                    HelloReply,
                )
                s.setblocking(True)
                # The catch-up from step 0 looks for it on disk (a coroutine): HISTORY_GONE.
                s.sendall(JobRequest(seed_of(0), 0).encode())
            await until(lambda: len(coord.peers) == 1, "the refused peer to be forgotten", 3)
            await trainer.request(2)  # keeps the trainer's connection open until stop()

    asyncio.run(asyncio.wait_for(go(), 20))
    assert not unhandled, [ctx.get("message") for ctx in unhandled]
