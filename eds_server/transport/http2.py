"""HTTP/2 and gRPC framing below the EDS service, where grpclib's defaults do not fit an xDS server
that faces untrusted clients.

- MAX_CONCURRENT_STREAMS: h2 allows 100 per connection and grpclib drops the whole connection on
  stream 101, but Envoy opens one stream per EDS cluster on a single connection;
- open streams counted in O(1) (h2 walks every stream on each new one: quadratic);
- per client IP, budgets for streams opened (per minute), and over a 10 s window for stream resets (the client's and
  the ones h2 sends on its own, e.g. for DATA after END_STREAM) and control frames (PING,
  SETTINGS, PRIORITY, empty DATA, unknown frame types, WINDOW_UPDATEs not paid for by our DATA);
  past one, GOAWAY ENHANCE_YOUR_CALM and the connection is closed;
- connections in total and per IP; a connection must open a stream, and a stream send its first
  request, within the request timeout; a TLS handshake must finish within its own timeout;
- unknown frame types are ignored (RFC 9113 section 4.1) and a PING ACK only counts as an answer
  to our keepalive if it carries our payload;
- reading a message: an oversize length prefix is refused before any of the body is read, the
  body must arrive within the request timeout, and partly received bodies share one server-wide
  byte budget;
- writing a message: one socket write per flow-control window, not per 16 KB frame, and no timer
  when nothing has to wait;
- a codec that passes pre-encoded bytes through in both directions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from ssl import SSLContext
from typing import Any, cast

import betterproto2
import grpclib.const
import grpclib.server
import hyperframe.frame
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.protocol import Connection, EventsProcessor, H2Protocol, _set_nodelay
from h2.config import H2Configuration
from h2.connection import ConnectionState, H2Connection
from h2.errors import ErrorCodes
from h2.events import PingAckReceived, RequestReceived
from h2.exceptions import ProtocolError as H2ProtocolError
from h2.settings import SettingCodes, Settings
from h2.stream import StreamState
from hyperframe.frame import (
    DataFrame,
    ExtensionFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from ..ratelimit import Bucket
from .direct import DirectReader, window_update

log = logging.getLogger("eds_server.grpc")

BUDGET_WINDOW = 10.0  # seconds: per-IP budgets are "N per 10 s", refilled continuously...
STREAM_WINDOW = 60.0  # ...but streams: N at once (one Envoy connecting), then N per minute
CLOSE_GRACE = 2.0  # seconds a closed connection may take to flush its GOAWAY before it is aborted
FILE_RESERVE = 600  # descriptors kept for the admin and REST ports (256 each by default) and files
WINDOW_CREDIT_PER_DATA_FRAME = 10  # WINDOW_UPDATEs a client may send per DATA frame we send (as Envoy)
SMALL_MESSAGE = 256 * 1024  # bytes: a request this small is never refused for others' partial messages

# h2 4.4 builds repr(frame) for every frame it receives, logging on or off, and hyperframe's repr
# hex-encodes a DATA frame's whole payload to keep its first 20 hex digits: a fifth of the CPU
# spent reading Envoy's 60 KB requests. Same text, from the first 11 bytes only.
_raw_data_repr = hyperframe.frame._raw_data_repr


def _short_raw_data_repr(data: bytes | None) -> str:
    return _raw_data_repr(data[:11] if data else data)


hyperframe.frame._raw_data_repr = _short_raw_data_repr


_FRAME_HEADER = struct.Struct(">HBBBL")  # length (16 + 8 bits), type, flags, stream id (and its reserved bit)


@dataclass
class ConnectionLimits:
    """What one client (connection, or IP) may take of the gRPC port."""

    max_streams: int = 10_000  # concurrent streams per connection (MAX_CONCURRENT_STREAMS)
    stream_budget: int = 1_000  # streams opened per IP per STREAM_WINDOW; more are refused (REFUSED_STREAM)
    reset_budget: int = 10_000  # stream resets (sent by the client or by h2) per IP per BUDGET_WINDOW
    control_budget: int = 1_000  # control frames per IP per BUDGET_WINDOW
    max_connections: int = 10_000  # in total
    max_connections_per_ip: int = 100
    request_timeout: float = 10.0  # to open a first stream, to send a first request, to finish a message
    tls_handshake_timeout: float = 5.0
    partial_message_budget: int = 128 * 1024 * 1024  # bytes of messages being received, server-wide


class PeerBudgets:
    """One client IP's connections and budgets, shared by all its connections."""

    __slots__ = ("connections", "control", "partial", "resets", "streams")

    def __init__(self, limits: ConnectionLimits) -> None:
        self.connections = 0
        self.partial = 0  # bytes of its messages being received
        self.streams = Bucket(limits.stream_budget, STREAM_WINDOW)
        self.resets = Bucket(limits.reset_budget, BUDGET_WINDOW)
        self.control = Bucket(limits.control_budget, BUDGET_WINDOW)

    @property
    def idle(self) -> bool:
        buckets = (self.streams, self.resets, self.control)
        return not self.connections and not self.partial and all(b.full for b in buckets)


@dataclass
class GateCounters:
    connections_refused: int = 0  # over the total or per-IP connection limit
    calmed: int = 0  # connections ended with GOAWAY ENHANCE_YOUR_CALM
    timed_out: int = 0  # connections that opened no stream in time


@dataclass
class Gate:
    """Connection limits and per-IP budgets of one server."""

    limits: ConnectionLimits
    peers: dict[str, PeerBudgets] = field(default_factory=dict)
    connections: int = 0
    counters: GateCounters = field(default_factory=GateCounters)
    _prune_at: int = 0  # table size at which idle peers are forgotten next

    def admit(self, ip: str) -> PeerBudgets | str:
        """The IP's budgets, or why the connection is refused."""
        if self.connections >= self.limits.max_connections:
            return f"server holds its limit of {self.limits.max_connections} connections"
        peer = self.peers.get(ip)
        if peer is None:
            if len(self.peers) >= max(self._prune_at, self.limits.max_connections):
                self._forget_idle()
                # next time at twice what is left: a table of busy peers is not walked per connection
                self._prune_at = 2 * len(self.peers)
            peer = self.peers[ip] = PeerBudgets(self.limits)
        if peer.connections >= self.limits.max_connections_per_ip:
            return f"{ip} holds its limit of {self.limits.max_connections_per_ip} connections"
        peer.connections += 1
        self.connections += 1
        return peer

    def release(self, peer: PeerBudgets) -> None:
        peer.connections -= 1
        self.connections -= 1

    def _forget_idle(self) -> None:
        """Drop IPs with no connection and full budgets: bounded memory, and nobody's debt forgotten."""
        for ip in [ip for ip, p in self.peers.items() if p.idle]:
            del self.peers[ip]


class _Calm(H2ProtocolError):
    """A client over one of its budgets: h2 answers GOAWAY with this code."""

    error_code = ErrorCodes.ENHANCE_YOUR_CALM


class GuardedH2Connection(H2Connection):
    """h2's connection, charging every frame received to the client IP's budgets, and counting
    open streams in O(1).

    Overrides h2 4.4's private `_receive_frame`, `_prepare_for_sending` and `_open_streams`
    (h2 is pinned in constraints.txt); tests/test_hostile.py fails if they stop taking effect.
    """

    def __init__(self, config: H2Configuration, peer: PeerBudgets) -> None:
        super().__init__(config=config)
        self.peer = peer
        self._touched: set[int] = set()  # streams a frame was sent or received on since the last count
        self._receiving = False
        self._window_credit = 100
        self.stream_checks = 0  # streams looked at to count open ones: the work test_hostile counts
        self.ping_payload: bytes | None = None  # of our last keepalive PING
        self.refused: set[int] = set()  # new streams over the stream budget, to be refused
        self.direct: dict[int, DirectReader] = {}  # streams whose DATA frames skip h2 (direct.py)

    def _charge(self, frame: Frame) -> None:
        peer = self.peer
        if isinstance(frame, HeadersFrame):
            if frame.stream_id in self.streams or frame.stream_id <= self.highest_inbound_stream_id:
                return  # trailers, or an error h2 reports itself
            if not peer.streams.take():
                # Refused cheaply (RST_STREAM REFUSED_STREAM, no handler): Envoy retries the stream
                # later. Refusals cost like control frames, and count as such.
                if not peer.control.take():
                    raise _Calm("over its budgets of streams opened and of control frames")
                self.refused.add(frame.stream_id)
            return
        elif isinstance(frame, DataFrame):
            if frame.data or "END_STREAM" in frame.flags:
                return
            bucket, what = peer.control, "control frames (empty DATA)"
        elif isinstance(frame, RstStreamFrame):
            bucket, what = peer.resets, "stream resets"
        elif isinstance(frame, WindowUpdateFrame):
            if self._window_credit > 0:
                self._window_credit -= 1
                return
            bucket, what = peer.control, "control frames (WINDOW_UPDATE)"
        elif isinstance(frame, PingFrame | SettingsFrame | PriorityFrame | ExtensionFrame):
            bucket, what = peer.control, f"control frames ({type(frame).__name__})"
        else:
            return
        if not bucket.take():
            raise _Calm(f"over its budget of {what}")

    def _receive_frame(self, frame: Frame) -> Any:
        self._charge(frame)
        if frame.stream_id:
            self._touched.add(frame.stream_id)
        self._receiving = True
        try:
            return super()._receive_frame(frame)
        finally:
            self._receiving = False

    def _prepare_for_sending(self, frames: list[Frame]) -> None:
        if self._receiving:  # h2 answering a frame on its own: a RST_STREAM costs like a client's
            resets = sum(1 for f in frames if isinstance(f, RstStreamFrame))
            if resets and not self.peer.resets.take(resets):
                raise _Calm("over its budget of stream resets")
        super()._prepare_for_sending(frames)

    def _open_streams(self, remainder: int) -> int:
        """Open streams started by the client, from the streams touched since the last count.

        A stream can only close on a frame sent or received on it, so only those are looked at;
        every other stream h2 still holds is open. h2 walks every stream instead, on every new one.
        """
        if remainder != int(not self.config.client_side):
            return super()._open_streams(remainder)
        for stream_id in self._touched:
            stream = self.streams.get(stream_id)
            if stream is not None and stream.closed:
                del self.streams[stream_id]
                self._closed_streams[stream_id] = stream.closed_by
        self.stream_checks += len(self._touched)
        self._touched.clear()
        return len(self.streams)

    def send_headers(self, stream_id: int, *args: Any, **kwargs: Any) -> None:
        self._touched.add(stream_id)
        super().send_headers(stream_id, *args, **kwargs)

    def send_data(self, stream_id: int, *args: Any, **kwargs: Any) -> None:
        self._touched.add(stream_id)
        self._window_credit = min(self._window_credit + WINDOW_CREDIT_PER_DATA_FRAME, 100_000)
        super().send_data(stream_id, *args, **kwargs)

    def note_data_frames(self, stream_id: int, frames: int) -> None:
        """DATA frames queued without send_data (queue_message builds them itself): the same
        bookkeeping as send_data's."""
        self._touched.add(stream_id)
        self._window_credit = min(self._window_credit + WINDOW_CREDIT_PER_DATA_FRAME * frames, 100_000)

    def end_stream(self, stream_id: int) -> None:
        self._touched.add(stream_id)
        super().end_stream(stream_id)

    def reset_stream(self, stream_id: int, error_code: ErrorCodes | int = 0) -> None:
        self._touched.add(stream_id)
        super().reset_stream(stream_id, error_code)

    def ping(self, opaque_data: bytes | str) -> None:
        self.ping_payload = opaque_data if isinstance(opaque_data, bytes) else None
        super().ping(opaque_data)


class _Processor(EventsProcessor):
    """grpclib's events processor; a PING ACK answers our keepalive only if it echoes its payload
    (a client that never reads cannot fake being alive)."""

    def process_ping_ack_received(self, event: PingAckReceived) -> None:
        h2 = cast(GuardedH2Connection, self.connection._connection)
        if h2.ping_payload is not None and event.ping_data == h2.ping_payload:
            self.connection.ping_ack_process()


class _LogLimit:
    """At most `most` warnings per BUDGET_WINDOW: a client that keeps tripping a limit cannot fill the log."""

    def __init__(self, most: int = 20) -> None:
        self.bucket = Bucket(most, BUDGET_WINDOW)
        self.suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        if self.bucket.take():
            if self.suppressed:
                msg += f" ({self.suppressed} similar messages suppressed)"
                self.suppressed = 0
            log.warning(msg, *args)
        else:
            self.suppressed += 1


_limited_log = _LogLimit()


def _refusal(reason: str) -> bytes:
    """A server preface and GOAWAY, for a connection refused before it gets an h2 state."""
    goaway = GoAwayFrame(0, error_code=ErrorCodes.ENHANCE_YOUR_CALM, additional_data=reason.encode()[:200])
    return SettingsFrame(0).serialize() + goaway.serialize()


class _H2Protocol(H2Protocol):
    """grpclib's protocol, with our settings from the start and the gate's limits enforced.

    `connection_made` follows grpclib 0.4.9's own (pinned in constraints.txt); only the local
    settings, the h2 connection class and the processor differ. The 150-cluster Envoy test fails if
    this stops taking effect.
    """

    gate: Gate
    _peer_budgets: PeerBudgets | None = None
    _transport: asyncio.Transport | None = None
    _deadline: asyncio.TimerHandle | None = None
    _saw_request = False

    _held = b""  # the start of a frame not yet complete, while frames are split here
    _direct_unacked = 0  # bytes of DATA read directly, not yet granted back to the client

    def data_received(self, data: bytes) -> None:
        if self._peer_budgets is None:
            return  # refused: closing
        h2 = cast(GuardedH2Connection, self.connection._connection)
        if h2.direct or self._held:
            self._split(h2, data)
        elif self._feed(h2, data):
            self.connection.flush()

    def _feed(self, h2: GuardedH2Connection, data: bytes | memoryview) -> bool:
        """Through h2, and its events to grpclib; False once the connection is being closed."""
        try:
            events = self.connection.feed(data)  # type: ignore[arg-type]  # h2 takes any buffer
        except H2ProtocolError as e:
            self.connection.flush()  # the GOAWAY h2 queued
            if isinstance(e, _Calm):
                self.gate.counters.calmed += 1
                _limited_log.warning("GOAWAY ENHANCE_YOUR_CALM to %s: %s", self._peer, e)
            else:
                log.debug("HTTP/2 protocol error from %s", self._peer, exc_info=True)
            self._close("Protocol error")
            return False
        self.connection.flush()
        processors = getattr(self.processor, "processors", {})
        for event in events:
            if type(event) is RequestReceived:
                self._saw_request = True
                if h2.refused and event.stream_id in h2.refused:
                    h2.refused.discard(event.stream_id)
                    stream = h2.streams.get(event.stream_id)
                    if stream is not None and not stream.closed:  # the client may have reset it already
                        h2.reset_stream(event.stream_id, ErrorCodes.REFUSED_STREAM)
                    continue
            if type(event) in processors:  # unknown frame types and the like are ignored
                self.processor.process(event)
        return True

    def _split(self, h2: GuardedH2Connection, data: bytes) -> None:
        """Cut the input into frames: plain DATA frames of direct streams go to their DirectReader,
        runs of every other frame to h2, in order. Any other frame on a direct stream that changes
        its state (HEADERS, RST_STREAM, DATA with END_STREAM or padding) hands the stream back to
        h2 before h2 reads it. h2 gets whole frames only, so its own buffer stays empty between
        calls; until it is (the preface, a frame begun before the first stream went direct), and
        from a frame over the size limit on (h2 reports it), everything goes through h2."""
        incoming = h2.incoming_buffer
        buf = self._held + data if self._held else data
        self._held = b""
        if incoming._preamble_len or incoming._data:
            if self._feed(h2, buf):
                self.connection.flush()
            return
        view = memoryview(buf)
        direct = h2.direct
        limit = h2.max_inbound_frame_size
        in_headers = bool(incoming._headers_buffer)  # a header block continues: nothing else may come between
        pos = run = 0
        end = len(buf)
        while end - pos >= 9:
            high, low, ftype, flags, sid = _FRAME_HEADER.unpack_from(buf, pos)
            length = high << 8 | low
            if length > limit:
                pos = end  # h2 refuses it, with the right GOAWAY
                break
            after = pos + 9 + length
            if after > end:
                break
            if ftype == 0:  # DATA
                reader = direct.get(sid & 0x7FFFFFFF) if direct else None
                if reader is not None:
                    if flags == 0 and not length and not in_headers and h2.peer.control.take():
                        # an empty DATA frame: nothing, for the price of a control frame (grpclib
                        # would take it for the end of the stream); over budget, h2 says so
                        if run < pos and not self._feed(h2, view[run:pos]):
                            return
                        run = after
                    elif flags == 0 and length and not in_headers:
                        if run < pos and not self._feed(h2, view[run:pos]):
                            return
                        self._direct_unacked += length
                        reader.take(view[pos + 9 : after])
                        run = after
                    else:
                        reader.fall_back()
            elif ftype == 1 or ftype == 3:  # HEADERS (trailers), RST_STREAM
                if direct:
                    reader = direct.get(sid & 0x7FFFFFFF)
                    if reader is not None:
                        reader.fall_back()
                if ftype == 1:
                    in_headers = not flags & 0x4  # END_HEADERS
            elif ftype == 5 or ftype == 9:  # PUSH_PROMISE, CONTINUATION
                in_headers = not flags & 0x4
            pos = after
        if run < pos and not self._feed(h2, view[run:pos]):
            return
        if pos < end:
            self._held = bytes(view[pos:])
        if self._direct_unacked >= self.config.http2_connection_window_size // 2:
            h2._data_to_send += window_update(0, self._direct_unacked)
            self._direct_unacked = 0
        self.connection.flush()

    def _close(self, reason: str) -> None:
        transport = self._transport
        self.processor.close(reason)
        if transport is not None:  # a client that does not read would keep it forever
            asyncio.get_running_loop().call_later(CLOSE_GRACE, transport.abort)

    def _no_request(self) -> None:
        if self._saw_request or self.connection.is_closing():
            return
        self.gate.counters.timed_out += 1
        _limited_log.warning("closing %s: no stream opened in %.0fs", self._peer, self.gate.limits.request_timeout)
        h2 = self.connection._connection
        h2.close_connection(error_code=ErrorCodes.NO_ERROR, additional_data=b"no request in time")
        self.connection.flush()
        self._close("No request in time")

    @property
    def _peer(self) -> str:
        addr = self._transport.get_extra_info("peername") if self._transport else None
        return f"{addr[0]}:{addr[1]}" if addr else "?"

    def connection_made(self, transport: Any) -> None:
        self._transport = cast(asyncio.Transport, transport)
        addr = transport.get_extra_info("peername")
        admitted = self.gate.admit(str(addr[0]) if addr else "?")
        if isinstance(admitted, str):
            self.gate.counters.connections_refused += 1
            _limited_log.warning("refusing connection from %s: %s", self._peer, admitted)
            transport.write(_refusal(admitted))
            transport.close()
            asyncio.get_running_loop().call_later(CLOSE_GRACE, transport.abort)
            return
        self._peer_budgets = admitted
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _set_nodelay(sock)
        h2_conn = GuardedH2Connection(self.h2_config, admitted)
        # Set before the first SETTINGS frame, so the limit holds before Envoy's ACK arrives too.
        h2_conn.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: self.gate.limits.max_streams,
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
        self.connection = _Connection(h2_conn, cast(asyncio.Transport, transport), config=self.config)
        self.connection.flush()
        self.connection.initialize()
        self.processor = _Processor(self.handler, self.connection)
        self._deadline = asyncio.get_running_loop().call_later(self.gate.limits.request_timeout, self._no_request)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._peer_budgets is None:
            return
        h2 = cast(GuardedH2Connection, self.connection._connection)
        for reader in list(h2.direct.values()):
            reader.fall_back()  # grpclib ends the stream its own way
        self.gate.release(self._peer_budgets)
        self._peer_budgets = None
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)


class Server(grpclib.server.Server):
    def __init__(self, handlers: list[Any], *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(handlers, **kwargs)
        self.gate = Gate(limits)
        self.ssl: SSLContext | None = None  # TLS for start() when it is given none

    async def start(
        self, host: str | None = None, port: int | None = None, *, ssl: SSLContext | None = None,
        backlog: int = 1024, **kwargs: Any,
    ) -> None:  # fmt: skip
        """grpclib's start, with a TLS handshake timeout. Over-limit connections are accepted and
        closed at once (with a GOAWAY saying why), so the accept backlog sheds rather than stalls."""
        if self._server is not None:
            raise RuntimeError("Server is already started")
        self._fit_connections_to_file_limit()
        ssl = ssl or self.ssl
        self._server = await self._loop.create_server(
            self._protocol_factory, host, cast(int, port), backlog=backlog, ssl=ssl, flags=socket.AI_PASSIVE,
            ssl_handshake_timeout=self.gate.limits.tls_handshake_timeout if ssl else None, **kwargs,
        )  # fmt: skip
        self._server_closed_fut = self._loop.create_future()

    def _fit_connections_to_file_limit(self) -> None:
        """Raise the open-file limit to its hard limit, and keep the connection limit under it
        (with room for the admin and REST ports and files): running out of descriptors fails
        everything at once, the admin port and file reloads included."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                soft = hard
        if soft == resource.RLIM_INFINITY:
            return
        room = max(16, soft - FILE_RESERVE)
        limits = self.gate.limits
        if limits.max_connections > room:
            log.warning("open-file limit %d: gRPC connections limited to %d (not %d)",
                        soft, room, limits.max_connections)  # fmt: skip
            limits.max_connections = room

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        mine = _H2Protocol(protocol.handler, protocol.config, protocol.h2_config)
        mine.gate = self.gate
        return mine


class PartialBudget:
    """Bytes of request messages announced but not yet fully received: server-wide, and per client
    IP (a quarter of the total, at least one message). Messages up to SMALL_MESSAGE (Envoy's
    requests, node included, are ~60 KB) are refused only by their IP's share, so one client that
    holds the whole budget cannot stop the others' requests."""

    def __init__(self, total: int, max_message_size: int = 0) -> None:
        self.total = total
        self.per_ip = max(total // 4, max_message_size)
        self.used = 0
        self.refused = 0

    def take(self, n: int, peer: PeerBudgets | None = None) -> bool:
        if peer is not None and peer.partial + n > self.per_ip:
            self.refused += 1
            return False
        if n > SMALL_MESSAGE and self.used + n > self.total:
            self.refused += 1
            return False
        self.used += n
        if peer is not None:
            peer.partial += n
        return True

    def give(self, n: int, peer: PeerBudgets | None = None) -> None:
        self.used -= n
        if peer is not None:
            peer.partial -= n


@dataclass
class MessageReader:
    """How request messages are read: size limit, deadlines, the shared partial-message budget."""

    max_size: int = 4 * 1024 * 1024
    timeout: float | None = None  # first message of a stream; every message's body
    budget: PartialBudget | None = None

    async def read(self, stream: grpclib.server.Stream[Any, Any], message_type: Any, first: bool = False) -> Any:
        return await recv_limited(
            stream, message_type, self.max_size, timeout=self.timeout, budget=self.budget, first=first
        )

    async def direct(self, stream: grpclib.server.Stream[Any, Any], on_message: Callable[[bytes], None]) -> None:
        """Give the stream's further messages to `on_message` as their DATA frames arrive (direct.py),
        until the stream needs grpclib again (returns: read on with `read`); raises what ended it.
        Returns at once where that cannot be done (not our h2 connection, data already buffered)."""
        raw = stream._stream
        h2 = raw._h2_connection
        buffer = raw.buffer
        if not isinstance(h2, GuardedH2Connection) or raw.id is None or raw.id in h2.direct:
            return
        if buffer._eof or buffer._acked_size or not buffer._unacked.empty() or raw.id not in h2.streams:
            return
        if h2.incoming_buffer._data:  # h2 holds a frame begun, maybe this stream's: it must read it
            return
        reader = DirectReader(raw, on_message, self, grant_at=max(1, h2.local_settings.initial_window_size // 2))
        h2.direct[raw.id] = reader
        try:
            await reader.done
        finally:
            reader.leave()  # if cancelled: the call is over


async def recv_limited(
    stream: grpclib.server.Stream[Any, Any], message_type: Any, max_size: int, *,
    timeout: float | None = None, budget: PartialBudget | None = None, first: bool = False,
) -> Any | None:  # fmt: skip
    """grpclib's recv_message, but refusing an oversize message from its length prefix, and with
    deadlines: for the first message of a stream to start, and for any message's body to arrive.

    grpclib would buffer (and acknowledge to the sender) whatever length a client announces, and
    wait for it forever.
    """
    raw = stream._stream
    try:
        if first and timeout is not None:
            try:
                async with asyncio.timeout(timeout):
                    header = await raw.recv_data(5)
            except TimeoutError:
                raise GRPCError(Status.DEADLINE_EXCEEDED, f"no request within {timeout:g}s") from None
        else:
            header = await raw.recv_data(5)
        if not header:
            return None
        if header[0]:
            raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
        size = int.from_bytes(header[1:5], "big")
        if size > max_size:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"message of {size} bytes (limit {max_size})")
        h2 = raw._h2_connection
        peer = h2.peer if isinstance(h2, GuardedH2Connection) else None
        if budget is not None and not budget.take(size, peer):
            raise GRPCError(Status.RESOURCE_EXHAUSTED, "server busy receiving other messages, retry later")
        try:
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
    return stream._codec.decode(data, message_type)


def limited_handler(
    handler: grpclib.const.Handler, reader: MessageReader, enter: Callable[[], bool], leave: Callable[[], None]
) -> grpclib.const.Handler:
    """A grpclib handler whose stream reads through `reader` and counts against a stream limit
    (`enter` False: refused with RESOURCE_EXHAUSTED), for services grpclib would read unbounded."""

    async def run(stream: grpclib.server.Stream[Any, Any]) -> None:
        if not enter():
            raise GRPCError(Status.RESOURCE_EXHAUSTED, "server holds its limit of streams")
        try:
            received = 0

            async def recv_message() -> Any:
                nonlocal received
                message = await reader.read(stream, handler.request_type, first=received == 0)
                received += 1
                return message

            stream.recv_message = recv_message  # type: ignore[method-assign]
            await handler.func(stream)
        finally:
            leave()

    return grpclib.const.Handler(run, handler.cardinality, handler.request_type, handler.reply_type)


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
class Framed:
    """A gRPC message (length prefix and body) cut into DATA frame payloads: built once for all
    the streams it goes to, which are sent views of the same bytes, not copies."""

    __slots__ = ("_cuts", "data")

    def __init__(self, payload: bytes) -> None:
        self.data = b"\x00" + len(payload).to_bytes(4, "big") + payload
        self._cuts: dict[int, tuple[list[bytes], list[memoryview]]] = {}

    def frames(self, step: int) -> tuple[list[bytes], list[memoryview]]:
        """For frames of at most `step` bytes: each frame's header up to its stream id, and payload."""
        cut = self._cuts.get(step)
        if cut is None:
            view, n = memoryview(self.data), len(self.data)
            heads = [min(step, n - pos).to_bytes(3, "big") + b"\x00\x00" for pos in range(0, n, step)]
            cut = self._cuts[step] = (heads, [view[pos : pos + step] for pos in range(0, n, step)])
        return cut


def queue_message(stream: grpclib.server.Stream[Any, Any], message: Framed) -> bool:
    """Queue a whole gRPC message as DATA frames for the connection's next write if the
    flow-control windows take it all (False, nothing queued, otherwise). The caller has the
    connection flushed (one write for every stream a change went to).

    The frames are built here, not by h2's send_data: per 16 KB frame h2 runs two state machines,
    builds a frame object and copies the payload three times. What send_data does that matters is
    done the same way, once per message: the connection's and the stream's states are checked (their
    state machines would not change on SEND_DATA), both windows shrink, and the connection counts the frames
    (WINDOW_UPDATEs they pay for, streams touched). The frames' payloads are views of `message`,
    queued on the connection's `_Transport` behind whatever h2 had queued before them.
    grpclib and h2 private API (pinned in constraints.txt; tests/test_grpc.py and the Envoy tests
    read these frames with h2 and with Envoy)."""
    raw = stream._stream
    h2 = raw._h2_connection
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
    pending = cast(_Transport, raw._transport).pending  # every connection of Server's is a _Connection
    if h2._data_to_send:
        pending.append(h2.data_to_send())  # queued before: written before
    for head, payload in zip(heads, payloads, strict=True):
        pending.append(head + tail)
        pending.append(payload)
    h2.outbound_flow_control_window -= size
    h2_stream.outbound_flow_control_window -= size
    cast(GuardedH2Connection, h2).note_data_frames(sid, len(heads))
    stream._send_message_done = True
    return True


class _Transport:
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

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Connection(Connection):
    """grpclib's Connection on a `_Transport`, whose queued frames its flush writes too."""

    def __init__(self, h2: H2Connection, transport: asyncio.Transport, *, config: Any) -> None:
        super().__init__(h2, cast(asyncio.Transport, _Transport(transport)), config=config)

    def flush(self) -> None:
        transport = cast(_Transport, self._transport)
        data = self._connection.data_to_send()
        if data:
            transport.pending.append(data)
        transport.flush()


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
        window = raw._h2_connection.local_flow_control_window(raw.id)
        if window <= 0:
            raw.window_updated.clear()
            await raw.window_updated.wait()
            continue
        pos = _write(stream, data, pos, window)
    stream._send_message_done = True


