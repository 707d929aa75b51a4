"""From a chunk's member losses to the ternary fitness of its antithetic pairs.

Pair i holds member 2i (+noise) and 2i+1 (-noise). The pair's raw signal is
loss(-) - loss(+): positive when the +noise direction is better. The reference shapes it
on the worker's host in double arithmetic, per chunk:

- chunk mean filter: add trunc(sign(mean) * |mean|^exponent) to every difference, so a
  chunk-wide trend pushes weak pairs its way;
- adaptive threshold: differences smaller than alpha * mean|difference| count as ties;
- the fitness is the sign (+1, 0, -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import Config


@dataclass(frozen=True)
class ChunkFitness:
    fitness: np.ndarray  # int32 [pairs], values in {-1, 0, 1}
    sum_loss: int  # sum of every member's loss (int64 on the wire)


def chunk_fitness(cfg: Config, losses: np.ndarray) -> ChunkFitness:
    """Fitness of a chunk's pairs from its members' int32 losses (member order)."""
    losses = np.asarray(losses, np.int64)
    if losses.ndim != 1 or len(losses) % 2:
        raise ValueError(f"losses must be a flat array of whole pairs, got shape {losses.shape}")
    plus, minus = losses[0::2], losses[1::2]
    sum_loss = int((plus + minus).sum())
    diffs = (minus - plus).astype(np.int32).astype(np.int64)
    n = len(diffs)
    f = cfg.fitness
    if f.chunk_mean_filter and n:
        mean = float(diffs.sum()) / n
        if mean != 0.0:
            mean = float(np.sign(mean)) * abs(mean) ** float(f.chunk_mean_exponent)
        diffs = diffs + int(mean)  # C cast: truncate toward zero
    if f.adaptive_threshold and n:
        magnitude = np.abs(diffs).astype(np.float64)
        # the reference's alpha is a float literal (0.1f) widened to double
        threshold = (magnitude.sum() / n) * float(np.float32(f.adaptive_threshold_alpha))
        # as in the reference, a zero difference with a zero threshold counts as -1
        fitness = np.where(magnitude < threshold, 0, np.where(diffs > 0, 1, -1))
    else:
        fitness = np.sign(diffs)
    return ChunkFitness(fitness.astype(np.int32), sum_loss)
