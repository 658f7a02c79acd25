"""A fleet connecting at once is not taken for a flood of HEADERS, on either HTTP/2 path, and the
flood still is: streams awaiting their first request are bounded server-wide, but not while the
request may wait in our own read queue. Every client is on 127.0.0.0/8; the bounds are scaled down."""

from __future__ import annotations

import asyncio
import contextlib

from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.transport.h2.limits import ConnectionLimits
from eds_server.transport.h2.overload import MemoryWatermark
from tests.support.grpc_harness import serving
from tests.support.h2_client import Client, data, first_request, grpc
from tests.support.waiting import wait_for

MB = 1 << 20
FRAME = 16_000  # DATA frames within the 16 KiB both paths take before our SETTINGS
INITIAL_WINDOW = 65_535


def big_request(node: str, size: int) -> bytes:
    """An Envoy-like first request: its Node padded to `size` bytes."""
    request = first_request(node, "web")
    request.node = Node(id=node, cluster="direct", user_agent_name="x" * size)
    return grpc(request)


def data_frames(sid: int, body: bytes) -> list[bytes]:
    return [data(sid, body[at : at + FRAME]) for at in range(0, len(body), FRAME)]


async def test_streams_whose_requests_wait_in_our_read_queue_do_not_trip_the_server_wide_watermark() -> None:
    """Twelve connections from distinct addresses each write twenty HEADERS and then their
    twenty 20 KB requests at once; the read scheduler is slowed to one slice a turn, so each
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
            reads.turn_budget = 1e-9  # one slice a turn
            reads.call_soon = lambda f: loop.call_later(0.05, f)
            sids: dict[Client, list[int]] = {}
            for n, client in enumerate(clients):
                opened = [client.new_stream() for _ in range(20)]
                sids[client] = [sid for sid, _ in opened]
                bodies = [b"".join(data_frames(sid, big_request(f"c{n}-{sid}", 20_000))) for sid, _ in opened]
                await client.send(b"".join(opening for _, opening in opened) + b"".join(bodies))
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
