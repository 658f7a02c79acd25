"""The connection cap of an aiohttp port, on aiohttp's public API only: for aiohttp versions the
fast path (http.py) was not tested with. The runner's `server` (aiohttp's low-level web.Server, a
protocol factory) is wrapped so each connection's protocol is counted; past the cap, a connection
gets `503` and is closed at once, before aiohttp sees it. A request's headers must end within
the timeout of their first byte (or of the connection's start), seen from the bytes alone: aiohttp
has no such deadline, so a slowloris client would hold a connection slot for ever; aiohttp's
keepalive timeout bounds an idle connection and the request deadline a body.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiohttp import web

from .base import timeout_middleware
from .limits import HttpLimits

REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class PortCount:
    """One port's open connections, and those refused (both runners count them here)."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.open = 0
        self.refused = 0
        self.timed_out = 0  # connections closed for a request's headers not in time (http.py)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """Count a new connection; past the cap it gets `503` and is closed, and is not counted."""
        if self.open >= self.limits.max_connections:
            self.refused += 1
            tr = cast(asyncio.Transport, transport)
            tr.write(REFUSED)
            tr.close()
            return False
        self.open += 1
        return True


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted against the port's cap."""

    def __init__(self, inner: asyncio.Protocol, port: PortCount) -> None:
        self.inner = inner
        self.port = port
        self.counted = False
        self.transport: asyncio.Transport | None = None
        self.deadline: asyncio.TimerHandle | None = None  # for the headers begun to end
        self.tail = b""  # the last bytes received, for an end of headers split across reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.port.admit(transport):
            return
        self.counted = True
        self.transport = cast(asyncio.Transport, transport)
        self.arm()
        self.inner.connection_made(transport)

    def arm(self, times: float = 1.0) -> None:
        self.deadline = asyncio.get_running_loop().call_later(times * self.port.limits.timeout, self.expire)

    def expire(self) -> None:
        self.deadline = None
        if self.transport is not None and not self.transport.is_closing():
            self.port.timed_out += 1
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.counted:
            return
        seen = self.tail + data
        end = seen.rfind(b"\r\n\r\n")
        if end >= 0:  # the headers ended: no deadline until more comes
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None
            if len(seen) > end + 4:  # a body (or the next request): the request deadline answers
                self.arm(2.0)  # a body first (408), then aiohttp would linger on the rest for 10 s
        elif self.deadline is None:  # a request begun (or a body: the request deadline is sooner)
            self.arm()
        self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.counted else None

    def pause_writing(self) -> None:
        if self.counted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.counted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if self.counted:
            self.counted = False
            self.port.open -= 1
            self.inner.connection_lost(exc)


class _Factory:
    """What a site calls for each connection: aiohttp's server, each protocol counted."""

    def __init__(self, server: Any, port: PortCount) -> None:
        self.server = server
        self.port = port

    def __call__(self) -> _Counted:
        return _Counted(self.server(), self.port)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)


class CappedAppRunner(web.AppRunner):
    """An AppRunner whose sites hold at most `limits.max_connections` connections, with aiohttp's
    keepalive timeout and a request deadline of `limits.timeout`. Each connection's protocol comes
    from `factory` (http.py's runner makes its own); `busy` hears of requests starting and ending."""

    factory: Any = _Factory
    busy: Any = None

    def __init__(self, app: web.Application, limits: HttpLimits) -> None:
        app.middlewares.insert(0, timeout_middleware(limits.timeout, type(self).busy))
        super().__init__(app, access_log=None, keepalive_timeout=limits.timeout)
        self.port = PortCount(limits)

    @property
    def server(self) -> Any:
        server = super().server
        return None if server is None else self.factory(server, self.port)
