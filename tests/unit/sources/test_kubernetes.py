"""The Kubernetes source's bookkeeping (events, relists, publishing), without an API server.

The real list+watch against kube-apiserver is in e2e/kubernetes/test_kubernetes_real.py; this pins the state rules.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eds_server.encode import encode_group
from eds_server.model import Health, Locality
from eds_server.sources.kubernetes import KubernetesSource
from eds_server.sources.kubernetes_api import NODES, SERVICES, SLICES
from eds_server.sources.kubernetes_config import ConfigProblem, make_client
from eds_server.sources.kubernetes_map import KubernetesOptions
from eds_server.store import Store
from tests.support.feeds import alone
from tests.support.paths import DATA
from tests.support.waiting import wait_for

DATA = DATA / "kubernetes"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    return data


def source(namespaces: tuple[str, ...] = ()) -> tuple[Store, KubernetesSource]:
    store = Store(encode_group)
    return store, alone(KubernetesSource, store, KubernetesOptions(namespaces=namespaces))


def addresses(store: Store, group: str) -> dict[str, Health]:
    res = store.resources().get(group)
    return {ep.address: ep.health for ep in res.group.endpoints} if res else {}


def test_nothing_served_before_every_kind_is_listed() -> None:
    store, src = source()
    src.replace(SERVICES, None, [load("service")])
    assert not src.loaded and not store.ready
    src.replace(SLICES, None, [load("slice-ipv4")])
    assert src.loaded
    src.publish()
    assert store.ready
    assert addresses(store, "web") == {
        "127.0.0.2": Health.HEALTHY,
        "127.0.0.3": Health.DRAINING,
        "127.0.0.6": Health.HEALTHY,
    }


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
    assert len(src.view.slices) == 2
    src.replace(SLICES, "shop", [])
    src.publish()
    assert list(src.view.slices) == ["other/web-x7k2p"]
    assert set(addresses(store, "web")) == {"127.0.0.2", "127.0.0.3", "127.0.0.6"}


def test_unchanged_events_do_not_remap() -> None:
    _, src = source()
    src.replace(SERVICES, None, [load("service")])
    src.replace(SLICES, None, [load("slice-ipv4")])
    src.publish()
    resent = load("slice-ipv4")
    resent["metadata"]["resourceVersion"] = "2000"  # a new version with the same content
    src.apply(SLICES, "MODIFIED", resent)
    assert not src.view.dirty


def test_node_regions() -> None:
    store = Store(encode_group)
    src = alone(KubernetesSource, store, KubernetesOptions(node_regions=True))
    assert (NODES, None) in src.scopes
    node = {"metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/region": "eu-west"}}}
    src.replace(SERVICES, None, [load("service")])
    src.replace(SLICES, None, [load("slice-ipv4")])
    src.replace(NODES, None, [node, {"metadata": {"name": "node-b", "labels": None}}])
    src.publish()
    localities = {ep.address: ep.locality for ep in store.resources()["web"].group.endpoints}
    assert localities["127.0.0.2"] == Locality("eu-west", "zone-a")  # on node-a
    assert localities["127.0.0.6"] == Locality()  # no nodeName
    src.apply(NODES, "MODIFIED", {**node, "status": {"conditions": []}})  # a heartbeat: nothing to do
    assert not src.view.dirty
    src.replace(NODES, None, [])  # node-a gone: its region with it
    src.publish()
    assert store.resources()["web"].group.endpoints[0].locality == Locality("", "zone-a")


def test_a_missing_kubeconfig_stops_the_start(tmp_path: Path) -> None:
    missing = tmp_path / "nope.kubeconfig"
    cmd = [
        sys.executable,
        "-m",
        "eds_server",
        "serve",
        "--kubernetes",
        "--kubeconfig",
        str(missing),
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "off",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"not starting: --kubeconfig {missing}: no such file" in out.stderr


def _kubeconfig(ca: str | None = None) -> str:
    cluster: dict[str, Any] = {"server": "https://127.0.0.1:1"}
    if ca is not None:
        cluster["certificate-authority"] = ca
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "c",
            "clusters": [{"name": "c", "cluster": cluster}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        }
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "apiVersion: v1\nclusters: [\n  - name: x\n   bad: : :\n",
            r"kubeconfig:3:3: not YAML: expected the node content",
        ),
        (_kubeconfig(ca="/nonexistent/ca.crt"), r"kubeconfig names a file that does not exist: /nonexistent/ca.crt$"),
        ("", r"kubeconfig: not a kubeconfig \(empty"),
        (None, r"kubeconfig: no such file$"),
    ],
)
async def test_configuration_errors_are_named_in_one_line(tmp_path: Path, text: str | None, said: str) -> None:
    path = tmp_path / "kubeconfig"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigProblem) as caught:
        await make_client(KubernetesOptions(kubeconfig=str(path)))
    assert "\n" not in str(caught.value) and re.search(said, str(caught.value)), str(caught.value)


async def test_a_configuration_error_is_said_once_as_such_not_blamed_on_the_api_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(_kubeconfig(ca=str(tmp_path / "ca.crt")))
    store = Store(encode_group)
    src = alone(
        KubernetesSource, store, KubernetesOptions(kubeconfig=str(path)), backoff=(0.01, 0.05), probe_every=0.05
    )
    stop = asyncio.Event()
    caplog.set_level(logging.INFO, "eds_server")
    attempts = 0

    async def counted(options: KubernetesOptions) -> Any:
        nonlocal attempts
        attempts += 1
        return await make_client(options)

    monkeypatch.setattr("eds_server.sources.kubernetes_config.make_client", counted)
    task = asyncio.create_task(src.run(stop))
    await wait_for(lambda: attempts, lambda n: n >= 10, timeout=10, what="many attempts")
    stop.set()
    await asyncio.wait_for(task, 5)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1, said
    assert said[0].startswith(f"kubernetes: configuration error: {path} names a file that does not exist: ")
    assert "unreachable" not in said[0] and "API server" not in said[0] and "\n" not in said[0]
    assert src.status().last_error == said[0].split("; ")[0].removeprefix("kubernetes: ")


def test_kubernetes_without_any_configuration_outside_a_cluster_stops_the_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    cmd = [sys.executable, "-m", "eds_server", "serve", "--kubernetes", "--listen", "127.0.0.1:0", "--admin", "off"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(lines) == 1 and "not starting: --kubernetes: no Kubernetes configuration: not in a cluster" in lines[0]
    assert f"no {tmp_path}/.kube/config" in lines[0]


async def test_reloads_after_refused_credentials_are_said_now_and_then(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 401 that lasts loads the configuration again every 10 s: said once, not every time."""
    path = tmp_path / "kubeconfig"
    path.write_text(_kubeconfig())
    src = alone(KubernetesSource, Store(encode_group), KubernetesOptions(kubeconfig=str(path)))
    caplog.set_level(logging.INFO, "eds_server")
    try:
        for _ in range(5):
            src.config.loaded_at = -1000.0  # as if 10 s had passed since the last load
            await src.config.reload()
        assert src.loads == 5
    finally:
        await src.config.close()
    said = [r.getMessage() for r in caplog.records if "configuration loaded again" in r.getMessage()]
    assert said == ["kubernetes: configuration loaded again (the credentials were refused); watches resume with it"]
