"""Admission by fair share: a full connection table costs the address holding the most one of its
connections, never the newcomer; a connection that holds no stream is closed after the idle
timeout, PINGs answered or not. The gate's rules on their own, then a server on loopback with
clients from many 127.0.0.x addresses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import hpack
import pytest

from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse
from eds_server.transport.h2.limits import ConnectionLimits, Gate
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.grpc_harness import fetch_web, serving
from tests.support.h2frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    frame,
    read_frames,
    split,
)
from tests.support.hostile_clients import STREAM, headers
from tests.support.waiting import wait_for

REQUEST_HEADERS = headers(STREAM)


class FakeConnection:
    def __init__(self, name: str, busy: bool = True) -> None:
        self.name, self._busy, self.gone = name, busy, ""

    def busy(self) -> bool:
        return self._busy

    def give_way(self, why: str) -> None:
        self.gone = why

    def memory(self) -> int:
        return 0

    def awaiting(self) -> int:
        return 0

    def held_back(self) -> bool:
        return False

    def __repr__(self) -> str:
        return self.name


def test_an_address_gone_idle_is_forgotten_soon_and_one_in_debt_is_not() -> None:
    """Once its last connection has closed, an address's state is dropped as soon as it is idle
    (budgets full, its cost of the loop decayed): not kept until the table fills, where each one held
    a 1 MiB block of Python's allocator among its freed streams. One still owing is kept."""
    now = [0.0]
    gate = Gate(ConnectionLimits(max_connections=10, max_connections_per_ip=100))
    gate.reads.clock = lambda: now[0]
    conns = {ip: FakeConnection(ip) for ip in ("quiet", "costly", "wasteful", "staying")}
    peers = {ip: gate.admit(ip, c) for ip, c in conns.items()}
    peers["costly"].cost.charge(2.0, now[0])  # two seconds of the loop's reading time
    peers["wasteful"].wasted.tokens = 0.0  # its streams ended without a request: 10 s to refill
    for ip in ("quiet", "costly", "wasteful"):
        gate.release(peers[ip], conns[ip])
    assert gate.sweep() == 1 and set(gate.peers) == {"costly", "wasteful", "staying"}
    now[0] += 12.0  # eleven half-lives: 2 s decayed to under 1 ms
    assert gate.sweep() == 1 and set(gate.peers) == {"wasteful", "staying"}
    assert gate.admit("costly", FakeConnection("costly again")).cost.now(now[0]) == 0.0  # a fresh start
    peers["wasteful"].wasted.tokens = peers["wasteful"].wasted.capacity  # refilled
    assert gate.sweep() == 1 and set(gate.peers) == {"staying", "costly"}
    assert gate.sweep() == 0  # never one that still holds a connection


def test_a_full_table_costs_the_biggest_holder_not_the_newcomer() -> None:
    gate = Gate(ConnectionLimits(max_connections=10, max_connections_per_ip=100))
    held = {ip: [FakeConnection(f"{ip}#{i}") for i in range(n)] for ip, n in (("a", 6), ("b", 3), ("c", 1))}
    for ip, conns in held.items():
        for c in conns:
            gate.admit(ip, c)
    assert gate.connections == 10
    newcomer = FakeConnection("d#0")
    assert gate.admit("d", newcomer).ip == "d"  # admitted...
    assert [c.name for c in held["a"] if c.gone] == ["a#0"]  # ...and a's least recently active gave way
    assert gate.connections == 10 and gate.refused["connection_limit"] == 1
    assert list(gate.held_by()) == [("a", 5), ("b", 3), ("c", 1), ("d", 1)]
    # the holder that gave way is released once only, when its connection goes
    gate.release(gate.peers["a"], held["a"][0])
    assert gate.connections == 10
    for i in range(2):  # a keeps giving way until it holds no more than b
        gate.admit("e", FakeConnection(f"e#{i}"))
    assert sorted(gate.held_by())[:2] == [("a", 3), ("b", 3)]


def test_the_idlest_connection_gives_way() -> None:
    gate = Gate(ConnectionLimits(max_connections=4, max_connections_per_ip=100))
    conns = [
        FakeConnection("old"),
        FakeConnection("no stream", busy=False),
        FakeConnection("new"),
        FakeConnection("newest"),
    ]
    for c in conns:
        gate.admit("a", c)
    gate.admit("b", FakeConnection("b"))
    assert conns[1].gone  # a connection holding no stream goes first
    gate.peers["a"].touch(conns[0])  # "old" sent a request: now the most recently active
    gate.admit("c", FakeConnection("c"))
    assert conns[2].gone and not conns[0].gone  # then the one that sent nothing for longest


def test_an_address_over_its_cap_gives_way_to_its_own_newcomer() -> None:
    """Past half the table an address holds at most its cap: its newcomer takes the place of its idlest."""
    gate = Gate(ConnectionLimits(max_connections=6, max_connections_per_ip=3))
    mine = [FakeConnection(f"a#{i}") for i in range(3)]
    for c in mine:
        gate.admit("a", c)
    newcomer = FakeConnection("a#3")
    gate.admit("a", newcomer)
    assert mine[0].gone.startswith("a holds its limit of 3 connections") and not newcomer.gone
    assert gate.peers["a"].connections == 3


def test_the_top_holder_is_tracked_through_every_change() -> None:
    """The gate finds the biggest holder without walking the table: it stays right as counts move."""
    gate = Gate(ConnectionLimits(max_connections=1000, max_connections_per_ip=1000))
    conns: dict[str, list[FakeConnection]] = {}
    for i in range(300):
        ip = f"10.0.0.{i % 7}"
        c = FakeConnection(str(i))
        conns.setdefault(ip, []).append(c)
        gate.admit(ip, c)
    for ip, cs in conns.items():  # release some, unevenly
        for c in cs[: len(ip) * 5 % 37]:
            gate.release(gate.peers[ip], c)
    counts = {ip: p.connections for ip, p in gate.peers.items() if p.connections}
    assert next(gate.held_by())[1] == max(counts.values())
    assert sorted(n for _, n in gate.held_by()) == sorted(counts.values())


# ---- on loopback: raw HTTP/2 clients from many 127.0.0.x addresses ----


async def hold(port: int, ip: str, stream: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection from `ip`, with one valid EDS stream (its request sent) if `stream`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ip, 0))
    data = PREFACE
    if stream:
        body = bytes(DiscoveryRequest(node=Node(id=f"attacker-{ip}"), resource_names=["web"], type_url=EDS_TYPE_URL))
        data += frame(HEADERS, END_HEADERS, 1, hpack.Encoder().encode(REQUEST_HEADERS))
        data += frame(DATA, 0, 1, b"\x00" + len(body).to_bytes(4, "big") + body)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def fetch_from(port: int, ip: str) -> DiscoveryResponse:
    """The response to a request for "web" on a connection from `ip` (raw HTTP/2: grpclib's client
    cannot choose its source address)."""
    reader, writer = await hold(port, ip, stream=True)
    buffer, body = b"", b""
    try:
        for _ in range(1000):  # bounded
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            assert chunk, "closed before the response"
            got, buffer = split(buffer + chunk)
            body += b"".join(f.payload for f in got if f.type == DATA and f.stream_id == 1)
            if len(body) >= 5 and len(body) >= 5 + int.from_bytes(body[1:5], "big"):
                return DiscoveryResponse().parse(body[5 : 5 + int.from_bytes(body[1:5], "big")])
        raise AssertionError("no response")
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def attackers(port: int, ips: list[str], per_ip: int, stream: bool) -> AsyncIterator[list[asyncio.StreamWriter]]:
    held = []
    try:
        for ip in ips:
            for _ in range(per_ip):
                held.append(await hold(port, ip, stream))
        yield [w for _, w in held]
    finally:
        for _, w in held:
            w.close()


async def test_a_full_table_still_serves_a_new_address_and_an_attackers_address() -> None:
    ips = [f"127.0.0.{10 + i}" for i in range(10)]
    limits = ConnectionLimits(max_connections=30, max_connections_per_ip=100)
    async with serving(limits) as (server, _, port), attackers(port, ips, 3, stream=True):
        await wait_for(lambda: server.gate.connections == 30, timeout=10)
        await fetch_web(port)  # a client from a new address is served...
        response = await fetch_from(port, ips[0])  # ...and one from an attacker's address
        assert response.resources
        assert server.gate.connections <= 30
        assert server.gate.refused["connection_limit"] >= 2
        held = dict(server.gate.held_by())
        assert max(held.values()) <= 3


async def test_the_connection_that_gives_way_gets_goaway() -> None:
    limits = ConnectionLimits(max_connections=4, max_connections_per_ip=100)
    async with serving(limits) as (server, _, port):
        async with attackers(port, ["127.0.0.20"], 3, stream=True), attackers(port, ["127.0.0.21"], 1, stream=False):
            await wait_for(lambda: server.gate.connections == 4, timeout=10)
            first = await hold(port, "127.0.0.22", stream=True)
            await wait_for(lambda: server.gate.refused["connection_limit"] == 1, timeout=10)
            first[1].close()
        assert dict(server.gate.held_by()).get("127.0.0.20") in (None, 2)


async def test_a_connection_that_holds_no_stream_is_closed_though_it_answers_pings() -> None:
    limits = ConnectionLimits(request_timeout=0.3, idle_timeout=0.3)
    async with serving(limits, keepalive_time=0.1, keepalive_timeout=5) as (server, _, port):
        reader, writer = await hold(port, "127.0.0.30", stream=True)
        # the stream is answered and ended by the client: then the connection holds none
        writer.write(frame(DATA, 1, 1, b""))
        types = [t for t, _ in await read_frames(reader, wait=10, pong=writer)]
        writer.close()
        assert GOAWAY in types and PING in types  # closed, PINGs answered all along
        assert server.gate.refused["idle"] == 1 and server.gate.refused["no_stream"] == 0


async def test_many_streams_without_a_request_are_all_ended_in_batches() -> None:
    """Fast path: 600 streams opened at once without a request time out together; they are answered
    a batch at a time (SWEEP_BATCH, other connections' input read in between), every one of them,
    and counted."""
    async with serving(ConnectionLimits(request_timeout=0.3), max_streams_per_connection=1000) as (server, _, port):
        if not server.fast:
            pytest.skip("the fast path's sweep of streams held without a request")
        encoder = hpack.Encoder()
        opening = b"".join(frame(HEADERS, END_HEADERS, 2 * n + 1, encoder.encode(REQUEST_HEADERS)) for n in range(600))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(PREFACE + opening)
            ended: set[int] = set()
            buffer = b""
            for _ in range(10_000):  # bounded
                chunk = await asyncio.wait_for(reader.read(65536), 5)
                assert chunk, "closed"
                got, buffer = split(buffer + chunk)
                ended |= {f.stream_id for f in got if f.type == HEADERS and f.flags & END_STREAM}
                if len(ended) == 600:
                    break
        finally:
            writer.close()
        assert len(ended) == 600
        await wait_for(lambda: server.refused["no_request"] == 600, timeout=5)
        await fetch_web(port)


async def test_a_stream_without_a_request_is_ended_and_counted_on_either_path() -> None:
    """Headers only, no request: the fast path answers DEADLINE_EXCEEDED in trailers, the stock path
    resets the stream (RST_STREAM CANCEL); both count it as no_request and serve the next stream."""
    async with serving(ConnectionLimits(request_timeout=0.3)) as (server, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(PREFACE + frame(HEADERS, END_HEADERS, 1, hpack.Encoder().encode(REQUEST_HEADERS)))
            types = []
            buffer = b""
            for _ in range(100):  # bounded
                chunk = await asyncio.wait_for(reader.read(65536), 5)
                assert chunk, "closed"
                got, buffer = split(buffer + chunk)
                types += [(f.type, f.stream_id) for f in got]
                if (RST_STREAM, 1) in types or (HEADERS, 1) in types:
                    break
        finally:
            writer.close()
        await wait_for(lambda: server.refused["no_request"] == 1, timeout=5)
        await fetch_web(port)


def test_a_full_table_forgets_by_the_same_rule() -> None:
    """A burst of fresh addresses may fill the table between two sweeps: admitting the next one
    forgets what a sweep would (idle, cost decayed), and keeps an address still owing the loop."""
    now = [0.0]
    gate = Gate(ConnectionLimits(max_connections=4, max_connections_per_ip=100))
    gate.reads.clock = lambda: now[0]
    conns = {ip: FakeConnection(ip) for ip in ("a", "b", "c", "costly")}
    peers = {ip: gate.admit(ip, c) for ip, c in conns.items()}
    peers["costly"].cost.charge(2.0, now[0])
    for ip, conn in conns.items():
        gate.release(peers[ip], conn)
    gate.admit("newcomer", FakeConnection("newcomer"))
    assert set(gate.peers) == {"costly", "newcomer"}
