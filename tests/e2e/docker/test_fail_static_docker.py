"""Fail static with Docker, proven with real parts: a private engine, busybox backends, eds-server through
its command line, and a real Envoy carrying requests the whole time (one every 50 ms, loopback only).

Each scenario breaks the way eds-server reaches the engine, or the engine itself, and asserts from Envoy's
side: no failed request while the backends are alive, and the cluster is never emptied. The figures
(requests sent/failed, host counts seen, longest stale and unready time) are printed (``pytest -s``).

1. eds-server restarted while the engine is unreachable: (a) the socket refuses it (EACCES: the server runs
   as ``nobody`` without the socket's group), (b) the socket path is missing. A fresh process has loaded
   nothing, so it answers nobody (``/readyz`` 503 naming the source and its error); Envoy keeps its hosts.
   When the socket becomes reachable the endpoints converge, including a backend started meanwhile.
2. The engine stopped and started: (a) with ``--live-restore`` the backends keep running: zero failures;
   (b) without it they die with the engine and come back (``--restart always``): the cluster keeps its
   hosts while the engine is away, and requests fail only while the backends are really down.
3. The engine frozen (SIGSTOP): its socket stays open and nothing answers; it is said stale within the
   stated bound, Envoy keeps every host, and it is followed again after SIGCONT.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.docker_engine import DockerEngine, _skip_or_fail, arun_backend
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.fault_watch import FaultWatch
from tests.support.hung_peer import frozen_is_said, wait_source
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess, RunAs
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.docker, pytest.mark.envoy]

NOBODY, NOGROUP = 65534, 65534
LABELS = {"eds.group": "web"}


async def backend(engine: DockerEngine, name: str, *extra: str) -> int:
    port = free_port()
    await arun_backend(engine, name, port, {**LABELS, "eds.port": str(port)}, extra_args=list(extra))
    return port


@contextlib.asynccontextmanager
async def envoy_on(server: EdsServerProcess, ports: set[int]) -> AsyncIterator[EnvoyProcess]:
    """A real Envoy routing / to cluster web, once it holds exactly `ports`; no update may be rejected."""
    async with EnvoyProcess(envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})) as e:
        await e.wait_live(timeout=30)
        await wait_hosts(e, ports)
        yield e
        assert await e.update_rejected("web") == 0


async def wait_hosts(envoy: EnvoyProcess, ports: set[int], timeout: float = 30.0) -> None:
    await envoy.wait_for(lambda: envoy.hosts("web"), lambda hs: {h.port for h in hs} == ports, timeout=timeout)


async def readyz(server: EdsServerProcess) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{server.admin_port}/readyz") as r,
    ):
        return r.status, await r.json()


async def wait_unready(server: EdsServerProcess, error: str, timeout: float = 15.0) -> dict[str, Any]:
    """/readyz is 503, waiting for the docker source, whose last error contains `error`."""

    def waits_for_docker(answer: tuple[int, dict[str, Any]]) -> bool:
        status, body = answer
        waiting = {w["source"]: w["last_error"] or "" for w in body.get("waiting_for", [])}
        return status == 503 and error in waiting.get("docker", "")

    _, body = await wait_for(
        lambda: readyz(server),
        waits_for_docker,
        timeout=timeout,
        interval=0.1,
        what=f"/readyz saying it waits for docker ({error!r})",
    )
    return body


async def wait_stale(server: EdsServerProcess, stale: bool, source: str = "docker", timeout: float = 30.0) -> None:
    """Wait until `source` has loaded and is (or is no longer) stale: following its engine or not."""

    def settled(body: dict[str, Any]) -> bool:
        found = {s["name"]: s for s in body["sources"]}[source]
        return bool(found["loaded"] and found["stale"] == stale)

    await wait_for(
        lambda: server.admin("/v1/sources"),
        settled,
        timeout=timeout,
        interval=0.1,
        what=f"source {source} stale={stale}",
    )


# -- 1. restarted while the engine is unreachable ---------------------------------------------------


def _nobody_can_run_us() -> None:
    """The server runs as nobody here, through setpriv (see RunAs)."""
    try:
        res = subprocess.run(
            [*RunAs(NOBODY, NOGROUP).command(), sys.executable, "-c", "import eds_server.cli"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError as e:
        res = subprocess.CompletedProcess([], 1, "", str(e))
    if res.returncode != 0:
        _skip_or_fail(f"cannot run eds-server as nobody with setpriv: {res.stderr[-500:]}")


async def _restart_while_unreachable(
    engine: DockerEngine,
    server: EdsServerProcess,
    prefix: str,
    error: str,
    cut: Callable[[], None],
    mend: Callable[[], None],
) -> FaultWatch:
    """eds-server serving two backends is stopped, `cut` off the engine, and started again: it answers
    nobody (/readyz names `error`) while a third backend starts; after `mend` all three reach Envoy."""
    first, second = await backend(engine, f"{prefix}-1"), await backend(engine, f"{prefix}-2")
    await server.start()
    async with (
        envoy_on(server, {first, second}) as envoy,
        FaultWatch(envoy, server, backends=(first, second)) as watch,
    ):
        await asyncio.sleep(1.0)
        assert await server.stop() == 0
        cut()
        watch.mark("eds-server stopped and cut off the engine")
        await server.start(wait_ready=False)
        watch.mark("eds-server restarted")
        body = await wait_unready(server, error)
        watch.mark(f"/readyz 503: {body['waiting_for']}")
        third = await backend(engine, f"{prefix}-3")  # started while eds-server cannot see it
        watch.mark(f"backend {prefix}-3 started")
        await asyncio.sleep(2.0)
        assert (await readyz(server))[0] == 503
        mend()
        watch.mark("engine reachable again")
        await wait_hosts(envoy, {first, second, third})
        watch.mark("Envoy has all three")
        await asyncio.sleep(1.0)
    return watch


async def test_restart_while_socket_permission_denied(docker_cleanup: DockerEngine, tmp_path: Path) -> None:
    """The compose case: eds-server recreated with the wrong socket group gets EACCES, answers nobody, and
    Envoy keeps every endpoint; once the socket's group is its own, the endpoints converge."""
    _nobody_can_run_us()
    engine = docker_cleanup
    sock = engine.socket_path
    sock_gid = sock.stat().st_gid
    assert stat.S_IMODE(sock.stat().st_mode) & 0o006 == 0, "the engine's socket is open to everyone"
    server = EdsServerProcess(
        None, "--docker", "--docker-host", engine.host, workdir=tmp_path, user=RunAs(NOBODY, NOGROUP, (sock_gid,))
    )

    def cut() -> None:
        server.user = RunAs(NOBODY, NOGROUP)  # recreated without the socket's group

    try:
        watch = await _restart_while_unreachable(
            engine, server, "perm", "Permission denied", cut, lambda: os.chown(sock, -1, NOGROUP)
        )
    finally:
        with contextlib.suppress(OSError):
            os.chown(sock, -1, sock_gid)
        await server.__aexit__(None, None, None)
    watch.assert_held("restart while the socket refuses eds-server (EACCES)")
    assert "not loaded yet" in server.log_text() and "last known endpoints" not in server.log_text()


async def test_restart_while_socket_missing(docker_cleanup: DockerEngine, tmp_path: Path) -> None:
    """eds-server restarted while its socket path does not exist (not mounted): it answers nobody and
    Envoy keeps every endpoint; once the path exists, the endpoints converge."""
    engine = docker_cleanup
    link_dir = Path(tempfile.mkdtemp(prefix="eds-sock-", dir="/tmp"))  # short: sun_path is 108 bytes
    link = link_dir / "docker.sock"
    link.symlink_to(engine.socket_path)
    server = EdsServerProcess(None, "--docker", "--docker-host", f"unix://{link}", workdir=tmp_path)
    try:
        watch = await _restart_while_unreachable(
            engine, server, "miss", "No such file", link.unlink, lambda: link.symlink_to(engine.socket_path)
        )
    finally:
        await server.__aexit__(None, None, None)
        with contextlib.suppress(OSError):
            link.unlink()
        link_dir.rmdir()
    watch.assert_held("restart while the socket path is missing")


# -- 2. the engine stopped and started --------------------------------------------------------------


async def test_engine_stop_start_with_live_restore(docker_cleanup: DockerEngine, tmp_path: Path) -> None:
    engine = docker_cleanup
    assert engine.live_restore
    first, second = await backend(engine, "lr-1"), await backend(engine, "lr-2")
    async with (
        EdsServerProcess(None, "--docker", "--docker-host", engine.host, workdir=tmp_path) as server,
        envoy_on(server, {first, second}) as envoy,
        FaultWatch(envoy, server, backends=(first, second)) as watch,
    ):
        await asyncio.sleep(1.0)
        await asyncio.to_thread(engine.stop)
        watch.mark("engine stopped")
        await wait_stale(server, True)
        await asyncio.sleep(2.0)
        await asyncio.to_thread(engine.start)
        watch.mark("engine started")
        await wait_stale(server, False)
        watch.mark("source live again")
        third = await backend(engine, "lr-3")
        await wait_hosts(envoy, {first, second, third})
        watch.mark("Envoy has all three")
        await asyncio.sleep(1.0)
    watch.assert_held("engine stopped and started, --live-restore")


@pytest.fixture
def plain_engine(docker_engine: DockerEngine) -> Iterator[DockerEngine]:
    """A second private engine without --live-restore (its containers die with it); needs the session
    engine only so that the same skip/fail rules apply."""
    engine = DockerEngine(live_restore=False)
    try:
        engine.start()
        yield engine
    finally:
        engine.close()


async def test_engine_stop_start_without_live_restore(plain_engine: DockerEngine, tmp_path: Path) -> None:
    """The containers die with the engine. dockerd stops them while its API still serves, so the source,
    loaded and live, sees them die and says so: the cluster empties, truthfully, while they are down.
    While the engine is away that state is kept unchanged; when the engine restarts them they come back
    once the source has reconnected (its backoff: requests fail between the two, and are counted apart).
    Outside [first backend down, source live again] nothing fails and the cluster is never empty."""
    engine = plain_engine
    ports = [await backend(engine, f"plain-{i}", "--restart", "always") for i in (1, 2)]
    async with (
        EdsServerProcess(None, "--docker", "--docker-host", engine.host, workdir=tmp_path) as server,
        envoy_on(server, set(ports)) as envoy,
        FaultWatch(envoy, server, backends=ports) as watch,
    ):
        await asyncio.sleep(1.0)
        watch.mark("engine stopping")
        await asyncio.to_thread(engine.stop)
        watch.mark("engine stopped (its containers with it)")
        await wait_stale(server, True)
        away = watch.now()
        await asyncio.sleep(2.0)
        back = watch.now()
        watch.mark("engine starting")
        await asyncio.to_thread(engine.start)
        watch.mark("engine started")
        await wait_stale(server, False)
        live = watch.now()
        watch.mark("source live again")
        await wait_hosts(envoy, set(ports))
        watch.mark("Envoy has both again")
        await asyncio.sleep(1.0)
    print("\n" + watch.summary("engine stopped and started, no --live-restore"))
    windows = watch.down_windows()
    assert windows, "the backends never went down"
    first_down, last_up = windows[0][0], windows[-1][1]
    lag = [r for r in watch.failed() if last_up < r.t <= live]
    print(
        f"   failed while a backend was down: {len(watch.failed()) - len(watch.failed_while_backends_up())}; "
        f"in the reconnect lag ({last_up:.2f}s..{live:.2f}s, backends up, source not yet live): {len(lag)}"
    )
    while_away = sorted({s.hosts for s in watch.samples if away <= s.t <= back}, key=str)
    print(f"   host counts while the engine was away: {while_away}")
    assert len(while_away) == 1, "the cluster changed while the engine was away"
    assert not [r for r in watch.failed() if not first_down <= r.t <= live]
    assert not [s for s in watch.samples if s.hosts == 0 and not first_down <= s.t <= live]
    assert watch.host_counts()[None] == 0


# -- 3. the engine frozen -----------------------------------------------------------------------------


async def test_engine_frozen_is_said_stale_within_the_bound_and_envoy_keeps_its_hosts(
    docker_cleanup: DockerEngine, tmp_path: Path
) -> None:
    """dockerd and containerd SIGSTOPped: the socket still accepts, nothing answers, the backends keep
    running. The source is said stale within the stated bound (/v1/sources, /readyz, /metrics) while
    Envoy keeps its hosts (no failed request), and follows the engine again after SIGCONT."""
    engine = docker_cleanup
    first, second = await backend(engine, "fz-1"), await backend(engine, "fz-2")
    async with (
        EdsServerProcess(None, "--docker", "--docker-host", engine.host, workdir=tmp_path) as server,
        envoy_on(server, {first, second}) as envoy,
        FaultWatch(envoy, server, backends=(first, second)) as watch,
    ):
        await wait_source(server, "docker", stale=False, timeout=15)
        await asyncio.sleep(1.0)
        with engine.frozen():
            frozen_at = time.monotonic()
            watch.mark("engine frozen (SIGSTOP)")
            took = await frozen_is_said(server, "docker", frozen_at)
            watch.mark(f"said stale {took:.1f} s after the freeze")
            await asyncio.sleep(3.0)  # stays stale, and served, while frozen
            await wait_source(server, "docker", stale=True, timeout=1)
        watch.mark("engine thawed (SIGCONT)")
        await wait_source(server, "docker", stale=False, timeout=15)
        watch.mark("source live again")
        third = await backend(engine, "fz-3")
        await wait_hosts(envoy, {first, second, third})
        watch.mark("Envoy has all three")
    watch.assert_held("engine frozen with SIGSTOP and thawed")
    assert "did not answer within" in server.log_text()
