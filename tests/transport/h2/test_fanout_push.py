"""The fan-out path: a change is answered from the store's callback, frames built without h2's
send_data, one socket write per connection per change; anything that cannot go at once still
goes, through the stream's task."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import grpclib.server
import h2
import h2.connection
import h2.stream
import hpack
import hyperframe
import pytest

from eds_server.model import Endpoint, Group
from eds_server.transport.h2 import fast_writer
from eds_server.transport.h2.base import Framed
from eds_server.transport.h2.fast_connection import GuardedH2Connection
from tests.support.grpc_harness import SOURCE, Harness, cla_of, first, recv, reply
from tests.support.waiting import wait_for


@pytest.fixture
def h(harness: Harness) -> Harness:
    return harness


def big_group(name: str, n: int, weight: int = 1) -> Group:
    return Group(name, tuple(Endpoint(f"10.0.{i >> 8}.{i & 255}", 8080, weight=weight) for i in range(n)))


@contextlib.asynccontextmanager
async def counting_flushes(server: Any) -> AsyncIterator[list[int]]:
    """How many connections each flush pass wrote."""
    passes: list[int] = []
    flusher = server.flusher
    original = flusher._flush

    def counted() -> None:
        passes.append(len(flusher._unflushed))
        original()

    flusher._flush = counted
    try:
        yield passes
    finally:
        flusher._flush = original


@pytest.mark.parametrize("endpoints", [3, 1500])  # one DATA frame, and several (a ~40 KB CLA)
async def test_a_change_reaches_every_stream_in_one_write_per_connection(h: Harness, endpoints: int) -> None:
    h.store.update(SOURCE, {"web": big_group("web", endpoints)})
    async with h.stream() as a, h.stream() as b, h.stream() as c:
        streams = [a, b, c]
        for s in streams:
            await s.send_message(first("web"))
        acks = [reply(await recv(s), "web") for s in streams]
        for s, ack in zip(streams, acks, strict=True):
            await s.send_message(ack)
        responses_before = h.service.counters.responses
        async with counting_flushes(h.server) as passes:
            h.store.update(SOURCE, {"web": big_group("web", endpoints, weight=2)})
            got = [await recv(s) for s in streams]
        assert passes == [1]  # three streams, one connection: one write
        assert h.service.counters.responses == responses_before + 3
        for resp in got:
            cla = cla_of(resp)
            assert len(cla.endpoints[0].lb_endpoints) == endpoints
            assert {e.load_balancing_weight.value for e in cla.endpoints[0].lb_endpoints} == {2}


async def test_a_message_larger_than_the_window_still_arrives_whole(h: Harness) -> None:
    """grpclib's client window is 64 KB: a ~130 KB CLA cannot be queued at once, so the stream's
    task sends it as the window opens."""
    h.store.update(SOURCE, {"web": big_group("web", 1)})
    async with h.stream() as s:
        await s.send_message(first("web"))
        await s.send_message(reply(await recv(s), "web"))
        h.store.update(SOURCE, {"web": big_group("web", 5000)})
        resp = await recv(s)
        assert len(cla_of(resp).endpoints[0].lb_endpoints) == 5000
        await s.send_message(reply(resp, "web"))
        h.store.update(SOURCE, {"web": big_group("web", 2)})  # and the stream carries on
        assert len(cla_of(await recv(s)).endpoints[0].lb_endpoints) == 2


async def test_pushed_frames_pay_for_the_clients_window_updates(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """fast_connection.py lets a client send WINDOW_UPDATEs only as paid for by DATA frames we sent: frames
    built by the fan-out path must count, or an Envoy taking big responses gets GOAWAY."""
    noted: list[int] = []
    original = GuardedH2Connection.note_data_frames

    def note(self: GuardedH2Connection, stream_id: int, frames: int) -> None:
        noted.append(frames)
        original(self, stream_id, frames)

    monkeypatch.setattr(GuardedH2Connection, "note_data_frames", note)
    h.store.update(SOURCE, {"web": big_group("web", 1)})
    async with h.stream() as s:
        await s.send_message(first("web"))
        resp = await recv(s)
        for n in range(2, 6):
            await s.send_message(reply(resp, "web"))
            h.store.update(SOURCE, {"web": big_group("web", 1500, weight=n)})  # ~40 KB: three DATA frames
            resp = await recv(s)
            assert len(cla_of(resp).endpoints[0].lb_endpoints) == 1500
        await s.send_message(reply(resp, "web"))
        size = len(resp.SerializeToString()) if hasattr(resp, "SerializeToString") else len(bytes(resp))
    # the first response (one frame) is queued with the stream's headers, the four changes after it
    assert noted == [1] + [-(-(size + 5) // 16384)] * 4, (noted, size)


async def test_connecting_streams_costs_at_most_one_write_each(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's response HEADERS go out with its first response, in its connection's next write
    (grpclib wrote the headers on their own, then the response: two writes per stream at least)."""
    writes = 0
    write, flush = fast_writer.QueuedTransport.write, fast_writer.QueuedTransport.flush

    def counted_write(self: fast_writer.QueuedTransport, data: bytes) -> None:
        nonlocal writes
        writes += bool(data and not self.pending)  # else the flush below writes it
        write(self, data)

    def counted_flush(self: fast_writer.QueuedTransport) -> None:
        nonlocal writes
        writes += bool(self.pending)
        flush(self)

    monkeypatch.setattr(fast_writer.QueuedTransport, "write", counted_write)
    monkeypatch.setattr(fast_writer.QueuedTransport, "flush", counted_flush)
    h.store.update(SOURCE, {"web": big_group("web", 10)})
    n, answered, done = 40, 0, asyncio.Event()

    async def client() -> None:
        nonlocal answered
        async with h.stream() as s:
            await s.send_message(first("web"))
            await recv(s)
            answered += 1
            if answered == n:
                done.set()
            await done.wait()

    async with asyncio.timeout(20):
        await asyncio.gather(*(client() for _ in range(n)))
    assert writes <= n + 4, writes  # + the connection's SETTINGS and its ACKs


async def test_a_big_fan_out_is_written_in_batches_each_connection_once_a_batch() -> None:
    flushed: list[object] = []

    class Conn:
        def is_closing(self) -> bool:
            return False

        def flush(self) -> None:
            flushed.append(self)

        def data_send_process(self) -> None:
            pass

    flusher = fast_writer.Flusher(every=4)
    conns = [Conn(), Conn()]
    for i in range(10):
        flusher.later(conns[i % 2])  # type: ignore[arg-type]
    assert flushed == conns * 2  # after 4 and 8 messages: both connections, once each
    await asyncio.sleep(0)
    assert flushed == conns * 3  # the last two, at the end of the loop's turn


async def test_one_connection_failing_to_write_holds_up_no_other() -> None:
    flushed: list[str] = []

    class Conn:
        def is_closing(self) -> bool:
            return False

        def __init__(self, name: str) -> None:
            self.name = name

        def flush(self) -> None:
            if self.name == "broken":
                raise OSError("broken pipe")
            flushed.append(self.name)

        def data_send_process(self) -> None:
            pass

    flusher = fast_writer.Flusher(every=2)
    flusher.later(Conn("broken"))  # type: ignore[arg-type]
    flusher.later(Conn("fine"))  # type: ignore[arg-type]  # the batch is written here: nothing raised
    assert flushed == ["fine"]


def test_the_response_headers_block_leaves_the_dynamic_tables_alone() -> None:
    """The first response's HEADERS are built once; a client decodes them and adds nothing to its
    dynamic table, so the connection's own encoder stays in step with it."""
    decoder = hpack.Decoder()
    for content_type in ("application/grpc", "application/grpc+proto"):
        block = fast_writer.ResponseHeaders().block(content_type)
        assert decoder.decode(block) == [(":status", "200"), ("content-type", content_type)]
    assert decoder.header_table.dynamic_entries == deque()


def test_private_api_the_fan_out_relies_on() -> None:
    """transport/h2/fast_writer.py's queue_message builds DATA frames and shrinks h2's windows itself, and
    direct.py reads DATA frames past h2 and grpclib: a new h2, hyperframe or grpclib must be
    checked against them before it is taken."""
    assert (h2.__version__, hyperframe.__version__) == ("4.4.1", "6.1.0")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    assert isinstance(conn.outbound_flow_control_window, int)
    # queue_message checks states instead of telling the state machines: SEND_DATA must change nothing there
    conn_sm, stream_sm = h2.connection.H2ConnectionStateMachine, h2.stream
    assert conn_sm._transitions[
        (h2.connection.ConnectionState.SERVER_OPEN, h2.connection.ConnectionInputs.SEND_DATA)
    ] == (None, h2.connection.ConnectionState.SERVER_OPEN)
    for state in (h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_REMOTE):
        assert stream_sm._transitions[(state, h2.stream.StreamInputs.SEND_DATA)] == (None, state)
    assert "outbound_flow_control_window" in h2.stream.H2Stream.__init__.__code__.co_names
    names = grpclib.server.Stream.send_message.__code__.co_names
    assert {"_send_initial_metadata_done", "_send_message_done"} <= set(names)
    # direct.py: h2's frame buffer between frames, grpclib's stream buffer (to check it is empty
    # and to put back a message begun)
    buffer = h2.frame_buffer.FrameBuffer(server=True)
    assert (buffer._preamble_len, buffer._data, buffer._headers_buffer) == (24, bytearray(), [])
    stream_buffer = grpclib.protocol.Buffer(lambda n: None)
    assert (stream_buffer._eof, stream_buffer._acked_size, stream_buffer._unacked.empty()) == (False, 0, True)
    assert list(stream_buffer._acked) == [] and grpclib.protocol.AckedData._fields == ("data", "data_size")
    # queue_initial_headers: h2's send_headers does no more than these, for a server's response headers
    assert {"state_machine", "request_method", "_build_headers_frames"} <= set(
        h2.stream.H2Stream.send_headers.__code__.co_names
    )
    assert {"state_machine", "_prepare_for_sending"} <= set(h2.connection.H2Connection.send_headers.__code__.co_names)
    assert hpack.Encoder().header_table.resized is False
    # fast_writer.py's FlushingConnection: grpclib's streams write through the transport it was given
    assert "_transport" in grpclib.protocol.Connection.create_stream.__code__.co_names


def test_push_latency_histogram_reads_as_prometheus_clients() -> None:
    """The plain-counter histogram exposes exactly what prometheus_client's Histogram would."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from eds_server.metrics import LATENCY_BUCKETS, LatencyHistogram

    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(
        "eds_push_latency_seconds",
        "From a change entering the store to a subscribed stream being sent it",
        buckets=LATENCY_BUCKETS,
        registry=theirs,
    )
    mine = LatencyHistogram()
    ours.register(mine)
    for value in (0.0, 0.0005, 0.001, 0.0011, 0.03, 0.5, 7.0, 11.0):  # on, under, over bounds; past the last
        reference.observe(value)
        mine.observe(value)
    expected = [line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == expected


async def test_a_change_is_encoded_once_for_all_its_streams(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams share nonces per change (xds.common.Nonces), so the same response is the same bytes:
    encoded and framed once, sent to each stream as views of them. A count, not a time."""
    from eds_server.transport import grpc as grpc_transport

    built: list[int] = []

    class Counted(Framed):
        def __init__(self, payload: bytes) -> None:
            built.append(len(payload))
            super().__init__(payload)

    monkeypatch.setattr(grpc_transport, "Framed", Counted)
    h.store.update(SOURCE, {"web": big_group("web", 1500)})
    async with h.stream() as a, h.stream() as b, h.stream() as c:
        await a.send_message(first("web"))
        await a.send_message(reply(await recv(a), "web"))
        h.store.update(SOURCE, {"web": big_group("web", 1500, weight=3)})  # a has had one response more
        await a.send_message(reply(await recv(a), "web"))
        streams, acks = [a, b, c], []
        for s in (b, c):
            await s.send_message(first("web"))
            acks.append(reply(await recv(s), "web"))
            await s.send_message(acks[-1])
        await wait_for(lambda: all(x.sm.in_flight is None for x in h.service.sessions))  # the ACKs read
        built.clear()
        h.store.update(SOURCE, {"web": big_group("web", 1500, weight=2)})
        got = [await recv(s) for s in streams]
    assert len(built) == 1, built
    assert len({r.nonce for r in got}) == 1  # one nonce for the change; each stream's nonces still differ
    assert all(r.nonce != ack.response_nonce for r, ack in zip(got[1:], acks, strict=True))


async def test_a_burst_of_new_streams_has_the_heap_trimmed(h: Harness) -> None:
    """After streams open (each first request carries a Node), glibc's free heap is given back; and
    again after they end (what they held is free heap then)."""
    from eds_server.heap import HeapTrim

    trim = h.service.heap = HeapTrim(after=3, delay=0.01)
    if not trim.available:
        pytest.skip("no malloc_trim in this C library")
    h.store.update(SOURCE, {"web": big_group("web", 3)})
    async with h.stream() as a, h.stream() as b, h.stream() as c:
        for s in (a, b, c):
            await s.send_message(first("web"))
            await recv(s)
        await wait_for(lambda: trim.trims and not trim.trimming, interval=0.01)
        assert trim.trims == 1 and trim.churned == 0
    await wait_for(lambda: trim.trims == 2 and not trim.trimming, interval=0.01)


async def test_the_heap_is_trimmed_once_a_burst_of_streams_is_over() -> None:
    """While streams keep opening (a fleet reconnecting), the trim waits: their Nodes are still in
    buffers. It runs once the burst has been quiet for `delay`, or has gone on for `most`."""
    from eds_server.heap import HeapTrim

    trim = HeapTrim(after=2, delay=0.1, most=10.0)
    if not trim.available:
        pytest.skip("no malloc_trim in this C library")
    for _ in range(10):  # a burst: a stream every 20 ms, for 0.2 s
        trim.churn()
        await asyncio.sleep(0.02)  # the burst's pace (the input, nothing is waited for)
    assert trim.trims == 0  # not during the burst
    await wait_for(lambda: trim.trims)
    assert trim.trims == 1
    steady = HeapTrim(after=2, delay=0.1, most=0.15)
    for _ in range(25):  # a stream every 20 ms for 0.5 s: never quiet, trimmed anyway
        steady.churn()
        await asyncio.sleep(0.02)  # the trickle's pace (the input, nothing is waited for)
    assert steady.trims >= 1
    trim.stop()
    steady.stop()


async def test_a_long_burst_is_trimmed_again_when_it_ends() -> None:
    """A burst longer than `most` is trimmed while it goes on (its first Nodes are long freed) and
    once more when it is over, however few streams opened after the first trim."""
    from eds_server.heap import HeapTrim

    trim = HeapTrim(after=10, delay=0.1, most=0.15)
    if not trim.available:
        pytest.skip("no malloc_trim in this C library")
    for _ in range(50):  # a stream every 20 ms until the burst is trimmed (bounded: 1 s)
        trim.churn()
        await asyncio.sleep(0.02)  # the burst's pace (the input; the loop ends on the condition)
        if trim.trims:
            break
    assert trim.trims == 1
    trim.churn()  # the tail of the burst: one stream, fewer than `after`
    await wait_for(lambda: trim.trims > 1)  # once quiet
    assert trim.trims == 2
    trim.stop()


async def test_addresses_forgotten_have_the_heap_collected_and_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    """However few (a fleet's last stragglers), addresses forgotten bring a trim that collects first,
    the event loop's free lists renewed before it: their state is freed seconds after their streams
    ended, and what it leaves in the free lists would keep the streams' arenas."""
    from eds_server import heap

    collected: list[int] = []
    renewed: list[int] = []
    take = heap._take_free_lists

    def counting_take(loop: asyncio.AbstractEventLoop) -> tuple[list[object], list[object]]:
        old, new = take(loop)
        renewed.append(len(new))
        return old, new

    def counting_collect() -> int:
        collected.append(1)
        return 0

    monkeypatch.setattr(heap, "_take_free_lists", counting_take)
    monkeypatch.setattr(heap.gc_settings, "collect", counting_collect)
    live = [0]
    trim = heap.HeapTrim(after=16, delay=0.01, live=lambda: live[0])
    if not trim.available:
        pytest.skip("no malloc_trim in this C library")
    try:
        trim.forgotten(1)
        assert trim.churned >= trim.after  # one address is enough
        await wait_for(lambda: trim.trims and not trim.trimming, interval=0.01)
        assert collected == [1] and renewed == [3 * heap.FREE_LISTS]
        # a fleet opened since (no stream ended, so no count of them was handed in): the trim after
        # an address forgotten does not walk it
        live[0] = heap.COLLECT_BELOW + 1
        for _ in range(20):
            trim.churn()
        await wait_for(lambda: trim.trims == 2 and not trim.trimming, interval=0.01)
        trim.forgotten(1)
        await wait_for(lambda: trim.trims == 3 and not trim.trimming, interval=0.01)
        assert collected == [1], "a collection walked the open fleet"
        trim.stop()
        trim.forgotten(1)  # stopped: nothing more is scheduled (the server's executor may be gone)
        assert not trim.trimming and trim._timer is None
    finally:
        trim.stop()
