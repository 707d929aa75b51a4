"""What a worker reports beside its chunks, each on the first chunk of the steps where
it is due (worker.py's _due): a sample of the model (LOG_MESSAGE, sent with that chunk's
RESULT), its validation loss (EVALUATION) and its health (HEALTH). The last two are
deggs messages, for a deggs coordinator only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import numpy as np

from ..config import Config
from ..data import DataError, detokenize, load_tokens
from ..numerics.es import Trainer, evaluate, validation_windows
from .protocol import Evaluation, Health, HealthEntry, LogMessage


class Reports:
    """A worker's reports, from the data in `data_dir` (val.bin beside input.bin for the
    validation loss and the activations' health); `log` takes its lines."""

    def __init__(self, data_dir: Path, log):
        self.data_dir, self.log = data_dir, log
        self._windows: np.ndarray | None = None  # validation windows, once loaded

    def windows(self, cfg: Config) -> np.ndarray:
        """The eval.windows windows of val.bin beside input.bin (none without one)."""
        if self._windows is None:
            path = self.data_dir / "val.bin"
            self._windows = np.zeros((0, 0), np.int64)
            if path.exists():
                try:
                    val = load_tokens(path, cfg)
                    self._windows = validation_windows(cfg, val, cfg.eval.windows)
                except (DataError, ValueError) as e:
                    self.log(f"[worker] no validation loss nor activation health: {e}")
        return self._windows

    def start_sample(
        self, trainer: Trainer, tokens: np.ndarray, pieces: list[bytes] | None
    ) -> Callable[[], bytes]:
        """A sample of the model started (Trainer.start_sample: a GPU samples beside the
        chunk started next); the function returned waits for it and gives its
        LOG_MESSAGE, in plain text: the coordinator escapes control characters, so
        colours would show as escape codes."""
        prompt = trainer.prompt(tokens)
        sampling, step, n = trainer.start_sample(prompt), trainer.step, len(prompt)
        text = lambda part: detokenize(part, trainer.cfg, pieces)

        def message() -> bytes:
            sample = sampling()
            head = f"--- GENERATION at step {step} ---\n"
            return LogMessage(f"{head}{text(sample[:n])} >>> {text(sample[n:])}\n").encode()

        return message

    def validation(self, trainer: Trainer, pieces: list[bytes] | None) -> bytes:
        """The EVALUATION of our model's validation loss on val.bin; b"" without one."""
        windows = self.windows(trainer.cfg)
        if not len(windows):
            return b""
        token_bytes = None
        if pieces is not None:
            token_bytes = np.array([len(piece) for piece in pieces], np.int64)
        v = evaluate(trainer.backend, windows, token_bytes)
        return Evaluation(
            trainer.step, v.windows, v.tokens, v.sum_loss, v.nats, v.text_bytes
        ).encode()

    def health(self, trainer: Trainer) -> bytes:
        """The HEALTH of our model: every weight slice, and activations on a few
        validation windows."""
        stats = trainer.health(self.windows(trainer.cfg))
        entries = tuple(HealthEntry(name, *astuple(s)) for name, s in stats.items())
        return Health(trainer.step, entries).encode()
