"""Files every part of deggs writes and reads alike: atomic writes, metrics.jsonl.

A leaf below data, prepare, plot, the runtime and the GPU's compile cache: it imports
nothing of deggs. A file written here replaces its old version whole or not at all
(temporary file, fsync, rename, fsync of the directory), with the mode any new file gets
under the umask (0644 under umask 022).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("deggs.files")

METRICS_FILE = "metrics.jsonl"


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


def append_line(path: str | Path, line: bytes) -> None:
    """Append one newline-ended line to a file, durably (fsynced). A file whose last
    line was torn by a crash gets a newline first, so the torn part stays a line of its
    own that readers skip instead of spoiling this one."""
    with open(path, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        torn = end > 0 and f.seek(end - 1) >= 0 and f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + line)
        f.flush()
        os.fsync(f.fileno())


def files_by_step(directory: str | Path, name: re.Pattern[str]) -> dict[int, Path]:
    """step -> path of the files of `directory` whose whole name matches `name` (its first
    group the step), in step order; none if the directory does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    found = {}
    for entry in directory.iterdir():
        match = name.fullmatch(entry.name)
        if match:
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash never leaves a partial file."""
    with atomic_file(path) as f:
        f.write(data)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable. A failure is logged, not raised: the file
    itself is whole and fsynced, but the promise that the rename survives a power cut
    does not hold for it, and the operator should know."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as e:
        log.warning(
            "cannot open %s to fsync it (%s): a rename there may not survive a crash",
            directory,
            e.strerror or e,
        )
        return
    try:
        os.fsync(fd)
    except OSError as e:
        log.warning(
            "fsync of the directory %s failed (%s): a rename there may not survive a crash",
            directory,
            e.strerror or e,
        )
    finally:
        os.close(fd)


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
