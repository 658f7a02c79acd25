"""The Kubernetes source's bookkeeping (events, relists, publishing), without an API server.

The real list+watch against kube-apiserver is in e2e/kubernetes/test_kubernetes_real.py; this pins the state rules.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from eds_server.encode import encode_group
from eds_server.model import Health, Locality
from eds_server.sources.kubernetes import NODES, SERVICES, SLICES, KubernetesSource
from eds_server.sources.kubernetes_map import KubernetesOptions
from eds_server.store import Store
from tests.support.paths import DATA

DATA = DATA / "kubernetes"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    return data


def source(namespaces: tuple[str, ...] = ()) -> tuple[Store, KubernetesSource]:
    store = Store(encode_group)
    return store, KubernetesSource(store, KubernetesOptions(namespaces=namespaces))


def addresses(store: Store, group: str) -> dict[str, Health]:
    res = store.resources().get(group)
    return {ep.address: ep.health for ep in res.group.endpoints} if res else {}


def test_nothing_served_before_every_kind_is_listed() -> None:
    store, src = source()
    src.replace(SERVICES, None, [load("service")])
    src._listed.add((SERVICES, None))
    assert not src.loaded and not store.ready
    src.replace(SLICES, None, [load("slice-ipv4")])
    src._listed.add((SLICES, None))
    assert src.loaded
    src.publish()
    assert store.ready
    assert addresses(store, "web") == {"127.0.0.2": Health.HEALTHY, "127.0.0.3": Health.DRAINING,
                                       "127.0.0.6": Health.HEALTHY}  # fmt: skip


def test_events_and_relist() -> None:
    store, src = source()
    src.replace(SERVICES, None, [load("service")])
    src.replace(SLICES, None, [load("slice-ipv4")])
    src.publish()
    # a slice event: the terminating endpoint goes
    changed = copy.deepcopy(load("slice-ipv4"))
    changed["endpoints"] = changed["endpoints"][:1]
    src.apply(SLICES, "MODIFIED", changed)
    src.publish()
    assert addresses(store, "web") == {"127.0.0.2": Health.HEALTHY}
    # the annotation is removed: the Service is no longer served
    plain = load("service")
    plain["metadata"]["annotations"] = {}
    src.apply(SERVICES, "MODIFIED", plain)
    src.publish()
    assert "web" not in store.resources()
    # opting in again finds the slices kept meanwhile
    src.apply(SERVICES, "MODIFIED", load("service"))
    src.publish()
    assert addresses(store, "web") == {"127.0.0.2": Health.HEALTHY}
    # a relist that lacks the slice (deleted while the watch was away) empties the group
    src.replace(SLICES, None, [])
    src.publish()
    assert addresses(store, "web") == {}
    # Service deleted: its groups go
    src.apply(SERVICES, "DELETED", load("service"))
    src.publish()
    assert "web" not in store.resources()


def test_relist_of_one_namespace_keeps_the_others() -> None:
    store, src = source(("shop", "other"))
    other_svc, other_slice = load("service"), load("slice-ipv4")
    other_svc["metadata"]["namespace"] = other_slice["metadata"]["namespace"] = "other"
    src.replace(SERVICES, "shop", [load("service")])
    src.replace(SERVICES, "other", [other_svc])
    src.replace(SLICES, "shop", [load("slice-ipv4")])
    src.replace(SLICES, "other", [other_slice])
    src.publish()
    assert len(src._slices) == 2
    src.replace(SLICES, "shop", [])
    src.publish()
    assert list(src._slices) == ["other/web-x7k2p"]
    assert set(addresses(store, "web")) == {"127.0.0.2", "127.0.0.3", "127.0.0.6"}


def test_unchanged_events_do_not_remap() -> None:
    _, src = source()
    src.replace(SERVICES, None, [load("service")])
    src.replace(SLICES, None, [load("slice-ipv4")])
    src.publish()
    resent = load("slice-ipv4")
    resent["metadata"]["resourceVersion"] = "2000"  # a new version with the same content
    src.apply(SLICES, "MODIFIED", resent)
    assert not src._dirty


def test_node_regions() -> None:
    store = Store(encode_group)
    src = KubernetesSource(store, KubernetesOptions(node_regions=True))
    assert (NODES, None) in src._scopes
    node = {"metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/region": "eu-west"}}}
    src.replace(SERVICES, None, [load("service")])
    src.replace(SLICES, None, [load("slice-ipv4")])
    src.replace(NODES, None, [node, {"metadata": {"name": "node-b", "labels": None}}])
    src.publish()
    localities = {ep.address: ep.locality for ep in store.resources()["web"].group.endpoints}
    assert localities["127.0.0.2"] == Locality("eu-west", "zone-a")  # on node-a
    assert localities["127.0.0.6"] == Locality()  # no nodeName
    src.apply(NODES, "MODIFIED", {**node, "status": {"conditions": []}})  # a heartbeat: nothing to do
    assert not src._dirty
    src.replace(NODES, None, [])  # node-a gone: its region with it
    src.publish()
    assert store.resources()["web"].group.endpoints[0].locality == Locality("", "zone-a")


def test_a_missing_kubeconfig_stops_the_start(tmp_path: Path) -> None:
    missing = tmp_path / "nope.kubeconfig"
    cmd = [sys.executable, "-m", "eds_server", "serve", "--kubernetes", "--kubeconfig", str(missing),
           "--listen", "127.0.0.1:0", "--admin", "off"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"not starting: --kubeconfig {missing}: no such file" in out.stderr
