"""Load generator for bench/run.py: Envoy-like SotW EDS streams over a minimal raw HTTP/2 client.

    .venv/bin/python bench/loadgen.py [--cpus 1]      # driven by bench/run.py over stdin/stdout

Each stream is one StreamEndpoints call subscribed to one group (Envoy without ADS: one stream per
EDS cluster), many streams multiplexed on one HTTP/2 connection (one connection ~ one Envoy). Every
response is ACKed at once with its version_info and nonce; the ~60 KB Node is sent on every request
(variant A, Envoy's default) or on the first only (variant B, `set_node_on_first_message_only`).

To keep the client cheap it frames HTTP/2 itself (no h2 state machine; HPACK only to read response
headers and trailers) and reads only version_info and nonce from each DiscoveryResponse with a tiny
field scanner. Receive times are CLOCK_MONOTONIC (time.monotonic_ns), taken once per socket read,
comparable with the server process's clock.

Control protocol: one JSON object per line on stdin, one JSON reply per line on stdout:
  {"cmd": "open", "port": P, "conns": [[group, ...], ...], "node_every": bool, "sources": [addr, ...]}
                          # sources (optional): each connection's own loopback address, as one Envoy per host
                          # pace (optional): seconds between this process's connections (0: all at once)
  {"cmd": "wait", "targets": {group: version}, "timeout": s}   # every stream of a listed group has
                                                               # received that version, the others any
  {"cmd": "wait", "counts": {group: n}, "timeout": s}   # every stream of a listed group has received
                                                        # n responses in all (servers whose versions
                                                        # the bench cannot know: bench/sidebyside.py)
  {"cmd": "counts"}   # the fewest responses any stream of each group has received
  {"cmd": "dump", "clear": bool}   {"cmd": "close"}   {"cmd": "quit"}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import uvloop
from hpack import Decoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
FRAME = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
RECV_WINDOW = 256 * 1024 * 1024  # Envoy's default initial stream and connection windows
EDS_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(len(payload) << 8 | ftype, flags, sid) + payload


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def pb_bytes(number: int, data: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(data)) + data


# A stream's request headers as Envoy 1.40's gRPC client encodes them (captured from a real Envoy;
# tests/e2e/envoy/test_bench_headers.py checks the shape still holds). The first block of a connection
# adds its fields to HPACK's dynamic table (Huffman-coded literals); every later stream sends them
# indexed, all but :path, a Huffman literal never indexed:
# :method POST, :path, :authority xds_cluster, :scheme http, te trailers, content-type
# application/grpc, x-envoy-internal true, x-forwarded-for 192.0.2.2.
FIRST_HEADERS = bytes.fromhex(
    "8304b060b5773fa5d05b3b98855cb54959cd5257eecaf82a92b39aa4df32087ee5b3d6e2d9dcc42b1b9361474e0aa4"
    "ace6a9284188f322222516a125b38640027465864d833505b11f5f8b1d75d0620d263d4c4d6564408cf2b16aee7f4b"
    "1aa496ca8747834d9697408bf2b4a7b3c0ec90b22d29ec870be25c0b89717f"
)
LATER_HEADERS = bytes.fromhex(
    "8304b060b5773fa5d05b3b98855cb54959cd5257eecaf82a92b39aa4df32087ee5b3d6e2d9dcc42b1b9361474e0aa4ace6a928c286c1c0bfbe"
)


def make_node(target: int = 60_000) -> bytes:
    """An encoded envoy.config.core.v3.Node shaped like Envoy's: mostly its extensions list."""
    from envoy.config.core.v3 import base_pb2

    node = base_pb2.Node(id="bench-envoy", cluster="bench", user_agent_name="envoy")
    node.metadata.update({"role": "bench", "istio_version": "1.99.0", "labels": {"app": "bench"}})
    node.user_agent_build_version.version.major_number = 1
    node.user_agent_build_version.version.minor_number = 40
    node.client_features.extend(
        [
            "envoy.lb.does_not_support_overprovisioning",
            "envoy.lrs.supports_send_all_clusters",
            "xds.config.resource-in-sotw",
            "xds.config.supports-resource-ttl",
        ]
    )
    categories = [
        "envoy.filters.http",
        "envoy.filters.network",
        "envoy.transport_sockets.upstream",
        "envoy.access_loggers",
        "envoy.matching.http.input",
        "envoy.stats_sinks",
    ]
    i = 0
    while node.ByteSize() < target:
        cat = categories[i % len(categories)]
        ext = node.extensions.add(name=f"{cat}.extension_{i}", category=cat)
        ext.type_urls.append(f"envoy.extensions.{cat.split('.')[1]}.extension_{i}.v3.Extension{i}Config")
        i += 1
    return cast(bytes, node.SerializeToString())


def scan_response(msg: bytes | memoryview) -> tuple[str, str]:
    """(version_info, nonce) of an encoded DiscoveryResponse; the resources are skipped unread."""
    return scan_parts([memoryview(msg)])


def scan_parts(parts: list[memoryview]) -> tuple[str, str]:
    """scan_response over a message held in pieces (the DATA frames' payloads, not joined): the
    resources are skipped by arithmetic, so a response is read without copying it. Anything that
    straddles two pieces (a key, a length, version_info or the nonce) is read from the joined bytes."""
    try:
        return _scan(parts)
    except IndexError:
        if len(parts) == 1:
            raise  # cut short: not a whole message
        return _scan([memoryview(b"".join(parts))])


def _scan(parts: list[memoryview]) -> tuple[str, str]:
    """The field walk of scan_parts; IndexError where a field straddles two pieces (or the end)."""
    version = nonce = ""
    i, part, pos = 0, parts[0], 0
    while True:
        while pos >= len(part):
            pos -= len(part)
            i += 1
            if i == len(parts):
                return version, nonce
            part = parts[i]
        key = part[pos]
        pos += 1
        if key & 0x80:  # multi-byte key: not one of DiscoveryResponse's fields 1-7
            raise ValueError("unexpected field")
        if key & 7 == 0:
            while part[pos] & 0x80:
                pos += 1
            pos += 1
            continue
        if key & 7 != 2:
            raise ValueError(f"unexpected wire type in key {key}")
        size = shift = 0
        while True:
            b = part[pos]
            pos += 1
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if key == 0x0A or key == 0x2A:
            if pos + size > len(part):
                raise IndexError
            text = bytes(part[pos : pos + size]).decode()
            if key == 0x0A:
                version = text
            else:
                nonce = text
        pos += size


class Stream:
    __slots__ = (
        "closed",
        "count",
        "done",
        "error",
        "group",
        "id",
        "last_size",
        "out",
        "parts",
        "pending",
        "recv",
        "rlen",
        "tail",
        "window",
    )

    def __init__(self, sid: int, group: str, window: int) -> None:
        self.id, self.group, self.window = sid, group, window
        self.tail = pb_bytes(3, group.encode()) + pb_bytes(4, EDS_TYPE_URL.encode())  # names, type_url
        # gRPC-framed request bytes not yet sent (flow control), as pieces: the Node is one shared
        # view, not a 60 KB copy per stream (100,000 streams' first requests would be 6 GB here)
        self.out: deque[bytes | memoryview] = deque()
        self.pending = 0  # bytes in out
        self.parts: list[memoryview] = []  # DATA payloads of the message being received, not joined
        self.rlen = 0  # bytes in parts
        self.recv: list[tuple[str, int]] = []  # (version_info, receive time ns)
        self.last_size = self.count = 0  # count: responses received in all (recv can be cleared)
        self.done = self.closed = False
        self.error = ""


class Conn(asyncio.Protocol):
    """One HTTP/2 connection carrying many StreamEndpoints calls, like one Envoy."""

    def __init__(self, gen: Generator, groups: list[str]) -> None:
        self.gen = gen
        self.groups = groups
        self.streams: dict[int, Stream] = {}
        self.blocked: dict[int, Stream] = {}  # streams with request bytes waiting for window
        self.buf = bytearray()
        self.out: list[bytes | memoryview] = []
        self.send_window = 65535
        self.peer_initial = 65535
        self.peer_max_frame = 16384
        self.consumed = 0
        self.headers: bytearray | None = None  # header block being continued
        self.headers_sid = 0
        self.headers_end = False
        self.hpack = Decoder()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        settings = struct.pack(">HIHI", 0x2, 0, 0x4, RECV_WINDOW)  # no push; stream window as Envoy
        grow = frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", RECV_WINDOW - 65535))
        self.out += [PREFACE, frame(SETTINGS, 0, 0, settings), grow]
        for i, group in enumerate(self.groups):
            s = Stream(2 * i + 1, group, self.peer_initial)
            self.streams[s.id] = s
            block = LATER_HEADERS if i else FIRST_HEADERS
            self.out.append(frame(HEADERS, END_HEADERS, s.id, block))
            self.send_request(s, self.gen.node_view, s.tail)
        self.flush()

    def flush(self) -> None:
        if self.out and self.transport is not None:
            self.transport.write(b"".join(self.out))
            self.out.clear()

    def send_request(self, s: Stream, *parts: bytes | memoryview) -> None:
        """Queue one gRPC message made of `parts` (views are kept, not copied) and send what the windows allow."""
        size = sum(len(p) for p in parts)
        self.send_framed(s, 5 + size, b"\x00" + size.to_bytes(4, "big"), *parts)

    def send_framed(self, s: Stream, size: int, *parts: bytes | memoryview) -> None:
        """Queue `parts`, a gRPC message with its prefix (`size` bytes in all); one that fits the
        windows and one frame with nothing queued before it (an ACK, mostly) is framed at once."""
        if not s.pending and size <= s.window and size <= self.send_window and size <= self.peer_max_frame:
            self.out.append(FRAME.pack(size << 8 | DATA, 0, s.id))
            self.out.extend(parts)
            s.window -= size
            self.send_window -= size
            return
        s.out.extend(parts)
        s.pending += size
        if not self.push(s):
            self.blocked[s.id] = s

    def push(self, s: Stream) -> bool:
        """Frame as much of the stream's pending bytes as the windows allow; True when all is sent.
        A frame's payload may span pieces: the frames are those of the message sent whole."""
        out, frames = s.out, self.out
        while s.pending:
            n = min(s.pending, s.window, self.send_window, self.peer_max_frame)
            if n <= 0:
                return False
            frames.append(FRAME.pack(n << 8 | DATA, 0, s.id))
            left = n
            while left:
                piece = out[0]
                if len(piece) <= left:
                    frames.append(piece)
                    out.popleft()
                    left -= len(piece)
                else:
                    frames.append(piece[:left])
                    out[0] = piece[left:]
                    left = 0
            s.pending -= n
            s.window -= n
            self.send_window -= n
        return True

    def unblock(self) -> None:
        for sid, s in list(self.blocked.items()):
            if self.send_window <= 0:
                break
            if self.push(s):
                del self.blocked[sid]

    def data_received(self, data: bytes) -> None:
        """Frames are read from views of `data`: a DATA payload is not copied on its way to its
        stream (a change is 270 MB at 10,000 streams, through one core shared by the generators);
        only a frame cut by the end of a read is put together."""
        now = time.monotonic_ns()
        view = memoryview(data)
        pos = 0
        if self.buf:
            buf = self.buf
            if len(buf) < 9:
                pos = min(9 - len(buf), len(view))
                buf += view[:pos]
                if len(buf) < 9:
                    return
            whole = 9 + int.from_bytes(buf[:3], "big")
            more = min(whole - len(buf), len(view) - pos)
            buf += view[pos : pos + more]
            pos += more
            if len(buf) < whole:
                return
            self.buf = bytearray()
            self.frames(memoryview(bytes(buf)), 0, now)
        pos = self.frames(view, pos, now)
        if pos < len(view):
            self.buf = bytearray(view[pos:])
        if self.consumed > RECV_WINDOW // 2:
            self.out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.consumed)))
            self.consumed = 0
        self.flush()

    def frames(self, buf: memoryview, pos: int, now: int) -> int:
        """Handle the whole frames in buf[pos:]; returns where the first partial one starts."""
        end = len(buf)
        while end - pos >= 9:
            lt, flags, sid = FRAME.unpack_from(buf, pos)
            length, ftype = lt >> 8, lt & 0xFF
            if end - pos - 9 < length:
                break
            start = pos + 9
            pos = start + length
            if ftype == DATA:
                self.on_data(sid & 0x7FFFFFFF, flags, buf[start:pos], length, now)
            elif ftype in (HEADERS, CONTINUATION):
                self.on_headers(sid & 0x7FFFFFFF, ftype, flags, bytes(buf[start:pos]))
            elif ftype == WINDOW_UPDATE:
                inc = int.from_bytes(buf[start : start + 4], "big") & 0x7FFFFFFF
                if sid == 0:
                    self.send_window += inc
                elif (s := self.streams.get(sid)) is not None:
                    s.window += inc
                self.unblock()
            elif ftype == SETTINGS and not flags & ACK:
                for off in range(start, pos, 6):
                    ident, value = struct.unpack_from(">HI", buf, off)
                    if ident == 0x4:
                        for s in self.streams.values():
                            s.window += value - self.peer_initial
                        self.peer_initial = value
                    elif ident == 0x5:
                        self.peer_max_frame = value
                self.out.append(frame(SETTINGS, ACK, 0))
                self.unblock()
            elif ftype == PING and not flags & ACK:
                self.out.append(frame(PING, ACK, 0, bytes(buf[start:pos])))
            elif ftype == RST_STREAM:
                self.close_stream(sid, f"RST_STREAM {int.from_bytes(buf[start:pos], 'big')}")
            elif ftype == GOAWAY:
                code = int.from_bytes(buf[start + 4 : start + 8], "big")
                self.gen.errors.append(f"GOAWAY {code}: {bytes(buf[start + 8 : pos])[:200]!r}")
        return pos

    def on_data(self, sid: int, flags: int, payload: memoryview, length: int, now: int) -> None:
        self.consumed += length
        s = self.streams.get(sid)
        if s is None:
            return
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        parts = s.parts
        parts.append(payload)
        s.rlen += len(payload)
        while s.rlen >= 5:
            if len(parts[0]) < 5:
                parts[:] = [memoryview(b"".join(parts))]
            size = int.from_bytes(parts[0][1:5], "big")
            if s.rlen < 5 + size:
                break
            piece, need, i, msg = parts[0][5:], size, 0, []
            while len(piece) < need:
                if piece:
                    msg.append(piece)
                need -= len(piece)
                i += 1
                piece = parts[i]
            msg.append(piece[:need])
            rest = piece[need:]
            s.parts = parts = ([rest] if rest else []) + parts[i + 1 :]
            s.rlen -= 5 + size
            version, nonce = scan_parts(msg)
            s.recv.append((version, now))
            s.count += 1
            s.last_size = size
            if self.gen.node_every:
                head = pb_bytes(1, version.encode())
                self.send_request(s, head, self.gen.node_view, s.tail + pb_bytes(5, nonce.encode()))
            else:
                ack = self.gen.ack(s.tail, version, nonce)
                self.send_framed(s, len(ack), ack)
            self.gen.arrived(s, version)
        # stream-level WINDOW_UPDATEs are needed only past 256 MiB per stream; bench streams stay below
        if flags & END_STREAM:
            self.close_stream(sid, "ended by server")

    def on_headers(self, sid: int, ftype: int, flags: int, payload: bytes) -> None:
        if ftype == HEADERS:
            pad = payload[0] if flags & PADDED else 0
            skip = (1 if flags & PADDED else 0) + (5 if flags & PRIORITY else 0)
            self.headers = bytearray(payload[skip : len(payload) - pad])
            self.headers_sid, self.headers_end = sid, bool(flags & END_STREAM)
        elif self.headers is not None:
            self.headers += payload
        if not flags & END_HEADERS or self.headers is None:
            return
        fields: dict[str, str] = {str(k): str(v) for k, v in self.hpack.decode(bytes(self.headers))}
        self.headers = None
        if self.headers_end:
            status, message = fields.get("grpc-status", "?"), fields.get("grpc-message", "")
            self.close_stream(self.headers_sid, f"grpc-status {status} {message}"[:300])

    def close_stream(self, sid: int, why: str) -> None:
        s = self.streams.get(sid)
        if s is not None and not s.closed:
            s.closed, s.error = True, why
            self.blocked.pop(sid, None)
            self.gen.errors.append(f"stream {sid} ({s.group}): {why}")
            self.gen.arrived(s, None)

    def connection_lost(self, exc: Exception | None) -> None:
        for sid in list(self.streams):
            self.close_stream(sid, f"connection lost: {exc!r}")
        self.transport = None


class Generator:
    def __init__(self, node_bytes: int) -> None:
        self.node_field = pb_bytes(2, make_node(node_bytes))
        self.node_view = memoryview(self.node_field)  # every stream's requests send views of it
        self.node_every = True
        self.conns: list[Conn] = []
        self.errors: list[str] = []
        self.targets: dict[str, str] | None = None
        self.counts: dict[str, int] = {}
        self.remaining = 0
        self.satisfied = asyncio.Event()
        self.t_start = 0
        self.acks: dict[tuple[bytes, str, str], bytes] = {}

    def ack(self, tail: bytes, version: str, nonce: str) -> bytes:
        """The framed ACK (no Node) of a response: every stream of a group ACKs the same bytes."""
        key = (tail, version, nonce)
        ack = self.acks.get(key)
        if ack is None:
            if len(self.acks) >= 4096:
                self.acks.clear()
            body = pb_bytes(1, version.encode()) + tail + pb_bytes(5, nonce.encode())
            ack = self.acks[key] = b"\x00" + len(body).to_bytes(4, "big") + body
        return ack

    def streams(self) -> list[Stream]:
        return [s for c in self.conns for s in c.streams.values()]

    def arrived(self, s: Stream, version: str | None) -> None:
        if self.targets is None or s.done:
            return
        want = self.targets.get(s.group)
        reached = s.count >= self.counts.get(s.group, 1) if self.counts else want is None or version == want
        if version is None or reached:
            s.done = True
            self.remaining -= 1
            if self.remaining <= 0:
                self.satisfied.set()

    async def open(
        self, port: int, conns: list[list[str]], node_every: bool, sources: list[str] | None = None, pace: float = 0.0
    ) -> dict[str, Any]:
        self.node_every = node_every
        loop = asyncio.get_running_loop()
        self.t_start = time.monotonic_ns()

        def factory(groups: list[str]) -> Callable[[], Conn]:
            return lambda: Conn(self, groups)

        froms = [(a, 0) for a in sources] if sources else [None] * len(conns)
        opening = []
        for g, a in zip(conns, froms, strict=True):
            opening.append(asyncio.ensure_future(loop.create_connection(factory(g), "127.0.0.1", port, local_addr=a)))
            if pace:
                await asyncio.sleep(pace)
        made = await asyncio.gather(*opening)
        self.conns += [p for _, p in made]
        return {"t_start": self.t_start, "node_bytes": len(self.node_field)}

    async def wait(self, targets: dict[str, str], timeout: float, counts: dict[str, int]) -> dict[str, Any]:
        self.targets, self.counts, self.remaining = targets, counts, 0
        self.satisfied.clear()
        for s in self.streams():
            want = targets.get(s.group)
            if counts:
                s.done = s.closed or s.count >= counts.get(s.group, 1)
            else:
                s.done = s.closed or (bool(s.recv) and (want is None or s.recv[-1][0] == want))
            self.remaining += not s.done
        if self.remaining:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.satisfied.wait(), timeout)
        self.targets, self.counts = None, {}
        return {"ok": self.remaining <= 0, "remaining": self.remaining}

    def min_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.streams():
            out[s.group] = min(out.get(s.group, s.count), s.count)
        return out

    def dump(self, clear: bool) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        out = {
            "streams": [[s.group, s.recv, s.last_size] for s in self.streams()],
            "errors": self.errors[:20],
            "n_errors": len(self.errors),
            "cpu": ru.ru_utime + ru.ru_stime,
            "cpu_sys": ru.ru_stime,
            "t_start": self.t_start,
        }
        if clear:
            for s in self.streams():
                s.recv = []
        return out

    def close(self) -> dict[str, Any]:
        for c in self.conns:
            if c.transport is not None:
                c.transport.close()
        self.conns = []
        return {}


async def main(node_bytes: int) -> None:
    gen = Generator(node_bytes)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": True}), flush=True)
    while line := await reader.readline():
        cmd = json.loads(line)
        reply: dict[str, Any]
        match cmd["cmd"]:
            case "open":
                reply = await gen.open(
                    cmd["port"], cmd["conns"], cmd["node_every"], cmd.get("sources"), cmd.get("pace", 0.0)
                )
            case "wait":
                reply = await gen.wait(cmd.get("targets", {}), cmd["timeout"], cmd.get("counts", {}))
            case "counts":
                reply = gen.min_counts()
            case "dump":
                reply = gen.dump(cmd.get("clear", False))
            case "close":
                reply = gen.close()
            case "quit":
                return
            case other:
                reply = {"error": f"unknown command {other}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpus", default="", help="pin to these cores (comma list)")
    p.add_argument("--node-bytes", type=int, default=60_000, help="size of the encoded Node")
    args = p.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    uvloop.run(main(args.node_bytes))
