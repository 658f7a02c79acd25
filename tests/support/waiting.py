"""Waiting for what happens on its own time (a server, Envoy, an engine, a file), never for a fixed
while: a sleep long enough on a loaded machine is too long everywhere else, and a failure after one
names nothing. Every wait here is bounded twice, by `timeout` and by a count of rounds, and says on
failure what it waited for and what it saw last.

`wait_for` is for code on the event loop; `wait_for_blocking` for code that is not (session fixtures
that start an engine, threads).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp

T = TypeVar("T")

# What a probe raises while the thing it asks is not up yet: "not yet", not a failure.
NOT_YET: tuple[type[BaseException], ...] = (OSError, TimeoutError, aiohttp.ClientError)


def _rounds(timeout: float, interval: float) -> int:
    return max(1, math.ceil(timeout / interval)) + 1


def _failure(what: str, timeout: float, last: object) -> AssertionError:
    return AssertionError(f"{what or 'condition'} not reached in {timeout}s; last observed: {last!r}")


async def wait_for(
    probe: Callable[[], T | Awaitable[T]],
    check: Callable[[T], object] = bool,
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "",
    retry: tuple[type[BaseException], ...] = NOT_YET,
) -> T:
    """Call `probe()` (plain or async) every `interval` until `check(value)` holds; return that value.

    An exception in `retry` counts as "not yet"; an awaited probe gets at most max(interval, 2 s)
    per round. AssertionError after `timeout` seconds, with the last value (or exception) seen.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: object = "<never probed>"
    for _ in range(_rounds(timeout, interval)):
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, timeout=max(interval, 2.0))
        except retry as exc:
            last = exc
        else:
            if check(value):  # type: ignore[arg-type]
                return value  # type: ignore[return-value]
            last = value
        if loop.time() >= deadline:
            break
        await asyncio.sleep(interval)
    raise _failure(what, timeout, last)


async def loop_past(when: float) -> None:
    """Until the event loop's clock has passed `when` (a `loop.time()`) and every callback timed for
    then or earlier has run: the loop runs its timers in the order of their deadlines, this one
    among them. For "a timer due by then did (or did not) fire", without guessing a margin."""
    loop = asyncio.get_running_loop()
    reached = asyncio.Event()
    loop.call_at(when, reached.set)
    await reached.wait()


def wait_for_blocking(
    probe: Callable[[], T],
    check: Callable[[T], object] = bool,
    *,
    timeout: float = 15.0,
    interval: float = 0.1,
    what: str = "",
    retry: tuple[type[BaseException], ...] = NOT_YET,
) -> T:
    """`wait_for` for code off the event loop: the same bounds, sleeping in this thread."""
    deadline = time.monotonic() + timeout
    last: object = "<never probed>"
    for _ in range(_rounds(timeout, interval)):
        try:
            value = probe()
        except retry as exc:
            last = exc
        else:
            if check(value):
                return value
            last = value
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    raise _failure(what, timeout, last)
