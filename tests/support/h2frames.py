"""Raw HTTP/2 for tests that speak the wire protocol by hand: the client preface, building a frame,
and cutting received bytes into frames."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

SETTINGS_EMPTY = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SETTINGS_EMPTY  # the client preface and an empty SETTINGS

# frame types (RFC 9113 section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# flags
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8


class Frame(NamedTuple):
    type: int
    flags: int
    stream_id: int
    payload: bytes


def frame(type_: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame's bytes, as given (no check of what the payload should be)."""
    return len(payload).to_bytes(3, "big") + bytes((type_, flags)) + stream_id.to_bytes(4, "big") + payload


def split(buffer: bytes) -> tuple[list[Frame], bytes]:
    """The whole frames at the start of `buffer`, and what is left (the start of a frame)."""
    frames = []
    pos, end = 0, len(buffer)
    while end - pos >= 9:
        after = pos + 9 + int.from_bytes(buffer[pos : pos + 3], "big")
        if after > end:
            break
        sid = int.from_bytes(buffer[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        frames.append(Frame(buffer[pos + 3], buffer[pos + 4], sid, buffer[pos + 9 : after]))
        pos = after
    return frames, buffer[pos:]


async def read_frames(
    reader: asyncio.StreamReader, wait: float = 5.0, *, pong: asyncio.StreamWriter | None = None
) -> list[tuple[int, bytes]]:
    """(type, payload) of every frame until the server closes or `wait` passes (and at most 10,000
    reads). With `pong`, each PING is answered on it, as a live client does."""
    frames: list[tuple[int, bytes]] = []
    buffer = b""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait
    for _ in range(10_000):  # bounded
        try:
            chunk = await asyncio.wait_for(reader.read(65536), max(0.01, end - loop.time()))
        except TimeoutError:
            break
        if not chunk:
            break
        got, buffer = split(buffer + chunk)
        for f in got:
            frames.append((f.type, f.payload))
            if pong is not None and f.type == PING and not f.flags & ACK:
                pong.write(frame(PING, ACK, 0, f.payload))
    return frames
