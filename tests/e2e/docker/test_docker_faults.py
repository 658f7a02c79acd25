"""The Docker source when the connection to a healthy engine is cut, or goes silent (half-open).

A TCP proxy on 127.0.0.1 sits between the source and the engine's socket, so the engine stays up
while the test cuts or freezes what flows between them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eds_server.encode import encode_group
from eds_server.sources.containers import DockerOptions
from eds_server.sources.docker import DockerSource
from eds_server.store import Store
from tests.support.docker_engine import DockerEngine, arun_backend
from tests.support.feeds import alone
from tests.support.ports import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.docker


class Proxy:
    """127.0.0.1:port <-> the engine's unix socket; `cut()` closes every connection, `frozen` stalls them."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.frozen = False
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Proxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(self.socket_path)
        self.writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(65536):
                    while self.frozen:  # a half-open connection: nothing gets through, nothing closes
                        await asyncio.sleep(0.05)
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def cut(self) -> None:
        for w in self.writers:
            w.close()
        self.writers.clear()


@pytest.fixture
async def following(docker_cleanup: DockerEngine) -> AsyncIterator[tuple[DockerEngine, Proxy, DockerSource, Store]]:
    async with Proxy(str(docker_cleanup.socket_path)) as proxy:
        store = Store(encode_group)
        source = alone(DockerSource, store, DockerOptions(), host=f"tcp://127.0.0.1:{proxy.port}",
                              ping_interval=0.5, request_timeout=1.0)  # fmt: skip
        stop = asyncio.Event()
        task = asyncio.create_task(source.run(stop))
        try:
            yield docker_cleanup, proxy, source, store
        finally:
            stop.set()
            proxy.frozen = False
            proxy.cut()
            await asyncio.wait_for(task, 15)


async def ports(store: Store, want: set[int], timeout: float = 15.0) -> None:
    """Until the store serves `want`; on failure it says what it served, and whether stale."""

    def seen() -> tuple[bool, set[int] | None, bool]:
        if not store.ready:
            return False, None, store.is_stale("web")
        return True, {e.port for e in store.get("web").group.endpoints}, store.is_stale("web")

    await wait_for(seen, lambda s: s[:2] == (True, want), timeout=timeout, interval=0.05,
                   what=f"ports {want} (last observed: ready, ports, stale)")  # fmt: skip


async def backend(engine: DockerEngine, name: str) -> int:
    port = free_port()
    await arun_backend(engine, name, port, {"eds.group": "web", "eds.port": str(port)})
    return port


async def test_event_stream_cut_while_the_engine_stays_up(
    following: tuple[DockerEngine, Proxy, DockerSource, Store], tmp_path: Path
) -> None:
    engine, proxy, source, store = following
    first = await backend(engine, "cut-1")
    await ports(store, {first})
    proxy.cut()  # the engine is fine; only our connections are gone
    second = await backend(engine, "cut-2")  # started while the source reconnects
    await ports(store, {first, second})
    assert source.connected


async def test_half_open_connection_is_noticed_and_recovered(
    following: tuple[DockerEngine, Proxy, DockerSource, Store],
) -> None:
    engine, proxy, source, store = following
    first = await backend(engine, "ho-1")
    await ports(store, {first})
    proxy.frozen = True  # nothing flows, nothing closes: only a timeout can tell
    await wait_for(lambda: not source.connected, timeout=10, interval=0.05)  # ping every 0.5 s, 1 s to answer
    assert not source.connected and store.is_stale("web")
    assert {e.port for e in store.get("web").group.endpoints} == {first}  # still served meanwhile
    proxy.frozen = False
    proxy.cut()
    second = await backend(engine, "ho-2")
    await ports(store, {first, second})
    assert source.connected and not store.is_stale("web")
