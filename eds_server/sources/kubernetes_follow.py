"""Following the API server: one list+watch loop per kind and namespace followed.

A watch resumes from the last resourceVersion it saw (bookmarks keep it fresh); `410 Gone` means
that version is no longer kept, so the kind is listed again and the listing replaces what we knew.
Each watch lasts WATCH_SECONDS and is renewed from where it was (`renewals`), with no listing. A
watch that stalls while the API server answers on another connection is opened again at once from
where it was (`reopened`), and the source stays live; one opened again that way and stalling again
before its first proper end is a failure as any other (stale, backoff): a path that stalls every
watch is not hidden. Other errors back off, until the API server answers again or its configuration
is rewritten; meanwhile the last endpoints keep being served, marked stale. Apart from the source,
so that the order of list, watch, renewal and retry reads in one loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from ..ratelimit import LogBudget
from .base import Comeback, pause
from .kubernetes_api import Cursor, Gone, Kind, Requests, Scope, Stalled, Unauthorized, describe, went_away
from .kubernetes_config import Configuration
from .kubernetes_liveness import ApiLiveness
from .kubernetes_view import HeldView

log = logging.getLogger("eds_server.sources.kubernetes")

RENEWED_AFTER = 1.0  # a watch that lasted longer was ended by the server when asked; shorter, it may be going away


class Follower:
    """Keeps `held` following the API server through `requests`, scope by scope, reloading `config`
    when it changes or is refused, and telling `health` how it goes; counts for the status."""

    def __init__(
        self, name: str, config: Configuration, requests: Requests, health: ApiLiveness, held: HeldView
    ) -> None:
        self.name, self.config, self.requests, self.health, self.held = name, config, requests, health, held
        self.renewals = 0  # watches ended by the API server when asked, and resumed
        self.reopened = 0  # watches gone silent while the API server answered, opened again at once
        self.relists = 0
        self._reopens_said = LogBudget(log, most=1, window=300.0)

    def _recovered(self, scope: Scope) -> None:
        liveness = self.health.liveness
        if self.health.outage.recovered(scope) and self.held.loaded and not liveness.live_now:
            liveness.live(self.held.summary())

    async def follow(self, kind: Kind, namespace: str | None, stop: asyncio.Event) -> None:
        """List, then watch from the list's version, watch after watch; on 410 list again; a watch
        gone silent is opened again at once while the API server answers; on errors back off, until
        the API server answers again or its configuration is rewritten."""
        scope = (kind, namespace)
        backoff = self.health.backoff()
        comeback = Comeback()
        at = Cursor()
        reopen = True  # a silent watch may be opened again at once (not one opened so, before it ends)
        loop = asyncio.get_running_loop()
        heartbeat = self.health.heartbeat

        def opened() -> None:
            self._recovered(scope)
            backoff.reset()
            comeback.reset()

        def event(etype: str, obj: Mapping[str, Any]) -> None:
            self.held.apply(kind, etype, obj)

        while not stop.is_set():
            if self.config.changed():
                with contextlib.suppress(Exception):  # kept as it is; the error is the next attempt's
                    await self.config.reload(changed=True)
            api, loads = self.config.api, self.config.loads
            request = "list" if at.version is None else "watch"
            try:
                if at.version is None:
                    async with heartbeat.guard():
                        items, version = await self.requests.list(kind, namespace)
                        self.held.replace(kind, namespace, items)
                        at.version = version
                    self._recovered(scope)
                    self.held.listed()  # the first full listing is published even if empty
                started, request = loop.time(), "watch"
                async with heartbeat.guard():
                    try:
                        await self.requests.watch(kind, namespace, at, opened, event)
                    except Stalled as e:
                        if not reopen or not await self.health.answers():  # Hung from the guard if it is hung
                            raise
                        reopen = False
                        self.reopened += 1
                        self._reopens_said.log(
                            logging.INFO,
                            "%s: %s; the API server answers on another connection: opened again from "
                            "resourceVersion %s",
                            self.name,
                            describe(kind, e),
                            at.version,
                        )
                        continue
                if loop.time() - started > RENEWED_AFTER:
                    self.renewals += 1
                    reopen = True
                    continue  # the server ended the watch (its timeout): resume from `at`
                # ended at once: the server may be going away; resume after a pause
                delay = backoff.next()
                log.debug(
                    "%s: the API server ended the %s watch at once; reconnecting in %.1f s", self.name, kind.name, delay
                )
                away: bool | None = None
            except Gone:
                log.info("%s: %s watch expired (410 Gone); listing again", self.name, kind.name)
                self.relists += 1
                at.version = None
                continue
            except Exception as e:
                if self.config.api is not api or self.config.changed():
                    continue  # a new configuration: the next attempt uses it, now
                delay = backoff.next()
                self.health.outage.failed(scope, describe(kind, e, request), delay, e)
                away = went_away(e)
                if isinstance(e, Unauthorized):
                    with contextlib.suppress(Exception):  # a bad new configuration: retried after the backoff
                        await self.config.reload()
                    if self.config.loads != loads:
                        continue
            if away:
                comeback.away()
            await pause(
                delay, stop, self.health.try_now(comeback, loads, probe=away is not False), self.health.probe_every
            )
