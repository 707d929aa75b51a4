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
  else one idle for a while (server.py's Admission), makes room for the newcomer.
- Lines about peers that proved nothing (their failures, their LOG_MESSAGEs, RESULTs
  ignored) are bounded: a few a second of each kind as they come, the rest as a count,
  so that a flood cannot fill the disk with log lines. A state digest counts only from
  a worker that scored a chunk of its step (replicas.py).

A reference worker that finds no work is answered WAIT at once; a deggs worker's request
is held (at most HOLD_S) and answered the moment there is work (docs/PROTOCOL.md).

One asyncio event loop serves every connection through a `Peer` (server.py); the step
and its figures are steps.py's, snapshots and digests replicas.py's. Disk work runs on one
background thread, in submission order, so the loop never blocks on a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import Config, ConfigError
from ..numerics.params import health_entries
from ..seeds import next_step_seed
from ..ternary import check_packed, packed_size
from . import auth
from . import checkpoint as ckpt
from . import snapshot as snapshots
from .channel import Channel, DigestCache
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
)
from .replicas import Replicas
from .server import LINGER_S, Admission, Drop, Peer, PeerLines, connection_budget, is_loopback
from .steps import (
    StepState,
    WorkerFigures,
    calibration,
    format_step_line,
    format_workers_line,
    log_health,
    log_validation,
    step_record,
    validation_record,
)
from .tensorboard import TensorBoard

log = logging.getLogger("deggs.runtime.coordinator")

HOLD_S = 1.0  # longest a deggs worker's request for work is held before WAIT (see above)
RECONNECT_S = 2.0  # a reconnecting worker's connect and handshake, after its backoff pause
# A step's rows in metrics.jsonl of connections that asked for work and got none: a
# run's idle workers, not every connection a stranger opens.
WORKER_ROWS = 256


class Coordinator:
    """Serves workers over TCP. `await start()` returns the port; `await stop()` flushes.

    save_dir: where checkpoints, config.json and metrics.jsonl go (None: nowhere).
    load_dir: resume from its newest checkpoint; older ones serve catch-up on demand.
    max_steps: stop handing out chunks once the run reaches this step; `finished` is set.
    secret: the shared secret workers must prove (None: anyone may join).
    tensorboard_dir: also write each step's scalars there as TensorBoard events.
    clock: monotonic seconds, the one clock of every deadline and figure (injectable).

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

        self.history: OrderedDict[int, bytes] = OrderedDict()  # step -> packed fitness
        self.seeds = ckpt.SeedChain(config.training.seed)
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
        self.admission = Admission(k.max_connections)  # its limit set by start()
        self.lines = PeerLines(secret is not None)  # lines about peers, summarised
        self._summaries = (self.admission, self.lines)
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
        # The port and --tensorboard first: a start that fails on either leaves the save
        # directory untouched (a retry with another config would find its config.json).
        self.admission.limit = connection_budget(self.config.coordinator.max_connections)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Peer(self), self.host, self.port, start_serving=False
        )
        try:
            await self._prepare()
        except BaseException:
            self._server.close()
            self._server = None
            if self.tensorboard is not None:
                self.tensorboard.close()
                self.tensorboard = None
            raise
        await self._server.start_serving()
        self.port = self._server.sockets[0].getsockname()[1]
        self.spawn(self._sweep_deadlines())
        self.state.started = self.clock()
        self._last_lost = self.clock()  # a restart: the workers may be reconnecting
        t = self.config.training
        log.info(
            "listening on %s:%d (at most %d connections)",
            self.host,
            self.port,
            self.admission.limit,
        )
        if self.secret is None and not is_loopback(self.host):
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

    async def _prepare(self) -> None:
        """--tensorboard's output, then the save directory, the history of --load-dir and
        the replicas' snapshots."""
        if self.tensorboard_dir is not None:
            self.tensorboard = TensorBoard(self.tensorboard_dir)
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
        deadline = self.clock() + LINGER_S + 0.5
        while self.peers and self.clock() < deadline:
            await asyncio.sleep(0.02)
        for peer in list(self.peers):
            peer.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        await asyncio.get_running_loop().run_in_executor(None, self._disk.shutdown, True)
        if self.tensorboard is not None:
            self.tensorboard.close()
        for summary in self._summaries:
            summary.flush()  # the counts of the last window, unsaid so far
        log.info("stopped at step %d", self.state.step)

    async def tell_latecomers(self, interrupted: asyncio.Event) -> None:
        """Once the run is finished, stay up while a worker may still be reconnecting, so
        that it is told FINISHED instead of retrying for ever an address where nobody will
        listen again. A worker retries at least every worker.retry_max_s, so one that
        lost its connection (or its coordinator: a restart) has come back by then."""
        due = self._last_lost + self.config.worker.retry_max_s + RECONNECT_S
        left = due - self.clock()
        if left <= 0:
            return
        log.info("telling reconnecting workers the run is finished for %.1f s more", left)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(interrupted.wait(), left)

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
            now = self.clock()
            for peer in list(self.peers):
                peer.check_deadlines(now)
            for summary in self._summaries:
                summary.tick()  # counted events said within a window, not at the next one

    # --- connections (called by Peer) --------------------------------------------------

    def admit(self, peer: Peer) -> bool:
        return self.admission.admit(self.peers, peer, self.clock())

    def say(self, peer: Peer, level: int, text: str):
        self.lines.say(peer, level, text)

    def forget(self, peer: Peer):
        """A connection closed: the chunks only it held go back to the queue at once."""
        self.peers.discard(peer)
        if (peer.welcomed or peer.step is not None) and not self.finished.is_set():
            self._last_lost = self.clock()  # a worker, which will reconnect
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
                back = f"chunk {chunk} of step {s.step} back in the queue"
                self.say(peer, logging.INFO, f"{why}: {back}")
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
        self.lines.log_lines(peer, LogMessage.decode(payload).text.rstrip("\n").split("\n"))
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
        # From here every write both ways is a sealed record, this HELLO_REPLY first. No
        # reply of before is still unsent: the proof needs our CHALLENGE, sent first.
        peer.channel = peer.reader = Channel.for_coordinator(
            self.secret, peer.hello.nonce, peer.nonce, self.limits, self.digests, peer.reader.unread
        )
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
        peer.asked = self.clock()
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
        give_up = self.clock() + HOLD_S
        while True:
            news, s = self._news, self.state
            if s.step != req.last_step or self.finished.is_set():
                reply = self._on_job_request(peer, req)  # the update, or the end
                return await reply if asyncio.iscoroutine(reply) else reply
            left = give_up - self.clock()
            if s.in_progress:  # the oldest chunk out becomes free at its straggler deadline
                _, waited = s.oldest_out(self.clock())
                left = min(left, self.config.coordinator.straggler_timeout_s - waited)
            # at least a millisecond: a deadline that rounds to now must not spin
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), max(left, 1e-3))
            if peer.closing:
                return b""
            if self.state is s and not self.finished.is_set():
                job = self._assign(peer)
                if not job.is_wait or self.clock() >= give_up:
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
                ckpt.fitness_from_disk,
                self.history_dirs,
                step,
                self.config.training.n_pairs,
                self.seeds.at(step + 1),
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
            peer.figures = s.workers.get(peer.name) or WorkerFigures()
            peer.figures.free_since = now
            if len(s.workers) < WORKER_ROWS:  # past that, only those given a chunk
                s.workers[peer.name] = peer.figures
        if self.replicas.book.split_step is not None:  # the replicas disagree: no training
            return JobResponse(s.seed, s.step, WAIT)
        if s.pending:
            chunk = s.pending.popleft()
        elif s.in_progress:
            chunk, waited = s.oldest_out(now)  # (never to the worker that holds it)
            if waited < self.config.coordinator.straggler_timeout_s or chunk in peer.chunks:
                return JobResponse(s.seed, s.step, WAIT)
            log.info("re-assigning chunk %d after %.1f s", chunk, waited)
        else:  # every chunk is in: the step is being sealed
            return JobResponse(s.seed, s.step, WAIT)
        s.in_progress[chunk] = now
        s.in_progress.move_to_end(chunk)  # a re-assigned chunk becomes the newest
        s.holders.setdefault(chunk, set()).add(peer)
        peer.chunks.add(chunk)
        peer.figures.took(chunk, now)
        s.workers.setdefault(peer.name, peer.figures)
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
            self.say(peer, logging.INFO, f"ignoring its RESULT for chunk {chunk}: it drifted")
            return
        if res.last_step != s.step:  # a straggler's; ignored, not closed, as the reference does
            self.say(
                peer,
                logging.INFO,
                f"ignoring a RESULT for step {res.last_step} (now at step {s.step})",
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
            self.say(peer, logging.INFO, f"ignoring a duplicate RESULT for chunk {chunk}")
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
        self._calibration = calibration(validation_record(s)) or self._calibration
        log_validation(ev, peer.name)

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
        log_health(report, self.config.eval.saturation_warning, peer.name)

    # --- finishing a step --------------------------------------------------------------

    async def _seal(self, s: StepState):
        """Make a finished step durable, then move every worker on to the next one."""
        packed = s.packed_fitness()
        digests = self.replicas.sealed(s.step, {n for n, f in s.workers.items() if f.returned})
        record = step_record(self.config, s, self.clock(), self._calibration, self._resumed_at)
        record |= digests
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
        deadline = self.clock() + self.config.coordinator.disk_retry_s
        pause = 0.1
        while True:
            try:
                return await self.on_disk(fn, *args)
            except OSError as e:
                left = deadline - self.clock()
                if left <= 0:
                    raise
                log.warning(
                    "writing the checkpoint failed (%s); workers wait, retrying for another %.1f s",
                    e.strerror or e,
                    left,
                )
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, 5.0)

    def _remember(self, step: int, packed: bytes):
        self.history[step] = packed
        while len(self.history) > self.config.coordinator.max_history:
            self.history.popitem(last=False)  # older steps stay on disk
