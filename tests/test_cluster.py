"""Real processes over loopback: a coordinator and CPU workers training a tiny model.

However the chunks are spread (one worker, two, a worker killed mid-chunk, a worker that
joins late, a coordinator restarted from its save dir, a chaos driver killing and pausing
processes, a disk that fills up), every step's loss must be the same as an undisturbed
run's: the math may not depend on who computed what, or on what failed on the way.
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sync
from tiny import tiny_config, toml_of

from deggs.runtime import checkpoint as ckpt
from deggs.ternary import pack_trits
from golden import golden_config
from golden import tokens as golden_tokens

pytestmark = pytest.mark.slow  # real processes, builds and installs

TINY_CFG = tiny_config(
    training=dict(population_size=64, chunk_size=16),
    coordinator=dict(straggler_timeout_s=2, disk_retry_s=1),
    worker=dict(retry_max_s=0.5),
)
TINY = toml_of(TINY_CFG)
STEPS = 6
CHAOS_STEPS = 20
TIMEOUT_S = 120
SECRET = "a secret only the cluster knows, long enough"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
for _name in ("DEGGS_SECRET", "DEGGS_SECRET_FILE"):
    ENV.pop(_name, None)


def deggs(*args, log, env=None, runner=None, **kwargs):
    """A deggs command in the background, its output going to a log file (runner: the
    command to run it with instead of `python -m deggs`)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*map(str, runner or [sys.executable, "-m", "deggs"]), *map(str, args)],
            env={**ENV, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            **kwargs,
        )
    proc.log = log
    return proc


def log_of(proc) -> str:
    return Path(proc.log).read_text()


def exit_code(proc, timeout=30) -> int:
    """The process's exit code once it ends; a test failure with its log if it does not."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s:\n{log_of(proc)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, what: str, watch=(), timeout=TIMEOUT_S):
    """Poll `condition` until it holds; fail early if a process in `watch` died."""

    def holds():
        if condition():
            return True
        for proc in watch:
            assert proc.poll() is None, f"{what}: a process exited:\n{log_of(proc)}"
        return False

    sync.wait_until(holds, timeout, what, interval=0.02)


class Cluster:
    """Processes of one run: a config file, a data directory, and what was started."""

    def __init__(self, root: Path, config_text: str = TINY, tokens=None):
        self.root = root
        self.config = root / "tiny.toml"
        self.config.write_text(config_text)
        self.data = root / "data"
        if tokens is None:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "deggs",
                    "prepare",
                    "--vocab-size",
                    "256",
                    "--out",
                    self.data,
                ],
                check=True,
                env=ENV,
                capture_output=True,
            )
        else:
            self.data.mkdir()
            tokens.tofile(self.data / "input.bin")
        self.procs = []

    def _log(self, kind):
        return self.root / f"{kind}{len(self.procs)}.log"

    def coordinator(self, save_dir, max_steps, load_dir=None, port=0, env=None):
        args = [
            "coordinator",
            "--config",
            self.config,
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--save-dir",
            save_dir,
            "--max-steps",
            max_steps,
        ]
        if load_dir:
            args += ["--load-dir", load_dir]
        proc = deggs(*args, log=self._log("coordinator"), env=env)
        self.procs.append(proc)

        def listening():
            proc.port_match = re.search(r"listening on [\d.]+:(\d+)", log_of(proc))
            return proc.port_match is not None

        wait_until(listening, "the coordinator to listen", [proc])
        proc.port = int(proc.port_match.group(1))
        return proc

    def worker(self, port, with_config=True, env=None, extra=(), runner=None):
        args = ["worker", "127.0.0.1", "--port", port, "--data-dir", self.data, "--threads", 1]
        if with_config:
            args += ["--config", self.config]
        args += list(extra)
        proc = deggs(*args, cwd=self.root, log=self._log("worker"), env=env, runner=runner)
        self.procs.append(proc)
        return proc

    def run(self, *args) -> subprocess.CompletedProcess:
        """A deggs command run to its end (stdout and stderr together)."""
        return subprocess.run(
            [sys.executable, "-m", "deggs", *map(str, args)],
            env=ENV,
            cwd=self.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
        )

    def finish(self, coordinator, code=0):
        assert coordinator.wait(timeout=TIMEOUT_S) == code, log_of(coordinator)
        return log_of(coordinator)

    def stop_all(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def losses(save_dir):
    return {r["step"]: r["sum_loss"] for r in ckpt.read_metrics(save_dir)}


def checkpoint_exists(save_dir, step):
    return lambda: ckpt.checkpoint_path(save_dir, step).exists()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop_all()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Per-step sum_loss of an undisturbed one-worker run of CHAOS_STEPS steps."""
    c = Cluster(tmp_path_factory.mktemp("baseline"))
    try:
        coord = c.coordinator(c.root / "save", CHAOS_STEPS)
        worker = c.worker(coord.port)
        c.finish(coord)
        assert exit_code(worker) == 0, log_of(worker)  # told the run is finished
        result = losses(c.root / "save")
    finally:
        c.stop_all()
    assert sorted(result) == list(range(CHAOS_STEPS))
    assert result[CHAOS_STEPS - 1] < result[0], "the tiny model should learn a little"
    return result


def first(steps, baseline):
    return {s: baseline[s] for s in range(steps)}


def test_two_workers_give_the_one_worker_losses(cluster, baseline):
    coord = cluster.coordinator(cluster.root / "save", STEPS)
    a = cluster.worker(coord.port)
    b = cluster.worker(coord.port, with_config=False)  # adopts the coordinator's config
    out = cluster.finish(coord)
    assert losses(cluster.root / "save") == first(STEPS, baseline)
    assert "GENERATION" in out
    for worker in (a, b):  # both are told the run is finished, and exit 0
        assert exit_code(worker) == 0, log_of(worker)
    assert "using the coordinator's config" in log_of(b)


def test_workers_that_ask_ahead_give_the_one_worker_losses(cluster, baseline):
    """Workers that ask for their next chunk while one is being scored (a GPU worker's
    way, forced here on the CPU by tests/ahead_worker.py): two chunks out at once, and
    every step's loss the one-worker run's."""
    coord = cluster.coordinator(cluster.root / "save", STEPS)
    runner = [sys.executable, Path(__file__).with_name("ahead_worker.py")]
    workers = [cluster.worker(coord.port, runner=runner) for _ in range(2)]
    cluster.finish(coord)
    assert losses(cluster.root / "save") == first(STEPS, baseline)
    for worker in workers:
        assert exit_code(worker) == 0, log_of(worker)
    assert any("at most 2 chunks started at once" in log_of(w) for w in workers)


def test_three_workers_each_get_their_figures(cluster, baseline):
    """Three worker processes, started before their coordinator so that all of them join
    the run at its start: each one's figures reach metrics.jsonl, the chunks they count
    add up to every step's, and the losses are the one-worker run's."""
    port, save = free_port(), cluster.root / "save"
    # retries 0.1 s apart, so that none is still pausing when the short run is over
    workers = [cluster.worker(port, extra=("--set", "worker.retry_max_s=0.1")) for _ in range(3)]
    for worker in workers:  # up and knocking before anyone listens
        wait_until(lambda w=worker: "retrying" in log_of(w), "a worker trying to connect", [worker])
    coord = cluster.coordinator(save, STEPS, port=port)
    out = cluster.finish(coord)
    assert losses(save) == first(STEPS, baseline)
    records = ckpt.read_metrics(save)
    n_chunks = TINY_CFG.training.population_size // TINY_CFG.training.chunk_size
    for r in records:
        figures = r["workers"].values()
        assert sum(w["chunks"] for w in figures) == n_chunks, r["workers"]
        assert all(w["busy_s"] > 0 and w["member_tokens_per_s"] > 0 for w in figures if w["chunks"])
        assert all(w["idle_s"] >= 0 for w in figures)
    assert len(set().union(*(r["workers"] for r in records))) == 3  # one connection each
    assert "Workers " in out
    for worker in workers:
        assert exit_code(worker) == 0, log_of(worker)


def test_killed_and_late_workers_give_the_same_losses(cluster, baseline):
    coord = cluster.coordinator(cluster.root / "save", STEPS)
    # a process that takes a chunk and is stopped (not killed: its connection stays open)
    # before it answers, so the chunk is re-assigned after the straggler timeout
    grabber = subprocess.Popen(
        [sys.executable, "-c", GRAB_A_CHUNK, str(coord.port)],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    cluster.procs.append(grabber)
    grabber.log = os.devnull
    assert grabber.stdout.readline().startswith("got chunk")
    grabber.send_signal(signal.SIGSTOP)
    first_worker = cluster.worker(coord.port)
    # once the run is under way the first worker dies; a new one catches up from the
    # history and finishes the run alone
    wait_until(checkpoint_exists(cluster.root / "save", 3), "step 3", [coord])
    first_worker.kill()
    late = cluster.worker(coord.port)
    out = cluster.finish(coord)
    assert re.search(r"re-assigning chunk \d+", out, re.I), out
    assert losses(cluster.root / "save") == first(STEPS, baseline)
    assert late.wait(timeout=30) == 0
    late_log = log_of(late)
    assert "updated to step 3" in late_log and " chunk " in late_log, late_log


def test_restart_from_load_dir_keeps_the_losses(cluster, baseline):
    run1 = cluster.coordinator(cluster.root / "run1", 3)
    cluster.worker(run1.port)
    cluster.finish(run1)
    run2 = cluster.coordinator(cluster.root / "run2", STEPS, load_dir=cluster.root / "run1")
    fresh = cluster.worker(run2.port)  # starts from scratch: replays steps 0..2 first
    cluster.finish(run2)
    merged = {**losses(cluster.root / "run1"), **losses(cluster.root / "run2")}
    assert merged == first(STEPS, baseline)
    assert fresh.wait(timeout=30) == 0
    assert "updated to step 3" in log_of(fresh)


def test_chaos_gives_the_undisturbed_losses(cluster, baseline):
    """Workers SIGKILLed and replaced, one SIGSTOPped past the straggler timeout, the
    coordinator SIGKILLed and restarted from its save directory: from a fixed seed."""
    rng = random.Random(5)
    port, save = free_port(), cluster.root / "save"
    coord = cluster.coordinator(save, CHAOS_STEPS, port=port)
    workers = [cluster.worker(port) for _ in range(3)]
    plan = ["kill worker", "kill worker", "stop worker", "kill coordinator", "kill coordinator"]
    rng.shuffle(plan)
    for step, action in zip(
        sorted(rng.sample(range(2, CHAOS_STEPS - 2), len(plan))), plan, strict=True
    ):
        wait_until(checkpoint_exists(save, step), f"step {step}", [coord])
        # chaos, not synchronisation: a random delay to strike somewhere inside the step
        time.sleep(rng.uniform(0, 0.3))
        if action == "kill worker":
            victim = rng.choice(workers)
            victim.kill()
            victim.wait()
            workers[workers.index(victim)] = cluster.worker(port)
        elif action == "stop worker":
            victim = rng.choice(workers)
            victim.send_signal(signal.SIGSTOP)
            # the fault itself: stopped for longer than the 2 s straggler timeout, so a
            # chunk it holds goes to the others (nothing to wait for: it may hold none).
            # The run may end meanwhile: the worker then finds the GOODBYE in its socket,
            # or is told by the next coordinator, which stays up for reconnecting workers.
            time.sleep(3)
            victim.send_signal(signal.SIGCONT)
        else:
            coord.kill()
            coord.wait()
            coord = cluster.coordinator(save, CHAOS_STEPS, load_dir=save, port=port)
    cluster.finish(coord)
    assert losses(save) == baseline
    assert sorted(ckpt.list_checkpoints(save)) == list(range(1, CHAOS_STEPS + 1))
    for worker in workers:
        assert exit_code(worker) == 0, log_of(worker)


def test_full_disk_ends_with_a_clear_exit_and_a_history_that_resumes(cluster, baseline):
    disk = cluster.root / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:  # test_coordinator's ENOSPC test covers the logic without
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        port, save = free_port(), disk / "save"
        coord = cluster.coordinator(save, CHAOS_STEPS, port=port)
        worker = cluster.worker(port)
        out = cluster.finish(coord, code=3)
        assert "No space left on device" in out.splitlines()[-1], out
        reached = sorted(ckpt.list_checkpoints(save))
        assert 2 <= len(reached) < CHAOS_STEPS and reached == list(range(1, len(reached) + 1))
        assert sorted(losses(save))[: len(reached)] == list(range(len(reached)))
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        coord = cluster.coordinator(save, CHAOS_STEPS, load_dir=save, port=port)
        cluster.finish(coord)  # the same worker waited, and goes on where it was
        assert losses(save) == baseline
        assert exit_code(worker) == 0, log_of(worker)
        assert "updated to step 1" in log_of(worker)
    finally:
        cluster.stop_all()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_worker_refused_for_good_exits_2(cluster):
    port = free_port()
    coord = cluster.coordinator(cluster.root / "run1", CHAOS_STEPS, port=port)
    worker = cluster.worker(port)
    wait_until(checkpoint_exists(cluster.root / "run1", 2), "step 2", [coord])
    coord.kill()
    coord.wait()
    # restarted without --load-dir: the worker is ahead of it, and no retry can fix that
    cluster.coordinator(cluster.root / "run2", CHAOS_STEPS, port=port)
    assert exit_code(worker, timeout=60) == 2, log_of(worker)
    assert "--load-dir" in log_of(worker).strip().splitlines()[-1]


def test_a_run_with_a_secret_equals_one_without(cluster, baseline):
    secret = {"DEGGS_SECRET": SECRET}
    coord = cluster.coordinator(cluster.root / "save", STEPS, env=secret)
    workers = [
        cluster.worker(coord.port, env=secret),
        cluster.worker(coord.port, with_config=False, env=secret),
    ]
    strangers = [
        cluster.worker(coord.port),  # no secret
        cluster.worker(coord.port, env={"DEGGS_SECRET": "a guess"}),  # too short to use
    ]
    # Another secret: to it the coordinator is an impostor, so it retries, never exits.
    other = cluster.worker(coord.port, env={"DEGGS_SECRET": SECRET[::-1]})
    whys = ["requires a shared secret", "at least 32 are needed"]
    for stranger, why in zip(strangers, whys, strict=True):
        assert stranger.wait(timeout=60) == 2, log_of(stranger)
        assert why in log_of(stranger).strip().splitlines()[-1]
    cluster.finish(coord)
    assert losses(cluster.root / "save") == first(STEPS, baseline)
    for worker in workers:
        assert exit_code(worker) == 0, log_of(worker)
    assert other.poll() is None, log_of(other)
    assert "the coordinator's proof of the shared secret is wrong" in log_of(other)


GRAB_A_CHUNK = """
import socket, sys, time
from deggs.runtime import protocol
from deggs.runtime.protocol import JobRequest, JobResponse
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
protocol.send_frame(sock, JobRequest(42, 0).encode())
opcode, payload = protocol.recv_frame(sock, {protocol.JOB_RESPONSE: 1 << 20})
job = JobResponse.decode(payload)
print("got chunk", job.data_position, flush=True)
time.sleep(600)  # holds the chunk and the connection until the test stops it
"""


def test_metrics_lines_are_json(cluster):
    coord = cluster.coordinator(cluster.root / "save", 1)
    cluster.worker(coord.port)
    cluster.finish(coord)
    lines = (cluster.root / "save" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0]


def test_a_cluster_trains_as_the_reference_did(tmp_path, golden_path):
    """A coordinator and two worker processes on the reference's tiny_bytes run: each
    step's sum_loss, fitness (the checkpoints) and update count are the golden ones, so
    the runtime is checked against the reference, not only against itself."""
    steps = 4  # the third update is the first that moves weights (3965 of them)
    path = golden_path("tiny_bytes")
    with np.load(path) as golden:
        cfg = golden_config(golden)
        tokens = golden_tokens(golden, path, cfg)
        sums = {s: int(golden[f"step{s}/sum_loss"].sum()) for s in range(steps)}
        fitness = {s: pack_trits(golden[f"after{s}/fitness_used"]) for s in range(1, steps + 1)}
        updates = {s: int(golden[f"after{s}/updates"][0]) for s in range(1, steps)}
    cfg = cfg.replace(coordinator=dict(straggler_timeout_s=30), worker=dict(retry_max_s=0.5))
    cluster = Cluster(tmp_path, toml_of(cfg), tokens)
    try:
        coord = cluster.coordinator(tmp_path / "save", steps)
        workers = [cluster.worker(coord.port) for _ in range(2)]
        cluster.finish(coord)
        for worker in workers:
            assert exit_code(worker) == 0, log_of(worker)
    finally:
        cluster.stop_all()
    assert losses(tmp_path / "save") == sums
    for s, packed in fitness.items():
        assert ckpt.read_checkpoint(ckpt.checkpoint_path(tmp_path / "save", s)).fitness == packed
    records = {r["step"]: r for r in ckpt.read_metrics(tmp_path / "save")}
    assert {s: records[s]["updates_max"] for s in updates} == updates


def test_validation_loss_and_health_reach_the_metrics(cluster):
    """With val.bin beside the data (deggs prepare holds out the end of the text), the
    worker that takes the first chunk of every
    eval.every_steps-th step reports the unperturbed model's validation loss, and the
    coordinator records it in the step's metrics line, in its units and in bits; so for
    the model's health on eval.health_every_steps-th steps, every parameter slice's and
    the activations' on validation windows."""
    assert (cluster.data / "val.bin").stat().st_size > 1000  # deggs prepare held it out
    evaluated = TINY_CFG.replace(eval=dict(every_steps=2, windows=5, health_every_steps=3))
    cluster.config.write_text(toml_of(evaluated))
    coord = cluster.coordinator(cluster.root / "save", 3)
    cluster.worker(coord.port)
    out = cluster.finish(coord)
    records = {r["step"]: r for r in ckpt.read_metrics(cluster.root / "save")}
    assert [s for s, r in sorted(records.items()) if "val_loss" in r] == [0, 2]
    first = records[0]
    assert first["val_tokens"] == 5 * 8
    assert 0 < first["val_bits_per_token"] < 16 and first["val_bits_per_byte"] == pytest.approx(
        first["val_bits_per_token"]
    )  # byte tokens: one byte each
    assert "validation at step 0: loss" in out and "validation at step 2" in out
    assert [s for s, r in sorted(records.items()) if "health" in r] == [0]
    health = records[0]["health"]
    assert list(health)[:2] == ["embedding", "emb_bias"] and len(health) == 8 + 12 + 2 + 2
    assert health["layers.0.ln_1"] == {"mean": 16.0, "std": 0.0, "saturation": 0.0, "entropy": 0.0}
    assert 0 < health["act.final_norm"]["std"] and 0 < health["act.final_norm"]["entropy"] <= 8
    assert "health at step 0: 24 entries" in out
