"""Helpers for integration tests that run a real Envoy against an xDS (EDS) server.

Typical use::

    xds_port, listener_port = free_port(), free_port()
    bootstrap = envoy_bootstrap(
        xds_port, [EdsCluster("web"), EdsCluster("api-cluster", service_name="api")],
        listener_port, routes={"/api": "api-cluster", "/": "web"},
    )
    async with EnvoyProcess(bootstrap) as envoy:
        await envoy.wait_for(lambda: envoy.hosts("web"), lambda hosts: len(hosts) == 2)
        status, body = await envoy.get("/")
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import aiohttp
import yaml

from tests.support import markers
from tests.support.waiting import wait_for

T = TypeVar("T")
ApiType = Literal["GRPC", "DELTA_GRPC", "REST"]

_HTTP2_KEEPALIVE_OPTIONS = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {
            "http2_protocol_options": {
                "connection_keepalive": {"interval": "30s", "timeout": "5s"},
            },
        },
    },
}


def envoy_binary() -> Path:
    """The `envoy` next to the running interpreter (the venv's), else the one on PATH."""
    markers.require("envoy", "a real Envoy")
    candidate = Path(sys.executable).parent / "envoy"
    if candidate.exists():
        return candidate
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary next to sys.executable or on PATH")
    return Path(found)


@dataclass(frozen=True)
class EdsCluster:
    """An Envoy cluster of `type: EDS`; `service_name` is the EDS resource name (default: name)."""

    name: str
    service_name: str | None = None
    api_type: ApiType = "GRPC"
    lb_policy: str = "ROUND_ROBIN"


def _static_cluster(name: str, ports: Sequence[int], **extra: Any) -> dict[str, Any]:
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in ports
    ]
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        **extra,
    }


# The xDS stream's back-off in the shipped configs (envoy/*.yaml): the tests' Envoys reconnect as users' do.
SHIPPED_XDS_BACK_OFF: Mapping[str, str] = {"base_interval": "0.25s", "max_interval": "2s"}


def envoy_bootstrap(
    xds_port: int,
    clusters: Sequence[EdsCluster],
    listener_port: int | None = None,
    routes: Mapping[str, str] | None = None,
    *,
    initial_fetch_timeout: str = "5s",
    static_clusters: Mapping[str, Sequence[int]] | None = None,
    prefix_rewrite: bool = False,
    rest_port: int | None = None,
    refresh_delay: str = "0.2s",
    xds_circuit_breakers: Mapping[str, int] | None = None,
    xds_retry_back_off: Mapping[str, str] | None = SHIPPED_XDS_BACK_OFF,
    node_id: str = "test-envoy",
    xds_source_address: str | None = None,
) -> dict[str, Any]:
    """An Envoy v3 bootstrap (as a dict) for running against an xDS server on 127.0.0.1.

    - admin on 127.0.0.1:0 (`EnvoyProcess` learns the port via `--admin-address-path`);
    - `xds_cluster`: STATIC 127.0.0.1:`xds_port`, HTTP/2 with connection keepalive (gRPC);
    - one `type: EDS` cluster per `EdsCluster`, subscribed with its `api_type`. REST clusters
      poll `xds_rest_cluster` (HTTP/1.1, 127.0.0.1:`rest_port`, default `xds_port`) every
      `refresh_delay`;
    - `xds_circuit_breakers`: thresholds of `xds_cluster` (e.g. ``{"max_requests": 100000}``): each
      gRPC EDS cluster holds one request on it, and Envoy's default of 1,024 resets the rest locally;
    - `xds_retry_back_off`: how gRPC EDS streams are re-established: by default the shipped configs'
      (SHIPPED_XDS_BACK_OFF); None: Envoy's own, 0.5 s doubling up to 30 s, fully jittered;
    - `xds_source_address`: the loopback address Envoy connects to the xDS server from (another
      127.0.0.0/8 address tells it from other clients by IP);
    - `static_clusters`: extra STATIC clusters, name -> backend ports on 127.0.0.1;
    - if `listener_port` is given, an HTTP listener on 127.0.0.1 routing path prefixes to
      clusters, e.g. ``{"/api": "api-cluster", "/": "web"}``; longer prefixes match first.
      With `prefix_rewrite`, the matched prefix is rewritten to "/".
    """
    xds_extra: dict[str, Any] = {"typed_extension_protocol_options": _HTTP2_KEEPALIVE_OPTIONS}
    if xds_circuit_breakers is not None:
        xds_extra["circuit_breakers"] = {"thresholds": [{"priority": "DEFAULT", **xds_circuit_breakers}]}
    if xds_source_address is not None:
        xds_extra["upstream_bind_config"] = {"source_address": {"address": xds_source_address, "port_value": 0}}
    cluster_list: list[dict[str, Any]] = [_static_cluster("xds_cluster", [xds_port], **xds_extra)]
    if any(c.api_type == "REST" for c in clusters):
        cluster_list.append(_static_cluster("xds_rest_cluster", [rest_port or xds_port]))
    for name, ports in (static_clusters or {}).items():
        cluster_list.append(_static_cluster(name, ports))
    for c in clusters:
        source: dict[str, Any] = {"api_type": c.api_type, "transport_api_version": "V3"}
        if c.api_type == "REST":
            source |= {
                "cluster_names": ["xds_rest_cluster"],
                "refresh_delay": refresh_delay,
                "request_timeout": "1s",
            }
        else:
            envoy_grpc: dict[str, Any] = {"cluster_name": "xds_cluster"}
            if xds_retry_back_off is not None:
                envoy_grpc["retry_policy"] = {"retry_back_off": dict(xds_retry_back_off)}
            source |= {"grpc_services": [{"envoy_grpc": envoy_grpc}], "set_node_on_first_message_only": True}
        eds_config: dict[str, Any] = {
            "eds_config": {
                "resource_api_version": "V3",
                "initial_fetch_timeout": initial_fetch_timeout,
                "api_config_source": source,
            }
        }
        if c.service_name is not None:
            eds_config["service_name"] = c.service_name
        cluster_list.append(
            {
                "name": c.name,
                "type": "EDS",
                "connect_timeout": "1s",
                "lb_policy": c.lb_policy,
                "eds_cluster_config": eds_config,
            }
        )
    static: dict[str, Any] = {"clusters": cluster_list}
    if listener_port is not None:
        static["listeners"] = [_http_listener(listener_port, routes or {}, prefix_rewrite)]
    return {
        "node": {"id": node_id, "cluster": "test"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": static,
    }


def _http_listener(port: int, routes: Mapping[str, str], rewrite: bool) -> dict[str, Any]:
    route_list = []
    for prefix, cluster in sorted(routes.items(), key=lambda kv: -len(kv[0])):
        action: dict[str, Any] = {"cluster": cluster}
        if rewrite and prefix != "/":
            action["prefix_rewrite"] = "/"
        route_list.append({"match": {"prefix": prefix}, "route": action})
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
        ".v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {
            "name": "local",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": route_list}],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    return {
        "name": "ingress",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }


class Locality(NamedTuple):
    region: str = ""
    zone: str = ""
    sub_zone: str = ""


@dataclass(frozen=True)
class Host:
    """One host of a cluster as reported by the admin `/clusters?format=json`."""

    address: str
    port: int
    weight: int
    health: str  # eds_health_status; "HEALTHY" when Envoy omits it (static/healthy hosts)
    priority: int
    locality: Locality
    hostname: str
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, status: dict[str, Any]) -> Host:
        sock = status.get("address", {}).get("socket_address", {})
        loc = status.get("locality", {})
        return cls(
            address=sock.get("address", ""),
            port=int(sock.get("port_value", 0)),
            weight=int(status.get("weight", 1)),
            health=status.get("health_status", {}).get("eds_health_status", "HEALTHY"),
            priority=int(status.get("priority", 0)),
            locality=Locality(loc.get("region", ""), loc.get("zone", ""), loc.get("sub_zone", "")),
            hostname=status.get("hostname", ""),
            raw=status,
        )


class EnvoyProcess:
    """Runs Envoy with `bootstrap` for the duration of an `async with` block.

    On enter: writes the bootstrap as YAML to a temp dir, starts Envoy (`--concurrency 1`:
    one worker, so round robin is deterministic) and waits (bounded) until its admin
    answers (not until it is LIVE: see `wait_live`). On exit: SIGTERM, then SIGKILL after
    `stop_timeout`. If Envoy died on its own, the log tail is raised (or attached as a note
    to the exception already propagating).
    """

    def __init__(
        self,
        bootstrap: Mapping[str, Any],
        *,
        log_level: str = "warning",
        start_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.bootstrap = bootstrap
        self.log_level = log_level
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = list(extra_args)
        self.proc: asyncio.subprocess.Process | None = None
        self.admin_url = ""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def listener_port(self) -> int:
        listeners = self.bootstrap["static_resources"]["listeners"]
        return int(listeners[0]["address"]["socket_address"]["port_value"])

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "EnvoyProcess is not running"
        return self._session

    def log_tail(self, lines: int = 40) -> str:
        if self._tmp is None:
            return ""
        out = []
        for name in ("envoy.log", "stdio.log"):
            path = Path(self._tmp.name) / name
            if path.exists():
                out += path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(out)

    async def __aenter__(self) -> EnvoyProcess:
        self._tmp = tempfile.TemporaryDirectory(prefix="envoy-test-")
        tmp = Path(self._tmp.name)
        (tmp / "bootstrap.yaml").write_text(yaml.safe_dump(dict(self.bootstrap), sort_keys=False))
        args = [
            "-c",
            str(tmp / "bootstrap.yaml"),
            "--disable-hot-restart",
            "--admin-address-path",
            str(tmp / "admin.txt"),
            "-l",
            self.log_level,
            "--log-path",
            str(tmp / "envoy.log"),
            "--concurrency",
            "1",
            *self.extra_args,
        ]
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True),
            timeout=aiohttp.ClientTimeout(total=5),
        )
        try:
            with (tmp / "stdio.log").open("wb") as stdio:
                self.proc = await asyncio.create_subprocess_exec(
                    str(envoy_binary()),
                    *args,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=stdio,
                    stderr=stdio,
                )
            await self._wait_admin(tmp / "admin.txt")
        except BaseException:
            await self._stop()
            self._tmp.cleanup()
            raise
        return self

    async def _wait_admin(self, path: Path) -> None:
        proc = self.proc
        assert proc is not None

        async def answering() -> bool:
            if proc.returncode is not None:  # not "not yet": it never will be
                raise RuntimeError(f"envoy exited with {proc.returncode} during startup:\n{self.log_tail()}")
            address = path.read_text().strip() if path.exists() else ""
            if not address:
                return False
            self.admin_url = f"http://{address}"
            async with self.session.get(f"{self.admin_url}/ready") as resp:
                await resp.read()
                return True

        try:
            await wait_for(answering, timeout=self.start_timeout, interval=0.05, what="envoy admin")
        except AssertionError:
            raise RuntimeError(f"envoy admin not answering in {self.start_timeout}s:\n{self.log_tail()}") from None

    async def _stop(self) -> int | None:
        """Stop Envoy; return its exit code if it had already died on its own, else None."""
        proc, died = self.proc, None
        if proc is not None:
            if proc.returncode is not None:
                died = proc.returncode
            else:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), self.stop_timeout)
                except TimeoutError:
                    proc.kill()
                    await asyncio.wait_for(proc.wait(), self.stop_timeout)
        if self._session is not None:
            await self._session.close()
        return died

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            died = await self._stop()
            if died is not None:
                message = f"envoy exited on its own with {died}:\n{self.log_tail()}"
                if exc is None:
                    raise RuntimeError(message)
                exc.add_note(message)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    # -- admin ---------------------------------------------------------------------------

    async def admin_get(self, path: str) -> str:
        async with self.session.get(f"{self.admin_url}{path}") as resp:
            return await resp.text()

    async def is_live(self) -> bool:
        """True once Envoy finished initializing (clusters fetched or timed out)."""
        async with self.session.get(f"{self.admin_url}/ready") as resp:
            return resp.status == 200

    async def wait_live(self, timeout: float = 15.0) -> None:
        await wait_for(self.is_live, timeout=timeout)

    async def clusters(self) -> dict[str, Any]:
        """The raw JSON of `/clusters?format=json`."""
        async with self.session.get(f"{self.admin_url}/clusters?format=json") as resp:
            result: dict[str, Any] = await resp.json(content_type=None)
            return result

    async def hosts(self, cluster: str) -> list[Host]:
        """Hosts of `cluster` (KeyError if Envoy has no such cluster)."""
        for status in (await self.clusters()).get("cluster_statuses", []):
            if status["name"] == cluster:
                return [Host.from_json(h) for h in status.get("host_statuses", [])]
        raise KeyError(cluster)

    async def stats(self, filter: str = "") -> dict[str, int | str]:
        """`/stats?filter=REGEX` as {name: value}; counters/gauges are ints, text readouts
        (e.g. `version_text`) strings without quotes, histograms raw strings."""
        async with self.session.get(f"{self.admin_url}/stats", params={"filter": filter}) as resp:
            text = await resp.text()
        result: dict[str, int | str] = {}
        for line in text.splitlines():
            name, sep, value = line.partition(": ")
            if not sep:
                continue
            if re.fullmatch(r"-?\d+", value):
                result[name] = int(value)
            else:
                result[name] = value[1:-1] if value.startswith('"') else value
        return result

    async def _stat(self, name: str) -> int | str | None:
        return (await self.stats(f"^{re.escape(name)}$")).get(name)

    async def version_text(self, cluster: str) -> str:
        """The EDS version last accepted for `cluster` ("" before any)."""
        return str(await self._stat(f"cluster.{cluster}.version_text") or "")

    async def update_rejected(self, cluster: str) -> int:
        return int(await self._stat(f"cluster.{cluster}.update_rejected") or 0)

    async def members(self, cluster_regex: str = ".*") -> dict[str, int]:
        """Hosts per cluster (`membership_total`) for clusters whose name matches `cluster_regex`.

        Gauges only, filtered by Envoy: cheap enough to poll while Envoy is busy with its xDS streams
        (1,500 clusters: 17 KB and 33 ms a look, against 1.1 MB and 84 ms for `/clusters?format=json`)."""
        params = {"filter": rf"^cluster\.({cluster_regex})\.membership_total$", "type": "Gauges"}
        async with self.session.get(f"{self.admin_url}/stats", params=params) as resp:
            text = await resp.text()
        result: dict[str, int] = {}
        for line in text.splitlines():
            name, sep, value = line.partition(": ")
            if sep:
                result[name.removeprefix("cluster.").removesuffix(".membership_total")] = int(value)
        return result

    async def wait_for(
        self,
        probe: Callable[[], Awaitable[T]],
        check: Callable[[T], object] = bool,
        *,
        timeout: float = 10.0,
        interval: float = 0.1,
    ) -> T:
        """`waiting.wait_for`, probing at a pace Envoy's admin does not notice."""
        return await wait_for(probe, check, timeout=timeout, interval=interval)

    async def get(self, path: str) -> tuple[int, str]:
        """HTTP GET through the listener on 127.0.0.1; returns (status, body)."""
        async with self.session.get(f"http://127.0.0.1:{self.listener_port}{path}") as resp:
            return resp.status, await resp.text()


@contextlib.asynccontextmanager
async def envoy_fleet(
    bootstraps: Sequence[Mapping[str, Any]], *, first_base_id: int = 100, start_timeout: float = 60.0
) -> AsyncIterator[list[EnvoyProcess]]:
    """One `EnvoyProcess` per bootstrap, started together as a fleet boots; all stopped on exit.

    Each gets its own `--base-id` (`first_base_id` + index) so that no two ever share hot-restart
    shared memory or sockets on the host, even if `--disable-hot-restart` is dropped. If any fails
    to start, those that started are stopped and the first error is raised."""
    envoys = [
        EnvoyProcess(b, start_timeout=start_timeout, extra_args=["--base-id", str(first_base_id + i)])
        for i, b in enumerate(bootstraps)
    ]
    async with contextlib.AsyncExitStack() as stack:
        results = await asyncio.gather(*(e.__aenter__() for e in envoys), return_exceptions=True)
        for envoy, result in zip(envoys, results, strict=True):
            if not isinstance(result, BaseException):
                stack.push_async_exit(envoy)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        yield envoys
