"""The update on the device (optimizer.py's apply_update, bit for bit): per parameter
slice, every pair's noise as int8 matrices [index, pair] (one side times the ternary
fitness) and every vote from one int8 GEMM (vectors: vector_votes), then the
optimizer's step on the whole slice and the overlays' update. The whole update is
captured once as a CUDA graph and replayed each step (step seed, learning rates and
fitness are read from device buffers).

A slice's noise entry j at pair p is noise(step_seed + p + off, j): every slice reads
one field of hashes at its own seed offset. So the matrices share two noise fields made
once a step (VoteGemm): each GEMM reads its larger side as a window of a field and
only the other side, times the fitness, is made for it.

The optimizer contract (as optimizer.py's on the CPU): an optimizer steps one whole
parameter slice, a matrix or a vector, from its vote and its state, in place; an
optimizer that needs the whole matrix (Muon) fits it as AdamW does. DEVICE_OPTIMIZERS
holds the device's, by optimizer.kind.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ...config import Config, OptimizerConfig
from ..params import Slice, param_slices
from .cuda import DeviceArray, Launcher, capture_graph, cp
from .plan import VOTE_PARAMS, VOTE_SPAN, VOTE_TILE
from .state import DeviceState

log = logging.getLogger(__name__)

# The seeds a vote GEMM sums over, where they are a window of the noise fields: the
# pairs and up to 15 more, rounded up to a multiple of this (cuBLAS's int8 GEMMs took half
# as long again at 16 over a multiple of 128)
GEMM_K_STEP = 256
# Zero bytes before and after the fitness: a window's fitness is read from pair -15 on,
# and up to pair k + 7 < pairs + GEMM_K_STEP + 8, in 8-byte words (update.cu's fitness_at)
FITNESS_PAD = 16, GEMM_K_STEP + 32


def at_layer(array: DeviceArray, layer: int | None) -> DeviceArray:
    """A per-layer parameter's slice of a layer (or the parameter itself: None)."""
    return array if layer is None else array[layer]


def vector_starts(slices: list[Slice]) -> tuple[dict[int, int], int]:
    """Where each vector slice's entries start in the vector votes (slice index -> start),
    and the entries in all."""
    starts, n = {}, 0
    for i, s in enumerate(slices):
        if not s.param.is_matrix:
            starts[i], n = n, n + math.prod(s.shape)
    return starts, n


@dataclass(frozen=True)
class VectorClusters:
    """The vector slices as vector_votes (update.cu) takes them: in clusters of up to
    VOTE_PARAMS slices of one seed distance d = off_b - off_a whose offsets lie within
    VOTE_SPAN of the cluster's first, off. `table`: int32 [clusters, VOTE_PARAMS + 1, 4],
    (off, span, count, d) then each slice's (off_a - off, entries, where its votes start,
    0), the longest first; offsets and d as uint32 bits."""

    table: DeviceArray
    span: int  # the widest cluster's offsets' span
    longest: int  # the longest slice's entries

    @classmethod
    def make(cls, slices: list[Slice], vector_at: dict[int, int]) -> VectorClusters:
        table = cls.layout(slices, vector_at)
        return cls(
            table=cp.asarray(table.view(np.int32)),
            span=int(table[:, 0, 1].max(initial=0)),
            longest=int(table[:, 1:, 1].max(initial=0)),
        )

    @staticmethod
    def layout(slices: list[Slice], vector_at: dict[int, int]) -> np.ndarray:
        """The table (uint32) of the vector slices `vector_at` names (index -> where its
        votes start)."""

        def d(s: Slice) -> int:
            return (s.off_b - s.off_a) & 0xFFFFFFFF

        def off(s: Slice) -> int:
            return s.off_a & 0xFFFFFFFF

        clusters: list[list[int]] = []  # slices' indices
        for i in sorted(vector_at, key=lambda i: (d(slices[i]), off(slices[i]))):
            first = slices[clusters[-1][0]] if clusters else None
            s = slices[i]
            if (
                first is not None
                and len(clusters[-1]) < VOTE_PARAMS
                and d(s) == d(first)
                and off(s) - off(first) <= VOTE_SPAN
            ):
                clusters[-1].append(i)
            else:
                clusters.append([i])
        table = np.zeros((len(clusters), VOTE_PARAMS + 1, 4), np.uint32)
        for z, c in enumerate(clusters):
            low, high = off(slices[c[0]]), off(slices[c[-1]])
            table[z, 0] = low, high - low, len(c), d(slices[c[0]])
            for k, i in enumerate(sorted(c, key=lambda i: -math.prod(slices[i].shape))):
                s = slices[i]
                table[z, k + 1] = off(s) - low, math.prod(s.shape), vector_at[i], 0
        return table


@dataclass(frozen=True)
class VoteGemm:
    """One int8 GEMM of the update: the votes of matrix slices `slices` (of one input
    size), vote[out, in] = sum_p fit_p a_p[out] b_p[in], a_p the noise at seeds step_seed
    + p + off_a and b_p at off_b, the slices' votes one after another.

    Where off_b = off_a + 1, both sides are windows of the step's fields (UpdateBuffers'
    field_a[j, c] = noise(step_seed + field_base + c, j), field_b the same at + 1): the
    GEMM sums over k seeds from `base` (off_a rounded down to 16, so that a window's rows
    stay 16-byte aligned for cuBLAS; k the pairs and 15 more, rounded up to a multiple of
    GEMM_K_STEP), reads side `shared`
    from its field, the larger ("b", the inputs, where equal), and makes the other for
    each slice, times the fitness of pair base + c - off_a (0 outside the pairs).
    Consecutive slices that read one input window take one GEMM, their output sides
    made one under another (a layer's q, k, v and o: one GEMM of 1,024 outputs, where
    four of 256 took 70% longer). Else (the embedding) both sides are made, over the
    pairs from off_a, the a side times the fitness."""

    slices: tuple[int, ...]
    base: int
    k: int
    shared: str | None
    inputs: int  # the slices' input size
    outputs: int  # their output sizes' sum


def vote_gemms(slices: list[Slice], pairs: int) -> list[VoteGemm]:
    """The vote GEMMs of the matrix slices, in their order."""
    window = -(-(pairs + 15) // GEMM_K_STEP) * GEMM_K_STEP  # from any off_a rounded down to 16
    gemms: list[VoteGemm] = []
    for i, s in enumerate(slices):
        if not s.param.is_matrix:
            continue
        n_in, n_out = s.shape
        if s.off_b != s.off_a + 1:
            gemms.append(VoteGemm((i,), s.off_a, pairs, None, n_in, n_out))
            continue
        g = VoteGemm((i,), s.off_a // 16 * 16, window, "b" if n_in >= n_out else "a", n_in, n_out)
        last = gemms[-1] if gemms else None
        if last and g.shared == last.shared == "b" and (g.base, n_in) == (last.base, last.inputs):
            g = dataclasses.replace(last, slices=last.slices + (i,), outputs=last.outputs + n_out)
            gemms.pop()
        gemms.append(g)
    return gemms


@dataclass(frozen=True)
class UpdateBuffers:
    """The update's device buffers, sized for the largest vote GEMM."""

    pairs: int  # the population's pairs, padded to 16 (noise_matrix takes 8 a thread)
    slices: list[Slice]
    fitness: DeviceArray  # int8 [pairs], FITNESS_PAD zero bytes around it (noise_matrix)
    seed: DeviceArray  # uint32 [1]: the step seed
    lr: DeviceArray  # float32 [2]: the learning rate, and times bias_lr_scale
    changes: DeviceArray  # uint64 [1]: weights changed
    vote: DeviceArray  # int32, a vote GEMM's votes
    vector_at: dict[int, int]  # slices' index -> where that vector slice's entries start
    vector_clusters: VectorClusters
    vector_vote: DeviceArray  # int32 [entries]: their votes
    vote_gemm: dict[int, tuple[VoteGemm, int]]  # slice index -> its GEMM, its votes' start
    field_base: int
    field_a: DeviceArray  # int8 [rows, width]: noise(step_seed + field_base + c, j)
    field_b: DeviceArray  # int8 [rows, width]: the same at seeds one further
    a: DeviceArray  # int8: a GEMM's output sides as made for it, [outputs, k]
    b: DeviceArray  # int8: its input side as made, [inputs, k]
    row_counts: DeviceArray  # int32: changes per input (a vector's entry)
    col_counts: DeviceArray  # int32: changes per output

    @classmethod
    def make(cls, cfg: Config) -> UpdateBuffers:
        n_pairs = cfg.training.n_pairs
        pairs = (n_pairs + 15) // 16 * 16
        peak = cfg.noise.perturb_bound**2
        if n_pairs * peak >= 2**31:
            raise NotImplementedError("votes could overflow int32 at this population")
        if peak >= 2**15:  # (the config's masks keep it at most 93^2)
            raise NotImplementedError(
                "vector_votes holds a product of two noise entries in 16 bits"
            )
        slices = param_slices(cfg)
        dims = [s.shape for s in slices]
        max_in = max(s[0] for s in dims)
        max_out = max((s[1] for s in dims if len(s) == 2), default=1)
        vector_at, n_entries = vector_starts(slices)
        gemms = vote_gemms(slices, pairs)
        vote_gemm = {}  # each matrix slice's GEMM and where its votes start in vote
        for g in gemms:
            at = 0
            for i in g.slices:
                vote_gemm[i], at = (g, at), at + math.prod(slices[i].shape)
        made_a = max((g.outputs * g.k for g in gemms if g.shared != "a"), default=0)
        made_b = max((g.inputs * g.k for g in gemms if g.shared != "b"), default=0)
        windows = [g for g in gemms if g.shared]
        base = min((g.base for g in windows), default=0)
        width = max((g.base - base + g.k for g in windows), default=0)
        rows_a = max((g.outputs for g in windows if g.shared == "a"), default=0)
        rows_b = max((g.inputs for g in windows if g.shared == "b"), default=0)
        before, after = FITNESS_PAD
        fitness = cp.zeros(before + pairs + after, cp.int8)
        return cls(
            pairs=pairs,
            slices=slices,
            fitness=fitness[before : before + pairs],
            seed=cp.zeros(1, cp.uint32),
            lr=cp.zeros(2, cp.float32),
            changes=cp.zeros(1, cp.uint64),
            vote=cp.empty(max((g.outputs * g.inputs for g in gemms), default=0), cp.int32),
            vector_at=vector_at,
            vector_clusters=VectorClusters.make(slices, vector_at),
            vector_vote=cp.empty(n_entries, cp.int32),
            vote_gemm=vote_gemm,
            field_base=base,
            field_a=cp.zeros((rows_a, width), cp.int8),
            field_b=cp.zeros((rows_b, width), cp.int8),
            a=cp.zeros(made_a, cp.int8),
            b=cp.zeros(made_b, cp.int8),
            row_counts=cp.zeros(max(max_in, max_out), cp.int32),
            col_counts=cp.zeros(max_out, cp.int32),
        )


@dataclass(frozen=True)
class DeviceParam:
    """One parameter slice on the device as an optimizer steps it: weights and state
    held [outer, inner] (a matrix Wt[out, in]: inner = its inputs; a vector: one row),
    `n` entries in all, and where its learning rate is (lr[lr_index])."""

    w: DeviceArray
    m: DeviceArray
    v: DeviceArray
    acc: DeviceArray
    n: int
    inner: int
    lr: DeviceArray
    lr_index: int


@dataclass(frozen=True)
class Changes:
    """Where a step counts its changed weights: per inner index, per outer index (None
    for a vector) and in total."""

    rows: DeviceArray
    cols: DeviceArray | None
    total: DeviceArray


class DeviceOptimizer(Protocol):
    def step(self, param: DeviceParam, vote, changes: Changes) -> None:
        """Step the whole slice in place from its vote (int32, [outer, inner]) and count
        the changed weights. Launches only: it runs inside the update's CUDA graph (no
        allocation, no host synchronisation)."""
        ...


def _slice_args(param: DeviceParam, vote, changes: Changes) -> dict:
    """What every optimizer kernel takes: the slice's weights and vote, its learning rate,
    and where the weights it changes are counted."""
    return dict(
        w=param.w,
        vote=vote,
        n=param.n,
        inner=param.inner,
        lr_buf=param.lr,
        lr_index=param.lr_index,
        row_counts=changes.rows,
        col_counts=changes.cols,
        changes=changes.total,
    )


class AdamWDevice:
    """optimizer.AdamW on the device (optimizer.cu's adamw_step)."""

    def __init__(self, o: OptimizerConfig, launch: Launcher):
        self.o, self.launch = o, launch

    def step(self, param: DeviceParam, vote, changes: Changes) -> None:
        o, f = self.o, np.float32
        self.launch(
            "adamw_step",
            ((param.n + 255) // 256,),
            (256,),
            **_slice_args(param, vote, changes),
            m=param.m,
            v=param.v,
            acc=param.acc,
            b1=f(o.beta1),
            omb1=f(1) - f(o.beta1),
            b2=f(o.beta2),
            omb2=f(1) - f(o.beta2),
            eps=f(o.eps),
            wd=f(o.weight_decay),
        )


class SgdDevice:
    """optimizer.ThresholdSgd on the device (optimizer.cu's sgd_step)."""

    def __init__(self, o: OptimizerConfig, launch: Launcher):
        self.o, self.launch = o, launch

    def step(self, param: DeviceParam, vote, changes: Changes) -> None:
        o, f = self.o, np.float32
        self.launch(
            "sgd_step",
            ((param.n + 255) // 256,),
            (256,),
            **_slice_args(param, vote, changes),
            acc=param.acc,
            wd=f(o.weight_decay),
            sgd_scale=f(o.sgd_vote_scale),
        )


# optimizer.kind -> its device optimizer (optimizer.OPTIMIZERS: the CPU's)
DEVICE_OPTIMIZERS: dict[str, type[AdamWDevice] | type[SgdDevice]] = {
    "adamw": AdamWDevice,
    "sgd": SgdDevice,
}


class UpdateCount:
    """How many weights an update queued on the stream changed: calling it waits for
    the update (once) and returns the count."""

    def __init__(self, done, host: np.ndarray):
        self.done, self.host = done, host
        self.value: int | None = None

    def __call__(self) -> int:
        if self.value is None:
            self.done.synchronize()
            self.value = int(self.host[0])
        return self.value


class Update:
    """The update of `state` from a step's fitness, captured as a CUDA graph (unless
    use_graph is False, or the capture fails: then it runs eagerly, and says so in the
    log and in `graph_error`)."""

    def __init__(
        self,
        cfg: Config,
        launch: Launcher,
        state: DeviceState,
        stream,
        use_graph: bool = True,
    ):
        self.cfg, self.launch, self.state, self.stream = cfg, launch, state, stream
        self.optimizer: DeviceOptimizer = DEVICE_OPTIMIZERS[cfg.optimizer.kind](
            cfg.optimizer, launch
        )
        self.use_graph = use_graph
        self.graph = None
        self.graph_error: str | None = None
        self._buffers: UpdateBuffers | None = None  # made at the first update
        # the changes' count of the update last started comes here (pinned: copied
        # while the stream runs on), read by its UpdateCount
        self._host = np.frombuffer(cp.cuda.alloc_pinned_memory(8), np.uint64, 1)
        self._count: UpdateCount | None = None

    @property
    def buffers(self) -> UpdateBuffers:
        if self._buffers is None:
            self._buffers = UpdateBuffers.make(self.cfg)
        return self._buffers

    def forget_graph(self) -> None:
        """The captured graph points at the state's arrays: after `state.load`, capture again."""
        self.graph = None

    def start(self, fitness, step: int, step_seed: int) -> UpdateCount:
        """Queue the update of `step` on the stream and return at once: whatever is
        queued behind it (the next step's chunks) sees the new weights, and the host
        prepares the next chunk while the GPU updates. The UpdateCount returned waits
        for the update and gives how many weights changed."""
        cfg = self.cfg
        fitness = np.asarray(fitness)
        if fitness.shape != (cfg.training.n_pairs,):
            raise ValueError(f"fitness must have {cfg.training.n_pairs} entries")
        if np.abs(fitness).max(initial=0) > 1:
            raise ValueError("the gpu update takes ternary fitness (-1, 0, 1)")
        if self._count is not None:
            self._count()  # its host word is about to be written again
        U = self.buffers
        fit = np.zeros(U.pairs, np.int8)
        fit[: len(fitness)] = fitness
        lr = np.float32(cfg.learning_rate(step))
        lrs = np.array([lr, lr * np.float32(cfg.optimizer.bias_lr_scale)], np.float32)
        done = cp.cuda.Event(disable_timing=True)
        with self.stream:
            # (from pageable memory: the copies take the host arrays before they return)
            U.fitness.set(fit, stream=self.stream)
            U.seed.set(np.array([int(step_seed) & 0xFFFFFFFF], np.uint32), stream=self.stream)
            U.lr.set(lrs, stream=self.stream)
            if self.use_graph and self.graph is None:
                self._capture()
            if self.graph is not None:
                self.graph.launch(self.stream)
            else:
                self.body()
            U.changes.data.copy_to_host_async(self._host.ctypes.data, 8, self.stream)
            done.record(self.stream)
        self._count = UpdateCount(done, self._host)
        return self._count

    def _capture(self) -> None:
        """Capture the update as a CUDA graph; on failure log why and run eagerly from
        now on (slower, the same bits)."""
        try:
            self.graph = capture_graph(self.stream, self.body)
        except Exception as e:  # pragma: no cover - depends on the CUDA stack
            self.graph_error = f"{type(e).__name__}: {e}"
            self.use_graph = False
            self.graph = None
            log.warning(
                "could not capture the update as a CUDA graph (%s): updating eagerly",
                self.graph_error,
            )

    def body(self) -> None:
        """Every slice's votes, optimizer step and overlays, then the core copies again."""
        U, state = self.buffers, self.state
        stream = cp.cuda.get_current_stream().ptr
        cp.cuda.runtime.memsetAsync(U.changes.data.ptr, 0, 8, stream)
        a_cfg = self.cfg.adaptive_noise
        self.vector_votes()
        self.noise_fields()
        for i, u in enumerate(U.slices):
            shape = u.shape
            arrays = (state.weights, state.m, state.v, state.acc)
            w, m, v, acc = (at_layer(d[u.name], u.layer) for d in arrays)
            n = math.prod(shape)
            if u.param.is_matrix:
                n_in, n_out = shape
                g, at = U.vote_gemm[i]
                if i == g.slices[0]:
                    a, lda, b, ldb = self.vote_operands(g, U.slices, U.a, U.b)
                    # vote[out, in] (row-major) = sum_p a_p[out] b_p[in], one side times fit_p
                    self.launch.gemm(b, a, U.vote, n_in, g.outputs, g.k, ldb, lda, n_in)
                vote, inner, cols = U.vote[at : at + n], n_in, U.col_counts
            else:
                at = U.vector_at[i]
                vote, inner, cols = U.vector_vote[at : at + n], n, None
            lr_index = int(u.param.bias_lr)
            param = DeviceParam(w, m, v, acc, n, inner, U.lr, lr_index)
            self.optimizer.step(param, vote, Changes(U.row_counts, cols, U.changes))
            if a_cfg.mode > 0:
                counts = [(u.param.overlays[0], U.row_counts, shape[0])]
                if u.param.is_matrix:
                    counts.append((u.param.overlays[1], U.col_counts, shape[1]))
                for name, count, size in counts:
                    self.launch(
                        "update_overlay",
                        ((size + 255) // 256,),
                        (256,),
                        ov=at_layer(state.overlays[name], u.layer),
                        counts=count,
                        n=size,
                        inc=a_cfg.inc,
                        dec=a_cfg.dec,
                    )
            else:
                rows, cols_ = U.row_counts, U.col_counts
                cp.cuda.runtime.memsetAsync(rows.data.ptr, 0, rows.nbytes, stream)
                cp.cuda.runtime.memsetAsync(cols_.data.ptr, 0, cols_.nbytes, stream)
        state.copy_cores()

    def noise_fields(self) -> None:
        """The step's two noise fields (VoteGemm), from one launch's hashes."""
        U = self.buffers
        if U.field_a.size or U.field_b.size:
            width = U.field_a.shape[1]
            self.noise_matrix(U.field_a, len(U.field_a), U.field_base, width, then=U.field_b)

    def vote_operands(self, g: VoteGemm, slices: list[Slice], a, b) -> tuple:
        """Make the sides of GEMM g's noise (of `slices`) that it does not read from the
        fields, into a and b, and return its operands: (the a side, its rows' stride, the
        b side, its rows' stride)."""
        U, first = self.buffers, slices[g.slices[0]]
        if g.shared is None:  # both sides made, over the pairs
            self.noise_matrix(b, g.inputs, first.off_b, g.k)
            self.noise_matrix(a, g.outputs, first.off_a, g.k, fitness=U.fitness)
            return a, g.k, b, g.k
        col, width = g.base - U.field_base, U.field_a.shape[1]
        if not 0 <= col <= width - g.k:
            raise ValueError(f"seeds {g.base}..{g.base + g.k} are not in the update's noise fields")
        if g.shared == "a":
            shift = g.base - first.off_a
            self.noise_matrix(b, g.inputs, g.base + 1, g.k, fitness=U.fitness, shift=shift)
            return U.field_a[:, col:], width, b, g.k
        row = 0  # the slices' output sides one under another
        for i in g.slices:
            s = slices[i]
            shift = g.base - s.off_a
            self.noise_matrix(
                a[row * g.k :], s.shape[1], g.base, g.k, fitness=U.fitness, shift=shift
            )
            row += s.shape[1]
        return a, g.k, U.field_b[:, col:], width

    def noise_matrix(
        self, out, n: int, off: int, pairs: int, fitness=None, shift: int = 0, then=None
    ) -> None:
        """out[j, p] = pair p's noise j at seed offset off (times the fitness of pair p +
        shift where given), for j < n and p < pairs (the rows' length); and then[j, p] its
        noise at off + 1, for j < len(then) (update.cu)."""
        n_then = 0 if then is None else len(then)
        self.launch(
            "noise_matrix",
            (-(-pairs // (8 * 256)), min(65535, max(1, max(n, n_then) // 8))),  # ~8 rows a thread
            (256,),
            out=out,
            then=then,
            fitness=fitness,
            shift=shift,
            step_seed=self.buffers.seed,
            off=off & 0xFFFFFFFF,
            n=n,
            n_then=n_then,
            pairs=pairs,
        )

    def vector_votes(self, clusters: VectorClusters | None = None, vote=None) -> None:
        """Every vector slice's votes (of `clusters`, into `vote`: by default the
        buffers') in one launch (update.cu): a block takes VOTE_TILE seeds of 256
        entries of a cluster."""
        U = self.buffers
        c = U.vector_clusters if clusters is None else clusters
        vote = U.vector_vote if vote is None else vote
        stream = cp.cuda.get_current_stream().ptr
        cp.cuda.runtime.memsetAsync(vote.data.ptr, 0, vote.nbytes, stream)
        if not len(c.table):
            return
        self.launch(
            "vector_votes",
            (-(-(U.pairs + c.span) // VOTE_TILE), -(-c.longest // 256), len(c.table)),
            (256,),
            vote=vote,
            fitness=U.fitness,
            step_seed=U.seed,
            clusters=c.table,
            pairs=U.pairs,
        )

    def set_inputs(self, fitness: np.ndarray, step_seed: int) -> None:
        """Put a step's fitness (padded to the buffers' pairs) and seed on the device
        without updating: for running the update's kernels one by one (scripts/kernels.py)."""
        U = self.buffers
        fit = np.zeros(U.pairs, np.int8)
        fit[: len(fitness)] = fitness
        U.fitness[...] = cp.asarray(fit)
        U.seed[...] = cp.asarray(np.array([step_seed & 0xFFFFFFFF], np.uint32))
