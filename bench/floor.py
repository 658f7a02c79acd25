"""The floor: the least a Python server can do per change for the bench's streams, to put eds-server beside.

    .venv/bin/python bench/floor.py serve --upstreams FILE --listen HOST:PORT [--admin HOST:PORT]

Started like any `--peer` (bench/sidebyside.py, bench/cores.py) and reached by the same load generator
(bench/loadgen.py): StreamEndpoints calls, many per HTTP/2 connection. What it does and no more:

- HTTP/2 by hand on non-blocking sockets and one `selectors` loop (no asyncio, no h2, no grpclib):
  the connection preface, SETTINGS (its own: big windows, 128 KiB frames as eds-server announces;
  the client's: windows and frame size honoured), PING, WINDOW_UPDATE both ways, RST_STREAM, GOAWAY.
  Request header blocks are not decoded (every call of the load generator is StreamEndpoints for the
  one group of the bench's file, and it adds nothing to HPACK's dynamic table); response headers are
  one pre-encoded block (`:status 200`, `content-type: application/grpc`).
- Requests are cut into gRPC messages only to tell a stream's first request (answered with the
  current response) from its ACKs (counted, then dropped); every DATA byte read is granted back.
- The response is eds-server's own encoding of the file's group as first read (`eds_server.encode`,
  `eds_server.xds.wire`: the same resource bytes, type URL and control plane), with version_info
  (16 hex digits, as eds-server's) and nonce new on each change. The file is not read again: what a
  change costs eds-server before its fan-out (reading, parsing, encoding: the "1 stream" shape of
  bench/sidebyside.py) is left out of the floor.
- A change is learnt from inotify (the file renamed over, or written and closed). Its response is
  framed once; per connection, every stream's DATA frame headers (built once per stream and frame
  size) and views of those bytes go out as one iovec list in one `sendmsg`, again only for what
  the socket did not take (the loopback socket's send buffer grows to `net.ipv4.tcp_wmem`'s max).

With --native it runs the same server written in C instead (bench/floor.c, compiled with gcc into
bench/results/ when missing or older than its source, then exec'd: the bench measures that process),
after writing the response's constant part for it, so both send the same bytes.

On SIGUSR1 and SIGTERM it logs what it did (connections, streams, responses, ACKs, sendmsg calls) to stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # eds_server, run from a checkout

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM = ACK = 0x1
END_HEADERS, PADDED = 0x4, 0x8
FRAME = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
OUR_WINDOW = (1 << 31) - 1  # the receive window we announce (stream and connection)
OUR_MAX_FRAME = 1 << 17  # as eds-server announces: a 60 KB first request is one DATA frame
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# :status 200 (static index 8); content-type (static 31) literal without indexing, no Huffman
RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"
IN_CLOSE_WRITE, IN_MOVED_TO = 0x8, 0x80
EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (name follows)


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return FRAME.pack(len(payload) << 8 | ftype, flags, sid) + payload


def framed_response(middle: bytes, version: int) -> bytes:
    """The gRPC-framed DiscoveryResponse of `version`: version_info (1), then `middle` (resources (2),
    type_url (4), control_plane (6)), then nonce (5), as eds-server lays them out."""
    nonce = str(version + 1).encode()
    msg = b"".join((b"\x0a\x10", f"{version:016x}".encode(), middle, b"\x2a", bytes([len(nonce)]), nonce))
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


class Stream:
    __slots__ = ("answered", "consumed", "head", "heads", "heads_key", "id", "need", "window")

    def __init__(self, sid: int, window: int) -> None:
        self.id, self.window = sid, window
        self.need = 0  # bytes still to come of the gRPC message being read
        self.head = bytearray()  # a 5-byte gRPC message prefix split over frames
        self.answered = False  # its first request read and answered: changes go to it
        self.consumed = 0  # DATA bytes read and not yet granted back
        self.heads: list[bytes] = []  # its DATA frame headers for the current response's frames
        self.heads_key: tuple[int, ...] = ()


class Conn:
    __slots__ = (
        "blocked",
        "consumed",
        "fd",
        "out",
        "peer_initial",
        "peer_max_frame",
        "preface",
        "rbuf",
        "send_window",
        "sock",
        "streams",
        "writing",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.fd = sock, sock.fileno()
        self.rbuf = bytearray()
        self.out: list[bytes | memoryview] = []
        self.streams: dict[int, Stream] = {}
        self.blocked: set[int] = set()  # answered streams owed the current response (windows were short)
        self.send_window = self.peer_initial = 65535
        self.peer_max_frame = 16384
        self.consumed = 0
        self.preface = False
        self.writing = False


class Floor:
    def __init__(self, listen: tuple[str, int], upstreams: Path) -> None:
        self.sel = selectors.DefaultSelector()
        self.lsock = socket.create_server(listen, backlog=4096, reuse_port=False)
        self.lsock.setblocking(False)
        self.sel.register(self.lsock, selectors.EVENT_READ, None)
        self.conns: dict[int, Conn] = {}
        self.upstreams = upstreams
        self.middle = self.encoded_group(upstreams)
        self.version = 0
        self.body = framed_response(self.middle, self.version)
        self.chunks: dict[int, list[memoryview]] = {}  # frame size -> views of body, one per DATA frame
        self.stats = {
            "connections": 0,
            "streams": 0,
            "responses": 0,
            "acks": 0,
            "changes": 0,
            "sendmsg": 0,
            "sendmsg_partial": 0,
            "bytes_sent": 0,
            "bytes_read": 0,
        }
        self.inotify = self.watch(upstreams)
        self.sel.register(self.inotify, selectors.EVENT_READ, "inotify")

    @staticmethod
    def encoded_group(path: Path) -> bytes:
        """resources (2) + type_url (4) + control_plane (6) of eds-server's response for the file's one group."""
        from eds_server import upstreams
        from eds_server.encode import encode_group
        from eds_server.encoded import Resource, content_version
        from eds_server.xds.wire import discovery_response

        groups = upstreams.load(str(path))
        if len(groups) != 1:
            raise SystemExit(f"floor: {path} must hold one group (the bench's files do), not {len(groups)}")
        ((name, group),) = groups.items()
        body = encode_group(group)
        return discovery_response("", [Resource(name, content_version(body), body, group)], "")

    @staticmethod
    def watch(path: Path) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0 or libc.inotify_add_watch(fd, str(path.parent).encode(), IN_CLOSE_WRITE | IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), "inotify")
        return fd

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            for key, events in self.sel.select():
                if key.data is None:
                    self.accept()
                elif key.data == "inotify":
                    self.on_inotify()
                else:
                    conn: Conn = key.data
                    if events & selectors.EVENT_READ and not self.read(conn):
                        continue
                    if events & selectors.EVENT_WRITE:
                        self.flush(conn)

    def accept(self) -> None:
        while True:
            try:
                sock, _ = self.lsock.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Conn(sock)
            self.conns[conn.fd] = conn
            self.stats["connections"] += 1
            self.sel.register(sock, selectors.EVENT_READ, conn)
            settings = struct.pack(">HIHI", 0x4, OUR_WINDOW, 0x5, OUR_MAX_FRAME)
            grow = frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", OUR_WINDOW - 65535))
            conn.out += [frame(SETTINGS, 0, 0, settings), grow]
            self.flush(conn)

    def close(self, conn: Conn) -> None:
        self.sel.unregister(conn.sock)
        conn.sock.close()
        self.conns.pop(conn.fd, None)

    def read(self, conn: Conn) -> bool:
        """Read what the socket has, act on every whole frame; False when the connection is gone."""
        try:
            data = conn.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if not data:
            self.close(conn)
            return False
        self.stats["bytes_read"] += len(data)
        buf = conn.rbuf
        buf += data
        pos, end = 0, len(buf)
        if not conn.preface:
            if end < len(PREFACE):
                return True
            if buf[: len(PREFACE)] != PREFACE:
                self.close(conn)
                return False
            conn.preface, pos = True, len(PREFACE)
        view, gone = memoryview(buf), False
        try:
            while end - pos >= 9:
                lt, flags, sid = FRAME.unpack_from(buf, pos)
                length = lt >> 8
                if end - pos - 9 < length:
                    break
                start, pos = pos + 9, pos + 9 + length
                ftype, sid = lt & 0xFF, sid & 0x7FFFFFFF
                if ftype == DATA:
                    self.on_data(conn, sid, flags, view[start:pos], length)
                elif ftype == HEADERS:
                    if sid not in conn.streams:  # a new call (its block is not decoded: see the docstring)
                        conn.streams[sid] = Stream(sid, conn.peer_initial)
                        self.stats["streams"] += 1
                elif ftype == WINDOW_UPDATE:
                    inc = int.from_bytes(view[start : start + 4], "big") & 0x7FFFFFFF
                    if sid == 0:
                        conn.send_window += inc
                    elif (s := conn.streams.get(sid)) is not None:
                        s.window += inc
                elif ftype == SETTINGS and not flags & ACK:
                    for off in range(start, pos, 6):
                        ident, value = struct.unpack_from(">HI", buf, off)
                        if ident == 0x4:
                            for s in conn.streams.values():
                                s.window += value - conn.peer_initial
                            conn.peer_initial = value
                        elif ident == 0x5:
                            conn.peer_max_frame = value
                    conn.out.append(frame(SETTINGS, ACK, 0))
                elif ftype == PING and not flags & ACK:
                    conn.out.append(frame(PING, ACK, 0, bytes(view[start:pos])))
                elif ftype == RST_STREAM:
                    conn.streams.pop(sid, None)
                    conn.blocked.discard(sid)
                elif ftype == GOAWAY:
                    gone = True
                    break
        finally:
            view.release()
        if gone:
            self.close(conn)
            return False
        del buf[:pos]
        if conn.consumed >= OUR_WINDOW // 2:
            conn.out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", conn.consumed)))
            conn.consumed = 0
        if conn.blocked:
            self.unblock(conn)
        if conn.out:
            self.flush(conn)
        return True

    def on_data(self, conn: Conn, sid: int, flags: int, payload: memoryview, length: int) -> None:
        conn.consumed += length
        s = conn.streams.get(sid)
        if s is None:
            return
        s.consumed += length
        if s.consumed >= OUR_WINDOW // 2:  # never at the bench's sizes; honest all the same
            conn.out.append(frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", s.consumed)))
            s.consumed = 0
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        pos, n = 0, len(payload)
        if not s.need and not s.head and n >= 5 and int.from_bytes(payload[1:5], "big") == n - 5:
            self.message(conn, s)  # one whole message in one frame: every ACK of the load generator
            return
        while pos < n:
            if s.need:
                take = min(s.need, n - pos)
                s.need -= take
                pos += take
                if not s.need:
                    self.message(conn, s)
                continue
            take = min(5 - len(s.head), n - pos)
            s.head += payload[pos : pos + take]
            pos += take
            if len(s.head) == 5:
                s.need = int.from_bytes(s.head[1:5], "big")
                s.head.clear()
                if not s.need:
                    self.message(conn, s)

    def message(self, conn: Conn, s: Stream) -> None:
        """A whole request: the first is answered with headers and the current response, the rest are ACKs."""
        if s.answered:
            self.stats["acks"] += 1
            return
        s.answered = True
        conn.out.append(frame(HEADERS, END_HEADERS, s.id, RESPONSE_HEADERS))
        self.queue(conn, s)

    # -- writing ---------------------------------------------------------------------------------
    def frames_of_body(self, size: int) -> list[memoryview]:
        chunks = self.chunks.get(size)
        if chunks is None:
            body = memoryview(self.body)
            chunks = self.chunks[size] = [body[i : i + size] for i in range(0, len(body), size)]
        return chunks

    def queue(self, conn: Conn, s: Stream) -> None:
        """The current response's DATA frames for one stream, if both windows take it (else owed)."""
        n = len(self.body)
        if n > s.window or n > conn.send_window:
            conn.blocked.add(s.id)
            return
        s.window -= n
        conn.send_window -= n
        chunks = self.frames_of_body(conn.peer_max_frame)
        key = (conn.peer_max_frame, n)
        if s.heads_key != key:
            s.heads = [FRAME.pack(len(c) << 8 | DATA, 0, s.id) for c in chunks]
            s.heads_key = key
        out = conn.out
        for head, chunk in zip(s.heads, chunks, strict=True):
            out.append(head)
            out.append(chunk)
        self.stats["responses"] += 1

    def unblock(self, conn: Conn) -> None:
        owed, conn.blocked = conn.blocked, set()
        for sid in sorted(owed):
            if (s := conn.streams.get(sid)) is not None:
                self.queue(conn, s)

    def flush(self, conn: Conn) -> None:
        """One sendmsg of everything queued (IOV_MAX pieces at a time); the rest when the socket is writable."""
        out = conn.out
        while out:
            batch = out[:IOV_MAX]
            try:
                sent = conn.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.close(conn)
                return
            self.stats["sendmsg"] += 1
            self.stats["bytes_sent"] += sent
            i = 0
            while i < len(batch) and sent >= len(batch[i]):
                sent -= len(batch[i])
                i += 1
            del out[:i]
            if i < len(batch):
                self.stats["sendmsg_partial"] += 1
                if sent:
                    out[0] = memoryview(out[0])[sent:]
                if not conn.writing:
                    conn.writing = True
                    self.sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
                return
        if conn.writing:
            conn.writing = False
            self.sel.modify(conn.sock, selectors.EVENT_READ, conn)

    # -- changes ---------------------------------------------------------------------------------
    def on_inotify(self) -> None:
        try:
            data = os.read(self.inotify, 65536)
        except BlockingIOError:
            return
        name, changed, pos = self.upstreams.name.encode(), False, 0
        while pos < len(data):
            _, _, _, size = EVENT.unpack_from(data, pos)
            changed |= data[pos + EVENT.size : pos + EVENT.size + size].rstrip(b"\0") == name
            pos += EVENT.size + size
        if changed:
            self.change()

    def change(self) -> None:
        """A new version to every answered stream: per connection one iovec list, one sendmsg."""
        self.version += 1
        self.stats["changes"] += 1
        self.body, self.chunks = framed_response(self.middle, self.version), {}
        for conn in list(self.conns.values()):
            conn.blocked.clear()  # the new response replaces whatever was owed
            for s in conn.streams.values():
                if s.answered:
                    self.queue(conn, s)
            if conn.out:
                self.flush(conn)


def native_binary() -> Path:
    """bench/floor.c compiled (again if its source is newer), renamed into place: runs may race."""
    src, out = HERE / "floor.c", HERE / "results" / "floor-native"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".floor-native.{os.getpid()}")
        subprocess.run(["gcc", "-O2", "-Wall", "-o", str(tmp), str(src)], check=True)
        os.replace(tmp, out)
    return out


def exec_native(upstreams: Path, listen: str) -> None:
    binary = native_binary()
    fd, middle = tempfile.mkstemp(prefix="floor-middle-")  # read, then removed, by the C program
    with os.fdopen(fd, "wb") as f:
        f.write(Floor.encoded_group(upstreams))
    os.execv(binary, [str(binary), "serve", "--upstreams", str(upstreams), "--listen", listen, "--middle", middle])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["serve"])
    p.add_argument("--upstreams", type=Path, required=True)
    p.add_argument("--listen", required=True, help="HOST:PORT")
    p.add_argument("--admin", default="", help="accepted for the bench's command line; no admin port is served")
    p.add_argument("--native", action="store_true", help="exec the C floor (bench/floor.c) instead")
    args = p.parse_args()
    if args.native:
        exec_native(args.upstreams.resolve(), args.listen)
    host, _, port = args.listen.rpartition(":")
    floor = Floor((host, int(port)), args.upstreams.resolve())

    def report(*_: object) -> None:
        print("floor: " + ", ".join(f"{k} {v}" for k, v in floor.stats.items()), file=sys.stderr, flush=True)

    def stop(*_: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGUSR1, report)
    signal.signal(signal.SIGTERM, stop)
    try:
        floor.run()
    finally:
        report()


if __name__ == "__main__":
    main()
