"""An upstream that is not an eds-server, for a relay to refuse: on 127.0.0.1, either an HTTP/2 server
that answers every gRPC call with a stream of junk messages (empty ones, random bytes, a valid
message of another type), or a server that answers a connection with random bytes (not HTTP/2).

Bounded: each stream sends at most `most` messages, `every` seconds apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import AsyncIterator

import h2.config
import h2.connection
import h2.events

from eds_server.protowire import string_field
from tests.support.ports import free_port

# a well-formed delta response of another type (CDS), with a nonce
OTHER_TYPE = string_field(4, "type.googleapis.com/envoy.config.cluster.v3.Cluster") + string_field(5, "1")


def _message(i: int) -> bytes:
    body = (b"", os.urandom(24), OTHER_TYPE)[i % 3]
    return b"\x00" + struct.pack(">I", len(body)) + body


class JunkUpstream:
    """`random_bytes`: answer each connection with random bytes instead of HTTP/2."""

    def __init__(self, *, random_bytes: bool = False, most: int = 2000, every: float = 0.01) -> None:
        self.random_bytes, self.most, self.every = random_bytes, most, every
        self.port = free_port()
        self.connections = 0
        self.sent = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> JunkUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.random_bytes:
                for _ in range(20):
                    writer.write(os.urandom(512))
                    await writer.drain()
                    await asyncio.sleep(0.05)
                return
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            conn.initiate_connection()
            writer.write(conn.data_to_send())
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        task = asyncio.create_task(self._stream(conn, writer, event.stream_id))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                    elif isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                writer.write(conn.data_to_send())
                await writer.drain()
        except (OSError, h2.exceptions.ProtocolError):
            pass
        finally:
            with contextlib.suppress(OSError):
                writer.close()

    async def _stream(self, conn: h2.connection.H2Connection, writer: asyncio.StreamWriter, stream_id: int) -> None:
        with contextlib.suppress(Exception):
            conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
            for i in range(self.most):
                conn.send_data(stream_id, _message(i))
                writer.write(conn.data_to_send())
                await writer.drain()
                self.sent += 1
                await asyncio.sleep(self.every)


@contextlib.asynccontextmanager
async def junk_upstream(**kwargs: object) -> AsyncIterator[JunkUpstream]:
    async with JunkUpstream(**kwargs) as junk:  # type: ignore[arg-type]
        yield junk
