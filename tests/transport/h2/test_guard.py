"""The frame guard on its own (bytes in, a refusal or what to pass on out), read in every split
the network could make; on a server, over loopback, on whichever HTTP/2 path runs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import hpack
from hypothesis import given
from hypothesis import strategies as st

from eds_server.ratelimit import Bucket
from eds_server.transport.h2.guard import FrameGuard, MessageMeter, Refusal, SendWindows
from eds_server.transport.h2.header_blocks import HeaderRelay, problem
from eds_server.transport.h2.limits import ConnectionLimits, PartialBudget
from tests.support.grpc_harness import fetch_web, serving
from tests.support.h2frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    read_frames,
)
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


def relayed(
    relay: HeaderRelay, seen: list[tuple[int, list[tuple[bytes, bytes]]]], refuse: bytes = b""
) -> Callable[[int, int, bytes, bytes], tuple[bytes, Refusal | None]]:
    """An on_block that decodes each block, notes it, and passes it on encoded anew (or, for a
    block holding the field `refuse`, passes nothing)."""

    def on_block(sid: int, flags: int, first: bytes, rest: bytes) -> tuple[bytes, Refusal | None]:
        fields = relay.fields(first, flags, rest)
        seen.append((sid, fields))
        if refuse and any(name == refuse for name, _ in fields):
            return b"", None
        return relay.frames(sid, fields, bool(flags & 1)), None

    return on_block


# a conversation whose header blocks use HPACK's dynamic table: the refused block (stream 3) adds
# entries the next block (stream 5) refers to, so leaving its bytes out would break stream 5
_ENCODER = hpack.Encoder()
_FIELDS = [[*headers(STREAM), ("x-n", str(n))] for n in range(3)]
_FIELDS[1].append(("x-refuse", "yes"))
_BLOCKS = [_ENCODER.encode(f) for f in _FIELDS]
HELD = [
    frame(HEADERS, END_HEADERS, 1, _BLOCKS[0]),
    frame(DATA, 0, 1, b"x" * 300),
    frame(HEADERS, 0x8 | 0x20, 3, b"\x02" + b"\x00\x00\x00\x01\x10" + _BLOCKS[1][:7] + b"\x00\x00"),  # padded, priority
    frame(CONTINUATION, 0, 3, _BLOCKS[1][7:9]),
    frame(CONTINUATION, END_HEADERS, 3, _BLOCKS[1][9:]),
    frame(DATA, 0, 3, b"y" * 10),  # on the refused stream: left out
    frame(HEADERS, END_HEADERS | 1, 5, _BLOCKS[2]),
    frame(PING, 0, 0, b"12345678"),
]


@given(st.lists(st.integers(min_value=0, max_value=len(PREFACE) + sum(map(len, HELD))), max_size=30))
def test_header_blocks_are_held_whole_and_passed_encoded_anew_in_any_split(cuts: list[int]) -> None:
    """Held across any split, decoded in order by the guard's own decoder (so a refused block's
    HPACK entries are still known), re-encoded for the library: which decodes what was sent."""
    seen: list[tuple[int, list[tuple[bytes, bytes]]]] = []
    g = guard()
    g.on_block = relayed(HeaderRelay(1 << 14, 1 << 16), seen, refuse=b"x-refuse")
    g.drop_stream(3)  # as a refusal would
    out, refusal = feed_in(g, PREFACE + b"".join(HELD), cuts)
    assert refusal is None
    expect = [[(n.encode(), v.encode()) for n, v in f] for f in _FIELDS]
    assert seen == [(1, expect[0]), (3, expect[1]), (5, expect[2])]
    frames = split_frames(out[len(PREFACE) :])
    assert [(t, fl, sid) for t, fl, sid, _ in frames] == [
        (HEADERS, END_HEADERS, 1),
        (DATA, 0, 1),
        (HEADERS, END_HEADERS | 1, 5),
        (PING, 0, 0),
    ]
    library = hpack.Decoder()  # h2's side: hears only what was passed
    assert [list(library.decode(p)) for t, _, _, p in frames if t == HEADERS] == [_FIELDS[0], _FIELDS[2]]


def split_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 3], "big")
        sid = int.from_bytes(data[pos + 5 : pos + 9], "big")
        out.append((data[pos + 3], data[pos + 4], sid, data[pos + 9 : pos + 9 + n]))
        pos += 9 + n
    return out


def test_a_held_header_block_broken_by_another_frame_is_a_protocol_error() -> None:
    for bad in (frame(PING, 0, 0, b"12345678"), frame(CONTINUATION, END_HEADERS, 3, b""), frame(DATA, 0, 1, b"")):
        g = guard()
        g.on_block = relayed(HeaderRelay(1 << 14, 1 << 16), [])
        refusal = g.feed(PREFACE + frame(HEADERS, 0, 1, BLOCK[:5]) + bad)[1]
        assert refusal is not None and refusal.reason == "protocol_error", bad
    g = guard()
    g.on_block = relayed(HeaderRelay(1 << 14, 1 << 16), [])
    refusal = g.feed(PREFACE + frame(CONTINUATION, END_HEADERS, 1, BLOCK))[1]
    assert refusal is not None and "outside a header block" in refusal.detail


def test_a_long_block_is_passed_on_in_frames_the_library_accepts() -> None:
    relay = HeaderRelay(100, 1 << 16)
    fields = [(b"x-big", b"v" * 250)]
    frames = split_frames(relay.frames(7, fields, end_stream=True))
    assert [(t, fl) for t, fl, _, _ in frames] == [(HEADERS, 1), (CONTINUATION, 0), (CONTINUATION, END_HEADERS)]
    assert all(len(p) <= 100 for *_, p in frames)
    assert hpack.Decoder().decode(b"".join(p for *_, p in frames), raw=True) == fields


def test_request_and_trailer_problems_include_non_ascii() -> None:
    good = [(n.encode(), v.encode()) for n, v in headers(STREAM)]
    assert problem(good, request=True) is None
    assert problem([*good, (b"x-caf\xc3\xa9", b"1")], request=True) == "a header name or value that is not ASCII"
    assert problem(good[1:], request=True) is not None
    assert problem([(b"grpc-status", b"0")], request=False) is None
    assert problem([(b":path", b"/x")], request=False) is not None


PADDED_DATA = [
    frame(DATA, 0x8, 1, b"\x03" + b"\x00\x00\x00\x00\x07" + b"abcdefg" + b"\x00" * 3),  # padded, one message
    frame(DATA, 0, 1, b"\x00\x00\x00"),  # a length prefix split across frames...
    frame(DATA, 0x8 | 1, 1, b"\x00" + b"\x00\x02hi"),  # ...padded with nothing, ending the stream
]


@given(st.lists(st.integers(min_value=0, max_value=len(PREFACE) + sum(map(len, PADDED_DATA))), max_size=20))
def test_data_is_seen_without_padding_and_messages_from_their_prefixes_in_any_split(cuts: list[int]) -> None:
    seen: list[tuple[int, bytes, bool]] = []
    budget = PartialBudget(1 << 20)
    meter = MessageMeter(100, budget, None)

    def on_data(sid: int, chunk: memoryview, end: bool) -> bytes:
        seen.append((sid, bytes(chunk), end))
        assert meter.data(sid, chunk, end) is None
        return b""

    out, refusal = feed_in(guard(on_data=on_data), PREFACE + b"".join(PADDED_DATA), cuts)
    assert refusal is None and out == PREFACE + b"".join(PADDED_DATA)
    assert b"".join(c for _, c, _ in seen) == b"\x00\x00\x00\x00\x07abcdefg" + b"\x00\x00\x00\x00\x02hi"
    assert [e for *_, e in seen if e] == [True] and seen[-1][2]
    assert budget.used == 0 and not meter.streams


def test_a_message_is_refused_from_its_prefix_and_its_budget_given_back() -> None:
    budget = PartialBudget(1 << 20, 1000)
    meter = MessageMeter(1000, budget, None)
    assert meter.data(1, memoryview(b"\x00\x00\x00\x03\xe8" + b"x" * 10), False) is None  # 1,000 announced
    assert budget.used == 1000
    refused = meter.data(3, memoryview(b"\x00\x00\x00\x03\xe9"), False)
    assert refused == ("message_size", "message of 1001 bytes (limit 1000)")
    meter.close(1)  # reset inside its message
    assert budget.used == 0 and not meter.streams


def test_a_message_begun_and_not_complete_is_overdue_after_the_timeout_only() -> None:
    now = [100.0]
    meter = MessageMeter(1000, None, None, clock=lambda: now[0])
    meter.data(1, memoryview(b"\x00\x00\x00"), False)  # a prefix begun
    meter.data(3, memoryview(b"\x00\x00\x00\x00\x04ab"), False)  # a body begun
    meter.data(5, memoryview(b"\x00\x00\x00\x00\x02ab"), False)  # a whole message: nothing begun
    now[0] = 105.0
    meter.data(3, memoryview(b"c"), False)  # progress does not restart the message's clock
    assert meter.overdue(10) == []
    now[0] = 110.5
    assert meter.overdue(10) == [1, 3]
    meter.data(3, memoryview(b"d"), False)  # complete
    assert meter.overdue(10) == [1]


def test_send_windows_follow_our_data_and_refuse_only_a_real_overflow() -> None:
    windows = SendWindows()
    update = (2**31 - 1 - 65_535).to_bytes(4, "big")
    assert windows.received(WINDOW_UPDATE, 0, 0, update) is None  # exactly the maximum
    assert windows.received(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")) is not None
    windows = SendWindows()
    windows.sent(1, 65_535)  # stream 1's window and the connection's spent: room for the maximum
    assert windows.received(WINDOW_UPDATE, 0, 1, (2**31 - 1).to_bytes(4, "big")) is None
    assert windows.received(WINDOW_UPDATE, 0, 0, (2**31 - 1).to_bytes(4, "big")) is None
    windows.sent(3, 10)
    assert windows.received(WINDOW_UPDATE, 0, 3, (2**31 - 1).to_bytes(4, "big")) is None  # h2 resets stream 3
    assert 3 not in windows.streams and windows.overflowed == 1  # for the caller to charge as a reset
    refusal = windows.received(SETTINGS, 0, 0, (4).to_bytes(2, "big") + (65_536).to_bytes(4, "big"))
    assert refusal is not None and refusal.code == 3 and "stream 1" in refusal.detail


def test_a_settings_frame_costs_the_same_however_many_streams_are_open() -> None:
    """Each SETTINGS_INITIAL_WINDOW_SIZE entry is checked against a bound, not by walking every
    stream: 1,000 streams and a frame of 2,700 entries, sent 10 times, walk them at most once."""
    windows = SendWindows()
    for sid in range(1, 2001, 2):
        windows.sent(sid, 100)
        windows.received(WINDOW_UPDATE, 0, sid, (1000 + sid).to_bytes(4, "big"))
    entries = b"".join((4).to_bytes(2, "big") + (65_535 + i % 7).to_bytes(4, "big") for i in range(2_700))
    for _ in range(10):
        assert windows.received(SETTINGS, 0, 0, entries) is None
    assert windows.walks == 0
    assert windows.window(1999) == 65_535 + 2_699 % 7 - 100 + 1000 + 1999
    near = (2**31 - 1 - 65_540 - 901).to_bytes(4, "big")  # stream 1's window one short of the maximum
    assert windows.received(WINDOW_UPDATE, 0, 1, near) is None and windows.window(1) == 2**31 - 2
    windows.closed(1)  # the bound says "maybe" for an initial size 2 larger: one walk, and no error
    assert windows.received(SETTINGS, 0, 0, entries) is None
    assert windows.walks == 1 and windows.top < 10_000
