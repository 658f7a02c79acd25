"""Keeping this replica's view following etcd: list, watch from the listed revision, and probe the
member the watch is on.

Fail static, and never a lie: a linearizable read of the member the watch is on, every second,
finds a member that hangs or lost quorum, and a watch that stopped delivering (a key committed a
probe ago that the view still lacks); then the view is marked stale, the last one keeps being
served, and the watch resumes on another member. Apart from the source, so that how the view keeps
up (and how it finds it does not) reads without the registration API around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from . import etcd_wire as wire
from .base import Backoff, Liveness, reconnect
from .etcd_client import EtcdUnavailable
from .etcd_kv import WRITE_DEADLINE, RegistrationKV
from .etcd_view import RegistrationView

log = logging.getLogger("eds_server.sources.registrations")

PROBE_INTERVAL = 1.0
PROBE_TIMEOUT = 1.5
BEHIND_PROBES = 3  # probes running that find a change the watch has not brought: it stalled
# A hung or cut-off member is found within PROBE_INTERVAL + 2 * PROBE_TIMEOUT (two probes running
# fail) and a watch that stopped delivering within (BEHIND_PROBES + 1) * PROBE_INTERVAL; then the
# view is stale and the watch resumes on another member: a change committed anywhere is in every
# live replica's view within FOLLOW_BOUND seconds.
FOLLOW_BOUND = 6.0


class Follower:
    """Feeds `view` from etcd through `kv`, and tells `liveness` (the source's status) and the view
    (writes wait on it) whether it follows."""

    def __init__(self, kv: RegistrationKV, view: RegistrationView, liveness: Liveness) -> None:
        self.kv = kv
        self.client = kv.client
        self.view = view
        self.liveness = liveness
        self._relist = False  # list again rather than resume the watch
        self._watching: asyncio.Task[None] | None = None

    def live(self) -> None:
        self.liveness.live(f"{len(self.view.state.regs)} registrations")
        self.view.follows()

    def lost(self, reason: str) -> None:
        self.liveness.lost(reason)
        self.view.stale()

    def suspect(self, reason: str) -> None:
        """The watch is not bringing what etcd holds: stale, and resumed on another member."""
        self.lost(reason)
        if self._watching is not None and not self._watching.done():
            self._watching.cancel()

    async def _list(self) -> None:
        deadline = asyncio.get_running_loop().time() + WRITE_DEADLINE
        kvs, revision = await self.kv.list_all(deadline)
        first = not self.liveness.loaded
        self.view.replace(kvs, revision)
        if first:
            log.info(
                "registrations: listed %s at revision %d: %d registrations",
                self.client.target,
                revision,
                len(self.view.state.regs),
            )
        self.live()

    async def _watch(self, member: str) -> None:
        """Follow from the view's revision until the stream ends or fails (raises)."""
        async for message in self.kv.watch(self.view.revision, member, PROBE_TIMEOUT):
            if message.compact_revision:
                log.info("registrations: revision %d was compacted in etcd; listing again", self.view.revision + 1)
                await self._list()
                return
            if message.canceled:
                raise wire.EtcdError(f"the watch was canceled: {message.reason or 'no reason given'}")
            if message.created:
                continue
            self.view.apply(message)

    async def _probe(self, stop: asyncio.Event, watching: asyncio.Task[None], member: str) -> None:
        """A linearizable read of the member the watch is on, every second. It fails while that member
        hangs, is cut off or etcd has no quorum, which a quiet watch stream would not show (a probe
        that moved to another member would vouch for a watch it does not see). It also asks for a key
        committed before the previous probe that the view still lacks: a watch that stopped
        delivering. Two failures running end the watch, so it resumes on another member."""
        failures = 0
        behind = 0
        before = 0  # etcd's revision one probe ago: every change up to it is in a following view by now
        loop = asyncio.get_running_loop()
        while not stop.is_set():  # bounded by `stop`
            if failures == 0:  # after a failure, ask again at once
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), PROBE_INTERVAL)
            if stop.is_set() or watching.done():
                return
            seen = self.view.revision  # before asking: an answer may arrive after the watch moved on
            check = before > seen
            try:
                now, missing = await self.kv.probe(
                    member, loop.time() + PROBE_TIMEOUT, changed=(seen + 1, before) if check else None
                )
            except (EtcdUnavailable, wire.EtcdError) as e:
                failures += 1  # once may be a busy moment (asked again at once), twice is not
                if failures >= 2:
                    self.lost(f"{e}" if member in str(e) else f"{member}: {e}")
                    watching.cancel()
                    return
                continue
            failures = 0
            if now < seen:  # etcd restored from an older backup
                log.warning("registrations: etcd is at revision %d, behind this view (%d): listing again", now, seen)
                self._relist = True
                watching.cancel()
                return
            if missing:
                behind += 1  # committed a probe ago, not here yet: a busy moment, or a watch that stalled
                if behind >= BEHIND_PROBES:
                    self.suspect(
                        f"the watch on {member} stopped delivering: revision "
                        f"{missing[0].mod_revision} was committed {behind} probes ago, "
                        f"the view is at {seen}"
                    )
                    return
                continue
            behind = 0
            before = now
            if self.liveness.loaded:
                self.live()

    async def run(self, stop: asyncio.Event) -> None:
        """List, then watch, until `stop` is set; on any failure keep the view (stale) and retry."""
        backoff = Backoff(0.2, 2.0)
        stopping = asyncio.create_task(stop.wait())

        async def connect() -> str:
            if not self.liveness.loaded or self._relist:
                await self._list()
                self._relist = False
            member = self.client.member
            watching = self._watching = asyncio.create_task(self._watch_or_relist(member), name="etcd watch")
            probing = asyncio.create_task(self._probe(stop, watching, member), name="etcd probe")
            await asyncio.wait({watching, stopping}, return_when=asyncio.FIRST_COMPLETED)
            probing.cancel()
            watching.cancel()
            await asyncio.gather(probing, watching, return_exceptions=True)
            backoff.reset()  # it listed and watched: the next attempt comes soon
            if watching.cancelled():
                return self.liveness.last_error or "no answer"
            exc = watching.exception()
            if isinstance(exc, wire.EtcdError) and exc.auth_expired:
                self.client.forget_token()
            return f"{type(exc).__name__}: {exc}" if exc is not None else "the watch ended"

        def why(e: Exception) -> str:
            if isinstance(e, EtcdUnavailable | wire.EtcdError):
                return str(e)
            log.error("registrations: following etcd failed", exc_info=e)  # e.g. a malformed answer
            return f"{type(e).__name__}: {e}"

        def lost(reason: str, _: float) -> None:
            self.lost(reason)
            self.client.move_off(self.client.watching)

        try:
            await reconnect(stop, connect, backoff=backoff, why=why, lost=lost)
        finally:
            stopping.cancel()
            await self.client.close()

    async def _watch_or_relist(self, member: str) -> None:
        await self._watch(member)
        if self.liveness.live_now:
            return  # re-listed after a compaction: the outer loop watches again
        raise wire.EtcdError("the watch ended")
