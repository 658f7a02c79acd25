"""A frozen API server with a real Envoy behind eds-server: the stand-in API server
(tests/support/fake_kube_api.py) as its own process, SIGSTOPped, so this runs without the
kube-apiserver binaries; the same with a real kube-apiserver is in test_kubernetes_real.py.

eds-server --kubernetes runs as a process, Envoy routes to two backends on 127.0.0.2 and 127.0.0.3
(the stand-in takes loopback addresses in its slice), and requests go through Envoy the whole time.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from tests.support.backends import Backend, serve_backend
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.fake_kube_api import kubeconfig, run_process
from tests.support.fault_watch import FaultWatch
from tests.support.hung_peer import frozen_is_said, wait_source
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess


async def test_a_frozen_api_server_keeps_envoys_hosts_and_is_said_stale_within_the_bound(tmp_path: Path) -> None:
    port = free_port()
    async with (
        serve_backend(Backend("pod-2", port, "127.0.0.2")) as b2,
        serve_backend(Backend("pod-3", port, "127.0.0.3")) as b3,
    ):
        proc, api_port = await run_process(str(port), "127.0.0.2", "127.0.0.3")
        try:
            config = kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{api_port}")
            async with EdsServerProcess(None, "--kubernetes", "--kubeconfig", str(config), workdir=tmp_path) as server:
                bootstrap = envoy_bootstrap(server.port, [EdsCluster("web")], free_port(), routes={"/": "web"})
                async with EnvoyProcess(bootstrap) as envoy:
                    await envoy.wait_for(lambda: envoy.hosts("web"), lambda h: len(h) == 2, timeout=30)
                    await wait_source(server, "kubernetes", stale=False, timeout=10)
                    async with FaultWatch(envoy, server) as watch:
                        await asyncio.sleep(1.0)
                        proc.send_signal(signal.SIGSTOP)
                        try:
                            frozen_at = time.monotonic()
                            watch.mark("API server frozen (SIGSTOP)")
                            took = await frozen_is_said(server, "kubernetes", frozen_at)
                            watch.mark(f"said stale {took:.1f} s after the freeze")
                            await asyncio.sleep(3.0)
                            await wait_source(server, "kubernetes", stale=True, timeout=1)
                        finally:
                            proc.send_signal(signal.SIGCONT)
                        watch.mark("API server thawed (SIGCONT)")
                        await wait_source(server, "kubernetes", stale=False, timeout=15)
                        watch.mark("following again")
                        await asyncio.sleep(1.0)
                    assert await envoy.update_rejected("web") == 0
            log = server.log_text()
        finally:
            proc.kill()
            await proc.wait()
    watch.assert_held("API server frozen with SIGSTOP and thawed")
    assert b2.hits > 0 and b3.hits > 0
    assert "the API server at http://127.0.0.1" in log and "did not answer within 2 s" in log
