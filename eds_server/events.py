"""An event and a queue of asyncio's interfaces that cost a tenth of their memory while idle.

asyncio's Event makes its waiters' deque up front: 857 bytes an Event (tracemalloc), and each open
stream holds several that are seldom or never waited on (grpclib's window, headers and trailers
events, a session's wake-up). asyncio's Queue makes three deques and an Event: 2.7 KB, and grpclib
gives every stream one for its incoming data, which the fast path's streams mostly read past
(transport/h2/direct.py). These keep their lists only while something is in them: about 100 bytes.
Same behaviour: `wait()` returns True once set (at once if set already), `set()` wakes every waiter,
`clear()` lets the next `wait()` block; the queue is unbounded, first in first out, and a `get()`
cancelled after a `put_nowait()` woke it passes the wake-up on, as asyncio's does.

And `NO_CONTEXT`, for a done callback that reads no context variable: asyncio otherwise keeps a
copy of the current context with each callback, one more object a stream for as long as it waits.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

NO_CONTEXT = contextvars.Context()  # empty, shared: callbacks given it read no context variable


class LeanEvent:
    __slots__ = ("_value", "_waiters")

    def __init__(self) -> None:
        self._value = False
        self._waiters: list[asyncio.Future[bool]] | None = None

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        if not self._value:
            self._value = True
            for fut in self._waiters or ():
                if not fut.done():
                    fut.set_result(True)

    def clear(self) -> None:
        self._value = False

    async def wait(self) -> bool:
        if self._value:
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(fut)
        try:
            await fut
            return True
        finally:
            self._waiters.remove(fut)
            if not self._waiters:
                self._waiters = None

    def __repr__(self) -> str:
        state = "set" if self._value else "unset"
        return f"<LeanEvent [{state}, waiters:{len(self._waiters or ())}]>"


class Wake:
    """A LeanEvent with one waiter, its own task, which checks `is_set` before it waits: it awaits
    the future `waiter` gives. A stream's task waits on it at every change: no coroutine and no
    list of waiters a wait, and no list kept while it waits."""

    __slots__ = ("_value", "_waiter")

    def __init__(self) -> None:
        self._value = False
        self._waiter: asyncio.Future[None] | None = None

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        if not self._value:
            self._value = True
            waiter = self._waiter
            if waiter is not None:
                self._waiter = None
                if not waiter.done():  # its task cancelled it
                    waiter.set_result(None)

    def clear(self) -> None:
        self._value = False

    def waiter(self) -> asyncio.Future[None]:
        """What to await until `set`; only while unset (else it would wait for the next one)."""
        assert not self._value
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        return waiter


class LeanQueue(Generic[T]):
    """asyncio.Queue's unbounded get/put side (no join, no maxsize): what grpclib's stream buffer uses."""

    __slots__ = ("_getters", "_items")

    def __init__(self) -> None:
        self._items: deque[T] | None = None
        self._getters: list[asyncio.Future[None]] | None = None

    def qsize(self) -> int:
        return len(self._items) if self._items else 0

    def empty(self) -> bool:
        return not self._items

    def queued(self) -> Iterable[T]:
        """What waits to be taken, oldest first (a view: read it before the next put or get)."""
        return self._items or ()

    def put_nowait(self, item: T) -> None:
        if self._items is None:
            self._items = deque()
        self._items.append(item)
        self._wake_next()

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        if not self._items:
            self._items = None
        return item

    async def get(self) -> T:
        while not self._items:
            getter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if self._getters is None:
                self._getters = []
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                getter.cancel()
                if self._getters is not None and getter in self._getters:
                    self._getters.remove(getter)
                if self._items and not getter.cancelled():
                    self._wake_next()  # woken by a put, but leaving: the next getter takes it
                raise
            finally:
                if not self._getters:
                    self._getters = None
        return self.get_nowait()

    def _wake_next(self) -> None:
        while self._getters:
            getter = self._getters.pop(0)
            if not getter.done():
                getter.set_result(None)
                break
        if not self._getters:
            self._getters = None
