"""Tests run on uvloop, the loop the server runs on in production."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import uvloop

pytest_plugins = ["docker_engine"]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    return {"uvloop": uvloop.new_event_loop}
