"""What every source is to the rest of the server, and the pieces more than one of them needs.

A source publishes whole states of its groups to a `Feed` (the App's `Aggregator`, which alone
holds the store and declares the sources to it in one merge order) and says how it is doing through
`status()`; the App, the status page, `/v1/sources`, `/readyz` and the metrics know sources by that
alone. A source never sees the store: what it may ask and tell is the `Feed` below. The followers
of something remote (Docker, Swarm, Kubernetes, etcd, an upstream eds-server) share the rest: a
jittered backoff between attempts, one log line per change of health rather than per attempt, and
marking their groups stale while the last known state is served without being followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..model import Group

if TYPE_CHECKING:
    from ..encoded import Resource

log = logging.getLogger("eds_server.sources")


@dataclass(frozen=True)
class SourceStatus:
    """loaded: it delivered its first state; live: it follows what it reads from now; stale: its
    last state is served but no longer followed (loaded and not live); last_error: why not live, or
    the last refused input."""

    name: str
    loaded: bool
    live: bool
    last_error: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)  # counts, paths: shown as they are

    @property
    def stale(self) -> bool:
        return self.loaded and not self.live

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "loaded": self.loaded,
            "live": self.live,
            "stale": self.stale,
            **self.details,
            "last_error": self.last_error,
        }


class Source(Protocol):
    """One provider of groups. The App starts each (in merge order), runs each until stopped."""

    name: str

    async def start(self) -> None:
        """What must hold before serving at all (e.g. a valid upstreams file); raising refuses to start."""

    async def run(self, stop: asyncio.Event) -> None:
        """Follow what it reads until `stop` is set, publishing to its feed; never raises for a fault
        of what it follows (that is `status().last_error`)."""

    def status(self) -> SourceStatus: ...


class Feed(Protocol):
    """What a source may tell the server, and ask of it, by its own name: the aggregator's side
    that sources see (Traefik's providers get a channel the same way). The merge order is not
    the feed's to choose: the App declares every source in one list (`app.MERGE_ORDER`)."""

    def publish(self, source: str, groups: Mapping[str, Group]) -> frozenset[str]:
        """Everything `source` provides now (a whole state); the names whose assignment changed."""
        ...

    def mark_stale(self, source: str, stale: bool) -> None:
        """`source` lost (or regained) what it follows; its last state keeps being served."""

    def loaded(self, source: str) -> bool:
        """`source` delivered its first state."""
        ...

    @property
    def serving(self) -> bool:
        """Envoy is answered (every source loaded, or the startup timeout passed)."""
        ...

    def problems_with(self, source: str, name: str, part: Group | None) -> list[str]:
        """What Envoy would reject in group `name` if `source` gave `part` (None: nothing) for it."""
        ...


class RelayFeed(Feed, Protocol):
    """A relay's feed: it is the only source of its server, passes its upstream's encoded
    resources on as they are, and asks its upstream only for the names someone follows."""

    def publish_resources(self, source: str, resources: Mapping[str, Resource], removed: Iterable[str] = ()) -> None:
        """Resources as the upstream encoded them; a removed name is withheld again (Envoy keeps what it has)."""

    def held(self) -> Mapping[str, Resource]:
        """Every resource served now."""
        ...

    def withhold(self, interest: Callable[[tuple[str, ...], tuple[str, ...]], None]) -> Iterable[str]:
        """Answer nothing for a name not received yet, and call `interest(added, removed)` when the
        followed names change; returns the names followed now."""
        ...


class Backoff:
    """Exponential backoff in seconds, capped and jittered: the `jitter` share of each delay is
    random (a half by default, so that many followers of one peer do not come back together; 1: any
    delay up to it, for retries that must get out of step with a rival's)."""

    def __init__(self, initial: float = 0.2, cap: float = 5.0, jitter: float = 0.5) -> None:
        self.initial, self.cap, self.jitter, self.attempt = initial, cap, jitter, 0

    def next(self) -> float:
        delay = min(self.cap, self.initial * 2**self.attempt)
        self.attempt += 1
        return random.uniform(delay * (1 - self.jitter), delay)

    def reset(self) -> None:
        self.attempt = 0


class Comeback:
    """Whether a backoff may be cut short: only once the remote end was seen away (a refused
    connection, a failed probe) and then answers a probe. A server that answers probes while the real
    requests keep failing (slow, overloaded, refusing us) gets the full backoff, not a retry a second."""

    def __init__(self) -> None:
        self.seen_away = False

    def away(self) -> None:
        self.seen_away = True

    def reset(self) -> None:
        self.seen_away = False

    def probed(self, answered: bool) -> bool:
        """True: try now. Each sighting of the way back is used once; the next cut needs a new absence."""
        if not answered:
            self.seen_away = True
            return False
        back, self.seen_away = self.seen_away, False
        return back


class SharedProbe:
    """A cheap "are you there?" asked for many waiters: one probe at a time, its answer shared for
    `fresh` seconds, so that every watch waiting out a backoff costs the remote end one request a
    second in all, not one each."""

    def __init__(
        self, probe: Callable[[], Awaitable[bool]], fresh: float = 0.5, clock: Callable[[], float] | None = None
    ) -> None:
        self.probe, self.fresh = probe, fresh
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.probes = 0  # sent, for tests
        self._task: asyncio.Future[bool] | None = None
        self._at = 0.0

    async def _ask(self) -> bool:
        try:
            return await self.probe()
        except Exception:  # a probe that fails says "not there", whatever the reason
            return False

    async def __call__(self) -> bool:
        now = self.clock()
        if self._task is None or (self._task.done() and now - self._at >= self.fresh):
            self._at, self.probes = now, self.probes + 1
            self._task = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._task)


async def pause(
    delay: float, stop: asyncio.Event, check: Callable[[], Awaitable[bool]] | None = None, every: float = 1.0
) -> bool:
    """Wait out a backoff of `delay` seconds, or until `stop`; every `every` seconds ask `check`
    whether the next attempt should be made now instead. True when `check` cut it short. The checks
    fall on the loop clock's multiples of `every`, so that the pauses of many watches check together
    (and share one probe)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + delay
    while not stop.is_set():
        now = loop.time()
        left = deadline - now
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), min(every - now % every, left))
        if stop.is_set() or loop.time() >= deadline:
            return False
        if check is not None and await check():
            return True
    return False


async def reconnect(
    stop: asyncio.Event,
    connect: Callable[[], Awaitable[str]],
    *,
    backoff: Backoff,
    why: Callable[[Exception], str],
    lost: Callable[[str, float], None],
    check: Callable[[], Awaitable[bool]] | None = None,
    every: float = 1.0,
) -> None:
    """The reconnect loop of the followers of something remote, until `stop` is set.

    `connect()` is one connection's life: it lists, follows, resets `backoff` once it follows again,
    and returns why it ended (or raises: `why` puts the exception in words). Unless stopping meanwhile,
    `lost(reason, delay)` says so (the source's Liveness marks it stale: its last state keeps being
    served) and the next attempt comes after `delay` seconds of jittered backoff, or sooner if
    `check`, asked every `every` seconds, says the peer is back."""
    while not stop.is_set():
        try:
            reason = await connect()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # whatever it was, keep serving and try again
            reason = why(e)
        if stop.is_set():
            return
        delay = backoff.next()
        lost(reason, delay)
        await pause(delay, stop, check, every)


class Hung(TimeoutError):
    """The peer stopped answering while its connections stay open: a frozen process, a black-holed
    route. Its words say which peer and for how long; a TimeoutError, as any request left unanswered."""


class Heartbeat:
    """Tells a hung peer from a quiet one, as fast as a dead one is told.

    A peer frozen with SIGSTOP keeps its TCP connections open and its kernel keeps accepting: a watch
    or an event stream waiting for news waits forever, and a quiet peer looks the same. So, while
    some work is `guard`ed, once nothing was heard from the peer for `every` seconds (`beat` says
    something was: an event, an answer) a cheap probe is sent; unanswered within `timeout`, it is
    sent again at once (one slow answer is a busy peer, not a hung one), and unanswered twice, every
    guarded block is ended with `Hung`. The source then does what it does for a dead peer: marks
    itself stale (its last state keeps being served) and reconnects. A hang is found within
    `every + 2 * timeout` seconds of the peer's last sign of life (the bound the docs state: 5 s with
    the defaults). Any answer counts, an error included: the question is only whether the peer is
    there.
    """

    def __init__(
        self,
        probe: Callable[[], Awaitable[object]],
        what: str,
        *,
        every: float = 1.0,
        timeout: float = 2.0,
        replied: Callable[[], None] | None = None,
    ) -> None:
        """`replied`: called when a probe got a proper reply (not an error), for a source that learns
        nothing else when its peer comes back with nothing new to say."""
        self.probe, self.what, self.every, self.timeout = probe, what, every, timeout
        self.replied = replied
        self.probes = 0  # sent, for tests
        self.hangs = 0  # found
        self._heard = 0.0
        self._guarded: set[asyncio.Timeout] = set()
        self._why = ""

    def beat(self) -> None:
        """The peer said something: no probe is needed for another `every` seconds."""
        self._heard = asyncio.get_running_loop().time()

    def heard_since(self, moment: float) -> bool:
        """Whether the peer said something (or answered a probe) after `moment`, a loop time."""
        return self._heard > moment

    @contextlib.asynccontextmanager
    async def guard(self) -> AsyncIterator[None]:
        """Run the block until it ends or the peer is found hung (then `Hung` is raised from it)."""
        scope = asyncio.timeout(None)
        self._guarded.add(scope)
        self.beat()  # a new connection: the peer gets `every` seconds before it is probed
        try:
            async with scope:
                yield
        except TimeoutError:
            if scope.expired():  # only run() expires it
                raise Hung(self._why) from None
            raise
        finally:
            self._guarded.discard(scope)

    async def _answered(self) -> bool | None:
        """True: answered; False: not within the timeout; None: cannot tell, our own loop was busy
        past the deadline (an answer may be waiting unread: probe again rather than cry hang)."""
        self.probes += 1
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            async with asyncio.timeout(self.timeout):
                await self.probe()
        except TimeoutError:
            return None if loop.time() - sent > self.timeout * 1.5 else False
        except Exception:  # an error is an answer: the peer is there
            return True
        if self.replied is not None:
            self.replied()
        return True

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Probe while anything is guarded and the peer is quiet, until `stop` (or cancelled)."""
        loop = asyncio.get_running_loop()
        missed = 0  # probes running not answered in time
        while stop is None or not stop.is_set():
            quiet = loop.time() - self._heard
            if not missed and (quiet < self.every or not self._guarded):
                await asyncio.sleep(max(0.05, self.every - quiet) if self._guarded else self.every)
                continue
            answered = await self._answered()
            if answered is None:
                continue
            if answered:
                missed = 0
                self.beat()
                continue
            missed += 1
            if missed < 2:
                continue  # asked again at once
            missed = 0
            self.hangs += 1
            self._why = f"{self.what} did not answer within {self.timeout:g} s, twice running (hung or cut off)"
            for scope in list(self._guarded):
                if scope.when() is None:
                    scope.reschedule(loop.time())  # ends the block with TimeoutError, made Hung in guard()

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """`guard` one block, probing for it meanwhile: a connection's life, for a source that has one."""
        prober = asyncio.create_task(self.run())
        try:
            async with self.guard():
                yield
        finally:
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)


class FileStamps:
    """Whether files changed since last looked at (rewritten, replaced, created or removed), by
    their stat: a rotated credential file is noticed without reading it."""

    def __init__(self, paths: Iterable[str] = ()) -> None:
        self.paths = list(paths)
        self.seen = self.now()

    def now(self) -> tuple[tuple[int, int, int, int] | None, ...]:
        stamps: list[tuple[int, int, int, int] | None] = []
        for path in self.paths:
            try:
                st = os.stat(path)
                stamps.append((st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def changed(self) -> bool:
        return self.now() != self.seen

    def take(self, paths: Iterable[str] | None = None) -> None:
        """From now on, compare with the files as they are now (the paths given, if any)."""
        if paths is not None:
            self.paths = list(paths)
        self.seen = self.now()


class Debounce:
    """Changes this close together are published as one: the first change starts the wait, and
    the publish comes `delay` after it however many follow (a steady stream cannot hold it off)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.since: float | None = None  # when the first unpublished change came

    def changed(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def timeout(self, now: float, longest: float) -> float:
        """How long to wait for the next event: at most `longest`, less if a publish falls due."""
        return longest if self.since is None else max(0.0, min(longest, self.delay - (now - self.since)))

    def due(self, now: float) -> bool:
        """True (once) when the pending changes should be published now."""
        if self.since is not None and now - self.since >= self.delay:
            self.since = None
            return True
        return False


class WarnOnce:
    """Per object, log a warning when it first appears or changes, not on every publish."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._warned: dict[str, str] = {}

    def update(self, warnings: Mapping[str, str | None]) -> None:
        for oid, warning in warnings.items():
            if warning and self._warned.get(oid) != warning:
                self._log.warning("%s", warning)
            if warning:
                self._warned[oid] = warning
            else:
                self._warned.pop(oid, None)

    def replace(self, warnings: Mapping[str, str]) -> None:
        """The whole set of current warnings: objects not in it are forgotten."""
        self.update(warnings)
        self._warned = dict(warnings)

    def forget(self, oid: str) -> None:
        self._warned.pop(oid, None)

    def keep(self, oids: set[str] | Mapping[str, Any]) -> None:
        self._warned = {oid: w for oid, w in self._warned.items() if oid in oids}


class Liveness:
    """A remote source's health: live or not, why not, told to the feed (stale marking) and logged
    once per change rather than once per retry."""

    def __init__(self, feed: Feed, name: str, what: str) -> None:
        self.feed, self.name, self.what = feed, name, what
        self.live_now = False
        self.last_error: str | None = None

    @property
    def loaded(self) -> bool:
        """It delivered its first state."""
        return self.feed.loaded(self.name)

    def live(self, detail: str = "") -> None:
        if not self.live_now:
            log.info("%s: following %s%s", self.name, self.what, f": {detail}" if detail else "")
        self.live_now, self.last_error = True, None
        self.feed.mark_stale(self.name, False)

    def lost(self, reason: str, retry_in: float | None = None, again: bool = False, then: str | None = None) -> None:
        """`reason` is what happened, in words; with `retry_in` it is said as it is, followed by when
        the next attempt comes, rather than as "<what> unreachable (reason)"; with `then`, followed by
        that instead (a fault that is not the remote end's, such as its configuration). `again`: said
        even if already not live (the source knows the failure changed in kind)."""
        if self.live_now or self.last_error is None or again:
            meanwhile = (
                "serving the last known endpoints (stale)"
                if self.loaded
                else "not loaded yet: serving without it (--startup-timeout passed)"
                if self.feed.serving
                else "not loaded yet: nothing is answered to Envoy until it is (Envoy keeps what it has)"
            )
            if then is not None:
                log.warning("%s: %s; %s; %s", self.name, reason, meanwhile, then)
            elif retry_in is not None:
                log.warning("%s: %s; %s; reconnecting in %.1f s", self.name, reason, meanwhile, retry_in)
            else:
                log.warning(
                    "%s: %s unreachable (%s); %s%s",
                    self.name,
                    self.what,
                    reason,
                    meanwhile,
                    " and retrying" if self.loaded else "; retrying",
                )
        self.live_now = False
        self.last_error = reason
        self.feed.mark_stale(self.name, True)

    def refused(self, reason: str) -> None:
        """Input refused while connected (the last good state stays): said as `last_error` on the
        status, `/readyz` and the metrics until the next good input."""
        self.last_error = reason

    def status(self, **details: Any) -> SourceStatus:
        return SourceStatus(self.name, self.loaded, self.live_now, self.last_error, details)


class Followed:
    """What a source that follows something remote shows of its Liveness."""

    liveness: Liveness

    @property
    def connected(self) -> bool:
        return self.liveness.live_now

    @property
    def last_error(self) -> str | None:
        return self.liveness.last_error
