"""Handing the C heap's free memory back to the operating system after a burst of new streams.

Every new Envoy stream's first request carries its Node (tens of kilobytes), and a fleet that
reconnects at once has thousands of them in buffers together. Python frees them, but glibc keeps the
freed heap pages: measured at 10,000 streams, about 28 KB per stream of RSS was such free heap,
more than the streams themselves hold (about 23 KB each). Streams ending in a burst (a fleet gone, an
attack's connections closed) leave the same behind: 100 connections of 100 streams closed left
72 MB of free heap resident. `malloc_trim(0)` returns it. It runs in a worker thread (ctypes drops
the GIL), once a burst is over. After streams have ended, with few left open, a full collection runs
first: it empties the interpreter's free lists, whose few hundred kept blocks each hold a 1 MiB arena
of Python's allocator (35 MB more came back after the same closes); walking what few streams remain
costs little, while a fleet of thousands is not walked for it. The event loop's own free lists
(uvloop's handles and timers, asyncio's future iterators), which no collection empties, hold the
objects freed last, one or a few in each of the burst's arenas: before collecting they are renewed
(`_take_free_lists`, under a millisecond). And the burst's addresses, forgotten seconds later
(`forgotten`), free their state into the interpreter's free lists: another such trim follows.
Measured (tests/hostile/test_memory.py, 10,000 streams closed): what stayed went from ~75 MB over the
start to ~30 MB (docs/limits.md). Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import time
from collections.abc import Callable

from . import gc_settings

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
COLLECT_BELOW = 1_000  # streams left open, at most, for a trim after streams ended to collect first
# At least what the event loop's free lists keep: uvloop 250 callback handles and 250 timer handles,
# asyncio's C futures 255 iterators (what `await future` makes).
FREE_LISTS = 256
RELEASE_AFTER = 0.01  # seconds: a loop iteration, whose end frees the timers cancelled (libuv closes them then)


def _noop() -> None:
    pass


def _take_free_lists(loop: asyncio.AbstractEventLoop) -> tuple[list[object], list[object]]:
    """What the event loop's free lists hold (`old`: the objects freed last, after a burst of streams
    ending one or a few in each of the burst's arenas), and as many new objects allocated together
    (`new`). Let go of `new` first, then `old`: the free lists keep `new`, `old` is freed."""
    old: list[object] = []
    new: list[object] = []
    future = loop.create_future()
    for held in (old, new):
        held += [loop.call_soon(_noop) for _ in range(FREE_LISTS)]
        timers = [loop.call_later(3600.0, _noop) for _ in range(FREE_LISTS)]
        for timer in timers:
            timer.cancel()
        held += timers
        held += [future.__await__() for _ in range(FREE_LISTS)]
    return old, new


class HeapTrim:
    """Trims the heap once a burst of at least `after` streams coming or going (a new one counted as
    its first request, Node and all, has been read and dropped) has been quiet for `delay` seconds
    (or has gone on for `most` seconds: a steady trickle still gets trimmed now and then)."""

    def __init__(
        self, after: int = 16, delay: float = 0.5, most: float = 10.0, live: Callable[[], int] | None = None
    ) -> None:
        """`live`: the streams open now, read when a trim is due (a collection walks them all)."""
        self.after = after
        self.live = live
        self.delay = delay
        self.most = most
        self.churned = 0  # streams come (first request read) or gone, and addresses forgotten, since the last trim
        self.trims = 0
        self._trim = _TRIM
        self._timer: asyncio.TimerHandle | None = None
        self._first = self._last = 0.0  # when the burst's first and latest streams opened
        self._running: asyncio.Future[int] | None = None
        self._long_burst = False
        self._ended = False  # a stream ended in this burst
        self._live = 0  # streams open after the latest one ended (when no `live` is given)
        self._stopped = False
        self._collecting: asyncio.TimerHandle | None = None  # a collection and trim, due once the loop lets go

    @property
    def available(self) -> bool:
        return self._trim is not None

    @property
    def trimming(self) -> bool:
        """A trim runs in a worker thread now: the next one waits for it (and so does a test)."""
        return self._collecting is not None or (self._running is not None and not self._running.done())

    def churn(self, live: int | None = None, count: int = 1) -> None:
        """A stream's first request was read, or (`live`: the streams still open) `count` streams ended."""
        if self._trim is None or self._stopped:
            return
        if live is not None:
            self._ended, self._live = True, live
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        if not self.churned:
            self._first = self._last
        self.churned += count
        if self._timer is None and (self.churned >= self.after or self._long_burst):
            self._timer = loop.call_later(self.delay, self._due)

    def forgotten(self, addresses: int) -> None:
        """Idle client addresses forgotten (seconds after their last connection closed): their state,
        allocated among their streams, is freed only now. However few (a burst's last stragglers), a
        trim collecting first follows once it is quiet: what each leaves in a free list keeps an arena."""
        self.churn(self._live, max(addresses, self.after))  # the count of streams open is read when due

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
        self.churned = 0
        self.trims += 1
        live = self.live() if self.live is not None else self._live  # now: streams opened since count
        collect, self._ended = self._ended and live <= COLLECT_BELOW, False
        if collect:
            self._collecting = loop.call_later(RELEASE_AFTER, self._collect, *_take_free_lists(loop))
            return
        self._running = loop.run_in_executor(None, self._trim, 0)  # type: ignore[arg-type]

    def _collect(self, old: list[object], new: list[object]) -> None:
        """The free lists renewed (see `_take_free_lists`), a full collection, then the trim."""
        self._collecting = None
        started = time.perf_counter()
        new.clear()
        old.clear()
        found = gc_settings.collect()  # the old objects, frozen, too
        log.debug("collected %d objects in %.1f ms before the trim", found, 1e3 * (time.perf_counter() - started))
        self._running = asyncio.get_running_loop().run_in_executor(None, self._trim, 0)  # type: ignore[arg-type]

    def stop(self) -> None:
        """No trim after this: the server is stopping (its executor may be gone)."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._collecting is not None:
            self._collecting.cancel()
            self._collecting = None
