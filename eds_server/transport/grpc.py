"""The gRPC face of the server: the EDS service (one session per stream, driving the sans-IO SotW
or delta state machine), gRPC health, and the server's assembly with keepalive pings far sooner
than grpclib's two hours, so half-open Envoy connections are noticed. Each stream is driven
through the StreamIO of the h2 package, the only code that knows HTTP/2 and grpclib's insides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from ssl import SSLContext
from typing import Any

import grpclib.const
import grpclib.server
from grpclib import GRPCError
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status

from ..encoded import Resource
from ..events import Wake
from ..heap import HeapTrim
from ..observe import Counters, Observers, StreamLog, StreamObserver, StreamView, names_shown
from ..pb.grpc.health.v1 import HealthBase, HealthCheckRequest, HealthCheckResponse
from ..pb.grpc.health.v1 import HealthCheckResponseServingStatus as Serving
from ..xds import wire
from ..xds.common import (
    WILDCARD,
    Nonces,
    ProtocolError,
    Resources,
    SubscriptionLimits,
    check_request,
    response_version,
)
from ..xds.session import DELTA, SOTW, Authorize, SessionDriver, StreamKind, decode_request, node_fields, shown
from .h2 import ConnectionLimits, Framed, GrpcServer, StreamIO, build_server
from .h2.limits import ThrottledLog
from .h2.stock import StockIO
from .reflection import ReflectionService
from .stream_table import AddressTable, StreamRegistry
from .unknown import UnknownMethods

log = logging.getLogger("eds_server.grpc")
_refusal_log = ThrottledLog()  # a client that keeps hitting the stream limits cannot fill the log

EDS_SERVICE = "envoy.service.endpoint.v3.EndpointDiscoveryService"
SERVED = (
    EDS_SERVICE,
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
)


@dataclass
class EdsService:
    """envoy.service.endpoint.v3.EndpointDiscoveryService over the store, seen through `Resources`."""

    store: Resources
    limits: SubscriptionLimits = field(default_factory=SubscriptionLimits)
    send_timeout: float = 30.0
    max_streams: int = 100_000  # open streams in total, across connections (health and reflection too)
    open_io: Callable[[grpclib.server.Stream[Any, Any]], StreamIO] = StockIO  # set by make_server
    counters: Counters = field(default_factory=Counters)
    stream_log: StreamLog = field(default_factory=StreamLog)
    observers: Observers = field(default_factory=Observers)  # told of every stream event: add() more
    sessions: StreamRegistry[StreamSession] = field(default_factory=StreamRegistry)  # the open xDS streams
    addresses: AddressTable = field(default_factory=AddressTable)  # open streams of each client IP
    authorize: Authorize | None = None  # None: every client may read every name
    stopping: bool = False  # stop() was called: no more streams, and no more changes sent
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    nonces: Nonces = field(default_factory=Nonces)  # shared by every stream: see Nonces
    heap: HeapTrim = field(default_factory=HeapTrim)  # the first requests' Nodes leave free heap behind
    responses: wire.Responses = field(default_factory=wire.Responses)  # the App's (encode.Encoders)
    _framed: tuple[StreamKind, str, str, tuple[Resource, ...], Framed] | None = None  # the last response encoded

    def framed(self, kind: StreamKind, response: Any) -> Framed:
        """The response encoded and framed, once for all the streams a change sends the same to
        (same resources, version and nonce: see Nonces)."""
        version, nonce, resources = kind.version(response), response.nonce, response.resources
        last = self._framed
        if last is not None and last[0] is kind and last[1] == version and last[2] == nonce:
            held = last[3]
            if len(held) == len(resources) and (
                held[0] is resources[0] if len(held) == 1 else all(a is b for a, b in zip(held, resources, strict=True))
            ):
                return last[4]
        framed = Framed(kind.encode(response, self.responses))
        self._framed = (kind, version, nonce, resources, framed)
        return framed

    def __post_init__(self) -> None:
        self.observers.observers[:0] = [self.counters, self.stream_log, _HeapTrimOnChurn(self)]
        if self.heap.live is None:
            self.heap.live = lambda: len(self.sessions)
        self._unwatch = self.store.watch(self._on_store_change)
        if self.store.ready:
            self._ready.set()

    def _on_store_change(self, names: frozenset[str] | None) -> None:
        if self.store.ready:
            self._ready.set()

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        prefix = f"/{EDS_SERVICE}/"
        return {
            prefix + "StreamEndpoints": grpclib.const.Handler(
                self.stream_endpoints, Cardinality.STREAM_STREAM, bytes, bytes
            ),
            prefix + "FetchEndpoints": grpclib.const.Handler(
                self.fetch_endpoints, Cardinality.UNARY_UNARY, bytes, bytes
            ),
            prefix + "DeltaEndpoints": grpclib.const.Handler(
                self.delta_endpoints, Cardinality.STREAM_STREAM, bytes, bytes
            ),
        }

    def stop(self, end_streams: bool = True) -> None:
        """Take no more changes, and end every open stream cleanly (status OK; Envoy keeps its
        endpoints and reconnects), or leave that to `end_streams_by`."""
        self.stopping = True
        self.heap.stop()
        self._unwatch()
        if end_streams:
            for session in self.sessions:
                session.end()

    async def end_streams_by(self, deadline: float, batch: int = 256, patience: float = 0.25) -> None:
        """End open streams cleanly, `batch` at a time, until `deadline` (the loop's clock). Thousands
        woken at once would each take their turn before anything checked the time, holding the loop
        a second or more past any deadline; a batch that ends slowly (a client that does not read)
        holds the next one `patience` seconds at most. Streams left are cut as their connections close."""
        loop = asyncio.get_running_loop()
        waiting = list(self.sessions)
        for i in range(0, len(waiting), batch):
            now = loop.time()
            if now >= deadline:
                return
            woken = waiting[i : i + batch]
            for session in woken:
                session.end()
            until = min(deadline, now + patience)
            while loop.time() < until and any(s in self.sessions for s in woken):
                await asyncio.sleep(0.005)
        while self.sessions and loop.time() < deadline:
            await asyncio.sleep(0.005)

    async def shed(
        self, streams: int, one_under: int, goaway: Callable[[set[str], str], int], timeout: float = 5.0
    ) -> dict[str, int]:
        """Ask whole connections to reconnect elsewhere (--workers: load back to a restarted worker):
        the smallest first while their streams add up to at most `streams`, or else the smallest one
        if it has fewer than `one_under`. Their streams end cleanly (status OK: Envoy keeps its
        endpoints and reopens them), then the connection gets GOAWAY, so the streams come back on a
        new connection."""
        by_peer = self.sessions.by_peer()
        chosen: list[str] = []
        total = 0
        for peer, sessions in sorted(by_peer.items(), key=lambda item: len(item[1])):
            if total + len(sessions) > streams:
                break
            chosen.append(peer)
            total += len(sessions)
        if not chosen and by_peer:
            peer, sessions = min(by_peer.items(), key=lambda item: len(item[1]))
            if len(sessions) < one_under:
                chosen, total = [peer], len(sessions)
        leaving = [s for peer in chosen for s in by_peer[peer]]
        for session in leaving:
            session.end()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(s in self.sessions for s in leaving) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        sent = goaway(set(chosen), "reconnect: moving load to another worker")
        log.info("asked %d connections (%d streams) to reconnect elsewhere", sent, total)
        return {"connections": sent, "streams": total}

    @property
    def open_streams(self) -> int:
        return len(self.sessions)

    def _room(self, ip: str) -> bool:
        """Whether one more stream of any service from `ip` fits (if not, counted as refused): the
        total limit, and half of it per client IP, so one client cannot take every stream while
        another has none."""
        total = len(self.sessions) + self.addresses.others_total
        held = self.addresses.held(ip)
        if total >= self.max_streams or 2 * held >= self.max_streams:
            self._refused(ip, f"{total} streams open, {held} of them from {ip}")
            return False
        return True

    def _refused(self, ip: str, why: str) -> None:
        self.counters.refused += 1
        _refusal_log.warning(
            "refusing a stream from %s (RESOURCE_EXHAUSTED): %s (--max-streams %d)", ip, why, self.max_streams
        )

    def _full(self) -> GRPCError:
        return GRPCError(Status.RESOURCE_EXHAUSTED, f"server holds its limit of {self.max_streams} streams")

    def enter_stream(self, stream: grpclib.server.Stream[Any, Any]) -> bool:
        """Count one more open health, reflection or fetch stream; False at the limits, which for
        these services include a hundredth of --max-streams per client IP (a health Watch costs a
        task, and nothing legitimate holds thousands from one address)."""
        ip = _ip(stream)
        others = self.addresses.others(ip)
        if 100 * others >= self.max_streams:
            self._refused(ip, f"{others} health, reflection and fetch streams from it")
            return False
        if not self._room(ip):
            return False
        self.addresses.add(ip, 1, other=True)
        return True

    def leave_stream(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        self.addresses.add(_ip(stream), -1, other=True)

    def describe_streams(self, after: int = 0, limit: int = 100) -> dict[str, Any]:
        """One page of /v1/streams (see StreamRegistry.describe)."""
        return self.sessions.describe(after, limit)

    # Plain functions handing grpclib `_serve`'s coroutine: a coroutine less for every stream to
    # hold, and to pass through each time its task wakes.
    def stream_endpoints(self, stream: grpclib.server.Stream[bytes, bytes]) -> Coroutine[Any, Any, None]:
        return self._serve(stream, SOTW)

    def delta_endpoints(self, stream: grpclib.server.Stream[bytes, bytes]) -> Coroutine[Any, Any, None]:
        return self._serve(stream, DELTA)

    async def _serve(self, stream: grpclib.server.Stream[bytes, bytes], kind: StreamKind) -> None:
        io = self.open_io(stream)
        async with io.status_in_trailers():
            if self.stopping:
                raise GRPCError(Status.UNAVAILABLE, "server is shutting down")
            session = StreamSession(self, stream, io, kind)
            ip = _ip(stream)
            if not self._room(ip):
                io.refused()
                raise self._full()
            self.sessions.add(session)
            self.addresses.add(ip, 1)
            self.observers.started(session)
            try:
                await session.run()
            finally:
                self.sessions.discard(session)
                self.addresses.add(ip, -1)
                self.store.unfollow(session.on_change)
                self.observers.closed(session)

    async def fetch_endpoints(self, stream: grpclib.server.Stream[bytes, bytes]) -> None:
        io = self.open_io(stream)
        if not self.enter_stream(stream):
            io.refused()
            raise self._full()
        try:
            async with io.status_in_trailers():
                await self._fetch(stream, io)
        finally:
            self.leave_stream(stream)

    async def _fetch(self, stream: grpclib.server.Stream[bytes, bytes], io: StreamIO) -> None:
        data = await io.read(first=True)
        if data is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "no request message")
        try:
            req, node = decode_request(wire.sotw_request, data, self.limits)
            check_request(req.type_url, req.resource_names, self.limits)
            fields = node_fields(node)
        except ProtocolError as e:
            raise GRPCError(Status[e.status], e.message) from None
        if self.authorize is not None:
            access = self.authorize(stream.peer.cert(), *fields)
            refused = [n for n in dict.fromkeys(req.resource_names) if not access(n)]
            if refused:
                self.observers.access_denied(None, refused, str(access))
                node_id, cluster = shown(*fields)
                log.warning(
                    "PERMISSION_DENIED fetch: node=%s cluster=%s peer=%s (%s) may not read %s",
                    node_id,
                    cluster,
                    _peer(stream),
                    access,
                    names_shown(refused),
                )
                raise GRPCError(Status.PERMISSION_DENIED, f"not allowed to read {names_shown(refused)}")
        await self._ready.wait()
        names = [n for n in dict.fromkeys(req.resource_names) if n != WILDCARD]
        if missing := self.store.unanswered(names):  # a relay: only names its streams follow are held
            raise GRPCError(Status.UNAVAILABLE, f"not received from the upstream eds-server: {names_shown(missing)}")
        resources = [self.store.get(n) for n in names]
        version = response_version(resources) if resources else ""
        await stream.send_message(self.responses.discovery_response(version, resources, ""))


class SendState(enum.Enum):
    """Who sends a stream's next response. A response comes due when a change arrives (the store's
    callback) or a request is read (the reader); it goes out from there, queued for the connection's
    next write, only while the stream is IDLE and the connection takes it at once (the fan-out's
    path: no task woken per stream, one write per connection per change). Otherwise the stream's
    own task sends it, waiting on flow control as long as the send timeout allows.

    Every move is one of SEND_MOVES, looked up there (`StreamSession._move`); anything else raises
    SendStateError. CLOSED is final.
    """

    IDLE = "idle"  # the task waits; what comes due is queued directly if the connection takes it
    SENDING = "sending"  # the task sends (or is woken to): what comes due waits for it
    CLOSED = "closed"  # ending: nothing more is sent

    __hash__ = object.__hash__  # singletons: hashed by identity, in C


class SendStep(enum.Enum):
    """What moves a stream's sending from one state to another."""

    HAND_OVER = "a response due that cannot be queued at once, or the reader ended: the task is woken"
    WAIT = "the task sent what was due and waits"
    WAKE = "the task woke to send"
    END = "the server stops, the connection is asked to move, the reader failed or the call ended"

    __hash__ = object.__hash__


_IDLE, _SENDING, _CLOSED = SendState.IDLE, SendState.SENDING, SendState.CLOSED  # read once per stream per change

# (state, step) -> the state after it; anything else is a bug (SendStateError). A response that
# comes due while IDLE and is queued at once moves nothing (the fan-out's path, no lookup at all).
SEND_TRANSITIONS: dict[tuple[SendState, SendStep], SendState] = {
    (_IDLE, SendStep.HAND_OVER): _SENDING,
    (_SENDING, SendStep.HAND_OVER): _SENDING,  # the task is at work, or already woken
    (_CLOSED, SendStep.HAND_OVER): _CLOSED,  # the reader ended after the call did
    (_SENDING, SendStep.WAIT): _IDLE,
    (_SENDING, SendStep.WAKE): _SENDING,  # whoever woke the task set SENDING first
    (_IDLE, SendStep.END): _CLOSED,
    (_SENDING, SendStep.END): _CLOSED,
    (_CLOSED, SendStep.END): _CLOSED,
}
SEND_MOVES: dict[SendStep, dict[SendState, SendState]] = {step: {} for step in SendStep}
for (_before, _step), _after in SEND_TRANSITIONS.items():
    SEND_MOVES[_step][_before] = _after


class SendStateError(RuntimeError):
    """A move SEND_TRANSITIONS does not list: the send path broke its own rules."""


def send_move(state: SendState, step: SendStep, node: str = "") -> SendState:
    """The state after `step`, as SEND_TRANSITIONS says; SendStateError if it says nothing."""
    after = SEND_MOVES[step].get(state)
    if after is None:
        raise SendStateError(f"stream of node={node}: {step.name} is no move from {state.name}")
    return after


class StreamSession(SessionDriver):
    """One stream call: the session driver (xds/session.py) with its IO. A reader task feeds it
    requests; responses leave by one path, `send_due`, from whichever side made them due: see
    SendState."""

    def __init__(self, service: EdsService, stream: grpclib.server.Stream[Any, bytes], io: StreamIO, kind: StreamKind):
        super().__init__(
            kind,
            service.store,
            service.limits,
            service.nonces,
            service.observers,
            _peer(stream),
            stream.peer.cert if service.authorize is not None else _no_cert,  # not a bound method a stream
            service.authorize,
        )
        self.service = service
        self.stream = stream
        self.io = io
        self.state = _SENDING  # until run() starts: what comes due is left to it
        self._wake = Wake()  # the task has work: a response, the reader's end, CLOSED
        # what reads the client's requests: a task while they go through grpclib, the direct
        # reader's future while they are read from their DATA frames (no task waits on it)
        self._reader: asyncio.Future[None] | None = None
        self._handed: tuple[Framed, Iterable[Resource]] | None = None  # taken from the machine, not queued

    def on_change(self, names: frozenset[str] | None) -> None:
        if self.sm.changed_due(names):  # the machine marks the names and says if a poll may answer
            self.send_due()

    def _move(self, step: SendStep) -> None:
        self.state = send_move(self.state, step, self.node)

    def end(self) -> None:
        """End the call cleanly (status OK: Envoy keeps its endpoints and reconnects) at the task's
        next turn, after a send under way."""
        self._move(SendStep.END)
        self._wake.set()

    def send_due(self) -> None:
        """Send the response due, if any: queued right here when the stream is IDLE and the
        connection takes it now, else handed to the task (see SendState)."""
        state = self.state
        if state is _IDLE:
            if self.service.stopping:
                self.end()  # it takes no more changes: as on shutdown
                return
            reader: asyncio.Future[None] | None = self._reader
            if self.io.ready() and reader is not None and not reader.done():
                response = self.sm.poll()
                if response is None:
                    return
                data = self.service.framed(self.kind, response)
                try:
                    if self.io.queue(data):
                        self.service.observers.responded(self, response.resources)
                        return
                except Exception as e:  # e.g. the stream was reset a moment ago: the task finds out properly
                    log.debug("direct send to node=%s handed to its task: %r", self.node, e)
                self._handed = (data, response.resources)
            self._move(SendStep.HAND_OVER)
            self._wake.set()
        elif state is _SENDING:
            self._wake.set()

    async def read(self, first: bool = True) -> None:
        io = self.io
        while True:
            data = await io.read(first=first)
            if data is None:
                return  # the client ended its side
            self.on_message(data, first)
            del data  # not kept while idle: a request may carry a 60 KB Node
            first = False
            # Further requests are read straight from their DATA frames, as they arrive, until the
            # stream needs grpclib again (its end, a reset): this task ends, and the direct reader's
            # future stands for it (a task, its coroutines and its context less a stream).
            direct = io.read_direct(self)
            if direct is not None:
                self._reader = direct
                return

    def _start_reading(self) -> None:
        """Read the first request here if it is here already (an Envoy's comes with the stream's
        HEADERS), and read on directly: then no reader task is ever made, and its first response
        is this task's to send. Else a reader task reads it (and what follows) as it comes."""
        data = self.io.first_request()
        if data is None:
            self._read_in_task(first=True)
            return
        direct = self.io.read_direct(self)
        if direct is None:
            self._read_in_task(first=False)
        else:
            self._reader = direct
        try:
            self.on_message(data, True)
        except ProtocolError as e:  # as a reader task's failure ends the call (_ended)
            raise GRPCError(Status[e.status], e.message) from None

    def _read_in_task(self, first: bool) -> None:
        reader = self._reader = asyncio.create_task(self.read(first=first))
        reader.add_done_callback(self._reader_done)

    def direct_ended(self, direct: asyncio.Future[None]) -> None:
        """The direct reader ended: failed (the task finds out), or the stream needs grpclib again,
        read on by a new reader task."""
        if direct is not self._reader or direct.cancelled():
            return  # the call is over
        if direct.exception() is None:
            self._read_in_task(first=False)
            return
        self._reader_done(direct)

    def on_message(self, data: bytes | memoryview, first: bool = False) -> None:
        self.receive(data, first)
        # An ACK with nothing new to send wakes no one (one task switch per stream per change saved)
        if self.sm.wants_poll:
            self.send_due()

    async def run(self) -> None:
        """The stream's task: sends what it is handed, until CLOSED or the reader ends."""
        wake = self._wake
        try:
            self._start_reading()
            while True:
                if self.state is _CLOSED:
                    return
                if not wake.is_set():  # else work came due while this task was at work: on at once
                    self._move(SendStep.WAIT)
                    await wake.waiter()
                wake.clear()
                if self.state is _CLOSED or self.service.stopping:
                    return
                self._move(SendStep.WAKE)
                ended, failure = _ended(self._reader)  # the task, or the direct reader's future
                if failure is not None:
                    raise failure
                if self._handed is not None:
                    handed, self._handed = self._handed, None
                    await self._send(*handed)
                response = self.sm.poll()
                if response is not None:
                    await self._send(self.service.framed(self.kind, response), response.resources)
                if ended:
                    return  # the client ended its side (after the answer already due, if any)
        finally:
            self._move(SendStep.END)
            reader: asyncio.Future[None] | None = self._reader
            if reader is not None:
                reader.cancel()
                if reader.done() and not reader.cancelled():
                    reader.exception()  # retrieved: raised above, or moot once the call ends
            # A failed or cancelled reader keeps its error, whose traceback holds the frames that
            # hold this session (and, raised here, this frame too): no reference back to the task,
            # so the stream's objects go as the call ends, not at the collector's next full pass.
            self._reader = self._handed = None
            reader = failure = None

    def _reader_done(self, reader: asyncio.Future[None]) -> None:
        """The reader ended (the client's side closed, or it failed): the task finds out which. A
        reader task that handed the stream to the direct reader ended too: nothing to tell."""
        if reader is not self._reader:
            return
        self._move(SendStep.HAND_OVER)
        self._wake.set()

    async def _send(self, data: Framed, resources: Iterable[Resource]) -> None:
        try:
            if not (self.io.ready() and self.io.queue(data)):  # no timer for a send that cannot block
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
                # arrives as the send completes, leaving this stream's tasks behind.
                async with asyncio.timeout(self.service.send_timeout):
                    await self.io.send(data)
        except TimeoutError:
            self.service.observers.stopped_reading(self)
            raise GRPCError(Status.UNAVAILABLE, "send timed out") from None
        self.service.observers.responded(self, resources)


def _no_cert() -> None:
    """Not asked for: the client's certificate is read only to authorize it."""


def _ended(reader: asyncio.Future[None] | None) -> tuple[bool, BaseException | None]:
    """Whether the reader has ended, and what it failed with, as the call should end."""
    if reader is None or not reader.done():
        return False, None
    exc = reader.exception()
    if isinstance(exc, ProtocolError):
        return True, GRPCError(Status[exc.status], exc.message)
    return True, exc


class _HeapTrimOnChurn(StreamObserver):
    """The first requests' Nodes (60 KB each from Envoy), and streams as they end, leave free heap
    behind: trim it after a burst."""

    def __init__(self, service: EdsService) -> None:
        self.service = service

    def opened(self, s: StreamView) -> None:
        self.service.heap.churn()

    def closed(self, s: StreamView) -> None:
        self.service.heap.churn(live=len(self.service.sessions))


class HealthService(HealthBase):
    """grpc.health.v1: SERVING once every source has delivered its first state.

    Watch streams wait on readiness changing, not on every store change: a thousand of them cost
    nothing while groups change (each used to wake on every change of any group)."""

    def __init__(self, store: Resources) -> None:
        self.store = store
        self._flipped: asyncio.Event | None = None  # set (and replaced) when readiness changes
        self._was_ready = store.ready

    def _readiness_changed(self) -> asyncio.Event:
        if self._flipped is None:
            self._flipped = asyncio.Event()
            self.store.watch(self._on_store_change)
        return self._flipped

    def _on_store_change(self, names: frozenset[str] | None) -> None:
        if self.store.ready != self._was_ready and self._flipped is not None:
            self._was_ready = self.store.ready
            flipped, self._flipped = self._flipped, asyncio.Event()
            flipped.set()

    def _status(self, service: str) -> HealthCheckResponse:
        if service not in ("", EDS_SERVICE):
            raise GRPCError(Status.NOT_FOUND, f"unknown service {service!r}")
        return HealthCheckResponse(status=Serving.SERVING if self.store.ready else Serving.NOT_SERVING)

    async def check(self, message: HealthCheckRequest) -> HealthCheckResponse:
        return self._status(message.service)

    async def watch(self, message: HealthCheckRequest) -> AsyncIterator[HealthCheckResponse]:
        last = None
        while True:
            flipped = self._readiness_changed()
            current = self._status(message.service)
            if current != last:
                yield current
                last = current
            await flipped.wait()


def _ip(stream: grpclib.server.Stream[Any, Any]) -> str:
    addr = stream.peer.addr()
    return str(addr[0]) if addr else "?"


def _peer(stream: grpclib.server.Stream[Any, Any]) -> str:
    addr = stream.peer.addr()
    return f"{addr[0]}:{addr[1]}" if addr else "?"


def make_server(
    service: EdsService,
    *,
    max_streams_per_connection: int,
    keepalive_time: float,
    keepalive_timeout: float,
    max_message_size: int,
    reset_budget: int = 10_000,
    limits: ConnectionLimits | None = None,
    ssl: SSLContext | None = None,
    http2: str = "auto",
) -> GrpcServer:
    """The gRPC server: EDS, health and reflection, all counted against the service's stream
    limit; `limits` (its max_streams and reset_budget replaced by the arguments of the same
    meaning) for connections and budgets; `http2` picks the path (h2/compat.py)."""
    limits = dataclasses.replace(
        limits or ConnectionLimits(),
        max_streams=max_streams_per_connection,
        reset_budget=reset_budget,
        keepalive_time=keepalive_time,
        keepalive_timeout=keepalive_timeout,
    )
    counted = {
        path: handler
        for svc in (HealthService(service.store), ReflectionService(SERVED))
        for path, handler in svc.__mapping__().items()
    }
    server = build_server(
        [service],
        counted,
        enter=service.enter_stream,
        leave=service.leave_stream,
        limits=limits,
        config=Configuration(),  # no keepalive of grpclib's: ours (h2/keepalive.py)
        max_message_size=max_message_size,
        mode=http2,
        mapping=lambda table: UnknownMethods(table, EDS_SERVICE),
    )
    server.ssl = ssl  # e.g. security.server_ssl_context(...): TLS 1.2+, ALPN h2
    service.open_io = server.open_io
    return server
