"""`eds-server demo` (what `make demo` runs): a copy of the example file to edit, every port named."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from eds_server import demo, ports
from tests.support.paths import ROOT
from tests.support.waiting import wait_for

pytestmark = pytest.mark.envoy
EXAMPLE = ROOT / "examples" / "upstreams.yaml"


def test_the_demo_names_every_port_it_needs() -> None:
    needed = demo.envoy_ports(str(EXAMPLE.parent.parent / "envoy" / "envoy.yaml"))
    assert needed == [("Envoy admin", ("127.0.0.1", 9901)), ("Envoy listener ingress", ("127.0.0.1", 10000))]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert ports.unbindable([("eds-server admin", ("127.0.0.1", port))]) == (
            f"eds-server admin 127.0.0.1:{port}: address in use"
        )


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        r.raise_for_status()
        return json.loads(await r.text())


async def test_demo_serves_a_copy_and_leaves_the_example_alone(tmp_path: Path) -> None:
    """On free ports (`--free-ports`), with the usual Envoy admin port taken, as by an Envoy already
    running here: the banner names the ports chosen, and its commands work on them."""
    before = hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    log = tmp_path / "demo.log"
    with socket.socket() as busy, log.open("wb") as out:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # taken already: as good
            busy.bind(("127.0.0.1", 9901))
            busy.listen()
        # from outside the checkout: the example and Envoy's config come from the package
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "eds_server", "demo", "--free-ports", stdout=out, stderr=out, cwd=tmp_path
        )
        try:
            found = await wait_for(
                lambda: asyncio.sleep(0, log.read_text()),
                lambda text: re.search(r"Edit (\S+/upstreams\.yaml)", text),
                timeout=30,
            )
            copy = Path(re.search(r"Edit (\S+/upstreams\.yaml)", found).group(1))  # type: ignore[union-attr]
            assert copy != EXAMPLE and copy.exists() and "eds-demo-" in str(copy)
            banner = re.search(
                r"eds-server \(gRPC :(\d+), admin :(\d+)\), 3 sample backends \(:(\d+), :(\d+), "
                r":(\d+)\), Envoy \(listener :(\d+), admin :(\d+)\)",
                found,
            )
            assert banner is not None, found
            grpc, admin, b1, b2, b3, listener, envoy_admin = map(int, banner.groups())
            assert envoy_admin != 9901 and len({grpc, admin, b1, b2, b3, listener, envoy_admin}) == 7
            assert f"127.0.0.1:{b1}" in copy.read_text()  # the copy lists the backends where they are
            # the banner comes once Envoy is live: the first command it prints works at once
            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{listener}/") as r:
                assert r.status == 200
                assert (await r.text()).startswith(
                    (f"hello from web backend 127.0.0.1:{b1}", f"hello from web backend 127.0.0.1:{b2}")
                )
            await wait_for(
                lambda: _get_json(f"http://127.0.0.1:{envoy_admin}/clusters?format=json"),
                lambda c: any(
                    s["name"] == "web" and len(s.get("host_statuses", [])) == 2 for s in c["cluster_statuses"]
                ),
                timeout=30,
            )
            copy.write_text(copy.read_text().replace(f"      - 127.0.0.1:{b1}\n", ""))
            await wait_for(
                lambda: _get_json(f"http://127.0.0.1:{admin}/v1/groups/web"),
                lambda g: len(g["endpoints"]) == 1,
                timeout=15,
            )
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
            code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 0, log.read_text()
    assert (
        log.read_text()
        .rstrip()
        .splitlines()[-1]
        .startswith("eds-server demo stopped: Envoy, eds-server and the 3 sample backends are down")
    )
    assert not copy.exists() and not copy.parent.exists()
    assert hashlib.sha256(EXAMPLE.read_bytes()).hexdigest() == before
