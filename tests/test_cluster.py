"""Real processes over loopback: a coordinator and CPU workers training a tiny model.

However the chunks are spread (one worker, two, a worker killed mid-chunk, a worker that
joins late, a coordinator restarted from its save dir), every step's loss must be the
same: the math may not depend on who computed what.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = """
[model]
hidden_dim = 32
head_dim = 32
n_layers = 1
seq_len = 8
vocab_size = 256

[training]
population_size = 64
chunk_size = 16

[coordinator]
straggler_timeout_s = 2
"""
STEPS = 6
TIMEOUT_S = 120
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def deggs(*args, log=None, **kwargs):
    """A deggs command in the background; its output goes to a pipe, or to a log file."""
    out = open(log, "w") if log else subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-m", "deggs", *map(str, args)], env=ENV,
                            stdout=out, stderr=subprocess.STDOUT, text=True, **kwargs)
    proc.log = log
    return proc


def log_of(proc) -> str:
    return Path(proc.log).read_text()


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.config = root / "tiny.toml"
        self.config.write_text(TINY)
        self.data = root / "data"
        subprocess.run([sys.executable, "-m", "deggs", "prepare", "--vocab-size", "256",
                        "--out", self.data], check=True, env=ENV, capture_output=True)
        self.procs = []

    def coordinator(self, save_dir, max_steps, load_dir=None):
        args = ["coordinator", "--config", self.config, "--host", "127.0.0.1", "--port", 0,
                "--save-dir", save_dir, "--max-steps", max_steps]
        if load_dir:
            args += ["--load-dir", load_dir]
        proc = deggs(*args)
        self.procs.append(proc)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"listening on [\d.]+:(\d+)", line)
            if match:
                proc.port = int(match.group(1))
                return proc
        raise AssertionError("coordinator did not start:\n" + "".join(lines))

    def worker(self, port, with_config=True):
        args = ["worker", "127.0.0.1", "--port", port, "--data-dir", self.data, "--threads", 1]
        if with_config:
            args += ["--config", self.config]
        proc = deggs(*args, cwd=self.root, log=self.root / f"worker{len(self.procs)}.log")
        self.procs.append(proc)
        return proc

    def finish(self, coordinator):
        out, _ = coordinator.communicate(timeout=TIMEOUT_S)
        assert coordinator.returncode == 0, out
        return out

    def stop_all(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def losses(save_dir):
    lines = (Path(save_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["sum_loss"] for r in map(json.loads, lines)}


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop_all()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Per-step sum_loss of a one-worker run."""
    c = Cluster(tmp_path_factory.mktemp("baseline"))
    try:
        coord = c.coordinator(c.root / "save", STEPS)
        c.worker(coord.port)
        c.finish(coord)
        result = losses(c.root / "save")
    finally:
        c.stop_all()
    assert sorted(result) == list(range(STEPS))
    assert result[STEPS - 1] < result[0], "the tiny model should learn a little"
    return result


def test_two_workers_give_the_one_worker_losses(cluster, baseline):
    coord = cluster.coordinator(cluster.root / "save", STEPS)
    a = cluster.worker(coord.port)
    b = cluster.worker(coord.port, with_config=False)  # adopts the coordinator's config
    out = cluster.finish(coord)
    assert losses(cluster.root / "save") == baseline
    assert "GENERATION" in out
    cluster.stop_all()
    logs = log_of(a) + log_of(b)
    assert "using the coordinator's config" in logs


def test_killed_and_late_workers_give_the_same_losses(cluster, baseline):
    coord = cluster.coordinator(cluster.root / "save", STEPS)
    # a process that takes a chunk and is killed before it answers
    grabber = subprocess.Popen([sys.executable, "-c", GRAB_A_CHUNK, str(coord.port)], env=ENV,
                               stdout=subprocess.PIPE, text=True)
    assert grabber.stdout.readline().startswith("got chunk")
    grabber.kill()
    grabber.wait()
    first = cluster.worker(coord.port)
    # once the run is under way the first worker dies; a new one catches up from the
    # history and finishes the run alone
    deadline = time.time() + TIMEOUT_S
    while not (cluster.root / "save" / "checkpoint_00000003.bin").exists():
        assert time.time() < deadline and coord.poll() is None
        time.sleep(0.05)
    first.kill()
    late = cluster.worker(coord.port)
    out = cluster.finish(coord)
    assert re.search(r"re-assigning chunk \d+", out, re.I), out
    assert losses(cluster.root / "save") == baseline
    cluster.stop_all()
    late_log = log_of(late)
    assert "updated to step 3" in late_log and " chunk " in late_log, late_log


def test_restart_from_load_dir_keeps_the_losses(cluster, baseline):
    first = cluster.coordinator(cluster.root / "run1", 3)
    cluster.worker(first.port)
    cluster.finish(first)
    second = cluster.coordinator(cluster.root / "run2", STEPS, load_dir=cluster.root / "run1")
    fresh = cluster.worker(second.port)  # starts from scratch: replays steps 0..2 first
    cluster.finish(second)
    merged = {**losses(cluster.root / "run1"), **losses(cluster.root / "run2")}
    assert merged == baseline
    cluster.stop_all()
    assert "updated to step 3" in log_of(fresh)


GRAB_A_CHUNK = """
import socket, sys, time
from deggs import protocol
from deggs.protocol import JobRequest, JobResponse
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
protocol.send_frame(sock, JobRequest(42, 0).encode())
opcode, payload = protocol.recv_frame(sock, 1 << 20)
job = JobResponse.decode(payload)
print("got chunk", job.data_position, flush=True)
time.sleep(600)
"""
