"""What the Kubernetes source holds: the objects read per kind and scope, whether every scope was
listed, and what goes to the store.

Nothing is handed to the store before every kind has been listed once in every scope followed, so
Envoy never sees a half-read cluster; after that, a burst of events is published as one version
(`debounce`). `ClusterView` (kubernetes_map) maps the objects to groups without IO; this is what
stands between it and the feed. Apart from the source, so that what is served, and when, reads
without the requests and retries that feed it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from .base import Feed, WarnOnce
from .kubernetes_api import NODES, SERVICES, SLICES, Kind, Scope
from .kubernetes_map import ClusterView, KubernetesOptions

log = logging.getLogger("eds_server.sources.kubernetes")


class HeldView:
    """The objects read (`cluster`), the `scopes` followed (each kind in each namespace, or in the
    cluster) and which were listed, published to `feed` under `name` when they change."""

    def __init__(self, feed: Feed, name: str, options: KubernetesOptions, debounce: float = 0.05) -> None:
        self.feed, self.name, self.debounce = feed, name, debounce
        self.cluster = ClusterView(options.annotation_prefix)  # the mapper: objects read -> groups
        self.warnings = WarnOnce(log)  # per Service
        self.scopes: tuple[Scope, ...] = tuple(
            (kind, ns) for kind in (SERVICES, SLICES) for ns in (options.namespaces or (None,))
        ) + (((NODES, None),) if options.node_regions else ())
        self._listed: set[Scope] = set()  # scopes listed at least once
        self.events = 0  # watch events applied, for tests and benchmarks
        self._changed = asyncio.Event()

    @property
    def loaded(self) -> bool:
        return len(self._listed) == len(self.scopes)

    def apply(self, kind: Kind, event_type: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) for a Service, an EndpointSlice or a Node;
        published (debounced) if it changed what is served."""
        self.cluster.apply(kind.plural, event_type, obj)
        self.events += 1
        if self.cluster.dirty:
            self._changed.set()

    def replace(self, kind: Kind, namespace: str | None, items: list[Mapping[str, Any]]) -> None:
        """A full listing of one kind in one scope: what it lacks is gone, and the scope is listed."""
        self.cluster.replace(kind.plural, namespace, items)
        self._listed.add((kind, namespace))

    def listed(self) -> None:
        """A scope was listed: published even if nothing changed (the first full listing may be empty)."""
        self._changed.set()

    def publish(self) -> None:
        """Map the Services that changed again, and publish the whole state."""
        groups, warnings = self.cluster.groups()
        self.warnings.replace(warnings)
        changed = self.feed.publish(self.name, groups)
        if changed:
            log.info("%s: groups changed: %s", self.name, ", ".join(sorted(changed)))

    def summary(self) -> str:
        return f"{len(self.cluster.services)} annotated Services, {len(self.cluster.slices)} EndpointSlices"

    async def publisher(self, stop: asyncio.Event) -> None:
        """Publish after each change, a burst coalesced into one version, once every scope is listed."""
        while not stop.is_set():
            await self._changed.wait()
            await asyncio.sleep(self.debounce)  # coalesce a burst of events into one version
            self._changed.clear()
            if self.loaded:
                self.publish()
