"""Fair reading: what each connection's input costs the event loop is measured as it is spent and
charged to its client address, and input is handed on in slices of whole frames, so that one
connection's burst never holds the loop from everyone else. Sans-IO apart from the loop's
`call_soon`: no socket, no other library's internals; both HTTP/2 paths read through it.

Why: a read brings up to 256 KiB, and h2 (or the guard with grpclib) turns all of it into work in
one go: 150 KB of HEADERS opening streams held the loop half a second, and nothing over a budget
was ever sent (each stream valid). Envoy bounds the same thing with per-connection buffer limits
and a cap on requests processed per I/O cycle; we bound the work itself:

- a connection's input is cut into slices of at most SLICE_FRAMES whole frames (a frame's header
  is 9 bytes of struct, a frame is never split here: the layers below see what they always did);
- each slice's cost (seconds of the loop, measured around it) is charged to the client address
  as a decaying sum (COST_HALF_LIFE), the loop's "share" an address has taken lately;
- in one turn of the loop, input runs at once while the turn's budget (TURN_BUDGET) lasts and
  no poorer address waits; the rest is queued, its transport's reading paused (back-pressure: the
  kernel's buffers hold it, then the client's), and served on later turns, poorest address first;
- what connections hold unread is bounded server-wide (BUFFER_WATERMARK): past it, the connection
  holding the most is shed, never the newcomer.
A well-behaved client (an Envoy sending an ACK, a fresh connection's first request) costs little,
so it is served first however many heavier ones wait; a burst costs its sender its own time.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import struct
import time
from collections import deque
from collections.abc import Callable, Collection, Container, Iterator
from typing import Protocol

SLICE_FRAMES = 32  # whole frames handed on at once: ~1.5 ms of HEADERS through h2, the costliest kind
SLICE_BYTES = 64 * 1024  # and at most this much (a bigger frame goes alone)
# a connection whose last slice cost less a frame is given more frames next time, up to what that
# cost says fits in SLICE_SECONDS: a batch of a hundred ACKs (cheap DATA frames) is one slice, not
# four, each with its own pass through the layers below and its own flush
SLICE_SECONDS = 0.0015
SLICE_MAX_FRAMES = 512
SLICE_MAX_BYTES = 256 * 1024
TURN_BUDGET = 0.004  # seconds of reading per turn of the loop, before the rest waits for the next
COST_HALF_LIFE = 1.0  # seconds: how fast an address's charged cost is forgotten
# seconds per byte held, added to what an address has cost when choosing whom to serve: input is
# weighed before its work is done (HEADERS opening streams measured ~3 us a byte, an ACK's DATA far
# less), so of two addresses that cost nothing yet, the one with a frame waits less than the one
# with a burst
BYTE_ESTIMATE = 1e-7
# seconds charged for each stream handed to a handler, on top of the read it came in: the handler
# runs in a later turn, outside what the scheduler can time, and a burst of requests is mostly that
STREAM_ESTIMATE = 150e-6
BUFFER_WATERMARK = 128 * 1024 * 1024  # bytes held unread server-wide before the largest holder is shed
PREFACE = 24  # the client's connection preface, before its first frame
# seconds until a deadline is checked again while input received before it was due still waits in
# the queue here: a request (or a frame's rest) held by us is not late, whatever the clock says
HELD_RECHECK = 0.1

# frames of a connection's queued input looked at, at most, for the requests of its streams
# awaiting one (overload.py): a hundred 60 KB requests in 16 KiB frames, behind their HEADERS
SCAN_FRAMES = 512

_LENGTH = struct.Struct(">I")  # a frame header's 24-bit length, read with the byte before it
_HEADER = struct.Struct(">HBBBL")  # length (16 + 8 bits), type, flags, stream id (and its reserved bit)
_DECAY = math.log(2) / COST_HALF_LIFE


class FrameCutter:
    """Where to cut one connection's input so each slice holds at most `frames` whole frames.

    A frame still incomplete at the start of the input is handed on as far as it goes (the layers
    below buffer a partial frame, and refuse an oversize one from its header, as they always did):
    then the cutter follows it into the next input. A frame header itself incomplete waits (at
    most 8 bytes)."""

    __slots__ = ("count", "frames", "inside", "most")

    def __init__(self, preface: int = PREFACE) -> None:
        self.inside = preface  # bytes of a frame (or the preface) handed on in part, still to come
        self.frames = SLICE_FRAMES  # whole frames a slice may hold (see `measured`)
        self.most = SLICE_BYTES
        self.count = 0  # whole frames in the last slice cut

    def measured(self, seconds: float) -> None:
        """The last slice took `seconds`: the next may hold as many frames as that cost says fit in
        SLICE_SECONDS (never fewer than SLICE_FRAMES, never more than SLICE_MAX_FRAMES). It grows
        only from a full slice, and at most twice as big a slice: a connection's first cheap
        frames (its SETTINGS) do not buy a burst of HEADERS a slice of hundreds."""
        count = self.count
        if not count:
            return
        fit = int(SLICE_SECONDS * count / seconds) if seconds > 0 else SLICE_MAX_FRAMES
        if count < self.frames:
            fit = min(fit, self.frames)  # a partial slice says nothing of a bigger one
        self.frames = max(SLICE_FRAMES, min(SLICE_MAX_FRAMES, fit, 2 * self.frames))
        self.most = SLICE_BYTES if self.frames == SLICE_FRAMES else SLICE_MAX_BYTES

    def cut(self, buf: bytes | bytearray | memoryview, start: int) -> int:
        """The end of the next slice of `buf[start:]`: `start` when nothing can go yet."""
        end = len(buf)
        pos = start
        most = self.most
        self.count = 0
        if self.inside:
            step = min(self.inside, end - pos)
            self.inside -= step
            pos += step
            if self.inside or pos - start >= most:
                return pos
        limit = start + most
        frames = self.frames
        count = 0
        while count < frames and end - pos >= 9 and pos < limit:
            after = pos + 9 + (_LENGTH.unpack_from(buf, pos)[0] >> 8)
            if after > end:
                if count == 0 and pos == start:  # the first frame, incomplete: what there is of it
                    self.inside = after - end
                    return end
                break
            pos = after
            count += 1
        self.count = count
        return pos


class Reader(Protocol):
    """A connection, as the scheduler sees it: its reading paused and resumed, or shed."""

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def overloaded(self, why: str) -> None:
        """Close the connection: it holds the most unread input while the server holds too much."""


class TransportReading:
    """A protocol's side of the scheduler's pause and resume, on its own transport (a closing one is
    left alone)."""

    _transport: asyncio.Transport | None

    def pause_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()


class AddressCost:
    """An address's recent cost of the loop, in seconds, decaying with COST_HALF_LIFE."""

    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.at = 0.0

    def now(self, t: float) -> float:
        if self.value and t > self.at:
            self.value *= math.exp(-_DECAY * (t - self.at))
        self.at = t
        return self.value

    def charge(self, seconds: float, t: float) -> None:
        self.value = self.now(t) + seconds


PIN_RATIO = 8  # a held part of a read smaller than 1/PIN_RATIO of it is copied, not the read kept


class MeteredInput:
    """One connection's input: held, cut into slices of whole frames, each handed to `process`
    when the scheduler says so. `process` returns False once the connection is being closed.

    What is held is kept as it came, the transport's own (immutable) reads, never copied into a
    buffer of ours: each slice is a view of one read. Only a frame header split across two reads
    is joined, with the rest of the read after it; a frame split across reads is handed on in two
    parts (as when its second part has not come yet), which the layers below join."""

    __slots__ = (
        "_arrivals",
        "_chunks",
        "_held",
        "_in",
        "_out",
        "_pos",
        "cost",
        "cutter",
        "dead",
        "process",
        "queued",
        "reader",
        "received",
        "scheduler",
        "waiting",
    )

    def __init__(
        self,
        scheduler: ReadScheduler,
        cost: AddressCost,
        reader: Reader,
        process: Callable[[bytes | memoryview], bool],
    ) -> None:
        self.scheduler = scheduler
        self.cost = cost
        self.reader = reader
        self.process = process
        self.cutter = FrameCutter()
        self._chunks: list[memoryview] = []  # reads held, oldest first (views of immutable bytes)
        self._pos = 0  # in the first of them: what is before was handed on
        self._held = 0
        self.queued = False  # in the scheduler's queue (its reading paused)
        self.waiting = False  # reading paused by the scheduler
        self.dead = False
        # when what is held arrived: (bytes ever held once this input was in, clock), oldest first
        # (None while nothing is held: a deque is 760 bytes, and most connections hold nothing)
        self._arrivals: deque[tuple[int, float]] | None = None
        self._in = 0  # bytes ever held
        self.received = 0  # bytes ever fed
        self._out = 0  # of those, bytes handed on

    @property
    def held(self) -> int:
        """Bytes received, not yet handed on."""
        return self._held

    def feed(self, data: bytes) -> None:
        """New input from the transport: what may run now runs, the rest is held (and queued)."""
        if self.dead:
            return
        self.received += len(data)
        scheduler = self.scheduler
        arrived = scheduler.clock()
        rest: bytes | memoryview = data
        if not self.held and not self.queued and scheduler.may_run(self, len(data)):
            end = self.cutter.cut(data, 0)
            if end == len(data):  # the common case: all of it, at once, no copy
                scheduler.run(self, data)
                return
            if end:
                view = memoryview(data)  # the slice and the rest, not copies of them
                scheduler.run(self, view[:end])
                if self.dead:
                    return
                rest = view[end:]
        self._keep(rest)
        scheduler.held += len(rest)
        self._in += len(rest)
        if self._arrivals is None:
            self._arrivals = deque()
        self._arrivals.append((self._in, arrived))
        if not self.queued:
            while self._runnable() and scheduler.may_run(self):
                before = self.held
                self.step()
                if self.dead or self.held == before:
                    return
            if self._runnable():
                scheduler.enqueue(self)
        scheduler.check_watermark()

    def _keep(self, data: bytes | memoryview) -> None:
        """Hold `data` after what is held: the read itself (or a view of it), not a copy, unless it
        is a small part of its read (what is held keeps at most PIN_RATIO times its size alive)."""
        view = data if isinstance(data, memoryview) else memoryview(data)
        if len(view) * PIN_RATIO < len(view.obj):  # type: ignore[arg-type]  # a read: bytes
            view = memoryview(bytes(view))
        self._chunks.append(view)
        self._held += len(view)

    def _runnable(self) -> bool:
        """Whether what is held can be handed on (a frame header's worth, or a frame's remainder)."""
        held = self.held
        return held >= 9 or bool(held and self.cutter.inside)

    def step(self) -> bool:
        """Hand on the next slice (measured and charged); True if more could run now."""
        chunks = self._chunks
        if not chunks:
            return False
        while True:
            first, start = chunks[0], self._pos
            end = self.cutter.cut(first, start)
            if end > start:
                break
            if len(chunks) < 2:  # a frame header begun: the rest of it is still to come
                return False
            # a frame header begun at the end of this read: that frame joined (its header and as
            # much of its payload as the next read holds), the next read's rest left as it is
            tail, after = first[start:], chunks[1]
            self._pos = 0
            need = 9 - len(tail)
            if len(after) < need:  # a read shorter than the header's rest
                chunks[1] = memoryview(b"".join((tail, after)))
                del chunks[0]
                continue
            header = b"".join((tail, after[:need]))
            taken = min(len(after), need + (_LENGTH.unpack_from(header)[0] >> 8))
            chunks[0] = memoryview(b"".join((tail, after[:taken])))
            if taken < len(after):
                chunks[1] = after[taken:]
            else:
                del chunks[1]
        # a view of the read, not a copy (60 KB of an Envoy's first request): what the layers
        # below keep of it they copy
        chunk = first[start:end]
        if end == len(first):
            del chunks[0]
            self._pos = 0
        elif len(chunks) == 1 and len(first) - end < 9:  # a frame header begun, waiting on the
            chunks[0] = memoryview(bytes(first[end:]))  # client: its bytes, not its whole read
            self._pos = 0
        else:
            self._pos = end
        size = end - start
        self._held -= size
        self.scheduler.held -= size
        self._out += size
        arrivals = self._arrivals
        if arrivals is not None:
            while arrivals and arrivals[0][0] <= self._out:
                arrivals.popleft()
            if not arrivals:
                self._arrivals = None
        self.scheduler.run(self, chunk)
        return not self.dead and self._runnable()

    def waited(self) -> float:
        """Seconds the oldest input waiting in the scheduler's queue has been here (0.0 if none
        waits: a frame header begun and left, fewer than its nine bytes, waits on the client)."""
        if not self.queued or self._arrivals is None:
            return 0.0
        return self.scheduler.clock() - self._arrivals[0][1]

    def requests_behind(self, streams: Collection[int]) -> bool:
        """Whether requests of some of `streams` wait in the scheduler's queue: then the rest of
        theirs may wait behind them, past the frames looked at or in the kernel's buffer while this
        connection's reading is paused, on us and not on the client. A flood of HEADERS queues
        HEADERS, no request: never behind. One that mixes in DATA frames is taken for behind: its
        streams then count against the held-back watermark (overload.py), still bounded per address."""
        return self.requests_for(streams, 1) > 0  # the first found will do

    def requests_for(self, streams: Container[int], count: int, most: int = SCAN_FRAMES) -> int:
        """How many of `streams` (`count` of them) have DATA waiting in the scheduler's queue, in
        its first `most` frames: their requests are received, and wait on us (0 if nothing is
        queued). A flood of HEADERS queues HEADERS, not requests: its streams are found in none."""
        if not self.queued or not count:
            return 0
        frames = self._frames_held()
        found: set[int] = set()
        for _ in range(most):
            header = next(frames, None)
            if header is None:
                break
            _, _, ftype, _, sid = _HEADER.unpack(header)
            if ftype == 0 and sid in streams:  # DATA (a reserved bit set matches no stream)
                found.add(sid)
                if len(found) == count:
                    break
        return len(found)

    def _frames_held(self) -> Iterator[bytes | memoryview]:
        """The header of each whole frame header held, in order, across the reads held (a frame's
        rest first: its header was read already)."""
        skip = self._pos + self.cutter.inside
        carry = b""  # a header begun at the end of one read
        for chunk in self._chunks:
            pos, end = skip, len(chunk)
            if carry:
                need = 9 - len(carry)
                if end < need:
                    carry += bytes(chunk)
                    skip = 0
                    continue
                header = carry + bytes(chunk[:need])
                carry = b""
                yield header
                pos = need + (_LENGTH.unpack_from(header)[0] >> 8)
            while end - pos >= 9:
                yield chunk[pos : pos + 9]
                pos += 9 + (_LENGTH.unpack_from(chunk, pos)[0] >> 8)
            if pos < end:
                carry = bytes(chunk[pos:])
                skip = 0
            else:
                skip = pos - end  # into the reads after this one
        return

    def charge(self, seconds: float) -> None:
        """Work this input caused that runs later (a stream's handler): charged now, to the turn
        and to the address, so that what follows it waits its turn."""
        self.scheduler.spent += seconds
        self.cost.charge(seconds, self.scheduler.clock())

    def close(self) -> None:
        """The connection is closing: nothing more is handed on, and what is held is let go."""
        if not self.dead:
            self.dead = True
            self.scheduler.held -= self.held
            self._chunks.clear()
            self._held = self._pos = 0
            self._arrivals = None


class Deferral:
    """A deadline check put off while input that arrived before the check was first due still
    waits in the scheduler's queue: that input may hold what the deadline waits for (a stream's
    request, a frame's rest), and its wait is ours. Input that arrived later, or input that waits
    for the client (a frame header begun and left), puts nothing off, so a client that keeps its
    connection queued (a flood) only delays a check by as long as the queue takes to reach what it
    had sent by then."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None  # loop time the check was first put off

    def holds(self, metered: MeteredInput | None, now: float) -> bool:
        """Whether the check due at `now` (loop time) waits again, for HELD_RECHECK."""
        waited = metered.waited() if metered is not None else 0.0
        if not waited:
            self.since = None
            return False
        if self.since is None:
            self.since = now
        if waited > now - self.since:
            return True
        self.since = None
        return False


class ReadScheduler:
    """One server's reading, shared by all its connections (see the module's docstring)."""

    def __init__(
        self,
        turn_budget: float = TURN_BUDGET,
        watermark: int = BUFFER_WATERMARK,
        clock: Callable[[], float] = time.perf_counter,
        call_soon: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self.turn_budget = turn_budget
        self.watermark = watermark
        self.clock = clock
        self.call_soon = call_soon  # how a turn of the loop is asked for (None: the running loop's call_soon)
        self.spent = 0.0  # seconds of reading in this turn of the loop
        self.held = 0  # bytes received and not yet handed on, every connection's
        self._queue: list[tuple[float, int, MeteredInput]] = []
        self._seq = 0
        self._tick_due = False
        # what it did: slices run, inputs queued (their reading paused), connections shed
        self.slices = 0
        self.deferred = 0
        self.shed = 0

    def weight(self, metered: MeteredInput, coming: int = 0) -> float:
        """What serving it costs, as far as can be told before: its address's recent cost, and
        what it holds (and `coming`) at BYTE_ESTIMATE."""
        return metered.cost.now(self.clock()) + (metered.held + coming) * BYTE_ESTIMATE

    def may_run(self, metered: MeteredInput, coming: int = 0) -> bool:
        """Whether input may run now: while the turn's budget lasts and no lighter input waits."""
        if self.spent >= self.turn_budget:
            return False
        queue = self._queue
        return not queue or self.weight(metered, coming) <= queue[0][0]

    def run(self, metered: MeteredInput, chunk: bytes | memoryview) -> None:
        """Hand `chunk` on, and charge what it took."""
        clock = self.clock
        before = self.spent
        t0 = clock()
        try:
            if not metered.process(chunk):
                metered.close()
        finally:
            t1 = clock()
            self.spent += t1 - t0
            metered.cost.charge(t1 - t0, t1)
            metered.cutter.measured(self.spent - before)  # with what it was charged for later work
            self.slices += 1
            self._turn()

    def enqueue(self, metered: MeteredInput) -> None:
        """Held input that could run but may not yet: its reading paused until it has been served."""
        if metered.queued:
            return
        metered.queued = True
        if not metered.waiting:
            metered.waiting = True
            metered.reader.pause_reading()
        self.deferred += 1
        self._seq += 1
        heapq.heappush(self._queue, (self.weight(metered), self._seq, metered))
        self._turn()

    def _turn(self) -> None:
        if not self._tick_due:
            self._tick_due = True
            call_soon = self.call_soon or asyncio.get_running_loop().call_soon
            call_soon(self._tick)

    def _tick(self) -> None:
        """A new turn of the loop: serve what waits, poorest address first, within the budget."""
        self._tick_due = False
        self.spent = 0.0
        queue = self._queue
        while queue and self.spent < self.turn_budget:
            _, _, metered = heapq.heappop(queue)
            metered.queued = False
            more = not metered.dead and metered.step()
            if more:
                self._seq += 1
                metered.queued = True
                heapq.heappush(queue, (self.weight(metered), self._seq, metered))
            else:
                self._release(metered)
        if queue:
            self._turn()

    def _release(self, metered: MeteredInput) -> None:
        if metered.waiting:
            metered.waiting = False
            if not metered.dead:
                metered.reader.resume_reading()

    def check_watermark(self) -> None:
        """Past the watermark of bytes held unread, the connections holding the most are shed."""
        while self.held > self.watermark and self._queue:
            heaviest = max(self._queue, key=lambda item: item[2].held)[2]
            held = heaviest.held
            self.shed += 1
            heaviest.close()
            heaviest.reader.overloaded(f"holds {held} bytes unread, the most while {self.held + held} are held")
            self._queue = [item for item in self._queue if item[2] is not heaviest]
            heapq.heapify(self._queue)
