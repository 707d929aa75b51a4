"""The worker against scripted fake coordinators on loopback.

A FakeCoordinator accepts one connection per script, in order, and runs that script on
it in a thread; the worker runs in another thread, bounded by TIMEOUT_S. Nothing here
sleeps to synchronise: scripts block on the worker's frames, tests on queues, and the
worker's pauses between reconnects are recorded instead of slept where they matter.
"""

import contextlib
import os
import queue
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from threadpoolctl import threadpool_info, threadpool_limits
from tiny import tiny_config, toml_of

from deggs.cli import worker_main
from deggs.runtime import auth
from deggs.runtime import progress as progress_module
from deggs.runtime import worker as worker_module
from deggs.runtime.channel import Channel, sealed_limits
from deggs.runtime.protocol import (
    OPCODE_NAMES,
    Auth,
    Challenge,
    Goodbye,
    Health,
    Hello,
    HelloReply,
    JobRequest,
    JobResponse,
    LogMessage,
    Reason,
    Result,
    decode_message,
    frame,
    recv_frame,
)
from deggs.runtime.worker import ChunkProgress, Worker, WorkerError
from deggs.ternary import pack_trits, packed_size

CFG = tiny_config(
    training={"population_size": 64, "chunk_size": 16},
    worker={"retry_max_s": 0.2, "reply_timeout_s": 2, "frame_timeout_s": 1},
)
TOML = toml_of(CFG)
SEED = CFG.training.seed
N_PAIRS = CFG.training.n_pairs
SECRET = b"correct horse battery staple and then some"
ANY_FRAME = dict.fromkeys(OPCODE_NAMES, 1 << 24)  # what a fake coordinator accepts
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data")
    (path / "input.bin").write_bytes(
        np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes()
    )
    return path


# --- the fake coordinator ----------------------------------------------------------------


class Peer:
    """The coordinator's end of one connection, speaking deggs.runtime.protocol frames."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.channel: Channel | None = None  # once the worker proved the secret
        self.checked: deque = deque()  # frames whose record's tag was checked

    def send(self, *messages):
        data = b"".join(m if isinstance(m, bytes) else m.encode() for m in messages)
        self.sock.sendall(data if self.channel is None else self.channel.seal(data))

    def recv(self):
        """The worker's next message, or None once it closed the connection."""
        if self.channel is None:
            item = self._frame(ANY_FRAME)
            return None if item is None else decode_message(*item)
        while not self.checked:
            item = self._frame(sealed_limits(ANY_FRAME))
            if item is None:
                return None
            self.checked += self.channel.feed(frame(*item))
        return decode_message(*self.checked.popleft())

    def _frame(self, limits):
        try:
            return recv_frame(self.sock, limits, TIMEOUT_S, TIMEOUT_S)
        except ConnectionResetError:
            return None

    def expect(self, kind):
        message = self.recv()
        assert isinstance(message, kind), f"expected a {kind.__name__}, got {message!r}"
        return message

    def welcome(self, config=CFG, pipelined=True) -> Hello:
        """A deggs coordinator without a secret: HELLO (and the pipelined JOB_REQUEST)
        answered with HELLO_REPLY."""
        hello = self.expect(Hello)
        if pipelined:
            assert self.expect(JobRequest) == JobRequest(SEED, 0)
        self.send(HelloReply(config.fingerprint(), config.to_json()))
        return hello

    def drain(self) -> list:
        """Read until the worker closes the connection; returns what it sent meanwhile.
        (Closing our end with its bytes unread would reset the connection instead.)"""
        messages = []
        while (message := self.recv()) is not None:
            messages.append(message)
        return messages


class FakeCoordinator:
    """Listens on loopback; runs scripts[i](Peer) on the i-th connection, then stops
    listening. `connections` gets the index of every connection as it is accepted."""

    def __init__(self, *scripts, port=0):
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port = self.listener.getsockname()[1]
        self.scripts = scripts
        self.connections: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.listener.settimeout(TIMEOUT_S)
        try:
            for index, script in enumerate(self.scripts):
                conn, _ = self.listener.accept()
                self.connections.put(index)
                with conn:
                    conn.settimeout(TIMEOUT_S)
                    try:
                        script(Peer(conn))
                    except BaseException as e:  # reported by check()
                        self.errors.append(e)
                        return
        finally:
            self.listener.close()

    def check(self):
        """Every script ran to its end without a failed assertion."""
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive(), "the fake coordinator is still running"
        if self.errors:
            raise self.errors[0]


def make_worker(port, data_dir, cfg=CFG, secret=None, host="127.0.0.1"):
    lines: list[str] = []
    worker = Worker(
        host, port, cfg, data_dir, backend="cpu", threads=1, log=lines.append, secret=secret
    )
    worker.lines = lines
    return worker


def run_worker(worker, max_steps=None):
    """worker.run() in a thread, bounded in time; re-raises what it raised."""
    outcome: queue.Queue = queue.Queue()

    def target():
        try:
            worker.run(max_steps)
            outcome.put(None)
        except BaseException as e:
            outcome.put(e)

    threading.Thread(target=target, daemon=True).start()
    try:
        error = outcome.get(timeout=TIMEOUT_S)
    except queue.Empty:
        pytest.fail("the worker did not stop:\n" + "\n".join(worker.lines))
    if error is not None:
        raise error


@pytest.fixture
def pauses(monkeypatch):
    """The worker's sleeps, recorded rather than slept."""
    recorded: list[float] = []
    fake_time = SimpleNamespace(
        sleep=recorded.append, perf_counter=time.perf_counter, monotonic=time.monotonic
    )
    monkeypatch.setattr(worker_module, "time", fake_time)
    return recorded


def finish(peer: Peer):
    peer.send(Goodbye(Reason.FINISHED, "the run reached step 0"))
    peer.drain()


# --- farewells ----------------------------------------------------------------------------


def test_goodbye_finished_ends_the_run(data_dir):
    def script(peer):
        peer.welcome()  # the JOB_REQUEST came right after HELLO, unanswered
        finish(peer)

    fake = FakeCoordinator(script)
    worker = make_worker(fake.port, data_dir)
    run_worker(worker)
    fake.check()
    assert "[coordinator] FINISHED: the run reached step 0" in worker.lines
    assert worker.lines[-1] == (
        "[worker] the run is finished; this worker's model is at step 0 "
        "(the last step's update is kept in the checkpoints)"
    )


def test_permanent_goodbye_is_a_worker_error_on_one_line(data_dir):
    def script(peer):
        peer.expect(Hello)
        peer.send(Goodbye(Reason.CONFIG_MISMATCH, "configs differ\n\x1b[31mforged line"))
        peer.drain()

    fake = FakeCoordinator(script)
    with pytest.raises(WorkerError, match="CONFIG_MISMATCH") as error:
        run_worker(make_worker(fake.port, data_dir))
    fake.check()
    assert str(error.value).endswith(r"configs differ\n\x1b[31mforged line")


def test_shutting_down_reconnects_and_coordinator_text_is_escaped(data_dir):
    def going_away(peer):
        peer.welcome()
        peer.send(
            LogMessage("first line\nsecond \x1b[2J line\n"),
            Goodbye(Reason.SHUTTING_DOWN, "the coordinator is shutting down"),
        )
        peer.drain()

    def back(peer):
        peer.welcome()
        finish(peer)

    fake = FakeCoordinator(going_away, back)
    worker = make_worker(fake.port, data_dir)
    run_worker(worker)
    fake.check()
    assert "[coordinator] first line" in worker.lines
    assert r"[coordinator] second \x1b[2J line" in worker.lines
    assert "[coordinator] SHUTTING_DOWN: the coordinator is shutting down" in worker.lines
    assert not any("\x1b" in line for line in worker.lines)
    assert worker.lines[-1] == (
        "[worker] the run is finished; this worker's model is at step 0 "
        "(the last step's update is kept in the checkpoints)"
    )


def test_a_goodbye_left_before_a_reset_is_read_when_the_result_cannot_be_sent(data_dir, pauses):
    """The coordinator finished while this worker scored a chunk (or was stopped), said
    GOODBYE and reset the connection: the RESULT's send fails, the GOODBYE is still in
    our socket and ends the run. Without it the worker would retry for ever."""

    def finished_meanwhile(peer):
        peer.welcome()
        peer.send(
            JobResponse(SEED, 0, CFG.training.chunk_size),
            Goodbye(Reason.FINISHED, "the run reached step 1"),
        )
        # a reset, as LINGER_S running out sends one: closing with no lingering
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.sock.close()

    fake = FakeCoordinator(finished_meanwhile)
    worker = make_worker(fake.port, data_dir)
    run_worker(worker)
    fake.check()
    assert worker.chunks_done == 1
    assert "[coordinator] FINISHED: the run reached step 1" in worker.lines
    assert not pauses  # no reconnect


# --- the handshake --------------------------------------------------------------------------


def challenge(peer, secret=SECRET):
    """A deggs coordinator with a secret: HELLO answered with CHALLENGE; returns the
    (worker's, coordinator's) nonces."""
    hello = peer.expect(Hello)
    ours = auth.new_nonce()
    peer.send(Challenge(ours, auth.proof(secret, "coordinator", hello.nonce, ours)))
    return hello.nonce, ours


def prove(peer):
    """A deggs coordinator with a secret, up to and including HELLO_REPLY: from the
    worker's AUTH on, every frame both ways is tagged."""
    theirs, ours = challenge(peer)
    # Nothing pipelined: the worker's next frame is its proof.
    assert peer.expect(Auth).proof == auth.proof(SECRET, "worker", theirs, ours)
    peer.channel = Channel.for_coordinator(SECRET, theirs, ours, ANY_FRAME)
    peer.send(HelloReply(CFG.fingerprint(), CFG.to_json()))


def test_secret_handshake(data_dir):
    def script(peer):
        prove(peer)
        assert peer.expect(JobRequest) == JobRequest(SEED, 0)
        finish(peer)

    fake = FakeCoordinator(script)
    worker = make_worker(fake.port, data_dir, secret=SECRET)
    run_worker(worker)
    fake.check()
    assert any("shared secret proven" in line for line in worker.lines)


def impostor(*frames, secret=None):
    """A fake coordinator's script that answers HELLO with `frames` (raw, untagged) or,
    with `secret`, a CHALLENGE proving that secret; it never learns the worker's proof."""

    def script(peer):
        if secret is not None:
            challenge(peer, secret=secret)
        else:
            peer.expect(Hello)
        peer.send(*frames)
        assert peer.drain() == []  # no AUTH: our proof is not given to an impostor

    return script


IMPOSTORS = {
    "GOODBYE FINISHED": impostor(Goodbye(Reason.FINISHED, "the run reached step 999")),
    "GOODBYE CONFIG_MISMATCH": impostor(Goodbye(Reason.CONFIG_MISMATCH, "forged")),
    "GOODBYE SHUTTING_DOWN": impostor(Goodbye(Reason.SHUTTING_DOWN, "forged")),
    "a log line, then GOODBYE": impostor(LogMessage("Step 99"), Goodbye(Reason.FINISHED)),
    "HELLO_REPLY": impostor(HelloReply(CFG.fingerprint(), CFG.to_json())),
    "JOB_RESPONSE": impostor(JobResponse(SEED, 0, 0)),
    "another secret's CHALLENGE": impostor(secret=b"another secret, also 32 characters"),
    "an SSH banner": impostor(b"SSH-2.0-OpenSSH_9.6\r\n"),
}


@pytest.mark.parametrize("name", IMPOSTORS)
def test_an_impostor_coordinator_cannot_stop_a_worker_with_a_secret(data_dir, pauses, name):
    """Whatever an unproven peer on the coordinator's port says, the worker logs it, backs
    off and retries; the real coordinator, once back, has it train to the end."""

    def real(peer):
        prove(peer)
        assert peer.expect(JobRequest) == JobRequest(SEED, 0)
        finish(peer)

    fake = FakeCoordinator(IMPOSTORS[name], IMPOSTORS[name], real)
    worker = make_worker(fake.port, data_dir, secret=SECRET)
    run_worker(worker)
    fake.check()
    failed = [line for line in worker.lines if "retrying in" in line]
    assert len(failed) == 2 and len(pauses) == 2, worker.lines
    assert all("proved the shared secret" in line or "proof" in line for line in failed)
    said = [line for line in worker.lines if line.startswith("[coordinator]")]
    assert said == ["[coordinator] FINISHED: the run reached step 0"]  # the real one's
    assert any("shared secret proven" in line for line in worker.lines)


def test_a_forged_frame_after_the_handshake_fails_the_connection(data_dir, pauses):
    """A frame changed on the way (here a JOB_RESPONSE's tag no longer matches its
    bytes), or one left out: the worker drops the connection and retries."""

    def changed(peer):
        prove(peer)
        peer.expect(JobRequest)
        sealed = bytearray(peer.channel.seal(JobResponse(SEED, 0, 0).encode()))
        sealed[25] ^= 1  # step 0 -> 1
        peer.channel = None
        peer.send(bytes(sealed))
        peer.drain()

    def dropped(peer):
        prove(peer)
        peer.expect(JobRequest)
        peer.channel.seal(JobResponse(SEED, 1, 0).encode())  # sealed, never sent
        peer.send(Goodbye(Reason.FINISHED, "forged"))  # its tag covers the record unsent
        peer.drain()

    def real(peer):
        prove(peer)
        assert peer.expect(JobRequest) == JobRequest(SEED, 0)
        finish(peer)

    fake = FakeCoordinator(changed, dropped, real)
    worker = make_worker(fake.port, data_dir, secret=SECRET)
    run_worker(worker)
    fake.check()
    failed = [line for line in worker.lines if "failed authentication" in line]
    assert len(failed) == 2, worker.lines
    assert "(JOB_RESPONSE)" in failed[0] and "(GOODBYE)" in failed[1]
    assert worker.chunks_done == 0 and len(pauses) == 2


def test_a_record_whose_tag_never_comes_gets_one_frame_deadline(data_dir, pauses):
    """Frames without a tag, each well within reply_timeout_s of the last, are not a way to
    hold a worker: the record gets frame_timeout_s (1 s here) from its first frame."""
    sent = []

    def dribble(peer):
        prove(peer)
        peer.expect(JobRequest)
        with contextlib.suppress(OSError):  # the worker's close ends it
            for _ in range(20):
                peer.sock.sendall(LogMessage("").encode())  # unmarked: a record begun
                sent.append(time.monotonic())
                time.sleep(0.25)  # the pace under test, not a wait for anything

    def real(peer):
        prove(peer)
        peer.expect(JobRequest)
        finish(peer)

    fake = FakeCoordinator(dribble, real)
    worker = make_worker(fake.port, data_dir, secret=SECRET)
    run_worker(worker)
    fake.check()
    assert any("no tag ending a record in 1 s" in line for line in worker.lines), worker.lines
    assert len(sent) < 20 and sent[-1] - sent[0] < 3


def test_a_worker_without_secret_is_told_to_set_one(data_dir):
    def script(peer):
        challenge(peer)
        peer.drain()

    fake = FakeCoordinator(script)
    with pytest.raises(
        WorkerError, match="requires a shared secret: set DEGGS_SECRET or DEGGS_SECRET_FILE"
    ):
        run_worker(make_worker(fake.port, data_dir))
    fake.check()


def test_a_short_secret_is_refused_at_start(data_dir):
    secret = b"monkey2024"
    with pytest.raises(auth.SecretError, match="has 10 characters; at least 32 .*`deggs secret"):
        make_worker(1, data_dir, secret=secret)


def test_a_worker_without_config_adopts_the_coordinators(data_dir):
    def script(peer):
        peer.welcome(pipelined=False)  # no config, no seed: nothing to ask for yet
        assert peer.expect(JobRequest) == JobRequest(SEED, 0)
        finish(peer)

    fake = FakeCoordinator(script)
    worker = make_worker(fake.port, data_dir, cfg=None)
    run_worker(worker)
    fake.check()
    assert "[worker] using the coordinator's config" in worker.lines
    assert worker.cfg.fingerprint() == CFG.fingerprint()


def test_something_that_is_not_a_coordinator_is_named(data_dir):
    def ssh_server(peer):
        peer.send(b"SSH-2.0-OpenSSH_9.6\r\n")
        peer.drain()

    fake = FakeCoordinator(ssh_server)
    with pytest.raises(WorkerError, match=r"not a d-eggs coordinator: bad magic b'SSH-'"):
        run_worker(make_worker(fake.port, data_dir))
    fake.check()


# --- work, and the reference coordinator's dead ends ----------------------------------------


def test_a_chunk_is_scored_and_the_generation_is_plain_text(data_dir):
    def script(peer):
        peer.welcome()
        peer.send(JobResponse(SEED, 0, 0))  # chunk 0 of step 0: the health, a generation
        report = peer.expect(Health)  # no val.bin here: the weights' alone
        assert report.step == 0 and len(report.entries) == 8 + 12 + 2
        first = report.entries[0]
        assert first.name == "embedding" and first.saturation == 0 and 0 < first.entropy < 8
        text = peer.expect(LogMessage).text  # sampled beside the chunk, sent with its RESULT
        assert "GENERATION at step 0" in text and "\x1b" not in text
        result = peer.expect(Result)
        assert (result.last_step, result.data_position) == (0, 0)
        assert len(result.data) == packed_size(CFG.training.chunk_size // 2)
        assert peer.expect(JobRequest) == JobRequest(SEED, 0)
        finish(peer)

    fake = FakeCoordinator(script)
    worker = make_worker(fake.port, data_dir)
    run_worker(worker)
    fake.check()
    assert worker.chunks_done == 1


def test_a_generation_goes_with_its_own_chunk_alone(data_dir, pauses):
    """The generation due at chunk 0 travels with that chunk's RESULT: when the
    connection drops before it, it is lost with the chunk, not sent with the next
    connection's first RESULT (a sample of step 0 beside a later step's chunk)."""
    sent = []

    def dropped(peer):
        peer.welcome()
        peer.send(JobResponse(SEED, 0, 0))  # chunk 0 of step 0: a generation is due
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.sock.close()  # a reset

    def back(peer):
        peer.welcome()
        peer.send(JobResponse(SEED, 0, CFG.training.chunk_size))  # chunk 1: nothing due
        while not sent or not isinstance(sent[-1], JobRequest):
            sent.append(peer.recv())
        finish(peer)

    fake = FakeCoordinator(dropped, back)
    run_worker(make_worker(fake.port, data_dir))
    fake.check()
    assert [type(m) for m in sent] == [Result, JobRequest]


def test_a_long_chunk_logs_its_progress(data_dir, monkeypatch):
    def script(peer):
        peer.welcome()
        peer.send(JobResponse(SEED, 0, CFG.training.chunk_size))  # chunk 1: no generation
        peer.expect(Result)
        peer.expect(JobRequest)
        finish(peer)

    ticks = iter(range(0, 10_000, 5))  # 5 s a batch: a line every other batch
    clock = lambda: float(next(ticks))
    monkeypatch.setattr(worker_module, "ChunkProgress", partial(ChunkProgress, clock=clock))
    fake = FakeCoordinator(script)
    worker = make_worker(fake.port, data_dir)
    worker.training.trainer.backend.batch = 2  # eight batches in a chunk of 16
    run_worker(worker)
    fake.check()
    # members done, 8 tokens each over the time so far, and the rest at that speed
    assert [line for line in worker.lines if " members, " in line] == [
        f"[worker] step 0 chunk 1: {done}/16 members, 3 member-tokens/s, about {left} s left"
        for done, left in [(4, 30), (8, 20), (12, 10)]
    ]


def test_a_slow_chunk_is_warned_about_at_start(data_dir, monkeypatch):
    assert not any("warning" in line for line in make_worker(1, data_dir).lines)
    monkeypatch.setattr(progress_module, "SLOW_CHUNK_S", 0.0)  # every chunk is slow now
    warnings = [line for line in make_worker(1, data_dir).lines if "warning" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith("[worker] warning: a chunk of 16 members will take this CPU")
    assert "(an estimate from timing 16 members)" in warnings[0]


def reference_at_step_1(then):
    """A reference coordinator (it ignores HELLO) that moves the worker to step 1 with a
    catch-up, then answers its next request with `then`."""

    def script(peer):
        peer.expect(Hello)
        assert peer.expect(JobRequest) == JobRequest(SEED, 0)
        peer.send(JobResponse(SEED, 1, 0, pack_trits(np.zeros(N_PAIRS))))
        assert peer.expect(JobRequest).last_step == 1
        peer.send(then)
        peer.drain()

    return script


@pytest.mark.parametrize(
    "then, message",
    [
        (
            JobResponse(0, 0, 0),
            "no longer has the history this worker needs to catch up from step 1",
        ),
        (
            JobResponse(SEED, 0, 16),
            "behind this worker: it hands out step 0, the worker is at step 1",
        ),
    ],
    ids=["all-zero response", "stale chunk"],
)
def test_reference_coordinator_dead_ends_are_worker_errors(data_dir, then, message):
    fake = FakeCoordinator(reference_at_step_1(then))
    worker = make_worker(fake.port, data_dir)
    with pytest.raises(WorkerError, match=message):
        run_worker(worker)
    fake.check()
    assert worker.step == 1
    assert any("a reference coordinator" in line for line in worker.lines)


def test_a_chunk_from_the_future_is_retried(data_dir, pauses):
    def ahead(peer):
        peer.welcome()
        peer.send(JobResponse(SEED, 5, 0))
        peer.drain()

    def fine(peer):
        peer.welcome()
        finish(peer)

    fake = FakeCoordinator(ahead, fine)
    worker = make_worker(fake.port, data_dir)
    run_worker(worker)
    fake.check()
    assert any("bad job: step 5" in line for line in worker.lines)


# --- connecting, deadlines and backoff ------------------------------------------------------


def test_an_unresolvable_host_is_an_error_after_resolve_tries(data_dir, pauses):
    worker = make_worker(1, data_dir, host="no-such-host.invalid")
    with pytest.raises(WorkerError, match="cannot resolve host 'no-such-host.invalid'"):
        run_worker(worker)
    assert len(pauses) == CFG.worker.resolve_tries - 1


def test_a_dripping_coordinator_is_dropped_by_the_frame_deadline(data_dir):
    dropped_after: queue.Queue = queue.Queue()

    def drip(peer):
        peer.expect(Hello)
        peer.expect(JobRequest)
        reply = HelloReply(CFG.fingerprint(), CFG.to_json()).encode()
        started = time.monotonic()
        for byte in reply:
            peer.sock.sendall(bytes([byte]))
            # One byte every 0.3 s, until the worker hangs up.
            readable, _, _ = select.select([peer.sock], [], [], 0.3)
            if readable:
                assert peer.drain() == []
                dropped_after.put(time.monotonic() - started)
                return
        raise AssertionError("the worker read the whole dripped reply")

    def fine(peer):
        peer.welcome()
        finish(peer)

    fake = FakeCoordinator(drip, fine)
    worker = make_worker(fake.port, data_dir)
    run_worker(worker)
    fake.check()
    # frame_timeout_s (1 s) after the first byte, though every byte came within 0.3 s
    assert 1.0 <= dropped_after.get_nowait() < 2.0
    assert any("no complete message from the coordinator in time" in line for line in worker.lines)
    assert fake.connections.qsize() == 2


def accept_and_close(peer):
    pass  # the connection closes as the script ends


def test_backoff_is_reset_by_a_handshake_not_by_a_connect(data_dir, pauses):
    def joins_then_drops(peer):
        peer.welcome()

    def fine(peer):
        peer.welcome()
        finish(peer)

    fake = FakeCoordinator(
        accept_and_close,
        accept_and_close,
        accept_and_close,
        joins_then_drops,
        accept_and_close,
        accept_and_close,
        fine,
    )
    cfg = CFG.replace(worker={"retry_max_s": 1.5})
    run_worker(make_worker(fake.port, data_dir, cfg=cfg))
    fake.check()
    assert pauses == [0.5, 1.0, 1.5, 0.5, 1.0, 1.5]


def test_a_refused_connection_is_retried_until_the_coordinator_is_up(data_dir, monkeypatch):
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    started: list[FakeCoordinator] = []

    def sleep(seconds):
        pauses.append(seconds)
        if len(pauses) == 6:  # the coordinator comes up at last
            started.append(FakeCoordinator(lambda peer: (peer.welcome(), finish(peer)), port=port))

    pauses: list[float] = []
    monkeypatch.setattr(
        worker_module,
        "time",
        SimpleNamespace(sleep=sleep, perf_counter=time.perf_counter, monotonic=time.monotonic),
    )
    worker = make_worker(port, data_dir)
    run_worker(worker)
    started[0].check()
    assert pauses == [0.2] * 6  # retry_max_s caps even the first pause
    assert sum("Connection refused" in line for line in worker.lines) == 6


# --- the command line -------------------------------------------------------------------------


def run_cli(tmp_path, data_dir, port, **env):
    (tmp_path / "tiny.toml").write_text(TOML)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "deggs",
            "worker",
            "127.0.0.1",
            "--port",
            str(port),
            "--config",
            str(tmp_path / "tiny.toml"),
            "--data-dir",
            str(data_dir),
            "--backend",
            "cpu",
            "--threads",
            "1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("DEGGS_SECRET")}, **env},
    )


def test_cli_exits_0_when_the_run_is_finished(tmp_path, data_dir):
    def script(peer):
        prove(peer)
        peer.expect(JobRequest)
        finish(peer)

    fake = FakeCoordinator(script)
    result = run_cli(tmp_path, data_dir, fake.port, DEGGS_SECRET=SECRET.decode())
    fake.check()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[worker] the run is finished; this worker's model is at step 0" in result.stdout


def test_cli_exits_2_on_a_refusal(tmp_path, data_dir):
    def script(peer):
        peer.expect(Hello)
        peer.send(Goodbye(Reason.HISTORY_GONE, "the fitness of step 0 is no longer kept"))
        peer.drain()

    fake = FakeCoordinator(script)
    result = run_cli(tmp_path, data_dir, fake.port)
    fake.check()
    assert result.returncode == 2
    assert (
        "deggs-worker: error: the coordinator refused this worker (HISTORY_GONE)" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_cli_exits_2_on_a_bad_secret_setting(tmp_path, data_dir):
    result = run_cli(tmp_path, data_dir, 1, DEGGS_SECRET="a", DEGGS_SECRET_FILE="/nonexistent")
    assert result.returncode == 2
    assert "not both" in result.stderr and "Traceback" not in result.stderr


def test_threads_limit_numpys_blas_pool_too(tmp_path, monkeypatch):
    pools = []

    class Recorder:  # the worker's place: what the thread pools are when it would run
        def __init__(self, *args, **kwargs):
            pass

        def run(self):
            pools.extend(threadpool_info())

    monkeypatch.setattr(worker_module, "Worker", Recorder)
    (tmp_path / "tiny.toml").write_text(TOML)
    args = ["127.0.0.1", "--config", str(tmp_path / "tiny.toml"), "--threads", "1"]
    with threadpool_limits(limits=4):  # more than 1 on any machine; restored on exit
        result = CliRunner().invoke(worker_main, args)
    assert result.exit_code == 0, result.output
    assert any(pool["user_api"] == "blas" for pool in pools)
    assert [pool["num_threads"] for pool in pools] == [1] * len(pools)


# --- the end of a job, and peers that are not coordinators ---------------------------------


def test_goodbye_stopped_ends_the_worker_as_finished_does(data_dir):
    def script(peer):
        peer.welcome()
        peer.send(Goodbye(Reason.STOPPED, "the coordinator was stopped at step 0"))
        peer.drain()

    fake = FakeCoordinator(script)
    worker = make_worker(fake.port, data_dir)
    run_worker(worker)  # returns: no retry, no error
    fake.check()
    assert "[coordinator] STOPPED: the coordinator was stopped at step 0" in worker.lines
    assert worker.lines[-1].startswith(
        "[worker] the coordinator was stopped, so this worker stops too; this worker's model"
    )


def test_a_stop_asked_for_during_a_chunk_ends_it_at_the_next_batch(data_dir, monkeypatch):
    batches = []

    def script(peer):
        peer.welcome()
        peer.send(JobResponse(SEED, 0, CFG.training.chunk_size))  # chunk 1: no generation
        assert peer.drain() == []  # no RESULT: the worker left within the chunk

    fake = FakeCoordinator(script)
    worker = make_worker(fake.port, data_dir)
    worker.training.trainer.backend.batch = 2  # eight batches in a chunk of 16

    def progress(self, done, total):  # after each batch; the signal comes after the first
        batches.append(done)
        if done == 2:
            worker.stop("SIGINT")  # while scoring: noted, not raised here

    monkeypatch.setattr(worker_module.ChunkProgress, "__call__", progress)
    with pytest.raises(worker_module.StopWorker, match="SIGINT"):
        run_worker(worker)
    fake.check()
    assert batches == [2]  # the next batch's check stopped it


def test_a_second_stop_or_one_between_chunks_is_at_once(data_dir):
    worker = make_worker(1, data_dir)
    with pytest.raises(worker_module.StopWorker, match="SIGTERM"):
        worker.stop("SIGTERM")  # not scoring: at once
    worker.stop_requested, worker.scoring = None, True
    worker.stop("SIGINT")  # scoring: noted
    with pytest.raises(worker_module.StopWorker, match="SIGINT"):
        worker.stop("SIGINT")  # asked again: at once


def test_a_peer_that_says_nothing_is_named_after_three_silent_connections(
    data_dir, pauses, monkeypatch
):
    monkeypatch.setattr(worker_module, "FIRST_REPLY_S", 0.2)

    def silent(peer):  # an HTTP server waiting for a request line that never comes
        peer.expect(Hello)
        peer.drain()

    fake = FakeCoordinator(silent, silent, silent)
    worker = make_worker(fake.port, data_dir)
    with pytest.raises(WorkerError, match=r"sent nothing in 0.2 s.*3 connections in a row: not a"):
        run_worker(worker)
    fake.check()
    assert len(pauses) == 2  # retried twice, saying why
    assert sum("sent nothing in 0.2 s" in line for line in worker.lines) == 2


def test_a_few_bytes_that_are_not_the_magic_are_refused_at_once(data_dir):
    def http_server(peer):  # three bytes, then it waits: not ten, but already not JOBS
        peer.send(b"HTT")
        peer.drain()

    fake = FakeCoordinator(http_server)
    with pytest.raises(WorkerError, match=r"not a d-eggs coordinator: bad magic b'HTT'"):
        run_worker(make_worker(fake.port, data_dir))
    fake.check()
