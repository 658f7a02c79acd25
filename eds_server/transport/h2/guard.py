"""The frame guard: what the bytes of an HTTP/2 connection may hold, checked from each frame's
9-byte header as the bytes arrive, before any HTTP/2 library buffers them. Sans-IO (bytes in, a
refusal or nothing out), no other library's internals, so it sits below both paths the same way.

- a frame longer than the SETTINGS_MAX_FRAME_SIZE we announced: refused from its header
  (FRAME_SIZE_ERROR), before its payload is read (h2 buffers all of it first);
- a header block (HEADERS or PUSH_PROMISE and its CONTINUATION frames) longer than
  `max_header_block`: refused as it grows (ENHANCE_YOUR_CALM, as h2 answers a header list over
  its own limit), instead of h2 holding up to 64 CONTINUATION frames of any size;
- CONTINUATION frames are charged as control frames (the `control` budget);
- unknown frame types, when `drop_unknown`: charged as control frames and left out of what is
  passed on (RFC 9113 section 4.1: ignored), for a library that would fail on them;
- `on_frame` sees every other frame's header: the stock path charges its budgets there
  (StreamLedger, from the frames' headers both ways), the fast path inside h2 (fast_connection.py);
- for a path that cannot refuse inside its library (stock), three more hooks: `on_block` gets
  each header block whole (held, not passed: header_blocks.py re-encodes it), `on_data` each DATA
  frame's data as it passes (MessageMeter: gRPC length prefixes), `on_small` each WINDOW_UPDATE's
  and SETTINGS' payload (SendWindows: flow-control overflow).

Frame types are hyperframe's public table (`hyperframe.frame.FRAMES`); the header itself is
unpacked with struct: hyperframe's `Frame.parse_frame_header` builds a frame object per header,
4.6 us against 0.13 us here (timeit, this machine under load), and the guard reads every header.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from h2.errors import ErrorCodes
from hyperframe.frame import (
    FRAMES,
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    PushPromiseFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from ...ratelimit import Bucket
from .limits import FirstWindow, PartialBudget, PeerBudgets

PREFACE_LENGTH = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n": the client's, before its first frame
END_HEADERS = 0x4
PADDED = 0x8
_CONTINUATION = ContinuationFrame.type
_HELD_CONTINUED = 0x100  # (in _held_flags, past the frame flags) a CONTINUATION frame is held
MAX_DROPPED_STREAMS = 1024  # streams refused below the library whose later frames are left out
_BLOCK_STARTS = (HeadersFrame.type, PushPromiseFrame.type)


@dataclass(frozen=True)
class Refusal:
    """Why the connection is ended: the GOAWAY error code, the refusal's reason (limits.REASONS)
    and what to log."""

    code: ErrorCodes
    reason: str
    detail: str


class FrameGuard:
    """Frame headers of one connection's input, followed across reads of any size."""

    __slots__ = (
        "_after",
        "_block",
        "_data_end",
        "_data_left",
        "_data_sid",
        "_dropping",
        "_first",
        "_head",
        "_held",
        "_held_flags",
        "_held_sid",
        "_left",
        "_pad",
        "_preface",
        "_rest",
        "_small",
        "_small_frame",
        "control",
        "drop_unknown",
        "dropped",
        "dropped_data",
        "frames",
        "max_frame_size",
        "max_header_block",
        "on_block",
        "on_data",
        "on_frame",
        "on_small",
        "refusal",
        "requests",
    )

    def __init__(
        self,
        *,
        max_frame_size: int,
        max_header_block: int,
        control: Bucket | None = None,
        server: bool = True,
        drop_unknown: bool = False,
        on_frame: Callable[[int, int, int, int], Refusal | None] | None = None,
        on_block: Callable[[int, int, bytes, bytes], tuple[bytes, Refusal | None]] | None = None,
        on_data: Callable[[int, memoryview, bool], bytes] | None = None,
        on_small: Callable[[int, int, int, bytes], Refusal | None] | None = None,
    ) -> None:
        self.max_frame_size = max_frame_size
        self.max_header_block = max_header_block
        self.control = control  # the connection's control-frame budget (None: not charged here)
        self.drop_unknown = drop_unknown
        self.on_frame = on_frame  # (type, flags, stream id, length) of each frame passed on: a refusal or None
        self.refusal: Refusal | None = None  # once refused, every later feed is too
        self._preface = PREFACE_LENGTH if server else 0
        self.frames = 0  # frame headers read: a frame begun and not complete at two checks is drip-fed
        # bytes of DATA, HEADERS and CONTINUATION frames read (what a client sends while it is busy
        # sending requests: keepalive.py counts it as alive; control frames cost nothing to send blind)
        self.requests = 0
        self._head = b""  # the start of a frame header split across reads
        self._left = 0  # bytes of the current frame's payload still to come
        self._dropping = False  # the current frame is left out
        self._block = -1  # bytes of the header block begun, -1 outside one
        # (on_block) header blocks are held, not passed: each whole block goes to on_block (stream
        # id, HEADERS flags, HEADERS payload, CONTINUATION payloads), whose bytes are passed instead
        self.on_block = on_block
        self.dropped: dict[int, None] = {}  # (on_block) streams whose other frames are left out
        self._held = False  # the current frame is part of a held header block
        self._held_sid = -1  # the held block's stream, -1 outside one
        self._held_flags = 0
        self._first = bytearray()  # the held block's HEADERS payload
        self._rest = bytearray()  # and its CONTINUATION payloads
        # (on_data) the data of each DATA frame passed on, padding left out, as it arrives: (stream
        # id, data, whether it ends the stream); what it answers is passed on after that frame
        self.on_data = on_data
        self.dropped_data = 0  # (on_block) bytes of DATA frames left out: flow control the library never saw
        self._data_sid = 0  # the DATA frame being read, 0 outside one
        self._data_end = False  # it has END_STREAM
        self._pad = 0  # -1: its padding length is still to come
        self._data_left = 0  # its data bytes still to come (then its padding)
        self._after = b""  # to pass on once the current frame is
        # (on_small) each WINDOW_UPDATE's and SETTINGS' (type, flags, stream id, payload), once read whole
        self.on_small = on_small
        self._small_frame: tuple[int, int, int] | None = None  # the one being read
        self._small = bytearray()

    def unhook(self) -> None:
        """The connection is gone: its hooks (bound to the protocol that holds this guard, a cycle)
        are let go, so both go as it closes."""
        self.on_frame = self.on_block = self.on_data = self.on_small = None

    def feed(self, data: bytes | bytearray | memoryview) -> tuple[bytes | bytearray | memoryview, Refusal | None]:
        """What to pass on of `data` (`data` itself unless frames are left out, or a frame header
        split across reads is held back until its type is known), and the refusal if a frame
        breaks a limit (then nothing more is passed on)."""
        if self.refusal is not None:
            return b"", self.refusal
        view = memoryview(data)
        end = len(data)
        pos = 0
        out: list[bytes | memoryview] | None = [] if self.drop_unknown or self.on_block or self.on_data else None
        changed = False  # something left out, held back, or sent from an earlier read
        mark = 0  # (out) the start of what is passed on and not yet in `out`
        if self._preface:
            pos = min(self._preface, end)
            self._preface -= pos
        while pos < end:
            if self._left:
                n = min(self._left, end - pos)
                if self._dropping and out is not None:
                    out.append(view[mark:pos])
                    mark, changed = pos + n, True
                    if self._held:
                        (self._rest if self._first_done else self._first).extend(view[pos : pos + n])
                elif self._data_sid:
                    self._data(view[pos : pos + n], n == self._left)
                elif self._small_frame is not None:
                    self._small += view[pos : pos + n]
                pos += n
                self._left -= n
                if not self._left and self._small_frame is not None:
                    refusal = self._small_done()
                    if refusal is not None:
                        return b"", refusal
                if not self._left and self._after and out is not None:
                    out.append(view[mark:pos])
                    out.append(self._after)
                    mark, changed, self._after = pos, True, b""
                if not self._left and self._held:
                    refusal = self._held_frame_done(out)  # type: ignore[arg-type]  # a list when held
                    if refusal is not None:
                        return b"", refusal
                continue
            start = pos
            need = 9 - len(self._head)
            if end - pos < need:  # a header split across reads
                self._head += bytes(view[pos:end])
                if out is not None:
                    out.append(view[mark:pos])
                    mark, changed = end, True
                break
            held = self._head
            header = held + bytes(view[pos : pos + need]) if held else bytes(view[pos : pos + 9])
            self._head = b""
            pos += need
            self.frames += 1
            length = int.from_bytes(header[:3], "big")
            ftype = header[3]
            if ftype <= 1 or ftype == _CONTINUATION:  # DATA (0), HEADERS (1), CONTINUATION
                self.requests += length
            refusal = self._check(length, ftype, header[4])
            sid = -1
            if refusal is None and self.on_frame is not None and ftype in FRAMES:
                sid = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
                refusal = self.on_frame(ftype, header[4], sid, length)
            if refusal is None and self.on_block is not None:
                if sid < 0:
                    sid = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
                refusal = self._hold(ftype, header[4], sid)
            if refusal is not None:
                self.refusal = refusal
                return b"", refusal
            self._left = length
            self._data_sid = 0
            if self.on_small is not None and ftype in _SMALL and not (sid > 0 and sid in self.dropped):
                self._small_frame = (ftype, header[4], int.from_bytes(header[5:9], "big") & 0x7FFFFFFF)
                self._small.clear()
                if not length:
                    refusal = self._small_done()
                    if refusal is not None:
                        return b"", refusal
            if out is not None:
                # (on_data) an empty DATA frame that does not end its stream carries nothing, and
                # grpclib's reader takes one for the end of the stream inside a message (a traceback)
                empty = not length and ftype == _DATA and self.on_data is not None and not header[4] & END_STREAM
                self._dropping = self._held or ftype not in FRAMES or (sid > 0 and sid in self.dropped) or empty
                if self._dropping and ftype == _DATA:
                    self.dropped_data += length
                elif ftype == _DATA and self.on_data is not None:
                    self._data_sid, self._data_end = sid, bool(header[4] & END_STREAM)
                    self._pad, self._data_left = (-1, 0) if header[4] & PADDED else (0, length)
                    if not length:
                        self._data(memoryview(b""), True)
                        if self._after:
                            out.append(view[mark:pos])
                            out.append(self._after)
                            mark, changed, self._after = pos, True, b""
                if self._dropping:
                    out.append(view[mark:start])
                    mark, changed = pos, True
                    if self._held and not length:
                        refusal = self._held_frame_done(out)
                        if refusal is not None:
                            return b"", refusal
                elif held:
                    out.append(view[mark:start])
                    out.append(held)
                    mark, changed = start, True
        if not changed or out is None:
            return data, None
        out.append(view[mark:end])
        return b"".join(out), None

    def _data(self, chunk: memoryview, last: bool) -> None:
        """(on_data) `chunk` of the current DATA frame's payload (`last`: the frame's end)."""
        if self._pad < 0:
            if not chunk:
                return
            self._pad = chunk[0]
            self._data_left = max(0, self._left - 1 - self._pad)  # (_left: this chunk on) h2 refuses a bad length
            chunk = chunk[1:]
        n = min(self._data_left, len(chunk))
        self._data_left -= n
        if n or (last and self._data_end):
            assert self.on_data is not None
            self._after += self.on_data(self._data_sid, chunk[:n], last and self._data_end)

    def _small_done(self) -> Refusal | None:
        assert self._small_frame is not None and self.on_small is not None
        (ftype, flags, sid), self._small_frame = self._small_frame, None
        refusal = self.on_small(ftype, flags, sid, bytes(self._small))
        if refusal is not None:
            self.refusal = refusal
        return refusal

    @property
    def _first_done(self) -> bool:
        return self._held_flags & _HELD_CONTINUED != 0

    def _hold(self, ftype: int, flags: int, sid: int) -> Refusal | None:
        """(on_block) Whether this frame is part of a held header block, or breaks one."""
        self._held = False
        if self._held_sid >= 0:
            if ftype != _CONTINUATION or sid != self._held_sid:
                return _protocol_error(f"frame of type {ftype:#x} on stream {sid} inside a header block")
            self._held = True
            self._held_flags |= _HELD_CONTINUED
            self._held_flags = (self._held_flags & ~END_HEADERS) | (flags & END_HEADERS)
            return None
        if ftype == _CONTINUATION:
            return _protocol_error(f"CONTINUATION on stream {sid} outside a header block")
        if ftype == PushPromiseFrame.type:
            return _protocol_error("PUSH_PROMISE from a client")
        if ftype == HeadersFrame.type:
            if not sid:
                return _protocol_error("HEADERS on stream 0")
            self._held = True
            self._held_sid = sid
            self._held_flags = flags
            self._first.clear()
            self._rest.clear()
        return None

    def _held_frame_done(self, out: list[bytes | memoryview]) -> Refusal | None:
        """A held frame's payload is in: at the block's end, on_block's bytes are passed in its place."""
        self._held = False
        if not self._held_flags & END_HEADERS:
            return None
        assert self.on_block is not None
        sid, flags = self._held_sid, self._held_flags & ~_HELD_CONTINUED
        first, rest = bytes(self._first), bytes(self._rest)
        self._held_sid = -1
        self._first.clear()
        self._rest.clear()
        passed, refusal = self.on_block(sid, flags, first, rest)
        if refusal is not None:
            self.refusal = refusal
            return refusal
        if passed:
            out.append(passed)
        return None

    def drop_stream(self, sid: int) -> None:
        """(on_block) Leave out the stream's later frames (but its header blocks, which go to
        on_block: HPACK state): it was refused below the library, which never heard of it."""
        dropped = self.dropped
        dropped[sid] = None
        if len(dropped) > MAX_DROPPED_STREAMS:  # the oldest: a client long past its reset
            del dropped[next(iter(dropped))]

    @property
    def between_frames(self) -> bool:
        """Whether a frame may be put in the input here: none is begun, and no header block."""
        return not (self._left or self._head or self._preface) and self._block < 0 and self._held_sid < 0

    def _check(self, length: int, ftype: int, flags: int) -> Refusal | None:
        if length > self.max_frame_size:
            why = f"GOAWAY FRAME_SIZE_ERROR: frame of {length} bytes (limit {self.max_frame_size})"
            return Refusal(ErrorCodes.FRAME_SIZE_ERROR, "frame_size", why)
        if ftype == _CONTINUATION:
            if self._block >= 0:
                self._block += length
            if not self._charge():
                return self._calm("CONTINUATION")
        elif ftype in _BLOCK_STARTS:
            self._block = length
        elif ftype not in FRAMES and self.drop_unknown:
            return None if self._charge() else self._calm(f"unknown type {ftype:#x}")
        else:
            return None  # anything else inside a block is h2's to refuse (PROTOCOL_ERROR)
        if self._block > self.max_header_block:
            size, self._block = self._block, -1
            why = f"GOAWAY ENHANCE_YOUR_CALM: header block of {size}+ bytes (limit {self.max_header_block})"
            return Refusal(ErrorCodes.ENHANCE_YOUR_CALM, "header_size", why)
        if flags & END_HEADERS:
            self._block = -1
        return None

    def _charge(self) -> bool:
        return self.control is None or self.control.take()

    @staticmethod
    def _calm(what: str) -> Refusal:
        return Refusal(
            ErrorCodes.ENHANCE_YOUR_CALM,
            "calm",
            f"GOAWAY ENHANCE_YOUR_CALM: over its budget of control frames ({what})",
        )


# frames whose payload on_small reads
_SMALL = frozenset((SettingsFrame.type, WindowUpdateFrame.type, PingFrame.type))
MAX_WINDOW = 2**31 - 1  # RFC 9113 section 6.9.1: no flow-control window may exceed it


class SendWindows:
    """The flow-control windows a client has granted us (RFC 9113 section 6.9), from its
    WINDOW_UPDATE and SETTINGS payloads and our DATA frames' headers: the connection's window, or a
    SETTINGS_INITIAL_WINDOW_SIZE, taken past 2^31-1 is a connection FLOW_CONTROL_ERROR, answered
    here (h2 raises, and grpclib swallows the error unanswered). A stream's is a stream error, which
    h2 answers itself (RST_STREAM FLOW_CONTROL_ERROR): that stream is forgotten here, and counted in
    `overflowed`, for the caller to charge as a reset the client caused.

    A stream's window is kept as its own part (`streams`: its WINDOW_UPDATEs less our DATA) on top
    of the initial size, with an upper bound of the largest part (`top`), so a SETTINGS frame costs
    the same whatever the streams open: each INITIAL_WINDOW_SIZE entry is checked against the bound,
    and the streams are walked only when the bound says a window may overflow (then the connection
    ends, or the bound is made exact). A SETTINGS frame of 2,700 such entries walked every stream
    2,700 times: 1,340 frames held the loop for a minute."""

    __slots__ = ("connection", "initial", "overflowed", "streams", "top", "walks")

    def __init__(self) -> None:
        self.connection = 65_535
        self.initial = 65_535
        self.streams: dict[int, int] = {}  # open streams' own parts of their windows (created on first use)
        self.top = 0  # at least the largest of those parts
        self.overflowed = 0  # stream windows taken past the maximum (streams h2 resets)
        self.walks = 0  # times the streams were walked to make `top` exact

    def window(self, sid: int) -> int:
        """Stream `sid`'s send window."""
        return self.initial + self.streams.get(sid, 0)

    def received(self, ftype: int, flags: int, sid: int, payload: bytes) -> Refusal | None:
        if ftype == WindowUpdateFrame.type and len(payload) == 4:
            increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
            if not sid:
                self.connection += increment
                if self.connection > MAX_WINDOW:
                    return _flow_error(f"WINDOW_UPDATE of {increment} takes the connection window past 2^31-1")
            else:
                own = self.streams.get(sid, 0) + increment
                if self.initial + own > MAX_WINDOW:  # a stream error: h2 resets it (RST_STREAM FLOW_CONTROL_ERROR)
                    self.streams.pop(sid, None)
                    self.overflowed += 1
                else:
                    self.streams[sid] = own
                    if own > self.top:
                        self.top = own
        elif ftype == SettingsFrame.type and not flags & ACK:
            for i in range(0, len(payload) - 5, 6):
                if int.from_bytes(payload[i : i + 2], "big") != 4:  # SETTINGS_INITIAL_WINDOW_SIZE
                    continue
                value = int.from_bytes(payload[i + 2 : i + 6], "big")
                if value > MAX_WINDOW:
                    return _flow_error(f"SETTINGS_INITIAL_WINDOW_SIZE of {value}")
                if self.streams and value + self.top > MAX_WINDOW:
                    stream, self.top = max(self.streams.items(), key=lambda item: item[1])  # exact, once
                    self.walks += 1
                    if value + self.top > MAX_WINDOW:
                        return _flow_error(
                            f"SETTINGS_INITIAL_WINDOW_SIZE of {value} takes stream {stream}'s window past 2^31-1"
                        )
                self.initial = value
        return None

    def sent(self, sid: int, length: int) -> None:
        """A DATA frame of ours."""
        self.connection -= length
        self.streams[sid] = self.streams.get(sid, 0) - length

    def closed(self, sid: int) -> None:
        self.streams.pop(sid, None)


def _flow_error(what: str) -> Refusal:
    return Refusal(ErrorCodes.FLOW_CONTROL_ERROR, "protocol_error", f"GOAWAY FLOW_CONTROL_ERROR: {what}")


# frame types and flags (RFC 9113 section 6), from hyperframe's classes
_DATA, _HEADERS, _PRIORITY, _RST = DataFrame.type, HeadersFrame.type, PriorityFrame.type, RstStreamFrame.type
_SETTINGS, _PING, _WINDOW_UPDATE = SettingsFrame.type, PingFrame.type, WindowUpdateFrame.type
END_STREAM = ACK = 0x1
WINDOW_CREDIT_PER_DATA_FRAME = 10  # WINDOW_UPDATEs a client may send per DATA frame we send (as Envoy)


class StreamLedger:
    """What a connection's frames, both ways, cost its client, from their headers alone (the
    rules of limits.py), for a path that cannot see inside the HTTP/2 library: streams open and
    awaiting their first request, stream and reset budgets, control frames. `received` and `sent`
    take each frame's (type, flags, stream id, length); `received` answers a refusal when a budget
    is spent."""

    def __init__(self, peer: PeerBudgets, control: Bucket, clock: Callable[[], float]) -> None:
        self.peer = peer
        self.control = control
        self.clock = clock
        self.open: set[int] = set()  # streams the client opened that are not closed both ways
        self.awaiting: dict[int, float] = {}  # streams opened with no DATA yet, and when (oldest first)
        self._remote_ended: set[int] = set()
        self._local_ended: set[int] = set()
        self.highest = 0  # the highest stream id the client opened
        self.opened = 0  # streams opened, in all
        self._settings_credit = 1  # the client's first SETTINGS, then one ACK per SETTINGS we send
        self._window_credit = 100
        self.first = FirstWindow()  # the window the client knows it has
        # the window the client knows is spent: its streams awaiting a request wait on it (PeerBudgets.held_back)
        self.held_back = False

    def received(self, ftype: int, flags: int, sid: int, length: int) -> Refusal | None:
        peer = self.peer
        if ftype == _HEADERS:
            if sid <= self.highest:
                return None  # trailers, or h2's to refuse
            self.highest = sid
            if not peer.may_open():  # an IP that spent its budget opens nothing until a tenth is back
                return over_budget("streams without a request")
            self.opened += 1
            self.open.add(sid)
            if flags & END_STREAM:
                self._remote_ended.add(sid)
                return self._wasted()
            self._await(sid)
            return None
        if ftype == _DATA:
            if sid and (sid in self._remote_ended or (sid <= self.highest and sid not in self.open)):
                # DATA on a stream the client ended or that is closed: h2 answers it with its own
                # RST_STREAM, charged here, before h2 sees it, like a client's reset
                return None if peer.resets.take() else over_budget("stream resets (DATA on a closed stream)")
            if self.awaiting and self._answered(sid) and not length and flags & END_STREAM:
                self._end(sid, remote=True)
                return self._wasted()
            if self.first.unknown and self.first.data(length) and not self.held_back:
                self.held_back = True
                peer.held_back += len(self.awaiting)
            if flags & END_STREAM:
                self._end(sid, remote=True)
            if length or flags & END_STREAM:
                return None
            what = "empty DATA"
        elif ftype == _RST:
            self._close(sid)
            if self._answered(sid) and self._wasted() is not None:
                return over_budget("streams without a request")
            return None if peer.resets.take() else over_budget("stream resets")
        elif ftype == _WINDOW_UPDATE:
            if self._window_credit > 0:
                self._window_credit -= 1
                return None
            what = "WINDOW_UPDATE"
        elif ftype == _SETTINGS:
            if flags & ACK:
                self.first.ack()
            if self._settings_credit > 0:
                self._settings_credit -= 1
                return None
            what = "SETTINGS"
        elif ftype == _PING:
            if flags & ACK:
                return None  # our keepalive's answer
            what = "PING"
        elif ftype == _PRIORITY:
            what = "PRIORITY"
        else:
            return None
        return None if self.control.take() else over_budget(f"control frames ({what})")

    def sent(self, ftype: int, flags: int, sid: int, length: int) -> None:
        """A frame we sent."""
        if ftype == _DATA:
            self._window_credit = min(self._window_credit + WINDOW_CREDIT_PER_DATA_FRAME, 100_000)
        if ftype == _RST:  # ours (h2 refusing a stream past its cap, say): not the client's to pay for
            self._answered(sid)
            self._close(sid)
        elif ftype in (_DATA, _HEADERS) and flags & END_STREAM:
            self._end(sid, remote=False)
        elif ftype == _SETTINGS and not flags & ACK:
            self._settings_credit += 1
            self.first.settings()
        elif ftype == _WINDOW_UPDATE and not sid:
            self.first.raised()

    def expired(self, timeout: float) -> list[int]:
        """Streams that have sent no request within `timeout`: forgotten here, and charged."""
        now = self.clock()
        out = []
        for sid, since in self.awaiting.items():  # in opening order: the oldest first
            if now - since < timeout:
                break
            out.append(sid)
        for sid in out:
            self._answered(sid)
            self._close(sid)
        return out

    def refuse(self, sid: int) -> Refusal | None:
        """A stream refused below the library (which never hears of it): closed here, and charged
        as a stream without a request."""
        awaited = self._answered(sid)  # else it ended with its HEADERS: charged then
        self._close(sid)
        return self._wasted() if awaited else None

    def receiving(self, sid: int) -> bool:
        """Whether the client may still send on stream `sid` (opened, not ended or closed by it)."""
        return sid in self.open and sid not in self._remote_ended

    def reset(self, sid: int) -> None:
        """A stream reset below the library (its trailers refused): closed here, not charged."""
        self._answered(sid)
        self._close(sid)

    def forget(self) -> None:
        """The connection is gone: its streams no longer await a request."""
        self.peer.pending -= len(self.awaiting)
        self.release_held()
        self.awaiting.clear()

    def release_held(self) -> None:
        """The client knows its window, and its input up to then is read: its streams awaiting a
        request count again against its address's bound."""
        if self.held_back:
            self.held_back = False
            self.peer.held_back -= len(self.awaiting)

    def _await(self, sid: int) -> None:
        self.awaiting[sid] = self.clock()
        self.peer.pending += 1
        if self.held_back:
            self.peer.held_back += 1

    def _answered(self, sid: int) -> bool:
        """The stream no longer awaits its first request: whether it did."""
        if self.awaiting.pop(sid, None) is None:
            return False
        self.peer.pending -= 1
        if self.held_back:
            self.peer.held_back -= 1
        return True

    def charge_expired(self) -> Refusal | None:
        return self._wasted()

    def _wasted(self) -> Refusal | None:
        return None if self.peer.waste() else over_budget("streams without a request")

    def _end(self, sid: int, remote: bool) -> None:
        ended, other = (self._remote_ended, self._local_ended) if remote else (self._local_ended, self._remote_ended)
        if sid in other:
            self._close(sid)
        elif sid in self.open:
            ended.add(sid)

    def _close(self, sid: int) -> None:
        self.open.discard(sid)
        self._remote_ended.discard(sid)
        self._local_ended.discard(sid)


class MessageMeter:
    """gRPC messages of one connection's streams, from the 5-byte length prefixes in their DATA:
    a message over `max_size`, or one the partial-message budget cannot hold, is refused from its
    prefix, before its body arrives; the budget is held until the body is in (or the stream ends).
    Each message begun is stamped with the clock, so one drip-fed past a deadline can be found."""

    __slots__ = ("budget", "clock", "max_size", "peer", "streams")

    def __init__(
        self,
        max_size: int,
        budget: PartialBudget | None,
        peer: PeerBudgets | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_size = max_size
        self.budget = budget
        self.peer = peer
        self.clock = clock
        # stream -> [prefix bytes so far, body bytes left, budget held, when the message began (0: none begun)]
        self.streams: dict[int, list[Any]] = {}

    def data(self, sid: int, chunk: memoryview, end: bool) -> tuple[str, str] | None:
        """The stream's data as it arrives: (reason, why) to refuse it, or None."""
        state = self.streams.get(sid)
        if state is None:
            if end and not chunk:
                return None
            state = self.streams[sid] = [b"", 0, 0, 0.0]
        pos, size = 0, len(chunk)
        while pos < size:
            if state[1]:
                n = min(state[1], size - pos)
                state[1] -= n
                pos += n
                if not state[1]:
                    state[3] = 0.0
                    if state[2]:
                        self._give(state)
                continue
            if not state[0]:
                state[3] = self.clock()
            prefix = state[0] + bytes(chunk[pos : pos + 5 - len(state[0])])
            pos += len(prefix) - len(state[0])
            if len(prefix) < 5:
                state[0] = prefix
                break
            state[0] = b""
            length = int.from_bytes(prefix[1:5], "big")
            if length > self.max_size:
                self.close(sid)
                return "message_size", f"message of {length} bytes (limit {self.max_size})"
            if length > 0 and self.budget is not None:
                if not self.budget.take(length, self.peer):
                    self.close(sid)
                    return "partial_messages", "server busy receiving other messages, retry later"
                state[2] = length
            state[1] = length
            if not length:
                state[3] = 0.0
        if end:
            self.close(sid)
        return None

    def close(self, sid: int) -> None:
        """The stream is over: what its message held of the budget is given back."""
        state = self.streams.pop(sid, None)
        if state is not None and state[2]:
            self._give(state)

    def close_all(self) -> None:
        for sid in list(self.streams):
            self.close(sid)

    def overdue(self, timeout: float) -> list[int]:
        """The streams whose message begun more than `timeout` seconds ago is not in yet."""
        before = self.clock() - timeout
        return [sid for sid, state in self.streams.items() if 0.0 < state[3] < before]

    def _give(self, state: list[Any]) -> None:
        if self.budget is not None:
            self.budget.give(state[2], self.peer)
        state[2] = 0


def _protocol_error(what: str) -> Refusal:
    return Refusal(ErrorCodes.PROTOCOL_ERROR, "protocol_error", f"GOAWAY PROTOCOL_ERROR: {what}")


def over_budget(what: str) -> Refusal:
    """A connection ended for a budget its client spent (ENHANCE_YOUR_CALM, counted as `calm`)."""
    return Refusal(ErrorCodes.ENHANCE_YOUR_CALM, "calm", f"GOAWAY ENHANCE_YOUR_CALM: over its budget of {what}")
