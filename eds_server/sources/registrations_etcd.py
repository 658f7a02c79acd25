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

The parts, each readable alone: `etcd_kv.py` (the keys, values and transactions), `etcd_view.py`
(what this replica serves), `etcd_follow.py` (list, watch, probe), `etcd_leases.py` (a TTL's
lease); here, the registration API's answers, made of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from ..model import Endpoint
from . import etcd_wire as wire
from .base import Backoff, Feed, Liveness, SourceStatus
from .etcd_client import EtcdClient, EtcdOptions, EtcdUnavailable
from .etcd_follow import Follower
from .etcd_kv import WRITE_DEADLINE, GroupView, RegistrationKV, encode
from .etcd_leases import Leases
from .etcd_view import RegistrationView
from .registrations import (
    MAX_REGISTRATIONS,
    MAX_STATE_BYTES,
    SOURCE_NAME,
    Registration,
    RegistrationError,
    State,
    check_address,
    check_limits,
    check_merged,
    check_weights,
)

log = logging.getLogger("eds_server.sources.registrations")

CATCH_UP_TIMEOUT = 3.0  # a committed write waits this long, at most, for the watch to bring it here
STALE_WAIT = 3.0  # a write through a stale view waits this long for it to follow etcd again, then 503
ATTEMPTS = 64  # tries of one write (each failed compare: another replica wrote to the group first)


class EtcdRegistrationSource:
    """The registration API's store when its state is in etcd: answers from the view (`view`), kept
    following by `follower`, and changes made as transactions (`kv`) on leases (`leases`)."""

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
        self.client = EtcdClient(target, options or EtcdOptions())
        self.max_registrations = max_registrations
        self.max_state_bytes = max_state_bytes
        self.name = name
        self.liveness = Liveness(feed, name, f"etcd {target}")
        self.kv = RegistrationKV(self.client, lambda: self.view.revision)
        self.view = RegistrationView(feed, name, self.kv, monotonic)
        self.leases = Leases(self.client)
        self.follower = Follower(self.kv, self.view, self.liveness)
        self._turns = Turns()

    # -- reading -------------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self.liveness.loaded

    def registrations(self, group: str | None = None) -> list[Registration]:
        return [r for r in self.view.state.regs.values() if group is None or r.group == group]

    def get(self, group: str, id: str) -> Registration | None:
        return self.view.state.regs.get((group, id))

    def expires_in(self, reg: Registration) -> float | None:
        """At most this long (a renewal through another replica extends it without this one seeing it)."""
        return self.view.expires_in(reg)

    def status(self) -> SourceStatus:
        return self.liveness.status(
            state=str(self.target),
            revision=self.view.revision,
            watching=self.client.watching,
            registrations=len(self.view.state.regs),
            max_registrations=self.max_registrations,
        )

    async def start(self) -> None:
        """Nothing to check before serving: until etcd is listed the store waits (not ready)."""

    async def run(self, stop: asyncio.Event) -> None:
        """List, then watch, until `stop` is set; on any failure keep the view (stale) and retry."""
        await self.follower.run(stop)

    async def read(self, group: str, id: str) -> Registration | None:
        """One registration as etcd holds it now (a linearizable read), not as this replica's view may
        still hold it: an answer never goes back in time, whichever replica is asked."""
        if not self.liveness.loaded:
            raise RegistrationError(503, "registrations are not loaded from etcd yet")
        deadline = asyncio.get_running_loop().time() + WRITE_DEADLINE
        try:
            found = await self.kv.read(group, id, deadline)
        except (EtcdUnavailable, TimeoutError) as e:
            raise RegistrationError(
                503,
                f"etcd cannot be reached ({e}); this replica's view may be stale: "
                f"see /v1/groups/{group}/endpoints for it",
            ) from None
        except wire.EtcdError as e:
            raise RegistrationError(503, f"etcd refused the read: {e.message}") from None
        return self.kv.entry(found) if found is not None else None

    # -- changing ------------------------------------------------------------------------------
    def _unreachable(self, e: Exception) -> RegistrationError:
        return RegistrationError(503, f"etcd cannot be reached ({e}): the change may not have been made; retry")

    def _checks(self, view: State, reg: Registration) -> None:
        """The group rules on `view` (this replica's, or the group as etcd holds it now); the count
        and size limits on this replica's view (so they may be passed by a few concurrent writes)."""
        check_address(view, reg)
        check_limits(self.view.state, reg, self.max_registrations, self.max_state_bytes)
        check_weights(view, reg)

    async def _usable(self) -> None:
        """Writes go through only while the view follows etcd: a write acknowledged into a view that
        will not see it would be a lie. A stale view is waited for, a few seconds at most."""
        if not self.liveness.loaded:
            raise RegistrationError(503, "registrations are not loaded from etcd yet")
        if not await self.view.wait_following(STALE_WAIT):
            raise RegistrationError(
                503,
                f"this replica's view of etcd is stale ({self.liveness.last_error}): "
                "nothing was changed; retry, here or through another replica",
            )

    async def _caught_up(self, revision: int) -> None:
        """Wait (bounded) until the view holds `revision`: a write answers 2xx only once this replica
        serves it. Past the bound the watch is moved and the write answers 503 (it is in etcd, and
        every replica serves it once its watch brings it)."""
        if not await self.view.wait_for(revision, CATCH_UP_TIMEOUT):
            reason = (
                f"the watch on {self.client.watching} did not bring revision {revision} within "
                f"{CATCH_UP_TIMEOUT:g}s (the view is at {self.view.revision})"
            )
            self.follower.suspect(reason)
            raise RegistrationError(
                503,
                f"etcd committed the change, but {reason}: this replica serves it once "
                "its watch (moved to another member) brings it; retrying is safe",
            )

    async def put(self, group: str, id: str, endpoint: Endpoint, ttl: float | None = None) -> tuple[Registration, bool]:
        """Register, replace or renew; returns once etcd committed it and this replica serves it.

        Writes to one group through this replica take turns (their transactions would fail each
        other's compare); a registration this view holds unchanged is confirmed in etcd (and its
        lease kept alive) rather than written again, and written if etcd holds something else."""
        check_merged(self.feed, self.name, group, self.view.delivered.members.get(group, {}), id, endpoint)
        await self._usable()
        value = encode(group, id, endpoint, ttl)
        known = self.view.state.regs.get((group, id))
        if known is not None and known.line == value:  # a renewal, or the same again: confirmed in etcd
            try:
                held = await self._confirm(group, id, value, ttl, asyncio.get_running_loop().time() + WRITE_DEADLINE)
            except (EtcdUnavailable, TimeoutError) as e:
                raise self._unreachable(e) from None
            except wire.EtcdError as e:
                raise RegistrationError(503, f"etcd refused the renewal: {e.message}") from None
            if held is not None:
                await self._caught_up(held.mod_revision)
                return self.view.state.regs.get((group, id), known), False
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
        held = await self.kv.holding(group, id, value, deadline)
        if held is None:
            return None
        if ttl is not None:
            if not held.lease or not await self.leases.keep_alive(held.lease, deadline):
                return None
            self.view.renewed((group, id))
        return held

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
        view = GroupView(self.view.state, self.view.revision, self.view.kvs, fresh=False)
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
                    view = await self.kv.read_group(group, deadline)
                    continue
                if ttl is not None and not lease:
                    lease = await self.leases.grant(ttl, deadline)
                    log.debug("registrations: lease %d granted for %s/%s", lease, group, id)
                old = view.state.regs.get(key)
                held = view.kvs.get(key) if old is not None else None
                old_lease = held.lease if held is not None else 0
                sent = bool(lease)
                committed = await self.kv.put_if(
                    group,
                    id,
                    value,
                    lease,
                    group_at=view.revision,
                    key_at=held.mod_revision if held is not None else 0,
                    deadline=deadline,
                )
                sent = False
                if committed is not None:
                    lease, granted = 0, lease  # it is the registration's now
                    if old_lease and old_lease != granted:
                        await self.leases.revoke(old_lease, deadline)
                    await self._caught_up(committed)
                    return self.view.state.regs.get(key, reg), old is None
                # another replica wrote to this group first: out of step with it, then look again
                await asyncio.sleep(rivals.next())
                if loop.time() >= deadline:
                    break
                view = await self.kv.read_group(group, deadline)
        except (EtcdUnavailable, TimeoutError) as e:
            raise self._unreachable(e) from None
        except wire.EtcdError as e:
            raise RegistrationError(503, f"etcd refused the change: {e.message}") from None
        finally:
            if lease and not sent:
                self.leases.revoke_later(lease)  # granted, not used (if it may have been, it expires by itself)
        raise RegistrationError(503, f"group {group!r} is changing too often to register into; retry")

    async def delete(self, group: str, id: str) -> Registration | None:
        """A transaction on the key as last read (the view's, or etcd's now): a copy of it applied later
        (by a member that hung with it) cannot delete what was written since. 404 only when etcd
        holds no such key."""
        await self._usable()
        deadline = asyncio.get_running_loop().time() + WRITE_DEADLINE
        held = self.view.kvs.get((group, id))
        try:
            for _ in range(ATTEMPTS):  # bounded, and by the deadline
                if held is None:
                    held = await self.kv.get(group, id, deadline)
                    if held is None:
                        raise RegistrationError(404, f"no registration {id!r} in group {group!r}")
                done = await self.kv.delete_if(group, id, held.mod_revision, deadline)
                if done is not None:
                    break
                held = None  # written since: read it again
            else:
                raise RegistrationError(
                    503, f"registration {id!r} in group {group!r} is changing too often to delete; retry"
                )
            revision, deleted = done
            if deleted and deleted[0].lease:
                await self.leases.revoke(deleted[0].lease, deadline)
        except (EtcdUnavailable, TimeoutError) as e:
            raise self._unreachable(e) from None
        except wire.EtcdError as e:
            raise RegistrationError(503, f"etcd refused the change: {e.message}") from None
        old = self.view.state.regs.get((group, id))
        await self._caught_up(revision)
        return (self.kv.entry(deleted[0]) if deleted else None) or old


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
