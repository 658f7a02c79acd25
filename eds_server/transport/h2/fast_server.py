"""The fast path: HTTP/2 and gRPC framing below the EDS service, on grpclib, h2 and hyperframe
internals (used only with the versions compat.py verified), where grpclib's defaults do not fit an
xDS server that faces untrusted clients and fans one change out to thousands of streams. This
module is grpclib's server on the fast protocol, and each stream's StreamIO; the parts:

- fast_connection.py: h2's connection charging every frame to the budgets of limits.py, counting
  open streams in O(1) (h2 walks every stream on each new one: quadratic);
- fast_protocol.py: one client connection: the frame guard (guard.py) first, MAX_CONCURRENT_STREAMS
  from the first SETTINGS (h2 allows 100, grpclib drops the connection on stream 101, Envoy opens
  one stream per EDS cluster), malformed headers refused (headers.py), streams without a request
  held and timed out, idle connections closed, direct streams' DATA frames handed to direct.py;
- fast_reader.py, direct.py: request messages read within limits, then straight from DATA frames;
- fast_writer.py: responses framed once, queued, written once per connection and batch;
- private.py: every internal of another library the package touches, where, why, and the figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from ssl import SSLContext
from typing import Any, cast

import grpclib.const
import grpclib.protocol
import grpclib.server
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.protocol import H2Protocol
from h2.exceptions import H2Error

from ...events import LeanEvent, LeanQueue
from .base import DirectClient, Framed
from .direct import DirectReader
from .fast_connection import short_frame_reprs
from .fast_protocol import FastProtocol
from .fast_reader import MessageReader
from .fast_writer import (
    Flusher,
    FlushingConnection,
    ResponseHeaders,
    StatusInTrailers,
    guarded_h2,
    queue_initial_headers,
    queue_message,
    send_frames,
)
from .handlers import releasing
from .limits import ConnectionLimits, Gate, fit_to_file_limit

__all__ = ["FastIO", "MessageReader", "Server", "limited_handler", "short_frame_reprs"]

Stream = grpclib.server.Stream[Any, Any]


class Server(grpclib.server.Server):
    """grpclib's server on the guarded protocol; `open_io` gives the services each stream's
    StreamIO. `mapping` wraps the handlers' table (unknown.py answers unknown methods)."""

    fast = True

    def __init__(
        self,
        handlers: list[Any],
        *,
        limits: ConnectionLimits,
        reader: MessageReader,
        mapping: Callable[[dict[str, Any]], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(handlers, **kwargs)
        # each stream's three events (window, headers, trailers) and its data queue at ~100 bytes
        # each, not 857 and 2,700 (events.py); grpclib's protocol module looks the names up as it
        # makes each stream
        setattr(grpclib.protocol, "Event", LeanEvent)  # noqa: B010 (names grpclib does not export)
        setattr(grpclib.protocol, "Queue", LeanQueue)  # noqa: B010
        self.gate = Gate(limits)
        self.reader = reader
        self.flusher = Flusher()
        self.response_headers = ResponseHeaders()
        self.ssl: SSLContext | None = None  # TLS for start() when it is given none
        self.open: set[FastProtocol] = set()
        if mapping is not None:
            self._mapping = mapping(self._mapping)  # read by each connection's handler

    def open_io(self, stream: grpclib.server.Stream[Any, Any]) -> FastIO:
        return FastIO(stream, self.reader, self.flusher, self.response_headers)

    def connection_protocol(self) -> asyncio.Protocol:
        """A protocol for one more client connection, as start() makes for each accepted socket:
        tests drive it over in-memory transports (tests/support/memory_io.py)."""
        return self._protocol_factory()

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

    @property
    def refused(self) -> dict[str, int]:
        """What was refused, by reason (the label values of eds_refused_total)."""
        budget = self.reader.budget
        if budget is None:
            return dict(self.gate.refused)
        return {**self.gate.refused, "partial_messages": budget.refused, "message_size": budget.too_big}

    async def start(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        ssl: SSLContext | None = None,
        backlog: int = 1024,
        path: str | None = None,
        sock: socket.socket | None = None,
        **kwargs: Any,
    ) -> None:
        """grpclib's start, with a TLS handshake timeout. Over-limit connections are accepted and
        closed at once (with a GOAWAY saying why), so the accept backlog sheds rather than stalls."""
        if self._server is not None:
            raise RuntimeError("Server is already started")
        fit_to_file_limit(self.gate.limits)
        ssl = ssl or self.ssl
        loop = asyncio.get_running_loop()
        if path is not None:  # a Unix socket: the workers' link to their owner
            self._server = await loop.create_unix_server(self._protocol_factory, path, backlog=backlog)
        elif sock is not None:  # a listening socket handed over by the owner of --workers N
            self._server = await loop.create_server(
                self._protocol_factory,
                sock=sock,
                backlog=backlog,
                ssl=ssl,
                ssl_handshake_timeout=self.gate.limits.tls_handshake_timeout if ssl else None,
            )
        else:
            self._server = await loop.create_server(
                self._protocol_factory,
                host,
                cast(int, port),
                backlog=backlog,
                ssl=ssl,
                flags=socket.AI_PASSIVE,
                ssl_handshake_timeout=self.gate.limits.tls_handshake_timeout if ssl else None,
                **kwargs,
            )
        self._server_closed_fut = loop.create_future()

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        mine = FastProtocol(releasing(self, protocol.handler, plain=True), protocol.config, protocol.h2_config)
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


def limited_handler(
    handler: grpclib.const.Handler,
    reader: MessageReader,
    enter: Callable[[Stream], bool],
    leave: Callable[[Stream], None],
) -> grpclib.const.Handler:
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


def charge_refusal(stream: Stream) -> None:
    """A stream refused at the stream limits: charged to its IP as a stream without a request, so a
    client that keeps opening streams past the limits ends in GOAWAY instead of costing a handler each."""
    raw = stream._stream
    h2 = guarded_h2(raw)
    if h2 is not None and raw.id is not None:
        h2.no_request(raw.id, "refused at the stream limits", defer=True)


class FastIO(StatusInTrailers):
    """A stream on the fast path: requests read with limits (and straight from DATA frames once
    the first is read), responses queued as shared frames and flushed once per connection and
    batch; and its own StatusInTrailers (one object less a stream)."""

    __slots__ = ("_flusher", "_headers", "_reader")

    def __init__(
        self, stream: grpclib.server.Stream[Any, Any], reader: MessageReader, flusher: Flusher, headers: ResponseHeaders
    ) -> None:
        self.stream = stream
        self._reader = reader
        self._flusher = flusher
        self._headers = headers

    async def read(self, first: bool = False) -> bytes | memoryview | None:
        data: bytes | None = await self._reader.read(self.stream, bytes, first=first)
        return data

    def first_request(self) -> bytes | memoryview | None:
        data: bytes | memoryview | None = self._reader.early(self.stream, bytes)
        return data

    def read_direct(self, client: DirectClient) -> asyncio.Future[None] | None:
        return self._reader.direct(self.stream, client)

    def ready(self) -> bool:
        stream = self.stream
        raw = stream._stream
        connection = cast(FlushingConnection, raw.connection)  # every connection of the fast server's
        if not connection.write_ready.is_set():
            return False
        if stream._send_initial_metadata_done:
            # The stream's and the connection's states are queue()'s to check, once: grpclib's
            # `closable` here looked them up again for every stream of every change (8% of a
            # fan-out's CPU). A stream found closed there is handed to its task, which finds out.
            return not connection.queued.is_closing()
        if not raw.closable:
            return False
        try:
            if not queue_initial_headers(stream, self._headers):
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
        return self

    @property
    def direct(self) -> DirectReader | None:
        """The stream's direct reader (direct.py) while its requests are read straight from its DATA
        frames, else None: how tests see the path is taken."""
        raw = self.stream._stream
        h2 = guarded_h2(raw)
        reader = None if h2 is None or raw.id is None else h2.direct.get(raw.id)
        return reader if isinstance(reader, DirectReader) else None

    def refused(self) -> None:
        charge_refusal(self.stream)
