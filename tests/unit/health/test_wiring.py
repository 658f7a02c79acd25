"""Where the checker runs and what it reports: only an App that owns its sources checks (a relay,
and so a worker of --workers, serves its upstream's results); the metrics it adds."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest

from eds_server.app import App
from eds_server.encode import encode_group
from eds_server.health.checker import Checker, _Target
from eds_server.health.spec import HealthSpec
from eds_server.health.tracker import Result
from eds_server.metrics import HealthChecks
from eds_server.settings import Settings, SourceSettings
from eds_server.sources.relay import UpstreamOptions
from eds_server.store import Store
from eds_server.transport.h2.overload import default_limit


async def test_only_an_app_that_owns_its_sources_checks() -> None:
    app = App(Settings())
    assert app.checker is not None
    # its kept connections leave the gRPC port's connections and reserve out of their budget
    net = app.settings.transport
    reserved = app.checker.connections.reserved
    assert reserved == net.connection_limits.max_connections + 2 * net.http_limits.max_connections + 88
    assert app.checker.connections.memory_limit == default_limit()  # the memory watermark's, by default
    relay = App(Settings(sources=SourceSettings(upstream_eds=UpstreamOptions("127.0.0.1", 1))))
    assert relay.checker is None and relay.store.overlay is None


def test_metrics() -> None:
    checker = Checker(Store(encode_group))
    target = ("127.0.0.1", 1, HealthSpec("http"))
    checker._targets[target] = _Target(target)  # as a reconcile would add it
    checker._record(checker._targets[target], Result(False, "HTTP 500", 0.003, time.time()))
    registry = CollectorRegistry()
    registry.register(HealthChecks(checker))
    text = generate_latest(registry).decode()
    assert 'eds_health_checks_total{kind="http",result="fail"} 1.0' in text
    assert 'eds_health_check_latency_seconds_bucket{kind="http",le="0.005"} 1.0' in text
    assert 'eds_health_check_latency_seconds_count{kind="http"} 1.0' in text
    assert 'eds_health_endpoints{health="unchecked"} 1.0' in text  # one failure: not yet its threshold
    assert "eds_health_cut_off 0.0" in text
