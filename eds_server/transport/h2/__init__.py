"""The one seam between eds-server and the HTTP/2 and HTTP libraries below it.

Everything that touches grpclib, h2, hpack, hyperframe or aiohttp internals lives in this package, and
runs only on the library versions its tests verified (compat.py); otherwise the stock path runs on
their public API. The services above see a small interface (base.py): a server that opens one
StreamIO per call (read a request, take further requests directly as they arrive, queue or send a
response, end with a status), and knows its port and what it refused.

- limits.py: what a client may take, and what each limit charges (pure), connection admission;
- guard.py: the frame guard both paths read through (frame headers only, sans-IO);
- headers.py: RFC 9113 request header checks (pure);
- fast_server.py (and fast_connection.py, fast_protocol.py, fast_reader.py, direct.py,
  fast_writer.py): the fast gRPC path; http.py: connection limits for the aiohttp ports
  (http_cap.py: their connection cap on aiohttp's public API, for other aiohttp versions);
- private.py: every internal of those libraries the package touches, where, why, and its figure;
- header_blocks.py: header blocks decoded and re-encoded below h2, for the stock path's checks;
- stock.py: the public-API gRPC path, below the guard.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from ssl import SSLContext
from typing import Any, Protocol

import grpclib.const
import grpclib.server
from aiohttp import web
from grpclib.config import Configuration

from . import compat
from .base import Framed, PassThroughCodec, StreamIO, keepalive_config
from .limits import FILE_HEADROOM, REASONS, ConnectionLimits, Gate, HttpLimits, PartialBudget

__all__ = [
    "FILE_HEADROOM",
    "REASONS",
    "ConnectionLimits",
    "Framed",
    "GrpcServer",
    "HttpLimits",
    "PassThroughCodec",
    "StreamIO",
    "build_server",
    "http_runner",
    "keepalive_config",
    "runner_port",
]


class GrpcServer(Protocol):
    """What the application uses of the gRPC server, on either path."""

    fast: bool
    ssl: SSLContext | None  # TLS for start(), e.g. security.server_ssl_context(...)
    gate: Gate  # its connections' limits and budgets, and what it refused

    def open_io(self, stream: grpclib.server.Stream[Any, Any]) -> StreamIO: ...
    def connection_protocol(self) -> asyncio.Protocol: ...  # one more connection's, as start() makes
    async def start(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        path: str | None = None,
        sock: socket.socket | None = None,
    ) -> None: ...
    def stop_accepting(self) -> None: ...
    def goaway(self, peers: set[str], why: str) -> int: ...
    def close(self) -> None: ...
    async def wait_closed(self) -> None: ...
    @property
    def port(self) -> int: ...
    @property
    def refused(self) -> dict[str, int]: ...
    @property
    def connections(self) -> int: ...
    @property
    def reading(self) -> dict[str, int]: ...
    @property
    def keepalive(self) -> dict[str, int]: ...


def build_server(
    handlers: list[Any],
    counted: dict[str, grpclib.const.Handler],
    *,
    enter: Callable[[grpclib.server.Stream[Any, Any]], bool],
    leave: Callable[[grpclib.server.Stream[Any, Any]], None],
    limits: ConnectionLimits,
    config: Configuration,
    max_message_size: int,
    mode: str = "auto",
    mapping: Callable[[dict[str, Any]], Any] | None = None,
) -> GrpcServer:
    """The gRPC server for `handlers` (which take a StreamIO from `server.open_io`), and for the
    `counted` handlers (health, reflection: grpclib-style), whose streams count against
    `enter`/`leave` and are read within the message limits where the path can. `mapping` wraps
    the path-to-handler table (unknown methods), on the fast path only."""
    if compat.fast_path(mode):
        from .fast_server import MessageReader, Server, limited_handler, short_frame_reprs

        short_frame_reprs()
        reader = MessageReader(
            max_message_size, limits.request_timeout, PartialBudget(limits.partial_message_budget, max_message_size)
        )
        others = {path: limited_handler(h, reader, enter, leave) for path, h in counted.items()}
        return Server(
            [*handlers, _Mapping(others)],
            codec=PassThroughCodec(),
            config=config,
            limits=limits,
            reader=reader,
            mapping=mapping,
        )
    from .stock import StockServer, counted_handler

    others = {path: counted_handler(h, enter, leave) for path, h in counted.items()}
    return StockServer(
        [*handlers, _Mapping(others)],
        codec=PassThroughCodec(),
        config=config,
        limits=limits,
        max_message_size=max_message_size,
    )


class _Mapping:
    """Handlers by path, as grpclib takes services."""

    def __init__(self, handlers: dict[str, grpclib.const.Handler]) -> None:
        self.handlers = handlers

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return self.handlers


def http_runner(app: web.Application, limits: HttpLimits, mode: str = "auto") -> web.AppRunner:
    """An AppRunner for an aiohttp port with a request deadline and a connection cap, and on the
    fast path also a deadline for each request's headers (http.py; else http_cap.py)."""
    if compat.fast_path(mode, {"aiohttp": compat.VERIFIED["aiohttp"]}):
        from .http import LimitedAppRunner

        return LimitedAppRunner(app, limits)
    from .http_cap import CappedAppRunner

    return CappedAppRunner(app, limits)


def runner_port(runner: web.AppRunner) -> int:
    """The port a started runner's first site listens on."""
    return int(runner.addresses[0][1])
