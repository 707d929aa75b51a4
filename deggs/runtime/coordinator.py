"""The coordinator: hands out chunks of each step's population and gathers their fitness.

A step's population is cut into chunks of chunk_size members. A worker asks for a job
(JOB_REQUEST), gets a chunk (JOB_RESPONSE with a data_position), evaluates its antithetic
pairs and sends back their ternary fitness (RESULT). When every chunk is in, the packed
whole-population fitness is the step's update: it is made durable on disk first, then
the step and seed advance, and every worker applies it before its next chunk. A worker
that is behind (a new one, or one that was away) replays the steps it missed, one
JOB_RESPONSE with that step's fitness per request, before it gets a chunk.

The rules that keep a run exact and the server alive, whoever connects:

- With a shared secret (auth.py) a peer must prove it before it may do anything; a peer
  that has not is closed with a log line and told nothing, not even the step.
- A RESULT counts only for a chunk handed to that connection. A chunk whose every holder
  has disconnected goes back to the queue at once; one held past straggler_timeout_s is
  handed to the next worker that asks, and the first RESULT to arrive wins.
- Nothing is served from a step before it is on disk: the step's checkpoint is written,
  fsynced and renamed before any worker is sent its fitness and before the next step's
  chunks go out. A write that keeps failing for disk_retry_s ends the run with a reason
  (`failure`) instead of leaving a hole in the history.
- Every read has a deadline (the handshake, each frame), every peer a bound on the
  replies queued to it, and the number of connections a bound below the descriptor limit.
  A worker reads each reply before it asks for work again: a peer that pipelines its
  requests is closed, and so is one that has not asked for work within idle_timeout_s
  (while it holds no chunk). When the connections run out, one that has proven nothing,
  else one idle for EVICT_IDLE_S, makes room for the newcomer.
- Failures of peers that proved nothing are logged at most about once a second for
  each kind, with a count, so that a flood cannot fill the disk with log lines.

A reference worker that finds no work is answered WAIT at once and asks again 0.1 s
later. A deggs worker's request is held instead (for at most HOLD_S) and answered the
moment there is something to do: a chunk back in the queue or past the straggler
timeout, or the step's update once it is durable. With one chunk a worker a step (eight
GPUs at the default), the polling alone would cost each of them 50 ms a step on average.

One asyncio event loop serves every connection through `Peer`, a Protocol that cuts
frames from the bytes as they arrive and writes each batch of replies with one send.
Disk work (checkpoints, metrics, reading old history) runs on a single background thread,
in submission order, so the loop never blocks on a file.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import re
import resource
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import Config, ConfigError
from ..numerics.params import health_entries
from ..seeds import next_step_seed
from ..ternary import check_packed, pack_trits, packed_size, unpack_blocks
from . import auth
from . import checkpoint as ckpt
from . import snapshot as snapshots
from .channel import Channel, DigestCache, sealed_limits
from .protocol import (
    AUTH,
    DEGGS_PROTOCOL,
    DIGEST,
    EVALUATION,
    HEALTH,
    HELLO,
    JOB_REQUEST,
    NO_FINGERPRINT,
    RESULT,
    SNAPSHOT,
    SNAPSHOT_PART,
    WAIT,
    Auth,
    Challenge,
    Digest,
    Evaluation,
    FrameReader,
    Goodbye,
    Health,
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
    limits_from_worker,
    printable,
    set_keepalive,
)
from .replicas import Replicas
from .tensorboard import TensorBoard

log = logging.getLogger("deggs.runtime.coordinator")

LOSS_SCALE = 16  # the worker sums losses in Q.4 fixed point
FD_RESERVE = 64  # descriptors kept free of connections: checkpoints, metrics, logs
LINGER_S = 1.0  # how long a GOODBYE waits for the peer to read it before the socket closes
WORST_NAMED = 5  # saturated matrices a health warning names
NAMED_WORKERS = 8  # workers the per-step line names: the slowest half, then the most idle
HOLD_S = 1.0  # longest a deggs worker's request for work is held before WAIT (see above)
SEED_STRIDE = 1024  # steps between the seeds the coordinator keeps (_seed_of)
RECONNECT_S = 2.0  # a reconnecting worker's connect and handshake, after its backoff pause
EVICT_IDLE_S = 5.0  # a worker waiting for work asks at least every HOLD_S + 0.1 s
UNPROVEN_KINDS = 64  # kinds of unproven peers' failures summarised apart; the rest as one


class Drop(Exception):
    """Close this connection, after sending `goodbye` (a frame saying why) if any."""

    def __init__(self, reason: str, goodbye: bytes = b""):
        super().__init__(reason)
        self.goodbye = goodbye


@dataclass(slots=True)
class WorkerFigures:
    """How one connection spent a step: the chunks it returned and where its time went.

    It is busy while it holds at least one chunk, from the hand-out to its RESULT
    (overlapping chunks count once), and free otherwise: from its first request of the
    step, or its last RESULT, to the next chunk it gets, WAIT replies and round trips
    included. Time after its connection closed is neither.
    """

    free_since: float | None = None  # when it last became free; None while busy or gone
    busy_since: float = 0.0
    holding: set[int] = field(default_factory=set)  # chunks handed to it, not returned yet
    chunks: int = 0  # RESULTs that counted (the first for their chunk)
    returned: int = 0  # RESULTs for chunks it held, duplicates of re-assigned ones included
    busy_s: float = 0.0
    idle_s: float = 0.0

    def took(self, chunk: int, now: float):
        if not self.holding:
            self.busy_since = now
            if self.free_since is not None:
                self.idle_s += now - self.free_since
                self.free_since = None
        self.holding.add(chunk)

    def gave_back(self, chunk: int, now: float):
        """Its RESULT for `chunk`; a second one for the same chunk is no new work."""
        if chunk not in self.holding:
            return
        self.holding.remove(chunk)
        self.returned += 1
        if not self.holding:
            self.busy_s += now - self.busy_since
            self.free_since = now

    def left(self, now: float):
        """Its connection closed: the time spent so far stays, nothing more adds up."""
        if self.holding:
            self.busy_s += now - self.busy_since
            self.holding.clear()
        elif self.free_since is not None:
            self.idle_s += now - self.free_since
        self.free_since = None

    def record(self, now: float, member_tokens_per_chunk: int) -> dict:
        """Its line in metrics.jsonl when the step is sealed at `now`: a chunk still held
        is busy time until then (work that went to waste), a free worker idle time."""
        busy = self.busy_s + (now - self.busy_since if self.holding else 0.0)
        idle = self.idle_s + (now - self.free_since if self.free_since is not None else 0.0)
        return {
            "chunks": self.chunks,
            "member_tokens_per_s": (
                round(self.returned * member_tokens_per_chunk / busy, 1) if busy > 0 else 0.0
            ),
            "busy_s": round(busy, 6),
            "idle_s": round(idle, 6),
        }


@dataclass
class StepState:
    """Everything the coordinator tracks about the step being trained."""

    step: int
    seed: int
    started: float  # clock time the step began
    n_chunks: int
    chunk_pairs: int
    packed: list = field(
        default_factory=list
    )  # per chunk: the packed fitness of the RESULT that counted, or None
    pending: deque = field(default_factory=deque)  # chunks nobody holds, next first
    in_progress: OrderedDict = field(
        default_factory=OrderedDict
    )  # chunk -> time handed out, oldest first
    holders: dict = field(default_factory=dict)  # chunk in progress -> the Peers holding it
    n_done: int = 0
    sealing: bool = False  # every chunk is in; the step is being made durable
    sum_loss: int = 0
    transmissions: int = 0  # RESULTs for this step, duplicates included
    updates_total: int = 0
    updates_min: int | None = None
    updates_max: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    evaluation: Evaluation | None = None  # the validation loss, on eval.every_steps steps
    health: Health | None = None  # weight and activation statistics, on health_every_steps
    workers: dict[str, WorkerFigures] = field(default_factory=dict)  # by peer name
    drifted: dict[str, int] = field(default_factory=dict)  # worker -> the step it drifted at

    @classmethod
    def fresh(cls, config: Config, step: int, seed: int, now: float) -> StepState:
        t = config.training
        return cls(
            step=step,
            seed=seed,
            started=now,
            n_chunks=t.n_chunks,
            chunk_pairs=t.chunk_size // 2,
            packed=[None] * t.n_chunks,
            pending=deque(range(t.n_chunks)),
        )

    def oldest_out(self, now: float) -> tuple[int, float]:
        """The chunk out the longest (the only one that can have timed out first) and
        how long it has been out."""
        chunk, handed_out = next(iter(self.in_progress.items()))
        return chunk, now - handed_out

    @property
    def complete(self) -> bool:
        return self.n_done == self.n_chunks

    def fitness(self) -> np.ndarray:
        """The population's fitness (zeros for chunks not in yet), unpacked in one go."""
        zeros = bytes(packed_size(self.chunk_pairs))
        return unpack_blocks(
            b"".join(zeros if p is None else p for p in self.packed),
            self.n_chunks,
            self.chunk_pairs,
        )


class Coordinator:
    """Serves workers over TCP. `await start()` returns the port; `await stop()` flushes.

    save_dir: where checkpoints, config.json and metrics.jsonl go (None: nowhere).
    load_dir: resume from its newest checkpoint; older ones serve catch-up on demand.
    max_steps: stop handing out chunks once the run reaches this step; `finished` is set.
    secret: the shared secret workers must prove (None: anyone may join).
    tensorboard_dir: also write each step's scalars there as TensorBoard events.
    clock: monotonic seconds for step times, stragglers and the workers' busy and idle
        time, injectable for tests.

    `ended` is set when the run cannot go on without its operator: `finished` (max_steps
    reached) or `failure` (the reason a step could not be made durable).
    """

    def __init__(
        self,
        config: Config,
        *,
        save_dir=None,
        load_dir=None,
        max_steps: int | None = None,
        host: str | None = None,
        port: int | None = None,
        secret: bytes | None = None,
        tensorboard_dir=None,
        clock=time.monotonic,
    ):
        self.config = config
        k = config.coordinator
        self.host = k.host if host is None else host
        self.port = k.port if port is None else port
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.load_dir = Path(load_dir) if load_dir is not None else None
        self.max_steps = max_steps
        self.secret = None if secret is None else auth.check_secret(secret)
        self.tensorboard_dir = tensorboard_dir
        self.tensorboard: TensorBoard | None = None  # opened by start()
        self.clock = clock

        t = config.training
        self.chunk_size = t.chunk_size
        self.chunk_pairs = t.chunk_size // 2
        self.chunk_bytes = packed_size(self.chunk_pairs)
        self.health_entries = health_entries(config)
        self.limits = limits_from_worker(self.chunk_bytes, self.health_entries)
        self.history_dirs = [d for d in (self.save_dir, self.load_dir) if d is not None]
        self.max_connections = k.max_connections

        self.history: OrderedDict[int, bytes] = OrderedDict()  # step -> packed fitness
        # The seed chain, every SEED_STRIDE-th step's seed: any step's is a few hashes
        # from one of them, and the table grows by one int per SEED_STRIDE steps.
        self.seeds = [config.training.seed]
        self.digests = DigestCache()  # of the large frames sealed for every worker alike
        self._updates: OrderedDict[tuple[int, int], bytes] = OrderedDict()  # see _update
        self.metrics: ckpt.MetricsLog | None = None  # metrics.jsonl, once start() opened it
        self.finished = asyncio.Event()
        self.ended = asyncio.Event()
        self._news = asyncio.Event()  # set (then replaced) when held requests should look again
        self.failure: str | None = None
        self.peers: set[Peer] = set()
        self._disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deggs-disk")
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._prev_loss: float | None = None
        # The latest validation's exact bits per unit of integer loss, and its bits per
        # byte over bits per token: they put the training loss in bits (see bits_of).
        self._calibration: tuple[float, float] | None = None
        self._last_lost = -float("inf")  # when a worker last lost its connection (see below)
        self._resumed_at: int | None = None  # the step a resumed run starts at
        self._over_limit = _Burst(log, "refused {n} connection(s) over the limit of {limit}")
        self._evicted = {
            what: _Burst(log, f"closed {{n}} {what} connection(s) to make room (at {{limit}})")
            for what in ("idle", "unproven")
        }
        self._unproven: dict[tuple[int, str], _Burst] = {}  # by level and kind (see say)
        self.state = self._initial_state()
        self.replicas = Replicas(self)  # snapshots and state digests

    # --- lifecycle ---------------------------------------------------------------------

    def _initial_state(self) -> StepState:
        step, seed = 0, self.config.training.seed
        if self.load_dir is not None:
            ckpt.check_saved_config(self.load_dir, self.config)
            ckpt.check_seed_chain(self.load_dir, seed)
            latest = ckpt.load_latest(self.load_dir, self.config.training.n_pairs)
            if latest is None:
                log.info("no checkpoint in %s: starting at step 0", self.load_dir)
            else:
                step, seed = latest.step, latest.seed
                self._resumed_at = step
                if step > 0:
                    self._remember(step - 1, latest.fitness)
                log.info(
                    "resumed from %s at step %d (seed %d)",
                    ckpt.checkpoint_path(self.load_dir, step),
                    step,
                    seed,
                )
        return StepState.fresh(self.config, step, seed, self.clock())

    async def start(self) -> int:
        """Prepare the save directory, listen, and return the bound port."""
        if self.save_dir is not None:
            ckpt.prepare_save_dir(self.save_dir, self.config, self.state.step)
            ckpt.tidy_metrics(self.save_dir, self.state.step)
            records = ckpt.read_metrics(self.save_dir)
            self.metrics = ckpt.MetricsLog(self.save_dir, records)
            for record in reversed(records):
                self._calibration = calibration(record)
                if self._calibration is not None:
                    break
            if self.load_dir is not None and self.load_dir.resolve() != self.save_dir.resolve():
                await self.on_disk(ckpt.copy_history, self.load_dir, self.save_dir)
                await self.on_disk(snapshots.copy_snapshots, self.load_dir, self.save_dir)
        await self.on_disk(self.replicas.load, self.history_dirs, self.state.step)
        if self.tensorboard_dir is not None:
            self.tensorboard = TensorBoard(self.tensorboard_dir)
        self.max_connections = _connection_budget(self.config.coordinator.max_connections)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Peer(self), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.spawn(self._sweep_deadlines())
        self.state.started = self.clock()
        self._last_lost = time.monotonic()  # a restart: the workers may be reconnecting
        t = self.config.training
        log.info(
            "listening on %s:%d (at most %d connections)",
            self.host,
            self.port,
            self.max_connections,
        )
        if self.secret is None and not _is_loopback(self.host):
            log.warning(
                "no shared secret: anyone who can reach %s:%d can join and steer "
                "training; set %s or %s",
                self.host,
                self.port,
                auth.SECRET_ENV,
                auth.SECRET_FILE_ENV,
            )
        log.info(
            "step %d, population %d in %d chunks of %d, fingerprint %s%s",
            self.state.step,
            t.population_size,
            t.n_chunks,
            t.chunk_size,
            self.config.fingerprint().hex(),
            ", workers must prove the shared secret" if self.secret is not None else "",
        )
        self._check_finished()
        return self.port

    async def stop(self, reason: Reason = Reason.SHUTTING_DOWN) -> None:
        """Say GOODBYE(reason) to every worker, close, and wait for the disk thread."""
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        if reason == Reason.FINISHED:
            text = f"the run reached step {self.state.step}"
        elif reason == Reason.STOPPED:
            text = f"the coordinator was stopped at step {self.state.step}: the run ends here"
        else:
            text = self.failure or "the coordinator is shutting down"
        goodbye = Goodbye(reason, text).encode()
        for peer in list(self.peers):
            peer.close_with(goodbye if peer.welcomed else b"")
        self.tell_held()  # their connections are closing: nothing more to wait for
        deadline = time.monotonic() + LINGER_S + 0.5
        while self.peers and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for peer in list(self.peers):
            peer.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        await asyncio.get_running_loop().run_in_executor(None, self._disk.shutdown, True)
        if self.tensorboard is not None:
            self.tensorboard.close()
        for burst in self._unproven.values():  # the last second's counts, unsaid so far
            burst.flush()
        log.info("stopped at step %d", self.state.step)

    async def tell_latecomers(self, interrupted: asyncio.Event) -> None:
        """Once the run is finished, stay up while a worker may still be reconnecting, so
        that it is told FINISHED instead of retrying for ever an address where nobody will
        listen again. A worker retries at least every worker.retry_max_s, so one that
        lost its connection (or its coordinator: a restart) has come back by then."""
        due = self._last_lost + self.config.worker.retry_max_s + RECONNECT_S
        left = due - time.monotonic()
        if left <= 0:
            return
        log.info("telling reconnecting workers the run is finished for %.1f s more", left)
        try:
            await asyncio.wait_for(interrupted.wait(), left)
        except TimeoutError:
            pass

    def _check_finished(self):
        if self.max_steps is not None and self.state.step >= self.max_steps:
            if not self.finished.is_set():
                log.info("reached step %d (--max-steps)", self.state.step)
            self.finished.set()
            self.ended.set()

    def _fail(self, reason: str):
        self.failure = reason
        log.error("%s", reason)
        self.ended.set()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def on_disk(self, fn, *args):
        """Run fn on the disk thread, after everything submitted before it."""
        return asyncio.get_running_loop().run_in_executor(self._disk, fn, *args)

    async def _sweep_deadlines(self):
        k = self.config.coordinator
        every = min(1.0, k.handshake_timeout_s / 4, k.frame_timeout_s / 4, k.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for peer in list(self.peers):
                peer.check_deadlines(now)

    # --- connections (called by Peer) --------------------------------------------------

    def admit(self, peer: Peer) -> bool:
        if len(self.peers) >= self.max_connections:
            victim = self._evictable(time.monotonic())
            if victim is None:
                self._over_limit.note(limit=self.max_connections)
                return False
            self._evicted["idle" if victim.proven else "unproven"].note(limit=self.max_connections)
            victim.evict()
        self.peers.add(peer)
        return True

    def _evictable(self, now: float) -> Peer | None:
        """The connection to close for a newcomer when none are left: the oldest that has
        proven nothing yet, else the one idle longest (no chunk held, no request for
        EVICT_IDLE_S), else none. A worker at work is never pushed out."""
        best, best_key = None, (2, 0.0)
        for p in self.peers:
            if p.closing:
                continue
            if not p.proven:
                key = (0, p.opened)
            elif not p.busy and not p.holding and now - p.asked >= EVICT_IDLE_S:
                key = (1, p.asked)
            else:
                continue
            if key < best_key:
                best, best_key = p, key
        return best

    def say(self, peer: Peer, level: int, text: str):
        """Log a line about a peer: as it is for one that proved the secret; for any
        other (without a secret, everyone: anyone can open connections by the thousand)
        summarised by kind, at most a line a second of each with a count. The kind is the
        text with its numbers and quoted bytes blanked, so that a peer's input cannot make
        kinds without end."""
        if self.secret is not None and peer.authenticated:
            log.log(level, "%s %s", peer.name, text)
            return
        key = (level, _KIND_DETAILS.sub("#", text))
        burst = self._unproven.get(key)
        if burst is None:
            if len(self._unproven) >= UNPROVEN_KINDS:
                key, text = (level, "other"), f"{text} (and other reasons)"
            burst = self._unproven.setdefault(
                key,
                _Burst(
                    log,
                    "{name} {why} ({n} such from unproven peers since the last such line)",
                    1.0,
                    level,
                    alone="{name} {why}",
                ),
            )
        burst.note(name=peer.name, why=text)

    def forget(self, peer: Peer):
        """A connection closed: the chunks only it held go back to the queue at once."""
        self.peers.discard(peer)
        if (peer.welcomed or peer.step is not None) and not self.finished.is_set():
            self._last_lost = time.monotonic()  # a worker, which will reconnect
        self.replicas.lost(peer)
        if peer.step == self.state.step:
            peer.figures.left(self.clock())
            self._requeue(peer, "left")

    def take_back(self, peer: Peer):
        """A drifted worker's chunks go back to the queue; its RESULTs for them are ignored."""
        if peer.step == self.state.step:
            self._requeue(peer, "drifted")
            peer.revoked |= {(peer.step, chunk) for chunk in peer.chunks}
            peer.chunks = set()

    def _requeue(self, peer: Peer, why: str):
        s = self.state
        for chunk in peer.chunks:
            holders = s.holders.get(chunk)
            if holders is None:
                continue  # done, or already back in the queue
            holders.discard(peer)
            if not holders:
                del s.holders[chunk]
                s.in_progress.pop(chunk, None)
                s.pending.appendleft(chunk)
                log.info(
                    "chunk %d of step %d back in the queue: %s %s", chunk, s.step, peer.name, why
                )
                self.tell_held()

    def peer_named(self, name: str) -> Peer | None:
        return next((peer for peer in self.peers if peer.name == name), None)

    def note_drift(self, name: str, step: int):
        """A worker found drifted: named in the step's metrics line."""
        self.state.drifted[name] = step

    def handle(self, peer: Peer, opcode: int, payload: bytes):
        """The reply to one message: a frame, an awaitable of a frame, or None.

        Raises Drop or ProtocolError to close the connection.
        """
        if opcode == HELLO:
            return self._on_hello(peer, Hello.decode(payload))
        if opcode == AUTH:
            return self._on_auth(peer, Auth.decode(payload))
        if not peer.authorized:
            raise Drop(
                "sent a message before proving the shared secret"
                + ("" if peer.hello else " (a reference worker? they cannot prove it)")
            )
        if opcode == RESULT:
            self._on_result(peer, Result.decode(payload))
            return None
        if opcode == JOB_REQUEST:
            return self._on_job_request(peer, JobRequest.decode(payload))
        if opcode == EVALUATION:
            if not peer.welcomed:  # a deggs message: only from a worker that said HELLO
                raise ProtocolError("EVALUATION from a peer that did not say HELLO")
            self._on_evaluation(peer, Evaluation.decode(payload))
            return None
        if opcode == HEALTH:
            if not peer.welcomed:
                raise ProtocolError("HEALTH from a peer that did not say HELLO")
            self._on_health(peer, Health.decode(payload))
            return None
        if opcode in (DIGEST, SNAPSHOT, SNAPSHOT_PART):
            if not peer.welcomed:
                raise ProtocolError("a snapshot or digest from a peer that did not say HELLO")
            if opcode == DIGEST:
                self.replicas.on_digest(peer, Digest.decode(payload))
            elif opcode == SNAPSHOT:
                self.replicas.on_header(peer, SnapshotHeader.decode(payload))
            else:
                self.replicas.on_part(peer, SnapshotPart.decode(payload))
            return None
        # LOG_MESSAGE: a line per line of text, each marked with its sender, so a peer can
        # neither forge the coordinator's own lines nor drive the terminal.
        for line in LogMessage.decode(payload).text.rstrip("\n").split("\n"):
            log.info("[%s] %s", peer.name, printable(line))
        return None

    # --- the handshake -----------------------------------------------------------------

    def _on_hello(self, peer: Peer, hello: Hello) -> bytes:
        if peer.hello is not None:
            raise ProtocolError("a second HELLO")
        peer.hello = hello
        if hello.deggs_protocol != DEGGS_PROTOCOL:
            raise self._refusal(
                peer,
                Reason.PROTOCOL_MISMATCH,
                f"the worker speaks deggs protocol {hello.deggs_protocol}, the "
                f"coordinator {DEGGS_PROTOCOL}: run the same deggs version",
            )
        if self.secret is None:
            return self._welcome(peer, hello)
        peer.nonce = auth.new_nonce()
        return Challenge(
            peer.nonce, auth.proof(self.secret, "coordinator", hello.nonce, peer.nonce)
        ).encode()

    def _on_auth(self, peer: Peer, message: Auth) -> bytes:
        if self.secret is None or peer.hello is None or peer.nonce is None or peer.authenticated:
            raise ProtocolError("AUTH without a challenge")
        if not auth.verify(self.secret, "worker", peer.hello.nonce, peer.nonce, message.proof):
            raise Drop("wrong proof of the shared secret")
        if peer.queue:  # a worker waits for HELLO_REPLY; later frames would need tags
            raise ProtocolError("frames after AUTH before its reply")
        peer.authenticated = True
        # From here every frame both ways carries a tag, this HELLO_REPLY first. No reply
        # of before is still unsent: the proof needs our CHALLENGE, which went out first.
        peer.channel = Channel.for_coordinator(
            self.secret, peer.hello.nonce, peer.nonce, self.digests
        )
        peer.reader.limits = sealed_limits(self.limits)
        return self._welcome(peer, peer.hello)

    def _welcome(self, peer: Peer, hello: Hello) -> bytes:
        """HELLO_REPLY to an admitted deggs worker whose config matches (or who has none)."""
        ours = self.config.fingerprint()
        if hello.fingerprint not in (NO_FINGERPRINT, ours):
            raise self._refusal(
                peer,
                Reason.CONFIG_MISMATCH,
                "the worker's config differs "
                "from the coordinator's: " + self._config_differences(hello),
            )
        peer.welcomed = True
        how = "config matches" if hello.fingerprint == ours else "takes the coordinator's config"
        self.say(peer, logging.INFO, f"joined ({how})")
        return HelloReply(ours, self.config.to_json()).encode()

    def _config_differences(self, hello: Hello) -> str:
        fingerprints = (
            f"fingerprints differ (worker {hello.fingerprint.hex()}, "
            f"coordinator {self.config.fingerprint().hex()})"
        )
        if not hello.config_json:
            return fingerprints
        try:
            worker_config = Config.from_json(hello.config_json)
        except ConfigError as e:
            return f"{fingerprints}; the worker's config is unreadable: {e}"
        diffs = worker_config.differences(self.config)
        return "(worker != coordinator) " + "; ".join(diffs) if diffs else fingerprints

    def _refusal(self, peer: Peer, reason: Reason, text: str) -> Drop:
        """Close with a GOODBYE saying why. Reference workers cannot read one: they get
        the close alone, and the log line here says why."""
        return Drop(text, Goodbye(reason, text).encode() if peer.hello else b"")

    # --- jobs and results --------------------------------------------------------------

    def _on_job_request(self, peer: Peer, req: JobRequest):
        for opcode, _ in peer.queue:  # a worker reads each reply before it asks again
            if opcode == JOB_REQUEST:
                raise ProtocolError("it asks for work again without reading the replies")
        s = self.state
        peer.asked = time.monotonic()
        if self.finished.is_set():
            raise self._refusal(peer, Reason.FINISHED, f"the run reached step {s.step}")
        if (
            peer.welcomed
            and req.last_step <= s.step
            and self.replicas.wants_snapshot(peer, req.last_step)
        ):
            return self.replicas.send_snapshot(peer)
        if req.last_step < s.step:
            return self._catch_up(peer, req.last_step)
        if req.last_step > s.step:
            raise self._refusal(
                peer,
                Reason.COORDINATOR_BEHIND,
                f"the worker is at step {req.last_step} but the coordinator is at step "
                f"{s.step}; was the coordinator restarted without --load-dir?",
            )
        if req.seed != s.seed:
            raise self._refusal(
                peer,
                Reason.SEED_MISMATCH,
                f"the worker's seed {req.seed} for step {s.step} differs from the "
                f"coordinator's {s.seed} (another training.seed?)",
            )
        job = self._assign(peer)
        if job.is_wait and peer.welcomed and not peer.figures.holding:
            return self._held(peer, req)
        return job.encode()

    async def _held(self, peer: Peer, req: JobRequest):
        """A deggs worker's request that found no work, answered when there is some (or
        WAIT after HOLD_S). Only a worker that holds no chunk is held: its next message
        could be that chunk's RESULT, which is not read while its request waits."""
        give_up = time.monotonic() + HOLD_S
        while True:
            news, s = self._news, self.state
            if s.step != req.last_step or self.finished.is_set():
                reply = self._on_job_request(peer, req)  # the update, or the end
                return await reply if asyncio.iscoroutine(reply) else reply
            left = give_up - time.monotonic()
            if s.in_progress:  # the oldest chunk out becomes free at its straggler deadline
                _, waited = s.oldest_out(self.clock())
                left = min(left, self.config.coordinator.straggler_timeout_s - waited)
            try:  # at least a millisecond: a deadline that rounds to now must not spin
                await asyncio.wait_for(news.wait(), max(left, 1e-3))
            except TimeoutError:
                pass
            if peer.closing:
                return b""
            if self.state is s and not self.finished.is_set():
                job = self._assign(peer)
                if not job.is_wait or time.monotonic() >= give_up:
                    return job.encode()

    def tell_held(self):
        """Wake every held request: the step moved on, or a chunk came back."""
        self._news.set()
        self._news = asyncio.Event()

    def _catch_up(self, peer: Peer, step: int):
        """The fitness of `step`, which moves a worker from `step` to `step + 1`."""
        fitness = self.history.get(step)
        if fitness is not None:
            return self._update(step, fitness)
        return self._catch_up_from_disk(peer, step)

    def _update(self, step: int, fitness: bytes) -> bytes:
        """Step `step`'s catch-up JOB_RESPONSE: one bytes object for every worker that
        asks for it now, so that sealing it for each of them hashes it once."""
        key = (step, self.state.seed)
        frame = self._updates.get(key)
        if frame is None:
            frame = JobResponse(self.state.seed, step + 1, 0, fitness).encode()
            self._updates[key] = frame
            if len(self._updates) > DigestCache.SIZE:
                self._updates.popitem(last=False)
        return frame

    async def _catch_up_from_disk(self, peer: Peer, step: int) -> bytes:
        fitness = None
        if self.history_dirs:
            fitness = await self.on_disk(
                _fitness_from_disk,
                self.history_dirs,
                step,
                self.config.training.n_pairs,
                self._seed_of(step + 1),
            )
        if fitness is None:
            snapshot = self.replicas.newest
            pruned = (
                f"; the history before the snapshot of step {snapshot.step} was pruned: a "
                "deggs worker starts from that snapshot, a reference worker cannot"
                if snapshot is not None and step < snapshot.step
                else ""
            )
            raise self._refusal(
                peer,
                Reason.HISTORY_GONE,
                f"the fitness of step {step} is no longer kept (neither in memory nor in a "
                f"checkpoint), so a worker at step {step} cannot catch up to step "
                f"{self.state.step}{pruned}",
            )
        return JobResponse(self.state.seed, step + 1, 0, fitness).encode()

    def _assign(self, peer: Peer) -> JobResponse:
        s, now = self.state, self.clock()
        if peer.step != s.step:  # its first request of the step: free, waiting, from now
            peer.step, peer.chunks = s.step, set()
            # a name already there is a closed connection's (the OS reused its port)
            peer.figures = s.workers.setdefault(peer.name, WorkerFigures())
            peer.figures.free_since = now
        if self.replicas.book.split_step is not None:  # the replicas disagree: no training
            return JobResponse(s.seed, s.step, WAIT)
        if s.pending:
            chunk = s.pending.popleft()
        elif s.in_progress:
            chunk, waited = s.oldest_out(now)
            if waited < self.config.coordinator.straggler_timeout_s:
                return JobResponse(s.seed, s.step, WAIT)
            log.info("re-assigning chunk %d after %.1f s", chunk, waited)
        else:  # every chunk is in: the step is being sealed
            return JobResponse(s.seed, s.step, WAIT)
        s.in_progress[chunk] = now
        s.in_progress.move_to_end(chunk)  # a re-assigned chunk becomes the newest
        s.holders.setdefault(chunk, set()).add(peer)
        peer.chunks.add(chunk)
        peer.figures.took(chunk, now)
        return JobResponse(s.seed, s.step, chunk * self.chunk_size)

    def _on_result(self, peer: Peer, res: Result):
        s = self.state
        population = self.config.training.population_size
        if res.data_position % self.chunk_size or res.data_position >= population:
            raise ProtocolError(
                f"RESULT data_position {res.data_position} is not the start of "
                f"a chunk (multiples of {self.chunk_size} below {population})"
            )
        if len(res.data) != self.chunk_bytes:
            raise ProtocolError(
                f"RESULT carries {len(res.data)} bytes of fitness, a chunk "
                f"packs into {self.chunk_bytes}"
            )
        chunk = res.data_position // self.chunk_size
        if (res.last_step, chunk) in peer.revoked:
            log.info("ignoring %s's RESULT for chunk %d: it drifted", peer.name, chunk)
            return
        if res.last_step != s.step:
            log.info(
                "ignoring a RESULT for step %d from %s (now at step %d)",
                res.last_step,
                peer.name,
                s.step,
            )
            return
        if res.seed != s.seed:
            raise ProtocolError(
                f"RESULT for step {s.step} carries seed {res.seed}, expected {s.seed}"
            )
        if peer.step != s.step or chunk not in peer.chunks:
            raise ProtocolError(
                f"RESULT for chunk {chunk} of step {s.step}, which was not "
                "handed to this connection"
            )
        try:
            check_packed(res.data, self.chunk_pairs)
        except ValueError as e:
            raise ProtocolError(f"RESULT fitness is malformed: {e}") from None
        peer.figures.gave_back(chunk, self.clock())
        s.transmissions += 1  # duplicates count, as in the reference's statistics
        s.updates_total += res.updates_count
        s.updates_min = (
            res.updates_count if s.updates_min is None else min(s.updates_min, res.updates_count)
        )
        s.updates_max = max(s.updates_max, res.updates_count)
        if s.packed[chunk] is not None:
            log.info("ignoring a duplicate RESULT for chunk %d from %s", chunk, peer.name)
            return
        s.n_done += 1
        peer.figures.chunks += 1
        s.in_progress.pop(chunk, None)
        s.holders.pop(chunk, None)
        s.sum_loss += res.sum_loss
        s.packed[chunk] = res.data  # unpacked with the whole population at the seal
        if s.complete:
            s.sealing = True
            self.spawn(self._seal(s))

    def _on_evaluation(self, peer: Peer, ev: Evaluation):
        """A validation loss of the step in progress: kept for its metrics line (every
        worker computes the same figures, so the first one counts)."""
        s = self.state
        if ev.step != s.step or s.evaluation is not None:
            return
        s.evaluation = ev
        self._calibration = calibration(self._validation(s)) or self._calibration
        log.info(
            "validation at step %d: loss %.4f, %.4f bits/token, %.4f bits/byte (%d windows, "
            "from %s)",
            ev.step,
            ev.sum_loss / (ev.tokens * LOSS_SCALE),
            ev.nats / ev.tokens / math.log(2),
            ev.nats / max(ev.text_bytes, 1) / math.log(2),
            ev.windows,
            peer.name,
        )

    def _on_health(self, peer: Peer, report: Health):
        """A model health report of the step in progress, kept for its metrics line (the
        first one counts); says which matrices are saturated past eval.saturation_warning."""
        if len(report.entries) > self.health_entries:
            raise ProtocolError(
                f"HEALTH with {len(report.entries)} entries, the model has {self.health_entries}"
            )
        s = self.state
        if report.step != s.step or s.health is not None:
            return
        s.health = report
        by_share = sorted(report.entries, key=lambda e: e.saturation, reverse=True)
        least = min(report.entries, key=lambda e: e.entropy)
        log.info(
            "health at step %d: %d entries, most saturated %s (%.2f%%), lowest entropy %s "
            "(%.2f bits) (from %s)",
            report.step,
            len(report.entries),
            by_share[0].name,
            100 * by_share[0].saturation,
            least.name,
            least.entropy,
            peer.name,
        )
        limit = self.config.eval.saturation_warning
        over = [e for e in by_share if e.saturation > limit]
        if over:
            named = ", ".join(f"{e.name} {100 * e.saturation:.2f}%" for e in over[:WORST_NAMED])
            log.warning(
                "saturation at step %d above eval.saturation_warning = %g%% in %d of %d: %s%s",
                report.step,
                100 * limit,
                len(over),
                len(report.entries),
                named,
                ", ..." if len(over) > WORST_NAMED else "",
            )

    # --- finishing a step --------------------------------------------------------------

    async def _seal(self, s: StepState):
        """Make a finished step durable, then move every worker on to the next one."""
        packed = pack_trits(s.fitness())
        digests = self.replicas.sealed(s.step)
        record = self._metrics(s) | digests
        step, seed = s.step + 1, next_step_seed(s.seed, s.step + 1)
        if self.save_dir is not None:
            try:
                await self._durably(
                    ckpt.commit_step,
                    self.save_dir,
                    ckpt.Checkpoint(step, seed, packed),
                    record,
                    self.metrics,
                )
            except OSError as e:
                self._fail(
                    f"cannot save step {s.step} in {self.save_dir} "
                    f"({e.strerror or e}); the run stops at step {s.step}, and "
                    f"--load-dir {self.save_dir} resumes it once the disk is fixed"
                )
                return
        log.info(format_step_line(record, self._prev_loss, self.config.training.population_size))
        log.info(format_workers_line(record["workers"]))
        self._prev_loss = record["loss"]
        if self.tensorboard is not None:  # in order after the step's own files; never fails
            self.on_disk(self.tensorboard.write, record)
        self._remember(s.step, packed)
        self.state = StepState.fresh(self.config, step, seed, self.clock())
        self._check_finished()
        self.tell_held()

    async def _durably(self, fn, *args):
        """fn on the disk thread, retried while it fails with OSError, for disk_retry_s."""
        deadline = time.monotonic() + self.config.coordinator.disk_retry_s
        pause = 0.1
        while True:
            try:
                return await self.on_disk(fn, *args)
            except OSError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                log.warning(
                    "writing the checkpoint failed (%s); workers wait, retrying for another %.1f s",
                    e.strerror or e,
                    left,
                )
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, 5.0)

    def _seed_of(self, step: int) -> int:
        """Step `step`'s seed in the chain from training.seed (what its checkpoint holds)."""
        while len(self.seeds) * SEED_STRIDE <= step:
            seed, base = self.seeds[-1], (len(self.seeds) - 1) * SEED_STRIDE
            for s in range(base + 1, base + SEED_STRIDE + 1):
                seed = next_step_seed(seed, s)
            self.seeds.append(seed)
        seed, base = self.seeds[step // SEED_STRIDE], step // SEED_STRIDE * SEED_STRIDE
        for s in range(base + 1, step + 1):
            seed = next_step_seed(seed, s)
        return seed

    def _remember(self, step: int, packed: bytes):
        self.history[step] = packed
        while len(self.history) > self.config.coordinator.max_history:
            self.history.popitem(last=False)  # older steps stay on disk

    def _metrics(self, s: StepState) -> dict:
        t, m = self.config.training, self.config.model
        now = self.clock()
        elapsed = max(now - s.started, 1e-9)
        step_tokens = t.population_size * m.seq_len
        return {
            "step": s.step,
            "tokens": (s.step + 1) * step_tokens,
            "loss": s.sum_loss / (step_tokens * LOSS_SCALE),
            "sum_loss": s.sum_loss,
            "step_time_s": elapsed,
            "updates_total": s.updates_total,
            "updates_min": s.updates_min or 0,
            "updates_max": s.updates_max,
            "transmissions": s.transmissions,
            "tokens_per_s": step_tokens / elapsed,
            "lr": self.config.learning_rate(s.step),
            "bytes_sent": s.bytes_sent,
            "bytes_received": s.bytes_received,
            "time": time.time(),
            **self._validation(s),
            **bits_of(s.sum_loss / (step_tokens * LOSS_SCALE), self._calibration),
            **self._health(s),
            **({"drifted": s.drifted} if s.drifted else {}),
            # Its workers reported the update before the restart, to the lost step: its
            # updates_* say nothing of the weights changed (deggs-plot leaves them out).
            **({"resumed": True} if s.step == self._resumed_at else {}),
            "workers": {
                name: figures.record(now, t.chunk_size * m.seq_len)
                for name, figures in s.workers.items()
            },
        }

    @staticmethod
    def _validation(s: StepState) -> dict:
        ev = s.evaluation
        if ev is None:
            return {}
        return {
            "val_loss": ev.sum_loss / (ev.tokens * LOSS_SCALE),
            "val_bits_per_token": ev.nats / ev.tokens / math.log(2),
            "val_bits_per_byte": ev.nats / max(ev.text_bytes, 1) / math.log(2),
            "val_tokens": ev.tokens,
        }

    @staticmethod
    def _health(s: StepState) -> dict:
        if s.health is None:
            return {}
        return {
            "health": {
                e.name: {
                    "mean": e.mean,
                    "std": e.std,
                    "saturation": e.saturation,
                    "entropy": e.entropy,
                }
                for e in s.health.entries
            }
        }


class Peer(asyncio.Protocol):
    """One connection: frames in, replies out, and the state of its handshake.

    Frames are handled in order. A reply that must come from disk (old history) pauses
    reading until it is written; so does a peer that leaves more than max_send_buffer
    bytes of replies unread, which bounds what one connection can make us hold.
    """

    transport: asyncio.Transport  # set by connection_made, which asyncio calls first

    def __init__(self, coordinator: Coordinator):
        self.coord = coordinator
        self.name = "?"
        self.reader = FrameReader(coordinator.limits)
        self.queue: deque[tuple[int, bytes]] = deque()
        self.opened = time.monotonic()
        self.partial_since: float | None = None  # when the unfinished frame began
        self.write_paused_since: float | None = None
        self.busy = False  # waiting for a reply from disk
        self.closing = False
        self.got_frame = False
        self.hello: Hello | None = None
        self.nonce: bytes | None = None  # our challenge's
        self.authenticated = False
        self.channel: Channel | None = None  # every frame tagged, once the secret is proven
        self.welcomed = False  # a deggs worker that passed the handshake
        self.asked = self.opened  # when it last asked for work (JOB_REQUEST)
        self.step: int | None = None  # the step it last asked for a chunk of
        self.chunks: set[int] = set()  # chunks handed to this connection in that step
        self.revoked: set[tuple[int, int]] = set()  # (step, chunk) taken back: it drifted
        self.drifted = False  # its state digest disagreed: it resyncs before more work
        self._writable = asyncio.Event()  # set while its replies do not pile up
        self._writable.set()
        self.figures = WorkerFigures()  # its share of that step; a new one each step

    @property
    def authorized(self) -> bool:
        """May this peer ask for work and send results? With a secret: once proven.
        Without one: anyone, but a deggs worker only after its HELLO was answered."""
        if self.coord.secret is not None:
            return self.authenticated
        return self.hello is None or self.welcomed

    @property
    def proven(self) -> bool:
        """Has it shown it is a worker? With a secret: proven it. Without: a deggs worker
        welcomed, or any peer that asked for work the protocol's way."""
        if self.coord.secret is not None:
            return self.authenticated
        return self.welcomed or self.asked > self.opened

    @property
    def holding(self) -> bool:
        """Does it hold a chunk of the step in progress (handed out, no RESULT yet)?"""
        return self.step == self.coord.state.step and bool(self.figures.holding)

    # --- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport):
        self.transport = transport
        self.name = _peer_name(transport)
        if not self.coord.admit(self):
            transport.abort()
            self.closing = True
            return
        set_keepalive(transport.get_extra_info("socket"))
        transport.set_write_buffer_limits(high=self.coord.config.coordinator.max_send_buffer)
        log.debug("%s connected", self.name)

    def connection_lost(self, exc):
        if self not in self.coord.peers:  # refused by admit(), or already forgotten
            return
        if self.reader.partial and not self.closing:
            self.coord.say(self, logging.WARNING, "dropping: disconnected mid-frame")
        elif self.proven:
            self.coord.say(self, logging.INFO, "disconnected")
        self.closing = True
        self.coord.forget(self)

    def data_received(self, data: bytes):
        if self.closing:
            return
        self.coord.state.bytes_received += len(data)
        try:
            frames = self.reader.feed(data)
        except ProtocolError as e:
            self._close(f"dropping: {e}")
            return
        if not self.reader.partial:
            self.partial_since = None
        elif frames or self.partial_since is None:
            self.partial_since = time.monotonic()
        if frames:
            self.got_frame = True
            if self.channel is not None:
                try:
                    frames = self.channel.open_all(frames)
                except ProtocolError as e:
                    self._close(f"dropping: {e}")
                    return
            self.queue.extend(frames)
            self._process()

    def eof_received(self):
        return False  # close our side too, once our replies are out

    def pause_writing(self):
        self.write_paused_since = time.monotonic()
        self._writable.clear()
        self.transport.pause_reading()

    def resume_writing(self):
        self.write_paused_since = None
        self._writable.set()
        if not self.busy and not self.closing:
            self.transport.resume_reading()
            self._process()

    # --- frames ------------------------------------------------------------------------

    def _process(self):
        """Handle queued frames until one must wait for the disk or the peer stops reading
        its replies (pause_writing); send each batch of replies as one write."""
        limit = self.coord.config.coordinator.max_send_buffer
        while self.queue and not self.busy and not self.closing and self.write_paused_since is None:
            out, size = [], 0
            while self.queue and size < limit and not self.busy:
                opcode, payload = self.queue.popleft()
                try:
                    reply = self.coord.handle(self, opcode, payload)
                except Drop as drop:
                    self._write(out)
                    self._close(f"closing: {drop}", drop.goodbye)
                    return
                except ProtocolError as e:
                    self._write(out)
                    self._close(f"dropping: {e}")
                    return
                except Exception as e:  # a bug of ours: this connection ends, the run goes on
                    self._write(out)
                    self._close(f"internal error handling its message: {e!r}", level=logging.ERROR)
                    return
                if isinstance(reply, bytes):
                    out.append(reply)
                    size += len(reply)
                elif reply is not None:
                    self.busy = True
                    self.transport.pause_reading()
                    asyncio.ensure_future(reply).add_done_callback(self._reply_ready)
            self._write(out)

    def _reply_ready(self, future: asyncio.Future):
        self.busy = False
        if future.cancelled():
            return
        error = future.exception()  # retrieved even when nobody is left to tell
        if self.closing:
            return
        if isinstance(error, Drop):
            self._close(f"closing: {error}", error.goodbye)
            return
        if error is not None:
            self._close(f"internal error handling its message: {error!r}", level=logging.ERROR)
            return
        self._write([future.result()])
        if self.write_paused_since is None:
            self.transport.resume_reading()
        self._process()

    def send_now(self, frame: bytes):
        """A frame out of turn (a request to the worker, or a streamed snapshot's part)."""
        self._write([frame])

    async def writable(self):
        """Until the peer has read enough of what we sent (or its connection closes)."""
        while not self._writable.is_set() and not self.closing:
            try:
                await asyncio.wait_for(self._writable.wait(), 1.0)
            except TimeoutError:
                pass

    def _write(self, frames: list[bytes]):
        if frames and not self.transport.is_closing():
            if self.channel is not None:
                frames = [self.channel.seal(f) for f in frames]
            data = b"".join(frames)
            self.coord.state.bytes_sent += len(data)
            self.transport.write(data)

    # --- closing -----------------------------------------------------------------------

    def check_deadlines(self, now: float):
        k = self.coord.config.coordinator
        admitted = self.authenticated if self.coord.secret is not None else self.got_frame
        if not admitted and now - self.opened > k.handshake_timeout_s:
            self._close(f"closing: no handshake within {k.handshake_timeout_s:g} s")
        elif self.partial_since is not None and now - self.partial_since > k.frame_timeout_s:
            self._close(f"closing: a frame still unfinished after {k.frame_timeout_s:g} s")
        elif (
            self.write_paused_since is not None
            and now - self.write_paused_since > k.frame_timeout_s
        ):
            self._close(f"closing: it has not read its replies for {k.frame_timeout_s:g} s")
        elif now - self.asked > k.idle_timeout_s and not self.busy and not self.holding:
            self._close(f"closing: it has not asked for work for {k.idle_timeout_s:g} s")

    def _close(self, why: str, goodbye: bytes = b"", level: int = logging.WARNING):
        if self.closing:
            return
        self.coord.say(self, level, why)
        self.close_with(goodbye)

    def evict(self):
        """Close at once, replies unsent: its descriptor is wanted for a newcomer."""
        self.closing = True
        self.queue.clear()
        self.transport.abort()

    def close_with(self, goodbye: bytes = b""):
        """Close, letting queued replies and a GOODBYE out for at most LINGER_S.

        After a GOODBYE we half-close and read on (ignoring it) until the peer closes:
        closing with its unread input (a worker pipelines JOB_REQUEST after HELLO) would
        reset the connection and could destroy the explanation on its way. A peer that
        reads nothing at all is cut off when LINGER_S runs out.
        """
        if self.closing:
            return
        self.closing = True
        self.queue.clear()
        transport = self.transport
        if goodbye and not transport.is_closing():
            self._write([goodbye])
            try:
                if transport.can_write_eof():
                    transport.write_eof()
            except OSError:  # the peer is already gone (reset): nothing left to tell it
                transport.abort()
                return
            transport.resume_reading()
        else:
            transport.close()
        asyncio.get_running_loop().call_later(LINGER_S, transport.abort)


# Numbers and quoted bytes in a reason: blanked to tell the kind of a failure.
_KIND_DETAILS = re.compile(r"b?'[^']*'|b?\"[^\"]*\"|\d+(\.\d+)?")


class _Burst:
    """Logs an event the first time, then at most once per `every` seconds with a count,
    so a flood of refused connections costs a few lines, not one per connection. `alone`,
    if given, is the line when there is nothing to count (a single event)."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        every: float = 10.0,
        level: int = logging.WARNING,
        alone: str | None = None,
    ):
        self.logger, self.message, self.every, self.level = logger, message, every, level
        self.alone = alone
        self.last = -float("inf")
        self.count = 0
        self.details: dict = {}  # the last event's, for flush()

    def note(self, **details):
        self.count += 1
        self.details = details
        now = time.monotonic()
        if now - self.last >= self.every:
            line = self.alone if self.count == 1 and self.alone is not None else self.message
            self.logger.log(self.level, line.format(n=self.count, **details))
            self.last, self.count = now, 0

    def flush(self):
        """Say the events counted since the last line (at the coordinator's stop)."""
        if self.count:
            self.logger.log(self.level, self.message.format(n=self.count, **self.details))
            self.count = 0


def _connection_budget(wanted: int) -> int:
    """max_connections, lowered so that connections never take the descriptors that
    checkpoint and metrics writes need (the soft limit is raised toward the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    budget = max(1, min(wanted, soft - FD_RESERVE))
    if budget < wanted:
        log.warning(
            "coordinator.max_connections lowered from %d to %d: the descriptor limit "
            "is %d (ulimit -n)",
            wanted,
            budget,
            soft,
        )
    return budget


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def calibration(record: dict) -> tuple[float, float] | None:
    """(bits per unit of integer loss, bits per byte / bits per token) of a validation
    record (the val_ keys of a metrics line), or None without one.

    The integer loss has no exact conversion to bits: it floors the log-sum-exp to a
    power of two and counts the logit gap at 1/8 bit a unit, where softmax(logit /
    exp_scale) counts it at 1 / (exp_scale ln 2). The validation measures both on the
    same windows, so their ratio puts any integer loss on the validation's scale."""
    figures = [record.get(k) for k in ("val_loss", "val_bits_per_token", "val_bits_per_byte")]
    if not all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in figures):
        return None
    loss, bits, per_byte = (float(v) for v in figures)  # type: ignore[arg-type]
    return bits / loss, per_byte / bits


def bits_of(loss: float, calibration: tuple[float, float] | None) -> dict:
    """The training loss in bits per token and per byte, on the latest validation's scale."""
    if calibration is None:
        return {}
    per_unit, bytes_ratio = calibration
    return {"bits_per_token": loss * per_unit, "bits_per_byte": loss * per_unit * bytes_ratio}


def format_step_line(r: dict, prev_loss: float | None = None, population: int = 0) -> str:
    """The human summary of a finished step, after the reference's: the training loss
    (the mean over the step's perturbed members) and, on a validation step, the
    validation's (the unperturbed model's) in bits per token when there is a validation
    to convert it with, else the integer loss alone."""
    trend = (
        ""
        if prev_loss is None
        else (" v" if r["loss"] < prev_loss else " ^" if r["loss"] > prev_loss else " =")
    )
    members = f"mean of {population:,} perturbed members, " if population else ""
    if "bits_per_token" in r:
        loss = f"Train: {r['bits_per_token']:.3f} bits/token{trend} ({members}loss {r['loss']:.4f})"
    else:
        loss = f"Loss: {r['loss']:.4f}{trend}"
    if "val_bits_per_token" in r:
        loss += f" | Val: {r['val_bits_per_token']:.3f} bits/token (unperturbed model)"
    net = (r["bytes_sent"] + r["bytes_received"]) / r["step_time_s"] / 2**20
    return (
        f"Step {r['step']} | Tokens: {_humanize(r['tokens'], 1000, ['', ' K', ' M', ' B'])}"
        f" | {loss} | Time: {r['step_time_s'] * 1000:.2f} ms"
        f" | Updates: {r['updates_total']} (n={r['transmissions']}, max={r['updates_max']})"
        f" | Speed: {r['tokens_per_s']:.2f} tok/s"
        f" | LR: {r['lr']:.3f} | Net: {net:.2f} MB/s"
        f" (Tx: {_humanize(r['bytes_sent'], 1024, [' B', ' KB', ' MB', ' GB'])},"
        f" Rx: {_humanize(r['bytes_received'], 1024, [' B', ' KB', ' MB', ' GB'])})"
    )


def format_workers_line(workers: dict) -> str:
    """One line on the workers of a finished step, naming at most NAMED_WORKERS: the
    slowest first, then the most idle of the rest, so that a slow GPU or one starved of
    work shows however many there are."""
    by_speed = sorted(workers, key=lambda name: workers[name]["member_tokens_per_s"])
    slowest = by_speed[: NAMED_WORKERS // 2]
    most_idle = sorted(by_speed[len(slowest) :], key=lambda name: -workers[name]["idle_s"])
    named = slowest + most_idle[: NAMED_WORKERS - len(slowest)]
    parts = [f"Workers {len(workers)}"]
    for name in named:
        w = workers[name]
        speed = _humanize(round(w["member_tokens_per_s"]), 1000, ["", " K", " M", " B"])
        chunks = f"{w['chunks']} chunk{'' if w['chunks'] == 1 else 's'}"
        parts.append(f"{name} {chunks} {speed} tok/s idle {w['idle_s']:.2f} s")
    if len(workers) > len(named):
        parts.append(f"and {len(workers) - len(named)} more")
    return " | ".join(parts)


def _humanize(n: int, base: int, units: list[str]) -> str:
    for power in range(len(units) - 1, 0, -1):
        if n >= base**power:
            return f"{n / base**power:.2f}{units[power]}"
    return f"{n}{units[0]}"


def _fitness_from_disk(dirs: list[Path], step: int, n_pairs: int, seed: int) -> bytes | None:
    """Step `step`'s packed fitness from checkpoint step+1 in the first dir that has it
    whole (its checksum, when recorded, and `seed`, the chain's at step+1, both hold)."""
    for directory in dirs:
        path = ckpt.checkpoint_path(directory, step + 1)
        if path.exists():
            try:
                checkpoint = ckpt.read_checkpoint(path, n_pairs)
                if checkpoint.seed != seed:
                    raise ckpt.CheckpointError(
                        f"{path}: seed {checkpoint.seed} is not the chain's {seed}; the file "
                        "is corrupt or from another run"
                    )
                return checkpoint.fitness
            except ckpt.CheckpointError as e:
                log.error("cannot serve step %d from disk: %s", step, e)
    return None


def _peer_name(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
