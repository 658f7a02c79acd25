"""The served state as one object: sources' groups merged (`source_merge.py`), each encoded once per
change with a content-derived version (`encoded.py`), and the streams told (`subscriptions.py`).

A thin composition: it keeps the public methods every layer calls, and each caller names only what
it uses of it (a Protocol of its own, or `xds.common.Resources`). It knows nothing of gRPC or of who
is listening: sources push whole states in, watchers are plain callbacks told which names changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Set

from .encoded import EMPTY_CACHE_SIZE, EncodedResources, Encoder, Relayed, Resource, content_version
from .fields import counted
from .model import Group
from .source_merge import KEPT, Overlay, SourceMerge
from .subscriptions import Interest, Subscriptions, Watcher

__all__ = [
    "EMPTY_CACHE_SIZE",
    "Encoder",
    "Interest",
    "Overlay",
    "Relayed",
    "Resource",
    "Store",
    "Watcher",
    "content_version",
]

log = logging.getLogger(__name__)


class Store:
    """The three parts behind the methods every layer already calls; the fan-out goes straight
    through `Subscriptions.announce`, and `get`, read on every push, probes the served dict itself."""

    def __init__(self, encode: Encoder) -> None:
        self._merge = SourceMerge()
        self._encoded = EncodedResources(encode)
        self._subscriptions = Subscriptions()
        self._held = self._encoded.by_name  # the same dict, read directly: `get` is on every push
        # A relay's store: a name its upstream has not answered yet is not answered at all (an empty
        # assignment would empty Envoy's cluster); see `put_resources`.
        self.withholds = False

    @property
    def encodes(self) -> int:
        """How many groups were encoded, for tests and metrics."""
        return self._encoded.encodes

    @property
    def overlay(self) -> Overlay | None:
        """Laid over each merged group before it is checked and encoded (the health checks' results)."""
        return self._merge.overlay

    @overlay.setter
    def overlay(self, overlay: Overlay | None) -> None:
        self._merge.overlay = overlay

    @property
    def interest(self) -> Interest | None:
        """Told when the set of followed names changes (a relay asks its upstream for them)."""
        return self._subscriptions.interest

    @interest.setter
    def interest(self, interest: Interest | None) -> None:
        self._subscriptions.interest = interest

    # -- sources -------------------------------------------------------------------------------
    def add_source(self, name: str) -> None:
        """Declare a source; the store is not ready until each declared source has delivered.

        Sources merge in the order they are declared (the first one's endpoint wins on a duplicate
        address), whichever delivers first."""
        self._merge.add_source(name)

    def update(self, source: str, groups: Mapping[str, Group]) -> frozenset[str]:
        """Replace everything `source` provides; return (and announce) the names whose CLA changed."""
        was_ready = self._merge.ready
        touched = self._merge.replace(source, groups)
        changed = frozenset(n for n in touched if self._refresh(n))
        self._delivered(was_ready, changed)
        return changed

    def put_resources(self, source: str, resources: Mapping[str, Resource], removed: Iterable[str] = ()) -> None:
        """A relay's resources, as its upstream encoded and versioned them: served unchanged, not merged
        with any other source (the App gives a relay store no other). Announces the names whose
        version changed; a removed name is withheld again (Envoy keeps what it has)."""
        was_ready = self._merge.ready
        removed = tuple(removed)
        self._merge.relay(source, resources.keys(), removed)
        put = self._encoded.put_encoded
        changed = frozenset(name for name, resource in resources.items() if put(name, resource))
        for name in removed:
            self._encoded.drop(name)
        self._delivered(was_ready, changed)

    def refresh(self, names: Iterable[str]) -> frozenset[str]:
        """Merge these groups again (the overlay's view of them changed); announce what changed."""
        changed = frozenset(n for n in names if n in self._held and self._refresh(n))
        if changed and self._merge.ready:
            self._subscriptions.announce(changed)
        return changed

    def _delivered(self, was_ready: bool, changed: frozenset[str]) -> None:
        """After a source delivered: everything is news once the last pending source has, else `changed`."""
        if not was_ready and self._merge.ready:
            log.info("all sources loaded: serving %s", counted(len(self._held), "group"))
            self._subscriptions.announce(None)
        elif changed and self._merge.ready:
            self._subscriptions.announce(changed)

    def _refresh(self, name: str) -> bool:
        """Merge `name` again and encode it if that changed what is served; True if its bytes did."""
        current = self._held.get(name)
        group = self._merge.served(name, current)
        if group is None:
            return self._encoded.drop(name)
        if group is KEPT:
            return False
        return self._encoded.put(name, group)

    def conflict(self, name: str) -> str | None:
        """Why the merged state of `name` is not what is served (None: it is)."""
        return self._merge.conflict(name)

    def conflicts(self) -> Mapping[str, str]:
        return self._merge.conflicts()

    def problems_with(self, source: str, name: str, part: Group | None) -> list[str]:
        """What Envoy would reject in group `name` if `source` gave `part` (None: nothing) for it."""
        return self._merge.problems_with(source, name, part)

    def mark_stale(self, source: str, stale: bool) -> None:
        """A source lost (or regained) what it follows; its last state keeps being served."""
        self._merge.mark_stale(source, stale)

    def is_stale(self, name: str) -> bool:
        return self._merge.is_stale(name)

    # -- readiness -----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._merge.ready

    @property
    def pending_sources(self) -> tuple[str, ...]:
        return self._merge.pending_sources

    def force_ready(self) -> None:
        """Serve what we have even though some sources never delivered (startup timeout)."""
        if self._merge.force_ready():
            self._subscriptions.announce(None)

    # -- readers -------------------------------------------------------------------------------
    def get(self, name: str) -> Resource:
        """The CLA for `name`; a name with no group gets an empty CLA, so Envoy's cluster warms."""
        found = self._held.get(name)
        return found if found is not None else self._encoded.empty(name)

    def resources(self) -> Mapping[str, Resource]:
        return self._held

    def unanswered(self, names: Iterable[str]) -> list[str]:
        """Of `names`, those a withholding (relay) store has nothing for yet; [] for any other store."""
        return [n for n in names if n not in self._held] if self.withholds else []

    def sources_of(self, name: str) -> list[str]:
        return self._merge.sources_of(name)

    def endpoint_sources(self, name: str) -> dict[tuple[str, int], str]:
        """Which source gave each endpoint of a group (the first one, as in merging)."""
        return self._merge.endpoint_sources(name, self._held.get(name))

    # -- watchers ------------------------------------------------------------------------------
    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call `watcher` on every change; returns the function that stops it."""
        return self._subscriptions.watch(watcher)

    def follow(self, watcher: Watcher, add: Iterable[str] = (), remove: Iterable[str] = ()) -> None:
        """Tell `watcher` of changes to these names only (and when the store becomes ready).

        A change then costs its subscribers, not every open stream.
        """
        self._subscriptions.follow(watcher, add, remove)

    def unfollow(self, watcher: Watcher) -> None:
        self._subscriptions.unfollow(watcher)

    def followed(self) -> Iterable[str]:
        """Every name some watcher follows."""
        return self._subscriptions.followed()

    def subscriptions(self) -> Mapping[Watcher, Set[str]]:
        """Each watcher that `follow`s, with the names it follows (read-only): once every stream is
        gone, empty (nothing held for a stream that left)."""
        return self._subscriptions.by_watcher()
