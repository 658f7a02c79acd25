"""Waiting, bounded, for a condition the server reaches on its own time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until(check: Callable[[], object], timeout: float = 3.0, what: str = "") -> None:
    """Poll `check()` every 10 ms until it holds; AssertionError after `timeout` seconds."""
    for _ in range(max(1, int(timeout / 0.01))):  # bounded
        if check():
            return
        await asyncio.sleep(0.01)
    assert check(), what or "condition not reached in time"
