"""What a replica holds besides its int8 weights and overlays: the optimizer's state.

Its own module, free of numba, so that the coordinator can read and check a snapshot
(runtime/snapshot.py) without the numerics' compiled code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import Config
from .params import param_shapes


@dataclass
class OptimizerState:
    """AdamW moments and fractional accumulators, float32, shaped like the parameters."""

    m: dict
    v: dict
    acc: dict

    @classmethod
    def zeros(cls, cfg: Config) -> OptimizerState:
        shapes = param_shapes(cfg)
        z = lambda: {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        return cls(z(), z(), z())
