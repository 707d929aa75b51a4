"""Rebuilding a trained model from a coordinator's save directory.

The weights are never saved: they are the initial weights plus every step's update, and
each update is a function of that step's fitness, which the checkpoints keep. Replaying
them in order gives, bit for bit, the model every worker holds.
"""

from __future__ import annotations

from pathlib import Path

from ..numerics.es import Trainer
from ..seeds import next_step_seed
from ..ternary import unpack_blocks
from .checkpoint import CheckpointError, list_checkpoints, read_checkpoint


def replay(
    save_dir: str | Path, trainer: Trainer, until: int | None = None, progress=None
) -> Trainer:
    """Apply the saved steps trainer.step..N-1 (N: the newest checkpoint, or `until`).

    Each step's checkpoint is read and checked while the device applies the step before
    (a GPU's update is a few milliseconds, about what the host spends on a file).
    progress(step, last, weights changed) is called after each step."""
    files = list_checkpoints(save_dir)
    last = max(files, default=0) if until is None else until
    running = None  # waits for the update last started

    def finish():
        nonlocal running
        if running is not None:
            wait, running = running, None
            changed = wait()
            if progress is not None:
                progress(trainer.step, last, changed)

    try:
        while trainer.step < last:
            fitness = _saved_fitness(save_dir, files, trainer)
            finish()
            running = trainer.start_apply(fitness)
    finally:
        finish()
    return trainer


def _saved_fitness(save_dir: str | Path, files: dict[int, Path], trainer: Trainer):
    """The fitness that moves `trainer` to its next step, from that step's checkpoint."""
    step = trainer.step + 1
    path = files.get(step)
    if path is None:
        raise CheckpointError(
            f"{Path(save_dir)}: no checkpoint for step {step}; "
            f"the history to replay stops at step {trainer.step}"
        )
    n_pairs = trainer.cfg.training.n_pairs
    checkpoint = read_checkpoint(path, n_pairs)
    expected = next_step_seed(trainer.seed, step)
    if checkpoint.seed != expected:
        raise CheckpointError(
            f"{path}: seed {checkpoint.seed} does not follow from the "
            f"config's seed (expected {expected})"
        )
    return unpack_blocks(checkpoint.fitness, 1, n_pairs)  # read_checkpoint checked it
