"""Kubernetes source at scale: N annotated Services x M endpoints, as EndpointSlices written directly.

    KUBEBUILDER_ASSETS=DIR .venv/bin/python bench/kubernetes_scale.py [--services 1000] [--endpoints 10]
                                                                       [--events 500]

Against a private kube-apiserver + etcd (tests/support/kube_apiserver.py), with eds-server as a process:
- time from eds-server's start to /readyz (every Service listed and served), and to all groups present;
- CPU of eds-server per watch event (slice updates flipping one endpoint's readiness), from /proc;
- eds-server's RSS with the Services loaded, and with none (same flags, an empty namespace);
- watch connections: eds-server's own count, and the API server's `apiserver_longrunning_requests`
  gauge for WATCH on services and endpointslices (nothing else watches in this setup).
Endpoint addresses come from 198.18.0.0/15 (kube-apiserver refuses loopback ones) and no traffic is
sent to them. Prints a table and
writes bench/results/kubernetes_scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import re
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the test helpers: tests.support

from tests.support.kube_apiserver import KubeApi, KubeCluster, binaries  # noqa: E402
from tests.support.server_process import EdsServerProcess  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
# kube-apiserver refuses loopback endpoint addresses; RFC 2544's benchmarking range is never routed, and
# nothing is sent to these addresses (no Envoy here)
BENCH_NET = ipaddress.ip_network("198.18.0.0/15")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def rss_mib(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else 0.0


def connections_to(pid: int, port: int) -> int:
    """Established TCP connections of process `pid` to 127.0.0.1:`port` (from /proc, no tools needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        remote, state, inode = parts[2], parts[3], parts[9]
        if state == "01" and inode in inodes and int(remote.split(":")[1], 16) == port:
            count += 1
    return count


def slice_for(i: int, endpoints: int, ready_first: bool = True) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"svc-{i}-1",
            "labels": {"kubernetes.io/service-name": f"svc-{i}", "endpointslice.kubernetes.io/managed-by": "bench"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [str(BENCH_NET[i * endpoints + j + 1])], "conditions": {"ready": ready_first or j > 0}}
            for j in range(endpoints)
        ],
    }


async def bounded(n: int, make: Any, concurrency: int = 16) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await make(i)

    await asyncio.gather(*(one(i) for i in range(n)))


async def watch_gauge(kube: KubeCluster) -> dict[str, float]:
    ctx = ssl.create_default_context(cafile=str(kube.ca))
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {kube.token}"}) as s,
        s.get(kube.url + "/metrics", ssl=ctx) as r,
    ):
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("apiserver_longrunning_requests{") and 'verb="WATCH"' in line:
            res = re.search(r'resource="([^"]+)"', line)
            if res and res.group(1) in ("services", "endpointslices"):
                out[res.group(1)] = out.get(res.group(1), 0) + float(line.rsplit(" ", 1)[1])
    return out


async def run(args: argparse.Namespace, kube: KubeCluster, workdir: Path) -> dict[str, Any]:
    ns, n, m = "scale", args.services, args.endpoints
    async with KubeApi(kube) as api:
        await api.namespace(ns)
        await api.namespace("empty")
        t0 = time.monotonic()
        await bounded(
            n,
            lambda i: api.create(
                f"/api/v1/namespaces/{ns}/services",
                {
                    "metadata": {"name": f"svc-{i}", "annotations": {"eds.group": f"svc-{i}"}},
                    "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
                },
            ),
        )
        await bounded(
            n, lambda i: api.create(f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", slice_for(i, m))
        )
        created = time.monotonic() - t0

    result: dict[str, Any] = {
        "services": n,
        "endpoints_per_service": m,
        "create_s": round(created, 2),
        "apiserver": kube.version,
    }
    empty = EdsServerProcess(
        None,
        "--kubernetes",
        "--kubeconfig",
        str(kube.kubeconfig),
        "--kubernetes-namespace",
        "empty",
        "--log-level",
        "info",
        workdir=workdir,
    )
    baseline = await watch_gauge(kube)  # kube-apiserver's own controllers watch Services too
    async with empty:
        await asyncio.sleep(2)
        assert empty.proc is not None
        result["rss_mib_empty"] = round(rss_mib(empty.proc.pid), 1)
        result["cpu_s_to_ready_empty"] = round(cpu_seconds(empty.proc.pid), 2)
    await asyncio.sleep(2)

    server = EdsServerProcess(
        None,
        "--kubernetes",
        "--kubeconfig",
        str(kube.kubeconfig),
        "--kubernetes-namespace",
        ns,
        "--log-level",
        "info",
        "--startup-timeout",
        "300s",
        workdir=workdir,
    )
    t0 = time.monotonic()
    await server.start(wait_ready=False)
    try:
        await server.wait_ready(timeout=300)
        result["ready_s"] = round(time.monotonic() - t0, 2)
        groups = (await server.admin("/v1/groups"))["groups"]
        assert len(groups) == n, len(groups)
        assert all(len(g["endpoints"]) == m for g in groups)
        assert server.proc is not None
        pid = server.proc.pid
        result["cpu_s_to_ready"] = round(cpu_seconds(pid), 2)
        await asyncio.sleep(1)
        result["rss_mib_loaded"] = round(rss_mib(pid), 1)

        async def source() -> dict[str, Any]:
            items = (await server.admin("/v1/sources"))["sources"]
            return next(s for s in items if s["name"] == "kubernetes")

        before = await source()
        result["watches_eds_server"] = before["watches"]
        gauge = await watch_gauge(kube)
        result["watches_apiserver_gauge_delta"] = {k: gauge.get(k, 0) - baseline.get(k, 0) for k in gauge}
        result["tcp_connections_to_apiserver"] = connections_to(pid, kube.port)
        # events: flip the first endpoint of `events` slices to not ready (one MODIFIED event each)
        k = min(args.events, n)
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        async with KubeApi(kube) as api:
            await bounded(
                k,
                lambda i: api.merge(
                    f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/svc-{i}-1",
                    {"endpoints": slice_for(i, m, ready_first=False)["endpoints"]},
                ),
            )
        for _ in range(600):
            now = await source()
            if now["events"] - before["events"] >= k:
                break
            await asyncio.sleep(0.1)
        for _ in range(100):  # the debounced publish after the last event
            g = await server.admin("/v1/groups/svc-0")
            if len(g["endpoints"]) == m - 1:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        cpu = cpu_seconds(pid) - cpu0
        result["events"] = now["events"] - before["events"]
        result["events_wall_s"] = round(time.monotonic() - t0, 2)
        result["cpu_ms_per_event"] = round(cpu * 1000 / max(1, result["events"]), 3)
        result["rss_mib_after_events"] = round(rss_mib(pid), 1)
    finally:
        await server.__aexit__(None, None, None)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--events", type=int, default=500)
    args = parser.parse_args()
    found = binaries()
    if isinstance(found, str):
        print(f"skipped: {found}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kube-bench-") as tmp:
        kube = KubeCluster(*found, Path(tmp))
        try:
            kube.start()
            result = asyncio.run(run(args, kube, Path(tmp)))
        finally:
            kube.stop()
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    out = HERE / "results" / "kubernetes_scale.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
