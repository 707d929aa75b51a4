"""The update: from a step's whole-population fitness to new int8 weights.

Every worker rebuilds the same update from the fitness alone, since it can regenerate
every pair's noise. A weight's "vote" is the fitness-weighted sum of its noise over the
pairs: for W[k, j], vote = sum_p fitness_p * a_p[j] * b_p[k], which is the matrix
product B^T diag(fitness) A (exact in float64 BLAS). The vote drives a quantized AdamW:
float32 moments and a fractional accumulator per weight, the int8 weight stepping by one
whenever the accumulator crosses +-1. The float32 expressions follow the reference's
order of operations, with the fused multiply-adds nvcc emits (see `fma32`).

Adaptive noise: after the update each overlay entry (a matrix row or column, a vector
entry) grows by `inc` if any of its weights changed and shrinks by `dec` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import Config
from .model import LAYER_SEED_STRIDE, MAX_VAL, SEED, param_shapes
from .noise import noise_table

# Pairs handled per block when building votes: bounds the noise matrices' memory.
PAIR_BLOCK = 4096


@dataclass(frozen=True)
class Update:
    """How one parameter (one layer's slice of it) is updated."""
    name: str
    layer: int | None
    off_a: int          # seed offset of the output-side (or first) noise
    off_b: int          # seed offset of the input-side (or second) noise
    overlays: tuple     # (row overlay, col overlay) for matrices, (overlay,) for vectors
    bias_lr: bool = False

    @property
    def is_matrix(self) -> bool:
        return len(self.overlays) == 2


def update_plan(cfg: Config) -> list[Update]:
    """Every parameter slice with its noise seeds and overlays."""
    d = cfg.model.hidden_dim

    def vec(name, key, layer=None, bias_lr=False):
        base = 0 if layer is None else layer * LAYER_SEED_STRIDE
        return Update(name, layer, base + SEED[f"{key}_a"], base + SEED[f"{key}_b"], (name,), bias_lr)

    def mat(name, key, layer=None):
        base = 0 if layer is None else layer * LAYER_SEED_STRIDE
        return Update(name, layer, base + SEED[f"{key}_a"], base + SEED[f"{key}_b"],
                      (f"{name}_row", f"{name}_col"))

    plan = [
        # the embedding is W[hidden, vocab]: its rows are the overlay's "col" side
        Update("embedding", None, SEED["emb"], SEED["emb"] + d, ("embedding_col", "embedding_row")),
        vec("emb_bias", "emb_bias", bias_lr=True),
        vec("ln_init", "ln_init"), vec("ln_init_bias", "ln_init_bias"),
        mat("w_emb_mlp_up", "emb_mlp_up"), vec("mlp_emb_bias_up", "emb_mlp_bias_up"),
        mat("w_emb_mlp_down", "emb_mlp_down"), vec("mlp_emb_bias_down", "emb_mlp_bias_down"),
    ]
    for layer in range(cfg.model.n_layers):
        plan += [
            vec("ln_1", "ln_1", layer), vec("ln_1_bias", "ln_1_bias", layer),
            mat("w_q", "q", layer), mat("w_k", "k", layer),
            mat("w_v", "v", layer), mat("w_o", "o", layer),
            vec("ln_2", "ln_2", layer), vec("ln_2_bias", "ln_2_bias", layer),
            mat("w_up", "mlp_up", layer), vec("mlp_bias_up", "mlp_bias_up", layer),
            mat("w_down", "mlp_down", layer), vec("mlp_bias_down", "mlp_bias_down", layer),
        ]
    plan += [vec("ln_f", "ln_f"), vec("ln_f_bias", "ln_f_bias")]
    return plan


@dataclass
class OptimizerState:
    """AdamW moments and fractional accumulators, float32, shaped like the parameters."""
    m: dict
    v: dict
    acc: dict

    @classmethod
    def zeros(cls, cfg: Config) -> "OptimizerState":
        shapes = param_shapes(cfg)
        z = lambda: {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        return cls(z(), z(), z())


# --- votes -------------------------------------------------------------------------

def _pair_blocks(cfg, fitness, step_seed):
    """(seeds, fitness) of the pairs with non-zero fitness, in blocks."""
    fitness = np.asarray(fitness, np.int64)
    active = np.nonzero(fitness)[0]
    for start in range(0, len(active), PAIR_BLOCK):
        pairs = active[start:start + PAIR_BLOCK]
        seeds = ((step_seed + pairs) & 0xFFFFFFFF).astype(np.uint32)[:, None]
        yield seeds, fitness[pairs].astype(np.float64)[:, None]


def _noise(cfg, seeds, offset, idx):
    return noise_table((seeds[:, 0] + np.uint32(offset & 0xFFFFFFFF)), np.asarray(idx, np.uint32),
                       cfg.noise.perturb_mask,
                       cfg.noise.perturb_distribution == "three_sample").astype(np.float64)


def matrix_votes(cfg, fitness, step_seed, off_a, off_b, rows, cols):
    """vote[k, j] = sum_p fitness_p * a_p[j] * b_p[k] for the listed rows k and cols j."""
    total = np.zeros((len(rows), len(cols)), np.float64)
    for seeds, fit in _pair_blocks(cfg, fitness, step_seed):
        a = _noise(cfg, seeds, off_a, cols) * fit
        b = _noise(cfg, seeds, off_b, rows)
        total += b.T @ a  # integers below 2^53: exact
    return total.astype(np.int64)


def vector_votes(cfg, fitness, step_seed, off_a, off_b, idx):
    total = np.zeros(len(idx), np.float64)
    for seeds, fit in _pair_blocks(cfg, fitness, step_seed):
        total += (fit * _noise(cfg, seeds, off_a, idx) * _noise(cfg, seeds, off_b, idx)).sum(0)
    return total.astype(np.int64)


# --- the quantized optimizer step ---------------------------------------------------

def fma32(a, b, c):
    """float32 fused multiply-add: the float32 product is exact in float64, one rounding."""
    return (np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32).astype(np.float64)
            + np.asarray(c, np.float32).astype(np.float64)).astype(np.float32)


def optimizer_step(cfg: Config, w, m, v, acc, vote, lr):
    """One AdamW (or threshold-SGD) step on int8 weights; returns (w, m, v, acc, changed)."""
    o = cfg.optimizer
    f = np.float32
    g = -vote.astype(np.float32)
    wf = w.astype(np.float32)
    if o.kind == "adamw":
        b1, b2 = f(o.beta1), f(o.beta2)
        m = fma32(b1, m, (f(1) - b1) * g)
        v = fma32(f(1) - b2, g * g, b2 * v)
        x = fma32(f(o.weight_decay), wf, m / (np.sqrt(v) + f(o.eps)))
    else:
        x = fma32(f(o.weight_decay), wf, f(o.sgd_vote_scale) * g)
    acc = fma32(-f(lr), x, acc)
    w, acc, changed = quantize(w, acc)
    return w, m, v, acc, changed


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


def update_region(cfg: Config, params, state: OptimizerState, u: Update, fitness, step: int,
                  step_seed: int, rows, cols=None):
    """Update rows (x cols, for a matrix) of one parameter slice in place.

    Weights and optimizer state change there; returns the changed-weight mask.
    """
    sel = (slice(None),) if u.layer is None else (u.layer,)
    lr = np.float32(cfg.learning_rate(step))
    if u.bias_lr:
        lr = lr * np.float32(cfg.optimizer.bias_lr_scale)
    if u.is_matrix:
        vote = matrix_votes(cfg, fitness, step_seed, u.off_a, u.off_b, rows, cols)
        region = np.ix_(rows, cols)
    else:
        vote = vector_votes(cfg, fitness, step_seed, u.off_a, u.off_b, rows)
        region = (rows,)
    arrays = [d[u.name][sel] for d in (params, state.m, state.v, state.acc)]
    *new, changed = optimizer_step(cfg, *(a[region] for a in arrays), vote, lr)
    for a, value in zip(arrays, new):
        a[region] = value
    return changed


def apply_update(cfg: Config, params, overlays, state: OptimizerState, fitness, step: int,
                 step_seed: int) -> int:
    """Update params, overlays and state in place from the fitness of `step`.

    Returns how many weights changed.
    """
    updates = 0
    for u in update_plan(cfg):
        sel = (slice(None),) if u.layer is None else (u.layer,)
        shape = params[u.name][sel].shape
        rows = np.arange(shape[0])
        cols = np.arange(shape[1]) if u.is_matrix else None
        changed = update_region(cfg, params, state, u, fitness, step, step_seed, rows, cols)
        updates += int(changed.sum())
        if cfg.adaptive_noise.mode > 0:
            counts = (changed.sum(1), changed.sum(0)) if u.is_matrix else (changed,)
            for name, count in zip(u.overlays, counts):
                overlays[name][sel] = update_overlay(cfg, overlays[name][sel], count)
    return updates
