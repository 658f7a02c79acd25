"""The gRPC port's keepalive, one mechanism for both HTTP/2 paths: a PING every `interval`, and
the connection closed when no PING ACK echoing its payload comes within `timeout`.

Why ours and not grpclib's: grpclib's timer closes the connection `timeout` after the PING
whatever became of the answer, silently. But the answer may have arrived and wait in the server's
own read queue (fair.py): a fleet of Envoys connecting at once sends megabytes of first requests,
each connection's PING ACK behind its own, and grpclib reset those connections at 100,000 streams
with nothing in the log. Here the expiry is put off while input received before it was due still
waits in our queue (fair.Deferral, as the request deadlines are), and a connection closed for it is
counted and logged (`keepalive`).

What it keeps: only an ACK that echoes the payload answers (a client that never reads cannot
answer a PING it never saw); mere input does not count as alive, unlike grpc-go and gRPC core,
which is what lets a client that never reads be closed here, whatever it sends. A client that
floods keeps its input queued, and that puts the expiry off only as long as the queue takes to
reach what it had sent by the deadline."""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import Callable

from .fair import HELD_RECHECK, Deferral, MeteredInput

_PAYLOAD = struct.Struct(">Q")
_COUNTER = itertools.count(1)  # payloads differ across connections and pings: no ACK is guessed from another


class KeepaliveCounts:
    """A server's PINGs sent and answered (`/v1/stats`: `keepalive`)."""

    __slots__ = ("answered", "pings")

    def __init__(self) -> None:
        self.pings = 0
        self.answered = 0

    def as_dict(self) -> dict[str, int]:
        return {"pings": self.pings, "answered": self.answered}


def _ignore(_: object) -> None:
    pass


def _no_input() -> MeteredInput | None:
    return None


class Keepalive:
    """One connection's keepalive. `send(payload)` writes a PING; `expire(why)` closes the
    connection; `queued()` is its metered input (or None), whose wait may put the expiry off."""

    __slots__ = (
        "_deferral",
        "_handle",
        "_sent_at",
        "counts",
        "expire",
        "interval",
        "payload",
        "queued",
        "send",
        "timeout",
    )

    def __init__(
        self,
        interval: float,
        timeout: float,
        send: Callable[[bytes], None],
        expire: Callable[[str], None],
        queued: Callable[[], MeteredInput | None],
        counts: KeepaliveCounts,
    ) -> None:
        self.counts = counts
        self.interval = interval
        self.timeout = timeout
        self.send = send
        self.expire = expire
        self.queued = queued
        self.payload: bytes | None = None  # of the PING awaiting its ACK
        self._sent_at = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._deferral = Deferral()

    def start(self) -> None:
        if self.interval > 0:
            self._handle = asyncio.get_running_loop().call_later(self.interval, self._ping)

    def stop(self) -> None:
        """No more PINGs; what it was handed is let go (the connection's protocol holds it: a cycle)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.payload = None
        self.send = self.expire = _ignore
        self.queued = _no_input

    def answered(self, payload: bytes) -> bool:
        """A PING ACK carrying `payload`: True if it answers ours (then the next PING is due an
        interval after this one was sent)."""
        if self.payload is None or payload != self.payload:
            return False
        self.payload = None
        self.counts.answered += 1
        if self._handle is not None:
            self._handle.cancel()
            loop = asyncio.get_running_loop()
            self._handle = loop.call_later(max(0.0, self._sent_at + self.interval - loop.time()), self._ping)
        return True

    def _ping(self) -> None:
        loop = asyncio.get_running_loop()
        self.payload = _PAYLOAD.pack(next(_COUNTER))
        self._deferral.since = None  # a deferral of the last PING's expiry says nothing of this one
        self._sent_at = loop.time()
        self._handle = loop.call_later(self.timeout, self._due)
        self.counts.pings += 1
        self.send(self.payload)

    def _due(self) -> None:
        """The ACK is late: unless our own queue may hold it, the connection ends."""
        loop = asyncio.get_running_loop()
        if self._deferral.holds(self.queued(), loop.time()):
            self._handle = loop.call_later(HELD_RECHECK, self._due)
            return
        self._handle = None
        self.payload = None
        self.expire(f"no answer to a PING within {self.timeout:g}s")
