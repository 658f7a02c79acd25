"""Docker as a source: list labelled containers once, then follow the engine's event stream.

aiodocker's event stream neither reconnects nor times out, so each connection gets a fresh client,
an engine quiet for a second is pinged with a short timeout (a frozen engine keeps its socket open
and answers nothing: it is found about 5 s after its last answer, as a stopped one is), and the
containers are listed again after every reconnect and on a slow periodic resync (the engine keeps
only a short event history). While the engine is away or hung the last known endpoints keep being served, marked stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import aiodocker

from ..model import Group
from .base import Backoff, Debounce, Feed, Followed, Heartbeat, Hung, Liveness, SourceStatus, WarnOnce, reconnect
from .containers import DockerOptions, container_endpoints, groups_of, opted_in

log = logging.getLogger("eds_server.sources.docker")

# Container events after which its inspect output may have changed.
REINSPECT = {"start", "restart", "unpause", "pause", "rename", "update", "oom"}
STOP_SIGNALS = {"15", "SIGTERM", "9", "SIGKILL", "2", "SIGINT", "3", "SIGQUIT"}


class EngineGone(Exception):
    pass


class EngineFollower(Followed):
    """What the Docker and Swarm sources share: settings, bounded requests, and a reconnect loop that
    keeps the last state (marked stale) while the engine is away."""

    async def _next_event(self, subscriber: Any, timeout: float) -> Mapping[str, Any] | None:
        """The engine's next event, or None if `timeout` passes first; EngineGone when its stream ends."""
        try:
            event = await asyncio.wait_for(subscriber.get(), max(0.0, timeout))
        except TimeoutError:
            return None
        if event is None:
            raise EngineGone("event stream ended")
        if self.heartbeat is not None:
            self.heartbeat.beat()  # news from the engine: no ping needed for now
        return cast(Mapping[str, Any], event)

    async def _upkeep(self, docker: aiodocker.Docker, pending: Debounce, now: float) -> None:
        """After each wait: publish a settled change, re-list when a resync is due. (An engine that
        stops answering is the heartbeat's to find.)"""
        if pending.due(now):
            self.publish()
        if self.last_sync is not None and now - self.last_sync >= self.resync_interval:
            await self.relist(docker)

    name = "engine"
    what = "engine"  # for log lines

    def __init__(
        self,
        feed: Feed,
        options: DockerOptions,
        *,
        host: str | None = None,
        debounce: float = 0.05,
        resync_interval: float = 60.0,
        ping_interval: float = 1.0,
        ping_timeout: float = 2.0,
        request_timeout: float = 10.0,
    ) -> None:
        self.feed = feed
        self.options = options
        self.host = host
        self.debounce = debounce
        self.resync_interval = max(30.0, resync_interval)
        self.ping_interval, self.ping_timeout = ping_interval, ping_timeout
        self.request_timeout = request_timeout
        self.liveness = Liveness(feed, self.name, self.what)
        self.heartbeat: Heartbeat | None = None  # the current connection's
        self.last_sync: float | None = None
        self.warnings = WarnOnce(log)  # per container or service

    def status(self) -> SourceStatus:
        return self.liveness.status(connected=self.connected, **self._counts())

    def _counts(self) -> dict[str, int]:
        return {}

    async def start(self) -> None:
        """Nothing to check before serving: until the engine is listed the store waits (not ready)."""

    async def _request(self, coro: Any) -> Any:
        return await asyncio.wait_for(coro, self.request_timeout)

    def _publish(self, warnings: Mapping[str, str | None], groups: Mapping[str, Group]) -> None:
        """Log each object's warning once (until it changes), and publish the whole state."""
        self.warnings.update(warnings)
        changed = self.feed.publish(self.name, groups)
        if changed:
            log.info("%s: groups changed: %s", self.name, ", ".join(sorted(changed)))

    async def _follow(self, docker: aiodocker.Docker, stop: asyncio.Event, backoff: Backoff) -> None:
        raise NotImplementedError

    def publish(self) -> None:
        """Publish the groups as they stand."""
        raise NotImplementedError

    async def relist(self, docker: aiodocker.Docker) -> None:
        """Read the whole state again (at connect, and every resync interval)."""
        raise NotImplementedError

    def _connected(self, backoff: Backoff, count: int, kind: str) -> None:
        self.liveness.live(f"{count} labelled {kind}")
        backoff.reset()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the engine until `stop` is set, reconnecting for as long as it takes."""
        backoff = Backoff()

        async def connect() -> str:
            docker: aiodocker.Docker | None = None
            try:
                # DOCKER_HOST first, as the docker CLI does (aiodocker alone prefers the context).
                url = self.host or os.environ.get("DOCKER_HOST") or None
                docker = aiodocker.Docker(url=url)
                self.heartbeat = Heartbeat(_pinger(docker), f"the engine at {url or 'its default socket'}",
                                           every=self.ping_interval, timeout=self.ping_timeout)  # fmt: skip
                async with self.heartbeat.watching():
                    await self._follow(docker, stop, backoff)
                return "the engine ended the event stream"
            finally:
                if docker is not None:
                    await _close(docker)

        await reconnect(stop, connect, backoff=backoff, why=_why,
                        lost=lambda reason, _: self.liveness.lost(with_fix(reason)))  # fmt: skip


def _why(e: Exception) -> str:
    if isinstance(e, Hung):
        return str(e)
    if isinstance(e, AssertionError):  # aiodocker's way of saying it found no engine address
        return "no engine: set DOCKER_HOST or --docker-host, or mount /var/run/docker.sock"
    if isinstance(e, aiodocker.DockerError):
        return f"{e.status}: {e.message}"
    return f"{type(e).__name__}: {e}"


def _pinger(docker: aiodocker.Docker) -> Callable[[], Awaitable[object]]:
    """GET /version: a cheap request the engine answers from memory, through aiodocker's public API."""

    async def ping() -> object:
        return await docker.version()

    return ping


def with_fix(reason: str) -> str:
    """The reason an engine could not be reached, with the fix where it is ours to name: a socket
    eds-server's user may not open (the image runs as uid 10001, the socket is root:docker 0660)."""
    if "Permission denied" in reason or "[Errno 13]" in reason:
        return (
            f"{reason}; eds-server's user needs the socket's group: in compose, put "
            "DOCKER_GID=$(stat -c %g /var/run/docker.sock) in .env (group_add), see docs/docker.md"
        )
    return reason


class DockerSource(EngineFollower):
    name = "docker"

    def __init__(self, feed: Feed, options: DockerOptions, **kwargs: Any) -> None:
        super().__init__(feed, options, **kwargs)
        self._inspects: dict[str, Mapping[str, Any]] = {}  # container id -> docker inspect
        self._draining: set[str] = set()

    def _counts(self) -> dict[str, int]:
        return {"containers": len(self._inspects)}

    # -- state ---------------------------------------------------------------------------------
    def publish(self) -> None:
        """Publish the whole current state (the store works out what changed)."""
        per_container = {
            cid: container_endpoints(self._inspects[cid], self.options, draining=cid in self._draining)
            for cid in sorted(self._inspects)
        }
        self._publish({cid: c.warning for cid, c in per_container.items()}, groups_of(per_container.values()))

    def forget(self, cid: str) -> None:
        self._inspects.pop(cid, None)
        self._draining.discard(cid)
        self.warnings.forget(cid)

    # -- engine --------------------------------------------------------------------------------
    async def _inspect(self, docker: aiodocker.Docker, cid: str) -> Mapping[str, Any] | None:
        try:
            data: Mapping[str, Any] = await self._request(docker.containers.container(cid).show())
        except aiodocker.DockerError as e:
            if e.status == 404:
                return None  # gone meanwhile
            raise
        return data

    async def relist(self, docker: aiodocker.Docker) -> None:
        """Replace what we know with a fresh listing of running, labelled containers."""
        label = f"{self.options.label_prefix}.group"
        listed = await self._request(docker.containers.list(filters=json.dumps({"label": [label]})))
        inspects: dict[str, Mapping[str, Any]] = {}
        for container in listed:
            data = await self._inspect(docker, container.id)
            if data is not None:
                inspects[container.id] = data
        self._draining &= inspects.keys()
        self._inspects = inspects
        self.last_sync = asyncio.get_running_loop().time()
        self.publish()

    async def handle(self, docker: aiodocker.Docker, event: Mapping[str, Any]) -> bool:
        """Apply one engine event; True when our state changed."""
        actor = event.get("Actor") or {}
        attrs = actor.get("Attributes") or {}
        action = str(event.get("Action") or event.get("status") or "")
        if event.get("Type") == "network":
            cid = attrs.get("container")
            if action not in ("connect", "disconnect") or not cid:
                return False
        else:
            cid = actor.get("ID") or event.get("id")
            if not cid or action.startswith("exec_"):  # health checks run as execs: noise
                return False
            if not opted_in(attrs, self.options) and cid not in self._inspects:
                return False
            if action in ("die", "destroy"):
                known = cid in self._inspects
                self.forget(cid)
                return known
            if action == "kill":
                if attrs.get("signal") in STOP_SIGNALS and cid in self._inspects:
                    self._draining.add(cid)  # `docker stop`: drain until `die`
                    return True
                return False
            if action not in REINSPECT and not action.startswith("health_status"):
                return False
            if action in ("start", "restart", "unpause"):
                self._draining.discard(cid)
        data = await self._inspect(docker, cid)
        labels = ((data or {}).get("Config") or {}).get("Labels") or {}
        status = ((data or {}).get("State") or {}).get("Status")
        if data is None or status not in ("running", "paused") or not opted_in(labels, self.options):
            known = cid in self._inspects
            self.forget(cid)
            return known
        self._inspects[cid] = data
        return True

    async def _follow(self, docker: aiodocker.Docker, stop: asyncio.Event, backoff: Backoff) -> None:
        subscriber = docker.events.subscribe(  # type: ignore[no-untyped-call]
            filters=json.dumps({"type": ["container", "network"]})
        )
        await self.relist(docker)  # after subscribing, so nothing falls between the two
        self._connected(backoff, len(self._inspects), "containers")
        loop = asyncio.get_running_loop()
        pending = Debounce(self.debounce)
        while not stop.is_set():
            event = await self._next_event(subscriber, pending.timeout(loop.time(), self.ping_interval))
            now = loop.time()
            if event is not None and await self.handle(docker, event):
                pending.changed(now)
            await self._upkeep(docker, pending, now)


async def _close(docker: aiodocker.Docker) -> None:
    # Stopping a broken stream re-raises its error; it is closed either way.
    with contextlib.suppress(Exception):
        await docker.events.stop()  # type: ignore[no-untyped-call]
    with contextlib.suppress(Exception):
        await docker.close()
