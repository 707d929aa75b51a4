#!/usr/bin/env python3
"""Hold the coordinator's deadlines to account: honest workers beside a flood of bad peers.

    python scripts/flood.py pipeline --attackers 100 --seconds 20
    python scripts/flood.py idle --attackers 1100

Starts a real coordinator (`python -m deggs coordinator --port 0`) as a process on
127.0.0.1 and, in this process, --workers fake honest workers (scripts/loadtest.py's:
HELLO, then each chunk takes --chunk-ms, each update --update-ms). A second process
opens the attackers' connections; every one of them is reopened when the coordinator
closes it, so the pressure never lets up.

pipeline  the attackers send HELLO and then JOB_REQUESTs for the current step (they
          learn it from metrics.jsonl, as a peer that reads would from the coordinator),
          64 to a send, as fast as the socket takes them, and never read a byte. The honest
          workers run --seconds undisturbed, then --seconds beside the attackers; the
          output compares the two windows' median time a step (between the steps'
          metrics records, sealing included) and steps done.
idle      the attackers each send one JOB_REQUEST and then nothing, more of them than
          [coordinator] max_connections (1024) allows. Once they are all in (or refused,
          and retrying), a new worker connects and says HELLO; join_s is the time from
          its first connect to its HELLO_REPLY, over however many refused tries.

Prints one JSON line on stdout (progress on stderr). Loopback only; everything stops by
itself after the windows, and the coordinator and temporary files go in every case.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import select
import shutil
import socket
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import (
    HOST,
    CoordinatorProcess,
    Load,
    LoadError,
    config_text,
    log,
    metrics_lines,
)  # noqa: E402

from deggs.config import Config  # noqa: E402
from deggs.runtime.protocol import (  # noqa: E402
    HELLO_REPLY,
    JOB_RESPONSE,
    FrameReader,
    Hello,
    JobRequest,
    limits_from_coordinator,
)
from deggs.seeds import next_step_seed  # noqa: E402

MAX_CONNECTIONS = 1024
JOIN_TIMEOUT_S = 60.0


# --- the attackers, in a process of their own ----------------------------------------


def attack(port: int, mode: str, n: int, hello: bytes, seed0: int, save_dir, stop, counts):
    """Keep n attacking connections open until `stop` is set; counts[0] gets the
    connections opened, counts[1] those the coordinator closed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 256)), hard))
    step, seed = 0, seed0
    request = JobRequest(seed, step).encode()
    burst = hello + request * 64
    socks: list[socket.socket | None] = [None] * n
    poller = select.poll()  # tells a close by the coordinator without reading a byte
    index: dict[int, int] = {}  # descriptor -> attacker

    def open_one(i):
        try:
            s = socket.create_connection((HOST, port), timeout=5)
        except OSError:
            return
        s.setblocking(False)
        try:
            s.send(burst if mode == "pipeline" else request)
        except OSError:
            s.close()
            return
        socks[i] = s
        index[s.fileno()] = i
        poller.register(s, select.POLLRDHUP | select.POLLERR | select.POLLHUP)
        counts[0] += 1

    def lost(i):
        s = socks[i]
        if s is not None:
            poller.unregister(s)
            del index[s.fileno()]
            s.close()
            socks[i] = None
            counts[1] += 1

    while not stop.is_set():
        records = metrics_lines(save_dir)
        while records and step <= records[-1]["step"]:  # the step the run is at now
            step += 1
            seed = next_step_seed(seed, step)
        request = JobRequest(seed, step).encode()
        burst = hello + request * 64
        for fd, _ in poller.poll(0):
            lost(index[fd])
        for i, s in enumerate(socks):
            if s is None:
                open_one(i)
            elif mode == "pipeline":
                try:
                    s.send(request * 64)
                except BlockingIOError:
                    pass  # its buffers are full: the coordinator stopped reading it
                except OSError:
                    lost(i)
        time.sleep(0.01 if mode == "pipeline" else 0.05)
    for s in socks:
        if s is not None:
            s.close()


# --- the measurements ----------------------------------------------------------------


def step_times(save_dir: Path, since: float, until: float) -> list[float]:
    """Wall time between consecutive steps' records within the window."""
    times = [r["time"] for r in metrics_lines(save_dir) if since <= r["time"] < until]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def honest_window(port: int, args, opts: dict) -> tuple[float, float]:
    load = Load(port, args.workers, opts)
    try:
        start = time.time()
        t0 = time.monotonic()
        load.run([t0 + args.seconds])
        return start, time.time()
    finally:
        load.close()


def join_time(port: int, config: Config) -> dict:
    """Seconds from a new worker's first connect to its HELLO_REPLY (joined) and to its
    first JOB_RESPONSE (a WAIT, held up to a second, while the attackers hold every
    chunk of the step), and how many connections it took."""
    started, tries = time.monotonic(), 0
    limits = limits_from_coordinator(1 << 20)
    while time.monotonic() - started < JOIN_TIMEOUT_S:
        tries += 1
        try:
            with socket.create_connection((HOST, port), timeout=5) as s:
                hello = Hello(config.fingerprint(), config.to_json()).encode()
                s.sendall(hello + JobRequest(config.training.seed, 0).encode())
                reader, seen = FrameReader(limits), {}
                s.settimeout(5)
                while JOB_RESPONSE not in seen:
                    data = s.recv(1 << 16)
                    if not data:
                        break
                    for opcode, _ in reader.feed(data):
                        seen.setdefault(opcode, round(time.monotonic() - started, 3))
                if HELLO_REPLY in seen and JOB_RESPONSE in seen:
                    return {
                        "join_s": seen[HELLO_REPLY],
                        "first_response_s": seen[JOB_RESPONSE],
                        "tries": tries,
                    }
        except OSError:
            pass
        time.sleep(0.25)  # as a worker backs off, a little
    raise LoadError(f"a new worker did not get in within {JOIN_TIMEOUT_S:g} s ({tries} tries)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["pipeline", "idle"])
    p.add_argument("--attackers", type=int, help="default: 100 (pipeline), 1100 (idle)")
    p.add_argument("--workers", type=int, default=4, help="honest fake workers")
    p.add_argument("--population", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--chunk-ms", type=float, default=50.0)
    p.add_argument("--update-ms", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=15.0, help="each measured window")
    args = p.parse_args(argv)
    attackers = args.attackers or (100 if args.mode == "pipeline" else 1100)
    config = Config.from_dict(
        tomllib.loads(config_text(args.population, args.chunk, MAX_CONNECTIONS))
    )
    opts = {
        "secret": None,
        "hello": True,
        "fingerprint": config.fingerprint().hex(),
        "seed": config.training.seed,
        "wait_ms": 100.0,
        "chunk_ms": args.chunk_ms,
        "update_ms": args.update_ms,
        "population": args.population,
        "chunk": args.chunk,
    }
    workdir = Path(tempfile.mkdtemp(prefix="deggs-flood-"))
    ctx = multiprocessing.get_context("fork")
    stop, counts = ctx.Event(), ctx.Array("l", 2)
    coord = attacker = None
    result: dict = {"mode": args.mode, "attackers": attackers, "workers": args.workers}
    try:
        (workdir / "flood.toml").write_text(
            config_text(args.population, args.chunk, MAX_CONNECTIONS)
        )
        save = workdir / "save"
        coord = CoordinatorProcess(workdir / "flood.toml", save, workdir, None, None)
        port = coord.wait_listening(30)
        hello = Hello(config.fingerprint(), config.to_json()).encode()
        attacker = ctx.Process(
            target=attack,
            args=(port, args.mode, attackers, hello, config.training.seed, save, stop, counts),
            daemon=True,
        )
        if args.mode == "pipeline":
            log(f"{args.workers} honest workers alone for {args.seconds:g} s")
            alone = step_times(save, *honest_window(port, args, opts))
            attacker.start()
            log(f"... and beside {attackers} pipelining non-readers for {args.seconds:g} s")
            time.sleep(1.0)
            beside = step_times(save, *honest_window(port, args, opts))
            coord.check_alive()
            # No two steps in the window: a step took at least the whole window.
            undisturbed = statistics.median(alone) if alone else args.seconds
            disturbed = statistics.median(beside) if beside else args.seconds
            result |= {
                "step_time_undisturbed_s": round(undisturbed, 4),
                "step_time_disturbed_s": round(disturbed, 4),
                "ratio": round(disturbed / undisturbed, 3),
                "steps": [len(alone), len(beside)],
            }
        else:
            attacker.start()
            log(f"{attackers} connections that send one JOB_REQUEST, then idle")
            deadline = time.monotonic() + 60
            while counts[0] < attackers and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # all of them in, or refused and retrying
            coord.check_alive()
            result |= join_time(port, config)
        result |= {"attacker_connections": counts[0], "closed_by_coordinator": counts[1]}
    except (LoadError, OSError) as e:
        print(f"flood: error: {e}", file=sys.stderr)
        return 1
    finally:
        stop.set()
        if attacker is not None and attacker.pid is not None:
            attacker.join(10)
            if attacker.is_alive():
                attacker.kill()
        if coord is not None:
            coord.stop()
            log(f"coordinator log: {coord.tail(2)}")
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
