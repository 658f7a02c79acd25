"""A small stand-in for a Kubernetes API server on 127.0.0.1: lists and watches of Services and
EndpointSlices in one namespace (with history, so a watch resumed from an old version misses
nothing; a bookmark 2 s before a watch's end, as the watch cache sends), a bearer token, /readyz,
/livez; it can stall the next watches of a kind (their headers, then nothing: a connection stalled in
between). It can go away and come back on the same port in-process, or run
as its own process (``python -m tests.support.fake_kube_api [PORT IP...]``: it prints its port and
serves one Service, group ``web``, with one slice of those endpoints) for a test that freezes it with
SIGSTOP.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.support.paths import ROOT
from tests.support.ports import free_port

NS = "fake"


def service() -> dict[str, Any]:
    return {
        "metadata": {"name": "web", "namespace": NS, "annotations": {"eds.group": "web"}},
        "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    }


def endpoint_slice(*ips: str, port: int = 8080) -> dict[str, Any]:
    return {
        "metadata": {"name": "web-1", "namespace": NS, "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}} for ip in ips],
    }


class FakeApiServer:
    """Lists and watches (with history, so a watch resumed from an old version misses nothing) of
    Services and EndpointSlices in one namespace, a bearer token, and /readyz."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = "token-a"
        self.rv = 100
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"services": {}, "endpointslices": {}}
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []
        self.readyz = 0  # probes answered
        self.livez = 0  # heartbeats answered
        self.refused = 0  # 401s
        self.failing = 0  # a status every API request gets (503: up, answering probes, not serving)
        self.failed = 0
        self.stall: dict[str, int] = {}  # per plural: how many of the next watches stall (headers, then nothing)
        self.stalled = 0
        self.watched: list[tuple[str, int]] = []  # each watch asked: plural, resourceVersion
        self._bump = asyncio.Event()
        self._runner: web.AppRunner | None = None

    def put(self, plural: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        name = obj["metadata"]["name"]
        etype = "MODIFIED" if name in self.objects[plural] else "ADDED"
        self.objects[plural][name] = obj
        self.history.append((self.rv, plural, etype, obj))
        self._bump.set()
        self._bump = asyncio.Event()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        """Away: open watches are cut mid-stream, new connections refused."""
        assert self._runner is not None
        await self._runner.cleanup()
        self._runner = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/readyz":
            self.readyz += 1
            return web.Response(text="ok")
        if request.path == "/livez":  # the heartbeat's: counted apart from probes and failures
            self.livez += 1
            return web.Response(text="ok")
        if self.failing:
            self.failed += 1
            return web.json_response({"kind": "Status", "code": self.failing, "message": "busy"}, status=self.failing)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.refused += 1
            return web.json_response({"kind": "Status", "code": 401, "message": "Unauthorized"}, status=401)
        plural = request.path.rsplit("/", 1)[-1]
        if plural not in self.objects:
            return web.json_response({"kind": "Status", "code": 404, "message": "not found"}, status=404)
        if not request.query.get("watch"):
            items = list(self.objects[plural].values())
            return web.json_response({"metadata": {"resourceVersion": str(self.rv)}, "items": items})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        sent = int(request.query["resourceVersion"])
        self.watched.append((plural, sent))
        if self.stall.get(plural):  # a connection stalled in between: nothing more, never ended
            self.stall[plural] -= 1
            self.stalled += 1
            await asyncio.sleep(60)
            return resp
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(request.query["timeoutSeconds"])
        # as the watch cache: a bookmark with the current version 2 s before the end
        bookmark: float | None = deadline - 2.0 if request.query.get("allowWatchBookmarks") == "true" else None
        while (left := deadline - loop.time()) > 0:
            for rv, kind, etype, obj in list(self.history):
                if rv > sent:
                    sent = rv
                    if kind == plural:
                        await resp.write(json.dumps({"type": etype, "object": obj}).encode() + b"\n")
            if bookmark is not None and loop.time() >= bookmark:
                bookmark = None
                mark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": str(self.rv)}}}
                await resp.write(json.dumps(mark).encode() + b"\n")
            with contextlib.suppress(TimeoutError):
                wake = left if bookmark is None else max(0.0, min(left, bookmark - loop.time()))
                await asyncio.wait_for(self._bump.wait(), wake)
        await resp.write_eof()
        return resp


async def run_process(*args: str) -> tuple[asyncio.subprocess.Process, int]:
    """The stand-in as its own process (stderr discarded) and its port; the caller kills it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.fake_kube_api",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    try:
        return proc, int(await asyncio.wait_for(proc.stdout.readline(), 30))
    except BaseException:
        proc.kill()
        await proc.wait()
        raise


def kubeconfig(path: Path, url: str, token: str = "token-a") -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": url}}],
                "users": [{"name": "me", "user": {"token": token}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "me"}}],
            }
        )
    )
    return path


async def _serve_forever(args: list[str]) -> None:
    """args: [PORT IP...], the endpoints of the one slice (default: 127.0.0.2 on 8080)."""
    server = FakeApiServer()
    server.put("services", service())
    server.put("endpointslices", endpoint_slice(*args[1:], port=int(args[0])) if args else endpoint_slice("127.0.0.2"))
    await server.start()
    print(server.port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(sys.argv[1:]))
    sys.exit(0)
