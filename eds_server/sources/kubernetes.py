"""Kubernetes as a source: annotated Services and their EndpointSlices, by list+watch.

One list+watch per kind (Services, EndpointSlices; Nodes too with --kubernetes-node-regions) and per
namespace followed (all namespaces: one cluster-wide watch per kind), never one per Service. The
source only assembles its parts, each readable alone:

- `kubernetes_config.py`: the configuration (kubeconfig, in-cluster), what is wrong with it, and
  loading it again when its files are rewritten or the credentials are refused;
- `kubernetes_api.py`: the requests (a listing, a 4 s watch read line by line, the probes), their
  timeouts, and what their failures mean;
- `kubernetes_view.py`: what is held per kind and scope, whether every scope was listed, and what
  goes to the store (nothing before every scope is listed once);
- `kubernetes_follow.py`: the list+watch loop of each scope (renewals, 410, a stalled watch opened
  again, backoff);
- `kubernetes_liveness.py`: whether the API server is there (heartbeat, probe while away), and the
  outage as said to the operator;
- `kubernetes_map.py`: the objects mapped to groups, without IO.

A backoff grows to 30 s during a long outage, and ends as soon as the API server answers again or
its configuration is rewritten; meanwhile the last endpoints keep being served, marked stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from .base import Feed, Followed, Heartbeat, SharedProbe, SourceStatus, pause
from .kubernetes_api import WATCH_SECONDS, Kind, Requests, Scope
from .kubernetes_config import ConfigProblem, Configuration, one_line
from .kubernetes_follow import Follower
from .kubernetes_liveness import ApiLiveness
from .kubernetes_map import ClusterView, KubernetesOptions
from .kubernetes_view import HeldView

log = logging.getLogger("eds_server.sources.kubernetes")


class KubernetesSource(Followed):
    """The parts, put together: one `Follower` loop per scope, the view's publisher and the
    heartbeat, once a configuration could be loaded."""

    name = "kubernetes"

    def __init__(
        self,
        feed: Feed,
        options: KubernetesOptions,
        *,
        debounce: float = 0.05,
        request_timeout: float = 30.0,
        watch_timeout: int = WATCH_SECONDS,
        probe_every: float = 1.0,
        probe_timeout: float = 2.0,
        backoff: tuple[float, float] = (0.2, 30.0),  # first delay, cap
    ) -> None:
        self.options = options
        self.config = Configuration(options, self.name, loaded=lambda host: self.health.serving(host))
        self.requests = Requests(
            self.config,
            lambda: self.health.heartbeat.beat(),  # every answer is a sign of life
            request_timeout=request_timeout,
            watch_timeout=watch_timeout,
            probe_timeout=probe_timeout,
        )
        self.health = ApiLiveness(
            feed,
            self.name,
            self.requests,
            self.config,
            probe_every=probe_every,
            probe_timeout=probe_timeout,
            backoff=backoff,
        )
        self.liveness = self.health.liveness
        self.held = HeldView(feed, self.name, options, debounce)
        self.follower = Follower(self.name, self.config, self.requests, self.health, self.held)

    # -- what tests, the status and the App read -----------------------------------------------
    @property
    def view(self) -> ClusterView:
        return self.held.cluster

    @property
    def scopes(self) -> tuple[Scope, ...]:
        return self.held.scopes

    @property
    def loaded(self) -> bool:
        return self.held.loaded

    @property
    def probe(self) -> SharedProbe:
        return self.health.probe

    @property
    def heartbeat(self) -> Heartbeat:
        return self.health.heartbeat

    @property
    def loads(self) -> int:
        return self.config.loads

    @property
    def events(self) -> int:
        return self.held.events

    @property
    def watches_open(self) -> int:
        return self.requests.watches_open

    @property
    def renewals(self) -> int:
        return self.follower.renewals

    @property
    def reopened(self) -> int:
        return self.follower.reopened

    @property
    def relists(self) -> int:
        return self.follower.relists

    def apply(self, kind: Kind, event_type: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) for a Service, an EndpointSlice or a Node."""
        self.held.apply(kind, event_type, obj)

    def replace(self, kind: Kind, namespace: str | None, items: list[Mapping[str, Any]]) -> None:
        """A full listing of one kind in one scope: what it lacks is gone, and the scope is listed."""
        self.held.replace(kind, namespace, items)

    def publish(self) -> None:
        """Map the Services that changed again, and publish the whole state."""
        self.held.publish()

    def status(self) -> SourceStatus:
        return self.liveness.status(
            connected=self.connected,
            services=len(self.view.services),
            endpointslices=len(self.view.slices),
            node_regions=len(self.view.regions) if self.options.node_regions else None,
            watches=self.watches_open,
            relists=self.relists,
            renewals=self.renewals,
            reopened=self.reopened,
            events=self.events,
            namespaces=list(self.options.namespaces) or "all",
        )

    async def start(self) -> None:
        """Nothing to check before serving: until every scope is listed the store waits (not ready)."""

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the API server until `stop` is set, reconnecting for as long as it takes."""
        backoff = self.health.backoff()
        while self.config.api is None and not stop.is_set():
            try:
                await self.config.reload()
            except Exception as e:  # no usable configuration (yet): say so, retry (at once if rewritten)
                reason = f"configuration error: {e if isinstance(e, ConfigProblem) else one_line(f'{e!r}')}"
                delay = backoff.next()
                self.liveness.lost(
                    reason,
                    again=reason != self.liveness.last_error,
                    then=f"loaded again when its files change, or in {delay:.1f} s",
                )
                await pause(delay, stop, self.config.rewritten, self.health.probe_every)
        if self.config.api is None:
            return
        try:
            tasks = [asyncio.create_task(self.follower.follow(kind, ns, stop)) for kind, ns in self.scopes]
            tasks.append(asyncio.create_task(self.held.publisher(stop)))
            tasks.append(asyncio.create_task(self.heartbeat.run(stop)))
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self.config.close()
