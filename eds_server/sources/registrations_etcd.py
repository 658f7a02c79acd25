"""Registrations kept in etcd, so that every replica serves the same ones.

Each replica lists the prefix, then watches it from the listed revision (a compacted revision: list
again); what it serves is that view. Every 2xx is true: a write is an etcd transaction on what etcd
holds now, and answers only once etcd committed it and this replica's view holds it:

- a put compares "no key of this group changed since the revision the checks were made at", so the
  conflict rules (one id per address in a group, the weight limits) hold across replicas: a
  concurrent write to the group fails the compare, and the checks run again on the group as etcd now
  holds it;
- a registration with a TTL is a key on its own lease, so it expires even while every eds-server is
  down. Registering it again unchanged is a renewal: a transaction that finds the key holding exactly
  that value (and reads its lease) then a keep-alive of that lease, through any replica, whatever
  its view says. A replace or delete revokes the old lease before it answers;
- a delete compares that the key exists (404 otherwise); a read of one registration is a
  linearizable read of its key.

Fail static, and never a lie: a linearizable read of the member the watch is on, every second,
finds a member that hangs or lost quorum, and a watch that stopped delivering (a key committed a
probe ago that the view still lacks); then the view is marked stale, the last one keeps being
served, the watch resumes on another member, and writes wait for the view (a few seconds) or answer
503. Nothing is served before the first listing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..model import Endpoint
from ..ratelimit import LogBudget
from . import etcd_wire as wire
from .base import Backoff, Feed, Liveness, SourceStatus, WarnOnce, reconnect
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
STALE_WAIT = 3.0  # a write through a stale view waits this long for it to follow etcd again, then 503
BEHIND_PROBES = 3  # probes running that find a change the watch has not brought: it stalled
# A hung or cut-off member is found within PROBE_INTERVAL + 2 * PROBE_TIMEOUT (two probes running
# fail) and a watch that stopped delivering within (BEHIND_PROBES + 1) * PROBE_INTERVAL; then the
# view is stale and the watch resumes on another member: a change committed anywhere is in every
# live replica's view within FOLLOW_BOUND seconds.
FOLLOW_BOUND = 6.0
ATTEMPTS = 64  # tries of one write (each failed compare: another replica wrote to the group first)
STALE_READ_TRIES = 3  # members asked for a read not behind the view


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
        feed: Feed,
        target: wire.EtcdTarget,
        options: EtcdOptions | None = None,
        *,
        max_registrations: int = MAX_REGISTRATIONS,
        max_state_bytes: int = MAX_STATE_BYTES,
        name: str = SOURCE_NAME,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.feed = feed
        self.target = target
        self.keys = wire.KeyLayout(target.prefix)
        self.client = EtcdClient(target, options or EtcdOptions())
        self.max_registrations = max_registrations
        self.max_state_bytes = max_state_bytes
        self.name = name
        self.liveness = Liveness(feed, name, f"etcd {target}")
        self._mono = monotonic
        self._state = State()
        self._kvs: dict[Key, wire.KeyValue] = {}  # each registration's key as the view holds it (lease, revision)
        self._renewed: dict[Key, float] = {}  # monotonic time this replica last saw it written or renewed
        self._revision = 0  # the view is etcd's as of this revision
        self._moved = asyncio.Event()  # set on every revision change of the view
        self._delivered = Delivered(feed, name)  # what the store has from us
        self._skipped = WarnOnce(log)  # keys whose value is not a registration
        self._turns = Turns()
        self._relist = False  # list again rather than resume the watch
        self._following = asyncio.Event()  # set while the view follows etcd (live), for writes to wait on
        self._watching: asyncio.Task[None] | None = None
        self._stale_reads = LogBudget(log)

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
        return self.liveness.status(
            state=str(self.target),
            revision=self._revision,
            watching=self.client.watching,
            registrations=len(self._state.regs),
            max_registrations=self.max_registrations,
        )

    async def start(self) -> None:
        """Nothing to check before serving: until etcd is listed the store waits (not ready)."""

    def _live(self) -> None:
        self.liveness.live(f"{len(self._state.regs)} registrations")
        self._following.set()

    def _lost(self, reason: str) -> None:
        self.liveness.lost(reason)
        self._following.clear()

    def _suspect_watch(self, reason: str) -> None:
        """The watch is not bringing what etcd holds: stale, and resumed on another member."""
        self._lost(reason)
        if self._watching is not None and not self._watching.done():
            self._watching.cancel()

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
        self._kvs[reg.key] = kv
        self._renewed[reg.key] = self._mono()

    def _replace(self, kvs: list[wire.KeyValue], revision: int) -> None:
        new = State()
        self._kvs, self._renewed = {}, {}
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
                self._kvs.pop(key, None)
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
        """Wait (bounded) until the view holds `revision`: a write answers 2xx only once this replica
        serves it. Past the bound the watch is moved and the write answers 503 (it is in etcd, and
        every replica serves it once its watch brings it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CATCH_UP_TIMEOUT
        while self._revision < revision and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), deadline - loop.time())
        if self._revision < revision:
            reason = (
                f"the watch on {self.client.watching} did not bring revision {revision} within "
                f"{CATCH_UP_TIMEOUT:g}s (the view is at {self._revision})"
            )
            self._suspect_watch(reason)
            raise RegistrationError(
                503,
                f"etcd committed the change, but {reason}: this replica serves it once "
                "its watch (moved to another member) brings it; retrying is safe",
            )

    # -- following -----------------------------------------------------------------------------
    async def _list(self) -> None:
        deadline = asyncio.get_running_loop().time() + WRITE_DEADLINE
        reply = await self.client.call(
            "/v3/kv/range", wire.range_request(self.keys.all, wire.range_end(self.keys.all)), deadline=deadline
        )
        revision = wire.revision(reply)
        first = not self.liveness.loaded
        self._replace(wire.kvs(reply), revision)
        if first:
            log.info(
                "registrations: listed %s at revision %d: %d registrations",
                self.target,
                revision,
                len(self._state.regs),
            )
        self._live()

    async def _watch(self, member: str) -> None:
        """Follow from the view's revision until the stream ends or fails (raises)."""
        body = wire.watch_request(self.keys.all, wire.range_end(self.keys.all), self._revision + 1)
        async for message in self.client.watch(body, connect_timeout=PROBE_TIMEOUT, member=member):
            if message.compact_revision:
                log.info("registrations: revision %d was compacted in etcd; listing again", self._revision + 1)
                await self._list()
                return
            if message.canceled:
                raise wire.EtcdError(f"the watch was canceled: {message.reason or 'no reason given'}")
            if message.created:
                continue
            self._apply(message)

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
            seen = self._revision  # before asking: an answer may arrive after the watch moved on
            check = before > seen
            everything = (self.keys.all, wire.range_end(self.keys.all))
            if check:
                body = wire.range_request(
                    *everything, keys_only=True, limit=1, min_mod_revision=seen + 1, max_mod_revision=before
                )
            else:
                body = wire.range_request(*everything, count_only=True)
            try:
                reply = await self.client.call(
                    "/v3/kv/range", body, deadline=loop.time() + PROBE_TIMEOUT, member=member
                )
            except (EtcdUnavailable, wire.EtcdError) as e:
                failures += 1  # once may be a busy moment (asked again at once), twice is not
                if failures >= 2:
                    self._lost(f"{e}" if member in str(e) else f"{member}: {e}")
                    watching.cancel()
                    return
                continue
            failures = 0
            now = wire.revision(reply)
            if now < seen:  # etcd restored from an older backup
                log.warning("registrations: etcd is at revision %d, behind this view (%d): listing again", now, seen)
                self._relist = True
                watching.cancel()
                return
            missing = wire.kvs(reply) if check else []
            if missing:
                behind += 1  # committed a probe ago, not here yet: a busy moment, or a watch that stalled
                if behind >= BEHIND_PROBES:
                    self._suspect_watch(
                        f"the watch on {member} stopped delivering: revision "
                        f"{missing[0].mod_revision} was committed {behind} probes ago, "
                        f"the view is at {seen}"
                    )
                    return
                continue
            behind = 0
            before = now
            if self.liveness.loaded:
                self._live()

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
            self._lost(reason)
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

    # -- changing ------------------------------------------------------------------------------
    def _unreachable(self, e: Exception) -> RegistrationError:
        return RegistrationError(503, f"etcd cannot be reached ({e}): the change may not have been made; retry")

    async def _group_now(self, group: str, deadline: float) -> GroupView:
        """The group as etcd holds it now (a linearizable read), for checks that must not see a stale view."""
        prefix = self.keys.group(group)
        reply = await self._read_now("/v3/kv/range", wire.range_request(prefix, wire.range_end(prefix)), deadline)
        state, kvs = State(), {}
        for kv in wire.kvs(reply):
            reg = self._entry(kv)
            if reg is not None:
                state.add(reg)
                kvs[reg.key] = kv
        return GroupView(state, wire.revision(reply), kvs, fresh=True)

    def _checks(self, view: State, reg: Registration) -> None:
        """The group rules on `view` (this replica's, or the group as etcd holds it now); the count
        and size limits on this replica's view (so they may be passed by a few concurrent writes)."""
        check_address(view, reg)
        check_limits(self._state, reg, self.max_registrations, self.max_state_bytes)
        check_weights(view, reg)

    async def _usable(self) -> None:
        """Writes go through only while the view follows etcd: a write acknowledged into a view that
        will not see it would be a lie. A stale view is waited for, a few seconds at most."""
        if not self.liveness.loaded:
            raise RegistrationError(503, "registrations are not loaded from etcd yet")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._following.wait(), STALE_WAIT)
        if not self._following.is_set():
            raise RegistrationError(
                503,
                f"this replica's view of etcd is stale ({self.liveness.last_error}): "
                "nothing was changed; retry, here or through another replica",
            )

    async def put(self, group: str, id: str, endpoint: Endpoint, ttl: float | None = None) -> tuple[Registration, bool]:
        """Register, replace or renew; returns once etcd committed it and this replica serves it.

        Writes to one group through this replica take turns (their transactions would fail each
        other's compare); a registration this view holds unchanged is confirmed in etcd (and its
        lease kept alive) rather than written again, and written if etcd holds something else."""
        check_merged(self.feed, self.name, group, self._delivered.members.get(group, {}), id, endpoint)
        await self._usable()
        value = encode(group, id, endpoint, ttl)
        known = self._state.regs.get((group, id))
        if known is not None and known.line == value:  # a renewal, or the same again: confirmed in etcd
            try:
                held = await self._confirm(group, id, value, ttl, asyncio.get_running_loop().time() + WRITE_DEADLINE)
            except (EtcdUnavailable, TimeoutError) as e:
                raise self._unreachable(e) from None
            except wire.EtcdError as e:
                raise RegistrationError(503, f"etcd refused the renewal: {e.message}") from None
            if held is not None:
                await self._caught_up(held.mod_revision)
                return self._state.regs.get((group, id), known), False
        # anything else (a view that does not hold it yet included) is a write whose transaction
        # compares the group as this view holds it
        async with self._turns.take(group):
            return await self._put(group, id, endpoint, ttl, value)

    async def _confirm(
        self,
        group: str,
        id: str,
        value: bytes,
        ttl: float | None,
        deadline: float,
    ) -> wire.KeyValue | None:
        """The key as etcd holds it now if it holds exactly `value`, its lease kept alive (a renewal);
        None when it does not (absent, another value, or its lease just ended): then it is written."""
        key = self.keys.key(group, id)
        reply = await self._read_now("/v3/kv/txn", wire.txn([wire.value_is(key, value)], [wire.get(key)]), deadline)
        held = wire.txn_range(reply) if reply.get("succeeded") else []
        if not held:
            return None
        if ttl is not None:
            if not held[0].lease or not await self._keep_alive(held[0].lease, deadline):
                return None
            self._renewed[(group, id)] = self._mono()
        return held[0]

    async def _put(
        self,
        group: str,
        id: str,
        endpoint: Endpoint,
        ttl: float | None,
        value: bytes,
    ) -> tuple[Registration, bool]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WRITE_DEADLINE
        key = (group, id)
        reg = Registration(group, id, endpoint, ttl, line=value)
        view = GroupView(self._state, self._revision, self._kvs, fresh=False)
        lease = 0
        sent = False  # a transaction with `lease` went out and its answer was lost: it may yet be applied
        rivals = Backoff(0.005, 0.1, jitter=1.0)  # after a lost compare: out of step with the other replica
        try:
            for _ in range(ATTEMPTS):  # bounded, and by the deadline
                try:
                    self._checks(view.state, reg)
                except RegistrationError:
                    if view.fresh:
                        raise
                    # this replica's view may be behind: refuse only on the group as etcd holds it now
                    view = await self._group_now(group, deadline)
                    continue
                if ttl is not None and not lease:
                    lease = int(
                        (await self.client.call("/v3/lease/grant", {"TTL": str(lease_ttl(ttl))}, deadline=deadline))[
                            "ID"
                        ]
                    )
                    log.debug("registrations: lease %d granted for %s/%s", lease, group, id)
                old = view.state.regs.get(key)
                held = view.kvs.get(key) if old is not None else None
                old_lease = held.lease if held is not None else 0
                group_range, etcd_key = self.keys.group(group), self.keys.key(group, id)
                # no key of the group written since the view's revision (the rules checked on it hold),
                # and this key as the view holds it (a delete since is no write the first compare sees);
                # sent once: a copy applied later (by a member that hung with it) fails these compares
                sent = bool(lease)
                reply = await self.client.call(
                    "/v3/kv/txn",
                    wire.txn(
                        [
                            wire.unchanged_since(group_range, wire.range_end(group_range), view.revision),
                            wire.held_at(etcd_key, held.mod_revision if held is not None else 0),
                        ],
                        [wire.put(etcd_key, value, lease)],
                    ),
                    deadline=deadline,
                    once=True,
                )
                sent = False
                if reply.get("succeeded"):
                    lease, granted = 0, lease  # it is the registration's now
                    if old_lease and old_lease != granted:
                        await self._revoke(old_lease, deadline)
                    await self._caught_up(wire.revision(reply))
                    return self._state.regs.get(key, reg), old is None
                # another replica wrote to this group first: out of step with it, then look again
                await asyncio.sleep(rivals.next())
                if loop.time() >= deadline:
                    break
                view = await self._group_now(group, deadline)
        except (EtcdUnavailable, TimeoutError) as e:
            raise self._unreachable(e) from None
        except wire.EtcdError as e:
            raise RegistrationError(503, f"etcd refused the change: {e.message}") from None
        finally:
            if lease and not sent:
                self._revoke_later(lease)  # granted, not used (if it may have been, it expires by itself)
        raise RegistrationError(503, f"group {group!r} is changing too often to register into; retry")

    async def _keep_alive(self, lease: int, deadline: float) -> bool:
        """Renew `lease`; False when it is gone (expired, revoked)."""
        reply = await self.client.call("/v3/lease/keepalive", {"ID": str(lease)}, deadline=deadline)
        result = reply.get("result", reply)
        return int(result.get("TTL", 0) or 0) > 0

    async def _revoke(self, lease: int, deadline: float) -> None:
        """Revoke the lease a replaced or deleted registration was on, before answering. The key is
        already off it (the transaction moved or deleted it), so if etcd cannot be reached now the
        lease keeps nothing alive and expires by itself."""
        log.debug("registrations: revoking lease %d", lease)
        try:
            await self.client.call("/v3/lease/revoke", {"ID": str(lease)}, deadline=deadline)
        except (EtcdUnavailable, TimeoutError, wire.EtcdError) as e:
            log.debug("registrations: lease %x not revoked (%s); it expires by itself", lease, e)

    def _revoke_later(self, lease: int) -> None:
        """A lease granted for a write that did not happen: best effort, in the background."""

        async def revoke() -> None:
            with contextlib.suppress(Exception):
                await self._revoke(lease, asyncio.get_running_loop().time() + WRITE_DEADLINE)

        task = asyncio.create_task(revoke())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def delete(self, group: str, id: str) -> Registration | None:
        """A transaction on the key as last read (the view's, or etcd's now): a copy of it applied later
        (by a member that hung with it) cannot delete what was written since. 404 only when etcd
        holds no such key."""
        await self._usable()
        deadline = asyncio.get_running_loop().time() + WRITE_DEADLINE
        etcd_key = self.keys.key(group, id)
        held = self._kvs.get((group, id))
        try:
            for _ in range(ATTEMPTS):  # bounded, and by the deadline
                if held is None:
                    found = wire.kvs(
                        await self.client.call("/v3/kv/range", wire.range_request(etcd_key), deadline=deadline)
                    )
                    if not found:
                        raise RegistrationError(404, f"no registration {id!r} in group {group!r}")
                    held = found[0]
                reply = await self.client.call(
                    "/v3/kv/txn",
                    wire.txn(
                        [wire.held_at(etcd_key, held.mod_revision)],
                        [wire.delete(etcd_key)],
                    ),
                    deadline=deadline,
                    once=True,
                )
                if reply.get("succeeded"):
                    break
                held = None  # written since: read it again
            else:
                raise RegistrationError(
                    503, f"registration {id!r} in group {group!r} is changing too often to delete; retry"
                )
            deleted = wire.txn_deleted(reply)
            if deleted and deleted[0].lease:
                await self._revoke(deleted[0].lease, deadline)
        except (EtcdUnavailable, TimeoutError) as e:
            raise self._unreachable(e) from None
        except wire.EtcdError as e:
            raise RegistrationError(503, f"etcd refused the change: {e.message}") from None
        old = self._state.regs.get((group, id))
        await self._caught_up(wire.revision(reply))
        return (self._entry(deleted[0]) if deleted else None) or old

    async def _read_now(self, path: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """A linearizable read that is not behind this replica's view: what the watch brought is
        committed, so an answer from before it (a member restored from an older backup, a proxy
        answering from a cache) cannot be the current state. It is asked again of the next member,
        a few times, then refused."""
        for _ in range(STALE_READ_TRIES):  # bounded
            seen = self._revision
            reply = await self.client.call(path, body, deadline=deadline)
            if wire.revision(reply) >= seen:
                return reply
            self._stale_reads.log(
                logging.WARNING,
                "registrations: %s answered a read at revision %d, behind this view (%d): asking another member",
                self.client.member,
                wire.revision(reply),
                seen,
            )
            self.client.rotate()
        raise EtcdUnavailable(f"every answer was behind this replica's view (revision {self._revision})")

    async def read(self, group: str, id: str) -> Registration | None:
        """One registration as etcd holds it now (a linearizable read), not as this replica's view may
        still hold it: an answer never goes back in time, whichever replica is asked."""
        if not self.liveness.loaded:
            raise RegistrationError(503, "registrations are not loaded from etcd yet")
        deadline = asyncio.get_running_loop().time() + WRITE_DEADLINE
        try:
            reply = await self._read_now("/v3/kv/range", wire.range_request(self.keys.key(group, id)), deadline)
        except (EtcdUnavailable, TimeoutError) as e:
            raise RegistrationError(
                503,
                f"etcd cannot be reached ({e}); this replica's view may be stale: "
                f"see /v1/groups/{group}/endpoints for it",
            ) from None
        except wire.EtcdError as e:
            raise RegistrationError(503, f"etcd refused the read: {e.message}") from None
        found = wire.kvs(reply)
        return self._entry(found[0]) if found else None


@dataclass
class GroupView:
    """What a write's checks are made on: this replica's view, or one group as etcd holds it now
    (`fresh`), as of `revision`, with each registration's key (its lease and mod revision)."""

    state: State
    revision: int
    kvs: Mapping[Key, wire.KeyValue]
    fresh: bool


class Turns:
    """One lock per key, kept only while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        """Keys with a lock now: none once every holder and waiter has left (the memory bound)."""
        return len(self._locks)

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
