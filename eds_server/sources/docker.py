"""Docker as a source: list labelled containers once, then follow the engine's event stream.

aiodocker's event stream neither reconnects nor times out, so each connection gets a fresh client,
an engine quiet for a second is pinged with a short timeout (a frozen engine keeps its socket open
and answers nothing: it is found about 5 s after its last answer, as a stopped one is), the event
stream is renewed as often (its own connection may die while the pings, on others, go through: see
`EventStream`), and the containers are listed again after every reconnect and on a slow periodic
resync (the engine keeps only a short event history). While the engine is away or hung the last
known endpoints keep being served, marked stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
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


NS = 1_000_000_000
# Replayed again at each renewal and skipped by key: the engine stamps an event before it takes the
# lock that orders its history, so two events logged together may come a little out of order.
MARGIN_NS = NS // 10
_RFC3339 = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def engine_ns(stamp: object) -> int | None:
    """The engine's RFC 3339 time (`SystemTime` in `docker info`, to the nanosecond) in ns since the epoch."""
    m = _RFC3339.match(str(stamp or ""))
    if m is None:
        return None
    whole, frac, zone = m.groups()
    seconds = int(datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp())
    return seconds * NS + int(((frac or "") + "000000000")[:9])


def since_param(ns: int) -> str:
    """An engine time as the events API's `since` takes it: seconds.nanoseconds."""
    return f"{ns // NS}.{ns % NS:09d}"


EventKey = tuple[int, str, str, str]


def event_key(event: Mapping[str, Any]) -> EventKey | None:
    """What tells one event from another (a replayed one has the same); None without an engine time."""
    ns = event.get("timeNano")
    if not isinstance(ns, int):
        return None
    actor = event.get("Actor") or {}
    return (
        ns,
        str(event.get("Type") or ""),
        str(event.get("Action") or event.get("status") or ""),
        str(actor.get("ID") or event.get("id") or ""),
    )


class EventStream:
    """The engine's events, on a connection never more than `renew` seconds old.

    An HTTP/1.1 event stream carries no ping, and the heartbeat's pings ride other pooled connections:
    the stream's own connection can die silently (a stalled proxy, a NAT that forgot it, a half-open
    TCP connection) while every ping is answered, and its events would wait for the resync. So every
    `renew` seconds (the heartbeat's bound by default) the subscription is opened again with `since`
    set to the engine's time of the last event taken (or, before any, its clock at connect) less
    MARGIN_NS (0.1 s), and the old one is closed: what the old connection held back, the engine
    replays from its history. Only the engine's own times are compared, never our clock, so a skewed
    clock does not matter; an event replayed twice is skipped by key. The history is short (the
    engine keeps its last 256 events): when a replay does not reach back to the last event taken,
    events may have been lost and `relist` is set. A renewed stream that ends while the engine answers a ping is opened
    afresh (the engine may have restarted, its history with it) and `relist` set: a failed renewal
    leaves the source live and its state served. Otherwise EngineGone: the source is stale (its
    state still served) until it reconnects.
    """

    def __init__(
        self,
        docker: aiodocker.Docker,
        types: Sequence[str],
        *,
        renew: float,
        ping: Callable[[], Awaitable[object]],
        timeout: float,
        heard: Callable[[], None] = lambda: None,
    ) -> None:
        self.docker, self.filters = docker, json.dumps({"type": list(types)})
        self.renew, self.ping, self.timeout, self.heard = renew, ping, timeout, heard
        self.relist = False  # the follower should list everything again (then clear it)
        self.renewals = 0  # subscriptions renewed (for tests and the figures)
        self.reopened = 0  # streams that ended and were opened afresh, the engine answering
        self.gaps = 0  # replays that did not reach back to the last event taken
        self._since: int | None = None  # the engine time the next renewal replays from (plus the margin)
        self._last: EventKey | None = None  # the last event taken
        self._seen: dict[EventKey, int] = {}  # events taken within the margin of `_since`
        self._expect: EventKey | None = None  # the last event taken, until a replay shows it again
        self._subscriber: Any = None
        self._opened = 0.0  # loop time of the current subscription
        self._renewed = False  # since the last fresh subscription

    async def open(self) -> None:
        """Subscribe afresh: at connect, before the listing, so nothing falls between the two."""
        info = await asyncio.wait_for(self.docker.system.info(), self.timeout)
        self._since = engine_ns((info or {}).get("SystemTime"))  # None: no renewal until an event has a time
        self._last, self._expect = None, None
        self._seen.clear()
        self._renewed = False
        self._subscribe()

    def _subscribe(self, **params: str) -> None:
        self._subscriber = self.docker.events.subscribe(filters=self.filters, **params)  # type: ignore[no-untyped-call]
        self._opened = asyncio.get_running_loop().time()

    async def _stop(self) -> str | None:
        """Close the current subscription (and its connection); what ended it, if it failed."""
        self._subscriber = None
        try:
            await self.docker.events.stop()  # type: ignore[no-untyped-call]
        except Exception as e:  # a stream that failed re-raises its error here; it is closed either way
            return _why(e)
        return None

    async def renew_now(self) -> None:
        """Open the subscription again from the last event taken, and close the old one."""
        assert self._since is not None
        since = self._since - MARGIN_NS
        self._seen = {key: ns for key, ns in self._seen.items() if ns >= since}
        self._expect = self._last if self._last is not None and self._last[0] >= since else None
        await self._stop()
        self._subscribe(since=since_param(since))
        self.renewals += 1
        self._renewed = True

    async def get(self, timeout: float) -> Mapping[str, Any] | None:
        """The next event not taken yet, or None if `timeout` passes first (or only a replayed one
        came); the subscription is renewed when due. EngineGone when the engine does not answer."""
        loop = asyncio.get_running_loop()
        if self._since is not None:
            due = self._opened + self.renew - loop.time()
            if due <= 0:
                await self.renew_now()
                due = self.renew
            timeout = min(timeout, due)
        try:
            event = await asyncio.wait_for(self._subscriber.get(), max(0.0, timeout))
        except TimeoutError:
            return None
        if event is None:
            await self._ended()
            return None
        self.heard()  # news from the engine: no ping needed for now
        return self._take(cast(Mapping[str, Any], event))

    def _take(self, event: Mapping[str, Any]) -> Mapping[str, Any] | None:
        key = event_key(event)
        if key is None:
            return event  # an engine without event times: nothing to renew from, nothing to skip
        if self._expect is not None:
            if key == self._expect:
                self._expect = None
            elif key[0] > self._expect[0]:  # newer, and the last one taken was not replayed: lost history
                self._expect, self.relist = None, True
                self.gaps += 1
        if key in self._seen:
            return None
        self._seen[key] = key[0]
        self._last = key
        self._since = key[0] if self._since is None else max(self._since, key[0])
        return event

    async def _ended(self) -> None:
        """The stream ended: opened afresh if the engine answers and it was a renewed one (a fresh one
        that ends is a reconnect's, with its backoff: an engine that ends every stream is not hammered)."""
        why = await self._stop()
        if self._renewed and await self._answers():
            self.reopened += 1
            await self.open()
            self.relist = True
            return
        raise EngineGone("event stream ended" + (f" ({why})" if why else ""))

    async def _answers(self) -> bool:
        try:
            await asyncio.wait_for(self.ping(), self.timeout)
        except aiodocker.DockerError:
            return True  # an answer: the engine is there
        except Exception:
            return False
        return True

    async def close(self) -> None:
        await self._stop()


class EngineFollower(Followed):
    """What the Docker and Swarm sources share: settings, bounded requests, and a reconnect loop that
    keeps the last state (marked stale) while the engine is away."""

    events: EventStream | None  # the current connection's

    async def _events(self, docker: aiodocker.Docker, types: Sequence[str]) -> EventStream:
        """Subscribe to the engine's events of `types` (before listing, so nothing falls between)."""
        events = EventStream(
            docker, types, renew=self.renew_interval, ping=_pinger(docker), timeout=self.ping_timeout, heard=self._heard
        )
        self.events = events
        await events.open()
        return events

    def _heard(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat()  # news from the engine: no ping needed for now

    async def _upkeep(self, docker: aiodocker.Docker, pending: Debounce, now: float) -> None:
        """After each wait: publish a settled change, re-list when a resync is due or the event
        stream may have lost events. (An engine that stops answering is the heartbeat's to find.)"""
        if pending.due(now):
            self.publish()
        if self.events is not None and self.events.relist:
            self.events.relist = False
            await self.relist(docker)
        elif self.last_sync is not None and now - self.last_sync >= self.resync_interval:
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
        renew_interval: float | None = None,
    ) -> None:
        """`renew_interval`: how often the event stream is opened again (see EventStream); by default
        the heartbeat's bound, `ping_interval + 2 * ping_timeout`, so a dead event connection is
        replaced as soon as a hung engine is found."""
        self.feed = feed
        self.options = options
        self.host = host
        self.debounce = debounce
        self.resync_interval = max(30.0, resync_interval)
        self.ping_interval, self.ping_timeout = ping_interval, ping_timeout
        self.request_timeout = request_timeout
        self.liveness = Liveness(feed, self.name, self.what)
        self.renew_interval = renew_interval if renew_interval is not None else ping_interval + 2 * ping_timeout
        self.heartbeat: Heartbeat | None = None  # the current connection's
        self.events = None
        self.relists = 0  # whole listings (for tests)
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
                self.heartbeat = Heartbeat(
                    _pinger(docker),
                    f"the engine at {url or 'its default socket'}",
                    every=self.ping_interval,
                    timeout=self.ping_timeout,
                )
                async with self.heartbeat.watching():
                    await self._follow(docker, stop, backoff)
                return "the engine ended the event stream"
            finally:
                if self.events is not None:
                    await self.events.close()
                    self.events = None
                if docker is not None:
                    await _close(docker)

        await reconnect(
            stop, connect, backoff=backoff, why=_why, lost=lambda reason, _: self.liveness.lost(with_fix(reason))
        )


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
        self.relists += 1
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
        events = await self._events(docker, ("container", "network"))
        await self.relist(docker)  # after subscribing, so nothing falls between the two
        self._connected(backoff, len(self._inspects), "containers")
        loop = asyncio.get_running_loop()
        pending = Debounce(self.debounce)
        while not stop.is_set():
            event = await events.get(pending.timeout(loop.time(), self.ping_interval))
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
