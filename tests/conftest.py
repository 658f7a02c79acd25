"""Every shared fixture is registered here, once, and every test gets the markers of its folder.

Tests run on uvloop, the loop the server runs on in production. The map of the tree is
tests/README.md.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import uvloop

from tests.support import markers
from tests.support.grpc_harness import Harness, grpc_harness

# dockerd fixtures: docker_engine, docker_cleanup, swarm_engine, swarm, swarm_pair
pytest_plugins = ["tests.support.docker_engine"]

TESTS = Path(__file__).resolve().parent

# What a folder's tests need beyond Python, as markers: `make test-fast` deselects these. A test
# elsewhere that needs one of them carries the marker itself (a real-Envoy test in unit/test_security.py).
FOLDER_MARKERS: dict[str, tuple[str, ...]] = {
    "e2e/envoy": ("envoy",),
    "e2e/docker": ("docker",),
    "e2e/kubernetes": ("kubernetes", "envoy"),
    "e2e/etcd": ("etcd",),
    "e2e/browser": ("browser", "envoy"),
    "hostile": ("hostile", "alone"),
}
DOCKER_FIXTURES = {"docker_engine", "docker_cleanup", "swarm_engine", "swarm", "swarm_pair"}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    return {"uvloop": uvloop.new_event_loop}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers by folder; and with EDS_HTTP2=stock (CI's second pass over the gRPC and Envoy tests),
    tests of what only the fast HTTP/2 path does (its limits, its direct reads) are skipped, saying so."""
    for item in items:
        folder = item.path.parent.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        for prefix, names in FOLDER_MARKERS.items():
            if folder == prefix or folder.startswith(prefix + "/"):
                for name in names:
                    item.add_marker(name)
        if DOCKER_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("docker"):
            raise pytest.UsageError(f"{item.nodeid} uses a Docker engine without the `docker` marker")
        if DOCKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            # Under `pytest -n` (`make test`), the tests of the shared engines run in one worker: one
            # private dockerd for them all, and no two swarms on this machine's ports at once. (The
            # compose test starts an engine of its own.)
            item.add_marker(pytest.mark.xdist_group("docker"))
    if os.environ.get("EDS_HTTP2") != "stock":
        return
    skip = pytest.mark.skip(reason="tests the fast HTTP/2 path (EDS_HTTP2=stock runs the stock one)")
    for item in items:
        if item.get_closest_marker("fast_path"):
            item.add_marker(skip)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    """The gRPC service in-process on a loopback port, with a grpclib channel to it."""
    async with grpc_harness() as h:
        yield h


@pytest.fixture(autouse=True)
def _running_markers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Lets support/ helpers check that a test starting Envoy says so (support/markers.py)."""
    markers.running = frozenset(m.name for m in request.node.iter_markers())
    yield
    markers.running = None
