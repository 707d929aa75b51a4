"""Rebuilding a trained model from a coordinator's save directory.

The weights are never saved: they are the initial weights plus every step's update, and
each update is a function of that step's fitness, which the checkpoints keep. Replaying
them in order gives, bit for bit, the model every worker holds.
"""

from __future__ import annotations

from pathlib import Path

from ..numerics.es import Trainer
from ..ternary import unpack_trits
from .checkpoint import CheckpointError, list_checkpoints, read_checkpoint


def replay(
    save_dir: str | Path, trainer: Trainer, until: int | None = None, progress=None
) -> Trainer:
    """Apply the saved steps trainer.step..N-1 (N: the newest checkpoint, or `until`).

    progress(step, last, weights changed) is called after each step."""
    cfg = trainer.cfg
    files = list_checkpoints(save_dir)
    last = max(files, default=0) if until is None else until
    while trainer.step < last:
        path = files.get(trainer.step + 1)
        if path is None:
            raise CheckpointError(
                f"{Path(save_dir)}: no checkpoint for step {trainer.step + 1}; "
                f"the history to replay stops at step {trainer.step}"
            )
        checkpoint = read_checkpoint(path, cfg.training.n_pairs)
        changed = trainer.apply(unpack_trits(checkpoint.fitness, cfg.training.n_pairs))
        if checkpoint.seed != trainer.seed:
            raise CheckpointError(
                f"{path}: seed {checkpoint.seed} does not follow from the "
                f"config's seed (expected {trainer.seed})"
            )
        if progress is not None:
            progress(trainer.step, last, changed)
    return trainer
