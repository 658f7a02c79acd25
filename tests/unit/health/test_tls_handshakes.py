"""A cold start with many HTTPS endpoints, all up, against real TLS servers on 127.0.0.1: no endpoint
is marked unhealthy. Without a bound on TLS handshakes in flight, hundreds of them interleave on one
loop (the backends' side in this process too), finish late together and time out: the checker's
congestion, counted as the backends' failures. The endpoints are many, the listening sockets few:
each endpoint's check names one of them (`port:`), so each is a target with its own connection."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import pytest

from eds_server.encode import encode_group
from eds_server.health import keepalive
from eds_server.health.checker import Checker
from eds_server.health.spec import HealthSpec
from eds_server.model import Endpoint, Group
from eds_server.store import Store
from tests.support.tls import CertAuthority, Issued
from tests.support.waiting import wait_for

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
ENDPOINTS = 600
LISTENERS = 4
ROUNDS = 3  # checks of every endpoint waited for (the first is the cold start)


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Issued:
    where = tmp_path_factory.mktemp("tls")
    return CertAuthority("backend CA", where).issue(where / "backend", dns=["backend.internal"])


def server_context(cert: Issued) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert.cert, cert.key)
    return context


async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One check answered, then the connection held until the checker closes it."""
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK)
        await writer.drain()
        await reader.read(1)
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


@pytest.mark.alone  # the backends' handshakes share this loop: a timeout of 1 s with the CPU shared is not one
async def test_a_cold_start_of_many_https_endpoints_marks_none_unhealthy(cert: Issued) -> None:
    context = server_context(cert)
    connections: list[asyncio.StreamWriter] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            for _ in range(100):  # bounded: checks on one connection
                await reader.readuntil(b"\r\n\r\n")
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    servers = [
        await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context, backlog=ENDPOINTS) for _ in range(LISTENERS)
    ]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    # thresholds 1: the first failure would mark its endpoint (the harshest case for a cold start)
    specs = [
        HealthSpec("http", path="/health", port=p, interval=0.5, timeout=1.0, unhealthy_threshold=1, tls=True)
        for p in ports
    ]
    # endpoints' own ports are never contacted: each check goes to its spec's port
    eps = tuple(Endpoint("127.0.0.1", 1024 + i, check=specs[i % LISTENERS]) for i in range(ENDPOINTS))
    store = Store(encode_group)
    store.add_source("file")
    checker = Checker(store)
    store.update("file", {"web": Group("web", eps)})

    def counted() -> int:
        """Checks counted (passed or failed; "starved" ones were never sent), once every endpoint has one."""
        if checker.by_health()["unchecked"]:
            return 0
        return checker.checks[("http", "pass")] + checker.checks[("http", "fail")]

    stop = asyncio.Event()
    task = asyncio.create_task(checker.run(stop))
    try:
        await wait_for(counted, lambda n: n >= ROUNDS * ENDPOINTS, timeout=120, interval=0.1)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        for s in servers:
            s.close()
    kept = checker.connections
    assert checker.by_health() == {"healthy": ENDPOINTS}
    assert checker.changes == ENDPOINTS  # each from unchecked to healthy once, never unhealthy
    assert checker.checks[("http", "fail")] == 0, dict(checker.checks)
    # one handshake per endpoint, on both sides: every later check went on its kept connection
    assert kept.handshakes == ENDPOINTS == context.session_stats()["accept_good"]
    assert kept.counts[("https", "opened")] == ENDPOINTS
    # the bound was reached (a real stampede) and held
    assert kept.handshakes_peak == keepalive.MAX_HANDSHAKES
    assert kept.slot_waits > 0
    assert kept.handshaking == 0


@pytest.fixture
async def good_and_mute(cert: Issued) -> AsyncIterator[tuple[int, int]]:
    """Two TLS backends' ports: one that answers a check once, one that accepts and never answers a
    ClientHello (a check to it holds its handshake slot until its timeout)."""
    hung: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)

    good = await asyncio.start_server(answer_once, "127.0.0.1", 0, ssl=server_context(cert))
    mute = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        yield good.sockets[0].getsockname()[1], mute.sockets[0].getsockname()[1]
    finally:
        for w in hung:
            w.close()
        for server in (good, mute):
            server.close()


async def test_the_wait_for_a_slot_is_not_the_backends_and_no_slot_in_an_interval_is_no_check(
    good_and_mute: tuple[int, int],
) -> None:
    good_port, mute_port = good_and_mute
    spec = HealthSpec("http", path="/health", interval=5.0, timeout=0.3, tls=True)
    slow = HealthSpec("http", path="/health", interval=5.0, timeout=0.6, tls=True)  # holds its slot longer
    pool = keepalive.KeptConnections(max_handshakes=1, slot_wait=0.0)  # a wait of one interval at most
    try:
        holder = asyncio.create_task(pool.check("127.0.0.1", mute_port, slow))
        await wait_for(lambda: pool.handshaking, timeout=5)
        # connected, then waits longer than its own timeout for the slot: that starts after
        waiter = asyncio.create_task(pool.check("127.0.0.1", good_port, spec))
        held = await holder
        assert (held.ok, held.reason, held.starved) == (False, "timed out after 0.6s", False)
        passed = await waiter
        assert (passed.ok, passed.reason, passed.starved) == (True, "HTTP 200", False)
        assert (pool.slot_waits, pool.handshakes_peak, pool.handshakes) == (1, 1, 1)

        # a slot not free within the check's interval: not sent, not a failure of the backend
        holder = asyncio.create_task(pool.check("127.0.0.1", mute_port, slow))
        await wait_for(lambda: pool.handshaking, timeout=5)
        brief = HealthSpec("http", path="/health", interval=0.1, timeout=0.3, tls=True)
        missed = await pool.check("127.0.0.1", good_port, brief)
        assert not missed.ok and missed.starved and missed.reason.startswith("not sent: no TLS handshake slot")
        assert not (await holder).ok
        assert (pool.slot_waits, pool.handshakes_peak, pool.handshakes, pool.handshaking) == (2, 1, 1, 0)
    finally:
        pool.close()


async def test_an_endpoint_forgotten_while_its_check_waits_for_a_slot_keeps_no_connection(
    good_and_mute: tuple[int, int],
) -> None:
    good_port, mute_port = good_and_mute
    spec = HealthSpec("http", path="/health", interval=5.0, timeout=0.3, tls=True)
    pool = keepalive.KeptConnections(max_handshakes=1)
    try:
        holder = asyncio.create_task(pool.check("127.0.0.1", mute_port, spec))
        await wait_for(lambda: pool.handshaking, timeout=5)
        waiter = asyncio.create_task(pool.check("127.0.0.1", good_port, spec))
        await wait_for(lambda: pool.slot_waits, timeout=5)  # connected, and queued for the slot
        pool.forget(("127.0.0.1", good_port, spec))  # its endpoint leaves meanwhile
        await holder
        assert (await waiter).ok  # the check still ends as checks do
        assert pool.idle == 0  # and its connection is not kept
    finally:
        pool.close()
