#!/usr/bin/env python3
"""Measure a worker backend at a config: forward, update, whole step, tokens/s.

    python scripts/bench.py [--config PATH | --golden NAME.npz] [--backend cpu|gpu]
        [--members N] [--repeats R] [--updates U] [--steps S] [--batch B] [--profile]
        [--timeline] [--head KERNEL] [--qkv KERNEL] [--replay N] [-D NAME=VALUE ...]
        [--data FILE] [--train-first N]

After one warm-up of each (compilation, caches, graph capture) it times R forward runs
of N members (default: a whole chunk on the GPU, 64 members on the CPU), U updates from
random ternary fitness, and S whole steps (every member's loss, then the update). The
step time is the median whole step, or with --steps 0 the projection
population / N * forward + update ("extrapolated": true). --timeline times one more
whole step on the GPU chunk by chunk (see step_timeline). With --replay N it also writes
a save directory of N steps of random fitness and times rebuilding the model from it
(what deggs-generate does before it samples). Prints one JSON line.

The tokens are random unless --data names a token file (input.bin). With --train-first N
it first trains N whole steps on them, untimed, so that what is timed sees the weights
training has moved: the default config's first steps change no weight, and on text the
head's work at trained weights differs from the initial weights' (docs/PERFORMANCE.md,
"The head at trained weights").
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from power import Sampler, thermals  # noqa: E402
from variants import define_option, parse_defines  # noqa: E402

from deggs.config import load_config  # noqa: E402
from deggs.data import DataError, load_tokens  # noqa: E402
from deggs.numerics.backend import BACKENDS, make_backend  # noqa: E402
from deggs.numerics.es import Trainer  # noqa: E402
from deggs.numerics.params import macs_per_token  # noqa: E402
from deggs.runtime.checkpoint import Checkpoint, save_checkpoint  # noqa: E402
from deggs.runtime.replay import replay  # noqa: E402
from deggs.runtime.steps import LOSS_SCALE  # noqa: E402
from deggs.seeds import next_step_seed  # noqa: E402
from deggs.ternary import pack_trits  # noqa: E402


def median_time(fn, runs):
    times = []
    for i in range(runs):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


# Dense int8 tensor-core rates (TOPS, no sparsity) of the cards deggs is measured on, by
# a piece of the name CUDA reports; the vendors' data sheets.
DENSE_INT8_TOPS = {
    "H100 PCIe": 1513,
    "H100 NVL": 1671,
    "H100": 1979,  # SXM (H100 80GB HBM3)
    "H200": 1979,
    "A100": 624,
    "L40S": 733,
    "RTX 4090": 660,
}


def int8_rate(device: str) -> float | None:
    """The device's dense int8 rate in TOPS, where the table knows it."""
    return next((tops for key, tops in DENSE_INT8_TOPS.items() if key in device), None)


def device_name(backend):
    if backend == "gpu":
        import cupy as cp

        return cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--golden",
    type=click.Path(exists=True, dir_okay=False),
    help="take the config of a golden .npz instead",
)
@click.option("--backend", type=click.Choice(sorted(BACKENDS)), default="cpu", show_default=True)
@click.option("--members", type=click.IntRange(min=2), help="members per timed forward run")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--updates", type=click.IntRange(min=0), default=1, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="whole steps to time (0: project from the forward and the update)",
)
@click.option("--batch", type=click.IntRange(min=2), help="members per forward sub-batch")
@click.option("--profile", is_flag=True, help="GPU: also time each kernel of one forward run")
@click.option(
    "--timeline", is_flag=True, help="GPU: one more whole step, each chunk's and the update's span"
)
@click.option(
    "--head",
    type=click.Choice(["head_loss", "head_loss_sm90"]),
    help="GPU: the fused head's kernel (default: the one chosen for the device)",
)
@click.option(
    "--qkv",
    type=click.Choice(["qkv_rope", "qkv_rope_sm90"]),
    help="GPU: q, k, v by cuBLAS + qkv_rope or the fused kernel (default: the device's choice)",
)
@click.option(
    "--replay",
    "replay_steps",
    type=click.IntRange(min=0),
    default=0,
    help="time a replay of N steps",
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(exists=True, dir_okay=False),
    help="score this token file (input.bin) instead of random tokens",
)
@click.option(
    "--train-first",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="train N whole steps, untimed, before timing (random --updates then move the weights on)",
)
@define_option("GPU: compile a kernel variant: replace a -D value (UP_ROWS=192, ...)")
def main(
    config_path,
    golden,
    backend,
    members,
    repeats,
    updates,
    steps,
    batch,
    profile,
    timeline,
    head,
    qkv,
    replay_steps,
    data_path,
    train_first,
    defines,
):
    if golden:
        from golden import golden_config

        cfg = golden_config(np.load(golden))
    else:
        cfg = load_config(config_path)
    m, t = cfg.model, cfg.training
    if (head or qkv or timeline or defines) and backend != "gpu":
        raise click.UsageError("--head, --qkv, --timeline and -D are for --backend gpu")
    overrides = parse_defines(defines)
    start = time.perf_counter()
    if backend == "gpu":
        from deggs.numerics.gpu import GpuBackend

        # the choices made at construction; a Hopper kernel asked for that cannot run
        # this config on this device is refused
        try:
            engine = GpuBackend(
                cfg,
                batch=batch,
                head=head,
                qkv=None if qkv is None else qkv == "qkv_rope_sm90",
                defines=overrides or None,
            )
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    else:
        engine = make_backend(cfg, backend)
        if batch:
            engine.batch = batch  # the CPU's members a batch
    trainer = Trainer(engine)
    init_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    if data_path:
        try:
            data = load_tokens(data_path, cfg)
        except DataError as e:
            raise click.UsageError(str(e)) from None
    else:
        data = rng.integers(0, m.vocab_size, max(m.seq_len + 1, 1_000_000))
        data = data.astype(cfg.token_dtype)
    # each trained step's mean loss a token (the coordinator's "loss")
    step_tokens = t.population_size * m.seq_len * LOSS_SCALE
    trained = [
        sum(r.sum_loss for r in trainer.train_step(data)) / step_tokens for _ in range(train_first)
    ]
    n = min(members or (t.chunk_size if backend == "gpu" else 64), t.population_size)
    batch_members = np.arange(n)
    fitness = lambda: rng.integers(-1, 2, t.n_pairs).astype(np.int32)
    seed = t.seed

    engine.losses(data, 0, seed, batch_members)  # warm-ups
    if updates or steps:
        engine.update(fitness(), 0, seed)
    forward_s, forward_runs = median_time(
        lambda i: engine.losses(data, 1 + i, seed + i, batch_members), repeats
    )
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "backend": backend,
        "device": device_name(backend),
        "config": {
            "hidden": m.hidden_dim,
            "layers": m.n_layers,
            "seq": m.seq_len,
            "vocab": m.vocab_size,
            "population": t.population_size,
            "chunk": t.chunk_size,
        },
        "init_s": round(init_s, 3),
        "data": data_path or "random",
        **({"trained_losses": [round(x, 4) for x in trained]} if trained else {}),
        "members": n,
        **({"defines": overrides} if overrides else {}),
        "forward_s": round(forward_s, 4),
        "forward_runs": [round(x, 4) for x in forward_runs],
        "member_tokens_per_s": round(n * m.seq_len / forward_s),
    }
    if updates:
        update_s, update_runs = median_time(
            lambda i: engine.update(fitness(), 1 + i, seed + i), updates
        )
        record.update(update_s=round(update_s, 4), update_runs=[round(x, 4) for x in update_runs])

    def whole_step(i):
        trainer.train_step(data)  # every chunk's losses and fitness, then the update

    if steps:
        # one untimed: each timed step then starts behind the update of the one before,
        # as in training (the host queues the first chunk while the GPU updates)
        whole_step(-1)
        before = thermals() if backend == "gpu" else None
        with Sampler() if backend == "gpu" else contextlib.nullcontext() as sampler:
            began = time.time()
            step_s, step_runs = median_time(whole_step, steps)
            ended = time.time()
        record.update(step_runs=[round(x, 4) for x in step_runs], extrapolated=False)
        if before is not None:
            # the card before the timed steps (at rest) and during them, from 1 s in
            # (power.draw averages the second before each sample)
            during = sampler.mean(began + 1.0, ended)
            record["thermals"] = {
                "before_steps": before,
                "during_steps": during and {k: round(v, 1) for k, v in during.items()},
            }
    else:
        step_s = t.population_size / n * forward_s + record.get("update_s", 0.0)
        record["extrapolated"] = True
    record.update(
        step_s=round(step_s, 4), tokens_per_s=round(t.population_size * m.seq_len / step_s)
    )
    # int8 operations (a multiply-add is two) of the step's forward passes over its time
    tops = 2 * macs_per_token(cfg) * record["tokens_per_s"] / 1e12
    record["int8_tops"] = float(f"{tops:.4g}")
    rate = int8_rate(record["device"])
    if rate is not None:
        record["int8_share"] = round(tops / rate, 4)
    if backend == "gpu":
        record.update(
            batch=min(engine.batch, n),  # members a sub-batch of the timed forward
            head=engine.plan.head if engine.plan.fused else "cuBLAS + sequence_loss",
            qkv="qkv_rope_sm90" if engine.plan.fused_qkv else "cuBLAS + qkv_rope",
            graph=engine.graph is not None,
            graph_error=engine.graph_error,
            head_again=engine.forward.head_again_shares(),
        )
        if profile:
            engine.start_profile()
            engine.losses(data, 2, seed, batch_members)
            record["profile_ms"] = engine.profile_report()
        if timeline:
            record["timeline"] = step_timeline(engine, trainer, data)
    if replay_steps:
        record["replay"] = time_replay(cfg, backend, replay_steps, rng)
    print(json.dumps(record))


def step_timeline(engine, trainer, data) -> list[dict]:
    """One more whole step, with CUDA events on the backend's stream as each chunk and
    the update are queued. span_ms: from when the GPU got to it (or the host began to
    queue it, if later) to the end of its last kernel; idle_before_ms: from the end of
    the one before to that; host_ms: the host's time in start_losses (queuing a chunk)
    or start_update. A chunk whose host_ms is well under the span of the one before was
    queued before the GPU got to it, so its span is GPU time alone; the update's
    includes what the host did first (the last chunk's fitness)."""
    import cupy as cp

    marks = []
    start_losses, start_update = engine.start_losses, engine.start_update

    def event():
        e = cp.cuda.Event()
        e.record(engine.stream)
        return e

    def timed(name, fn):
        def run(*args):
            first, began = event(), time.perf_counter()
            out = fn(*args)
            host_ms = 1e3 * (time.perf_counter() - began)
            marks.append((name(), first, event(), host_ms))
            return out

        return run

    engine.start_losses = timed(lambda: f"chunk {len(marks)}", start_losses)
    engine.start_update = timed(lambda: "update", start_update)
    try:
        trainer.train_step(data)
        engine.stream.synchronize()
    finally:
        del engine.start_losses, engine.start_update  # the methods again
    ms = lambda event: cp.cuda.get_elapsed_time(marks[0][1], event)
    rows, previous = [], 0.0
    for name, first, last, host_ms in marks:
        begin, end = ms(first), ms(last)
        rows.append(
            dict(
                what=name,
                span_ms=round(end - begin, 2),
                idle_before_ms=round(begin - previous, 2),
                host_ms=round(host_ms, 2),
            )
        )
        previous = end
    return rows


def time_replay(cfg, backend: str, steps: int, rng) -> dict:
    """Rebuild a model from a save directory of `steps` steps of random fitness."""
    with tempfile.TemporaryDirectory() as save_dir:
        trainer = Trainer(make_backend(cfg, backend))
        seed = trainer.seed
        for step in range(1, steps + 1):
            seed = next_step_seed(seed, step)
            fitness = rng.integers(-1, 2, cfg.training.n_pairs).astype(np.int32)
            save_checkpoint(save_dir, Checkpoint(step, seed, pack_trits(fitness)))
        start = time.perf_counter()
        replay(save_dir, trainer)
        seconds = time.perf_counter() - start
    return {"steps": steps, "seconds": round(seconds, 3), "per_step_s": round(seconds / steps, 4)}


if __name__ == "__main__":
    main()
