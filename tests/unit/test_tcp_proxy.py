"""The TCP proxy of tests/support that the history-checking fault test cuts a replica off with: it
forwards, a black hole holds every byte until the heal and then delivers it, a reset ends every
connection and refuses new ones until the heal."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.support.tcp_proxy import TcpProxy


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()


async def roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), 5)


async def test_forwards_holds_in_a_black_hole_and_delivers_after_the_heal() -> None:
    async with echo_server() as port, TcpProxy([port]) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.ports[0])
        assert await roundtrip(reader, writer, b"one") == b"one"
        proxy.black_hole()
        writer.write(b"two")
        await writer.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(3), 0.3)
        proxy.heal()
        assert await asyncio.wait_for(reader.readexactly(3), 5) == b"two"
        assert await roundtrip(reader, writer, b"three") == b"three"
        writer.close()


async def test_a_reset_ends_every_connection_and_refuses_new_ones_until_the_heal() -> None:
    async with echo_server() as port, TcpProxy([port]) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.ports[0])
        assert await roundtrip(reader, writer, b"x") == b"x"
        proxy.reset()
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await roundtrip(reader, writer, b"y")
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.ports[0])
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError, BrokenPipeError)):
            await roundtrip(reader, writer, b"z")
        assert proxy.resets >= 2
        proxy.heal()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.ports[0])
        assert await roundtrip(reader, writer, b"again") == b"again"
        writer.close()


async def test_freezes_or_cuts_only_the_connections_that_carry_a_watch() -> None:
    async with echo_server() as port, TcpProxy([port]) as proxy:
        call_r, call_w = await asyncio.open_connection("127.0.0.1", proxy.ports[0])
        watch_r, watch_w = await asyncio.open_connection("127.0.0.1", proxy.ports[0])
        assert await roundtrip(watch_r, watch_w, b"POST /v3/watch HTTP/1.1\r\n") == b"POST /v3/watch HTTP/1.1\r\n"
        assert proxy.watch_connections == 1
        proxy.freeze_watches()
        assert await roundtrip(call_r, call_w, b"POST /v3/kv/txn HTTP/1.1\r\n") == b"POST /v3/kv/txn HTTP/1.1\r\n"
        watch_w.write(b"more")
        await watch_w.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(watch_r.readexactly(4), 0.3)
        proxy.heal()
        assert await asyncio.wait_for(watch_r.readexactly(4), 5) == b"more"  # held, then delivered
        proxy.cut_watches()
        with contextlib.suppress(ConnectionResetError):  # reset: no bytes either way
            assert await asyncio.wait_for(watch_r.read(), 5) == b""
        assert await roundtrip(call_r, call_w, b"still") == b"still"
        again_r, again_w = await asyncio.open_connection("127.0.0.1", proxy.ports[0])
        again_w.write(b"POST /v3/watch HTTP/1.1\r\n")
        await again_w.drain()
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(again_r.read(), 5) == b""
        for w in (call_w, watch_w, again_w):
            with contextlib.suppress(OSError, ValueError):
                w.close()


async def test_loses_a_share_of_the_answers_after_the_request_went_through() -> None:
    async with echo_server() as port, TcpProxy([port]) as proxy:
        proxy.lose_answers(1.0)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.ports[0])
        writer.write(b"POST /v3/kv/txn HTTP/1.1\r\n")
        await writer.drain()
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), 5) == b""
        assert proxy.lost_answers == 1
        proxy.heal()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.ports[0])
        assert await roundtrip(reader, writer, b"answered") == b"answered"
        writer.close()
