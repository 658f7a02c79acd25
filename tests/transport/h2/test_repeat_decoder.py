"""A header block that repeats the last one is answered from memory (transport/h2/repeat_decoder.py)
only while nothing its decoding depends on has changed: each test below is a change that must make
the memory stale, checked against hpack's own Decoder, and Envoy's real blocks on both paths.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import hpack
import pytest
from hpack import HeaderTuple, NeverIndexedHeaderTuple

from eds_server.transport.h2 import ConnectionLimits
from eds_server.transport.h2.header_blocks import HeaderRelay
from eds_server.transport.h2.repeat_decoder import MAX_KEPT, RepeatDecoder
from tests.support.grpc_harness import serving
from tests.support.h2_client import client_of, data, first_request, grpc
from tests.support.h2frames import END_HEADERS, HEADERS, frame
from tests.support.paths import bench_module

loadgen = bench_module("loadgen")

ENTRY = 34  # the table size of a field with a one-letter name and value (RFC 7541 4.1: 32 + 1 + 1)


def size_update(size: int) -> bytes:
    assert 31 <= size < 31 + 128
    return bytes([0x3F, size - 31])


def added(name: str, value: str) -> bytes:
    """A literal field with incremental indexing, new name, plain strings: it enters the table."""
    return b"\x40" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def not_indexed(name: str, value: str) -> bytes:
    """A literal field never indexed, new name, plain strings (a value of at most 127 * 128 bytes)."""
    length = len(value)
    size = bytes([0x7F, (length - 127) & 0x7F | 0x80, (length - 127) >> 7]) if length >= 127 else bytes([length])
    return b"\x10" + bytes([len(name)]) + name.encode() + size + value.encode()


def indexed(*indices: int) -> bytes:
    return bytes(0x80 | i for i in indices)


def outcome(decoder: hpack.Decoder, block: bytes) -> object:
    """What decoding the block gives: its fields, or the class of its error."""
    try:
        return list(decoder.decode(block, raw=True))
    except hpack.HPACKError as e:
        return type(e)


def both(
    blocks: list[bytes], change: Callable[[hpack.Decoder], None] | None = None, at: int = -1
) -> tuple[RepeatDecoder, int]:
    """Decode `blocks` with hpack's Decoder and ours, `change` applied to both before block `at`:
    every outcome the same. Ours, and how many of them were errors."""
    ours, theirs = RepeatDecoder(), hpack.Decoder()
    errors = 0
    for n, block in enumerate(blocks):
        if n == at and change is not None:
            change(ours)
            change(theirs)
        got = outcome(ours, block)
        assert got == outcome(theirs, block), f"block {n}"
        errors += not isinstance(got, list)
    return ours, errors


def test_envoys_blocks_after_a_connections_first_are_decoded_once() -> None:
    ours, errors = both([loadgen.FIRST_HEADERS] + [loadgen.LATER_HEADERS] * 50)
    assert (ours.repeats, errors) == (49, 0)


def test_a_field_added_equal_to_the_newest_makes_a_new_table() -> None:
    """A table of two, [b: 2, a: 1]; the same block indexes both. Then b: 2 is added again, evicting
    a: 1 (in a block too long to be remembered in place of the one before): the table is as long,
    its newest entry equal to the one before, and holds another field."""
    start = size_update(2 * ENTRY) + added("a", "1") + added("b", "2")
    ours, errors = both(
        [start, indexed(62, 63), indexed(62, 63), added("b", "2") + not_indexed("x", "v" * MAX_KEPT), indexed(62, 63)]
    )
    assert (ours.repeats, errors) == (1, 0)  # the second read of [62, 63], not the third


def test_a_resize_that_evicts_makes_a_new_table() -> None:
    """The table shrunk to one field and grown back in one block (too long to be remembered in
    place of the one before): its size limit and newest entry as before, one field fewer, so index
    63 is gone."""
    start = size_update(2 * ENTRY) + added("a", "1") + added("b", "2")
    resize = size_update(ENTRY) + size_update(2 * ENTRY) + not_indexed("x", "v" * (MAX_KEPT + 1))
    ours, errors = both([start, indexed(62, 63), resize, indexed(62, 63)])
    assert (ours.repeats, errors) == (0, 1)


def test_a_field_too_large_for_the_table_is_added_once_the_table_has_room() -> None:
    """A field larger than the table's limit empties it and leaves it as it was (empty); the same
    block after the limit was raised (in a block too long to be remembered) adds the field, which
    the next block reads at index 62. Found in review: the limit was not part of what must match."""
    field = added("a", "v" * 100)  # 133 bytes in a table
    raise_limit = size_update(150) + not_indexed("x", "y" * MAX_KEPT)
    ours, errors = both([size_update(100), field, raise_limit, field, indexed(62)])
    assert (ours.repeats, errors) == (0, 0)


def test_a_lower_limit_on_the_header_list_applies_to_a_repeated_block() -> None:
    def lower(decoder: hpack.Decoder) -> None:
        decoder.max_header_list_size = 100

    _, errors = both([loadgen.FIRST_HEADERS, loadgen.LATER_HEADERS, loadgen.LATER_HEADERS], lower, at=2)
    assert errors == 1


def test_a_lower_limit_on_the_table_applies_to_a_repeated_block() -> None:
    def lower(decoder: hpack.Decoder) -> None:
        decoder.max_allowed_table_size = 100  # our SETTINGS_HEADER_TABLE_SIZE lowered and acknowledged

    _, errors = both([loadgen.FIRST_HEADERS, loadgen.LATER_HEADERS, loadgen.LATER_HEADERS], lower, at=2)
    assert errors == 1


def test_a_block_over_the_bound_is_not_kept() -> None:
    big = not_indexed("x", "v" * MAX_KEPT)
    ours, _ = both([big, big, big])
    assert ours.repeats == 0


def test_a_block_read_raw_and_as_text_is_read_each_way() -> None:
    ours = RepeatDecoder()
    ours.decode(loadgen.FIRST_HEADERS)
    raw, text = ours.decode(loadgen.LATER_HEADERS, raw=True), ours.decode(loadgen.LATER_HEADERS, raw=False)
    assert (next(iter(raw)), next(iter(text))) == ((b":method", b"POST"), (":method", "POST"))


def test_random_blocks_decode_as_hpack_decodes_them() -> None:
    """Blocks from hpack's Encoder (fields indexed, added, never indexed, the table resized), each
    sent again at random later: the same outcome as hpack's Decoder every time, errors included."""
    rng = random.Random(7)
    encoder = hpack.Encoder()
    names = [b"a", b"b", b"content-type", b"x-long"]
    values = [b"1", b"2", b"x" * 30]
    sent: list[bytes] = []
    for _ in range(2_000):
        if sent and rng.random() < 0.4:
            sent.append(sent[-1] if rng.random() < 0.7 else rng.choice(sent))
            continue
        if rng.random() < 0.05:
            encoder.header_table_size = rng.choice([0, 64, 128, 4096])
        fields = [
            (NeverIndexedHeaderTuple if rng.random() < 0.3 else HeaderTuple)(rng.choice(names), rng.choice(values))
            for _ in range(rng.randrange(1, 4))
        ]
        sent.append(encoder.encode(fields, huffman=rng.random() < 0.5))
    ours, errors = both(sent)
    assert ours.repeats > 200 and errors > 20  # both ways taken, many times


def test_the_stock_paths_relay_decodes_envoys_repeated_blocks_once() -> None:
    relay = HeaderRelay(16_384, 1 << 16)
    fields = [relay.fields(loadgen.FIRST_HEADERS, END_HEADERS, b"")]
    fields += [relay.fields(loadgen.LATER_HEADERS, END_HEADERS, b"") for _ in range(5)]
    assert all(f == fields[0] for f in fields)
    assert relay._decoder.repeats == 4


@pytest.mark.fast_path
async def test_envoys_blocks_over_a_socket_open_streams_decoded_once() -> None:
    """Ten streams opened with the blocks a real Envoy sends (bench/loadgen.py's, checked against
    Envoy by tests/e2e/envoy/test_bench_headers.py): each answered; the first adds to the table,
    the second is decoded, the other eight come from memory."""
    async with serving(ConnectionLimits()) as (_server, service, port), client_of(port) as client:
        sids = list(range(1, 21, 2))
        opening = b""
        for n, sid in enumerate(sids):
            client.windows[sid], client.messages[sid] = client.initial_window, []
            block = loadgen.LATER_HEADERS if n else loadgen.FIRST_HEADERS
            opening += frame(HEADERS, END_HEADERS, sid, block) + data(sid, grpc(first_request(f"n{n}", "web")))
        await client.send(opening)
        for sid in sids:
            assert (await client.response(sid, 1)).resources, f"stream {sid} answered"
        decoders = {s.stream._stream.connection.h2.decoder for s in service.sessions}
        assert len(decoders) == 1 and len(service.sessions) == 10
        assert decoders.pop().repeats == 8
