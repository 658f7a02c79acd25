"""A stream's read that cannot wait keeps no deadline (fast_reader._buffered): it must say "no
wait" only when grpclib's buffer really holds the bytes (or the stream's end), else a drip-fed
request would be read with no deadline at all (test_request_guard's drip-feed tests hold that end)."""

from __future__ import annotations

import asyncio

from grpclib.protocol import Buffer

from eds_server.events import LeanQueue
from eds_server.transport.h2.fast_reader import _buffered


def lean_buffer() -> Buffer:
    buffer = Buffer(lambda size: None)  # whichever queue grpclib's module makes now
    buffer._unacked = LeanQueue()  # type: ignore[assignment]  # as the fast server makes grpclib's queues
    return buffer


async def test_a_read_is_buffered_only_when_its_bytes_or_the_end_are_there() -> None:
    buffer = lean_buffer()
    assert not _buffered(buffer, 5)
    buffer.add(b"\x00\x00\x00", 3)
    assert _buffered(buffer, 3) and not _buffered(buffer, 5)
    buffer.add(b"\x00\x0a" + b"x" * 4, 6)  # the prefix's rest and 4 of the body's 10 bytes
    assert _buffered(buffer, 5) and _buffered(buffer, 9) and not _buffered(buffer, 10)
    assert await buffer.read(5) == b"\x00\x00\x00\x00\x0a"  # taken: 4 bytes acked, none queued
    assert _buffered(buffer, 4) and not _buffered(buffer, 10)
    buffer.eof()  # the stream's end: a read of more returns or fails at once, never waits
    assert _buffered(buffer, 10)


async def test_a_read_from_a_queue_not_ours_always_keeps_its_deadline() -> None:
    buffer = Buffer(lambda size: None)
    buffer._unacked = asyncio.Queue()  # as grpclib makes it where the fast server has not set its own
    buffer.add(b"x" * 100, 100)
    assert not _buffered(buffer, 5)  # asyncio's queue is not looked into: the timeout stays
