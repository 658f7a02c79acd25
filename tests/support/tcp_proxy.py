"""A TCP proxy on loopback that a test can use to cut one process off from others, the ways networks do.

Each listener forwards to one target (127.0.0.1:port). `reset()` resets every connection and every
new one until `heal()` (a peer that went away, a firewall that rejects); `black_hole()` holds every
byte, both ways, until `heal()`, then delivers it (a partition: nothing is refused, nothing arrives,
and after the heal TCP's retransmissions deliver what was sent). Only 127.0.0.1 is ever connected to.

etcd's watches can be singled out: a connection that carries `POST /v3/watch` (a watch holds its
connection until it ends) is a watch's. `freeze_watches()` holds what etcd sends on them, `cut_watches()`
resets them and every new one, until `heal()`; the other calls (writes, reads, leases) still go
through, so a replica's writes succeed while its view stands still. `lose_answers(share)` resets, until
`heal()`, that share of the other connections just as etcd's answer arrives (the request was
served, the answer never comes: a change that may or may not have been made, as clients see it).
`lose_next_answer(marker)` does the same to the answer of the next request that holds `marker` (a
path), once: one chosen change made whose answer never came.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from collections.abc import Sequence


class TcpProxy:
    def __init__(self, target_ports: Sequence[int]) -> None:
        self.target_ports = list(target_ports)
        self.ports: list[int] = []  # where the proxy listens, one per target, in the same order
        self.mode = "pass"
        self.watch_mode = "pass"  # or "freeze", "cut": for watch connections only
        self.losing = 0.0  # the share of answers (not a watch's) lost, by a reset as they arrive
        self.lost_answers = 0
        self.lose_marker: bytes | None = None  # the answer to the next request holding it is lost
        self._losing: set[asyncio.StreamWriter] = set()  # connections whose next answer is lost
        self._rng = random.Random(0)
        self.connections = 0
        self.watch_connections = 0
        self.resets = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._watches_flowing = asyncio.Event()
        self._watches_flowing.set()
        self._watches: set[asyncio.StreamWriter] = set()  # both ends of each watch connection
        self._servers: list[asyncio.Server] = []
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> TcpProxy:
        for target in self.target_ports:
            server = await asyncio.start_server(lambda r, w, t=target: self._handle(r, w, t), "127.0.0.1", 0)
            self._servers.append(server)
            self.ports.append(int(server.sockets[0].getsockname()[1]))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.heal()
        for server in self._servers:
            server.close()
        for writer in list(self._open):
            _abort(writer)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def reset(self) -> None:
        self.mode = "reset"
        self._flowing.set()
        for writer in list(self._open):
            _abort(writer)
            self.resets += 1

    def black_hole(self) -> None:
        self.mode = "black-hole"
        self._flowing.clear()

    def freeze_watches(self) -> None:
        self.watch_mode = "freeze"
        self._watches_flowing.clear()

    def cut_watches(self) -> None:
        self.watch_mode = "cut"
        self._watches_flowing.set()
        for writer in list(self._watches):
            _abort(writer)
            self.resets += 1

    def lose_answers(self, share: float, seed: int = 0) -> None:
        self.losing = share
        self._rng = random.Random(seed)

    def lose_next_answer(self, marker: bytes) -> None:
        self.lose_marker = marker

    def heal(self) -> None:
        self.mode = "pass"
        self.watch_mode = "pass"
        self.losing = 0.0
        self.lose_marker = None
        self._losing.clear()
        self._flowing.set()
        self._watches_flowing.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: int) -> None:
        if self.mode == "reset":
            self.resets += 1
            _abort(writer)
            return
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", target), 5)
        except (OSError, TimeoutError):
            _abort(writer)
            return
        self._open |= {writer, up_writer}
        ends = (writer, up_writer)
        try:
            ways = ((reader, up_writer, False), (up_reader, writer, True))
            pumps = [asyncio.create_task(self._pump(src, dst, ends, back)) for src, dst, back in ways]
            self._tasks.update(pumps)
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
        finally:
            for w in (writer, up_writer):
                self._open.discard(w)
                self._losing.discard(w)
                self._watches.discard(w)
                with contextlib.suppress(OSError, RuntimeError):
                    w.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ends: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
        back: bool,
    ) -> None:
        """One way of a connection; `back`: etcd's answers (what a frozen watch holds)."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            for _ in range(1 << 40):  # until the connection ends
                await self._flowing.wait()  # black-holed: read nothing, so the sender's buffers fill
                data = await reader.read(65536)
                if not data:
                    return
                if not back and ends[0] not in self._watches and b"POST /v3/watch" in data:
                    self._watches.update(ends)
                    self.watch_connections += 1
                watch = ends[0] in self._watches
                if not back and self.lose_marker is not None and self.lose_marker in data:
                    self.lose_marker = None
                    self._losing.add(ends[0])
                if back and ends[0] in self._losing:
                    self._losing.discard(ends[0])
                    self.lost_answers += 1
                    for end in ends:
                        _abort(end)
                    return
                if watch and self.watch_mode == "cut":
                    self.resets += 1
                    for end in ends:
                        _abort(end)
                    return
                if back and not watch and self.losing and self._rng.random() < self.losing:
                    self.lost_answers += 1
                    for end in ends:
                        _abort(end)
                    return
                await self._flowing.wait()  # what was read before the cut waits for the heal too
                if watch and back:
                    await self._watches_flowing.wait()  # a frozen watch: nothing of it arrives
                writer.write(data)
                await writer.drain()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a host that rejects or forgets the connection."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError, RuntimeError):
        writer.transport.abort()
