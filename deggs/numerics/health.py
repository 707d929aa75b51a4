"""Model health: how the int8 weights and activations use their 256 values.

The counterpart of the reference's debug printer. For every weight matrix and vector (each
layer's copy on its own) and for a few activations of the unperturbed model:

- mean and standard deviation;
- saturation: the share of entries at +-127, where a weight can move only one way and an
  activation has been clipped;
- bit entropy: the Shannon entropy, in bits, of the histogram of the 256 int8 values
  (0: one value everywhere; 8: every value equally often), how much of int8's range is used.

Entries are named after params.py: "embedding", "layers.3.w_up"; activations "act.NAME".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import Config
from .params import HEALTH_ACTIVATIONS, param_slices

SATURATED = 127


@dataclass(frozen=True)
class Stats:
    mean: float
    std: float
    saturation: float  # share of entries with |value| >= 127
    entropy: float  # bits, 0..8


def int8_stats(values: np.ndarray) -> Stats:
    """The four figures of an array of int8-range integers (any integer dtype)."""
    v = np.asarray(values).ravel()
    if v.size == 0:
        raise ValueError("no values")
    if not np.issubdtype(v.dtype, np.integer) or v.min() < -128 or v.max() > 127:
        raise ValueError(f"values must be int8 integers, got {v.dtype} in [{v.min()}, {v.max()}]")
    # Everything from the 256-bin histogram of exact counts. The mean is an exact integer
    # sum divided once, so it cannot round past the int8 range a coordinator checks.
    counts = np.bincount(v.astype(np.int64) + 128, minlength=256)
    levels = np.arange(-128, 128, dtype=np.int64)
    mean = int(counts @ levels) / v.size
    p = counts / v.size
    std = float(np.sqrt(p @ (levels - mean) ** 2))
    saturation = int(counts[np.abs(levels) >= SATURATED].sum()) / v.size
    used = p[p > 0]
    entropy = float((used * np.log2(1 / used)).sum())  # log2(1/p), not -log2(p): no -0.0
    # Rounding can leave the sum a hair outside [0, 8]; the figure itself cannot be.
    return Stats(mean, std, saturation, min(max(entropy, 0.0), 8.0))


def entry_name(name: str, layer: int | None) -> str:
    return name if layer is None else f"layers.{layer}.{name}"


def weight_health(cfg: Config, params: dict[str, np.ndarray]) -> dict[str, Stats]:
    """Every parameter slice's figures, in the reference's order (params.param_slices)."""
    return {
        entry_name(s.name, s.layer): int8_stats(params[s.name][s.index]) for s in param_slices(cfg)
    }


def activation_health(
    cfg: Config, params: dict[str, np.ndarray], overlays: dict[str, np.ndarray], tokens
) -> dict[str, Stats]:
    """The unperturbed model's int8 activations on windows of tokens [window, position]:
    the embedded tokens entering the first block and the final normed hidden state the
    head reads. Computed with the CPU specification from the weights whatever backend
    trains them (the backends expose logits only, and a few windows are cheap)."""
    # Here, not at the top: the coordinator reads this module's names without numba.
    from .model import KVCache, Weights, embed, forward, make_tables

    tokens = np.asarray(tokens, np.int64)
    windows, length = tokens.shape
    weights = Weights(cfg, params, overlays, None)
    positions = np.arange(length)
    cache = KVCache.empty(cfg, windows, length)
    normed = forward(cfg, make_tables(cfg, length), weights, tokens, cache, positions)
    stats = (int8_stats(embed(cfg, weights, tokens)), int8_stats(normed))
    return dict(zip(HEALTH_ACTIVATIONS, stats, strict=True))
