"""The registrations as etcd keys and values, and every read and transaction on them.

Apart from the source, so that what goes over the wire (which compares a transaction makes, which
call may be sent once only, which read must not be behind the view) reads in one place; the source
decides when to make them, and what an answer means for the registration API.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..model import Endpoint
from ..ratelimit import LogBudget
from . import etcd_wire as wire
from .base import WarnOnce
from .etcd_client import EtcdClient, EtcdUnavailable
from .registrations import (
    Key,
    Registration,
    RegistrationError,
    State,
    check_group,
    check_id,
    check_ttl,
    parse_endpoint,
    registration_entry,
    reject_constant,
)

log = logging.getLogger("eds_server.sources.registrations")

WRITE_DEADLINE = 4.0  # seconds a write may spend reaching etcd before it answers 503
STALE_READ_TRIES = 3  # members asked for a read not behind the view


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


@dataclass
class GroupView:
    """What a write's checks are made on: this replica's view, or one group as etcd holds it now
    (`fresh`), as of `revision`, with each registration's key (its lease and mod revision)."""

    state: State
    revision: int
    kvs: Mapping[Key, wire.KeyValue]
    fresh: bool


class RegistrationKV:
    """The registrations' keys under the target's prefix, read and written through `client`.

    `view_revision` is the revision this replica's view is at: a linearizable read answered from
    before it is not the current state (see `read_now`)."""

    def __init__(self, client: EtcdClient, view_revision: Callable[[], int]) -> None:
        self.client = client
        self.keys = wire.KeyLayout(client.target.prefix)
        self._view_revision = view_revision
        self._skipped = WarnOnce(log)  # keys whose value is not a registration
        self._stale_reads = LogBudget(log)

    # -- keys and values -----------------------------------------------------------------------
    def parse(self, key: bytes) -> Key | None:
        """The (group, id) of a registration's key; None for another key under the prefix."""
        return self.keys.parse(key)

    def entry(self, kv: wire.KeyValue) -> Registration | None:
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

    def deleted(self, key: bytes) -> None:
        """A key deleted in etcd: its value, if it was not a registration, is warned of again if it comes back."""
        self._skipped.forget(key.decode("utf-8", "replace"))

    # -- following -----------------------------------------------------------------------------
    async def list_all(self, deadline: float) -> tuple[list[wire.KeyValue], int]:
        """Every key under the prefix, and the revision they are etcd's as of."""
        reply = await self.client.call(
            "/v3/kv/range", wire.range_request(self.keys.all, wire.range_end(self.keys.all)), deadline=deadline
        )
        return wire.kvs(reply), wire.revision(reply)

    def watch(self, after: int, member: str, connect_timeout: float) -> AsyncIterator[wire.WatchMessage]:
        """The changes under the prefix after revision `after`, from `member` only."""
        body = wire.watch_request(self.keys.all, wire.range_end(self.keys.all), after + 1)
        return self.client.watch(body, connect_timeout=connect_timeout, member=member)

    async def probe(
        self, member: str, deadline: float, changed: tuple[int, int] | None = None
    ) -> tuple[int, list[wire.KeyValue]]:
        """A linearizable read of `member` only: etcd's revision now, and with `changed` (lo, hi)
        one key under the prefix last written in that range of revisions, if any."""
        everything = (self.keys.all, wire.range_end(self.keys.all))
        if changed is not None:
            lo, hi = changed
            body = wire.range_request(*everything, keys_only=True, limit=1, min_mod_revision=lo, max_mod_revision=hi)
        else:
            body = wire.range_request(*everything, count_only=True)
        reply = await self.client.call("/v3/kv/range", body, deadline=deadline, member=member)
        return wire.revision(reply), wire.kvs(reply) if changed is not None else []

    # -- reading now ---------------------------------------------------------------------------
    async def read_now(self, path: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """A linearizable read that is not behind this replica's view: what the watch brought is
        committed, so an answer from before it (a member restored from an older backup, a proxy
        answering from a cache) cannot be the current state. It is asked again of the next member,
        a few times, then refused."""
        for _ in range(STALE_READ_TRIES):  # bounded
            seen = self._view_revision()
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
        raise EtcdUnavailable(f"every answer was behind this replica's view (revision {self._view_revision()})")

    async def read(self, group: str, id: str, deadline: float) -> wire.KeyValue | None:
        """One key as etcd holds it now (`read_now`)."""
        reply = await self.read_now("/v3/kv/range", wire.range_request(self.keys.key(group, id)), deadline)
        found = wire.kvs(reply)
        return found[0] if found else None

    async def read_group(self, group: str, deadline: float) -> GroupView:
        """The group as etcd holds it now (`read_now`), for checks that must not see a stale view."""
        prefix = self.keys.group(group)
        reply = await self.read_now("/v3/kv/range", wire.range_request(prefix, wire.range_end(prefix)), deadline)
        state, kvs = State(), {}
        for kv in wire.kvs(reply):
            reg = self.entry(kv)
            if reg is not None:
                state.add(reg)
                kvs[reg.key] = kv
        return GroupView(state, wire.revision(reply), kvs, fresh=True)

    async def holding(self, group: str, id: str, value: bytes, deadline: float) -> wire.KeyValue | None:
        """The key as etcd holds it now (`read_now`) if it holds exactly `value`; None otherwise."""
        key = self.keys.key(group, id)
        reply = await self.read_now("/v3/kv/txn", wire.txn([wire.value_is(key, value)], [wire.get(key)]), deadline)
        held = wire.txn_range(reply) if reply.get("succeeded") else []
        return held[0] if held else None

    async def get(self, group: str, id: str, deadline: float) -> wire.KeyValue | None:
        """One key, from whichever member answers (a delete compares its mod revision: a stale
        answer only makes the compare fail)."""
        found = wire.kvs(
            await self.client.call("/v3/kv/range", wire.range_request(self.keys.key(group, id)), deadline=deadline)
        )
        return found[0] if found else None

    # -- changing ------------------------------------------------------------------------------
    async def put_if(
        self, group: str, id: str, value: bytes, lease: int, *, group_at: int, key_at: int, deadline: float
    ) -> int | None:
        """Put the key on `lease` if no key of the group was written since `group_at` (the rules
        checked on the group as of then hold) and the key itself is as of `key_at` (0: absent; a
        delete since is no write the first compare sees). Sent once: a copy applied later (by a
        member that hung with it) fails these compares. The revision it was committed at, or None
        when a compare failed."""
        group_range, etcd_key = self.keys.group(group), self.keys.key(group, id)
        reply = await self.client.call(
            "/v3/kv/txn",
            wire.txn(
                [
                    wire.unchanged_since(group_range, wire.range_end(group_range), group_at),
                    wire.held_at(etcd_key, key_at),
                ],
                [wire.put(etcd_key, value, lease)],
            ),
            deadline=deadline,
            once=True,
        )
        return wire.revision(reply) if reply.get("succeeded") else None

    async def delete_if(
        self, group: str, id: str, mod_revision: int, deadline: float
    ) -> tuple[int, list[wire.KeyValue]] | None:
        """Delete the key if it is still as of `mod_revision`, sent once (a copy applied later
        cannot delete what was written since): the revision it was committed at and the key as it
        was, or None when it was written since."""
        etcd_key = self.keys.key(group, id)
        reply = await self.client.call(
            "/v3/kv/txn",
            wire.txn([wire.held_at(etcd_key, mod_revision)], [wire.delete(etcd_key)]),
            deadline=deadline,
            once=True,
        )
        if not reply.get("succeeded"):
            return None
        return wire.revision(reply), wire.txn_deleted(reply)
