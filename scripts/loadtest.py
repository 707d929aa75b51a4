#!/usr/bin/env python3
"""Load-test the coordinator: how many RESULTs a second it takes from many fake workers.

    python scripts/loadtest.py --connections 200 --seconds 20
    python scripts/loadtest.py --processes 2 --secret --seconds 15
    python scripts/loadtest.py --coordinator-profile /tmp/coord.prof   # cProfile it

It starts a real coordinator (`python -m deggs coordinator --port 0`) as a separate
process on 127.0.0.1, at population 1,048,576 in chunks of 64 (16,384 chunks a step; a
tiny model, which the coordinator never runs), and opens N connections to it from one or
more load processes (--processes splits the connections). Each connection is a fake
worker that does no work: it asks for a job (JOB_REQUEST), answers every chunk at once
with a valid RESULT (the same pre-packed chunk fitness every time) pipelined with its
next JOB_REQUEST in one send, applies catch-up responses (step and seed advance as a real
worker's would), and asks again after --wait-ms when told to WAIT. With --chunk-ms and
--update-ms a fake worker takes that long per chunk and per update, as a GPU worker does:

    python scripts/loadtest.py --population 327680 --chunk 40960 --connections 8 \
        --chunk-ms 192 --update-ms 23 --wait-ms 100 --hello --seconds 20

models the runtime's share of a step on eight GPUs (see docs/PERFORMANCE.md). Without --secret a
connection starts with JOB_REQUEST like the reference worker (or HELLO first with
--hello); with --secret the coordinator gets a random DEGGS_SECRET and every connection
does the HELLO / CHALLENGE / AUTH handshake first, then seals every write it sends and
checks the tag of every record it gets (deggs/runtime/channel.py), as a worker does.

After --warmup seconds it measures over a window of --seconds:

    results_per_s        RESULTs sent (each one counts: a chunk is held by one connection)
    steps_per_s          steps the coordinator finished (lines of its metrics.jsonl)
    requests_per_s       JOB_REQUESTs sent, waits_per_s those answered with WAIT,
                         catchups_per_s catch-up responses (one per connection per step)
    coordinator_cpu_pct  the coordinator process's CPU (utime + stime of /proc/PID/stat,
                         all its threads) as % of one core; coordinator_sys_pct the stime
                         (the kernel's share: socket calls, loopback delivery), and
                         coordinator_us_per_result its CPU time per RESULT
    coordinator_rss_mb   its VmRSS at the end, coordinator_peak_rss_mb its VmHWM
    loadgen_cpu_pct      the load processes' own CPU, % of one core (summed)
    machine_busy_pct     every core's non-idle time (/proc/stat), % of one core (2 cores:
                         at most 200); other_cpu_pct what neither side used (other
                         processes, interrupts): a busy machine makes the numbers low
    step_time_median_s   from the coordinator's metrics: first chunk out to last RESULT in
    seal_ms_median       the pause between a step's last RESULT and the next step's first
                         chunk (packing, metrics and checkpoint written and fsynced)

and prints exactly one JSON line on stdout; progress goes to stderr. It exits non-zero
with a one-line error when the coordinator does not start, dies, or closes connections.
Everything talks to 127.0.0.1 only and stops by itself after warmup + seconds; the
coordinator is stopped (SIGTERM, then SIGKILL) and temporary files removed in every case,
Ctrl-C included. With --coordinator-profile the coordinator runs under cProfile (main
thread only; the disk thread is not profiled) and the profile is written when it stops.
"""

from __future__ import annotations

import argparse
import ctypes
import heapq
import json
import multiprocessing
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deggs.config import Config  # noqa: E402
from deggs.runtime import auth  # noqa: E402
from deggs.runtime.channel import SEALED, TAG_SIZE, Channel  # noqa: E402
from deggs.runtime.protocol import (  # noqa: E402
    CHALLENGE,
    GOODBYE,
    HELLO_REPLY,
    JOB_RESPONSE,  # noqa: E402
    LOG_MESSAGE,
    OPCODE_NAMES,
    WAIT,
    Auth,
    Challenge,
    Goodbye,
    Hello,
    HelloReply,
    JobRequest,
    ProtocolError,
    Result,
)
from deggs.seeds import next_step_seed  # noqa: E402
from deggs.ternary import pack_trits, packed_size  # noqa: E402

HOST = "127.0.0.1"
_HEADER = struct.Struct(">4sBBI")
_RESPONSE = struct.Struct(">QQQI")  # JOB_RESPONSE's fixed fields
_SEED_STEP_POS = struct.Struct(">QQQ")  # the first fields of RESULT and JOB_REQUEST
_RESPONSE_FRAME = 10 + _RESPONSE.size  # a JOB_RESPONSE without data: a chunk or a WAIT
_RESPONSE_PREFIX = b"JOBS\x01" + bytes([JOB_RESPONSE])
ANY_FRAME = dict.fromkeys(OPCODE_NAMES, 1 << 24)  # what a fake worker accepts
RECV_SIZE = 1 << 16  # 256 KiB would cost an mmap + munmap per recv (glibc)
CLOSE_TIMEOUT_S = 10.0  # SIGTERM -> SIGKILL


class LoadError(Exception):
    """Ends the load test with a one-line error."""


class CoordinatorDied(LoadError):
    """The coordinator process exited; the message has its last lines."""


def log(text: str):
    print(f"[loadtest] {text}", file=sys.stderr, flush=True)


# --- the coordinator process ---------------------------------------------------------


def config_text(population: int, chunk: int, max_connections: int) -> str:
    """The load test's config: the smallest model, the coordinator on HOST."""
    return f"""\
[model]
hidden_dim = 32
head_dim = 32
n_layers = 1
seq_len = 8
vocab_size = 256

[training]
population_size = {population}
chunk_size = {chunk}

[coordinator]
host = "{HOST}"
max_connections = {max_connections}
"""


def write_config(path: Path, population: int, chunk: int, connections: int):
    path.write_text(config_text(population, chunk, max(1024, connections + 64)))


def _die_with_parent():
    """Runs in the coordinator child before exec: SIGKILL it if the load test dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class CoordinatorProcess:
    def __init__(
        self,
        config_path: Path,
        save_dir: Path,
        workdir: Path,
        secret: str | None,
        profile: str | None,
    ):
        self.log_path = workdir / "coordinator.log"
        env = {
            k: v for k, v in os.environ.items() if k not in (auth.SECRET_ENV, auth.SECRET_FILE_ENV)
        }
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if secret is not None:
            env[auth.SECRET_ENV] = secret
        prefix = ["-m", "cProfile", "-o", str(Path(profile).resolve())] if profile else []
        cmd = [
            sys.executable,
            *prefix,
            "-m",
            "deggs",
            "coordinator",
            "--config",
            str(config_path),
            "--host",
            HOST,
            "--port",
            "0",
            "--save-dir",
            str(save_dir),
        ]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.pid = self.proc.pid

    def wait_listening(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        pattern = re.compile(rb"listening on 127\.0\.0\.1:(\d+)")
        while time.monotonic() < deadline:
            found = pattern.search(self.log_path.read_bytes())
            if found:
                return int(found.group(1))
            if self.proc.poll() is not None:
                raise CoordinatorDied(
                    f"the coordinator exited with code "
                    f"{self.proc.returncode} before listening: {self.tail()}"
                )
            time.sleep(0.05)
        raise LoadError(f"the coordinator did not listen within {timeout:g} s: {self.tail()}")

    def tail(self, lines: int = 3) -> str:
        try:
            text = [
                line
                for line in self.log_path.read_text(errors="replace").splitlines()
                if line.strip()
            ]
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(no output)"

    def check_alive(self):
        if self.proc.poll() is not None:
            raise CoordinatorDied(
                f"the coordinator died (exit code {self.proc.returncode}): {self.tail()}"
            )

    def sample(self) -> dict:
        """CPU seconds (all threads), current and peak RSS in MB."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
        hz = os.sysconf("SC_CLK_TCK")
        mem = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    mem[key] = int(value.split()[0]) / 1024  # kB -> MB
        return {
            "cpu_s": (utime + stime) / hz,
            "sys_s": stime / hz,
            "rss_mb": mem.get("VmRSS", 0.0),
            "peak_rss_mb": mem.get("VmHWM", 0.0),
        }

    def stop(self):
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log(f"the coordinator ignored SIGTERM for {CLOSE_TIMEOUT_S:g} s: SIGKILL")
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all cores together, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already in user
    return total - idle, total


def metrics_lines(save_dir: Path) -> list[dict]:
    try:
        raw = (save_dir / "metrics.jsonl").read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in raw.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


# --- the fake workers ----------------------------------------------------------------


class Conn:
    __slots__ = (
        "sock",
        "fd",
        "send",
        "recv",
        "buf",
        "out",
        "seed",
        "step",
        "position",
        "nonce",
        "ready",
        "channel",
    )

    def __init__(self, sock: socket.socket, seed: int):
        self.sock, self.fd = sock, sock.fileno()
        self.send, self.recv = sock.send, sock.recv
        self.buf = bytearray()
        self.out = b""  # bytes the socket did not take yet
        self.seed, self.step = seed, 0
        self.position = 0  # of the chunk being "scored" (--chunk-ms)
        self.nonce = auth.new_nonce()
        self.ready = False  # past the handshake
        self.channel: Channel | None = None  # with --secret, once AUTH is sent


# counters
RESULTS, REQUESTS, WAITS, CATCHUPS, RX_BYTES = range(5)
COUNTER_NAMES = ("results", "requests", "waits", "catchups", "rx_bytes")


class Load:
    """N fake workers in one process: non-blocking sockets on one epoll, no asyncio."""

    def __init__(self, port: int, n: int, opts: dict):
        self.opts = opts
        self.secret = opts["secret"].encode() if opts["secret"] else None
        self.hello = opts["hello"] or self.secret is not None
        self.fingerprint = bytes.fromhex(opts["fingerprint"])
        self.wait_s = opts["wait_ms"] / 1000
        self.chunk_s = opts["chunk_ms"] / 1000
        self.update_s = opts["update_ms"] / 1000
        self.catchup_bytes = packed_size(opts["population"] // 2)
        self.counts = [0] * len(COUNTER_NAMES)
        # (due, n, send, conn): a request after a WAIT or an update, a RESULT after a chunk
        self.waiting: list = []
        self._n = 0  # breaks ties between equal due times
        self.ep = select.epoll()
        self.conns: dict[int, Conn] = {}
        rng = np.random.default_rng(12345)
        packed = pack_trits(rng.integers(-1, 2, opts["chunk"] // 2))
        result = Result(0, 0, 0, 0, -123456, packed).encode()
        request = JobRequest(0, 0, 0).encode()
        self.pair = bytearray(result + request)  # RESULT + next JOB_REQUEST, one send
        self.request_at = len(result) + 10
        self.request = bytearray(request)
        deadline = time.monotonic() + 30
        try:
            for _ in range(n):
                sock = socket.create_connection(
                    (HOST, port), timeout=max(0.1, deadline - time.monotonic())
                )
                conn = Conn(sock, opts["seed"])
                self.conns[conn.fd] = conn
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setblocking(False)
                self.ep.register(conn.fd, select.EPOLLIN)
        except BaseException:
            self.close()
            raise

    def close(self):
        for conn in self.conns.values():
            try:
                conn.sock.close()
            except OSError:
                pass
        self.conns.clear()
        self.ep.close()

    # --- sending -------------------------------------------------------------------

    def _send(self, c: Conn, data):
        if c.channel is not None:
            data = c.channel.seal(bytes(data))
        if c.out:
            c.out += bytes(data)
            return
        try:
            n = c.send(data)
        except BlockingIOError:
            n = 0
        except OSError as e:
            raise LoadError(f"send to the coordinator failed: {e}") from None
        if n < len(data):
            c.out = bytes(data[n:])
            self.ep.modify(c.fd, select.EPOLLIN | select.EPOLLOUT)

    def _flush(self, c: Conn):
        try:
            n = c.send(c.out)
        except BlockingIOError:
            return
        except OSError as e:
            raise LoadError(f"send to the coordinator failed: {e}") from None
        c.out = c.out[n:]
        if not c.out:
            self.ep.modify(c.fd, select.EPOLLIN)

    def _request(self, c: Conn):
        _SEED_STEP_POS.pack_into(self.request, 10, c.seed, c.step, 0)
        self.counts[REQUESTS] += 1
        self._send(c, self.request)

    def start(self):
        for c in self.conns.values():
            if self.hello:
                hello = Hello(self.fingerprint, "", c.nonce).encode()
                if self.secret is None:  # as a deggs worker: JOB_REQUEST right behind it
                    _SEED_STEP_POS.pack_into(self.request, 10, c.seed, c.step, 0)
                    self.counts[REQUESTS] += 1
                    hello += bytes(self.request)
                self._send(c, hello)
            else:
                c.ready = True
                self._request(c)

    # --- receiving -----------------------------------------------------------------

    def _frames(self, c: Conn):
        """Whole frames in c.buf (the slow path: catch-ups, handshakes, anything split)."""
        buf = c.buf
        while c.channel is None and len(buf) >= 10:
            magic, version, opcode, length = _HEADER.unpack_from(buf)
            if magic != b"JOBS" or version != 1:
                raise LoadError(f"bad frame header from the coordinator: {bytes(buf[:10])!r}")
            end = 10 + length
            if len(buf) < end:
                return
            payload = bytes(buf[10:end])
            del buf[:end]
            self._frame(c, opcode, payload)
        if c.channel is not None and buf:  # records: frames once their tag is checked
            frames = c.channel.feed(bytes(buf))
            buf.clear()
            for opcode, payload in frames:
                self._frame(c, opcode, payload)

    def _frame(self, c: Conn, opcode: int, payload: bytes):
        if opcode == JOB_RESPONSE:
            seed, step, position, size = _RESPONSE.unpack_from(payload)
            if len(payload) - _RESPONSE.size != size:
                raise LoadError(
                    f"JOB_RESPONSE announces {size} bytes, carries {len(payload) - _RESPONSE.size}"
                )
            self._response(c, seed, step, position, size)
        elif opcode == CHALLENGE and self.secret is not None and not c.ready:
            ch = Challenge.decode(payload)
            if not auth.verify(self.secret, "coordinator", c.nonce, ch.nonce, ch.proof):
                raise LoadError("the coordinator's proof of the secret is wrong")
            self._send(c, Auth(auth.proof(self.secret, "worker", c.nonce, ch.nonce)).encode())
            c.channel = Channel.for_worker(self.secret, c.nonce, ch.nonce, ANY_FRAME)
        elif opcode == HELLO_REPLY and self.hello and not c.ready:
            reply = HelloReply.decode(payload)
            if reply.fingerprint != self.fingerprint:
                raise LoadError("HELLO_REPLY with another config fingerprint")
            c.ready = True
            if self.secret is not None:
                self._request(c)
        elif opcode == GOODBYE:
            bye = Goodbye.decode(payload)
            raise LoadError(f"the coordinator said GOODBYE ({bye.reason.name}): {bye.text}")
        elif opcode != LOG_MESSAGE:
            raise LoadError(f"unexpected opcode {opcode} from the coordinator")

    def _later(self, seconds: float, send, c: Conn):
        if seconds <= 0:
            send(c)
            return
        self._n += 1
        heapq.heappush(self.waiting, (time.monotonic() + seconds, self._n, send, c))

    def _response(self, c: Conn, seed: int, step: int, position: int, size: int):
        counts = self.counts
        if size:  # catch-up: the fitness of step `step - 1`
            if size != self.catchup_bytes or step != c.step + 1:
                raise LoadError(f"catch-up to step {step} of {size} bytes at step {c.step}")
            c.step = step
            c.seed = next_step_seed(c.seed, step)
            counts[CATCHUPS] += 1
            self._later(self.update_s, self._request, c)
        elif position == WAIT:
            counts[WAITS] += 1
            self._later(self.wait_s, self._request, c)
        else:
            if step != c.step or seed != c.seed:
                raise LoadError(
                    f"chunk of step {step} (seed {seed}) for a worker at step "
                    f"{c.step} (seed {c.seed})"
                )
            c.position = position
            self._later(self.chunk_s, self._result, c)

    def _result(self, c: Conn):
        """The chunk's RESULT and the next JOB_REQUEST, in one send."""
        pair = self.pair
        _SEED_STEP_POS.pack_into(pair, 10, c.seed, c.step, c.position)
        _SEED_STEP_POS.pack_into(pair, self.request_at, c.seed, c.step, 0)
        self.counts[RESULTS] += 1
        self.counts[REQUESTS] += 1
        self._send(c, pair)

    def _lost(self, c: Conn, why: str):
        if c.buf:
            try:
                self._frames(c)  # a GOODBYE says why
            except (LoadError, ProtocolError) as e:
                raise LoadError(str(e)) from None
        raise LoadError(f"the coordinator closed a connection ({why})")

    # --- the loop ------------------------------------------------------------------

    def run(self, marks: list[float], on_mark=None) -> list[dict]:
        """Drive the connections until the last mark; a snapshot at every mark."""
        snapshots = []
        counts, conns, waiting, ep = self.counts, self.conns, self.waiting, self.ep
        response = self._response
        unpack = _RESPONSE.unpack_from
        prefix, frame_size = _RESPONSE_PREFIX, _RESPONSE_FRAME
        if self.secret is not None:  # each reply a record of its own: marked and tagged
            prefix, frame_size = prefix[:5] + bytes([JOB_RESPONSE | SEALED]), frame_size + TAG_SIZE
        EPOLLIN, EPOLLOUT = select.EPOLLIN, select.EPOLLOUT
        clock = time.monotonic
        self.start()
        for mark in marks:
            while True:
                now = clock()
                while waiting and waiting[0][0] <= now:
                    _, _, send, c = heapq.heappop(waiting)
                    send(c)
                if now >= mark:
                    break
                timeout = mark - now
                if waiting:
                    timeout = min(timeout, waiting[0][0] - now)
                for fd, ev in ep.poll(min(timeout, 0.1)):
                    c = conns[fd]
                    if ev & EPOLLOUT:
                        self._flush(c)
                    if not ev & EPOLLIN:
                        if ev & (select.EPOLLERR | select.EPOLLHUP):
                            self._lost(c, "error")
                        continue
                    try:
                        data = c.recv(RECV_SIZE)
                    except BlockingIOError:
                        continue
                    except OSError as e:
                        self._lost(c, str(e))
                    if not data:
                        self._lost(c, "end of stream")
                    counts[RX_BYTES] += len(data)
                    if not c.buf and len(data) == frame_size and data.startswith(prefix):
                        if c.channel is not None:  # raises ProtocolError on a bad tag
                            c.channel.feed(data)
                        response(c, *unpack(data, 10))  # the common case: a chunk, a WAIT
                    else:
                        c.buf += data
                        self._frames(c)
            times = os.times()
            snapshots.append(
                {
                    "t": clock(),
                    "cpu_s": times.user + times.system,
                    "counts": list(counts),
                    "max_step": max((c.step for c in conns.values()), default=0),
                    "ready": sum(c.ready for c in conns.values()),
                }
            )
            if on_mark is not None:
                on_mark(len(snapshots) - 1)
        return snapshots


def child_main(index: int, port: int, n: int, opts: dict, pipe):
    """A load process of --processes > 1: connect, report ready, run on 'go' marks."""
    load = None
    try:
        load = Load(port, n, opts)
        pipe.send(("ready", index))
        if not pipe.poll(60):
            return
        marks = pipe.recv()
        pipe.send(("done", load.run(marks)))
    except KeyboardInterrupt:
        pass
    except (LoadError, ProtocolError, OSError) as e:
        try:
            pipe.send(("error", f"load process {index}: {e}"))
        except OSError:
            pass
    finally:
        if load is not None:
            load.close()


# --- the measurement -----------------------------------------------------------------


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def measure(args, coord: CoordinatorProcess, port: int, save_dir: Path, opts: dict) -> dict:
    coord_samples, metric_counts = {}, {}

    def on_mark(i):
        coord.check_alive()
        coord_samples[i] = {**coord.sample(), "machine": machine_cpu()}
        metric_counts[i] = metrics_lines(save_dir)

    if args.processes == 1:
        load = Load(port, args.connections, opts)
        try:
            log(
                f"{args.connections} connections open; warm-up {args.warmup:g} s, "
                f"then {args.seconds:g} s measured"
            )
            t0 = time.monotonic() + args.warmup
            snaps = [load.run([t0, t0 + args.seconds], on_mark)]
        finally:
            load.close()
    else:
        ctx = multiprocessing.get_context("fork")
        procs, pipes = [], []
        try:
            for i, n in enumerate(split(args.connections, args.processes)):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=child_main, args=(i, port, n, opts, theirs), daemon=True)
                p.start()
                procs.append(p)
                pipes.append(ours)
            for pipe in pipes:
                if not pipe.poll(60):
                    raise LoadError("a load process did not connect within 60 s")
                kind, detail = pipe.recv()
                if kind != "ready":
                    raise LoadError(detail)
            log(
                f"{args.connections} connections open in {args.processes} processes; warm-up "
                f"{args.warmup:g} s, then {args.seconds:g} s measured"
            )
            t0 = time.monotonic() + args.warmup
            marks = [t0, t0 + args.seconds]
            for pipe in pipes:
                pipe.send(marks)
            for i, mark in enumerate(marks):
                while time.monotonic() < mark:
                    coord.check_alive()
                    time.sleep(min(0.2, max(0.0, mark - time.monotonic())))
                on_mark(i)
            snaps = []
            for pipe in pipes:
                if not pipe.poll(30):
                    raise LoadError("a load process did not report within 30 s of the end")
                kind, detail = pipe.recv()
                if kind != "done":
                    raise LoadError(detail)
                snaps.append(detail)
        finally:
            for p in procs:
                p.join(1)
                if p.is_alive():
                    p.terminate()
                    p.join(2)
                if p.is_alive():
                    p.kill()
                    p.join()

    window = max(s[1]["t"] - s[0]["t"] for s in snaps)
    delta = [
        sum(s[1]["counts"][k] - s[0]["counts"][k] for s in snaps) for k in range(len(COUNTER_NAMES))
    ]
    loadgen_cpu = sum(s[1]["cpu_s"] - s[0]["cpu_s"] for s in snaps)
    c0, c1 = coord_samples[0], coord_samples[1]
    records = metric_counts[1][len(metric_counts[0]) :]
    steps = len(records)
    n_chunks = args.population // args.chunk
    short = [r["step"] for r in records if r.get("transmissions") != n_chunks]
    if short:
        log(f"steps {short} did not count exactly {n_chunks} RESULTs")
    step_times = sorted(r["step_time_s"] for r in records)
    # A record is written when a step's last RESULT is in; its step_time_s runs from the
    # end of the step before's sealing. So the gap between two records, less the later
    # one's step_time_s, is the sealing (pack, fsync, rename) during which all wait.
    seals = sorted(
        b["time"] - a["time"] - b["step_time_s"]
        for a, b in zip(records, records[1:], strict=False)
        if b["step"] == a["step"] + 1
    )
    busy = c1["machine"][0] - c0["machine"][0]
    jiffies = c1["machine"][1] - c0["machine"][1]
    machine_busy = 100 * (os.cpu_count() or 1) * busy / max(jiffies, 1)
    coordinator_cpu = 100 * (c1["cpu_s"] - c0["cpu_s"]) / window
    rate = lambda k: round(delta[k] / window, 1)  # noqa: E731
    return {
        "results_per_s": rate(RESULTS),
        "steps_per_s": round(steps / window, 3),
        "steps_per_s_from_results": round(delta[RESULTS] / n_chunks / window, 3),
        "requests_per_s": rate(REQUESTS),
        "waits_per_s": rate(WAITS),
        "catchups_per_s": rate(CATCHUPS),
        "rx_mb_per_s": round(delta[RX_BYTES] / window / 2**20, 2),
        "connections": args.connections,
        "ready_connections": sum(s[1]["ready"] for s in snaps),  # past the handshake
        "processes": args.processes,
        "population": args.population,
        "chunk": args.chunk,
        "chunks_per_step": n_chunks,
        "seconds": round(window, 3),
        "warmup_s": args.warmup,
        "steps_in_window": steps,
        "step_time_median_s": (round(step_times[len(step_times) // 2], 4) if step_times else None),
        "coordinator_cpu_pct": round(coordinator_cpu, 1),
        "coordinator_sys_pct": round(100 * (c1["sys_s"] - c0["sys_s"]) / window, 1),
        "coordinator_us_per_result": (
            round(coordinator_cpu * 1e4 * window / delta[RESULTS], 1) if delta[RESULTS] else None
        ),
        "coordinator_rss_mb": round(c1["rss_mb"], 1),
        "coordinator_peak_rss_mb": round(c1["peak_rss_mb"], 1),
        "loadgen_cpu_pct": round(100 * loadgen_cpu / window, 1),
        "machine_busy_pct": round(machine_busy, 1),
        "other_cpu_pct": round(machine_busy - coordinator_cpu - 100 * loadgen_cpu / window, 1),
        "seal_ms_median": round(1000 * seals[len(seals) // 2], 1) if seals else None,
        "secret": bool(args.secret),
        "hello": bool(args.hello or args.secret),
        "wait_ms": args.wait_ms,
        "chunk_ms": args.chunk_ms,
        "update_ms": args.update_ms,
        "profiled": bool(args.coordinator_profile),
        "cpus": os.cpu_count(),
    }


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--population", type=int, default=1 << 20, help="training.population_size")
    p.add_argument("--chunk", type=int, default=64, help="training.chunk_size")
    p.add_argument("--connections", type=int, default=200, help="fake workers")
    p.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before the window")
    p.add_argument(
        "--processes", type=int, default=1, help="load processes, the connections split among them"
    )
    p.add_argument("--wait-ms", type=float, default=5.0, help="pause after a WAIT")
    p.add_argument("--chunk-ms", type=float, default=0.0, help="a fake worker's time per chunk")
    p.add_argument("--update-ms", type=float, default=0.0, help="its time per update")
    p.add_argument(
        "--secret",
        action="store_true",
        help="give the coordinator a random DEGGS_SECRET; workers prove it",
    )
    p.add_argument("--hello", action="store_true", help="send HELLO first without a secret too")
    p.add_argument(
        "--save-dir",
        help="the coordinator's save dir (default: a temporary one, removed afterwards)",
    )
    p.add_argument(
        "--coordinator-profile",
        metavar="FILE",
        help="run the coordinator under cProfile, writing FILE when it stops",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=60.0,
        help="seconds the coordinator may take to listen",
    )
    args = p.parse_args(argv)
    for name in ("population", "chunk", "connections", "processes"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.processes > args.connections:
        p.error("--processes must not exceed --connections")
    if args.seconds <= 0 or min(args.warmup, args.wait_ms, args.chunk_ms, args.update_ms) < 0:
        p.error("--seconds must be positive; --warmup and the --*-ms not negative")
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        config = Config.from_dict(
            {
                "model": {
                    "hidden_dim": 32,
                    "head_dim": 32,
                    "n_layers": 1,
                    "seq_len": 8,
                    "vocab_size": 256,
                },
                "training": {"population_size": args.population, "chunk_size": args.chunk},
            }
        )
    except ValueError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="deggs-loadtest-"))
    save_dir = Path(args.save_dir) if args.save_dir else workdir / "save"
    secret = auth.new_nonce().hex() if args.secret else None
    opts = {
        "secret": secret,
        "hello": args.hello,
        "fingerprint": config.fingerprint().hex(),
        "seed": config.training.seed,
        "wait_ms": args.wait_ms,
        "chunk_ms": args.chunk_ms,
        "update_ms": args.update_ms,
        "population": args.population,
        "chunk": args.chunk,
    }
    coord = None
    try:
        config_path = workdir / "loadtest.toml"
        write_config(config_path, args.population, args.chunk, args.connections)
        coord = CoordinatorProcess(config_path, save_dir, workdir, secret, args.coordinator_profile)
        port = coord.wait_listening(args.start_timeout)
        log(
            f"coordinator pid {coord.pid} listening on {HOST}:{port}: population "
            f"{args.population} in {args.population // args.chunk} chunks of {args.chunk}"
        )
        result = measure(args, coord, port, save_dir, opts)
        coord.check_alive()
    except (LoadError, ProtocolError, OSError) as e:
        if not isinstance(e, CoordinatorDied) and coord is not None:
            try:  # a lost connection: did the coordinator die? (it may still be exiting)
                coord.proc.wait(0.5)
                e = f"the coordinator died (exit code {coord.proc.returncode}): {coord.tail()}"
            except subprocess.TimeoutExpired:
                pass
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("loadtest: error: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        try:
            if coord is not None:
                coord.stop()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            signal.signal(signal.SIGINT, signal.default_int_handler)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
