"""Requests on established streams read straight from their DATA frames (transport/h2/direct.py), over
real loopback sockets, by a raw HTTP/2 client that writes its frames (and TCP writes) exactly as a
test needs them.

Each test proves the direct path was taken where it matters: the stream's DirectReader (found in its
h2 connection's `direct` dict) counts the messages it read. Every wait is bounded (WAIT seconds at
most, loops by count); nothing measures time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2

from eds_server.pb.envoy.service.discovery.v3 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
)
from eds_server.transport.h2 import ConnectionLimits
from eds_server.xds.common import EDS_TYPE_URL
from tests.support.grpc_harness import serving
from tests.support.h2_client import (
    DELTA,
    SOURCE,
    WAIT,
    Client,
    ack,
    client_of,
    data,
    direct_stream,
    first_request,
    group,
    grpc,
    reader_of,
    tagged,
)
from tests.support.h2frames import (
    CONTINUATION,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PADDED,
    RST_STREAM,
    frame,
)
from tests.support.hostile_clients import STREAM, headers
from tests.support.waiting import wait_for

OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED = 0, 3, 4, 8, 12


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# 1. SotW: ACK after ACK


async def test_sotw_acks_are_read_directly_and_responses_keep_flowing() -> None:
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        sid, r1 = await direct_stream(client, service, "a")
        reader = reader_of(service, "a")
        versions = [r1.version_info]
        for i in range(2, 42):  # 40 changes, each answered and ACKed in a DATA frame of its own
            service.store.update(SOURCE, group(i))
            resp = await client.response(sid, i)
            versions.append(resp.version_info)
            await client.send(data(sid, grpc(ack(resp, "web"))))
        await wait_for(lambda: service.counters.acks == 41, timeout=WAIT)
        assert len(set(versions)) == 41 and versions[-1] == service.store.get("web").version
        assert reader_of(service, "a") is reader  # never left the direct path...
        assert reader is not None and reader.messages == 41  # ...and read every ACK
        assert service.counters.nacks == 0 and service.counters.responses == 41
        assert reader_tasks() == []  # no task waits on the direct reader: its future stands for it


def reader_tasks() -> list[asyncio.Task[object]]:
    """The streams' reader tasks (StreamSession.read) alive now."""
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "StreamSession.read"]


# 2. Messages cut across DATA frames and TCP writes, and several in one frame


async def test_messages_split_and_merged_across_frames_and_writes(handled: Callable[[str], list[bytes]]) -> None:
    async with serving(ConnectionLimits()) as (server, service, port), client_of(port) as client:
        sid, _ = await direct_stream(client, service, "a")
        m = [tagged(f"t{i}", size=40_000 if i == 10 else 0) for i in range(11)]
        g = [grpc(x) for x in m]

        async def write(raw: bytes) -> None:
            await client.send(raw)
            await asyncio.sleep(0.005)  # apart, most likely read apart too (whether or not, same answer)

        # one message in three DATA frames, its prefix cut between the first two
        await write(data(sid, g[0][:2]) + data(sid, g[0][2:12]) + data(sid, g[0][12:]))
        # one DATA frame cut across writes: its header in two, then its payload's prefix byte by byte
        one = data(sid, g[1])
        for piece in [one[:4], one[4:9], *(one[i : i + 1] for i in range(9, 14)), one[14:]]:
            await write(piece)
        # a DATA frame per byte of the prefix, each its own write
        for i in range(5):
            await write(data(sid, g[2][i : i + 1]))
        await write(data(sid, g[2][5:]))
        # three messages in one DATA frame
        await write(data(sid, g[3] + g[4] + g[5]))
        # frames that end and begin messages
        await write(data(sid, g[6] + g[7][:3]) + data(sid, g[7][3:] + g[8] + g[9][:7]) + data(sid, g[9][7:]))
        # a 40 KB message in three frames, written in 1,000-byte pieces (cut anywhere)
        big = b"".join(data(sid, g[10][i : i + 16384]) for i in range(0, len(g[10]), 16384))
        for i in range(0, len(big), 1000):
            await write(big[i : i + 1000])
        await wait_for(lambda: len(handled("a")) == 2 + len(m), timeout=WAIT)
        assert handled("a")[2:] == m  # every one, in order
        reader = reader_of(service, "a")
        assert reader is not None and reader.messages == 1 + len(m)  # all of them read directly
        assert server.reader.budget is not None and server.reader.budget.used == 0


async def test_a_frame_begun_before_the_stream_went_direct(handled: Callable[[str], list[bytes]]) -> None:
    async with serving(ConnectionLimits()) as (_, _, port), client_of(port) as client:
        sid, opening = client.new_stream()
        second = data(sid, grpc(tagged("t1")))
        # the first request, and the start of the second's DATA frame, in one write: h2 holds the
        # frame begun when the first request is read and the stream goes direct
        await client.send(opening + data(sid, grpc(first_request("a", "web"))) + second[:16])
        await client.response(sid, 1)  # the stream is direct by now
        await client.send(second[16:] + data(sid, grpc(tagged("t2"))))
        await wait_for(lambda: len(handled("a")) >= 3, timeout=WAIT)  # t1 and t2 read before t3 is sent
        await client.send(data(sid, grpc(tagged("t3"))))
        await client.ping()
        await wait_for(lambda: len(handled("a")) >= 4, timeout=2.0)
        assert handled("a")[1:] == [tagged("t1"), tagged("t2"), tagged("t3")]


# 3. END_STREAM once the stream is direct


@pytest.mark.parametrize("last", ["empty DATA", "request", "request begun before"])
async def test_end_stream_after_the_stream_went_direct(
    last: str, handled: Callable[[str], list[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        sid, r1 = await direct_stream(client, service, "a")
        final = bytes(ack(r1, "web", "other"))  # subscribes to "other" too
        if last == "request begun before":  # read directly up to there, then left to grpclib with the rest
            await client.send(data(sid, grpc(final)[:20]))
            await client.ping()
            await client.send(data(sid, grpc(final)[20:], END_STREAM))
        else:
            await client.send(data(sid, b"" if last == "empty DATA" else grpc(final), END_STREAM))
        assert await client.until(lambda: sid in client.trailers)
        assert client.status(sid) == OK
        if last != "empty DATA":
            assert handled("a")[-1] == final
            r2 = await client.response(sid, 2)  # answered, before the trailers
            cla = endpoint_pb2.ClusterLoadAssignment.FromString(r2.resources[0].value)
            assert [cla.cluster_name] == ["other"] and len(r2.resources) == 1
        else:
            assert len(client.messages[sid]) == 1
        assert len(handled("a")) == 2 + (last != "empty DATA")
        assert sid not in client.resets
        await wait_for(lambda: service.open_streams == 0, timeout=WAIT)
    no_tracebacks(caplog)


# 4. A message begun, then the stream or connection ends


@pytest.mark.parametrize("begun", ["prefix", "body"])
@pytest.mark.parametrize("end", ["END_STREAM", "RST_STREAM", "connection closed"])
async def test_a_message_begun_then_the_stream_ends(begun: str, end: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with (
        serving(ConnectionLimits()) as (server, service, port),
        client_of(port) as canary,
        client_of(port) as client,
    ):
        canary_sid, _ = await direct_stream(canary, service, "canary")
        sid, _ = await direct_stream(client, service, "a")
        message = grpc(tagged("never finished", size=1000))
        await client.send(data(sid, message[:3] if begun == "prefix" else message[:300]))
        await client.ping()  # the server has it
        budget = server.reader.budget
        assert budget is not None and budget.used == (0 if begun == "prefix" else len(message) - 5)
        if end == "END_STREAM":
            await client.send(data(sid, b"", END_STREAM))
            assert await client.until(lambda: sid in client.trailers)
            assert client.status(sid) == INVALID_ARGUMENT  # truncated, not an empty request
        elif end == "RST_STREAM":
            await client.send(frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big")))
        else:
            client.close()
        await wait_for(lambda: service.open_streams == 1, timeout=WAIT)  # the canary's only
        assert budget.used == 0 and server.gate.peers["127.0.0.1"].partial == 0
        # the server goes on serving: the canary gets the next change, and its ACK is read directly
        service.store.update(SOURCE, group(2))
        resp = await canary.response(canary_sid, 2)
        await canary.send(data(canary_sid, grpc(ack(resp, "web"))))
        await canary.ping()
        reader = reader_of(service, "canary")
        assert reader is not None and reader.messages == 2
        assert service.counters.acks == 3
    no_tracebacks(caplog)


# 5. Limits on the direct path


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"\x00" + (2 << 20).to_bytes(4, "big") + b"\x0a" * 100, RESOURCE_EXHAUSTED),  # over the 1 MiB limit
        (b"\x01" + (5).to_bytes(4, "big") + b"\x0a\x03abc", UNIMPLEMENTED),  # compressed
        (grpc(b"\xff\xff\xff"), INVALID_ARGUMENT),  # not a DiscoveryRequest
    ],
    ids=["oversize", "compressed", "garbage"],
)
async def test_a_bad_message_on_a_direct_stream_ends_it(
    raw: bytes, status: int, handled: Callable[[str], list[bytes]]
) -> None:
    async with serving(ConnectionLimits()) as (server, service, port), client_of(port) as client:
        sid, _ = await direct_stream(client, service, "a")
        after = tagged("after")
        await client.send(data(sid, grpc(tagged("before")) + raw + grpc(after)))
        assert await client.until(lambda: sid in client.trailers)
        assert client.status(sid) == status
        assert tagged("before") in handled("a") and after not in handled("a")  # not what came after it
        await wait_for(lambda: service.open_streams == 0, timeout=WAIT)
        assert server.reader.budget is not None and server.reader.budget.used == 0
        # the connection goes on
        sid2, _ = await direct_stream(client, service, "b")
        assert sid2 != sid


async def test_a_message_begun_and_never_finished_runs_out_of_time() -> None:
    async with serving(ConnectionLimits(request_timeout=0.5)) as (server, service, port), client_of(port) as client:
        sid, _ = await direct_stream(client, service, "a")
        await client.send(data(sid, b"\x00" + (1000).to_bytes(4, "big") + b"\x0a" * 10))
        await client.ping()
        budget = server.reader.budget
        assert budget is not None and budget.used == 1000  # held for the message begun
        assert server.gate.peers["127.0.0.1"].partial == 1000
        assert await client.until(lambda: sid in client.trailers)
        assert client.status(sid) == DEADLINE_EXCEEDED
        assert "0.5s" in client.trailers[sid].get("grpc-message", "")  # the request timeout, as configured
        assert budget.used == 0 and server.gate.peers["127.0.0.1"].partial == 0  # given back


async def test_messages_begun_on_direct_streams_share_the_partial_budget() -> None:
    # the budget per IP: max(total / 4, the 1 MiB message size limit) = 1 MiB
    limits = ConnectionLimits(partial_message_budget=1 << 20)
    async with serving(limits) as (server, service, port), client_of(port) as client:
        a, _ = await direct_stream(client, service, "a")
        b, _ = await direct_stream(client, service, "b")
        await client.send(data(a, b"\x00" + (900_000).to_bytes(4, "big") + b"\x0a" * 100))
        await client.ping()
        budget = server.reader.budget
        assert budget is not None and budget.used == 900_000
        await client.send(data(b, b"\x00" + (900_000).to_bytes(4, "big") + b"\x0a" * 100))
        assert await client.until(lambda: b in client.trailers)
        assert client.status(b) == RESOURCE_EXHAUSTED and "busy" in client.trailers[b]["grpc-message"]
        assert budget.used == 900_000 and a not in client.trailers
        await client.send(frame(RST_STREAM, 0, a, (8).to_bytes(4, "big")))
        await wait_for(lambda: service.open_streams == 0, timeout=WAIT)
        assert budget.used == 0 and server.gate.peers["127.0.0.1"].partial == 0


# 6. Flow control


async def send_within_windows(client: Client, pending: dict[int, bytearray]) -> None:
    """Send every stream's bytes as DATA frames of at most 16 KiB, never past the connection's or the
    stream's send window: waiting for the server's WINDOW_UPDATEs when they are used up."""
    for _ in range(100_000):  # bounded
        out = b""
        for sid, buf in pending.items():
            n = min(16384, client.conn_window, client.windows[sid], len(buf))
            if n > 0:
                frame_ = data(sid, bytes(buf[:n]))
                del buf[:n]
                client.conn_window -= n
                client.windows[sid] -= n
                out += frame_
        if out:
            await client.conn.send(out)  # charged above
        if not any(pending.values()):
            return
        if not out:
            assert await client.pump(WAIT), f"stalled: windows {client.windows}, connection {client.conn_window}"
    raise AssertionError("not sent")


async def test_more_than_the_windows_in_direct_requests_is_not_stalled(handled: Callable[[str], list[bytes]]) -> None:
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        a, _ = await direct_stream(client, service, "a")
        b, _ = await direct_stream(client, service, "b")
        # 2 x 16 x 300 KB: 9.6 MB, more than the 4 MiB connection window and each 4 MiB stream window
        # and the two together
        sent = {node: [tagged(f"{node}{i}", size=300_000) for i in range(16)] for node in ("a", "b")}
        pending = {sid: bytearray(b"".join(grpc(m) for m in sent[node])) for sid, node in ((a, "a"), (b, "b"))}
        assert sum(len(p) for p in pending.values()) > 8 << 20
        await send_within_windows(client, pending)
        await wait_for(lambda: len(handled("a")) == 18 and len(handled("b")) == 18, timeout=30)
        for node in ("a", "b"):
            assert handled(node)[2:] == sent[node]
            reader = reader_of(service, node)
            assert reader is not None and reader.messages == 17  # every one read directly
        assert client.updates.get(a) and client.updates.get(b) and client.updates.get(0)


@pytest.mark.parametrize("fall_back", ["padded DATA", "DATA with an undefined flag"])
async def test_falling_back_and_returning_keeps_the_stream_window(
    fall_back: str, handled: Callable[[str], list[bytes]]
) -> None:
    """A DATA frame the direct path leaves to h2 (padded, or with a flag RFC 9113 does not define,
    which h2 ignores) makes the stream fall back without ending it; it goes direct again after the
    next message."""
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        sid, _ = await direct_stream(client, service, "a")
        expected = []
        for round_ in range(5):  # 5 x 1.5 MB: more than the 4 MiB stream window, granted back at 2 MiB
            messages = [tagged(f"r{round_}m{i}", size=300_000) for i in range(5)]
            await send_within_windows(client, {sid: bytearray(b"".join(grpc(m) for m in messages))})
            expected += messages
            count = 2 + len(expected)
            await wait_for(lambda: len(handled("a")) == count, timeout=WAIT, what=f"round {round_}")  # noqa: B023
            reader = reader_of(service, "a")
            assert reader is not None and reader.messages == (1 if round_ == 0 else 0) + 5  # read directly
            # a request in a frame that makes the stream fall back to h2 and grpclib
            back = tagged(f"back{round_}")
            payload = b"\x04" + grpc(back) + b"\x00" * 4 if fall_back == "padded DATA" else grpc(back)
            size = len(payload)
            assert await client.until(lambda: min(client.conn_window, client.windows[sid]) >= size)  # noqa: B023
            await client.send(data(sid, payload, PADDED if fall_back == "padded DATA" else 0x20))
            expected.append(back)
            await wait_for(lambda: len(handled("a")) == count + 1, timeout=WAIT, what=f"round {round_}")  # noqa: B023
            await wait_for(lambda: reader_of(service, "a") not in (None, reader), timeout=WAIT)  # noqa: B023  # direct again
            await wait_for(lambda: reader_tasks() == [], timeout=WAIT)  # the task that read through grpclib ended
        assert handled("a")[2:] == expected


async def test_an_empty_data_frame_on_a_direct_stream_is_nothing(handled: Callable[[str], list[bytes]]) -> None:
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        sid, _ = await direct_stream(client, service, "a")
        await client.send(data(sid, b"") + data(sid, grpc(tagged("after"))))
        await client.ping()
        await wait_for(lambda: tagged("after") in handled("a"), timeout=2.0)
        assert sid not in client.trailers


# 7. Delta


async def test_delta_requests_are_read_directly(handled: Callable[[str], list[bytes]]) -> None:
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        sid, _ = await direct_stream(client, service, "d", DELTA)
        reader = reader_of(service, "d")
        for i in range(2, 12):  # 10 changes, each ACKed
            service.store.update(SOURCE, group(i))
            resp = await client.response(sid, i, DeltaDiscoveryResponse)
            assert [r.name for r in resp.resources] == ["web"]
            await client.send(data(sid, grpc(DeltaDiscoveryRequest(type_url=EDS_TYPE_URL, response_nonce=resp.nonce))))
        # and a subscription change
        await client.send(
            data(sid, grpc(DeltaDiscoveryRequest(type_url=EDS_TYPE_URL, resource_names_subscribe=["other"])))
        )
        resp = await client.response(sid, 12, DeltaDiscoveryResponse)
        assert [r.name for r in resp.resources] == ["other"]
        await wait_for(lambda: service.counters.acks == 11, timeout=WAIT)
        assert reader_of(service, "d") is reader and reader is not None and reader.messages == 12
        assert len(handled("d")) == 13


# 8. A header block of another stream among a direct stream's DATA frames


@pytest.mark.parametrize("writes", ["one write", "block cut between writes", "CONTINUATION cut between writes"])
async def test_a_header_block_among_direct_data_frames(writes: str, handled: Callable[[str], list[bytes]]) -> None:
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        a, _ = await direct_stream(client, service, "a")
        b, _ = client.new_stream()  # for its id: its header block is built here, in three frames
        block = client.conn.encoder.encode(headers(STREAM))
        cut1, cut2 = len(block) // 3, 2 * len(block) // 3
        opening = (
            frame(HEADERS, 0, b, block[:cut1])
            + frame(CONTINUATION, 0, b, block[cut1:cut2])
            + frame(CONTINUATION, END_HEADERS, b, block[cut2:])
        )
        stream = (
            data(a, grpc(tagged("a1")))
            + opening
            + data(a, grpc(tagged("a2")))
            + data(b, grpc(first_request("b", "web")))
            + data(a, grpc(tagged("a3")))
        )
        if writes == "one write":
            pieces = [stream]
        else:
            at = stream.index(opening) + (9 + cut1 if writes == "block cut between writes" else 9 + cut1 + 9 + 3)
            pieces = [stream[:at], stream[at:]]
        for piece in pieces:
            await client.send(piece)
            await wait_for(lambda: tagged("a1") in handled("a"), timeout=WAIT)  # read before the next piece is sent
        await client.response(b, 1)  # stream b opened and answered
        await client.ping()
        assert client.goaway is None
        assert handled("a")[2:] == [tagged("a1"), tagged("a2"), tagged("a3")]
        reader = reader_of(service, "a")
        assert reader is not None and reader.messages == 4
        assert handled("b") == [bytes(first_request("b", "web"))]
        assert reader_of(service, "b") is not None  # b went direct in turn


async def test_a_direct_data_frame_inside_a_header_block_is_a_protocol_error(
    handled: Callable[[str], list[bytes]],
) -> None:
    """RFC 9113 6.10: nothing may come between a HEADERS frame and its CONTINUATION, a direct
    stream's DATA no more than any other frame; h2 answers GOAWAY PROTOCOL_ERROR."""
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        a, _ = await direct_stream(client, service, "a")
        b, _ = client.new_stream()
        block = client.conn.encoder.encode(headers(STREAM))
        await client.send(
            frame(HEADERS, 0, b, block[:5])
            + data(a, grpc(tagged("a1")))
            + frame(CONTINUATION, END_HEADERS, b, block[5:])
        )
        assert await client.until(lambda: client.goaway is not None)
        assert client.goaway == 1  # PROTOCOL_ERROR
        assert tagged("a1") not in handled("a")


# 9. Frames after the connection ended, in the same read


async def test_frames_after_a_goaway_in_the_same_read_are_not_fed_to_a_closed_connection(
    handled: Callable[[str], list[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    """A client's GOAWAY makes grpclib close the connection, taking h2's frame table and the
    transport away; a direct DATA frame after it splits the read, and the frames after that must
    not reach h2 (they did: an AttributeError in the read scheduler's turn, seen with 100,000
    streams in the bench)."""
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        a, _ = await direct_stream(client, service, "a")
        reader = reader_of(service, "a")
        assert reader is not None
        before = reader.messages
        goaway = frame(7, 0, 0, (0).to_bytes(4, "big") + (0).to_bytes(4, "big"))  # last stream 0, NO_ERROR
        ping = frame(6, 0, 0, b"12345678")
        with caplog.at_level(logging.ERROR):
            await client.send(goaway + data(a, grpc(tagged("a1"))) + ping)
            assert not await client.until(lambda: False)  # read until the server has closed (bounded)
            assert client.eof
        no_tracebacks(caplog)
        assert reader.messages == before  # nothing read past the end
        assert tagged("a1") not in handled("a")
