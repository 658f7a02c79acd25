"""The admin status page (`GET /`), rendered by a real headless Chromium while a real Envoy is
connected, with a NACKed group and hostile text from the file and from a client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from eds_server import status_page
from eds_server.model import endpoint_json
from eds_server.serving_state import serving_state
from eds_server.sources.containers import DockerOptions, container_endpoints
from tests.support.backends import Backend, http_backends
from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.paths import ROOT
from tests.support.ports import free_port
from tests.support.server_process import EdsServerProcess
from tests.support.waiting import wait_for
from tests.support.xds_client import nacking_client

pytestmark = pytest.mark.envoy

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE_GROUP = '<i>odd</i>&"group'
HOSTILE_NODE = "<img src=x onerror=alert(1)>"
HOSTILE_HOSTNAME = "<s>web</s>-{}"  # an eds.hostname label, or the file's hostname: any text
NACK_MESSAGE = "<b>rejected</b> by the status page test"
TOKEN = "status-page-test-token"
READY = serving_state(True, [])


def chromium(tmp: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Debian's chromium, headless, with a fresh profile, nothing fetched from anywhere but `url`."""
    assert CHROMIUM is not None
    profile = tmp / f"chromium-profile-{len(list(tmp.glob('chromium-profile-*')))}"
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def upstreams(web: list[Backend], api: list[Backend]) -> str:
    return (
        "groups:\n  web:\n    endpoints:\n"
        + "".join(
            f"      - {{address: 127.0.0.1, port: {b.port}, zone: eu-west-1a, weight: 2, "
            f"hostname: {json.dumps(HOSTILE_HOSTNAME.format(i))}}}\n"
            for i, b in enumerate(web)
        )
        + f"  api:\n    health_check: {{http: /health, interval: 1s}}\n    endpoints: [127.0.0.1:{api[0].port}]\n"
        + f"  {json.dumps(HOSTILE_GROUP)}:\n    endpoints: [127.0.0.1:1]\n"
    )


@pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="needs Debian's chromium (apt-get install chromium; .ci/run does)",
)
async def test_status_page_in_a_real_browser(tmp_path: Path) -> None:
    async with http_backends(3) as backends:
        path = tmp_path / "upstreams.yaml"
        path.write_text(upstreams(backends[:2], backends[2:]))
        state = tmp_path / "state.json"
        async with EdsServerProcess(
            path, "--state", str(state), "--admin-token", TOKEN, "--registration-allow-cidr", "127.0.0.0/8"
        ) as server:
            admin = f"http://127.0.0.1:{server.admin_port}"
            async with (
                aiohttp.ClientSession() as s,
                s.put(
                    f"{admin}/v1/groups/web/endpoints/vm-1",
                    json={"address": "127.0.0.2", "port": 8080, "region": "eu-west-1"},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                ) as r,
            ):
                assert r.status == 201, await r.text()
            bootstrap = envoy_bootstrap(
                server.port,
                [EdsCluster("web"), EdsCluster("api-cluster", service_name="api")],
                free_port(),
                routes={"/api": "api-cluster", "/": "web"},
            )
            async with EnvoyProcess(bootstrap) as envoy, nacking_client(server.port, "api", HOSTILE_NODE, NACK_MESSAGE):
                await envoy.wait_live()
                await envoy.wait_for(lambda: server.admin("/v1/streams"), _three_streams_one_nack)
                await wait_for(
                    lambda: server.admin("/v1/groups/api"),
                    lambda g: g["endpoints"][0].get("check", {}).get("result") == "pass",
                    timeout=10,
                    what="the api endpoint checked",
                )
                web_version = await envoy.version_text("web")
                dom = await asyncio.to_thread(chromium, tmp_path, admin + "/", "--dump-dom")
                shot = tmp_path / "status-page.png"
                await asyncio.to_thread(
                    chromium,
                    tmp_path,
                    admin + "/",
                    f"--screenshot={shot}",
                    "--window-size=1280,1500",
                    "--hide-scrollbars",
                )
    page = dom.stdout
    (tmp_path / "status-page.html").write_text(page)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert "<title>eds-server" in page and "ready</span>" in page
    # sources: the file and the registrations, both loaded and live
    sources = _section(page, "sources", "groups")
    assert f"file:{path}" in sources and "registrations" in sources and "health-checks" in sources
    assert sources.count(">live<") == 3
    # groups: version, endpoints with health, locality, weight and the source of each
    web = _group(page, "web")
    assert web_version in web and "3 endpoints" in web and "1 endpoint ·" in _group(page, "api")
    assert web.count("eu-west-1a") == 2 and "eu-west-1" in web and web.count(">2</td>") == 2
    assert "127.0.0.2:8080" in web and "registrations" in web and f"file:{path}" in web
    # each endpoint's hostname (a container's name, with Docker) next to its address, as text
    for i, b in enumerate(backends[:2]):
        assert re.search(rf"127\.0\.0\.1:{b.port}</td><td class=\"mono hostname\">&lt;s&gt;web&lt;/s&gt;-{i}</td>", web)
    assert "<s>" not in page
    # the NACKed group says so, with the client's message, escaped
    api = _group(page, "api")
    assert "(HTTP 200, " in api and " ms)</span>" in api  # its last health check, next to its health
    assert "NACKed by" in api and "&lt;b&gt;rejected&lt;/b&gt; by the status page test" in api
    assert "NACKed by" not in web
    # streams: Envoy's two, and the scripted client's with its NACK
    streams = _section(page, "streams", None)
    assert streams.count("test-envoy") == 2 and streams.count(">sotw<") == 3
    assert f"web</span>: sent <code>{web_version}</code>, ACKed <code>{web_version}</code>" in streams
    assert '<tr class="nack">' in streams and "NACKed" in streams
    # everything from files and clients is text, never markup
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "<img" not in page and "<b>" not in page
    assert '&lt;i&gt;odd&lt;/i&gt;&amp;"group' in page and "<i>" not in page
    # registrations: id, group, endpoint, TTL
    registrations = _section(page, "registrations", None)
    assert ">vm-1<" in registrations and ">web<" in registrations and "127.0.0.2:8080" in registrations
    # links to the JSON it shows
    for link in ("/v1/sources", "/v1/groups", "/v1/streams", "/metrics", "/v1/groups/web", "/v1/registrations"):
        assert f'href="{link}"' in page


@pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="needs Debian's chromium (apt-get install chromium; .ci/run does)",
)
async def test_a_file_broken_after_a_good_load_turns_the_badge_amber(tmp_path: Path) -> None:
    """Ready is not enough: the page says which source's last good state is served, and why."""
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8080]\n")
    async with EdsServerProcess(path) as server:
        admin = f"http://127.0.0.1:{server.admin_port}"
        path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8080\n")  # a syntax error
        await wait_for(lambda: server.admin("/readyz"), lambda b: b["state"] == "degraded", timeout=15)
        dom = await asyncio.to_thread(chromium, tmp_path, admin + "/", "--dump-dom")
        shot = tmp_path / "status-page-degraded.png"
        await asyncio.to_thread(
            chromium, tmp_path, admin + "/", f"--screenshot={shot}", "--window-size=1280,600", "--hide-scrollbars"
        )
    page = dom.stdout
    (tmp_path / "status-page-degraded.html").write_text(page)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    badge = re.search(
        r'<span class="pill ([a-z ]+)" id="state" data-state="degraded" title="([^"]*)">(.*?)</span>', page, re.S
    )
    assert badge, page[:2000]
    assert badge.group(1) == "degraded"
    assert badge.group(3) == f"degraded: serving the last good state of file:{path} (why: Sources)"  # not the error
    assert badge.group(2).startswith(f"degraded: serving the last good state of file:{path} because ")
    sources = _section(page, "sources", "groups")
    assert "last load failed" in sources and '<tr class="nack">' in sources
    assert "127.0.0.1:8080" in _group(page, "web")  # the last good state is what is shown and served


# scripts/status_page_picture.sh sets it: the demo's page, as the test below sees it, becomes docs/status-page.png
WRITE_PICTURE = os.environ.get("EDS_WRITE_STATUS_PICTURE") == "1"
PICTURE = ROOT / "docs" / "status-page.png"


@pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="needs Debian's chromium (apt-get install chromium; .ci/run does)",
)
async def test_the_demos_status_page_is_the_picture_the_docs_show(tmp_path: Path) -> None:
    """The README's picture is `eds-server demo` with its Envoy connected, taken here: the run that
    checks the page can also write docs/status-page.png, so the picture follows the page."""
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "eds_server", "demo", "--free-ports", stdout=out, stderr=out, cwd=tmp_path
        )
        try:
            found = await wait_for(
                lambda: asyncio.sleep(0, log.read_text()),
                lambda text: re.search(r"eds-server \(gRPC :\d+, admin :(\d+)\)", text),
                timeout=30,
                what="the demo's banner",
            )
            port = re.search(r"eds-server \(gRPC :\d+, admin :(\d+)\)", found)
            assert port is not None, found
            admin = f"http://127.0.0.1:{port.group(1)}"
            await wait_for(
                lambda: _get_json(admin + "/v1/streams"), _both_acked, timeout=30, interval=0.2, what="Envoy's ACKs"
            )
            await wait_for(
                lambda: _get_json(admin + "/v1/groups/api"),
                lambda g: g["endpoints"][0].get("check", {}).get("result") == "pass",
                timeout=15,
                what="the api endpoint checked",
            )
            dom = await asyncio.to_thread(chromium, tmp_path, admin + "/", "--dump-dom")
            shot = tmp_path / "status-page.png"
            await asyncio.to_thread(
                chromium, tmp_path, admin + "/", f"--screenshot={shot}", "--window-size=1000,720", "--hide-scrollbars"
            )
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
            code = await asyncio.wait_for(proc.wait(), 20)
    assert code == 0, log.read_text()
    page = dom.stdout
    assert 'data-state="ready"' in page and page.count('<section class="group"') == 2
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if WRITE_PICTURE:
        shutil.copyfile(shot, PICTURE)


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        r.raise_for_status()
        return json.loads(await r.text())


def _both_acked(body: dict[str, Any]) -> bool:
    """The demo's Envoy has its two clusters' streams, each name ACKed at the version sent."""
    names = [n for s in body["streams"] for n in s["names"].values()]
    return len(names) == 2 and all(n.get("sent") and n.get("acked") == n["sent"] for n in names)


def _three_streams_one_nack(body: dict[str, Any]) -> bool:
    streams = body["streams"]
    return len(streams) == 3 and any(n.get("nacked") for s in streams for n in s["names"].values())


def _section(page: str, start: str, end: str | None) -> str:
    begin = page.index(f'id="{start}"')
    return page[begin : page.index(f'id="{end}"') if end else len(page)]


def _group(page: str, name: str) -> str:
    match = re.search(rf'<section class="group" data-group="{re.escape(name)}">(.*?)</section>', page, re.S)
    assert match, name
    return match.group(1)


async def test_status_page_without_a_browser(tmp_path: Path) -> None:
    """Served as HTML, not cached, and ready for an empty server too."""
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups: {}\n")
    async with (
        EdsServerProcess(path) as server,
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{server.admin_port}/") as r,
    ):
        assert r.status == 200 and r.content_type == "text/html"
        assert r.headers["Cache-Control"] == "no-store"
        text = await r.text()
    assert "No groups." in text and "No Envoy is connected." in text


def test_long_lists_are_cut_with_a_link_and_everything_is_escaped() -> None:
    """Pure rendering: bounded however much there is."""
    ep = {"address": "::1", "port": 80, "health": "<draining>", "zone": "<z>", "source": "file:<f>"}
    groups = [{"name": f"g{i}<", "version": "v<1>", "sources": ["s<"], "endpoints": [ep] * 60} for i in range(200)]
    streams = [
        {
            "node": "n<",
            "cluster": "c<",
            "peer": "p<",
            "transport": "sotw",
            "last_nack": "<x>",
            "names": {f"g{i}<": {"sent": "v<", "acked": None, "nacked": "v<"} for i in range(30)},
            "names_total": 500,
        }
    ] * 200
    state = serving_state(False, [{"name": "file:<p>", "loaded": False}])
    page = status_page.render(
        version="1<",
        state=state,
        sources=[{"name": "<s>", "loaded": 0}],
        groups=groups,
        total_groups=300,
        total_endpoints=18_000,
        streams=streams,
        stats={"nacks_by_group": {"g0<": 2}},
        total_streams=250,
    )
    assert "200 of 300 shown" in page and "50 of 60 shown" in page and "200 of 250 shown" in page
    assert "... 500 names" in page and "250 streams" in page and "not ready: waiting for file:&lt;p&gt;" in page
    assert page.count('<section class="group"') == 200 and page.count("<tr") < 200 * 52 + 202
    assert "<" + "z>" not in page and "<x>" not in page and "<draining>" not in page and "[::1]:80" in page
    assert 'href="/v1/groups/g0%3C"' in page and "2 NACKs since start" in page


def test_a_group_held_back_shows_why() -> None:
    group = {
        "name": "web",
        "version": "v1",
        "sources": ["file:u", "registrations"],
        "endpoints": [],
        "error": "endpoint weights in priority 0 add up to <4294967296>",
    }
    page = status_page.render(
        version="1", state=READY, sources=[], groups=[group], total_groups=1, total_endpoints=0, streams=[], stats={}
    )
    assert 'class="bad conflict"' in page and "add up to &lt;4294967296&gt;" in page
    ok = status_page.render(
        version="1",
        state=READY,
        sources=[],
        groups=[{**group, "error": None}],
        total_groups=1,
        total_endpoints=0,
        streams=[],
        stats={},
    )
    assert "conflict" not in ok


def test_registrations_show_their_ttl_and_expiry() -> None:
    html = status_page._registrations(
        [{"id": "vm-<1>", "group": "web", "address": "10.0.0.5", "port": 80, "ttl": 30, "expires_in": 12.3}], 250
    )
    assert "30 s, expires in 12 s" in html and "vm-&lt;1&gt;" in html and "10.0.0.5:80" in html
    assert 'href="/v1/registrations"' in html  # 1 of 250 shown: the rest are a link away
    assert status_page._registrations(None, 0) == ""


def test_a_containers_name_is_shown_next_to_its_address() -> None:
    """With Docker, an address says little (containers come and go, IPs are reused): the page names
    the container, as the Docker source keeps it (Swarm: the task, Kubernetes: the pod)."""
    inspect = {
        "Id": "0123456789abcdef",
        "Name": "/eds-server-web-2",
        "State": {"Status": "running", "Running": True},
        "Config": {"Labels": {"eds.group": "web", "eds.port": "80"}},
        "HostConfig": {"NetworkMode": "eds-server_default"},
        "NetworkSettings": {"Networks": {"eds-server_default": {"IPAddress": "172.18.0.5"}}},
    }
    found = container_endpoints(inspect, DockerOptions())
    endpoints = [{**endpoint_json(found.endpoints["web"]), "source": "docker"}]
    unnamed = {"address": "10.0.0.9", "port": 80, "health": "healthy", "source": "file:u"}
    long_name = {**unnamed, "address": "10.0.0.10", "hostname": "x" * 500}
    group = {"name": "web", "version": "v1", "sources": ["docker"], "endpoints": [*endpoints, unnamed, long_name]}
    page = status_page.render(
        version="1", state=READY, sources=[], groups=[group], total_groups=1, total_endpoints=3, streams=[], stats={}
    )
    assert '172.18.0.5:80</td><td class="mono hostname">eds-server-web-2</td>' in page
    assert '10.0.0.9:80</td><td class="mono hostname"><span class="muted">-</span></td>' in page
    cut = "x" * (status_page.MOST_HOSTNAME_CHARS - 1) + "\u2026"
    assert f'10.0.0.10:80</td><td class="mono hostname">{cut}</td>' in page and "x" * 100 not in page


def test_workers_are_listed_with_one_that_is_down_marked() -> None:
    workers = [
        {"worker": 1, "pid": 10, "alive": True, "restarts": 0, "streams_open": 7},
        {"worker": 2, "pid": 11, "alive": False, "restarts": 3, "streams_open": None},
    ]
    page = status_page.render(
        version="1",
        state=READY,
        sources=[],
        groups=[],
        total_groups=0,
        total_endpoints=0,
        streams=[],
        stats={"workers": workers},
    )
    assert '<h2 id="workers">' in page
    assert '<td>1</td><td>10</td><td class="">up</td><td>0</td><td>7</td>' in page
    assert '<td class="bad">down</td><td>3</td>' in page
    single = status_page.render(
        version="1", state=READY, sources=[], groups=[], total_groups=0, total_endpoints=0, streams=[], stats={}
    )
    assert 'id="workers"' not in single


def test_acks_count_responses_and_a_resumed_stream_says_what_it_held() -> None:
    """After a restart Envoy reconnects saying which version it holds; nothing is resent, so nothing is
    ACKed: the header counts ACKs of responses sent, the stream shows the version held."""
    streams = [
        {
            "node": "n",
            "cluster": "c",
            "peer": "p",
            "transport": "sotw",
            "last_nack": None,
            "names": {"web": {"sent": "v1", "acked": "v1", "nacked": None}},
            "names_total": 1,
        }
    ]
    page = status_page.render(
        version="1",
        state=READY,
        sources=[],
        groups=[],
        total_groups=0,
        total_endpoints=0,
        streams=streams,
        stats={"acks": 0, "nacks": 0},
        total_streams=1,
    )
    assert "0 ACKs, 0 NACKs of responses sent since start" in page
    assert "ACKed (or held when it connected)" in page and "ACKed <code>v1</code>" in page
