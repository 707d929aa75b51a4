"""The CPU backend: the readable specification (NumPy + BLAS, members over threads).

It implements deggs.numerics.backend.Backend with the functions of model.py,
optimizer.py and sampling.py, holding the weights, overlays and optimizer state as
NumPy arrays.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
from threadpoolctl import threadpool_limits

from ..config import Config
from .model import (
    KVCache,
    Weights,
    forward,
    init_overlays,
    init_params,
    logits,
    make_tables,
    member_losses,
)
from .optimizer import apply_update
from .sampling import generate
from .state import OptimizerState

# Members evaluated together: bounds the [members, positions, vocab] logits in memory.
LOGIT_BUDGET = 1 << 23


def limit_threads(n: int) -> threadpool_limits:
    """Hold this process's BLAS and OpenMP pools to n threads (NumPy's BLAS would
    otherwise run one a core beside the backend's own n). numba runs no pool here (no
    parallel=True), so it needs no limit. restore_original_limits() on the result undoes it."""
    return threadpool_limits(limits=n)


class CpuBackend:
    name = "cpu"

    def __init__(self, cfg: Config, threads: int | None = None):
        self.cfg = cfg
        self.tables = make_tables(cfg)
        self.params: dict[str, np.ndarray] = init_params(cfg)
        self.overlays: dict[str, np.ndarray] = init_overlays(cfg)
        self.state: OptimizerState = OptimizerState.zeros(cfg)
        self.threads = threads or os.cpu_count() or 1
        per_member = cfg.model.seq_len * max(cfg.model.vocab_size, 4 * cfg.model.hidden_dim)
        self.batch = max(2, min(256, LOGIT_BUDGET // per_member) // 2 * 2)

    def load_state(self, params: dict, overlays: dict, state: OptimizerState | None = None):
        """Replace weights, overlays and (optionally) the optimizer state with copies."""
        self.params = {k: np.array(v, np.int8) for k, v in params.items()}
        self.overlays = {k: np.array(v, np.int8) for k, v in overlays.items()}
        if state is not None:
            copy = lambda d: {k: np.array(v, np.float32) for k, v in d.items()}
            self.state = OptimizerState(copy(state.m), copy(state.v), copy(state.acc))

    def losses(
        self,
        data: np.ndarray,
        step: int,
        step_seed: int,
        members,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """progress(members scored, members in all) is called after each batch, from
        this thread: a chunk of a GPU-sized config takes the CPU minutes."""
        members = np.asarray(members, np.int64)
        batches = [members[i : i + self.batch] for i in range(0, len(members), self.batch)]
        report = progress or (lambda done, total: None)

        def run(batch):
            return member_losses(
                self.cfg, self.tables, self.params, self.overlays, data, step, step_seed, batch
            )

        parts, done = [], 0
        if len(batches) == 1 or self.threads == 1:
            for batch in batches:
                parts.append(run(batch))
                done += len(batch)
                report(done, len(members))
        else:
            with ThreadPoolExecutor(self.threads) as pool:
                futures = {pool.submit(run, batch): len(batch) for batch in batches}
                try:
                    for future in as_completed(futures):
                        done += futures[future]
                        report(done, len(members))
                except BaseException:  # a stop signal: drop the queued batches, not wait
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
                parts = [future.result() for future in futures]  # in submission order
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def start_losses(self, data: np.ndarray, step: int, step_seed: int, members):
        """Scores here: the CPU's threads are all busy with one chunk."""
        result = self.losses(data, step, step_seed, members)
        return lambda: result

    @property
    def members_at_once(self) -> int:
        """Members scored in one round of the backend's threads."""
        return self.batch * self.threads

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Integer logits of the unperturbed model for windows of tokens [window, position]."""
        tokens = np.asarray(tokens, np.int64)
        weights = Weights(self.cfg, self.params, self.overlays, None)
        parts = []
        for i in range(0, len(tokens), self.batch):
            window = tokens[i : i + self.batch]
            cache = KVCache.empty(self.cfg, len(window), window.shape[1])
            positions = np.arange(window.shape[1])
            normed = forward(self.cfg, self.tables, weights, window, cache, positions)
            parts.append(logits(self.cfg, weights, normed))
        return np.concatenate(parts)

    def update(self, fitness, step: int, step_seed: int) -> int:
        return apply_update(
            self.cfg, self.params, self.overlays, self.state, fitness, step, step_seed
        )

    def start_update(self, fitness, step: int, step_seed: int) -> Callable[[], int]:
        changed = self.update(fitness, step, step_seed)  # here and now
        return lambda: changed

    def generate(self, prompt, seed: int, n_tokens: int | None = None) -> np.ndarray:
        needed = len(prompt) + (self.cfg.sampling.generate_tokens if n_tokens is None else n_tokens)
        if needed > self.tables.rope.shape[0]:
            self.tables = make_tables(self.cfg, needed)
        return generate(self.cfg, self.tables, self.params, self.overlays, prompt, seed, n_tokens)

    def start_generate(self, prompt, seed: int, n_tokens: int | None = None):
        tokens = self.generate(prompt, seed, n_tokens)
        return lambda: tokens
