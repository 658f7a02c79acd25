"""Limits for the aiohttp ports (admin, registration API, REST EDS), which aiohttp leaves open:
its keepalive is an hour, and it has no deadline for a request's headers or body and no
connection cap, so idle, slowloris and half-sent-body clients could hold the admin port.

- a connection cap per port: past it, a connection gets `503` and is closed at once;
- a connection must finish each request's headers within `timeout` of connecting or of its
  previous response (which also bounds keepalive);
- a request must be handled, body read included, within `timeout` (else `408`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .http_cap import CappedAppRunner, PortCount


class _Handler(RequestHandler):
    """aiohttp's protocol, counted against the port's cap, with a deadline while no request runs."""

    def __init__(self, port: PortCount, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.port = port
        self.busy = 0
        self.deadline: asyncio.TimerHandle | None = None
        self.counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self.port.admit(transport):
            return
        self.counted = True
        self.arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.counted:
            self.counted = False
            self.port.open -= 1
        self.disarm()
        super().connection_lost(exc)

    def arm(self) -> None:
        self.disarm()
        if self.counted:
            self.deadline = asyncio.get_running_loop().call_later(self.port.limits.timeout, self.expire)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def expire(self) -> None:
        self.deadline = None
        if not self.busy and self.transport is not None:
            self.port.timed_out += 1
            self.transport.close()


class _Factory:
    """What the site calls for each connection (aiohttp's web.Server does the same, unlimited)."""

    def __init__(self, server: web.Server, port: PortCount) -> None:
        self.server = server
        self.port = port

    def __call__(self) -> _Handler:
        return _Handler(self.port, self.server, loop=self.server._loop, **self.server._kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)


def _busy(request: web.Request, delta: int) -> None:
    """A request starts (+1) or ends (-1): no deadline for the connection while one runs."""
    proto = request.protocol
    if isinstance(proto, _Handler):
        proto.busy += delta
        if delta > 0:
            proto.disarm()
        elif not proto.busy:
            proto.arm()


class LimitedAppRunner(CappedAppRunner):
    """An AppRunner whose sites get the limits above: the cap, and aiohttp's own protocol with a
    deadline while no request runs."""

    factory = _Factory
    busy = staticmethod(_busy)
