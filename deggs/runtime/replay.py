"""Rebuilding a trained model from a coordinator's save directory.

The weights are never saved: they are the initial weights plus every step's update, and
each update is a function of that step's fitness, which the checkpoints keep. Replaying
them in order gives, bit for bit, the model every worker holds.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import CheckpointError, list_checkpoints, read_checkpoint
from ..numerics.noise import next_step_seed
from ..ternary import unpack_trits


def replay(save_dir: str | Path, engine, until: int | None = None, progress=None) -> tuple[int, int]:
    """Apply steps 0..N-1 of a run to a fresh backend; returns (N, seed of step N)."""
    cfg = engine.cfg
    files = list_checkpoints(save_dir)
    last = max(files, default=0) if until is None else until
    seed = cfg.training.seed
    for step in range(last):
        path = files.get(step + 1)
        if path is None:
            raise CheckpointError(f"{Path(save_dir)}: no checkpoint for step {step + 1}; "
                                  f"the history to replay stops at step {step}")
        checkpoint = read_checkpoint(path, cfg.training.n_pairs)
        updates = engine.update(unpack_trits(checkpoint.fitness, cfg.training.n_pairs), step, seed)
        seed = next_step_seed(seed, step + 1)
        if checkpoint.seed != seed:
            raise CheckpointError(f"{path}: seed {checkpoint.seed} does not follow from the "
                                  f"config's seed (expected {seed})")
        if progress is not None:
            progress(step + 1, last, updates)
    return last, seed
