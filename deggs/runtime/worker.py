"""The worker: asks the coordinator for chunks, scores them, applies every step's update.

Its loop, as the reference worker's:

    JOB_REQUEST(step, seed)
      <- JOB_RESPONSE with fitness data: the update of our step; apply it, step += 1
      <- JOB_RESPONSE "wait": sleep a little, ask again
      <- JOB_RESPONSE with a chunk: losses of its members -> fitness -> RESULT

Every connection starts with deggs' handshake (protocol.py, auth.py):

    no secret, a config:  HELLO and JOB_REQUEST back to back. A deggs coordinator answers
                          HELLO_REPLY first; the reference coordinator ignores HELLO and
                          answers the JOB_REQUEST, which is how it joins us.
    no secret, no config: HELLO, then wait for the HELLO_REPLY whose config we adopt.
    a shared secret:      HELLO -> CHALLENGE (the coordinator's proof, checked first)
                          -> AUTH (ours) -> HELLO_REPLY, and from AUTH on every write
                          both ways is a record with a tag (channel.py).

The model lives on the worker, not on the wire: a worker that falls behind catches up
one step per request from the coordinator's fitness history, after loading the newest
weight snapshot when a deggs coordinator has one (snapshot.py). At every digest step it
reports its state digest, and at a snapshot step it keeps a copy of its model until the
next one, for the coordinator to ask for. How a run ends for it:

- GOODBYE(FINISHED), or the model reaches max_steps: run() returns.
- A refusal that retrying cannot fix (another config, a coordinator that lost the history
  we need, not a coordinator at all): WorkerError. With a secret, only a coordinator that
  has proven it is believed: anything said before fails that connection, and the worker
  retries, so an impostor on the coordinator's port cannot stop it.
- Anything else (refused or dropped connections, silence, a coordinator restarting):
  the worker keeps its model and reconnects with backoff.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import Config, ConfigError, WorkerConfig
from ..data import check_meta, load_decoding, load_tokens
from ..numerics.backend import BackendError, make_backend
from ..numerics.es import ChunkResult, Trainer
from ..ternary import packed_size, unpack_trits
from . import auth, protocol
from . import snapshot as snapshots
from .channel import Channel, sealed_limits
from .export import ExportError
from .progress import ChunkProgress, warn_if_slow
from .protocol import (
    Auth,
    Challenge,
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
    SnapshotHeader,
    SnapshotPart,
    SnapshotRequest,
    describe,
    printable,
    set_keepalive,
)
from .reports import Reports

WAIT_S = 0.1  # the reference worker's pause after a WAIT
FIRST_PAUSE_S = 0.5  # the first pause between reconnects; doubles to worker.retry_max_s
CONNECT_TIMEOUT_S = 10.0
# A deggs coordinator answers HELLO at once (the reference, the JOB_REQUEST sent with it):
# silence this long after connecting is news, and on SILENT_TRIES connections in a row,
# something else listens there (an HTTP server waiting for its request, say).
FIRST_REPLY_S = 10.0
SILENT_TRIES = 3


class WorkerError(Exception):
    """A problem that retrying cannot fix (bad data, a config the coordinator refuses)."""


class StopWorker(Exception):
    """Raised from a signal handler to end the worker cleanly."""


class Finished(Exception):
    """The coordinator says the run is over (GOODBYE FINISHED or STOPPED): run() returns."""


class CoordinatorAway(Exception):
    """The coordinator said GOODBYE for now (stopped, or its disk failed); it may return."""


class Unproven(ProtocolError):
    """With a secret: the peer said something before proving the secret. Believed by
    nobody: the connection failed and the worker retries."""


@dataclass
class Started:
    """A chunk started on the device (Trainer.start_chunk), not yet collected."""

    response: JobResponse
    chunk: int
    wait: Callable[[], ChunkResult]
    since: float  # perf_counter at its start
    sample: Callable[[], bytes] | None  # the generation due at it, sent with its RESULT


@dataclass
class Training:
    """What a worker trains once it knows the config: the data and a model replica."""

    trainer: Trainer
    tokens: np.ndarray
    pieces: list[bytes] | None  # token texts, for generations; None: raw bytes or unknown


class Worker:
    """Trains against the coordinator at host:port.

    cfg: our config, checked against the coordinator's; None adopts the coordinator's.
    secret: the shared secret to prove (auth.load_secret()), or None.
    log: called with each line of text the worker reports.
    """

    def __init__(
        self,
        host: str,
        port: int,
        cfg: Config | None,
        data_dir: str | Path = ".",
        backend: str = "auto",
        threads: int | None = None,
        log=print,
        secret: bytes | None = None,
    ):
        self.host, self.port = host, port
        self.address = f"{host}:{port}"
        self.cfg = cfg
        self.secret = None if secret is None else auth.check_secret(secret)
        self.channel: Channel | None = None  # this connection's tags, once proven
        self._checked: deque[tuple[int, bytes]] = deque()  # frames whose tag was checked
        self.data_dir = Path(data_dir)
        self.backend_name, self.threads = backend, threads
        self.log = log
        self.training: Training | None = None  # once the config is known
        self.last_updates = self.chunks_done = 0
        self._updating: Callable[[], int] | None = None  # an update started, not waited for
        self._asked_at = 0.0  # when our last JOB_REQUEST went out
        self.deggs_coordinator = False  # may we send deggs messages (EVALUATION, HEALTH)?
        self.reports = Reports(self.data_dir, log)  # samples, validation loss, health
        self._pause = FIRST_PAUSE_S  # before the next reconnect
        self._heard = False  # has this connection delivered a frame yet?
        self.keeper = snapshots.Keeper()  # digests owed and the model kept for a snapshot
        self._silent = 0  # connections in a row that answered nothing
        self.scoring = False  # inside a chunk's member losses (a stop waits for the batch)
        self.stop_requested: str | None = None  # why we were asked to stop
        if cfg is not None:
            self._prepare(cfg)

    # --- setup -------------------------------------------------------------------------

    def _prepare(self, cfg: Config):
        """Load and check the data for a config, and build the model replica."""
        check_meta(self.data_dir, cfg)  # when deggs-prepare left a meta.json: files match it
        tokens = load_tokens(self.data_dir / "input.bin", cfg)
        pieces = None
        decoding = self.data_dir / "decoding.bin"
        if not cfg.model.byte_tokens:
            if decoding.exists():
                pieces = load_decoding(decoding, cfg.model.vocab_size)
            else:
                self.log(f"[worker] {decoding} not found: generations will show token ids")
        try:
            backend = make_backend(cfg, self.backend_name, self.threads)
        except BackendError as e:
            raise WorkerError(str(e)) from None
        self.cfg = cfg
        self.training = Training(Trainer(backend), tokens, pieces)
        self.log(
            f"[worker] {len(tokens)} tokens, backend {backend.name}, "
            f"config {cfg.fingerprint().hex()}"
        )
        warn_if_slow(self.log, self.training.trainer, tokens)

    def stop(self, why: str) -> None:
        """Asked to stop (a signal handler calls this): StopWorker now, or, while a chunk
        is scored, after its current batch (asked twice: now)."""
        again = self.stop_requested is not None
        self.stop_requested = why
        if again or not self.scoring:
            raise StopWorker(why)

    def _stop_if_asked(self) -> None:
        if self.stop_requested is not None:
            raise StopWorker(self.stop_requested)

    @property
    def step(self) -> int:
        """The step our model is at (0 until we know the config)."""
        return self.training.trainer.step if self.training else 0

    @property
    def seed(self) -> int:
        return self.training.trainer.seed if self.training else 0

    def _ready(self) -> Training:
        if self.training is None:
            raise ProtocolError("a job before the coordinator sent its config")
        return self.training

    @property
    def settings(self) -> WorkerConfig:
        """The [worker] table: deadlines and retries (the defaults until we have a config)."""
        return self.cfg.worker if self.cfg is not None else WorkerConfig()

    def _limits(self) -> dict[int, int]:
        """The largest payload we accept of each message a coordinator sends."""
        pairs = 0 if self.cfg is None else self.cfg.training.n_pairs
        return protocol.limits_from_coordinator(max(1 << 20, packed_size(pairs)))

    # --- connecting and reconnecting ---------------------------------------------------

    def run(self, max_steps: int | None = None):
        """Serve until the run is finished, the model reaches max_steps, or StopWorker.

        Raises WorkerError for what retrying cannot fix; retries everything else."""
        self._pause = FIRST_PAUSE_S
        unresolved = 0  # failed name lookups in a row
        while not self._reached(max_steps):
            try:
                sock = self._connect()
            except socket.gaierror as e:
                # A lookup can fail for a moment (a DNS server restarting), a typo forever.
                unresolved += 1
                if unresolved >= self.settings.resolve_tries:
                    raise WorkerError(
                        f"cannot resolve host {self.host!r}: {e.strerror or e} ({unresolved} tries)"
                    ) from None
                self._retry_later(f"cannot resolve host {self.host!r} ({e.strerror or e})")
                continue
            except OSError as e:  # refused or unreachable: the coordinator may not be up yet
                unresolved = 0
                self._retry_later(f"cannot connect to {self.address}: {e}")
                continue
            unresolved = 0
            try:
                with sock:
                    self._serve(sock, max_steps)
            except Finished as e:
                # self.step is our model's: the run's last update is never handed out.
                self.log(
                    f"[worker] {e}; this worker's model is at step "
                    f"{self.step} (the last step's update is kept in the checkpoints)"
                )
                return
            except (OSError, ProtocolError, CoordinatorAway) as e:  # TimeoutError included
                self._retry_later(f"connection to {self.address} lost: {e}")

    def _reached(self, max_steps: int | None) -> bool:
        return max_steps is not None and self.step >= max_steps

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_keepalive(sock)
        except OSError:
            sock.close()
            raise
        self.log(f"[worker] connected to {self.address}")
        return sock

    def _retry_later(self, why: str):
        """Pause before the next connection: FIRST_PAUSE_S, doubling up to retry_max_s.
        Only a completed handshake starts it over (_joined), so a peer that accepts and
        drops every connection is not hammered."""
        longest = self.settings.retry_max_s
        pause = min(self._pause, longest)
        self.log(f"[worker] {why}; retrying in {pause:g} s")
        time.sleep(pause)
        self._pause = min(pause * 2, longest)

    def _joined(self, how: str):
        self._pause = FIRST_PAUSE_S
        self.log(f"[worker] joined {self.address} ({how}) at step {self.step}")

    # --- one connection ----------------------------------------------------------------

    def _serve(self, sock: socket.socket, max_steps: int | None):
        """Handshake, then request and do jobs until max_steps (or an exception).

        Against a deggs coordinator a GPU worker asks for its next chunk as soon as it has
        started one, so that the round trip and the coordinator's answer overlap the GPU's
        work: at most two chunks are out, the older one being scored, the newer queued
        behind it on the device."""
        self._heard = False
        self.deggs_coordinator = False
        self.channel = None
        self._checked.clear()
        pipelined = self.secret is None and self.cfg is not None
        job = self._handshake(sock, pipelined)
        # A pipelined JOB_REQUEST is answered after the HELLO_REPLY: do not ask twice.
        asked = pipelined and job is None
        results: list[bytes] = []  # RESULTs, sent with the next request in one write
        started: deque[Started] = deque()  # chunks on the device, oldest first
        try:
            while not self._reached(max_steps):
                if job is None:
                    if not asked:
                        self._ask(sock, *results)
                        results = []
                    asked = False
                    job = self._next_job(sock)
                kind = self._classify(job)
                if kind == "chunk" and self._prefetching():
                    started.append(self._start_chunk(sock, job))
                    job = None
                    if len(started) < 2:
                        continue  # ask for the next one while this one is scored
                elif kind == "wait" and started:
                    job = None  # no more chunks now: finish ours, then ask again
                else:
                    results.append(self._do_job(sock, job, kind))
                    job = None
                    continue
                results.append(self._finish_chunk(started.popleft()))
            while started:
                results.append(self._finish_chunk(started.popleft()))
        finally:
            for chunk in started:  # a chunk's copy still in flight is waited for
                chunk.wait()
            self._settle_update()  # logged before the run's end, a stop or a reconnect
        if any(results):
            self._send(sock, *results)

    def _ask(self, sock: socket.socket, *before: bytes):
        self._send(sock, *before, self.keeper.owed(), JobRequest(self.seed, self.step).encode())
        self._asked_at = time.monotonic()

    def _handshake(self, sock: socket.socket, pipelined: bool) -> JobResponse | None:
        """Introduce ourselves until the coordinator accepts us. Returns the JOB_RESPONSE a
        reference coordinator sends instead of HELLO_REPLY, else None."""
        ours = auth.new_nonce()
        fingerprint = self.cfg.fingerprint() if self.cfg else protocol.NO_FINGERPRINT
        hello = Hello(fingerprint, self.cfg.to_json() if self.cfg else "", ours).encode()
        if self.secret is not None:
            self._prove(sock, hello, ours, self.secret)
            return None
        if pipelined:
            self._ask(sock, hello)
            hint = ""
        else:
            self._send(sock, hello)
            hint = " (a reference coordinator never answers HELLO: pass --config)"

        message = self._receive(sock, hint)
        if isinstance(message, Challenge):
            raise WorkerError(
                f"the coordinator requires a shared secret: set "
                f"{auth.SECRET_ENV} or {auth.SECRET_FILE_ENV}"
            )
        if isinstance(message, HelloReply):
            self._adopt(message)
            self.deggs_coordinator = True
            self._reached_step()  # a model kept across a reconnect may owe its digest
            self._joined("deggs")
            return None
        if not pipelined:
            raise ProtocolError(f"a {type(message).__name__} in answer to HELLO")
        self._classify(message)  # a reference coordinator joins us with a valid job
        self._joined("a reference coordinator")
        return message

    def _prove(self, sock: socket.socket, hello: bytes, ours: bytes, secret: bytes):
        """The handshake with a shared secret. Until the coordinator has proven it,
        nothing the peer says is acted on: an impostor on the coordinator's port (during
        a restart, or by a spoofed address) could otherwise end every worker with one
        forged GOODBYE. Anything but a right CHALLENGE fails this connection (Unproven)."""
        self._send(sock, hello)
        hint = " (a reference coordinator never answers HELLO, nor checks a secret)"
        try:
            challenge = protocol.decode_message(*self._read_frame(sock, hint))
        except ProtocolError as e:
            raise Unproven(f"before the coordinator proved the shared secret: {e}") from None
        if not isinstance(challenge, Challenge):
            raise Unproven(
                f"{describe(challenge)} before the coordinator proved the shared secret "
                f"(is {auth.SECRET_ENV} set there?)"
            )
        if not auth.verify(secret, "coordinator", ours, challenge.nonce, challenge.proof):
            raise Unproven(
                "the coordinator's proof of the shared secret is wrong: an impostor, or "
                f"{auth.SECRET_ENV} differs between it and this worker"
            )
        self._send(sock, Auth(auth.proof(secret, "worker", ours, challenge.nonce)).encode())
        self.channel = Channel.for_worker(secret, ours, challenge.nonce, self._limits())
        message = self._receive(sock)  # every frame authenticated from here on
        if not isinstance(message, HelloReply):
            raise ProtocolError(f"a {type(message).__name__} in answer to AUTH")
        self._adopt(message)
        self.deggs_coordinator = True
        self._reached_step()  # a model kept across a reconnect may owe its digest
        self._joined("shared secret proven")

    def _adopt(self, reply: HelloReply):
        """Check the coordinator's config against ours, or take it when we have none."""
        try:
            theirs = Config.from_json(reply.config_json)
        except ConfigError as e:
            raise WorkerError(
                f"the coordinator sent a config we cannot use: {printable(str(e))}"
            ) from None
        if theirs.fingerprint() != reply.fingerprint:
            raise WorkerError(
                f"the coordinator's fingerprint {reply.fingerprint.hex()} is not "
                f"that of its config ({theirs.fingerprint().hex()}): another "
                "deggs version?"
            )
        if self.cfg is None:
            self.log("[worker] using the coordinator's config")
            self._prepare(theirs)
        elif theirs.fingerprint() != self.cfg.fingerprint():
            diff = "; ".join(self.cfg.differences(theirs))
            raise WorkerError(f"the coordinator's config differs from ours: {diff}")
        self.keeper.schedule = theirs  # its [coordinator] table says when digests are due

    def _send(self, sock: socket.socket, *frames: bytes):
        # The last read may have left a short timeout on the socket: sending has its own.
        sock.settimeout(self.settings.frame_timeout_s)
        data = b"".join(frames)
        if self.channel is not None:
            data = self.channel.seal(data)
        try:
            protocol.send_frame(sock, data)
        except OSError:
            self._read_last_words(sock)
            raise

    def _read_last_words(self, sock: socket.socket):
        """A send failed: the coordinator may have said GOODBYE and closed while we were
        busy (or stopped) and did not read. Its GOODBYE is still in our socket and says
        more than a broken pipe: above all whether the run is finished, so that we end
        instead of retrying an address where nobody will listen again."""
        if self.secret is not None and self.channel is None:
            return  # an unproven peer's word is believed by nobody
        reader = self.channel or protocol.FrameReader(self._limits())  # a Channel checks tags
        frames = list(self._checked)
        sock.settimeout(0)  # only what has already arrived
        try:
            while data := sock.recv(1 << 16):
                frames += reader.feed(data)
        except (OSError, ProtocolError):
            pass  # nothing more, or not a frame: the send's own error is the news
        goodbyes = [payload for opcode, payload in frames if opcode == protocol.GOODBYE]
        if goodbyes:
            with contextlib.suppress(ProtocolError):  # a malformed one tells nothing
                self._goodbye(Goodbye.decode(goodbyes[0]))

    def _next_job(self, sock: socket.socket) -> JobResponse:
        """The answer to our request; a snapshot sent instead is loaded, and we ask again."""
        while True:
            message = self._receive(sock)
            if isinstance(message, JobResponse):
                return message
            if not (isinstance(message, SnapshotHeader) and self.deggs_coordinator):
                raise ProtocolError(f"a {type(message).__name__} where a JOB_RESPONSE belongs")
            self._download(sock, message)
            self._ask(sock)

    def _receive(self, sock: socket.socket, hint: str = ""):
        """The coordinator's next message, after the log lines it sends first. A GOODBYE
        raises: Finished, WorkerError (a refusal for good) or CoordinatorAway."""
        while True:
            message = protocol.decode_message(*self._read_frame(sock, hint))
            if isinstance(message, LogMessage):
                self._show("[coordinator]", message.text)
            elif isinstance(message, Goodbye):
                self._goodbye(message)
            elif isinstance(message, SnapshotRequest) and self.deggs_coordinator:
                self._upload(sock, message.step)
            else:
                return message

    def _read_frame(self, sock: socket.socket, hint: str) -> tuple[int, bytes]:
        """The coordinator's next frame; once proven, the next whose record's tag is checked."""
        if self.channel is None:
            return self._next_frame(sock, hint, self._limits())
        by = None  # a record's frames come within frame_timeout_s of its first, or none
        while not self._checked:
            self.channel.limits = self._limits()  # they grow once we have the config
            item = self._next_frame(sock, hint, sealed_limits(self.channel.limits), by)
            self._checked += self.channel.feed(protocol.frame(*item))
            by = by or time.monotonic() + self.settings.frame_timeout_s
        return self._checked.popleft()

    def _next_frame(self, sock, hint: str, limits: dict[int, int], by: float | None = None):
        w = self.settings
        first, self._heard = not self._heard, True
        wait = min(w.reply_timeout_s, FIRST_REPLY_S) if first else w.reply_timeout_s
        left = w.frame_timeout_s if by is None else max(by - time.monotonic(), 1e-3)
        try:
            item = protocol.recv_frame(sock, limits, min(wait, left), min(w.frame_timeout_s, left))
        except TimeoutError as e:
            if by is not None:  # a record begun: its tag is late, whatever the read said
                raise TimeoutError(f"no tag ending a record in {w.frame_timeout_s:g} s") from None
            if first and isinstance(e, protocol.NoFrame):  # not one byte since HELLO
                self._silent += 1
                what = (
                    f"{self.address} accepted the connection but sent nothing in "
                    f"{wait:g} s; a deggs coordinator answers at once{hint}"
                )
                if self._silent >= SILENT_TRIES:
                    raise WorkerError(
                        f"{what}; {self._silent} connections in a row: not a d-eggs "
                        "coordinator (another service on that port?)"
                    ) from None
                raise TimeoutError(what) from None
            raise TimeoutError(
                f"no complete message from the coordinator in time ({e}; "
                f"worker.reply_timeout_s = {w.reply_timeout_s:g}, "
                f"frame_timeout_s = {w.frame_timeout_s:g}){hint}"
            ) from None
        except NotOurProtocol as e:
            # Later it is more likely a corrupted stream; and with a secret, an unproven
            # peer's bytes are no reason to give up.
            if first and self.secret is None:
                raise WorkerError(f"{self.address} is not a d-eggs coordinator: {e}") from None
            raise
        if item is None:
            raise ConnectionError("the coordinator closed the connection")
        self._silent = 0
        return item

    def _goodbye(self, goodbye: Goodbye):
        reason = goodbye.reason
        if reason.permanent:  # the CLI prints the error on one line: newlines escaped too
            raise WorkerError(
                f"the coordinator refused this worker ({reason.name}): {printable(goodbye.text)}"
            )
        self._show(f"[coordinator] {reason.name}:", goodbye.text)
        if reason == Reason.FINISHED:
            raise Finished("the run is finished")
        if reason == Reason.STOPPED:
            raise Finished("the coordinator was stopped, so this worker stops too")
        raise CoordinatorAway(f"the coordinator said goodbye ({reason.name})")

    def _show(self, prefix: str, text: str):
        """A peer's text, line by line, with control characters escaped."""
        for line in text.rstrip("\n").split("\n"):
            self.log(f"{prefix} {printable(line)}")

    # --- the work ----------------------------------------------------------------------

    def _classify(self, job: JobResponse) -> str:
        """'update', 'wait' or 'chunk'; refuses a job we cannot do. The reference
        coordinator never says GOODBYE, so its dead ends are recognised here."""
        if job.data:
            if job.last_step != self.step + 1:
                raise ProtocolError(f"update to step {job.last_step} while at step {self.step}")
            return "update"
        if job.is_wait:
            return "wait"
        if self.step > 0 and job == JobResponse(0, 0, 0):
            raise WorkerError(
                f"the coordinator no longer has the history this worker needs "
                f"to catch up from step {self.step} (a reference coordinator "
                "restarted?)"
            )
        if job.last_step < self.step:
            raise WorkerError(
                f"the coordinator is behind this worker: it hands out step "
                f"{job.last_step}, the worker is at step {self.step} (restarted "
                "without --load-dir?)"
            )
        settings = self._ready().trainer.cfg.training
        c, population = settings.chunk_size, settings.population_size
        if job.last_step > self.step or job.data_position % c or job.data_position >= population:
            raise ProtocolError(
                f"bad job: step {job.last_step}, position {job.data_position} "
                f"(we are at step {self.step})"
            )
        return "chunk"

    def _do_job(self, sock: socket.socket, job: JobResponse, kind: str) -> bytes:
        """Do one job of its kind (_classify's); a chunk's RESULT frame to send, else b""."""
        if kind == "update":
            self._apply_update(job)
        elif kind == "wait":
            # A deggs coordinator holds our request until there is work (up to a second),
            # the reference answers at once: pause what is left of WAIT_S either way.
            time.sleep(max(0.0, WAIT_S - (time.monotonic() - self._asked_at)))
        else:
            return self._run_chunk(sock, job)
        return b""

    def _apply_update(self, response: JobResponse):
        training = self._ready()
        try:
            fitness = unpack_trits(response.data, training.trainer.cfg.training.n_pairs)
        except ValueError as e:
            raise ProtocolError(f"bad fitness for step {self.step}: {e}") from None
        self._settle_update()
        # a GPU updates while we ask for the next chunk and queue it behind the update
        self._updating = training.trainer.start_apply(fitness)
        self._reached_step()

    def _settle_update(self):
        """Wait for the update last started, before anything else moves the model (so it is
        at the step the update reached); its count of weights changed goes with the next RESULT."""
        if self._updating is not None:
            wait, self._updating = self._updating, None
            self.last_updates = wait()
            self.log(f"[worker] updated to step {self.step}: {self.last_updates} weights changed")

    # --- digests and snapshots (snapshot.Keeper keeps them) ---------------------------

    def _reached_step(self):
        """Our model reached a step: owe its digest (and keep it) where one is due."""
        if self.training is not None and self.deggs_coordinator:
            self.keeper.reached(self.training.trainer)

    def _upload(self, sock: socket.socket, step: int):
        """The coordinator asks for our model at `step`: send it if we still hold it."""
        started = time.perf_counter()
        frames = self.keeper.upload(step)
        for frame in frames:
            self._send(sock, frame)
        what = "uploaded the snapshot" if len(frames) > 1 else "was asked for the snapshot"
        self.log(f"[worker] {what} of step {step} ({time.perf_counter() - started:.2f} s)")

    def _download(self, sock: socket.socket, header: SnapshotHeader):
        """Load the snapshot the coordinator sends instead of a catch-up step (or the
        initial weights, for step 0 and no bytes)."""
        trainer = self._ready().trainer
        self._settle_update()  # an update still running is one the snapshot replaces
        if header.step == 0 and header.size == 0:
            self.keeper.restart(trainer)
            self.log("[worker] starting over from the initial weights, as the coordinator asks")
            return
        started = time.perf_counter()
        name = f"the snapshot of step {header.step} from {self.address}"
        assembly = snapshots.Assembly(header, snapshots.size_bounds(trainer.cfg), name)
        while True:
            message = self._receive(sock)
            if not isinstance(message, SnapshotPart):
                raise ProtocolError(f"a {type(message).__name__} inside {name}")
            if assembly.add(message):
                break
        try:
            self.keeper.load(trainer, header, bytes(assembly.data), name)
        except ExportError as e:
            raise ProtocolError(str(e)) from None
        self.log(
            f"[worker] loaded the snapshot of step {header.step} ({header.size / 2**20:.1f} MiB "
            f"in {time.perf_counter() - started:.2f} s)"
        )

    def _prefetching(self) -> bool:
        """Ask for the next chunk before this one is scored? Against a deggs coordinator,
        which gives a worker that holds a chunk another one or WAIT at once, and on a
        backend that scores asynchronously (on a CPU it would only hold a chunk back)."""
        training = self._ready()
        return self.deggs_coordinator and training.trainer.asynchronous

    def _start_chunk(self, sock: socket.socket, response: JobResponse) -> Started:
        """What is due at the chunk first (_due), then the chunk started on the device."""
        self._stop_if_asked()
        training = self._ready()
        chunk = response.data_position // training.trainer.cfg.training.chunk_size
        sample = self._due(sock, training, chunk)
        wait = training.trainer.start_chunk(training.tokens, chunk)
        return Started(response, chunk, wait, time.perf_counter(), sample)

    def _finish_chunk(self, chunk: Started) -> bytes:
        """Wait for a started chunk; its RESULT frame."""
        return self._result(chunk.response, chunk.wait(), chunk.since, chunk.sample)

    def _due(self, sock: socket.socket, training: Training, chunk: int):
        """The first chunk of a step brings the reports due at it (reports.py; an
        interval of 0: never): the validation and health are sent now, a sample is
        started (beside the chunk on a GPU) and returned, for the chunk's RESULT."""
        trainer = training.trainer
        cfg = trainer.cfg
        due = lambda every: chunk == 0 and every > 0 and trainer.step % every == 0
        sample = None
        if due(cfg.sampling.every_steps):
            sample = self.reports.start_sample(trainer, training.tokens, training.pieces)
        if due(cfg.eval.every_steps) and self.deggs_coordinator:
            evaluation = self.reports.validation(trainer, training.pieces)
            if evaluation:  # (none without val.bin)
                self._send(sock, evaluation)
        if due(cfg.eval.health_every_steps) and self.deggs_coordinator:
            self._send(sock, self.reports.health(trainer))
        return sample

    def _result(
        self, response: JobResponse, result: ChunkResult, since: float, sample=None
    ) -> bytes:
        """A scored chunk's RESULT frame, after the generation due at it (`sample`, from
        _due) if any, and its line in the log."""
        trainer = self._ready().trainer
        cfg = trainer.cfg
        self._settle_update()
        text = b"" if sample is None else sample()
        frame = Result(
            trainer.seed,
            trainer.step,
            response.data_position,
            self.last_updates,
            result.sum_loss,
            result.packed,
        ).encode()
        self.last_updates = 0  # counted once, with the first chunk after the update
        self.chunks_done += 1
        seconds = time.perf_counter() - since
        self.log(
            f"[worker] step {trainer.step} chunk {result.chunk}: {seconds:.2f} s, "
            f"{cfg.training.chunk_size * cfg.model.seq_len / seconds:,.0f} member-tokens/s"
        )
        return text + frame

    def _run_chunk(self, sock: socket.socket, response: JobResponse) -> bytes:
        """Score a chunk here and now, stopping between its batches when asked; its
        RESULT frame."""
        training = self._ready()
        trainer = training.trainer
        cfg = trainer.cfg
        chunk = response.data_position // cfg.training.chunk_size
        sample = self._due(sock, training, chunk)
        started = time.perf_counter()
        progress = ChunkProgress(self.log, f"step {trainer.step} chunk {chunk}", cfg.model.seq_len)

        def between_batches(done: int, total: int):
            self._stop_if_asked()
            progress(done, total)

        self.scoring = True
        try:
            self._stop_if_asked()  # a signal that came while we were not scoring
            result = trainer.score_chunk(training.tokens, chunk, between_batches)
        finally:
            self.scoring = False
        return self._result(response, result, started, sample)
