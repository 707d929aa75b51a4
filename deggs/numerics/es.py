"""One evolution-strategies step, top-down.

A step of training, as every worker, the replay and the checks run it:

    for each chunk of the population (on whichever worker it is handed to):
        losses  = backend.losses(data, step, seed, the chunk's members)
        fitness = chunk_fitness(losses)        # one trit per antithetic pair
        packed  = pack_trits(fitness)          # 5 pairs a byte: all that crosses the wire
    then on every worker, from the whole population's fitness:
        backend.update(fitness, step, seed)    # every pair's noise regenerated, AdamW
        step, seed = step + 1, next_step_seed(seed, step + 1)

Member 2i of the population adds pair i's noise to the weights, member 2i + 1 subtracts
it; a chunk is `chunk_size` consecutive members. `Trainer` holds one replica of the model
(a backend) with the step and seed it is at. Where one process scores every chunk
(`Trainer.score_population`), each chunk is started (`Backend.start_losses`) before the
fitness of the one ahead is taken, and the update is started (`Backend.start_update`)
before the next step's first chunk, so that a GPU does not wait for the host between
chunks or steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..config import Config
from ..seeds import next_step_seed
from ..ternary import pack_trits
from .backend import Backend
from .fitness import chunk_fitness
from .health import Stats, activation_health, weight_health
from .model import init_overlays, init_params, make_tables, sequence_loss
from .sampling import prompt_window
from .state import OptimizerState

GENERATION_SEED = 999  # a step's sample is drawn with the step seed + 999, as the reference
HEALTH_WINDOWS = 4  # validation windows the activations' health is measured on


@dataclass(frozen=True)
class ChunkResult:
    chunk: int
    losses: np.ndarray  # int32, one per member
    fitness: np.ndarray  # int32 in {-1, 0, 1}, one per pair
    sum_loss: int  # every member's loss added up
    packed: bytes  # the fitness as sent in a RESULT


@dataclass(frozen=True)
class Validation:
    """The unperturbed model on fixed validation windows."""

    windows: int
    tokens: int  # tokens predicted
    sum_loss: int  # the integer loss in the reference's units, summed
    nats: float  # cross-entropy of softmax(logit / exp_scale), the int8 logits' own scale
    text_bytes: int  # bytes of text the predicted tokens stand for


def validation_windows(cfg: Config, tokens: np.ndarray, n: int) -> np.ndarray:
    """n windows of seq_len + 1 tokens spread evenly over a validation stream (the same at
    every step, so the figures are comparable)."""
    width = cfg.model.seq_len + 1
    if len(tokens) < width:
        raise ValueError(f"{len(tokens)} validation tokens, fewer than seq_len + 1 = {width}")
    starts = np.linspace(0, len(tokens) - width, n).astype(np.int64)
    return np.asarray(tokens, np.int64)[starts[:, None] + np.arange(width)[None, :]]


def evaluate(backend: Backend, windows: np.ndarray, token_bytes=None) -> Validation:
    """The validation loss of a backend's unperturbed model; token_bytes[token] is the
    length of a token's text (None: one byte a token)."""
    cfg = backend.cfg
    tables = make_tables(cfg, 1)
    sum_loss, nats = 0, 0.0
    for window in windows:  # one at a time: a window's float logits are seq x vocab
        window = window[None, :]
        lgt = backend.logits(window[:, :-1])
        targets = window[:, 1:]
        sum_loss += int(sequence_loss(cfg, tables, lgt, targets).astype(np.int64).sum())
        z = lgt / cfg.softmax.exp_scale
        peak = z.max(-1)
        log_total = peak + np.log(np.exp(z - peak[..., None]).sum(-1))
        nats += float((log_total - np.take_along_axis(z, targets[..., None], -1)[..., 0]).sum())
    targets = windows[:, 1:]
    text_bytes = targets.size if token_bytes is None else int(token_bytes[targets].sum())
    return Validation(len(windows), targets.size, sum_loss, nats, text_bytes)


def chunk_members(cfg: Config, chunk: int) -> np.ndarray:
    c = cfg.training.chunk_size
    return np.arange(chunk * c, (chunk + 1) * c)


def chunk_result(cfg: Config, chunk: int, losses: np.ndarray) -> ChunkResult:
    """A chunk's fitness and its packed form, from its member losses."""
    result = chunk_fitness(cfg, losses)
    return ChunkResult(chunk, losses, result.fitness, result.sum_loss, pack_trits(result.fitness))


class Trainer:
    """A model replica at a step: a backend's weights, the step number and its seed."""

    def __init__(self, backend: Backend):
        """A fresh replica: the initial weights at step 0 and the config's first seed."""
        self.backend = backend
        self.cfg = backend.cfg
        self.step = 0
        self.seed = self.cfg.training.seed

    def restart(self):
        """Back to the initial weights and a zero optimizer state at step 0: a replica
        that must rebuild its model and has no snapshot to start from."""
        cfg = self.cfg
        self.backend.load_state(init_params(cfg), init_overlays(cfg), OptimizerState.zeros(cfg))
        self.step, self.seed = 0, cfg.training.seed

    def score_chunk(
        self, data: np.ndarray, chunk: int, progress: Callable[[int, int], None] | None = None
    ) -> ChunkResult:
        """A chunk's member losses at this step, their fitness and its packed form.

        progress(members scored, members in all) is called as the backend finishes each
        batch of members (Backend.losses)."""
        members = chunk_members(self.cfg, chunk)
        losses = self.backend.losses(data, self.step, self.seed, members, progress)
        return chunk_result(self.cfg, chunk, losses)

    def start_chunk(self, data: np.ndarray, chunk: int) -> Callable[[], ChunkResult]:
        """Start scoring a chunk (Backend.start_losses); returns the function that waits for
        its result. A GPU scores it while the caller does something else (a worker asks for
        its next chunk); call the function in any case, as start_losses says."""
        wait = self.backend.start_losses(data, self.step, self.seed, chunk_members(self.cfg, chunk))
        return lambda: chunk_result(self.cfg, chunk, wait())

    @property
    def asynchronous(self) -> bool:
        """Does start_chunk return before the chunk is scored (a GPU), so that other work
        overlaps it? The CPU backend scores inside it."""
        return self.backend.name != "cpu"

    def score_population(self, data: np.ndarray) -> list[ChunkResult]:
        """Every chunk of the step, in order (what all workers together compute). Each
        chunk is started before the one ahead of it is collected, so that a GPU scores
        it while the host takes the fitness of the other."""
        n_chunks = self.cfg.training.n_chunks
        results, pending = [], [self.start_chunk(data, 0)]
        try:
            for chunk in range(n_chunks):
                if chunk + 1 < n_chunks:
                    pending.append(self.start_chunk(data, chunk + 1))
                results.append(pending.pop(0)())
        finally:  # on an error, a chunk still queued is waited for (start_losses says why)
            for wait in pending:
                wait()
        return results

    def apply(self, fitness: np.ndarray) -> int:
        """The update from the whole population's fitness; moves to the next step.

        Returns how many weights changed."""
        return self.start_apply(fitness)()

    def start_apply(self, fitness: np.ndarray) -> Callable[[], int]:
        """`apply`, started (Backend.start_update): the function returned waits for the
        update and returns how many weights changed. A GPU updates while the caller
        queues the next step's first chunk behind it."""
        wait = self.backend.start_update(fitness, self.step, self.seed)
        self.step += 1
        self.seed = next_step_seed(self.seed, self.step)
        return wait

    def train_step(self, data: np.ndarray) -> list[ChunkResult]:
        """One whole step in this process: score every chunk, then start the update
        (the next step's chunks queue behind it)."""
        results = self.score_population(data)
        self.start_apply(np.concatenate([r.fitness for r in results]))
        return results

    def prompt(self, data: np.ndarray) -> np.ndarray:
        """The prompt a worker samples from at this step: a window of the data."""
        return prompt_window(self.cfg, data, self.step)

    def health(self, windows: np.ndarray) -> dict[str, Stats]:
        """The unperturbed model's figures: every weight slice, and the activations on up
        to HEALTH_WINDOWS of the validation windows (none without any)."""
        params = self.backend.params  # one copy: the GPU backend fetches it from the device
        stats = weight_health(self.cfg, params)
        if len(windows):
            spread = np.linspace(0, len(windows) - 1, min(HEALTH_WINDOWS, len(windows)))
            few = windows[spread.astype(np.int64)][:, :-1]
            stats |= activation_health(self.cfg, params, self.backend.overlays, few)
        return stats

    def chunk_estimate_s(self, data: np.ndarray) -> tuple[float, int] | None:
        """How long this replica would take to score a chunk, and how many members the
        estimate timed (one round of the CPU backend's threads, after a pair that loads
        numba's compiled code); None on a backend that is not the CPU's."""
        backend = self.backend
        if backend.name != "cpu":
            return None
        c = self.cfg.training.chunk_size
        probe = np.arange(min(c, getattr(backend, "members_at_once", c)))
        backend.losses(data, self.step, self.seed, probe[:2])
        started = time.perf_counter()
        backend.losses(data, self.step, self.seed, probe)
        return (time.perf_counter() - started) * c / len(probe), len(probe)

    def sample(
        self, prompt: np.ndarray, n_tokens: int | None = None, seed: int | None = None
    ) -> np.ndarray:
        """The prompt and n_tokens sampled from the unperturbed model (default seed: the
        step's, as the reference's workers sample)."""
        return self.start_sample(prompt, n_tokens, seed)()

    def start_sample(
        self, prompt: np.ndarray, n_tokens: int | None = None, seed: int | None = None
    ) -> Callable[[], np.ndarray]:
        """`sample`, started (Backend.start_generate): a GPU samples beside the chunk the
        caller starts next. The function returned waits for the tokens."""
        seed = self.seed + GENERATION_SEED if seed is None else seed
        return self.backend.start_generate(prompt, seed, n_tokens)
