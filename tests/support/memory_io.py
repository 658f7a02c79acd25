"""Client connections to the gRPC server held in memory: no sockets, no kernel buffers, so what a
test sees depends only on the event loop's order. Each end is an asyncio Transport whose writes
become the other end's data_received, one chunk per loop turn, as a socket's would; an end that
stops reading (pause_reading, as asyncio's StreamReader does when its buffer is full) leaves the
other's writes piling up, past `high` bytes of which the writer's protocol is told to pause
writing, and below `high // 4` to resume: a slow reader's back pressure, at a size the test picks
(a socket's is the kernel's, megabytes and unknown).

`MemoryServer` is `grpc_harness.serving` with such connections: the server takes each through
`connection_protocol()`, the protocol start() would make for an accepted socket, so the path under
test (fast or stock, `http2`) is the one that serves real clients; the client is h2_client.Client
(raw frames: what it sends, and the order, are the test's).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

from eds_server.encode import encode_group
from eds_server.model import Endpoint, Group
from eds_server.store import Store
from eds_server.transport.grpc import EdsService, make_server
from eds_server.transport.h2 import ConnectionLimits, GrpcServer
from tests.support.h2_client import Client
from tests.support.hostile_clients import Conn

CHUNK = 1 << 16  # the most one data_received gets, as a socket read of 64 KB
MODES = ("fast", "stock")  # both HTTP/2 paths (h2/compat.py), each in every test that takes `http2`


class MemoryTransport(asyncio.Transport):
    """One end of an in-memory connection; `peer` is the other end."""

    def __init__(self, protocol: asyncio.Protocol, peername: tuple[str, int], high: int, chunk: int = CHUNK) -> None:
        super().__init__(extra={"peername": peername, "sockname": None, "socket": None, "sslcontext": None})
        self.protocol = protocol
        self.peer: MemoryTransport | None = None
        self.high, self.low = high, high // 4
        self.chunk = chunk  # the most one data_received gets
        self.inbox = bytearray()  # written by the peer, not yet handed to our protocol
        self.reading = True
        self.write_paused = False
        self.closing = False  # close() or abort() called on this end
        self.lost = False  # our protocol was told connection_lost
        self.eof = False  # the peer closed: after the inbox, our protocol gets EOF
        self.delivered = 0  # bytes handed to our protocol
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    # -- writing: into the peer's inbox

    def write(self, data: bytes | bytearray | memoryview) -> None:
        peer = self.peer
        if self.closing or peer is None or peer.lost or not data:
            return
        peer.inbox += data
        peer._schedule()
        if not self.write_paused and len(peer.inbox) > self.high:
            self.write_paused = True
            self.protocol.pause_writing()  # type: ignore[attr-defined]

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def get_write_buffer_size(self) -> int:
        return len(self.peer.inbox) if self.peer is not None else 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.low, self.high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.high = 1 << 16 if high is None else high
        self.low = self.high // 4 if low is None else low

    def can_write_eof(self) -> bool:
        return False

    # -- reading: our inbox, to our protocol

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True
        self._schedule()

    def is_reading(self) -> bool:
        return self.reading

    def _schedule(self) -> None:
        if not self._scheduled and not self.lost:
            self._scheduled = True
            self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        self._scheduled = False
        if self.lost or not self.reading:
            return
        if self.inbox:
            chunk = bytes(self.inbox[: self.chunk])
            del self.inbox[: self.chunk]
            self.delivered += len(chunk)
            self.protocol.data_received(chunk)  # type: ignore[attr-defined]
            writer = self.peer
            if writer is not None and writer.write_paused and len(self.inbox) <= writer.low and not writer.lost:
                writer.write_paused = False
                writer.protocol.resume_writing()  # type: ignore[attr-defined]
            if self.inbox:
                self._schedule()
                return
        if self.eof:  # the peer closed, and everything it wrote before is in
            self._lose()

    # -- ending

    def is_closing(self) -> bool:
        return self.closing or self.lost

    def close(self) -> None:
        """As a socket's close: what was written still reaches the peer, then it sees the end."""
        if self.closing:
            return
        self.closing = True
        peer = self.peer
        if peer is not None and not peer.lost:
            peer.eof = True
            peer._schedule()
        else:
            self._loop.call_soon(self._lose)

    def abort(self) -> None:
        """As a reset: both ends end now, whatever was not read is gone."""
        self.closing = True
        self.inbox.clear()
        peer = self.peer
        if peer is not None:
            peer.inbox.clear()
            peer.closing = True
            self._loop.call_soon(peer._lose)
        self._loop.call_soon(self._lose)

    def _lose(self) -> None:
        """Our protocol learns the connection is gone (once), and so does the peer's."""
        if self.lost:
            return
        self.lost = self.closing = True
        self.protocol.connection_lost(None)
        peer = self.peer
        if peer is not None and not peer.lost:
            peer.closing = True
            self._loop.call_soon(peer._lose)


def connect(
    server_protocol: asyncio.Protocol,
    client_addr: tuple[str, int],
    *,
    high: int = 1 << 16,
    reader_limit: int = 1 << 16,
    chunk: int = CHUNK,
) -> tuple[Conn, MemoryTransport, MemoryTransport]:
    """A client connection to `server_protocol`: the client's Conn (an asyncio stream pair, which
    stops reading past 2 x `reader_limit` bytes unread, as asyncio's does, taking what the server
    writes `chunk` bytes at a time), and the client's and the server's transports. Both ends pause
    writing past `high` bytes the other has not read."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=reader_limit, loop=loop)
    client_protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    client = MemoryTransport(client_protocol, ("127.0.0.1", 50051), high, chunk)
    server = MemoryTransport(server_protocol, client_addr, high)
    client.peer, server.peer = server, client
    server_protocol.connection_made(server)
    client_protocol.connection_made(client)
    writer = asyncio.StreamWriter(client, client_protocol, reader, loop)
    return Conn(reader, writer), client, server


class MemoryServer:
    """A gRPC server whose client connections are in memory (`client()`); "web" in the store."""

    def __init__(self, store: Store, service: EdsService, server: GrpcServer) -> None:
        self.store, self.service, self.server = store, service, server
        self.transports: list[tuple[MemoryTransport, MemoryTransport]] = []  # (client's, server's) per connection

    async def client(
        self, *, high: int = 1 << 16, reader_limit: int = 1 << 16, chunk: int = CHUNK, window: int | None = None
    ) -> Client:
        """A raw client on a new in-memory connection from its own port of 127.0.0.1 (see `connect`),
        SETTINGS exchanged; `window`: the stream windows it grants (default: so large the server
        never waits)."""
        port = 40000 + len(self.transports)
        conn, client_end, server_end = connect(
            self.server.connection_protocol(), ("127.0.0.1", port), high=high, reader_limit=reader_limit, chunk=chunk
        )
        self.transports.append((client_end, server_end))
        return await Client.over(conn, window=window)

    def update(self, *ports: int, name: str = "web") -> None:
        """The group `name` now has these endpoints: a change for every stream that follows it."""
        self.store.update("test", {name: Group(name, tuple(Endpoint("127.0.0.1", p) for p in ports))})


@contextlib.asynccontextmanager
async def memory_server(
    http2: str, limits: ConnectionLimits | None = None, **kwargs: Any
) -> AsyncIterator[MemoryServer]:
    """A server on the `http2` path with `limits` and `kwargs` (make_server's), "web" in the store.
    It listens on a loopback port nobody connects to: grpclib's close() needs a started server."""
    store = Store(encode_group)
    store.add_source("test")
    store.update("test", {"web": Group("web", (Endpoint("127.0.0.1", 1),))})
    service = EdsService(store, send_timeout=kwargs.pop("send_timeout", 30.0))
    settings: dict[str, Any] = {
        "max_streams_per_connection": 1000,
        "keepalive_time": 30,
        "keepalive_timeout": 10,
        "max_message_size": 1 << 20,
        "limits": limits or ConnectionLimits(stream_budget=100_000),
        "http2": http2,
        **kwargs,
    }
    server = make_server(service, **settings)
    await server.start("127.0.0.1", 0)
    held = MemoryServer(store, service, server)
    try:
        yield held
    finally:
        service.stop()
        for client_end, _ in held.transports:
            client_end.abort()
        server.close()
        await server.wait_closed()
