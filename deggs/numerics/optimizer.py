"""The update: from a step's whole-population fitness to new int8 weights.

Every worker rebuilds the same update from the fitness alone, since it can regenerate
every pair's noise. A weight's "vote" is the fitness-weighted sum of its noise over the
pairs: for W[k, j], vote = sum_p fitness_p * a_p[j] * b_p[k], which is the matrix
product B^T diag(fitness) A (exact in float64 BLAS). The vote drives the optimizer (the
contract below; AdamW by default): float32 moments and a fractional accumulator per
weight, the int8 weight stepping by one whenever the accumulator crosses +-1. The
float32 expressions follow the reference's order of operations, with the fused
multiply-adds nvcc emits (see `fma32`).

Adaptive noise: after the update each overlay entry (a matrix row or column, a vector
entry) grows by `inc` if any of its weights changed and shrinks by `dec` otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..config import Config, OptimizerConfig
from ..seeds import pair_seed
from .model import MAX_VAL, fma32
from .noise import noise_table
from .params import Slice, param_slices
from .state import OptimizerState

# Pairs handled per block when building votes: bounds the noise matrices' memory.
PAIR_BLOCK = 4096


# --- votes -------------------------------------------------------------------------


def _pair_blocks(cfg, fitness, step_seed):
    """(seeds, fitness) of the pairs with non-zero fitness, in blocks."""
    fitness = np.asarray(fitness, np.int64)
    active = np.nonzero(fitness)[0]
    for start in range(0, len(active), PAIR_BLOCK):
        pairs = active[start : start + PAIR_BLOCK]
        seeds = pair_seed(step_seed, pairs).astype(np.uint32)[:, None]
        yield seeds, fitness[pairs].astype(np.float64)[:, None]


def pair_noise(cfg, seeds, offset, idx):
    """noise[p, j]: pair p's perturbation noise entry idx[j] at a parameter's seed offset
    (seeds: the pairs' seeds as a column), in float64 for the vote products."""
    return noise_table(
        (seeds[:, 0] + np.uint32(offset & 0xFFFFFFFF)),
        np.asarray(idx, np.uint32),
        cfg.noise.perturb_mask,
        cfg.noise.perturb_distribution == "three_sample",
    ).astype(np.float64)


def matrix_votes(cfg, fitness, step_seed, off_a, off_b, rows, cols):
    """vote[k, j] = sum_p fitness_p * a_p[j] * b_p[k] for the listed rows k and cols j."""
    total = np.zeros((len(rows), len(cols)), np.float64)
    for seeds, fit in _pair_blocks(cfg, fitness, step_seed):
        a = pair_noise(cfg, seeds, off_a, cols) * fit
        b = pair_noise(cfg, seeds, off_b, rows)
        total += b.T @ a  # integers below 2^53: exact
    return total.astype(np.int64)


def vector_votes(cfg, fitness, step_seed, off_a, off_b, idx):
    total = np.zeros(len(idx), np.float64)
    for seeds, fit in _pair_blocks(cfg, fitness, step_seed):
        total += (
            fit * pair_noise(cfg, seeds, off_a, idx) * pair_noise(cfg, seeds, off_b, idx)
        ).sum(0)
    return total.astype(np.int64)


# --- the optimizers ------------------------------------------------------------------
#
# The contract: an optimizer takes one whole parameter slice (a matrix W[in, out] or a
# vector) with its vote and its state, and returns the new int8 weights, the new state
# and which weights changed. apply_update walks the parameters and calls it; nothing else
# knows which optimizer runs. An optimizer that needs the whole matrix (Muon) implements
# `step` on the matrix and says elementwise = False; AdamW and threshold SGD are
# elementwise: a direction per weight, then the quantized step (`quantize`).


@dataclass
class Moments:
    """One parameter's (or a region's) optimizer state: float32 arrays shaped like its
    weights (AdamW's first and second moments, and the fractional accumulator)."""

    m: np.ndarray
    v: np.ndarray
    acc: np.ndarray


class Optimizer(Protocol):
    # each weight's step reads its own vote and state alone, so that a region of a
    # parameter updates as the whole parameter would (scripts/conformance.py's slices)
    elementwise: bool

    def step(
        self, w: np.ndarray, vote: np.ndarray, state: Moments, lr: np.float32
    ) -> tuple[np.ndarray, Moments, np.ndarray]:
        """New int8 weights, new state and the changed-weight mask of one parameter from
        its int8 weights, its integer vote (same shape) and its state."""
        ...


class Elementwise(ABC):
    """An optimizer that moves each weight's float accumulator by -lr times a per-weight
    step direction; the weight moves by one where the accumulator crosses +-1."""

    elementwise = True

    def __init__(self, o: OptimizerConfig):
        self.o = o

    @abstractmethod
    def direction(self, g, wf, state: Moments):
        """The step direction x from the gradient g (the negated vote) and the weights wf,
        with the new moments (m, v)."""

    def step(self, w, vote, state: Moments, lr):
        g = -vote.astype(np.float32)
        x, m, v = self.direction(g, w.astype(np.float32), state)
        acc = fma32(-np.float32(lr), x, state.acc)
        w, acc, changed = quantize(w, acc)
        return w, Moments(m, v, acc), changed


class AdamW(Elementwise):
    """AdamW's step direction, in the reference's float32 order of operations."""

    def direction(self, g, wf, state: Moments):
        o, f = self.o, np.float32
        b1, b2 = f(o.beta1), f(o.beta2)
        m = fma32(b1, state.m, (f(1) - b1) * g)
        v = fma32(f(1) - b2, g * g, b2 * state.v)
        return fma32(f(o.weight_decay), wf, m / (np.sqrt(v) + f(o.eps))), m, v


class ThresholdSgd(Elementwise):
    """A scaled vote and weight decay; no moments."""

    def direction(self, g, wf, state: Moments):
        o, f = self.o, np.float32
        return fma32(f(o.weight_decay), wf, f(o.sgd_vote_scale) * g), state.m, state.v


# optimizer.kind -> its optimizer. The GPU's are in deggs/numerics/gpu/update.py.
OPTIMIZERS: dict[str, type[Elementwise]] = {"adamw": AdamW, "sgd": ThresholdSgd}


def make_optimizer(cfg: Config) -> Optimizer:
    return OPTIMIZERS[cfg.optimizer.kind](cfg.optimizer)


def optimizer_step(cfg: Config, w, m, v, acc, vote, lr):
    """One step of the config's optimizer on an array of weights; returns (w, m, v, acc,
    changed)."""
    w, state, changed = make_optimizer(cfg).step(w, vote, Moments(m, v, acc), lr)
    return w, state.m, state.v, state.acc, changed


def quantize(w, acc):
    """Move each weight one step where its accumulator crossed +-1 (clamped at +-127)."""
    w = w.astype(np.int64)
    up, down = acc >= 1, acc <= -1
    can_up, can_down = up & (w < MAX_VAL), down & (w > -MAX_VAL)
    acc = acc.copy()
    acc[can_up] -= np.float32(1)
    acc[up & ~can_up] = np.float32(1)
    acc[can_down] += np.float32(1)
    acc[down & ~can_down] = np.float32(-1)
    w = w + can_up - can_down
    return w.astype(np.int8), acc, can_up | can_down


def update_overlay(cfg: Config, overlay, changes):
    """Grow an overlay entry by inc where its weights changed, shrink by dec elsewhere."""
    a = cfg.adaptive_noise
    ov = overlay.astype(np.int64)
    ov = np.where(changes > 0, np.minimum(ov + a.inc, MAX_VAL), np.maximum(ov - a.dec, -MAX_VAL))
    return ov.astype(np.int8)


def update_region(
    cfg: Config,
    params,
    state: OptimizerState,
    s: Slice,
    fitness,
    step: int,
    step_seed: int,
    rows,
    cols=None,
):
    """Update rows (x cols, for a matrix) of one parameter slice in place: all of them
    (apply_update), or a region where the optimizer is elementwise.

    Weights and optimizer state change there; returns the changed-weight mask.
    """
    optimizer = make_optimizer(cfg)
    whole = len(rows) == s.shape[0] and (cols is None or len(cols) == s.shape[1])
    if not (whole or optimizer.elementwise):
        raise ValueError(f"{cfg.optimizer.kind} updates whole parameters only")
    lr = np.float32(cfg.learning_rate(step))
    if s.param.bias_lr:
        lr = lr * np.float32(cfg.optimizer.bias_lr_scale)
    if s.param.is_matrix:
        vote = matrix_votes(cfg, fitness, step_seed, s.off_a, s.off_b, rows, cols)
        region = np.ix_(rows, cols)
    else:
        vote = vector_votes(cfg, fitness, step_seed, s.off_a, s.off_b, rows)
        region = (rows,)
    arrays = [d[s.name][s.index] for d in (params, state.m, state.v, state.acc)]
    w, m, v, acc = (a[region] for a in arrays)
    w, moments, changed = optimizer.step(w, vote, Moments(m, v, acc), lr)
    for a, value in zip(arrays, (w, moments.m, moments.v, moments.acc), strict=True):
        a[region] = value
    return changed


def apply_update(
    cfg: Config, params, overlays, state: OptimizerState, fitness, step: int, step_seed: int
) -> int:
    """Update params, overlays and state in place from the fitness of `step`.

    Returns how many weights changed.
    """
    updates = 0
    for s in param_slices(cfg):
        rows = np.arange(s.shape[0])
        cols = np.arange(s.shape[1]) if s.param.is_matrix else None
        changed = update_region(cfg, params, state, s, fitness, step, step_seed, rows, cols)
        updates += int(changed.sum())
        if cfg.adaptive_noise.mode > 0:
            counts = (changed.sum(1), changed.sum(0)) if s.param.is_matrix else (changed,)
            for name, count in zip(s.param.overlays, counts, strict=True):
                overlays[name][s.index] = update_overlay(cfg, overlays[name][s.index], count)
    return updates
