"""A step as the coordinator tracks it: its chunks, its workers' figures, its record.

`StepState` is the step being trained: which chunks are pending, out (since when, with
whom) or in, what came back, and how each connection spent the step (`WorkerFigures`).
When the step is sealed, `step_record` makes its line in metrics.jsonl and
`format_step_line` / `format_workers_line` its two lines in the log.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from ..config import Config
from ..ternary import TRITS_PER_BYTE, pack_trits, packed_size, unpack_blocks
from .protocol import Evaluation, Health

LOSS_SCALE = 16  # the worker sums losses in Q.4 fixed point
NAMED_WORKERS = 8  # workers the per-step line names: the slowest half, then the most idle
WORST_NAMED = 5  # saturated matrices a health warning names

log = logging.getLogger("deggs.runtime.coordinator")


@dataclass(slots=True)
class WorkerFigures:
    """How one connection spent a step: the chunks it returned and where its time went.

    It is busy while it holds at least one chunk, from the hand-out to its RESULT
    (overlapping chunks count once), and free otherwise: from its first request of the
    step, or its last RESULT, to the next chunk it gets, WAIT replies and round trips
    included. Time after its connection closed is neither.
    """

    free_since: float | None = None  # when it last became free; None while busy or gone
    busy_since: float = 0.0
    holding: set[int] = field(default_factory=set)  # chunks handed to it, not returned yet
    chunks: int = 0  # RESULTs that counted (the first for their chunk)
    returned: int = 0  # RESULTs for chunks it held, duplicates of re-assigned ones included
    busy_s: float = 0.0
    idle_s: float = 0.0

    def took(self, chunk: int, now: float):
        if not self.holding:
            self.busy_since = now
            if self.free_since is not None:
                self.idle_s += now - self.free_since
                self.free_since = None
        self.holding.add(chunk)

    def gave_back(self, chunk: int, now: float):
        """Its RESULT for `chunk`; a second one for the same chunk is no new work."""
        if chunk not in self.holding:
            return
        self.holding.remove(chunk)
        self.returned += 1
        if not self.holding:
            self.busy_s += now - self.busy_since
            self.free_since = now

    def left(self, now: float):
        """Its connection closed: the time spent so far stays, nothing more adds up."""
        if self.holding:
            self.busy_s += now - self.busy_since
            self.holding.clear()
        elif self.free_since is not None:
            self.idle_s += now - self.free_since
        self.free_since = None

    def record(self, now: float, member_tokens_per_chunk: int) -> dict:
        """Its line in metrics.jsonl when the step is sealed at `now`: a chunk still held
        is busy time until then (work that went to waste), a free worker idle time."""
        busy = self.busy_s + (now - self.busy_since if self.holding else 0.0)
        idle = self.idle_s + (now - self.free_since if self.free_since is not None else 0.0)
        return {
            "chunks": self.chunks,
            "member_tokens_per_s": (
                round(self.returned * member_tokens_per_chunk / busy, 1) if busy > 0 else 0.0
            ),
            "busy_s": round(busy, 6),
            "idle_s": round(idle, 6),
        }


@dataclass
class StepState:
    """Everything the coordinator tracks about the step being trained."""

    step: int
    seed: int
    started: float  # clock time the step began
    n_chunks: int
    chunk_pairs: int
    packed: list = field(
        default_factory=list
    )  # per chunk: the packed fitness of the RESULT that counted, or None
    pending: deque = field(default_factory=deque)  # chunks nobody holds, next first
    in_progress: OrderedDict = field(
        default_factory=OrderedDict
    )  # chunk -> time handed out, oldest first
    holders: dict = field(default_factory=dict)  # chunk in progress -> the Peers holding it
    n_done: int = 0
    sealing: bool = False  # every chunk is in; the step is being made durable
    sum_loss: int = 0
    transmissions: int = 0  # RESULTs for this step, duplicates included
    updates_total: int = 0
    updates_min: int | None = None
    updates_max: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    evaluation: Evaluation | None = None  # the validation loss, on eval.every_steps steps
    health: Health | None = None  # weight and activation statistics, on health_every_steps
    workers: dict[str, WorkerFigures] = field(default_factory=dict)  # by peer name
    drifted: dict[str, int] = field(default_factory=dict)  # worker -> the step it drifted at

    @classmethod
    def fresh(cls, config: Config, step: int, seed: int, now: float) -> StepState:
        t = config.training
        return cls(
            step=step,
            seed=seed,
            started=now,
            n_chunks=t.n_chunks,
            chunk_pairs=t.chunk_size // 2,
            packed=[None] * t.n_chunks,
            pending=deque(range(t.n_chunks)),
        )

    def oldest_out(self, now: float) -> tuple[int, float]:
        """The chunk out the longest (the only one that can have timed out first) and
        how long it has been out."""
        chunk, handed_out = next(iter(self.in_progress.items()))
        return chunk, now - handed_out

    @property
    def complete(self) -> bool:
        return self.n_done == self.n_chunks

    def fitness(self) -> np.ndarray:
        """The population's fitness (zeros for chunks not in yet), unpacked in one go."""
        return unpack_blocks(self._chunks_packed(), self.n_chunks, self.chunk_pairs)

    def packed_fitness(self) -> bytes:
        """The population's fitness packed as one run, as a checkpoint and a catch-up hold
        it. Where a chunk fills whole bytes (the default's 20,480 pairs), that is its
        chunks' own bytes end to end: 2 ms less of the seal, on every worker's clock."""
        if self.chunk_pairs % TRITS_PER_BYTE == 0:
            return self._chunks_packed()
        return pack_trits(self.fitness())

    def _chunks_packed(self) -> bytes:
        zeros = bytes(packed_size(self.chunk_pairs))
        return b"".join(zeros if p is None else p for p in self.packed)


def step_record(
    config: Config,
    s: StepState,
    now: float,
    calibration: tuple[float, float] | None,
    resumed_at: int | None,
) -> dict:
    """A sealed step's line in metrics.jsonl (`now`: the coordinator's clock)."""
    t, m = config.training, config.model
    elapsed = max(now - s.started, 1e-9)
    step_tokens = t.population_size * m.seq_len
    return {
        "step": s.step,
        "tokens": (s.step + 1) * step_tokens,
        "loss": s.sum_loss / (step_tokens * LOSS_SCALE),
        "sum_loss": s.sum_loss,
        "step_time_s": elapsed,
        "updates_total": s.updates_total,
        "updates_min": s.updates_min or 0,
        "updates_max": s.updates_max,
        "transmissions": s.transmissions,
        "tokens_per_s": step_tokens / elapsed,
        "lr": config.learning_rate(s.step),
        "bytes_sent": s.bytes_sent,
        "bytes_received": s.bytes_received,
        "time": time.time(),
        **validation_record(s),
        **bits_of(s.sum_loss / (step_tokens * LOSS_SCALE), calibration),
        **health_record(s),
        **({"drifted": s.drifted} if s.drifted else {}),
        # Its workers reported the update before the restart, to the lost step: its
        # updates_* say nothing of the weights changed (deggs-plot leaves them out).
        **({"resumed": True} if s.step == resumed_at else {}),
        "workers": {
            name: figures.record(now, t.chunk_size * m.seq_len)
            for name, figures in s.workers.items()
        },
    }


def validation_record(s: StepState) -> dict:
    ev = s.evaluation
    if ev is None:
        return {}
    return {
        "val_loss": ev.sum_loss / (ev.tokens * LOSS_SCALE),
        "val_bits_per_token": ev.nats / ev.tokens / math.log(2),
        "val_bits_per_byte": ev.nats / max(ev.text_bytes, 1) / math.log(2),
        "val_tokens": ev.tokens,
    }


def health_record(s: StepState) -> dict:
    if s.health is None:
        return {}
    return {
        "health": {
            e.name: {
                "mean": e.mean,
                "std": e.std,
                "saturation": e.saturation,
                "entropy": e.entropy,
            }
            for e in s.health.entries
        }
    }


def calibration(record: dict) -> tuple[float, float] | None:
    """(bits per unit of integer loss, bits per byte / bits per token) of a validation
    record (the val_ keys of a metrics line), or None without one.

    The integer loss has no exact conversion to bits: it floors the log-sum-exp to a
    power of two and counts the logit gap at 1/8 bit a unit, where softmax(logit /
    exp_scale) counts it at 1 / (exp_scale ln 2). The validation measures both on the
    same windows, so their ratio puts any integer loss on the validation's scale."""
    figures = [record.get(k) for k in ("val_loss", "val_bits_per_token", "val_bits_per_byte")]
    if not all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in figures):
        return None
    loss, bits, per_byte = (float(v) for v in figures)  # type: ignore[arg-type]
    return bits / loss, per_byte / bits


def bits_of(loss: float, calibration: tuple[float, float] | None) -> dict:
    """The training loss in bits per token and per byte, on the latest validation's scale."""
    if calibration is None:
        return {}
    per_unit, bytes_ratio = calibration
    return {"bits_per_token": loss * per_unit, "bits_per_byte": loss * per_unit * bytes_ratio}


def format_step_line(r: dict, prev_loss: float | None = None, population: int = 0) -> str:
    """The human summary of a finished step, after the reference's: the training loss
    (the mean over the step's perturbed members) and, on a validation step, the
    validation's (the unperturbed model's) in bits per token when there is a validation
    to convert it with, else the integer loss alone."""
    trend = (
        ""
        if prev_loss is None
        else (" v" if r["loss"] < prev_loss else " ^" if r["loss"] > prev_loss else " =")
    )
    members = f"mean of {population:,} perturbed members, " if population else ""
    if "bits_per_token" in r:
        # The trend beside the integer loss it compares: the bits move with each
        # validation's rescaling as well.
        loss = f"Train: {r['bits_per_token']:.3f} bits/token ({members}loss {r['loss']:.4f}{trend})"
    else:
        loss = f"Loss: {r['loss']:.4f}{trend}"
    if "val_bits_per_token" in r:
        loss += f" | Val: {r['val_bits_per_token']:.3f} bits/token (unperturbed model)"
    net = (r["bytes_sent"] + r["bytes_received"]) / r["step_time_s"] / 2**20
    return (
        f"Step {r['step']} | Tokens: {_humanize(r['tokens'], 1000, ['', ' K', ' M', ' B'])}"
        f" | {loss} | Time: {r['step_time_s'] * 1000:.2f} ms"
        f" | Updates: {r['updates_total']} (n={r['transmissions']}, max={r['updates_max']})"
        f" | Speed: {r['tokens_per_s']:.2f} tok/s"
        f" | LR: {r['lr']:.3f} | Net: {net:.2f} MB/s"
        f" (Tx: {_humanize(r['bytes_sent'], 1024, [' B', ' KB', ' MB', ' GB'])},"
        f" Rx: {_humanize(r['bytes_received'], 1024, [' B', ' KB', ' MB', ' GB'])})"
    )


def format_workers_line(workers: dict) -> str:
    """One line on the workers of a finished step, naming at most NAMED_WORKERS: the
    slowest first, then the most idle of the rest, so that a slow GPU or one starved of
    work shows however many there are."""
    by_speed = sorted(workers, key=lambda name: workers[name]["member_tokens_per_s"])
    slowest = by_speed[: NAMED_WORKERS // 2]
    most_idle = sorted(by_speed[len(slowest) :], key=lambda name: -workers[name]["idle_s"])
    named = slowest + most_idle[: NAMED_WORKERS - len(slowest)]
    parts = [f"Workers {len(workers)}"]
    for name in named:
        w = workers[name]
        speed = _humanize(round(w["member_tokens_per_s"]), 1000, ["", " K", " M", " B"])
        chunks = f"{w['chunks']} chunk{'' if w['chunks'] == 1 else 's'}"
        parts.append(f"{name} {chunks} {speed} tok/s idle {w['idle_s']:.2f} s")
    if len(workers) > len(named):
        parts.append(f"and {len(workers) - len(named)} more")
    return " | ".join(parts)


def _humanize(n: int, base: int, units: list[str]) -> str:
    for power in range(len(units) - 1, 0, -1):
        if n >= base**power:
            return f"{n / base**power:.2f}{units[power]}"
    return f"{n}{units[0]}"


def log_validation(ev: Evaluation, who: str):
    log.info(
        "validation at step %d: loss %.4f, %.4f bits/token, %.4f bits/byte (%d windows, from %s)",
        ev.step,
        ev.sum_loss / (ev.tokens * LOSS_SCALE),
        ev.nats / ev.tokens / math.log(2),
        ev.nats / max(ev.text_bytes, 1) / math.log(2),
        ev.windows,
        who,
    )


def log_health(report: Health, limit: float, who: str):
    """A line on a health report, and a warning naming the matrices saturated past
    `limit` (eval.saturation_warning)."""
    by_share = sorted(report.entries, key=lambda e: e.saturation, reverse=True)
    least = min(report.entries, key=lambda e: e.entropy)
    log.info(
        "health at step %d: %d entries, most saturated %s (%.2f%%), lowest entropy %s "
        "(%.2f bits) (from %s)",
        report.step,
        len(report.entries),
        by_share[0].name,
        100 * by_share[0].saturation,
        least.name,
        least.entropy,
        who,
    )
    over = [e for e in by_share if e.saturation > limit]
    if over:
        named = ", ".join(f"{e.name} {100 * e.saturation:.2f}%" for e in over[:WORST_NAMED])
        log.warning(
            "saturation at step %d above eval.saturation_warning = %g%% in %d of %d: %s%s",
            report.step,
            100 * limit,
            len(over),
            len(report.entries),
            named,
            ", ..." if len(over) > WORST_NAMED else "",
        )
