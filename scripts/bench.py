#!/usr/bin/env python3
"""Measure a worker backend: forward (losses) throughput and the update.

    python scripts/bench.py [--config PATH | --golden NAME.npz] [--backend cpu]
                            [--members N] [--repeats R] [--update/--no-update]

Times `losses` on N members of chunk 0 (median of R runs after one warm-up) and, with
--update, one whole update from a random fitness vector. Prints one JSON line:
member-tokens per second of the forward pass and the projected time of a whole step of
the config (population / N forward runs plus one update) on this one machine.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deggs.backend import CpuBackend  # noqa: E402
from deggs.config import load_config  # noqa: E402

BACKENDS = {"cpu": CpuBackend}


def timed(fn, repeats):
    fn()  # warm-up: compilation, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@click.command()
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--golden", type=click.Path(exists=True, dir_okay=False),
              help="take the config of a golden .npz instead")
@click.option("--backend", type=click.Choice(sorted(BACKENDS)), default="cpu", show_default=True)
@click.option("--members", type=click.IntRange(min=2), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--update/--no-update", default=True, show_default=True)
def main(config_path, golden, backend, members, repeats, update):
    if golden:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from conformance import golden_config
        cfg = golden_config(np.load(golden))
    else:
        cfg = load_config(config_path)
    engine = BACKENDS[backend](cfg)
    rng = np.random.default_rng(0)
    n = max(cfg.model.seq_len + 1, 100_000)
    data = rng.integers(0, cfg.model.vocab_size, n).astype(cfg.token_dtype)
    batch = np.arange(min(members, cfg.training.population_size))
    forward_s = timed(lambda: engine.losses(data, 0, cfg.training.seed, batch), repeats)
    member_tokens = len(batch) * cfg.model.seq_len / forward_s
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "backend": backend,
        "device": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "config": {"hidden": cfg.model.hidden_dim, "layers": cfg.model.n_layers,
                   "seq": cfg.model.seq_len, "vocab": cfg.model.vocab_size,
                   "population": cfg.training.population_size},
        "members": len(batch),
        "forward_s": round(forward_s, 4),
        "member_tokens_per_s": round(member_tokens),
    }
    if update:
        fitness = rng.integers(-1, 2, cfg.training.n_pairs).astype(np.int32)
        start = time.perf_counter()
        engine.update(fitness, 0, cfg.training.seed)
        record["update_s"] = round(time.perf_counter() - start, 3)
        step_tokens = cfg.training.population_size * cfg.model.seq_len
        step_s = step_tokens / member_tokens + record["update_s"]
        record["projected_step_s"] = round(step_s, 1)
        record["projected_tokens_per_s"] = round(step_tokens / step_s)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
