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

checkpoints.sha256 records the SHA-256 of every checkpoint deggs writes, in the format of
`sha256sum` (which checks it too), appended and fsynced before the checkpoint itself; a
file whose bytes no longer match is refused when it is loaded or served for catch-up. On
a resume the seed in every checkpoint's header must follow the seed chain from
training.seed (seeds.next_step_seed). A directory the reference wrote has no manifest:
its files are held to the seed chain alone. Checkpoints removed on purpose (pruning) are
simply absent: only the files present are checked (forget_checkpoints tidies the
manifest after them).

A file that fails validation (bad magic or version, a size that disagrees with the
header or the config, bytes that are not packed trits, a step that disagrees with its
name, a checksum or seed that is not the recorded one) raises CheckpointError naming the
file. The newest checkpoint is loaded when a run
resumes, and a bad one stops the start: quietly falling back to an older step would put
the coordinator behind workers that already applied the newer one. Older files are read
only when a worker needs them to catch up; a bad one there fails that worker's catch-up,
not the run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, ConfigError
from ..files import METRICS_FILE, append_line, files_by_step, read_metrics, write_atomic
from ..seeds import next_step_seed
from ..ternary import check_packed, packed_size

log = logging.getLogger("deggs.runtime.checkpoint")

CHECKPOINT_MAGIC = 0x45474743
CHECKPOINT_VERSION = 1
_HEADER = struct.Struct("<IIQQQ")
_NAME = re.compile(r"checkpoint_(\d{8,})\.bin")
CONFIG_FILE = "config.json"
MANIFEST_FILE = "checkpoints.sha256"


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


def save_checkpoint(directory: str | Path, checkpoint: Checkpoint) -> Path:
    path = checkpoint_path(directory, checkpoint.step)
    data = encode_checkpoint(checkpoint)
    record_checksum(directory, path.name, data)  # first: no file is ever without one
    write_atomic(path, data)
    return path


def read_checkpoint(path: str | Path, n_pairs: int | None = None) -> Checkpoint:
    """Read and validate one checkpoint file, checking its step against its name."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    verify_checksum(path, data)
    checkpoint = decode_checkpoint(data, str(path), n_pairs)
    match = _NAME.fullmatch(path.name)
    if match and int(match.group(1)) != checkpoint.step:
        raise CheckpointError(f"{path}: header says step {checkpoint.step}")
    return checkpoint


def list_checkpoints(directory: str | Path) -> dict[int, Path]:
    """Checkpoint files of a directory by step (from their names; contents unchecked)."""
    return files_by_step(directory, _NAME)


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
    """Copy the checkpoint files `target` lacks, so it alone holds the full history,
    with their checksums (a file that fails its own is not copied, and says so)."""
    copied = 0
    for step, path in list_checkpoints(source).items():
        dest = checkpoint_path(target, step)
        if not dest.exists():
            data = path.read_bytes()
            try:
                verify_checksum(path, data)
            except CheckpointError as e:
                log.error("not copied: %s", e)
                continue
            record_checksum(target, dest.name, data)
            write_atomic(dest, data)
            copied += 1
    return copied


# --- metrics.jsonl and committing a step ----------------------------------------------


def append_metrics(directory: str | Path, record: dict) -> None:
    """Append one finished step's record as a JSON line, durably (files.append_line)."""
    record = {**record, "time": record.get("time", time.time())}
    append_line(Path(directory) / METRICS_FILE, json.dumps(record).encode() + b"\n")


def tidy_metrics(directory: str | Path, start_step: int) -> None:
    """Before a run resumes at start_step: keep only whole records of earlier steps."""
    path = Path(directory) / METRICS_FILE
    if not path.exists():
        return
    kept = [r for r in read_metrics(directory) if r["step"] < start_step]
    write_atomic(path, b"".join(json.dumps(r).encode() + b"\n" for r in kept))


def commit_step(
    directory: str | Path, checkpoint: Checkpoint, record: dict, metrics: MetricsLog | None = None
) -> None:
    """Make a finished step durable: its metrics line (through `metrics`, a running
    coordinator's MetricsLog, when given), then the checkpoint of the next step.

    Safe to call again after it failed part way (a repeated metrics line is read as one).
    """
    if metrics is not None:
        metrics.append(record)
    else:
        append_metrics(directory, record)
    save_checkpoint(directory, checkpoint)


# --- checksums and the seed chain ------------------------------------------------------


def _manifest_line(name: str, digest: str) -> bytes:
    return f"{digest}  {name}\n".encode()


def record_checksum(directory: str | Path, name: str, data: bytes) -> None:
    """Append the SHA-256 of a checkpoint's bytes to the manifest, durably (a torn last
    line from a crash is skipped by readers, as in metrics)."""
    digest = hashlib.sha256(data).hexdigest()
    append_line(Path(directory) / MANIFEST_FILE, _manifest_line(name, digest))


def read_manifest(directory: str | Path) -> dict[str, str]:
    """Checkpoint name -> recorded SHA-256 (hex); the last line of a name counts. {} when
    the directory has no manifest (the reference's)."""
    path = Path(directory) / MANIFEST_FILE
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    return _parsed_manifest(path, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _parsed_manifest(path: Path, inode: int, size: int, mtime_ns: int) -> dict[str, str]:
    """A manifest's lines, parsed once per version of the file (its inode, size and time
    name the version): a catch-up from disk reads one for every step it serves. The
    caller must not change the dict."""
    recorded = {}
    for line in path.read_bytes().splitlines():
        digest, _, name = line.decode("ascii", "replace").partition("  ")
        if len(digest) == 64 and _NAME.fullmatch(name):
            recorded[name] = digest
    return recorded


def verify_checksum(path: Path, data: bytes) -> None:
    """CheckpointError when the manifest beside `path` records other bytes for it."""
    expected = read_manifest(path.parent).get(path.name)
    if expected is None:
        return
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise CheckpointError(
            f"{path}: its SHA-256 {actual[:16]}... is not the {expected[:16]}... recorded in "
            f"{MANIFEST_FILE} when it was written, so it changed since; restore it from a "
            "copy, or remove it: as the newest checkpoint the run then resumes from the step "
            "before, as an older one workers behind its step can no longer catch up"
        )


def check_seed_chain(directory: str | Path, first_seed: int) -> None:
    """Every checkpoint's header seed must be the seed chain's from training.seed at its
    step. Only the headers are read; a file whose header does not parse is left to fail
    when it is read. CheckpointError names the first file that breaks the chain."""
    files = list_checkpoints(directory)
    seed, step = first_seed, 0
    for number, path in files.items():
        while step < number:
            step += 1
            seed = next_step_seed(seed, step)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
        except OSError:
            continue
        if len(header) < _HEADER.size:
            continue
        magic, version, _, recorded, _ = _HEADER.unpack(header)
        if magic != CHECKPOINT_MAGIC or version != CHECKPOINT_VERSION or recorded == seed:
            continue
        newest = number == max(files)
        raise CheckpointError(
            f"{path}: seed {recorded} is not step {number}'s seed {seed} in the chain from "
            f"training.seed {first_seed}: the file is corrupt or from another run; restore "
            "it from a copy, or remove it"
            + (
                f" to resume from step {number - 1}"
                if newest
                else f" and every older checkpoint (workers behind step {number} then "
                "cannot catch up)"
            )
        )


def forget_checkpoints(directory: str | Path, below_step: int) -> None:
    """After checkpoints below `below_step` were removed on purpose: rewrite the manifest
    without them."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.exists():
        return
    kept = {
        name: digest
        for name, digest in read_manifest(directory).items()
        if int(name[len("checkpoint_") : -len(".bin")]) >= below_step
    }
    write_atomic(path, b"".join(_manifest_line(n, d) for n, d in sorted(kept.items())))


class MetricsLog:
    """metrics.jsonl as a running coordinator keeps it: it remembers every record the file
    holds (read at start) or got since, so that a file deleted, truncated or replaced
    under it is noticed at the next append, said in a warning and rewritten whole
    (atomically) instead of restarting from the current step. The records are kept
    zlib-compressed (a step's line of ~1-3 KB repeats its keys: ~100 bytes a step), so
    that a day-long run's memory stays small."""

    def __init__(self, directory: str | Path, records: list[dict]):
        self.path = Path(directory) / METRICS_FILE
        self._packer = zlib.compressobj(6)
        self._packed = bytearray()
        self.count = 0
        for record in records:
            self._keep(record)
        self.identity = self._identity()

    def _keep(self, record: dict):
        self._packed += self._packer.compress(json.dumps(record).encode() + b"\n")
        self.count += 1

    def _text(self) -> bytes:
        return zlib.decompress(bytes(self._packed) + self._packer.copy().flush())

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size

    def append(self, record: dict) -> None:
        record = {**record, "time": record.get("time", time.time())}
        now = self._identity()
        expected = self.identity
        lost = (expected is not None and expected[1] > 0) and (
            now is None or now[0] != expected[0] or now[1] < expected[1]
        )
        if lost:
            what = "vanished" if now is None else "shrank or was replaced"
            log.warning(
                "%s %s under the running coordinator; rewriting it from the %d records "
                "this coordinator knows",
                self.path,
                what,
                self.count,
            )
            write_atomic(self.path, self._text())
        append_metrics(self.path.parent, record)
        self._keep(record)
        self.identity = self._identity()


# --- serving the history ----------------------------------------------------------------

SEED_STRIDE = 1024  # steps between the seeds a SeedChain keeps


class SeedChain:
    """Any step's seed in the chain from training.seed (what its checkpoint holds). It
    keeps every SEED_STRIDE-th step's seed, so that any step's is a few hashes from one of
    them and the table grows by one int per SEED_STRIDE steps."""

    def __init__(self, first: int):
        self.kept = [first]

    def at(self, step: int) -> int:
        while len(self.kept) * SEED_STRIDE <= step:
            seed, base = self.kept[-1], (len(self.kept) - 1) * SEED_STRIDE
            for s in range(base + 1, base + SEED_STRIDE + 1):
                seed = next_step_seed(seed, s)
            self.kept.append(seed)
        base = step // SEED_STRIDE * SEED_STRIDE
        seed = self.kept[step // SEED_STRIDE]
        for s in range(base + 1, step + 1):
            seed = next_step_seed(seed, s)
        return seed


def fitness_from_disk(dirs: list[Path], step: int, n_pairs: int, seed: int) -> bytes | None:
    """Step `step`'s packed fitness from checkpoint step+1 in the first dir that has it
    whole (its checksum, when recorded, and `seed`, the chain's at step+1, both hold)."""
    for directory in dirs:
        path = checkpoint_path(directory, step + 1)
        if path.exists():
            try:
                checkpoint = read_checkpoint(path, n_pairs)
                if checkpoint.seed != seed:
                    raise CheckpointError(
                        f"{path}: seed {checkpoint.seed} is not the chain's {seed}; the file "
                        "is corrupt or from another run"
                    )
                return checkpoint.fitness
            except CheckpointError as e:
                log.error("cannot serve step %d from disk: %s", step, e)
    return None
