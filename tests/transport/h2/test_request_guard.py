"""A stream's request refused on its own, whichever HTTP/2 path serves (`make test-stock` runs
these on the stock one, where the guard below grpclib decides): malformed request headers and
trailers (RFC 9113 section 8) answered RST_STREAM PROTOCOL_ERROR, and an address's streams awaiting
their first request bounded (RST_STREAM REFUSED_STREAM). Each refusal is counted by reason, the
connection goes on (its HPACK state in step: the client's encoder indexes every block), and a
canary keeps getting its changes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import types

import pytest

from eds_server.transport.h2.limits import ConnectionLimits
from eds_server.transport.h2.stock import STOCK_MAX_STREAMS, STOCK_PENDING_STREAMS
from tests.support.grpc_harness import serving
from tests.support.h2_client import SOURCE, Client, ack, client_of, data, first_request, group, grpc
from tests.support.h2frames import (
    END_HEADERS,
    GOAWAY,
    HEADERS,
    PING,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    read_frames,
)
from tests.support.hostile_clients import MALFORMED, PROTOCOL_ERROR, Conn, headers
from tests.support.waiting import wait_for

REFUSED_STREAM = 7
ENHANCE_YOUR_CALM = 11
END_STREAM = 1


def no_server_errors(caplog: pytest.LogCaptureFixture) -> None:
    assert "Traceback" not in caplog.text and "Server error" not in caplog.text, caplog.text[-3000:]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-3000:]


async def open_canary(client: Client) -> int:
    """A well-behaved client's stream, its first response ACKed: the next change is sent to it."""
    sid = await client.request(first_request("canary", "web"))
    await client.send(data(sid, grpc(ack(await client.response(sid, 1), "web"))))
    await client.ping()
    return sid


@pytest.mark.parametrize("case", [*MALFORMED, "non-ASCII value"])
async def test_a_malformed_request_is_refused_alone(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """RST_STREAM PROTOCOL_ERROR (or GOAWAY PROTOCOL_ERROR: h2's own check on the fast path), never
    a handler, never unanswered; a valid request on the same connection is then served."""
    caplog.set_level(logging.INFO)
    fields = MALFORMED.get(case) or [*headers("/x"), ("x-name", "caf\u00e9")]
    async with serving(ConnectionLimits()) as (server, service, port), client_of(port) as canary:
        canary_sid = await open_canary(canary)
        async with client_of(port) as client:
            sid = client.conn.next_id
            client.conn.next_id += 2
            await client.send(frame(HEADERS, END_HEADERS, sid, client.conn.encoder.encode(fields)))
            answered = await client.until(lambda: sid in client.resets or client.goaway is not None)
            assert answered, f"{case}: no RST_STREAM or GOAWAY (trailers: {client.trailers.get(sid)})"
            if sid in client.resets:
                assert client.resets[sid] == PROTOCOL_ERROR, client.resets
                assert server.refused["bad_headers"] == 1, server.refused
                other = await client.request(first_request("b", "web"))  # HPACK still in step
                await client.response(other, 1)
            else:
                assert client.goaway == PROTOCOL_ERROR, client.goaway
            assert sid not in client.trailers and not client.messages.get(sid)
        service.store.update(SOURCE, group(2))
        await canary.response(canary_sid, 2)
    no_server_errors(caplog)


async def test_malformed_trailers_reset_the_stream(caplog: pytest.LogCaptureFixture) -> None:
    """Trailers holding a pseudo-header: the stream is reset (PROTOCOL_ERROR), the connection serves on."""
    caplog.set_level(logging.INFO)
    async with serving(ConnectionLimits()) as (server, _, port), client_of(port) as client:
        sid = await client.request(first_request("a", "web"))
        await client.response(sid, 1)
        block = client.conn.encoder.encode([(":path", "/x"), ("x-after", "1")])
        await client.send(frame(HEADERS, END_HEADERS | END_STREAM, sid, block))
        assert await client.until(lambda: sid in client.resets), (client.resets, client.trailers)
        assert client.resets[sid] == PROTOCOL_ERROR
        assert server.refused["bad_headers"] == 1
        other = await client.request(first_request("b", "web"))
        await client.response(other, 1)
    no_server_errors(caplog)


async def test_streams_awaiting_a_request_are_bounded_per_address(caplog: pytest.LogCaptureFixture) -> None:
    """Past `pending_streams` of an address's streams awaiting their first request, a new one is
    refused (REFUSED_STREAM, counted); those awaiting are served once their requests come, and
    then new streams are taken again."""
    caplog.set_level(logging.INFO)
    async with serving(ConnectionLimits(pending_streams=4)) as (server, service, port), client_of(port) as canary:
        canary_sid = await open_canary(canary)
        async with client_of(port) as client:
            opened = [client.new_stream() for _ in range(6)]
            await client.send(b"".join(opening for _, opening in opened))
            refused = [sid for sid, _ in opened[4:]]
            assert await client.until(lambda: all(s in client.resets for s in refused)), client.resets
            assert [client.resets[s] for s in refused] == [REFUSED_STREAM] * 2
            assert not any(s in client.resets for s, _ in opened[:4])
            assert server.refused["pending_streams"] == 2, server.refused
            for n, (sid, _) in enumerate(opened[:4]):
                await client.send(data(sid, grpc(first_request(f"n{n}", "web"))))
                await client.response(sid, 1)
            fresh = await client.request(first_request("fresh", "web"))
            await client.response(fresh, 1)
        service.store.update(SOURCE, group(2))
        await canary.response(canary_sid, 2)
    no_server_errors(caplog)


async def test_an_address_that_wastes_streams_may_hold_fewer_awaiting_a_request(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound on an address's streams awaiting a request shrinks with the stream budget it has
    spent: half spent, half the bound. A flat bound let an address whose budget ran out open the
    whole bound again for each token refilled, a thousand header blocks' work per token. The
    budgets' clock is the test's: a loaded host's pauses refill nothing."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr("eds_server.ratelimit.time", types.SimpleNamespace(monotonic=lambda: 1000.0))
    limits = ConnectionLimits(pending_streams=40, stream_budget=100)
    async with serving(limits) as (server, service, port), client_of(port) as canary:
        canary_sid = await open_canary(canary)
        async with client_of(port, "127.0.0.8") as client:
            wasted = [client.conn.open_stream(end=True)[1] for _ in range(50)]  # ended by their headers
            await client.send(b"".join(wasted))
            await client.ping()
            opened = [client.new_stream() for _ in range(40)]  # the whole bound, had it spent nothing
            await client.send(b"".join(opening for _, opening in opened))
            await client.ping()
            refused = [sid for sid, _ in opened if sid in client.resets]
            held = len(opened) - len(refused)
            assert 20 <= held <= 30, (held, client.resets)  # 20: nothing refills on the test's clock
            assert {client.resets[s] for s in refused} == {REFUSED_STREAM}, client.resets
            assert server.refused["pending_streams"] == len(refused), server.refused
            assert client.goaway is None
        service.store.update(SOURCE, group(2))
        await canary.response(canary_sid, 2)
    no_server_errors(caplog)


async def test_an_address_that_spent_its_stream_budget_opens_nothing_until_a_tenth_is_back(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once an address has spent its stream budget, its next connection is ended at its first
    stream (GOAWAY ENHANCE_YOUR_CALM) until a tenth of the budget has refilled, not as soon as one
    token has: streams are charged after h2 or a handler has done their work, and one read brings
    hundreds, so a single token let a whole connection's worth in. The budgets' clock is the test's."""
    caplog.set_level(logging.INFO)
    now = [1000.0]
    monkeypatch.setattr("eds_server.ratelimit.time", types.SimpleNamespace(monotonic=lambda: now[0]))
    limits = ConnectionLimits(stream_budget=20)  # refills 2 a second
    async with serving(limits) as (server, service, port), client_of(port) as canary:
        canary_sid = await open_canary(canary)
        async with client_of(port, "127.0.0.9") as client:
            await client.send(b"".join(client.conn.open_stream(end=True)[1] for _ in range(21)))
            assert await client.until(lambda: client.goaway is not None), client.resets
            assert client.goaway == ENHANCE_YOUR_CALM
        now[0] += 0.6  # one token back, a twentieth of the budget
        async with client_of(port, "127.0.0.9") as client:
            sid = await client.request(first_request("early", "web"))
            assert await client.until(lambda: client.goaway is not None), client.messages
            assert client.goaway == ENHANCE_YOUR_CALM and not client.messages[sid]
        assert server.refused["calm"] == 2, server.refused
        now[0] += 0.5  # a tenth back
        async with client_of(port, "127.0.0.9") as client:
            sid = await client.request(first_request("later", "web"))
            await client.response(sid, 1)
        service.store.update(SOURCE, group(2))
        await canary.response(canary_sid, 2)
    no_server_errors(caplog)


RESOURCE_EXHAUSTED = 8


async def test_an_oversize_message_is_refused_from_its_length_prefix(caplog: pytest.LogCaptureFixture) -> None:
    """A message announced over --max-message-size (1 MiB here) gets RESOURCE_EXHAUSTED before its
    body comes; what the client goes on sending on that stream is given back to its connection
    window (the server never waits on it), and the connection serves its next request."""
    caplog.set_level(logging.INFO)
    async with serving(ConnectionLimits()) as (server, service, port), client_of(port) as canary:
        canary_sid = await open_canary(canary)
        async with client_of(port, "127.0.0.7") as client:
            sid, opening = client.new_stream()
            await client.send(opening + data(sid, b"\x00" + (1 << 30).to_bytes(4, "big")))
            assert await client.until(lambda: client.status(sid) is not None or sid in client.resets)
            assert client.status(sid) == RESOURCE_EXHAUSTED, (client.trailers, client.resets)
            window = client.conn_window
            for _ in range(140):  # what a client had in flight, and more: 2.24 MB of the refused message
                await client.send(data(sid, b"\x00" * 16_000))
            await client.ping()
            # given back: at once on the stock path (left out below h2), with h2's next update on the
            # fast path (h2 gives a connection's window back once half of it, 2 MiB, was used)
            assert await client.until(lambda: client.conn_window >= window - (2 << 20)), (window, client.conn_window)
            other = await client.request(first_request("b", "web"))
            await client.response(other, 1)
        assert server.refused["message_size"] == 1, server.refused
        service.store.update(SOURCE, group(2))
        await canary.response(canary_sid, 2)
    no_server_errors(caplog)


async def test_messages_being_received_are_bounded_per_address(caplog: pytest.LogCaptureFixture) -> None:
    """The partial-message budget: an address holding a quarter of it (at least one message: 1 MiB
    here) in messages announced and not yet received gets RESOURCE_EXHAUSTED for the next one; once
    its held message's stream is reset, the budget is given back and it is served again. Others
    (the canary) are served throughout."""
    caplog.set_level(logging.INFO)
    limits = ConnectionLimits(partial_message_budget=2 << 20)
    async with serving(limits) as (server, service, port), client_of(port) as canary:
        canary_sid = await open_canary(canary)
        async with client_of(port, "127.0.0.8") as client:
            held, opening = client.new_stream()
            await client.send(opening + data(held, b"\x00" + (900_000).to_bytes(4, "big") + b"\x00" * 1000))
            await client.ping()
            sid, opening = client.new_stream()
            await client.send(opening + data(sid, b"\x00" + (900_000).to_bytes(4, "big")))
            assert await client.until(lambda: client.status(sid) is not None or sid in client.resets)
            assert client.status(sid) == RESOURCE_EXHAUSTED, (client.trailers, client.resets)
            assert server.refused["partial_messages"] == 1, server.refused
            service.store.update(SOURCE, group(2))
            await canary.response(canary_sid, 2)
            await client.send(frame(RST_STREAM, 0, held, (8).to_bytes(4, "big")))  # CANCEL: given back
            again = await client.request(first_request("c", "web"))
            await client.response(again, 1)
    no_server_errors(caplog)


@pytest.mark.parametrize("with_requests", [True, False])
async def test_streams_past_the_limit_before_our_settings(with_requests: bool) -> None:
    """Stock path: 300 streams opened at once, before the client reads our SETTINGS (limit 100).
    Each with its request (as Envoy opens them): those past the limit are refused (REFUSED_STREAM),
    the connection stays and its first 100 are served. Headers only: the connection is ended
    (ENHANCE_YOUR_CALM) rather than read for streams nobody will use."""
    async with serving(ConnectionLimits()) as (server, _, port):
        if server.fast:
            pytest.skip("the stock path's handling of h2's concurrent stream limit")
        conn = await Conn.open(port, "127.0.0.11")
        try:
            opened = []
            for n in range(300):
                sid, opening = conn.open_stream()
                opened.append(opening + (data(sid, grpc(first_request(f"n{n}", "web"))) if with_requests else b""))
            await conn.send(b"".join(opened))
            frames = await read_frames(conn.reader, wait=3.0)
        finally:
            conn.close()
        resets = [int.from_bytes(p, "big") for t, p in frames if t == RST_STREAM]
        goaway = [int.from_bytes(p[4:8], "big") for t, p in frames if t == GOAWAY]
        if with_requests:
            assert not goaway and resets.count(REFUSED_STREAM) == 200, (goaway, resets[:5], len(resets))
            assert server.refused["calm"] == 0
        else:
            assert goaway == [ENHANCE_YOUR_CALM], goaway
            assert server.refused["calm"] == 1


FLOW_CONTROL_ERROR = 3


@pytest.mark.parametrize("window", ["connection", "stream", "settings"])
async def test_a_window_taken_past_its_maximum_is_a_flow_control_error(
    window: str, caplog: pytest.LogCaptureFixture
) -> None:
    """RFC 9113 section 6.9.1: a WINDOW_UPDATE taking a stream's send window past 2^31-1 is a stream
    error (RST_STREAM FLOW_CONTROL_ERROR, the connection serves on); the connection's window, or a
    SETTINGS_INITIAL_WINDOW_SIZE change taking any window there, a connection error (GOAWAY
    FLOW_CONTROL_ERROR); never left unanswered, and others are served on."""
    caplog.set_level(logging.INFO)
    async with serving(ConnectionLimits()) as (server, service, port), client_of(port) as canary:
        canary_sid = await open_canary(canary)
        async with client_of(port, "127.0.0.12") as client:
            sid = await client.request(first_request("a", "web"))
            await client.response(sid, 1)
            if window == "settings":  # the stream's window near the top (from 2^30 less what was sent), raised
                raw = frame(WINDOW_UPDATE, 0, sid, (2**30 - 1).to_bytes(4, "big"))
                raw += frame(SETTINGS, 0, 0, (4).to_bytes(2, "big") + (2**30 + 10_000).to_bytes(4, "big"))
            else:
                raw = frame(WINDOW_UPDATE, 0, sid if window == "stream" else 0, (2**31 - 1).to_bytes(4, "big"))
            await client.send(raw)
            assert await client.until(lambda: client.goaway is not None or sid in client.resets)
            if window == "stream":  # a stream error: that stream is reset, the connection serves on
                assert client.goaway is None and client.resets.get(sid) == FLOW_CONTROL_ERROR, client.resets
                other = await client.request(first_request("b", "web"))
                await client.response(other, 1)
            else:
                assert client.goaway == FLOW_CONTROL_ERROR, (client.goaway, client.resets)
        if not server.fast and window != "stream":  # answered by the guard, below h2
            assert server.refused["protocol_error"] == 1, server.refused
        service.store.update(SOURCE, group(2))
        await canary.response(canary_sid, 2)
    no_server_errors(caplog)


async def test_stream_windows_overflowed_on_purpose_are_charged_as_resets(caplog: pytest.LogCaptureFixture) -> None:
    """Each stream whose window a client takes past 2^31-1 is reset by us: a reset the client caused,
    charged to its address's reset budget as its own would be (else a stream opened with a request
    and overflowed is a rapid reset that costs nothing). Past the budget (20 here) the connection is
    ended ENHANCE_YOUR_CALM; the canary is served throughout."""
    caplog.set_level(logging.INFO)
    async with serving(ConnectionLimits(), reset_budget=20) as (_, service, port), client_of(port) as canary:
        canary_sid = await open_canary(canary)
        async with client_of(port, "127.0.0.13") as client:
            for n in range(30):
                if client.goaway is not None:
                    break
                sid = await client.request(first_request(f"r{n}", "web"))
                await client.send(frame(WINDOW_UPDATE, 0, sid, (2**31 - 1).to_bytes(4, "big")))
                await client.until(lambda: sid in client.resets or client.goaway is not None)  # noqa: B023
            assert client.goaway == ENHANCE_YOUR_CALM, (client.goaway, len(client.resets))
            assert 19 <= len(client.resets) <= 21, len(client.resets)
        service.store.update(SOURCE, group(2))
        await canary.response(canary_sid, 2)
    no_server_errors(caplog)


PRIORITY_FLAG = 0x20


@pytest.mark.parametrize("case", ["depends on itself", "lower stream id"])
async def test_stream_state_errors_reach_the_http2_library(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """The guard re-encodes every header block on the stock path: what it passes on keeps what h2
    checks (the priority a HEADERS frame carries; a HEADERS frame on a stream that is not open is
    not taken for trailers), so these stay connection errors as RFC 9113 says (h2spec 5.3.1 and
    5.1.1.2), and the canary's connection is untouched."""
    caplog.set_level(logging.INFO)
    async with serving(ConnectionLimits()) as (_, service, port), client_of(port) as canary:
        canary_sid = await open_canary(canary)
        async with client_of(port) as client:
            block = client.conn.encoder.encode(headers("/x"))
            if case == "depends on itself":  # stream 1, depending on stream 1, weight 16
                priority = (1).to_bytes(4, "big") + b"\x0f"
                raw = frame(HEADERS, END_HEADERS | END_STREAM | PRIORITY_FLAG, 1, priority + block)
                expected = PROTOCOL_ERROR
            else:  # stream 5, then stream 3
                raw = frame(HEADERS, END_HEADERS | END_STREAM, 5, block)
                raw += frame(HEADERS, END_HEADERS | END_STREAM, 3, client.conn.encoder.encode(headers("/x")))
                expected = PROTOCOL_ERROR
            await client.send(raw)
            # grpclib closes without flushing the GOAWAY h2 queued (h2spec takes either)
            assert await client.until(lambda: client.goaway is not None or client.eof), f"{case}: {client.resets}"
            assert client.goaway in (expected, None), (case, client.goaway)
            assert not client.messages and not client.trailers, f"{case}: answered"
        service.store.update(SOURCE, group(2))
        await canary.response(canary_sid, 2)
    no_server_errors(caplog)


async def test_a_message_drip_fed_past_the_request_timeout_ends_its_stream(caplog: pytest.LogCaptureFixture) -> None:
    """A request whose length prefix came but whose body does not: the stream ends with
    DEADLINE_EXCEEDED once the request timeout has passed (its partial-message budget given back),
    the connection serves on."""
    caplog.set_level(logging.INFO)
    limits = ConnectionLimits(request_timeout=0.5)
    async with serving(limits) as (server, _, port), client_of(port) as client:
        sid = await client.request(first_request("a", "web"))
        body = grpc(ack(await client.response(sid, 1), "web"))
        await client.send(data(sid, body[:8]))  # the prefix and 3 bytes of the body, the rest never
        assert await client.until(lambda: client.status(sid) is not None, wait=10), client.trailers
        assert client.status(sid) == 4  # DEADLINE_EXCEEDED
        assert "not complete within" in client.trailers[sid]["grpc-message"]
        if not server.fast:
            assert server.refused["slow_input"] == 1, server.refused
        other = await client.request(first_request("b", "web"))
        await client.response(other, 1)
    no_server_errors(caplog)


async def test_a_first_request_whose_body_never_ends_ends_its_stream(caplog: pytest.LogCaptureFixture) -> None:
    """The same for a stream's first request: its HEADERS, the length prefix and part of the body in
    one write, the rest never. The part that came is read at once; what is missing keeps the request
    timeout (a read that cannot complete from what is buffered waits with a deadline)."""
    caplog.set_level(logging.INFO)
    limits = ConnectionLimits(request_timeout=0.5)
    async with serving(limits) as (_, _, port), client_of(port) as client:
        sid, opening = client.new_stream()
        body = grpc(first_request("a", "web"))
        await client.send(opening + data(sid, body[: len(body) // 2]))
        assert await client.until(lambda: client.status(sid) is not None, wait=10), client.trailers
        assert client.status(sid) == 4  # DEADLINE_EXCEEDED
        assert "not complete within" in client.trailers[sid]["grpc-message"]
        other = await client.request(first_request("b", "web"))
        await client.response(other, 1)
    no_server_errors(caplog)


async def test_a_frame_drip_fed_past_the_request_timeout_ends_the_connection() -> None:
    """A DATA frame begun and fed a byte at a time, so that the same frame is still not complete a
    request timeout later: the connection is closed (counted as slow input), on either path."""
    limits = ConnectionLimits(request_timeout=0.5)
    async with serving(limits) as (server, _, port), client_of(port) as client:
        sid = await client.request(first_request("a", "web"))
        await client.response(sid, 1)
        await client.send(frame(0, 0, sid, b"\0" * 100)[:12])  # the header and 3 of 100 bytes
        dripped = 0
        for _ in range(40):  # bounded: 40 bytes at most, one every 0.1 s
            if not await client.until(lambda: False, wait=0.1) and client.eof:
                break
            with contextlib.suppress(OSError):
                await client.send(b"\0")
                dripped += 1
        assert client.eof or client.goaway is not None, f"still open after {dripped} bytes"
        assert server.refused["slow_input"] == 1, server.refused


async def test_an_empty_data_frame_before_the_request_is_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """HTTP/2 allows an empty DATA frame; grpclib's reader took one for the end of the stream inside a
    message (an AssertionError traceback on the stock path, the stream ended on the fast path)."""
    caplog.set_level(logging.INFO)
    async with serving(ConnectionLimits()) as (_, _, port), client_of(port) as client:
        sid, opening = client.new_stream()
        await client.send(opening + data(sid, b""))
        await client.ping()  # the server has read it, and its handler has run
        await client.send(data(sid, grpc(first_request("a", "web"))))
        await client.response(sid, 1)
        assert client.status(sid) is None
    no_server_errors(caplog)


async def test_a_request_waiting_in_our_own_read_queue_is_not_late() -> None:
    """A stream whose HEADERS were read in one slice and whose request waits in the read scheduler's
    queue (turns of the loop a second apart here, the request timeout half that) is served, not
    timed out: what waits on our side is not the client's delay."""
    async with serving(ConnectionLimits(request_timeout=0.5)) as (server, _, port), client_of(port) as client:
        loop = asyncio.get_running_loop()
        reads = server.gate.reads
        reads.turn_budget = 1e-9  # one slice a turn
        reads.call_soon = lambda f: loop.call_later(1.0, f)
        sids, chunks = [], [frame(PING, 0, 0, b"12345678")]  # one frame first: a slice ends between a pair
        for i in range(40):  # past one slice of frames: a stream's HEADERS in one, its request in the next
            sid, opening = client.new_stream()
            sids.append(sid)
            chunks.append(opening + data(sid, grpc(first_request(f"n{i}", "web"))))
        await client.send(b"".join(chunks))
        assert await client.until(lambda: all(client.messages.get(s) for s in sids), wait=15), {
            s: client.trailers.get(s) for s in sids if not client.messages.get(s)
        }
        assert server.refused["no_request"] == 0 and reads.deferred >= 1


@pytest.mark.skipif(os.environ.get("EDS_HTTP2") != "stock", reason="the stock path's own bound (make test-stock)")
async def test_the_stock_path_holds_sixteen_connections_of_streams_awaiting_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the stock path grpclib starts a handler, and the service a session, for each stream as it
    opens: an address's streams awaiting a request are bounded by sixteen connections' worth there
    (1,600), not the fast path's 16,384, where each costs an h2 stream alone. The budgets' clock is
    the test's (a loaded host's pauses refill nothing); the stream budget is large, so that the bound
    does not shrink as the refused streams are charged."""
    monkeypatch.setattr("eds_server.ratelimit.time", types.SimpleNamespace(monotonic=lambda: 1000.0))
    async with serving(ConnectionLimits(stream_budget=100_000)) as (server, _, port):
        conns = [await Conn.open(port, "127.0.0.9") for _ in range(STOCK_PENDING_STREAMS // STOCK_MAX_STREAMS + 1)]
        try:
            for conn in conns:
                await conn.send(b"".join(conn.open_stream()[1] for _ in range(STOCK_MAX_STREAMS)))
            await wait_for(lambda: server.refused["pending_streams"] == STOCK_MAX_STREAMS, what=str(server.refused))
            assert server.gate.peers["127.0.0.9"].pending == STOCK_PENDING_STREAMS
        finally:
            for conn in conns:
                conn.close()


async def test_a_frame_header_begun_and_left_does_not_hold_the_deadlines_back() -> None:
    """A few bytes of a frame header (fewer than its nine) wait with us until the rest comes, but
    they are the client's delay, not our queue's: a stream without a request is still timed out,
    and a connection that opens no stream still closed, on either path."""
    async with serving(ConnectionLimits(request_timeout=0.5)) as (server, _, port):
        async with client_of(port) as client:
            sid, opening = client.new_stream()
            await client.send(opening + frame(PING, 0, 0, b"12345678")[:5])
            assert await client.until(lambda: sid in client.resets or sid in client.trailers, wait=10), (
                "a stream without a request outlived its timeout while five bytes of a header waited"
            )
            assert server.refused["no_request"] == 1, server.refused
        async with client_of(port) as client:
            await client.send(frame(PING, 0, 0, b"12345678")[:5])
            assert await client.until(lambda: client.eof or client.goaway is not None, wait=10), (
                "a connection that opened no stream outlived its timeout while five bytes of a header waited"
            )
            assert server.refused["no_stream"] == 1, server.refused
