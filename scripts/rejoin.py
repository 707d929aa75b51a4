#!/usr/bin/env python3
"""How long a fresh worker takes to join a long run: from its start to its first chunk.

    python scripts/rejoin.py [--config PATH] [--backend cpu|gpu] [--every K]
                             [--tail T] [--export] STEP [STEP ...]

For each STEP it writes a save directory of a run at STEP + T: a history of random
fitness (as `bench.py --replay` makes), a snapshot every K steps made by replaying that
history here, and the checkpoints before the newest snapshot pruned. Then it starts
`deggs coordinator --load-dir` on it and one fresh worker, and times the worker from its
start to the end of its first chunk (it loads the snapshot of STEP and replays T steps
first). With --export it also times `deggs export` of the snapshot's step. One JSON line
per STEP (--repeats: the median of that many joins); docs/RELIABILITY.md has the figures.

The synthetic history is built by replaying it on this machine. A GPU run at a large
STEP can instead take --synthetic: the snapshot holds the initial weights labelled as
step STEP (with its true seed), which costs the joining worker the same to load.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from deggs.config import load_config  # noqa: E402
from deggs.numerics.backend import NAMES, make_backend  # noqa: E402
from deggs.numerics.es import Trainer  # noqa: E402
from deggs.runtime.checkpoint import Checkpoint, save_checkpoint, save_config  # noqa: E402
from deggs.runtime.export import save_model  # noqa: E402
from deggs.runtime.snapshot import prune, snapshot_path  # noqa: E402
from deggs.seeds import next_step_seed  # noqa: E402
from deggs.ternary import pack_trits  # noqa: E402

TIMEOUT_S = 600


def build_run(save_dir: Path, cfg, backend: str, last: int, every: int, synthetic: bool):
    """A save directory at step `last`: random fitness, snapshots every `every` steps,
    the history before the newest snapshot pruned."""
    rng = np.random.default_rng(0)
    save_dir.mkdir()
    save_config(save_dir, cfg)
    trainer = Trainer(make_backend(cfg, backend))
    seed = trainer.seed
    newest = last // every * every
    for step in range(1, last + 1):
        fitness = rng.integers(-1, 2, cfg.training.n_pairs).astype(np.int32)
        seed = next_step_seed(seed, step)
        if step >= newest:  # the ones before are pruned anyway
            save_checkpoint(save_dir, Checkpoint(step, seed, pack_trits(fitness)))
        if not synthetic or step > newest:
            trainer.apply(fitness)  # checkpoint `step` holds the fitness that reaches it
        elif step == newest:
            trainer.step, trainer.seed = step, seed  # the initial weights, labelled
        if step == newest:
            save_model(snapshot_path(save_dir, step), trainer)
    prune(save_dir, keep=1, history=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_join(save_dir: Path, config: Path, backend: str, work: Path) -> dict:
    port = free_port()
    deggs = [sys.executable, "-m", "deggs"]
    with open(work / "coordinator.log", "w") as log:
        coordinator = subprocess.Popen(
            [*deggs, "coordinator", "--config", config, "--host", "127.0.0.1", "--port", str(port),
             "--load-dir", save_dir, "--save-dir", work / "save"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    shutil.rmtree(work / "save", ignore_errors=True)  # each join a coordinator's first start
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in (work / "coordinator.log").read_text():
            if coordinator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((work / "coordinator.log").read_text())
            time.sleep(0.05)
        started = time.perf_counter()
        worker = subprocess.Popen(
            [*deggs, "worker", "127.0.0.1", "--port", str(port), "--backend", backend,
             "--data-dir", work],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work,
        )  # fmt: skip
        lines = []
        try:
            assert worker.stdout is not None
            for line in worker.stdout:
                lines.append(line)
                if re.search(r"\] step \d+ chunk \d+: ", line):
                    break
            else:
                raise RuntimeError("the worker ended before a chunk:\n" + "".join(lines))
            seconds = time.perf_counter() - started
        finally:
            worker.terminate()
            worker.wait(30)
    finally:
        coordinator.terminate()
        coordinator.wait(30)
    loaded = next((line.strip() for line in lines if "loaded the snapshot" in line), None)
    return {"first_chunk_s": round(seconds, 2), "loaded": loaded}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("steps", nargs=-1, type=click.IntRange(min=1), required=True)
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--backend", type=click.Choice(NAMES), default="cpu", show_default=True)
@click.option("--every", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--tail", type=click.IntRange(min=0), default=50, show_default=True)
@click.option("--synthetic", is_flag=True, help="the snapshot holds the initial weights")
@click.option("--export", "time_export", is_flag=True, help="also time deggs export")
@click.option("--repeats", type=click.IntRange(min=1), default=1, help="joins timed (median)")
def main(steps, config_path, backend, every, tail, synthetic, time_export, repeats):
    cfg = load_config(config_path).replace(coordinator={"snapshot_every_steps": every})
    for step in steps:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            config = work / "config.toml"
            config.write_text(cfg.to_toml())
            input_tokens = np.random.default_rng(1).integers(0, cfg.model.vocab_size, 1 << 16)
            dtype = np.uint8 if cfg.model.byte_tokens else np.uint32
            input_tokens.astype(dtype).tofile(work / "input.bin")
            started = time.perf_counter()
            build_run(work / "run", cfg, backend, step + tail, every, synthetic)
            row = {"step": step + tail, "snapshot": step, "every": every, "backend": backend}
            row["build_s"] = round(time.perf_counter() - started, 1)
            joins = [time_join(work / "run", config, backend, work) for _ in range(repeats)]
            row |= joins[0] | {
                "first_chunk_s": statistics.median(j["first_chunk_s"] for j in joins),
                "joins_s": [j["first_chunk_s"] for j in joins],
            }
            if time_export:
                started = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "deggs", "export", "--load-dir", work / "run",
                     "--step", str(step), "--backend", "cpu", "--out", work / "m.safetensors"],
                    check=True, capture_output=True, timeout=TIMEOUT_S,
                )  # fmt: skip
                row["export_s"] = round(time.perf_counter() - started, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
