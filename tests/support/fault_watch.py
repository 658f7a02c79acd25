"""Watch a fault from Envoy's side: real requests through its listener and a timeline of what it holds.

`FaultWatch` runs two bounded loops for the duration of an ``async with`` block:

- traffic: one GET through Envoy's listener (127.0.0.1) every ``interval`` seconds, each recorded with its
  time and status (an exception counts as failed);
- poll: every ``poll_interval`` seconds, the host count of Envoy's cluster (``/clusters``), eds-server's
  readiness (``/readyz``) and whether a loaded source is stale (``/v1/sources``) on its admin port, and, if backend
  ports are given, whether each backend answers when asked directly.

The figures the fault suite reports (requests sent and failed, host counts seen, the longest time the
group was served stale or eds-server answered nobody) come from `summary()`. Loopback only; both loops
stop at ``max_seconds`` whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.support.envoy_harness import EnvoyProcess
from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for


@dataclass
class Sample:
    t: float
    hosts: int | None  # None: Envoy's admin did not answer
    ready: bool | None  # eds-server /readyz; None: its admin did not answer (restarting)
    stale: bool | None  # some loaded source serves its last state, marked stale (/v1/sources)
    backends_up: bool | None  # every backend answered directly; None: not probed


@dataclass
class Request:
    t: float
    status: int | None  # None: no HTTP answer at all
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class FaultWatch:
    envoy: EnvoyProcess
    server: EdsServerProcess
    cluster: str = "web"
    backends: Sequence[int] = ()
    interval: float = 0.05
    poll_interval: float = 0.1
    max_seconds: float = 100.0
    requests: list[Request] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    _t0: float = 0.0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None

    def now(self) -> float:
        return time.monotonic() - self._t0

    def mark(self, what: str) -> None:
        """Note a step of the scenario on the timeline (printed with the summary)."""
        self.events.append((self.now(), what))

    async def served(self, requests: int, what: str, timeout: float = 10.0) -> None:
        """Until `requests` more requests through Envoy have been answered 200 (failures, if any, are
        the assertions' to report): traffic went on in the state the scenario is in."""
        before = sum(r.ok for r in self.requests)
        await wait_for(
            lambda: sum(r.ok for r in self.requests) - before, lambda n: n >= requests, timeout=timeout, what=what
        )

    async def __aenter__(self) -> FaultWatch:
        self._t0 = time.monotonic()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=3)
        )
        self._tasks = [asyncio.create_task(self._traffic()), asyncio.create_task(self._poll())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)
        if self._session is not None:
            await self._session.close()

    # -- loops -----------------------------------------------------------------------------------

    async def _traffic(self) -> None:
        assert self._session is not None
        url = f"http://127.0.0.1:{self.envoy.listener_port}/"
        for _ in range(int(self.max_seconds / self.interval)):  # bounded in count and time
            if self._stop.is_set() or self.now() > self.max_seconds:
                return
            started = self.now()
            try:
                async with self._session.get(url) as resp:
                    await resp.read()
                    self.requests.append(Request(started, resp.status))
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                self.requests.append(Request(started, None, f"{type(e).__name__}: {e}"))
            await self._sleep(started + self.interval - self.now())

    async def _poll(self) -> None:
        for _ in range(int(self.max_seconds / self.poll_interval)):
            if self._stop.is_set() or self.now() > self.max_seconds:
                return
            started = self.now()
            hosts, ready, stale, up = await asyncio.gather(
                self._hosts(), self._ready(), self._stale(), self._backends_up()
            )
            self.samples.append(Sample(started, hosts, ready, stale, up))
            await self._sleep(started + self.poll_interval - self.now())

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), max(0.0, seconds))

    async def _get(self, url: str) -> tuple[int, Any] | None:
        assert self._session is not None
        try:
            async with self._session.get(url) as resp:
                return resp.status, await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None

    async def _hosts(self) -> int | None:
        got = await self._get(f"{self.envoy.admin_url}/clusters?format=json")
        if got is None:
            return None
        for status in got[1].get("cluster_statuses", []):
            if status["name"] == self.cluster:
                return len(status.get("host_statuses", []))
        return None

    async def _ready(self) -> bool | None:
        got = await self._get(f"http://127.0.0.1:{self.server.admin_port}/readyz")
        return None if got is None else got[0] == 200

    async def _stale(self) -> bool | None:
        """A source that has loaded is serving its last state without following the engine."""
        got = await self._get(f"http://127.0.0.1:{self.server.admin_port}/v1/sources")
        if got is None:
            return None
        return any(s.get("loaded") and s.get("stale") for s in got[1].get("sources", []))

    async def _backends_up(self) -> bool | None:
        if not self.backends:
            return None
        assert self._session is not None
        for port in self.backends:
            try:
                # 1 s: on a loaded host (a benchmark beside the suite) a live busybox httpd once took
                # longer than 0.5 s to answer, and the scenario was called one that killed a backend
                async with self._session.get(
                    f"http://127.0.0.1:{port}/", timeout=aiohttp.ClientTimeout(total=1.0)
                ) as resp:
                    await resp.read()
                    if resp.status != 200:
                        return False
            except (aiohttp.ClientError, OSError, TimeoutError):
                return False
        return True

    # -- figures ---------------------------------------------------------------------------------

    def failed(self) -> list[Request]:
        return [r for r in self.requests if not r.ok]

    def down_windows(self) -> list[tuple[float, float]]:
        """Intervals in which some backend did not answer directly (widened to the samples around them)."""
        windows: list[tuple[float, float]] = []
        start: float | None = None
        prev = 0.0
        for s in self.samples:
            if s.backends_up is False and start is None:
                start = prev
            elif s.backends_up and start is not None:
                windows.append((start, s.t))
                start = None
            prev = s.t
        if start is not None:
            windows.append((start, self.now()))
        return windows

    def failed_while_backends_up(self) -> list[Request]:
        windows = self.down_windows()
        return [r for r in self.failed() if not any(a <= r.t <= b for a, b in windows)]

    def longest(self, flag: str) -> float:
        """Longest run of consecutive samples for which `flag` holds: "stale" (a loaded source is served
        marked stale), "unready" (eds-server answers nobody: restarting, or waiting for a source)."""

        def holds(s: Sample) -> bool:
            return bool(s.stale) if flag == "stale" else not s.ready

        best, start = 0.0, None
        for i, s in enumerate(self.samples):
            if holds(s) and start is None:
                start = s.t
            if start is not None and (not holds(s) or i == len(self.samples) - 1):
                best = max(best, s.t - start)
                start = None
        return best

    def host_counts(self) -> Counter[int | None]:
        return Counter(s.hosts for s in self.samples)

    def summary(self, name: str) -> str:
        failed = self.failed()
        counts = dict(sorted(self.host_counts().items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
        down = [(round(a, 1), round(b, 1)) for a, b in self.down_windows()]
        lines = [
            f"== {name}: {len(self.requests)} requests through Envoy, {len(failed)} failed "
            f"({len(self.failed_while_backends_up())} while every backend answered directly); "
            f"host counts seen {counts} in {len(self.samples)} polls; longest stale {self.longest('stale'):.1f}s; "
            f"longest unready {self.longest('unready'):.1f}s" + (f"; backends down {down}" if self.backends else ""),
        ]
        lines += [f"   t={t:6.2f}s {what}" for t, what in self.events]
        changes = [
            (round(s.t, 2), s.hosts, s.ready, s.stale, s.backends_up)
            for i, s in enumerate(self.samples)
            if i == 0
            or (s.hosts, s.ready, s.stale, s.backends_up)
            != (
                self.samples[i - 1].hosts,
                self.samples[i - 1].ready,
                self.samples[i - 1].stale,
                self.samples[i - 1].backends_up,
            )
        ]
        lines += [f"   t={t:6.2f}s hosts={h} ready={r} stale={st} backends_up={b}" for t, h, r, st, b in changes]
        errors = Counter(r.error or str(r.status) for r in failed)
        lines += [f"   failed: {n} x {e}" for e, n in errors.most_common(5)]
        return "\n".join(lines)

    def assert_held(self, name: str, *, min_requests: int = 50, admin_gaps: bool = False) -> None:
        """Print the figures, then: every backend stayed up, nothing failed, and Envoy's cluster was
        never empty. `admin_gaps`: Envoy's admin may miss a poll (a ring of weights near 2**32 keeps
        Envoy busy for seconds)."""
        print("\n" + self.summary(name), flush=True)
        assert len(self.requests) > min_requests and len(self.samples) > min_requests // 2
        assert admin_gaps or self.host_counts()[None] == 0, f"{name}: Envoy's admin did not answer"
        assert not self.down_windows(), f"{name}: a backend stopped answering, the scenario kept none alive"
        assert not self.failed(), self.failed()[:5]
        assert self.host_counts()[0] == 0, f"{name}: Envoy's cluster was emptied"
