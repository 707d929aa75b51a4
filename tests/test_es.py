"""One ES step (deggs.numerics.es) and the replay built on it."""

import numpy as np
import pytest
from tiny import tiny_config

from deggs.numerics.cpu import CpuBackend
from deggs.numerics.es import Trainer, chunk_members
from deggs.numerics.fitness import chunk_fitness
from deggs.runtime.checkpoint import Checkpoint, CheckpointError, save_checkpoint
from deggs.runtime.replay import replay
from deggs.seeds import hash_rng
from deggs.ternary import pack_trits, unpack_trits

CFG = tiny_config(
    training=dict(population_size=32), sampling=dict(prompt_tokens=4, generate_tokens=4)
)
DATA = np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint8)


def test_a_chunk_is_scored_and_packed():
    trainer = Trainer(CpuBackend(CFG, threads=1))
    result = trainer.score_chunk(DATA, 2)
    assert chunk_members(CFG, 2).tolist() == list(range(16, 24))
    losses = trainer.backend.losses(DATA, 0, CFG.training.seed, range(16, 24))
    assert np.array_equal(result.losses, losses)
    expected = chunk_fitness(CFG, losses)
    assert np.array_equal(result.fitness, expected.fitness) and result.sum_loss == expected.sum_loss
    assert result.packed == pack_trits(expected.fitness) and len(result.packed) == 1  # 4 pairs


@pytest.mark.parametrize("threads", [1, 2])
def test_the_cpu_reports_a_chunks_progress_batch_by_batch(threads):
    trainer = Trainer(CpuBackend(CFG, threads=threads))
    trainer.backend.batch = 2  # four batches in a chunk of 8
    seen: list[tuple[int, int]] = []
    result = trainer.score_chunk(DATA, 2, lambda *at: seen.append(at))
    assert seen == [(2, 8), (4, 8), (6, 8), (8, 8)]
    whole = Trainer(CpuBackend(CFG, threads=1)).score_chunk(DATA, 2)  # one batch
    assert np.array_equal(result.losses, whole.losses) and result.packed == whole.packed


class QueuedBackend(CpuBackend):
    """A CPU backend that records when each chunk is started and waited for, as a GPU
    would leave it running in between; the chunk `failing` fails when waited for."""

    def __init__(self, cfg, failing=None):
        super().__init__(cfg, threads=1)
        self.events: list[tuple[str, int]] = []
        self.failing = failing

    def start_losses(self, data, step, step_seed, members):
        chunk = int(members[0]) // self.cfg.training.chunk_size
        self.events.append(("start", chunk))
        losses = self.losses(data, step, step_seed, members)

        def wait():
            self.events.append(("wait", chunk))
            if chunk == self.failing:
                raise RuntimeError(f"chunk {chunk} failed")
            return losses

        return wait


def test_each_chunk_is_started_before_the_one_ahead_is_taken():
    backend = QueuedBackend(CFG)
    results = Trainer(backend).score_population(DATA)
    steps = [("start", 0)] + [e for c in range(1, 4) for e in (("start", c), ("wait", c - 1))]
    assert backend.events == steps + [("wait", 3)]
    alone = Trainer(CpuBackend(CFG, threads=1))
    assert [r.packed for r in results] == [alone.score_chunk(DATA, c).packed for c in range(4)]


def test_a_failing_chunk_still_waits_for_the_chunk_queued_behind_it():
    """Until it is waited for, a queued chunk's losses may still be arriving in memory
    that the backend hands back with the function (Backend.start_losses)."""
    backend = QueuedBackend(CFG, failing=1)
    with pytest.raises(RuntimeError, match="chunk 1 failed"):
        Trainer(backend).score_population(DATA)
    assert backend.events[-3:] == [("start", 2), ("wait", 1), ("wait", 2)]


class UpdatingBackend(QueuedBackend):
    """QueuedBackend that also records when an update is started and waited for."""

    def start_update(self, fitness, step, step_seed):
        self.events.append(("update", step))
        changed = self.update(fitness, step, step_seed)

        def wait():
            self.events.append(("updated", step))
            return changed

        return wait


def test_the_next_steps_first_chunk_is_queued_behind_the_update():
    """train_step starts the update and returns: the next step's first chunk is started
    with the update still running (a GPU queues it behind), and nothing waits for it."""
    backend = UpdatingBackend(CFG)
    trainer = Trainer(backend)
    trainer.train_step(DATA)
    trainer.train_step(DATA)
    at = backend.events.index(("update", 0))
    assert backend.events[at - 1] == ("wait", 3) and backend.events[at + 1] == ("start", 0)
    assert ("updated", 0) not in backend.events and trainer.step == 2
    # the weights are the same as those of updates waited for one by one
    alone = Trainer(CpuBackend(CFG, threads=1))
    for _ in range(2):
        alone.apply(np.concatenate([r.fitness for r in alone.score_population(DATA)]))
    assert all(np.array_equal(alone.backend.params[k], v) for k, v in backend.params.items())


def test_apply_moves_to_the_next_step_and_seed():
    trainer = Trainer(CpuBackend(CFG, threads=1))
    before = {k: v.copy() for k, v in trainer.backend.params.items()}
    fitness = np.resize([1, -1, 0], CFG.training.n_pairs)
    changed = trainer.apply(fitness)
    assert (trainer.step, trainer.seed) == (1, hash_rng(42, 1))
    # AdamW's first steps move each accumulator by lr * |m / sqrt(v)| < 1: no weight yet
    changed += sum(trainer.apply(fitness) for _ in range(3))
    assert (trainer.step, trainer.seed) == (
        4,
        hash_rng(hash_rng(hash_rng(hash_rng(42, 1), 2), 3), 4),
    )
    assert changed == sum(int((trainer.backend.params[k] != v).sum()) for k, v in before.items())
    assert changed > 0


def test_replay_rebuilds_the_trained_model(tmp_path):
    trained = Trainer(CpuBackend(CFG, threads=1))
    for _ in range(3):
        results = trained.train_step(DATA)
        fitness = np.concatenate([r.fitness for r in results])
        save_checkpoint(tmp_path, Checkpoint(trained.step, trained.seed, pack_trits(fitness)))
    seen = []
    rebuilt = replay(
        tmp_path,
        Trainer(CpuBackend(CFG, threads=1)),
        progress=lambda step, last, changed: seen.append((step, last)),
    )
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert (rebuilt.step, rebuilt.seed) == (trained.step, trained.seed)
    for k, v in trained.backend.params.items():
        assert np.array_equal(rebuilt.backend.params[k], v), k
    prompt = DATA[:4].astype(np.int64)
    assert np.array_equal(rebuilt.sample(prompt), trained.sample(prompt))


def test_replay_refuses_a_hole_and_a_foreign_seed(tmp_path):
    fitness = pack_trits(np.zeros(CFG.training.n_pairs, np.int32))
    save_checkpoint(tmp_path, Checkpoint(2, hash_rng(hash_rng(42, 1), 2), fitness))
    with pytest.raises(CheckpointError, match="no checkpoint for step 1"):
        replay(tmp_path, Trainer(CpuBackend(CFG, threads=1)))
    save_checkpoint(tmp_path, Checkpoint(1, 7, fitness))
    with pytest.raises(CheckpointError, match="seed 7 does not follow"):
        replay(tmp_path, Trainer(CpuBackend(CFG, threads=1)))
    assert unpack_trits(fitness, CFG.training.n_pairs).tolist() == [0] * 16
