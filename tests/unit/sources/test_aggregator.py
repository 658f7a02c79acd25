"""The aggregator: the one way sources reach the store, in the App's merge order."""

from __future__ import annotations

from pathlib import Path

import pytest

from eds_server.app import MERGE_ORDER, App
from eds_server.encode import encode_group
from eds_server.model import Endpoint, Group
from eds_server.settings import AdminSettings, RegistrationSettings, Settings, SourceSettings
from eds_server.sources.aggregator import Aggregator
from eds_server.sources.containers import DockerOptions
from eds_server.store import Store

WEB_FIRST = Group("web", (Endpoint("10.0.0.1", 80, weight=5),))
WEB_SECOND = Group("web", (Endpoint("10.0.0.1", 80, weight=9), Endpoint("10.0.0.2", 80)))


def test_the_declared_order_merges_whoever_publishes_first() -> None:
    store = Store(encode_group)
    feed = Aggregator(store)
    feed.declare(["file", "registrations"])
    feed.publish("registrations", {"web": WEB_SECOND})  # the later source publishes first
    assert not feed.serving and feed.loaded("registrations") and not feed.loaded("file")
    feed.publish("file", {"web": WEB_FIRST})
    assert feed.serving
    assert store.sources_of("web") == ["file", "registrations"]
    weights = {ep.address: ep.weight for ep in store.get("web").group.endpoints}
    assert weights == {"10.0.0.1": 5, "10.0.0.2": None}  # the duplicate address: the first declared wins


def test_sources_are_declared_once_and_an_undeclared_one_is_not_loaded() -> None:
    feed = Aggregator(Store(encode_group))
    assert not feed.loaded("docker")
    feed.declare(["docker"])
    with pytest.raises(ValueError, match="already declared"):
        feed.declare(["file"])
    with pytest.raises(KeyError):
        feed.publish("file", {})


def test_stale_marking_goes_through_the_feed() -> None:
    store = Store(encode_group)
    feed = Aggregator(store)
    feed.declare(["docker"])
    feed.publish("docker", {"web": WEB_FIRST})
    feed.mark_stale("docker", True)
    assert store.is_stale("web")
    feed.mark_stale("docker", False)
    assert not store.is_stale("web")


async def test_the_app_declares_its_sources_in_merge_order_not_construction_order(tmp_path: Path) -> None:
    assert MERGE_ORDER == ("file", "docker", "swarm", "kubernetes", "registrations", "relay")
    upstreams = tmp_path / "upstreams.yaml"
    upstreams.write_text("groups: {}\n")
    sources = SourceSettings(upstreams=str(upstreams), docker=DockerOptions(), swarm=DockerOptions())
    app = App(
        Settings(
            sources=sources, registrations=RegistrationSettings(admin_token="t" * 32), admin=AdminSettings(address=None)
        )
    )
    names = [s.name for s in app.sources]
    assert names == [f"file:{upstreams}", "docker", "swarm", "registrations"]
    assert app.aggregator.order == tuple(names) and app.store.pending_sources == tuple(names)
