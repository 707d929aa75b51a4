"""What one replica holds on the device: the int8 weights, the adaptive-noise overlays,
the optimizer state, and the sm90a kernels' copies of their matrices (cores.CoreCopy).

`load` puts host arrays (the CPU backend's logical layouts) on the device; `save` (and
the `params`, `overlays`, `optimizer_state` views) fetch them back. On the device the
matrices are transposed, Wt[out, in] (K-contiguous for the GEMMs), and a layer's q, k
and v side by side, so that one GEMM projects all three.
"""

from __future__ import annotations

import numpy as np

from ...config import Config
from ..params import EMB_MLP, LAYER_MLP, MATRICES, PARAM, offsets, param_shapes
from ..state import OptimizerState
from .cores import (
    CoreCopy,
    core_pieces,
    in_hidden_order,
    residual_order,
    sliced_core_pieces,
    up_order,
)
from .cuda import DeviceArray, Launcher, cp
from .plan import TILE_N, Plan

QKV = ("w_q", "w_k", "w_v")  # one GEMM projects a layer's three


def to_device_layout(name: str, arr: np.ndarray) -> np.ndarray:
    """Matrices [.., in, out] -> [.., out, in] (K-contiguous for the GEMMs)."""
    if name in MATRICES:
        return np.ascontiguousarray(np.swapaxes(arr, -1, -2))
    return np.ascontiguousarray(arr)


def from_device_layout(name: str, arr: np.ndarray) -> np.ndarray:
    if name in MATRICES:
        return np.ascontiguousarray(np.swapaxes(arr, -1, -2))
    return arr


class DeviceState:
    """Weights (`weights`, by parameter name; `qkv` [layer, 3, out, in]), overlays,
    optimizer state (`m`, `v`, `acc`) and core copies (`cores`, by (name, layer)) on the
    device, for the kernels `plan` runs."""

    def __init__(self, cfg: Config, plan: Plan, launch: Launcher, stream):
        self.cfg, self.plan, self.launch, self.stream = cfg, plan, launch, stream
        self.weights: dict = {}
        self.qkv: DeviceArray = None
        self.overlays: dict = {}
        self.m: dict = {}
        self.v: dict = {}
        self.acc: dict = {}
        self.cores: dict[tuple[str, int | None], CoreCopy] = {}

    def load(self, params: dict, overlays: dict, state: OptimizerState | None = None) -> None:
        """Put weights, overlays and optimizer state (zeros where None) on the device, in
        new arrays (a captured update graph must be captured again)."""
        shapes = param_shapes(self.cfg)
        self.weights = {
            k: cp.asarray(to_device_layout(k, np.asarray(params[k], np.int8))) for k in shapes
        }
        # A layer's q, k and v matrices side by side ([layers, 3, out, in]), so that one
        # GEMM projects all three; the table's names keep views of their parts.
        self.qkv = cp.stack([self.weights[k] for k in QKV], axis=1)
        self.weights.update({k: self.qkv[:, i] for i, k in enumerate(QKV)})
        self.overlays = {
            k: cp.asarray(np.ascontiguousarray(v, np.int8)) for k, v in overlays.items()
        }
        if state is None:
            state = OptimizerState.zeros(self.cfg)
        on_device = lambda part: {
            k: cp.asarray(to_device_layout(k, np.asarray(part[k], np.float32))) for k in shapes
        }
        self.m, self.v, self.acc = on_device(state.m), on_device(state.v), on_device(state.acc)
        self.cores = self._core_copies()
        cp.cuda.Device().synchronize()  # the arrays above came on the current stream
        with self.stream:
            self.copy_cores()
        self.stream.synchronize()  # before any stream reads them

    def save(self) -> tuple[dict, dict, OptimizerState]:
        """Host copies of the weights, overlays and optimizer state (logical layouts)."""
        return self.params, self.host_overlays, self.optimizer_state

    @property
    def params(self) -> dict:
        self.stream.synchronize()
        return {k: from_device_layout(k, v.get()) for k, v in self.weights.items()}

    @property
    def host_overlays(self) -> dict:
        self.stream.synchronize()
        return {k: v.get() for k, v in self.overlays.items()}

    @property
    def optimizer_state(self) -> OptimizerState:
        self.stream.synchronize()
        fetch = lambda d: {k: from_device_layout(k, v.get()) for k, v in d.items()}
        return OptimizerState(fetch(self.m), fetch(self.v), fetch(self.acc))

    def param(self, name: str, layer: int | None = None):
        """A parameter on the device (this layer's copy), its overlays (a matrix's input
        and output side) and its noise offsets (a, b), by its table name."""
        per_layer = PARAM[name].per_layer
        pick = (lambda a: a[layer]) if per_layer else (lambda a: a)
        overlays = [pick(self.overlays[o]) for o in PARAM[name].overlays]
        at = layer if per_layer else None
        return pick(self.weights[name]), overlays, offsets(self.cfg, name, at)

    def _core_copies(self) -> dict[tuple[str, int | None], CoreCopy]:
        """The sm90 kernels' copies of their matrices (CoreCopy), by (name, layer), for
        the kernels the plan runs."""
        m, plan = self.cfg.model, self.plan
        d, layers = m.hidden_dim, range(m.n_layers)
        copies: dict[tuple[str, int | None], CoreCopy] = {}

        def keep(key, source, index, piece=16):
            copies[key] = CoreCopy(source, index, cp.empty(piece * index.size, cp.int8), piece)

        if plan.fused_qkv:
            index = cp.asarray(core_pieces(np.arange(3 * d), d))
            for layer in layers:
                keep(("qkv", layer), self.qkv[layer], index)
        if plan.fused_up:
            index = cp.asarray(core_pieces(up_order(d), d))
            for name, at in [(EMB_MLP.up, None), *((LAYER_MLP.up, layer) for layer in layers)]:
                keep((name, at), self.param(name, at)[0], index)
        slice_ = plan.defines["SLICE"]
        if plan.o_residual:  # its output features in residual_order
            index = cp.asarray(sliced_core_pieces(residual_order(d), d, slice_))
            for layer in layers:
                keep(("w_o", layer), self.param("w_o", layer)[0], index)
        # The down-projection's: its slices for down_residual_sm90 (output features in
        # residual_order), and where up_gelu_sm90 writes its input in hidden_order, its
        # inputs in that order (for cuBLAS, as a plain matrix otherwise)
        if plan.down_residual or plan.fused_up:
            pieces = (
                sliced_core_pieces(residual_order(d), 4 * d, slice_)
                if plan.down_residual
                else np.arange(d * d // 4)
            )
            piece = 1 if plan.fused_up else 16
            index = cp.asarray(in_hidden_order(pieces, 4 * d) if plan.fused_up else pieces)
            for name, at in [(EMB_MLP.down, None), *((LAYER_MLP.down, layer) for layer in layers)]:
                keep((name, at), self.param(name, at)[0], index, piece)
        if "head_loss_sm90" in plan.shared:
            rows = np.arange(-(-m.vocab_size // TILE_N) * TILE_N)  # whole tiles
            order = np.where(rows < m.vocab_size, rows, -1)
            keep(("embedding", None), self.weights["embedding"], cp.asarray(core_pieces(order, d)))
        return copies

    def copy_cores(self) -> None:
        """Make the sm90 kernels' copies again (after the weights changed; no allocation,
        so the update's graph captures it)."""
        for copy in self.cores.values():
            n = copy.index.size
            self.launch(
                "gather_pieces" if copy.piece == 16 else "gather_bytes",
                (-(-n // 256),),
                (256,),
                source=copy.source,
                index=copy.index,
                out=copy.out,
                n=n,
            )
