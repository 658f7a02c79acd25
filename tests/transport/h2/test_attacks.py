"""Attacks on the gRPC port's HTTP/2 layer: big requests reassembled from small DATA frames, frames
announced over the frame size limit, malformed request headers.

The frame-level tests run an in-process server (grpc_harness.serving) and a raw client
(h2_client.Client) that writes frames exactly as the attack needs them; every wait is
bounded. Costs are counted in bytes allocated (tracemalloc), never in time. The same three attacks
also run in hostile/test_clients.py, against a real eds-server process from their own loopback address,
with the canary, whose updates must keep flowing, under the suite's RSS cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from eds_server.transport.grpc import EdsService
from eds_server.transport.h2.fast_server import Server
from eds_server.transport.h2.limits import ConnectionLimits
from tests.support.grpc_harness import serving
from tests.support.h2_client import (
    SOURCE,
    Client,
    client_of,
    data,
    direct_stream,
    first_request,
    group,
    grpc,
    reader_of,
    tagged,
)
from tests.support.h2frames import CONTINUATION, DATA, END_HEADERS, HEADERS, PING, PREFACE, frame
from tests.support.hostile_clients import (
    ANSWERED_WITHIN,
    FRAME_SIZE_ERROR,
    MALFORMED,
    OVERSIZE,
    PROTOCOL_ERROR,
    Conn,
    headers,
)

BIG_LIMIT = 4 << 20  # the default --max-message-size
BIG = 4_150_000  # bytes of node in a request just under it
PIECE = 1024  # bytes of message per DATA frame
LINEAR = 4  # bytes allocated per byte of message, at most: a few copies of each byte, not one per frame


class Allocations:
    """Calls run through `measure`, and `total`: the sum over calls of the most memory each held at
    once beyond what was held before it (tracemalloc). A copy of everything received so far, made
    on every DATA frame, adds that size each time: quadratic in a message's size."""

    def __init__(self) -> None:
        self.total = 0

    def measure(self, call: Callable[[], object]) -> None:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        call()
        self.total += tracemalloc.get_traced_memory()[1] - before


@pytest.fixture
def allocations() -> Iterator[Allocations]:
    tracemalloc.start()
    try:
        yield Allocations()
    finally:
        tracemalloc.stop()


def no_server_errors(caplog: pytest.LogCaptureFixture) -> None:
    assert "Traceback" not in caplog.text and "Server error" not in caplog.text, caplog.text[-3000:]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-3000:]


async def canary_gets_a_change(canary: Client, service: EdsService, sid: int, n: int) -> None:
    """The server goes on serving others: the canary's stream gets its `n`th response, a new change."""
    service.store.update(SOURCE, group(n))
    await canary.response(sid, n)


# 1. Quadratic copy: a big request reassembled from small DATA frames on the direct path


async def test_reassembling_a_big_message_from_small_frames_allocates_linearly(
    allocations: Allocations,
) -> None:
    """The stream's DirectReader is handed a ~4 MiB request 1 KiB at a time, as the protocol hands
    it DATA frame payloads. Copying everything received so far on each frame allocates ~2,000 times
    the message (~8 GB); reassembly must allocate a few times its size at most."""
    async with serving(ConnectionLimits(), max_message_size=BIG_LIMIT) as (_, service, port), client_of(port) as client:
        await direct_stream(client, service, "a")
        reader = reader_of(service, "a")
        assert reader is not None
        handed: list[bytes] = []
        session = reader.client

        class Spy:
            def on_message(self, message: bytes) -> None:
                handed.append(message)
                session.on_message(message)

            def direct_ended(self, done: asyncio.Future[None]) -> None:
                session.direct_ended(done)

        reader.client = Spy()
        body = tagged("big", size=BIG)
        view = memoryview(grpc(body))
        for i in range(0, len(view), PIECE):
            allocations.measure(functools.partial(reader.take, view[i : i + PIECE]))
        total = allocations.total
        assert len(handed) == 1 and handed[0] == body, "the message was not handed over whole"
        assert reader.messages == 2  # the ACK, and this one
        assert reader_of(service, "a") is reader, "the stream left the direct path"
        assert total < LINEAR * len(view), (
            f"{total:,} bytes allocated to reassemble a {len(view):,}-byte message from {PIECE}-byte frames "
            f"({total / len(view):.0f} times its size)"
        )


async def test_big_requests_in_small_frames_over_a_socket_allocate_linearly(
    monkeypatch: pytest.MonkeyPatch, allocations: Allocations
) -> None:
    """The attack end to end: two ~4 MiB requests on an established stream, in 1 KiB DATA frames
    within the windows the server grants, 16 frames per TCP write (and a PING, so that a write is
    one read). Whatever the server allocates in data_received, per read, adds up to a few times the
    bytes received, not a copy of the message so far per read."""
    original = Server._protocol_factory

    def factory(self: Server) -> Any:
        protocol = original(self)
        received = protocol.data_received
        protocol.data_received = lambda chunk: allocations.measure(functools.partial(received, chunk))
        return protocol

    monkeypatch.setattr(Server, "_protocol_factory", factory)
    async with serving(ConnectionLimits(), max_message_size=BIG_LIMIT) as (_, service, port), client_of(port) as client:
        sid, _ = await direct_stream(client, service, "a")
        requests = service.counters.requests
        allocations.total = 0  # what the attack costs, from here on
        message = grpc(tagged("big", size=BIG))
        frames = [data(sid, message[i : i + PIECE]) for i in range(0, len(message), PIECE)]
        for _ in range(2):
            for i in range(0, len(frames), 16):
                batch = b"".join(frames[i : i + 16])
                size = len(batch) - 9 * len(frames[i : i + 16])
                assert await client.until(lambda: min(client.conn_window, client.windows[sid]) >= size), "stalled"  # noqa: B023
                client.pings_sent += 1
                await client.send(batch + frame(PING, 0, 0, client.pings_sent.to_bytes(8, "big")))
                assert await client.until(lambda: client.pings >= client.pings_sent), "no PING ACK"
        total = allocations.total
        assert service.counters.requests == requests + 2 and sid not in client.trailers and client.goaway is None
        reader = reader_of(service, "a")
        assert reader is not None and reader.messages == 3, "not read on the direct path"  # the ACK, and these
        received = 2 * len(message)
        assert total < LINEAR * received, (
            f"{total:,} bytes allocated in data_received for {received:,} bytes of requests in {PIECE}-byte "
            f"frames ({total / received:.0f} times their size)"
        )


# 2. A frame announced over SETTINGS_MAX_FRAME_SIZE


@contextlib.asynccontextmanager
async def raw_client(port: int) -> AsyncIterator[Client]:
    """A Client whose connection has sent nothing yet, not even the preface."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = Client(Conn(reader, writer))
    try:
        yield client
    finally:
        client.close()


@pytest.mark.parametrize(
    "where", ["HEADERS", "DATA", "CONTINUATION", "DATA on a direct stream", "HEADERS with the preface"]
)
async def test_an_oversize_frame_is_refused_from_its_header(where: str, caplog: pytest.LogCaptureFixture) -> None:
    """A frame whose header announces 16 MiB (the limit is 16 KiB) is a connection error
    (RFC 9113 4.2): GOAWAY FRAME_SIZE_ERROR as soon as the 9-byte header is in, before the payload
    comes (its first 64 KiB trickled, 1 KiB per 20 ms), not once all 16 MiB are buffered. Also when
    the header comes in the connection's first TCP segment, right after the client preface."""
    caplog.set_level(logging.INFO)
    async with (
        serving(ConnectionLimits()) as (_, service, port),
        client_of(port) as canary,
        raw_client(port) if where == "HEADERS with the preface" else client_of(port) as client,
    ):
        canary_sid, _ = await direct_stream(canary, service, "canary")
        if where == "HEADERS with the preface":
            sid, ftype, flags = 1, HEADERS, END_HEADERS
            await client.send(PREFACE + OVERSIZE.to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big"))
        elif where == "DATA on a direct stream":
            sid, _ = await direct_stream(client, service, "a")
            ftype, flags = DATA, 0
        else:
            sid, opening = client.new_stream()
            ftype, flags = (HEADERS, END_HEADERS) if where == "HEADERS" else (DATA, 0)
            if where == "DATA":
                await client.send(opening)
            elif where == "CONTINUATION":  # a header block begun, continued by the oversize frame
                await client.send(frame(HEADERS, 0, sid, client.conn.encoder.encode(headers("/x"))))
                ftype, flags = CONTINUATION, END_HEADERS
        if where != "HEADERS with the preface":
            await client.send(OVERSIZE.to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big"))
        sent = 0
        for _ in range(ANSWERED_WITHIN // PIECE):  # bounded
            if await client.until(lambda: client.goaway is not None, wait=0.02) or client.eof:
                break
            await client.conn.send(b"\x00" * PIECE)
            sent += PIECE
        assert client.goaway == FRAME_SIZE_ERROR, (
            f"{where}: no GOAWAY FRAME_SIZE_ERROR with {sent:,} bytes of the {OVERSIZE:,}-byte payload sent "
            f"(GOAWAY {client.goaway}, closed {client.eof})"
        )
        assert sent < ANSWERED_WITHIN
        assert await client.until(lambda: client.eof), "the connection was not closed"
        await canary_gets_a_change(canary, service, canary_sid, 2)
    no_server_errors(caplog)


# 3. Malformed request headers


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_request_headers_are_a_protocol_error(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """A malformed request (RFC 9113 8.1.1) is a stream error PROTOCOL_ERROR: RST_STREAM, and the
    connection goes on (a valid request on a fresh stream of it is answered). GOAWAY PROTOCOL_ERROR
    is taken too: h2's own header validation (validate_inbound_headers) answers every one of these
    with it. Never left unanswered, never an error logged for it."""
    caplog.set_level(logging.INFO)
    async with (
        serving(ConnectionLimits()) as (_, service, port),
        client_of(port) as canary,
        client_of(port) as client,
    ):
        canary_sid, _ = await direct_stream(canary, service, "canary")
        sid = client.conn.next_id
        client.conn.next_id += 2
        await client.send(frame(HEADERS, END_HEADERS, sid, client.conn.encoder.encode(MALFORMED[case])))
        answered = await client.until(lambda: sid in client.resets or client.goaway is not None, wait=3.0)
        assert answered, (
            f"{case}: no RST_STREAM or GOAWAY in 3 s (trailers: {client.trailers.get(sid)}, closed: {client.eof})"
        )
        if sid in client.resets:
            assert client.resets[sid] == PROTOCOL_ERROR, client.resets
            other = await client.request(first_request("b", "web"))
            await client.response(other, 1)
        else:
            assert client.goaway == PROTOCOL_ERROR, client.goaway
        assert sid not in client.trailers and not client.messages.get(sid)
        await canary_gets_a_change(canary, service, canary_sid, 2)
    no_server_errors(caplog)
