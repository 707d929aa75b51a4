"""The coordinator's connections: one `Peer` per socket, and the limits around them.

A Peer is an asyncio Protocol: it cuts frames from the bytes as they arrive (checking
each header against the payload limits, and with a secret each record's tag), hands them
to the coordinator in order, and writes each batch of replies with one send. It keeps a
peer to its deadlines (the handshake, each frame, asking for work, reading its replies)
and closes it with one line when it breaks one. `Burst` summarises lines that a flood of
connections could otherwise repeat without end.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import resource
import time
from collections import deque
from typing import TYPE_CHECKING

from .channel import Channel
from .protocol import FrameReader, Hello, ProtocolError, printable, set_keepalive
from .steps import WorkerFigures

if TYPE_CHECKING:
    from .coordinator import Coordinator

log = logging.getLogger("deggs.runtime.coordinator")  # the coordinator's lines, one logger

FD_RESERVE = 64  # descriptors kept free of connections: checkpoints, metrics, logs
LINGER_S = 1.0  # how long a GOODBYE waits for the peer to read it before the socket closes


class Drop(Exception):
    """Close this connection, after sending `goodbye` (a frame saying why) if any."""

    def __init__(self, reason: str, goodbye: bytes = b""):
        super().__init__(reason)
        self.goodbye = goodbye


class Peer(asyncio.Protocol):
    """One connection: frames in, replies out, and the state of its handshake.

    Frames are handled in order. A reply that must come from disk (old history) pauses
    reading until it is written; so does a peer that leaves more than max_send_buffer
    bytes of replies unread, which bounds what one connection can make us hold.
    """

    transport: asyncio.Transport  # set by connection_made, which asyncio calls first

    def __init__(self, coordinator: Coordinator):
        self.coord = coordinator
        self.name = "?"
        self.reader = FrameReader(coordinator.limits)
        self.queue: deque[tuple[int, bytes]] = deque()
        self.opened = self.coord.clock()
        self.partial_since: float | None = None  # when the unfinished frame began
        self.write_paused_since: float | None = None
        self.busy = False  # waiting for a reply from disk
        self.closing = False
        self.got_frame = False
        self.hello: Hello | None = None
        self.nonce: bytes | None = None  # our challenge's
        self.authenticated = False
        self.channel: Channel | None = None  # seals our writes, once the secret is proven
        self.welcomed = False  # a deggs worker that passed the handshake
        self.asked = self.opened  # when it last asked for work (JOB_REQUEST)
        self.step: int | None = None  # the step it last asked for a chunk of
        self.chunks: set[int] = set()  # chunks handed to this connection in that step
        self.revoked: set[tuple[int, int]] = set()  # (step, chunk) taken back: it drifted
        self.drifted = False  # its state digest disagreed: it resyncs before more work
        self._writable = asyncio.Event()  # set while its replies do not pile up
        self._writable.set()
        self.figures = WorkerFigures()  # its share of that step; a new one each step

    @property
    def authorized(self) -> bool:
        """May this peer ask for work and send results? With a secret: once proven.
        Without one: anyone, but a deggs worker only after its HELLO was answered."""
        if self.coord.secret is not None:
            return self.authenticated
        return self.hello is None or self.welcomed

    @property
    def proven(self) -> bool:
        """Has it shown it is a worker? With a secret: proven it. Without: a deggs worker
        welcomed, or any peer that asked for work the protocol's way."""
        if self.coord.secret is not None:
            return self.authenticated
        return self.welcomed or self.asked > self.opened

    @property
    def holding(self) -> bool:
        """Does it hold a chunk of the step in progress (handed out, no RESULT yet)?"""
        return self.step == self.coord.state.step and bool(self.figures.holding)

    # --- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport):
        self.transport = transport
        self.name = _peer_name(transport)
        if not self.coord.admit(self):
            transport.abort()
            self.closing = True
            return
        set_keepalive(transport.get_extra_info("socket"))
        transport.set_write_buffer_limits(high=self.coord.config.coordinator.max_send_buffer)
        log.debug("%s connected", self.name)

    def connection_lost(self, exc):
        if self not in self.coord.peers:  # refused by admit(), or already forgotten
            return
        if self.reader.partial and not self.closing:
            self.coord.say(self, logging.WARNING, "dropping: disconnected mid-frame")
        elif self.proven:
            self.coord.say(self, logging.INFO, "disconnected")
        self.closing = True
        self.coord.forget(self)

    def data_received(self, data: bytes):
        if self.closing:
            return
        self.coord.state.bytes_received += len(data)
        try:
            frames = self.reader.feed(data)
        except ProtocolError as e:
            self._close(f"dropping: {e}")
            return
        if not self.reader.partial:
            self.partial_since = None
        elif frames or self.partial_since is None:
            self.partial_since = self.coord.clock()
        if frames:
            self.got_frame = True
            self.queue.extend(frames)
            self._process()

    def eof_received(self):
        return False  # close our side too, once our replies are out

    def pause_writing(self):
        self.write_paused_since = self.coord.clock()
        self._writable.clear()
        self.transport.pause_reading()

    def resume_writing(self):
        self.write_paused_since = None
        self._writable.set()
        if not self.busy and not self.closing:
            self.transport.resume_reading()
            self._process()

    # --- frames ------------------------------------------------------------------------

    def _process(self):
        """Handle queued frames until one must wait for the disk or the peer stops reading
        its replies (pause_writing); send each batch of replies as one write."""
        limit = self.coord.config.coordinator.max_send_buffer
        while self.queue and not self.busy and not self.closing and self.write_paused_since is None:
            out, size = [], 0
            while self.queue and size < limit and not self.busy:
                opcode, payload = self.queue.popleft()
                try:
                    reply = self.coord.handle(self, opcode, payload)
                except Drop as drop:
                    self._write(out)
                    self._close(f"closing: {drop}", drop.goodbye)
                    return
                except ProtocolError as e:
                    self._write(out)
                    self._close(f"dropping: {e}")
                    return
                except Exception as e:  # a bug of ours: this connection ends, the run goes on
                    self._write(out)
                    self._close(f"internal error handling its message: {e!r}", level=logging.ERROR)
                    return
                if isinstance(reply, bytes):
                    out.append(reply)
                    size += len(reply)
                elif reply is not None:
                    self.busy = True
                    self.transport.pause_reading()
                    asyncio.ensure_future(reply).add_done_callback(self._reply_ready)
            self._write(out)

    def _reply_ready(self, future: asyncio.Future):
        self.busy = False
        if future.cancelled():
            return
        error = future.exception()  # retrieved even when nobody is left to tell
        if self.closing:
            return
        if isinstance(error, Drop):
            self._close(f"closing: {error}", error.goodbye)
            return
        if error is not None:
            self._close(f"internal error handling its message: {error!r}", level=logging.ERROR)
            return
        self._write([future.result()])
        if self.write_paused_since is None:
            self.transport.resume_reading()
        self._process()

    def send_now(self, frame: bytes):
        """A frame out of turn (a request to the worker, or a streamed snapshot's part)."""
        self._write([frame])

    async def writable(self):
        """Until the peer has read enough of what we sent (or its connection closes)."""
        while not self._writable.is_set() and not self.closing:
            try:
                await asyncio.wait_for(self._writable.wait(), 1.0)
            except TimeoutError:
                pass

    def _write(self, frames: list[bytes]):
        if frames and not self.transport.is_closing():
            data = b"".join(frames)
            if self.channel is not None:
                data = self.channel.seal(data)  # one write, one record: one tag
            self.coord.state.bytes_sent += len(data)
            self.transport.write(data)

    # --- closing -----------------------------------------------------------------------

    def check_deadlines(self, now: float):
        k = self.coord.config.coordinator
        admitted = self.authenticated if self.coord.secret is not None else self.got_frame
        if not admitted and now - self.opened > k.handshake_timeout_s:
            self._close(f"closing: no handshake within {k.handshake_timeout_s:g} s")
        elif self.partial_since is not None and now - self.partial_since > k.frame_timeout_s:
            self._close(f"closing: a frame still unfinished after {k.frame_timeout_s:g} s")
        elif (
            self.write_paused_since is not None
            and now - self.write_paused_since > k.frame_timeout_s
        ):
            self._close(f"closing: it has not read its replies for {k.frame_timeout_s:g} s")
        elif now - self.asked > k.idle_timeout_s and not self.busy and not self.holding:
            self._close(f"closing: it has not asked for work for {k.idle_timeout_s:g} s")

    def _close(self, why: str, goodbye: bytes = b"", level: int = logging.WARNING):
        if self.closing:
            return
        self.coord.say(self, level, why)
        self.close_with(goodbye)

    def evict(self):
        """Close at once, replies unsent: its descriptor is wanted for a newcomer."""
        self.closing = True
        self.queue.clear()
        self.transport.abort()

    def close_with(self, goodbye: bytes = b""):
        """Close, letting queued replies and a GOODBYE out for at most LINGER_S.

        After a GOODBYE we half-close and read on (ignoring it) until the peer closes:
        closing with its unread input (a worker pipelines JOB_REQUEST after HELLO) would
        reset the connection and could destroy the explanation on its way. A peer that
        reads nothing at all is cut off when LINGER_S runs out.
        """
        if self.closing:
            return
        self.closing = True
        self.queue.clear()
        transport = self.transport
        if goodbye and not transport.is_closing():
            self._write([goodbye])
            try:
                if transport.can_write_eof():
                    transport.write_eof()
            except OSError:  # the peer is already gone (reset): nothing left to tell it
                transport.abort()
                return
            transport.resume_reading()
        else:
            transport.close()
        asyncio.get_running_loop().call_later(LINGER_S, transport.abort)


# Numbers and quoted bytes in a reason: blanked to tell the kind of a failure.
KIND_DETAILS = re.compile(r"b?'[^']*'|b?\"[^\"]*\"|\d+(\.\d+)?")


class Burst:
    """Lines about a kind of event, bounded: the first `lines` events of a window of
    `every` seconds are logged as they come, the rest counted and said as one line when
    the window ends (at the next event or tick()). A window that needed such a line
    counts all of its own, so a flood costs a line a window. `alone` is the line of a
    single event, `message` the count's."""

    def __init__(
        self,
        logger: logging.Logger,
        message: str,
        every: float = 10.0,
        level: int = logging.WARNING,
        alone: str | None = None,
        lines: int = 1,
    ):
        self.logger, self.message, self.every, self.level = logger, message, every, level
        self.alone, self.lines = alone, lines
        self.start = -float("inf")  # the window's (a rate of log lines: the wall's clock)
        self.said = 0  # lines the window has logged as they came
        self.count = 0  # events since, not said yet
        self.details: dict = {}  # the last event's, for the count's line

    def note(self, n: int = 1, **details):
        """`n` events alike (said, if they may be, as one line): the last one's details."""
        now = time.monotonic()
        if now - self.start >= self.every:
            self._next_window(now)
        self.details = details
        if self.said < self.lines and n == 1:
            self.said += 1
            self._say(1)
        else:
            self.count += n

    @property
    def open(self) -> bool:
        """Would the next event be said as it comes?"""
        return self.said < self.lines or time.monotonic() - self.start >= self.every

    def tick(self):
        """End a window whose events are counted and unsaid (called about once a second),
        so that its line comes within a window of them, not at the next event."""
        now = time.monotonic()
        if self.count and now - self.start >= self.every:
            self._next_window(now)

    def flush(self):
        """Say the events counted and unsaid (at the coordinator's stop)."""
        if self.count:
            self._say(self.count)
            self.count = 0

    def _next_window(self, now: float):
        flooded = self.count > 0
        self.flush()
        self.start, self.said = now, (self.lines if flooded else 0)

    def _say(self, n: int):
        line = self.alone if n == 1 and self.alone is not None else self.message
        self.logger.log(self.level, line.format(n=n, **self.details))


UNPROVEN_KINDS = 64  # kinds of unproven peers' failures summarised apart; the rest as one
PEER_LINES = 8  # lines a second of one kind said as they come: a box of workers joining
LOG_LINES = 64  # LOG_MESSAGE lines a second said as they come: a few workers' samples


class PeerLines:
    """Lines about peers: as they are for one that proved the secret; for any other
    (without a secret, everyone: anyone can open connections by the thousand) bounded
    by kind, PEER_LINES a second of each as they come and the rest as a count. The kind
    is the text with its numbers and quoted bytes blanked, so that a peer's input cannot
    make kinds without end."""

    def __init__(self, secret: bool):
        self.secret = secret
        self.bursts: dict[tuple[int, str], Burst] = {}  # by level and kind
        whose = " of unproven peers" if secret else ""
        self._log_lines = Burst(  # their LOG_MESSAGEs' lines, all kinds as one
            log,
            f"[{{name}}] {{line}} ({{n}} log lines{whose} since the last such count, "
            "the last shown)",
            1.0,
            logging.INFO,
            alone="[{name}] {line}",
            lines=LOG_LINES,
        )

    def say(self, peer: Peer, level: int, text: str):
        if self.secret and peer.authenticated:
            log.log(level, "%s %s", peer.name, text)
            return
        key = (level, KIND_DETAILS.sub("#", text))
        burst = self.bursts.get(key)
        if burst is None:
            if len(self.bursts) >= UNPROVEN_KINDS:
                key, text = (level, "other"), f"{text} (and other reasons)"
            whose = " from unproven peers" if self.secret else ""
            burst = self.bursts.setdefault(
                key,
                Burst(
                    log,
                    f"{{name}} {{why}} ({{n}} such{whose} since the last such line)",
                    1.0,
                    level,
                    alone="{name} {why}",
                    lines=PEER_LINES,
                ),
            )
        burst.note(name=peer.name, why=text)

    def log_lines(self, peer: Peer, lines: list[str]):
        """A peer's LOG_MESSAGE (its samples, its progress), a line each marked with its
        name and made printable (so that a peer can neither forge the coordinator's own
        lines nor drive the terminal): as they are from a peer that proved the secret;
        from any other, under one bound for them all, LOG_LINES a second as they come
        and the rest counted, without a look at each."""
        if self.secret and peer.authenticated:
            for line in lines:
                log.info("[%s] %s", peer.name, printable(line))
            return
        for i, line in enumerate(lines):
            if not self._log_lines.open:
                rest = len(lines) - i
                self._log_lines.note(rest, name=peer.name, line=printable(lines[-1]))
                return
            self._log_lines.note(name=peer.name, line=printable(line))

    def _all(self) -> list[Burst]:
        return [*self.bursts.values(), self._log_lines]

    def tick(self):
        for burst in self._all():
            burst.tick()

    def flush(self):
        """Say the counts not said yet (at the coordinator's stop)."""
        for burst in self._all():
            burst.flush()


EVICT_IDLE_S = 5.0  # a waiting worker asks at least every HOLD_S + 0.1 s (coordinator.py)


class Admission:
    """The bound on connections. At it, a newcomer takes the place of the oldest
    connection that has proven nothing yet, else of the one idle longest (no chunk held,
    no request for EVICT_IDLE_S), else it is refused: a worker at work is never pushed
    out. Each kind of closing is a bounded line with a count."""

    def __init__(self, limit: int):
        self.limit = limit
        self.over = Burst(log, "refused {n} connection(s) over the limit of {limit}")
        self.evicted = {
            what: Burst(log, f"closed {{n}} {what} connection(s) to make room (at {{limit}})")
            for what in ("idle", "unproven")
        }

    def admit(self, peers: set[Peer], peer: Peer, now: float) -> bool:
        if len(peers) >= self.limit:
            victim = self._evictable(peers, now)
            if victim is None:
                self.over.note(limit=self.limit)
                return False
            self.evicted["idle" if victim.proven else "unproven"].note(limit=self.limit)
            victim.evict()
        peers.add(peer)
        return True

    @staticmethod
    def _evictable(peers: set[Peer], now: float) -> Peer | None:
        best, best_key = None, (2, 0.0)
        for p in peers:
            if p.closing:
                continue
            if not p.proven:
                key = (0, p.opened)
            elif not p.busy and not p.holding and now - p.asked >= EVICT_IDLE_S:
                key = (1, p.asked)
            else:
                continue
            if key < best_key:
                best, best_key = p, key
        return best

    def tick(self):
        for burst in (self.over, *self.evicted.values()):
            burst.tick()

    def flush(self):
        for burst in (self.over, *self.evicted.values()):
            burst.flush()


def connection_budget(wanted: int) -> int:
    """max_connections, lowered so that connections never take the descriptors that
    checkpoint and metrics writes need (the soft limit is raised toward the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    budget = max(1, min(wanted, soft - FD_RESERVE))
    if budget < wanted:
        log.warning(
            "coordinator.max_connections lowered from %d to %d: the descriptor limit "
            "is %d (ulimit -n)",
            wanted,
            budget,
            soft,
        )
    return budget


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _peer_name(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
