import hashlib
import hmac
import socket
import struct
import threading
import time

import pytest

from deggs.runtime.channel import Channel, channel_keys
from deggs.runtime.protocol import (
    HELLO,
    JOB_REQUEST,
    LOG_MESSAGE,
    OPCODE_NAMES,
    RESULT,
    WAIT,
    Auth,
    Challenge,
    FrameReader,
    Goodbye,
    Hello,
    HelloReply,
    JobRequest,
    JobResponse,
    LogMessage,
    NotOurProtocol,
    ProtocolError,
    Reason,
    Result,
    decode_message,
    parse_header,
    printable,
    recv_frame,
    send_frame,
)

LIMITS = {JOB_REQUEST: 24, RESULT: 100, LOG_MESSAGE: 100}


def header(opcode: int, length: int) -> bytes:
    return b"JOBS\x01" + bytes([opcode]) + length.to_bytes(4, "big")


def u64(n):
    return n.to_bytes(8, "big")


def u32(n):
    return n.to_bytes(4, "big")


def test_header_bytes():
    assert header(0, 24) == bytes.fromhex("4a4f4253 01 00 00000018".replace(" ", ""))
    assert parse_header(bytes.fromhex("4a4f425301020000001c")) == (2, 28)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"JOBX\x01\x00\x00\x00\x00\x18", "bad magic"),
        (b"JOBS\x02\x00\x00\x00\x00\x18", "version 2"),
        (b"JOBS\x01\x00\x00\x00", "10 bytes"),
    ],
)
def test_parse_header_rejects(raw, message):
    with pytest.raises(ProtocolError, match=message):
        parse_header(raw)


def test_another_service_is_told_apart():
    with pytest.raises(NotOurProtocol, match="bad magic b'SSH-'"):
        parse_header(b"SSH-2.0-Op")


def test_job_request():
    raw = header(0, 24) + u64(42) + u64(7) + u64(0)
    assert JobRequest(42, 7, 0).encode() == raw
    assert JobRequest.decode(raw[10:]) == JobRequest(42, 7, 0)
    with pytest.raises(ProtocolError, match="JOB_REQUEST payload is 23 bytes, needs at least 24"):
        JobRequest.decode(raw[10:-1])


def test_result_with_negative_sum_loss():
    data = b"\x01\xf2\x00"
    raw = (
        header(1, 44 + 3)
        + u64(0xDEADBEEF)
        + u64(3)
        + u64(40)
        + u64(1234)
        + (2**64 - 5).to_bytes(8, "big")
        + u32(3)
        + data
    )
    msg = Result(0xDEADBEEF, 3, 40, 1234, -5, data)
    assert msg.encode() == raw
    assert Result.decode(raw[10:]) == msg


def test_result_rejects_short_payloads():
    good = Result(1, 2, 3, 4, 5, b"abcd").encode()[10:]
    with pytest.raises(ProtocolError, match="RESULT payload is 43 bytes"):
        Result.decode(good[:43])
    with pytest.raises(ProtocolError, match="announces 4 bytes of fitness but carries 3"):
        Result.decode(good[:-1])


def test_job_response_chunk_catch_up_and_wait():
    chunk = header(2, 28) + u64(99) + u64(5) + u64(20) + u32(0)
    assert JobResponse(99, 5, 20).encode() == chunk
    assert JobResponse.decode(chunk[10:]) == JobResponse(99, 5, 20, b"")

    catch_up = header(2, 30) + u64(99) + u64(1) + u64(0) + u32(2) + b"\x05\x07"
    assert JobResponse(99, 1, 0, b"\x05\x07").encode() == catch_up
    assert JobResponse.decode(catch_up[10:]).data == b"\x05\x07"

    wait = JobResponse.decode(u64(0) + u64(0) + b"\xff" * 8 + u32(0))
    assert wait.data_position == WAIT == 2**64 - 1 and wait.is_wait
    with pytest.raises(ProtocolError, match="announces 2 bytes of fitness but carries 1"):
        JobResponse.decode(catch_up[10:-1])
    with pytest.raises(ProtocolError, match="JOB_RESPONSE payload is 27 bytes"):
        JobResponse.decode(chunk[10:-1])


def test_log_message_replaces_bad_utf8():
    assert LogMessage("héllo\n").encode() == header(3, 7) + "héllo\n".encode()
    assert LogMessage.decode(b"ok \xff").text == "ok \ufffd"


def test_hello():
    fp, nonce = bytes(range(1, 9)), bytes(range(16))
    raw = header(4, 2 + 8 + 4 + 2 + 16) + b"\x00\x05" + fp + u32(2) + b"{}" + nonce
    assert Hello(fp, "{}", nonce).encode() == raw
    assert Hello.decode(raw[10:]) == Hello(fp, "{}", nonce, 5)
    with pytest.raises(ProtocolError, match="HELLO payload ends inside nonce"):
        Hello.decode(raw[10:-1])
    with pytest.raises(ProtocolError, match="inside fingerprint"):
        Hello.decode(b"\x00\x05\x00")
    with pytest.raises(ProtocolError, match="config of 70000 bytes exceeds 65536"):
        Hello.decode(b"\x00\x05" + fp + u32(70000))
    with pytest.raises(ValueError, match="8 bytes"):
        Hello(b"short").encode()
    # another version's HELLO is read only as far as its version
    assert Hello.decode(b"\x00\x02" + fp).deggs_protocol == 2


def test_hello_reply():
    fp = b"\xaa" * 8
    raw = header(5, 8 + 4 + 2) + fp + u32(2) + b"{}"
    assert HelloReply(fp, "{}").encode() == raw
    assert HelloReply.decode(raw[10:]) == HelloReply(fp, "{}")
    with pytest.raises(ProtocolError, match="HELLO_REPLY payload ends inside config"):
        HelloReply.decode(raw[10:-1])


def test_challenge_auth_goodbye():
    nonce, proof = b"n" * 16, b"p" * 32
    assert Challenge(nonce, proof).encode() == header(6, 48) + nonce + proof
    assert Challenge.decode(nonce + proof) == Challenge(nonce, proof)
    assert Auth(proof).encode() == header(7, 32) + proof
    assert Auth.decode(proof) == Auth(proof)
    with pytest.raises(ProtocolError, match="AUTH payload ends inside proof"):
        Auth.decode(proof[:31])
    bye = Goodbye(Reason.HISTORY_GONE, "gone")
    assert bye.encode() == header(8, 5) + b"\x12gone"
    assert Goodbye.decode(b"\x12gone") == bye and bye.reason.permanent
    assert not Reason.FINISHED.permanent and not Reason.DISK_FAILURE.permanent
    with pytest.raises(ProtocolError, match="unknown reason 99"):
        Goodbye.decode(b"\x63")


def test_printable_escapes_control_characters():
    assert printable("Step 1\n\x1b[31mred\r\t") == "Step 1\\n\\x1b[31mred\\r\\t"
    assert printable("héllo ✓") == "héllo ✓"


def test_decode_message_dispatches_and_rejects_unknown_opcodes():
    assert decode_message(JOB_REQUEST, u64(1) + u64(2) + u64(3)) == JobRequest(1, 2, 3)
    assert isinstance(decode_message(HELLO, Hello(bytes(8)).encode()[10:]), Hello)
    with pytest.raises(ProtocolError, match="unknown opcode 99"):
        decode_message(99, b"")


# --- framing over streams and sockets ----------------------------------------------------


def test_frame_reader_cuts_frames_wherever_the_bytes_split():
    two = JobRequest(1, 2, 3).encode() + LogMessage("x").encode()
    for cut in range(len(two) + 1):
        reader = FrameReader(LIMITS)
        frames = reader.feed(two[:cut])
        assert reader.partial == (0 < cut < len(two) and cut != 34)  # 34: between the frames
        frames += reader.feed(two[cut:])
        assert frames == [(JOB_REQUEST, u64(1) + u64(2) + u64(3)), (LOG_MESSAGE, b"x")]
        assert not reader.partial


@pytest.mark.parametrize(
    "data, message",
    [
        (header(RESULT, 1000), "RESULT payload of 1000 bytes exceeds the limit of 100"),
        (header(2, 0), "unexpected JOB_RESPONSE"),
        (header(99, 0), "unknown opcode 99"),
        (b"GET / HTTP/1.1\r\n", "bad magic"),
    ],
)
def test_frame_reader_refuses_from_the_header_alone(data, message):
    with pytest.raises(ProtocolError, match=message):
        FrameReader(LIMITS).feed(data)


def test_blocking_socket_helpers():
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, Result(1, 2, 3, 4, -1, b"\x00").encode())
        send_frame(a, header(0, 24) + b"ab")
        opcode, payload = recv_frame(b, LIMITS)
        assert opcode == RESULT and Result.decode(payload).sum_loss == -1
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match="disconnected mid-frame.*2 of 24 payload"):
            recv_frame(b, LIMITS)
    c, d = socket.socketpair()
    with c, d:
        send_frame(c, header(1, 5000))
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            recv_frame(d, LIMITS)
        c.close()
        assert recv_frame(d, LIMITS) is None


def test_recv_frame_deadlines_are_per_frame_not_per_read():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(TimeoutError):  # nothing comes
            recv_frame(b, LIMITS, wait_s=0.1)
        frame = JobRequest(1, 2, 3).encode()

        def drip():  # each byte within any per-read timeout, the whole far too slow
            for byte in frame:
                try:
                    a.send(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.05)  # the slow peer under test, not a wait for anything

        threading.Thread(target=drip, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="took too long"):
            recv_frame(b, LIMITS, wait_s=1, frame_s=0.3)
        assert time.monotonic() - started < 0.6


def test_evaluation():
    import struct

    from deggs.runtime.protocol import Evaluation

    ev = Evaluation(step=7, windows=4, tokens=256, sum_loss=-3, nats=12.5, text_bytes=300)
    body = u64(7) + u32(4) + u64(256) + struct.pack(">q", -3) + struct.pack(">d", 12.5) + u64(300)
    assert ev.encode() == header(9, 44) + body
    assert Evaluation.decode(body) == ev
    with pytest.raises(ProtocolError, match="EVALUATION payload is 43 bytes, needs at least 44"):
        Evaluation.decode(body[:-1])
    nan = body[:28] + struct.pack(">d", float("nan")) + body[36:]
    with pytest.raises(ProtocolError, match="impossible figures"):
        Evaluation.decode(nan)


def f64(x):
    return struct.pack(">d", x)


def health_entry_bytes(name: bytes, *figures) -> bytes:
    return bytes([len(name)]) + name + b"".join(f64(x) for x in figures)


def test_health():
    from deggs.runtime.protocol import Health, HealthEntry

    report = Health(
        5,
        (
            HealthEntry("layers.0.w_q", -0.25, 8.5, 0.125, 4.75),
            HealthEntry("act.final_norm", 3.0, 20.0, 0.0, 6.0),
        ),
    )
    body = (
        u64(5)
        + b"\x00\x02"
        + health_entry_bytes(b"layers.0.w_q", -0.25, 8.5, 0.125, 4.75)
        + health_entry_bytes(b"act.final_norm", 3.0, 20.0, 0.0, 6.0)
    )
    assert report.encode() == header(10, len(body)) + body
    assert Health.decode(body) == report
    assert decode_message(10, body) == report
    with pytest.raises(ValueError, match="cannot be sent"):
        Health(0, (HealthEntry("w q", 0, 0, 0, 0),)).encode()


ENTRY = health_entry_bytes(b"w_q", 0.0, 1.0, 0.5, 2.0)


@pytest.mark.parametrize(
    "body, message",
    [
        (u64(1) + b"\x00\x00", "HEALTH with 0 entries"),
        (u64(1) + b"\x10\x01" + ENTRY, "HEALTH with 4097 entries"),
        (u64(1) + b"\x00\x02" + ENTRY, "HEALTH payload ends inside name length"),
        (u64(1) + b"\x00\x01" + ENTRY[:-1], "HEALTH payload ends inside figures"),
        (u64(1) + b"\x00\x01" + ENTRY + b"\x00", "1 bytes after its last entry"),
        (u64(1) + b"\x00\x01" + b"\x00" + ENTRY[4:], "entry 0 has a name of 0 bytes"),
        (u64(1) + b"\x00\x01" + b"\x31" + b"a" * 49 + ENTRY[4:], "a name of 49 bytes"),
        (u64(1) + b"\x00\x01" + health_entry_bytes(b"w\nq", 0, 1, 0, 2), r"name b'w\\nq'"),
        (u64(1) + b"\x00\x01" + health_entry_bytes(b"w\xffq", 0, 1, 0, 2), "name b'w"),
        (u64(1) + b"\x00\x02" + ENTRY + ENTRY, "names w_q twice"),
        (u64(1) + b"\x00\x01" + health_entry_bytes(b"w", float("nan"), 1, 0, 2), "mean nan"),
        (u64(1) + b"\x00\x01" + health_entry_bytes(b"w", 200, 1, 0, 2), "mean 200.0 outside"),
        (u64(1) + b"\x00\x01" + health_entry_bytes(b"w", 0, -1, 0, 2), "std -1.0 outside"),
        (u64(1) + b"\x00\x01" + health_entry_bytes(b"w", 0, 1, 1.5, 2), "saturation 1.5"),
        (u64(1) + b"\x00\x01" + health_entry_bytes(b"w", 0, 1, 0, float("inf")), "entropy inf"),
        (u64(1) + b"\x00\x01" + health_entry_bytes(b"w", 0, 1, 0, 8.5), "entropy 8.5 outside"),
    ],
)
def test_malformed_health_is_refused(body, message):
    from deggs.runtime.protocol import Health

    with pytest.raises(ProtocolError, match=message):
        Health.decode(body)


def test_health_frames_are_bounded_by_the_models_entries():
    from deggs.runtime.protocol import HEALTH, limits_from_worker

    # step and count, then per entry a length byte, a name of up to 48 and four f64
    assert limits_from_worker(1, health_entries=60)[HEALTH] == 10 + 60 * (1 + 48 + 32)
    assert limits_from_worker(1)[HEALTH] == 10 + 4096 * 81
    with pytest.raises(ProtocolError, match="HEALTH payload of 4871 bytes exceeds the limit"):
        FrameReader(limits_from_worker(1, health_entries=60)).feed(header(10, 4871))


def test_a_sealed_write_is_its_frames_with_the_last_marked_and_a_running_tag():
    """channel.py's wire format, built by hand: HKDF-SHA256 keys per direction; a write
    is a record whose last frame has opcode bit 0x80 and ends in BLAKE2s-128 over every
    record so far on the connection (less tags), counted in that frame's length."""
    secret, wn, cn = b"s" * 32, bytes(range(16)), bytes(range(16, 32))
    prk = hmac.new(b"deggs frames 1\0" + wn + cn, secret, hashlib.sha256).digest()
    up = hmac.new(prk, b"worker to coordinator\x01", hashlib.sha256).digest()
    down = hmac.new(prk, b"coordinator to worker\x01", hashlib.sha256).digest()
    assert channel_keys(secret, wn, cn) == (up, down)

    def tag(key, *records):
        return hashlib.blake2s(b"".join(records), key=key, digest_size=16).digest()

    limits = dict.fromkeys(OPCODE_NAMES, 1 << 20)
    worker = Channel.for_worker(secret, wn, cn, limits)
    coordinator = Channel.for_coordinator(secret, wn, cn, limits)
    request, log = u64(1) + u64(2) + u64(0), b"hi"
    sealed = worker.seal(JobRequest(1, 2).encode() + LogMessage("hi").encode())
    first = header(0, 24) + request + header(0x80 | 3, 2 + 16) + log
    assert sealed == first + tag(up, first)
    # The receiver holds the request until the record's tag is in, byte by byte too.
    assert [coordinator.feed(sealed[i : i + 1]) for i in range(len(sealed) - 1)] == [[]] * (
        len(sealed) - 1
    )
    assert coordinator.feed(sealed[-1:]) == [(0, request), (3, log)]
    second = header(0x80 | 0, 24 + 16) + request
    assert worker.seal(JobRequest(1, 2).encode()) == second + tag(up, first, second)

    reply = coordinator.seal(JobResponse(1, 2, 3).encode())
    body = u64(1) + u64(2) + u64(3) + u32(0)
    assert reply == header(0x80 | 2, len(body) + 16) + body + tag(down, reply[:-16])
    # A payload over channel.BIG bytes is hashed through its SHA-256.
    update = JobResponse(1, 2, 0, bytes(range(256)) * 8)
    big = coordinator.seal(update.encode())
    payload = update.encode()[10:]
    marked = header(0x80 | 2, len(payload) + 16)
    assert big == marked + payload + tag(
        down, reply[:-16], marked + hashlib.sha256(payload).digest()
    )
    assert worker.feed(reply + big) == [(2, body), (2, payload)]
    with pytest.raises(ProtocolError, match=r"a record \(JOB_RESPONSE\) failed authentication"):
        worker.feed(big)  # the same again: a replay


def test_a_write_over_a_record_is_cut_into_records():
    """What a receiver holds unchecked is bounded: unmarked frames end within
    RECORD_BYTES of their record's start, at most RECORD_FRAMES in a record, and a peer
    that sends more is dropped."""
    limits = dict.fromkeys(OPCODE_NAMES, 1 << 20)
    sender = Channel.for_worker(b"s" * 32, bytes(16), bytes(16), limits)
    receiver = Channel.for_coordinator(b"s" * 32, bytes(16), bytes(16), limits)
    logs = [LogMessage("x" * 1000).encode() for _ in range(200)]  # 202,000 bytes
    sealed = sender.seal(b"".join(logs))
    marked = sealed.count(bytes([0x80 | 3, 0, 0, 0x03, 0xF8]))  # opcode, length 1000 + 16
    assert marked == 4  # 65 frames of 1,010 bytes, then a tag, ...
    assert receiver.feed(sealed) == [(3, b"x" * 1000)] * 200
    empty = sender.seal(LogMessage("").encode() * 130)
    assert empty.count(b"JOBS\x01\x83") == 3  # records of 64, 64 and 2 frames
    for flood in (b"".join(logs), LogMessage("").encode() * 64):  # bytes, or frames
        receiver = Channel.for_coordinator(b"s" * 32, bytes(16), bytes(16), limits)
        with pytest.raises(ProtocolError, match="65536 bytes or 63 frames without a tag"):
            receiver.feed(flood)
