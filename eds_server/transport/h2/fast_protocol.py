"""The fast path's protocol: one client connection, below grpclib. Every byte is read first
through the frame guard (guard.py: a frame longer than allowed refused from its header, a header
block's total size bounded, its CONTINUATION frames charged as control frames); then through h2
(fast_connection.GuardedH2Connection charges each frame to the budgets), except an established
stream's plain DATA frames, which go straight to its DirectReader (direct.py). Malformed request
headers are answered RST_STREAM PROTOCOL_ERROR (headers.py) before grpclib sees them; a stream
that sends no request is held here, not given a handler, until it does or its time runs out; a
connection that opens no stream in time, or holds none for an idle timeout, is closed; unknown
frame types are ignored (RFC 9113 section 4.1). Touches grpclib and h2 internals (private.py lists
each, and why), on the versions compat.py verified only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import socket
import struct
from typing import Any, cast

from grpclib.const import Status
from grpclib.protocol import EventsProcessor, H2Protocol, Stream
from h2.errors import ErrorCodes
from h2.events import (
    DataReceived,
    PingAckReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from h2.exceptions import ProtocolError as H2ProtocolError
from h2.settings import SettingCodes, Settings

from ...observe import clip
from .direct import EarlyRequest
from .fair import HELD_RECHECK, STREAM_ESTIMATE, Deferral, MeteredInput, TransportReading
from .fast_connection import Calm, GuardedH2Connection, window_update
from .fast_writer import Flusher, FlushingConnection
from .guard import FrameGuard
from .handlers import ProcessorRelease
from .headers import HeaderText, RequestCheck, trailers_problem
from .keepalive import Keepalive, unsent
from .limits import Gate, PeerBudgets
from .overload import STREAM_MEMORY

MAX_INBOUND_FRAME = 1 << 17  # SETTINGS_MAX_FRAME_SIZE we announce (RFC 9113: 16 KiB to 16 MiB)
CLOSE_GRACE = 2.0  # seconds a closed connection may take to flush its GOAWAY before it is aborted
SWEEP_BATCH = 256  # streams timed out without a request, answered in one turn of the loop

_FRAME_HEADER = struct.Struct(">HBBBL")  # length (16 + 8 bits), type, flags, stream id (and its reserved bit)


class PingCheckingProcessor(EventsProcessor):
    """grpclib's events processor; a PING ACK answers our keepalive only if it echoes its payload
    (a client that never reads cannot fake being alive), and a WINDOW_UPDATE of the connection
    wakes the streams only when one may wait on it."""

    wakes = 0  # connection WINDOW_UPDATEs that woke every stream (the work the tests count)
    keepalive: Keepalive | None = None

    def process_window_updated(self, event: WindowUpdated) -> None:
        """grpclib wakes every stream on each WINDOW_UPDATE of the connection: 10,000 streams'
        events per frame, and a client earns ten such frames per DATA frame we send. A stream waits
        for the window only while it is spent (min of the stream's and the connection's, at most
        0), and the update that last took the connection's above 0 woke them all: so while it was
        above 0 before this read, nobody waits on it (and once woken, not again in the same read)."""
        if event.stream_id == 0:
            h2 = cast(FlushingConnection, self.connection).h2
            if h2.window_before_read > 0:
                return
            h2.window_before_read = 1
            self.wakes += 1
        super().process_window_updated(event)

    def register(self, stream: Stream) -> ProcessorRelease:
        assert stream.id is not None
        self.streams[stream.id] = stream
        return ProcessorRelease(self, stream)

    def process_data_received(self, event: DataReceived) -> None:
        """An empty DATA frame that does not end its stream carries nothing: grpclib's reader would
        take it for the end of the stream inside a message."""
        if event.flow_controlled_length or event.stream_ended is not None:
            super().process_data_received(event)

    def process_ping_ack_received(self, event: PingAckReceived) -> None:
        if self.keepalive is not None and self.keepalive.answered(event.ping_data):
            cast(FlushingConnection, self.connection).h2.ping_payload = None  # a second one is charged


class FastProtocol(TransportReading, H2Protocol):
    """grpclib's protocol, with our settings from the start and the gate's limits enforced.

    `connection_made` follows grpclib 0.4.9's own (used only with the versions compat.py
    verified); only the local settings, the h2 connection class and the processor differ.
    """

    gate: Gate
    flusher: Flusher
    connection: FlushingConnection
    h2: GuardedH2Connection
    open: set[FastProtocol] | None = None  # the server's open connections, this one among them
    _guard: FrameGuard
    _peer_budgets: PeerBudgets | None = None
    _transport: asyncio.Transport | None = None
    _deadline: asyncio.TimerHandle | None = None
    _stall: asyncio.TimerHandle | None = None  # a frame begun at the end of a read: checked a request timeout later
    _saw_request = False
    _opened_at_check = 0  # the highest stream id at the last idle check
    _dead = False  # closing after a protocol error or a refusal: input is ignored
    _sweep: asyncio.Handle | None = None  # for streams held without a request
    _release: asyncio.Handle | None = None  # streams held back by the client's first window, counted again

    _held: bytes | bytearray = b""  # the start of a frame not yet complete, while frames are split here
    _direct_unacked = 0  # bytes of DATA read directly, not yet granted back to the client
    _input: MeteredInput | None = None
    _keepalive: Keepalive | None = None

    def data_received(self, data: bytes) -> None:
        """Through the read scheduler (fair.py): in slices of whole frames, each charged to the
        client's address, the rest held (reading paused) while others wait their turn."""
        if self._input is not None:
            self._input.feed(data)

    def _process(self, data: bytes | memoryview) -> bool:
        """One slice of input; False once the connection is being closed."""
        if self._peer_budgets is None or self._dead:
            return False  # refused or closing
        _, refusal = self._guard.feed(data)
        if refusal is not None:  # nothing of it reaches h2: the connection ends here
            self.gate.shed(refusal.reason, self._peer, refusal.detail)
            self._goaway(refusal.code, refusal.detail.split(": ", 1)[-1], "Frame guard")
            return False
        h2 = self.h2
        self._split(h2, data)  # first requests and direct streams' requests past h2, the rest through it
        if self._closed():  # by what the slice held: grpclib has let go of h2 and the transport
            return False
        if self._stall is None and not self._guard.between_frames and not self._dead:
            self._stall = asyncio.get_running_loop().call_later(
                self.gate.limits.request_timeout, self._check_stall, self._guard.frames
            )
        if h2.held_back and not h2.window_unknown and self._release is None:
            self._release = asyncio.get_running_loop().call_soon(self._release_held)
        return not self._dead

    def _release_held(self) -> None:
        """The client has our raise of its window: its streams held back by the first one count
        again once its input up to now is read (its requests may be right behind the ACK: the
        slices after this one run once the read that brought them is done)."""
        self._release = None
        if self._dead or self._peer_budgets is None or (self._input is not None and self._input.queued):
            return  # queued: the last slice of what waits asks again
        self.h2.release_held()

    def _check_stall(self, frames: int) -> None:
        """A frame (or header block) begun when this was set, a request timeout ago: if no frame has
        begun since and it is still not complete, it is drip-fed and the connection ends; if
        another is in progress now, it is checked the same way."""
        self._stall = None
        guard = self._guard
        if self._dead or guard.between_frames:
            return
        loop = asyncio.get_running_loop()
        if self._stall_deferral.holds(self._input, loop.time()):  # the rest may wait in our own queue
            self._stall = loop.call_later(HELD_RECHECK, self._check_stall, frames)
            return
        if guard.frames != frames:
            self._stall = loop.call_later(self.gate.limits.request_timeout, self._check_stall, guard.frames)
            return
        why = f"a frame not complete within {self.gate.limits.request_timeout:g}s"
        self.gate.shed("slow_input", self._peer, f"closing (GOAWAY NO_ERROR): {why}")
        self._goaway(ErrorCodes.NO_ERROR, why, "Slow input")

    # the read scheduler's view of the connection (fair.Reader): pause and resume from TransportReading
    def overloaded(self, why: str) -> None:
        if not self._dead and self._peer_budgets is not None:
            self.gate.shed("overload", self._peer, f"GOAWAY ENHANCE_YOUR_CALM: {why}")
            self._goaway(ErrorCodes.ENHANCE_YOUR_CALM, "server overloaded", "Overload")

    def leave(self, why: str) -> None:
        """GOAWAY NO_ERROR and close: the client opens a new connection for its next streams."""
        if self._dead or self._peer_budgets is None:
            return
        h2 = self.h2
        h2.close_connection(error_code=ErrorCodes.NO_ERROR, additional_data=why.encode()[:200])
        self.connection.flush()
        self._close(why)

    def _protocol_error(self, h2: GuardedH2Connection, why: str) -> None:
        """GOAWAY PROTOCOL_ERROR for what h2 failed on without a ProtocolError of its own."""
        self.gate.shed("protocol_error", self._peer, f"GOAWAY PROTOCOL_ERROR: {why}")
        with contextlib.suppress(H2ProtocolError):
            h2.close_connection(error_code=ErrorCodes.PROTOCOL_ERROR, additional_data=why.encode())
        self.connection.flush()
        self._close("Protocol error")

    def _calm(self, why: str) -> None:
        """GOAWAY ENHANCE_YOUR_CALM, from outside a frame (a stream timed out)."""
        if self._dead:
            return
        self.gate.shed("calm", self._peer, f"GOAWAY ENHANCE_YOUR_CALM: {why}")
        h2 = self.h2
        h2.close_connection(error_code=ErrorCodes.ENHANCE_YOUR_CALM, additional_data=why.encode()[:200])
        self.connection.flush()
        self._close("Over a budget")

    def _feed(self, h2: GuardedH2Connection, data: bytes | bytearray | memoryview) -> bool:
        """Through h2, and its events to grpclib; False once the connection is being closed (and
        then nothing more is fed: grpclib's close takes h2's frame table and the transport away)."""
        if self._closed():
            return False
        h2.window_before_read = h2.outbound_flow_control_window
        try:
            events = self.connection.feed(data)  # type: ignore[arg-type]  # h2 takes any buffer
        except H2ProtocolError as e:
            self.connection.flush()  # the GOAWAY h2 queued
            if isinstance(e, Calm):
                self.gate.shed("calm", self._peer, f"GOAWAY ENHANCE_YOUR_CALM: {e}")
            else:
                self.gate.shed("protocol_error", self._peer, f"GOAWAY {e.error_code.name}: {clip(str(e))}")
            self._close("Protocol error")
            return False
        except UnicodeDecodeError:  # a header name or value that is not ASCII: h2 fails mid-block,
            # so the HPACK state is lost and the connection must end (RFC 9113 4.3)
            self._protocol_error(h2, "a header that is not ASCII")
            return False
        self.connection.flush()
        try:
            for event in events:
                if type(event) is RequestReceived or type(event) is TrailersReceived:
                    event.headers = self._header_text(event.headers)  # type: ignore[assignment]
        except UnicodeDecodeError:  # a header name or value that is not ASCII
            self._protocol_error(h2, "a header that is not ASCII")
            return False
        processors = getattr(self.processor, "processors", {})
        held = h2.held
        started = 0  # streams handed to grpclib, which starts a handler for each
        for event in events:
            kind = type(event)
            if kind is RequestReceived:
                self._saw_request = True
                request = cast(RequestReceived, event)
                sid = request.stream_id
                if h2.refused and sid in h2.refused:
                    h2.refused.discard(sid)
                    self._refuse(
                        h2,
                        sid,
                        ErrorCodes.REFUSED_STREAM,
                        "pending_streams",
                        f"{h2.peer.pending} of its streams await a request",
                    )
                    continue
                problem = self._request_check(request.headers)  # type: ignore[arg-type]  # str: header_encoding
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
                    started += 1
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
                if kind is RequestReceived:
                    started += 1
                self.processor.process(event)
        if started and self._input is not None:  # their handlers run later: charged now
            self._input.charge(started * STREAM_ESTIMATE)
        return not self._closed()

    def _closed(self) -> bool:
        """Closed by us, or by grpclib (a client's GOAWAY): nothing more may reach h2."""
        return self._dead or self.connection.is_closing()

    def _sweep_later(self) -> None:
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.gate.limits.request_timeout, self._sweep_held)

    def _sweep_held(self) -> None:
        """Streams held without a request past the request timeout are answered DEADLINE_EXCEEDED
        (trailers only, as a handler would) and charged as streams without a request, SWEEP_BATCH
        at a time: the rest on the loop's next turn, so that thousands of idle streams timing out
        together do not hold the loop from every other connection's input meanwhile."""
        self._sweep = None
        if self._dead:
            return
        h2 = self.h2
        timeout = self.gate.limits.request_timeout
        loop = asyncio.get_running_loop()
        if self._sweep_deferral.holds(self._input, loop.time()):  # their requests may wait in our own queue
            self._sweep = loop.call_later(HELD_RECHECK, self._sweep_held)
            return
        now = loop.time()
        expired: list[int] = []
        for sid, (_, since) in h2.held.items():  # in opening order: the oldest first
            if now - since < timeout or len(expired) == SWEEP_BATCH:
                break
            expired.append(sid)
        if expired:  # one line for them all: a connection of 1,000 idle streams is one event
            h2.on_shed(
                "no_request",
                f"DEADLINE_EXCEEDED on {len(expired)} streams ({expired[0]}...): no request within {timeout:g}s",
                len(expired),
            )
        for sid in expired:
            del h2.held[sid]
            stream = h2.streams.get(sid)
            if stream is not None and not stream.closed:
                trailers = [
                    (":status", "200"),
                    ("content-type", "application/grpc"),
                    ("grpc-status", str(Status.DEADLINE_EXCEEDED.value)),
                    ("grpc-message", f"no request within {timeout:g}s"),
                ]
                h2.send_headers(sid, trailers, end_stream=True)
            h2.no_request(sid)
            if self._dead:
                return
        self.connection.flush()
        if h2.held:
            oldest = next(iter(h2.held.values()))[1]
            if oldest + timeout <= now:  # more expired than one batch: the rest after the loop's next poll
                self._sweep = loop.call_soon(self._sweep_held)
            else:
                self._sweep = loop.call_at(oldest + timeout, self._sweep_held)

    def _refuse(self, h2: GuardedH2Connection, sid: int, code: ErrorCodes, reason: str, why: str) -> None:
        """End one stream with RST_STREAM `code`, before any handler sees it."""
        self.gate.shed(reason, self._peer, f"RST_STREAM {code.name} on stream {sid}: {why}")
        stream = h2.streams.get(sid)
        if stream is not None and not stream.closed:  # the client may have reset it already
            h2.reset_stream(sid, code)

    def _split(self, h2: GuardedH2Connection, data: bytes | memoryview) -> None:
        """Cut the input into frames: plain DATA frames of direct streams go to their DirectReader,
        runs of every other frame to h2, in order. Any other frame on a direct stream that changes
        its state (HEADERS, RST_STREAM, DATA with END_STREAM or padding) hands the stream back to
        h2 before h2 reads it. h2 gets whole frames only, so its own buffer stays empty between
        calls; until it is (the preface, a frame begun before the first stream went direct),
        everything goes through h2."""
        held = self._held
        if held:
            have = len(held) + len(data)
            head = bytes(held[:9]) if len(held) >= 9 else bytes(held) + bytes(data[: 9 - len(held)])
            if len(head) < 9 or have < 9 + int.from_bytes(head[:3], "big"):
                # a frame still incomplete: appended, not copied again (held is a bytearray)
                cast(bytearray, held).extend(data)
                return
            # the frame begun, completed from the start of this input on its own: the rest of the
            # input after it is not copied to put the frame's first part in front of it
            take = 9 + int.from_bytes(head[:3], "big") - len(held)
            self._held = b""
            view = memoryview(data)
            self._split_whole(h2, held + view[:take])
            if take == len(data) or self._closed():
                return
            data = view[take:]
        self._split_whole(h2, data)

    def _split_whole(self, h2: GuardedH2Connection, buf: bytes | bytearray | memoryview) -> None:
        """`_split` of input that begins with a frame's start (the rest of a frame begun before is
        in front of it already)."""
        incoming = h2.incoming_buffer
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
                sid &= 0x7FFFFFFF
                reader = direct.get(sid) if direct else None
                if (
                    reader is None
                    and flags == 0
                    and length
                    and not in_headers
                    and (sid > h2.highest_inbound_stream_id or sid in h2.held)
                ):
                    # a stream's first request begins (its HEADERS, if in this run, go to h2 first)
                    if run < pos and not self._feed(h2, view[run:pos]):
                        return
                    run = pos
                    reader = self._early(h2, sid)
                if reader is not None:
                    early = type(reader) is EarlyRequest  # its bytes counted in h2's windows, not ours
                    if flags == 0 and not length and not in_headers and h2.control.take():
                        # an empty DATA frame: nothing, for the price of a control frame (grpclib
                        # would take it for the end of the stream); over budget, h2 says so
                        if run < pos and not self._feed(h2, view[run:pos]):
                            return
                        run = after
                    elif (
                        flags == 0
                        and length
                        and not in_headers
                        and (not early or cast(EarlyRequest, reader).fits(length))
                    ):
                        if run < pos and not self._feed(h2, view[run:pos]):
                            return
                        if not early:
                            self._direct_unacked += length
                        if h2.window_unknown:
                            h2.spend(length)
                        self._active()
                        reader.take(view[pos + 9 : after])
                        if self._closed():  # by what the message led to: the rest is not read
                            return
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
            self.connection.queue(window_update(0, self._direct_unacked))
            self._direct_unacked = 0
        self.connection.flush()

    def _early(self, h2: GuardedH2Connection, sid: int) -> EarlyRequest | None:
        """A held stream's first DATA: grpclib hears of the stream now (as it would from h2's
        event), and its first request is read past h2 (direct.EarlyRequest)."""
        stream = h2.streams.get(sid)
        if stream is None or sid not in h2.held:  # not awaiting its request, or gone: h2 reads on
            return None
        begun = h2.held.pop(sid)
        h2.request_begun(sid)
        self.processor.process(begun[0])
        if self._input is not None:
            self._input.charge(STREAM_ESTIMATE)
        raw = self.processor.streams.get(sid)
        if raw is None or self._closed():
            return None
        windows = (h2._inbound_flow_control_window_manager, stream._inbound_window_manager)
        reader = h2.direct[sid] = EarlyRequest(raw, windows)
        return reader

    def _ping(self, payload: bytes) -> None:
        if not self._dead:
            self.h2.ping(payload)
            self.connection.flush()

    def _unanswered(self, why: str) -> None:
        """Our keepalive's PING went unanswered: the client is gone, or never reads (or reads too
        slowly: what of ours it has not taken is said)."""
        why += f", {unsent(self._transport)} bytes of ours unsent"
        if not self._dead and self._peer_budgets is not None:
            self.gate.shed("keepalive", self._peer, f"closing (GOAWAY NO_ERROR): {why}")
            self._goaway(ErrorCodes.NO_ERROR, why, "Keepalive")

    def _close(self, reason: str) -> None:
        self._dead = True
        if self._keepalive is not None:
            self._keepalive.stop()
        if self._input is not None:
            self._input.close()
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
        h2 = self.h2
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
        h2 = self.h2
        h2.close_connection(error_code=code, additional_data=why.encode()[:200])
        self.connection.flush()
        self._close(reason)

    def busy(self) -> bool:
        """Whether it holds a stream (for the gate's choice of who gives way)."""
        return bool(self._peer_budgets is not None and self.h2.open_inbound_streams)

    def give_way(self, why: str) -> None:
        """Closed by the gate to make room for another connection (its slot is released already)."""
        if not self._dead:
            self._goaway(ErrorCodes.NO_ERROR, f"closing to make room: {why}", "Connection limit")

    def held_back(self) -> bool:
        if self._peer_budgets is None:
            return False
        return self.h2.held_back or (self._input is not None and self._input.requests_behind(self.h2.awaiting))

    def awaiting(self) -> int:
        """Its streams awaiting a request, less those whose requests wait in the read
        scheduler's queue (fair.MeteredInput.requests_for)."""
        if self._peer_budgets is None:
            return 0
        awaiting = self.h2.awaiting
        count = len(awaiting)
        return count - self._input.requests_for(awaiting, count) if self._input is not None else count

    def memory(self) -> int:
        """Bytes it holds, as estimated (for the memory watermark's choice of whom to close)."""
        if self._peer_budgets is None or self._transport is None:
            return 0
        held = self._input.held if self._input is not None else 0
        return held + self._transport.get_write_buffer_size() + len(self.h2.streams) * STREAM_MEMORY

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
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as grpclib's own protocol does
        raw_headers = copy.copy(self.h2_config)  # grpclib's, but headers handed on as h2 decoded them:
        raw_headers.header_encoding = None  # as text here (HeaderText), once while they repeat
        h2_conn = GuardedH2Connection(raw_headers, admitted, self.gate.limits)
        h2_conn.on_calm = self._calm
        h2_conn.on_active = self._active
        h2_conn.on_shed = self._shed
        self._request_check = RequestCheck()
        self._header_text = HeaderText()
        self._guard = FrameGuard(
            max_frame_size=MAX_INBOUND_FRAME,
            max_header_block=self.gate.limits.max_header_block,
            control=h2_conn.control,
        )
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
            h2_conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size})
        self.h2 = h2_conn
        self.connection = FlushingConnection(
            h2_conn, cast(asyncio.Transport, transport), config=self.config, flusher=self.flusher
        )
        self.connection.flush()
        self.connection.initialize()
        self.processor = PingCheckingProcessor(self.handler, self.connection)
        limits = self.gate.limits
        self.processor.keepalive = self._keepalive = Keepalive(
            limits.keepalive_time,
            limits.keepalive_timeout,
            self.gate.keepalive,
            self._ping,
            self._unanswered,
            lambda: self._input,
            lambda: self._guard,
            lambda: self._transport,
        )
        self._input = MeteredInput(self.gate.reads, admitted.cost, self, self._process)
        self._stall_deferral, self._sweep_deferral = Deferral(), Deferral()
        self._deadline = asyncio.get_running_loop().call_later(self.gate.limits.request_timeout, self._check_idle)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.open is not None:
            self.open.discard(self)
        if self._input is not None:
            self._input.close()
            self._input = None  # it holds this protocol (a cycle)
        if self._peer_budgets is None:
            return
        h2 = self.h2
        for reader in list(h2.direct.values()):
            reader.fall_back()  # grpclib ends the stream its own way
        h2.forget()
        self.gate.release(self._peer_budgets, self)
        self._peer_budgets = None
        if self._deadline is not None:
            self._deadline.cancel()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._sweep is not None:
            self._sweep.cancel()
        if self._keepalive is not None:
            self._keepalive.stop()
        super().connection_lost(exc)
