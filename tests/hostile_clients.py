"""Hostile HTTP/2 clients, one per attack of issue 11, run as their own process by test_hostile.py.

    python tests/hostile_clients.py ATTACK PORT SOURCE_IP SECONDS

Loopback only (the target is 127.0.0.1; SOURCE_IP is another 127.0.0.0/8 address, so per-IP
limits tell the attacker from the canary). Every loop is bounded by SECONDS and by a count.
Prints one JSON line of what the attacker saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import hpack
from h2frames import PREFACE
from hyperframe.frame import (
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
)

STREAM = "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
HOST = "127.0.0.1"
MAX_BYTES = 2 << 30  # no attack sends more than this in total


def headers(path: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "eds"),
            ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip


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


async def flood(port: int, src: str, seconds: float, chunk: bytes, *, setup: bytes = b"",
                connections: int = 1, reconnect: bool = True) -> dict[str, Any]:  # fmt: skip
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
        while time.monotonic() < deadline and stats["streams"] < 5_000_000:
            try:
                conn = await Conn.open(port, src)
            except OSError:
                await asyncio.sleep(0.05)
                continue
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


async def partial_messages(port: int, src: str, seconds: float, announced: int = 4 * 1024 * 1024 - 6,
                           path: str = STREAM) -> dict[str, Any]:  # fmt: skip
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


ATTACKS: dict[str, Callable[[int, str, float], Awaitable[dict[str, Any]]]] = {
    f.__name__: f
    for f in (ping_flood, settings_flood, priority_flood, unknown_flood, empty_data_flood, reset_churn,
              open_close_churn, data_after_end, idle_streams, idle_connections, partial_messages,
              big_health_message, health_streams)
}  # fmt: skip


async def main(name: str, port: int, src: str, seconds: float) -> None:
    assert src.startswith("127."), "loopback only"
    stats = await asyncio.wait_for(ATTACKS[name](port, src, seconds), seconds + 30)
    print(json.dumps({"attack": name, **stats}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
