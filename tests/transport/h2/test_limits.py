"""HTTP/2 limits of the gRPC port, in-process: h2 connections fed frames directly (no sockets)
where the point is a count of work, grpclib clients on loopback where it is behaviour."""

from __future__ import annotations

import asyncio
import contextlib
import types
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import hpack
import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from h2.settings import SettingCodes, Settings
from hyperframe.frame import HeadersFrame, PingFrame, RstStreamFrame

from eds_server.encode import encode_group
from eds_server.pb.envoy.config.core.v3 import Node
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse
from eds_server.pb.grpc.health.v1 import HealthCheckRequest, HealthStub
from eds_server.store import Store
from eds_server.transport.h2.fast_connection import GuardedH2Connection
from eds_server.transport.h2.limits import INITIAL_WINDOW, SPENT_WINDOW, ConnectionLimits, FirstWindow, PeerBudgets
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.grpc_harness import fetch_web, serving
from tests.support.h2frames import PREFACE, read_frames
from tests.support.hostile_clients import STREAM, headers
from tests.support.waiting import wait_for

HEADERS = headers(STREAM)


def pair(limits: ConnectionLimits) -> tuple[h2.connection.H2Connection, GuardedH2Connection]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = GuardedH2Connection(h2.config.H2Configuration(client_side=False), PeerBudgets(limits), limits)
    server.local_settings = Settings(
        client=False, initial_values={SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_streams}
    )
    server.initiate_connection()
    client.initiate_connection()
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    return client, server


def test_ten_thousand_streams_cost_linear_work() -> None:
    """h2 walks every stream held on each new one (10,000 streams: ~5e7 looks); ours looks at the
    streams a frame touched since the last count."""
    n = 10_000
    limits = ConnectionLimits(max_streams=2 * n, stream_budget=10 * n)
    _, server = pair(limits)
    encoder = hpack.Encoder()  # frames built by hand: h2's own client would walk its streams too
    for i in range(n):
        frames = HeadersFrame(1 + 2 * i, data=encoder.encode(HEADERS), flags=["END_HEADERS"]).serialize()
        if i % 3 == 0:  # some close again, and must be forgotten
            frames += RstStreamFrame(1 + 2 * i, error_code=8).serialize()
        server.receive_data(frames)
    assert server.open_inbound_streams == n - len(range(0, n, 3))  # the same answer h2 gives...
    assert server.stream_checks <= 3 * n, server.stream_checks  # ...for linear work
    # and the count is exact: streams closed by our side too
    for sid in list(server.streams)[:100]:
        server.reset_stream(sid)
    assert server.open_inbound_streams == n - len(range(0, n, 3)) - 100


def test_h2_private_api_this_relies_on_is_there() -> None:
    """GuardedH2Connection overrides h2 internals (h2 pinned in constraints.txt)."""
    base = h2.connection.H2Connection
    for name in (
        "_receive_frame",
        "_prepare_for_sending",
        "_open_streams",
        "_closed_streams",
        "highest_inbound_stream_id",
    ):
        assert hasattr(base, name) or name in vars(base(h2.config.H2Configuration(client_side=False))), name
    client, server = pair(ConnectionLimits(control_budget=10))  # the first SETTINGS and the ACKs are free
    with pytest.raises(h2.exceptions.ProtocolError):
        for _ in range(11):
            client.ping(b"12345678")
            server.receive_data(client.data_to_send())
    events = client.receive_data(server.data_to_send())
    goaway = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


def test_data_after_end_stream_counts_as_resets() -> None:
    """h2 answers DATA on a closed stream with its own RST_STREAM: charged like a client's reset."""
    client, server = pair(ConnectionLimits(reset_budget=10))
    client.send_headers(1, HEADERS, end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(":status", "200")], end_stream=True)
    client.receive_data(server.data_to_send())
    raw = b"".join(b"\x00\x00\x01\x00\x00\x00\x00\x00\x01x" for _ in range(20))  # DATA, 1 byte, stream 1
    with pytest.raises(h2.exceptions.ProtocolError):
        server.receive_data(raw)


UNKNOWN = b"\x00\x00\x05\x42\x00\x00\x00\x00\x00hello"  # type 0x42, 5 bytes, stream 0


async def test_unknown_frames_are_ignored_and_the_connection_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async with serving(ConnectionLimits()) as (_, _, port):
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(client.data_to_send() + UNKNOWN)
            client.send_headers(1, HEADERS)
            body = bytes(DiscoveryRequest(node=Node(id="n"), resource_names=["web"], type_url=EDS_TYPE_URL))
            client.send_data(1, b"\x00" + len(body).to_bytes(4, "big") + body)
            writer.write(client.data_to_send())
            got = []
            for _ in range(50):  # bounded
                chunk = await asyncio.wait_for(reader.read(65536), 5)
                assert chunk, "the server closed the connection"
                got += client.receive_data(chunk)
                writer.write(client.data_to_send())
                if any(isinstance(e, h2.events.DataReceived) for e in got):
                    break
            assert any(isinstance(e, h2.events.DataReceived) for e in got)  # the response came
        finally:
            writer.close()
    assert "Traceback" not in caplog.text and "NotImplementedError" not in caplog.text


async def test_a_ping_ack_with_another_payload_does_not_keep_a_connection_alive() -> None:
    async with serving(ConnectionLimits(), keepalive_time=0.2, keepalive_timeout=0.5) as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(PREFACE)
            closed = False
            for _ in range(100):  # bounded: ~4 s
                # a client that never reads answers "PING ACK" blindly, with a made-up payload
                try:
                    writer.write(PingFrame(0, flags=["ACK"], opaque_data=b"made-up!").serialize())
                    await writer.drain()
                except ConnectionError:  # closed between our last look and this write: closed all the same
                    closed = True
                    break
                await asyncio.sleep(0.04)  # the blind client's pace (the attack itself, not a wait)
                if reader.at_eof() or writer.is_closing():
                    closed = True
                    break
                with contextlib.suppress(TimeoutError):
                    if not await asyncio.wait_for(reader.read(65536), 0.001):
                        closed = True
                        break
            assert closed
        finally:
            writer.close()


async def test_per_ip_connection_limit_sheds_with_goaway() -> None:
    # the per-IP cap binds once the server holds half its connections: 3 of 6 here; the address's
    # newcomer gets in, and its idlest connection gets the GOAWAY
    async with serving(ConnectionLimits(max_connections_per_ip=3, max_connections=6)) as (server, _, port):
        held = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.9", 0)) for _ in range(3)]
        try:
            for _, w in held:
                w.write(PREFACE)
            await wait_for(lambda: server.gate.connections == 3, timeout=5)
            _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.9", 0))
            frames = await read_frames(held[0][0])
            writer.close()
            why = b"closing to make room: 127.0.0.9 holds its limit of 3 connections (server half full)"
            assert (7, b"\x00\x00\x00\x00" + (0).to_bytes(4, "big") + why) in frames
            await fetch_web(port)  # another IP is served
            assert server.gate.refused["connection_limit"] == 1
        finally:
            for _, w in held:
                w.close()


async def test_a_connection_that_opens_no_stream_is_closed() -> None:
    async with serving(ConnectionLimits(request_timeout=0.3)) as (server, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(PREFACE)
        frames = await read_frames(reader)
        writer.close()
        assert any(t == 7 for t, _ in frames)  # GOAWAY, then closed
        assert server.gate.refused["no_stream"] == 1


async def test_a_stream_that_sends_no_request_ends_with_deadline_exceeded() -> None:
    async with serving(ConnectionLimits(request_timeout=0.3)) as (server, service, port):
        channel = Channel("127.0.0.1", port)
        try:
            with pytest.raises(GRPCError) as e:
                async with channel.request(STREAM, Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse) as s:
                    await s.send_request()
                    await asyncio.wait_for(s.recv_message(), 5)
            assert e.value.status == Status.DEADLINE_EXCEEDED
            assert service.open_streams == 0
            assert server.refused["no_request"] == 1  # counted (eds_refused_total) and logged
        finally:
            channel.close()


async def test_health_is_under_the_message_size_and_stream_limits() -> None:
    async with serving(ConnectionLimits()) as (_, service, port):
        channel = Channel("127.0.0.1", port)
        try:
            health = HealthStub(channel)
            with pytest.raises(GRPCError) as e:  # 2 MiB, over the 1 MiB limit: refused from its prefix
                await health.check(HealthCheckRequest(service="x" * (2 << 20)))
            assert e.value.status == Status.RESOURCE_EXHAUSTED
            service.max_streams = 1
            watch = channel.request(
                "/grpc.health.v1.Health/Watch",
                Cardinality.UNARY_STREAM,
                HealthCheckRequest,
                type(await health.check(HealthCheckRequest())),
            )
            async with watch as w:
                await w.send_message(HealthCheckRequest(), end=True)
                await asyncio.wait_for(w.recv_message(), 5)
                with pytest.raises(GRPCError) as e:
                    await fetch_web(port)
                assert e.value.status == Status.RESOURCE_EXHAUSTED
                await w.cancel()
        finally:
            channel.close()


async def test_partial_messages_share_one_budget() -> None:
    async with serving(ConnectionLimits(partial_message_budget=1 << 20)) as (server, _service, port):
        channel = Channel("127.0.0.1", port)
        try:
            async with channel.request(STREAM, Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse) as a:
                await a.send_request()
                await a._stream.send_data(b"\x00" + (900_000).to_bytes(4, "big") + b"\x0a" * 1000)
                # the server took the first message's share
                await wait_for(lambda: server.reader.budget and server.reader.budget.used, timeout=2.0)
                with pytest.raises(GRPCError) as e:  # a second one does not fit
                    async with channel.request(
                        STREAM, Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse
                    ) as b:
                        await b.send_request()
                        await b._stream.send_data(b"\x00" + (900_000).to_bytes(4, "big"))
                        await asyncio.wait_for(b.recv_message(), 5)
                assert e.value.status == Status.RESOURCE_EXHAUSTED
                await a.cancel()
            await fetch_web(port)  # small requests still fit
        finally:
            channel.close()


async def test_an_unfinished_tls_handshake_is_dropped(tmp_path: Path) -> None:
    from eds_server.security import server_ssl_context
    from tests.support.tls import CertAuthority

    ca = CertAuthority("test CA", tmp_path / "pki")
    cert = ca.issue(tmp_path / "server", dns=["localhost"], ips=["127.0.0.1"])
    ssl = server_ssl_context(str(cert.cert), str(cert.key), None)
    async with serving(ConnectionLimits(tls_handshake_timeout=0.3), ssl=ssl) as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x16\x03\x01")  # the start of a ClientHello, and nothing more
        try:
            closed = await asyncio.wait_for(reader.read(), 10)  # bounded: closed long before
            assert closed == b""
        finally:
            writer.close()


def test_partial_budget_shares() -> None:
    """One IP gets a quarter of the server-wide budget; small requests (Envoy's) are refused only by
    their own IP's share, so a client holding the budget does not stop others' requests."""
    from eds_server.transport.h2.limits import SMALL_MESSAGE, PartialBudget

    limits = ConnectionLimits()
    budget = PartialBudget(total=16 << 20, max_message_size=4 << 20)
    attackers = [PeerBudgets(limits) for _ in range(4)]
    for a in attackers:
        assert budget.take(4 << 20, a)  # each its quarter
        assert not budget.take(1, a)  # and no more
    other = PeerBudgets(limits)
    assert not budget.take(SMALL_MESSAGE + 1, other)  # the total is taken: big messages wait
    assert budget.take(60_000, other)  # an Envoy request still fits
    budget.give(60_000, other)
    budget.give(4 << 20, attackers[0])
    assert budget.take(SMALL_MESSAGE + 1, other)


def test_small_messages_past_the_total_are_bounded_server_wide() -> None:
    """Past the total, each address gets one small message in, not its whole quarter: many
    addresses holding small messages take at most twice the budget."""
    from eds_server.transport.h2.limits import SMALL_MESSAGE, PartialBudget

    limits = ConnectionLimits()
    budget = PartialBudget(total=16 << 20, max_message_size=4 << 20)
    taken = 0
    for _ in range(1000):
        peer = PeerBudgets(limits)
        while budget.take(SMALL_MESSAGE, peer):
            taken += SMALL_MESSAGE
            if taken > 64 << 20:
                break
    assert budget.used <= 2 * budget.total
    newcomer = PeerBudgets(limits)
    assert not budget.take(SMALL_MESSAGE, newcomer)  # twice the total is the end, for everyone
    assert budget.refused >= 1000


def test_refusals_are_metrics_by_reason() -> None:
    from prometheus_client import generate_latest

    from eds_server.metrics import make_registry
    from eds_server.observe import Counters, Observers

    store = Store(encode_group)
    registry = make_registry(store, Counters(), Observers(), list, lambda: (3, {"calm": 2, "bad_headers": 0}))
    text = generate_latest(registry).decode()
    assert 'eds_refused_total{reason="calm"} 2.0' in text
    assert 'eds_refused_total{reason="bad_headers"} 0.0' in text  # every reason from 0, for rate()
    assert "eds_connections_open 3.0" in text


def test_a_spent_stream_budget_shrinks_what_an_address_may_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pure bookkeeping, on the test's clock: the bound on streams awaiting a request follows the
    budget left, and a spent budget opens nothing until a tenth of it is back."""
    now = [1000.0]
    monkeypatch.setattr("eds_server.ratelimit.time", types.SimpleNamespace(monotonic=lambda: now[0]))
    peer = PeerBudgets(ConnectionLimits(stream_budget=100))  # refills 10 a second
    assert peer.pending_room(16_384) == 16_384 and peer.may_open()
    for _ in range(50):
        assert peer.waste()
    assert peer.pending_room(16_384) == 8_192
    for _ in range(50):
        assert peer.waste()
    assert not peer.waste() and not peer.may_open() and peer.pending_room(16_384) == 0
    now[0] += 0.5  # five tokens back: not yet
    assert not peer.may_open()
    now[0] += 0.5  # ten, a tenth
    assert peer.may_open() and peer.pending_room(16_384) == 1_638


def test_the_window_a_client_knows_is_the_initial_one_until_it_acknowledges_settings_sent_after_our_raise() -> None:
    """Our SETTINGS, our WINDOW_UPDATE raising the connection's window, our second SETTINGS (as
    grpclib and the fast path open a connection): the client knows the raise once it has
    acknowledged the second; until then what it may send is the initial 65,535 bytes, and once
    less than SPENT_WINDOW of it is left, its waiting streams wait on flow control."""
    first = FirstWindow()
    first.settings()
    first.raised()
    first.settings()
    first.raised()  # a later WINDOW_UPDATE (data read, given back) is not followed
    assert first.unknown
    assert not first.data(INITIAL_WINDOW - SPENT_WINDOW)  # SPENT_WINDOW left: it could send a request
    assert first.data(1)
    first.ack()
    assert first.unknown  # the first SETTINGS went before the raise
    first.ack()
    assert not first.unknown
    other = FirstWindow()
    other.settings()
    other.raised()  # no SETTINGS after it: known once the client sends more than the initial window
    assert other.data(INITIAL_WINDOW)
    assert not other.data(1) and not other.unknown
    assert not FirstWindow().unknown  # never raised: our own window is what it knows
