"""Reading an established stream's request messages straight from its DATA frames.

An Envoy stream sends one small request (an ACK) per response, and through h2 and grpclib each one
costs a frame object and its repr, h2's stream and flow-control state machines, an event, a queue
put and get, a task switch and two buffered reads: most of the CPU of a fan-out. A stream's first
request, sent with its HEADERS, is joined from its frames before its handler runs (`EarlyRequest`,
below) or, if it cannot be, read the usual way; after it, the fast path's protocol
(fast_protocol.py) hands the stream's plain DATA frames (no END_STREAM, no padding) to a
`DirectReader`, which cuts them into gRPC messages and gives each to the session at once, inside
data_received. Everything else
(HEADERS, RST_STREAM, END_STREAM, padded DATA) makes the stream fall back to h2 and grpclib first,
with any partly received message put back in front of grpclib's buffer, so nothing is lost or
reordered.

The limits of the usual path hold here too: the message size limit (from the length prefix), the
partial-message budget, and the time a started message has to finish. Flow control: h2 never sees
these frames, so their bytes are granted back to the client here, by WINDOW_UPDATE frames queued in
h2's output buffer once half a window has been consumed.
"""

from __future__ import annotations

import asyncio
import struct
from typing import TYPE_CHECKING, Any, Protocol, cast

from grpclib import GRPCError
from grpclib.const import Status
from grpclib.protocol import AckedData

from .fair import PIN_RATIO
from .fast_connection import window_update
from .limits import PartialBudget

if TYPE_CHECKING:
    from .base import DirectClient
    from .fast_connection import GuardedH2Connection
    from .fast_writer import FlushingConnection


_PREFIX = struct.Struct(">BL")  # a gRPC message's compressed flag and length


class ReadLimits(Protocol):
    """The limits a stream's messages are read within (fast_reader.MessageReader's)."""

    @property
    def max_size(self) -> int: ...
    @property
    def timeout(self) -> float | None: ...
    @property
    def budget(self) -> PartialBudget | None: ...


class DirectReader:
    """One stream's request messages, cut from the DATA frames the protocol hands over."""

    __slots__ = (
        "_buf",
        "_deadline",
        "_need",
        "_taken",
        "client",
        "connection",
        "done",
        "grant_at",
        "h2",
        "limits",
        "messages",
        "raw",
        "stream_id",
        "unacked",
    )

    def __init__(
        self,
        raw: Any,
        client: DirectClient,
        limits: ReadLimits,
        grant_at: int,
    ) -> None:
        self.raw = raw  # grpclib's protocol.Stream
        self.connection: FlushingConnection = raw.connection
        self.h2: GuardedH2Connection = self.connection.h2
        self.stream_id: int = raw.id
        self.client = client  # each message; `done`, once it is, after the reader has let go
        self.limits = limits
        self.grant_at = grant_at  # bytes consumed before the stream's window is topped up
        self.unacked = 0
        self.messages = 0  # read this way: what tests count to see the path is taken
        self._buf: bytes | bytearray = b""  # a message begun: its 5-byte prefix (whole or not) and body so far
        self._need = 0  # bytes _buf must hold before a message in it is whole
        self._taken = 0  # partial-message budget held for it
        self._deadline: asyncio.TimerHandle | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def take(self, payload: memoryview) -> None:
        """A DATA frame's payload (no padding): every message it completes goes to the client."""
        self.unacked += len(payload)
        if self.unacked >= self.grant_at:
            self.connection.queue(window_update(self.stream_id, self.unacked))
            self.unacked = 0
        if self._buf:
            # A message begun: appended in place until it is whole, so a message that arrives in
            # many frames costs linear time (copying all of it again per frame was quadratic).
            buf = cast(bytearray, self._buf)
            buf += payload  # extended in place
            if len(buf) < self._need:
                return
            payload = memoryview(buf)
        try:
            rest = self._cut(payload)
        except Exception as e:  # whatever the session raised ends the stream, as on the usual path
            self.fail(e)
            return
        if not self.done.done():
            if rest:
                self._buf = buf = bytearray(rest)  # at most one frame and a partial message
                self._need = 5 if len(buf) < 5 else 5 + _PREFIX.unpack_from(buf)[1]
                self._await_rest()
            elif self._buf:
                self._buf = b""

    def _cut(self, data: memoryview) -> memoryview:
        """Hand over every whole message at the start of `data`; the unfinished rest."""
        pos, end = 0, len(data)
        while end - pos >= 5:
            compressed, size = _PREFIX.unpack_from(data, pos)
            if compressed:
                raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
            if size > self.limits.max_size:
                if self.limits.budget is not None:
                    self.limits.budget.too_big += 1
                raise GRPCError(Status.RESOURCE_EXHAUSTED, f"message of {size} bytes (limit {self.limits.max_size})")
            if end - pos - 5 < size:
                self._hold(size)
                break
            message = bytes(data[pos + 5 : pos + 5 + size])
            pos += 5 + size
            if self._taken or self._deadline is not None:  # it was the message begun before
                self._release()
            self.messages += 1
            self.client.on_message(message)
            if self.done.done():  # the session ended the stream, or it fell back meanwhile
                break
        return data[pos:]

    def _hold(self, size: int) -> None:
        """A message's body is still to come: charge it to the partial-message budget, once."""
        budget = self.limits.budget
        if budget is not None and not self._taken:
            if not budget.take(size, self.h2.peer):
                raise GRPCError(Status.RESOURCE_EXHAUSTED, "server busy receiving other messages, retry later")
            self._taken = size

    def _release(self) -> None:
        budget = self.limits.budget
        if budget is not None and self._taken:
            budget.give(self._taken, self.h2.peer)
        self._taken = 0
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _await_rest(self) -> None:
        timeout = self.limits.timeout
        if timeout is not None and self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._expired, timeout)

    def _expired(self, timeout: float) -> None:
        self._deadline = None
        self.fail(GRPCError(Status.DEADLINE_EXCEEDED, f"message not complete within {timeout:g}s"))

    def leave(self) -> None:
        """Stop reading this stream's frames (and give back what a message begun held)."""
        if self.h2.direct.get(self.stream_id) is self:
            del self.h2.direct[self.stream_id]
        if self.unacked:  # the stream may go on (a padded frame, say): its window is not lost
            self.connection.queue(window_update(self.stream_id, self.unacked))
            self.unacked = 0
        self._release()

    def ended(self, done: asyncio.Future[None]) -> None:
        self.leave()
        self.client.direct_ended(done)

    def fail(self, exc: BaseException) -> None:
        """End the direct path with `exc`, raised where the session waits on it."""
        self.leave()
        self._buf = b""
        if not self.done.done():
            self.done.set_exception(exc)

    def call_ended(self) -> None:
        """Nothing: the call's end cancels its future (MessageReader.direct), which lets go of it."""

    def fall_back(self) -> None:
        """Hand the stream back to grpclib, with the bytes of a message begun in front of its buffer."""
        self.leave()
        if self._buf:
            buffer = self.raw.buffer
            held = bytes(self._buf)
            self._buf = b""
            buffer._acked.appendleft(AckedData(memoryview(held), len(held)))
            buffer._acked_size += len(held)
        if not self.done.done():
            self.done.set_result(None)


def _whole(data: bytearray | memoryview) -> bool:
    """Whether `data` is exactly one uncompressed gRPC message, prefix and all."""
    return len(data) >= 5 and not data[0] and len(data) == 5 + _PREFIX.unpack_from(data)[1]


class EarlyRequest:
    """A stream's first request, read straight from its DATA frames before its handler has run.

    An Envoy sends a stream's HEADERS and its first request (a 60 KB Node, four DATA frames)
    together. Through h2 and grpclib each of those frames cost a frame object, h2's flow-control
    and stream state machines, an event and a buffered read; here they are joined as they come (a
    request in one frame, as an Envoy sends it under our frame size, is kept as it was read: a view
    of an immutable read, not a copy, unless that would keep more than PIN_RATIO times its size
    alive), and the handler's first read takes the whole message. Only that: a message not whole when the
    handler reads, or more than one message, or any frame but plain DATA (fast_protocol's split
    hands those to `fall_back`), puts every byte received in front of grpclib's buffer, and the
    stream is read the usual way (size limit, deadlines, partial-message budget) from there.

    Flow control is h2's own: each frame is counted against the stream's and the connection's
    receive windows as h2 counts a DATA frame it reads (one that would overrun either is left to
    h2, which refuses it as it always did), and the bytes are acknowledged to h2 when the handler
    takes them or grpclib's buffer does, so h2 grants them back by its own rule, as for any read.
    """

    __slots__ = ("_buf", "_windows", "connection", "h2", "raw", "stream_id")

    def __init__(self, raw: Any, windows: tuple[Any, Any]) -> None:
        self.raw = raw  # grpclib's protocol.Stream
        self.connection: FlushingConnection = raw.connection
        self.h2: GuardedH2Connection = self.connection.h2
        self.stream_id: int = raw.id
        self._windows = windows  # h2's receive window accounting: the connection's, the stream's
        self._buf: bytearray | memoryview = bytearray()

    def fits(self, length: int) -> bool:
        """Whether a DATA frame of `length` bytes is within both receive windows (else h2 reads it)."""
        connection, stream = self._windows
        return bool(length <= connection.current_window_size and length <= stream.current_window_size)

    def take(self, payload: memoryview) -> None:
        for window in self._windows:  # counted as h2 counts the frames it reads
            window.window_consumed(len(payload))
        buf = self._buf
        if not buf and _whole(payload) and len(payload) * PIN_RATIO >= len(payload.obj):  # type: ignore[arg-type]
            # the whole request in one frame (an Envoy's: a DATA frame of up to 1 MB), kept as it was
            # read, not copied: the read is immutable, and at most PIN_RATIO times its size
            self._buf = payload
            self.h2.early_kept += 1
            return
        if isinstance(buf, memoryview):  # more after a whole request: joined after all
            self._buf = buf = bytearray(buf)
        buf += payload

    def message(self) -> memoryview | None:
        """The stream's whole first request, taken; None if it is not whole (it is then in grpclib's
        buffer, to be read the usual way)."""
        buf = self._buf
        if _whole(buf):
            self._leave()
            self.h2.early_taken += 1
            return memoryview(buf)[5:]
        self.fall_back()
        return None

    def fall_back(self) -> None:
        """Hand the stream to h2 and grpclib, what came so far first in grpclib's buffer: acknowledged
        to h2 as grpclib reads it, as if h2 had read it."""
        buf = self._leave(acknowledge=False)
        self.h2.early_returned += 1
        if buf:
            self.raw.buffer.add(bytes(buf), len(buf))

    def call_ended(self) -> None:
        """Its call ended without reading it: what came is granted back, and let go."""
        self._leave()

    def _leave(self, acknowledge: bool = True) -> bytearray | memoryview:
        if self.h2.direct.get(self.stream_id) is self:
            del self.h2.direct[self.stream_id]
        buf, self._buf = self._buf, bytearray()
        if buf and acknowledge:
            self.connection.ack(self.stream_id, len(buf))  # h2 grants them back by its own rule
        return buf
