"""Runs the checks the store's endpoints ask for, and lays the results over the store's groups.

One target per (address, port, spec): an endpoint in several groups with the same check is checked
once. Targets come from the store (every endpoint whose `check` is set), so whatever source gave the
endpoint, its check goes to the endpoint's own address. A heap of due times and one timer drive the
checks: a few targets that appear together are checked at once, more (a source's first load) each at
a uniformly random point of its interval (checks spread evenly); each later check is due one interval
(jittered by +-5%, as Envoy's interval_jitter_percent) after the last was due. At most `max_running`
checks run at a time. With the default probe, a check on a kept connection runs by callbacks
(KeptConnections.start: no task); the rest, and any other probe, in a task each.

Fail static: when every target with a result fails its latest check at once (tracker.CutOff), the
checked health is frozen as it was and the checker reports itself degraded; it thaws on the first
pass. A failure that took far longer than its timeout says this process's loop was starved (the
timeout could not fire on time), and a check never sent for want of a TLS handshake slot
(keepalive.py) says it was busy: neither is counted, either way. Every change of an endpoint's
checked health is one log line, at most `log_most` a minute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import logging
import random
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, Protocol

from .. import fields
from ..encoded import Resource
from ..model import Endpoint, Group
from ..ratelimit import LogBudget
from ..source_merge import Overlay
from ..subscriptions import Watcher
from .keepalive import KeptConnections, Outcome
from .spec import HealthSpec
from .tracker import CutOff, Result, Tracker, combine

log = logging.getLogger("eds_server.health")

TargetKey = tuple[str, int, HealthSpec]
Probe = Callable[[str, int, HealthSpec], Awaitable[Result]]
JITTER = 0.05
AT_ONCE = 16  # new targets checked at once; more appearing together are spread over their interval
STARVED, STARVED_SLACK = 2.0, 0.25  # a failure that took longer than 2 x timeout + 0.25 s: the loop's fault
CLOCK_SLACK = 0.002  # uvloop's timers fire on whole milliseconds, possibly just before they are due
# Checks due within a short window start together, on one wake of the loop: 1% of a check's interval,
# at most 10 ms (never less than CLOCK_SLACK). Each due time and its jitter are as before; a check
# starts at most this much before it. Fewer wakes: 10-25% of a kept check's CPU (docs/health-checks.md).
BATCH, BATCH_SHARE = 0.010, 0.01
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _name(healthy: bool | None) -> str:
    return {None: "unchecked", True: "healthy", False: "unhealthy"}[healthy]


def _targets_of(group: Group) -> set[TargetKey]:
    return {(ep.address, ep.port, ep.check) for ep in group.endpoints if ep.check is not None}


class _Target:
    __slots__ = ("due", "groups", "key", "running", "tracker")

    def __init__(self, key: TargetKey) -> None:
        self.key = key
        self.groups: set[str] = set()
        self.tracker = Tracker()
        self.due = 0.0
        self.running = False


class _Served(dict[TargetKey, bool]):
    """Checked health as served, its unhealthy entries counted as they change: `by_health` is asked
    for on every scrape (and by the benchmark every 0.1 s), over every target. Entries are set with
    [] and removed with `pop` or `del`; the other ways to change a dict would skip the count."""

    __slots__ = ("unhealthy",)

    def __init__(self) -> None:
        super().__init__()
        self.unhealthy = 0

    def __setitem__(self, key: TargetKey, healthy: bool) -> None:
        self.unhealthy += (not healthy) - (self.get(key) is False)
        super().__setitem__(key, healthy)

    def pop(self, key: TargetKey, default: bool | None = None) -> bool | None:  # type: ignore[override]
        if key not in self:
            return default
        healthy = super().pop(key)
        self.unhealthy -= healthy is False
        return healthy

    def __delitem__(self, key: TargetKey) -> None:
        if key not in self:
            raise KeyError(key)
        self.pop(key)

    def _uncounted(self, *args: object, **kwargs: object) -> Any:
        raise TypeError("checked health is set with [] and removed with pop or del: the count follows those")

    update = setdefault = popitem = clear = __ior__ = _uncounted


class CheckedStore(Protocol):
    """What the checker uses of the store (`store.Store`): it lays `overlay` over every merged
    group, hears of every change (`watch`), reads what is served, and has the groups whose checked
    health changed merged again (`refresh`)."""

    overlay: Overlay | None

    def watch(self, watcher: Watcher) -> Callable[[], None]: ...
    def resources(self) -> Mapping[str, Resource]: ...
    def refresh(self, names: Iterable[str]) -> frozenset[str]: ...


class Checker:
    """Owns the checks of one store. Sets `store.overlay`; `run(stop)` checks until stop is set."""

    def __init__(
        self, store: CheckedStore, *, probe: Probe | None = None, max_running: int = 1024, log_most: int = 60
    ) -> None:
        self.store = store
        # plain HTTP checks reuse a connection per target; closed when the target goes or run() ends
        self.connections = KeptConnections()
        self.probe = probe or self.connections.check
        # the default probe: a check on a kept connection is begun and ended by callbacks, no task
        self._kept = probe is None
        self.max_running = max_running
        self._targets: dict[TargetKey, _Target] = {}
        self._by_group: dict[str, set[TargetKey]] = {}
        self._published = _Served()  # checked health as served (frozen while cut off); a subset of _targets
        # the same by address:port: what an endpoint whose check was just edited is served until
        # the checker has moved its target to the new check (the store merges before it is told)
        self._by_address: dict[tuple[str, int], bool] = {}
        self._heap: list[tuple[float, int, TargetKey]] = []
        self._seq = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # while running
        self._timer: asyncio.TimerHandle | None = None  # wakes _tick when the next check is due
        self._timer_at = 0.0  # when it fires (uvloop's handles do not say)
        self._poked = False  # a _tick is queued (call_soon)
        self._dirty: set[str] = set()  # groups whose served health changed: merged again soon
        self._unseen: set[str] | None = None  # groups to look at again (None: all)
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = 0  # checks in flight: tasks, and those driven by callbacks (KeptConnections.start)
        self.cut = CutOff()
        self.frozen_since: float | None = None  # wall time the checker found itself cut off
        self.checks: Counter[tuple[str, str]] = Counter()  # (kind, "pass"/"fail") -> count
        self.latency: dict[str, list[int]] = {}  # kind -> count per LATENCY_BUCKETS bound, then +Inf
        self.latency_sum: dict[str, float] = {}
        self.changes = 0  # changes of checked health published
        self._log = LogBudget(log, log_most, 60.0)
        store.overlay = self.overlay
        store.watch(self._changed)

    # -- the store's side ---------------------------------------------------------------------
    def overlay(self, group: Group) -> Group:
        """The group with each checked endpoint's health combined with its check's. Also how the
        checker hears of every merged group: a change of checks alone changes no bytes for Envoy, so
        the store announces nothing for it."""
        self._changed(frozenset((group.name,)))
        out: list[Endpoint] | None = None
        for i, ep in enumerate(group.endpoints):
            if ep.check is None:
                continue
            checked = self._published.get((ep.address, ep.port, ep.check))
            if checked is None:
                checked = self._by_address.get((ep.address, ep.port))
            health = combine(ep.health, checked)
            if health != ep.health:
                if out is None:
                    out = list(group.endpoints)
                out[i] = dataclasses.replace(ep, health=health)
        return group if out is None else dataclasses.replace(group, endpoints=tuple(out))

    def _changed(self, names: frozenset[str] | None) -> None:
        if names is None:
            self._unseen = None
        elif self._unseen is not None:
            self._unseen |= names
        self._poke()

    def _reconcile(self) -> None:
        """Add the targets of endpoints that appeared, drop those of endpoints that left."""
        resources = self.store.resources()
        names = set(resources) | set(self._by_group) if self._unseen is None else self._unseen
        self._unseen = set()
        now = asyncio.get_running_loop().time()
        new: list[_Target] = []
        gone: dict[tuple[str, int], tuple[bool | None, bool | None]] = {}  # its checked health, as served
        for name in names:
            resource = resources.get(name)
            wanted = _targets_of(resource.group) if resource is not None else set()
            had = self._by_group.pop(name, set())
            if wanted:
                self._by_group[name] = wanted
            for key in had - wanted:
                target = self._targets[key]
                target.groups.discard(name)
                if not target.groups:
                    del self._targets[key]
                    self.connections.forget(key)
                    gone[key[:2]] = (target.tracker.healthy, self._published.pop(key))
                    self.cut.forget(key)
            for key in wanted - had:
                found = self._targets.get(key)
                if found is None:
                    found = self._targets[key] = _Target(key)
                    new.append(found)
                found.groups.add(name)
        spread = len(new) > AT_ONCE  # a source's first load, say: spread over the interval, not a burst
        for target in new:
            if (kept := gone.pop(target.key[:2], None)) is not None:  # the same endpoint, its check edited
                target.tracker.healthy, published = kept
                if published is not None:
                    self._published[target.key] = published
            self._schedule(target, now + (random.uniform(0, target.key[2].interval) if spread else 0.0))
        for address in gone:  # endpoints that left for good
            self._by_address.pop(address, None)

    # -- scheduling ----------------------------------------------------------------------------
    def _schedule(self, target: _Target, due: float) -> None:
        target.due = due
        self._seq += 1
        heapq.heappush(self._heap, (due, self._seq, target.key))

    async def run(self, stop: asyncio.Event) -> None:
        """Check until `stop` is set. Driven by one timer at the next due time and by pokes (a
        change in the store, a result to publish): no task of its own waking per check."""
        self._loop = asyncio.get_running_loop()
        self._tick()
        try:
            await stop.wait()
        finally:
            self._loop = None
            if self._timer is not None:
                self._timer.cancel()
            # first: checks driven by callbacks end here, with no outcome, as the tasks cancelled next
            self.connections.close()
            self._running = len(self._tasks)  # each counts itself out as it ends
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks)

    def _poke(self) -> None:
        """Run _tick soon, once however many pokes come first."""
        if self._loop is not None and not self._poked:
            self._poked = True
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._poked = False
        if self._loop is None:
            return
        if self._unseen is None or self._unseen:
            self._reconcile()
        self._start_due(self._loop.time())
        self._flush()
        self._arm()

    def _arm(self) -> None:
        """Make sure the timer fires by the earliest due time."""
        if not self._heap or self._loop is None:
            return
        when = self._heap[0][0]
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(when, self._fire), when

    def _fire(self) -> None:
        self._timer = None
        self._tick()

    def _start_due(self, now: float) -> None:
        """Start the checks due by `now`, and those due within their batching window after it."""
        heap = self._heap
        kept, loop = (self.connections if self._kept else None), self._loop
        latest = now + max(BATCH, CLOCK_SLACK)
        while heap and heap[0][0] <= latest and self._running < self.max_running:
            due, _, key = heap[0]
            target = self._targets.get(key)
            if target is None or target.due != due or target.running:
                heapq.heappop(heap)
                continue  # removed, or rescheduled since
            if due > now + max(CLOCK_SLACK, min(BATCH, key[2].interval * BATCH_SHARE)):
                break  # not within its own window: its timer wakes the loop for it
            heapq.heappop(heap)
            target.running = True
            self._running += 1
            if kept is not None and loop is not None:
                try:
                    if kept.start(loop, key, self._ended, target):
                        continue
                except Exception as e:  # as a probe's own bug in _check
                    self._ended(target, self._internal_error(target, e))
                    continue
            self._spawn(target, None)

    def _spawn(self, target: _Target, retry: Coroutine[Any, Any, Result] | None) -> None:
        task = asyncio.create_task(self._check(target, retry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _internal_error(self, target: _Target, e: Exception) -> Result:
        """A probe's own bug: counted as a failure, never the end of checking."""
        log.exception(
            "health check of %s failed unexpectedly", fields.address_port(target.key[0], target.key[1]), exc_info=e
        )
        return Result(False, f"internal error: {type(e).__name__}", 0.0, time.time())

    async def _check(self, target: _Target, retry: Coroutine[Any, Any, Result] | None = None) -> None:
        """One check in a task: the probe, or `retry` (a callback-driven check tried again fresh)."""
        address, port, spec = target.key
        try:
            result = await (self.probe(address, port, spec) if retry is None else retry)
        except Exception as e:
            result = self._internal_error(target, e)
        except BaseException:  # cancelled: run() ends
            target.running = False
            self._running -= 1
            raise
        self._ended(target, result)

    def _ended(self, target: _Target, outcome: Outcome) -> None:
        """A check's outcome, from its task or from its connection's callback (KeptConnections.start):
        a Result, or a retry to await in a task."""
        if not isinstance(outcome, Result):
            if self._loop is None:  # stopped meanwhile: not begun
                outcome.close()
                target.running = False
                self._running -= 1
                return
            self._spawn(target, outcome)
            return
        result = outcome
        target.running = False
        self._running -= 1
        address, port, spec = target.key
        if self._targets.get(target.key) is not target:
            return  # the endpoint left meanwhile
        late = not result.ok and result.latency > STARVED * spec.timeout + STARVED_SLACK
        if result.starved or late:
            # Never sent (no TLS handshake slot), or its timeout fired that late: this process was
            # too busy, the backend is not to blame.
            self.checks[(spec.kind, "starved")] += 1
            self._log.log(
                logging.WARNING,
                "health: check of %s not counted: %s (this process was too busy to run it on time)",
                fields.address_port(address, port),
                result.reason if result.starved else f"it took {result.latency:.2f}s for a {spec.timeout:g}s timeout",
            )
        else:
            self._record(target, result)
        if self._loop is None:
            return
        now = self._loop.time()
        self._schedule(target, max(target.due + spec.interval * (1 + random.uniform(-JITTER, JITTER)), now))
        if self._dirty or self._heap[0][0] <= now:
            self._poke()  # a result to publish, or checks held back by max_running
        else:
            self._arm()

    # -- results -------------------------------------------------------------------------------
    def _record(self, target: _Target, result: Result) -> None:
        spec = target.key[2]
        self.checks[(spec.kind, "pass" if result.ok else "fail")] += 1
        self.latency_sum[spec.kind] = self.latency_sum.get(spec.kind, 0.0) + result.latency
        counts = self.latency.get(spec.kind)
        if counts is None:
            counts = self.latency[spec.kind] = [0] * (len(LATENCY_BUCKETS) + 1)
        counts[bisect_left(LATENCY_BUCKETS, result.latency)] += 1
        if self.frozen_since is not None and result.ok:
            self._thaw()
        changed = target.tracker.record(result, spec.healthy_threshold, spec.unhealthy_threshold)
        self.cut.record(target.key, result.ok)
        if self.cut.cut_off and self.frozen_since is None:
            self.frozen_since = time.time()
            log.warning(
                "health checks: all %d checked endpoints fail at once (last: %s): that is this checker "
                "cut off, not every backend; their last health is kept until a check passes again",
                self.cut.counts[1],
                result.reason,
            )
        if self.frozen_since is None and changed:
            self._publish(target)

    def _thaw(self) -> None:
        """A check passes again: what failed while the checker was cut off is no evidence. Each target
        starts counting again from the health it was frozen at."""
        self.frozen_since = None
        log.warning("health checks: a check passes again; results apply again, counted from now")
        for other in self._targets.values():
            t = other.tracker
            t.successes = t.failures = 0
            t.healthy = self._published.get(other.key)  # none yet: the next result decides

    def _publish(self, target: _Target) -> None:
        healthy = target.tracker.healthy
        assert healthy is not None
        before = self._published.get(target.key)
        self._published[target.key] = healthy
        self._by_address[target.key[:2]] = healthy
        self.changes += 1
        self._dirty |= target.groups
        last = target.tracker.last
        address, port, spec = target.key
        if before is not None or not healthy:  # a first pass is no news
            in_row = target.tracker.failures if not healthy else target.tracker.successes
            self._log.log(
                logging.WARNING if not healthy else logging.INFO,
                "health: group %s endpoint %s: %s -> %s (%s, %s, %d in a row)",
                ",".join(sorted(target.groups)),
                fields.address_port(address, port),
                _name(before),
                _name(healthy),
                last.reason if last else "?",
                spec.describe(),
                in_row,
            )

    def _flush(self) -> None:
        if self._dirty:
            dirty, self._dirty = self._dirty, set()
            self.store.refresh(dirty)

    # -- readers -------------------------------------------------------------------------------
    def last_check(self, address: str, port: int, spec: HealthSpec) -> dict[str, Any] | None:
        """What /v1/groups shows of an endpoint's check."""
        target = self._targets.get((address, port, spec))
        if target is None:
            return {"spec": spec.describe(), "result": None}
        t = target.tracker
        out: dict[str, Any] = {"spec": spec.describe(), "checked": _name(self._published.get(target.key))}
        if t.last is None:
            return {**out, "result": None}
        return {
            **out,
            "result": "pass" if t.last.ok else "fail",
            "reason": t.last.reason,
            "at": t.last.at,
            "latency_ms": round(t.last.latency * 1000, 3),
            "in_a_row": t.successes if t.last.ok else t.failures,
        }

    def by_health(self) -> Counter[str]:
        """Targets by checked health as served, from counts kept as it changes (no walk)."""
        published, unhealthy = len(self._published), self._published.unhealthy
        counts = {"unchecked": len(self._targets) - published, "healthy": published - unhealthy, "unhealthy": unhealthy}
        return Counter({name: n for name, n in counts.items() if n})

    def status(self) -> dict[str, Any]:
        """As a source's status (SourceStatus.as_json): degraded while cut off."""
        error = None
        if self.frozen_since is not None:
            failing, known = self.cut.counts
            error = (
                f"every health check fails at once ({failing} of {known} endpoints): the checker is "
                "cut off, the last checked health is kept"
            )
        return {
            "name": "health-checks",
            "loaded": True,
            "live": True,
            "stale": False,
            "targets": len(self._targets),
            "last_error": error,
        }

    @property
    def has_targets(self) -> bool:
        return bool(self._targets)

    def endpoint_check(self, ep: Endpoint) -> dict[str, Any] | None:
        """An endpoint's last check, for /v1/groups and the status page (None: not checked)."""
        return None if ep.check is None else self.last_check(ep.address, ep.port, ep.check)

    def targets(self) -> Iterable[TargetKey]:
        return self._targets.keys()
