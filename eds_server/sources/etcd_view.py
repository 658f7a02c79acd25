"""This replica's view of the registrations in etcd: what the list and the watch brought, as of
which revision, and whether it still follows etcd.

What the replica serves is this view, and nothing else changes it: a write answers once the view
holds its revision (`wait_for`), and goes through only while the view follows etcd (`following`).
Apart from the source, so that what is served can be read without the IO that feeds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from . import etcd_wire as wire
from .base import Feed
from .etcd_kv import RegistrationKV
from .etcd_leases import lease_ttl
from .registrations import Delivered, Key, Registration, State

log = logging.getLogger("eds_server.sources.registrations")


class RegistrationView:
    """The registrations as etcd held them at `revision`, each with its key (lease, mod revision)
    and when this replica last saw it written or renewed; published to the feed on every change."""

    def __init__(
        self, feed: Feed, name: str, kv: RegistrationKV, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._kv = kv
        self._mono = monotonic
        self.state = State()
        self.kvs: dict[Key, wire.KeyValue] = {}  # each registration's key as the view holds it (lease, revision)
        self._renewed: dict[Key, float] = {}  # monotonic time this replica last saw it written or renewed
        self.revision = 0  # the view is etcd's as of this revision
        self._moved = asyncio.Event()  # set on every revision change of the view
        self.delivered = Delivered(feed, name)  # what the store has from us
        self._following = asyncio.Event()  # set while the view follows etcd (live), for writes to wait on

    # -- freshness -----------------------------------------------------------------------------
    @property
    def following(self) -> bool:
        return self._following.is_set()

    def follows(self) -> None:
        """The view follows etcd (listed, watched, the probe of its member answered)."""
        self._following.set()

    def stale(self) -> None:
        """The view may be behind etcd: it keeps being served, writes wait for it."""
        self._following.clear()

    async def wait_following(self, timeout: float) -> bool:
        """Whether the view follows etcd, waiting `timeout` seconds at most for it to."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._following.wait(), timeout)
        return self._following.is_set()

    async def wait_for(self, revision: int, timeout: float) -> bool:
        """Whether the view holds `revision`, waiting `timeout` seconds at most for the watch to bring it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.revision < revision and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), deadline - loop.time())
        return self.revision >= revision

    # -- leases --------------------------------------------------------------------------------
    def expires_in(self, reg: Registration) -> float | None:
        """At most this long (a renewal through another replica extends it without this one seeing it)."""
        if reg.ttl is None:
            return None
        seen = self._renewed.get(reg.key, self._mono())
        return max(0.0, seen + lease_ttl(reg.ttl) - self._mono())

    def renewed(self, key: Key) -> None:
        """This replica kept the registration's lease alive just now."""
        self._renewed[key] = self._mono()

    # -- changes -------------------------------------------------------------------------------
    def replace(self, kvs: list[wire.KeyValue], revision: int) -> None:
        """Everything under the prefix as listed at `revision` (the first listing, or after a compaction)."""
        new = State()
        self.kvs, self._renewed = {}, {}
        for kv in kvs:
            self._put(new, kv)
        touched = set(self.state.regs) | set(new.regs)
        self.state = new
        self._advance(revision, touched, initial=True)

    def apply(self, message: wire.WatchMessage) -> None:
        """One batch of the watch's events."""
        touched: set[Key] = set()
        for event in message.events:
            key = self._kv.parse(event.kv.key)
            if key is None:
                continue
            if event.deleted:
                self._kv.deleted(event.kv.key)
                if self.state.remove(key) is not None:
                    log.info("registration %s/%s removed (deleted or expired in etcd)", *key)
                self.kvs.pop(key, None)
                self._renewed.pop(key, None)
            else:
                self._put(self.state, event.kv)
            touched.add(key)
        # the events' own revisions, not the header's: a catching-up watch may send a batch stamped
        # with the store's current revision before it has sent every event up to it
        revision = max((e.kv.mod_revision for e in message.events), default=self.revision)
        self._advance(max(self.revision, revision), touched)

    def _put(self, state: State, kv: wire.KeyValue) -> None:
        reg = self._kv.entry(kv)
        if reg is None:
            parsed = self._kv.parse(kv.key)
            if parsed is not None:
                state.remove(parsed)  # a value that is no longer a registration: not served
            return
        state.add(reg)
        self.kvs[reg.key] = kv
        self._renewed[reg.key] = self._mono()

    def _advance(self, revision: int, touched: set[Key], initial: bool = False) -> None:
        self.delivered.publish(self.state.regs, touched, initial)
        self.state.touched = set()
        if revision != self.revision:
            self.revision = revision
            self._moved.set()
            self._moved = asyncio.Event()
