"""The contract between an ES step and the hardware that computes it, and the registry.

A backend holds one model replica: the int8 weights, the adaptive-noise overlays and the
optimizer state, in the CPU backend's logical layouts when read (`params`, `overlays`,
`state`: the CPU backend's own arrays, copies fetched from the device on the GPU; write
them with `load_state`). The CPU backend (cpu.py) is the readable specification; the GPU backend
(gpu/) computes the same bits with CUDA kernels. A new backend implements `Backend`
and gets a row in `BACKENDS`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..config import Config

if TYPE_CHECKING:  # the registry itself stays light: `deggs worker --help` reads NAMES
    from .state import OptimizerState

log = logging.getLogger(__name__)


class Backend(Protocol):
    name: str
    cfg: Config

    def losses(
        self,
        data: np.ndarray,
        step: int,
        step_seed: int,
        members,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """int32 loss of each listed population member at a step; progress(members
        scored, members in all) after each batch the backend scores."""
        ...

    def start_losses(
        self, data: np.ndarray, step: int, step_seed: int, members
    ) -> Callable[[], np.ndarray]:
        """Start scoring members as `losses` does; returns a function that waits for the
        losses and returns them. A backend that runs asynchronously (the GPU) is left
        scoring meanwhile, so the caller can queue the next chunk behind this one; one
        that does not scores here. Call the function even when the losses are no longer
        wanted: until then the device may still be writing into the host memory it
        returns them in."""
        ...

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Integer logits [window, position, vocab] of the unperturbed model."""
        ...

    def update(self, fitness: np.ndarray, step: int, step_seed: int) -> int:
        """Apply a step's whole-population fitness; returns how many weights changed."""
        ...

    def start_update(self, fitness: np.ndarray, step: int, step_seed: int) -> Callable[[], int]:
        """Start `update`; returns a function that waits for it and returns how many
        weights changed. A backend that runs asynchronously (the GPU) queues it ahead of
        whatever comes next (the next step's chunks, which see the new weights) and
        returns at once; one that does not updates here."""
        ...

    def generate(self, prompt, seed: int, n_tokens: int | None = None) -> np.ndarray:
        """The prompt followed by n_tokens tokens sampled from the unperturbed model."""
        ...

    def start_generate(
        self, prompt, seed: int, n_tokens: int | None = None
    ) -> Callable[[], np.ndarray]:
        """Start `generate`; returns a function that waits for the tokens and returns
        them. A backend that runs asynchronously (the GPU) samples beside whatever it is
        given next (a chunk), from the weights as they are now; one that does not
        samples here."""
        ...

    def load_state(self, params: dict, overlays: dict, state: OptimizerState | None = None):
        """Replace the weights, overlays and (when given) the optimizer state."""
        ...

    @property
    def params(self) -> dict[str, np.ndarray]: ...

    @property
    def overlays(self) -> dict[str, np.ndarray]: ...

    @property
    def state(self) -> OptimizerState: ...


class BackendError(ValueError):
    """A backend that cannot run here, or cannot run this config."""


def _cpu(cfg: Config, threads: int | None) -> Backend:
    from .cpu import CpuBackend

    return CpuBackend(cfg, threads)


def _gpu(cfg: Config, threads: int | None) -> Backend:
    from .gpu import GpuBackend, why_no_gpu

    reason = why_no_gpu()
    if reason:
        raise BackendError(f"backend 'gpu' needs CuPy and a CUDA device: {reason}")
    try:
        return GpuBackend(cfg)
    except ValueError as e:  # a shape its kernels do not support
        raise BackendError(f"{e}; use --backend cpu") from None


BACKENDS = {"cpu": _cpu, "gpu": _gpu}
NAMES = ("auto", *BACKENDS)


def why_no_gpu() -> str:
    """Why the GPU backend cannot run here ("" where it can): deggs.numerics.gpu does not
    import, or CuPy does not, or it sees no CUDA device."""
    try:
        from .gpu import why_no_gpu as reason
    except ImportError as e:
        return f"deggs.numerics.gpu does not import ({e})"
    return reason()


def gpu_present() -> bool:
    """CuPy imports and sees a CUDA device (without building a backend)."""
    return not why_no_gpu()


def make_backend(cfg: Config, name: str = "auto", threads: int | None = None) -> Backend:
    """A backend by name; 'auto' is the GPU where CuPy sees one, else the CPU (and the
    log says why not the GPU).

    threads: how many CPU threads the CPU backend uses (default: every core)."""
    if name == "auto":
        reason = why_no_gpu()
        if reason:
            log.info("backend auto: the CPU, since %s", reason)
        name = "cpu" if reason else "gpu"
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r} (available: {', '.join(NAMES)})")
    return BACKENDS[name](cfg, threads)
