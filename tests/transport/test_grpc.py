"""The gRPC service in-process, driven by a grpclib client speaking the wire protocol like Envoy."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from grpclib import GRPCError
from grpclib.const import Cardinality, Status

from eds_server.encode import encode_group
from eds_server.metrics import make_registry
from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
)
from eds_server.pb.envoy.service.endpoint.v3 import EndpointDiscoveryServiceStub
from eds_server.pb.grpc.health.v1 import HealthCheckRequest, HealthStub
from eds_server.pb.grpc.health.v1 import HealthCheckResponseServingStatus as Serving
from eds_server.store import Store
from eds_server.transport.grpc import EDS_SERVICE, EdsService, SendState, make_server
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.grpc_harness import SOURCE, STREAM, Harness, cla_of, first, group, no_message, recv, reply
from tests.support.h2frames import GOAWAY, PING, PREFACE, frame, split
from tests.support.waiting import wait_for

# a StreamEndpoints call's request headers, for the raw HTTP/2 clients below
REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", STREAM),
    (":authority", "test"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


def raw_client(window: int = 0, stream_window: int = 0) -> Any:
    """h2's client connection, its preface and SETTINGS queued: `window` opens both the stream and
    the connection windows that far, `stream_window` sets the streams' alone."""
    import h2.config
    import h2.connection
    from h2.settings import SettingCodes

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    if window or stream_window:
        conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: window or stream_window})
    if window:
        conn.increment_flow_control_window(window)
    return conn


async def test_nothing_is_sent_before_sources_load(harness: Harness) -> None:
    async with harness.stream() as stream:
        await stream.send_message(first("web"))
        await no_message(stream)
        harness.store.update(SOURCE, {"web": group("web", 1)})
        resp = await recv(stream)
        assert cla_of(resp).cluster_name == "web"
        assert len(cla_of(resp).endpoints[0].lb_endpoints) == 1


async def test_push_ack_change_and_one_encode_per_change(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(harness.stream()) for _ in range(5)]
        firsts = []
        for s in opened:
            await s.send_message(first("web"))
            firsts.append(await recv(s))
            await s.send_message(reply(firsts[-1], "web"))
        encodes = harness.store.encodes
        harness.store.update(SOURCE, {"web": group("web", 1, 2)})
        for s, before in zip(opened, firsts, strict=True):
            resp = await recv(s)
            assert resp.version_info != before.version_info
            assert len(cla_of(resp).endpoints[0].lb_endpoints) == 2
        assert harness.store.encodes == encodes + 1  # once, whatever the number of subscribers


async def test_nack_is_not_answered_with_the_same_version(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as stream:
        await stream.send_message(first("web"))
        r1 = await recv(stream)
        await stream.send_message(reply(r1, "web", error="rejected for the test"))
        await no_message(stream)  # no resend loop
        assert harness.service.counters.nacks == 1
        harness.store.update(SOURCE, {"web": group("web", 3)})
        r2 = await recv(stream)
        assert r2.version_info != r1.version_info
        await stream.send_message(reply(r2, "web", error="again"))
        await no_message(stream)
        assert harness.service.counters.responses == 2


async def test_stale_nonce_gets_no_response(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as stream:
        await stream.send_message(first("web"))
        r1 = await recv(stream)
        stale = DiscoveryResponse(version_info=r1.version_info, nonce="stale")
        await stream.send_message(reply(stale, "web", "other"))
        await no_message(stream)
        await stream.send_message(reply(r1, "web", "other"))  # current nonce: answered
        r2 = await recv(stream)
        assert [cla_of(r2, i).cluster_name for i in range(len(r2.resources))] == ["other"]


async def test_reconnect_with_current_version_is_not_resent(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    version = harness.store.get("web").version
    async with harness.stream() as stream:
        await stream.send_message(first("web", version=version))
        await no_message(stream)
        harness.store.update(SOURCE, {"web": group("web", 2)})
        assert (await recv(stream)).version_info == harness.store.get("web").version


@pytest.mark.parametrize(
    ("request_", "status"),
    [
        (DiscoveryRequest(resource_names=["web"]), Status.INVALID_ARGUMENT),  # no node
        (DiscoveryRequest(node=Node(id="n"), type_url="type.googleapis.com/x.Y"), Status.INVALID_ARGUMENT),
        (DiscoveryRequest(node=Node(id="n"), resource_names=["x" * 2000]), Status.INVALID_ARGUMENT),
        (DiscoveryRequest(node=Node(id="n"), resource_names=["a"] * 10_001), Status.RESOURCE_EXHAUSTED),
        (
            DiscoveryRequest(node=Node(id="n"), resource_names=["a" * 1000] * 1100),
            Status.RESOURCE_EXHAUSTED,
        ),  # over --max-message-size
    ],
)
async def test_bad_requests_get_grpc_errors(harness: Harness, request_: DiscoveryRequest, status: Status) -> None:
    harness.store.update(SOURCE, {})
    with pytest.raises(GRPCError) as e:
        async with harness.stream() as stream:
            await stream.send_message(request_)
            await recv(stream)
    assert e.value.status == status
    async with harness.stream() as stream:  # the server is fine
        await stream.send_message(first("web"))
        assert cla_of(await recv(stream)).cluster_name == "web"


async def test_garbage_bytes_are_an_error_not_a_crash(harness: Harness) -> None:
    harness.store.update(SOURCE, {})
    harness.channel._codec = _RawCodec()  # type: ignore[assignment]
    with pytest.raises(GRPCError) as e:
        async with harness.channel.request(STREAM, Cardinality.STREAM_STREAM, bytes, bytes) as stream:
            await stream.send_message(b"\xff\xff\xff\xff\x0f garbage")
            await stream.recv_message()
    assert e.value.status == Status.INVALID_ARGUMENT


class _RawCodec:
    __content_subtype__ = "proto"

    def encode(self, message: bytes, message_type: Any) -> bytes:
        return message

    def decode(self, data: bytes, message_type: Any) -> bytes:
        return data


async def test_generated_stub_and_fetch(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1, 2)})
    stub = EndpointDiscoveryServiceStub(harness.channel)
    resp = await stub.fetch_endpoints(first("web", "nope"))
    assert [cla_of(resp, i).cluster_name for i in range(2)] == ["web", "nope"]
    assert len(cla_of(resp, 1).endpoints) == 0


async def test_delta_stream(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    path = "/envoy.service.endpoint.v3.EndpointDiscoveryService/DeltaEndpoints"
    async with harness.channel.request(
        path, Cardinality.STREAM_STREAM, DeltaDiscoveryRequest, DeltaDiscoveryResponse
    ) as stream:
        await stream.send_message(
            DeltaDiscoveryRequest(
                node=Node(id="d"),
                type_url=EDS_TYPE_URL,
                resource_names_subscribe=["web", "nope"],
                initial_resource_versions={"nope": harness.store.get("nope").version},
            )
        )
        r1 = await recv(stream)
        assert [r.name for r in r1.resources] == ["web"]  # "nope" was current already
        assert r1.resources[0].version == harness.store.get("web").version
        await stream.send_message(DeltaDiscoveryRequest(response_nonce=r1.nonce))
        harness.store.update(SOURCE, {"web": group("web", 1, 2)})
        r2 = await recv(stream)
        cla = endpoint_pb2.ClusterLoadAssignment.FromString(r2.resources[0].resource.value)
        assert len(cla.endpoints[0].lb_endpoints) == 2
        await stream.cancel()


async def test_health_follows_readiness(harness: Harness) -> None:
    health = HealthStub(harness.channel)
    assert (await health.check(HealthCheckRequest())).status == Serving.NOT_SERVING
    harness.store.update(SOURCE, {})
    resp = await health.check(HealthCheckRequest(service=EDS_SERVICE))
    assert resp.status == Serving.SERVING
    with pytest.raises(GRPCError) as e:
        await health.check(HealthCheckRequest(service="nope"))
    assert e.value.status == Status.NOT_FOUND


async def test_stop_ends_streams_cleanly(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as stream:
        await stream.send_message(first("web"))
        await recv(stream)
        harness.service.stop()
        assert await asyncio.wait_for(stream.recv_message(), 5) is None  # trailers, status OK
    assert harness.service.open_streams == 0


async def test_oversize_length_prefix_is_refused_before_the_body(harness: Harness) -> None:
    harness.store.update(SOURCE, {})
    with pytest.raises(GRPCError) as e:
        async with harness.stream() as stream:
            await stream.send_request()
            # announce a 1 GiB message and send none of it: the server must not wait for it
            await stream._stream.send_data(b"\x00" + (1 << 30).to_bytes(4, "big"))
            await recv(stream)
    assert e.value.status == Status.RESOURCE_EXHAUSTED


async def test_streams_reset_right_after_a_response_leave_nothing_behind(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    for _ in range(50):  # bounded
        async with harness.stream() as stream:
            await stream.send_message(first("web"))
            await recv(stream)
        # the context manager resets the stream, as a departing Envoy does
    await wait_for(lambda: harness.service.open_streams == 0 and not harness.store.subscriptions())
    assert harness.service.open_streams == 0
    assert not harness.store.subscriptions() and not list(harness.store.followed())
    assert harness.service.counters.streams_opened == 50


async def test_keepalive_pings_close_a_silent_connection() -> None:
    """A half-open client (one that never answers PING) is dropped by the server's keepalive."""
    store = Store(encode_group)
    server = make_server(
        EdsService(store),
        max_streams_per_connection=10,
        keepalive_time=0.2,
        keepalive_timeout=0.3,
        max_message_size=1 << 20,
    )
    await server.start("127.0.0.1", 0)
    port = server.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(PREFACE)
        await writer.drain()
        frame_types: list[int] = []
        buffer = b""
        for _ in range(200):  # bounded: at most ~10 s
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                break  # the server closed the connection
            frames, buffer = split(buffer + chunk)
            frame_types += [f.type for f in frames]
        assert PING in frame_types
        assert not chunk  # closed, since we never answered it
        assert server.refused["keepalive"] == 1  # counted (and logged), not closed in silence
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def test_a_ping_ack_that_does_not_echo_ours_is_no_answer() -> None:
    """A client that never reads cannot answer a PING it never saw: ACKs sent blind, with a payload
    of their own, keep nothing open (on either path), and each is charged as a control frame."""
    store = Store(encode_group)
    server = make_server(
        EdsService(store),
        max_streams_per_connection=10,
        keepalive_time=0.2,
        keepalive_timeout=0.3,
        max_message_size=1 << 20,
        http2=os.environ.get("EDS_HTTP2", "auto"),
    )
    await server.start("127.0.0.1", 0)
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(PREFACE)
        blind = 0
        for _ in range(60):  # bounded: ~3 s of blind ACKs, one every 50 ms; closed after ~0.5 s
            writer.write(frame(PING, 1, 0, b"\x00" * 8))
            blind += 1
            await asyncio.sleep(0.05)
            if server.connections == 0:
                break
        assert server.connections == 0, f"still open after {blind} blind ACKs"
        assert blind >= 5  # the floor: it did send ACKs past the first PING's timeout
        assert server.refused["keepalive"] == 1
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def test_a_client_busy_sending_requests_is_alive_though_its_answer_is_late() -> None:
    """A client's PING ACK may wait in its own output behind megabytes of its requests (a fleet's
    first flights): requests received since the PING count as alive, and the next PING asks again.
    Once it sends nothing more, the unanswered PING closes it. The client here never reads, so it
    answers no PING: only its requests (new streams, each with a request) keep it."""
    import socket

    store = Store(encode_group)  # no source loaded: nothing is sent on the streams
    server = make_server(
        EdsService(store),
        max_streams_per_connection=100,
        keepalive_time=0.2,
        keepalive_timeout=0.3,
        max_message_size=1 << 20,
        http2=os.environ.get("EDS_HTTP2", "auto"),
    )
    await server.start("127.0.0.1", 0)
    conn = raw_client()
    body = bytes(first("web"))
    sock = socket.socket()
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        for n in range(20):  # bounded: a stream with its request every 0.1 s, 2 s in all
            sid = 1 + 2 * n
            conn.send_headers(sid, REQUEST_HEADERS)
            conn.send_data(sid, b"\x00" + len(body).to_bytes(4, "big") + body)
            await loop.sock_sendall(sock, conn.data_to_send())
            await asyncio.sleep(0.1)
        counts = server.keepalive  # type: ignore[attr-defined]  # both paths' servers count them
        assert server.connections == 1 and server.refused["keepalive"] == 0, counts
        assert counts["busy"] >= 3 and counts["answered"] == 0, counts  # the floor: PINGs went unanswered
        await wait_for(lambda: server.connections == 0, what="closed once it sends nothing more")
        assert server.refused["keepalive"] == 1
    finally:
        sock.close()
        server.close()
        await server.wait_closed()


async def test_keepalive_waits_for_an_answer_held_in_our_own_read_queue() -> None:
    """A PING ACK that arrived in time but waits in the server's own read queue (a fleet's first
    requests ahead of it) is the server's wait, not the client's: the connection stays, and the
    answer counts once read. Here the queue is held by the read scheduler's next turn coming only
    after the keepalive timeout."""
    store = Store(encode_group)
    server = make_server(
        EdsService(store),
        max_streams_per_connection=10,
        keepalive_time=0.3,
        keepalive_timeout=0.3,
        max_message_size=1 << 20,
        http2=os.environ.get("EDS_HTTP2", "auto"),
    )
    await server.start("127.0.0.1", 0)
    reads = server.gate.reads  # type: ignore[attr-defined]  # both paths' servers have a gate
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(PREFACE)
        answered = 0
        buffer = b""
        for _ in range(200):  # bounded: three PINGs come within ~1.5 s
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            assert chunk, f"closed after {answered} PINGs answered"
            frames, buffer = split(buffer + chunk)
            for f in frames:
                if f.type == PING and not f.flags & 1:
                    await asyncio.sleep(0.05)  # the turns of the loop already asked for have run
                    reads.spent = reads.turn_budget  # this turn's reading is spent,
                    reads.call_soon = lambda tick: loop.call_later(0.7, tick)  # and the next comes late
                    writer.write(frame(PING, 1, 0, f.payload))
                    answered += 1
            if answered == 3:
                break
        await wait_for(lambda: reads.slices >= 1 and reads.deferred >= 3, what="the answers queued, then read")
        reads.call_soon = None
        assert server.connections == 1 and server.refused["keepalive"] == 0
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def test_keepalive_closes_a_connection_that_never_reads() -> None:
    """A client that asks for a big group and then reads nothing (its socket buffer full, so our
    PINGs never reach it) is closed by keepalive too, well before the send timeout would drop its
    stream: its connection, stream and socket are released, not left waiting for a flush."""
    import socket

    store = Store(encode_group)
    store.add_source(SOURCE)
    store.update(SOURCE, {"web": group("web", *range(1000, 9000))})  # a response of about 200 KB
    service = EdsService(store, send_timeout=300)  # so only keepalive can end it within the test
    server = make_server(
        service,
        max_streams_per_connection=10,
        keepalive_time=0.3,
        keepalive_timeout=0.3,
        max_message_size=1 << 20,
        http2=os.environ.get("EDS_HTTP2", "auto"),
    )
    await server.start("127.0.0.1", 0)
    conn = raw_client(window=1 << 24)  # flow control never stops the server
    conn.send_headers(1, REQUEST_HEADERS)
    body = bytes(first("web"))
    conn.send_data(1, b"\x00" + len(body).to_bytes(4, "big") + body)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(conn.data_to_send())
        await wait_for(lambda: service.open_streams == 1, what="the stream open")
        await wait_for(
            lambda: server.connections == 0 and service.open_streams == 0,
            timeout=20,
            what="the connection closed by keepalive",
        )
        assert service.counters.dropped == 0  # keepalive ended it, not the send timeout
    finally:
        sock.close()
        server.close()
        await server.wait_closed()


async def test_a_client_taking_our_output_slowly_is_alive_though_its_answer_is_late() -> None:
    """A client busy elsewhere reads slowly: our PING waits in our own output behind a big
    response, so its answer is late. That it takes some of that output between the PING and the
    expiry says it reads, and it is asked again; once it stops reading, the PING goes unanswered
    and the connection is closed. The client here reads raw bytes and answers no PING."""
    import socket

    store = Store(encode_group)
    store.add_source(SOURCE)
    store.update(SOURCE, {"web": group("web", *range(1000, 9000))})  # a response of about 200 KB
    service = EdsService(store, send_timeout=300)  # so only keepalive can end it within the test
    server = make_server(
        service,
        max_streams_per_connection=10,
        keepalive_time=0.2,
        keepalive_timeout=0.3,
        max_message_size=1 << 20,
        http2=os.environ.get("EDS_HTTP2", "auto"),
    )
    await server.start("127.0.0.1", 0)
    conn = raw_client(window=1 << 24)  # flow control never stops the server
    conn.send_headers(1, REQUEST_HEADERS)
    body = bytes(first("web"))
    conn.send_data(1, b"\x00" + len(body).to_bytes(4, "big") + body)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    loop = asyncio.get_running_loop()
    try:
        sock.connect(("127.0.0.1", server.port))
        sock.setblocking(False)
        await loop.sock_sendall(sock, conn.data_to_send())
        await wait_for(lambda: service.open_streams == 1, what="the stream open")
        taken = 0
        for _ in range(20):  # bounded: 2 s of reading 2 KB every 0.1 s, ten keepalive periods
            await asyncio.sleep(0.1)
            with contextlib.suppress(BlockingIOError):
                taken += len(sock.recv(2048))
        counts = server.keepalive  # type: ignore[attr-defined]  # both paths' servers count them
        assert taken < 150_000  # the floor: the response was still being taken, not all read
        assert server.connections == 1 and server.refused["keepalive"] == 0, counts
        assert counts["busy"] >= 3 and counts["answered"] == 0, counts
        await wait_for(lambda: server.connections == 0, what="closed once it stops reading")
        assert server.refused["keepalive"] == 1 and service.counters.dropped == 0
    finally:
        sock.close()
        server.close()
        await server.wait_closed()


async def test_a_client_that_stops_reading_is_dropped_and_holds_up_nobody(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:

    harness.store.update(SOURCE, {"web": group("web", 1)})
    port = harness.channel._port
    # A raw HTTP/2 client that opens a StreamEndpoints call with a 10-byte flow-control window
    # and never reads: the server's first response cannot be sent.
    conn = raw_client(stream_window=10)
    conn.send_headers(1, REQUEST_HEADERS)
    body = bytes(first("web"))
    conn.send_data(1, b"\x00" + len(body).to_bytes(4, "big") + body)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(conn.data_to_send())
    await writer.drain()
    try:
        await wait_for(lambda: harness.service.open_streams == 1, what="the stuck stream open")
        async with harness.stream() as stream:  # meanwhile a healthy client is served normally
            await stream.send_message(first("web"))
            r1 = await recv(stream)
            await stream.send_message(reply(r1, "web"))
            harness.store.update(SOURCE, {"web": group("web", 2)})
            assert (await recv(stream)).version_info != r1.version_info
            await wait_for(lambda: harness.service.open_streams == 1)  # dropped after the send timeout (1 s here)
            assert harness.service.open_streams == 1  # only the healthy one is left
            assert "dropping node=test-node" in caplog.text and "not reading" in caplog.text
    finally:
        writer.close()


async def test_reset_flood_gets_goaway() -> None:
    import h2.events

    store = Store(encode_group)
    store.add_source(SOURCE)
    store.update(SOURCE, {})
    server = make_server(
        EdsService(store),
        max_streams_per_connection=100,
        keepalive_time=30,
        keepalive_timeout=10,
        max_message_size=1 << 20,
        reset_budget=20,
    )
    await server.start("127.0.0.1", 0)
    port = server.port
    conn = raw_client()
    for i in range(50):  # open and reset at once, as in an HTTP/2 rapid-reset attack
        conn.send_headers(1 + 2 * i, REQUEST_HEADERS)
        conn.reset_stream(1 + 2 * i)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(conn.data_to_send())
        await writer.drain()
        goaway = None
        for _ in range(100):  # bounded
            data = await asyncio.wait_for(reader.read(65536), 10)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ConnectionTerminated):
                    goaway = event
        assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    finally:
        writer.close()
        server.close()
        await server.wait_closed()


async def test_total_stream_limit(harness: Harness) -> None:
    """--max-streams in total, of which one client IP may hold half: one client cannot take every
    stream while another has none."""
    harness.store.update(SOURCE, {"web": group("web", 1)})
    harness.service.max_streams = 4
    async with harness.stream() as a, harness.stream() as b:
        for s in (a, b):
            await s.send_message(first("web"))
            await recv(s)
        with pytest.raises(GRPCError) as e:
            async with harness.stream() as c:
                await c.send_message(first("web"))
                await recv(c)
        assert e.value.status == Status.RESOURCE_EXHAUSTED
    assert harness.service.counters.refused == 1


@pytest.mark.fast_path  # stock grpclib: a message cut by the stream's end is an application error
async def test_truncated_grpc_frame_is_an_error_not_a_hang(harness: Harness) -> None:
    harness.store.update(SOURCE, {})
    with pytest.raises(GRPCError) as e:
        async with harness.stream() as stream:
            await stream.send_request()
            # announce 100 bytes, send 10, end the stream
            await stream._stream.send_data(b"\x00" + (100).to_bytes(4, "big") + b"\x0a" * 10, end_stream=True)
            await asyncio.wait_for(stream.recv_message(), 5)
    assert e.value.status == Status.INVALID_ARGUMENT
    async with harness.stream() as stream:  # the server is fine
        await stream.send_message(first("web"))
        assert cla_of(await recv(stream)).cluster_name == "web"


async def test_ten_thousand_names_in_one_request(harness: Harness) -> None:
    harness.store.update(SOURCE, {"n7": group("n7", 1)})
    names = [f"n{i}" for i in range(10_000)]
    async with harness.stream() as stream:
        await stream.send_message(first(*names))
        resp = await recv(stream, timeout=30)
        assert len(resp.resources) == 10_000
        assert len(cla_of(resp, 7).endpoints) == 1 and not cla_of(resp, 8).endpoints


@pytest.mark.fast_path  # stock grpclib: no size limit before the body, 100 streams a connection
async def test_many_streams_opened_and_closed_leave_nothing_behind(harness: Harness) -> None:
    import gc

    from eds_server.transport.grpc import StreamSession

    harness.store.update(SOURCE, {"web": group("web", 1)})

    def counts() -> tuple[int, int, int]:
        gc.collect()
        sessions = sum(1 for o in gc.get_objects() if isinstance(o, StreamSession))
        return len(asyncio.all_tasks()), len(os.listdir("/proc/self/fd")), sessions

    async def one_round(n: int) -> None:
        async with contextlib.AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(harness.stream()) for _ in range(n)]
            for s in streams:
                await s.send_message(first("web"))
            for s in streams:
                await recv(s)

    await one_round(50)  # warm up: the connection and caches exist from here on
    await wait_for(lambda: harness.service.open_streams == 0)
    last: list[tuple[int, int, int]] = []

    def settled() -> tuple[int, int, int] | None:
        """The counts once two readings in a row agree (the streams' tasks have ended)."""
        last.append(counts())
        return last[-1] if len(last) > 1 and last[-1] == last[-2] else None

    before = await wait_for(settled, what="the counts settled after the warm-up")
    for _ in range(5):  # 1,000 streams, 200 at a time
        await one_round(200)
    await wait_for(lambda: harness.service.open_streams == 0)
    # tasks, file descriptors, sessions: back to what they were
    await wait_for(counts, lambda now: now == before, what=f"tasks, fds, sessions back to {before}")
    assert not harness.store.subscriptions()


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_lists_and_describes_the_services(harness: Harness, version: str) -> None:
    from google.protobuf import descriptor_pb2, descriptor_pool

    from eds_server.pb.grpc.reflection.v1 import ServerReflectionRequest, ServerReflectionResponse

    path = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    async with harness.channel.request(
        path, Cardinality.STREAM_STREAM, ServerReflectionRequest, ServerReflectionResponse
    ) as stream:
        await stream.send_message(ServerReflectionRequest(list_services=""))
        listed = await recv(stream)
        assert EDS_SERVICE in [s.name for s in listed.list_services_response.service]
        await stream.send_message(ServerReflectionRequest(file_containing_symbol=f"{EDS_SERVICE}.StreamEndpoints"))
        files = list((await recv(stream)).file_descriptor_response.file_descriptor_proto)
        cla = "envoy.config.endpoint.v3.ClusterLoadAssignment"  # what the Any in a response holds
        await stream.send_message(ServerReflectionRequest(file_containing_symbol=cla))
        files += [f for f in (await recv(stream)).file_descriptor_response.file_descriptor_proto if f not in files]
        await stream.send_message(ServerReflectionRequest(file_containing_symbol="no.such.Thing"))
        assert (await recv(stream)).error_response.error_code == 5
        await stream.end()
    pool = descriptor_pool.DescriptorPool()  # what grpcurl does with them
    for raw in files:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
    service = pool.FindServiceByName(EDS_SERVICE)
    method = service.methods_by_name["StreamEndpoints"]
    assert method.input_type.full_name == "envoy.service.discovery.v3.DiscoveryRequest"
    assert "lb_endpoints" in pool.FindMessageTypeByName("envoy.config.endpoint.v3.LocalityLbEndpoints").fields_by_name


async def test_a_client_that_half_closes_still_gets_its_answer(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.channel.request(
        STREAM, Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse
    ) as stream:
        await stream.send_message(first("web"), end=True)
        resp = await recv(stream)
        assert cla_of(resp).cluster_name == "web"
        assert await asyncio.wait_for(stream.recv_message(), 5) is None  # then the call ends, OK


@pytest.mark.fast_path  # stock grpclib: an application error
async def test_length_prefix_then_end_of_stream_is_an_error(harness: Harness) -> None:
    harness.store.update(SOURCE, {"web": group("web", 1)})
    with pytest.raises(GRPCError) as e:
        async with harness.stream() as stream:
            await stream.send_message(first("web"))
            await recv(stream)
            # announce 20 bytes, then end the stream: not an empty request unsubscribing everything
            await stream._stream.send_data(b"\x00" + (20).to_bytes(4, "big"), end_stream=True)
            stream._end_done = True  # what grpclib's own end() would have recorded
            await asyncio.wait_for(stream.recv_message(), 5)
    assert e.value.status == Status.INVALID_ARGUMENT


async def test_a_client_goaway_read_with_a_ping_ends_that_connection_cleanly(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """Envoy sends GOAWAY when it drains a connection. One read holding a PING (which h2 answers) and
    the GOAWAY (on which grpclib closes the connection) wrote the answer to a connection already
    closed: an AttributeError logged as a fatal transport error. The others' streams go on."""
    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as canary:
        await canary.send_message(first("web"))
        resp = await recv(canary)
        await canary.send_message(reply(resp, "web"))
        reader, writer = await asyncio.open_connection("127.0.0.1", harness.server.port)
        try:
            goaway = frame(GOAWAY, 0, 0, bytes(8))  # last stream 0, NO_ERROR
            writer.write(PREFACE + frame(PING, 0, 0, bytes(8)) + goaway)
            for _ in range(100):  # bounded: the server closes the connection
                if not await asyncio.wait_for(reader.read(65536), 5):
                    break
        finally:
            writer.close()
        harness.store.update(SOURCE, {"web": group("web", 1, 2)})
        assert len(cla_of(await recv(canary)).endpoints[0].lb_endpoints) == 2
    assert "Traceback" not in caplog.text and "Fatal error" not in caplog.text, caplog.text[-3000:]


async def test_a_stream_shows_who_sends_and_metrics_count_it_through_the_observers(harness: Harness) -> None:
    """A stream's SendState is idle between responses (a change then goes out from the store's
    callback), closed once the call ends; eds_streams_open hears of it through the observer list."""
    registry = make_registry(harness.store, harness.service.counters, harness.service.observers, list)

    def open_streams() -> tuple[float | None, float | None]:
        return (
            registry.get_sample_value("eds_streams_open", {"transport": "sotw"}),
            registry.get_sample_value("eds_streams_open", {"transport": "delta"}),
        )

    harness.store.update(SOURCE, {"web": group("web", 1)})
    async with harness.stream() as stream:
        await stream.send_message(first("web"))
        r1 = await recv(stream)
        [session] = harness.service.sessions
        assert open_streams() == (1, 0) and harness.service.counters.streams_opened == 1
        await stream.send_message(reply(r1, "web"))
        await wait_for(lambda: session.sm.in_flight is None and session.state is SendState.IDLE)
        harness.store.update(SOURCE, {"web": group("web", 1, 2)})
        # the fast path queues it right there (no task woken); the stock one hands it to the task
        assert session.state is (SendState.SENDING if os.environ.get("EDS_HTTP2") == "stock" else SendState.IDLE)
        assert len(cla_of(await recv(stream)).endpoints[0].lb_endpoints) == 2
    await wait_for(lambda: harness.service.open_streams == 0)
    assert session.state is SendState.CLOSED and open_streams() == (0, 0)
