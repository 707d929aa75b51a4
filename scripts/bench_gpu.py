#!/usr/bin/env python3
"""Time the GPU backend: forward seconds per chunk, update seconds per step, tokens/s.

    python scripts/bench_gpu.py [--config config.toml] [--chunks K] [--updates N]

Times K chunks of the forward (each chunk_size members), N updates and S whole steps
(the whole population's losses in one call, then the update), after one warm-up chunk and
one warm-up update (compilation, graph capture). step_s is the median whole step; with
--steps 0 it is extrapolated as n_chunks * median chunk + median update, and the JSON
says so ("extrapolated": true).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deggs.config import load_config  # noqa: E402
from deggs.gpu import GpuBackend, cp  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "config.toml"))
    ap.add_argument("--chunks", type=int, default=2, help="chunks of the forward to time")
    ap.add_argument("--updates", type=int, default=3, help="updates to time")
    ap.add_argument("--batch", type=int, default=None, help="members per forward sub-batch")
    ap.add_argument("--steps", type=int, default=2,
                    help="whole steps to time (losses of the population + update); 0: extrapolate")
    ap.add_argument("--profile", action="store_true", help="also time each kernel of one chunk")
    args = ap.parse_args()
    cfg = load_config(args.config)
    m, tr = cfg.model, cfg.training
    rng = np.random.default_rng(0)
    data = rng.integers(0, m.vocab_size, 1_000_000).astype(cfg.token_dtype)
    t0 = time.perf_counter()
    gpu = GpuBackend(cfg, batch=args.batch)
    init_s = time.perf_counter() - t0
    chunk = np.arange(tr.chunk_size)
    seed = 42
    t0 = time.perf_counter()
    gpu.losses(data, 0, seed, chunk)
    warm_forward_s = time.perf_counter() - t0
    fitness = lambda: rng.integers(-1, 2, tr.n_pairs).astype(np.int32)
    t0 = time.perf_counter()
    gpu.update(fitness(), 0, seed)
    warm_update_s = time.perf_counter() - t0
    forward = []
    for i in range(args.chunks):
        members = chunk + (i % tr.n_chunks) * tr.chunk_size
        t0 = time.perf_counter()
        gpu.losses(data, 1, seed + i, members)
        forward.append(time.perf_counter() - t0)
    updates = []
    for i in range(args.updates):
        f = fitness()
        t0 = time.perf_counter()
        gpu.update(f, 1 + i, seed + i)
        updates.append(time.perf_counter() - t0)
    whole = []
    population = np.arange(tr.population_size)
    for i in range(args.steps):
        t0 = time.perf_counter()
        gpu.losses(data, 10 + i, seed + i, population)
        gpu.update(fitness(), 10 + i, seed + i)
        whole.append(time.perf_counter() - t0)
    profile = None
    if args.profile:
        gpu.profile = {}
        gpu.losses(data, 2, seed, chunk)
        profile = gpu.profile_report()
        gpu.profile = None
    chunk_s = float(np.median(forward))
    update_s = float(np.median(updates))
    extrapolated = not whole
    step_s = float(np.median(whole)) if whole else tr.n_chunks * chunk_s + update_s
    print(json.dumps(dict(
        gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        config=dict(hidden=m.hidden_dim, layers=m.n_layers, seq=m.seq_len, vocab=m.vocab_size,
                    population=tr.population_size, chunk=tr.chunk_size),
        batch=gpu.batch, graph=gpu.graph is not None, graph_error=gpu.graph_error,
        init_s=round(init_s, 3), warmup_forward_s=round(warm_forward_s, 3),
        warmup_update_s=round(warm_update_s, 3),
        forward_s_per_chunk=round(chunk_s, 4), forward_chunks=[round(x, 4) for x in forward],
        update_s=round(update_s, 4), updates=[round(x, 4) for x in updates],
        step_s=round(step_s, 4), steps=[round(x, 4) for x in whole], extrapolated=extrapolated,
        step_s_from_chunks=round(tr.n_chunks * chunk_s + update_s, 4),
        tokens_per_s=round(tr.population_size * m.seq_len / step_s),
        profile_ms_one_chunk=profile,
    )))


if __name__ == "__main__":
    main()
