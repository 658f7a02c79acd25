"""The fast path's h2 connection: every frame received charged to the connection's and the client
IP's budgets (limits.py says what is charged) before h2 reads it, and open streams counted in
O(1). Also the one patch of hyperframe the fast path installs (short frame reprs). Touches h2 and
hyperframe internals (private.py lists each, and why), on the versions compat.py verified only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import hyperframe.frame
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import RequestReceived
from h2.exceptions import ProtocolError as H2ProtocolError
from h2.settings import SettingCodes
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

from ...ratelimit import Bucket
from .limits import BUDGET_WINDOW, ConnectionLimits, FirstWindow, PeerBudgets
from .repeat_decoder import RepeatDecoder

WINDOW_CREDIT_PER_DATA_FRAME = 10  # WINDOW_UPDATEs a client may send per DATA frame we send (as Envoy)
OPEN_WINDOW = 65_535  # bytes of connection window left: the client could have sent its requests


class Calm(H2ProtocolError):
    """A client over one of its budgets: h2 answers GOAWAY with this code."""

    error_code = ErrorCodes.ENHANCE_YOUR_CALM


class DirectStream(Protocol):
    """A stream whose DATA frames are read past h2 (direct.py's DirectReader)."""

    def take(self, payload: memoryview) -> None: ...
    def fall_back(self) -> None: ...
    def call_ended(self) -> None: ...


def _nothing() -> None:
    return None


def _ignore(reason: str, detail: str, count: int) -> None:
    return None


def window_update(stream_id: int, increment: int) -> bytes:
    """A WINDOW_UPDATE frame (type 8, no flags)."""
    return b"\x00\x00\x04\x08\x00" + stream_id.to_bytes(4, "big") + increment.to_bytes(4, "big")


class GuardedH2Connection(H2Connection):
    """h2's connection, charging what each frame received costs to the connection's and the client
    IP's budgets (limits.py says what is charged), and counting open streams in O(1).

    Overrides h2 4.4's private `_receive_frame`, `_prepare_for_sending` and `_open_streams`
    (used only with the versions compat.py verified); tests/hostile/test_clients.py fails if they stop
    taking effect.
    """

    def __init__(self, config: H2Configuration, peer: PeerBudgets, limits: ConnectionLimits) -> None:
        self._settings_credit = 1  # the client's first SETTINGS; one more per SETTINGS we send (its ACK)
        self.first = FirstWindow()  # the window the client knows it has (h2's __init__ sends no frame)
        self.window_unknown = False  # first.unknown, read per DATA frame: one attribute, not two
        self.held_back = False  # the window the client knows is spent: its streams awaiting a request wait on it
        super().__init__(config=config)
        self.decoder = RepeatDecoder(self.decoder.max_header_list_size)  # Envoy's repeated blocks from memory
        self.peer = peer
        self.control = Bucket(limits.control_budget, BUDGET_WINDOW)
        self.pending_limit = limits.pending_streams
        self._touched: set[int] = set()  # streams a frame was sent or received on since the last count
        self._receiving = False
        self._window_credit = 100
        self.stream_checks = 0  # streams looked at to count open ones: the work test_hostile counts
        self.ping_payload: bytes | None = None  # of our last keepalive PING
        self.window_before_read = 0  # our send window on the connection before the frames being read
        self.awaiting: set[int] = set()  # streams opened that have sent no DATA yet
        # their RequestReceived events, and when: grpclib starts no handler for a stream until its
        # request begins, so a stream that sends nothing costs an h2 stream, not a task
        self.held: dict[int, tuple[RequestReceived, float]] = {}
        self.refused: set[int] = set()  # new streams to refuse (REFUSED_STREAM): too many await a request
        self.bad: dict[int, str] = {}  # streams whose headers were malformed, and why (answered PROTOCOL_ERROR)
        self.direct: dict[int, DirectStream] = {}  # streams whose DATA frames skip h2 (direct.py)
        self.early_taken = self.early_returned = 0  # first requests read past h2, or handed back (the tests count)
        self.early_kept = 0  # of those read past h2, kept as they were read (one frame), not joined
        self.on_calm: Callable[[str], None] | None = None  # ends the connection over a budget, outside a frame
        self.on_active: Callable[[], None] = _nothing  # a stream opened or a request sent: the connection is busy
        self.on_shed: Callable[[str, str, int], None] = _ignore  # refusals (reason, detail, count): counted, logged

    def _wasted(self, what: str) -> None:
        """A stream ended (or refused, or timed out) without a request."""
        if not self.peer.waste():
            raise Calm(f"over its budget of streams without a request ({what})")

    def _answered(self, stream_id: int) -> None:
        self.awaiting.discard(stream_id)
        self.peer.pending -= 1
        if self.held_back:
            self.peer.held_back -= 1

    def request_begun(self, stream_id: int) -> None:
        """A stream's first request began past h2 (direct.EarlyRequest): as its DATA would tell _charge."""
        if stream_id in self.awaiting:
            self._answered(stream_id)

    def spend(self, length: int) -> None:
        """`length` bytes of DATA received while the client may not know our raise of its window:
        once what it knows is spent, its streams awaiting a request are held back by flow control
        (not counted against the address's bound) until it has the raise and we have read what it
        sent by then (release_held)."""
        spent = self.first.data(length)
        self.window_unknown = self.first.unknown
        if spent and not self.held_back:
            self.held_back = True
            self.peer.held_back += len(self.awaiting)

    def acknowledged(self, size: int, stream_id: int) -> bytes:
        """h2's acknowledge_received_data, its WINDOW_UPDATEs returned as bytes: the same windows'
        own rule (each manager's process_bytes) decides the grants, with no hyperframe frame built
        (0.94 against 3.81 us: bench/private_touches.py acknowledge). Unlike h2's, a stream it no
        longer knows still has the connection's grant written. The frames join the connection's
        next write ahead of output h2 holds then: WINDOW_UPDATEs may go in any order."""
        if stream_id <= 0:
            raise ValueError(f"Stream ID {stream_id} is not valid for acknowledged")
        if size < 0:
            raise ValueError(f"Cannot acknowledge negative data, got {size}")
        frames = b""
        increment = self._inbound_flow_control_window_manager.process_bytes(size)
        if increment:
            frames = window_update(0, increment)
        stream = self.streams.get(stream_id)
        if stream is not None and stream.open:
            increment = stream._inbound_window_manager.process_bytes(size)
            if increment:
                frames += window_update(stream_id, increment)
        return frames

    def release_held(self) -> None:
        """The client knows its window, and its input up to then is read: its streams awaiting a
        request count again."""
        if self.held_back:
            self.held_back = False
            self.peer.held_back -= len(self.awaiting)

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
        except Calm as e:
            if self.on_calm is not None:
                if defer:
                    asyncio.get_running_loop().call_soon(self.on_calm, str(e))
                else:
                    self.on_calm(str(e))

    def forget(self) -> None:
        """The connection is gone: its streams no longer await a request, and its hooks (bound to
        the protocol, which holds this connection: a cycle) are let go, so both go as it closes."""
        self.peer.pending -= len(self.awaiting)
        self.release_held()
        self.awaiting.clear()
        self.held.clear()
        self.on_calm, self.on_active, self.on_shed = None, _nothing, _ignore

    def _charge(self, frame: Frame) -> None:
        peer = self.peer
        sid = frame.stream_id
        if isinstance(frame, HeadersFrame):
            if sid in self.streams or sid <= self.highest_inbound_stream_id:
                return  # trailers, or an error h2 reports itself
            if not peer.may_open():  # an IP that spent its budget opens nothing until a tenth is back
                raise Calm("over its budget of streams without a request")
            if "END_STREAM" in frame.flags:
                self._wasted("ended by its headers")
                return
            full = peer.pending - peer.held_back >= peer.pending_room(self.pending_limit)
            if full and not self.held_back and self.inbound_flow_control_window >= OPEN_WINDOW:
                # Refused cheaply (RST_STREAM REFUSED_STREAM, no handler): a client that sends its
                # requests never gets here, nor one whose requests wait on flow control (a big
                # Envoy's first requests, 60 KB each: the window it knows, or ours, is spent); one
                # that opens streams and sends nothing pays.
                self.refused.add(sid)
                self._wasted(f"refused, {peer.pending - peer.held_back} streams awaiting a request")
            else:
                self.awaiting.add(sid)
                peer.pending += 1
                if self.held_back:
                    peer.held_back += 1
                self.on_active()
            return
        if isinstance(frame, DataFrame):
            if frame.data:
                self.on_active()
            if sid in self.awaiting:
                self._answered(sid)
                if not frame.data and "END_STREAM" in frame.flags:
                    self._wasted("ended before its request")
            if self.window_unknown:
                self.spend(frame.flow_controlled_length)
            if frame.data or "END_STREAM" in frame.flags:
                return
            what = "control frames (empty DATA)"
        elif isinstance(frame, RstStreamFrame):
            if sid in self.awaiting:
                self._answered(sid)
                if not self.held_back and self.inbound_flow_control_window >= OPEN_WINDOW:  # not held back by a window
                    self._wasted("reset before its request")
            if not peer.resets.take():
                raise Calm("over its budget of stream resets")
            return
        elif isinstance(frame, WindowUpdateFrame):
            if self._window_credit > 0:
                self._window_credit -= 1
                return
            what = "control frames (WINDOW_UPDATE)"
        elif isinstance(frame, SettingsFrame):
            if "ACK" in frame.flags:
                self.first.ack()
                self.window_unknown = self.first.unknown
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
            raise Calm(f"over its budget of {what}")

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
                raise Calm("over its budget of stream resets")
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
        self.first.settings()
        super().initiate_connection()

    def update_settings(self, new_settings: dict[SettingCodes | int, int]) -> None:
        self._settings_credit += 1
        self.first.settings()
        super().update_settings(new_settings)

    def increment_flow_control_window(self, increment: int, stream_id: int | None = None) -> None:
        if not stream_id:
            self.first.raised()
            self.window_unknown = self.first.unknown
        super().increment_flow_control_window(increment, stream_id)

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
