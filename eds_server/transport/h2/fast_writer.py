"""The fast path's writer: gRPC messages framed once for every stream a change goes to, queued
on each connection, and written once per connection and batch (Flusher); a new stream's response
HEADERS with its first message; one socket write per flow-control window otherwise. Touches
grpclib and h2 internals (private.py lists each, and why), on the versions compat.py verified only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

import grpclib.server
from grpclib import GRPCError
from grpclib.events import SendInitialMetadata
from grpclib.metadata import encode_grpc_message
from grpclib.protocol import Connection, Peer
from h2.connection import ConnectionInputs, ConnectionState
from h2.exceptions import StreamClosedError
from h2.stream import StreamInputs, StreamState

from .base import Framed
from .fast_connection import GuardedH2Connection

log = logging.getLogger("eds_server.grpc")


def hpack_literal(name_index: int, value: bytes) -> bytes:
    """An HPACK header field "without indexing" with a static-table name (RFC 7541 6.2.2): it leaves
    both sides' dynamic tables as they are. Values under 127 bytes only (content types are)."""
    if len(value) >= 127:
        raise ValueError(f"{len(value)} bytes: too long for a one-byte length")
    first = bytes([name_index]) if name_index < 15 else bytes([15, name_index - 15])
    return first + bytes([len(value)]) + value


STATUS_200 = b"\x88"  # ":status: 200", static table entry 8
CONTENT_TYPE = 31  # "content-type" in the static table


class ResponseHeaders:
    """The HPACK block of a response's headers, built once per content type (a server's streams
    share one: there are one or two content types, and at most 16 are kept)."""

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        self._blocks: dict[str, bytes] = {}

    def block(self, content_type: str) -> bytes | None:
        """The block for `content_type`, or None where h2 must encode it (too long, too many)."""
        block = self._blocks.get(content_type)
        if block is None:
            value = content_type.encode()
            if len(value) >= 127 or len(self._blocks) >= 16:
                return None
            block = self._blocks[content_type] = STATUS_200 + hpack_literal(CONTENT_TYPE, value)
        return block


def queue_initial_headers(stream: grpclib.server.Stream[Any, Any], headers: ResponseHeaders) -> bool:
    """grpclib's send_initial_metadata without its own socket write or await, when nothing listens
    for its event: the HEADERS stay in h2's buffer, and go out in the connection's next write, with
    the first response's DATA (queue_message takes h2's buffer first). Connecting 10,000 streams
    wrote each stream's headers on their own, then its first response: 20,000 writes, now one per
    connection and batch.

    Every response starts with the same two headers, so their HPACK block is built once (fields
    that leave the dynamic tables alone) and the frame written here; h2's state machines take the
    same inputs its send_headers gives them. h2 encoding, validating and framing them cost a tenth
    of the CPU of connecting a stream. False (nothing done) where grpclib's own way must run."""
    raw = stream._stream
    connection = cast(FlushingConnection, raw.connection)  # every connection of the fast server's
    h2 = connection.h2
    sid = raw.id
    if stream._dispatch._listeners.get(SendInitialMetadata) or sid not in h2.streams:
        return False
    h2_stream = h2.streams[sid]
    state = h2_stream.state_machine.state
    if state is not StreamState.OPEN and state is not StreamState.HALF_CLOSED_REMOTE:
        return False
    if h2.state_machine.state is not ConnectionState.SERVER_OPEN or h2.encoder.header_table.resized:
        return False  # h2 raises as it should, or must start its next block with a table size update
    block = headers.block(stream._content_type)
    if block is None:
        return False
    h2.state_machine.process_input(ConnectionInputs.SEND_HEADERS)
    h2_stream.state_machine.process_input(StreamInputs.SEND_HEADERS)
    h2_stream.request_method = None  # as h2 sets it from a response's headers
    pending = connection.queued.pending
    queued = h2.data_to_send()
    if queued:
        pending.append(queued)  # queued before: written before
    pending.append(len(block).to_bytes(3, "big") + b"\x01\x04" + sid.to_bytes(4, "big") + block)
    h2.note_headers(sid)
    raw.connection.headers_send_process()
    stream._send_initial_metadata_done = True
    return True


def queue_message(stream: grpclib.server.Stream[Any, Any], message: Framed) -> bool:
    """Queue a whole gRPC message as DATA frames for the connection's next write if the
    flow-control windows take it all (False, nothing queued, otherwise). The caller has the
    connection flushed (one write for every stream a change went to).

    The frames are built here, not by h2's send_data: per 16 KB frame h2 runs two state machines,
    builds a frame object and copies the payload three times. What send_data does that matters is
    done the same way, once per message: the connection's and the stream's states are checked (their
    state machines would not change on SEND_DATA), both windows shrink, and the connection counts the frames
    (WINDOW_UPDATEs they pay for, streams touched). The frames' payloads are views of `message`,
    queued on the connection's `QueuedTransport` behind whatever h2 had queued before them.
    grpclib and h2 private API (pinned in constraints.txt; tests/transport/test_grpc.py and the Envoy tests
    read these frames with h2 and with Envoy)."""
    raw = stream._stream
    connection = cast(FlushingConnection, raw.connection)  # every connection of the fast server's
    h2 = connection.h2
    sid = raw.id
    assert sid is not None
    h2_stream = h2.streams.get(sid)
    size = len(message.data)
    # h2's state machines take SEND_DATA in these states without a change or a callback; in any
    # other the usual path (send_frames, through h2) raises as it should.
    if h2_stream is None or h2.state_machine.state is not ConnectionState.SERVER_OPEN:
        return False
    state = h2_stream.state_machine.state  # compared by identity: an Enum's hash is Python code
    if state is not StreamState.OPEN and state is not StreamState.HALF_CLOSED_REMOTE:
        return False
    if h2.outbound_flow_control_window < size or h2_stream.outbound_flow_control_window < size:
        return False
    heads, payloads = message.frames(h2.max_outbound_frame_size)
    tail = sid.to_bytes(4, "big")
    pending = connection.queued.pending
    queued = h2.data_to_send()
    if queued:
        pending.append(queued)  # queued before: written before
    for head, payload in zip(heads, payloads, strict=True):
        pending.append(head + tail)
        pending.append(payload)
    h2.outbound_flow_control_window -= size
    h2_stream.outbound_flow_control_window -= size
    h2.note_data_frames(sid, len(heads))
    stream._send_message_done = True
    return True


def guarded_h2(raw: Any) -> GuardedH2Connection | None:
    """The h2 connection below a grpclib protocol stream, if the fast server's (None otherwise)."""
    connection = raw.connection
    return connection.h2 if isinstance(connection, FlushingConnection) else None


class QueuedTransport:
    """The connection's transport as grpclib and its streams see it: DATA frames queued for many
    streams (`pending`, see queue_message) go out in one writelines, views and all, and whatever is
    written meanwhile goes out after them, in order."""

    __slots__ = ("_transport", "pending")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.pending: list[bytes | memoryview] = []

    def write(self, data: bytes) -> None:
        if self.pending:
            self.pending.append(data)
            self.flush()
        elif data:
            self._transport.write(data)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if pending and not self._transport.is_closing():
            self._transport.writelines(pending)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:  # asked per stream per change: not through __getattr__
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:  # asked per new stream (its peer)
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class FlushingConnection(Connection):
    """grpclib's Connection on a `QueuedTransport`, whose queued frames its flush writes too.
    Holds its h2 connection and transport under names of its own, so the fast path reaches them
    through the public `Stream.connection` rather than grpclib's private attributes."""

    def __init__(self, h2: GuardedH2Connection, transport: asyncio.Transport, *, config: Any, flusher: Flusher) -> None:
        self.h2 = h2
        self.queued = QueuedTransport(transport)
        super().__init__(h2, cast(asyncio.Transport, self.queued), config=config)
        self._flusher = flusher
        self._peer = super().get_peer()

    def get_peer(self) -> Peer:
        """One for all the connection's streams (grpclib made one a stream): it holds only the transport."""
        return self._peer

    def queue(self, frame: bytes) -> None:
        """A frame built outside h2 (a WINDOW_UPDATE for DATA read past it), written with the
        connection's next write, this turn of the loop at the latest."""
        self.queued.pending.append(frame)
        self._flusher.later(self)

    def ack(self, stream_id: int, size: int) -> None:
        """grpclib writes the WINDOW_UPDATEs for every read at once: one write per stream as 10,000
        connect (a tenth of their CPU). Here they join the connection's next write, this turn of the loop."""
        if size:
            data = self.h2.acknowledged(size, stream_id)
            if data:
                self.queued.pending.append(data)
                self._flusher.later(self)

    def call_ended(self, stream_id: int) -> None:
        """A call's handler ended: a first request read past h2 and never taken is let go."""
        reader = self.h2.direct.get(stream_id)
        if reader is not None:
            reader.call_ended()

    def flush(self) -> None:
        queued = self.queued
        data = self.h2.data_to_send()
        if data:
            queued.pending.append(data)
        queued.flush()


def _write(stream: grpclib.server.Stream[Any, Any], data: memoryview, pos: int, window: int) -> int:
    """Queue as much of `data[pos:]` as `window` allows as DATA frames, write them at once."""
    raw = stream._stream
    connection = cast(FlushingConnection, raw.connection)
    h2 = connection.h2
    assert raw.id is not None  # the client opened the stream
    end = len(data)
    while pos < end and window > 0:
        n = min(window, h2.max_outbound_frame_size, end - pos)
        h2.send_data(raw.id, data[pos : pos + n])
        pos += n
        window -= n
    connection.queued.write(h2.data_to_send())
    connection.data_send_process()  # resets grpclib's keepalive bookkeeping
    return pos


async def send_frames(stream: grpclib.server.Stream[Any, Any], message: Framed) -> None:
    """grpclib's send_message for a server-streaming response, with one socket write per window.

    grpclib writes every 16 KB DATA frame to the socket on its own; fanning a 30 KB assignment out
    to 1,000 streams that is 2,000 writes where 1,000 do. Flow control is honoured as grpclib does.
    """
    if not stream._send_initial_metadata_done:
        await stream.send_initial_metadata()
    raw = stream._stream
    assert raw.id is not None
    data = memoryview(message.data)
    pos = 0
    while pos < len(data):
        await raw.connection.write_ready.wait()
        window = cast(FlushingConnection, raw.connection).h2.local_flow_control_window(raw.id)
        if window <= 0:
            raw.window_updated.clear()
            await raw.window_updated.wait()
            continue
        pos = _write(stream, data, pos, window)
    stream._send_message_done = True


FLUSH_EVERY = 256  # messages queued, at most, before the connections holding them are written


class Flusher:
    """Writes each connection's queued frames once, after every stream due an answer has queued
    its own: a change fanned out to 100 streams of one connection is one socket write, not 100.
    A change to thousands of streams is written every FLUSH_EVERY messages, not all at the end:
    the first Envoys start reading while the rest are queued (measured at 10,000 streams on two
    workers: delivery p50 205-220 ms down to 140-160 ms, CPU per change the same)."""

    def __init__(self, every: int = FLUSH_EVERY) -> None:
        self._unflushed: dict[Connection, None] = {}
        self._every = every
        self._queued = 0

    def later(self, connection: Connection) -> None:
        if not self._unflushed:
            asyncio.get_running_loop().call_soon(self._flush)
        self._unflushed[connection] = None
        self._queued += 1
        if self._queued >= self._every:
            self._flush()

    def _flush(self) -> None:
        pending, self._unflushed = self._unflushed, {}
        self._queued = 0
        for connection in pending:
            if connection.is_closing():
                continue
            try:  # one connection's failure must not hold up the others' frames, nor reach the caller
                connection.flush()
            except Exception as e:  # transports report write errors themselves; this is a backstop
                log.warning("write to a gRPC connection failed: %r", e)
                continue
            connection.data_send_process()  # resets grpclib's keepalive bookkeeping


class StatusInTrailers:
    """End a call that fails with trailers carrying its status, and no RST_STREAM after them.

    grpclib follows error trailers with RST_STREAM(NO_ERROR) when the client has not ended its side
    (RFC 9113 8.1 allows it); a grpclib client that gets both before it reads then reports "Stream
    reset by remote party" instead of the status. The reset is not needed: clients end their side
    once they read the trailers (grpclib, grpc-go and Envoy do), as after OK trailers, which grpclib
    never follows with a reset; a client that does not keeps one stream of its own connection's
    MAX_CONCURRENT_STREAMS, and grpclib discards (and acknowledges) its further DATA. Follows
    grpclib 0.4.9's `Stream.send_trailing_metadata`, minus the reset. A class, not a generator
    context manager: one is built per stream, and that costs a third as much.
    """

    __slots__ = ("stream",)

    def __init__(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        self.stream = stream

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: object) -> bool:
        stream = self.stream
        if not isinstance(e, GRPCError) or stream._send_trailing_metadata_done:
            return False
        headers: list[tuple[str, str]] = []
        if not stream._send_initial_metadata_done:  # trailers-only
            headers += [(":status", "200"), ("content-type", stream._content_type)]
        headers.append(("grpc-status", str(e.status.value)))
        if e.message is not None:
            headers.append(("grpc-message", encode_grpc_message(e.message)))
        stream._send_trailing_metadata_done = True
        with contextlib.suppress(StreamClosedError):  # the client reset it already
            await stream._stream.send_headers(headers, end_stream=True)
        return True
