"""The coordinator: hands out chunks of each step's population and gathers their fitness.

A step's population is cut into chunks of chunk_size members. A worker asks for a job
(JOB_REQUEST), gets a chunk (JOB_RESPONSE with a data_position), evaluates its antithetic
pairs and sends back their ternary fitness (RESULT). When every chunk is in, the packed
whole-population fitness becomes the step's update: it is kept in memory and on disk, the
step and seed advance, and every worker applies it before its next chunk. A worker that
is behind (a new one, or one that was away) replays the steps it missed, one
JOB_RESPONSE with that step's fitness per request, before it gets a chunk.

One asyncio event loop serves every connection. Disk work (checkpoints, metrics, reading
old history) runs on a single background thread, in submission order, so the loop never
blocks on a file and a checkpoint is written before any later one. A connection that
breaks the protocol is closed with one log line; the step and every other worker carry on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from .config import Config
from .noise import next_step_seed
from .protocol import (DEGGS_PROTOCOL, HEADER_SIZE, HELLO, JOB_REQUEST, LOG_MESSAGE,
                       NO_FINGERPRINT, OPCODE_NAMES, RESULT, WAIT, Hello, HelloReply,
                       JobRequest, JobResponse, LogMessage, ProtocolError, Result,
                       read_frame)
from .ternary import packed_size, pack_trits, unpack_trits

log = logging.getLogger("deggs.coordinator")

LOSS_SCALE = 16  # the worker sums losses in Q.4 fixed point


class Drop(Exception):
    """Close this connection, after sending `frame` (a message explaining why) if any."""

    def __init__(self, reason: str, frame: bytes = b""):
        super().__init__(reason)
        self.frame = frame


@dataclass
class StepState:
    """Everything the coordinator tracks about the step being trained."""
    step: int
    seed: int
    started: float  # clock time the step began
    n_chunks: int
    fitness: np.ndarray  # int32 per pair of the population
    pending: deque = field(default_factory=deque)  # chunks never handed out
    in_progress: dict = field(default_factory=dict)  # chunk -> time handed out, oldest first
    done: set = field(default_factory=set)
    sum_loss: int = 0
    transmissions: int = 0  # RESULTs for this step, duplicates included
    updates_total: int = 0
    updates_min: int | None = None
    updates_max: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    @classmethod
    def fresh(cls, config: Config, step: int, seed: int, now: float) -> "StepState":
        t = config.training
        return cls(step=step, seed=seed, started=now, n_chunks=t.n_chunks,
                   fitness=np.zeros(t.n_pairs, dtype=np.int32),
                   pending=deque(range(t.n_chunks)))

    @property
    def complete(self) -> bool:
        return len(self.done) == self.n_chunks


class Coordinator:
    """Serves workers over TCP. `await start()` returns the port; `await stop()` flushes.

    save_dir: where checkpoints, config.json and metrics.jsonl go (None: nowhere).
    load_dir: resume from its newest checkpoint; older ones serve catch-up on demand.
    max_steps: stop handing out chunks once the run reaches this step; `finished` is set.
    clock: monotonic seconds, injectable for tests of the straggler timeout.
    """

    def __init__(self, config: Config, *, save_dir=None, load_dir=None,
                 max_steps: int | None = None, host: str | None = None,
                 port: int | None = None, clock=time.monotonic):
        self.config = config
        self.host = config.coordinator.host if host is None else host
        self.port = config.coordinator.port if port is None else port
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.load_dir = Path(load_dir) if load_dir is not None else None
        self.max_steps = max_steps
        self.clock = clock

        t = config.training
        self.chunk_size = t.chunk_size
        self.chunk_pairs = t.chunk_size // 2
        self.chunk_bytes = packed_size(self.chunk_pairs)
        self.population_bytes = packed_size(t.n_pairs)
        # The largest frame a worker has reason to send is a RESULT.
        self.max_payload = max(1 << 20, 44 + self.chunk_bytes)
        self.history_dirs = [d for d in (self.save_dir, self.load_dir) if d is not None]

        self.history: OrderedDict[int, bytes] = OrderedDict()  # step -> packed fitness
        self.finished = asyncio.Event()
        self._disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deggs-disk")
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self._prev_loss: float | None = None
        self.state = self._initial_state()

    # --- lifecycle ---------------------------------------------------------------------

    def _initial_state(self) -> StepState:
        step, seed = 0, self.config.training.seed
        if self.load_dir is not None:
            ckpt.check_saved_config(self.load_dir, self.config)
            latest = ckpt.load_latest(self.load_dir, self.population_bytes)
            if latest is None:
                log.info("no checkpoint in %s: starting at step 0", self.load_dir)
            else:
                step, seed = latest.step, latest.seed
                if step > 0:
                    self._remember(step - 1, latest.fitness)
                log.info("resumed from %s at step %d (seed %d)",
                         ckpt.checkpoint_path(self.load_dir, step), step, seed)
        return StepState.fresh(self.config, step, seed, self.clock())

    async def start(self) -> int:
        """Prepare the save directory, listen, and return the bound port."""
        if self.save_dir is not None:
            ckpt.prepare_save_dir(self.save_dir, self.config, self.state.step)
            if self.load_dir is not None and self.load_dir.resolve() != self.save_dir.resolve():
                self._on_disk(ckpt.copy_history, self.load_dir, self.save_dir)
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.state.started = self.clock()
        t = self.config.training
        log.info("listening on %s:%d", self.host, self.port)
        log.info("step %d, population %d in %d chunks of %d, fingerprint %s",
                 self.state.step, t.population_size, t.n_chunks, t.chunk_size,
                 self.config.fingerprint().hex())
        self._check_finished()
        return self.port

    async def stop(self) -> None:
        """Close every connection and wait until checkpoints and metrics are on disk."""
        if self._server is not None:
            self._server.close()
        # Closing a connection ends its handler at the next read, with the usual log line.
        for writer in self._connections.values():
            writer.close()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        await asyncio.get_running_loop().run_in_executor(None, self._disk.shutdown, True)
        log.info("stopped at step %d", self.state.step)

    def _check_finished(self):
        if self.max_steps is not None and self.state.step >= self.max_steps:
            if not self.finished.is_set():
                log.info("reached step %d (--max-steps)", self.state.step)
            self.finished.set()

    def _on_disk(self, fn, *args):
        """Run fn on the disk thread, after everything submitted before it."""
        future = asyncio.get_running_loop().run_in_executor(self._disk, fn, *args)
        future.add_done_callback(_log_disk_failure)
        return future

    # --- connections -------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        self._connections[task] = writer
        peer = _peer_name(writer)
        log.info("worker %s connected", peer)
        try:
            while (got := await read_frame(reader, self.max_payload)) is not None:
                opcode, payload = got
                self.state.bytes_received += HEADER_SIZE + len(payload)
                reply = await self._handle(opcode, payload, peer)
                if reply:
                    await self._send(writer, reply)
            log.info("worker %s disconnected", peer)
        except Drop as drop:
            log.warning("closing connection to %s: %s", peer, drop)
            if drop.frame:
                await self._say_goodbye(reader, writer, drop.frame)
        except ProtocolError as e:
            log.warning("dropping %s: %s", peer, e)
        except OSError as e:
            log.warning("lost %s: %s", peer, e)
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass
            self._connections.pop(task, None)

    async def _say_goodbye(self, reader, writer, frame: bytes, linger_s: float = 1.0):
        """Send a last frame and let the peer read it before the connection closes.

        Closing with unread input (a worker pipelines JOB_REQUEST after HELLO) would
        reset the connection, and the reset can destroy the explanation on its way.
        """
        try:
            await self._send(writer, frame)
            writer.write_eof()
            async with asyncio.timeout(linger_s):
                while await reader.read(1 << 16):
                    pass
        except (OSError, TimeoutError):
            pass

    async def _send(self, writer: asyncio.StreamWriter, data: bytes):
        writer.write(data)
        self.state.bytes_sent += len(data)
        await writer.drain()

    async def _handle(self, opcode: int, payload: bytes, peer: str) -> bytes | None:
        """The reply frame to one message (None: no reply). Raises Drop or ProtocolError."""
        if opcode == JOB_REQUEST:
            return await self._on_job_request(JobRequest.decode(payload))
        if opcode == RESULT:
            self._on_result(Result.decode(payload), peer)
            return None
        if opcode == LOG_MESSAGE:
            log.info("[%s] %s", peer, LogMessage.decode(payload).text.rstrip("\n"))
            return None
        if opcode == HELLO:
            return self._on_hello(Hello.decode(payload), peer)
        if opcode in OPCODE_NAMES:
            raise ProtocolError(f"unexpected {OPCODE_NAMES[opcode]} from a worker")
        raise ProtocolError(f"unknown opcode {opcode}")

    # --- messages ----------------------------------------------------------------------

    def _on_hello(self, hello: Hello, peer: str) -> bytes:
        ours = self.config.fingerprint()
        config_json = self.config.to_json()
        if hello.deggs_protocol != DEGGS_PROTOCOL:
            problem = (f"worker speaks deggs protocol {hello.deggs_protocol}, the coordinator "
                       f"{DEGGS_PROTOCOL}")
        elif hello.fingerprint in (NO_FINGERPRINT, ours):
            what = "sent the config" if hello.fingerprint == NO_FINGERPRINT else "config matches"
            log.info("worker %s: hello accepted (%s)", peer, what)
            return HelloReply(True, ours, config_json, "welcome").encode()
        else:
            problem = "config differs from the coordinator's: " + self._config_differences(hello)
        reply = HelloReply(False, ours, config_json, problem).encode()
        raise Drop(f"hello refused: {problem}", reply)

    def _config_differences(self, hello: Hello) -> str:
        fingerprints = (f"fingerprints differ (worker {hello.fingerprint.hex()}, "
                        f"coordinator {self.config.fingerprint().hex()})")
        if not hello.config_json:
            return fingerprints
        try:
            worker_config = Config.from_json(hello.config_json)
        except ValueError as e:
            return f"{fingerprints}; the worker's config is unreadable: {e}"
        diffs = worker_config.differences(self.config)
        return "(worker != coordinator) " + "; ".join(diffs) if diffs else fingerprints

    async def _on_job_request(self, req: JobRequest) -> bytes:
        s = self.state
        if req.last_step < s.step:
            return await self._catch_up(req.last_step)
        if req.last_step > s.step:
            raise self._refusal(
                f"worker is at step {req.last_step} but the coordinator is at step {s.step}; "
                "was the coordinator restarted without --load-dir?")
        if req.seed != s.seed:
            raise self._refusal(
                f"worker's seed {req.seed} for step {s.step} differs from the coordinator's "
                f"{s.seed} (another training.seed?)")
        return self._assign().encode()

    def _refusal(self, reason: str) -> Drop:
        return Drop(reason, LogMessage(f"coordinator: {reason}\n").encode())

    async def _catch_up(self, step: int) -> bytes:
        """The fitness of `step`, which moves a worker from `step` to `step + 1`."""
        fitness = self.history.get(step)
        if fitness is None and self.history_dirs:
            fitness = await self._on_disk(_fitness_from_disk, self.history_dirs, step,
                                          self.population_bytes)
        if fitness is None:
            raise self._refusal(
                f"the fitness of step {step} is no longer kept (neither in memory nor in a "
                f"checkpoint), so a worker at step {step} cannot catch up to step "
                f"{self.state.step}")
        return JobResponse(self.state.seed, step + 1, 0, fitness).encode()

    def _assign(self) -> JobResponse:
        s = self.state
        wait = JobResponse(s.seed, s.step, WAIT)
        if self.finished.is_set():
            return wait
        now = self.clock()
        if s.pending:
            chunk = s.pending.popleft()
        else:
            timeout = self.config.coordinator.straggler_timeout_s
            chunk = next((c for c, t in s.in_progress.items() if now - t >= timeout), None)
            if chunk is None:
                return wait
            log.info("re-assigning chunk %d after %.1f s", chunk, now - s.in_progress.pop(chunk))
        s.in_progress[chunk] = now  # (re)inserted last: the dict stays oldest first
        return JobResponse(s.seed, s.step, chunk * self.chunk_size)

    def _on_result(self, res: Result, peer: str):
        chunk, fitness = self._validate_result(res)
        s = self.state
        if res.last_step != s.step:
            log.info("ignoring a RESULT for step %d from %s (now at step %d)",
                     res.last_step, peer, s.step)
            return
        if res.seed != s.seed:
            raise ProtocolError(f"RESULT for step {s.step} carries seed {res.seed}, expected "
                                f"{s.seed}")
        s.transmissions += 1  # duplicates count, as in the reference's statistics
        s.updates_total += res.updates_count
        s.updates_min = res.updates_count if s.updates_min is None else min(s.updates_min,
                                                                            res.updates_count)
        s.updates_max = max(s.updates_max, res.updates_count)
        s.in_progress.pop(chunk, None)
        if chunk in s.done:
            log.info("ignoring a duplicate RESULT for chunk %d from %s", chunk, peer)
            return
        if chunk in s.pending:
            s.pending.remove(chunk)
        s.done.add(chunk)
        s.sum_loss += res.sum_loss
        first = chunk * self.chunk_pairs
        s.fitness[first:first + self.chunk_pairs] = fitness
        if s.complete:
            self._finish_step()

    def _validate_result(self, res: Result) -> tuple[int, np.ndarray]:
        """(chunk index, fitness) of a well-formed RESULT; ProtocolError otherwise."""
        population = self.config.training.population_size
        if res.data_position % self.chunk_size or res.data_position >= population:
            raise ProtocolError(f"RESULT data_position {res.data_position} is not the start of "
                                f"a chunk (multiples of {self.chunk_size} below {population})")
        if len(res.data) != self.chunk_bytes:
            raise ProtocolError(f"RESULT carries {len(res.data)} bytes of fitness, a chunk "
                                f"packs into {self.chunk_bytes}")
        try:
            fitness = unpack_trits(res.data, self.chunk_pairs)
        except ValueError as e:
            raise ProtocolError(f"RESULT fitness is malformed: {e}") from None
        return res.data_position // self.chunk_size, fitness

    # --- finishing a step --------------------------------------------------------------

    def _finish_step(self):
        s = self.state
        packed = pack_trits(s.fitness)
        self._remember(s.step, packed)
        record = self._metrics(s)
        log.info(format_step_line(record, self._prev_loss))
        self._prev_loss = record["loss"]

        step = s.step + 1
        seed = next_step_seed(s.seed, step)
        if self.save_dir is not None:
            self._on_disk(ckpt.save_checkpoint, self.save_dir, ckpt.Checkpoint(step, seed, packed))
            self._on_disk(ckpt.append_metrics, self.save_dir, record)
        self.state = StepState.fresh(self.config, step, seed, self.clock())
        self._check_finished()

    def _remember(self, step: int, packed: bytes):
        self.history[step] = packed
        while len(self.history) > self.config.coordinator.max_history:
            self.history.popitem(last=False)  # older steps stay on disk

    def _metrics(self, s: StepState) -> dict:
        t, m = self.config.training, self.config.model
        elapsed = max(self.clock() - s.started, 1e-9)
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
        }


def format_step_line(r: dict, prev_loss: float | None = None) -> str:
    """The human summary of a finished step, after the reference's."""
    trend = "" if prev_loss is None else (" v" if r["loss"] < prev_loss else
                                          " ^" if r["loss"] > prev_loss else " =")
    net = (r["bytes_sent"] + r["bytes_received"]) / r["step_time_s"] / 2**20
    return (f"Step {r['step']} | Tokens: {_humanize(r['tokens'], 1000, ['', ' K', ' M', ' B'])}"
            f" | Loss: {r['loss']:.4f}{trend} | Time: {r['step_time_s'] * 1000:.2f} ms"
            f" | Updates: {r['updates_total']} (n={r['transmissions']}, min={r['updates_min']},"
            f" max={r['updates_max']}) | Speed: {r['tokens_per_s']:.2f} tok/s"
            f" | LR: {r['lr']:.3f} | Net: {net:.2f} MB/s"
            f" (Tx: {_humanize(r['bytes_sent'], 1024, [' B', ' KB', ' MB', ' GB'])},"
            f" Rx: {_humanize(r['bytes_received'], 1024, [' B', ' KB', ' MB', ' GB'])})")


def _humanize(n: int, base: int, units: list[str]) -> str:
    for power in range(len(units) - 1, 0, -1):
        if n >= base ** power:
            return f"{n / base ** power:.2f}{units[power]}"
    return f"{n}{units[0]}"


def _fitness_from_disk(dirs: list[Path], step: int, size: int) -> bytes | None:
    """Step `step`'s packed fitness from checkpoint step+1 in the first dir that has it."""
    for directory in dirs:
        path = ckpt.checkpoint_path(directory, step + 1)
        if path.exists():
            try:
                return ckpt.read_checkpoint(path, size).fitness
            except ckpt.CheckpointError as e:
                log.error("cannot serve step %d from disk: %s", step, e)
    return None


def _log_disk_failure(future):
    if not future.cancelled() and future.exception() is not None:
        log.error("disk task failed: %s", future.exception())


def _peer_name(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
