"""The checker over a real store, with a scripted probe: thresholds reach the served health, the
source's health combines with the check's, one target per endpoint, and fail static."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from eds_server.encode import encode_group
from eds_server.health.checker import Checker
from eds_server.health.spec import HealthSpec
from eds_server.health.tracker import Result
from eds_server.model import Endpoint, Group, Health
from eds_server.store import Store
from tests.support.waiting import wait_for

SPEC = HealthSpec("http", path="/health", interval=0.1, timeout=0.05, healthy_threshold=2, unhealthy_threshold=2)


class Script:
    """Answers per port: True passes, False fails; counts the checks. `late` ports fail as a check
    whose timeout fired long after it was due (a starved loop); `unsent` ones as a check never sent
    for want of a TLS handshake slot."""

    def __init__(self) -> None:
        self.up: dict[int, bool] = {}
        self.late: set[int] = set()
        self.unsent: set[int] = set()
        self.calls: Counter[int] = Counter()

    async def probe(self, address: str, port: int, spec: HealthSpec) -> Result:
        self.calls[port] += 1
        if port in self.late:
            return Result(False, "timed out after 0.05s", 10 * spec.timeout + 1, time.time())
        if port in self.unsent:
            return Result(False, "not sent: no TLS handshake slot in 0.10s", 0.1, time.time(), starved=True)
        ok = self.up.get(port, True)
        return Result(ok, "HTTP 200" if ok else "HTTP 500", 0.001, time.time())


def endpoints(*ports: int, health: Health = Health.UNKNOWN, check: HealthSpec | None = SPEC) -> tuple[Endpoint, ...]:
    return tuple(Endpoint("127.0.0.1", p, health=health, check=check) for p in ports)


@asynccontextmanager
async def running(groups: dict[str, Group]) -> AsyncIterator[tuple[Store, Checker, Script]]:
    store = Store(encode_group)
    store.add_source("file")
    script = Script()
    checker = Checker(store, probe=script.probe)
    store.update("file", groups)
    stop = asyncio.Event()
    task = asyncio.create_task(checker.run(stop))
    try:
        yield store, checker, script
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


def health(store: Store, name: str) -> dict[int, Health]:
    return {ep.port: ep.health for ep in store.resources()[name].group.endpoints}


async def test_fall_and_rise_reach_what_is_served(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "eds_server.health")
    async with running({"web": Group("web", endpoints(1, 2, 3))}) as (store, checker, script):
        await wait_for(lambda: health(store, "web"), lambda h: set(h.values()) == {Health.HEALTHY}, timeout=5)
        version = store.get("web").version
        script.up[2] = False
        await wait_for(lambda: health(store, "web")[2], lambda h: h == Health.UNHEALTHY, timeout=5)
        assert store.get("web").version != version
        assert script.calls[2] >= 2  # never on the first failure: unhealthy_threshold is 2
        script.up[2] = True
        await wait_for(lambda: health(store, "web")[2], lambda h: h == Health.HEALTHY, timeout=5)
        lines = [r.getMessage() for r in caplog.records if "endpoint 127.0.0.1:2" in r.getMessage()]
        assert lines == [
            "health: group web endpoint 127.0.0.1:2: healthy -> unhealthy (HTTP 500, http /health every 0.1s, "
            "2 in a row)",
            "health: group web endpoint 127.0.0.1:2: unhealthy -> healthy (HTTP 200, http /health every 0.1s, "
            "2 in a row)",
        ]
        last = checker.last_check("127.0.0.1", 2, SPEC)
        assert last is not None and last["result"] == "pass" and last["checked"] == "healthy"
        assert checker.checks[("http", "fail")] >= 2 and checker.status()["last_error"] is None


async def test_source_health_combines_worse_wins_draining_stays() -> None:
    eps = (*endpoints(1, health=Health.DRAINING), *endpoints(2, health=Health.DEGRADED), *endpoints(3))
    plain = endpoints(4, check=None)
    async with running({"web": Group("web", (*eps, *plain))}) as (store, _, script):
        script.up.update({1: False, 2: True, 3: True, 4: False})
        await wait_for(lambda: health(store, "web"), lambda h: h[3] == Health.HEALTHY, timeout=5)
        assert health(store, "web") == {1: Health.DRAINING, 2: Health.DEGRADED, 3: Health.HEALTHY, 4: Health.UNKNOWN}
        assert script.calls[4] == 0  # no check, no probe


async def test_one_target_per_endpoint_across_groups_and_gone_with_it() -> None:
    groups = {"a": Group("a", endpoints(1)), "b": Group("b", endpoints(1))}
    async with running(groups) as (store, checker, script):
        await wait_for(lambda: script.calls[1], lambda n: n >= 3, timeout=5)
        assert len(list(checker.targets())) == 1
        store.update("file", {"a": Group("a", endpoints(1))})
        await wait_for(lambda: len(list(checker.targets())), lambda n: n == 1, timeout=5)
        store.update("file", {})
        await wait_for(lambda: len(list(checker.targets())), lambda n: n == 0, timeout=5)
        calls = script.calls[1]
        await asyncio.sleep(0.3)
        assert script.calls[1] <= calls + 1  # at most the one already running


async def test_new_endpoint_checked_at_once_and_out_after_its_threshold() -> None:
    async with running({"web": Group("web", endpoints(1))}) as (store, _, script):
        await wait_for(lambda: health(store, "web"), lambda h: h[1] == Health.HEALTHY, timeout=5)
        script.up[2] = False
        store.update("file", {"web": Group("web", endpoints(1, 2))})
        await wait_for(lambda: health(store, "web"), lambda h: h[2] == Health.UNHEALTHY, timeout=5)
        assert script.calls[2] == SPEC.unhealthy_threshold  # checked at once, then every interval


async def test_every_check_failing_at_once_is_the_checker_cut_off() -> None:
    async with running({"web": Group("web", endpoints(1, 2)), "api": Group("api", endpoints(3))}) as (
        store,
        checker,
        script,
    ):
        await wait_for(
            lambda: health(store, "web") | health(store, "api"),
            lambda h: set(h.values()) == {Health.HEALTHY},
            timeout=5,
        )
        script.up.update({1: False, 2: False, 3: False})  # the checker's network gone
        await wait_for(checker.status, lambda s: s["last_error"], timeout=5)
        await wait_for(lambda: min(script.calls.values()), lambda n: n >= 8, timeout=5)
        assert set((health(store, "web") | health(store, "api")).values()) == {Health.HEALTHY}
        assert "cut off" in checker.status()["last_error"]
        script.up.update({1: True, 3: True})  # back: port 2 really is down, and now says so
        await wait_for(lambda: health(store, "web")[2], lambda h: h == Health.UNHEALTHY, timeout=5)
        assert checker.status()["last_error"] is None
        assert health(store, "web")[1] == Health.HEALTHY and health(store, "api")[3] == Health.HEALTHY


async def test_a_starved_loop_is_not_the_backends_fault() -> None:
    async with running({"web": Group("web", endpoints(1, 2))}) as (store, checker, script):
        await wait_for(lambda: health(store, "web"), lambda h: set(h.values()) == {Health.HEALTHY}, timeout=5)
        script.late.add(1)
        await wait_for(lambda: checker.checks[("http", "starved")], lambda n: n >= 4, timeout=5)
        assert health(store, "web")[1] == Health.HEALTHY
        script.late.clear()
        script.unsent.add(2)  # and a check never sent: not a failure either
        await wait_for(lambda: checker.checks[("http", "starved")], lambda n: n >= 8, timeout=5)
        assert health(store, "web") == {1: Health.HEALTHY, 2: Health.HEALTHY}
        assert checker.checks[("http", "fail")] == 0 and checker.status()["last_error"] is None


async def test_an_edited_check_keeps_the_endpoints_checked_health() -> None:
    async with running({"web": Group("web", endpoints(1, 2))}) as (store, checker, script):
        script.up[2] = False
        await wait_for(lambda: health(store, "web")[2], lambda h: h == Health.UNHEALTHY, timeout=5)
        slower = dataclasses.replace(SPEC, interval=0.2)
        store.update("file", {"web": Group("web", endpoints(1, 2, check=slower))})
        await wait_for(lambda: {k[2] for k in checker.targets()}, lambda s: s == {slower}, timeout=5)
        assert health(store, "web")[2] == Health.UNHEALTHY  # not back to the source's health meanwhile


async def test_checks_due_close_together_start_on_one_wake_never_more_than_their_window_early() -> None:
    """Checks due within 1% of their interval (at most 10 ms) of a wake start on it: fewer wakes of the
    loop than checks, and none starts more than its window before its due time."""
    from eds_server.health import checker as module

    slow = dataclasses.replace(SPEC, interval=1.0)  # window 10 ms
    fast = dataclasses.replace(SPEC, interval=0.2)  # window 2 ms
    groups = {
        "a": Group("a", endpoints(*range(1, 301), check=slow)),
        "b": Group("b", endpoints(*range(301, 311), check=fast)),
    }
    early: list[float] = []  # how long before its due time each check started
    async with running(groups) as (_store, checker, script):
        loop = asyncio.get_running_loop()
        ticks = [0]  # wakes by the checker's timer
        fire = checker._fire

        def counted() -> None:
            ticks[0] += 1
            fire()

        checker._fire = counted  # type: ignore[method-assign]
        probe = script.probe

        async def timed(address: str, port: int, spec: HealthSpec) -> Result:
            target = checker._targets[(address, port, spec)]
            early.append((target.due - loop.time()) / max(module.CLOCK_SLACK, min(module.BATCH, spec.interval / 100)))
            return await probe(address, port, spec)

        checker.probe = timed
        await wait_for(lambda: sum(script.calls.values()), lambda n: n >= 1200, timeout=20)
        checks, woken = sum(script.calls.values()), ticks[0]
    assert max(early) <= 1.0  # never before its own window
    assert woken < 0.45 * checks, (woken, checks)  # about 4 a wake (300 a second, 10 ms); 1.6 with 2 ms


def recount(checker: Checker) -> Counter[str]:
    """by_health the slow way: every target's checked health as served, looked up."""
    names = {None: "unchecked", True: "healthy", False: "unhealthy"}
    return Counter(names[checker._published.get(key)] for key in checker.targets())


async def test_counts_by_health_follow_flips_edits_and_removals() -> None:
    """by_health is kept as results change, not walked: it must equal a recount through a fall, an
    edited check (the health carried over), a rise, and targets leaving healthy and unhealthy."""
    async with running({"web": Group("web", endpoints(1, 2, 3))}) as (store, checker, script):
        await wait_for(lambda: checker.by_health(), lambda c: c == {"healthy": 3}, timeout=5)
        script.up[2] = script.up[3] = False
        await wait_for(lambda: checker.by_health(), lambda c: c == {"healthy": 1, "unhealthy": 2}, timeout=5)
        assert checker.by_health() == recount(checker)
        slower = dataclasses.replace(SPEC, interval=0.2)
        store.update("file", {"web": Group("web", (*endpoints(1, 2), *endpoints(3, check=slower)))})
        await wait_for(lambda: {k[2] for k in checker.targets()}, lambda s: s == {SPEC, slower}, timeout=5)
        assert checker.by_health() == recount(checker) == {"healthy": 1, "unhealthy": 2}
        script.up[3] = True
        await wait_for(lambda: checker.by_health(), lambda c: c == {"healthy": 2, "unhealthy": 1}, timeout=5)
        store.update("file", {"web": Group("web", endpoints(3, 4))})  # 1 (healthy) and 2 (unhealthy) leave
        await wait_for(lambda: len(list(checker.targets())), lambda n: n == 2, timeout=5)
        assert checker.by_health() == recount(checker)
        await wait_for(lambda: checker.by_health(), lambda c: c == {"healthy": 2}, timeout=5)
        store.update("file", {})
        await wait_for(lambda: checker.by_health(), lambda c: c == {}, timeout=5)


def test_served_health_is_changed_only_in_ways_that_keep_its_count() -> None:
    from eds_server.health.checker import _Served

    served = _Served()
    a, b = ("10.0.0.1", 80, SPEC), ("10.0.0.2", 80, SPEC)
    served[a], served[b] = False, False
    served[a] = True
    assert served.unhealthy == 1
    assert served.pop(a) is True and served.pop(a) is None and served.pop(a, False) is False
    del served[b]
    assert served.unhealthy == 0 and not served
    for change in (lambda: served.update({a: False}), served.clear, lambda: served.setdefault(a, False)):
        with pytest.raises(TypeError):
            change()
    assert served.unhealthy == 0 and not served
