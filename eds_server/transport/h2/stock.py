"""The stock path: grpclib's public API, for library versions the fast path was not tested with
(compat.py). Slower: every change wakes each stream's task and is encoded into its own frames by
h2, and messages are read whole by grpclib (their size limits are kept from below, see next).

It is as guarded as the fast path where it counts, from below: each connection's protocol is
grpclib's own, wrapped by GuardedProtocol, which sees every byte both ways before grpclib and h2
do and needs nothing of theirs but the protocol (`Server._protocol_factory`, the one private
name this path touches; checked when the server is built). Connection admission by fair share
and the idle timeout (limits.py), the frame guard (guard.py: frame and header block sizes,
CONTINUATION and unknown frames, the latter left out), the stream, reset and control-frame budgets
from frame headers (guard.StreamLedger), and the first-request deadline (a stream with no request
in time is reset both ways); the RFC 9113 header checks and the bound on streams awaiting a request,
on header blocks held whole by the guard and passed to h2 re-encoded (header_blocks.py), so a refused
stream never reaches h2; message sizes and the partial-message budget from the gRPC length
prefixes in DATA (guard.MessageMeter); send windows taken past 2^31-1 (guard.SendWindows).
docs/limits.md lists what holds on each path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from ssl import SSLContext
from typing import Any, cast

import grpclib.const
import grpclib.server
from grpclib import GRPCError
from grpclib.const import Status
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame, HeadersFrame, PingFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame

from ...ratelimit import Bucket
from .base import DirectClient, Framed, plain_status
from .fair import HELD_RECHECK, STREAM_ESTIMATE, Deferral, MeteredInput, TransportReading
from .guard import END_STREAM, FrameGuard, MessageMeter, Refusal, SendWindows, StreamLedger, over_budget
from .handlers import releasing
from .header_blocks import BlockError, HeaderRelay, literal_block, problem
from .keepalive import Keepalive, unsent
from .limits import BUDGET_WINDOW, REASONS, ConnectionLimits, Gate, PartialBudget, PeerBudgets, fit_to_file_limit
from .overload import STREAM_MEMORY

log = logging.getLogger("eds_server.grpc")
STOCK_MAX_FRAME = 16_384  # h2's default SETTINGS_MAX_FRAME_SIZE, which grpclib's connections announce
STOCK_MAX_STREAMS = 100  # h2's default SETTINGS_MAX_CONCURRENT_STREAMS, which grpclib's connections announce
# streams of one address awaiting their first request, at most (below ConnectionLimits.pending_streams):
# sixteen connections' worth here, as that limit is on the fast path. grpclib starts a handler (and
# the EDS service a session) for each stream as it opens, ~10 KB a stream where the fast path holds an
# h2 stream alone until the request begins: 150 connections of idle streams from one address took
# the server to 200-330 MB, held until they timed out
STOCK_PENDING_STREAMS = 16 * STOCK_MAX_STREAMS
MAX_HEADER_LIST = 1 << 16  # bytes of a decoded header list: h2's own limit (its decoder's default)
CLOSE_GRACE = 2.0  # seconds a closed connection may take to flush its GOAWAY before it is aborted
_HEADERS, _RST, _SETTINGS, _PING = HeadersFrame.type, RstStreamFrame.type, SettingsFrame.type, PingFrame.type

Stream = grpclib.server.Stream[Any, Any]


class StockIO:
    """A stream through grpclib's public Stream API."""

    __slots__ = ("stream",)

    def __init__(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        self.stream = stream

    async def read(self, first: bool = False) -> bytes | None:
        data: bytes | None = await self.stream.recv_message()
        return data

    def first_request(self) -> bytes | None:
        return None

    def read_direct(self, client: DirectClient) -> asyncio.Future[None] | None:
        return None

    def ready(self) -> bool:
        return False  # every send goes through send(), in the stream's own task

    def queue(self, message: Framed) -> bool:
        return False

    async def send(self, message: Framed) -> None:
        await self.stream.send_message(message.payload)

    def status_in_trailers(self) -> contextlib.AbstractAsyncContextManager[None]:
        return plain_status()

    def refused(self) -> None:
        """Nothing is charged on the stock path."""


class _Tap:
    """The transport as grpclib sees it: every write's frame headers go to the ledger first; and
    frames of ours (resets) put in between grpclib's, only where a frame of theirs ends."""

    __slots__ = ("_outbound", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, outbound: FrameGuard) -> None:
        self._transport = transport
        self._outbound = outbound
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._outbound.feed(data)
        self._transport.write(data)
        if self._pending and self._outbound.between_frames:
            self._transport.write(b"".join(self._pending))
            self._pending.clear()

    def inject(self, frame: bytes) -> None:
        """A frame of ours to the client, below h2 (which never hears of it)."""
        if self._transport.is_closing():
            return
        if self._outbound.between_frames:
            self._transport.write(frame)
        else:
            self._pending.append(frame)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedProtocol(TransportReading, asyncio.Protocol):
    """grpclib's protocol for one connection, below which the gRPC port's per-client limits hold
    (docs/limits.md lists the few that need h2's insides and do not)."""

    def __init__(
        self, inner: asyncio.Protocol, gate: Gate, max_message_size: int = 0, budget: PartialBudget | None = None
    ) -> None:
        self.inner = inner
        self.gate = gate
        self.max_message_size = max_message_size or 1 << 32  # 0: no limit (4 bytes of length prefix)
        self.budget = budget
        self.peer: PeerBudgets | None = None
        self._transport: asyncio.Transport | None = None
        self._dead = False
        self._timer: asyncio.TimerHandle | None = None
        self._opened_at_check = 0  # streams opened at the last check
        self._age = 0.0  # seconds of checks: since the connection was made
        self._idle = 0.0  # seconds of checks without a stream held or opened
        self._frames_at_check = 0  # frames the guard had read at the last check
        self._stalled = -1.0  # seconds of checks the same frame stayed begun (-1: none was at the last check)
        self._input: MeteredInput | None = None
        self._deferral = Deferral()
        self._keepalive: Keepalive | None = None
        self._release: asyncio.Handle | None = None  # streams held back by the client's first window, counted again

    # the gate's view (limits.Holder)
    def busy(self) -> bool:
        return bool(self._ledger.open)

    def give_way(self, why: str) -> None:
        self._goaway(ErrorCodes.NO_ERROR, f"closing to make room: {why}")

    def held_back(self) -> bool:
        if self.peer is None:
            return False
        return self._ledger.held_back or (
            self._input is not None and self._input.requests_behind(self._ledger.awaiting)
        )

    def awaiting(self) -> int:
        """Its streams awaiting a request, less those whose requests wait in the read
        scheduler's queue (fair.MeteredInput.requests_for)."""
        if self.peer is None:
            return 0
        awaiting = self._ledger.awaiting
        count = len(awaiting)
        return count - self._input.requests_for(awaiting, count) if self._input is not None else count

    def memory(self) -> int:
        if self._transport is None or self.peer is None:
            return 0
        held = self._input.held if self._input is not None else 0
        return held + self._transport.get_write_buffer_size() + len(self._ledger.open) * STREAM_MEMORY

    @property
    def _peer_name(self) -> str:
        addr = self._transport.get_extra_info("peername") if self._transport else None
        return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "?"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        addr = transport.get_extra_info("peername")
        limits = self.gate.limits
        self.peer = self.gate.admit(str(addr[0]) if isinstance(addr, tuple) else "?", self)
        loop = asyncio.get_running_loop()
        control = Bucket(limits.control_budget, BUDGET_WINDOW)
        self._control = control
        self._ledger = StreamLedger(self.peer, control, loop.time)
        self._relay = HeaderRelay(STOCK_MAX_FRAME, MAX_HEADER_LIST)
        self._meter = MessageMeter(self.max_message_size, self.budget, self.peer)
        self._headers_sent: set[int] = set()  # streams whose response headers grpclib has sent
        self._opens = False  # the header block being received opens a stream
        self._settings_acked = False  # the client has our SETTINGS (MAX_CONCURRENT_STREAMS)
        self._over_cap = 0  # streams refused past that limit before it had them
        self._requested = False  # a stream has sent request data
        self._guard = FrameGuard(
            max_frame_size=STOCK_MAX_FRAME,
            max_header_block=limits.max_header_block,
            control=control,
            drop_unknown=True,
            on_frame=self._received,
            on_block=self._block,
            on_data=self._data,
            on_small=self._small,
        )
        self._windows = SendWindows()
        self._outbound = FrameGuard(max_frame_size=1 << 24, max_header_block=1 << 30, server=False, on_frame=self._sent)
        self._tap = _Tap(self._transport, self._outbound)
        self.inner.connection_made(cast(asyncio.Transport, self._tap))
        self._input = MeteredInput(self.gate.reads, self.peer.cost, self, self._process)
        self._timer = loop.call_later(min(limits.request_timeout, limits.idle_timeout), self._check)
        self._keepalive = Keepalive(
            limits.keepalive_time,
            limits.keepalive_timeout,
            self.gate.keepalive,
            self._ping,
            self._unanswered,
            lambda: self._input,
            lambda: self._guard,
            lambda: self._transport,
        )

    def _received(self, ftype: int, flags: int, sid: int, length: int) -> Refusal | None:
        if ftype == 1:
            self._opens = sid > self._ledger.highest
            if self._opens and self._input is not None:  # grpclib starts its handler, which runs later
                self._input.charge(STREAM_ESTIMATE)
        elif ftype == _SETTINGS and flags & 1:
            self._settings_acked = True
        refusal = self._ledger.received(ftype, flags, sid, length)
        if ftype == _RST:
            self._meter.close(sid)
        if length and ftype == 0:
            self._requested = True
        if sid and sid not in self._ledger.open:
            self._windows.closed(sid)
        if refusal is None and self.peer is not None and ((length and ftype == 0) or ftype == 1):
            self.peer.touch(self)  # a request, or a stream opened: the last of its address to give way
        return refusal

    def _small(self, ftype: int, flags: int, sid: int, payload: bytes) -> Refusal | None:
        """A WINDOW_UPDATE's, SETTINGS' or PING's payload (a WINDOW_UPDATE on a closed stream is
        ignored, as h2 does). A stream window taken past its maximum makes h2 reset that stream: a
        reset the client caused, charged as its own (as the fast path charges every reset h2 answers
        a frame with). A PING ACK is free only if it answers our keepalive."""
        if ftype == _PING:
            if not flags & 1 or (self._keepalive is not None and self._keepalive.answered(payload)):
                return None  # a PING is charged from its header; the answer to ours is free
            return None if self._control.take() else over_budget("control frames (PING ACK)")
        if sid and sid not in self._ledger.open:
            return None
        windows = self._windows
        overflowed = windows.overflowed
        refusal = windows.received(ftype, flags, sid, payload)
        if windows.overflowed != overflowed and self.peer is not None and not self.peer.resets.take():
            return over_budget("stream resets (stream windows taken past 2^31-1)")
        return refusal

    def _sent(self, ftype: int, flags: int, sid: int, length: int) -> Refusal | None:
        self._ledger.sent(ftype, flags, sid, length)
        if ftype == 0:
            self._windows.sent(sid, length)
        if sid and sid not in self._ledger.open:
            self._windows.closed(sid)
        if ftype == _RST or (ftype == _HEADERS and flags & END_STREAM):
            self._headers_sent.discard(sid)
            if ftype == _RST:
                self._meter.close(sid)
        elif ftype == _HEADERS:
            self._headers_sent.add(sid)
        return None

    def _data(self, sid: int, chunk: memoryview, end: bool) -> bytes:
        """A stream's request data as it arrives, below h2: a message over the size limit or the
        partial-message budget is refused from its length prefix. The client gets the gRPC error
        (RESOURCE_EXHAUSTED) and RST_STREAM NO_ERROR from here; h2 and grpclib a reset from the
        client, after the frame they are being passed; the stream's later frames are left out."""
        refused = self._meter.data(sid, chunk, end)
        if refused is None:
            return b""
        reason, why = refused
        return self._end_stream(sid, Status.RESOURCE_EXHAUSTED, reason, why)

    def _end_stream(self, sid: int, code: Status, reason: str, why: str) -> bytes:
        """A stream ended below h2, with gRPC status `code` to the client; what h2 and grpclib
        are to be handed (a reset from the client) is returned."""
        self.gate.shed(reason, self._peer_name, f"{code.name} on stream {sid}: {why}")
        status = [(b"grpc-status", b"%d" % code.value), (b"grpc-message", why.encode())]
        if sid not in self._headers_sent:  # trailers only
            status = [(b":status", b"200"), (b"content-type", b"application/grpc"), *status]
        self._headers_sent.discard(sid)
        trailers = HeadersFrame(sid, literal_block(status), flags={"END_HEADERS", "END_STREAM"}).serialize()
        self._tap.inject(trailers + RstStreamFrame(sid, error_code=ErrorCodes.NO_ERROR).serialize())
        self._guard.drop_stream(sid)
        self._ledger.reset(sid)
        return RstStreamFrame(sid, error_code=ErrorCodes.CANCEL).serialize()

    def _block(self, sid: int, flags: int, first: bytes, rest: bytes) -> tuple[bytes, Refusal | None]:
        """A whole header block from the client: decoded, checked (RFC 9113 section 8, and the
        bound on the address's streams awaiting a request), and passed to h2 encoded anew, or
        refused below it (h2 and grpclib never hear of a refused stream)."""
        try:
            fields = self._relay.fields(first, flags, rest)
        except BlockError as e:
            return b"", Refusal(ErrorCodes[e.code], e.reason, str(e))
        if sid in self._guard.dropped:
            return b"", None  # a stream refused already: decoded only to keep HPACK in step
        opens, self._opens = self._opens, False
        if opens and sid % 2:  # an even stream id is h2's to refuse (a connection error)
            if len(self._ledger.open) > STOCK_MAX_STREAMS:  # h2 would refuse it (spared encoding it here)
                return self._past_the_cap(sid)
            why = problem(fields, request=True)
            if why is not None:
                return self._refuse_stream(sid, ErrorCodes.PROTOCOL_ERROR, "bad_headers", why)
            peer = self.peer
            bound = min(self.gate.limits.pending_streams, STOCK_PENDING_STREAMS)
            # this stream is counted already; those held back by the client's first window are not
            counted = peer.pending - peer.held_back if peer is not None else 0
            if peer is not None and not self._ledger.held_back and counted > (most := peer.pending_room(bound)):
                why = f"{counted - 1} of its streams await a request (limit {most})"
                return self._refuse_stream(sid, ErrorCodes.REFUSED_STREAM, "pending_streams", why)
        elif self._ledger.receiving(sid):  # trailers; HEADERS on a stream ended or closed are h2's to refuse
            why = problem(fields, request=False)
            if why is not None:  # trailers: the stream is reset both ways
                self.gate.shed("bad_headers", self._peer_name, f"RST_STREAM PROTOCOL_ERROR on stream {sid}: {why}")
                self._tap.inject(RstStreamFrame(sid, error_code=ErrorCodes.PROTOCOL_ERROR).serialize())
                self._ledger.reset(sid)
                return RstStreamFrame(sid, error_code=ErrorCodes.CANCEL).serialize(), None
        return self._relay.frames(sid, fields, bool(flags & END_STREAM)), None

    def _past_the_cap(self, sid: int) -> tuple[bytes, Refusal | None]:
        """A new stream past h2's limit of concurrent streams: refused here (REFUSED_STREAM), as h2
        would. Envoy opens its streams before our SETTINGS come, each with its request: such a
        stream is charged as a reset (as h2's own refusals are); a connection that opens more than
        twice the limit without sending one request is ended (grpclib gave up on it at the first);
        once the client has our SETTINGS, it is charged as a stream without a request."""
        self._tap.inject(RstStreamFrame(sid, error_code=ErrorCodes.REFUSED_STREAM).serialize())
        self._guard.drop_stream(sid)
        if self._settings_acked:
            return b"", self._ledger.refuse(sid)
        self._ledger.reset(sid)
        self._over_cap += 1
        if (self._over_cap > STOCK_MAX_STREAMS and not self._requested) or (
            self.peer is not None and not self.peer.resets.take()
        ):
            why = f"{self._over_cap} streams past the limit of {STOCK_MAX_STREAMS} at once"
            return b"", Refusal(ErrorCodes.ENHANCE_YOUR_CALM, "calm", f"GOAWAY ENHANCE_YOUR_CALM: {why}")
        return b"", None

    def _refuse_stream(self, sid: int, code: ErrorCodes, reason: str, why: str) -> tuple[bytes, Refusal | None]:
        """A new stream refused with RST_STREAM `code`, below h2, and charged as one without a request."""
        self.gate.shed(reason, self._peer_name, f"RST_STREAM {code.name} on stream {sid}: {why}")
        self._tap.inject(RstStreamFrame(sid, error_code=code).serialize())
        self._guard.drop_stream(sid)
        return b"", self._ledger.refuse(sid)

    def _refuse(self, refusal: Refusal) -> None:
        if not self._dead:
            self.gate.shed(refusal.reason, self._peer_name, refusal.detail)
            self._goaway(refusal.code, refusal.detail.split(": ", 1)[-1])

    def data_received(self, data: bytes) -> None:
        """Through the read scheduler (fair.py): in slices of whole frames, each charged to the
        client's address, the rest held (reading paused) while others wait their turn."""
        if self._input is not None:
            self._input.feed(data)

    def _process(self, data: bytes | memoryview) -> bool:
        """One slice of input; False once the connection is being closed."""
        if self._dead:
            return False
        guard = self._guard
        passed, refusal = guard.feed(data)
        if refusal is not None:
            self._refuse(refusal)
            return False
        if guard.dropped_data:  # frames h2 never saw still used the client's window: given back here
            self._tap.inject(WindowUpdateFrame(0, window_increment=guard.dropped_data).serialize())
            guard.dropped_data = 0
        if passed:
            self.inner.data_received(cast(bytes, passed))
        ledger = self._ledger
        if ledger.held_back and not ledger.first.unknown and self._release is None and not self._dead:
            self._release = asyncio.get_running_loop().call_soon(self._release_held)
        return not self._dead

    def _release_held(self) -> None:
        """The client has our raise of its window: its streams held back by the first one count
        again once its input up to now is read (its requests may be right behind the ACK)."""
        self._release = None
        if self._dead or self.peer is None or (self._input is not None and self._input.queued):
            return  # queued: the last slice of what waits asks again
        self._ledger.release_held()

    # the read scheduler's view of the connection (fair.Reader): pause and resume from TransportReading
    def overloaded(self, why: str) -> None:
        if not self._dead:
            self.gate.shed("overload", self._peer_name, f"GOAWAY ENHANCE_YOUR_CALM: {why}")
            self._goaway(ErrorCodes.ENHANCE_YOUR_CALM, "server overloaded")

    def _check(self) -> None:
        """Every tick (the shorter of the request and idle timeouts): streams that sent no request
        in time are reset both ways (h2 and grpclib hear a reset from the client, the client one
        from us) and charged; a connection that opened no stream in time, or has held none for the
        idle timeout, is closed."""
        self._timer = None
        if self._dead:
            return
        limits, ledger = self.gate.limits, self._ledger
        tick = min(limits.request_timeout, limits.idle_timeout)
        if self._deferral.holds(self._input, asyncio.get_running_loop().time()):  # what is late may wait in our queue
            self._timer = asyncio.get_running_loop().call_later(HELD_RECHECK, self._check)
            return
        if not self._guard.between_frames:  # a frame or header block begun: the same one as at the last check?
            same = self._stalled >= 0 and self._guard.frames == self._frames_at_check
            self._stalled = self._stalled + tick if same else 0.0
            if self._stalled >= limits.request_timeout:
                why = f"a frame not complete within {limits.request_timeout:g}s"
                self.gate.shed("slow_input", self._peer_name, f"closing (GOAWAY NO_ERROR): {why}")
                self._goaway(ErrorCodes.NO_ERROR, why)
                return
        else:
            self._stalled = -1.0
            for sid in self._meter.overdue(limits.request_timeout):
                why = f"message not complete within {limits.request_timeout:g}s"
                self._meter.close(sid)
                self.inner.data_received(self._end_stream(sid, Status.DEADLINE_EXCEEDED, "slow_input", why))
        self._frames_at_check = self._guard.frames
        if ledger.awaiting and self._guard.between_frames:
            expired = ledger.expired(limits.request_timeout)
            if expired:  # one line for them all: a connection of 1,000 idle streams is one event
                why = f"RST_STREAM CANCEL on {len(expired)} streams ({expired[0]}...): no request in time"
                self.gate.shed("no_request", self._peer_name, why, len(expired))
            for sid in expired:
                reset = RstStreamFrame(sid, error_code=ErrorCodes.CANCEL).serialize()
                self.inner.data_received(reset)
                self._tap.inject(reset)
                refusal = ledger.charge_expired()
                if refusal is not None:
                    self._refuse(refusal)
                    return
        self._age += tick
        if not ledger.opened:
            if self._age >= limits.request_timeout:
                why = f"no stream opened in {limits.request_timeout:g}s"
                self.gate.shed("no_stream", self._peer_name, f"closing (GOAWAY NO_ERROR): {why}")
                self._goaway(ErrorCodes.NO_ERROR, why)
                return
        elif not ledger.open and ledger.opened == self._opened_at_check:
            self._idle += tick
            if self._idle >= limits.idle_timeout:
                why = f"no stream held for {limits.idle_timeout:g}s"
                self.gate.shed("idle", self._peer_name, f"closing (GOAWAY NO_ERROR): {why}")
                self._goaway(ErrorCodes.NO_ERROR, why)
                return
        else:
            self._idle = 0.0
        self._opened_at_check = ledger.opened
        self._timer = asyncio.get_running_loop().call_later(tick, self._check)

    def _ping(self, payload: bytes) -> None:
        """Our keepalive's PING, below h2 (which hears only its ACK, and makes nothing of it)."""
        if not self._dead:
            self._tap.inject(PingFrame(0, opaque_data=payload).serialize())

    def _unanswered(self, why: str) -> None:
        """Our keepalive's PING went unanswered: the client is gone, or never reads (or reads too
        slowly: what of ours it has not taken is said)."""
        why += f", {unsent(self._transport)} bytes of ours unsent"
        if not self._dead:
            self.gate.shed("keepalive", self._peer_name, f"closing (GOAWAY NO_ERROR): {why}")
            self._goaway(ErrorCodes.NO_ERROR, why)

    def _goaway(self, code: ErrorCodes, why: str) -> None:
        """GOAWAY written here, below h2 (whose state no longer matters: the connection ends), then closed."""
        if self._dead:
            return
        self._dead = True
        if self._keepalive is not None:
            self._keepalive.stop()
        if self._input is not None:
            self._input.close()
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        goaway = GoAwayFrame(
            0, last_stream_id=self._ledger.highest, error_code=code, additional_data=why.encode()[:200]
        )
        transport.write(goaway.serialize())
        transport.close()
        asyncio.get_running_loop().call_later(CLOSE_GRACE, transport.abort)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._input is not None:
            self._input.close()
        if self.peer is not None:
            self._ledger.forget()
            self._meter.close_all()
            self.gate.release(self.peer, self)
        if self._timer is not None:
            self._timer.cancel()
        if self._keepalive is not None:
            self._keepalive.stop()
        self.inner.connection_lost(exc)
        # what holds this protocol's methods, and is held by it (cycles), is let go: it all goes now
        self._input = None
        if self.peer is not None:
            self._guard.unhook()
            self._outbound.unhook()


class StockServer(grpclib.server.Server):
    """grpclib's server, listening on a socket of ours (so its port is known without internals),
    each connection under a GuardedProtocol."""

    fast = False

    def __init__(
        self, handlers: list[Any], *, limits: ConnectionLimits, max_message_size: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(handlers, **kwargs)
        self.limits = limits
        self.max_message_size = max_message_size
        self.budget = PartialBudget(limits.partial_message_budget, max_message_size)
        self.gate = Gate(limits)
        self.ssl: SSLContext | None = None
        self._sock: socket.socket | None = None
        if not callable(getattr(grpclib.server.Server, "_protocol_factory", None)):  # then never called
            log.warning(
                "HTTP/2: this grpclib has no Server._protocol_factory: the stock path runs without "
                "its per-client limits (docs/limits.md)"
            )

    def _protocol_factory(self) -> Any:  # grpclib's own, below the guard
        inner = super()._protocol_factory()
        inner.handler = releasing(self, inner.handler)
        return GuardedProtocol(inner, self.gate, self.max_message_size, self.budget)

    def open_io(self, stream: grpclib.server.Stream[Any, Any]) -> StockIO:
        return StockIO(stream)

    def connection_protocol(self) -> asyncio.Protocol:
        """A protocol for one more client connection, as start() makes for each accepted socket:
        tests drive it over in-memory transports (tests/support/memory_io.py)."""
        return cast(asyncio.Protocol, self._protocol_factory())

    async def start(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        ssl: SSLContext | None = None,
        path: str | None = None,
        sock: socket.socket | None = None,
        **kwargs: Any,
    ) -> None:
        """On `host`:`port`, a Unix socket `path`, or a listening socket handed over (a worker's)."""
        fit_to_file_limit(self.limits)
        if path is not None:  # a Unix socket: the workers' link to their owner
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            sock.listen(1024)
            self._sock = sock
            await super().start(sock=sock, **kwargs)
            return
        if sock is None:
            family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
            sock = socket.create_server((host or "", port or 0), family=family, backlog=1024)
        self._sock = sock
        await super().start(sock=sock, ssl=ssl or self.ssl, **kwargs)

    @property
    def port(self) -> int:
        """0 on a Unix socket."""
        assert self._sock is not None
        name = self._sock.getsockname()
        return int(name[1]) if isinstance(name, tuple) else 0

    def stop_accepting(self) -> None:
        """grpclib has no public way to stop accepting alone: close() at the end does it."""

    def goaway(self, peers: set[str], why: str) -> int:
        """grpclib has no public way to end one connection: the streams end, the connection stays."""
        return 0

    @property
    def refused(self) -> dict[str, int]:
        return {**dict.fromkeys(REASONS, 0), **self.gate.refused}

    @property
    def reading(self) -> dict[str, int]:
        """What the read scheduler did (fair.py): slices handed on, inputs held back for a later
        turn, connections shed over the watermark, and the bytes held unread now."""
        reads = self.gate.reads
        return {"slices": reads.slices, "deferred": reads.deferred, "shed": reads.shed, "held_bytes": reads.held}

    @property
    def keepalive(self) -> dict[str, int]:
        """PINGs sent to clients (keepalive.py), and those answered."""
        return self.gate.keepalive.as_dict()

    @property
    def connections(self) -> int:
        return self.gate.connections


def counted_handler(
    handler: grpclib.const.Handler, enter: Callable[[Stream], bool], leave: Callable[[Stream], None]
) -> grpclib.const.Handler:
    """A grpclib handler whose stream counts against a stream limit (`enter` False: refused)."""

    async def run(stream: grpclib.server.Stream[Any, Any]) -> None:
        if not enter(stream):
            raise GRPCError(Status.RESOURCE_EXHAUSTED, "server holds its limit of streams")
        try:
            await handler.func(stream)
        finally:
            leave(stream)

    return grpclib.const.Handler(run, handler.cardinality, handler.request_type, handler.reply_type)
