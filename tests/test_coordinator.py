"""The coordinator over loopback, driven by scripted asyncio clients."""

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from sync import async_wait_until

from deggs.config import Config, ConfigError
from deggs.runtime import auth
from deggs.runtime import checkpoint as ckpt
from deggs.runtime import coordinator as coordinator_module
from deggs.runtime import server as server_module
from deggs.runtime.channel import SEALED, TAG_SIZE, Channel, sealed_limits
from deggs.runtime.coordinator import Coordinator, format_workers_line
from deggs.runtime.protocol import (
    NO_FINGERPRINT,
    OPCODE_NAMES,
    WAIT,
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
    Opcode,
    Reason,
    Result,
    decode_message,
    recv_frame,
    send_frame,
)
from deggs.runtime.steps import StepState
from deggs.seeds import next_step_seed
from deggs.ternary import pack_trits

# 4 chunks of 10 members: 5 pairs (1 packed byte) a chunk, 20 pairs (4 bytes) a step.
SMALL = Config().replace(training={"population_size": 40, "chunk_size": 10})
CHUNK, PAIRS, N_CHUNKS = 10, 5, 4
SEED0 = SMALL.training.seed


def seed_of(step: int) -> int:
    seed = SEED0
    for s in range(1, step + 1):
        seed = next_step_seed(seed, s)
    return seed


def chunk_fitness(step: int, chunk: int) -> np.ndarray:
    """Deterministic made-up fitness of a chunk, different for every step and chunk."""
    return np.random.default_rng(step * 100 + chunk).integers(-1, 2, PAIRS).astype(np.int32)


def step_fitness(step: int) -> np.ndarray:
    return np.concatenate([chunk_fitness(step, c) for c in range(N_CHUNKS)])


ANY_FRAME = dict.fromkeys(OPCODE_NAMES, 1 << 24)  # what a test client accepts
SECRET = b"correct horse battery staple and then some"


def run(coro, timeout=20):
    asyncio.run(asyncio.wait_for(coro, timeout))


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@contextlib.asynccontextmanager
async def coordinator(config=SMALL, **kwargs):
    coord = Coordinator(config, host="127.0.0.1", port=0, **kwargs)
    await coord.start()
    try:
        yield coord
    finally:
        await coord.stop()


class Client:
    """A scripted worker speaking the wire protocol."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.frames = FrameReader(ANY_FRAME)
        self.received: deque = deque()
        self.channel: Channel | None = None  # once the secret is proven: frames tagged

    @classmethod
    async def connect(cls, coord):
        return cls(*await asyncio.open_connection("127.0.0.1", coord.port))

    @property
    def port(self):
        return self.writer.get_extra_info("sockname")[1]

    async def send(self, data):
        data = data if isinstance(data, bytes) else data.encode()
        if self.channel is not None:
            data = self.channel.seal(data)
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self):
        while not self.received:
            data = await asyncio.wait_for(self.reader.read(1 << 16), 5)
            assert data, "the coordinator closed the connection"
            self.received.extend(self.frames.feed(data))
        return decode_message(*self.received.popleft())

    async def hello(self, config=SMALL, secret=None):
        """The deggs handshake (with the shared secret's proofs when one is given)."""
        nonce = auth.new_nonce()
        await self.send(Hello(config.fingerprint(), config.to_json(), nonce))
        reply = await self.recv()
        if secret is not None:
            assert isinstance(reply, Challenge)
            assert auth.verify(secret, "coordinator", nonce, reply.nonce, reply.proof)
            await self.send(Auth(auth.proof(secret, "worker", nonce, reply.nonce)))
            self.channel = Channel.for_worker(secret, nonce, reply.nonce, ANY_FRAME)
            self.frames = self.channel  # it checks each record's tag before giving frames
            reply = await self.recv()
        assert isinstance(reply, HelloReply), reply
        return reply

    async def request(self, step, seed=None):
        await self.send(JobRequest(seed_of(step) if seed is None else seed, step))
        return await self.recv()

    async def result(self, job, fitness=None, sum_loss=None, updates=7, data_position=None):
        chunk = job.data_position // CHUNK
        fitness = chunk_fitness(job.last_step, chunk) if fitness is None else fitness
        await self.send(
            Result(
                job.seed,
                job.last_step,
                job.data_position if data_position is None else data_position,
                updates,
                chunk + 1 if sum_loss is None else sum_loss,
                pack_trits(fitness),
            )
        )

    async def closed(self, timeout=5) -> bool:
        """True once the coordinator has closed this connection (after reading the rest)."""
        try:
            rest = await asyncio.wait_for(self.reader.read(), timeout)
        except ConnectionError:
            return True
        self.received.extend(self.frames.feed(rest))
        return True

    async def goodbye(self) -> Goodbye:
        """The GOODBYE that ends this connection."""
        message = await self.recv()
        assert isinstance(message, Goodbye), message
        assert await self.closed()
        return message

    async def close(self):
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def settle(coord, step):
    """Wait until the coordinator has reached `step` (results are handled asynchronously)."""
    await async_wait_until(
        lambda: coord.state.step >= step,
        10,
        lambda: f"step {step} (stuck at step {coord.state.step})",
    )


async def train_step(client, step, last=False):
    """Take every chunk of `step`, return their results, and wait (as a worker does, on
    WAIT) until the coordinator has made the step durable and sends its update (unless
    this is the run's last step)."""
    for chunk in range(N_CHUNKS):
        job = await client.request(step)
        assert (job.last_step, job.data_position, job.seed) == (step, chunk * CHUNK, seed_of(step))
        await client.result(job)
    if last:
        return
    deadline = time.monotonic() + 10
    while not (update := await client.request(step)).data:
        assert update.data_position == WAIT
        assert time.monotonic() < deadline, f"step {step} still not durable (WAIT) after 10 s"
        await asyncio.sleep(0.005)  # WAIT means "ask again": a poll interval, as a worker's
    assert update.last_step == step + 1 and update.data == pack_trits(step_fitness(step))


@pytest.fixture(autouse=True)
def no_asyncio_errors(caplog):
    """Unhandled errors in the event loop's callbacks fail the test that caused them."""
    yield
    errors = [
        r.getMessage()
        for r in caplog.get_records("call")
        if r.name == "asyncio" and r.levelno >= logging.ERROR
    ]
    assert not errors, errors


@pytest.fixture
def info_logs(caplog):
    caplog.set_level(logging.INFO, logger="deggs")
    return caplog


# --- whole steps -----------------------------------------------------------------------


def test_whole_steps(info_logs):
    async def go():
        async with coordinator() as coord:
            a, b = await Client.connect(coord), await Client.connect(coord)
            jobs = [await a.request(0) for _ in range(3)] + [await b.request(0)]
            assert [j.data_position for j in jobs] == [0, 10, 20, 30]
            assert all(j.data == b"" and j.seed == SEED0 for j in jobs)
            wait = await a.request(0)  # every chunk is out
            assert wait.data_position == WAIT and wait.last_step == 0
            for job in reversed(jobs):
                await (b if job is jobs[3] else a).result(job)
            await settle(coord, 1)
            assert coord.state.seed == seed_of(1) == next_step_seed(SEED0, 1)
            assert coord.history[0] == pack_trits(step_fitness(0))
            await train_step(a, 1)
            await settle(coord, 2)
            assert coord.history[1] == pack_trits(step_fitness(1))
            await a.close(), await b.close()

    run(go())
    lines = [r.getMessage() for r in info_logs.records if r.getMessage().startswith("Step ")]
    assert len(lines) == 2
    # sum_loss is 1+2+3+4 = 10 per step; loss = 10 / (40 * 64 * 16)
    assert lines[0].startswith("Step 0 | Tokens: 2.56 K | Loss: 0.0002 | Time: ")
    assert "Updates: 28 (n=4, max=7)" in lines[0] and "LR: 0.500" in lines[0]


def test_catch_up_replays_every_step():
    async def go():
        async with coordinator() as coord:
            trainer = await Client.connect(coord)
            await train_step(trainer, 0)
            await train_step(trainer, 1)
            await settle(coord, 2)
            late = await Client.connect(coord)
            first = await late.request(0)
            assert isinstance(first, JobResponse)
            assert (first.last_step, first.data_position, first.seed) == (1, 0, seed_of(2))
            assert first.data == pack_trits(step_fitness(0))
            second = await late.request(1)
            assert second.last_step == 2 and second.data == pack_trits(step_fitness(1))
            job = await late.request(2)
            assert (job.last_step, job.data_position, job.data) == (2, 0, b"")

    run(go())


def test_straggler_chunk_is_reassigned(info_logs):
    clock = FakeClock()
    config = SMALL.replace(coordinator={"straggler_timeout_s": 30})

    async def go():
        async with coordinator(config, clock=clock) as coord:
            slow, fast = await Client.connect(coord), await Client.connect(coord)
            slow_jobs = [await slow.request(0) for _ in range(N_CHUNKS)]
            assert (await fast.request(0)).data_position == WAIT
            clock.now += 10
            late_jobs = [await slow.request(0)]  # chunk 0 is 10 s old: still waiting
            assert late_jobs[0].data_position == WAIT
            clock.now += 25  # chunk 0 is now 35 s old, the others too
            retry = await fast.request(0)
            assert retry.data_position == 0
            await fast.result(retry)
            for job in slow_jobs[1:]:
                await slow.result(job)
            await settle(coord, 1)
            assert coord.history[0] == pack_trits(step_fitness(0))

    run(go())
    assert any("re-assigning chunk 0 after 35.0 s" in r.getMessage() for r in info_logs.records)


def test_duplicate_results_are_ignored_but_counted(info_logs):
    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            job = await a.request(0)
            await a.result(job, sum_loss=5, updates=3)
            await a.result(job, fitness=-chunk_fitness(0, 0), sum_loss=500, updates=11)
            # Frames of a connection are handled in order: this reply means both RESULTs were.
            second = await a.request(0)
            s = coord.state
            assert s.sum_loss == 5 and s.transmissions == 2
            assert (s.updates_total, s.updates_min, s.updates_max) == (14, 3, 11)
            np.testing.assert_array_equal(s.fitness()[:PAIRS], chunk_fitness(0, 0))
            await a.result(second)
            for _ in range(2):
                await a.result(await a.request(0))
            await settle(coord, 1)
            assert coord.history[0] == pack_trits(step_fitness(0))

    run(go())
    assert any("duplicate RESULT for chunk 0" in r.getMessage() for r in info_logs.records)


def test_results_for_another_step_are_ignored():
    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            job = await a.request(0)
            stale = JobResponse(seed_of(3), 3, 0)
            await a.result(stale, fitness=np.ones(PAIRS, np.int32))
            # Frames of a connection are handled in order: this reply means the stale RESULT was.
            second = await a.request(0)
            assert coord.state.n_done == 0 and coord.state.transmissions == 0
            await a.result(job)  # the connection is still served
            await a.result(second)
            for _ in range(2):
                await a.result(await a.request(0))
            await settle(coord, 1)
            assert coord.history[0] == pack_trits(step_fitness(0))

    run(go())


# --- per-worker figures ------------------------------------------------------------------


async def taken(coord, n_done):
    """Wait until the coordinator has taken `n_done` chunks' RESULTs (they get no reply)."""
    await async_wait_until(lambda: coord.state.n_done >= n_done, 5, f"{n_done} chunks in")


def test_worker_figures_are_the_hand_computed_ones(tmp_path, info_logs):
    """Workers at different speeds, on a fake clock: chunks that counted, busy time
    (chunks held at once counted once), idle time (waiting for a chunk, WAITs and the
    wait for the step's slowest chunk included) and member-tokens/s, in metrics.jsonl."""
    clock = FakeClock()  # starts at 1000.0
    config = SMALL.replace(coordinator={"straggler_timeout_s": 30})
    tokens = CHUNK * SMALL.model.seq_len  # member-tokens of one chunk

    async def go():
        async with coordinator(config, save_dir=tmp_path, clock=clock) as coord:
            fast, slow = await Client.connect(coord), await Client.connect(coord)
            # step 0: fast holds chunks 0 and 1 at once, slow takes chunk 2 for 10 s
            f0, f1, s2 = await fast.request(0), await fast.request(0), await slow.request(0)
            assert [j.data_position for j in (f0, f1, s2)] == [0, CHUNK, 2 * CHUNK]
            clock.now = 1001.0
            await fast.result(f0)
            await taken(coord, 1)
            clock.now = 1003.0
            await fast.result(f1)  # busy from 1000 to 1003: 3 s, not 1 + 3
            await taken(coord, 2)
            clock.now = 1003.5
            f3 = await fast.request(0)  # free for 0.5 s
            clock.now = 1005.0
            await fast.result(f3)
            assert (await fast.request(0)).data_position == WAIT  # free until the seal
            clock.now = 1010.0
            await slow.result(s2)
            await settle(coord, 1)

            # step 1: slow holds chunk 0 for 41 s; fast takes the other three at once,
            # waits 39 s until chunk 0 is re-assigned to it, and still holds it when
            # slow's RESULT seals the step; a third worker waits 9 s and leaves
            clock.now = 1020.0
            for client in (slow, fast):
                assert (await client.request(0)).last_step == 1  # step 0's update
            s0 = await slow.request(1)
            assert s0.data_position == 0
            fast_jobs = [await fast.request(1) for _ in range(3)]
            late = await Client.connect(coord)
            assert (await late.request(0)).last_step == 1
            clock.now = 1021.0
            for job in fast_jobs:
                await fast.result(job)
            assert (await fast.request(1)).data_position == WAIT
            assert (await late.request(1)).data_position == WAIT
            clock.now = 1030.0
            await late.close()
            await async_wait_until(lambda: len(coord.peers) == 2, 5, "the third worker gone")
            clock.now = 1060.0
            assert (await fast.request(1)).data_position == 0
            clock.now = 1061.0
            await slow.result(s0)
            await settle(coord, 2)
            return [f"127.0.0.1:{c.port}" for c in (fast, slow, late)]

    fast, slow, late = run_value(go())
    records = ckpt.read_metrics(tmp_path)

    def figures(chunks, busy, idle, returned=None):
        returned = chunks if returned is None else returned
        speed = round(returned * tokens / busy, 1) if busy else 0.0
        return {"chunks": chunks, "member_tokens_per_s": speed, "busy_s": busy, "idle_s": idle}

    assert records[0]["workers"] == {
        fast: figures(3, busy=3.0 + 1.5, idle=0.5 + 5.0),
        slow: figures(1, busy=10.0, idle=0.0),
    }
    assert records[0]["workers"][fast]["member_tokens_per_s"] == 426.7  # 3 x 640 / 4.5 s
    assert records[1]["workers"] == {
        slow: figures(1, busy=41.0, idle=0.0),
        fast: figures(3, busy=1.0 + 1.0, idle=39.0),  # chunk 0 still held at the seal
        late: figures(0, busy=0.0, idle=9.0),
    }
    lines = [r.getMessage() for r in info_logs.records if r.getMessage().startswith("Workers ")]
    assert lines[0] == (
        f"Workers 2 | {slow} 1 chunk 64 tok/s idle 0.00 s | {fast} 3 chunks 427 tok/s idle 5.50 s"
    )
    assert lines[1].startswith(f"Workers 3 | {late} 0 chunks 0 tok/s idle 9.00 s | {slow} ")


def test_workers_line_names_the_slowest_then_the_most_idle():
    workers = {
        f"gpu{i}": {
            "chunks": 4,
            "member_tokens_per_s": 10_000_000.0 + i * 100_000,
            "busy_s": 1.0,
            "idle_s": 0.01 * i,
        }
        for i in range(12)
    }
    line = format_workers_line(workers)
    named = [part.split()[0] for part in line.split(" | ")[1:-1]]
    assert named == ["gpu0", "gpu1", "gpu2", "gpu3", "gpu11", "gpu10", "gpu9", "gpu8"]
    assert line.startswith("Workers 12 | gpu0 4 chunks 10.00 M tok/s idle 0.00 s | gpu1 ")
    assert line.endswith(" | gpu8 4 chunks 10.80 M tok/s idle 0.08 s | and 4 more")


# --- bad input ---------------------------------------------------------------------------


def _header(opcode, length, magic=b"JOBS", version=1):
    return magic + bytes([version, opcode]) + length.to_bytes(4, "big")


def _result_bytes(data_position=CHUNK, data=b"\x00", size=None, step=0):
    head = struct.pack(
        ">QQQQqI", seed_of(step), step, data_position, 0, 0, len(data) if size is None else size
    )
    return _header(1, len(head) + len(data)) + head + data


BAD_INPUTS = {
    "wrong magic": (_header(0, 24, magic=b"HTTP") + bytes(24), "bad magic"),
    "wrong version": (_header(0, 24, version=2) + bytes(24), "version 2"),
    "unknown opcode": (_header(99, 0), "unknown opcode 99"),
    "worker sends JOB_RESPONSE": (JobResponse(0, 0, 0).encode(), "unexpected JOB_RESPONSE"),
    "oversized payload": (_header(1, 1 << 30), "exceeds the limit"),
    "short JOB_REQUEST": (_header(0, 8) + bytes(8), "needs at least 24"),
    "RESULT shorter than its header": (_header(1, 20) + bytes(20), "needs at least 44"),
    "RESULT shorter than it announces": (
        _result_bytes(data=b"", size=1),
        "announces 1 bytes of fitness but carries 0",
    ),
    "RESULT with too little fitness": (_result_bytes(data=b""), "a chunk packs into 1"),
    "RESULT off a chunk boundary": (_result_bytes(data_position=5), "data_position 5"),
    "RESULT past the population": (_result_bytes(data_position=40), "data_position 40"),
    "RESULT with invalid trits": (_result_bytes(data=b"\xf3"), "243"),
    "RESULT for a chunk it was not handed": (
        _result_bytes(data_position=2 * CHUNK),
        "chunk 2 of step 0, which was not handed",
    ),
    "RESULT with a foreign seed": (
        _result_bytes()[:10] + bytes(8) + _result_bytes()[18:],
        "carries seed 0",
    ),
    "disconnect mid-frame": (_header(0, 24) + bytes(10), "disconnected mid-frame"),
    "HEALTH without HELLO": (
        Health(0, (HealthEntry("w_q", 0.0, 1.0, 0.0, 2.0),)).encode(),
        "HEALTH from a peer that did not say HELLO",
    ),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_drops_only_that_connection(info_logs, name):
    data, problem = BAD_INPUTS[name]
    clock = FakeClock()

    async def go():
        async with coordinator(clock=clock) as coord:
            good = await Client.connect(coord)
            first = await good.request(0)
            bad = await Client.connect(coord)
            await bad.request(0)  # the bad worker holds chunk 1 when it misbehaves
            await bad.send(data)
            bad.writer.write_eof()
            assert await bad.closed()
            await good.result(first)
            # chunk 1 is back in the queue at once: no straggler timeout to wait for
            for _ in range(3):
                job = await good.request(0)
                assert job.last_step == 0
                await good.result(job)
            await settle(coord, 1)
            assert coord.history[0] == pack_trits(step_fitness(0))
            assert coord.state.step == 1 and coord.state.seed == seed_of(1)
            return bad.port

    port = asyncio.run(asyncio.wait_for(go(), 20))
    about_bad = [
        r
        for r in info_logs.records
        if r.levelno >= logging.WARNING and f"127.0.0.1:{port}" in r.getMessage()
    ]
    assert len(about_bad) == 1, [r.getMessage() for r in about_bad]
    assert problem in about_bad[0].getMessage()


def test_worker_ahead_of_coordinator_is_told_and_closed():
    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            await a.hello()
            await a.send(JobRequest(seed_of(5), 5))
            bye = await a.goodbye()
            assert bye.reason == Reason.COORDINATOR_BEHIND and bye.reason.permanent
            assert "--load-dir" in bye.text
            b = await Client.connect(coord)
            assert (await b.request(0)).data_position == 0

    run(go())


def test_reference_worker_is_refused_with_a_close_alone(info_logs):
    """A reference worker cannot read GOODBYE: it gets the close, the log says why."""

    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            await a.send(JobRequest(7, 0))
            assert await a.closed() and not a.received

    run(go())
    assert any("seed 7" in r.getMessage() for r in info_logs.records)


def test_worker_with_another_seed_is_told_and_closed():
    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            await a.hello()
            await a.send(JobRequest(7, 0))
            bye = await a.goodbye()
            assert bye.reason == Reason.SEED_MISMATCH and "seed 7" in bye.text

    run(go())


def test_catch_up_beyond_kept_history_is_refused():
    config = SMALL.replace(coordinator={"max_history": 1})

    async def go():
        async with coordinator(config) as coord:
            a = await Client.connect(coord)
            await train_step(a, 0)
            await train_step(a, 1)
            await settle(coord, 2)
            assert list(coord.history) == [1]
            late = await Client.connect(coord)
            await late.hello(config)
            await late.send(JobRequest(SEED0, 0))
            bye = await late.goodbye()
            assert bye.reason == Reason.HISTORY_GONE and "step 0 is no longer kept" in bye.text
            assert (await (await Client.connect(coord)).request(1)).last_step == 2

    run(go())


# --- HELLO -----------------------------------------------------------------------------


def test_hello_with_matching_config_then_job():
    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            # Sent back to back, as our worker does without a secret.
            await a.send(
                Hello(SMALL.fingerprint(), SMALL.to_json()).encode() + JobRequest(SEED0, 0).encode()
            )
            reply = await a.recv()
            assert isinstance(reply, HelloReply) and reply.fingerprint == SMALL.fingerprint()
            job = await a.recv()
            assert isinstance(job, JobResponse) and job.data_position == 0

    run(go())


def test_hello_without_config_gets_the_config():
    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            await a.send(Hello(NO_FINGERPRINT))
            reply = await a.recv()
            assert Config.from_json(reply.config_json) == coord.config
            assert (await a.request(0)).data_position == 0

    run(go())


def test_hello_with_another_config_is_refused(info_logs):
    theirs = SMALL.replace(model={"seq_len": 32})

    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            await a.send(
                Hello(theirs.fingerprint(), theirs.to_json()).encode()
                + JobRequest(SEED0, 0).encode()
            )
            bye = await a.goodbye()
            assert bye.reason == Reason.CONFIG_MISMATCH and "model.seq_len: 32 != 64" in bye.text
            assert coord.state.pending == deque(range(N_CHUNKS))  # nothing was handed out

            b = await Client.connect(coord)
            await b.send(Hello(b"\x01" * 8))
            assert "fingerprints differ" in (await b.goodbye()).text

            c = await Client.connect(coord)  # a config that nests deeply or holds a huge number
            await c.send(Hello(b"\x01" * 8, "[" * 5000 + "]" * 5000))
            assert "nests 5000 levels deep" in (await c.goodbye()).text
            d = await Client.connect(coord)
            await d.send(Hello(b"\x01" * 8, '{"model": {"seq_len": ' + "9" * 5000 + "}}"))
            assert "a number of 5000 characters" in (await d.goodbye()).text

    run(go())
    assert any(
        "closing" in r.getMessage() and "model.seq_len" in r.getMessage() for r in info_logs.records
    )


def test_hello_of_another_protocol_version_is_refused():
    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            await a.send(Hello(SMALL.fingerprint(), deggs_protocol=1))
            bye = await a.goodbye()
            assert bye.reason == Reason.PROTOCOL_MISMATCH and "protocol 1" in bye.text

    run(go())


def test_log_messages_cannot_forge_lines(info_logs):
    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            await a.send(LogMessage("hi\nStep 99 | Loss: 0.0001\x1b[2J\r"))
            await a.send(JobRequest(SEED0, 0))
            await a.recv()

    run(go())
    lines = [r.getMessage() for r in info_logs.records]
    assert not any(line.startswith("Step 99") for line in lines)
    assert any(line.endswith("] Step 99 | Loss: 0.0001\\x1b[2J\\r") for line in lines), lines


# --- the shared secret -----------------------------------------------------------------


def test_secret_handshake_then_training():
    async def go():
        async with coordinator(secret=SECRET) as coord:
            a = await Client.connect(coord)
            reply = await a.hello(secret=SECRET)
            assert Config.from_json(reply.config_json) == coord.config
            await train_step(a, 0)
            await settle(coord, 1)

    run(go())


FORGERIES = {
    "a reference worker": JobRequest(SEED0, 0).encode(),
    "a RESULT out of the blue": _result_bytes(data_position=0),
    "a log line": LogMessage("Step 99 | Loss: 0.0001").encode(),
    "HELLO then a JOB_REQUEST": Hello(SMALL.fingerprint(), SMALL.to_json()).encode()
    + JobRequest(SEED0, 0).encode(),
    "HELLO then a made-up AUTH": Hello(SMALL.fingerprint()).encode() + Auth(bytes(32)).encode(),
    "AUTH first": Auth(bytes(32)).encode(),
}


@pytest.mark.parametrize("name", FORGERIES)
def test_unauthenticated_peers_learn_nothing_and_count_for_nothing(name, info_logs):
    async def go():
        async with coordinator(secret=SECRET) as coord:
            honest = await Client.connect(coord)
            await honest.hello(secret=SECRET)
            job = await honest.request(0)
            bad = await Client.connect(coord)
            await bad.send(FORGERIES[name])
            assert await bad.closed()
            told = [
                m
                for m in map(lambda f: decode_message(*f), bad.received)
                if not isinstance(m, Challenge)
            ]
            assert told == []  # no step, seed, config, not even a refusal
            assert coord.state.n_done == 0 and coord.state.transmissions == 0
            await honest.result(job)
            await settle_chunks(coord, 1)

    run(go())
    assert any(
        "closing" in r.getMessage() or "dropping" in r.getMessage()
        for r in info_logs.records
        if r.levelno >= logging.WARNING
    )


def test_a_recorded_handshake_cannot_be_replayed():
    async def go():
        async with coordinator(secret=SECRET) as coord:
            honest = await Client.connect(coord)
            nonce = auth.new_nonce()
            await honest.send(Hello(SMALL.fingerprint(), "", nonce))
            challenge = await honest.recv()
            recorded = Auth(auth.proof(SECRET, "worker", nonce, challenge.nonce))
            await honest.send(recorded)
            reply = await asyncio.wait_for(honest.reader.read(1 << 16), 5)
            assert reply[5] == Opcode.HELLO_REPLY | SEALED  # the honest worker is in
            replay = await Client.connect(coord)  # same HELLO, same AUTH: a new challenge
            await replay.send(Hello(SMALL.fingerprint(), "", nonce))
            second = await replay.recv()
            assert second.nonce != challenge.nonce
            await replay.send(recorded)
            assert await replay.closed() and not replay.received

    run(go())


def test_a_coordinators_proof_does_not_pass_as_a_workers():
    async def go():
        async with coordinator(secret=SECRET) as coord:
            a = await Client.connect(coord)
            nonce = auth.new_nonce()
            await a.send(Hello(SMALL.fingerprint(), "", nonce))
            challenge = await a.recv()
            await a.send(Auth(challenge.proof))  # reflect the coordinator's own proof
            assert await a.closed() and not a.received

    run(go())


class Proxy:
    """A man in the middle on loopback: relays whole frames between each client and the
    coordinator, passing every frame from a client through change(opcode, payload), which
    returns the bytes to send on instead."""

    def __init__(self, coord, change):
        self.coord, self.change = coord, change
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def connect(self) -> Client:
        return Client(*await asyncio.open_connection("127.0.0.1", self.port))

    async def _relay(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.coord.port)

        async def pump(source, sink, change):
            frames = FrameReader(sealed_limits(ANY_FRAME))
            with contextlib.suppress(OSError):
                while data := await source.read(1 << 16):
                    for opcode, payload in frames.feed(data):
                        sink.write(change(opcode, payload))
                    await sink.drain()
            sink.close()

        await asyncio.gather(
            pump(reader, up_writer, self.change), pump(up_reader, writer, protocol_frame)
        )


def protocol_frame(opcode, payload):
    return _header(opcode, len(payload)) + payload


def forge_result(opcode, payload):
    """The attack of issue [11]: every RESULT's sum_loss 0 and its fitness all +1, with a
    tag left as it came."""
    if opcode & ~SEALED != Result.OPCODE:
        return protocol_frame(opcode, payload)
    tag = payload[-TAG_SIZE:] if opcode & SEALED else b""
    r = Result.decode(payload[: len(payload) - len(tag)])
    forged = Result(r.seed, r.last_step, r.data_position, r.updates_count, 0, pack_trits([1] * 5))
    return protocol_frame(opcode, forged.encode()[10:] + tag)


def test_a_man_in_the_middle_cannot_change_a_result(tmp_path, info_logs):
    """With a secret, a RESULT rewritten on its way closes that connection with one line;
    its chunk goes back to the queue and the step's losses and update are the honest ones."""

    async def go():
        async with coordinator(secret=SECRET, save_dir=tmp_path) as coord:
            async with Proxy(coord, forge_result) as proxy:
                victim = await proxy.connect()
                await victim.hello(secret=SECRET)
                job = await victim.request(0)
                assert job.data_position == 0
                await victim.result(job)
                assert await victim.closed()
                await async_wait_until(lambda: not coord.peers, 5, "the victim's close")
                assert list(coord.state.pending) == [0, 1, 2, 3] and coord.state.n_done == 0
                honest = await Client.connect(coord)
                await honest.hello(secret=SECRET)
                await train_step(honest, 0)  # the update is step_fitness(0), unforged
                await train_step(honest, 1, last=True)
                await settle(coord, 2)

    run(go())
    assert [r["sum_loss"] for r in ckpt.read_metrics(tmp_path)] == [10, 10]  # chunks 1+2+3+4
    failed = [r.getMessage() for r in info_logs.records if "authentication" in r.getMessage()]
    assert len(failed) == 1 and "a record (RESULT) failed authentication" in failed[0], failed


def _sealed(client, *messages) -> list[bytes]:
    return [client.channel.seal(m.encode()) for m in messages]


# What a peer on the path does with a proven worker's frames: each closes the connection.
TAMPERING = {
    "replayed": lambda c, other: _sealed(c, LogMessage("a")) * 2,
    "reordered": lambda c, other: _sealed(c, LogMessage("a"), JobRequest(SEED0, 0))[::-1],
    "dropped": lambda c, other: _sealed(c, LogMessage("a"), JobRequest(SEED0, 0))[1:],
    "from another connection": lambda c, other: [
        Channel.for_worker(SECRET, bytes(16), bytes(16), ANY_FRAME).seal(
            JobRequest(SEED0, 0).encode()
        )
    ],
    "untagged, ahead of a record": lambda c, other: [
        JobRequest(SEED0, 0).encode(),
        *_sealed(c, LogMessage("a")),
    ],
    "tag cut short": lambda c, other: [_cut(_sealed(c, JobRequest(SEED0, 0))[0])],
    "a frame dropped from a record": lambda c, other: [
        _without_first(c.channel.seal(LogMessage("a").encode() + JobRequest(SEED0, 0).encode()))
    ],
    "unmarked": lambda c, other: [
        _unmarked(_sealed(c, LogMessage("a"))[0]),
        *_sealed(c, JobRequest(SEED0, 0)),
    ],
}


def _cut(frame: bytes) -> bytes:
    """The frame one byte shorter, header included."""
    return _header(frame[5], len(frame) - 11) + frame[10:-1]


def _without_first(record: bytes) -> bytes:
    """A sealed record less its first frame."""
    return record[10 + int.from_bytes(record[6:10], "big") :]


def _unmarked(frame: bytes) -> bytes:
    """A sealed frame with its SEALED bit cleared: the tag now reads as payload."""
    return _header(frame[5] & ~SEALED, len(frame) - 10) + frame[10:]


@pytest.mark.parametrize("name", TAMPERING)
def test_frames_replayed_reordered_dropped_or_spliced_close_the_connection(name, info_logs):
    async def go():
        async with coordinator(secret=SECRET) as coord:
            victim, other = await Client.connect(coord), await Client.connect(coord)
            await victim.hello(secret=SECRET)
            await other.hello(secret=SECRET)
            assert (await victim.request(0)).data_position == 0  # it holds chunk 0
            frames = TAMPERING[name](victim, other)
            victim.channel = None  # the bytes go out exactly as tampered
            victim.writer.write(b"".join(frames))
            assert await victim.closed()
            # Its chunk is back in the queue: the next worker to ask gets it.
            await async_wait_until(lambda: len(coord.peers) == 1, 5, "the victim's close")
            assert (await other.request(0)).data_position == 0

    run(go())
    closed = [r.getMessage() for r in info_logs.records if r.levelno >= logging.WARNING]
    assert len(closed) == 1 and "failed authentication" in closed[0], closed


async def settle_chunks(coord, n):
    await async_wait_until(
        lambda: coord.state.n_done >= n, 10, lambda: f"{n} chunks done (only {coord.state.n_done})"
    )


# --- checkpoints and restart -----------------------------------------------------------


def test_checkpoint_files_have_the_reference_layout(tmp_path):
    async def go():
        async with coordinator(save_dir=tmp_path, max_steps=2) as coord:
            a = await Client.connect(coord)
            await train_step(a, 0)
            await train_step(a, 1, last=True)
            await asyncio.wait_for(coord.finished.wait(), 5)
            await a.send(JobRequest(seed_of(2), 2))  # --max-steps reached: nothing more to do
            assert await a.closed() and not a.received

    run(go())
    for step in (1, 2):
        raw = (tmp_path / f"checkpoint_{step:08d}.bin").read_bytes()
        packed = pack_trits(step_fitness(step - 1))
        expected = (
            b"CGGE"
            + b"\x01\x00\x00\x00"
            + step.to_bytes(8, "little")
            + seed_of(step).to_bytes(8, "little")
            + (4).to_bytes(8, "little")
            + packed
        )
        assert raw == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_00000001.bin",
        "checkpoint_00000002.bin",
        "checkpoints.sha256",
        "config.json",
        "metrics.jsonl",
    ]
    # The checksums, one line a file as `sha256sum` writes (and `sha256sum -c` checks) them.
    assert (tmp_path / "checkpoints.sha256").read_text() == "".join(
        f"{hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}  {name}\n"
        for name in ("checkpoint_00000001.bin", "checkpoint_00000002.bin")
    )
    assert Config.from_json((tmp_path / "config.json").read_text()) == SMALL
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert set(records[0]) == {
        "step",
        "tokens",
        "loss",
        "sum_loss",
        "step_time_s",
        "updates_total",
        "updates_min",
        "updates_max",
        "transmissions",
        "tokens_per_s",
        "lr",
        "bytes_sent",
        "bytes_received",
        "time",
        "workers",
    }
    assert records[1]["tokens"] == 2 * 40 * 64 and records[0]["transmissions"] == 4
    assert [w["chunks"] for w in records[0]["workers"].values()] == [N_CHUNKS]


def test_restart_from_load_dir_restores_state_and_history(tmp_path):
    async def go():
        async with coordinator(save_dir=tmp_path) as coord:
            a = await Client.connect(coord)
            await train_step(a, 0)
            await train_step(a, 1)
            await settle(coord, 2)
        async with coordinator(save_dir=tmp_path, load_dir=tmp_path) as coord:
            assert (coord.state.step, coord.state.seed) == (2, seed_of(2))
            assert list(coord.history) == [1]  # older steps are read from disk on demand
            fresh = await Client.connect(coord)
            for step in (0, 1):
                update = await fresh.request(step)
                assert update.last_step == step + 1
                assert update.data == pack_trits(step_fitness(step))
            await train_step(fresh, 2)
            await settle(coord, 3)

    run(go())
    assert ckpt.load_latest(tmp_path).step == 3


def test_load_dir_into_another_save_dir_copies_the_history(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"

    async def go():
        async with coordinator(save_dir=first) as coord:
            await train_step(await Client.connect(coord), 0)
            await settle(coord, 1)
        async with coordinator(save_dir=second, load_dir=first) as coord:
            await train_step(await Client.connect(coord), 1)
            await settle(coord, 2)

    run(go())
    assert sorted(ckpt.list_checkpoints(second)) == [1, 2]


def test_load_dir_with_another_config_is_refused(tmp_path):
    ckpt.save_config(tmp_path, SMALL.replace(model={"n_layers": 2}))
    with pytest.raises(ConfigError, match="model.n_layers: 2 != 4"):
        Coordinator(SMALL, load_dir=tmp_path)


def test_save_dir_of_another_run_is_refused(tmp_path):
    ckpt.save_checkpoint(tmp_path, ckpt.Checkpoint(3, 1, bytes(4)))

    async def go():
        with pytest.raises(ckpt.CheckpointError, match="--load-dir"):
            await Coordinator(SMALL, save_dir=tmp_path, port=0).start()

    run(go())


def test_corrupt_newest_checkpoint_stops_the_start(tmp_path):
    ckpt.save_checkpoint(tmp_path, ckpt.Checkpoint(1, seed_of(1), bytes(4)))
    path = ckpt.checkpoint_path(tmp_path, 2)
    path.write_bytes(ckpt.encode_checkpoint(ckpt.Checkpoint(2, seed_of(2), bytes(4)))[:-1])
    with pytest.raises(ckpt.CheckpointError, match="checkpoint_00000002.bin.*announces 4"):
        Coordinator(SMALL, load_dir=tmp_path)


def test_corrupt_older_checkpoint_fails_only_that_catch_up(tmp_path, info_logs):
    ckpt.save_checkpoint(tmp_path, ckpt.Checkpoint(1, seed_of(1), b"\x00" * 4))
    ckpt.save_checkpoint(tmp_path, ckpt.Checkpoint(2, seed_of(2), b"\x01" * 4))
    ckpt.checkpoint_path(tmp_path, 1).write_bytes(b"garbage" * 10)

    async def go():
        async with coordinator(load_dir=tmp_path) as coord:
            a = await Client.connect(coord)
            await a.hello()
            await a.send(JobRequest(SEED0, 0))
            assert "no longer kept" in (await a.goodbye()).text
            assert (await (await Client.connect(coord)).request(1)).data == b"\x01" * 4

    run(go())
    assert any("checkpoint_00000001.bin: its SHA-256" in r.getMessage() for r in info_logs.records)


# --- checkpoint module -------------------------------------------------------------------


def test_decode_checkpoint_errors():
    good = ckpt.encode_checkpoint(ckpt.Checkpoint(1, 2, b"ab"))
    assert ckpt.decode_checkpoint(good, "f") == ckpt.Checkpoint(1, 2, b"ab")
    cases = {
        good[:20]: "truncated",
        b"X" + good[1:]: "bad magic",
        good[:4] + b"\x02" + good[5:]: "version 2",
        good + b"c": "the file holds 3",
    }
    for data, message in cases.items():
        with pytest.raises(ckpt.CheckpointError, match=f"f: .*{message}"):
            ckpt.decode_checkpoint(data, "f")
    with pytest.raises(ckpt.CheckpointError, match="packs into 5"):
        ckpt.decode_checkpoint(good, "f", n_pairs=25)
    bad_trits = ckpt.encode_checkpoint(ckpt.Checkpoint(1, 2, b"\x00\xf3"))
    with pytest.raises(ckpt.CheckpointError, match="f: corrupt fitness: .*243"):
        ckpt.decode_checkpoint(bad_trits, "f", n_pairs=10)


def test_checkpoint_name_must_match_its_step(tmp_path):
    path = ckpt.checkpoint_path(tmp_path, 4)
    path.write_bytes(ckpt.encode_checkpoint(ckpt.Checkpoint(3, 0, b"")))
    with pytest.raises(ckpt.CheckpointError, match="header says step 3"):
        ckpt.read_checkpoint(path)


def test_write_atomic_leaves_the_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint_00000001.bin"
    ckpt.write_atomic(path, b"old")

    def crash(fd):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "fsync", crash)  # files.write_atomic's
    with pytest.raises(OSError, match="disk on fire"):
        ckpt.write_atomic(path, b"new contents")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind


# --- the command line --------------------------------------------------------------------

CLI = [sys.executable, "-c", "from deggs.cli import coordinator_main; coordinator_main()"]
# The package is importable from the checkout even when it is not installed.
CLI_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    ),
}
SMALL_TOML = "[training]\npopulation_size = 40\nchunk_size = 10\n"


class CliProcess:
    """deggs-coordinator in a subprocess, with its stdout read line by line."""

    def __init__(self, tmp_path, *args):
        (tmp_path / "small.toml").write_text(SMALL_TOML)
        self.proc = subprocess.Popen(
            CLI
            + [
                "--config",
                str(tmp_path / "small.toml"),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--save-dir",
                str(tmp_path / "run"),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=CLI_ENV,
            # a suite run under nohup would pass its ignored SIGHUP on, and the CLI keeps
            # an ignored SIGHUP ignored (test_cli_keeps_an_ignored_sighup_ignored)
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout=30) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            self.output.append(line)
            if match := re.search(pattern, line):
                return match
        self.proc.kill()
        raise AssertionError(f"no line matching {pattern!r} in {self.output}")

    def finish(self, timeout=30) -> int:
        code = self.proc.wait(timeout)
        while not self.lines.empty():
            self.output.append(self.lines.get())
        return code


def blocking_step(port: int, step: int):
    """A blocking-socket worker (the helpers the real worker uses) trains one step."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for chunk in range(N_CHUNKS):
            send_frame(sock, JobRequest(seed_of(step), step).encode())
            job = JobResponse.decode(recv_frame(sock, ANY_FRAME)[1])
            assert job.data_position == chunk * CHUNK
            send_frame(
                sock,
                Result(
                    job.seed, step, job.data_position, 1, 16, pack_trits(chunk_fitness(step, chunk))
                ).encode(),
            )
        send_frame(sock, JobRequest(seed_of(step), step).encode())
        recv_frame(sock, ANY_FRAME)  # WAIT, the next step or the end: all results were read


@pytest.mark.slow  # it stays up retry_max_s + 2 s for reconnecting workers, as it should
def test_cli_runs_max_steps_and_exits(tmp_path):
    cli = CliProcess(tmp_path, "--max-steps", "1")
    port = int(cli.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    blocking_step(port, 0)
    assert cli.finish() == 0, cli.output
    assert any(line.split(" ", 1)[1].startswith("Step 0 | Tokens") for line in cli.output)
    run_dir = tmp_path / "run"
    assert ckpt.load_latest(run_dir) == ckpt.Checkpoint(1, seed_of(1), pack_trits(step_fitness(0)))
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1


def test_cli_exits_cleanly_on_sigterm_with_files_flushed(tmp_path):
    cli = CliProcess(tmp_path, "--max-steps", "5")
    port = int(cli.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    blocking_step(port, 0)
    cli.wait_for(r"Step 0 \|")
    cli.proc.send_signal(signal.SIGTERM)
    assert cli.finish() == 0, cli.output
    assert "Traceback" not in "".join(cli.output)
    assert ckpt.load_latest(tmp_path / "run").step == 1
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    assert (tmp_path / "run" / "config.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "{bad}"], "unknown key training.chunk_sise"),
        (["--config", "{missing}"], "config file not found"),
        (["--load-dir", "{load}"], "model.seq_len"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_code_2(tmp_path, args, message):
    (tmp_path / "bad.toml").write_text("[training]\nchunk_sise = 10\n")
    (tmp_path / "load").mkdir()
    ckpt.save_config(tmp_path / "load", Config().replace(model={"seq_len": 16}))
    paths = {
        "bad": tmp_path / "bad.toml",
        "missing": tmp_path / "nope.toml",
        "load": tmp_path / "load",
    }
    args = [a.format(**paths) for a in args]
    proc = subprocess.run(
        CLI + ["--port", "0", "--save-dir", str(tmp_path / "run"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=CLI_ENV,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_cli_refuses_a_short_secret_and_deggs_secret_makes_one(tmp_path):
    deggs = [sys.executable, "-c", "from deggs.cli import main; main()"]
    run = lambda args, **env: subprocess.run(
        deggs + args, capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**CLI_ENV, **env},
    )  # fmt: skip
    proc = run(["coordinator", "--port", "0"], DEGGS_SECRET="monkey2024")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "DEGGS_SECRET has 10 characters; at least 32" in proc.stderr
    assert "`deggs secret > ~/.deggs-secret`" in proc.stderr
    made = [run(["secret"]).stdout.strip() for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{64}", m) for m in made) and made[0] != made[1]
    assert auth.load_secret({"DEGGS_SECRET": made[0]}) == made[0].encode()


# --- deadlines and bounds ----------------------------------------------------------------

QUICK = SMALL.replace(coordinator={"handshake_timeout_s": 0.5, "frame_timeout_s": 0.5})


def test_stalled_and_silent_connections_are_closed_within_their_deadlines(info_logs):
    async def go():
        async with coordinator(QUICK) as coord:
            busy = await Client.connect(coord)  # a worker silent after its handshake stays
            await busy.hello()
            job = await busy.request(0)
            started = time.monotonic()
            silent = await Client.connect(coord)  # connects and says nothing
            half_header = await Client.connect(coord)
            await half_header.send(b"JOB")
            trickle = await Client.connect(coord)  # a frame that never completes
            await trickle.hello()
            await trickle.send(JobRequest(SEED0, 0).encode()[:-1])
            for client in (silent, half_header, trickle):
                assert await client.closed(timeout=3)
            assert time.monotonic() - started < 3
            # busy has been silent since before those three connected, so longer than both
            # deadlines: the sweep that closed them looked at busy too, and left it open.
            await busy.result(job)
            assert (await busy.request(0)).data_position == CHUNK

    run(go())
    messages = " ".join(r.getMessage() for r in info_logs.records)
    assert "no handshake within 0.5 s" in messages
    assert "a frame still unfinished after 0.5 s" in messages


def test_frames_whose_tag_never_comes_are_held_to_the_frame_deadline(info_logs):
    """With a secret, whole frames without their record's tag are not handled, and the
    connection is closed like one with a frame unfinished."""

    async def go():
        async with coordinator(QUICK, secret=SECRET) as coord:
            client = await Client.connect(coord)
            await client.hello(secret=SECRET)
            client.writer.write(JobRequest(SEED0, 0).encode())  # unmarked: a record begun
            started = time.monotonic()
            assert await client.closed(timeout=3)
            assert time.monotonic() - started < 3
            assert list(coord.state.pending) == list(range(N_CHUNKS))  # nothing handed out

    run(go())
    messages = " ".join(r.getMessage() for r in info_logs.records)
    assert "a frame still unfinished after 0.5 s" in messages


def test_a_peer_dripping_bytes_cannot_stretch_a_frame():
    async def go():
        async with coordinator(QUICK) as coord:
            dripper = await Client.connect(coord)
            await dripper.hello()
            started = time.monotonic()
            with contextlib.suppress(ConnectionError):
                for byte in JobRequest(SEED0, 0).encode():
                    await dripper.send(bytes([byte]))
                    await asyncio.sleep(0.1)  # the delay under test, not a wait for anything
            assert await dripper.closed(timeout=3)
            assert time.monotonic() - started < 2

    run(go())


def test_connections_over_the_limit_are_closed_at_once_and_logged_once(info_logs):
    config = SMALL.replace(coordinator={"max_connections": 3})

    async def go():
        async with coordinator(config) as coord:
            kept = [await Client.connect(coord) for _ in range(3)]
            await asyncio.gather(*(c.hello() for c in kept))
            extra = [await Client.connect(coord) for _ in range(20)]
            for client in extra:
                assert await client.closed(timeout=3)
            assert (await kept[0].request(0)).data_position == 0

    run(go())
    # The first refusal as it came, the other 19 in one line (at a tick or the stop).
    refusals = [m for r in info_logs.records if "over the limit of 3" in (m := r.getMessage())]
    counts = [int(re.search(r"refused (\d+) connection", line).group(1)) for line in refusals]
    assert counts == [1, 19], refusals


def test_chunk_of_a_departed_worker_is_handed_out_at_once(info_logs):
    async def go():
        async with coordinator() as coord:
            leaver, stayer = await Client.connect(coord), await Client.connect(coord)
            assert (await leaver.request(0)).data_position == 0
            await leaver.close()
            # the coordinator sees the close at its next read, and requeues the chunk first
            await async_wait_until(
                lambda: coord.state.pending and coord.state.pending[0] == 0,
                5,
                "chunk 0 back at the head of the queue",
            )
            assert (await stayer.request(0)).data_position == 0

    run(go())
    assert any("chunk 0 of step 0 back in the queue" in r.getMessage() for r in info_logs.records)


def test_a_deggs_workers_request_is_held_until_there_is_work(monkeypatch):
    """A reference worker finds WAIT at once and polls; a deggs worker holding no chunk
    has its request answered as soon as there is work (the step's update, a chunk that
    came back), and WAIT only after HOLD_S."""
    monkeypatch.setattr(coordinator_module, "HOLD_S", 1.0)

    async def go():
        async with coordinator() as coord:
            owner = await Client.connect(coord)  # takes every chunk
            jobs = [await owner.request(0) for _ in range(N_CHUNKS)]
            reference = await Client.connect(coord)
            assert (await reference.request(0)).data_position == WAIT  # no HELLO: at once
            waiter = await Client.connect(coord)
            await waiter.hello()

            started = time.monotonic()  # nothing happens: WAIT after HOLD_S
            assert (await waiter.request(0)).data_position == WAIT
            assert time.monotonic() - started >= 1.0

            await waiter.send(JobRequest(SEED0, 0))  # held while every chunk is out ...
            for job in jobs:
                await owner.result(job)
            update = await waiter.recv()  # ... and answered with the update once sealed
            assert (update.last_step, update.data) == (1, pack_trits(step_fitness(0)))

            leaver = await Client.connect(coord)
            jobs = [await leaver.request(1) for _ in range(N_CHUNKS)]
            await waiter.send(JobRequest(seed_of(1), 1))  # held ...
            await leaver.close()
            job = await waiter.recv()  # ... and given a chunk its holder left behind
            assert (job.last_step, job.data) == (1, b"") and job.data_position != WAIT

            # A worker holding a chunk is answered at once (recv gives up after 5 s): its
            # RESULT is not kept waiting behind its request.
            other = await Client.connect(coord)
            for _ in range(N_CHUNKS - 1):
                assert (await other.request(1)).data_position != WAIT
            monkeypatch.setattr(coordinator_module, "HOLD_S", 30.0)
            assert (await waiter.request(1)).data_position == WAIT

    run(go())


def test_a_held_request_gets_a_stragglers_chunk_at_its_deadline(monkeypatch):
    monkeypatch.setattr(coordinator_module, "HOLD_S", 30.0)
    config = SMALL.replace(coordinator={"straggler_timeout_s": 0.3})

    async def go():
        async with coordinator(config) as coord:
            slow = await Client.connect(coord)
            for _ in range(N_CHUNKS):
                await slow.request(0)
            fast = await Client.connect(coord)
            await fast.hello()
            started = time.monotonic()
            job = await fast.request(0)  # held until chunk 0 is 0.3 s old, not 30 s
            assert job.data_position == 0
            assert time.monotonic() - started < 10

    run(go())


def test_a_finished_run_stays_up_for_a_worker_that_may_be_reconnecting(monkeypatch, info_logs):
    """A worker lost just before the end comes back within worker.retry_max_s: it is told
    FINISHED rather than left retrying for ever a port where nobody listens. With no
    worker lost in that time (nor a restart), the coordinator does not wait."""
    monkeypatch.setattr(coordinator_module, "RECONNECT_S", 0.0)
    config = SMALL.replace(worker={"retry_max_s": 2.0})
    staying = "telling reconnecting workers the run is finished"

    def stayed() -> bool:
        return any(staying in r.getMessage() for r in info_logs.records)

    async def go():
        async with coordinator(config, max_steps=1) as coord:
            await asyncio.sleep(2.1)  # past the start's own wait (for a restart's workers)
            lost = await Client.connect(coord)
            await lost.hello()
            await lost.request(0)
            await lost.close()
            trainer = await Client.connect(coord)
            await train_step(trainer, 0, last=True)
            await settle(coord, 1)
            interrupted = asyncio.Event()
            stay = asyncio.create_task(coord.tell_latecomers(interrupted))
            late = await Client.connect(coord)  # the lost worker, back
            await late.hello()
            await late.send(JobRequest(seed_of(1), 1))
            assert (await late.goodbye()).reason == Reason.FINISHED
            assert not stay.done()  # for 2 s after the loss at most: ended here by Ctrl-C
            interrupted.set()
            await stay
            assert stayed()

        info_logs.clear()
        async with coordinator(SMALL.replace(worker={"retry_max_s": 0.3}), max_steps=0) as coord:
            await asyncio.sleep(0.4)
            await coord.tell_latecomers(asyncio.Event())
            assert not stayed()

    run(go())


def test_a_peer_that_does_not_read_its_replies_is_bounded_and_closed():
    config = QUICK.replace(
        coordinator={"max_send_buffer": 1 << 16},
        training={"population_size": 400_000, "chunk_size": 10},
    )

    async def go():
        async with coordinator(config) as coord:
            coord.history.update({s: bytes(40_000) for s in range(1)})
            coord.state.step = 1  # a step behind: every request earns 40 KB of catch-up
            hog = await Client.connect(coord)
            await async_wait_until(lambda: coord.peers, 5, "the hog's connection")
            (peer,) = coord.peers
            request = JobRequest(SEED0, 0).encode()
            # One request at a time, each once the last was answered (pipelining would be
            # closed at once), never reading: 80 MB of replies if they were all queued.
            with contextlib.suppress(ConnectionError):
                for _ in range(2000):
                    sent = coord.state.bytes_sent
                    hog.writer.write(request)
                    await asyncio.wait_for(hog.writer.drain(), 5)
                    await async_wait_until(
                        lambda: coord.state.bytes_sent > sent or peer.write_paused_since,  # noqa: B023
                        5,
                        "a reply",
                    )
                    if peer.write_paused_since is not None:
                        break
            assert peer.write_paused_since is not None, "its replies never piled up"
            # Meanwhile another worker is served as if the hog were not there.
            other = await Client.connect(coord)
            assert (await other.request(1, seed=SEED0)).data_position == 0
            assert peer in coord.peers

            def hog_gone():  # it stops reading the hog, and closes it after the deadline
                queued = [p.transport.get_write_buffer_size() for p in coord.peers]
                assert all(size <= 2 * (1 << 16) + 40_100 for size in queued), queued
                return peer not in coord.peers

            await async_wait_until(hog_gone, 5, "the coordinator to close the hog")

    run(go())


def test_a_peer_that_pipelines_requests_without_reading_is_closed_at_once(info_logs):
    async def go():
        async with coordinator() as coord:
            hog = await Client.connect(coord)
            await hog.send(Hello(SMALL.fingerprint()).encode() + JobRequest(SEED0, 0).encode() * 64)
            assert await hog.closed()
            assert coord.state.in_progress == {}  # not even its first request was served
            honest = await Client.connect(coord)
            assert (await honest.request(0)).data_position == 0

    run(go())
    closed = [r.getMessage() for r in info_logs.records if r.levelno == logging.WARNING]
    assert len(closed) == 1 and "asks for work again without reading the replies" in closed[0], (
        closed
    )


def test_a_connection_that_does_not_ask_for_work_is_closed_after_idle_timeout(info_logs):
    config = SMALL.replace(coordinator={"idle_timeout_s": 0.5})

    async def go():
        async with coordinator(config) as coord:
            busy, idle, silent = [await Client.connect(coord) for _ in range(3)]
            await busy.hello()
            await idle.hello()
            await silent.send(LogMessage("hello"))  # a whole frame: past the handshake
            job = await busy.request(0)  # holds chunk 0: it is at work, not idle
            await idle.result(await idle.request(0))  # holds nothing after its RESULT
            assert await idle.closed() and await silent.closed()
            assert busy.writer.transport is not None and len(coord.peers) == 1
            await busy.result(job)  # still served
            assert (await busy.request(0)).data_position == 2 * CHUNK

    run(go())
    # Without a secret nobody is proven, and two closes are still each a line as it comes.
    closed = [
        r.getMessage() for r in info_logs.records if "has not asked for work" in r.getMessage()
    ]
    assert len(closed) == 2 and all(line.endswith("for 0.5 s") for line in closed), closed


def test_when_connections_run_out_unproven_then_idle_ones_make_room(monkeypatch, info_logs):
    monkeypatch.setattr(server_module, "EVICT_IDLE_S", 0.0)
    config = SMALL.replace(coordinator={"max_connections": 3})

    async def go():
        async with coordinator(config) as coord:
            working, idle = await Client.connect(coord), await Client.connect(coord)
            await working.hello()
            await idle.hello()
            await working.request(0)  # holds chunk 0
            await idle.result(await idle.request(0))  # asked, then nothing
            unproven = await Client.connect(coord)  # connected, said nothing
            await async_wait_until(lambda: len(coord.peers) == 3, 5, "three connections")
            newcomers = []
            for expect_closed in (unproven, idle):  # the unproven first, then the idle
                newcomers.append(await Client.connect(coord))
                await newcomers[-1].hello()
                assert await expect_closed.closed()
            assert (await newcomers[0].request(0)).data_position == 2 * CHUNK
            assert (await newcomers[1].request(0)).data_position == 3 * CHUNK
            # Now all three hold a chunk: a newcomer is refused.
            refused = await Client.connect(coord)
            assert await refused.closed()
            assert len(coord.peers) == 3

    run(go())
    made_room = [r.getMessage() for r in info_logs.records if "make room" in r.getMessage()]
    assert made_room == [
        "closed 1 unproven connection(s) to make room (at 3)",
        "closed 1 idle connection(s) to make room (at 3)",
    ], made_room


def test_failures_of_unproven_peers_are_summarised(info_logs):
    async def go():
        async with coordinator(secret=SECRET) as coord:
            for _ in range(50):
                bad = await Client.connect(coord)
                await bad.send(b"GET / HTTP/1.1\r\n\r\n")
                assert await bad.closed()
            for burst in coord.lines.bursts.values():
                burst.start -= 1.0  # as if a second had passed
            last = await Client.connect(coord)
            await last.send(b"GET /other HTTP/1.1\r\n\r\n")
            assert await last.closed()

    run(go())
    lines = [r.getMessage() for r in info_logs.records if "bad magic" in r.getMessage()]
    # The first PEER_LINES as they came, the rest of that second as a count, and the
    # last (in a second that follows a counted one: counted too) said at the stop. On a
    # slow box the 50 may span more seconds, and more counts: none is lost.
    alone = "dropping: bad magic b'GET ' (expected b'JOBS')"
    assert all(line.endswith(alone) for line in lines[: server_module.PEER_LINES]), lines
    counts = [
        re.search(r"\((\d+) such from unproven peers since the last such line\)$", line)
        for line in lines
    ]
    assert sum(int(m.group(1)) if m else 1 for m in counts) == 51, lines
    assert counts[server_module.PEER_LINES] is not None and lines[-1].endswith(alone), lines


def test_log_lines_of_unproven_peers_are_bounded_and_counted(info_logs):
    """Without a secret a LOG_MESSAGE's lines are bounded like other lines about peers:
    LOG_LINES a second as they come, the rest as a count; none goes uncounted."""

    async def go():
        async with coordinator() as coord:
            a = await Client.connect(coord)
            await a.send(LogMessage("".join(f"line {i}\n" for i in range(1000))))
            assert (await a.request(0)).data_position == 0  # the message was handled

    run(go())
    lines = [r.getMessage() for r in info_logs.records if "] line " in r.getMessage()]
    assert len(lines) <= server_module.LOG_LINES + 2, len(lines)
    counts = [re.search(r"\((\d+) log lines since the last such count", line) for line in lines]
    assert sum(int(m.group(1)) if m else 1 for m in counts) == 1000, lines[-2:]
    assert lines[-1].startswith("[127.0.0.1:") and "line 999 (" in lines[-1], lines[-1]


def test_a_drifted_worker_that_reports_again_is_closed(info_logs):
    config = SMALL.replace(coordinator={"digest_every_steps": 1})
    A, B = b"\xaa" * 32, b"\xbb" * 32

    async def go():
        async with coordinator(config) as coord:
            worker, stranger = await Client.connect(coord), await Client.connect(coord)
            await worker.hello(config)
            await stranger.hello(config)
            await train_step(worker, 0)
            await worker.send(Digest(1, A))
            await stranger.send(Digest(1, B))  # no chunk of step 1: no vote
            await train_step(worker, 1)
            assert coord.replicas.book.agreed[1] == A  # the worker's, though outvoted 1 to 1
            assert coord.state.drifted == {}  # the stranger's was held to it: drifted
            await stranger.send(Digest(1, B))  # again, before asking for the snapshot
            assert await stranger.closed()

    run(go())
    said = [r.getMessage() for r in info_logs.records]
    assert any("drifted: its state at step 1 has digest 'bbbb" in line for line in said), said
    assert any("a DIGEST from a worker that drifted, before it resynced" in m for m in said)


def test_a_steps_rows_of_workers_without_a_chunk_are_bounded(monkeypatch, tmp_path):
    monkeypatch.setattr(coordinator_module, "WORKER_ROWS", 2)

    async def go():
        async with coordinator(save_dir=tmp_path) as coord:
            worker = await Client.connect(coord)
            jobs = [await worker.request(0) for _ in range(N_CHUNKS)]  # it holds them all
            for _ in range(3):
                idle = await Client.connect(coord)
                assert (await idle.request(0)).data_position == WAIT
            for job in jobs:
                await worker.result(job)
            await settle(coord, 1)
            return worker.port

    port = asyncio.run(asyncio.wait_for(go(), 20))
    (record,) = ckpt.read_metrics(tmp_path)
    assert len(record["workers"]) == 2 and f"127.0.0.1:{port}" in record["workers"]


def test_a_burst_says_its_count_within_a_window(monkeypatch):
    """A bounded line says the events it counted when its window ends, even if no event
    follows; a window after a counted one counts all of its own; a quiet one does not."""
    now = [100.0]
    monkeypatch.setattr(server_module.time, "monotonic", lambda: now[0])
    said: list[str] = []
    logger = logging.getLogger("test_burst")
    monkeypatch.setattr(logger, "log", lambda level, line: said.append(line))
    burst = server_module.Burst(logger, "{n} times {what}", 1.0, alone="once {what}", lines=2)

    def at(t, *events):
        now[0] = 100.0 + t
        for what in events:
            burst.note(what=what)
        burst.tick()

    at(0.0, "a", "b", "c", "d", "e")
    assert said == ["once a", "once b"]  # the other three counted
    at(0.5)
    assert said == ["once a", "once b"]
    at(1.0)
    assert said[2:] == ["3 times e"]
    at(1.5, "f")  # the window after a counted one: counted
    assert said[3:] == []
    at(2.0)
    assert said[3:] == ["once f"]  # a count of one is the event's own line
    at(3.0, "g")  # after a quiet window: as it comes
    assert said[4:] == ["once g"]
    for what in "hij":
        burst.note(what=what)
    burst.flush()  # the stop: what is counted is said
    assert said[5:] == ["once h", "2 times j"]


def test_without_a_secret_the_count_does_not_speak_of_proof():
    lines = server_module.PeerLines(secret=False)

    class Someone:
        name, authenticated = "127.0.0.1:1", False

    for _ in range(server_module.PEER_LINES + 1):
        lines.say(Someone(), logging.INFO, "joined")  # type: ignore[arg-type]
    (burst,) = lines.bursts.values()
    assert burst.count == 1 and "unproven" not in burst.message and "proof" not in burst.message


# --- durability ----------------------------------------------------------------------------


def test_no_catch_up_and_no_next_step_before_the_checkpoint_is_durable(tmp_path, monkeypatch):
    release, committing = threading.Event(), threading.Event()
    real_commit = ckpt.commit_step

    def slow_commit(*args):
        committing.set()
        assert release.wait(10)
        real_commit(*args)

    monkeypatch.setattr(ckpt, "commit_step", slow_commit)

    async def go():
        async with coordinator(save_dir=tmp_path) as coord:
            a, late = await Client.connect(coord), await Client.connect(coord)
            await train_step(a, 0, last=True)
            await async_wait_until(committing.is_set, 5, "the checkpoint write to begin")
            for _ in range(5):  # while the fsync is pending: WAIT, no update
                reply = await a.request(0)
                assert reply.data_position == WAIT and reply.data == b""
            assert not ckpt.list_checkpoints(tmp_path) and coord.state.step == 0
            release.set()
            await settle(coord, 1)
            assert ckpt.load_latest(tmp_path).step == 1
            assert (await late.request(0)).data == pack_trits(step_fitness(0))

    run(go())


def test_a_failing_disk_stops_the_run_with_no_hole_in_the_history(tmp_path, monkeypatch, info_logs):
    config = SMALL.replace(coordinator={"disk_retry_s": 0.3})
    real_commit = ckpt.commit_step
    calls = []

    def commit_until_full(directory, checkpoint, record, metrics=None):
        calls.append(checkpoint.step)
        if checkpoint.step >= 3:  # steps 0 and 1 fit; then the disk is full
            with open(Path(directory) / ckpt.METRICS_FILE, "ab") as f:
                f.write(b'{"step": 2, "tor')  # a torn line, as a full disk leaves
            raise OSError(28, "No space left on device")
        real_commit(directory, checkpoint, record, metrics)

    monkeypatch.setattr(ckpt, "commit_step", commit_until_full)

    async def go():
        async with coordinator(config, save_dir=tmp_path) as coord:
            a = await Client.connect(coord)
            await a.hello()
            await train_step(a, 0)
            await train_step(a, 1)
            await train_step(a, 2, last=True)
            await asyncio.wait_for(coord.ended.wait(), 5)
            assert coord.failure and "No space left on device" in coord.failure
            assert coord.state.step == 2  # never moved past what is on disk
            return calls

    assert len(run_value(go())) > 1  # retried before giving up
    assert sorted(ckpt.list_checkpoints(tmp_path)) == [1, 2]
    assert [r["step"] for r in ckpt.read_metrics(tmp_path)] == [0, 1]  # 2 torn: skipped
    monkeypatch.setattr(ckpt, "commit_step", real_commit)

    async def resume():
        async with coordinator(config, save_dir=tmp_path, load_dir=tmp_path) as coord:
            assert coord.state.step == 2
            a = await Client.connect(coord)
            for step in (0, 1):  # a fresh worker replays from disk...
                assert (await a.request(step)).data == pack_trits(step_fitness(step))
            await train_step(a, 2)  # ...and trains the step that failed

    run(resume())
    assert [r["step"] for r in ckpt.read_metrics(tmp_path)] == [0, 1, 2]
    assert sorted(ckpt.list_checkpoints(tmp_path)) == [1, 2, 3]
    assert any("retrying" in r.getMessage() for r in info_logs.records)


def run_value(coro, timeout=20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_metrics_survive_a_torn_last_line(tmp_path):
    path = tmp_path / ckpt.METRICS_FILE
    path.write_bytes(b'{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    ckpt.append_metrics(tmp_path, {"step": 1, "loss": 0.5})
    ckpt.append_metrics(tmp_path, {"step": 1, "loss": 0.25})  # step 1 run again after a crash
    assert [(r["step"], r["loss"]) for r in ckpt.read_metrics(tmp_path)] == [(0, 1.0), (1, 0.25)]
    ckpt.tidy_metrics(tmp_path, 1)
    assert path.read_text().splitlines() == ['{"step": 0, "loss": 1.0}']


def test_metrics_deleted_or_truncated_under_a_running_coordinator_are_rewritten(
    tmp_path, info_logs
):
    path = tmp_path / ckpt.METRICS_FILE

    async def go():
        async with coordinator(save_dir=tmp_path) as coord:
            a = await Client.connect(coord)
            await train_step(a, 0)
            await train_step(a, 1)
            await settle(coord, 2)
            path.unlink()  # deleted mid-run
            await train_step(a, 2)
            await settle(coord, 3)
            path.write_bytes(path.read_bytes()[:10])  # truncated mid-run
            await train_step(a, 3)
            await settle(coord, 4)

    run(go())
    assert [r["step"] for r in ckpt.read_metrics(tmp_path)] == [0, 1, 2, 3]
    warned = [r.getMessage() for r in info_logs.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned
    assert (
        "metrics.jsonl vanished under the running coordinator; rewriting it from the 2"
        in (warned[0])
    )
    assert "shrank or was replaced" in warned[1] and "from the 3 records" in warned[1]


async def train(save_dir, steps: int):
    async with coordinator(save_dir=save_dir) as coord:
        a = await Client.connect(coord)
        for step in range(steps):
            await train_step(a, step)
        await settle(coord, steps)


def change_byte(path: Path, offset: int, value: int):
    data = bytearray(path.read_bytes())
    assert data[offset] != value
    data[offset] = value
    path.write_bytes(bytes(data))


FITNESS_AT = 32  # a checkpoint's header is 32 bytes; its packed fitness follows
SEED_AT = 16


def test_a_checkpoint_changed_on_disk_is_refused_naming_the_file(tmp_path, info_logs):
    """One fitness byte changed to another valid value: refused on load (the newest) and
    for catch-up (an older one), naming the file; the run never trains on it."""
    run(train(tmp_path, 3))
    newest, older = ckpt.checkpoint_path(tmp_path, 3), ckpt.checkpoint_path(tmp_path, 1)
    first = tmp_path.joinpath(newest.name).read_bytes()[FITNESS_AT]
    change_byte(newest, FITNESS_AT, (first + 1) % 243)  # still packed trits
    with pytest.raises(ckpt.CheckpointError) as refused:
        Coordinator(SMALL, load_dir=tmp_path)
    assert str(newest) in str(refused.value) and "SHA-256" in str(refused.value)
    assert "resumes from the step before" in str(refused.value)

    newest.unlink()  # as the refusal says: resume from step 2
    first = older.read_bytes()[FITNESS_AT]
    change_byte(older, FITNESS_AT, (first + 1) % 243)

    async def go():
        async with coordinator(load_dir=tmp_path) as coord:
            assert coord.state.step == 2
            fresh = await Client.connect(coord)
            await fresh.hello()
            await fresh.send(JobRequest(SEED0, 0))  # needs checkpoint 1 to catch up
            assert (await fresh.goodbye()).reason == Reason.HISTORY_GONE

    run(go())
    errors = [r.getMessage() for r in info_logs.records if r.levelno == logging.ERROR]
    assert any(str(older) in e and "SHA-256" in e for e in errors), errors


@pytest.mark.parametrize("step", [1, 3], ids=["older", "newest"])
def test_a_broken_seed_chain_is_refused_naming_the_file(tmp_path, step):
    run(train(tmp_path, 3))
    path = ckpt.checkpoint_path(tmp_path, step)
    data = path.read_bytes()
    change_byte(path, SEED_AT, data[SEED_AT] ^ 1)
    (tmp_path / ckpt.MANIFEST_FILE).unlink()  # as the reference's dirs: the seed alone
    with pytest.raises(ckpt.CheckpointError, match=f"{path.name}: seed .* not step {step}'s"):
        Coordinator(SMALL, load_dir=tmp_path)


def test_a_reference_save_dir_without_checksums_loads(tmp_path):
    for step in (1, 2):  # written as the reference does: no checkpoints.sha256
        ckpt.write_atomic(
            ckpt.checkpoint_path(tmp_path, step),
            ckpt.encode_checkpoint(ckpt.Checkpoint(step, seed_of(step), bytes(4))),
        )
    coord = Coordinator(SMALL, load_dir=tmp_path)
    assert (coord.state.step, coord.state.seed) == (2, seed_of(2))


def test_checkpoints_removed_on_purpose_are_no_error(tmp_path):
    run(train(tmp_path, 4))
    for step in (1, 2):  # pruned: gone, their checksums still listed
        ckpt.checkpoint_path(tmp_path, step).unlink()
    assert Coordinator(SMALL, load_dir=tmp_path).state.step == 4
    ckpt.forget_checkpoints(tmp_path, 3)
    assert sorted(ckpt.read_manifest(tmp_path)) == [
        "checkpoint_00000003.bin",
        "checkpoint_00000004.bin",
    ]
    change_byte(ckpt.checkpoint_path(tmp_path, 4), FITNESS_AT, 0)  # still checked
    with pytest.raises(ckpt.CheckpointError, match="checkpoint_00000004.bin: its SHA-256"):
        Coordinator(SMALL, load_dir=tmp_path)


# --- model health and TensorBoard ------------------------------------------------------------

HEALTH = (
    HealthEntry("embedding", 0.01, 8.8, 0.0, 4.9),
    HealthEntry("layers.1.w_q", -0.5, 30.0, 0.07, 6.5),
    HealthEntry("layers.3.w_up", 2.0, 60.0, 0.2, 7.0),
    HealthEntry("act.final_norm", -2.3, 18.8, 0.01, 6.2),
)


def figures(entries) -> dict:
    return {
        e.name: {"mean": e.mean, "std": e.std, "saturation": e.saturation, "entropy": e.entropy}
        for e in entries
    }


async def train_with_health(coord, steps=2):
    """A deggs worker reports its model's health and validation loss before its first
    chunk of step 0 (another worker's later report of the step, and a report of a past
    step, count for nothing); then it trains `steps` steps."""
    a, b = await Client.connect(coord), await Client.connect(coord)
    await a.hello(), await b.hello()
    await a.send(Evaluation(0, 2, 128, 1024, 300.0, 128))
    await a.send(Health(0, HEALTH))
    await b.send(Health(0, HEALTH[:1]))
    for step in range(steps):
        await train_step(a, step, last=step == steps - 1)
        if step == 0:
            await a.send(Health(0, HEALTH))
    await settle(coord, steps)


def test_health_reaches_the_metrics_and_saturation_is_warned(tmp_path, info_logs):
    async def go():
        async with coordinator(save_dir=tmp_path) as coord:
            await train_with_health(coord)

    run(go())
    records = ckpt.read_metrics(tmp_path)
    assert records[0]["health"] == figures(HEALTH)
    assert "health" not in records[1]
    warnings = [r.getMessage() for r in info_logs.records if r.levelno == logging.WARNING]
    assert warnings == [
        "saturation at step 0 above eval.saturation_warning = 5% in 2 of 4: "
        "layers.3.w_up 20.00%, layers.1.w_q 7.00%"
    ]
    assert any(
        r.getMessage().startswith(
            "health at step 0: 4 entries, most saturated layers.3.w_up (20.00%), lowest "
            "entropy embedding (4.90 bits)"
        )
        for r in info_logs.records
    )


def test_health_with_more_entries_than_the_model_has_is_refused(info_logs):
    too_many = tuple(HealthEntry(f"e{i}", 0.0, 1.0, 0.0, 1.0) for i in range(61))

    async def go():
        async with coordinator() as coord:
            assert coord.health_entries == 60  # 58 parameter slices at 4 layers, 2 activations
            a = await Client.connect(coord)
            await a.hello()
            await a.send(Health(0, too_many))
            assert await a.closed()
            assert coord.state.health is None

    run(go())
    assert any(
        "HEALTH with 61 entries, the model has 60" in r.getMessage() for r in info_logs.records
    )


def read_events(directory: Path) -> dict:
    """{(step, tag): value} of the one TensorBoard event file in DIRECTORY, every record's
    length and data checked against their CRCs (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    (path,) = directory.glob("events.out.tfevents.*")
    data, pos, scalars = path.read_bytes(), 0, {}
    while pos < len(data):
        head, (head_crc,) = data[pos : pos + 8], struct.unpack_from("<I", data, pos + 8)
        (length,) = struct.unpack("<Q", head)
        body = data[pos + 12 : pos + 12 + length]
        (body_crc,) = struct.unpack_from("<I", data, pos + 12 + length)
        assert (head_crc, body_crc) == (masked_crc32c(head), masked_crc32c(body))
        event = Event.FromString(body)
        for value in event.summary.value:
            scalars[event.step, value.tag] = value.simple_value
        pos += 12 + length + 4
    return scalars


def test_tensorboard_gets_the_scalars_of_the_metrics(tmp_path):
    async def go():
        async with coordinator(save_dir=tmp_path / "run", tensorboard_dir=tmp_path / "tb") as coord:
            await train_with_health(coord)

    run(go())
    records = ckpt.read_metrics(tmp_path / "run")
    scalars = read_events(tmp_path / "tb")
    for r in records:
        for key in ("loss", "tokens_per_s", "lr"):
            assert scalars[r["step"], key] == pytest.approx(r[key], rel=1e-6)  # float32
    assert scalars[0, "val_loss"] == pytest.approx(records[0]["val_loss"]) == 0.5
    assert scalars[0, "val_bits_per_token"] == pytest.approx(records[0]["val_bits_per_token"])
    assert scalars[0, "val_bits_per_byte"] == pytest.approx(records[0]["val_bits_per_byte"])
    for e in HEALTH:
        assert scalars[0, f"saturation/{e.name}"] == pytest.approx(e.saturation)
        assert scalars[0, f"entropy/{e.name}"] == pytest.approx(e.entropy)
    assert (1, "val_loss") not in scalars and (1, "saturation/embedding") not in scalars
    assert {step for step, _ in scalars} == {0, 1}


def test_a_failing_tensorboard_disk_is_warned_once_and_training_goes_on(tmp_path, info_logs):
    async def go():
        async with coordinator(save_dir=tmp_path / "run", tensorboard_dir=tmp_path / "tb") as coord:
            writes = []

            def full(event):
                writes.append(event.step)
                raise OSError(28, "No space left on device")

            coord.tensorboard._writer.write_event = full
            await train_with_health(coord, steps=3)
            assert writes == [0] and not coord.tensorboard.active

    run(go())
    assert [r["step"] for r in ckpt.read_metrics(tmp_path / "run")] == [0, 1, 2]
    warnings = [r.getMessage() for r in info_logs.records if "TensorBoard" in r.getMessage()]
    assert warnings == [
        f"cannot write TensorBoard events in {tmp_path / 'tb'} (No space left on device): no "
        "more TensorBoard output in this run; metrics.jsonl goes on"
    ]


def test_tensorboard_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    from deggs.runtime.tensorboard import TensorBoard, TensorBoardError

    (tmp_path / "file").write_text("")
    with pytest.raises(TensorBoardError, match="cannot write TensorBoard events in .*file"):
        TensorBoard(tmp_path / "file")
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboardX"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    with pytest.raises(TensorBoardError, match=re.escape("pip install 'deggs[tensorboard]'")):
        TensorBoard(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def test_cli_without_tensorboardx_says_which_extra_to_install(tmp_path):
    (tmp_path / "small.toml").write_text(SMALL_TOML)
    hidden = "import sys; sys.modules['tensorboardX'] = None; "  # as if it were not installed
    proc = subprocess.run(
        [sys.executable, "-c", hidden + CLI[2]]
        + ["--config", str(tmp_path / "small.toml"), "--port", "0"]
        + ["--save-dir", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")],
        capture_output=True,
        text=True,
        timeout=60,
        env=CLI_ENV,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("deggs-coordinator: error: --tensorboard needs the tensorboardX ")
    assert line.endswith("): pip install 'deggs[tensorboard]'")
    assert not (tmp_path / "run").exists()  # the save directory untouched


def test_the_training_loss_is_put_in_bits_by_the_latest_validation(tmp_path, info_logs):
    async def go():
        async with coordinator(save_dir=tmp_path) as coord:
            await train_with_health(coord)

    run(go())
    first, second = ckpt.read_metrics(tmp_path)
    # the validation: 1024 / 16 units over 128 tokens = 0.5, and 300 nats over 128 tokens
    per_unit = 300.0 / 128 / math.log(2) / 0.5
    for r in (first, second):  # the second step has no validation: the first one's scale
        assert r["bits_per_token"] == pytest.approx(r["loss"] * per_unit)
        assert r["bits_per_byte"] == pytest.approx(r["bits_per_token"])  # a byte a token
    assert "val_loss" not in second
    lines = [r.getMessage() for r in info_logs.records if r.getMessage().startswith("Step ")]
    assert f"Train: {first['bits_per_token']:.3f} bits/token (mean of 40 perturbed" in lines[0]
    assert f"Val: {first['val_bits_per_token']:.3f} bits/token (unperturbed model)" in lines[0]
    assert "Val:" not in lines[1]
    # The trend stands by the integer loss it compares (a validation rescales the bits).
    before, after = first["loss"], second["loss"]
    trend = "v" if after < before else "^" if after > before else "="
    assert f"loss {second['loss']:.4f} {trend}) | " in lines[1], lines[1]


def test_without_a_validation_the_loss_stays_in_its_own_units(tmp_path, info_logs):
    async def go():
        async with coordinator(save_dir=tmp_path) as coord:
            a = await Client.connect(coord)
            await train_step(a, 0, last=True)
            await settle(coord, 1)

    run(go())
    (record,) = ckpt.read_metrics(tmp_path)
    assert "bits_per_token" not in record and "bits_per_byte" not in record
    (line,) = [r.getMessage() for r in info_logs.records if r.getMessage().startswith("Step ")]
    assert "| Loss: " in line and "bits/token" not in line


def test_a_resumed_step_is_marked_and_keeps_the_bits_scale(tmp_path):
    async def first():
        async with coordinator(save_dir=tmp_path) as coord:
            await train_with_health(coord)

    async def second():
        async with coordinator(save_dir=tmp_path, load_dir=tmp_path) as coord:
            assert coord.state.step == 2
            a = await Client.connect(coord)
            await train_step(a, 2)
            await train_step(a, 3, last=True)
            await settle(coord, 4)

    run(first())
    run(second())
    records = ckpt.read_metrics(tmp_path)
    assert [r.get("resumed", False) for r in records] == [False, False, True, False]
    per_unit = records[0]["val_bits_per_token"] / records[0]["val_loss"]
    assert records[3]["bits_per_token"] == pytest.approx(records[3]["loss"] * per_unit)


@pytest.mark.parametrize(
    "sig, reason",
    [
        (signal.SIGINT, Reason.STOPPED),  # Ctrl-C: the run ends, and its workers with it
        (signal.SIGTERM, Reason.STOPPED),
        (signal.SIGUSR1, Reason.SHUTTING_DOWN),  # back soon: the workers keep waiting
        (signal.SIGHUP, Reason.SHUTTING_DOWN),
    ],
)
def test_cli_signals_tell_the_workers_whether_the_run_ends(tmp_path, sig, reason):
    cli = CliProcess(tmp_path)
    port = int(cli.wait_for(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    config = Config().replace(training={"population_size": 40, "chunk_size": 10})
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        send_frame(sock, Hello(config.fingerprint(), config.to_json(), auth.new_nonce()).encode())
        assert isinstance(decode_message(*recv_frame(sock, ANY_FRAME, 20, 20)), HelloReply)
        cli.proc.send_signal(sig)
        goodbye = decode_message(*recv_frame(sock, ANY_FRAME, 20, 20))
    assert isinstance(goodbye, Goodbye) and goodbye.reason == reason, goodbye
    assert cli.finish() == 0, cli.output
    assert any(sig.name in line for line in cli.output), cli.output


def test_cli_keeps_an_ignored_sighup_ignored(tmp_path):
    """Under nohup a closed terminal's SIGHUP is ignored: the coordinator keeps running."""
    code = (
        "import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
        "from deggs.cli import coordinator_main; coordinator_main()"
    )
    (tmp_path / "small.toml").write_text(SMALL_TOML)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--config", str(tmp_path / "small.toml")]
        + ["--host", "127.0.0.1", "--port", "0", "--save-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=CLI_ENV,
    )
    try:
        for line in proc.stdout:
            if "listening on" in line:
                break
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGTERM)  # signals arrive in order: SIGHUP was seen first
        output = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "SIGTERM: the run ends here" in output and "SIGHUP" not in output, output


@pytest.mark.parametrize("chunk", [10, 8])  # 5 pairs a chunk fill whole bytes; 4 do not
def test_a_steps_packed_fitness_is_its_fitness_packed(chunk):
    s = StepState.fresh(SMALL.replace(training={"chunk_size": chunk}), 0, SEED0, 0.0)
    rng = np.random.default_rng(chunk)
    for i in range(s.n_chunks - 1):  # the last chunk not in: zeros
        s.packed[i] = pack_trits(rng.integers(-1, 2, s.chunk_pairs))
    assert s.packed_fitness() == pack_trits(s.fitness())
