"""A raw HTTP/2 client for the gRPC port, which writes its frames (and TCP writes) exactly as a test
needs them and reads what the server sends; and how to find a stream's direct reader
(transport/h2/direct.py) to prove the direct path was taken. The server is grpc_harness.serving.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import hpack

from eds_server.model import Endpoint, Group
from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
)
from eds_server.transport.grpc import EdsService
from eds_server.transport.h2.direct import DirectReader
from eds_server.transport.h2.fast_server import FastIO
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.h2frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Frame,
    frame,
    split,
)
from tests.support.hostile_clients import STREAM, Conn

DELTA = "/envoy.service.endpoint.v3.EndpointDiscoveryService/DeltaEndpoints"
SOURCE = "test"  # grpc_harness.serving's source; "web" is in the store from the start
WAIT = 10.0  # the most any one wait may take (a bound, never a claim about speed)
OUR_WINDOW = 1 << 30  # the client's receive windows: the server never waits on us


def grpc(message: Any) -> bytes:
    """A gRPC message: uncompressed flag, length prefix, body."""
    body = message if isinstance(message, bytes) else bytes(message)
    return b"\x00" + len(body).to_bytes(4, "big") + body


def data(sid: int, payload: bytes, flags: int = 0) -> bytes:
    return frame(DATA, flags, sid, payload)


def first_request(node: str, *names: str) -> DiscoveryRequest:
    return DiscoveryRequest(node=Node(id=node, cluster="direct"), resource_names=list(names), type_url=EDS_TYPE_URL)


def ack(resp: DiscoveryResponse, *names: str) -> DiscoveryRequest:
    return DiscoveryRequest(
        version_info=resp.version_info, resource_names=list(names), response_nonce=resp.nonce, type_url=EDS_TYPE_URL
    )


def tagged(tag: str, size: int = 0) -> bytes:
    """A request the SotW stream ignores (a nonce it never sent), told apart by `tag`; `size` bytes
    of node make it big."""
    node = Node(id=tag, user_agent_name="x" * size) if size else None
    return bytes(DiscoveryRequest(resource_names=["web"], response_nonce=tag, type_url=EDS_TYPE_URL, node=node))


def group(port: int) -> dict[str, Group]:
    return {"web": Group("web", (Endpoint("127.0.0.1", port),))}


class Client:
    """A raw HTTP/2 client (hostile_clients.Conn writes its frames) that reads what the server sends:
    its SETTINGS (acknowledged) and PINGs (answered), the send windows it grants, gRPC messages,
    trailers, resets and GOAWAY."""

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.decoder = hpack.Decoder()
        self.buffer = b""
        self.initial_window = 65535  # for streams: the server's SETTINGS say
        self.conn_window = 65535
        self.windows: dict[int, int] = {}  # what each stream may still send
        self.updates: dict[int, int] = {}  # WINDOW_UPDATE frames received, by stream (0: the connection)
        self.messages: dict[int, list[bytes]] = {}  # gRPC messages received, by stream
        self._partial: dict[int, bytes] = {}
        self.trailers: dict[int, dict[str, str]] = {}
        self.resets: dict[int, int] = {}
        self.goaway: int | None = None
        self.pings = 0  # our PINGs acknowledged
        self.pings_sent = 0
        self.eof = False

    @classmethod
    async def open(cls, port: int, src: str = "127.0.0.1") -> Client:
        return await cls.start(await Conn.open(port, src))

    @classmethod
    async def over(cls, conn: Conn, window: int | None = None) -> Client:
        """A client on a connection made some other way (memory_io.py): the preface first."""
        await conn.send(PREFACE)
        return await cls.start(conn, window)

    @classmethod
    async def start(cls, conn: Conn, window: int | None = None) -> Client:
        """The client on `conn` (its preface sent), once SETTINGS are exchanged: its streams grant
        `window` bytes (by default so many the server never waits on us)."""
        client = cls(conn)
        await client.send(
            frame(SETTINGS, 0, 0, (4).to_bytes(2, "big") + (window or OUR_WINDOW).to_bytes(4, "big"))
            + frame(WINDOW_UPDATE, 0, 0, OUR_WINDOW.to_bytes(4, "big"))
        )
        # The server's SETTINGS are in and acknowledged: nothing the client answers later can land
        # inside a frame a test leaves unfinished.
        await client.ping()
        return client

    def close(self) -> None:
        self.conn.close()

    async def send(self, raw: bytes) -> None:
        """Write `raw` as one TCP write; its DATA frames are charged to the send windows (when it
        holds whole frames only)."""
        frames, rest = split(raw)
        if not rest:
            for f in frames:
                if f.type == DATA:
                    self.conn_window -= len(f.payload)
                    self.windows[f.stream_id] = self.windows.get(f.stream_id, self.initial_window) - len(f.payload)
        await self.conn.send(raw)

    def new_stream(self, path: str = STREAM) -> tuple[int, bytes]:
        """A new stream's id and its HEADERS frame (not sent)."""
        sid, opening = self.conn.open_stream(path)
        self.windows[sid] = self.initial_window
        self.messages[sid] = []
        return sid, opening

    async def request(self, message: Any, path: str = STREAM) -> int:
        """Open a stream with its first request, in one write: the stream's id."""
        sid, opening = self.new_stream(path)
        await self.send(opening + data(sid, grpc(message)))
        return sid

    async def response(self, sid: int, n: int, parse: Any = DiscoveryResponse) -> Any:
        """The stream's `n`th message (from 1), once it has come."""
        assert await self.until(lambda: len(self.messages[sid]) >= n), f"no message {n} on stream {sid}"
        return parse.parse(self.messages[sid][n - 1])

    def status(self, sid: int) -> int | None:
        trailers = self.trailers.get(sid)
        return int(trailers["grpc-status"]) if trailers and "grpc-status" in trailers else None

    async def ping(self) -> None:
        """A PING, and its ACK back: the server has read everything sent before it."""
        self.pings_sent += 1
        await self.send(frame(PING, 0, 0, self.pings_sent.to_bytes(8, "big")))
        assert await self.until(lambda: self.pings >= self.pings_sent), "no PING ACK"

    async def pump(self, wait: float) -> bool:
        """Read once (waiting at most `wait`) and take in the frames: False if nothing came."""
        try:
            chunk = await asyncio.wait_for(self.conn.reader.read(1 << 16), wait)
        except TimeoutError:
            return False
        except ConnectionError:
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        frames, self.buffer = split(self.buffer + chunk)
        replies = b"".join(self._take(f) for f in frames)
        if replies and not self.conn.closed():
            with contextlib.suppress(OSError, TimeoutError):
                await self.conn.send(replies)
        return True

    async def until(self, done: Callable[[], bool], wait: float = WAIT) -> bool:
        """Read until `done()` or `wait` has passed or the server closed: `done()`."""
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        for _ in range(100_000):  # bounded
            if done():
                return True
            left = end - loop.time()
            if left <= 0 or self.eof:
                break
            await self.pump(left)
        return done()

    def _take(self, f: Frame) -> bytes:
        """One frame from the server; what to answer."""
        if f.type == SETTINGS and not f.flags & 1:
            for i in range(0, len(f.payload), 6):
                if int.from_bytes(f.payload[i : i + 2], "big") == 4:  # INITIAL_WINDOW_SIZE
                    value = int.from_bytes(f.payload[i + 2 : i + 6], "big")
                    for sid in self.windows:
                        self.windows[sid] += value - self.initial_window
                    self.initial_window = value
            return frame(SETTINGS, 1, 0)
        if f.type == PING:
            if f.flags & 1:
                self.pings += 1
                return b""
            return frame(PING, 1, 0, f.payload)
        if f.type == WINDOW_UPDATE:
            increment = int.from_bytes(f.payload, "big") & 0x7FFFFFFF
            if f.stream_id:
                self.windows[f.stream_id] = self.windows.get(f.stream_id, self.initial_window) + increment
            else:
                self.conn_window += increment
            self.updates[f.stream_id] = self.updates.get(f.stream_id, 0) + 1
        elif f.type == HEADERS:
            assert f.flags & END_HEADERS and not f.flags & (PADDED | 0x20), f  # what h2 sends us
            fields = dict(self.decoder.decode(f.payload))
            if f.flags & END_STREAM:
                self.trailers[f.stream_id] = fields
        elif f.type == DATA:
            buf = self._partial.get(f.stream_id, b"") + f.payload
            while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
                size = int.from_bytes(buf[1:5], "big")
                self.messages.setdefault(f.stream_id, []).append(buf[5 : 5 + size])
                buf = buf[5 + size :]
            self._partial[f.stream_id] = buf
        elif f.type == RST_STREAM:
            self.resets[f.stream_id] = int.from_bytes(f.payload, "big")
        elif f.type == GOAWAY:
            self.goaway = int.from_bytes(f.payload[4:8], "big")
        return b""


@contextlib.asynccontextmanager
async def client_of(port: int, src: str = "127.0.0.1") -> AsyncIterator[Client]:
    client = await Client.open(port, src)
    try:
        yield client
    finally:
        client.close()


def reader_of(service: EdsService, node: str) -> DirectReader | None:
    """The direct reader of node's stream (fast path), if it is on the direct path now."""
    found = [s for s in service.sessions if s.node == node]
    assert len(found) == 1, f"{len(found)} sessions of node {node}"
    io = found[0].io
    assert isinstance(io, FastIO), f"{type(io).__name__}: the stock path has no direct reader"
    return io.direct


async def direct_stream(client: Client, service: EdsService, node: str, path: str = STREAM) -> tuple[int, Any]:
    """A stream of `node` subscribed to "web", its first response ACKed (on the direct path): its id
    and that response."""
    if path == STREAM:
        sid = await client.request(first_request(node, "web"), path)
        r1 = await client.response(sid, 1)
        await client.send(data(sid, grpc(ack(r1, "web"))))
    else:
        sid = await client.request(
            DeltaDiscoveryRequest(node=Node(id=node), type_url=EDS_TYPE_URL, resource_names_subscribe=["web"]), path
        )
        r1 = await client.response(sid, 1, DeltaDiscoveryResponse)
        await client.send(data(sid, grpc(DeltaDiscoveryRequest(type_url=EDS_TYPE_URL, response_nonce=r1.nonce))))
    await client.ping()
    reader = reader_of(service, node)
    assert reader is not None and reader.messages == 1, "the ACK was not read directly"
    return sid, r1
