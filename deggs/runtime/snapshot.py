"""Weight snapshots: the model at a step, kept in the save directory.

Without them a run's model exists only as its fitness history, and every worker that
joins, every export and every sample replays the run from step 0. A snapshot of step S
holds everything a replica needs to train step S bit for bit (the weights, overlays,
optimizer state, step, seed and config: an export, export.py's format, so an export is a
snapshot and the other way round), and whoever needs the model replays only the steps
after the newest snapshot.

    snapshot_%08d.safetensors   S in eight digits, like checkpoint_%08d.bin

The coordinator needs no GPU for them: every `[coordinator] snapshot_every_steps` steps it
asks a worker whose state digest agrees with the others' for its model at S (the worker
kept a copy when it reached S), checks the upload (its size, every tensor's shape, the
digest it records against the agreed one) and writes it atomically before it counts.
It then serves the file to a worker that is behind it, in SNAPSHOT_PART frames.

Pruning: only the newest `keep_snapshots` files stay, and with `prune_history` the
checkpoints before the oldest of them go too (checkpoint S stays: it holds S's seed). A
directory pruned so is still a save directory: the newest checkpoint resumes the run, the
snapshot plus the checkpoints after it rebuild the model.
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config import Config
from ..files import atomic_file, files_by_step, write_atomic
from .checkpoint import forget_checkpoints, list_checkpoints
from .export import (
    MAX_HEADER_BYTES,
    ExportError,
    Model,
    encode_model,
    expected_tensors,
    load_into,
    model_and_digest,
    model_of,
    state_digest,
)
from .protocol import DIGEST_SIZE, PART_SIZE, Digest, ProtocolError, SnapshotHeader, SnapshotPart

if TYPE_CHECKING:  # numba's: a coordinator reads snapshots without it
    from ..numerics.es import Trainer

log = logging.getLogger(__name__)

# The header beyond the tensors: the JSON of ~100 tensor entries and the config, padded.
# A default model's is ~12 KiB; a 256-layer one's ~300 KiB.
HEADER_ALLOWANCE = 1 << 20
_NAME = re.compile(r"snapshot_(\d{8,})\.safetensors")


class Assembly:
    """A snapshot arriving in SNAPSHOT_PARTs: its header's size bounded before anything is
    held, then every part in order, with nothing missing, overlapping or past the end."""

    def __init__(self, header: SnapshotHeader, bounds: tuple[int, int], who: str):
        least, most = bounds
        if not least <= header.size <= most:
            raise ProtocolError(
                f"{who} announces a snapshot of {header.size} bytes; this run's are {least}..{most}"
            )
        self.header, self.who = header, who
        self.data = bytearray()

    def add(self, part: SnapshotPart) -> bool:
        """Take the next part; True once the file is whole."""
        if part.offset != len(self.data) or not part.data:
            raise ProtocolError(
                f"{self.who} sent snapshot bytes at {part.offset}, expected {len(self.data)}"
            )
        if len(self.data) + len(part.data) > self.header.size:
            raise ProtocolError(f"{self.who} sent more snapshot bytes than it announced")
        self.data += part.data
        return len(self.data) == self.header.size


def snapshot_frames(header: SnapshotHeader, data: bytes):
    """SNAPSHOT and its SNAPSHOT_PARTs, one encoded frame at a time."""
    yield header.encode()
    for offset in range(0, len(data), PART_SIZE):
        yield SnapshotPart(offset, data[offset : offset + PART_SIZE]).encode()


def snapshot_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"snapshot_{step:08d}.safetensors"


def list_snapshots(directory: str | Path) -> dict[int, Path]:
    """step -> path of every snapshot file in a directory, in step order (none if it
    does not exist)."""
    return files_by_step(directory, _NAME)


def data_bytes(cfg: Config) -> int:
    """The tensors' bytes in a model file of this config."""
    return sum(
        int(np.prod(shape, dtype=np.int64)) * (1 if dtype == "I8" else 4)
        for dtype, shape in expected_tensors(cfg).values()
    )


def size_bounds(cfg: Config) -> tuple[int, int]:
    """The least and most bytes a snapshot of this config can have: what an announced
    upload or download is checked against before a byte of it is held."""
    least = data_bytes(cfg) + 8
    return least, least + min(HEADER_ALLOWANCE, MAX_HEADER_BYTES)


def digest_due(cfg: Config, step: int) -> bool:
    """Do the replicas compare their state digests at this step (never at step 0, where
    every replica holds the initial weights by construction)?"""
    k = cfg.coordinator
    every = [n for n in (k.digest_every_steps, k.snapshot_every_steps) if n > 0]
    return step > 0 and any(step % n == 0 for n in every)


def snapshot_due(cfg: Config, step: int) -> bool:
    every = cfg.coordinator.snapshot_every_steps
    return step > 0 and every > 0 and step % every == 0


@dataclass(frozen=True)
class Snapshot:
    """A model file's bytes, with what it says of itself."""

    step: int
    seed: int
    digest: bytes
    data: bytes

    @classmethod
    def of(cls, model: Model, data: bytes) -> Snapshot:
        return cls(model.step, model.seed, state_digest(model), data)


def _read_checked(data: bytes, cfg: Config, name: str, step: int | None) -> tuple[Model, bytes]:
    """The model in a snapshot's bytes and its state digest, refused (ExportError) unless
    it is a valid model file of this config's run (at `step`, when one is expected)."""
    model, digest = model_and_digest(data, name)
    if model.cfg.fingerprint() != cfg.fingerprint():
        raise ExportError(
            f"{name}: a model of another config (fingerprint {model.cfg.fingerprint().hex()}, "
            f"the run's {cfg.fingerprint().hex()})"
        )
    if step is not None and model.step != step:
        raise ExportError(f"{name}: a model of step {model.step}, announced as step {step}")
    return model, digest


def check(data: bytes, cfg: Config, name: str, step: int, digest: bytes) -> Model:
    """The model in a snapshot's bytes, refused (ExportError) unless it is a valid model
    file of this config's run at `step` whose tensors have `digest`."""
    model, actual = _read_checked(data, cfg, name, step)
    if actual != digest:
        raise ExportError(
            f"{name}: state digest {actual.hex()[:16]} is not the announced {digest.hex()[:16]}"
        )
    return model


def write_snapshot(directory: str | Path, step: int, data: bytes) -> Path:
    """Store checked snapshot bytes atomically (fsynced, then renamed)."""
    path = snapshot_path(directory, step)
    write_atomic(path, data)
    return path


def read_snapshot(path: str | Path, cfg: Config) -> tuple[Model, Snapshot]:
    """A snapshot file, checked (load_model's checks with the digest it records, the
    run's config, the step its name says); ExportError names the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ExportError(f"{path}: cannot read: {e.strerror or e}") from None
    match = _NAME.fullmatch(Path(path).name)  # its name announces its step
    step = int(match.group(1)) if match else None
    model, digest = _read_checked(data, cfg, str(path), step)
    return model, Snapshot(model.step, model.seed, digest, data)


def newest_valid(
    directory: str | Path, cfg: Config, at_most: int | None = None
) -> tuple[Model, Snapshot] | None:
    """The newest snapshot in a directory (at or before `at_most`) that passes its checks;
    a bad one is logged and passed over: an older snapshot is only a longer replay."""
    for step, path in reversed(list_snapshots(directory).items()):
        if at_most is not None and step > at_most:
            continue
        try:
            return read_snapshot(path, cfg)
        except ExportError as e:
            log.error("snapshot passed over: %s", e)
    return None


def copy_snapshots(source: str | Path, target: str | Path) -> int:
    """Copy the snapshot files `target` lacks (a run resumed into another directory)."""
    copied = 0
    for step, path in list_snapshots(source).items():
        dest = snapshot_path(target, step)
        if not dest.exists():
            with open(path, "rb") as f, atomic_file(dest) as out:
                shutil.copyfileobj(f, out, PART_SIZE)
            copied += 1
    return copied


def prune(directory: str | Path, keep: int, history: bool) -> list[Path]:
    """Delete all but the newest `keep` snapshots and, with `history`, the checkpoints
    before the oldest kept snapshot. Returns what was deleted."""
    snapshots = list(list_snapshots(directory).items())
    gone = [path for _, path in snapshots[:-keep]] if keep < len(snapshots) else []
    kept = snapshots[-keep:]
    if history and kept:
        oldest = kept[0][0]
        checkpoints = list_checkpoints(directory)
        gone += [path for step, path in checkpoints.items() if step < oldest]
    for path in gone:
        path.unlink(missing_ok=True)
    if history and kept:
        forget_checkpoints(directory, kept[0][0])  # their checksums leave the manifest
    if gone:
        log.info("pruned %d file(s) from %s", len(gone), directory)
    return gone


class Keeper:
    """A worker's side of digests and snapshots: the digest it owes the coordinator (one
    a digest step, sent with its next request) and its model kept at the last snapshot
    step, until the coordinator asks for it or the next snapshot step comes."""

    def __init__(self) -> None:
        self.schedule: Config | None = None  # the coordinator's config: when they are due
        self._owed = b""  # a DIGEST frame
        self.reported = -1  # the last step whose digest was owed (once a step)
        self.held: Snapshot | None = None

    def reached(self, trainer: Trainer, loaded: Snapshot | None = None):
        """The trainer's model reached its step (`loaded`: from that snapshot)."""
        cfg, step = self.schedule, trainer.step
        if cfg is None or not digest_due(cfg, step) or step == self.reported:
            return
        keep = snapshot_due(cfg, step)
        if loaded is None:
            model = model_of(trainer)  # host copies of the device's arrays on a GPU
            loaded = Snapshot.of(model, encode_model(model) if keep else b"")
        if keep:
            self.held = loaded
        self._owed = Digest(step, loaded.digest).encode()
        self.reported = step

    def owed(self) -> bytes:
        owed, self._owed = self._owed, b""
        return owed

    def upload(self, step: int) -> list[bytes]:
        """The frames answering SNAPSHOT_REQUEST(step): the file, or "not held"."""
        held = self.held
        if held is None or held.step != step or not held.data:
            return [SnapshotHeader(step, 0, 0, bytes(DIGEST_SIZE)).encode()]
        header = SnapshotHeader(held.step, held.seed, len(held.data), held.digest)
        return list(snapshot_frames(header, held.data))

    def load(self, trainer: Trainer, header: SnapshotHeader, data: bytes, name: str):
        """Check a downloaded snapshot against its header and put it into the trainer."""
        model = check(data, trainer.cfg, name, header.step, header.digest)
        load_into(trainer, model)
        self.reported = -1
        self.reached(trainer, Snapshot(model.step, model.seed, header.digest, data))

    def restart(self, trainer: Trainer):
        trainer.restart()
        self.reported = -1  # its digests are due again on the way back
