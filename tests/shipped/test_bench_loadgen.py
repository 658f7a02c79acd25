"""The bench's load generator reads responses from views of what the socket gave it, putting
together only what a read cut in two: its figures are only true if it reads every response and
ACKs each with its own version and nonce, wherever the reads cut the frames and the messages."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest

from tests.support.paths import bench_module


def loadgen() -> ModuleType:
    return bench_module("loadgen")


class Written:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def get_extra_info(self, name: str) -> Any:
        return None


def response(lg: ModuleType, version: str, nonce: str, size: int) -> bytes:
    body = (
        lg.pb_bytes(1, version.encode())
        + lg.pb_bytes(2, bytes(random.randrange(256) for _ in range(size)))
        + lg.pb_bytes(4, lg.EDS_TYPE_URL.encode())
        + lg.pb_bytes(5, nonce.encode())
    )
    return bytes(b"\x00" + len(body).to_bytes(4, "big") + body)


def acks(lg: ModuleType, written: bytes) -> list[tuple[int, str, str]]:
    """(stream, version_info, nonce) of every request written after the first requests."""
    out: list[tuple[int, str, str]] = []
    pos, bodies = len(lg.PREFACE), dict[int, bytes]()
    while pos < len(written):
        lt, _flags, sid = lg.FRAME.unpack_from(written, pos)
        length, kind = lt >> 8, lt & 0xFF
        if kind == lg.DATA:
            bodies[sid] = bodies.get(sid, b"") + written[pos + 9 : pos + 9 + length]
        pos += 9 + length
    for sid, data in sorted(bodies.items()):
        while data:
            size = int.from_bytes(data[1:5], "big")
            msg, data = data[5 : 5 + size], data[5 + size :]
            if msg[:1] == b"\x0a":  # version_info first: an ACK (a first request starts with its Node)
                version, nonce = lg.scan_response(msg)
                out.append((sid, version, nonce))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_every_response_is_read_and_acked_however_the_reads_cut_it(seed: int) -> None:
    random.seed(seed)
    lg = loadgen()
    gen = lg.Generator(200)
    gen.node_every = False
    conn = lg.Conn(gen, ["g"] * 3)
    written = Written()
    conn.connection_made(written)
    stream_ids = sorted(conn.streams)
    sent: list[tuple[int, str, str]] = []
    wire = bytearray()
    for change in range(8):
        # responses of every size around the frame size and the piece boundaries, two per frame at times
        for sid in stream_ids:
            version, nonce = f"{change:016x}", f"n{seed}-{change}-{sid}"
            msg = response(lg, version, nonce, random.choice([0, 3, 200, 16_370, 16_384, 40_000]))
            sent.append((sid, version, nonce))
            cut = 0
            while cut < len(msg):
                n = min(random.choice([1, 4, 5, 6, 9, 100, 16_384]), len(msg) - cut)
                wire += lg.frame(lg.DATA, 0, sid, msg[cut : cut + n])
                cut += n
        wire += lg.frame(lg.PING, 0, 0, b"12345678")
    pos = 0
    while pos < len(wire):  # reads of every size, down to a byte, so frames and prefixes straddle them
        n = random.choice([1, 2, 8, 9, 10, 777, 16_393, 70_000])
        conn.data_received(bytes(wire[pos : pos + n]))
        pos += n
    assert [s.count for s in conn.streams.values()] == [8, 8, 8]
    assert acks(lg, bytes(written.data)) == sorted(sent)
    assert written.data.count(lg.frame(lg.PING, lg.ACK, 0, b"12345678")) == 8


def test_a_response_whose_fields_straddle_two_frames_is_read_as_sent() -> None:
    lg = loadgen()
    msg = response(lg, "v1", "nonce-1", 100)[5:]
    for cut in range(len(msg) + 1):
        parts = [memoryview(msg[:cut]), memoryview(msg[cut:])]
        assert lg.scan_parts(parts) == ("v1", "nonce-1"), cut
    assert lg.scan_parts([memoryview(msg[i : i + 1]) for i in range(len(msg))]) == ("v1", "nonce-1")
