"""Real requests through a real Envoy for the whole of a fault, and what Envoy's cluster held meanwhile.

    async with Traffic(envoy, "/", cluster="web", server=server) as t:
        ...  # the fault
    t.assert_clean()   # zero failed requests, the cluster never empty

A request is sent every `interval` and Envoy's /clusters polled as often, bounded by `max_seconds` (and
so by count); `server` (an EdsServerProcess) adds the longest time its groups were marked stale.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from envoy_harness import EnvoyProcess


@dataclass
class Traffic:
    envoy: EnvoyProcess
    path: str = "/"
    cluster: str = "web"
    server: Any = None  # an EdsServerProcess, for its stale flag
    interval: float = 0.05
    max_seconds: float = 120.0
    sent: int = 0
    failed: list[tuple[float, str]] = field(default_factory=list)
    host_counts: Counter[int] = field(default_factory=Counter)
    longest_stale: float = 0.0
    _task: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        stale_since: float | None = None
        for _ in range(int(self.max_seconds / self.interval)):  # bounded in count and time
            if self._stop.is_set() or loop.time() - start > self.max_seconds:
                return
            now = loop.time() - start
            try:
                status, body = await self.envoy.get(self.path)
                if status != 200:
                    self.failed.append((now, f"{status} {body[:80]}"))
            except Exception as e:  # a failed request, whatever the reason
                self.failed.append((now, repr(e)))
            self.sent += 1
            with contextlib.suppress(Exception):
                self.host_counts[len(await self.envoy.hosts(self.cluster))] += 1
            if self.server is not None:
                stale = await self._stale()
                if stale and stale_since is None:
                    stale_since = loop.time()
                if stale_since is not None:
                    self.longest_stale = max(self.longest_stale, loop.time() - stale_since)
                    if stale is False:
                        stale_since = None
            await asyncio.sleep(self.interval)

    async def _stale(self) -> bool | None:
        try:
            groups = (await self.server.admin("/v1/groups"))["groups"]
        except Exception:
            return None  # server away: not known
        return any(g["stale"] for g in groups if g["name"] == self.cluster)

    async def __aenter__(self) -> Traffic:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await asyncio.wait_for(self._task, 30)

    def summary(self) -> str:
        counts = dict(sorted(self.host_counts.items()))
        return (f"requests sent {self.sent}, failed {len(self.failed)}, host counts {counts}, "
                f"longest stale {self.longest_stale:.1f}s")

    def assert_clean(self) -> None:
        print(f"\n[{self.cluster}] {self.summary()}")
        assert self.sent > 0
        assert not self.failed, f"{self.summary()}; first failures: {self.failed[:5]}"
        assert 0 not in self.host_counts, f"the cluster was emptied: {self.summary()}"
