"""TensorBoard event files of a run's metrics (deggs-coordinator --tensorboard DIR).

Each finished step's scalars are written at that step under their metrics.jsonl names
(SCALARS), and every health entry's saturation and entropy as `saturation/NAME` and
`entropy/NAME`. The events go through tensorboardX's protobufs and its synchronous
EventsWriter, called on the coordinator's disk thread: its SummaryWriter hands events to
a thread of its own, where a failing disk goes unnoticed and a full queue blocks the
caller. A write that fails is logged once and ends the TensorBoard output; the run and
metrics.jsonl go on.

tensorboardX is optional: pip install 'deggs[tensorboard]'.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("deggs.runtime.tensorboard")

INSTALL_HINT = "pip install 'deggs[tensorboard]'"
SCALARS = (
    "loss",
    "bits_per_token",
    "bits_per_byte",
    "val_loss",
    "val_bits_per_token",
    "val_bits_per_byte",
    "tokens_per_s",
    "lr",
)
HEALTH_FIGURES = ("saturation", "entropy")


class TensorBoardError(Exception):
    """--tensorboard cannot be used (no tensorboardX, a directory we cannot write)."""


class TensorBoard:
    """An event file in `directory`, opened at once so that a problem shows at start."""

    def __init__(self, directory: str | Path):
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary
        except ImportError as e:
            raise TensorBoardError(
                f"--tensorboard needs the tensorboardX package ({e}): {INSTALL_HINT}"
            ) from None
        self.directory = Path(directory)
        self._event: Any = Event
        self._summary: Any = Summary
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer: Any = EventsWriter(str(self.directory / "events"))
            self._writer.flush()
        except OSError as e:
            raise TensorBoardError(
                f"cannot write TensorBoard events in {self.directory}: {e.strerror or e}"
            ) from None

    @property
    def active(self) -> bool:
        return self._writer is not None

    def write(self, record: dict) -> None:
        """One metrics record's scalars, at its step. Never raises OSError."""
        if self._writer is None:
            return
        value = self._summary.Value
        values = [
            value(tag=key, simple_value=float(record[key]))
            for key in SCALARS
            if record.get(key) is not None
        ]
        for name, figures in record.get("health", {}).items():
            values += [
                value(tag=f"{figure}/{name}", simple_value=float(figures[figure]))
                for figure in HEALTH_FIGURES
            ]
        event = self._event(
            wall_time=record["time"], step=record["step"], summary=self._summary(value=values)
        )
        try:
            self._writer.write_event(event)
            self._writer.flush()
        except OSError as e:
            log.warning(
                "cannot write TensorBoard events in %s (%s): no more TensorBoard output "
                "in this run; metrics.jsonl goes on",
                self.directory,
                e.strerror or e,
            )
            self.close()

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(OSError):  # flushed after every step: nothing is lost
                writer.close()
