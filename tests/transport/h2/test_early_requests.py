"""A stream's first request read straight from its DATA frames, before its handler runs
(transport/h2/direct.py's EarlyRequest), over real loopback sockets with a raw HTTP/2 client.

Each test counts which way the first request went (`early_taken` on the connection's h2: read past
h2; `early_returned`: handed back to h2 and grpclib, read the usual way) and checks what the
session received, in order. Nothing measures time; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryRequest
from eds_server.transport.grpc import EdsService
from eds_server.transport.h2 import ConnectionLimits
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.grpc_harness import serving
from tests.support.h2_client import WAIT, Client, client_of, data, first_request, grpc, reader_of, tagged
from tests.support.h2frames import END_STREAM, RST_STREAM, SETTINGS, frame
from tests.support.hostile_clients import Conn
from tests.support.waiting import wait_for

pytestmark = pytest.mark.fast_path

FETCH = "/envoy.service.endpoint.v3.EndpointDiscoveryService/FetchEndpoints"
OK, FLOW_CONTROL_ERROR, RESOURCE_EXHAUSTED = 0, 3, 8


def h2_of(service: EdsService) -> Any:
    """The h2 connection of the service's streams (one connection in these tests)."""
    connections = {s.stream._stream.connection.h2 for s in service.sessions}
    assert len(connections) == 1
    return connections.pop()


def big_first_request(node: str, size: int = 60_000) -> DiscoveryRequest:
    """An Envoy-sized first request: its Node is most of it."""
    return DiscoveryRequest(
        node=Node(id=node, cluster="early", user_agent_name="x" * size), resource_names=["web"], type_url=EDS_TYPE_URL
    )


@contextlib.contextmanager
def tasks_made() -> Iterator[list[str]]:
    """The qualified names of the coroutines of every task made meanwhile on the running loop."""
    loop = asyncio.get_running_loop()
    made: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        yield made
    finally:
        loop.set_task_factory(None)


def frames_of(sid: int, message: bytes, size: int = 16_384) -> bytes:
    return b"".join(data(sid, message[i : i + size]) for i in range(0, len(message), size))


async def test_first_flights_of_many_streams_are_read_past_h2(handled: Callable[[str], list[bytes]]) -> None:
    """Twenty streams, each its HEADERS and a 60 KB first request in four DATA frames, in one write
    (as an Envoy starts): every first request is taken whole, every stream answered, then ACKs go
    the direct way. A stream whose request is whole when its call starts makes no reader task: its
    call's task reads the request there and then, and the direct reader reads the rest. (On a
    loaded host a call may start between two of its request's frames, the rest of the write still
    queued: that request is read the usual way, by a reader task. A few may; most may not.)"""
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        flight, sids = b"", []
        for i in range(20):
            sid, opening = client.new_stream()
            sids.append(sid)
            flight += opening + frames_of(sid, grpc(big_first_request(f"n{i}")))
        with tasks_made() as made:
            await client.send(flight)
            for sid in sids:
                await client.response(sid, 1)
        calls = [name for name in made if name.startswith("ReleasingHandler.")]  # (the client's own are the rest)
        h2 = h2_of(service)
        assert h2.early_taken + h2.early_returned == 20 and h2.early_returned <= 5
        assert len(calls) == 20 and made.count("StreamSession.read") <= 5
        for i in range(20):
            assert handled(f"n{i}") == [bytes(big_first_request(f"n{i}"))]
        assert not [s for s in h2.direct if s not in sids]  # nothing left behind
        await client.send(data(sids[0], grpc(tagged("t1"))))
        await wait_for(lambda: len(handled("n0")) == 2, timeout=WAIT)
        reader = reader_of(service, "n0")
        assert reader is not None and reader.messages == 1  # the direct reader took over


async def test_a_first_request_in_one_frame_is_kept_as_read_unless_small_in_its_read(
    handled: Callable[[str], list[bytes]],
) -> None:
    """A request in one DATA frame (an Envoy's, under our 1 MB frame size) is kept as it was read,
    not joined into a copy; a small one in a big read is copied, so it does not keep that read
    alive (at most PIN_RATIO times its size). Either way the session gets it whole."""
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        flight, sids = b"", []
        for i in range(4):
            sid, opening = client.new_stream()
            sids.append(sid)
            flight += opening + data(sid, grpc(big_first_request(f"big{i}")))  # 60 KB, one frame
        for i in range(20):
            sid, opening = client.new_stream()
            sids.append(sid)
            flight += opening + data(sid, grpc(first_request(f"small{i}", "web")))  # tens of bytes
        await client.send(flight)
        for sid in sids:
            await client.response(sid, 1)
        h2 = h2_of(service)
        assert (h2.early_taken, h2.early_returned) == (24, 0)
        assert h2.early_kept == 4  # the big ones; the small ones copied
        assert all(handled(f"big{i}") == [bytes(big_first_request(f"big{i}"))] for i in range(4))
        assert all(len(handled(f"small{i}")) == 1 for i in range(20))


async def test_a_first_request_not_whole_when_its_handler_reads_is_read_the_usual_way(
    handled: Callable[[str], list[bytes]],
) -> None:
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        sid, opening = client.new_stream()
        request = grpc(big_first_request("a"))
        await client.send(opening + data(sid, request[:20_000]))
        await wait_for(lambda: len(service.sessions) == 1, timeout=WAIT)  # its handler runs, and waits
        await asyncio.sleep(0.05)  # its first read has found the request begun (a pause, not a measure)
        await client.send(frames_of(sid, request[20_000:]))
        await client.response(sid, 1)
        h2 = h2_of(service)
        assert (h2.early_taken, h2.early_returned) == (0, 1)
        assert handled("a") == [bytes(big_first_request("a"))]
        assert sid not in h2.direct or reader_of(service, "a") is not None


async def test_two_messages_before_the_handler_runs_are_both_read_in_order(
    handled: Callable[[str], list[bytes]],
) -> None:
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        sid, opening = client.new_stream()
        # the second message begins inside the first's last frame, and has a frame of its own too
        both = grpc(first_request("a", "web")) + grpc(tagged("t1"))
        await client.send(opening + data(sid, both[:-10]) + data(sid, both[-10:]))
        await client.response(sid, 1)
        await wait_for(lambda: len(handled("a")) == 2, timeout=WAIT)
        assert handled("a") == [bytes(first_request("a", "web")), tagged("t1")]
        assert (h2_of(service).early_taken, h2_of(service).early_returned) == (0, 1)


async def test_a_unary_call_ends_its_request_through_h2(caplog: pytest.LogCaptureFixture) -> None:
    """FetchEndpoints: the request's last frame ends the stream, so it is handed back, whole."""
    async with serving(ConnectionLimits()) as (_server, _service, port), client_of(port) as client:
        sid, opening = client.new_stream(FETCH)
        request = grpc(first_request("a", "web"))
        await client.send(opening + data(sid, request[:7]) + data(sid, request[7:], END_STREAM))
        await client.response(sid, 1)
        assert await client.until(lambda: client.status(sid) is not None)
        assert client.status(sid) == OK
        assert "Traceback" not in caplog.text


async def test_an_oversize_first_request_is_refused_as_before(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with (
        serving(ConnectionLimits(), max_message_size=1 << 16) as (_server, _service, port),
        client_of(port) as client,
    ):
        sid, opening = client.new_stream()
        request = grpc(big_first_request("a", size=100_000))
        await client.send(opening + frames_of(sid, request[:60_000]))
        assert await client.until(lambda: client.status(sid) is not None)
        assert client.status(sid) == RESOURCE_EXHAUSTED
        assert "Traceback" not in caplog.text


@pytest.mark.parametrize("then", ["reset", "unread"])
async def test_a_first_request_begun_and_abandoned_leaves_nothing_behind(then: str) -> None:
    """Reset in the middle of its first request, or its call ended by the server without reading
    it (here: the server is stopping): no early reader stays, and its bytes are acknowledged to
    h2, which grants them back (over half the connection's window here: at once)."""
    async with serving(ConnectionLimits()) as (server, service, port), client_of(port) as client:
        sid, opening = client.new_stream()
        request = grpc(big_first_request("a", size=3_000_000))[:2_200_000]
        granted = client.updates.get(0, 0)
        if then == "reset":
            await client.send(opening + frames_of(sid, request) + frame(RST_STREAM, 0, sid, b"\x00\x00\x00\x08"))
        else:
            service.stopping = True  # calls end at once, unread (UNAVAILABLE)
            await client.send(opening + frames_of(sid, request))
            assert await client.until(lambda: client.status(sid) is not None)
        (protocol,) = server.open  # type: ignore[attr-defined]
        h2 = protocol.h2
        await wait_for(lambda: not h2.direct, timeout=WAIT)
        assert await client.until(lambda: client.updates.get(0, 0) > granted)  # the connection's window back
        assert h2.early_taken == 0


async def test_a_first_request_past_its_window_is_refused_by_h2_as_always() -> None:
    """Counted against h2's receive windows as it comes: a client that sends past the stream's
    window (65,535 bytes until it acknowledges our SETTINGS) is refused by h2, FLOW_CONTROL_ERROR,
    as when h2 read every frame."""
    async with serving(ConnectionLimits()) as (_server, _service, port):
        client = Client(await Conn.open(port, "127.0.0.1"))
        try:
            sid, opening = client.new_stream()
            request = grpc(big_first_request("a", size=100_000))[: 5 * 16_384]
            await client.send(frame(SETTINGS, 0, 0) + opening + frames_of(sid, request))  # no ACK of ours yet
            assert await client.until(lambda: client.goaway is not None)
            assert client.goaway == FLOW_CONTROL_ERROR
        finally:
            client.close()
