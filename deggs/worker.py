"""The worker: asks the coordinator for chunks, scores them, applies every step's update.

Its loop, as the reference worker's:

    HELLO (our handshake), then repeatedly JOB_REQUEST(step, seed)
      <- JOB_RESPONSE with fitness data: the update of our step; apply it, step += 1
      <- JOB_RESPONSE "wait": sleep a little, ask again
      <- JOB_RESPONSE with a chunk: losses of its members -> fitness -> RESULT

The model lives on the worker, not on the wire: a worker that falls behind catches up
one step per request from the coordinator's fitness history. When the coordinator goes
away the worker keeps its model and reconnects with backoff.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np

from . import protocol
from .config import Config, ConfigError
from .data import detokenize, load_decoding, load_tokens
from .fitness import chunk_fitness
from .noise import next_step_seed
from .protocol import Hello, HelloReply, JobRequest, JobResponse, LogMessage, ProtocolError, Result
from .sampling import prompt_window
from .ternary import pack_trits, packed_size, unpack_trits

WAIT_S = 0.1            # the reference worker's pause after a WAIT
BACKOFF_S = (0.5, 10.0)  # first and longest pause between reconnects
REPLY_TIMEOUT_S = 300.0  # a coordinator silent this long is taken as gone


class WorkerError(Exception):
    """A problem that retrying cannot fix (bad data, a config the coordinator refuses)."""


class StopWorker(Exception):
    """Raised from a signal handler to end the worker cleanly."""


def make_backend(cfg: Config, name: str, threads: int | None = None):
    """The compute backend by name: 'auto' is the GPU where CuPy sees one, else the CPU."""
    from .backend import CpuBackend
    if name in ("auto", "gpu"):
        from .gpu import GpuBackend, gpu_available
        if gpu_available():
            try:
                return GpuBackend(cfg)
            except ValueError as e:  # a shape its kernels do not support
                raise WorkerError(f"{e}; use --backend cpu") from None
        if name == "gpu":
            raise WorkerError("backend 'gpu' needs CuPy and a CUDA device")
    if name in ("auto", "cpu"):
        return CpuBackend(cfg, threads)
    raise WorkerError(f"unknown backend {name!r} (available: auto, cpu, gpu)")


class Worker:
    def __init__(self, host: str, port: int, cfg: Config | None, data_dir: str | Path = ".",
                 backend: str = "auto", threads: int | None = None, log=print):
        self.host, self.port = host, port
        self.cfg = cfg
        self.data_dir = Path(data_dir)
        self.backend_name, self.threads = backend, threads
        self.log = log
        self.engine = None          # built once the config is known
        self.tokens = None
        self.pieces = None
        self.step = 0
        self.seed = cfg.training.seed if cfg else None
        self.last_updates = 0
        self.chunks_done = 0
        if cfg is not None:
            self._prepare(cfg)

    # --- setup -------------------------------------------------------------------------

    def _prepare(self, cfg: Config):
        """Load and check the data for a config, and build the backend."""
        self.tokens = load_tokens(self.data_dir / "input.bin", cfg)
        decoding = self.data_dir / "decoding.bin"
        if not cfg.model.byte_tokens:
            if decoding.exists():
                self.pieces = load_decoding(decoding)
            else:
                self.log(f"[worker] {decoding} not found: generations will show token ids")
        self.cfg = cfg
        self.seed = cfg.training.seed
        self.engine = make_backend(cfg, self.backend_name, self.threads)
        self.log(f"[worker] {len(self.tokens)} tokens, backend {self.engine.name}, "
                 f"config {cfg.fingerprint().hex()}")

    def _adopt(self, reply: HelloReply):
        if not reply.accepted:
            raise WorkerError(f"coordinator refused this worker: {reply.message}")
        try:
            theirs = Config.from_json(reply.config_json)
        except ConfigError as e:
            raise WorkerError(f"coordinator sent a config we cannot use: {e}") from None
        if self.cfg is None:
            self.log("[worker] using the coordinator's config")
            self._prepare(theirs)
        elif theirs.fingerprint() != self.cfg.fingerprint():
            diff = "; ".join(self.cfg.differences(theirs))
            raise WorkerError(f"coordinator's config differs from ours: {diff}")

    # --- the loop ----------------------------------------------------------------------

    def run(self, max_steps: int | None = None):
        """Serve until stopped (StopWorker), or until the model reaches max_steps."""
        backoff = BACKOFF_S[0]
        while max_steps is None or self.step < max_steps:
            try:
                with socket.create_connection((self.host, self.port), timeout=10) as sock:
                    sock.settimeout(REPLY_TIMEOUT_S)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.log(f"[worker] connected to {self.host}:{self.port}")
                    backoff = BACKOFF_S[0]
                    self._serve(sock, max_steps)
                    return
            except (OSError, ProtocolError) as e:
                self.log(f"[worker] connection to {self.host}:{self.port} lost: {e}; "
                         f"retrying in {backoff:.1f} s")
            time.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_S[1])

    def _serve(self, sock, max_steps):
        fingerprint = self.cfg.fingerprint() if self.cfg else protocol.NO_FINGERPRINT
        config_json = self.cfg.to_json() if self.cfg else ""
        protocol.send_frame(sock, Hello(fingerprint, config_json).encode())
        if self.cfg is None:  # nothing to ask for until we know the config
            opcode, payload = self._receive(sock)
            if opcode != protocol.HELLO_REPLY:
                raise WorkerError("this coordinator sends no config (a reference coordinator?): "
                                  "pass --config")
            self._adopt(HelloReply.decode(payload))
        while max_steps is None or self.step < max_steps:
            protocol.send_frame(sock, JobRequest(self.seed, self.step).encode())
            response = self._next_job(sock)
            if response.data:
                self._apply_update(response)
            elif response.is_wait:
                time.sleep(WAIT_S)
            else:
                self._run_chunk(sock, response)

    def _receive(self, sock):
        item = protocol.recv_frame(sock, self._max_payload())
        if item is None:
            raise ConnectionError("coordinator closed the connection")
        return item

    def _max_payload(self) -> int:
        pairs = self.cfg.training.n_pairs if self.cfg else 0
        return max(1 << 20, 28 + packed_size(pairs))

    def _next_job(self, sock) -> JobResponse:
        """Read until a JOB_RESPONSE, handling the handshake reply and log lines."""
        while True:
            opcode, payload = self._receive(sock)
            if opcode == protocol.JOB_RESPONSE:
                return JobResponse.decode(payload)
            if opcode == protocol.HELLO_REPLY:
                self._adopt(HelloReply.decode(payload))
            elif opcode == protocol.LOG_MESSAGE:
                self.log(f"[coordinator] {LogMessage.decode(payload).text}")
            else:
                raise ProtocolError(f"unexpected opcode {opcode} from the coordinator")

    # --- the work ----------------------------------------------------------------------

    def _apply_update(self, response: JobResponse):
        cfg = self.cfg
        if response.last_step != self.step + 1:
            raise ProtocolError(f"update for step {response.last_step} while at step {self.step}")
        try:
            fitness = unpack_trits(response.data, cfg.training.n_pairs)
        except ValueError as e:
            raise ProtocolError(f"bad fitness for step {self.step}: {e}") from None
        started = time.perf_counter()
        self.last_updates = self.engine.update(fitness, self.step, self.seed)
        self.step = response.last_step
        self.seed = next_step_seed(self.seed, self.step)
        self.log(f"[worker] updated to step {self.step}: {self.last_updates} weights changed "
                 f"({time.perf_counter() - started:.2f} s)")

    def _run_chunk(self, sock, response: JobResponse):
        cfg = self.cfg
        c = cfg.training.chunk_size
        start = response.data_position
        if start % c or start >= cfg.training.population_size or response.last_step != self.step:
            raise ProtocolError(f"bad job: step {response.last_step}, position {start} "
                                f"(we are at step {self.step})")
        chunk = start // c
        if chunk == 0 and self.step % cfg.sampling.every_steps == 0:
            protocol.send_frame(sock, LogMessage(self.generation_text()).encode())
        started = time.perf_counter()
        losses = self.engine.losses(self.tokens, self.step, self.seed, np.arange(start, start + c))
        result = chunk_fitness(cfg, losses)
        protocol.send_frame(sock, Result(self.seed, self.step, start, self.last_updates,
                                         result.sum_loss, pack_trits(result.fitness)).encode())
        self.last_updates = 0  # counted once, with the first chunk after the update
        self.chunks_done += 1
        seconds = time.perf_counter() - started
        self.log(f"[worker] step {self.step} chunk {chunk}: {seconds:.2f} s, "
                 f"{c * cfg.model.seq_len / seconds:,.0f} member-tokens/s")

    def generation_text(self) -> str:
        cfg = self.cfg
        prompt = prompt_window(cfg, self.tokens, self.step)
        tokens = self.engine.generate(prompt, self.seed + 999)
        n = len(prompt)
        return ("\n--- GENERATION ---\n\033[32m" + detokenize(tokens[:n], cfg, self.pieces)
                + "\033[36m" + detokenize(tokens[n:], cfg, self.pieces) + "\033[0m\n\n")
