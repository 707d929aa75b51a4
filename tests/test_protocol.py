import asyncio
import socket

import pytest

from deggs.protocol import (HELLO, JOB_REQUEST, NO_FINGERPRINT, RESULT, WAIT, Hello,
                            HelloReply, JobRequest, JobResponse, LogMessage, ProtocolError,
                            Result, decode_message, parse_header, read_frame, recv_frame,
                            send_frame)


def header(opcode: int, length: int) -> bytes:
    return b"JOBS\x01" + bytes([opcode]) + length.to_bytes(4, "big")


def u64(n):
    return n.to_bytes(8, "big")


def u32(n):
    return n.to_bytes(4, "big")


def test_header_bytes():
    assert header(0, 24) == bytes.fromhex("4a4f4253 01 00 00000018".replace(" ", ""))
    assert parse_header(bytes.fromhex("4a4f425301020000001c")) == (2, 28)


@pytest.mark.parametrize("raw, message", [
    (b"JOBX\x01\x00\x00\x00\x00\x18", "bad magic"),
    (b"JOBS\x02\x00\x00\x00\x00\x18", "version 2"),
    (b"JOBS\x01\x00\x00\x00", "10 bytes"),
])
def test_parse_header_rejects(raw, message):
    with pytest.raises(ProtocolError, match=message):
        parse_header(raw)


def test_job_request():
    raw = header(0, 24) + u64(42) + u64(7) + u64(0)
    assert JobRequest(42, 7, 0).encode() == raw
    assert JobRequest.decode(raw[10:]) == JobRequest(42, 7, 0)
    with pytest.raises(ProtocolError, match="JOB_REQUEST payload is 23 bytes, needs at least 24"):
        JobRequest.decode(raw[10:-1])


def test_result_with_negative_sum_loss():
    data = b"\x01\xf2\x00"
    raw = (header(1, 44 + 3) + u64(0xDEADBEEF) + u64(3) + u64(40) + u64(1234)
           + (2**64 - 5).to_bytes(8, "big") + u32(3) + data)
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
    fp = bytes(range(1, 9))
    raw = header(4, 2 + 8 + 4 + 2) + b"\x00\x01" + fp + u32(2) + b"{}"
    assert Hello(fp, "{}").encode() == raw
    assert Hello.decode(raw[10:]) == Hello(fp, "{}", 1)
    empty = header(4, 14) + b"\x00\x01" + bytes(8) + u32(0)
    assert Hello(NO_FINGERPRINT).encode() == empty
    with pytest.raises(ProtocolError, match="HELLO payload ends inside config"):
        Hello.decode(raw[10:-1])
    with pytest.raises(ProtocolError, match="inside fingerprint"):
        Hello.decode(b"\x00\x01\x00")
    with pytest.raises(ValueError, match="8 bytes"):
        Hello(b"short").encode()


def test_hello_reply():
    fp = b"\xaa" * 8
    raw = (header(5, 1 + 8 + 4 + 2 + 4 + 2) + b"\x00" + fp + u32(2) + b"{}" + u32(2) + b"no")
    msg = HelloReply(False, fp, "{}", "no")
    assert msg.encode() == raw
    assert HelloReply.decode(raw[10:]) == msg
    assert HelloReply.decode(HelloReply(True, fp, "", "").encode()[10:]).accepted
    with pytest.raises(ProtocolError, match="HELLO_REPLY payload ends inside message"):
        HelloReply.decode(raw[10:-1])
    with pytest.raises(ProtocolError, match="ends inside accepted"):
        HelloReply.decode(b"")


def test_decode_message_dispatches_and_rejects_unknown_opcodes():
    assert decode_message(JOB_REQUEST, u64(1) + u64(2) + u64(3)) == JobRequest(1, 2, 3)
    assert isinstance(decode_message(HELLO, Hello(bytes(8)).encode()[10:]), Hello)
    with pytest.raises(ProtocolError, match="unknown opcode 9"):
        decode_message(9, b"")


# --- framing over streams and sockets ----------------------------------------------------

def stream_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_read_frame():
    async def go():
        two = JobRequest(1, 2, 3).encode() + LogMessage("x").encode()
        reader = stream_of(two)
        assert await read_frame(reader, 100) == (JOB_REQUEST, u64(1) + u64(2) + u64(3))
        assert await read_frame(reader, 100) == (3, b"x")
        assert await read_frame(reader, 100) is None  # clean end between frames

        with pytest.raises(ProtocolError, match="RESULT payload of 1000 bytes exceeds the limit of 100"):
            await read_frame(stream_of(header(RESULT, 1000)), 100)
        with pytest.raises(ProtocolError, match="disconnected mid-frame.*3 of 24 payload"):
            await read_frame(stream_of(header(0, 24) + b"abc"), 100)
        with pytest.raises(ProtocolError, match="disconnected mid-frame.*4 of 10 header"):
            await read_frame(stream_of(b"JOBS"), 100)
        with pytest.raises(ProtocolError, match="bad magic"):
            await read_frame(stream_of(b"GET / HTTP/1.1\r\n"), 100)
    asyncio.run(go())


def test_blocking_socket_helpers():
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, Result(1, 2, 3, 4, -1, b"\x00").encode())
        send_frame(a, header(0, 24) + b"ab")
        opcode, payload = recv_frame(b, 1000)
        assert opcode == RESULT and Result.decode(payload).sum_loss == -1
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match="disconnected mid-frame.*2 of 24 payload"):
            recv_frame(b, 1000)
    c, d = socket.socketpair()
    with c, d:
        send_frame(c, header(1, 5000))
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            recv_frame(d, 1000)
        c.close()
        assert recv_frame(d, 1000) is None
