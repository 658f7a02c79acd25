"""The read scheduler (transport/h2/fair.py) as pure logic: a fake clock that advances by what each
slice costs, a hand-run loop turn, connections that record what they were handed."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from eds_server.transport.h2.fair import (
    PREFACE,
    SLICE_FRAMES,
    SLICE_MAX_FRAMES,
    SLICE_SECONDS,
    STREAM_ESTIMATE,
    AddressCost,
    Deferral,
    FrameCutter,
    MeteredInput,
    ReadScheduler,
)
from tests.support.h2frames import DATA, HEADERS, PING, frame, split

PREFACE_BYTES = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
assert len(PREFACE_BYTES) == PREFACE


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Loop:
    """call_soon by hand: `turn()` runs what was scheduled in the previous turn."""

    def __init__(self) -> None:
        self.ready: list[Callable[[], None]] = []

    def call_soon(self, f: Callable[[], None]) -> None:
        self.ready.append(f)

    def turn(self) -> None:
        ready, self.ready = self.ready, []
        for f in ready:
            f()


class Conn:
    """A connection whose every byte handed on costs `cost` seconds of the fake clock."""

    def __init__(
        self, scheduler: ReadScheduler, clock: Clock, address: AddressCost, cost: float = 1e-6, preface: bool = False
    ) -> None:
        self.clock = clock
        self.cost = cost
        self.got: list[bytes | memoryview] = []  # kept, views too
        self.paused = False
        self.pauses = 0
        self.shed: list[str] = []
        self.input = MeteredInput(scheduler, address, self, self.process)
        if not preface:
            self.input.cutter.inside = 0

    def process(self, chunk: bytes | memoryview) -> bool:
        self.got.append(chunk)
        self.clock.t += self.cost * len(chunk)
        return True

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False

    def overloaded(self, why: str) -> None:
        self.shed.append(why)

    @property
    def received(self) -> bytes:
        return b"".join(self.got)


def headers(n: int) -> bytes:
    return b"".join(frame(HEADERS, 0x4, 2 * i + 1, b"\x82\x86\x84") for i in range(n))


def setup(turn_budget: float = 0.004, watermark: int = 1 << 30) -> tuple[ReadScheduler, Clock, Loop]:
    clock, loop = Clock(), Loop()
    return ReadScheduler(turn_budget, watermark, clock=clock, call_soon=loop.call_soon), clock, loop


def test_the_cutter_hands_on_whole_frames_at_most_a_slice_at_a_time() -> None:
    data = PREFACE_BYTES + headers(100)
    cutter = FrameCutter()
    ends, pos = [], 0
    while pos < len(data):
        end = cutter.cut(data, pos)
        assert end > pos
        ends.append(end)
        pos = end
    first, rest = split(data[PREFACE : ends[0]])
    assert len(first) == SLICE_FRAMES and rest == b""  # the preface is no frame: it goes with the first
    slices = [data[a:b] for a, b in itertools.pairwise(ends)]
    for piece in slices:
        frames, rest = split(piece)
        assert rest == b"" and 1 <= len(frames) <= SLICE_FRAMES
    assert SLICE_FRAMES + sum(len(split(p)[0]) for p in slices) == 100


def test_the_cutter_hands_on_an_incomplete_first_frame_and_follows_it() -> None:
    big = frame(DATA, 0, 1, b"x" * 50_000) + frame(PING, 0, 0, b"12345678")
    cutter = FrameCutter(preface=0)
    assert cutter.cut(big[:1000], 0) == 1000  # as far as it goes: the layers below hold partial frames
    rest = big[1000:]
    assert cutter.cut(rest, 0) == len(rest)  # the frame's remainder, and the PING after it
    assert cutter.inside == 0
    assert FrameCutter(preface=0).cut(b"\x00\x00", 0) == 0  # a header incomplete: waits


def test_a_burst_is_handed_on_within_the_turn_budget_and_the_rest_waits() -> None:
    scheduler, clock, loop = setup()
    attacker = Conn(scheduler, clock, AddressCost(), cost=2e-6)  # a 12-byte HEADERS frame: 24 us
    burst = headers(10_000)
    attacker.input.feed(burst)
    first = len(attacker.received)
    assert 0 < first < len(burst) and attacker.paused  # the rest held, its reading paused
    turns = 0
    while loop.ready and turns < 10_000:
        loop.turn()
        turns += 1
    assert attacker.received == burst and not attacker.paused
    assert turns >= 10  # 240 ms of work in 4 ms turns
    assert scheduler.held == 0


def test_held_input_is_handed_on_as_views_of_the_reads_themselves() -> None:
    """What waits is held as it was read and handed on as views of those reads, not copied into a
    buffer of ours and out again (an Envoy's 60 KB first request was copied twice on the way in).
    A layer below may keep a view as long as it likes (this Conn keeps them all): the reads are
    immutable, and every view kept reads what it was handed."""
    scheduler, clock, loop = setup()
    conn = Conn(scheduler, clock, AddressCost(), cost=2e-6)
    sent = headers(10_000)
    reads = [sent[:60_000], *(sent[n : n + 5_000] for n in range(60_000, len(sent), 5_000))]
    conn.input.feed(reads[0])
    for read in reads[1:]:  # more arrives as slices are handed on and kept
        loop.turn()
        conn.input.feed(read)
    for _ in range(10_000):
        if not loop.ready:
            break
        loop.turn()
    views = [chunk for chunk in conn.got if isinstance(chunk, memoryview)]
    of_reads = [view for view in views if any(view.obj is read for read in reads)]  # no copy
    joined = [view for view in views if not any(view.obj is read for read in reads)]  # a frame two reads split
    assert len(of_reads) >= 10 and sum(map(len, of_reads)) > len(sent) // 2
    assert all(len(view) <= 12 for view in joined)  # that frame alone, never the rest of a read
    assert conn.received == sent and scheduler.held == 0


def test_a_frame_header_begun_keeps_its_bytes_not_its_read() -> None:
    """A read that ends in the first bytes of a frame header, the client then silent: what is held
    is those bytes, copied, not a view keeping the whole read alive (at most PIN_RATIO times what is
    held is kept alive), whether the read ran at once or waited its turn."""
    scheduler, clock, loop = setup()
    conn = Conn(scheduler, clock, AddressCost(), cost=1e-10)  # cheap: every slice within the turn
    body = b"".join(frame(DATA, 0, 1, b"d" * 16_000) for _ in range(6))
    begun = frame(PING, 0, 0, b"12345678")[:5]
    conn.input.feed(body + begun)  # runs at once, a slice at a time
    assert conn.input.held == 5 and [len(c.obj) for c in conn.input._chunks] == [5]  # type: ignore[arg-type]
    assert conn.received == body

    one = Conn(scheduler, clock, AddressCost(), cost=1e-10)
    one.input.feed(frame(DATA, 0, 1, b"d" * 1_000) + begun)  # one slice, and the header begun
    assert one.input.held == 5 and [len(c.obj) for c in one.input._chunks] == [5]  # type: ignore[arg-type]

    queued = Conn(scheduler, clock, AddressCost(), cost=1e-6)
    queued.input.feed(headers(10_000))  # more than a turn: the rest waits its turn
    assert queued.input.queued
    queued.input.feed(body + begun)
    for _ in range(10_000):
        if not loop.ready:
            break
        loop.turn()
    assert queued.received == headers(10_000) + body
    assert queued.input.held == 5 and [len(c.obj) for c in queued.input._chunks] == [5]  # type: ignore[arg-type]


def requests_in(held: bytes, skip: int, streams: set[int], most: int) -> int:
    """What MeteredInput.requests_for answers, from what it holds joined into one buffer."""
    found: set[int] = set()
    pos = skip
    for _ in range(most):
        if len(held) - pos < 9:
            break
        header = held[pos : pos + 9]
        length, ftype, sid = int.from_bytes(header[:3], "big"), header[3], int.from_bytes(header[5:9], "big")
        if ftype == DATA and sid in streams:
            found.add(sid)
            if len(found) == len(streams):
                break
        pos += 9 + length
    return len(found)


@pytest.mark.parametrize("seed", range(8))
def test_input_read_in_pieces_of_any_size_is_handed_on_whole_in_order(seed: int) -> None:
    """Frames of every size read in pieces of every size (a frame header split across two reads
    included), held and handed on in turns: every byte arrives once and in order, and what the
    queue is asked of its requests matches what the same bytes in one buffer would say."""
    rng = random.Random(seed)
    scheduler, clock, loop = setup(turn_budget=0.0005)
    conn = Conn(scheduler, clock, AddressCost(), cost=1e-7)
    sent = b"".join(
        frame(DATA, 0, rng.choice((1, 3, 5)), b"d" * rng.choice((0, 1, 8, 9, 10, 500, 5_000, 20_000)))
        if rng.random() < 0.6
        else frame(HEADERS, 0x4, 2 * rng.randrange(1, 50) + 1, b"\x82\x86\x84")
        for _ in range(400)
    )
    pos, asked = 0, 0
    while pos < len(sent):
        n = rng.choice((1, 2, 5, 8, 9, 10, 17, 100, 1_000, 7_000, 30_000))
        conn.input.feed(sent[pos : pos + n])
        pos += n
        held = conn.input.held
        assert conn.input.queued or not (held >= 9 or (held and conn.input.cutter.inside))  # never stranded
        if conn.input.queued and rng.random() < 0.3:
            metered = conn.input
            held = b"".join(bytes(c) for c in metered._chunks)[metered._pos :]
            streams = set(rng.sample((1, 3, 5, 7), rng.randint(1, 3)))
            most = rng.choice((1, 3, 50))
            skip = metered.cutter.inside
            assert metered.requests_for(streams, len(streams), most) == requests_in(held, skip, streams, most)
            asked += 1
        if rng.random() < 0.5:
            loop.turn()
    for _ in range(100_000):
        if not loop.ready:
            break
        loop.turn()
    assert conn.received == sent and scheduler.held == 0 and conn.input.held == 0
    assert asked >= 5 and len(conn.got) >= 50  # the queue was asked, and input was held and cut


def test_a_light_client_is_served_at_once_while_a_heavy_one_waits() -> None:
    scheduler, clock, loop = setup()
    heavy = Conn(scheduler, clock, AddressCost(), cost=2e-6)
    light = Conn(scheduler, clock, AddressCost())
    heavy.input.feed(headers(10_000))
    loop.turn()  # the heavy one has spent this turn's budget and more
    ack = frame(DATA, 0, 1, b"\x00\x00\x00\x00\x05hello")
    light.input.feed(ack)  # the same turn: its budget spent, so it waits, but first in line
    served_before = len(heavy.received)
    loop.turn()
    assert light.received == ack
    assert len(heavy.received) > served_before  # the heavy one is served too, after
    for _ in range(10_000):
        if not loop.ready:
            break
        loop.turn()
    assert heavy.received == headers(10_000)


def test_many_heavy_addresses_delay_a_light_one_by_one_turn_at_most() -> None:
    scheduler, clock, loop = setup()
    heavies = [Conn(scheduler, clock, AddressCost(), cost=2e-6) for _ in range(50)]
    for h in heavies:
        h.input.feed(headers(2_000))
    light = Conn(scheduler, clock, AddressCost())
    loop.turn()
    loop.turn()
    light.input.feed(frame(PING, 0, 0, b"12345678"))
    loop.turn()
    assert light.received  # within one turn, though fifty heavier addresses wait
    assert sum(h.paused for h in heavies) >= 40


def test_past_the_watermark_the_connection_holding_the_most_is_shed() -> None:
    scheduler, clock, _loop = setup(turn_budget=0.0, watermark=100_000)  # nothing runs: all is held
    small = Conn(scheduler, clock, AddressCost())
    big = Conn(scheduler, clock, AddressCost())
    small.input.feed(headers(2_000))  # 24 KB
    big.input.feed(headers(8_000))  # 96 KB: over the watermark together
    assert big.shed and not small.shed
    assert "the most" in big.shed[0]
    assert scheduler.held == small.input.held and scheduler.shed == 1


def test_an_address_cost_decays() -> None:
    cost = AddressCost()
    cost.charge(1.0, 10.0)
    assert cost.now(10.0) == 1.0
    assert abs(cost.now(11.0) - 0.5) < 1e-9  # a half-life of one second
    assert cost.now(30.0) < 1e-5


def test_a_connection_of_cheap_frames_gets_bigger_slices_and_a_costly_one_small_again() -> None:
    """A batch of ACKs (cheap DATA frames) goes in one slice once its frames were measured cheap; a
    slice that cost its frames dearly (HEADERS opening streams) brings the next back to SLICE_FRAMES."""
    cutter = FrameCutter(preface=0)
    data = b"".join(frame(DATA, 0, 1, b"x" * 20) for _ in range(300))
    cutter.count = 1
    cutter.measured(1e-6)  # one cheap frame (a SETTINGS) is no full slice: nothing grows
    assert cutter.frames == SLICE_FRAMES
    assert cutter.cut(data, 0) == SLICE_FRAMES * 29 and cutter.count == SLICE_FRAMES
    sizes = []
    for _ in range(6):  # 2 us a frame: twice as big a slice each time, up to the most
        cutter.count = cutter.frames
        cutter.measured(cutter.frames * 2e-6)
        sizes.append(cutter.frames)
    assert sizes == [64, 128, 256, SLICE_MAX_FRAMES, SLICE_MAX_FRAMES, SLICE_MAX_FRAMES]
    assert cutter.cut(data, 0) == len(data) and cutter.count == 300
    cutter.measured(300 * 50e-6)  # 50 us a frame
    assert cutter.frames == SLICE_FRAMES
    cutter.count = 32
    cutter.measured(32 * SLICE_SECONDS / 48)  # 48 frames' worth fit: grows to that, not to twice
    assert cutter.frames == 48


def test_work_charged_for_later_counts_in_the_slice_size() -> None:
    """Streams handed to handlers cost little to read and much later: what a slice was charged for
    them keeps the next slice small (bigger slices of bursts of requests held the loop for seconds)."""
    scheduler, clock, loop = setup(turn_budget=1.0)
    conn = Conn(scheduler, clock, AddressCost(), cost=0.0)

    def process(chunk: bytes) -> bool:
        conn.got.append(chunk)
        conn.input.charge(STREAM_ESTIMATE * len(split(chunk)[0]))  # as a stream per frame would be
        return True

    conn.input.process = process
    conn.input.feed(headers(200))
    loop.turn()
    assert conn.input.cutter.frames == SLICE_FRAMES
    assert {len(split(chunk)[0]) for chunk in conn.got} == {SLICE_FRAMES, 200 % SLICE_FRAMES}


def test_a_check_waits_only_for_input_that_arrived_before_it_was_due() -> None:
    """A deadline check is put off while input received before it was first due waits in the queue
    (it may hold the awaited request); not for input that came later (a client keeping its
    connection queued), nor for a frame header begun and left (the client's wait, not ours)."""
    scheduler, clock, loop = setup()
    flood = Conn(scheduler, clock, AddressCost(), cost=2e-6)
    flood.input.feed(headers(10_000))  # more than a turn: queued
    assert 0 < flood.input.waited() < 0.01  # arrived just before its first slice ran
    deferral = Deferral()
    clock.t += 1.0
    assert deferral.holds(flood.input, now=50.0)  # the check due at 50.0: what arrived before waits
    checks, turns = 1, 0
    while deferral.holds(flood.input, now=50.0 + 0.1 * checks) and turns < 10_000:
        flood.input.feed(headers(10))  # the flood goes on: new input, never the check's concern
        loop.turn()
        clock.t += 0.1
        checks, turns = checks + 1, turns + 1
    assert flood.input.queued and turns < 10_000  # still queued, yet the check ran
    assert len(flood.received) >= len(headers(10_000))  # once what came before it was handed on
    assert deferral.since is None

    begun = Conn(scheduler, clock, AddressCost())
    begun.input.feed(frame(PING, 0, 0, b"12345678")[:5])
    assert not begun.input.queued and begun.input.held == 5
    assert begun.input.waited() == 0.0 and not Deferral().holds(begun.input, now=60.0)
    assert not Deferral().holds(None, now=60.0)


def test_the_requests_waiting_in_the_queue_are_found_and_headers_alone_are_not() -> None:
    """What the watermark of streams awaiting a request asks of a connection's queue: of its streams
    opened, which have DATA waiting there (their requests are received; the wait is ours). A
    burst of HEADERS queues HEADERS: none is found. The look is bounded in frames."""
    scheduler, clock, _ = setup(turn_budget=1e-9)
    conn = Conn(scheduler, clock, AddressCost())
    requests = b"".join(frame(DATA, 0, 2 * i + 1, b"\x00\x00\x00\x00\x10" + b"r" * 16) for i in range(100))
    conn.input.feed(headers(100) + requests)
    opened = set(range(1, 2 * SLICE_FRAMES, 2))  # the first slice's streams
    assert conn.input.queued and [f.stream_id for f in split(conn.got[0])[0]] == sorted(opened)
    assert conn.input.requests_for(opened, len(opened)) == len(opened)
    behind = 100 - SLICE_FRAMES  # HEADERS still queued before the requests
    assert conn.input.requests_for(opened, len(opened), most=behind) == 0  # HEADERS only in reach
    assert conn.input.requests_for(opened, len(opened), most=behind + 10) == 10
    flood = Conn(scheduler, clock, AddressCost())
    flood.input.feed(headers(1000))
    assert flood.input.queued and flood.input.requests_for(opened, len(opened)) == 0
    assert Conn(scheduler, clock, AddressCost()).input.requests_for(opened, len(opened)) == 0  # nothing queued
