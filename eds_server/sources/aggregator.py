"""The one place sources' states meet the store.

Sources are providers: each publishes whole states under its own name to a `Feed` and knows
nothing of the others or of the store (as Traefik's providers feed one configuration channel). The
App owns one `Aggregator`, builds the sources with it as their feed, then `declare`s them in its
merge order (`app.MERGE_ORDER`), whatever order they were built in. Until every declared source
has published once the store answers nobody, so Envoy keeps what it has (fail static); a source
that is not live keeps its last state, marked stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from ..encoded import Resource
from ..model import Group
from ..subscriptions import Interest


class StoreInlet(Protocol):
    """What the aggregator forwards to (`store.Store`): sources declared, their states (or a relay's
    resources) put in, staleness, readiness; and for a relay, withholding and the followed names."""

    withholds: bool
    interest: Interest | None

    @property
    def ready(self) -> bool: ...
    @property
    def pending_sources(self) -> tuple[str, ...]: ...
    def add_source(self, name: str) -> None: ...
    def update(self, source: str, groups: Mapping[str, Group]) -> frozenset[str]: ...
    def put_resources(self, source: str, resources: Mapping[str, Resource], removed: Iterable[str] = ()) -> None: ...
    def mark_stale(self, source: str, stale: bool) -> None: ...
    def problems_with(self, source: str, name: str, part: Group | None) -> list[str]: ...
    def resources(self) -> Mapping[str, Resource]: ...
    def followed(self) -> Iterable[str]: ...


class Aggregator:
    """Merges the sources' states into the store, first declared first (on a duplicate address in a
    group the first source's endpoint wins: docs/fail-static.md). Implements `base.RelayFeed`."""

    def __init__(self, store: StoreInlet) -> None:
        self._store = store
        self.order: tuple[str, ...] = ()  # every declared source, in merge order

    def declare(self, names: Sequence[str]) -> None:
        """The sources, in merge order: the store is not ready until each has published once.
        Called once, with every source, before any of them runs."""
        if self.order:
            raise ValueError(f"sources already declared: {', '.join(self.order)}")
        for name in names:
            self._store.add_source(name)
        self.order = tuple(names)

    # -- base.Feed -----------------------------------------------------------------------------
    def publish(self, source: str, groups: Mapping[str, Group]) -> frozenset[str]:
        return self._store.update(source, groups)

    def mark_stale(self, source: str, stale: bool) -> None:
        self._store.mark_stale(source, stale)

    def loaded(self, source: str) -> bool:
        return source in self.order and source not in self._store.pending_sources

    @property
    def serving(self) -> bool:
        return self._store.ready

    def problems_with(self, source: str, name: str, part: Group | None) -> list[str]:
        return self._store.problems_with(source, name, part)

    # -- base.RelayFeed ------------------------------------------------------------------------
    def publish_resources(self, source: str, resources: Mapping[str, Resource], removed: Iterable[str] = ()) -> None:
        self._store.put_resources(source, resources, removed)

    def held(self) -> Mapping[str, Resource]:
        return self._store.resources()

    def withhold(self, interest: Callable[[tuple[str, ...], tuple[str, ...]], None]) -> Iterable[str]:
        self._store.withholds = True
        self._store.interest = interest
        return self._store.followed()
