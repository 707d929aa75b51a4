"""The coordinator's save directory: one checkpoint file per step, config.json, metrics.jsonl.

checkpoint_%08d.bin has the reference layout, little-endian:

    u32 magic 0x45474743 ("CGGE" on disk), u32 version 1, u64 step, u64 seed,
    u64 data_size, then data_size bytes

where step and seed are those of the step the run has just reached and the data is the
packed whole-population fitness of the step before it. So checkpoint S+1 holds the
fitness of step S, and the files together are the full history a worker starting from
scratch replays. Every file is written atomically (temporary file, fsync, rename, fsync
of the directory), so a crash leaves either the old state or the new one, never half a
file.

metrics.jsonl gets one JSON line per finished step, appended before that step's
checkpoint is written (commit_step). A crash between the two leaves a line for a step
that is run again after the restart, and a crash inside an append leaves a torn last
line: read_metrics skips torn lines and keeps the last record of each step, and a resumed
run first rewrites the file without them (tidy_metrics).

A file that fails validation (bad magic or version, a size that disagrees with the
header or the config, bytes that are not packed trits, a step that disagrees with its
name) raises CheckpointError naming the file. The newest checkpoint is loaded when a run
resumes, and a bad one stops the start: quietly falling back to an older step would put
the coordinator behind workers that already applied the newer one. Older files are read
only when a worker needs them to catch up; a bad one there fails that worker's catch-up,
not the run.
"""

from __future__ import annotations

import json
import os
import re
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..config import Config, ConfigError
from ..ternary import check_packed, packed_size

CHECKPOINT_MAGIC = 0x45474743
CHECKPOINT_VERSION = 1
_HEADER = struct.Struct("<IIQQQ")
_NAME = re.compile(r"checkpoint_(\d{8,})\.bin")
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


class CheckpointError(ValueError):
    """A save directory or checkpoint file that cannot be used; the message names it."""


@dataclass(frozen=True)
class Checkpoint:
    step: int  # the step the run reached
    seed: int  # that step's seed
    fitness: bytes  # packed population fitness of step - 1


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"checkpoint_{step:08d}.bin"


def encode_checkpoint(checkpoint: Checkpoint) -> bytes:
    header = _HEADER.pack(
        CHECKPOINT_MAGIC,
        CHECKPOINT_VERSION,
        checkpoint.step,
        checkpoint.seed,
        len(checkpoint.fitness),
    )
    return header + checkpoint.fitness


def decode_checkpoint(data: bytes, name: str, n_pairs: int | None = None) -> Checkpoint:
    """Parse and validate a checkpoint file's bytes; `name` is used in error messages.

    With n_pairs (the population's pairs) the fitness must be exactly their packed trits.
    """
    if len(data) < _HEADER.size:
        raise CheckpointError(
            f"{name}: truncated ({len(data)} bytes, the header alone is {_HEADER.size})"
        )
    magic, version, step, seed, size = _HEADER.unpack_from(data)
    if magic != CHECKPOINT_MAGIC:
        raise CheckpointError(f"{name}: bad magic {magic:#010x}, not a checkpoint")
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(f"{name}: unsupported checkpoint version {version}")
    if len(data) != _HEADER.size + size:
        raise CheckpointError(
            f"{name}: header announces {size} bytes of fitness, the file "
            f"holds {len(data) - _HEADER.size}"
        )
    fitness = bytes(data[_HEADER.size :])
    if n_pairs is not None:
        if size != packed_size(n_pairs):
            raise CheckpointError(
                f"{name}: {size} bytes of fitness, this config's population "
                f"packs into {packed_size(n_pairs)}"
            )
        try:
            check_packed(fitness, n_pairs)
        except ValueError as e:
            raise CheckpointError(f"{name}: corrupt fitness: {e}") from None
    return Checkpoint(step, seed, fitness)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux tells it (os.umask can
    only be read by setting it, which would race with the disk thread's files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode open() gives a new file: 0644 under umask 022."""
    return 0o666 & ~current_umask()


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A file to write that replaces `path` when the block ends: whole and fsynced, or,
    on a crash or an error, not at all (and no temporary file is left behind). Its mode
    follows the umask like any other new file's (mkstemp's own is 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # make the rename itself durable


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash never leaves a partial file."""
    with atomic_file(path) as f:
        f.write(data)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform opens directories
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(directory: str | Path, checkpoint: Checkpoint) -> Path:
    path = checkpoint_path(directory, checkpoint.step)
    write_atomic(path, encode_checkpoint(checkpoint))
    return path


def read_checkpoint(path: str | Path, n_pairs: int | None = None) -> Checkpoint:
    """Read and validate one checkpoint file, checking its step against its name."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    checkpoint = decode_checkpoint(data, str(path), n_pairs)
    match = _NAME.fullmatch(path.name)
    if match and int(match.group(1)) != checkpoint.step:
        raise CheckpointError(f"{path}: header says step {checkpoint.step}")
    return checkpoint


def list_checkpoints(directory: str | Path) -> dict[int, Path]:
    """Checkpoint files of a directory by step (from their names; contents unchecked)."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    found = {}
    for entry in directory.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match:
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


def load_latest(directory: str | Path, n_pairs: int | None = None) -> Checkpoint | None:
    """The newest checkpoint of a directory, validated; None when there is none."""
    files = list_checkpoints(directory)
    if not files:
        return None
    return read_checkpoint(files[max(files)], n_pairs)


# --- config.json ---------------------------------------------------------------------


def saved_config(directory: str | Path) -> Config | None:
    """The config a run saved in `directory`, or None when it saved none."""
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        return None
    try:
        return Config.from_json(path.read_text())
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def check_saved_config(directory: str | Path, config: Config) -> None:
    """Refuse a directory whose run trained with different math settings."""
    saved = saved_config(directory)
    if saved is None or saved.fingerprint() == config.fingerprint():
        return
    diffs = "; ".join(saved.differences(config)) or "fingerprints differ"
    raise ConfigError(
        f"{Path(directory) / CONFIG_FILE} was saved with another config (saved != current): {diffs}"
    )


def save_config(directory: str | Path, config: Config) -> None:
    write_atomic(Path(directory) / CONFIG_FILE, (config.to_json() + "\n").encode())


def prepare_save_dir(directory: str | Path, config: Config, start_step: int) -> None:
    """Create the save directory; refuse one that another run's files would mix into."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    check_saved_config(directory, config)
    newer = [s for s in list_checkpoints(directory) if s > start_step]
    if newer:
        raise CheckpointError(
            f"{directory} already holds checkpoints up to step {max(newer)} and this run "
            f"starts at step {start_step}; pass --load-dir {directory} to resume it, or "
            "choose another save directory"
        )
    save_config(directory, config)


def copy_history(source: str | Path, target: str | Path) -> int:
    """Copy the checkpoint files `target` lacks, so it alone holds the full history."""
    copied = 0
    for step, path in list_checkpoints(source).items():
        dest = checkpoint_path(target, step)
        if not dest.exists():
            write_atomic(dest, path.read_bytes())
            copied += 1
    return copied


# --- metrics.jsonl and committing a step ----------------------------------------------


def append_metrics(directory: str | Path, record: dict) -> None:
    """Append one finished step's record as a JSON line, durably.

    A file whose last line was torn by a crash gets a newline first, so the torn part
    stays a line of its own that readers skip instead of spoiling this record.
    """
    record = {**record, "time": record.get("time", time.time())}
    with open(Path(directory) / METRICS_FILE, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        torn = end > 0 and f.seek(end - 1) >= 0 and f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + json.dumps(record).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def read_metrics(directory: str | Path) -> list[dict]:
    """The records of metrics.jsonl by step: torn lines skipped, the last record of a step
    that was run twice (around a crash) kept."""
    path = Path(directory) / METRICS_FILE
    if not path.exists():
        return []
    by_step = {}
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def tidy_metrics(directory: str | Path, start_step: int) -> None:
    """Before a run resumes at start_step: keep only whole records of earlier steps."""
    path = Path(directory) / METRICS_FILE
    if not path.exists():
        return
    kept = [r for r in read_metrics(directory) if r["step"] < start_step]
    write_atomic(path, b"".join(json.dumps(r).encode() + b"\n" for r in kept))


def commit_step(directory: str | Path, checkpoint: Checkpoint, record: dict) -> None:
    """Make a finished step durable: its metrics line, then the checkpoint of the next step.

    Safe to call again after it failed part way (a repeated metrics line is read as one).
    """
    append_metrics(directory, record)
    save_checkpoint(directory, checkpoint)
