"""Registrations as a source: endpoints that are not containers, registered over HTTP.

Each registration is (group, id) -> one Endpoint, optionally with a TTL after which it expires unless
it is registered again. The whole state is kept in a JSON file, rewritten atomically (temp file,
fsync, rename, fsync of the directory) *before* a change is acknowledged or reaches the store, so
an acknowledged registration survives a crash. Concurrent changes are committed together (one
write for everything that queued up while the previous write ran), so renewals scale with the
disk's latency, not with the number of registrations.

Expiry times are kept twice: on the monotonic clock, which decides expiry while the process runs
(a wall-clock step does not expire anything early), and on the wall clock, which is what the file
holds so expiry survives a restart. An entry already expired when the file is loaded is dropped.
Expiry does not wait for the disk: an expired entry is removed from the store at once and the file
is rewritten afterwards (a stale entry left in the file is expired by its own time at the next load).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import secrets
import time
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import fields
from ..health import spec as health_spec
from ..model import Endpoint, Group, endpoint_json
from .base import Feed, SourceStatus
from .state_lock import StateLock, StateLockError

log = logging.getLogger("eds_server.sources.registrations")

SOURCE_NAME = "registrations"
STATE_FORMAT_VERSION = 1
MAX_REGISTRATIONS = 10_000
MAX_STATE_BYTES = 32 * 1024 * 1024  # the state file, i.e. the registrations' own size, at most
MAX_TTL = 86_400.0  # one day
MAX_ID_LENGTH = 256
MAX_PENDING = 4096  # changes waiting for the disk; more are refused (503) rather than queued
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]+")
TTL_KEY = "ttl"
HEALTH_CHECK_KEY = "health_check"
ENDPOINT_KEYS = (*fields.ENDPOINT_KEYS, HEALTH_CHECK_KEY)  # a registration's endpoint, as stored
REGISTRATION_KEYS = (*ENDPOINT_KEYS, TTL_KEY)

Key = tuple[str, str]  # (group, id)


class RegistrationError(Exception):
    """A change that was refused: `status` is the HTTP status that says why; nothing changed."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


class RegistrationStateError(Exception):
    """The state file cannot be used: the server must not start (its registrations would be lost)."""


# -- checks shared by the API and the state file ----------------------------------------------------
def check_group(name: Any) -> str:
    """The upstreams file's rule for group names, and no control or format characters (newlines,
    NUL, bidi overrides): a name is written to logs and shown to operators."""
    if not isinstance(name, str) or not name.strip() or name != name.strip() or len(name) > fields.MAX_NAME_LENGTH:
        raise ValueError(f"group names must be 1-{fields.MAX_NAME_LENGTH} characters, no outer spaces")
    if any(unicodedata.category(c)[0] == "C" for c in name):
        raise ValueError("group names may not hold control or format characters (newlines, NUL, bidi controls)")
    return name


def check_id(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_ID_LENGTH or not ID_PATTERN.fullmatch(value):
        raise ValueError(f"ids are 1-{MAX_ID_LENGTH} characters of A-Z a-z 0-9 . _ : -")
    return value


def check_ttl(value: Any) -> float | None:
    """Seconds (> 0, at most a day); None (or absent) for a registration that does not expire."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{value!r} is not a number of seconds")
    if not 0 < value <= MAX_TTL:
        raise ValueError(f"{value!r} is not a ttl (more than 0, at most {MAX_TTL:g} seconds)")
    return value


def parse_endpoint(spec: Mapping[str, Any], allowed: tuple[str, ...] = ENDPOINT_KEYS) -> Endpoint:
    """An endpoint from a JSON object with the upstreams file's keys and checks, and a
    `health_check` as the file's (its checks go to the endpoint's own address, which the
    registration policy has allowed).

    Raises RegistrationError(422) naming the first bad field.
    """
    for key in spec:
        if key not in allowed:
            raise RegistrationError(422, f"unknown field (expected one of: {', '.join(allowed)})", key)
    for required in ("address", "port"):
        if required not in spec:
            raise RegistrationError(422, "missing", required)
    values: dict[str, Any] = {}
    for key in fields.ENDPOINT_KEYS:
        if key in spec:
            try:
                values[key] = fields.ENDPOINT_CHECKS[key](spec[key])
            except ValueError as e:
                raise RegistrationError(422, str(e), key) from None
    endpoint = Endpoint.from_fields(values)
    if HEALTH_CHECK_KEY in spec:
        raw = spec[HEALTH_CHECK_KEY]
        if not isinstance(raw, dict):
            raise RegistrationError(
                422, 'must be an object, e.g. {"http": "/health", "interval": "1s"}', HEALTH_CHECK_KEY
            )
        try:
            check = health_spec.parse(raw)
        except health_spec.SpecError as e:
            raise RegistrationError(422, str(e), f"{HEALTH_CHECK_KEY}.{e.field}") from None
        if check is not None:
            endpoint = dataclasses.replace(endpoint, check=check)
    return endpoint


# -- state ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Registration:
    group: str
    id: str
    endpoint: Endpoint
    ttl: float | None = None
    expires_at: float | None = None  # wall clock (time.time()); what the state file holds
    deadline: float | None = None  # monotonic clock; what decides expiry while running
    line: bytes = field(default=b"", compare=False, repr=False)  # this entry in the state file

    @property
    def key(self) -> Key:
        return (self.group, self.id)

    @property
    def size(self) -> int:
        return len(self.line)


def registration_entry(group: str, id: str, ep: Endpoint, ttl: float | None) -> dict[str, Any]:
    """A registration as the state file and etcd hold it (the file adds `expires_at`)."""
    entry: dict[str, Any] = {"group": group, "id": id, "endpoint": endpoint_json(ep)}
    if ttl is not None:
        entry["ttl"] = ttl
    return entry


def _make(
    group: str, id: str, ep: Endpoint, ttl: float | None, expires_at: float | None, deadline: float | None
) -> Registration:
    entry = registration_entry(group, id, ep, ttl)
    if ttl is not None:
        entry["expires_at"] = expires_at
    line = json.dumps(entry, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    return Registration(group, id, ep, ttl, expires_at, deadline, line)


class State:
    """Registrations plus the indexes the checks need; copied once per commit (O(n), n <= the limit)."""

    def __init__(self) -> None:
        self.regs: dict[Key, Registration] = {}
        self.by_address: dict[tuple[str, str, int], str] = {}  # (group, address, port) -> id
        self.weights: dict[tuple[str, int], int] = {}  # (group, priority) -> endpoint weight sum
        self.size = 0
        self.earliest = math.inf  # no deadline is before this (a lower bound: expiry scans only when due)
        self.touched: set[Key] = set()  # registrations changed since this copy was made

    def copy(self) -> State:
        new = State()
        new.regs = dict(self.regs)
        new.by_address = dict(self.by_address)
        new.weights = dict(self.weights)
        new.size = self.size
        new.earliest = self.earliest
        return new

    def add(self, reg: Registration) -> None:
        self.remove(reg.key)
        ep = reg.endpoint
        self.regs[reg.key] = reg
        self.by_address[(reg.group, ep.address, ep.port)] = reg.id
        bucket = (reg.group, ep.priority)
        self.weights[bucket] = self.weights.get(bucket, 0) + (ep.weight or 1)
        self.size += reg.size
        if reg.deadline is not None:
            self.earliest = min(self.earliest, reg.deadline)
        self.touched.add(reg.key)

    def remove(self, key: Key) -> Registration | None:
        reg = self.regs.pop(key, None)
        if reg is None:
            return None
        ep = reg.endpoint
        self.by_address.pop((reg.group, ep.address, ep.port), None)
        bucket = (reg.group, ep.priority)
        left = self.weights.get(bucket, 0) - (ep.weight or 1)
        if left > 0:
            self.weights[bucket] = left
        else:
            self.weights.pop(bucket, None)
        self.size -= reg.size
        self.touched.add(key)
        return reg

    def expired(self, now: float) -> list[Key]:
        """The registrations due at `now`; O(n), but only when one may be due."""
        if now < self.earliest:
            return []
        due: list[Key] = []
        earliest = math.inf
        for key, reg in self.regs.items():
            if reg.deadline is None:
                continue
            if reg.deadline <= now:
                due.append(key)
            elif reg.deadline < earliest:
                earliest = reg.deadline
        self.earliest = earliest
        return due

    def next_deadline(self) -> float | None:
        """When to look again (possibly early: then `expired` finds nothing and knows better)."""
        return None if self.earliest == math.inf else self.earliest

    def dump(self) -> bytes:
        lines = b",\n".join([r.line for r in self.regs.values()])
        head = f'{{"version": {STATE_FORMAT_VERSION}, "registrations": [\n'.encode()
        return head + lines + b"\n]}\n"


def check_put(state: State, reg: Registration, max_registrations: int, max_state_bytes: int) -> None:
    """Raise RegistrationError(409) if adding `reg` to `state` breaks a rule; changes nothing."""
    check_address(state, reg)
    check_limits(state, reg, max_registrations, max_state_bytes)
    check_weights(state, reg)


def check_address(group_state: State, reg: Registration) -> None:
    """One id per address:port in a group (only `reg`'s group of `group_state` is looked at)."""
    ep = reg.endpoint
    other = group_state.by_address.get((reg.group, ep.address, ep.port))
    if other is not None and other != reg.id:
        shown = fields.address_port(ep.address, ep.port)
        raise RegistrationError(409, f"{shown} is already registered in group {reg.group!r} as {other!r}", "address")


def check_limits(state: State, reg: Registration, max_registrations: int, max_state_bytes: int) -> None:
    """How many registrations, and how many bytes of them, all groups together."""
    old = state.regs.get(reg.key)
    if old is None and len(state.regs) >= max_registrations:
        raise RegistrationError(409, f"registration limit reached ({max_registrations})")
    if state.size - (old.size if old else 0) + reg.size > max_state_bytes:
        raise RegistrationError(409, f"registration limit reached (state size {max_state_bytes} bytes)")


def check_weights(group_state: State, reg: Registration) -> None:
    """Envoy's limit on the weights of one priority of the group (registrations alone)."""
    ep, group = reg.endpoint, reg.group
    old = group_state.regs.get(reg.key)
    bucket = (group, ep.priority)
    total = group_state.weights.get(bucket, 0) + (ep.weight or 1)
    if old is not None and old.endpoint.priority == ep.priority:
        total -= old.endpoint.weight or 1
    if total > fields.UINT32_MAX:
        raise RegistrationError(
            409,
            f"the weights of group {group!r} in priority {ep.priority} would add "
            f"up to {total}, over Envoy's limit of {fields.UINT32_MAX}",
            "weight",
        )


def check_merged(
    feed: Feed, source: str, group: str, members: Mapping[str, Endpoint], id: str, endpoint: Endpoint
) -> None:
    """Refuse what would make the group, merged with the other sources, one Envoy rejects. (The
    store checks again on every change: this is for a clear answer to the caller.)"""

    def part(members: Mapping[str, Endpoint]) -> Group | None:
        return Group(group, tuple(members.values())) if members else None

    if members.get(id) == endpoint or feed.problems_with(source, group, part(members)):
        return  # no change, or already refused for reasons of the other sources
    problems = feed.problems_with(source, group, part({**members, id: endpoint}))
    if problems:
        raise RegistrationError(
            409,
            f"group {group!r} merged with the other sources would be rejected by Envoy: {problems[0]}",
            "weight",
        )


class Delivered:
    """The groups a registration store hands the store, rebuilt only for the groups a change touched
    (the others' Group objects are reused, so the store re-encodes only those)."""

    def __init__(self, feed: Feed, name: str) -> None:
        self.feed, self.name = feed, name
        self.members: dict[str, dict[str, Endpoint]] = {}  # group -> id -> endpoint
        self.groups: dict[str, Group] = {}

    def publish(self, regs: Mapping[Key, Registration], touched: Iterable[Key], initial: bool = False) -> None:
        """Deliver the groups of the registrations in `touched` as `regs` now holds them."""
        groups: set[str] = set()
        for key in touched:
            group, id = key
            groups.add(group)
            reg = regs.get(key)
            if reg is not None:
                self.members.setdefault(group, {})[id] = reg.endpoint
            elif group in self.members:
                self.members[group].pop(id, None)
        for group in groups:
            members = self.members.get(group)
            if members:
                # order does not matter: the encoding is canonical, so is the version
                self.groups[group] = Group(group, tuple(members.values()))
            else:
                self.members.pop(group, None)
                self.groups.pop(group, None)
        if groups or initial:
            changed = self.feed.publish(self.name, dict(self.groups))
            if changed:
                log.info("registrations: groups changed: %s", ", ".join(sorted(changed)))


class Registrations(Protocol):
    """What the registration API needs of a registration store (a state file, or etcd)."""

    name: str
    max_registrations: int

    def registrations(self, group: str | None = None) -> list[Registration]: ...
    def get(self, group: str, id: str) -> Registration | None: ...
    async def read(self, group: str, id: str) -> Registration | None: ...
    def expires_in(self, reg: Registration) -> float | None: ...
    async def put(
        self, group: str, id: str, endpoint: Endpoint, ttl: float | None = None
    ) -> tuple[Registration, bool]: ...
    async def delete(self, group: str, id: str) -> Registration | None: ...


# -- ops: applied in order to a copy of the state, then written once ---------------------------------
@dataclass(frozen=True, slots=True)
class _Put:
    group: str
    id: str
    endpoint: Endpoint
    ttl: float | None


@dataclass(frozen=True, slots=True)
class _Delete:
    group: str
    id: str


@dataclass(frozen=True, slots=True)
class _Flush:
    """Rewrite the file (after expiries), changing nothing."""


_Op = _Put | _Delete | _Flush


@dataclass(slots=True)
class _Outcome:
    registration: Registration | None = None
    created: bool = False
    error: RegistrationError | None = None


def write_atomically(path: str, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new file, never a mix,
    and the new one is on disk when this returns."""
    directory = os.path.dirname(os.path.abspath(path))
    # a fresh random name, created here and nowhere else: never a file or symlink planted in advance
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class RegistrationSource:
    def __init__(
        self,
        feed: Feed,
        state_path: str | None,
        *,
        max_registrations: int = MAX_REGISTRATIONS,
        max_state_bytes: int = MAX_STATE_BYTES,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        name: str = SOURCE_NAME,
    ) -> None:
        self.feed = feed
        self.state_path = state_path
        self.max_registrations = max_registrations
        self.max_state_bytes = max_state_bytes
        self.name = name
        self.last_error: str | None = None  # the last failed write of the state file
        self.writes = 0  # state file writes, for tests and metrics
        self._clock = clock
        self._mono = monotonic
        self._state = State()  # committed: on disk and in the store
        self._delivered = Delivered(feed, name)  # what the store has from us
        self._queue: list[tuple[_Op, asyncio.Future[_Outcome]]] = []
        self._writer: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._dirty = False  # the file still holds entries that have expired since
        self._loaded = False
        self._lock = StateLock(state_path) if state_path is not None else None

    # -- reading -------------------------------------------------------------------------------
    def registrations(self, group: str | None = None) -> list[Registration]:
        regs = self._state.regs.values()
        return [r for r in regs if group is None or r.group == group]

    def get(self, group: str, id: str) -> Registration | None:
        return self._state.regs.get((group, id))

    async def read(self, group: str, id: str) -> Registration | None:
        """What this process holds is all there is: the state file is its own."""
        return self.get(group, id)

    def expires_in(self, reg: Registration) -> float | None:
        return None if reg.deadline is None else max(0.0, reg.deadline - self._mono())

    def status(self) -> SourceStatus:
        """Live once loaded; `last_error` is the last failed write of the state file."""
        return SourceStatus(
            self.name,
            self._loaded,
            self._loaded,
            self.last_error,
            {
                "state_file": self.state_path,
                "registrations": len(self._state.regs),
                "max_registrations": self.max_registrations,
            },
        )

    async def start(self) -> None:
        self.load()

    # -- start ---------------------------------------------------------------------------------
    def load(self) -> None:
        """Read the state file and deliver it; raise RegistrationStateError if it cannot be used.

        A missing file is a first start: an empty one is written, so a directory that cannot be
        written is found now rather than at the first registration.
        """
        path = self.state_path
        state = State()
        if path is None:
            log.warning("registrations are kept in memory only (no state file): a restart loses them")
        else:
            self._hold(path)
            try:
                with open(path, "rb") as f:
                    data: bytes | None = f.read()
            except FileNotFoundError:
                data = None
            except OSError as e:
                raise RegistrationStateError(f"{path}: cannot read: {e.strerror or e}") from None
            dropped = 0
            if data is not None:
                state, dropped = self._parse(path, data)
            try:
                write_atomically(path, state.dump())
            except OSError as e:
                raise RegistrationStateError(
                    f"{path}: cannot write the state file: {e.strerror or e} (its directory must exist and be writable)"
                ) from None
            log.info(
                "loaded %s: %d registrations%s",
                path,
                len(state.regs),
                f" ({dropped} expired while the server was down)" if dropped else "",
            )
            if len(state.regs) > self.max_registrations:
                log.warning(
                    "%s holds %d registrations, over the limit of %d: no new ones are accepted",
                    path,
                    len(state.regs),
                    self.max_registrations,
                )
        self._state = state
        self._loaded = True
        self._publish(set(state.touched), initial=True)
        state.touched.clear()

    def _hold(self, path: str) -> None:
        assert self._lock is not None
        try:
            self._lock.acquire()
        except StateLockError as e:
            raise RegistrationStateError(f"{path}: {e}") from None
        except OSError as e:
            raise RegistrationStateError(
                f"{path}: cannot write the lock file {self._lock.path}: {e.strerror or e} "
                "(its directory must exist and be writable)"
            ) from None

    def close(self) -> None:
        """Let another process take the state file."""
        if self._lock is not None:
            self._lock.release()

    def _parse(self, path: str, data: bytes) -> tuple[State, int]:
        def bad(where: str, message: str) -> RegistrationStateError:
            return RegistrationStateError(
                f"{path}: {where}{': ' if where else ''}{message} "
                "(so that no acknowledged registration is lost: fix the file, or move it away to start with none)"
            )

        try:
            top = json.loads(data.decode("utf-8"), parse_constant=reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise bad("", f"not a valid state file: {e}") from None
        if not isinstance(top, dict) or not isinstance(top.get("registrations"), list):
            raise bad("", 'not a valid state file: expected {"version": 1, "registrations": [...]}')
        if top.get("version") != STATE_FORMAT_VERSION:
            raise bad("version", f"{top.get('version')!r} is not a known state file version")
        wall, mono = self._clock(), self._mono()
        state = State()
        dropped = 0
        for i, entry in enumerate(top["registrations"]):
            where = f"registrations[{i}]"
            if not isinstance(entry, dict):
                raise bad(where, "must be an object")
            unknown = set(entry) - {"group", "id", "endpoint", "ttl", "expires_at"}
            if unknown:
                raise bad(f"{where}.{sorted(unknown)[0]}", "unknown key")
            checked: list[Any] = []
            for key, check in (("group", check_group), ("id", check_id), ("ttl", check_ttl)):
                try:
                    checked.append(check(entry.get(key)))
                except ValueError as e:
                    raise bad(f"{where}.{key}", str(e)) from None
            group, id, ttl = checked
            if not isinstance(entry.get("endpoint"), dict):
                raise bad(f"{where}.endpoint", "must be an object")
            try:
                ep = parse_endpoint(entry["endpoint"])
            except RegistrationError as e:
                raise bad(f"{where}.endpoint.{e.field}", e.message) from None
            if (group, id) in state.regs:
                raise bad(where, f"duplicate registration {group}/{id}")
            if (other := state.by_address.get((group, ep.address, ep.port))) is not None:
                shown = fields.address_port(ep.address, ep.port)
                raise bad(where, f"{shown} is registered in {group!r} twice (also as {other!r})")
            if ttl is None:
                state.add(_make(group, id, ep, None, None, None))
                continue
            expires_at = entry.get("expires_at")
            if isinstance(expires_at, bool) or not isinstance(expires_at, int | float) or not math.isfinite(expires_at):
                raise bad(f"{where}.expires_at", "missing or not a number (needed with a ttl)")
            remaining = min(ttl, expires_at - wall)  # a wall clock set back extends nothing past the ttl
            if remaining <= 0:
                dropped += 1
                continue
            state.add(_make(group, id, ep, ttl, wall + remaining, mono + remaining))
        return state, dropped

    # -- changing ------------------------------------------------------------------------------
    async def put(self, group: str, id: str, endpoint: Endpoint, ttl: float | None = None) -> tuple[Registration, bool]:
        """Register (or replace, or renew) one endpoint; True when it is new.

        Returns only once the state file holds it and the store has it; raises RegistrationError.
        """
        self._check_merged(group, id, endpoint)
        out = await self._submit(_Put(group, id, endpoint, ttl))
        assert out.registration is not None
        return out.registration, out.created

    def _check_merged(self, group: str, id: str, endpoint: Endpoint) -> None:
        check_merged(self.feed, self.name, group, self._delivered.members.get(group, {}), id, endpoint)

    async def delete(self, group: str, id: str) -> Registration:
        out = await self._submit(_Delete(group, id))
        assert out.registration is not None
        return out.registration

    def _flush(self) -> None:
        """Rewrite the file in the background, not waiting for it (expiry must not wait on a slow disk).

        Best effort: a failure is in last_error, and tried again on the next round of `run`."""
        fut: asyncio.Future[_Outcome] = asyncio.get_running_loop().create_future()
        self._queue.append((_Flush(), fut))
        self._start_writer()

    def _start_writer(self) -> None:
        # A running writer looks at the queue again after each write, so one writer is enough.
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain(), name="registrations writer")

    async def _submit(self, op: _Op) -> _Outcome:
        if not self._loaded:
            raise RegistrationError(503, "registrations are not loaded yet")
        if len(self._queue) >= MAX_PENDING:
            raise RegistrationError(503, "too many changes waiting for the disk; retry")
        fut: asyncio.Future[_Outcome] = asyncio.get_running_loop().create_future()
        self._queue.append((op, fut))
        self._start_writer()
        # shielded: a client that hangs up does not stop a change that may already be on disk
        out = await asyncio.shield(fut)
        if out.error is not None:
            raise out.error
        return out

    async def _drain(self) -> None:
        """Commit everything queued, one state file write per round."""
        while self._queue:  # bounded by MAX_PENDING per round; ends when nobody is waiting
            batch, self._queue = self._queue, []
            try:
                outcomes = await self._commit([op for op, _ in batch])
            except Exception as e:  # a bug: fail the batch rather than leave callers waiting
                log.exception("registrations: commit failed")
                outcomes = [_Outcome(error=RegistrationError(500, f"internal error: {e!r}")) for _ in batch]
            for (_, fut), out in zip(batch, outcomes, strict=True):
                if not fut.done():
                    fut.set_result(out)

    async def _commit(self, ops: list[_Op]) -> list[_Outcome]:
        wall, mono = self._clock(), self._mono()
        new = self._state.copy()
        for key in new.expired(mono):
            new.remove(key)
        outcomes: list[_Outcome] = []
        write = False
        for op in ops:
            try:
                out, changed = self._apply(new, op, wall, mono)
            except RegistrationError as e:
                out, changed = _Outcome(error=e), False
            outcomes.append(out)
            write = write or changed
        if write and self.state_path is not None:
            was_dirty, self._dirty = self._dirty, False  # expire() during the write sets it again
            try:
                await asyncio.to_thread(write_atomically, self.state_path, new.dump())
            except OSError as e:
                self._dirty = self._dirty or was_dirty
                error = f"{self.state_path}: cannot write: {e.strerror or e}"
                if error != self.last_error:
                    log.error("%s (changes are refused until it can be written)", error)
                self.last_error = error
                err = RegistrationError(503, f"the change could not be saved: {e.strerror or e}; nothing changed")
                return [o if o.error is not None else _Outcome(error=err) for o in outcomes]
            self.writes += 1
            if self.last_error is not None:
                log.info("%s: written again", self.state_path)
            self.last_error = None
        if write:
            late = new.expired(self._mono())  # what expired while the file was written
            for key in late:
                new.remove(key)
            self._dirty = self._dirty or bool(late)
            self._state = new
            self._publish(new.touched)
            new.touched = set()
            if self._wake is not None:
                self._wake.set()
        return outcomes

    def _apply(self, state: State, op: _Op, wall: float, mono: float) -> tuple[_Outcome, bool]:
        if isinstance(op, _Flush):
            return _Outcome(), True
        key = (op.group, op.id)
        old = state.regs.get(key)
        if isinstance(op, _Delete):
            if old is None:
                raise RegistrationError(404, f"no registration {op.id!r} in group {op.group!r}")
            state.remove(key)
            return _Outcome(old), True
        ep = op.endpoint
        if old is not None and old.ttl is None and op.ttl is None and old.endpoint == ep:
            return _Outcome(old), False  # the same again: nothing to write
        reg = _make(
            op.group,
            op.id,
            ep,
            op.ttl,
            None if op.ttl is None else wall + op.ttl,
            None if op.ttl is None else mono + op.ttl,
        )
        check_put(state, reg, self.max_registrations, self.max_state_bytes)
        state.add(reg)
        return _Outcome(reg, created=old is None), True

    # -- delivering ----------------------------------------------------------------------------
    def _publish(self, touched: set[Key], initial: bool = False) -> None:
        self._delivered.publish(self._state.regs, touched, initial)

    def expire(self) -> int:
        """Drop what has expired, from the store at once; the file follows (see the module doc)."""
        keys = self._state.expired(self._mono())
        if not keys:
            return 0
        for key in keys:
            self._state.remove(key)
            log.info("registration %s/%s expired", *key)
        self._publish(self._state.touched)
        self._state.touched = set()
        self._dirty = True
        return len(keys)

    async def run(self, stop: asyncio.Event) -> None:
        """Expire registrations until `stop` is set; then wait (bounded) for the last write."""
        self._wake = asyncio.Event()
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                self._wake.clear()
                deadline = self._state.next_deadline()
                delay = 1.0 if deadline is None else min(1.0, max(0.0, deadline - self._mono()))
                waking = asyncio.create_task(self._wake.wait())
                await asyncio.wait({stopping, waking}, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
                waking.cancel()
                self.expire()
                if self._dirty and self.state_path is not None and (self._writer is None or self._writer.done()):
                    self._flush()
        finally:
            stopping.cancel()
            if self._writer is not None and not self._writer.done():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._writer), 5.0)
            self.close()


def reject_constant(name: str) -> Any:
    """json.loads' parse_constant: NaN and Infinity are not JSON (and not something Envoy takes)."""
    raise ValueError(f"{name} is not valid JSON")
