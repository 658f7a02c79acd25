"""Docker Swarm as a source: labelled services, their running tasks as endpoints.

The pure half (`service_endpoints` and friends) turns `docker service inspect`, task and node JSON into
endpoints, reusing the label rules of the Docker source (`containers.py`). The IO half (`SwarmSource`)
talks to a manager: a full listing on connect and on a slow periodic resync, service/node/container
events, and, because the events API does not report every task transition, a short bounded re-poll of
a service's tasks after an event or while any of its tasks is in a transitional state. While the
manager is away the last known endpoints keep being served, marked stale.

Addresses: a task's IP on the chosen overlay network (``eds.network`` / ``--docker-network``); for a
port published in ``mode: host``, or a service on the ``host`` network, the node's address (the local
node: ``--docker-host-address``; another node: its ``Status.Addr``). The service VIP is never used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiodocker

from ..model import Endpoint, Group, Health, groups_from
from .base import Backoff, Debounce, Feed
from .containers import DockerOptions, Skip, group_settings, labelled_endpoint, opted_in
from .docker import EngineFollower

log = logging.getLogger("eds_server.sources.swarm")

# Task states before "running" (it may still come up) and after it (it is gone).
STARTING_STATES = {"new", "allocated", "pending", "assigned", "accepted", "preparing", "ready", "starting"}
TERMINAL_STATES = {"complete", "shutdown", "failed", "rejected", "remove", "orphaned"}
# Container events (local node only) after which a service's tasks are worth looking at again.
CONTAINER_ACTIONS = {"start", "die", "kill", "stop", "destroy", "oom", "pause", "unpause"}
SERVICE_ID_LABEL = "com.docker.swarm.service.id"


# -- pure: JSON -> endpoints -----------------------------------------------------------------------


@dataclass
class ServiceEndpoints:
    name: str
    endpoints: dict[str, list[Endpoint]] = field(default_factory=dict)  # group -> one per task
    warning: str | None = None


def service_name(service: Mapping[str, Any]) -> str:
    return str((service.get("Spec") or {}).get("Name") or str(service.get("ID", "?"))[:12])


def service_labels(service: Mapping[str, Any]) -> dict[str, str]:
    """Container labels of the task template, overridden by the service's own labels."""
    spec = service.get("Spec") or {}
    container = ((spec.get("TaskTemplate") or {}).get("ContainerSpec") or {}).get("Labels") or {}
    return {**container, **(spec.get("Labels") or {})}


def task_transitional(task: Mapping[str, Any]) -> bool:
    """A task on its way up or down: its state will change without a service event."""
    state = str((task.get("Status") or {}).get("State") or "")
    desired = str(task.get("DesiredState") or "")
    if desired == "running":
        return state in STARTING_STATES
    return state not in TERMINAL_STATES  # told to stop, not stopped yet


def task_health(task: Mapping[str, Any]) -> Health | None:
    """None: no endpoint (not running, or its health check has not passed yet)."""
    status = task.get("Status") or {}
    if status.get("State") != "running":
        return None
    if task.get("DesiredState") != "running":
        return Health.DRAINING  # scaled down, updated, node drained: stopping
    # Swarm keeps a task "starting" until its health check passes and replaces an unhealthy one; a
    # health status is mapped as the Docker source does, should the task carry one.
    container = status.get("ContainerStatus") or {}
    health = container.get("Health") or status.get("Health") or {}
    value = health.get("Status", "none") if isinstance(health, Mapping) else str(health)
    return {"none": Health.HEALTHY, "healthy": Health.HEALTHY, "unhealthy": Health.UNHEALTHY}.get(value)


def _strip_prefix(address: str) -> str:
    return address.split("/", 1)[0]


def _attachments(task: Mapping[str, Any]) -> dict[str, tuple[str, str | None]]:
    """Network name -> (driver, first address) of a task's network attachments."""
    out: dict[str, tuple[str, str | None]] = {}
    for att in task.get("NetworksAttachments") or []:
        net = att.get("Network") or {}
        spec = net.get("Spec") or {}
        name = str(spec.get("Name") or net.get("ID") or "?")
        driver = str((spec.get("DriverConfiguration") or {}).get("Name") or "")
        if spec.get("Ingress") or name == "ingress":
            continue  # the routing mesh: VIP territory, never an endpoint
        addrs = [_strip_prefix(a) for a in att.get("Addresses") or [] if a]
        out[name] = (driver, addrs[0] if addrs else None)
    return out


def _network_ip(task: Mapping[str, Any], wanted: str | None, prefix: str) -> str:
    nets = _attachments(task)
    with_ip = {name: ip for name, (_, ip) in nets.items() if ip}
    if wanted:
        # Stacks prefix network names with the stack name: accept "backend" for "shop_backend".
        matches = [n for n in with_ip if n == wanted] or [n for n in with_ip if n.endswith("_" + wanted)]
        if len(matches) != 1:
            on = ", ".join(sorted(nets)) or "none"
            raise Skip(f"has no address on network {wanted!r} (its networks: {on})")
        return with_ip[matches[0]]
    if len(with_ip) == 1:
        return next(iter(with_ip.values()))
    if not with_ip:
        raise Skip("has no address on any network")
    raise Skip(f"is on several networks ({', '.join(sorted(with_ip))}): set {prefix}.network")


def _host_networked(task: Mapping[str, Any]) -> bool:
    nets = _attachments(task)
    return any(driver == "host" or name == "host" for name, (driver, _) in nets.items())


def _host_published(task: Mapping[str, Any], port: int) -> int | None:
    for p in ((task.get("Status") or {}).get("PortStatus") or {}).get("Ports") or []:
        if (
            p.get("PublishMode") == "host"
            and p.get("TargetPort") == port
            and (p.get("Protocol") or "tcp") == "tcp"
            and p.get("PublishedPort")
        ):
            return int(p["PublishedPort"])
    return None


def _service_port(service: Mapping[str, Any], settings: Mapping[str, Any], prefix: str) -> int:
    if "port" in settings:
        return int(settings["port"])
    spec = service.get("Spec") or {}
    ports = sorted(
        {
            int(p["TargetPort"])
            for p in ((spec.get("EndpointSpec") or {}).get("Ports") or [])
            if p.get("TargetPort") and (p.get("Protocol") or "tcp") == "tcp"
        }
    )
    if len(ports) == 1:
        return ports[0]
    if not ports:
        raise Skip(f"no {prefix}.port label and no published TCP port")
    raise Skip(f"publishes several ports ({', '.join(map(str, ports))}): set {prefix}.port")


def node_address(
    node_id: str, nodes: Mapping[str, Mapping[str, Any]], local_node: str | None, options: DockerOptions
) -> str:
    if node_id and node_id == local_node:
        return options.host_address
    addr = str(((nodes.get(node_id) or {}).get("Status") or {}).get("Addr") or "")
    if addr in ("", "0.0.0.0", "::"):
        raise Skip(f"node {node_id[:12] or '?'} has no known address")
    return addr


def task_name(service: Mapping[str, Any], task: Mapping[str, Any]) -> str:
    slot = task.get("Slot")
    return f"{service_name(service)}.{slot if slot else str(task.get('NodeID', '?'))[:12]}"


def _task_endpoint(
    service: Mapping[str, Any],
    task: Mapping[str, Any],
    settings: Mapping[str, Any],
    health: Health,
    options: DockerOptions,
    nodes: Mapping[str, Mapping[str, Any]],
    local_node: str | None,
) -> Endpoint:
    prefix = options.label_prefix
    port = _service_port(service, settings, prefix)
    published = _host_published(task, port)
    node_id = str(task.get("NodeID") or "")
    if "address" in settings:
        address = str(settings["address"])
        port = published or port
    elif published is not None:
        address, port = node_address(node_id, nodes, local_node, options), published
    elif _host_networked(task):
        address = node_address(node_id, nodes, local_node, options)
    elif options.address_mode == "published":
        raise Skip(f"port {port}/tcp is not published in mode host (needed with --docker-address-mode published)")
    else:
        address = _network_ip(task, settings.get("network") or options.network, prefix)
    return labelled_endpoint(address, port, settings, health, task_name(service, task))


def node_usable(node: Mapping[str, Any] | None) -> bool:
    """Only a node Swarm declares `down` (its heartbeat missed for good, ~15 s) loses its tasks.

    `unknown` is what a restarted manager says of every worker until it re-registers (a few seconds,
    while its tasks keep running), and `disconnected` is a passing state too: uncertainty keeps what
    Envoy has, with each task's last health."""
    if node is None:
        return True  # not listed yet: trust the task
    return str((node.get("Status") or {}).get("State") or "ready") != "down"


def service_endpoints(
    service: Mapping[str, Any],
    tasks: Iterable[Mapping[str, Any]],
    options: DockerOptions,
    nodes: Mapping[str, Mapping[str, Any]] | None = None,
    local_node: str | None = None,
) -> ServiceEndpoints:
    """The endpoints one service contributes: per group, one per running task (or a warning)."""
    nodes = nodes or {}
    out = ServiceEndpoints(service_name(service))
    labels = service_labels(service)
    if not opted_in(labels, options):
        return out
    try:
        groups, settings = group_settings(labels, options.label_prefix)
        for task in sorted(tasks, key=lambda t: (t.get("Slot") or 0, str(t.get("NodeID")), str(t.get("ID")))):
            if task.get("ServiceID") not in (None, service.get("ID")):
                continue
            health = task_health(task)
            if health is None or not node_usable(nodes.get(str(task.get("NodeID") or ""))):
                continue
            for group in groups:
                ep = _task_endpoint(service, task, settings[group], health, options, nodes, local_node)
                out.endpoints.setdefault(group, []).append(ep)
    except Skip as e:
        out.endpoints = {}
        out.warning = f"service {out.name}: {e}; skipped"
    return out


def groups_of(services: Iterable[ServiceEndpoints]) -> dict[str, Group]:
    """Merge per-service endpoints into groups; a repeated address:port keeps the first."""
    return groups_from((group, ep) for s in services for group, eps in s.endpoints.items() for ep in eps)


# -- IO: follow a manager ---------------------------------------------------------------------------


class SwarmSource(EngineFollower):
    name = "swarm"
    what = "manager"

    def __init__(
        self,
        feed: Feed,
        options: DockerOptions,
        *,
        poll_interval: float = 1.0,
        poll_window: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(feed, options, **kwargs)
        self.poll_interval = max(0.2, poll_interval)
        self.poll_window = poll_window
        self._services: dict[str, Mapping[str, Any]] = {}  # service id -> inspect (opted in)
        self._tasks: dict[str, list[Mapping[str, Any]]] = {}  # service id -> its tasks
        self._nodes: dict[str, Mapping[str, Any]] = {}
        self._local_node: str | None = None
        self._hot: dict[str, float] = {}  # service id -> re-poll its tasks until this loop time

    def _counts(self) -> dict[str, int]:
        return {"services": len(self._services)}

    # -- state ---------------------------------------------------------------------------------
    def publish(self) -> None:
        """Publish the whole current state (the store works out what changed)."""
        per_service = {
            sid: service_endpoints(
                self._services[sid], self._tasks.get(sid, []), self.options, self._nodes, self._local_node
            )
            for sid in sorted(self._services)
        }
        self._publish({sid: s.warning for sid, s in per_service.items()}, groups_of(per_service.values()))

    def forget(self, sid: str) -> bool:
        known = sid in self._services
        self._services.pop(sid, None)
        self._tasks.pop(sid, None)
        self._hot.pop(sid, None)
        self.warnings.forget(sid)
        return known

    def _heat(self, sid: str) -> None:
        self._hot[sid] = asyncio.get_running_loop().time() + self.poll_window

    # -- manager -------------------------------------------------------------------------------
    async def _list_tasks(self, docker: aiodocker.Docker, sid: str) -> list[Mapping[str, Any]]:
        tasks: list[Mapping[str, Any]] = await self._request(docker.tasks.list(filters={"service": [sid]}))
        return [t for t in tasks if t.get("ServiceID") == sid]

    async def _list_nodes(self, docker: aiodocker.Docker) -> None:
        nodes = await self._request(docker.nodes.list())
        self._nodes = {str(n["ID"]): n for n in nodes}
        info = await self._request(docker.system.info())
        self._local_node = ((info or {}).get("Swarm") or {}).get("NodeID") or None

    async def refresh_service(self, docker: aiodocker.Docker, sid: str) -> bool:
        """Inspect one service and list its tasks again; True when our state may have changed."""
        try:
            service: Mapping[str, Any] = await self._request(docker.services.inspect(sid))
        except aiodocker.DockerError as e:
            if e.status == 404:
                return self.forget(sid)
            raise
        if not opted_in(service_labels(service), self.options):
            return self.forget(sid)
        tasks = await self._list_tasks(docker, sid)
        old = (self._services.get(sid), self._tasks.get(sid))
        self._services[sid], self._tasks[sid] = service, tasks
        return old != (service, tasks)

    async def relist(self, docker: aiodocker.Docker) -> None:
        """Replace what we know with a fresh listing of labelled services and their tasks."""
        await self._list_nodes(docker)
        listed = await self._request(docker.services.list())
        services = {str(s["ID"]): s for s in listed if opted_in(service_labels(s), self.options)}
        tasks = {sid: await self._list_tasks(docker, sid) for sid in services}
        self._services, self._tasks = services, tasks
        now = asyncio.get_running_loop().time()
        self._hot = {sid: t for sid, t in self._hot.items() if sid in services}
        for sid in services:
            if _updating(services[sid]) or any(task_transitional(t) for t in tasks[sid]):
                self._hot[sid] = max(self._hot.get(sid, 0.0), now + self.poll_window)
        self.warnings.keep(services)
        self.relists += 1
        self.last_sync = now
        self.publish()

    async def handle(self, docker: aiodocker.Docker, event: Mapping[str, Any]) -> bool:
        """Apply one event; True when our state changed."""
        kind = event.get("Type")
        actor = event.get("Actor") or {}
        attrs = actor.get("Attributes") or {}
        action = str(event.get("Action") or "")
        if kind == "service":
            sid = str(actor.get("ID") or "")
            if not sid:
                return False
            if action == "remove":
                return self.forget(sid)
            changed = await self.refresh_service(docker, sid)
            if sid in self._services:
                self._heat(sid)
            return changed
        if kind == "node":
            await self._list_nodes(docker)
            for sid in list(self._services):  # a drained or lost node moves tasks of any service
                self._heat(sid)
            return True
        if kind == "container":
            sid = str(attrs.get(SERVICE_ID_LABEL) or "")
            if sid in self._services and action.split(":")[0] in CONTAINER_ACTIONS | {"health_status"}:
                self._heat(sid)
        return False

    async def _poll_hot(self, docker: aiodocker.Docker) -> bool:
        now = asyncio.get_running_loop().time()
        changed = False
        for sid, until in list(self._hot.items()):
            if now >= until:
                del self._hot[sid]
                continue
            changed |= await self.refresh_service(docker, sid)
        return changed

    async def _follow(self, docker: aiodocker.Docker, stop: asyncio.Event, backoff: Backoff) -> None:
        events = await self._events(docker, ("service", "node", "container"))
        await self.relist(docker)  # after subscribing, so nothing falls between the two
        self._connected(backoff, len(self._services), "services")
        loop = asyncio.get_running_loop()
        pending = Debounce(self.debounce)
        next_poll = loop.time()
        while not stop.is_set():
            now = loop.time()
            timeout = pending.timeout(now, self.ping_interval)
            if self._hot:
                timeout = min(timeout, next_poll - now)
            event = await events.get(timeout)
            now = loop.time()
            if event is not None and await self.handle(docker, event):
                pending.changed(now)
            if self._hot and now >= next_poll:
                next_poll = now + self.poll_interval
                if await self._poll_hot(docker):
                    pending.changed(now)
            elif not self._hot:
                next_poll = now
            await self._upkeep(docker, pending, now)


def _updating(service: Mapping[str, Any]) -> bool:
    state = str((service.get("UpdateStatus") or {}).get("State") or "")
    return state in ("updating", "rollback_started")
