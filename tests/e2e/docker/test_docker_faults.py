"""The Docker source when the connection to a healthy engine is cut, or goes silent (half-open).

A TCP proxy on 127.0.0.1 sits between the source and the engine's socket, so the engine stays up
while the test cuts or freezes what flows between them: all of it, or only the event stream's
connection (the pings, on other pooled connections, still go through).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
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


@dataclass
class EventConnection:
    ends: tuple[asyncio.StreamWriter, asyncio.StreamWriter]  # to the source, to the engine
    frozen: bool = False


class Proxy:
    """127.0.0.1:port <-> the engine's unix socket; `cut()` closes every connection, `frozen` stalls them,
    `freeze_events()` stalls only the connections that carry an event stream now."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.frozen = False
        self.writers: list[asyncio.StreamWriter] = []
        self.event_connections: list[EventConnection] = []  # the connections that asked for events
        self.event_requests = 0  # requests for events seen (a renewal asks again)
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
        events = EventConnection((writer, up_writer))  # listed once it asks for events

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, ask: bool) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(65536):
                    if ask and b"/events?" in data:
                        self.event_requests += 1
                        if events not in self.event_connections:
                            self.event_connections.append(events)
                    for _ in range(100_000):  # a half-open connection: nothing gets through, nothing closes
                        if not (self.frozen or events.frozen) or writer.is_closing() or up_writer.is_closing():
                            break
                        await asyncio.sleep(0.05)
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

    def freeze_events(self) -> int:
        """Stall (both ways, kept open) each connection that carries an event stream now, and only
        those, for good; returns how many."""
        live = [c for c in self.event_connections if not c.frozen and not c.ends[0].is_closing()]
        for c in live:
            c.frozen = True
        return len(live)

    def live_events(self) -> list[EventConnection]:
        return [c for c in self.event_connections if not c.ends[0].is_closing()]

    def cut_events(self) -> int:
        """Close each connection that carries an event stream now, and only those; returns how many."""
        live = self.live_events()
        for c in live:
            for w in c.ends:
                w.close()
        return len(live)

    def cut(self) -> None:
        for w in self.writers:
            w.close()
        self.writers.clear()


@pytest.fixture
async def following(docker_cleanup: DockerEngine) -> AsyncIterator[tuple[DockerEngine, Proxy, DockerSource, Store]]:
    async with Proxy(str(docker_cleanup.socket_path)) as proxy:
        store = Store(encode_group)
        source = alone(
            DockerSource,
            store,
            DockerOptions(),
            host=f"tcp://127.0.0.1:{proxy.port}",
            ping_interval=0.5,
            request_timeout=1.0,
        )
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

    await wait_for(
        seen,
        lambda s: s[:2] == (True, want),
        timeout=timeout,
        interval=0.05,
        what=f"ports {want} (last observed: ready, ports, stale)",
    )


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


async def test_a_dead_event_connection_is_replaced_while_the_pings_go_through(
    following: tuple[DockerEngine, Proxy, DockerSource, Store],
) -> None:
    """Only the event stream's connection goes silent: the engine answers every ping on its other
    connections, so the heartbeat has nothing to find. The subscription is renewed (from the last
    event's engine time) within the heartbeat's bound, so a container started after the freeze is
    served without waiting for the resync (60 s) and without the source ever being marked stale."""
    engine, proxy, source, store = following
    first = await backend(engine, "dead-1")
    await ports(store, {first})
    events, heartbeat = source.events, source.heartbeat
    assert events is not None and heartbeat is not None
    relists, renewals, hangs = source.relists, events.renewals, heartbeat.hangs
    assert proxy.freeze_events() == 1  # the one event stream; the pings' connections still flow
    second = await backend(engine, "dead-2")  # its events are held on the frozen connection
    # The bound is 0.5 + 2 * 2 = 4.5 s here; waited up to 25 s, still short of the 60 s resync.
    await ports(store, {first, second}, timeout=25)
    assert source.connected and not store.is_stale("web")  # no hang found, no reconnect: only a renewal
    assert (source.events, source.heartbeat) == (events, heartbeat)  # the same connection's
    assert heartbeat.hangs == hangs and source.relists == relists  # neither a hang nor a resync found it
    assert events.renewals > renewals and events.reopened == 0  # a renewal (on a new connection) did
    assert len(proxy.event_connections) >= 2


async def test_a_renewed_event_stream_that_fails_keeps_the_source_live(
    following: tuple[DockerEngine, Proxy, DockerSource, Store],
) -> None:
    """The event connection is closed under a renewed subscription while the engine answers: the
    stream is opened afresh and the containers listed again, and the source is never said stale."""
    engine, proxy, source, store = following
    first = await backend(engine, "renew-1")
    await ports(store, {first})
    events = source.events
    assert events is not None
    await wait_for(lambda: events.renewals, lambda n: n >= 1, timeout=20, interval=0.05, what="a renewal")
    # The renewed subscription's request has reached the engine, and the old one's connection is
    # closed: on a busy host either may come a while after the renewal is counted.
    await wait_for(
        lambda: (proxy.event_requests, len(proxy.live_events())),
        lambda seen: seen[0] >= 2 and seen[1] == 1,
        timeout=10,
        interval=0.05,
        what="the renewed event stream alone",
    )
    relists, stale_seen = source.relists, 0

    async def watch_stale() -> None:
        nonlocal stale_seen
        for _ in range(2000):  # at most 2000 looks, 10 ms apart
            stale_seen += store.is_stale("web") or not source.connected
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch_stale())
    try:
        assert proxy.cut_events() == 1
        second = await backend(engine, "renew-2")
        await ports(store, {first, second})
        await wait_for(lambda: events.reopened, lambda n: n >= 1, timeout=10, interval=0.05, what="reopened")
    finally:
        watcher.cancel()
    assert source.events is events and source.relists > relists  # the same connection's life, listed again
    assert stale_seen == 0
