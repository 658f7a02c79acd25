"""Groups merged across sources, each encoded once per change, with content-derived versions.

The store knows nothing of gRPC or of who is listening: sources push whole states in, watchers are
plain callbacks told which names changed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass
from types import MappingProxyType

from . import envoy_checks
from .fields import counted
from .model import Group, merge_groups

log = logging.getLogger(__name__)

# Called with the names that changed, or None when everything should be looked at again
# (the store just became ready).
Watcher = Callable[[frozenset[str] | None], None]
Encoder = Callable[[Group], bytes]
# Called with the names that gained their first follower, and those that lost their last one.
Interest = Callable[[tuple[str, ...], tuple[str, ...]], None]
# Laid over each merged group before it is checked and encoded (the health checker's results).
Overlay = Callable[[Group], Group]
EMPTY_CACHE_SIZE = 4096


def content_version(data: bytes) -> str:
    """A version that never stands for two contents, across restarts and replicas alike."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass(frozen=True, eq=False, slots=True, weakref_slot=True)
class Resource:
    """One encoded ClusterLoadAssignment. Compared by identity; `version` says if content differs."""

    name: str
    version: str
    body: bytes
    group: Group
    changed_at: float = 0.0  # time.monotonic() when this version entered the store


_GROUP = Resource.__dict__["group"]  # the slot, below the property that shadows it in Relayed


class Relayed(Resource):
    """A resource as a relay's upstream encoded it. Its Group is decoded when something asks for it
    (the admin pages, metrics), not on every change in every relay and worker: streams only send
    its bytes."""

    __slots__ = ("_decode",)
    _decode: Callable[[bytes], Group]

    @classmethod
    def make(cls, name: str, version: str, body: bytes, changed_at: float, decode: Callable[[bytes], Group]) -> Relayed:
        out = object.__new__(cls)  # the frozen dataclass's __init__ would set `group` through the property
        for field_name, value in (("name", name), ("version", version), ("body", body), ("changed_at", changed_at)):
            Resource.__dict__[field_name].__set__(out, value)
        _GROUP.__set__(out, None)
        object.__setattr__(out, "_decode", decode)
        return out

    @property
    def group(self) -> Group:
        group = _GROUP.__get__(self)
        if group is None:
            try:
                group = self._decode(self.body)
            except ValueError as e:
                log.warning("group %s: cannot read what the upstream sent (it is served as sent): %s", self.name, e)
                group = Group(self.name)
            _GROUP.__set__(self, group)
        return group  # type: ignore[no-any-return]


_RELAYED = Group("")  # a relay source's entry for a name: its group is the resource's own


class Store:
    def __init__(self, encode: Encoder) -> None:
        self._encode = encode
        self._by_source: dict[str, dict[str, Group]] = {}  # in declaration order: the merge order
        self._order: list[str] = []  # every declared source, in declaration order
        self._pending: list[str] = []  # sources that have not delivered their first state
        self._resources: dict[str, Resource] = {}
        self._watchers: dict[Watcher, None] = {}  # told of every change (ordered set)
        self._by_name: dict[str, dict[Watcher, None]] = {}  # told only of the names they follow
        self._following: dict[Watcher, set[str]] = {}
        self._empty: OrderedDict[str, Resource] = OrderedDict()  # LRU of empty CLAs for unknown names
        self._forced_ready = False
        self._stale: set[str] = set()  # sources that cannot currently reach what they follow
        self._conflicts: dict[str, str] = {}  # group -> why its merged state is not served
        self.encodes = 0  # how many groups were encoded, for tests and metrics
        # A relay's store: a name its upstream has not answered yet is not answered at all (an empty
        # assignment would empty Envoy's cluster); see `put_resources`.
        self.withholds = False
        self.interest: Interest | None = None  # told when the set of followed names changes
        self.overlay: Overlay | None = None  # health checks' results over the sources' health

    # -- sources -------------------------------------------------------------------------------
    def add_source(self, name: str) -> None:
        """Declare a source; the store is not ready until each declared source has delivered.

        Sources merge in the order they are declared (the first one's endpoint wins on a duplicate
        address), whichever delivers first."""
        if name in self._by_source or name in self._pending:
            raise ValueError(f"source {name!r} added twice")
        self._pending.append(name)
        self._order.append(name)

    def update(self, source: str, groups: Mapping[str, Group]) -> frozenset[str]:
        """Replace everything `source` provides; return (and announce) the names whose CLA changed."""
        if source not in self._by_source and source not in self._pending:
            raise KeyError(f"unknown source {source!r}")
        was_ready = self.ready
        old = self._by_source.get(source, {})
        first = source not in self._by_source
        self._by_source[source] = dict(groups)
        if first:
            self._by_source = {s: self._by_source[s] for s in self._order if s in self._by_source}
        if source in self._pending:
            self._pending.remove(source)
        changed = frozenset(n for n in old.keys() | groups.keys() if self._refresh(n))
        self._delivered(was_ready, changed)
        return changed

    def put_resources(self, source: str, resources: Mapping[str, Resource], removed: Iterable[str] = ()) -> None:
        """A relay's resources, as its upstream encoded and versioned them: served unchanged, not merged
        with any other source (the App gives a relay store no other). Announces the names whose
        version changed; a removed name is withheld again (Envoy keeps what it has)."""
        if source not in self._by_source and source not in self._pending:
            raise KeyError(f"unknown source {source!r}")
        was_ready = self.ready
        groups = self._by_source.setdefault(source, {})
        if source in self._pending:
            self._pending.remove(source)
        changed = []
        for name, resource in resources.items():
            current = self._resources.get(name)
            groups[name] = _RELAYED
            if current is None or current.version != resource.version:
                self._resources[name] = resource
                changed.append(name)
        for name in removed:
            groups.pop(name, None)
            self._resources.pop(name, None)
        self._delivered(was_ready, frozenset(changed))

    def refresh(self, names: Iterable[str]) -> frozenset[str]:
        """Merge these groups again (the overlay's view of them changed); announce what changed."""
        changed = frozenset(n for n in names if n in self._resources and self._refresh(n))
        if changed and self.ready:
            self._announce(changed)
        return changed

    def _delivered(self, was_ready: bool, changed: frozenset[str]) -> None:
        """After a source delivered: everything is news once the last pending source has, else `changed`."""
        if not was_ready and self.ready:
            log.info("all sources loaded: serving %s", counted(len(self._resources), "group"))
            self._announce(None)
        elif changed and self.ready:
            self._announce(changed)

    def _refresh(self, name: str) -> bool:
        parts = [g[name] for g in self._by_source.values() if name in g]
        current = self._resources.get(name)
        if not parts:
            self._set_conflict(name, None, kept=False)
            if current is None:
                return False
            del self._resources[name]
            return True
        group = merge_groups(name, parts)
        if self.overlay is not None:
            group = self.overlay(group)
        if current is not None and current.group == group:
            self._set_conflict(name, None, kept=True)
            return False
        problems = envoy_checks.problems(group)
        self._set_conflict(name, "; ".join(problems) if problems else None, kept=current is not None)
        if problems:
            if current is not None:
                return False  # Envoy would reject it: the last good version stays
            group = envoy_checks.fit(group)  # nothing accepted yet (a restart): what fits
        body = self._encode(group)
        self.encodes += 1
        version = content_version(body)
        if current is not None and current.version == version:
            self._resources[name] = Resource(name, version, body, group)
            return False  # e.g. endpoints reordered: same bytes, nothing to push
        self._resources[name] = Resource(name, version, body, group, time.monotonic())
        return True

    def _set_conflict(self, name: str, problem: str | None, *, kept: bool) -> None:
        before = self._conflicts.get(name)
        if problem == before:
            return
        if problem is None:
            del self._conflicts[name]
            log.info("group %s: sources no longer conflict; serving it again", name)
            return
        self._conflicts[name] = problem
        log.warning(
            "group %s: the merged endpoints of %s are not sent, Envoy would reject them: %s; serving %s",
            name,
            ", ".join(self.sources_of(name)),
            problem,
            "the last accepted version" if kept else "only the endpoints that fit",
        )

    def conflict(self, name: str) -> str | None:
        """Why the merged state of `name` is not what is served (None: it is)."""
        return self._conflicts.get(name)

    def conflicts(self) -> Mapping[str, str]:
        return self._conflicts

    def problems_with(self, source: str, name: str, part: Group | None) -> list[str]:
        """What Envoy would reject in group `name` if `source` gave `part` (None: nothing) for it."""
        parts: list[Group] = []
        for s, groups in self._by_source.items():
            if s != source and name in groups:
                parts.append(groups[name])
            elif s == source and part is not None:
                parts.append(part)
        if source not in self._by_source and part is not None:
            parts.append(part)
        return envoy_checks.problems(merge_groups(name, parts)) if parts else []

    def mark_stale(self, source: str, stale: bool) -> None:
        """A source lost (or regained) what it follows; its last state keeps being served."""
        if stale:
            self._stale.add(source)
        else:
            self._stale.discard(source)

    def is_stale(self, name: str) -> bool:
        return any(s in self._stale for s in self.sources_of(name))

    # -- readiness -----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._forced_ready or not self._pending

    @property
    def pending_sources(self) -> tuple[str, ...]:
        return tuple(self._pending)

    def force_ready(self) -> None:
        """Serve what we have even though some sources never delivered (startup timeout)."""
        if not self.ready:
            self._forced_ready = True
            self._announce(None)

    # -- readers -------------------------------------------------------------------------------
    def get(self, name: str) -> Resource:
        """The CLA for `name`; a name with no group gets an empty CLA, so Envoy's cluster warms."""
        found = self._resources.get(name)
        if found is not None:
            return found
        found = self._empty.get(name)
        if found is not None:
            self._empty.move_to_end(name)
            return found
        group = Group(name)
        body = self._encode(group)
        empty = self._empty[name] = Resource(name, content_version(body), body, group)
        if len(self._empty) > EMPTY_CACHE_SIZE:
            self._empty.popitem(last=False)
        return empty

    def resources(self) -> Mapping[str, Resource]:
        return self._resources

    def unanswered(self, names: Iterable[str]) -> list[str]:
        """Of `names`, those a withholding (relay) store has nothing for yet; [] for any other store."""
        return [n for n in names if n not in self._resources] if self.withholds else []

    def sources_of(self, name: str) -> list[str]:
        return [s for s, groups in self._by_source.items() if name in groups]

    def endpoint_sources(self, name: str) -> dict[tuple[str, int], str]:
        """Which source gave each endpoint of a group (the first one, as in merging)."""
        out: dict[tuple[str, int], str] = {}
        for source, groups in self._by_source.items():
            group = groups.get(name)
            if group is _RELAYED:
                group = self._resources[name].group
            for ep in group.endpoints if group is not None else ():
                out.setdefault(ep.key, source)
        return out

    # -- watchers ------------------------------------------------------------------------------
    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call `watcher` on every change; returns the function that stops it."""
        self._watchers[watcher] = None

        def stop() -> None:
            self._watchers.pop(watcher, None)

        return stop

    def follow(self, watcher: Watcher, add: Iterable[str] = (), remove: Iterable[str] = ()) -> None:
        """Tell `watcher` of changes to these names only (and when the store becomes ready).

        A change then costs its subscribers, not every open stream.
        """
        names = self._following.setdefault(watcher, set())
        by_name, new = self._by_name, []
        for name in add:
            names.add(name)
            followers = by_name.get(name)
            if followers is None:
                followers = by_name[name] = {}
                new.append(name)
            followers[watcher] = None
        gone = [name for name in remove if name in names and self._drop(name, watcher)]
        for name in remove:
            names.discard(name)
        if self.interest is not None and (new or gone):
            self.interest(tuple(new), tuple(gone))

    def unfollow(self, watcher: Watcher) -> None:
        gone = [name for name in self._following.pop(watcher, ()) if self._drop(name, watcher)]
        if self.interest is not None and gone:
            self.interest((), tuple(gone))

    def followed(self) -> Iterable[str]:
        """Every name some watcher follows."""
        return self._by_name.keys()

    def subscriptions(self) -> Mapping[Watcher, Set[str]]:
        """Each watcher that `follow`s, with the names it follows (read-only): once every stream is
        gone, empty (nothing held for a stream that left)."""
        return MappingProxyType(self._following)

    def _drop(self, name: str, watcher: Watcher) -> bool:
        """Stop telling `watcher` of `name`; True if nobody follows it any more."""
        followers = self._by_name.get(name)
        if followers is not None:
            followers.pop(watcher, None)
            if not followers:
                del self._by_name[name]
                return True
        return False

    def _announce(self, names: frozenset[str] | None) -> None:
        for watcher in list(self._watchers):
            watcher(names)
        if names is None:
            for watcher in list(self._following):
                watcher(None)
            return
        if len(names) == 1:  # the usual change: its followers all get the same set, no regrouping
            for watcher in list(self._by_name.get(next(iter(names)), ())):
                watcher(names)
            return
        followers: dict[Watcher, list[str]] = {}
        for name in names:
            for watcher in self._by_name.get(name, ()):
                followers.setdefault(watcher, []).append(name)
        for watcher, theirs in followers.items():
            watcher(frozenset(theirs))
