"""Registrations kept in etcd, so that every replica serves the same ones.

Each replica lists the prefix, then watches it from the listed revision (a compacted revision: list
again); what it serves and answers reads from is that view. A write is an etcd transaction that
answers only once etcd committed it and this replica's view holds it:

- a put compares "no key of this group changed since the revision the checks were made at", so the
  conflict rules (one id per address in a group, the weight limits) hold across replicas: a
  concurrent write to the group fails the compare, and the checks run again on the group as etcd now
  holds it;
- a registration with a TTL is a key on its own lease, so it expires even while every eds-server is
  down; registering it again unchanged is a lease keep-alive, through any replica;
- a delete compares that the key exists (404 otherwise).

Fail static: while etcd cannot be reached (a linearizable read every second proves it can), the
last view keeps being served, marked stale, and writes answer 503 within a few seconds. Nothing is
served before the first listing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from ..model import Endpoint
from ..store import Store
from . import etcd_wire as wire
from .base import Backoff, Liveness, SourceStatus, WarnOnce
from .etcd_client import EtcdClient, EtcdOptions, EtcdUnavailable
from .registrations import (
    MAX_REGISTRATIONS,
    MAX_STATE_BYTES,
    SOURCE_NAME,
    Delivered,
    Key,
    Registration,
    RegistrationError,
    State,
    check_address,
    check_group,
    check_id,
    check_limits,
    check_merged,
    check_ttl,
    check_weights,
    parse_endpoint,
    registration_entry,
    reject_constant,
)

log = logging.getLogger("eds_server.sources.registrations")

WRITE_DEADLINE = 4.0  # seconds a write may spend reaching etcd before it answers 503
PROBE_INTERVAL = 1.0
PROBE_TIMEOUT = 1.5
CATCH_UP_TIMEOUT = 3.0  # a committed write waits this long, at most, for the watch to bring it here
ATTEMPTS = 64  # tries of one write (each failed compare: another replica wrote to the group first)


def lease_ttl(ttl: float) -> int:
    """etcd leases are whole seconds: round up (etcd itself raises it to its minimum, ~2 s by default)."""
    return max(1, math.ceil(ttl))


def encode(group: str, id: str, endpoint: Endpoint, ttl: float | None) -> bytes:
    entry = registration_entry(group, id, endpoint, ttl)
    return json.dumps(entry, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def decode(key: tuple[str, str], value: bytes) -> tuple[Endpoint, float | None]:
    """A registration's value; ValueError says what is wrong with it (then it is skipped)."""
    entry = json.loads(value.decode("utf-8"), parse_constant=reject_constant)
    if not isinstance(entry, dict) or set(entry) - {"group", "id", "endpoint", "ttl"}:
        raise ValueError("not a registration")
    if (check_group(entry.get("group")), check_id(entry.get("id"))) != key:
        raise ValueError("its group and id are not those of its key")
    if not isinstance(entry.get("endpoint"), dict):
        raise ValueError("endpoint: must be an object")
    try:
        endpoint = parse_endpoint(entry["endpoint"])
    except RegistrationError as e:
        raise ValueError(f"endpoint.{e.field}: {e.message}") from None
    return endpoint, check_ttl(entry.get("ttl"))


class EtcdRegistrationSource:
    def __init__(
        self,
        store: Store,
        target: wire.EtcdTarget,
        options: EtcdOptions | None = None,
        *,
        max_registrations: int = MAX_REGISTRATIONS,
        max_state_bytes: int = MAX_STATE_BYTES,
        name: str = SOURCE_NAME,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.target = target
        self.keys = wire.KeyLayout(target.prefix)
        self.client = EtcdClient(target, options or EtcdOptions())
        self.max_registrations = max_registrations
        self.max_state_bytes = max_state_bytes
        self.name = name
        self.liveness = Liveness(store, name, f"etcd {target}")
        self._mono = monotonic
        self._state = State()
        self._leases: dict[Key, int] = {}
        self._renewed: dict[Key, float] = {}  # monotonic time this replica last saw it written or renewed
        self._revision = 0  # the view is etcd's as of this revision
        self._moved = asyncio.Event()  # set on every revision change of the view
        self._delivered = Delivered(store, name)  # what the store has from us
        self._skipped = WarnOnce(log)  # keys whose value is not a registration
        self._turns = Turns()
        self._relist = False  # list again rather than resume the watch
        store.add_source(name)

    # -- reading -------------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self.liveness.loaded

    def registrations(self, group: str | None = None) -> list[Registration]:
        return [r for r in self._state.regs.values() if group is None or r.group == group]

    def get(self, group: str, id: str) -> Registration | None:
        return self._state.regs.get((group, id))

    def expires_in(self, reg: Registration) -> float | None:
        """At most this long (a renewal through another replica extends it without this one seeing it)."""
        if reg.ttl is None:
            return None
        seen = self._renewed.get(reg.key, self._mono())
        return max(0.0, seen + lease_ttl(reg.ttl) - self._mono())

    def status(self) -> SourceStatus:
        return self.liveness.status(state=str(self.target), revision=self._revision,
                                    registrations=len(self._state.regs), max_registrations=self.max_registrations)

    async def start(self) -> None:
        """Nothing to check before serving: until etcd is listed the store waits (not ready)."""

    # -- the view ------------------------------------------------------------------------------
    def _entry(self, kv: wire.KeyValue) -> Registration | None:
        """The registration a key holds; None for another key, or a value that is not one (warned once)."""
        key = self.keys.parse(kv.key)
        if key is None:
            return None
        shown = kv.key.decode("utf-8", "replace")
        try:
            key = (check_group(key[0]), check_id(key[1]))
            endpoint, ttl = decode(key, kv.value)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            self._skipped.update({shown: f"etcd key {shown!r}: {e}; skipped"})
            return None
        self._skipped.forget(shown)
        return Registration(key[0], key[1], endpoint, ttl, line=kv.value)

    def _put_local(self, state: State, kv: wire.KeyValue) -> None:
        reg = self._entry(kv)
        if reg is None:
            parsed = self.keys.parse(kv.key)
            if parsed is not None:
                state.remove(parsed)  # a value that is no longer a registration: not served
            return
        state.add(reg)
        self._leases[reg.key] = kv.lease
        self._renewed[reg.key] = self._mono()

    def _replace(self, kvs: list[wire.KeyValue], revision: int) -> None:
        new = State()
        self._leases, self._renewed = {}, {}
        for kv in kvs:
            self._put_local(new, kv)
        touched = set(self._state.regs) | set(new.regs)
        self._state = new
        self._advance(revision, touched, initial=True)

    def _apply(self, message: wire.WatchMessage) -> None:
        touched: set[Key] = set()
        for event in message.events:
            key = self.keys.parse(event.kv.key)
            if key is None:
                continue
            if event.deleted:
                self._skipped.forget(event.kv.key.decode("utf-8", "replace"))
                if self._state.remove(key) is not None:
                    log.info("registration %s/%s removed (deleted or expired in etcd)", *key)
                self._leases.pop(key, None)
                self._renewed.pop(key, None)
            else:
                self._put_local(self._state, event.kv)
            touched.add(key)
        # the events' own revisions, not the header's: a catching-up watch may send a batch stamped
        # with the store's current revision before it has sent every event up to it
        revision = max((e.kv.mod_revision for e in message.events), default=self._revision)
        self._advance(max(self._revision, revision), touched)

    def _advance(self, revision: int, touched: set[Key], initial: bool = False) -> None:
        self._publish(touched, initial)
        self._state.touched = set()
        if revision != self._revision:
            self._revision = revision
            self._moved.set()
            self._moved = asyncio.Event()

    def _publish(self, touched: set[Key], initial: bool) -> None:
        self._delivered.publish(self._state.regs, touched, initial)

    async def _caught_up(self, revision: int) -> None:
        """Wait (bounded) until the view holds `revision`: a write answers once this replica serves it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CATCH_UP_TIMEOUT
        while self._revision < revision and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), deadline - loop.time())
        if self._revision < revision:
            log.warning("the watch did not bring revision %d within %gs (it is at %d)",
                        revision, CATCH_UP_TIMEOUT, self._revision)  # fmt: skip

    # -- following -----------------------------------------------------------------------------
    async def _list(self) -> None:
        deadline = asyncio.get_running_loop().time() + WRITE_DEADLINE
        reply = await self.client.call("/v3/kv/range", wire.range_request(self.keys.all, wire.range_end(self.keys.all)),
                                       deadline=deadline)  # fmt: skip
        revision = wire.revision(reply)
        first = not self.liveness.loaded
        self._replace(wire.kvs(reply), revision)
        if first:
            log.info("registrations: listed %s at revision %d: %d registrations",
                     self.target, revision, len(self._state.regs))  # fmt: skip
        self.liveness.live(f"{len(self._state.regs)} registrations")

    async def _watch(self) -> None:
        """Follow from the view's revision until the stream ends or fails (raises)."""
        body = wire.watch_request(self.keys.all, wire.range_end(self.keys.all), self._revision + 1)
        async for message in self.client.watch(body, connect_timeout=PROBE_TIMEOUT):
            if message.compact_revision:
                log.info("registrations: revision %d was compacted in etcd; listing again", self._revision + 1)
                await self._list()
                return
            if message.canceled:
                raise wire.EtcdError(f"the watch was canceled: {message.reason or 'no reason given'}")
            if message.created:
                continue
            self._apply(message)

    async def _probe(self, stop: asyncio.Event, watching: asyncio.Task[None] | None) -> None:
        """A linearizable read every second: it fails while etcd has no quorum (or cannot be reached),
        which a quiet watch stream would not show. Ends the watch after two failures, so it restarts
        on another member."""
        failures = 0
        body = wire.range_request(self.keys.all, wire.range_end(self.keys.all), count_only=True)
        loop = asyncio.get_running_loop()
        while not stop.is_set():  # bounded by `stop`
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PROBE_INTERVAL)
            if stop.is_set():
                return
            try:
                reply = await self.client.call("/v3/kv/range", body, deadline=loop.time() + PROBE_TIMEOUT)
                if wire.revision(reply) < self._revision:  # etcd restored from an older backup
                    log.warning("registrations: etcd is at revision %d, behind this view (%d): listing again",
                                wire.revision(reply), self._revision)  # fmt: skip
                    self._relist = True
                    if watching is not None:
                        watching.cancel()
                    return
            except (EtcdUnavailable, wire.EtcdError) as e:
                failures += 1
                self.liveness.lost(str(e))
                if failures >= 2 and watching is not None and not watching.done():
                    watching.cancel()
                continue
            failures = 0
            if self.liveness.loaded and watching is not None and not watching.done():
                self.liveness.live(f"{len(self._state.regs)} registrations")

    async def run(self, stop: asyncio.Event) -> None:
        """List, then watch, until `stop` is set; on any failure keep the view (stale) and retry."""
        backoff = Backoff(0.2, 2.0)
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():  # bounded by `stop`; each round waits a backoff
                try:
                    if not self.liveness.loaded or self._relist:
                        await self._list()
                        self._relist = False
                    watching = asyncio.create_task(self._watch_or_relist(), name="etcd watch")
                    probing = asyncio.create_task(self._probe(stop, watching), name="etcd probe")
                    await asyncio.wait({watching, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    probing.cancel()
                    watching.cancel()
                    await asyncio.gather(probing, watching, return_exceptions=True)
                    if stop.is_set():
                        break
                    exc = watching.exception() if not watching.cancelled() else None
                    reason = f"{type(exc).__name__}: {exc}" if exc is not None else "the watch ended"
                    if watching.cancelled():
                        reason = self.liveness.last_error or "no answer"
                    self.liveness.lost(reason)
                    if isinstance(exc, wire.EtcdError) and exc.auth_expired:
                        self.client.forget_token()
                except (EtcdUnavailable, wire.EtcdError) as e:
                    self.liveness.lost(str(e))
                except Exception as e:  # e.g. a malformed answer: keep serving, retry
                    log.exception("registrations: following etcd failed")
                    self.liveness.lost(f"{type(e).__name__}: {e}")
                else:
                    backoff.reset()
                self.client.rotate()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff.next())
        finally:
            stopping.cancel()
            await self.client.close()

    async def _watch_or_relist(self) -> None:
        await self._watch()
        if self.liveness.live_now:
            return  # re-listed after a compaction: the outer loop watches again
        raise wire.EtcdError("the watch ended")

    # -- changing ------------------------------------------------------------------------------
    def _unreachable(self, e: Exception) -> RegistrationError:
        return RegistrationError(503, f"etcd cannot be reached ({e}): the change may not have been made; retry")

    async def _group_now(self, group: str, deadline: float) -> GroupView:
        """The group as etcd holds it now (a linearizable read), for checks that must not see a stale view."""
        prefix = self.keys.group(group)
        reply = await self.client.call("/v3/kv/range", wire.range_request(prefix, wire.range_end(prefix)),
                                       deadline=deadline)  # fmt: skip
        state, leases = State(), {}
        for kv in wire.kvs(reply):
            reg = self._entry(kv)
            if reg is not None:
                state.add(reg)
                leases[reg.key] = kv.lease
        return GroupView(state, wire.revision(reply), leases, fresh=True)

    def _checks(self, view: State, reg: Registration) -> None:
        """The group rules on `view` (this replica's, or the group as etcd holds it now); the count
        and size limits on this replica's view (so they may be passed by a few concurrent writes)."""
        check_address(view, reg)
        check_limits(self._state, reg, self.max_registrations, self.max_state_bytes)
        check_weights(view, reg)

    async def put(self, group: str, id: str, endpoint: Endpoint, ttl: float | None = None) -> tuple[Registration, bool]:
        """Register, replace or renew; returns once etcd committed it and this replica serves it.

        Writes to one group through this replica take turns (their transactions would fail each
        other's compare); an unchanged registration with a TTL is only a lease keep-alive."""
        if not self.liveness.loaded:
            raise RegistrationError(503, "registrations are not loaded from etcd yet")
        check_merged(self.store, self.name, group, self._delivered.members.get(group, {}), id, endpoint)
        old = self._state.regs.get((group, id))
        lease = self._leases.get((group, id), 0)
        if old is not None and old.endpoint == endpoint and old.ttl == ttl and ttl is not None and lease:
            try:
                if await self._keep_alive(lease, asyncio.get_running_loop().time() + WRITE_DEADLINE):
                    self._renewed[(group, id)] = self._mono()
                    return old, False
            except (EtcdUnavailable, TimeoutError) as e:
                raise self._unreachable(e) from None
            except wire.EtcdError as e:
                raise RegistrationError(503, f"etcd refused the renewal: {e.message}") from None
        async with self._turns.take(group):
            return await self._put(group, id, endpoint, ttl)

    async def _put(self, group: str, id: str, endpoint: Endpoint, ttl: float | None) -> tuple[Registration, bool]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WRITE_DEADLINE
        key = (group, id)
        value = encode(group, id, endpoint, ttl)
        reg = Registration(group, id, endpoint, ttl, line=value)
        old = self._state.regs.get(key)
        if old is not None and old.endpoint == endpoint and old.ttl is None and ttl is None:
            return old, False  # the same again
        view = GroupView(self._state, self._revision, self._leases, fresh=False)
        lease = 0
        try:
            for attempt in range(ATTEMPTS):  # bounded, and by the deadline
                try:
                    self._checks(view.state, reg)
                except RegistrationError:
                    if view.fresh:
                        raise
                    # this replica's view may be behind: refuse only on the group as etcd holds it now
                    view = await self._group_now(group, deadline)
                    continue
                if ttl is not None and not lease:
                    lease = int((await self.client.call("/v3/lease/grant", {"TTL": str(lease_ttl(ttl))},
                                                        deadline=deadline))["ID"])  # fmt: skip
                old = view.state.regs.get(key)
                old_lease = view.leases.get(key, 0) if old is not None else 0
                group_range = self.keys.group(group)
                reply = await self.client.call("/v3/kv/txn", wire.txn(
                    [wire.unchanged_since(group_range, wire.range_end(group_range), view.revision)],
                    [wire.put(self.keys.key(group, id), value, lease)],
                ), deadline=deadline)  # fmt: skip
                if reply.get("succeeded"):
                    lease, granted = 0, lease  # it is the registration's now
                    await self._caught_up(wire.revision(reply))
                    if old_lease and old_lease != granted:
                        self._revoke(old_lease)
                    return self._state.regs.get(key, reg), old is None
                # another replica wrote to this group first: out of step with it, then look again
                await asyncio.sleep(random.uniform(0, min(0.1, 0.005 * 2**attempt)))
                if loop.time() >= deadline:
                    break
                view = await self._group_now(group, deadline)
        except (EtcdUnavailable, TimeoutError) as e:
            raise self._unreachable(e) from None
        except wire.EtcdError as e:
            raise RegistrationError(503, f"etcd refused the change: {e.message}") from None
        finally:
            if lease:
                self._revoke(lease)  # granted, not used
        raise RegistrationError(503, f"group {group!r} is changing too often to register into; retry")

    async def _keep_alive(self, lease: int, deadline: float) -> bool:
        """Renew `lease`; False when it is gone (expired, revoked)."""
        reply = await self.client.call("/v3/lease/keepalive", {"ID": str(lease)}, deadline=deadline)
        result = reply.get("result", reply)
        return int(result.get("TTL", 0) or 0) > 0

    def _revoke(self, lease: int) -> None:
        """Best effort, in the background: a lease left over expires by itself."""

        async def revoke() -> None:
            with contextlib.suppress(Exception):
                deadline = asyncio.get_running_loop().time() + WRITE_DEADLINE
                await self.client.call("/v3/lease/revoke", {"ID": str(lease)}, deadline=deadline)

        task = asyncio.create_task(revoke())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def delete(self, group: str, id: str) -> Registration | None:
        if not self.liveness.loaded:
            raise RegistrationError(503, "registrations are not loaded from etcd yet")
        deadline = asyncio.get_running_loop().time() + WRITE_DEADLINE
        etcd_key = self.keys.key(group, id)
        try:
            reply = await self.client.call("/v3/kv/txn", wire.txn([wire.exists(etcd_key)], [wire.delete(etcd_key)]),
                                           deadline=deadline)  # fmt: skip
        except (EtcdUnavailable, TimeoutError) as e:
            raise self._unreachable(e) from None
        except wire.EtcdError as e:
            raise RegistrationError(503, f"etcd refused the change: {e.message}") from None
        if not reply.get("succeeded"):
            raise RegistrationError(404, f"no registration {id!r} in group {group!r}")
        deleted = wire.txn_deleted(reply)
        old = self._state.regs.get((group, id))
        await self._caught_up(wire.revision(reply))
        if deleted and deleted[0].lease:
            self._revoke(deleted[0].lease)
        return (self._entry(deleted[0]) if deleted else None) or old


@dataclass
class GroupView:
    """What a write's checks are made on: this replica's view, or one group as etcd holds it now
    (`fresh`), as of `revision`, with each registration's lease."""

    state: State
    revision: int
    leases: Mapping[Key, int]
    fresh: bool


class Turns:
    """One lock per key, kept only while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def take(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


_background: set[asyncio.Task[None]] = set()  # revocations under way (a reference, so they are not collected)
