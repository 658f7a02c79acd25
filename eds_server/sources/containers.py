"""Docker containers -> endpoints: labels, addresses and health, from `docker inspect` JSON alone.

No IO here, so every rule (label syntax, address selection per network mode, health mapping) is
unit-tested from recorded inspect output. A container with a bad label is skipped with one
warning that names it and the label; nothing else is affected.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .. import fields
from ..health import spec as health_spec
from ..health.spec import HealthSpec
from ..model import Endpoint, Group, Health, groups_from, locality

AddressMode = Literal["network", "published"]
SETTING_KEYS = ("port", "weight", "priority", "region", "zone", "subzone", "hostname", "network", "address")


@dataclass(frozen=True)
class DockerOptions:
    label_prefix: str = "eds"
    network: str | None = None  # default for eds.network
    host_address: str = "127.0.0.1"  # where host-network (and published) ports are reached
    address_mode: AddressMode = "network"


class Skip(Exception):
    """This container gives no endpoints; the message says why (logged as a warning)."""


@dataclass
class ContainerEndpoints:
    name: str
    endpoints: dict[str, Endpoint] = field(default_factory=dict)  # group -> endpoint
    warning: str | None = None


def container_name(inspect: Mapping[str, Any]) -> str:
    return str(inspect.get("Name") or inspect.get("Id", "?")[:12]).lstrip("/")


def opted_in(labels: Mapping[str, str] | None, options: DockerOptions) -> bool:
    return bool(labels) and f"{options.label_prefix}.group" in labels  # type: ignore[operator]


def health_of(inspect: Mapping[str, Any], draining: bool) -> Health | None:
    """None: no endpoint (not running, or its health check has not passed yet)."""
    state = inspect.get("State") or {}
    if state.get("Paused") or state.get("Status") == "paused":
        return Health.UNHEALTHY
    if state.get("Status") != "running":
        return None
    if draining:
        return Health.DRAINING
    status = (state.get("Health") or {}).get("Status", "none")
    return {"none": Health.HEALTHY, "healthy": Health.HEALTHY, "unhealthy": Health.UNHEALTHY}.get(status)


_LABEL_CHECKS: dict[str, Any] = {
    "port": fields.port,
    "weight": fields.weight,
    "priority": fields.priority,
    "address": fields.ip,
    "region": fields.text,
    "zone": fields.text,
    "subzone": fields.text,
    "hostname": fields.text,
    "network": fields.text,
}


def _checked(label: str, setting: str, value: str, checks: Mapping[str, Any], what: str) -> Any:
    """A label's value, checked as its setting requires; Skip names the label itself."""
    check = checks.get(setting, fields.text)  # metadata.<key>: any text
    try:
        return check(value)
    except ValueError as e:
        raise Skip(f"{what} {label}: {e}") from None


def group_settings(
    labels: Mapping[str, str],
    prefix: str,
    *,
    keys: tuple[str, ...] = SETTING_KEYS,
    checks: Mapping[str, Any] = _LABEL_CHECKS,
    what: str = "label",
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Groups, and per group the checked settings that apply: eds.<group>.<key> over eds.<key>.

    Shared by Docker labels, Swarm labels and Kubernetes annotations (`what` names them in errors)."""
    ours = {k[len(prefix) + 1 :]: v for k, v in labels.items() if k.startswith(prefix + ".")}
    groups = [g.strip() for g in ours.pop("group", "").split(",") if g.strip()]
    if not groups:
        raise Skip(f"{what} {prefix}.group is empty")
    common: dict[str, Any] = {}
    health = {k[len("health.") :]: (f"{prefix}.{k}", ours.pop(k)) for k in [k for k in ours if k.startswith("health.")]}
    own_health: dict[str, dict[str, tuple[str, str]]] = {g: {} for g in groups}
    own: dict[str, dict[str, Any]] = {g: {} for g in groups}
    by_length = sorted(groups, key=len, reverse=True)  # a group name may contain dots
    for key, value in ours.items():
        if key in keys or key.startswith("metadata."):
            common[key] = _checked(f"{prefix}.{key}", key, value, checks, what)
            continue
        group = next((g for g in by_length if key.startswith(g + ".")), None)
        rest = key[len(group) + 1 :] if group else ""
        if group is not None and rest.startswith("health."):
            own_health[group][rest[len("health.") :]] = (f"{prefix}.{key}", value)
            continue
        if group is None or not (rest in keys or rest.startswith("metadata.")):
            raise Skip(
                f"unknown {what} {prefix}.{key} (expected {prefix}.<key> or {prefix}.<group>.<key>, "
                f"keys: {', '.join(keys)}, metadata.<name>)"
            )
        own[group][rest] = _checked(f"{prefix}.{key}", rest, value, checks, what)
    for g in groups:
        if health or own_health[g]:
            own[g]["check"] = health_check(_with_own(health, own_health[g]), prefix, what)
    return groups, {g: {**common, **own[g]} for g in groups}


def _with_own(common: Mapping[str, tuple[str, str]], own: Mapping[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """A group's health labels: eds.<group>.health.<key> over eds.health.<key>; a kind of its own
    replaces the common kind."""
    if any(k in health_spec.KINDS for k in own):
        common = {k: v for k, v in common.items() if k not in health_spec.KINDS}
    return {**common, **own}


def health_check(health: Mapping[str, tuple[str, str]], prefix: str, what: str) -> HealthSpec | None:
    """Health labels (or annotations), key -> (the label's name, its value) -> a check; Skip names
    the label and says how to write it."""
    values: dict[str, Any] = {}
    for key, (label, value) in health.items():
        try:
            values[key] = health_spec.check_field(key, value)
        except health_spec.SpecError as e:
            raise Skip(f"{what} {label}: {e}") from None
    try:
        return health_spec.build(values)
    except health_spec.SpecError as e:
        label = health[e.field][0] if e.field in health else f"{prefix}.health.{e.field}"
        raise Skip(f"{what} {label}: {e}") from None


_SIDECAR_URL = re.compile(r"[a-z]+://[^/]*(/\S*)?")


def sidecar_check(labels: Mapping[str, str]) -> tuple[HealthSpec | None, str | None]:
    """Sidecar's `HealthCheck`/`HealthCheckArgs` labels, read as ours where they mean the same: the
    check, and a line for the operator (None: nothing to say). The URL's host and port are not used:
    eds-server checks the endpoint's own address and port (`eds.health.port` for another port)."""
    kind, args = labels.get("HealthCheck", ""), labels.get("HealthCheckArgs", "")
    if kind == "AlwaysSuccessful":
        return None, None
    if kind == "HttpGet" and (m := _SIDECAR_URL.fullmatch(args.strip())):
        return HealthSpec("http", path=health_spec.path(m.group(1) or "/")), None
    return None, (
        f"Sidecar's label HealthCheck={kind} is not run by eds-server: write eds.health.http=/PATH or "
        "eds.health.tcp=true (docs/health-checks.md)"
    )


def _container_port(inspect: Mapping[str, Any], settings: Mapping[str, Any], prefix: str) -> int:
    if "port" in settings:
        return int(settings["port"])
    exposed = sorted(
        {int(p.split("/")[0]) for p in ((inspect.get("Config") or {}).get("ExposedPorts") or {}) if p.endswith("/tcp")}
    )
    if len(exposed) == 1:
        return exposed[0]
    if not exposed:
        raise Skip(f"no {prefix}.port label and no exposed TCP port")
    raise Skip(f"exposes several ports ({', '.join(map(str, exposed))}): set {prefix}.port")


def _network_ip(inspect: Mapping[str, Any], wanted: str | None, prefix: str) -> str:
    networks: dict[str, Any] = (inspect.get("NetworkSettings") or {}).get("Networks") or {}
    with_ip = {
        name: n.get("IPAddress") or n.get("GlobalIPv6Address")
        for name, n in networks.items()
        if n and (n.get("IPAddress") or n.get("GlobalIPv6Address"))
    }
    if wanted:
        # Compose prefixes network names with the project: accept "backend" for "shop_backend".
        matches = [n for n in with_ip if n == wanted] or [n for n in with_ip if n.endswith("_" + wanted)]
        if len(matches) != 1:
            on = ", ".join(sorted(networks)) or "none"
            raise Skip(f"has no address on network {wanted!r} (its networks: {on})")
        return str(with_ip[matches[0]])
    if len(with_ip) == 1:
        return str(next(iter(with_ip.values())))
    if not with_ip:
        raise Skip("has no IP address on any network")
    raise Skip(f"is on several networks ({', '.join(sorted(with_ip))}): set {prefix}.network")


def _published(inspect: Mapping[str, Any], port: int, host_address: str) -> tuple[str, int]:
    bindings = ((inspect.get("NetworkSettings") or {}).get("Ports") or {}).get(f"{port}/tcp") or []
    for b in sorted(bindings, key=lambda b: ":" in (b.get("HostIp") or "")):  # IPv4 first
        ip, host_port = b.get("HostIp") or "", b.get("HostPort")
        if not host_port:
            continue
        return (host_address if ip in ("", "0.0.0.0", "::") else ip), int(host_port)
    raise Skip(f"port {port}/tcp is not published (needed with --docker-address-mode published)")


def _endpoint(
    inspect: Mapping[str, Any], settings: Mapping[str, Any], health: Health, options: DockerOptions
) -> Endpoint:
    prefix = options.label_prefix
    port = _container_port(inspect, settings, prefix)
    host_mode = ((inspect.get("HostConfig") or {}).get("NetworkMode")) == "host"
    if "address" in settings:
        address = str(settings["address"])
        if options.address_mode == "published" and not host_mode:
            port = _published(inspect, port, options.host_address)[1]
    elif host_mode:
        address = options.host_address
    elif options.address_mode == "published":
        address, port = _published(inspect, port, options.host_address)
    else:
        address = _network_ip(inspect, settings.get("network") or options.network, prefix)
    return labelled_endpoint(address, port, settings, health, container_name(inspect))


def labelled_endpoint(
    address: str, port: int, settings: Mapping[str, Any], health: Health, default_hostname: str
) -> Endpoint:
    """An endpoint from checked label settings, for containers and Swarm tasks alike."""
    return Endpoint(
        address=str(fields.ip(address)),
        port=port,
        weight=settings.get("weight"),
        health=health,
        priority=settings.get("priority", 0),
        locality=locality(settings.get("region", ""), settings.get("zone", ""), settings.get("subzone", "")),
        hostname=settings.get("hostname", default_hostname),
        metadata={k[len("metadata.") :]: v for k, v in settings.items() if k.startswith("metadata.")},
        check=settings.get("check"),
    )


def container_endpoints(
    inspect: Mapping[str, Any], options: DockerOptions, *, draining: bool = False
) -> ContainerEndpoints:
    """The endpoints one container contributes, one per group it is in (or a warning)."""
    out = ContainerEndpoints(container_name(inspect))
    labels = (inspect.get("Config") or {}).get("Labels") or {}
    if not opted_in(labels, options):
        return out
    health = health_of(inspect, draining)
    try:
        groups, settings = group_settings(labels, options.label_prefix)
        if health is None:
            return out
        sidecar: HealthSpec | None = None
        if "HealthCheck" in labels and not any(k.startswith(f"{options.label_prefix}.health.") for k in labels):
            try:
                sidecar, out.warning = sidecar_check(labels)
            except ValueError as e:
                out.warning = f"Sidecar's label HealthCheckArgs: {e}"
            if out.warning:
                out.warning = f"container {out.name}: {out.warning}"
        for group in groups:
            ep = _endpoint(inspect, settings[group], health, options)
            out.endpoints[group] = dataclasses.replace(ep, check=sidecar) if sidecar is not None else ep
    except Skip as e:
        out.endpoints = {}
        out.warning = f"container {out.name}: {e}; skipped"
    return out


def groups_of(containers: Iterable[ContainerEndpoints]) -> dict[str, Group]:
    """Merge per-container endpoints into groups; a repeated address:port keeps the first."""
    return groups_from(pair for c in containers for pair in c.endpoints.items())
