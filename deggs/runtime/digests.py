"""Do the replicas still hold the same model? The coordinator's book of state digests.

Every worker reports the digest of its whole state (export.state_digest) when its model
reaches a digest step S, before it asks for a chunk of S. When step S is sealed the
coordinator decides: the digest a strict majority of the reports of the workers that
scored a chunk of S holds is the agreed state of S (a connection that did no work has no
vote, so it cannot outvote those that did), and a worker that reported another one has
drifted (bad memory, a driver, a
kernel that computes otherwise on another card). A drifted worker gets no more chunks
and rebuilds its model from the newest snapshot. Reports that arrive after the decision
are held to the agreed digest at once.

With one report there is nothing to compare, and its digest stands. Reports split with
no majority (two workers that disagree) leave no agreed state: the coordinator stops
handing out chunks until reports made again (by restarted workers, which rebuild from
the newest snapshot and replay through S) reach a majority.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

KEEP_AGREED = 256  # agreed digests remembered, newest last: a resync replays through them
MAX_PENDING_STEPS = 8  # steps with reports waiting for their decision


@dataclass
class Verdict:
    """The decision on a step's reports."""

    step: int
    agreed: bytes | None  # None: no reports, or a split
    reports: int
    drifted: dict[str, bytes] = field(default_factory=dict)  # reporter -> its digest
    split: bool = False
    resolved: bool = False  # it ends a split: chunks may go out again


class DigestBook:
    def __init__(self) -> None:
        self.pending: dict[int, dict[str, bytes]] = {}  # step -> reporter -> digest
        self.agreed: OrderedDict[int, bytes] = OrderedDict()
        self.split_step: int | None = None  # a step whose reports split, until resolved
        self._holders: dict[int, list[str]] = {}  # agreed step -> who reported its digest

    def agree(self, step: int, digest: bytes):
        """A digest known to be the run's state (a snapshot's)."""
        self.agreed[step] = digest
        self.agreed.move_to_end(step)
        while len(self.agreed) > KEEP_AGREED:
            self.agreed.popitem(last=False)

    def holders(self, step: int) -> list[str]:
        """The reporters of `step` whose digest was the agreed one (decided steps only)."""
        return list(self._holders.get(step, ()))

    def report(self, step: int, who: str, digest: bytes, current: int) -> Verdict | None:
        """Take a report. Returns a Verdict when it decides something now: the reporter
        drifted from an agreed digest, or its report resolves a split."""
        agreed = self.agreed.get(step)
        if agreed is not None:
            if digest == agreed:
                self._holders.setdefault(step, []).append(who)
                return None
            return Verdict(step, agreed, 1, {who: digest})
        if step < current and step != self.split_step:
            return None  # a step decided long ago, or one nobody else reported: no basis
        reports = self.pending.setdefault(step, {})
        reports[who] = digest
        while len(self.pending) > MAX_PENDING_STEPS:
            del self.pending[min(self.pending)]
        if step == self.split_step and len(reports) >= 2:
            verdict = self._majority(step, reports)
            if verdict.agreed is not None:
                self.split_step = None
                del self.pending[step]
                verdict.resolved = True
                return verdict
        return None

    def decide(self, step: int, voters: set[str]) -> Verdict:
        """The decision on `step`, once it is sealed, by the reports of `voters`; the
        others' are then held to the agreed digest, as late reports are."""
        reports = self.pending.pop(step, {})
        votes = {who: d for who, d in reports.items() if who in voters}
        if not votes:
            return Verdict(step, None, 0)
        verdict = self._majority(step, votes)
        if verdict.split:
            self.split_step = step
            self.pending[step] = {}  # made again by restarted workers
            return verdict
        for who, digest in reports.items():
            if who not in votes:
                if digest == verdict.agreed:
                    self._holders[step].append(who)
                else:
                    verdict.drifted[who] = digest
        return verdict

    def _majority(self, step: int, reports: dict[str, bytes]) -> Verdict:
        digest, count = Counter(reports.values()).most_common(1)[0]
        if 2 * count <= len(reports):
            return Verdict(step, None, len(reports), dict(reports), split=True)
        self.agree(step, digest)
        self._holders[step] = [who for who, d in reports.items() if d == digest]
        for old in [s for s in self._holders if s not in self.agreed]:
            del self._holders[old]
        drifted = {who: d for who, d in reports.items() if d != digest}
        return Verdict(step, digest, len(reports), drifted)
