"""Handing the C heap's free memory back to the operating system after a burst of new streams.

Every new Envoy stream's first request carries its Node (tens of kilobytes), and a fleet that
reconnects at once has thousands of them in buffers together. Python frees them, but glibc keeps the
freed heap pages: measured at 10,000 streams, about 28 KB per stream of RSS was such free heap,
more than the streams themselves hold (about 23 KB each). `malloc_trim(0)` returns it. It runs in
a worker thread (ctypes drops the GIL), once a burst is over.
Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger("eds_server.heap")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, from the C library this process already has loaded (no lookup by name,
    which runs ldconfig); None where there is none."""
    with contextlib.suppress(OSError, AttributeError):
        trim = ctypes.CDLL(None).malloc_trim
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return trim
    return None


_TRIM = _malloc_trim()  # once per process


class HeapTrim:
    """Trims the heap once a burst of at least `after` new streams (counted as their first requests,
    Node and all, have been read and dropped) has been quiet for `delay` seconds
    (or has gone on for `most` seconds: a steady trickle still gets trimmed now and then)."""

    def __init__(self, after: int = 16, delay: float = 0.5, most: float = 10.0) -> None:
        self.after = after
        self.delay = delay
        self.most = most
        self.opened = 0  # first requests read since the last trim
        self.trims = 0
        self._trim = _TRIM
        self._timer: asyncio.TimerHandle | None = None
        self._first = self._last = 0.0  # when the burst's first and latest streams opened
        self._running: asyncio.Future[int] | None = None
        self._long_burst = False

    @property
    def available(self) -> bool:
        return self._trim is not None

    @property
    def trimming(self) -> bool:
        """A trim runs in a worker thread now: the next one waits for it (and so does a test)."""
        return self._running is not None and not self._running.done()

    def first_request_read(self) -> None:
        if self._trim is None:
            return
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        self.opened += 1
        if self.opened == 1:
            self._first = self._last
        if self._timer is None and (self.opened >= self.after or self._long_burst):
            self._timer = loop.call_later(self.delay, self._due)

    def _due(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        quiet_at = self._last + self.delay
        running = self.trimming
        if running or (quiet_at > now and now - self._first < self.most):
            self._timer = loop.call_at(now + self.delay if running else quiet_at, self._due)
            return  # still opening streams (or trimming): wait for the end
        self._timer = None
        self._long_burst = quiet_at > now  # trimmed while it goes on: trim again when it ends
        self.opened = 0
        self.trims += 1
        self._running = loop.run_in_executor(None, self._trim, 0)  # type: ignore[arg-type]

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
