"""The send path (transport/grpc.py's sessions, over either HTTP/2 path) driven through in-memory
connections (support/memory_io.py): what reaches each stream, and when, depends only on the order
of the event loop, never on a socket's buffers or timing, so each case can wait for exactly what
it names and count what arrived. Every case runs on both paths (`http2`). The same behaviour over
real sockets: test_grpc.py, test_xds_edge_cases.py, h2/test_fanout_push.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpclib.server
import pytest

from eds_server.pb.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse
from eds_server.pb.google.rpc import Status as RpcStatus
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.h2_client import END_STREAM, WINDOW_UPDATE, Client, ack, data, first_request, frame, grpc
from tests.support.memory_io import MODES, MemoryServer, memory_server
from tests.support.waiting import wait_for

UNAVAILABLE = 14


@pytest.fixture(params=MODES)
def http2(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def server(http2: str) -> AsyncIterator[MemoryServer]:
    async with memory_server(http2, send_timeout=0.3) as held:
        yield held


async def subscribed(client: Client, node: str, *names: str) -> tuple[int, DiscoveryResponse]:
    """A SotW stream of `node` for `names`, its first response ACKed: its id and that response."""
    sid = await client.request(first_request(node, *names))
    r1 = await client.response(sid, 1)
    await client.send(data(sid, grpc(ack(r1, *names))))
    return sid, r1


def nack(resp: DiscoveryResponse, *names: str) -> DiscoveryRequest:
    """The answer that rejects `resp` (its nonce, the version held before it: none)."""
    return DiscoveryRequest(
        resource_names=list(names),
        response_nonce=resp.nonce,
        type_url=EDS_TYPE_URL,
        error_detail=RpcStatus(code=3, message="rejected for the test"),
    )


def names_of(server: MemoryServer, node: str) -> dict[str, dict[str, str | None]]:
    """What /v1/streams shows of node's one stream, by name: sent, acked, nacked."""
    found = [s for s in server.service.describe_streams()["streams"] if s["node"] == node]
    assert len(found) == 1, found
    return found[0]["names"]  # type: ignore[no-any-return]


async def test_a_change_reaches_every_stream_once(server: MemoryServer) -> None:
    """100 streams on 4 connections, each ACKed: one change is encoded once, and every stream gets
    exactly one response with it."""
    clients = [await server.client() for _ in range(4)]
    streams = [(c, *await subscribed(c, f"n{i}-{j}", "web")) for i, c in enumerate(clients) for j in range(25)]
    for c in clients:
        await c.ping()  # every ACK is read
    encodes, responses = server.store.encodes, server.service.counters.responses
    assert responses == 100

    server.update(1, 2)
    for c, sid, r1 in streams:
        r2 = await c.response(sid, 2)
        assert r2.version_info != r1.version_info and r2.nonce != r1.nonce
    for c in clients:
        await c.ping()
    assert all(len(c.messages[sid]) == 2 for c, sid, _ in streams)  # one each, none twice
    assert server.store.encodes == encodes + 1
    assert server.service.counters.responses == 200


async def test_a_response_waits_for_its_window_then_arrives_whole(server: MemoryServer) -> None:
    """A change whose response is larger than the stream's flow-control window left: the response
    waits (on the fast path it cannot be queued, so it is handed to the stream's task) and goes out
    whole once the client grants more, while a stream on another connection is answered meanwhile."""
    tight = await server.client(window=1000)  # the first response fits, a larger one will not
    sid, r1 = await subscribed(tight, "tight", "web")
    other = await server.client()
    o_sid, _ = await subscribed(other, "other", "web")

    server.update(*range(1, 101))  # some 3 KB
    assert len((await other.response(o_sid, 2)).resources) == 1  # not held up by the waiting stream
    await tight.ping()
    assert len(tight.messages[sid]) == 1 and tight.status(sid) is None  # only the window's worth came

    await tight.send(frame(WINDOW_UPDATE, 0, sid, (1 << 20).to_bytes(4, "big")))
    r2 = await tight.response(sid, 2)
    assert r2.version_info != r1.version_info
    assert names_of(server, "tight")["web"]["sent"] == r2.version_info
    assert server.service.counters.dropped == 0


async def test_nack_then_ack_round_trip(server: MemoryServer) -> None:
    """A NACK is kept as the rejected version and not answered with it again; the next change is
    sent, and its ACK clears the NACK."""
    client = await server.client()
    sid = await client.request(first_request("a", "web"))
    r1 = await client.response(sid, 1)
    await client.send(data(sid, grpc(nack(r1, "web"))))
    await client.ping()
    assert names_of(server, "a")["web"] == {"sent": r1.version_info, "acked": None, "nacked": r1.version_info}
    assert server.service.counters.nacks == 1 and server.service.counters.acks == 0
    assert len(client.messages[sid]) == 1  # no resend of what was rejected

    server.update(3)
    r2 = await client.response(sid, 2)
    assert r2.version_info != r1.version_info
    await client.send(data(sid, grpc(ack(r2, "web"))))
    await client.ping()
    assert names_of(server, "a")["web"] == {"sent": r2.version_info, "acked": r2.version_info, "nacked": None}
    assert server.service.counters.acks == 1 and server.service.counters.responses == 2


async def test_a_reader_that_stops_is_dropped_and_holds_up_no_one(server: MemoryServer) -> None:
    """A client stops reading while a large response is on its way to it: its connection's writes
    back up past the transport's limit, so a stream it opens then cannot be answered and is dropped
    after the send timeout (UNAVAILABLE), while another connection gets every change."""
    healthy = await server.client()
    h_sid, _ = await subscribed(healthy, "healthy", "web")
    # 1 KB reads, reading paused past 2 KB unread, writes paused past 4 KB unread
    slow = await server.client(high=4096, reader_limit=1024, chunk=1024)
    s_sid, _ = await subscribed(slow, "slow", "web")
    await slow.ping()

    server.update(*range(1, 1001))  # a response of some 30 KB to every stream
    r2 = await healthy.response(h_sid, 2)
    await healthy.send(data(h_sid, grpc(ack(r2, "web"))))
    client_end, server_end = server.transports[-1]
    await wait_for(lambda: not client_end.reading, what="the slow client's reads paused")
    assert server_end.write_paused
    if server.server.fast:  # nothing waits yet (the stock path's send of it may already have timed out)
        assert server.service.counters.dropped == 0

    late = await slow.request(first_request("slow-late", "web"))  # writes to the server still go
    server.update(*range(1, 1002))
    assert len((await healthy.response(h_sid, 3)).resources) == 1  # not held up
    # The fast path queued the large response whole; the stock path sends it through grpclib, which
    # waits for the transport between frames, so there that stream is dropped as well.
    dropped = ["slow-late"] if server.server.fast else ["slow", "slow-late"]
    await wait_for(lambda: server.service.counters.dropped == len(dropped), what="the unanswered streams dropped")
    assert {s["node"] for s in server.service.describe_streams()["streams"]} == {"healthy", "slow", "slow-late"} - set(
        dropped
    )

    client_end.resume_reading()  # the slow client reads again: what the server wrote comes
    assert await slow.until(lambda: slow.status(late) is not None), "no trailers on the dropped stream"
    assert slow.status(late) == UNAVAILABLE and slow.messages[late] == []
    if server.server.fast:
        assert await slow.until(lambda: len(slow.messages[s_sid]) == 2)  # the large response, whole
        assert slow.status(s_sid) is None
    else:
        assert await slow.until(lambda: slow.status(s_sid) is not None)
        assert slow.status(s_sid) == UNAVAILABLE and len(slow.messages[s_sid]) == 1
    assert server.service.counters.dropped == len(dropped)


async def test_a_client_that_ends_its_side_while_a_response_waits_gets_it_and_status_ok(server: MemoryServer) -> None:
    """The client half-closes while a response waits on its window: the reader's end comes due
    while the stream's task is at work. The response still goes out once the window opens, and the
    call ends with status OK (Envoy keeps its endpoints). The task used to wait on work already
    due, a move its table forbids: the call ended UNKNOWN."""
    tight = await server.client(window=1000)
    sid, _ = await subscribed(tight, "tight", "web")
    server.update(*range(1, 101))  # some 3 KB: waits on the window
    await tight.ping()
    await tight.send(data(sid, b"", END_STREAM))
    await tight.ping()
    await tight.send(frame(WINDOW_UPDATE, 0, sid, (1 << 20).to_bytes(4, "big")))
    assert len((await tight.response(sid, 2)).resources) == 1
    assert await tight.until(lambda: tight.status(sid) is not None)
    assert tight.status(sid) == 0


async def test_a_connection_of_many_calls_is_not_walked_for_each_new_one(
    server: MemoryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Envoy opens one call per EDS cluster on one connection (thousands). grpclib's handler
    walks every call it holds on every tenth new one (quadratic); ours drops each call as it ends,
    and walks none."""
    walks: list[int] = []
    walk = grpclib.server.Handler.__gc_collect__

    def counted(handler: grpclib.server.Handler) -> None:
        walks.append(len(handler._tasks))
        walk(handler)

    monkeypatch.setattr(grpclib.server.Handler, "__gc_collect__", counted)
    client = await server.client()
    sids = [await client.request(first_request(f"n{i}", "web")) for i in range(100)]
    for sid in sids:
        await client.response(sid, 1)
    assert len(server.service.sessions) == 100 and walks == []
