"""examples/monitoring: the Grafana dashboard and the Prometheus alert rules are well-formed, every
series they name is in a real scrape, and a real Prometheus runs every query and fires on a NACK and
on a group held back."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from eds_server import __version__
from tests.support.backends import http_backends
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.paths import ROOT
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess, write_atomically
from tests.support.waiting import wait_for
from tests.support.xds_client import nacking_client

KIT = ROOT / "examples" / "monitoring"
DASHBOARD = KIT / "grafana-dashboard.json"
ALERTS = KIT / "prometheus-alerts.yaml"
PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
SERIES = re.compile(r"\b(?:eds|process|python_gc)_[a-z0-9_]+")
# Grafana's variables, as the dashboard would fill them in for "All"
GRAFANA_VARIABLES = {"$job": ".*", "$instance": ".*", "$__rate_interval": "15s", "$__range": "5m"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every query of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_the_process_and_the_garbage_collector_are_on_metrics() -> None:
    """What every Prometheus user expects beside the server's own series: memory, CPU, open files, GC."""
    from prometheus_client import generate_latest

    from eds_server.encode import encode_group
    from eds_server.metrics import make_registry
    from eds_server.observe import Counters, Observers
    from eds_server.store import Store

    registry = make_registry(Store(encode_group), Counters(), Observers(), list)
    scraped = {s.name for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert {
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_max_fds",
        "python_gc_collections_total",
        "eds_ready",
    } <= scraped


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def grafana_filled(expr: str) -> str:
    for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    return expr


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] == "eds-server" and dash["uid"] and dash["schemaVersion"] >= 36
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"datasource", "job", "instance"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in dash["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval", "__range"}
            assert used <= variables, (panel["title"], used)
            assert 'job=~"$job",instance=~"$instance"' in target["expr"], panel["title"]


def test_alert_rules_are_well_formed() -> None:
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert {
        "EdsServerNotReady",
        "EdsServerSourceDegraded",
        "EdsServerSourceUnhealthy",
        "EdsServerNacks",
        "EdsServerStreamsDropped",
    } <= names
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    if PROMTOOL is not None:  # Prometheus's own checker: PromQL syntax, durations, templates
        out = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(
    PROMTOOL is None and not os.environ.get("CI"),
    reason="needs Debian's prometheus (apt-get install prometheus; .ci/run does)",
)
def test_a_source_that_fails_after_loading_is_degraded_not_unhealthy(tmp_path: Path) -> None:
    """promtool's rule unit test: series in, alerts out. A loaded source that fails fires Degraded
    after 2 minutes; one that never loaded fires Unhealthy after 5, never both for one source."""
    assert PROMTOOL is not None
    series = [
        {"series": 'eds_source_loaded{job="eds",instance="a",source="file"}', "values": "1x10"},
        {"series": 'eds_source_healthy{job="eds",instance="a",source="file"}', "values": "1 0x9"},
        {"series": 'eds_source_loaded{job="eds",instance="a",source="docker"}', "values": "0x10"},
        {"series": 'eds_source_healthy{job="eds",instance="a",source="docker"}', "values": "0x10"},
    ]
    labels = {"job": "eds", "instance": "a", "severity": "warning"}
    tests = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {
                        "eval_time": "4m",
                        "alertname": "EdsServerSourceDegraded",
                        "exp_alerts": [{"exp_labels": {**labels, "source": "file"}}],
                    },
                    {"eval_time": "4m", "alertname": "EdsServerSourceUnhealthy", "exp_alerts": []},
                    {
                        "eval_time": "6m",
                        "alertname": "EdsServerSourceUnhealthy",
                        "exp_alerts": [{"exp_labels": {**labels, "source": "docker"}}],
                    },
                ],
            }
        ],
    }
    for check in tests["tests"][0]["alert_rule_test"]:  # promtool compares annotations too, when given
        check["exp_alerts"] = [
            {**a, "exp_annotations": _annotations(check["alertname"], a["exp_labels"])} for a in check["exp_alerts"]
        ]
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests))
    out = subprocess.run(
        [PROMTOOL, "test", "rules", str(tmp_path / "test.yaml")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _annotations(alert: str, labels: dict[str, str]) -> dict[str, str]:
    """The rule's annotations with its templates filled in from `labels`."""
    rule = next(r for r in alert_rules() if r["alert"] == alert)
    return {k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m[1]], v) for k, v in rule["annotations"].items()}


async def _get(session: aiohttp.ClientSession, url: str, **params: str) -> Any:
    async with session.get(url, params=params) as r:
        return await r.json(content_type=None)


@pytest.mark.envoy
@pytest.mark.skipif(
    PROMETHEUS is None and not os.environ.get("CI"),
    reason="needs Debian's prometheus (apt-get install prometheus; .ci/run does)",
)
async def test_a_real_prometheus_scrapes_queries_and_alerts(tmp_path: Path) -> None:
    async with http_backends(2) as backends:
        path = tmp_path / "upstreams.yaml"
        path.write_text(
            f"groups:\n  web:\n    endpoints: [127.0.0.1:{backends[0].port}]\n"
            f"  api:\n    endpoints: [127.0.0.1:{backends[1].port}]\n"
        )
        token = "kit-test-token-0123456789"
        async with EdsServerProcess(
            path,
            "--state",
            str(tmp_path / "state.json"),
            "--admin-token",
            token,
            "--registration-allow-cidr",
            "127.0.0.0/8",
        ) as server:
            admin = f"127.0.0.1:{server.admin_port}"
            bootstrap = envoy_bootstrap(server.port, [EdsCluster("web"), EdsCluster("api-cluster", service_name="api")])
            async with EnvoyProcess(bootstrap) as envoy, aiohttp.ClientSession() as s:
                await envoy.wait_live()
                write_atomically(
                    path,
                    f"groups:\n  web:\n    endpoints: [127.0.0.1:{backends[0].port}, 127.0.0.1:1]\n"
                    f"  api:\n    endpoints: [127.0.0.1:{backends[1].port}]\n",
                )
                await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 2)
                # a registration that fits, then a file edit that no longer fits with it: web is held back
                async with s.put(
                    f"http://{admin}/v1/groups/web/endpoints/vm-1",
                    json={"address": "127.0.0.2", "port": 8080, "weight": 2**31},
                    headers={"Authorization": f"Bearer {token}"},
                ) as r:
                    assert r.status == 201, await r.text()
                await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 3)
                write_atomically(
                    path, path.read_text().replace("127.0.0.1:1]", "{address: 127.0.0.1, port: 1, weight: 2147483647}]")
                )
                await wait_for(lambda: server.admin("/v1/groups/web"), lambda g: g.get("error"), timeout=10)
                async with Prometheus(tmp_path, admin) as prom:
                    up = await prom.wait_for_samples(s, 'up{job="eds-server"}', lambda v: v == 1)
                    assert up == 1
                    async with nacking_client(server.port, "api", "scripted-client", "rejected for the kit test"):
                        async with s.get(f"http://{admin}/metrics") as r:
                            scrape = await r.text()
                        _every_named_series_is_scraped(scrape)
                        await prom.wait_for_samples(s, "eds_nacks_total", lambda v: v == 1)
                        for title, expr in dashboard_queries():
                            body = await _get(s, f"{prom.url}/api/v1/query", query=grafana_filled(expr))
                            assert body["status"] == "success", (title, body)
                            assert body["data"]["result"], (title, expr)  # each panel has something to draw
                        build = await _get(s, f"{prom.url}/api/v1/query", query="eds_build_info")
                        assert build["data"]["result"][0]["metric"]["version"] == __version__
                        expected = {("EdsServerNacks", "api"), ("EdsServerGroupHeldBack", "web")}
                        firing = await wait_for(
                            lambda: _get(s, f"{prom.url}/api/v1/alerts"), lambda b: _firing(b) == expected, timeout=30
                        )
                        assert _firing(firing) == expected
                    rules = await _get(s, f"{prom.url}/api/v1/rules")
                    evaluated = [r for g in rules["data"]["groups"] for r in g["rules"]]
                    assert len(evaluated) == len(alert_rules())
                    assert all(r["health"] == "ok" for r in evaluated), evaluated


def _every_named_series_is_scraped(scrape: str) -> None:
    scraped = {sample.name for family in text_string_to_metric_families(scrape) for sample in family.samples}
    named = {m for _, expr in dashboard_queries() for m in SERIES.findall(expr)}
    named |= {m for rule in alert_rules() for m in SERIES.findall(rule["expr"])}
    assert named and named <= scraped, sorted(named - scraped)


def _firing(body: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (a["labels"]["alertname"], a["labels"].get("group", ""))
        for a in body["data"]["alerts"]
        if a["state"] == "firing"
    }


class Prometheus:
    """Debian's prometheus on a loopback port, scraping one target every second, with the alert rules."""

    def __init__(self, tmp: Path, target: str) -> None:
        self.dir = tmp / "prometheus"
        self.dir.mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [{"job_name": "eds-server", "static_configs": [{"targets": [target]}]}],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Prometheus:
        assert PROMETHEUS is not None
        log = (self.dir / "prometheus.log").open("wb")
        self.proc = await asyncio.create_subprocess_exec(
            PROMETHEUS,
            f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            stdout=log,
            stderr=log,
        )
        log.close()

        async def ready(s: aiohttp.ClientSession) -> int:
            async with s.get(f"{self.url}/-/ready") as r:
                return r.status

        async with aiohttp.ClientSession() as s:
            await wait_for(lambda: ready(s), lambda status: status == 200, timeout=30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    async def wait_for_samples(self, s: aiohttp.ClientSession, query: str, check: Any) -> float:
        async def value() -> float | None:
            body = await _get(s, f"{self.url}/api/v1/query", query=query)
            result = body["data"]["result"]
            return float(result[0]["value"][1]) if result else None

        found = await wait_for(value, lambda v: v is not None and check(v), timeout=30)
        assert found is not None
        return found
