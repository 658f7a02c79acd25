"""Whether the API server is there, and what the source says of it while it is not.

An API server that stops answering with its connections open (a frozen process: a watch looks just
like a quiet one) is found by a heartbeat: once nothing was heard for a second, GET /livez with two
seconds to answer, twice running (any status counts); unanswered, every list and watch in flight is
ended and the source is marked stale, about 5 s after its last answer, as for a server that went away.
A watch gone silent while /livez answers on another connection is its own connection's fault, not
the server's (`answers`).

A backoff grows to 30 s during a long outage, and the server's return should not wait that out:
while the API server is away it is probed (GET /readyz, short timeout) about once a second, one
probe shared by every scope, and the wait ends once it answers again (`try_now`); so does a rewrite
of the configuration. Apart from the source, so that how an outage is found, said and ended reads
without the requests and the view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from .base import Backoff, Comeback, Feed, Heartbeat, Liveness, SharedProbe
from .kubernetes_api import Requests, Scope, went_away
from .kubernetes_config import Configuration

log = logging.getLogger("eds_server.sources.kubernetes")


class Outage:
    """Which scopes are failing and why: said once per outage, and again when its nature changes
    while it lasts (the API server back but refusing the credentials is news to act on, not more of
    the same)."""

    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness
        self.down: dict[Scope, str] = {}  # scopes failing now, and why
        self._said = False  # whether this outage was logged
        self._nature: int | None = None  # and its kind: None away, else the status the server refused us with

    def failed(self, scope: Scope, reason: str, retry_in: float, error: BaseException) -> None:
        self.down[scope] = reason
        # the API server away (whichever way) is one thing; each status it refuses us with is another
        nature = None if went_away(error) is not False else int(getattr(error, "status", 0))
        again = self._said and nature != self._nature
        self._said = True
        self._nature = nature
        self.liveness.lost(reason, retry_in, again=again)

    def recovered(self, scope: Scope) -> bool:
        """`scope` follows again; True when no scope is failing any more."""
        self.down.pop(scope, None)
        if not self.down:
            self._said, self._nature = False, None
        return not self.down


class ApiLiveness:
    """The source's health (`liveness`, `outage`), the `heartbeat` that finds a hung API server, the
    shared `probe` that ends a backoff early, and the backoff's shape (first delay, cap)."""

    def __init__(
        self,
        feed: Feed,
        name: str,
        requests: Requests,
        config: Configuration,
        *,
        probe_every: float = 1.0,
        probe_timeout: float = 2.0,
        backoff: tuple[float, float] = (0.2, 30.0),
    ) -> None:
        self.name, self.requests, self.config = name, requests, config
        self.probe_every, self.probe_timeout, self.backoff_shape = probe_every, probe_timeout, backoff
        self.liveness = Liveness(feed, name, "the API server")
        self.outage = Outage(self.liveness)  # the scopes failing now, said once per outage
        self.probe = SharedProbe(self._probe, fresh=probe_every / 2)
        self.heartbeat = Heartbeat(requests.livez, "the API server", every=probe_every, timeout=probe_timeout)
        self._answering = True  # the last probe's answer, to say once that the server is back

    def backoff(self) -> Backoff:
        """A new backoff of this shape: one per scope."""
        return Backoff(*self.backoff_shape)

    def serving(self, host: str) -> None:
        """A configuration was loaded: the heartbeat names its server."""
        self.heartbeat.what = f"the API server at {host}"

    async def _probe(self) -> bool:
        answered = await self.requests.readyz()
        if answered and not self._answering:
            log.info("%s: the API server answers again; reconnecting now", self.name)
        self._answering = answered
        return answered

    async def answers(self) -> bool:
        """After a watch went silent: whether the API server answers on another connection. GET /livez
        with the heartbeat's timeout; unanswered, the heartbeat's verdict. Awaited in the heartbeat's
        guard, so that a hung server is said hung in the heartbeat's words (Hung is raised here)
        whichever of the two noticed first."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.probe_timeout):
                await self.requests.livez()
            self.heartbeat.beat()
            return True
        bound = self.probe_every + 2 * self.probe_timeout
        while loop.time() - asked < 2 * bound:  # the heartbeat decides well before this
            if self.heartbeat.heard_since(asked):
                return True
            await asyncio.sleep(0.05)
        return False

    def try_now(self, comeback: Comeback, loads: int, probe: bool) -> Callable[[], Awaitable[bool]]:
        """When to end a backoff early: the configuration changed, or the API server, seen away,
        answers again."""

        async def check() -> bool:
            if self.config.changed() or self.config.loads != loads:
                return True
            return probe and comeback.probed(await self.probe())

        return check
