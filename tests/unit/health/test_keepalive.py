"""Kept HTTP and HTTPS check connections against real backends on 127.0.0.1 (and ::1) that count the
connections they accept and, over TLS, the handshakes they complete: one connection (one handshake)
for repeated checks, a new one whenever the answer forbids reuse (with the check's result as without
keep-alive), the same bounds over TLS, the budget, and nothing left open when a target goes or the
checker stops."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from eds_server.encode import encode_group
from eds_server.health import keepalive, probes
from eds_server.health.checker import Checker
from eds_server.health.keepalive import KeptConnections
from eds_server.health.spec import HealthSpec
from eds_server.health.tracker import Result
from eds_server.metrics import HealthChecks
from eds_server.model import Endpoint, Group
from eds_server.store import Store
from tests.support.tls import CertAuthority, Issued
from tests.support.waiting import wait_for

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
SPEC = HealthSpec("http", path="/health", interval=1.0, timeout=0.5)


Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


class Backend:
    """Answers each request on a connection with `answers[i]` (the last one repeated), up to 50
    requests a connection; counts accepted connections and those the checker closed (EOF)."""

    def __init__(self, *answers: bytes | Answer, close: bool = False) -> None:
        self.answers = answers
        self.close = close  # close after each answer
        self.accepted = 0
        self.ended = 0  # connections that saw EOF or a reset from the checker
        self.requests = 0
        self.finished = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            for i in range(50):  # bounded: requests on one connection
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"GET /health HTTP/1.1\r\n")
                self.requests += 1
                answer = self.answers[min(i, len(self.answers) - 1)]
                if isinstance(answer, bytes):
                    writer.write(answer)
                    await writer.drain()
                else:
                    await answer(writer)
                if self.close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            self.ended += 1
        finally:
            writer.close()
            self.finished += 1


class TLS:
    """A backend's TLS side: a fresh server context that counts its completed handshakes and records
    the server name (SNI) each client sent (None: none)."""

    def __init__(self, cert: Issued) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert.cert, cert.key)
        self.names: list[str | None] = []
        self.context.sni_callback = lambda _sock, name, _ctx: self.names.append(name)

    @property
    def handshakes(self) -> int:
        return int(self.context.session_stats()["accept_good"])


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Issued:
    where = tmp_path_factory.mktemp("tls")
    return CertAuthority("backend CA", where).issue(where / "backend", dns=["backend.internal"])  # no IP, as usual


@pytest.fixture(params=["http", "https"])
def tls(request: pytest.FixtureRequest, cert: Issued) -> TLS | None:
    """Each test so marked runs against a plain backend and again against the same one over TLS."""
    return TLS(cert) if request.param == "https" else None


def over(tls: TLS | None, spec: HealthSpec = SPEC) -> HealthSpec:
    return dataclasses.replace(spec, tls=tls is not None)


@asynccontextmanager
async def serving(backend: Backend, tls: TLS | None = None, host: str = "127.0.0.1") -> AsyncIterator[int]:
    server = await asyncio.start_server(backend.handle, host, 0, ssl=tls.context if tls else None)
    handshakes = tls.handshakes if tls else 0
    try:
        yield server.sockets[0].getsockname()[1]
        await wait_for(lambda: backend.finished == backend.accepted, timeout=5)  # nothing left open
    finally:
        server.close()
    if tls is not None:
        assert tls.handshakes - handshakes == backend.accepted  # a connection, a handshake: none on a kept one


@pytest.fixture(params=["awaited", "callbacks"])
def way(request: pytest.FixtureRequest) -> str:
    """How a check on a kept connection runs: awaited (KeptConnections.check, in a task) or driven by
    callbacks (KeptConnections.start, as the checker runs it); the same results, counts and bounds."""
    return str(request.param)


async def one(pool: KeptConnections, host: str, port: int, spec: HealthSpec, way: str = "awaited") -> Result:
    """A check as `way` runs it: by callbacks when the target has a kept connection, else awaited (as
    the checker does), and a callback-driven check's fresh retry awaited as the checker awaits it."""
    loop = asyncio.get_running_loop()
    if way == "awaited":
        return await pool.check(host, port, spec)
    outcome: asyncio.Future[keepalive.Outcome] = loop.create_future()
    if not pool.start(loop, (host, port, spec), lambda arg, got: outcome.set_result(got), None):
        return await pool.check(host, port, spec)
    got = await asyncio.wait_for(outcome, spec.timeout + 5)  # bounded: a check whose timeout never fires fails
    return got if isinstance(got, Result) else await got


async def checks(
    pool: KeptConnections, port: int, n: int, spec: HealthSpec = SPEC, host: str = "127.0.0.1", way: str = "awaited"
) -> list[str]:
    results = [await one(pool, host, port, spec, way) for _ in range(n)]
    return [("pass " if r.ok else "fail ") + r.reason for r in results]


async def test_repeated_checks_use_one_connection(tls: TLS | None, way: str) -> None:
    chunked = b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n4;x=y\r\nbusy\r\n2\r\nno\r\n0\r\nA: b\r\n\r\n"
    kind = "https" if tls else "http"
    for answers in ((OK,), (OK, chunked, b"HTTP/1.1 204 No Content\r\n\r\n", OK)):
        backend = Backend(*answers)
        pool = KeptConnections(budget_=10)
        async with serving(backend, tls) as port:
            got = await checks(pool, port, 5, over(tls), way=way)
            assert backend.accepted == 1 and backend.requests == 5, got
            assert pool.counts == {(kind, "opened"): 1, (kind, "reused"): 4} and pool.idle_by_kind() == Counter(
                {kind: 1}
            )
            pool.close()
        if len(answers) > 1:
            assert got == ["pass HTTP 200", "fail HTTP 503", "pass HTTP 204", "pass HTTP 200", "pass HTTP 200"]


async def test_answers_that_forbid_reuse_get_a_new_connection_and_still_pass(tls: TLS | None, way: str) -> None:
    for backend in (
        Backend(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", close=True),
        Backend(b"HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 2\r\n\r\nok"),  # the checker closes it
        Backend(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"),  # 1.0 without keep-alive
        Backend(b"HTTP/1.1 200 OK\r\n\r\nuntil close"),  # no length: read until close
    ):
        pool = KeptConnections(budget_=10)
        async with serving(backend, tls) as port:
            assert await checks(pool, port, 3, over(tls), way=way) == ["pass HTTP 200"] * 3
            assert backend.accepted == 3 and pool.reused == 0 and pool.idle == 0
    keep10 = Backend(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok")
    pool = KeptConnections(budget_=10)
    async with serving(keep10, tls) as port:
        assert await checks(pool, port, 3, over(tls), way=way) == ["pass HTTP 200"] * 3
        assert keep10.accepted == 1
        pool.close()


async def test_huge_malformed_and_extra_answers_as_before_and_not_reused(tls: TLS | None, way: str) -> None:
    big = keepalive.MAX_BODY + 1
    cases = {
        "huge body": (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % big + b"x" * big, "pass HTTP 200"),
        "huge chunk": (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % big + b"x" * big,
            "pass HTTP 200",
        ),
        "bad header": (b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 2\r\n\r\nok", "pass HTTP 200"),
        "bad length": (b"HTTP/1.1 500 No\r\nContent-Length: 2x\r\n\r\nok", "fail HTTP 500"),
        "bad chunk": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "pass HTTP 200"),
        "two framings": (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
            "pass HTTP 200",
        ),
        "extra bytes": (OK + b"HTTP/1.1 200 OK\r\n", "pass HTTP 200"),
        "long head": (b"HTTP/1.1 200 OK\r\nX: " + b"y" * keepalive.MAX_HEAD + b"\r\n\r\n", "pass HTTP 200"),
        "not HTTP": (b"SSH-2.0-OpenSSH\r\n", "fail ValueError: not an HTTP status line: b'SSH-2.0-OpenSSH\\r\\n'"),
        "endless line": (b"HTTP/1.1 200 " + b"x" * (2 * keepalive.MAX_HEAD), "fail status line longer than 8192 bytes"),
        "interim": (b"HTTP/1.1 100 Continue\r\n\r\n" + OK, "fail HTTP 100"),
    }
    for name, (answer, result) in cases.items():
        backend = Backend(answer)
        pool = KeptConnections(budget_=10)
        async with serving(backend, tls) as port:
            assert await checks(pool, port, 2, over(tls), way=way) == [result] * 2, name
            assert backend.accepted == 2 and pool.reused == 0 and pool.idle == 0, name
    for name, (answer, result) in cases.items():  # the same on a kept connection: read, then closed
        backend = Backend(OK, answer, OK)
        pool = KeptConnections(budget_=10)
        async with serving(backend, tls) as port:
            got = await checks(pool, port, 3, over(tls), way=way)
            assert got == ["pass HTTP 200", result, "pass HTTP 200"], name
            assert backend.accepted == 2 and pool.reused == 1 and pool.idle == 1, name
            pool.close()


async def test_a_dripping_answer_costs_one_timeout_and_its_connection(tls: TLS | None, way: str) -> None:
    async def drip(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        for _ in range(30):  # bounded: 3 s at most
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.1)

    async def drip_head(writer: asyncio.StreamWriter) -> None:
        for _ in range(30):
            writer.write(b"H")
            await writer.drain()
            await asyncio.sleep(0.1)

    # over TLS a fresh connection's timeout covers a handshake too: 1 s leaves room on a busy host
    spec = HealthSpec("http", path="/health", interval=1.0, timeout=1.0 if tls else 0.3, tls=tls is not None)
    for answer, result in ((drip, "pass HTTP 200"), (drip_head, f"fail timed out after {spec.timeout:g}s")):
        backend = Backend(OK, answer, OK)
        pool = KeptConnections(budget_=10)
        async with serving(backend, tls) as port:
            assert await checks(pool, port, 3, spec, way=way) == ["pass HTTP 200", result, "pass HTTP 200"]
            assert backend.accepted == 2 and pool.reused == 1  # the slow answer's connection was closed
            pool.close()


async def test_a_kept_connection_closed_by_the_backend_is_retried_fresh(tls: TLS | None, way: str) -> None:
    async def hang_up(writer: asyncio.StreamWriter) -> None:
        writer.close()  # the request lands as the backend closes its idle connection

    backend = Backend(OK, hang_up)  # every second request on a connection is hung up on
    pool = KeptConnections(budget_=10)
    async with serving(backend, tls) as port:
        assert await checks(pool, port, 3, over(tls), way=way) == ["pass HTTP 200"] * 3
        assert backend.accepted == 3 and backend.requests == 5 and pool.reused == 0
        pool.close()


async def test_budget_closes_the_least_recently_used_when_it_is_needed_later() -> None:
    slow = HealthSpec("http", path="/health", interval=60.0, timeout=0.5)
    fast = HealthSpec("http", path="/health", interval=0.1, timeout=0.5)
    a, b = Backend(OK), Backend(OK)
    pool = KeptConnections(budget_=1)
    async with serving(a) as port_a, serving(b) as port_b:
        await checks(pool, port_a, 1, slow)
        await checks(pool, port_b, 1, fast)  # a's connection, unused for 60 s, makes room
        await wait_for(lambda: a.ended, timeout=5)
        assert pool.idle == 1 and pool.evicted == 1
        await checks(pool, port_b, 1, fast)
        await checks(pool, port_a, 1, slow)  # needed later than b's: not kept, b's stays
        await checks(pool, port_b, 1, fast)
        assert (a.accepted, b.accepted, pool.evicted) == (2, 1, 2)
        assert await checks(pool, port_a, 1, slow) == ["pass HTTP 200"]  # beyond the budget: fresh, as before
        assert a.accepted == 3
        pool.close()
    assert keepalive.budget(0) <= keepalive.MAX_KEPT
    soft = os.sysconf("SC_OPEN_MAX")
    assert keepalive.budget(soft) == 0  # nothing left past the gRPC port's share: nothing kept


async def test_kept_tls_connections_stop_at_their_memory_bound_and_plain_ones_do_not(cert: Issued) -> None:
    tls_a, tls_b = TLS(cert), TLS(cert)
    a, b, plain = Backend(OK), Backend(OK), Backend(OK)
    slow = HealthSpec("http", path="/health", interval=60.0, timeout=0.5, tls=True)
    fast = dataclasses.replace(slow, interval=0.1)
    pool = KeptConnections(budget_=10, tls_budget_=1)
    async with serving(a, tls_a) as port_a, serving(b, tls_b) as port_b, serving(plain) as port_p:
        await checks(pool, port_a, 1, slow)
        await checks(pool, port_b, 1, fast)  # at the bound: a's, unused for 60 s, makes room
        await wait_for(lambda: a.ended, timeout=5)
        await checks(pool, port_a, 2, slow)  # needed later than b's: not kept, b's stays
        await checks(pool, port_p, 3)  # plain ones keep to the descriptor budget alone
        await checks(pool, port_b, 2, fast)
        assert (a.accepted, b.accepted, plain.accepted) == (3, 1, 1)
        assert (tls_a.handshakes, tls_b.handshakes) == (3, 1)
        assert pool.idle_by_kind() == Counter({"http": 1, "https": 1}) and pool.counts[("https", "evicted")] == 3
        pool.close()
    assert keepalive.tls_budget(1 << 30) == int((1 << 30) * keepalive.TLS_MEMORY_SHARE) // keepalive.TLS_CONN_BYTES
    assert keepalive.tls_budget(0) == keepalive.MAX_KEPT  # no limit known: the descriptor budget alone


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_the_checker_closes_connections_of_endpoints_that_leave_and_when_it_stops() -> None:
    backends = [Backend(OK) for _ in range(3)]
    spec = HealthSpec("http", path="/health", interval=0.1, timeout=0.5)
    async with serving(backends[0]) as p0, serving(backends[1]) as p1, serving(backends[2]) as p2:
        before = fds()
        store = Store(encode_group)
        store.add_source("file")
        checker = Checker(store)
        group = Group("web", tuple(Endpoint("127.0.0.1", p, check=spec) for p in (p0, p1, p2)))
        store.update("file", {"web": group})
        stop = asyncio.Event()
        task = asyncio.create_task(checker.run(stop))
        await wait_for(lambda: [b.requests for b in backends], lambda r: min(r) >= 3, timeout=10)
        assert [b.accepted for b in backends] == [1, 1, 1]
        store.update("file", {"web": Group("web", group.endpoints[1:])})  # p0 leaves
        await wait_for(lambda: backends[0].ended, timeout=5)
        edited = dataclasses.replace(spec, interval=0.2)  # the same endpoint, its check edited
        store.update("file", {"web": Group("web", (group.endpoints[1], Endpoint("127.0.0.1", p2, check=edited)))})
        await wait_for(lambda: backends[2].ended, timeout=5)
        stop.set()
        await asyncio.wait_for(task, 5)
        await wait_for(lambda: backends[1].ended, timeout=5)
        await wait_for(fds, lambda n: n == before, timeout=5)
        assert checker.connections.idle == 0


async def test_the_checker_runs_checks_on_kept_connections_by_callbacks_within_max_running() -> None:
    """The checker's own probe: a check on a kept connection starts no task; `max_running` still
    bounds checks in flight, callback-driven or not; a check in flight when the checker stops ends
    with nothing counted and its connection closed."""
    in_flight = [0, 0]  # now, at most
    release = asyncio.Event()

    async def slow(writer: asyncio.StreamWriter) -> None:
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), 0.1)  # bounded: held until released, or 0.1 s
        in_flight[0] -= 1
        writer.write(OK)
        await writer.drain()

    backends = [Backend(OK, slow) for _ in range(3)]
    spec = HealthSpec("http", path="/health", interval=0.1, timeout=1.0)
    async with serving(backends[0]) as p0, serving(backends[1]) as p1, serving(backends[2]) as p2:
        before = fds()
        store = Store(encode_group)
        store.add_source("file")
        checker = Checker(store, max_running=1)
        spawned = [0]
        spawn = checker._spawn

        def counted(*args: object) -> None:
            spawned[0] += 1
            spawn(*args)  # type: ignore[arg-type]

        checker._spawn = counted  # type: ignore[method-assign]
        store.update("file", {"web": Group("web", tuple(Endpoint("127.0.0.1", p, check=spec) for p in (p0, p1, p2)))})
        stop = asyncio.Event()
        task = asyncio.create_task(checker.run(stop))
        await wait_for(lambda: [b.requests for b in backends], lambda r: min(r) >= 4, timeout=20)
        assert in_flight[1] == 1  # never two checks at once, kept connections or not
        assert spawned[0] == 3 and [b.accepted for b in backends] == [1, 1, 1]  # a task for each first check only
        await wait_for(lambda: in_flight[0], timeout=5)  # a check in flight on a kept connection
        counted_before = sum(checker.checks.values())
        stop.set()
        await asyncio.wait_for(task, 5)
        release.set()
        await wait_for(lambda: sum(b.ended for b in backends), lambda n: n == 3, timeout=5)
        await wait_for(fds, lambda n: n == before, timeout=5)
        assert sum(checker.checks.values()) == counted_before and checker._running == 0  # ended, not counted
        assert checker.connections.idle == 0 and checker.checks[("http", "fail")] == 0


async def test_the_checker_retries_a_kept_connection_found_closed_fresh_in_a_task() -> None:
    async def hang_up(writer: asyncio.StreamWriter) -> None:
        writer.close()  # the request lands as the backend closes its idle connection

    backend = Backend(OK, hang_up)  # every second request on a connection is hung up on
    spec = HealthSpec("http", path="/health", interval=0.1, timeout=0.5)
    async with serving(backend) as port:
        store = Store(encode_group)
        store.add_source("file")
        checker = Checker(store)
        store.update("file", {"web": Group("web", (Endpoint("127.0.0.1", port, check=spec),))})
        stop = asyncio.Event()
        task = asyncio.create_task(checker.run(stop))
        await wait_for(lambda: checker.checks[("http", "pass")], lambda n: n >= 5, timeout=10)
        stop.set()
        await asyncio.wait_for(task, 5)
    assert checker.checks[("http", "fail")] == 0 and backend.accepted >= 4  # each retry on a fresh one
    assert checker.connections.reused == 0 and checker._running == 0


async def test_a_bug_in_starting_a_check_by_callbacks_is_a_failed_check_not_the_end_of_checking() -> None:
    store = Store(encode_group)
    store.add_source("file")
    checker = Checker(store)

    def broken(*args: object) -> bool:
        raise RuntimeError("a bug")

    checker.connections.start = broken  # type: ignore[method-assign]
    spec = HealthSpec("http", path="/health", interval=0.1, timeout=0.5, unhealthy_threshold=1)
    store.update("file", {"web": Group("web", (Endpoint("127.0.0.1", 9, check=spec),))})
    stop = asyncio.Event()
    task = asyncio.create_task(checker.run(stop))
    await wait_for(lambda: checker.checks[("http", "fail")], lambda n: n >= 3, timeout=10)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert checker.last_check("127.0.0.1", 9, spec)["reason"] == "internal error: RuntimeError"  # type: ignore[index]
    assert checker._running == 0 and checker.by_health() == Counter({"unhealthy": 1})


async def test_an_aiohttp_backend_over_ipv4_and_ipv6_keeps_one_connection() -> None:
    transports: set[int] = set()

    async def handle(request: web.Request) -> web.StreamResponse:
        transports.add(id(request.transport))
        if request.path == "/chunked":
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            await response.write(b"ok")
            await response.write_eof()
            return response
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    pool = KeptConnections(budget_=10)
    try:
        for host in ("127.0.0.1", "::1"):
            site = web.TCPSite(runner, host, 0)
            await site.start()
            port = int(runner.addresses[-1][1])
            transports.clear()
            for path in ("/health", "/chunked"):
                spec = HealthSpec("http", path=path, interval=1.0, timeout=0.5)
                results = [await pool.check(host, port, spec) for _ in range(3)]
                assert [r.reason for r in results if r.ok] == ["HTTP 200"] * 3, results
            assert len(transports) == 2, host  # one connection per target (path), each reused
    finally:
        pool.close()
        await runner.cleanup()


async def test_https_over_ipv4_and_ipv6_keeps_one_tls_connection_and_sends_no_server_name(cert: Issued) -> None:
    for host in ("127.0.0.1", "::1"):
        tls = TLS(cert)
        backend = Backend(OK)
        pool = KeptConnections(budget_=10)
        async with serving(backend, tls, host) as port:
            assert await checks(pool, port, 6, over(tls), host) == ["pass HTTP 200"] * 6, host
            assert (backend.accepted, tls.handshakes, backend.requests) == (1, 1, 6), host
            assert pool.counts == {("https", "opened"): 1, ("https", "reused"): 5}, host
            fresh = await probes.check(host, port, over(tls))  # a check without keep-alive, as before
            assert fresh.ok and backend.accepted == 2, fresh
            assert tls.names == [None, None], host  # an IP is no server name: none sent, kept or not
            pool.close()


async def test_the_metrics_count_connections_opened_and_reused_and_those_kept_by_kind(cert: Issued) -> None:
    plain, secure, tls = Backend(OK), Backend(OK), TLS(cert)
    spec = HealthSpec("http", path="/health", interval=0.1, timeout=0.5)
    async with serving(plain) as p, serving(secure, tls) as s:
        store = Store(encode_group)
        store.add_source("file")
        checker = Checker(store)
        registry = CollectorRegistry()
        registry.register(HealthChecks(checker))
        eps = (Endpoint("127.0.0.1", p, check=spec), Endpoint("127.0.0.1", s, check=over(tls, spec)))
        store.update("file", {"web": Group("web", eps)})
        stop = asyncio.Event()
        task = asyncio.create_task(checker.run(stop))
        await wait_for(lambda: (plain.requests, secure.requests), lambda r: min(r) >= 4, timeout=10)
        kept = ['eds_health_kept_connections{kind="http"} 1.0', 'eds_health_kept_connections{kind="https"} 1.0']
        scrape = lambda: generate_latest(registry).decode()  # noqa: E731
        text = await wait_for(scrape, lambda t: all(k in t for k in kept), timeout=5)
        stop.set()
        await asyncio.wait_for(task, 5)
    assert "eds_health_tls_handshakes 0.0" in text and "eds_health_tls_handshake_waits_total 0.0" in text
    for kind in ("http", "https"):
        assert f'eds_health_connections_total{{how="opened",kind="{kind}"}} 1.0' in text
        assert f'eds_health_connections_total{{how="evicted",kind="{kind}"}} 0.0' in text
    reused = {kind: checker.connections.counts[(kind, "reused")] for kind in ("http", "https")}
    assert min(reused.values()) >= 3 and (plain.accepted, secure.accepted, tls.handshakes) == (1, 1, 1), reused


class _Waiting:
    """What _Expiry reads of a check in flight: its deadline and whether it was answered."""

    def __init__(self, deadline: float, finished: bool) -> None:
        self.deadline = deadline
        self.finished = finished
        self.expired_at: float | None = None

    def done(self) -> bool:
        return self.finished

    def set_exception(self, exception: BaseException) -> None:
        assert isinstance(exception, TimeoutError) and not self.finished
        self.finished = True
        self.expired_at = asyncio.get_running_loop().time()


async def test_one_timer_expires_each_unanswered_check_at_its_own_deadline_and_no_answered_one() -> None:
    loop = asyncio.get_running_loop()
    expiry = keepalive._Expiry(loop)
    base = loop.time()
    waiting = [_Waiting(base + 0.05 * i, finished=False) for i in range(1, 8)]
    for w in waiting:
        expiry.add(w)  # type: ignore[arg-type]
    for w in waiting[1::2]:
        w.finished = True  # 2, 4, 6: answered in time
    await wait_for(lambda: all(w.finished for w in waiting), timeout=5)
    assert [i for i, w in enumerate(waiting, 1) if w.expired_at is not None] == [1, 3, 5, 7]
    for w in waiting:
        assert w.expired_at is None or w.expired_at >= w.deadline - keepalive.TIMER_SLACK  # never before its own
    await wait_for(lambda: not expiry.queue and expiry.timer is None, timeout=5)  # all gone, no timer left
    expiry.add(_Waiting(loop.time() + 60, finished=False))  # type: ignore[arg-type]
    expiry.close()
    assert expiry.timer is None and not expiry.queue
