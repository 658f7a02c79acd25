"""The Kubernetes source after an outage or a credential rotation, against a small fake API server
on 127.0.0.1 that can go away and come back on the same port, in-process with short probe periods,
so that "sooner than the backoff" is a bounded wait rather than a race. The same behaviour against a
real kube-apiserver is in test_kubernetes_real.py (it needs the binaries).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from eds_server.encode import encode_group
from eds_server.sources.kubernetes import KubernetesSource
from eds_server.sources.kubernetes_api import SLICES, ApiError, Unauthorized, describe, went_away
from eds_server.sources.kubernetes_map import KubernetesOptions
from eds_server.store import Store
from tests.support.fake_kube_api import NS, FakeApiServer, endpoint_slice, kubeconfig, run_process, service
from tests.support.feeds import alone
from tests.support.hung_peer import HUNG_WAIT
from tests.support.waiting import wait_for

REPR = re.compile(r"\b[A-Z]\w*(Error|Exception)\b|<\w+")  # an exception's class name or repr


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer()
    server.put("services", service())
    server.put("endpointslices", endpoint_slice("127.0.0.2"))
    await server.start()
    try:
        yield server
    finally:
        if server._runner is not None:
            await server.stop()


def addresses(store: Store) -> set[str]:
    res = store.resources().get("web")
    return {ep.address for ep in res.group.endpoints} if res else set()


async def until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait (bounded) for `check`; returns how long it took (printed, never asserted on)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    await wait_for(check, timeout=timeout, what=what)
    return loop.time() - start


@contextlib.asynccontextmanager
async def following(config: Path) -> AsyncIterator[tuple[Store, KubernetesSource]]:
    """A source whose every backoff is at least 10 s (first delay 20 s, jittered down to half), probing
    every 0.1 s: what arrives within 5 s of the server's return did not wait the backoff out, however
    loaded the host."""
    store = Store(encode_group)
    source = alone(
        KubernetesSource,
        store,
        KubernetesOptions(kubeconfig=str(config), namespaces=(NS,)),
        probe_every=0.1,
        probe_timeout=0.5,
        backoff=(20.0, 60.0),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    try:
        await until(lambda: store.ready and addresses(store) == {"127.0.0.2"}, 20, "first load")
        yield store, source
    finally:
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_changes_flow_again_as_soon_as_the_api_server_answers(
    fake: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = kubeconfig(tmp_path / "kubeconfig", fake.url, fake.token)
    with caplog.at_level(logging.INFO, "eds_server"):
        async with following(config) as (store, source):
            await fake.stop()
            await until(lambda: not source.connected, 5, "the outage noticed")
            # the watches' reconnects refused, the probes too
            await asyncio.sleep(1.0)  # a window to count probes in (a rate, not a wait for something)
            assert addresses(store) == {"127.0.0.2"}  # fail static: the last state is served, marked stale
            assert store.is_stale("web")
            probes = source.probe.probes
            assert 3 <= probes <= 15  # about one every 0.1 s for both watches together, not one each
            await fake.start()
            fake.put("endpointslices", endpoint_slice("127.0.0.3"))
            await until(lambda: addresses(store) == {"127.0.0.3"}, 5, "the change after the outage")
            await until(lambda: source.connected, 5, "connected again")
            assert not store.is_stale("web")
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "kubernetes: Services: the API server closed the watch mid-stream: it went away" in said or (
        "kubernetes: EndpointSlices: the API server closed the watch mid-stream: it went away" in said
    ), said
    assert "reconnecting in" in said and "the API server answers again; reconnecting now" in said
    assert not REPR.search(said), said


async def test_a_rewritten_kubeconfig_is_used_at_once(
    fake: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The old token stops working: 401s, backed off without probing (the server is there, refusing
    us); the kubeconfig rewritten with the new token ends the backoff and is used."""
    config = kubeconfig(tmp_path / "kubeconfig", fake.url, fake.token)
    caplog.set_level(logging.INFO, "eds_server")
    async with following(config) as (store, source):
        await fake.stop()
        await until(lambda: source.watches_open == 0, 5, "the outage noticed by both watches")
        probes = source.probe.probes
        await until(lambda: source.probe.probes >= probes + 2, 5, "the server probed while away")
        fake.token = "token-b"
        await fake.start()  # seen away, now back: each watch tries at once, and is refused
        await until(lambda: fake.refused >= 2, 5, "the old token refused (both watches)")
        assert "refused our credentials" in str(source.last_error) and not REPR.search(str(source.last_error))
        probes, loads = fake.readyz, source.loads
        await asyncio.sleep(0.5)  # five probe intervals in which nothing may happen (not a wait for something)
        assert fake.readyz == probes  # refused, not away: nothing to probe for
        new = kubeconfig(tmp_path / "kubeconfig.new", fake.url, "token-b")
        new.replace(config)  # as kubectl and Secret volumes do
        fake.put("endpointslices", endpoint_slice("127.0.0.3"))
        await until(lambda: addresses(store) == {"127.0.0.3"}, 5, "the change with the new token")
        await until(lambda: source.connected, 5, "both watches following again")  # each ends its own backoff
        assert source.loads == loads + 1
    said = [r.getMessage() for r in caplog.records if "reconnecting in" in r.getMessage()]
    assert len(said) == 2, said  # went away, then (news, not more of the same) back but refusing the token
    assert "went away" in said[0] and "refused our credentials (401): Unauthorized" in said[1]


async def test_a_server_that_answers_probes_but_fails_requests_gets_the_full_backoff(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    """Seen away, then back: one early attempt. If that fails too while the probes keep answering,
    the next one waits its backoff (no retry a second against a struggling server)."""
    config = kubeconfig(tmp_path / "kubeconfig", fake.url, fake.token)
    async with following(config) as (store, source):
        await fake.stop()
        await until(lambda: source.watches_open == 0, 5, "the outage noticed by both watches")
        # one probe at a time: a second one sent means the first was answered, "not there"
        probes = source.probe.probes
        await until(lambda: source.probe.probes >= probes + 2, 5, "the server probed while away")
        fake.failing = 503  # back, answering probes, failing every request
        await fake.start()
        await until(lambda: fake.failed >= 2, 5, "the early attempts")  # one per watch
        probes = fake.readyz
        # 15 probes (one every 0.1 s) and no new attempt: their next attempts are at least 10 s away
        await until(lambda: fake.readyz >= probes + 15, 10, "15 more probes")
        assert fake.failed == 2  # still probing, no longer cutting short
        assert addresses(store) == {"127.0.0.2"}
        fake.failing = 0


def test_failures_are_said_in_words() -> None:
    class Key:
        host, port, ssl, is_ssl = "127.0.0.1", 6443, True, True

    refused = aiohttp.ClientConnectorError(Key(), ConnectionRefusedError(111, "Connect call failed"))  # type: ignore[arg-type]
    cut = aiohttp.ClientPayloadError("Response payload is not completed: <TransferEncodingError: 400>")
    gone = "EndpointSlices: the API server closed the watch mid-stream: it went away (restarting or stopping)"
    cases: list[tuple[BaseException, str, bool | None]] = [
        (
            refused,
            "EndpointSlices: cannot connect to the API server at 127.0.0.1:6443 (connection refused): "
            "it is down or restarting",
            True,
        ),
        (cut, gone, None),
        (aiohttp.ServerDisconnectedError(), gone, None),
        (TimeoutError(), "EndpointSlices: the API server did not answer in time", None),
        (
            Unauthorized("GET /x: 401: Unauthorized", 401),
            "EndpointSlices: the API server refused our credentials (401): Unauthorized",
            False,
        ),
        (
            ApiError("GET /x: 403: forbidden", 403),
            "EndpointSlices: the API server answered GET /x: 403: forbidden",
            False,
        ),
        (
            ApiError("GET /x: 503: not ready", 503),
            "EndpointSlices: the API server answered GET /x: 503: not ready",
            None,
        ),
    ]
    for error, words, away in cases:
        assert (describe(SLICES, error, "watch"), went_away(error)) == (words, away)
        assert not REPR.search(words)


async def test_a_frozen_api_server_is_found_within_the_bound_and_followed_again_after_it_thaws(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The stand-in API server as its own process, SIGSTOPped: its port accepts and the watches stay
    open, nothing answers. The default heartbeat (1 s of quiet, then two probes with 2 s each to answer)
    finds it: the source is stale, with the heartbeat's words, after two more probes, and serves its
    last state; after SIGCONT it follows again."""
    proc, port = await run_process()
    try:
        config = kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}", "token-a")
        store = Store(encode_group)
        source = alone(KubernetesSource, store, KubernetesOptions(kubeconfig=str(config), namespaces=(NS,)))
        stop = asyncio.Event()
        task = asyncio.create_task(source.run(stop))
        caplog.set_level(logging.INFO, "eds_server")
        try:
            await until(lambda: store.ready and source.connected and source.watches_open == 2, 20, "following")
            # quiet: the heartbeat probes, the server answers, nothing changes
            await until(lambda: source.heartbeat.probes >= 1, 5, "a heartbeat probe")
            assert source.connected and source.heartbeat.probes >= 1 and source.heartbeat.hangs == 0
            probes = source.heartbeat.probes
            proc.send_signal(signal.SIGSTOP)
            try:
                took = await until(lambda: not source.connected, HUNG_WAIT, "the frozen server noticed")
                # found by the heartbeat's unanswered probes, not a read timeout
                assert source.heartbeat.hangs == 1 and source.heartbeat.probes - probes >= 2
                assert store.is_stale("web") and addresses(store) == {"127.0.0.2"}  # served, marked stale
                assert "did not answer within 2 s, twice running" in str(source.last_error)
                await asyncio.sleep(2.0)  # a window in which nothing may change: still stale while frozen
                assert not source.connected
            finally:
                proc.send_signal(signal.SIGCONT)
            await until(lambda: source.connected and source.watches_open == 2, 10, "following again")
            assert not store.is_stale("web") and addresses(store) == {"127.0.0.2"}
        finally:
            stop.set()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        proc.kill()
        await proc.wait()
    print(f"\nstale {took:.1f} s after the freeze")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "the API server at http://127.0.0.1" in said[0], said


async def test_a_silent_watch_is_opened_again_at_once_while_the_api_server_answers(
    fake: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Watches are asked to end after 4 s; one not ended 1 s later is dead, whatever the heartbeat
    hears on other connections. The API server answering /livez, it is opened again at once from
    where it was, and the source stays live; a quiet watch resumes from the bookmark sent before
    each end (the other kind's changes move the version on), never from the list's version. A watch
    opened again that way that stalls too is a failure: said, and stale."""
    config = kubeconfig(tmp_path / "kubeconfig", fake.url, fake.token)
    caplog.set_level(logging.INFO, "eds_server")
    async with following(config) as (store, source):
        listed = fake.rv
        fake.put("services", {**service(), "spec": {"ports": [{"name": "http", "port": 81, "targetPort": 8080}]}})
        moved = fake.rv
        await until(lambda: ("endpointslices", moved) in fake.watched, 8, "a slice watch from the bookmark's version")
        assert all(rv >= listed for plural, rv in fake.watched)

        fake.stall["endpointslices"] = 1
        await until(lambda: fake.stalled == 1, 6, "a slice watch stalled")
        livez = fake.livez
        fake.put("endpointslices", endpoint_slice("127.0.0.3"))

        def arrived() -> bool:
            assert source.connected and not store.is_stale("web")  # live all along
            return addresses(store) == {"127.0.0.3"}

        await until(arrived, 8, "the change held back by the stalled watch")
        assert source.reopened == 1 and source.relists == 0 and fake.livez > livez
        assert any("watch's connection went silent" in r.getMessage() for r in caplog.records)

        fake.stall["endpointslices"] = 2  # every watch stalls: after the one opened again, a failure
        await until(lambda: not source.connected, 16, "a path that stalls every watch said")
        assert source.reopened == 2 and store.is_stale("web") and addresses(store) == {"127.0.0.3"}
        assert "EndpointSlices: the watch's connection went silent" in str(source.last_error)
