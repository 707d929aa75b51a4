"""The coordinator's side of snapshots and state digests (snapshot.py, digests.py).

`Replicas` keeps the newest snapshot the save directory holds, the digest book, and the
upload in progress. The coordinator hands it:

- DIGEST, SNAPSHOT and SNAPSHOT_PART from deggs workers (`on_digest`, `on_header`,
  `on_part`);
- every sealed step (`sealed`): the step's digests are decided, drifted workers flagged,
  and at a snapshot step a worker that holds the agreed state is asked for its model;
- a JOB_REQUEST of a deggs worker that is behind the newest snapshot or drifted
  (`wants_snapshot`, then `send_snapshot`, which streams the file);
- a closed connection (`lost`): an upload from it goes to the next worker that agreed.

Nothing here blocks the event loop on a file: checks and writes run on the coordinator's
disk thread, and uploads never stop the other workers training.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Config
from . import snapshot as snapshots
from .digests import DigestBook, Verdict
from .export import ExportError
from .protocol import (
    PART_SIZE,
    Digest,
    ProtocolError,
    SnapshotHeader,
    SnapshotPart,
    SnapshotRequest,
)

if TYPE_CHECKING:
    from .coordinator import Coordinator, Peer

log = logging.getLogger("deggs.runtime.coordinator")


@dataclass(frozen=True)
class Stored:
    """A checked snapshot file the coordinator serves."""

    step: int
    seed: int
    digest: bytes
    size: int
    path: Path


@dataclass
class Upload:
    """The snapshot of `step` being asked for, from one worker after another."""

    step: int
    digest: bytes  # the agreed state's
    candidates: list[str]  # reporters of the agreed digest not asked yet
    peer: Peer | None = None  # the one asked now
    assembly: snapshots.Assembly | None = None
    asked: list[str] = field(default_factory=list)


class Replicas:
    def __init__(self, coordinator: Coordinator):
        self.coord = coordinator
        self.cfg: Config = coordinator.config
        self.book = DigestBook()
        self.newest: Stored | None = None
        self.upload: Upload | None = None
        self.alone_said = False  # "one worker: nothing to compare" is logged once

    # --- the save directory ----------------------------------------------------------

    def load(self, directories: list[Path], at_most: int):
        """Find the newest good snapshot at or before `at_most` (a resumed run's step);
        runs on the disk thread at start."""
        for directory in directories:
            steps = [step for step in snapshots.list_snapshots(directory) if step <= at_most]
            if not steps or (self.newest is not None and max(steps) <= self.newest.step):
                continue  # nothing newer here (a resumed run's save dir holds load-dir copies)
            newest = snapshots.newest_valid(directory, self.cfg, at_most)
            found = newest[1] if newest is not None else None
            if found is not None and (self.newest is None or found.step > self.newest.step):
                path = snapshots.snapshot_path(directory, found.step)
                self.newest = Stored(found.step, found.seed, found.digest, len(found.data), path)
        if self.newest is not None:
            self.book.agree(self.newest.step, self.newest.digest)
            log.info("serving the snapshot of step %d (%s)", self.newest.step, self.newest.path)

    # --- digests ---------------------------------------------------------------------

    def on_digest(self, peer: Peer, message: Digest):
        step = self.coord.state.step
        if message.step > step:
            raise ProtocolError(f"DIGEST for step {message.step}, beyond the run's {step}")
        if peer.drifted:  # it asks for the snapshot before it can have another state
            raise ProtocolError("a DIGEST from a worker that drifted, before it resynced")
        verdict = self.book.report(message.step, peer.name, message.digest, step)
        if verdict is not None:
            self._apply(verdict)

    def sealed(self, step: int, workers: set[str]) -> dict:
        """Decide `step`'s digests as it is sealed, by the votes of `workers` (those that
        scored a chunk of it: a connection that does no work has no say); returns its
        metrics entries."""
        if not snapshots.digest_due(self.cfg, step):
            return {}
        verdict = self.book.decide(step, workers)
        if verdict.reports == 0:
            return {}
        if verdict.reports == 1 and not self.alone_said:
            self.alone_said = True
            log.info(
                "one worker reported its state digest at step %d: there is nothing to "
                "compare it with (two or more workers can catch one that drifted)",
                step,
            )
        self._apply(verdict)
        record: dict = {"digest_reports": verdict.reports}
        if verdict.agreed is not None:
            record["digest"] = verdict.agreed.hex()
            if snapshots.snapshot_due(self.cfg, step) and self.coord.save_dir is not None:
                self._ask_for(step, verdict.agreed)
        return record

    def _apply(self, verdict: Verdict):
        start = f"the snapshot of step {self.newest.step}" if self.newest else "step 0"
        if verdict.split:
            named = ", ".join(f"{who} {d.hex()[:12]}" for who, d in verdict.drifted.items())
            log.error(
                "the workers disagree about the model at step %d with no majority (%s): no "
                "chunks are handed out until they agree. Restart the workers: each rebuilds "
                "its model from %s and is compared again at step %d; a worker that disagrees "
                "again has a fault (memory, driver, another GPU kind): leave it out",
                verdict.step,
                named,
                start,
                verdict.step,
            )
            return
        if verdict.resolved:
            log.info("the workers agree again about step %d: chunks go out again", verdict.step)
            self.coord.tell_held()
        for who, digest in verdict.drifted.items():
            peer = self.coord.peer_named(who)
            text = (
                f"drifted: its state at step {verdict.step} has digest '{digest.hex()[:16]}', "
                f"the agreed one '{verdict.agreed.hex()[:16] if verdict.agreed else '?'}'; it "
                f"gets no more chunks and rebuilds its model from {start}"
            )
            self.coord.note_drift(who, verdict.step)
            if peer is None:
                log.warning("worker %s %s", who, text)
                continue
            self.coord.say(peer, logging.WARNING, text)  # bounded where it proved nothing
            self.coord.take_back(peer)
            peer.drifted = True

    # --- uploads ---------------------------------------------------------------------

    def _ask_for(self, step: int, digest: bytes):
        candidates = self.book.holders(step)
        self.upload = Upload(step, digest, candidates)
        self._ask_next()

    def _ask_next(self):
        upload = self.upload
        if upload is None:
            return
        while upload.candidates:
            peer = self.coord.peer_named(upload.candidates.pop(0))
            if peer is None or peer.closing or peer.drifted:
                continue
            upload.peer, upload.assembly = peer, None
            upload.asked.append(peer.name)
            peer.send_now(SnapshotRequest(upload.step).encode())
            log.info("asking %s for its model at step %d (a snapshot)", peer.name, upload.step)
            return
        log.warning(
            "no connected worker holds the agreed model of step %d (asked: %s): no snapshot "
            "of it; the next snapshot step tries again",
            upload.step,
            ", ".join(upload.asked) or "none",
        )
        self.upload = None

    def on_header(self, peer: Peer, header: SnapshotHeader):
        upload = self.upload
        if upload is None or upload.peer is not peer or upload.assembly is not None:
            raise ProtocolError("a SNAPSHOT nobody asked this worker for")
        if header.step != upload.step:
            raise ProtocolError(f"a SNAPSHOT of step {header.step}, asked for {upload.step}")
        if header.size == 0:
            log.info("%s no longer holds step %d", peer.name, upload.step)
            self._ask_next()
            return
        if header.digest != upload.digest:
            raise ProtocolError(f"a SNAPSHOT of step {header.step} with another digest")
        upload.assembly = snapshots.Assembly(header, snapshots.size_bounds(self.cfg), peer.name)

    def on_part(self, peer: Peer, part: SnapshotPart):
        upload = self.upload
        if upload is None or upload.peer is not peer or upload.assembly is None:
            raise ProtocolError("a SNAPSHOT_PART outside an upload")
        if upload.assembly.add(part):
            data = bytes(upload.assembly.data)
            upload.peer = upload.assembly = None
            self.coord.spawn(self._store(upload, peer.name, data))

    async def _store(self, upload: Upload, who: str, data: bytes):
        """Check an upload against the agreed digest and write it; only then it counts."""
        directory = self.coord.save_dir
        try:
            stored = await self.coord.on_disk(self._check_and_write, upload, who, data)
        except ExportError as e:
            log.error("snapshot upload refused: %s; asking another worker", e)
            self._ask_next()
            return
        except OSError as e:
            log.error(
                "cannot write the snapshot of step %d in %s (%s): the run goes on with the "
                "snapshot of step %s",
                upload.step,
                directory,
                e.strerror or e,
                self.newest.step if self.newest else "none",
            )
            self.upload = None
            return
        self.upload = None
        self.newest = stored
        log.info(
            "snapshot of step %d written (%.1f MiB, from %s): %s",
            stored.step,
            stored.size / 2**20,
            who,
            stored.path,
        )

    def _check_and_write(self, upload: Upload, who: str, data: bytes) -> Stored:
        name = f"the snapshot of step {upload.step} from {who}"
        model = snapshots.check(data, self.cfg, name, upload.step, upload.digest)
        directory = self.coord.save_dir
        assert directory is not None  # nothing is asked for without a save directory
        path = snapshots.write_snapshot(directory, upload.step, data)
        k = self.cfg.coordinator
        snapshots.prune(directory, k.keep_snapshots, k.prune_history)
        return Stored(model.step, model.seed, upload.digest, len(data), path)

    def lost(self, peer: Peer):
        upload = self.upload
        if upload is not None and upload.peer is peer:
            log.info("%s left during its snapshot upload; asking another worker", peer.name)
            self._ask_next()

    # --- downloads -------------------------------------------------------------------

    def wants_snapshot(self, peer: Peer, step: int) -> bool:
        """Does a deggs worker at `step` get a snapshot instead of a catch-up step?"""
        if peer.drifted:
            return True
        return self.newest is not None and step < self.newest.step

    async def send_snapshot(self, peer: Peer) -> bytes:
        """Stream the newest snapshot to a worker (or, with none, tell a drifted worker to
        start over from the initial weights), frame by frame as its socket drains."""
        peer.drifted = False
        stored = self.newest
        if stored is None:
            return SnapshotHeader(0, 0, 0, bytes(32)).encode()
        f = await self.coord.on_disk(open, stored.path, "rb")  # an open file survives pruning
        try:
            header = SnapshotHeader(stored.step, stored.seed, stored.size, stored.digest)
            peer.send_now(header.encode())
            for offset in range(0, stored.size, PART_SIZE):
                data = await self.coord.on_disk(f.read, PART_SIZE)
                if len(data) != min(PART_SIZE, stored.size - offset):
                    raise ProtocolError(f"{stored.path} changed while it was sent")
                await peer.writable()
                if peer.closing:
                    return b""
                peer.send_now(SnapshotPart(offset, data).encode())
        finally:
            self.coord.on_disk(f.close)
        log.info("sent the snapshot of step %d to %s", stored.step, peer.name)
        return b""
