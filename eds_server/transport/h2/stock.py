"""The stock path: grpclib's public API only, for library versions the fast path was not tested
with (compat.py). Correct, and slower: every change wakes each stream's task and is encoded into
its own frames by h2, messages are read whole by grpclib (no size limit before the body, no
deadline), and none of the per-client budgets of limits.py apply; docs/limits.md lists what holds.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

import grpclib.const
import grpclib.server
from grpclib import GRPCError
from grpclib.const import Status

from .base import Framed, plain_status
from .limits import REASONS, ConnectionLimits

Stream = grpclib.server.Stream[Any, Any]


class StockIO:
    """A stream through grpclib's public Stream API."""

    __slots__ = ("stream",)

    def __init__(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        self.stream = stream

    async def read(self, first: bool = False) -> bytes | None:
        data: bytes | None = await self.stream.recv_message()
        return data

    async def read_direct(self, on_message: Callable[[bytes], None]) -> None:
        return None

    def ready(self) -> bool:
        return False  # every send goes through send(), in the stream's own task

    def queue(self, message: Framed) -> bool:
        return False

    async def send(self, message: Framed) -> None:
        await self.stream.send_message(message.payload)

    def status_in_trailers(self) -> contextlib.AbstractAsyncContextManager[None]:
        return plain_status()

    def refused(self) -> None:
        """Nothing is charged on the stock path."""


class StockServer(grpclib.server.Server):
    """grpclib's server, listening on a socket of ours (so its port is known without internals)."""

    fast = False

    def __init__(self, handlers: list[Any], *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(handlers, **kwargs)
        self.limits = limits
        self.ssl: SSLContext | None = None
        self._sock: socket.socket | None = None

    def open_io(self, stream: grpclib.server.Stream[Any, Any]) -> StockIO:
        return StockIO(stream)

    async def start(
        self, host: str | None = None, port: int | None = None, *, ssl: SSLContext | None = None,
        path: str | None = None, sock: socket.socket | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        """On `host`:`port`, a Unix socket `path`, or a listening socket handed over (a worker's)."""
        if path is not None:  # a Unix socket: the workers' link to their owner
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            sock.listen(1024)
            self._sock = sock
            await super().start(sock=sock, **kwargs)
            return
        if sock is None:
            family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
            sock = socket.create_server((host or "", port or 0), family=family, backlog=1024)
        self._sock = sock
        await super().start(sock=sock, ssl=ssl or self.ssl, **kwargs)

    @property
    def port(self) -> int:
        """0 on a Unix socket."""
        assert self._sock is not None
        name = self._sock.getsockname()
        return int(name[1]) if isinstance(name, tuple) else 0

    def stop_accepting(self) -> None:
        """grpclib has no public way to stop accepting alone: close() at the end does it."""

    def goaway(self, peers: set[str], why: str) -> int:
        """grpclib has no public way to end one connection: the streams end, the connection stays."""
        return 0

    @property
    def refused(self) -> dict[str, int]:
        return dict.fromkeys(REASONS, 0)

    @property
    def connections(self) -> int:
        return 0


def counted_handler(
    handler: grpclib.const.Handler, enter: Callable[[Stream], bool], leave: Callable[[Stream], None]
) -> grpclib.const.Handler:
    """A grpclib handler whose stream counts against a stream limit (`enter` False: refused)."""

    async def run(stream: grpclib.server.Stream[Any, Any]) -> None:
        if not enter(stream):
            raise GRPCError(Status.RESOURCE_EXHAUSTED, "server holds its limit of streams")
        try:
            await handler.func(stream)
        finally:
            leave(stream)

    return grpclib.const.Handler(run, handler.cardinality, handler.request_type, handler.reply_type)
