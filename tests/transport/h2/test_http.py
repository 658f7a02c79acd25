"""The admin and REST ports' limits (transport/h2/http.py): a connection cap, and deadlines for
headers, bodies and idle keepalive that aiohttp does not have. Loopback, in-process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from eds_server.transport.h2.http import LimitedAppRunner
from eds_server.transport.h2.http_cap import CappedAppRunner
from eds_server.transport.h2.limits import HttpLimits
from tests.support.waiting import wait_for


@contextlib.asynccontextmanager
async def serving(
    limits: HttpLimits, runner_class: type[LimitedAppRunner | CappedAppRunner] = LimitedAppRunner
) -> AsyncIterator[tuple[int, Any]]:
    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_route("*", "/", echo)
    runner = runner_class(app, limits)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1], runner
    finally:
        await runner.cleanup()


async def closed_within(reader: asyncio.StreamReader, seconds: float = 10.0) -> bytes:
    """Everything the server sends until it closes (bounded by `seconds`, which fails the test)."""
    return await asyncio.wait_for(reader.read(), seconds)


@pytest.mark.parametrize("runner_class", [LimitedAppRunner, CappedAppRunner])
async def test_slowloris_headers_are_cut_off(runner_class: type[LimitedAppRunner | CappedAppRunner]) -> None:
    async with serving(HttpLimits(timeout=0.3), runner_class) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and never the end of the headers
        for _ in range(20):  # a byte now and then does not keep it open
            if reader.at_eof():
                break
            with contextlib.suppress(RuntimeError, ConnectionError):
                writer.write(b"x")
            await asyncio.sleep(0.05)  # the slow client's pace (the attack itself, not a wait)
        assert await closed_within(reader) == b""
        writer.close()


@pytest.mark.parametrize("runner_class", [LimitedAppRunner, CappedAppRunner])
async def test_an_idle_keepalive_connection_is_closed(runner_class: type[LimitedAppRunner | CappedAppRunner]) -> None:
    async with serving(HttpLimits(timeout=0.3), runner_class) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await closed_within(reader)
        assert answer.startswith(b"HTTP/1.1 200")  # answered, then closed once idle
        writer.close()


@pytest.mark.parametrize("runner_class", [LimitedAppRunner, CappedAppRunner])
async def test_a_half_sent_body_gets_408(runner_class: type[LimitedAppRunner | CappedAppRunner]) -> None:
    async with serving(HttpLimits(timeout=0.3), runner_class) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        answer = await closed_within(reader)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        writer.close()


@pytest.mark.parametrize("runner_class", [LimitedAppRunner, CappedAppRunner])
async def test_connections_over_the_cap_get_503(runner_class: type[LimitedAppRunner | CappedAppRunner]) -> None:
    """On the fast path (aiohttp's internals) and on other aiohttp versions (its public API only)."""
    async with serving(HttpLimits(max_connections=2, timeout=5), runner_class) as (port, runner):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        try:
            await wait_for(lambda: runner.port.open == 2, timeout=2.0)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert (await closed_within(reader)).startswith(b"HTTP/1.1 503")
            writer.close()
            assert runner.port.refused == 1
        finally:
            for _, w in held:
                w.close()
        await wait_for(lambda: runner.port.open == 0, timeout=2.0)  # the held ones are gone, room again
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await closed_within(reader)).startswith(b"HTTP/1.1 200")
        writer.close()
