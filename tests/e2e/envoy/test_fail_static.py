"""Fail static, proven with real traffic through a real Envoy: what eds-server is unsure of never
empties Envoy's cluster, and what Envoy would reject is never sent (its last good version stays)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from tests.support.backends import http_backends
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.fault_watch import FaultWatch
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess, file_error, wait_error, write_atomically
from tests.support.waiting import wait_for

pytestmark = pytest.mark.envoy
MAX = 2**32 - 1
TOKEN = "fail-static-test-token"


def upstreams(ports: list[int], weight: int | None = None) -> str:
    w = f", weight: {weight}" if weight else ""
    eps = "\n".join(f"      - {{address: 127.0.0.1, port: {p}{w}}}" for p in ports)
    return f"groups:\n  web:\n    endpoints:\n{eps}\n"


async def test_upstreams_file_deleted_unreadable_garbage_then_restored(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    async with http_backends(2) as backends:
        ports = [b.port for b in backends]
        path.write_text(upstreams(ports))
        async with EdsServerProcess(path, workdir=tmp_path) as server:
            bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})
            async with EnvoyProcess(bootstrap) as envoy:
                await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 2)
                version = await envoy.version_text("web")
                async with FaultWatch(envoy, server, backends=ports) as watch:
                    path.unlink()
                    await wait_error(server, "missing")
                    await watch.served(5, "traffic through Envoy with the file missing")
                    path.mkdir()  # a directory where the file was: unreadable even to root
                    await wait_error(server, "cannot read")
                    await watch.served(5, "traffic through Envoy with the file unreadable")
                    path.rmdir()
                    write_atomically(path, "groups: {web: [garbage\n")
                    await wait_error(server, "upstreams.yaml:")
                    await watch.served(5, "traffic through Envoy with the file garbage")
                    assert await envoy.version_text("web") == version  # nothing reached Envoy
                    write_atomically(path, upstreams(ports, weight=3))  # restored, with a change
                    await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: {x.weight for x in h} == {3})
                watch.assert_held("upstreams file deleted, a directory, garbage, restored", min_requests=10)
                assert await file_error(server) is None
                assert await envoy.update_rejected("web") == 0


@pytest.mark.parametrize("lb_policy", ["RING_HASH", "MAGLEV"])
async def test_merged_group_over_envoys_limits_is_not_sent(tmp_path: Path, lb_policy: str) -> None:
    """A file endpoint and a registered one whose weights add up past uint32: the registration is
    refused (409), the file edit that would do it is held back (the last good version stays, the
    conflict is reported), and Envoy never rejects an update."""
    path = tmp_path / "upstreams.yaml"
    async with http_backends(2) as backends:
        file_port, reg_port = backends[0].port, backends[1].port
        path.write_text(upstreams([file_port], weight=MAX - 10))
        async with EdsServerProcess(
            path, "--admin-token", TOKEN, "--registration-allow-cidr", "127.0.0.0/8", workdir=tmp_path
        ) as server:
            bootstrap = envoy_bootstrap(
                server.port, [EdsCluster("web", lb_policy=lb_policy)], free_port(), routes={"/": "web"}
            )
            url = f"http://127.0.0.1:{server.admin_port}/v1/groups/web/endpoints/vm-1"
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with EnvoyProcess(bootstrap) as envoy, aiohttp.ClientSession() as http:
                await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 1)
                async with FaultWatch(envoy, server, backends=(file_port, reg_port)) as watch:
                    body = {"address": "127.0.0.1", "port": reg_port, "weight": 11}
                    async with http.put(url, json=body, headers=auth) as r:
                        refused = await r.json()
                        assert r.status == 409 and "limit of 4294967295" in refused["error"], refused
                    body["weight"] = 10  # exactly the limit
                    async with http.put(url, json=body, headers=auth) as r:
                        assert r.status == 201
                    await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 2)
                    good = await envoy.version_text("web")

                    # now the file grows: merged with the registration, Envoy would reject it
                    write_atomically(path, upstreams([file_port], weight=MAX - 9))
                    group = await wait_for(
                        lambda: server.admin("/v1/groups/web"), lambda g: g["error"], timeout=5, interval=0.05
                    )
                    assert "priority 0 add up to 4294967296" in group["error"]
                    assert group["version"] == good
                    metrics = await (await http.get(f"http://127.0.0.1:{server.admin_port}/metrics")).text()
                    assert 'eds_group_conflict{group="web"} 1.0' in metrics
                    assert "the merged endpoints of" in server.log_text()
                    await asyncio.sleep(0.5)
                    assert await envoy.version_text("web") == good

                    # the registration goes: the file's version fits alone and is served
                    async with http.delete(url, headers=auth) as r:
                        assert r.status == 204
                    await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: [x.weight for x in h] == [MAX - 9])
                watch.assert_held(f"merged weights over Envoy's limit ({lb_policy})", min_requests=10, admin_gaps=True)
                assert (await server.admin("/v1/groups/web"))["error"] is None
                assert await envoy.update_rejected("web") == 0


async def test_locality_weights_over_the_limit_on_a_locality_weighted_cluster(tmp_path: Path) -> None:
    """Locality weights summing past uint32 at one priority: refused in the file with its line, and
    Envoy (locality-weighted RING_HASH) keeps getting only what it accepts."""
    path = tmp_path / "upstreams.yaml"
    async with http_backends(2) as backends:
        a, b = backends[0].port, backends[1].port

        def text(wa: int) -> str:
            return (
                "groups:\n  web:\n    endpoints:\n"
                f"      - {{address: 127.0.0.1, port: {a}, zone: a}}\n"
                f"      - {{address: 127.0.0.1, port: {b}, zone: b}}\n"
                f"    localities:\n      - {{zone: a, weight: {wa}}}\n      - {{zone: b, weight: 1}}\n"
            )

        path.write_text(text(MAX - 1))
        async with EdsServerProcess(path, workdir=tmp_path) as server:
            bootstrap = envoy_bootstrap(server.port, [EdsCluster("web", lb_policy="RING_HASH")])
            bootstrap["static_resources"]["clusters"][-1]["common_lb_config"] = {"locality_weighted_lb_config": {}}
            async with EnvoyProcess(bootstrap) as envoy:
                await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 2)
                good = await envoy.version_text("web")
                write_atomically(path, text(MAX))
                error = await wait_error(server, "locality weights in priority 0 add up to 4294967296")
                assert "upstreams.yaml:3: groups.web:" in error
                await asyncio.sleep(0.5)
                assert await envoy.version_text("web") == good
                assert await envoy.update_rejected("web") == 0


def test_root_can_read_a_mode_000_file(tmp_path: Path) -> None:
    """Why the test above uses a directory for 'unreadable': chmod 000 does not stop root."""
    if os.geteuid() != 0:
        pytest.skip("only meaningful as root")
    f = tmp_path / "f"
    f.write_text("x")
    f.chmod(0)
    assert f.read_text() == "x"
