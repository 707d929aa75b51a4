"""A long chunk's progress in the worker's log: members done, speed, time left."""

from __future__ import annotations

import time

PROGRESS_EVERY_S = 10.0  # a line this often while a long chunk is scored


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class ChunkProgress:
    """Logs a chunk's progress every `every_s` seconds while it is scored: members done,
    member-tokens/s and the time left at that speed (called as progress(done, total))."""

    def __init__(self, log, what: str, seq_len: int, every_s=PROGRESS_EVERY_S, clock=None):
        self.log, self.what, self.seq_len, self.every_s = log, what, seq_len, every_s
        self.clock = clock or time.monotonic
        self.started = self.last = self.clock()

    def __call__(self, done: int, total: int):
        now = self.clock()
        if done >= total or now - self.last < self.every_s:
            return  # the chunk's own line follows the last batch
        self.last = now
        elapsed = max(now - self.started, 1e-9)
        self.log(
            f"[worker] {self.what}: {done:,}/{total:,} members, "
            f"{done * self.seq_len / elapsed:,.0f} member-tokens/s, "
            f"about {duration((total - done) * elapsed / done)} left"
        )


SLOW_CHUNK_S = 300.0  # a chunk estimated to take longer is warned about at start


def warn_if_slow(log, trainer, data) -> None:
    """Warn when a chunk will take this CPU longer than SLOW_CHUNK_S: a config sized for
    a GPU leaves a CPU worker silent for a long time otherwise (Trainer.chunk_estimate_s
    times one round of the backend's threads)."""
    estimate = trainer.chunk_estimate_s(data)
    if estimate is None:
        return
    seconds, probed = estimate
    c = trainer.cfg.training.chunk_size
    if seconds > SLOW_CHUNK_S:
        log(
            f"[worker] warning: a chunk of {c:,} members will take this CPU about "
            f"{duration(seconds)} (an estimate from timing {probed} members): this "
            "config is sized for a GPU (--backend gpu on one), or make training.chunk_size "
            f"or the model smaller; progress is logged every {PROGRESS_EVERY_S:g} s"
        )
