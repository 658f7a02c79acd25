"""Prometheus metrics for `GET /metrics`.

Almost everything is read from live state when scraped (a custom collector), so the hot path
pays nothing for metrics; only push latency is observed as it happens, once per stream per change,
into plain counters (the event loop is single-threaded; prometheus_client's Histogram takes two
locks per observation, 6% of the CPU of a 10,000-stream fan-out). Label values come from
our own groups and sources, never from client input, so a client cannot grow the series count.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from . import __version__
from .encoded import Resource
from .health.checker import LATENCY_BUCKETS as CHECK_BUCKETS
from .health.checker import Checker
from .health.keepalive import HOW as KEPT_HOW
from .health.keepalive import KINDS as CONNECTION_KINDS
from .observe import Counters, Observers, StreamObserver, StreamView
from .serving_state import serving_state, source_kind

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StoreFigures(Protocol):
    """What a scrape reads of the store (`store.Store`): readiness, the groups served, the groups
    whose merge is not served, and how many encodings were made."""

    @property
    def ready(self) -> bool: ...
    @property
    def encodes(self) -> int: ...
    def resources(self) -> Mapping[str, Resource]: ...
    def conflicts(self) -> Mapping[str, str]: ...


class LatencyHistogram(Collector, StreamObserver):
    """eds_push_latency_seconds: Prometheus histogram semantics (a value lands in the first bucket
    whose bound is >= it), kept in plain counters. Call `observe` from the event loop only; as a
    stream observer it observes every response that carries a change (not a stream's first answer)."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: over every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def responded(self, s: StreamView, resources: Iterable[Resource]) -> None:
        now = time.monotonic()
        for r in resources:
            if r.changed_at >= s.opened_at:  # a change, not a first answer
                self.observe(now - r.changed_at)

    def collect(self) -> Iterator[Metric]:
        buckets, total = [], 0
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            buckets.append((bound, total))
        yield HistogramMetricFamily(
            "eds_push_latency_seconds",
            "From a change entering the store to a subscribed stream being sent it",
            buckets=buckets,
            sum_value=self.sum,
        )


class OpenStreams(StreamObserver):
    """eds_streams_open: streams the service took and has not closed, by transport ("sotw",
    "delta"), whether or not their first request came. Told before the first stream starts."""

    def __init__(self) -> None:
        self.by_transport: dict[str, int] = {"sotw": 0, "delta": 0}

    def started(self, s: StreamView) -> None:
        self.by_transport[s.transport] = self.by_transport.get(s.transport, 0) + 1

    def closed(self, s: StreamView) -> None:
        self.by_transport[s.transport] -= 1


class _StateCollector(Collector):
    def __init__(
        self,
        store: StoreFigures,
        counters: Counters,
        open_streams: OpenStreams,
        sources: Callable[[], list[dict[str, Any]]],
        transport: Callable[[], tuple[int, dict[str, int]]] | None,
    ) -> None:
        self.store, self.counters, self.open_streams = store, counters, open_streams
        self.sources, self.transport = sources, transport

    def collect(self) -> Iterator[Metric]:
        c = self.counters
        build = GaugeMetricFamily("eds_build_info", "The running eds-server's version", labels=["version"])
        build.add_metric([__version__], 1)
        yield build
        open_streams = GaugeMetricFamily("eds_streams_open", "Open xDS streams", labels=["transport"])
        for kind, n in sorted(self.open_streams.by_transport.items()):
            open_streams.add_metric([kind], n)
        yield open_streams
        for name, value, doc in (
            ("eds_streams_opened", c.streams_opened, "xDS streams opened"),
            ("eds_requests", c.requests, "Discovery requests received on streams"),
            ("eds_responses", c.responses, "Discovery responses (pushes) sent on streams"),
            ("eds_acks", c.acks, "Responses Envoy accepted"),
            ("eds_nacks", c.nacks, "Responses Envoy rejected"),
            ("eds_clients_dropped", c.dropped, "Streams ended because the client stopped reading"),
            ("eds_streams_refused", c.refused, "Streams refused at the --max-streams limit"),
            ("eds_requests_denied", c.denied, "Streams and fetches refused by --authz"),
            ("eds_encodes", self.store.encodes, "Groups encoded (once per changed group)"),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if self.transport is not None:
            connections, refused = self.transport()
            yield GaugeMetricFamily("eds_connections_open", "Open gRPC connections", value=connections)
            by_reason = CounterMetricFamily(
                "eds_refused",
                "Connections, streams and frames refused or shed, by reason (docs/limits.md)",
                labels=["reason"],
            )
            for reason, n in refused.items():
                by_reason.add_metric([reason], n)
            yield by_reason
        # every served group from 0, so the first NACK is an increase a rate() or alert can see
        nacks = CounterMetricFamily("eds_group_nacks", "Rejections per group", labels=["group"])
        for group in sorted(self.store.resources().keys() | c.nacks_by_group.keys()):
            nacks.add_metric([group], c.nacks_by_group.get(group, 0))
        yield nacks
        resources = self.store.resources()
        yield GaugeMetricFamily("eds_groups", "Groups served", value=len(resources))
        yield GaugeMetricFamily(
            "eds_endpoints",
            "Endpoints served, in every group",
            value=sum(len(r.group.endpoints) for r in resources.values()),
        )
        yield GaugeMetricFamily(
            "eds_groups_in_conflict",
            "Groups whose merged endpoints Envoy would reject (not sent)",
            value=len(self.store.conflicts()),
        )
        info = GaugeMetricFamily("eds_group_info", "Current version of each group", labels=["group", "version"])
        endpoints = GaugeMetricFamily("eds_group_endpoints", "Endpoints per group", labels=["group"])
        for name, res in sorted(resources.items()):
            info.add_metric([name, res.version], 1)
            endpoints.add_metric([name], len(res.group.endpoints))
        yield info
        yield endpoints
        conflicts = GaugeMetricFamily(
            "eds_group_conflict",
            "1 while a group's merged endpoints would be rejected by Envoy (not sent)",
            labels=["group"],
        )
        for name in sorted(self.store.conflicts()):
            conflicts.add_metric([name], 1)
        yield conflicts
        statuses = self.sources()
        loaded = GaugeMetricFamily("eds_source_loaded", "Source delivered its first state", labels=["source"])
        ok = GaugeMetricFamily("eds_source_healthy", "Source's last load or connection succeeded", labels=["source"])
        for src in statuses:
            loaded.add_metric([src["name"]], float(src["loaded"]))
            ok.add_metric([src["name"]], float(src.get("last_error") is None and not src.get("stale", False)))
        yield loaded
        yield ok
        yield GaugeMetricFamily("eds_ready", "All sources loaded (or start-up timeout passed)", value=self.store.ready)
        yield GaugeMetricFamily(
            "eds_state",
            "0 not ready, 1 ready, 2 degraded (ready, but a loaded source fails: its last good state is served)",
            value=serving_state(self.store.ready, statuses).value,
        )


class HealthChecks(Collector):
    """The health checker's counts, read when scraped: checks by kind and result, their latency,
    checked endpoints by checked health, whether the checker finds itself cut off, and its HTTP(S)
    check connections: opened, reused and evicted, and those kept idle now; TLS handshakes in flight
    and the checks that waited for a slot."""

    def __init__(self, checker: Checker) -> None:
        self.checker = checker

    def collect(self) -> Iterator[Metric]:
        c = self.checker
        checks = CounterMetricFamily("eds_health_checks", "Health checks run", labels=["kind", "result"])
        for (kind, result), n in sorted(c.checks.items()):
            checks.add_metric([kind, result], n)
        yield checks
        latency = HistogramMetricFamily(
            "eds_health_check_latency_seconds", "Time each health check took", labels=["kind"]
        )
        for kind, counts in sorted(c.latency.items()):
            buckets, total = [], 0
            for bound, n in zip((*map(floatToGoString, CHECK_BUCKETS), "+Inf"), counts, strict=True):
                total += n
                buckets.append((bound, total))
            latency.add_metric([kind], buckets, c.latency_sum.get(kind, 0.0))
        yield latency
        by_health = GaugeMetricFamily(
            "eds_health_endpoints", "Checked endpoints by their checked health", labels=["health"]
        )
        counted = c.by_health()
        for name in ("healthy", "unhealthy", "unchecked"):
            by_health.add_metric([name], counted.get(name, 0))
        yield by_health
        yield GaugeMetricFamily(
            "eds_health_cut_off",
            "1 while every health check fails at once (the checker's fault: the last checked health is kept)",
            value=int(c.frozen_since is not None),
        )
        yield CounterMetricFamily("eds_health_changes", "Changes of an endpoint's checked health", value=c.changes)
        kept = c.connections
        connections = CounterMetricFamily(
            "eds_health_connections",
            "HTTP(S) check connections: opened (a connect, and for https a TLS handshake), reused (a check "
            "on a kept connection), evicted (an idle one closed, or not kept, for the descriptor budget or the "
            "TLS memory bound)",
            labels=["kind", "how"],
        )
        for kind in CONNECTION_KINDS:
            for how in KEPT_HOW:
                connections.add_metric([kind, how], kept.counts.get((kind, how), 0))
        yield connections
        idle = GaugeMetricFamily(
            "eds_health_kept_connections", "Idle connections kept for an endpoint's next HTTP(S) check", labels=["kind"]
        )
        by_kind = kept.idle_by_kind()
        for kind in CONNECTION_KINDS:
            idle.add_metric([kind], by_kind.get(kind, 0))
        yield idle
        yield GaugeMetricFamily(
            "eds_health_tls_handshakes",
            "TLS handshakes of health checks in flight now (at most 32: a check waits for a slot)",
            value=kept.handshaking,
        )
        yield CounterMetricFamily(
            "eds_health_tls_handshake_waits",
            "Health checks over TLS that found every handshake slot taken and waited for one",
            value=kept.slot_waits,
        )


# Series labelled with a group's name: not on the --metrics-listen port (docs/security.md), which
# keeps their totals (eds_groups, eds_endpoints, eds_groups_in_conflict, eds_nacks).
GROUP_SERIES = frozenset({"eds_group_info", "eds_group_nacks", "eds_group_endpoints", "eds_group_conflict"})


def public_exposition(text: str) -> str:
    """`/metrics` for the --metrics-listen port, meant for scrapers on other hosts: no group names
    (GROUP_SERIES left out) and no file path or address in a source's label (`file:/etc/x.yaml`
    is `file`: one source of a kind per server). The admin port keeps every series as it is."""
    families = []
    for family in text_string_to_metric_families(text):
        if family.name in GROUP_SERIES:
            continue
        family.samples = [
            type(sample)(sample.name, {**sample.labels, "source": source_kind(sample.labels["source"])}, *sample[2:])
            if "source" in sample.labels
            else sample
            for sample in family.samples
        ]
        families.append(family)

    class _Families(Collector):
        def collect(self) -> Iterable[Metric]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families())
    return generate_latest(registry).decode()


def make_registry(
    store: StoreFigures,
    counters: Counters,
    observers: Observers,
    sources: Callable[[], list[dict[str, Any]]],
    transport: Callable[[], tuple[int, dict[str, int]]] | None = None,
) -> CollectorRegistry:
    """A registry of its own (not the process-global one). What it counts of the streams it learns
    as one more of their `observers` (call it before the first stream starts), and from `counters`,
    the observer the service counts with; `transport` gives the gRPC port's open connections and
    refusals by reason. The process's memory, CPU and open files (`process_*`) and the garbage
    collector (`python_gc_*`) are on it too, as every Prometheus user expects: prometheus_client's
    own collectors, which read /proc when scraped."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # each registers itself (GCCollector only where it can: CPython)
    GCCollector(registry=registry)
    open_streams = OpenStreams()
    observers.add(open_streams)
    registry.register(_StateCollector(store, counters, open_streams, sources, transport))
    latency = LatencyHistogram()
    registry.register(latency)
    observers.add(latency)
    return registry
