"""Two eds-server replicas behind one Envoy xds_cluster: Envoy cannot tell which one answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.server_process import EdsServerProcess, write_atomically

pytestmark = pytest.mark.envoy


def upstreams(*ports: int) -> str:
    return "groups:\n" + "".join(
        f"  c{i}:\n    endpoints: [{', '.join(f'127.0.0.1:{p}' for p in ports)}]\n" for i in range(4)
    )


@pytest.mark.parametrize("api_type", ["GRPC", "DELTA_GRPC"])
async def test_failover_between_replicas(tmp_path: Path, api_type: str) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text(upstreams(9001, 9002))
    async with EdsServerProcess(path, workdir=tmp_path) as one, EdsServerProcess(path, workdir=tmp_path) as two:
        versions = [{g["name"]: g["version"] for g in (await s.admin("/v1/groups"))["groups"]} for s in (one, two)]
        assert versions[0] == versions[1]  # same sources, same versions: no coordination needed
        clusters = [EdsCluster(f"c{i}", api_type=api_type) for i in range(4)]  # type: ignore[arg-type]
        bootstrap = envoy_bootstrap(one.port, clusters)
        xds = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "xds_cluster")
        lb = xds["load_assignment"]["endpoints"][0]["lb_endpoints"]
        lb.append({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": two.port}}}})
        async with EnvoyProcess(bootstrap) as envoy:
            await envoy.wait_live()
            names = [f"c{i}" for i in range(4)]
            seen_sizes: list[int] = []

            async def sizes() -> list[int]:
                return [len(await envoy.hosts(n)) for n in names]

            # kill whichever replicas Envoy uses: first one, then (after a change) watch it move to two
            assert await one.stop() == 0
            for _ in range(100):  # at least ~5 s: the streams' back-off tries again within 2 s (SHIPPED_XDS_BACK_OFF)
                seen_sizes.extend(await sizes())
                streams = (await two.admin("/v1/streams"))["streams"]
                if len(streams) == len(names):
                    break
                await asyncio.sleep(0.05)
            assert len((await two.admin("/v1/streams"))["streams"]) == len(names)
            assert min(seen_sizes) == 2  # never an empty cluster on the way
            write_atomically(path, upstreams(9001, 9002, 9003))  # a change while only two runs
            await envoy.wait_for(sizes, lambda s: s == [3] * 4, timeout=15)
            for n in names:
                assert await envoy.update_rejected(n) == 0
            await one.start()  # and back: it serves the same versions as two
            assert {g["name"]: g["version"] for g in (await one.admin("/v1/groups"))["groups"]} == {
                g["name"]: g["version"] for g in (await two.admin("/v1/groups"))["groups"]
            }
