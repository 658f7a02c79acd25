"""What the gRPC services see of a stream and of the server, whichever HTTP/2 path runs below:
the fast path (fast_server.py: grpclib, h2 and hyperframe internals, for the versions compat.py
verified) or the stock path (stock.py: grpclib's public API only). Only public API of other
libraries here, but grpclib's keepalive keywords (keepalive_config; private.py lists them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, cast

import betterproto2
from aiohttp import web
from grpclib import GRPCError
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.encoding.base import CodecBase


class Framed:
    """A gRPC message (length prefix and body) cut into DATA frame payloads: built once for all
    the streams it goes to, which are sent views of the same bytes, not copies."""

    __slots__ = ("_cuts", "data", "payload")

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.data = b"\x00" + len(payload).to_bytes(4, "big") + payload
        self._cuts: dict[int, tuple[list[bytes], list[memoryview]]] = {}

    def frames(self, step: int) -> tuple[list[bytes], list[memoryview]]:
        """For frames of at most `step` bytes: each frame's header up to its stream id, and payload."""
        cut = self._cuts.get(step)
        if cut is None:
            view, n = memoryview(self.data), len(self.data)
            heads = [min(step, n - pos).to_bytes(3, "big") + b"\x00\x00" for pos in range(0, n, step)]
            cut = self._cuts[step] = (heads, [view[pos : pos + step] for pos in range(0, n, step)])
        return cut


class DirectClient(Protocol):
    """Who a stream's direct reading tells (the session, itself: no bound method kept a stream)."""

    def on_message(self, data: bytes) -> None: ...
    def direct_ended(self, done: asyncio.Future[None]) -> None: ...


class StreamIO(Protocol):
    """One gRPC call's stream, as the EDS service drives it."""

    async def read(self, first: bool = False) -> bytes | memoryview | None:
        """The next request message; None once the client ended its side."""

    def first_request(self) -> bytes | memoryview | None:
        """The stream's first request if it is here whole already (an Envoy sends it with the
        stream's HEADERS), taken without waiting; None: `read(first=True)` reads it."""

    def read_direct(self, client: DirectClient) -> asyncio.Future[None] | None:
        """Give further messages to `client.on_message` as they arrive, until the stream needs
        `read` again: the future is done then (its exception what ended the stream), and
        `client.direct_ended` is called with it, as its done callback; cancelling it stops the
        reading. None where the path cannot do this now: `read` on."""

    def ready(self) -> bool:
        """A message can be queued now, without waiting (headers sent, transport not paused)."""

    def queue(self, message: Framed) -> bool:
        """Queue a whole message for the connection's next write, if it fits the windows now."""

    async def send(self, message: Framed) -> None:
        """Send a message, waiting for flow control as needed."""

    def status_in_trailers(self) -> contextlib.AbstractAsyncContextManager[None]:
        """End a call that raises GRPCError with its status in trailers."""

    def refused(self) -> None:
        """The call was refused at the stream limits: charged to its client like a stream without a request."""


class PassThroughCodec(CodecBase):
    """Protobuf codec that sends `bytes` as they are and can leave requests undecoded (a request read
    as a view of its frames stays one: no copy of an Envoy's 60 KB Node)."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, bytes):
            return message
        return bytes(cast(betterproto2.Message, message))

    def decode(self, data: bytes | memoryview, message_type: Any) -> Any:
        if message_type is bytes:
            return data
        try:
            return message_type.parse(data)
        except Exception as e:  # betterproto2 raises assorted errors on garbage
            raise GRPCError(Status.INVALID_ARGUMENT, f"cannot parse request: {e}") from None


@contextlib.asynccontextmanager
async def plain_status() -> AsyncIterator[None]:
    """grpclib's own handling of a failed call (the stock path)."""
    yield


def timeout_middleware(
    timeout: float, busy: Callable[[web.Request, int], None] | None = None
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """An aiohttp middleware answering 408 when a request is not handled, body read included,
    within `timeout`; `busy(request, +1 / -1)` is told when a request starts and ends."""

    @web.middleware
    async def limit(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
        if busy is not None:
            busy(request, 1)
        try:
            async with asyncio.timeout(timeout):
                return await handler(request)
        except TimeoutError:
            raise web.HTTPRequestTimeout(text=f"request not handled within {timeout:g}s\n") from None
        finally:
            if busy is not None:
                busy(request, -1)

    return limit


def keepalive_config(keepalive_time: float, keepalive_timeout: float) -> Configuration:
    """grpclib's Configuration with keepalive, for our gRPC clients (the relay): its keyword
    arguments for it are private (a leading underscore), so they are named here only. The server
    runs its own keepalive (keepalive.py)."""
    return Configuration(_keepalive_time=keepalive_time, _keepalive_timeout=keepalive_timeout)
