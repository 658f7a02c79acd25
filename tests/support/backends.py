"""Tiny HTTP backends on 127.0.0.1 that answer every request with their own name.

`async with http_backends(2) as backends:` gives backends named "backend-0" and "backend-1",
each with its `port` and a `hits` counter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from ssl import SSLContext

from aiohttp import web


@dataclass
class Backend:
    name: str
    port: int = 0
    address: str = "127.0.0.1"
    hits: int = 0  # requests served so far
    ssl: SSLContext | None = None  # serve HTTPS with this context


@asynccontextmanager
async def _serve(backend: Backend) -> AsyncIterator[Backend]:
    async def handle(request: web.Request) -> web.Response:
        backend.hits += 1
        return web.Response(text=backend.name, headers={"x-backend": backend.name})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        # port 0 (default): the OS picks, no race
        site = web.TCPSite(runner, backend.address, backend.port, ssl_context=backend.ssl)
        await site.start()
        backend.port = int(runner.addresses[0][1])
        yield backend
    finally:
        await runner.cleanup()


@asynccontextmanager
async def serve_backend(backend: Backend) -> AsyncIterator[Backend]:
    """One backend at `backend.address`:`backend.port` (e.g. 127.0.0.2, as a Pod IP in the Kubernetes tests)."""
    async with _serve(backend) as b:
        yield b


@asynccontextmanager
async def http_backends(n: int, prefix: str = "backend") -> AsyncIterator[list[Backend]]:
    """Start `n` backends named f"{prefix}-{i}"; stop them on exit."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(_serve(Backend(f"{prefix}-{i}"))) for i in range(n)]
