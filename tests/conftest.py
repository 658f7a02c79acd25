"""Tests run on uvloop, the loop the server runs on in production."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest
import uvloop

pytest_plugins = ["docker_engine"]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    return {"uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With EDS_HTTP2=stock (CI's second pass over the gRPC and Envoy tests), tests of what only the
    fast HTTP/2 path does (its limits, its direct reads) are skipped, saying so."""
    if os.environ.get("EDS_HTTP2") != "stock":
        return
    skip = pytest.mark.skip(reason="tests the fast HTTP/2 path (EDS_HTTP2=stock runs the stock one)")
    for item in items:
        if item.get_closest_marker("fast_path"):
            item.add_marker(skip)
