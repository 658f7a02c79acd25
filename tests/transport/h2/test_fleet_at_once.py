"""A fleet connecting at once is not taken for a flood of HEADERS, on either HTTP/2 path, and the
flood still is: streams awaiting their first request are bounded per address and server-wide, but
not while the request waits on flow control (the window the client knows) or in our own read
queue. Every client is on 127.0.0.0/8; the bounds are scaled down."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.transport.h2.limits import ConnectionLimits
from eds_server.transport.h2.overload import MemoryWatermark
from tests.support.grpc_harness import serving
from tests.support.h2_client import Client, data, first_request, grpc
from tests.support.hostile_clients import Conn
from tests.support.waiting import wait_for

MB = 1 << 20
FRAME = 16_000  # DATA frames within the 16 KiB both paths take before our SETTINGS
INITIAL_WINDOW = 65_535
# the queued-requests test's request size: a connection's write (~250 KB) within one read of the
# socket, so every request waits in our queue and none in the kernel's buffer behind reading the
# scheduler paused (which this check cannot see: 20 KB requests flaked under load)
QUEUED_REQUEST = 12_000


def big_request(node: str, size: int) -> bytes:
    """An Envoy-like first request: its Node padded to `size` bytes."""
    request = first_request(node, "web")
    request.node = Node(id=node, cluster="direct", user_agent_name="x" * size)
    return grpc(request)


def split_frames(raw: bytes) -> list[bytes]:
    """`raw`, whole frames, one by one."""
    out, pos = [], 0
    while pos < len(raw):
        end = pos + 9 + int.from_bytes(raw[pos : pos + 3], "big")
        out.append(raw[pos:end])
        pos = end
    return out


def data_frames(sid: int, body: bytes) -> list[bytes]:
    return [data(sid, body[at : at + FRAME]) for at in range(0, len(body), FRAME)]


async def headers_then_requests(server: Any, clients: list[Client], size: int, tag: str) -> dict[Client, list[int]]:
    """The read scheduler slowed to one slice a turn, a turn every 0.05 s (input waits, reading
    paused); then each client writes twenty HEADERS and their twenty requests of `size` bytes at
    once. Each client's stream ids."""
    loop = asyncio.get_running_loop()
    server.gate.reads.turn_budget = 1e-9
    server.gate.reads.call_soon = lambda f: loop.call_later(0.05, f)
    sids: dict[Client, list[int]] = {}
    for n, client in enumerate(clients):
        opened = [client.new_stream() for _ in range(20)]
        sids[client] = [sid for sid, _ in opened]
        bodies = [b"".join(data_frames(sid, big_request(f"{tag}{n}-{sid}", size))) for sid, _ in opened]
        await client.send(b"".join(opening for _, opening in opened) + b"".join(bodies))
    return sids


class FirstFlight:
    """One client that does not wait for our SETTINGS: its preface, its HEADERS and as much of its
    requests as HTTP/2's initial 65,535-byte connection window allows, in one write (the HEADERS
    all first, or each stream's with its DATA, as the bench's load generator writes them); the
    rest once the server has granted more."""

    def __init__(self, client: Client, streams: int, size: int, interleaved: bool = False) -> None:
        self.client = client
        self.requests: dict[int, bytes] = {}
        self.sids: list[int] = []
        self.streams, self.size, self.interleaved = streams, size, interleaved

    @classmethod
    async def open(cls, port: int, src: str, streams: int, size: int, interleaved: bool = False) -> FirstFlight:
        flight = cls(Client(await Conn.open(port, src)), streams, size, interleaved)
        await flight.send_first()
        return flight

    async def send_first(self, requests: bool = True) -> None:
        client = self.client
        openings = []
        for i in range(self.streams):
            sid, opening = client.new_stream()
            self.sids.append(sid)
            openings.append(opening)
            if requests:
                self.requests[sid] = big_request(f"n{i}", self.size)
        if not self.interleaved:
            await client.send(b"".join(openings) + self.take(INITIAL_WINDOW))
            return
        out, window = [], INITIAL_WINDOW
        for sid, opening in zip(self.sids, openings, strict=True):
            out.append(opening)
            chunk = self.take(window, sid)
            window -= sum(len(f) - 9 for f in split_frames(chunk))
            out.append(chunk)
        await client.send(b"".join(out))

    def take(self, window: int, only: int = 0) -> bytes:
        """The next DATA frames (of stream `only`, or of all), `window` bytes at most (a request may be cut)."""
        out: list[bytes] = []
        for sid in [only] if only else self.sids:
            body = self.requests.get(sid, b"")
            while body and window > 0:
                n = min(window, FRAME, len(body))
                out.append(data(sid, body[:n]))
                body, window = body[n:], window - n
            self.requests[sid] = body
        return b"".join(out)

    async def finish(self) -> bool:
        """Send the rest as the server grants window (and answer its SETTINGS): whether every
        stream got its first response, the connection untouched."""
        client = self.client
        assert await client.until(lambda: client.conn_window > 0 or client.eof), "no window granted"
        rest = self.take(client.conn_window)
        if rest:
            await client.send(rest)
        return await client.until(lambda: all(client.messages.get(s) for s in self.sids) or client.eof)

    def close(self) -> None:
        self.client.close()


@contextlib.asynccontextmanager
async def flights(
    port: int, srcs: list[str], streams: int, size: int, interleaved: bool = False
) -> AsyncIterator[list[FirstFlight]]:
    opened: list[FirstFlight] = []
    try:
        for src in srcs:  # every first flight written before any client reads an answer
            opened.append(await FirstFlight.open(port, src, streams, size, interleaved))
        yield opened
    finally:
        for flight in opened:
            flight.close()


@pytest.mark.parametrize("interleaved", [False, True], ids=["headers first", "interleaved"])
async def test_an_address_opening_many_connections_at_once_is_not_refused_for_its_first_flights(
    interleaved: bool,
) -> None:
    """Six connections from one address, twenty streams each, every first flight written at once:
    each carries one 60 KB request and the start of a second, the other eighteen streams wait on
    the initial window until the client has our WINDOW_UPDATE. Judged by eds-server's own window
    (4 MiB from the start) they counted against the address's bound of 40 streams awaiting a
    request, and the third connection's streams were refused. Now every stream is served."""
    limits = ConnectionLimits(pending_streams=40, stream_budget=100_000)
    async with serving(limits) as (server, _, port), flights(port, ["127.0.0.5"] * 6, 20, 60_000, interleaved) as fleet:
        peer = server.gate.peers["127.0.0.5"]
        read = await wait_for(
            lambda: (server.refused["pending_streams"], peer.pending),
            lambda x: x[0] or x[1] >= 6 * 18,
            what="every first flight read (refused, awaiting)",
        )
        assert read[0] == 0, server.refused
        assert peer.pending - peer.held_back < limits.pending_streams, (peer.pending, peer.held_back)
        for flight in fleet:
            assert await flight.finish(), (flight.client.resets, flight.client.goaway)
        assert not any(f.client.resets or f.client.goaway is not None for f in fleet)
        assert server.refused["pending_streams"] == 0, server.refused
        await wait_for(lambda: (peer.pending, peer.held_back), lambda x: x == (0, 0), what="nothing left held")


async def test_a_first_flight_of_headers_alone_is_still_bounded() -> None:
    """A client that opens streams in its first flight and sends no request has its window
    whole: its streams past the address's bound are refused, as before. One that spends its first
    window and then sends nothing more is held back only until it has our window and we have
    read what it sent: its later streams count with the others, and past the bound are refused."""
    limits = ConnectionLimits(pending_streams=40, stream_budget=100_000)
    async with serving(limits) as (server, _, port):
        flood = FirstFlight(Client(await Conn.open(port, "127.0.0.6")), 60, 0)
        try:
            await flood.send_first(requests=False)
            assert await flood.client.until(lambda: len(flood.client.resets) >= 20), flood.client.resets
            assert server.refused["pending_streams"] == 20, server.refused
        finally:
            flood.close()
        spender = await FirstFlight.open(port, "127.0.0.7", 30, 60_000)
        try:
            client = spender.client
            peer = server.gate.peers["127.0.0.7"]
            await wait_for(lambda: peer.held_back, lambda n: n >= 28, what="its streams held back by the window")
            assert await client.until(lambda: client.conn_window > 0), "no window granted"
            await client.ping()  # our SETTINGS acknowledged before it: its window is known, its input read
            await wait_for(lambda: peer.held_back, lambda n: n == 0, what="its streams counted again")
            more = [client.new_stream() for _ in range(20)]
            await client.send(b"".join(opening for _, opening in more))
            assert await client.until(lambda: all(sid in client.resets for sid, _ in more[12:])), client.resets
            assert not any(sid in client.resets for sid in spender.sids), client.resets
            assert server.refused["pending_streams"] == 20 + 8, server.refused
        finally:
            spender.close()


# when the host is busy, the server's first read of a connection may take only part of its write,
# and the rest waits in the kernel, where this check cannot see it (2 of 4 runs with two busy loops)
@pytest.mark.alone
async def test_streams_whose_requests_wait_in_our_read_queue_do_not_trip_the_server_wide_watermark() -> None:
    """Twelve connections from distinct addresses each write twenty HEADERS and then their
    twenty 12 KB requests at once; the read scheduler is slowed to one slice a turn, so each
    connection's first slice opens its streams and their requests wait in our queue behind the
    other connections' HEADERS. The watermark of streams awaiting a request (scaled to 50)
    closed the connections holding most of them; now streams whose requests wait there are not counted, and
    every stream is served. A flood of HEADERS alone is still closed, its burst still queued: what
    waits there is more HEADERS, no request."""
    async with serving(ConnectionLimits()) as (server, _, port):
        loop = asyncio.get_running_loop()
        reads = server.gate.reads
        watermark = MemoryWatermark(server.gate, 100 * MB, rss=lambda: 10 * MB, awaiting_watermark=50)
        srcs = [f"127.0.2.{i}" for i in range(1, 13)]
        clients = [await Client.open(port, src) for src in srcs]  # SETTINGS exchanged: the window is known
        try:
            sids = await headers_then_requests(server, clients, QUEUED_REQUEST, "c")
            peers = [server.gate.peers[src] for src in srcs]
            checks, started = 0, False
            for _ in range(2_000):  # bounded: a check each round while it matters, until all is read
                awaiting = sum(p.pending for p in peers)
                started = started or bool(awaiting or reads.held)
                if awaiting > watermark.awaiting_watermark:
                    watermark.check()
                    checks += 1
                if (started and not awaiting and not reads.held) or server.gate.refused["overload"]:
                    break
                await asyncio.sleep(0.01)
            assert checks > 0, "the watermark was never crossed: the test shows nothing"
            assert server.gate.refused["overload"] == 0, server.gate.refused
            reads.turn_budget, reads.call_soon = 0.004, None
            for client in clients:
                assert await client.until(lambda c=client: all(c.messages.get(s) for s in sids[c]) or c.eof)
                assert client.goaway is None and not client.resets and not client.eof
        finally:
            for client in clients:
                client.close()
        async with contextlib.AsyncExitStack() as stack:
            flood = await Client.open(port, "127.0.2.99")
            stack.callback(flood.close)
            reads.turn_budget = 1e-9  # its burst read a slice a turn, a second apart: most of it queued
            reads.call_soon = lambda f: loop.call_later(1.0, f)
            await flood.send(b"".join(flood.new_stream()[1] for _ in range(400)))
            peer = server.gate.peers["127.0.2.99"]
            await wait_for(lambda: peer.pending, lambda n: n > watermark.awaiting_watermark, what="the flood's streams")
            assert reads.held, "the flood's burst is read already: the test shows nothing"
            watermark.check()  # its queue holds more HEADERS, no request: its streams count
            assert server.gate.refused["overload"] == 1, server.gate.refused
            assert await flood.until(lambda: flood.goaway is not None or flood.eof), "the flood is not closed"


@pytest.mark.alone  # as above: what the server's first read takes of a write depends on the host's load
async def test_streams_whose_requests_wait_behind_our_paused_reading_count_as_held_back() -> None:
    """As above, with requests of an Envoy's size (60 KB): a connection's write (1.2 MB) is more than
    one read of the socket, so once the scheduler has paused its reading most of its requests wait
    in the kernel's buffer, where no scan can see them. The requests found in our queue say the rest
    are behind: its streams count against the watermark of streams held back (roomy here), not that
    of streams that could send and do not (scaled to 50), and no connection is closed. Counted
    there, the same streams closed a connection (one, in the runs of that mutant)."""
    async with serving(ConnectionLimits(stream_budget=100_000)) as (server, _, port):
        reads = server.gate.reads
        watermark = MemoryWatermark(server.gate, 100 * MB, rss=lambda: 10 * MB, awaiting_watermark=50)
        srcs = [f"127.0.4.{i}" for i in range(1, 7)]
        clients = [await Client.open(port, src) for src in srcs]  # SETTINGS exchanged: the window is known
        try:
            sids = await headers_then_requests(server, clients, 60_000, "k")
            peers = [server.gate.peers[src] for src in srcs]
            checks = behind = 0
            for _ in range(2_000):  # bounded: a check each round while it matters
                awaiting = sum(p.pending for p in peers)
                if awaiting > watermark.awaiting_watermark:
                    holders = [h for p in peers for h in p.held]
                    behind = max(behind, sum(h.awaiting() for h in holders if h.held_back()))
                    watermark.check()
                    checks += 1
                if (checks and not awaiting) or server.gate.refused["overload"]:
                    break
                await asyncio.sleep(0.01)
            assert checks > 0, "the watermark was never crossed: the test shows nothing"
            assert server.gate.refused["overload"] == 0, server.gate.refused
            assert behind > watermark.awaiting_watermark, f"{behind} streams behind our reading: nothing shown"
            reads.turn_budget, reads.call_soon = 0.004, None
            for client in clients:
                assert await client.until(lambda c=client: all(c.messages.get(s) for s in sids[c]) or c.eof)
                assert client.goaway is None and not client.resets and not client.eof
        finally:
            reads.turn_budget, reads.call_soon = 0.004, None
            for client in clients:
                client.close()


async def test_first_flights_waiting_on_their_window_do_not_trip_the_server_wide_watermark() -> None:
    """Twelve addresses write their first flights at once (twenty streams, one 60 KB request
    each, as much as HTTP/2's first window carries), and send the rest only once all twelve are
    written: 19 streams a connection wait on the window the client does not know yet. They count
    against a watermark of their own, not the one for streams that could send their request and do
    not (scaled to 50 here, which they pass four times over): no connection is closed."""
    async with serving(ConnectionLimits(stream_budget=100_000)) as (server, _, port):
        watermark = MemoryWatermark(server.gate, 100 * MB, rss=lambda: 10 * MB, awaiting_watermark=50)
        srcs = [f"127.0.3.{i}" for i in range(1, 13)]
        async with flights(port, srcs, 20, 60_000) as fleet:
            peers = [await wait_for(lambda s=src: server.gate.peers.get(s), what="its address") for src in srcs]
            await wait_for(
                lambda: sum(p.held_back for p in peers), lambda n: n >= 12 * 18, what="every flight held back"
            )
            assert sum(p.pending for p in peers) > 4 * watermark.awaiting_watermark  # the floor: crossed
            watermark.check()
            assert server.gate.refused["overload"] == 0, server.gate.refused
            for flight in fleet:
                assert await flight.finish(), (flight.client.resets, flight.client.goaway)
            assert not any(f.client.resets or f.client.goaway is not None for f in fleet)
