"""The fast path's reader: a stream's request messages read with limits (an oversize length
prefix refused before any of the body is read, the body due within the request timeout, partly
received bodies sharing one server-wide byte budget), and an established stream's messages taken
straight from its DATA frames (direct.py). Touches grpclib internals (private.py lists each, and
why), on the versions compat.py verified only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpclib.protocol
import grpclib.server
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.encoding.base import CodecBase

from ...events import NO_CONTEXT, LeanQueue
from .base import DirectClient, PassThroughCodec
from .direct import DirectReader, EarlyRequest
from .fast_writer import guarded_h2
from .limits import PartialBudget

_PASS_THROUGH = PassThroughCodec()


@dataclass
class MessageReader:
    """How request messages are read: size limit, deadlines, the shared partial-message budget."""

    max_size: int = 4 * 1024 * 1024
    timeout: float | None = None  # first message of a stream; every message's body
    budget: PartialBudget | None = None
    codec: PassThroughCodec = field(default_factory=PassThroughCodec)  # the server's: requests decoded as its handlers'

    def early(self, stream: grpclib.server.Stream[Any, Any], message_type: Any) -> Any:
        """The stream's first request, if it was joined from its DATA frames whole (EarlyRequest),
        as a view (60 KB from Envoy, not copied); None: it is in grpclib's buffer, or to come."""
        raw = stream._stream
        h2 = guarded_h2(raw)
        early = h2.direct.get(raw.id) if h2 is not None and raw.id is not None else None
        if isinstance(early, EarlyRequest):
            message = early.message()  # else it is in grpclib's buffer now, to be read as usual
            if message is not None:
                return self.codec.decode(message, message_type)
        return None

    async def read(self, stream: grpclib.server.Stream[Any, Any], message_type: Any, first: bool = False) -> Any:
        if first:
            message = self.early(stream, message_type)
            if message is not None:
                return message
        return await recv_limited(
            stream,
            message_type,
            self.max_size,
            timeout=self.timeout,
            budget=self.budget,
            first=first,
            codec=self.codec,
        )

    def direct(
        self,
        stream: grpclib.server.Stream[Any, Any],
        client: DirectClient,
    ) -> asyncio.Future[None] | None:
        """Give the stream's further messages to `client` as their DATA frames arrive (direct.py),
        until the stream needs grpclib again: the future returned is done then (read on with
        `read`), or fails with what ended the stream; cancelled (the call is over), the reading
        stops. None where that cannot be done (not our h2 connection, data already buffered).
        No task waits meanwhile: a stream's reader task ends here (grpc.StreamSession.read)."""
        raw = stream._stream
        h2 = guarded_h2(raw)
        buffer = raw.buffer
        if h2 is None or raw.id is None or raw.id in h2.direct:
            return None
        if buffer._eof or buffer._acked_size or not buffer._unacked.empty() or raw.id not in h2.streams:
            return None
        if h2.incoming_buffer._data:  # h2 holds a frame begun, maybe this stream's: it must read it
            return None
        reader = DirectReader(raw, client, self, grant_at=max(1, h2.local_settings.initial_window_size // 2))
        h2.direct[raw.id] = reader
        # however it ends (cancelled: the call is over), one callback: a list of them less a stream
        reader.done.add_done_callback(reader.ended, context=NO_CONTEXT)
        return reader.done


def _buffered(buffer: grpclib.protocol.Buffer, size: int) -> bool:
    """Whether reading `size` bytes of a stream's data completes without waiting (all received, or
    the stream's end is): then no deadline is kept for it. An Envoy's request comes with its
    HEADERS, so a stream's first request is nearly always here already when its handler reads it:
    two asyncio timeouts a stream (a timer, the task's uncancel bookkeeping), 7-9 us, 2-3% of the
    CPU of connecting a stream (docs/performance.md). grpclib's buffer: what is taken in
    `_acked_size`, the rest queued in `_unacked` (ours, events.LeanQueue, on the fast path), an
    item acking nothing being its end."""
    need = size - buffer._acked_size
    if need <= 0:
        return True
    queue = buffer._unacked
    if not isinstance(queue, LeanQueue):
        return False
    for item in queue.queued():
        if not item.ack_size:
            return True
        need -= item.data_size
        if need <= 0:
            return True
    return False


async def recv_limited(
    stream: grpclib.server.Stream[Any, Any],
    message_type: Any,
    max_size: int,
    *,
    timeout: float | None = None,
    budget: PartialBudget | None = None,
    first: bool = False,
    codec: CodecBase | None = None,
) -> Any | None:
    """grpclib's recv_message, but refusing an oversize message from its length prefix, and with
    deadlines: for the first message of a stream to start, and for any message's body to arrive.

    grpclib would buffer (and acknowledge to the sender) whatever length a client announces, and
    wait for it forever.
    """
    raw = stream._stream
    try:
        if first and timeout is not None and not _buffered(raw.buffer, 5):
            try:
                async with asyncio.timeout(timeout):
                    header = await raw.recv_data(5)
            except TimeoutError:
                h2 = guarded_h2(raw)
                if h2 is not None and raw.id is not None:
                    h2.timed_out(raw.id, timeout, defer=True)
                raise GRPCError(Status.DEADLINE_EXCEEDED, f"no request within {timeout:g}s") from None
        else:
            header = await raw.recv_data(5)
        if not header:
            return None
        if header[0]:
            raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
        size = int.from_bytes(header[1:5], "big")
        if size > max_size:
            if budget is not None:
                budget.too_big += 1
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"message of {size} bytes (limit {max_size})")
        h2 = guarded_h2(raw)
        peer = h2.peer if h2 is not None else None
        if budget is not None and not budget.take(size, peer):
            raise GRPCError(Status.RESOURCE_EXHAUSTED, "server busy receiving other messages, retry later")
        try:
            if _buffered(raw.buffer, size):
                data = await raw.recv_data(size)  # read without a wait: no deadline to keep
            else:
                async with asyncio.timeout(timeout):
                    data = await raw.recv_data(size)
        except TimeoutError:
            raise GRPCError(Status.DEADLINE_EXCEEDED, f"message not complete within {timeout:g}s") from None
        finally:
            if budget is not None:
                budget.give(size, peer)
    except AssertionError:  # grpclib's way of saying the stream ended inside a message
        raise GRPCError(Status.INVALID_ARGUMENT, "truncated gRPC message") from None
    if len(data) != size:  # ended right after the length prefix: b"", not an empty request
        raise GRPCError(Status.INVALID_ARGUMENT, "truncated gRPC message")
    return (codec or _PASS_THROUGH).decode(data, message_type)
