"""The memory watermark (transport/h2/overload.py): past it, the address holding the most gives way,
never a lighter one. Its choice and actions as pure logic, then on a real server on either path,
with the resident size in the test's hands."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from eds_server.transport.h2.limits import ConnectionLimits, Gate
from eds_server.transport.h2.overload import LAG_WATERMARK, PRESSURE, MemoryWatermark, default_limit, process_rss
from tests.support.grpc_harness import serving
from tests.support.h2_client import SOURCE, Client, ack, client_of, data, first_request, group, grpc, tagged

MB = 1 << 20


class Holding:
    def __init__(self, memory: int, awaiting: int = 0, back: bool = False) -> None:
        self.held, self.gone, self.streams, self.back = memory, "", awaiting, back

    def busy(self) -> bool:
        return True

    def give_way(self, why: str) -> None:
        self.gone = why

    def memory(self) -> int:
        return self.held

    def awaiting(self) -> int:
        return self.streams

    def held_back(self) -> bool:
        return self.back


def test_the_heaviest_address_opens_no_stream_under_pressure_and_gives_way_past_the_limit() -> None:
    gate = Gate(ConnectionLimits())
    light, heavy_small, heavy_big = Holding(1 * MB), Holding(2 * MB), Holding(30 * MB)
    canary = gate.admit("127.0.0.1", light)
    attacker = gate.admit("127.0.0.2", heavy_small)
    gate.admit("127.0.0.2", heavy_big)
    rss = [10 * MB]
    watermark = MemoryWatermark(gate, 100 * MB, rss=lambda: rss[0])
    watermark.check()
    assert not attacker.throttled and gate.refused["overload"] == 0  # below the pressure mark: nothing
    rss[0] = int(100 * MB * PRESSURE) + 1
    watermark.check()
    assert attacker.throttled and not attacker.may_open() and canary.may_open()
    assert not heavy_big.gone and gate.refused["overload"] == 1  # refused new streams, nothing closed
    watermark.check()
    assert gate.refused["overload"] == 1  # said once, not every check
    rss[0] = 101 * MB
    watermark.check()
    assert "holds the most" in heavy_big.gone and not heavy_small.gone and not light.gone
    assert watermark.closed == 1 and gate.refused["overload"] == 2
    watermark.check()  # still over: its next heaviest connection
    assert heavy_small.gone and not light.gone
    rss[0] = 10 * MB
    watermark.check()
    assert not attacker.throttled and attacker.may_open()


def test_each_check_tells_how_many_idle_addresses_it_forgot() -> None:
    """What the check's sweep forgot is passed on (the server has its heap trimmed then: each address's
    state was allocated among its streams, and is freed only now, seconds after they ended)."""
    gate = Gate(ConnectionLimits())
    told: list[int] = []
    watermark = MemoryWatermark(gate, 100 * MB, rss=lambda: 10 * MB, forgotten=told.append)
    gone = [Holding(0) for _ in range(3)]
    peers = [gate.admit(f"127.0.0.{i + 1}", h) for i, h in enumerate(gone)]
    watermark.check()
    assert told == []  # every address holds a connection
    for peer, holding in zip(peers, gone, strict=True):
        gate.release(peer, holding)
    watermark.check()
    watermark.check()
    assert told == [3]  # once, with how many


def test_past_the_watermark_of_streams_awaiting_a_request_the_connections_holding_most_give_way() -> None:
    gate = Gate(ConnectionLimits())
    envoy = Holding(0, awaiting=5)
    fresh = [Holding(0, awaiting=n) for n in (3000, 9000, 6000, 100)]
    gate.admit("127.0.0.1", envoy).pending = 5
    for i, holder in enumerate(fresh):  # each from an address of its own, each under its own bound
        gate.admit(f"127.1.0.{i}", holder).pending = holder.streams
    watermark = MemoryWatermark(gate, 100 * MB, rss=lambda: 10 * MB, awaiting_watermark=10_000)
    watermark.check()
    assert [bool(h.gone) for h in fresh] == [False, True, False, False]  # 18,105 less 9,000: under
    assert "await a request" in fresh[1].gone and not envoy.gone
    assert gate.refused["overload"] == 1
    gate.peers["127.1.0.1"].pending = 0  # its connection gone
    watermark.check()
    assert gate.refused["overload"] == 1  # under the watermark: nothing more


def test_a_fleet_held_back_by_its_first_window_has_a_watermark_of_its_own() -> None:
    """A fleet connecting at once: each connection's streams wait for the window the client does
    not know yet (its first 65,535 bytes carried one request). They count against a watermark of
    their own, so a fleet does not trip the one for streams that could send and do not (a flood of
    HEADERS); past theirs, they give way the same way."""
    gate = Gate(ConnectionLimits())
    fleet = [Holding(0, awaiting=98, back=True) for _ in range(300)]  # 29,400 held back
    flood = Holding(0, awaiting=900)
    for i, holder in enumerate(fleet):
        peer = gate.admit(f"127.1.{i // 250}.{1 + i % 250}", holder)
        peer.pending = peer.held_back = holder.streams
    gate.admit("127.2.0.1", flood).pending = flood.streams
    watermark = MemoryWatermark(
        gate, 100 * MB, rss=lambda: 10 * MB, awaiting_watermark=1_000, held_back_watermark=50_000
    )
    watermark.check()
    assert not any(h.gone for h in fleet) and not flood.gone  # 900 and 29,400: each under its own
    later = Holding(0, awaiting=200)
    gate.admit("127.2.0.2", later).pending = later.streams
    watermark.check()
    assert "await a request" in flood.gone and not later.gone  # 1,100 past 1,000: the heaviest of them
    assert not any(h.gone for h in fleet)  # though each fleet connection holds fewer, it is not theirs to pay
    watermark.held_back_watermark = 29_000
    watermark.check()
    gone = [h for h in fleet if h.gone]
    assert len(gone) == 5 and "the window the client does not know yet" in gone[0].gone  # 29,400 less 5 x 98


def test_memory_the_server_holds_itself_closes_nobody() -> None:
    gate = Gate(ConnectionLimits())
    idle = Holding(0)
    gate.admit("127.0.0.1", idle)
    watermark = MemoryWatermark(gate, 100 * MB, rss=lambda: 200 * MB)
    watermark.check()
    assert not idle.gone and gate.refused["overload"] == 0


def test_a_late_loop_refuses_new_streams_to_the_address_that_cost_it_most_and_only_while_late() -> None:
    gate = Gate(ConnectionLimits())
    now = gate.reads.clock()
    canary = gate.admit("127.0.0.1", Holding(0))
    attacker = gate.admit("127.0.0.2", Holding(0))
    canary.cost.charge(0.05, now)
    attacker.cost.charge(2.0, now)
    watermark = MemoryWatermark(gate, 100 * MB, rss=lambda: 10 * MB)
    watermark.check(lag=LAG_WATERMARK / 2)
    assert not attacker.throttled and gate.refused["overload"] == 0  # late, not that late
    watermark.check(lag=LAG_WATERMARK)
    assert attacker.throttled and not attacker.may_open() and canary.may_open()
    assert gate.refused["overload"] == 1 and not canary.throttled
    watermark.check(lag=LAG_WATERMARK)
    assert gate.refused["overload"] == 1  # said once
    watermark.check(lag=0.01)
    assert not attacker.throttled and attacker.may_open()  # on time again: lifted

    alone = Gate(ConnectionLimits())  # one address: nobody to be fair to, nobody refused
    envoy = alone.admit("127.0.0.1", Holding(0))
    envoy.cost.charge(2.0, alone.reads.clock())
    MemoryWatermark(alone, 100 * MB, rss=lambda: 10 * MB).check(lag=5.0)
    assert not envoy.throttled and alone.refused["overload"] == 0

    even = Gate(ConnectionLimits())  # no address took most of it: nobody refused
    for ip in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
        even.admit(ip, Holding(0)).cost.charge(1.0, even.reads.clock())
    MemoryWatermark(even, 100 * MB, rss=lambda: 10 * MB).check(lag=5.0)
    assert not any(p.throttled for p in even.peers.values())


def test_the_defaults_read_this_machine() -> None:
    assert process_rss() > 1 * MB
    assert default_limit() > 100 * MB


@contextlib.asynccontextmanager
async def canary_and_heavy() -> AsyncIterator[tuple[Any, Any, Client, int, Client, int]]:
    """A real server; the canary at 127.0.0.1 with a stream answered and ACKed, and a client at
    127.0.0.2 with a stream answered: (server, service, canary, its stream, heavy, its stream)."""
    async with (
        serving(ConnectionLimits()) as (server, service, port),
        client_of(port) as canary,
        client_of(port, "127.0.0.2") as heavy,
    ):
        sid = await canary.request(first_request("canary", "web"))
        await canary.send(data(sid, grpc(ack(await canary.response(sid, 1), "web"))))
        held = await heavy.request(first_request("heavy", "web"))
        await heavy.response(held, 1)
        yield server, service, canary, sid, heavy, held


async def send_in_frames(client: Client, sid: int, body: bytes) -> None:
    """`body` as DATA frames within the stock path's 16 KiB too, then a PING: all of it read."""
    for at in range(0, len(body), 16_000):
        await client.send(data(sid, body[at : at + 16_000]))
    await client.ping()


async def test_past_the_limit_the_connection_holding_partial_messages_is_closed_not_the_canary() -> None:
    """On a real server: a client at 127.0.0.2 holds half of a 1 MB message; with the resident size
    said to be over the limit, its connection gets GOAWAY, and the canary's next change still comes."""
    async with canary_and_heavy() as (server, service, canary, sid, heavy, held):
        body = (1 << 20).to_bytes(5, "big") + b"x" * 60_000  # begun, never ended
        await send_in_frames(heavy, held, body)
        assert server.gate.peers["127.0.0.2"].partial == 1 << 20
        watermark = MemoryWatermark(server.gate, 100 * MB, rss=lambda: 200 * MB)
        watermark.check()
        assert await heavy.until(lambda: heavy.goaway is not None or heavy.eof), "the heavy one is not closed"
        assert server.gate.refused["overload"] == 2
        service.store.update(SOURCE, group(2))
        await canary.response(sid, 2)
        assert canary.goaway is None


async def test_on_a_real_server_a_late_loop_refuses_the_costly_address_a_stream_and_serves_the_canary() -> None:
    """Either path: a client at 127.0.0.2 has spent most of the reading time (4 MB of requests on
    its stream); the loop said to be a watermark late, its next stream is refused, while
    the canary opens one and is answered, and its first stream goes on getting changes."""
    async with canary_and_heavy() as (server, service, canary, sid, heavy, held):
        for i in range(20):  # reading 4 MB costs more than all the canary sent; requests it ignores
            await send_in_frames(heavy, held, grpc(tagged(f"heavy-{i}", 200_000)))
        now = server.gate.reads.clock()
        costs = {ip: server.gate.peers[ip].cost.now(now) for ip in ("127.0.0.1", "127.0.0.2")}
        assert costs["127.0.0.2"] > costs["127.0.0.1"], costs
        MemoryWatermark(server.gate, 100 * MB, rss=lambda: 10 * MB).check(lag=LAG_WATERMARK)
        assert server.gate.peers["127.0.0.2"].throttled and server.gate.refused["overload"] == 1
        refused = await heavy.request(first_request("heavy", "web"))
        assert await heavy.until(lambda: refused in heavy.resets or heavy.goaway is not None or heavy.eof)
        second = await canary.request(first_request("canary-2", "web"))
        await canary.response(second, 1)  # the canary's new stream is served
        service.store.update(SOURCE, group(2))
        await canary.response(sid, 2)
        assert canary.goaway is None and not server.gate.peers["127.0.0.1"].throttled
