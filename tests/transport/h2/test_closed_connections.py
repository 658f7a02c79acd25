"""A closed connection leaves nothing of itself behind: its grpclib Handler, protocols, streams and
sessions are freed as it closes, by reference counting alone (the cyclic collector is off while it
closes: a quiet server seldom runs a full collection, so what only that frees stays for good).

And a stream the client resets gives the request data it never read back to the connection's window.

Clients are raw sockets (tests/support/hostile_clients.Conn), so every grpclib and h2 object in the
process is the server's. Runs on either HTTP/2 path (EDS_HTTP2=stock: `make test-stock`).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections import Counter
from typing import Any

import grpclib.protocol
import grpclib.server
import pytest
from h2.connection import H2Connection
from hyperframe.frame import DataFrame, RstStreamFrame

from eds_server.transport.grpc import StreamSession
from eds_server.transport.h2 import ConnectionLimits
from eds_server.transport.h2.stock import GuardedProtocol
from tests.support.grpc_harness import serving
from tests.support.h2frames import DATA, frame
from tests.support.hostile_clients import Conn, Watcher, discovery_request, grpc_message
from tests.support.waiting import wait_for

CONNECTIONS = 20
STREAMS = 10  # per connection, each sending a request
TRACKED = (
    grpclib.server.Handler,
    grpclib.protocol.H2Protocol,
    grpclib.protocol.Stream,
    grpclib.server.Stream,
    H2Connection,
    GuardedProtocol,
    StreamSession,
)


def request_frames(conn: Conn, streams: int) -> bytes:
    request = DataFrame(1, data=grpc_message(discovery_request(("web",), node="n"))).serialize()
    chunks = []
    for _ in range(streams):
        sid, opening = conn.open_stream()
        chunks += [opening, request[:5] + sid.to_bytes(4, "big") + request[9:]]
    return b"".join(chunks)


def tracked(other_than: list[Any] = []) -> list[weakref.ref[Any]]:  # noqa: B006  # read only
    """Weak references to the tracked objects alive now, but `other_than`'s."""
    earlier = {id(o) for o in other_than}
    return [weakref.ref(o) for o in gc.get_objects() if isinstance(o, TRACKED) and id(o) not in earlier]


def alive(refs: list[weakref.ref[Any]]) -> Counter[str]:
    return Counter(type(o).__name__ for r in refs if (o := r()) is not None)


async def test_closed_connections_leave_nothing_behind() -> None:
    gc.collect()
    earlier = [o for o in gc.get_objects() if isinstance(o, TRACKED)]  # another test's, if any
    async with serving(ConnectionLimits()) as (server, service, port):
        conns = [await Conn.open(port, f"127.0.0.{2 + i}") for i in range(CONNECTIONS)]
        for conn in conns:
            await conn.send(request_frames(conn, STREAMS))
        await wait_for(lambda: service.open_streams == CONNECTIONS * STREAMS)
        refs = tracked(earlier)
        held = alive(refs)
        assert held["StreamSession"] == CONNECTIONS * STREAMS, held
        assert held["FastProtocol"] + held["GuardedProtocol"] == CONNECTIONS, held
        gc.disable()
        try:
            for conn in conns:
                conn.close()
            del conns
            await wait_for(lambda: server.connections == 0 and service.open_streams == 0)
            for _ in range(10):  # the calls' tasks end, and their done callbacks run
                await asyncio.sleep(0.01)
            left = alive(refs)
            assert not left, f"kept after their connections closed (of {dict(held)}): {dict(left)}"
        finally:
            gc.enable()


@pytest.mark.parametrize("when", ["with its data", "once its handler waits"])
async def test_a_reset_streams_unread_data_is_given_back_to_the_connection(when: str) -> None:
    """Request data a stream never read, because the client reset it, still used the connection's
    window: it is given back, or a client resetting its streams runs the window dry for every stream
    of the connection. Here streams send part of a message and reset, until they have sent three
    connection windows' worth: each waits for the window the server gives back."""
    announced, chunk = 512 * 1024, 256 * 1024  # a message begun, never finished (max size 1 MiB)
    async with serving(ConnectionLimits()) as (_server, service, port):
        conn = await Conn.open(port, "127.0.0.2")
        watcher = Watcher(conn)
        try:
            # the server's windows, raised (the connection's by WINDOW_UPDATE, the streams' by SETTINGS)
            assert await watcher.wait(lambda: watcher.conn_window > 65535 and watcher.initial_window > chunk, 5)
            target = 3 * watcher.conn_window
            sent = 0
            for _ in range(target // chunk + 1):  # bounded
                if sent >= target:
                    break
                window_back = await watcher.wait(lambda: watcher.window(conn.next_id) >= chunk, 5)
                assert window_back, f"the connection's window ran dry after {sent} bytes on reset streams"
                sid, opening = conn.open_stream()
                body = b"\x00" + announced.to_bytes(4, "big") + b"x" * (chunk - 5)
                data = b"".join(frame(DATA, 0, sid, body[i : i + 16384]) for i in range(0, chunk, 16384))
                reset = RstStreamFrame(sid, error_code=8).serialize()  # CANCEL
                if when == "with its data":
                    await conn.send(opening + data + reset)
                else:
                    await conn.send(opening + data)
                    await wait_for(lambda: service.open_streams == 1, timeout=5)  # its handler reads
                    await conn.send(reset)
                    await wait_for(lambda: service.open_streams == 0, timeout=5)
                watcher.spend(sid, chunk)
                sent += chunk
            assert sent >= target
        finally:
            conn.close()
            watcher.task.cancel()
