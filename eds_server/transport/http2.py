"""HTTP/2 and gRPC framing below the EDS service, where grpclib's defaults do not fit an xDS server.

- MAX_CONCURRENT_STREAMS: h2 allows 100 per connection and grpclib drops the whole connection on
  stream 101, but Envoy opens one stream per EDS cluster on a single connection;
- a budget of client stream resets per connection, past which the connection gets GOAWAY
  (HTTP/2 "rapid reset");
- reading a message: grpclib buffers whatever length a client announces; here an oversize
  length prefix is refused before any of the body is read;
- writing a message: one socket write per flow-control window, not per 16 KB frame, and no timer
  when nothing has to wait;
- a codec that passes pre-encoded bytes through in both directions.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from ssl import SSLContext
from typing import Any, cast

import betterproto2
import grpclib.server
import hyperframe.frame
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.protocol import Connection, EventsProcessor, H2Protocol, _set_nodelay
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import StreamReset
from h2.exceptions import ProtocolError as H2ProtocolError
from h2.settings import SettingCodes, Settings

log = logging.getLogger("eds_server.grpc")

RESET_WINDOW = 10.0  # seconds

# h2 4.4 builds repr(frame) for every frame it receives, logging on or off, and hyperframe's repr
# hex-encodes a DATA frame's whole payload to keep its first 20 hex digits: a fifth of the CPU
# spent reading Envoy's 60 KB requests. Same text, from the first 11 bytes only.
_raw_data_repr = hyperframe.frame._raw_data_repr


def _short_raw_data_repr(data: bytes | None) -> str:
    return _raw_data_repr(data[:11] if data else data)


hyperframe.frame._raw_data_repr = _short_raw_data_repr


class PassThroughCodec(CodecBase):
    """Protobuf codec that sends `bytes` as they are and can leave requests undecoded."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, bytes):
            return message
        return bytes(cast(betterproto2.Message, message))

    def decode(self, data: bytes, message_type: Any) -> Any:
        if message_type is bytes:
            return data
        try:
            return message_type.parse(data)
        except Exception as e:  # betterproto2 raises assorted errors on garbage
            raise GRPCError(Status.INVALID_ARGUMENT, f"cannot parse request: {e}") from None


class _H2Protocol(H2Protocol):
    """grpclib's protocol, advertising and enforcing our MAX_CONCURRENT_STREAMS from the start.

    `connection_made` follows grpclib 0.4.9's own (pinned in constraints.txt); only the local
    settings differ. The 150-cluster Envoy test fails if this stops taking effect.
    """

    max_streams = 10_000
    reset_budget = 10_000  # client stream resets per connection per RESET_WINDOW before GOAWAY
    _resets: collections.deque[float] | None = None

    def data_received(self, data: bytes) -> None:
        # grpclib's own, plus a count of the client's stream resets: a flood gets GOAWAY.
        try:
            events = self.connection.feed(data)
        except H2ProtocolError:
            log.debug("HTTP/2 protocol error from %s", self._peer, exc_info=True)
            self.processor.close("Protocol error")
            return
        self.connection.flush()
        for event in events:
            self.processor.process(event)
        self.connection.flush()
        resets = sum(1 for e in events if isinstance(e, StreamReset) and e.remote_reset)
        if resets:
            self._count_resets(resets)

    def _count_resets(self, n: int) -> None:
        if self._resets is None:
            self._resets = collections.deque()
        now = time.monotonic()
        self._resets.extend([now] * min(n, self.reset_budget + 1))
        while self._resets and now - self._resets[0] > RESET_WINDOW:
            self._resets.popleft()
        if len(self._resets) > self.reset_budget:
            log.warning("GOAWAY to %s: over %d stream resets in %.0fs", self._peer, self.reset_budget, RESET_WINDOW)
            self.connection._connection.close_connection(
                error_code=ErrorCodes.ENHANCE_YOUR_CALM, additional_data=b"too many stream resets"
            )
            self.connection.flush()
            self.connection._transport.close()
            self._resets.clear()

    @property
    def _peer(self) -> str:
        addr = self.connection.get_peer().addr()
        return f"{addr[0]}:{addr[1]}" if addr else "?"

    def connection_made(self, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _set_nodelay(sock)
        h2_conn = H2Connection(config=self.h2_config)
        # Set before the first SETTINGS frame, so the limit holds before Envoy's ACK arrives too.
        h2_conn.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams,
                SettingCodes.MAX_HEADER_LIST_SIZE: H2Connection.DEFAULT_MAX_HEADER_LIST_SIZE,
            },
        )
        h2_conn.initiate_connection()
        initial = h2_conn.local_settings.initial_window_size
        conn_delta = self.config.http2_connection_window_size - initial
        if conn_delta:
            h2_conn.increment_flow_control_window(conn_delta)
        if self.config.http2_stream_window_size != initial:
            h2_conn.update_settings(
                {SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size}
            )
        self.connection = Connection(h2_conn, cast(asyncio.Transport, transport), config=self.config)
        self.connection.flush()
        self.connection.initialize()
        self.processor = EventsProcessor(self.handler, self.connection)


class Server(grpclib.server.Server):
    def __init__(self, handlers: list[Any], *, max_streams: int, reset_budget: int, **kwargs: Any) -> None:
        super().__init__(handlers, **kwargs)
        self._max_streams = max_streams
        self._reset_budget = reset_budget
        self.ssl: SSLContext | None = None  # TLS for start() when it is given none

    async def start(self, *args: Any, ssl: SSLContext | None = None, **kwargs: Any) -> None:
        await super().start(*args, ssl=ssl or self.ssl, **kwargs)

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        mine = _H2Protocol(protocol.handler, protocol.config, protocol.h2_config)
        mine.max_streams = self._max_streams
        mine.reset_budget = self._reset_budget
        return mine


async def recv_limited(
    stream: grpclib.server.Stream[Any, Any], message_type: Any, max_size: int
) -> Any | None:
    """grpclib's recv_message, but refusing an oversize message from its length prefix.

    grpclib would buffer (and acknowledge to the sender) whatever length a client announces.
    """
    raw = stream._stream
    try:
        header = await raw.recv_data(5)
        if not header:
            return None
        if header[0]:
            raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
        size = int.from_bytes(header[1:5], "big")
        if size > max_size:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"message of {size} bytes (limit {max_size})")
        data = await raw.recv_data(size)
    except AssertionError:  # grpclib's way of saying the stream ended inside a message
        raise GRPCError(Status.INVALID_ARGUMENT, "truncated gRPC message") from None
    if len(data) != size:  # ended right after the length prefix: b"", not an empty request
        raise GRPCError(Status.INVALID_ARGUMENT, "truncated gRPC message")
    return stream._codec.decode(data, message_type)


def _grpc_frame(payload: bytes) -> memoryview:
    return memoryview(b"\x00" + len(payload).to_bytes(4, "big") + payload)


def _write(stream: grpclib.server.Stream[Any, Any], data: memoryview, pos: int, window: int) -> int:
    """Queue as much of `data[pos:]` as `window` allows as DATA frames, write them at once."""
    raw = stream._stream
    h2 = raw._h2_connection
    assert raw.id is not None  # the client opened the stream
    end = len(data)
    while pos < end and window > 0:
        n = min(window, h2.max_outbound_frame_size, end - pos)
        h2.send_data(raw.id, data[pos : pos + n])
        pos += n
        window -= n
    raw._transport.write(h2.data_to_send())
    raw.connection.data_send_process()  # resets grpclib's keepalive bookkeeping
    return pos


def send_now(stream: grpclib.server.Stream[Any, Any], payload: bytes) -> bool:
    """Send a whole message at once if nothing has to wait (the usual case); False otherwise."""
    raw = stream._stream
    if not stream._send_initial_metadata_done or not raw.connection.write_ready.is_set():
        return False
    assert raw.id is not None
    data = _grpc_frame(payload)
    if raw._h2_connection.local_flow_control_window(raw.id) < len(data):
        return False
    _write(stream, data, 0, len(data))
    stream._send_message_done = True
    return True


async def send_frames(stream: grpclib.server.Stream[Any, Any], payload: bytes) -> None:
    """grpclib's send_message for a server-streaming response, with one socket write per window.

    grpclib writes every 16 KB DATA frame to the socket on its own; fanning a 30 KB assignment out
    to 1,000 streams that is 2,000 writes where 1,000 do. Flow control is honoured as grpclib does.
    """
    if not stream._send_initial_metadata_done:
        await stream.send_initial_metadata()
    raw = stream._stream
    assert raw.id is not None
    data = _grpc_frame(payload)
    pos = 0
    while pos < len(data):
        await raw.connection.write_ready.wait()
        window = raw._h2_connection.local_flow_control_window(raw.id)
        if window <= 0:
            raw.window_updated.clear()
            await raw.window_updated.wait()
            continue
        pos = _write(stream, data, pos, window)
    stream._send_message_done = True


