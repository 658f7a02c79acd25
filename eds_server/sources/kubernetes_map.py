"""Kubernetes Services + EndpointSlices -> endpoints, from API JSON alone.

No IO here, so every rule (annotations, port choice, endpoint conditions, address types) is
unit-tested from recorded API objects. Annotations are parsed by the Docker label code
(`containers.group_settings`), so `eds.group`, `eds.<key>` and `eds.<group>.<key>` mean the same in both.

Conditions (discovery.k8s.io/v1; a missing `ready`/`serving` means true, a missing `terminating` false):
- not terminating and ready                 -> HEALTHY
- terminating and serving                   -> DRAINING (until the endpoint leaves its slice)
- not ready, or terminating and not serving -> left out: Kubernetes itself sends such a Pod no
  traffic, and an UNHEALTHY host would count towards Envoy's panic threshold, where Envoy routes to
  every host, unready ones included (a rollout of many new Pods would do that).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import fields
from ..model import Endpoint, Group, Health, groups_from, locality
from .containers import Skip, group_settings

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
REGION_LABEL = "topology.kubernetes.io/region"
# What an annotation may set; eds.port names a Service port, so it is checked against the Service.
SETTING_KEYS = ("port", "weight", "priority")
_CHECKS: dict[str, Any] = {"port": fields.text, "weight": fields.weight, "priority": fields.priority}
_HEALTH_ORDER = {Health.HEALTHY: 0, Health.DRAINING: 1}


@dataclass(frozen=True)
class KubernetesOptions:
    annotation_prefix: str = "eds"
    namespaces: tuple[str, ...] = ()  # empty: every namespace (a cluster-wide watch)
    kubeconfig: str | None = None  # None: KUBECONFIG, in-cluster, then ~/.kube/config
    node_regions: bool = False  # read Nodes for topology.kubernetes.io/region (needs list/watch on nodes)


@dataclass
class ServiceEndpoints:
    """What one Service contributes: (group, endpoint) pairs, and warnings keyed by object."""

    key: str  # namespace/name
    pairs: list[tuple[str, Endpoint]] = field(default_factory=list)
    warnings: dict[str, str] = field(default_factory=dict)


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def annotations_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def opted_in(service: Mapping[str, Any], prefix: str) -> bool:
    return f"{prefix}.group" in annotations_of(service)


def slice_service(slice_: Mapping[str, Any]) -> str | None:
    """namespace/name of the Service a slice belongs to (None: not a Service's slice)."""
    meta = slice_.get("metadata") or {}
    name = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    return f"{meta.get('namespace', '')}/{name}" if name else None


def health_of(conditions: Mapping[str, Any] | None) -> Health | None:
    """An endpoint's health from its conditions; None: leave it out (see the module docstring)."""
    c = conditions or {}
    ready, serving = c.get("ready") is not False, c.get("serving") is not False
    if c.get("terminating") is True:
        return Health.DRAINING if serving else None
    return Health.HEALTHY if ready else None


def port_name(service: Mapping[str, Any], wanted: str | None, prefix: str) -> str:
    """The name of the Service port to serve (slices carry ports by the Service port's name)."""
    ports = (service.get("spec") or {}).get("ports") or []
    if wanted is None:
        if len(ports) == 1:
            return str(ports[0].get("name") or "")
        if not ports:
            raise Skip("has no ports")
        names = ", ".join(str(p.get("name") or p.get("port")) for p in ports)
        raise Skip(f"has several ports ({names}): set annotation {prefix}.port")
    for p in ports:
        if wanted == str(p.get("name") or "") or wanted == str(p.get("port")):
            return str(p.get("name") or "")
    names = ", ".join(str(p.get("name") or p.get("port")) for p in ports) or "none"
    raise Skip(f"annotation {prefix}.port: {wanted!r} is not one of its ports ({names})")


def slice_endpoints(
    slice_: Mapping[str, Any], port: str, settings: Mapping[str, Any], regions: Mapping[str, str] | None = None
) -> tuple[list[Endpoint], str | None]:
    """The endpoints of one slice for one group's settings, and a warning (or None)."""
    kind = slice_.get("addressType")
    where = f"EndpointSlice {object_key(slice_)}"
    if kind not in ("IPv4", "IPv6"):
        return [], f"{where}: addressType {kind} is not served (Envoy needs IP addresses in EDS); skipped"
    number = next((p.get("port") for p in slice_.get("ports") or [] if str(p.get("name") or "") == port), None)
    if number is None:
        return [], None  # the controller has not filled the port yet, or the port has no endpoints
    out, bad = [], []
    # the same for every endpoint of the slice
    weight, priority, regions = settings.get("weight"), settings.get("priority", 0), regions or {}
    metadata = {k[len("metadata.") :]: v for k, v in settings.items() if k.startswith("metadata.")}
    for e in slice_.get("endpoints") or []:
        health = health_of(e.get("conditions"))
        addresses = e.get("addresses") or []
        if health is None or not addresses:
            continue
        ref = e.get("targetRef") or {}
        try:
            address = fields.ip(addresses[0])  # the API says they are fungible: the first is enough
        except ValueError:
            bad.append(str(addresses[0]))
            continue
        out.append(
            Endpoint(
                address=address,
                port=int(number),
                weight=weight,
                health=health,
                priority=priority,
                locality=locality(str(regions.get(e.get("nodeName") or "", "")), str(e.get("zone") or "")),
                hostname=str(e.get("hostname") or (ref.get("name") if ref.get("kind") == "Pod" else "") or ""),
                metadata=metadata,
                check=settings.get("check"),
            )
        )
    warning = f"{where}: {len(bad)} addresses are not IPs ({', '.join(bad[:3])}); skipped" if bad else None
    return out, warning


def service_endpoints(
    service: Mapping[str, Any],
    slices: Iterable[Mapping[str, Any]],
    prefix: str,
    regions: Mapping[str, str] | None = None,
) -> ServiceEndpoints:
    """One opted-in Service's endpoints, per group; an invalid annotation skips the whole Service.

    `regions`: node name -> its topology.kubernetes.io/region, when Nodes are read."""
    key = object_key(service)
    out = ServiceEndpoints(key)
    try:
        groups, settings = group_settings(
            annotations_of(service), prefix, keys=SETTING_KEYS, checks=_CHECKS, what="annotation"
        )
        ports = {g: port_name(service, settings[g].get("port"), prefix) for g in groups}
    except Skip as e:
        out.warnings[f"Service {key}"] = f"Service {key}: {e}; skipped"
        return out
    slices = sorted(slices, key=object_key)
    for group in groups:
        eps: list[Endpoint] = []
        for s in slices:
            found, warning = slice_endpoints(s, ports[group], settings[group], regions)
            eps.extend(found)
            if warning:
                out.warnings[f"EndpointSlice {object_key(s)}"] = warning
        # An endpoint may sit in two slices for a moment while the controller moves it: keep its
        # healthiest form.
        eps.sort(key=lambda ep: _HEALTH_ORDER.get(ep.health, 2))
        unique: dict[tuple[str, int], Endpoint] = {}
        for ep in eps:
            unique.setdefault(ep.key, ep)
        out.pairs.extend((group, ep) for ep in unique.values())
    return out


def groups_of(services: Iterable[ServiceEndpoints]) -> dict[str, Group]:
    """Merge per-Service endpoints into groups (several Services may feed one group)."""
    return groups_from(pair for s in services for pair in s.pairs)


def trim_slice(slice_: Mapping[str, Any]) -> dict[str, Any]:
    """Only what the mapping reads: a cluster's slices are kept in memory, so keep them small."""
    meta = slice_.get("metadata") or {}
    return {
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "labels": {SERVICE_NAME_LABEL: (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)},
        },
        "addressType": slice_.get("addressType"),
        "ports": [{"name": p.get("name"), "port": p.get("port")} for p in slice_.get("ports") or []],
        "endpoints": [
            {
                "addresses": (e.get("addresses") or [])[:1],
                "conditions": e.get("conditions") or {},
                "hostname": e.get("hostname"),
                "targetRef": {
                    "kind": (e.get("targetRef") or {}).get("kind"),
                    "name": (e.get("targetRef") or {}).get("name"),
                },
                "zone": e.get("zone"),
                "nodeName": e.get("nodeName"),
            }
            for e in slice_.get("endpoints") or []
        ],
    }


def trim_service(service: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Only our annotations (not, say, kubectl's last-applied-configuration) and the ports."""
    meta = service.get("metadata") or {}
    ours = {k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(prefix + ".")}
    return {
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "annotations": ours},
        "spec": {
            "ports": [
                {"name": p.get("name"), "port": p.get("port")} for p in (service.get("spec") or {}).get("ports") or []
            ]
        },
    }


class ClusterView:
    """What the watches have read of the cluster, and the groups it maps to: the mapper's half of
    the Kubernetes source, with no IO (the watcher, `kubernetes.KubernetesSource`, lists and
    watches and hands every object here). Kinds are named by their plural: "services",
    "endpointslices", "nodes". Only the Services an object touched are mapped again."""

    def __init__(self, annotation_prefix: str) -> None:
        self.prefix = annotation_prefix
        self.services: dict[str, dict[str, Any]] = {}  # namespace/name -> trimmed, opted-in Service
        self.slices: dict[str, dict[str, Any]] = {}  # namespace/name -> trimmed EndpointSlice
        self.regions: dict[str, str] = {}  # node name -> region (with node regions)
        self.dirty: set[str] = set()  # Service keys to map again
        self._slices_of: dict[str, set[str]] = {}  # Service key -> its slices' keys
        self._mapped: dict[str, ServiceEndpoints] = {}  # Service key -> what it contributes

    def _set_service(self, obj: Mapping[str, Any] | None, key: str) -> None:
        if obj is not None and opted_in(obj, self.prefix):
            trimmed = trim_service(obj, self.prefix)
            if self.services.get(key) != trimmed:
                self.services[key] = trimmed
                self.dirty.add(key)
        elif self.services.pop(key, None) is not None:
            self.dirty.add(key)

    def _set_slice(self, obj: Mapping[str, Any] | None, key: str) -> None:
        trimmed = trim_slice(obj) if obj is not None else None
        old = self.slices.get(key)
        if trimmed == old:
            return  # a new resourceVersion of the same content (or nothing known of it)
        if old is not None:
            del self.slices[key]
            owner = slice_service(old)
            if owner is not None:
                siblings = self._slices_of.get(owner, set())
                siblings.discard(key)
                if not siblings:
                    self._slices_of.pop(owner, None)
                self.dirty.add(owner)
        owner = slice_service(trimmed) if trimmed is not None else None
        if trimmed is not None and owner is not None:
            self.slices[key] = trimmed
            self._slices_of.setdefault(owner, set()).add(key)
            self.dirty.add(owner)

    def _set_node(self, obj: Mapping[str, Any] | None, key: str) -> None:
        name = key.lstrip("/")
        region = str(((((obj or {}).get("metadata") or {}).get("labels")) or {}).get(REGION_LABEL) or "")
        if self.regions.get(name, "") == region:
            return  # most Node updates are status heartbeats: nothing for us
        if region:
            self.regions[name] = region
        else:
            self.regions.pop(name, None)
        self.dirty.update(self.services)  # rare: map every Service again

    def _setter(self, kind: str) -> Callable[[Mapping[str, Any] | None, str], None]:
        if kind == "services":
            return self._set_service
        return self._set_slice if kind == "endpointslices" else self._set_node

    def apply(self, kind: str, event_type: str, obj: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED)."""
        self._setter(kind)(None if event_type == "DELETED" else obj, object_key(obj))

    def replace(self, kind: str, namespace: str | None, items: list[Mapping[str, Any]]) -> None:
        """A full listing of one kind in one namespace (None: all): what it lacks is gone."""
        known: Iterable[str]
        if kind == "services":
            known = self.services
        elif kind == "endpointslices":
            known = self.slices
        else:
            known = [f"/{n}" for n in self.regions]
        setter = self._setter(kind)
        listed = {object_key(o): o for o in items}
        in_scope = [k for k in known if namespace is None or k.startswith(namespace + "/")]
        for key in [k for k in in_scope if k not in listed]:
            setter(None, key)
        for key, obj in listed.items():
            setter(obj, key)

    def groups(self) -> tuple[dict[str, Group], dict[str, str]]:
        """Map the Services that changed again: every group, and the warnings per object."""
        dirty, self.dirty = self.dirty, set()
        for key in dirty:
            svc = self.services.get(key)
            if svc is None:
                self._mapped.pop(key, None)
                continue
            slices = [self.slices[k] for k in self._slices_of.get(key, ()) if k in self.slices]
            self._mapped[key] = service_endpoints(svc, slices, self.prefix, self.regions)
        warnings: dict[str, str] = {}
        for entry in self._mapped.values():
            warnings.update(entry.warnings)
        return groups_of(self._mapped[k] for k in sorted(self._mapped)), warnings
