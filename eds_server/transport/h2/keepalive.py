"""The gRPC port's keepalive, one mechanism for both HTTP/2 paths: a PING every `interval`, and
the connection closed when no PING ACK echoing its payload comes within `timeout`, unless the client
was plainly alive meanwhile.

Why ours and not grpclib's: grpclib's timer closes the connection `timeout` after the PING
whatever became of the answer, silently. At 100,000 streams it reset a fleet's connections with
nothing in the log, for reasons a client is not to blame for:
- the answer arrived but waits in the server's own read queue (fair.py), behind the client's
  first requests: the expiry is put off while input received before it was due still waits there
  (fair.Deferral, as the request deadlines are);
- the answer waits in the client's own output, behind megabytes of its first requests (measured:
  0.3-3.6 MB received from such a client between the PING and its expiry): a client that sent
  requests since the PING (bytes of DATA, HEADERS or CONTINUATION frames) is alive, and the next
  PING asks again, as gRPC core and grpc-go count any data received as an answer;
- the PING waits in our own output, behind responses a client busy elsewhere reads slowly
  (measured: 70-200 KB of ours unsent at the expiry, nothing received): a client that took some of
  it since the PING (what we hold unsent is less than when the PING was written) is reading, and is
  asked again. One that takes nothing is closed, whether it is gone or never reads.
A connection closed for it is counted and logged (`keepalive`), with what was received since.

What it keeps: only requests count, not control frames, and only an ACK that echoes the payload
answers: a client that never reads cannot answer a PING it never saw, and PING ACKs or other
control frames sent blind keep nothing open. A client that never reads but sends requests is
held to its budgets as it sends them, and its streams to the send timeout."""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import itertools
import struct
import termios
from collections.abc import Callable
from typing import Protocol

from .fair import HELD_RECHECK, Deferral, MeteredInput


class Reading(Protocol):
    """A connection's frame guard, as the keepalive sees it (guard.FrameGuard)."""

    requests: int  # bytes of DATA, HEADERS and CONTINUATION frames read


_PAYLOAD = struct.Struct(">Q")
_COUNTER = itertools.count(1)  # payloads differ across connections and pings: no ACK is guessed from another


class KeepaliveCounts:
    """A server's PINGs sent and answered (`/v1/stats`: `keepalive`)."""

    __slots__ = ("answered", "busy", "pings")

    def __init__(self) -> None:
        self.pings = 0
        self.answered = 0
        self.busy = 0  # unanswered, but the client sent requests or took our output: asked again

    def as_dict(self) -> dict[str, int]:
        return {"pings": self.pings, "answered": self.answered, "busy": self.busy}


def unsent(transport: asyncio.Transport | None) -> int:
    """Bytes written to `transport` that its client has not taken: what the transport holds, and
    what the kernel holds in the socket's send queue (Linux's SIOCOUTQ, the same number as
    TIOCOUTQ), where a loopback connection keeps megabytes."""
    if transport is None:
        return 0
    held = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        out = array.array("i", [0])
        with contextlib.suppress(OSError, ValueError):
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, out, True)
            held += out[0]
    return held


def _ignore(_: object) -> None:
    pass


def _no_input() -> MeteredInput | None:
    return None


def _nothing_sent() -> int:
    return 0


class Keepalive:
    """One connection's keepalive. `send(payload)` writes a PING; `expire(why)` closes the
    connection; `queued()` is its metered input (or None), whose wait may put the expiry off;
    `requests()` counts the bytes of requests the client has sent (FrameGuard.requests)."""

    __slots__ = (
        "_deferral",
        "_handle",
        "_received",
        "_requests",
        "_sent_at",
        "_unsent",
        "counts",
        "expire",
        "interval",
        "payload",
        "queued",
        "requests",
        "send",
        "timeout",
        "unsent",
    )

    def __init__(
        self,
        interval: float,
        timeout: float,
        counts: KeepaliveCounts,
        send: Callable[[bytes], None],
        expire: Callable[[str], None],
        queued: Callable[[], MeteredInput | None],
        guard: Callable[[], Reading],
        transport: Callable[[], asyncio.Transport | None],
    ) -> None:
        """Running from here (its first PING an interval away): what counts as alive is the same
        on both paths, the bytes of requests its frame guard read and what of its transport's
        output the client has not taken."""
        self.requests: Callable[[], int] = lambda: guard().requests
        self.unsent: Callable[[], int] = lambda: unsent(transport())
        self.counts = counts
        self.interval = interval
        self.timeout = timeout
        self.send = send
        self.expire = expire
        self.queued = queued
        self.payload: bytes | None = None  # of the PING awaiting its ACK
        self._sent_at = 0.0
        self._received = 0  # bytes received from the client before the PING
        self._requests = 0  # of them, bytes of requests
        self._unsent = 0  # bytes of ours the client had not taken when the PING was written
        self._handle: asyncio.TimerHandle | None = None
        self._deferral = Deferral()
        if interval > 0:
            self._handle = asyncio.get_running_loop().call_later(interval, self._ping)

    def stop(self) -> None:
        """No more PINGs; what it was handed is let go (the connection's protocol holds it: a cycle)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.payload = None
        self.send = self.expire = _ignore
        self.queued = _no_input
        self.requests = self.unsent = _nothing_sent

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
        metered = self.queued()
        self._received = metered.received if metered is not None else 0
        self._requests = self.requests()
        self._unsent = self.unsent()
        self._sent_at = loop.time()
        self._handle = loop.call_later(self.timeout, self._due)
        self.counts.pings += 1
        self.send(self.payload)

    def _due(self) -> None:
        """The ACK is late: unless our own queue may hold it, or the client has plainly been alive
        since the PING (sent requests, taken our output), the connection ends."""
        loop = asyncio.get_running_loop()
        if self._deferral.holds(self.queued(), loop.time()):
            self._handle = loop.call_later(HELD_RECHECK, self._due)
            return
        # its answer may wait behind its own requests, or the PING behind our output it is taking
        if self.requests() > self._requests or self.unsent() < self._unsent:
            self.counts.busy += 1
            self._handle = loop.call_later(max(0.0, self._sent_at + self.interval - loop.time()), self._ping)
            return
        self._handle = None
        self.payload = None
        metered = self.queued()
        since = metered.received - self._received if metered is not None else 0
        self.expire(f"no answer to a PING within {self.timeout:g}s ({since} bytes received since)")
