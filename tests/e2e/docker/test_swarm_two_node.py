"""Fail static with a two-node Swarm on this machine, proven with a real Envoy carrying requests.

Two private engines (tests/support/docker_engine.py ``swarm_pair``): a manager and a worker, each listening on its
own 127.0.0.1 port. Two labelled services, host networking on distinct loopback ports, are placed on the
worker (``node.role==worker``), so their tasks outlive anything that happens to the manager. eds-server
``--swarm`` follows the manager; Envoy gets one request every 50 ms through its listener.

(a) The manager engine restarts: the source loses it (stale, endpoints kept); the restarted manager lists
    the worker as ``unknown`` until it re-registers, and its tasks as running.
(b) The worker engine is frozen (SIGSTOP of its dockerd and containerd; its containers run on) while the
    manager restarts, and thawed a few seconds after the manager answers: the manager lists the worker as
    ``unknown`` for that whole time (a frozen worker alone stays ``ready`` until its heartbeat times out,
    ~10-15 s, and is then ``down``: measured, not tested here).
In both: zero failed requests, Envoy's cluster never empty. What Swarm reported for the worker node
over time is printed with the figures (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.docker_engine import (
    NOT_YET_DOCKER,
    DockerEngine,
    backend_script,
    http_get,
    node_states,
    swarm_remove_services,
)
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.fault_watch import FaultWatch
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for, wait_for_blocking

pytestmark = [pytest.mark.docker, pytest.mark.envoy]


@dataclass
class NodeWatch:
    """The worker node's ``Status.State`` as the manager lists it, polled every 100 ms (bounded); only
    changes are kept, with the time `clock` gives ("no answer" while the manager is away)."""

    manager: DockerEngine
    clock: Callable[[], float]
    timeline: list[tuple[float, str]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def _state(self) -> str:
        try:
            return node_states(self.manager).get("worker", "not listed")
        except Exception:
            return "no answer"

    async def _run(self, max_seconds: float) -> None:
        for _ in range(int(max_seconds / 0.1)):
            if self._stop.is_set():
                return
            state = await asyncio.to_thread(self._state)
            if not self.timeline or self.timeline[-1][1] != state:
                self.timeline.append((self.clock(), state))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.1)

    async def __aenter__(self) -> NodeWatch:
        self._task = asyncio.create_task(self._run(100.0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await asyncio.wait_for(self._task, 10)

    def states(self) -> list[str]:
        return [s for _, s in self.timeline]

    def __str__(self) -> str:
        return " -> ".join(f"{s} (t={t:.2f}s)" for t, s in self.timeline)


@pytest.fixture
def swarm2(swarm_pair: tuple[DockerEngine, DockerEngine]) -> Iterator[tuple[DockerEngine, DockerEngine]]:
    manager, worker = swarm_pair
    for engine in (manager, worker):
        if not engine.running:
            engine.start()
    yield manager, worker
    for engine in (manager, worker):
        if not engine.running:
            engine.start()
    swarm_remove_services(manager)
    wait_for_blocking(
        lambda: not worker.container_ids(), timeout=30, what="the worker's tasks to go", retry=NOT_YET_DOCKER
    )


def worker_services(manager: DockerEngine, count: int = 2) -> list[int]:
    """`count` labelled services of one task each, on the worker, host network, distinct loopback ports."""
    ports = [free_port() for _ in range(count)]
    for i, port in enumerate(ports):
        name = f"web-w{i}"
        manager.cli(
            "service",
            "create",
            "-d",
            "--no-resolve-image",
            "--name",
            name,
            "--network",
            "host",
            "--constraint",
            "node.role==worker",
            "--label",
            "eds.group=web",
            "--label",
            f"eds.port={port}",
            manager.image,
            "sh",
            "-c",
            backend_script(name, port),
            timeout=60,
        )
    for i, port in enumerate(ports):
        wait_for_blocking(
            lambda p=port, n=f"web-w{i}": http_get(p, timeout=1.0) == (200, n),
            timeout=30,  # type: ignore[misc]
            what=f"task of web-w{i} on 127.0.0.1:{port}",
        )
    return ports


@contextlib.asynccontextmanager
async def stack(manager: DockerEngine, ports: list[int], tmp_path: Path) -> AsyncIterator[FaultWatch]:
    async with EdsServerProcess(None, "--swarm", "--docker-host", manager.host, workdir=tmp_path) as server:
        bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live(timeout=30)
            await envoy.wait_for(lambda: envoy.hosts("web"), lambda hs: {h.port for h in hs} == set(ports), timeout=30)
            assert {h.address for h in await envoy.hosts("web")} == {"127.0.0.1"}  # the worker's Status.Addr
            async with FaultWatch(envoy, server, backends=ports) as watch:
                yield watch
            assert await envoy.update_rejected("web") == 0


async def wait_source(watch: FaultWatch, *, live: bool, timeout: float = 60.0) -> None:
    def settled(body: dict[str, Any]) -> bool:
        swarm = {s["name"]: s for s in body["sources"]}.get("swarm")
        return bool(swarm and swarm["loaded"] and swarm["stale"] is not live)

    await wait_for(
        lambda: watch.server.admin("/v1/sources"),
        settled,
        timeout=timeout,
        interval=0.1,
        what=f"the swarm source {'live' if live else 'stale'}",
    )


async def restart_manager(watch: FaultWatch, manager: DockerEngine) -> None:
    """Restart the manager's engine, marking each step, until the swarm source is live again."""
    watch.mark("manager restarting")
    await asyncio.to_thread(manager.restart)
    watch.mark("manager answers again")
    await wait_source(watch, live=True)
    watch.mark("source live again")


async def worker_ready(watch: FaultWatch, manager: DockerEngine) -> None:
    await asyncio.to_thread(
        wait_for_blocking,
        lambda: node_states(manager).get("worker") == "ready",
        timeout=30,
        what="the worker to be ready again",
        retry=NOT_YET_DOCKER,
    )
    watch.mark("worker ready")


def check(watch: FaultWatch, nodes: NodeWatch, name: str, *, unknown_seen: bool) -> None:
    watch.assert_held(name)
    print(f"   worker node as the manager listed it: {nodes}")
    if unknown_seen:
        assert "unknown" in nodes.states()


async def test_manager_restart(swarm2: tuple[DockerEngine, DockerEngine], tmp_path: Path) -> None:
    manager, _ = swarm2
    ports = await asyncio.to_thread(worker_services, manager)
    async with stack(manager, ports, tmp_path) as watch, NodeWatch(manager, watch.now) as nodes:
        await asyncio.sleep(1.0)
        await restart_manager(watch, manager)
        await worker_ready(watch, manager)
        await asyncio.sleep(2.0)
    check(watch, nodes, "two-node swarm, manager engine restarted", unknown_seen=False)  # too short to count on


async def test_worker_frozen_while_the_manager_restarts(
    swarm2: tuple[DockerEngine, DockerEngine], tmp_path: Path
) -> None:
    manager, worker = swarm2
    ports = await asyncio.to_thread(worker_services, manager)
    async with stack(manager, ports, tmp_path) as watch, NodeWatch(manager, watch.now) as nodes:
        await asyncio.sleep(1.0)
        with worker.frozen():
            watch.mark("worker engine frozen (SIGSTOP dockerd, containerd)")
            await asyncio.sleep(2.0)
            await restart_manager(watch, manager)
            await asyncio.sleep(3.0)  # the worker cannot re-register: `unknown` all along
            assert node_states(manager).get("worker") == "unknown"
        watch.mark("worker engine thawed (SIGCONT)")
        await worker_ready(watch, manager)
        await asyncio.sleep(2.0)
    check(watch, nodes, "two-node swarm, worker frozen across a manager restart", unknown_seen=True)
