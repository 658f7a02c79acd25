"""The fast path: HTTP/2 and gRPC framing below the EDS service, on grpclib, h2 and hyperframe
internals (used only with the versions compat.py verified), where grpclib's defaults do not fit
an xDS server that faces untrusted clients and fans one change out to thousands of streams.

- MAX_CONCURRENT_STREAMS advertised from the first SETTINGS (h2 allows 100, and grpclib drops the
  whole connection on stream 101, but Envoy opens one stream per EDS cluster on one connection);
- open streams counted in O(1) (h2 walks every stream on each new one: quadratic);
- the budgets of limits.py charged per frame; past one, GOAWAY ENHANCE_YOUR_CALM;
- every byte read first through the frame guard (guard.py): a frame longer than allowed refused
  from its header (GOAWAY FRAME_SIZE_ERROR), not buffered; a header block's total size bounded and
  its CONTINUATION frames charged as control frames;
- malformed request headers answered RST_STREAM PROTOCOL_ERROR (headers.py) before grpclib sees them;
- a connection must open a stream, and a stream send its first request, within the request
  timeout; a TLS handshake must finish within its own timeout;
- unknown frame types are ignored (RFC 9113 section 4.1) and a PING ACK only counts as an answer
  to our keepalive if it carries our payload;
- reading a message: an oversize length prefix is refused before any of the body is read, the
  body must arrive within the request timeout, partly received bodies share one server-wide byte
  budget, and an established stream's messages are read straight from its DATA frames (direct.py);
- writing a message: frames built once for every stream a change goes to, queued, and written
  once per connection and batch of 256 messages (Flusher), a new stream's response HEADERS with
  its first message; one socket write per flow-control window otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any, cast

import grpclib.const
import grpclib.server
import hyperframe.frame
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.events import SendInitialMetadata
from grpclib.metadata import encode_grpc_message
from grpclib.protocol import Connection, EventsProcessor, H2Protocol, _set_nodelay
from h2.config import H2Configuration
from h2.connection import ConnectionInputs, ConnectionState, H2Connection
from h2.errors import ErrorCodes
from h2.events import DataReceived, PingAckReceived, RequestReceived, StreamEnded, StreamReset, TrailersReceived
from h2.exceptions import H2Error, StreamClosedError
from h2.exceptions import ProtocolError as H2ProtocolError
from h2.settings import SettingCodes, Settings
from h2.stream import StreamInputs, StreamState
from hyperframe.frame import (
    DataFrame,
    ExtensionFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from ...observe import clip
from ...ratelimit import Bucket
from .base import Framed
from .direct import DirectReader, window_update
from .guard import FrameGuard
from .headers import request_problem, trailers_problem
from .limits import BUDGET_WINDOW, ConnectionLimits, Gate, PartialBudget, PeerBudgets, fit_to_file_limit

MAX_INBOUND_FRAME = 1 << 17  # SETTINGS_MAX_FRAME_SIZE we announce (RFC 9113: 16 KiB to 16 MiB)
log = logging.getLogger("eds_server.grpc")

CLOSE_GRACE = 2.0  # seconds a closed connection may take to flush its GOAWAY before it is aborted
WINDOW_CREDIT_PER_DATA_FRAME = 10  # WINDOW_UPDATEs a client may send per DATA frame we send (as Envoy)
OPEN_WINDOW = 65_535  # bytes of connection window left: the client could have sent its requests

_FRAME_HEADER = struct.Struct(">HBBBL")  # length (16 + 8 bits), type, flags, stream id (and its reserved bit)

Stream = grpclib.server.Stream[Any, Any]


class _Calm(H2ProtocolError):
    """A client over one of its budgets: h2 answers GOAWAY with this code."""

    error_code = ErrorCodes.ENHANCE_YOUR_CALM


def _nothing() -> None:
    return None


def _ignore(reason: str, detail: str, count: int) -> None:
    return None


class GuardedH2Connection(H2Connection):
    """h2's connection, charging what each frame received costs to the connection's and the client
    IP's budgets (limits.py says what is charged), and counting open streams in O(1).

    Overrides h2 4.4's private `_receive_frame`, `_prepare_for_sending` and `_open_streams`
    (used only with the versions compat.py verified); tests/hostile/test_clients.py fails if they stop
    taking effect.
    """

    def __init__(self, config: H2Configuration, peer: PeerBudgets, limits: ConnectionLimits) -> None:
        self._settings_credit = 1  # the client's first SETTINGS; one more per SETTINGS we send (its ACK)
        super().__init__(config=config)
        self.peer = peer
        self.control = Bucket(limits.control_budget, BUDGET_WINDOW)
        self.pending_limit = limits.pending_streams
        self._touched: set[int] = set()  # streams a frame was sent or received on since the last count
        self._receiving = False
        self._window_credit = 100
        self.stream_checks = 0  # streams looked at to count open ones: the work test_hostile counts
        self.ping_payload: bytes | None = None  # of our last keepalive PING
        self.awaiting: set[int] = set()  # streams opened that have sent no DATA yet
        # their RequestReceived events, and when: grpclib starts no handler for a stream until its
        # request begins, so a stream that sends nothing costs an h2 stream, not a task
        self.held: dict[int, tuple[RequestReceived, float]] = {}
        self.refused: set[int] = set()  # new streams to refuse (REFUSED_STREAM): too many await a request
        self.bad: dict[int, str] = {}  # streams whose headers were malformed, and why (answered PROTOCOL_ERROR)
        self.direct: dict[int, DirectReader] = {}  # streams whose DATA frames skip h2 (direct.py)
        self.on_calm: Callable[[str], None] | None = None  # ends the connection over a budget, outside a frame
        self.on_active: Callable[[], None] = _nothing  # a stream opened or a request sent: the connection is busy
        self.on_shed: Callable[[str, str, int], None] = _ignore  # refusals (reason, detail, count): counted, logged

    def _wasted(self, what: str) -> None:
        """A stream ended (or refused, or timed out) without a request."""
        if not self.peer.wasted.take():
            raise _Calm(f"over its budget of streams without a request ({what})")

    def _answered(self, stream_id: int) -> None:
        self.awaiting.discard(stream_id)
        self.peer.pending -= 1

    def timed_out(self, stream_id: int, timeout: float, defer: bool = False) -> None:
        """A stream that sent no request within `timeout`: counted, logged and charged."""
        self.on_shed("no_request", f"DEADLINE_EXCEEDED on stream {stream_id}: no request within {timeout:g}s", 1)
        self.no_request(stream_id, defer=defer)

    def no_request(self, stream_id: int, why: str = "no request in time", defer: bool = False) -> None:
        """A stream ended, or was refused, without a request: charged as a wasted stream. Over the
        budget, the connection is ended; `defer`: once the running handler has answered (from
        inside one, ending the connection at once would cancel that very handler)."""
        if stream_id in self.awaiting:
            self._answered(stream_id)
        try:
            self._wasted(why)
        except _Calm as e:
            if self.on_calm is not None:
                if defer:
                    asyncio.get_running_loop().call_soon(self.on_calm, str(e))
                else:
                    self.on_calm(str(e))

    def forget(self) -> None:
        """The connection is gone: its streams no longer await a request."""
        self.peer.pending -= len(self.awaiting)
        self.awaiting.clear()
        self.held.clear()

    def _charge(self, frame: Frame) -> None:
        peer = self.peer
        sid = frame.stream_id
        if isinstance(frame, HeadersFrame):
            if sid in self.streams or sid <= self.highest_inbound_stream_id:
                return  # trailers, or an error h2 reports itself
            if not peer.wasted.peek():  # an IP that spent its budget opens nothing until it refills
                raise _Calm("over its budget of streams without a request")
            if "END_STREAM" in frame.flags:
                self._wasted("ended by its headers")
            elif peer.pending >= self.pending_limit and self.inbound_flow_control_window >= OPEN_WINDOW:
                # Refused cheaply (RST_STREAM REFUSED_STREAM, no handler): a client that sends its
                # requests never gets here, nor one whose requests wait for our flow control (a big
                # Envoy's first requests, 60 KB each); one that opens streams and sends nothing pays.
                self.refused.add(sid)
                self._wasted(f"refused, {peer.pending} streams awaiting a request")
            else:
                self.awaiting.add(sid)
                peer.pending += 1
                self.on_active()
            return
        if isinstance(frame, DataFrame):
            if frame.data:
                self.on_active()
            if sid in self.awaiting:
                self._answered(sid)
                if not frame.data and "END_STREAM" in frame.flags:
                    self._wasted("ended before its request")
            if frame.data or "END_STREAM" in frame.flags:
                return
            what = "control frames (empty DATA)"
        elif isinstance(frame, RstStreamFrame):
            if sid in self.awaiting:
                self._answered(sid)
                if self.inbound_flow_control_window >= OPEN_WINDOW:  # not a request our window held back
                    self._wasted("reset before its request")
            if not peer.resets.take():
                raise _Calm("over its budget of stream resets")
            return
        elif isinstance(frame, WindowUpdateFrame):
            if self._window_credit > 0:
                self._window_credit -= 1
                return
            what = "control frames (WINDOW_UPDATE)"
        elif isinstance(frame, SettingsFrame):
            if self._settings_credit > 0:  # the first SETTINGS of a connection, or the ACK of ours
                self._settings_credit -= 1
                return
            what = "control frames (SETTINGS)"
        elif isinstance(frame, PingFrame):
            if "ACK" in frame.flags and self.ping_payload is not None and frame.opaque_data == self.ping_payload:
                return  # the answer to our keepalive
            what = "control frames (PING)"
        elif isinstance(frame, PriorityFrame | ExtensionFrame):
            what = f"control frames ({type(frame).__name__})"
        else:
            return
        if not self.control.take():
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

    def initiate_connection(self) -> None:
        self._settings_credit += 1
        super().initiate_connection()

    def update_settings(self, new_settings: dict[SettingCodes | int, int]) -> None:
        self._settings_credit += 1
        super().update_settings(new_settings)

    def send_headers(self, stream_id: int, *args: Any, **kwargs: Any) -> None:
        self._touched.add(stream_id)
        super().send_headers(stream_id, *args, **kwargs)

    def note_headers(self, stream_id: int) -> None:
        """HEADERS queued without send_headers (queue_initial_headers builds them): its bookkeeping."""
        self._touched.add(stream_id)

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


class _H2Protocol(H2Protocol):
    """grpclib's protocol, with our settings from the start and the gate's limits enforced.

    `connection_made` follows grpclib 0.4.9's own (used only with the versions compat.py
    verified); only the local settings, the h2 connection class and the processor differ.
    """

    gate: Gate
    flusher: Flusher
    open: set[_H2Protocol] | None = None  # the server's open connections, this one among them
    _guard: FrameGuard
    _peer_budgets: PeerBudgets | None = None
    _transport: asyncio.Transport | None = None
    _deadline: asyncio.TimerHandle | None = None
    _saw_request = False
    _opened_at_check = 0  # the highest stream id at the last idle check
    _dead = False  # closing after a protocol error or a refusal: input is ignored
    _sweep: asyncio.TimerHandle | None = None  # for streams held without a request

    _held: bytes | bytearray = b""  # the start of a frame not yet complete, while frames are split here
    _direct_unacked = 0  # bytes of DATA read directly, not yet granted back to the client

    def data_received(self, data: bytes) -> None:
        if self._peer_budgets is None or self._dead:
            return  # refused or closing
        _, refusal = self._guard.feed(data)
        if refusal is not None:  # nothing of it reaches h2: the connection ends here
            self.gate.shed(refusal.reason, self._peer, refusal.detail)
            self._goaway(refusal.code, refusal.detail.split(": ", 1)[-1], "Frame guard")
            return
        h2 = cast(GuardedH2Connection, self.connection._connection)
        if h2.direct or self._held:
            self._split(h2, data)
        elif self._feed(h2, data):
            self.connection.flush()

    def leave(self, why: str) -> None:
        """GOAWAY NO_ERROR and close: the client opens a new connection for its next streams."""
        if self._dead or self._peer_budgets is None:
            return
        h2 = self.connection._connection
        h2.close_connection(error_code=ErrorCodes.NO_ERROR, additional_data=why.encode()[:200])
        self.connection.flush()
        self._close(why)

    def _calm(self, why: str) -> None:
        """GOAWAY ENHANCE_YOUR_CALM, from outside a frame (a stream timed out)."""
        if self._dead:
            return
        self.gate.shed("calm", self._peer, f"GOAWAY ENHANCE_YOUR_CALM: {why}")
        h2 = self.connection._connection
        h2.close_connection(error_code=ErrorCodes.ENHANCE_YOUR_CALM, additional_data=why.encode()[:200])
        self.connection.flush()
        self._close("Over a budget")

    def _feed(self, h2: GuardedH2Connection, data: bytes | bytearray | memoryview) -> bool:
        """Through h2, and its events to grpclib; False once the connection is being closed."""
        try:
            events = self.connection.feed(data)  # type: ignore[arg-type]  # h2 takes any buffer
        except H2ProtocolError as e:
            self.connection.flush()  # the GOAWAY h2 queued
            if isinstance(e, _Calm):
                self.gate.shed("calm", self._peer, f"GOAWAY ENHANCE_YOUR_CALM: {e}")
            else:
                self.gate.shed("protocol_error", self._peer, f"GOAWAY {e.error_code.name}: {clip(str(e))}")
            self._close("Protocol error")
            return False
        self.connection.flush()
        processors = getattr(self.processor, "processors", {})
        held = h2.held
        for event in events:
            kind = type(event)
            if kind is RequestReceived:
                self._saw_request = True
                request = cast(RequestReceived, event)
                sid = request.stream_id
                if h2.refused and sid in h2.refused:
                    h2.refused.discard(sid)
                    self._refuse(h2, sid, ErrorCodes.REFUSED_STREAM, "pending_streams",
                                 f"{h2.peer.pending} of its streams await a request")  # fmt: skip
                    continue
                problem = request_problem(request.headers)  # type: ignore[arg-type]  # str: header_encoding
                if problem is not None:
                    self._refuse(h2, sid, ErrorCodes.PROTOCOL_ERROR, "bad_headers", problem)
                    h2.no_request(sid)
                    if self._dead:
                        return False
                    continue
                if sid in h2.awaiting:  # no DATA yet: grpclib hears of it when its request begins
                    if not held:
                        self._sweep_later()
                    held[sid] = (request, asyncio.get_running_loop().time())
                    continue
            elif held and (kind is DataReceived or kind is StreamEnded):
                begun = held.pop(cast(DataReceived, event).stream_id, None)
                if begun is not None:
                    self.processor.process(begun[0])
            elif held and kind is StreamReset:
                if held.pop(cast(StreamReset, event).stream_id, None) is not None:
                    continue  # grpclib never knew it
            elif kind is TrailersReceived:
                trailers = cast(TrailersReceived, event)
                problem = trailers_problem(trailers.headers)  # type: ignore[arg-type]
                if problem is not None:
                    self._refuse(h2, trailers.stream_id, ErrorCodes.PROTOCOL_ERROR, "bad_headers", problem)
                    continue
            if kind in processors:  # unknown frame types and the like are ignored
                self.processor.process(event)
        return True

    def _sweep_later(self) -> None:
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.gate.limits.request_timeout, self._sweep_held)

    def _sweep_held(self) -> None:
        """Streams held without a request past the request timeout are answered DEADLINE_EXCEEDED
        (trailers only, as a handler would) and charged as streams without a request."""
        self._sweep = None
        if self._dead:
            return
        h2 = cast(GuardedH2Connection, self.connection._connection)
        timeout = self.gate.limits.request_timeout
        now = asyncio.get_running_loop().time()
        expired = []
        for sid, (_, since) in h2.held.items():  # in opening order: the oldest first
            if now - since < timeout:
                break
            expired.append(sid)
        if expired:  # one line for them all: a connection of 1,000 idle streams is one event
            h2.on_shed("no_request", f"DEADLINE_EXCEEDED on {len(expired)} streams ({expired[0]}...): "
                                     f"no request within {timeout:g}s", len(expired))  # fmt: skip
        for sid in expired:
            del h2.held[sid]
            stream = h2.streams.get(sid)
            if stream is not None and not stream.closed:
                trailers = [(":status", "200"), ("content-type", "application/grpc"),
                            ("grpc-status", str(Status.DEADLINE_EXCEEDED.value)),
                            ("grpc-message", f"no request within {timeout:g}s")]  # fmt: skip
                h2.send_headers(sid, trailers, end_stream=True)
            h2.no_request(sid)
            if self._dead:
                return
        self.connection.flush()
        if h2.held:
            oldest = next(iter(h2.held.values()))[1]
            self._sweep = asyncio.get_running_loop().call_at(oldest + timeout, self._sweep_held)

    def _refuse(self, h2: GuardedH2Connection, sid: int, code: ErrorCodes, reason: str, why: str) -> None:
        """End one stream with RST_STREAM `code`, before any handler sees it."""
        self.gate.shed(reason, self._peer, f"RST_STREAM {code.name} on stream {sid}: {why}")
        stream = h2.streams.get(sid)
        if stream is not None and not stream.closed:  # the client may have reset it already
            h2.reset_stream(sid, code)

    def _split(self, h2: GuardedH2Connection, data: bytes) -> None:
        """Cut the input into frames: plain DATA frames of direct streams go to their DirectReader,
        runs of every other frame to h2, in order. Any other frame on a direct stream that changes
        its state (HEADERS, RST_STREAM, DATA with END_STREAM or padding) hands the stream back to
        h2 before h2 reads it. h2 gets whole frames only, so its own buffer stays empty between
        calls; until it is (the preface, a frame begun before the first stream went direct),
        everything goes through h2."""
        incoming = h2.incoming_buffer
        held = self._held
        if held:
            if len(held) >= 9 and len(held) + len(data) < 9 + int.from_bytes(held[:3], "big"):
                # a frame still incomplete: appended, not copied again (held is a bytearray)
                cast(bytearray, held).extend(data)
                return
            buf: bytes | bytearray = held + data
        else:
            buf = data
        self._held = b""
        if incoming._preamble_len or incoming._data:
            if self._feed(h2, buf):
                self.connection.flush()
            return
        view = memoryview(buf)
        direct = h2.direct
        in_headers = bool(incoming._headers_buffer)  # a header block continues: nothing else may come between
        pos = run = 0
        end = len(buf)
        while end - pos >= 9:
            high, low, ftype, flags, sid = _FRAME_HEADER.unpack_from(buf, pos)
            length = high << 8 | low  # within the frame size limit: the guard saw this header first
            after = pos + 9 + length
            if after > end:
                break
            if ftype == 0:  # DATA
                reader = direct.get(sid & 0x7FFFFFFF) if direct else None
                if reader is not None:
                    if flags == 0 and not length and not in_headers and h2.control.take():
                        # an empty DATA frame: nothing, for the price of a control frame (grpclib
                        # would take it for the end of the stream); over budget, h2 says so
                        if run < pos and not self._feed(h2, view[run:pos]):
                            return
                        run = after
                    elif flags == 0 and length and not in_headers:
                        if run < pos and not self._feed(h2, view[run:pos]):
                            return
                        self._direct_unacked += length
                        self._active()
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
            self._held = bytearray(view[pos:])
        if self._direct_unacked >= self.config.http2_connection_window_size // 2:
            h2._data_to_send += window_update(0, self._direct_unacked)
            self._direct_unacked = 0
        self.connection.flush()

    def _close(self, reason: str) -> None:
        self._dead = True
        transport = self._transport
        self.processor.close(reason)
        if transport is not None:  # a client that does not read would keep it forever
            asyncio.get_running_loop().call_later(CLOSE_GRACE, transport.abort)

    def _check_idle(self) -> None:
        """Close a connection that opened no stream within the request timeout, or has held none
        since the last check (an idle timeout ago): a client that answers our PINGs but asks for
        nothing keeps no slot (grpc-go's MaxConnectionIdle). Checked at that interval, so an idle
        connection goes between one and two idle timeouts after its last stream."""
        self._deadline = None
        if self.connection.is_closing() or self._dead:
            return
        h2 = cast(GuardedH2Connection, self.connection._connection)
        limits = self.gate.limits
        opened = h2.highest_inbound_stream_id
        if not self._saw_request:
            reason, why = "no_stream", f"no stream opened in {limits.request_timeout:g}s"
        elif opened == self._opened_at_check and not h2.open_inbound_streams:
            reason, why = "idle", f"no stream held for {limits.idle_timeout:g}s"
        else:
            self._opened_at_check = opened
            self._deadline = asyncio.get_running_loop().call_later(limits.idle_timeout, self._check_idle)
            return
        self.gate.shed(reason, self._peer, f"closing (GOAWAY NO_ERROR): {why}")
        self._goaway(ErrorCodes.NO_ERROR, why, "Idle connection")

    def _goaway(self, code: ErrorCodes, why: str, reason: str) -> None:
        h2 = self.connection._connection
        h2.close_connection(error_code=code, additional_data=why.encode()[:200])
        self.connection.flush()
        self._close(reason)

    def busy(self) -> bool:
        """Whether it holds a stream (for the gate's choice of who gives way)."""
        return bool(self._peer_budgets is not None and self.connection._connection.open_inbound_streams)

    def give_way(self, why: str) -> None:
        """Closed by the gate to make room for another connection (its slot is released already)."""
        if not self._dead:
            self._goaway(ErrorCodes.NO_ERROR, f"closing to make room: {why}", "Connection limit")

    def _shed(self, reason: str, detail: str, count: int) -> None:
        self.gate.shed(reason, self._peer, detail, count)

    def _active(self) -> None:
        budgets = self._peer_budgets
        if budgets is not None:
            budgets.touch(self)

    @property
    def _peer(self) -> str:
        addr = self._transport.get_extra_info("peername") if self._transport else None
        return f"{addr[0]}:{addr[1]}" if addr else "?"

    def connection_made(self, transport: Any) -> None:
        self._transport = cast(asyncio.Transport, transport)
        addr = transport.get_extra_info("peername")
        admitted = self.gate.admit(str(addr[0]) if addr else "?", self)
        self._peer_budgets = admitted
        if self.open is not None:
            self.open.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _set_nodelay(sock)
        h2_conn = GuardedH2Connection(self.h2_config, admitted, self.gate.limits)
        h2_conn.on_calm = self._calm
        h2_conn.on_active = self._active
        h2_conn.on_shed = self._shed
        self._guard = FrameGuard(max_frame_size=MAX_INBOUND_FRAME, max_header_block=self.gate.limits.max_header_block,
                                 control=h2_conn.control)  # fmt: skip
        # Set before the first SETTINGS frame, so the limit holds before Envoy's ACK arrives too.
        h2_conn.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: self.gate.limits.max_streams,
                SettingCodes.MAX_HEADER_LIST_SIZE: self.gate.limits.max_header_block,
                # an Envoy's first request (its Node, often 60 KB) comes as one DATA frame, not four:
                # a quarter of the frames for h2 to parse, account and turn into events per stream
                SettingCodes.MAX_FRAME_SIZE: MAX_INBOUND_FRAME,
            },
        )
        h2_conn.max_inbound_frame_size = h2_conn.incoming_buffer.max_frame_size = MAX_INBOUND_FRAME
        h2_conn.initiate_connection()
        initial = h2_conn.local_settings.initial_window_size
        conn_delta = self.config.http2_connection_window_size - initial
        if conn_delta:
            h2_conn.increment_flow_control_window(conn_delta)
        if self.config.http2_stream_window_size != initial:
            h2_conn.update_settings(
                {SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size}
            )
        self.connection = _Connection(h2_conn, cast(asyncio.Transport, transport), config=self.config,
                                      flusher=self.flusher)  # fmt: skip
        self.connection.flush()
        self.connection.initialize()
        self.processor = _Processor(self.handler, self.connection)
        self._deadline = asyncio.get_running_loop().call_later(self.gate.limits.request_timeout, self._check_idle)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.open is not None:
            self.open.discard(self)
        if self._peer_budgets is None:
            return
        h2 = cast(GuardedH2Connection, self.connection._connection)
        for reader in list(h2.direct.values()):
            reader.fall_back()  # grpclib ends the stream its own way
        h2.forget()
        self.gate.release(self._peer_budgets, self)
        self._peer_budgets = None
        if self._deadline is not None:
            self._deadline.cancel()
        if self._sweep is not None:
            self._sweep.cancel()
        super().connection_lost(exc)


class Server(grpclib.server.Server):
    """grpclib's server on the guarded protocol; `open_io` gives the services each stream's
    StreamIO. `mapping` wraps the handlers' table (unknown.py answers unknown methods)."""

    fast = True

    def __init__(
        self, handlers: list[Any], *, limits: ConnectionLimits, reader: MessageReader,
        mapping: Callable[[dict[str, Any]], Any] | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(handlers, **kwargs)
        self.gate = Gate(limits)
        self.reader = reader
        self.flusher = Flusher()
        self.ssl: SSLContext | None = None  # TLS for start() when it is given none
        self.open: set[_H2Protocol] = set()
        if mapping is not None:
            self._mapping = mapping(self._mapping)  # read by each connection's handler

    def open_io(self, stream: grpclib.server.Stream[Any, Any]) -> FastIO:
        return FastIO(stream, self.reader, self.flusher)

    @property
    def port(self) -> int:
        """0 on a Unix socket."""
        assert self._server is not None
        name = cast(asyncio.Server, self._server).sockets[0].getsockname()
        return int(name[1]) if isinstance(name, tuple) else 0

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    @property
    def connections(self) -> int:
        return self.gate.connections

    @property
    def refused(self) -> dict[str, int]:
        """What was refused, by reason (the label values of eds_refused_total)."""
        budget = self.reader.budget
        return {**self.gate.refused, "partial_messages": budget.refused if budget else 0}

    async def start(
        self, host: str | None = None, port: int | None = None, *, ssl: SSLContext | None = None,
        backlog: int = 1024, path: str | None = None, sock: socket.socket | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        """grpclib's start, with a TLS handshake timeout. Over-limit connections are accepted and
        closed at once (with a GOAWAY saying why), so the accept backlog sheds rather than stalls."""
        if self._server is not None:
            raise RuntimeError("Server is already started")
        fit_to_file_limit(self.gate.limits)
        ssl = ssl or self.ssl
        if path is not None:  # a Unix socket: the workers' link to their owner
            self._server = await self._loop.create_unix_server(self._protocol_factory, path, backlog=backlog)
        elif sock is not None:  # a listening socket handed over by the owner of --workers N
            self._server = await self._loop.create_server(
                self._protocol_factory, sock=sock, backlog=backlog, ssl=ssl,
                ssl_handshake_timeout=self.gate.limits.tls_handshake_timeout if ssl else None,
            )  # fmt: skip
        else:
            self._server = await self._loop.create_server(
                self._protocol_factory, host, cast(int, port), backlog=backlog, ssl=ssl, flags=socket.AI_PASSIVE,
                ssl_handshake_timeout=self.gate.limits.tls_handshake_timeout if ssl else None, **kwargs,
            )  # fmt: skip
        self._server_closed_fut = self._loop.create_future()

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        mine = _H2Protocol(protocol.handler, protocol.config, protocol.h2_config)
        mine.gate = self.gate
        mine.flusher = self.flusher
        mine.open = self.open  # joined once admitted (a failed TLS handshake never is, nor ever leaves)
        return mine

    def goaway(self, peers: set[str], why: str) -> int:
        """GOAWAY NO_ERROR to the connections from these peers (`ip:port`); how many were sent one."""
        chosen = [p for p in self.open if p._peer in peers]
        for protocol in chosen:
            protocol.leave(why)
        return len(chosen)


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
                h2 = raw._h2_connection
                if isinstance(h2, GuardedH2Connection) and raw.id is not None:
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
    handler: grpclib.const.Handler, reader: MessageReader,
    enter: Callable[[Stream], bool], leave: Callable[[Stream], None],
) -> grpclib.const.Handler:  # fmt: skip
    """A grpclib handler whose stream reads through `reader` and counts against a stream limit
    (`enter` False: refused with RESOURCE_EXHAUSTED), for services grpclib would read unbounded."""

    async def run(stream: grpclib.server.Stream[Any, Any]) -> None:
        if not enter(stream):
            charge_refusal(stream)
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
            leave(stream)

    return grpclib.const.Handler(run, handler.cardinality, handler.request_type, handler.reply_type)


def _hpack_literal(name_index: int, value: bytes) -> bytes:
    """An HPACK header field "without indexing" with a static-table name (RFC 7541 6.2.2): it leaves
    both sides' dynamic tables as they are. Values under 127 bytes only (content types are)."""
    if len(value) >= 127:
        raise ValueError(f"{len(value)} bytes: too long for a one-byte length")
    first = bytes([name_index]) if name_index < 15 else bytes([15, name_index - 15])
    return first + bytes([len(value)]) + value


_STATUS_200 = b"\x88"  # ":status: 200", static table entry 8
_CONTENT_TYPE = 31  # "content-type" in the static table
_RESPONSE_HEADERS: dict[str, bytes] = {}  # content type -> the HEADERS block of a response


def queue_initial_headers(stream: grpclib.server.Stream[Any, Any]) -> bool:
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
    h2 = raw._h2_connection
    sid = raw.id
    if stream._dispatch._listeners.get(SendInitialMetadata) or sid not in h2.streams:
        return False
    h2_stream = h2.streams[sid]
    state = h2_stream.state_machine.state
    if state is not StreamState.OPEN and state is not StreamState.HALF_CLOSED_REMOTE:
        return False
    if h2.state_machine.state is not ConnectionState.SERVER_OPEN or h2.encoder.header_table.resized:
        return False  # h2 raises as it should, or must start its next block with a table size update
    content_type = stream._content_type
    block = _RESPONSE_HEADERS.get(content_type)
    if block is None:
        value = content_type.encode()
        if len(value) >= 127 or len(_RESPONSE_HEADERS) >= 16:
            return False
        block = _RESPONSE_HEADERS[content_type] = _STATUS_200 + _hpack_literal(_CONTENT_TYPE, value)
    h2.state_machine.process_input(ConnectionInputs.SEND_HEADERS)
    h2_stream.state_machine.process_input(StreamInputs.SEND_HEADERS)
    h2_stream.request_method = None  # as h2 sets it from a response's headers
    h2._data_to_send += len(block).to_bytes(3, "big") + b"\x01\x04" + sid.to_bytes(4, "big") + block
    cast(GuardedH2Connection, h2).note_headers(sid)
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
    queued on the connection's `_Transport` behind whatever h2 had queued before them.
    grpclib and h2 private API (pinned in constraints.txt; tests/transport/test_grpc.py and the Envoy tests
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

    def __init__(self, h2: H2Connection, transport: asyncio.Transport, *, config: Any, flusher: Flusher) -> None:
        super().__init__(h2, cast(asyncio.Transport, _Transport(transport)), config=config)
        self._flusher = flusher

    def ack(self, stream_id: int, size: int) -> None:
        """grpclib writes the WINDOW_UPDATEs for every read at once: one write per stream as 10,000
        connect (a tenth of their CPU). Here they join the connection's next write, this turn of the loop."""
        if size:
            self._connection.acknowledge_received_data(size, stream_id)
            if self._connection._data_to_send:
                self._flusher.later(self)

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




def charge_refusal(stream: Stream) -> None:
    """A stream refused at the stream limits: charged to its IP as a stream without a request, so a
    client that keeps opening streams past the limits ends in GOAWAY instead of costing a handler each."""
    raw = stream._stream
    h2 = raw._h2_connection
    if isinstance(h2, GuardedH2Connection) and raw.id is not None:
        h2.no_request(raw.id, "refused at the stream limits", defer=True)


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
            if connection._transport.is_closing():
                continue
            try:  # one connection's failure must not hold up the others' frames, nor reach the caller
                connection.flush()
            except Exception as e:  # transports report write errors themselves; this is a backstop
                log.warning("write to a gRPC connection failed: %r", e)
                continue
            connection.data_send_process()  # resets grpclib's keepalive bookkeeping


class FastIO:
    """A stream on the fast path: requests read with limits (and straight from DATA frames once
    the first is read), responses queued as shared frames and flushed once per connection and batch."""

    __slots__ = ("_flusher", "_reader", "stream")

    def __init__(self, stream: grpclib.server.Stream[Any, Any], reader: MessageReader, flusher: Flusher) -> None:
        self.stream = stream
        self._reader = reader
        self._flusher = flusher

    async def read(self, first: bool = False) -> bytes | None:
        data: bytes | None = await self._reader.read(self.stream, bytes, first=first)
        return data

    async def read_direct(self, on_message: Callable[[bytes], None]) -> None:
        await self._reader.direct(self.stream, on_message)

    def ready(self) -> bool:
        stream = self.stream
        raw = stream._stream
        if not (raw.connection.write_ready.is_set() and raw.closable):
            return False
        if stream._send_initial_metadata_done:
            return True
        try:
            if not queue_initial_headers(stream):
                return False
        except H2Error:  # h2's state machines refused: the send finds out the usual way
            return False
        self._flusher.later(raw.connection)  # the headers go out even if no message follows
        return True

    def queue(self, message: Framed) -> bool:
        if not queue_message(self.stream, message):
            return False
        self._flusher.later(self.stream._stream.connection)
        return True

    async def send(self, message: Framed) -> None:
        await send_frames(self.stream, message)

    def status_in_trailers(self) -> contextlib.AbstractAsyncContextManager[None]:
        return StatusInTrailers(self.stream)

    def refused(self) -> None:
        charge_refusal(self.stream)


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


def short_frame_reprs() -> None:
    """h2 4.4 builds repr(frame) for every frame it receives, logging on or off, and hyperframe's
    repr hex-encodes a DATA frame's whole payload to keep its first 20 hex digits: a fifth of the CPU
    spent reading Envoy's 60 KB requests. Same text, from the first 11 bytes only. Installed when a
    fast-path server is built (compat.py checked the version), never at import."""
    current = hyperframe.frame._raw_data_repr
    if getattr(current, "eds_short", False):
        return

    def short(data: bytes | None) -> str:
        return current(data[:11] if data else data)

    short.eds_short = True  # type: ignore[attr-defined]
    hyperframe.frame._raw_data_repr = short
