"""The frame guard on its own (bytes in, a refusal or what to pass on out), read in every split
the network could make; on a server, over loopback, on whichever HTTP/2 path runs."""

from __future__ import annotations

import asyncio

import hpack
from hypothesis import given
from hypothesis import strategies as st

from eds_server.ratelimit import Bucket
from eds_server.transport.h2.guard import FrameGuard, Refusal
from eds_server.transport.h2.limits import ConnectionLimits
from tests.support.grpc_harness import fetch_web, serving
from tests.support.h2frames import CONTINUATION, DATA, END_HEADERS, GOAWAY, HEADERS, PING, PREFACE, frame, read_frames
from tests.support.hostile_clients import STREAM, headers

UNKNOWN = 0x42
BLOCK = hpack.Encoder().encode(headers(STREAM))


def guard(**kwargs: object) -> FrameGuard:
    settings: dict = {"max_frame_size": 1 << 14, "max_header_block": 1 << 12, **kwargs}
    return FrameGuard(**settings)


def feed_in(g: FrameGuard, data: bytes, cuts: list[int]) -> tuple[bytes, Refusal | None]:
    out, pos = b"", 0
    for cut in [*sorted(set(cuts)), len(data)]:
        passed, refusal = g.feed(data[pos:cut])
        out += bytes(passed)
        if refusal is not None:
            return out, refusal
        pos = cut
    return out, None


CONVERSATION = [
    frame(HEADERS, END_HEADERS, 1, BLOCK),
    frame(UNKNOWN, 0, 0, b"hello"),
    frame(DATA, 0, 1, b"x" * 300),
    frame(HEADERS, 0, 3, BLOCK[:10]),
    frame(CONTINUATION, END_HEADERS, 3, BLOCK[10:]),
    frame(UNKNOWN, 0, 1, b""),
    frame(PING, 0, 0, b"12345678"),
]


@given(st.lists(st.integers(min_value=0, max_value=len(PREFACE) + sum(map(len, CONVERSATION))), max_size=30))
def test_any_split_passes_the_same_frames_unknown_ones_left_out(cuts: list[int]) -> None:
    data = PREFACE + b"".join(CONVERSATION)
    out, refusal = feed_in(guard(drop_unknown=True), data, cuts)
    assert refusal is None
    assert out == PREFACE + b"".join(f for f in CONVERSATION if f[3] != UNKNOWN)
    passed, refusal = feed_in(guard(), data, cuts)  # without drop_unknown: everything, as it came
    assert refusal is None and passed == data


@given(st.lists(st.integers(min_value=0, max_value=len(PREFACE) + 9), max_size=5))
def test_an_oversize_frame_is_refused_from_its_header(cuts: list[int]) -> None:
    header = frame(DATA, 0, 1, b"")[:9]
    header = (1 << 20).to_bytes(3, "big") + header[3:]
    _, refusal = feed_in(guard(), PREFACE + header, cuts)
    assert refusal is not None and refusal.reason == "frame_size" and refusal.code == 6  # FRAME_SIZE_ERROR


def test_a_header_block_is_bounded_as_it_grows() -> None:
    g = guard(max_header_block=1000)
    g.feed(PREFACE + frame(HEADERS, 0, 1, b"a" * 400))
    assert g.feed(frame(CONTINUATION, 0, 1, b"a" * 400))[1] is None
    _, refusal = g.feed(frame(CONTINUATION, 0, 1, b"a" * 400)[:9])  # refused from the header alone
    assert refusal is not None and refusal.reason == "header_size" and refusal.code == 11  # ENHANCE_YOUR_CALM
    assert g.feed(b"more")[1] is refusal  # and stays refused
    # blocks are counted one by one: many small ones are fine
    g = guard(max_header_block=1000)
    g.feed(PREFACE)
    for sid in range(1, 200, 2):
        assert g.feed(frame(HEADERS, 0, sid, b"a" * 600) + frame(CONTINUATION, END_HEADERS, sid, b"a" * 300))[1] is None


def test_continuation_frames_are_control_frames() -> None:
    g = guard(control=Bucket(3, 10.0), max_header_block=1 << 20)
    g.feed(PREFACE + frame(HEADERS, 0, 1, b"a"))
    for _ in range(3):
        assert g.feed(frame(CONTINUATION, 0, 1, b"a"))[1] is None
    refusal = g.feed(frame(CONTINUATION, 0, 1, b"a"))[1]
    assert refusal is not None and refusal.reason == "calm" and "CONTINUATION" in refusal.detail


def test_unknown_frames_are_charged_where_they_are_left_out() -> None:
    g = guard(control=Bucket(2, 10.0), drop_unknown=True)
    g.feed(PREFACE)
    assert g.feed(frame(UNKNOWN, 0, 0, b"x") * 2)[1] is None
    assert g.feed(frame(UNKNOWN, 0, 0, b"x"))[1] is not None


async def test_a_server_refuses_a_long_header_block_and_serves_the_next_client() -> None:
    """CONTINUATION frames of 16 KiB each, never ending the block: h2 would hold 64 of them (8 MiB at
    the 128 KiB frame size); the guard ends the connection once the block passes its limit."""
    limits = ConnectionLimits(max_header_block=1 << 16)
    async with serving(limits) as (server, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(PREFACE + frame(HEADERS, 0, 1, BLOCK))
            for _ in range(4):  # just past the limit: the server reads all it was sent, and resets nothing
                writer.write(frame(CONTINUATION, 0, 1, b"\x00" * (1 << 14)))
            frames = await read_frames(reader)
        finally:
            writer.close()
        goaway = [p for t, p in frames if t == GOAWAY]
        assert goaway and int.from_bytes(goaway[0][4:8], "big") == 11, frames  # ENHANCE_YOUR_CALM
        assert server.refused["header_size"] == 1
        await fetch_web(port)


def test_the_ledger_charges_what_h2_would_answer_and_counts_open_streams() -> None:
    """From frame headers alone: a stream is open until ended both ways or reset; DATA on a stream
    the client ended is charged as a reset (h2 answers it with one) before h2 sees it."""
    from eds_server.transport.h2.guard import StreamLedger
    from eds_server.transport.h2.limits import PeerBudgets

    now = [0.0]
    ledger = StreamLedger(PeerBudgets(ConnectionLimits(reset_budget=3)), Bucket(100, 10.0), lambda: now[0])
    assert ledger.received(HEADERS, END_HEADERS, 1, 50) is None
    assert ledger.open == {1} and list(ledger.awaiting) == [1]
    assert ledger.received(DATA, 1, 1, 10) is None  # the request, and the client's end
    assert not ledger.awaiting and ledger.open == {1}
    ledger.sent(HEADERS, END_HEADERS | 1, 1, 20)  # our trailers: closed both ways
    assert ledger.open == set()
    refusals = [ledger.received(DATA, 0, 1, 1) for _ in range(4)]  # DATA after END_STREAM
    assert refusals[:3] == [None] * 3 and refusals[3] is not None and refusals[3].reason == "calm"
    assert ledger.received(HEADERS, END_HEADERS, 3, 50) is None
    now[0] = 11.0
    assert ledger.expired(10.0) == [3] and ledger.open == set()
