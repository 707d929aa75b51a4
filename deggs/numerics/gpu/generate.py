"""Generation on the device (sampling.py's generate, bit for bit): the forward's row
kernels run the one sequence as a single member of sign 0 (no perturbation), the
prompt's positions together and then each new position alone, with a key/value cache per
layer; cached_attention attends over the cache and choose_token samples the next token
into the token buffer on the device, so nothing returns to the host until the end.

Its row buffers and its RoPE table are its own: a generation longer than any before
makes a longer table here, and the training forward's are never touched. A shape's
launches (some 45 a position, one row each: bound by the host, not the GPU) are
captured once as a CUDA graph and replayed with each call's prompt and seed.

A generation runs on a stream of its own at the highest priority, so that it fills the
gaps of whatever the backend's stream runs meanwhile (a worker's chunk) instead of
waiting behind it: on an H100 a default generation beside a chunk added about 1 ms to
it, against 11 ms one after the other. It reads the weights as the work queued on the
backend's stream before it leaves them, and the backend's next update waits for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...config import Config
from ..model import make_tables
from ..sampling import sampler_limits
from .cuda import DeviceArray, Launcher, capture_graph, cp
from .forward import Batch, Cache, Forward, Rows
from .plan import STATIC_SHARED, Plan

log = logging.getLogger(__name__)


# Shapes of generation whose buffers and graph are kept (a worker's samples are one shape)
KEPT_SHAPES = 4
# Longer generations launch eagerly: a graph of theirs would hold millions of launches
GRAPH_POSITIONS = 1024


@dataclass
class Shape:
    """A generation of one shape (`first` positions run together, `total` in all): its
    token buffer, seed, key/value caches and, once captured, the CUDA graph of its
    launches, replayed with each call's prompt and seed written into the buffers. The
    graph is captured on the shape's second call: a one-off generation (deggs-generate)
    launches eagerly."""

    tokens: DeviceArray
    seed: DeviceArray
    layers: list[tuple[DeviceArray, DeviceArray]]
    graph: Any = None
    calls: int = 0


# The device's highest stream priority: CUDA clamps one beyond its range to its end
HIGHEST_PRIORITY = -1000


class Generate:
    def __init__(self, cfg: Config, plan: Plan, launch: Launcher, forward: Forward, use_graph=True):
        self.cfg, self.plan, self.launch, self.forward = cfg, plan, launch, forward
        self.stream = cp.cuda.Stream(non_blocking=True, priority=HIGHEST_PRIORITY)
        launch.blas.own_workspace(self.stream)  # its GEMMs run beside a chunk's
        self.done = None  # an event at the end of the generation last started
        self.pinned: np.ndarray | None = None  # its host buffers
        self.rows: Rows | None = None  # made for the longest prompt so far
        self.seed = None  # one member's seed and sign (0: the unperturbed model)
        self.sign = None
        self.rope = forward.rope  # RoPE table of `self.positions` positions
        self.positions = forward.rope_positions
        # by (first, total), oldest first; their graphs read self.rows and self.rope, so
        # new ones of those drop them
        self.shapes: dict[tuple[int, int], Shape] = {}
        self.use_graph = use_graph  # False (or once a capture failed): eager launches

    def forget_graphs(self) -> None:
        """The captured graphs point at the state's arrays: after `state.load`, capture
        again."""
        self.shapes.clear()

    def _rope_for(self, total: int):
        """A RoPE table covering `total` positions (its own, longer, where needed)."""
        if total > self.positions:
            tables = make_tables(self.cfg, total)
            self.rope = cp.asarray(tables.rope.astype(np.int32).ravel())
            self.positions = total
            self.shapes.clear()
        return self.rope

    def __call__(self, prompt, seed: int, n_tokens: int | None = None) -> np.ndarray:
        """Prompt followed by n_tokens sampled tokens, as deggs.numerics.sampling.generate."""
        return self.start(prompt, seed, n_tokens)()

    def start(
        self, prompt, seed: int, n_tokens: int | None = None, after=None
    ) -> Callable[[], np.ndarray]:
        """`__call__`, started behind the work queued so far on the stream `after`; the
        function returned waits for the tokens and returns them."""
        cfg = self.cfg
        n_tokens = cfg.sampling.generate_tokens if n_tokens is None else n_tokens
        prompt = np.asarray(prompt, np.int64)
        total = len(prompt) + n_tokens
        buffer = np.zeros(total, np.int64)
        buffer[: len(prompt)] = prompt
        first = max(len(prompt), 1)  # positions run together before the first choice
        if total <= first:
            return lambda: buffer
        if total >= 1 << 16:
            raise ValueError(f"{total} positions: the gpu's choose_token counts in 16 bits")
        attention = self.launch.kernels["cached_attention"].function
        if 4 * total + attention.shared_size_bytes > STATIC_SHARED:  # a word a visible key
            attention.max_dynamic_shared_size_bytes = 4 * total
        if self.done is not None:
            self.done.synchronize()  # before the last one's pinned buffers are let go
        # in pinned memory, so that no copy waits for the stream: the prompt and the seed
        # in, the tokens out (kept until the next start, in case no one waits for these)
        words = 2 * total + 1  # (the pool's block may be longer)
        pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * words), np.int32, words)
        staged, host = pinned[: total + 1], pinned[total + 1 :]
        staged[:total] = buffer
        staged[total:].view(np.uint32)[0] = seed & 0xFFFFFFFF
        self.pinned = pinned
        if after is not None:
            self.stream.wait_event(after.record())
        try:
            self._launch(staged, host, first, total)
        finally:  # what was queued, even a part, is what the next start and update wait for
            self.done = done = self.stream.record()

        def finish() -> np.ndarray:
            done.synchronize()
            return host.astype(np.int64)

        return finish

    def _launch(self, staged, host, first: int, total: int) -> None:
        """The generation's copies and launches on the stream (see start)."""
        m = self.cfg.model
        with self.stream:
            rope = self._rope_for(total)  # (uploaded on the stream that reads it)
            if self.rows is None or self.rows.n < first:
                words = max(self.forward.product_words(first, whole=False), m.vocab_size)
                self.rows = self.forward.make_rows(first, words)
                self.seed = cp.zeros(1, cp.uint32)
                self.sign = cp.zeros(1, cp.int32)  # sign 0: the unperturbed model
                self.shapes.clear()
            shape = self._shape(first, total)
            shape.calls += 1
            shape.tokens.data.copy_from_host_async(staged.ctypes.data, 4 * total, self.stream)
            shape.seed.data.copy_from_host_async(staged[total:].ctypes.data, 4, self.stream)
            if shape.graph is None and self._capturable(shape, total - first):
                self._capture(shape, first, total, rope)
            if shape.graph is not None:
                shape.graph.launch(self.stream)
            else:
                self._positions(shape, first, total, rope)
            shape.tokens.data.copy_to_host_async(host.ctypes.data, host.nbytes, self.stream)

    def _shape(self, first: int, total: int) -> Shape:
        """The kept buffers of this shape, made (and the oldest shape dropped) if new."""
        shape = self.shapes.pop((first, total), None)
        if shape is None:
            m = self.cfg.model
            layers = [
                (cp.zeros(total * m.hidden_dim, cp.int8), cp.zeros(total * m.hidden_dim, cp.int8))
                for _ in range(m.n_layers)
            ]
            shape = Shape(cp.zeros(total, cp.int32), cp.zeros(1, cp.uint32), layers)
            while len(self.shapes) >= KEPT_SHAPES:
                self.shapes.pop(next(iter(self.shapes)))
        self.shapes[first, total] = shape  # the newest last
        return shape

    def _capturable(self, shape: Shape, positions: int) -> bool:
        """Whether to capture the shape's graph now: from its second call, for at most
        GRAPH_POSITIONS positions, not while the launches are being timed one by one
        (Launcher.start_profile), and unless a capture failed before."""
        if not self.use_graph or self.launch.profile is not None:
            return False
        return shape.calls >= 2 and positions <= GRAPH_POSITIONS

    def _capture(self, shape: Shape, first: int, total: int, rope) -> None:
        """Capture the shape's launches as a CUDA graph; on failure log why and launch
        eagerly from now on (slower, the same bits)."""
        try:
            body = lambda: self._positions(shape, first, total, rope)
            shape.graph = capture_graph(self.stream, body)
        except Exception as e:  # pragma: no cover - depends on the CUDA stack
            self.use_graph = False
            log.warning("could not capture a generation as a CUDA graph (%s): launching eagerly", e)

    def _positions(self, shape: Shape, first: int, total: int, rope) -> None:
        """Every position's launches: the prompt's first positions together, then one
        position at a time, each followed by its choice of the next token."""
        cfg, rows = self.cfg, self.rows
        assert rows is not None
        m, s = cfg.model, cfg.sampling
        penalty, min_p_limit = sampler_limits(cfg)
        d = m.hidden_dim
        table = self.forward.state.weights["embedding"]
        start = 0
        for t in range(first - 1, total - 1):
            seq = t + 1 - start
            batch = Batch(rows, self.seed, self.sign, members=1, positions=seq)
            self.forward.hidden(batch, shape.tokens[start:], Cache(shape.layers, start, rope))
            self.launch.project(table, rows.y[(seq - 1) * d :], rows.g, m.vocab_size, 1, d)
            self.launch(
                "choose_token",
                (1,),
                (self.plan.defines["CT_THREADS"],),
                g=rows.g,
                tokens=shape.tokens,
                t=t,
                seed=shape.seed,
                penalty=penalty,
                temperature=s.temperature,
                min_p_limit=min_p_limit,
                exp_tab=self.forward.exp,
            )
            start = t + 1
